/* One-call sampling of random rows on the CPU (tokenspout/sample/ops/rows_cpu.py wraps it).
 *
 * Why: the torch path (sample/ops/topk_topp.py, nucleus.py, draw.py, noise.py) runs ~160 small ops for a row with
 * top_k, top_p and a temperature; at a few microseconds of dispatch each that is ~0.8 ms per step at batch 1 --
 * 10-15% of a decode step -- and under the engine's passive OpenMP policy every op that goes parallel wakes a
 * sleeping thread.  A temperature-only row costs ~0.8 ms there too, and a top-p row with a wide nucleus several
 * ms (candidate sets that do not cover it, then the bucketed nucleus).  This kernel does the same computation for
 * one row in one or two passes over its logits plus work on its candidates.
 *
 * Semantics: exactly those of topk_topp.py (read its docstring) and draw.py:
 *   y = logits / T;  with top-k, the candidates are {t : y_t >= the k-th largest y} (ties at the k-th value all
 *   stay), ordered by (y desc, id asc);  w = exp(y - max y);  min_p keeps w >= min_p;  top-p keeps t iff the kept
 *   mass ahead of t is < top_p * Z;  then the two-level Gumbel-max draw of draw.py with the counter-based noise of
 *   noise.py (SplitMix64 of (seed key, position, id)).  The noise is bit-identical to the torch path; float32 sums
 *   and exp may round differently, so the two agree token for token except where a decision sits within an ulp of
 *   a boundary (tests/unit/test_sampler_kernel.py compares them on ~500 rows of every kind).
 */
#include "isa.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIX_M1 0xBF58476D1CE4E5B9ULL
#define MIX_M2 0x94D049BB133111EBULL
#define MIX_ID 0xD6E8FEB86659FD93ULL
#define SALT_TOKEN 0x243F6A8885A308D3ULL
#define SALT_BLOCK 0x13198A2E03707344ULL
#define CAND_CAP 4096 /* candidates collected per row before a wider set takes another path (sorting them stays cheap) */

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= MIX_M1;
    z ^= z >> 27;
    z *= MIX_M2;
    return z ^ (z >> 31);
}

/* noise.gumbel for one (row key, id, salt): U = (top 53 bits + 0.5) * 2^-53, G = -log(-log U), in double. */
static inline double gumbel(uint64_t key, int64_t id, uint64_t salt) {
    uint64_t z = mix64((uint64_t)id * MIX_ID + key + salt);
    double u = ((double)(z >> 11) + 0.5) * 0x1p-53;
    return -log(-log(u));
}

/* y = x / t for 8 logits (a division, as torch's `logits / temperature`; skipped at t = 1, where it is exact). */
static inline __m256 load_scaled(const float *x, __m256 tv, float t) {
    const __m256 v = _mm256_loadu_ps(x);
    return t == 1.0f ? v : _mm256_div_ps(v, tv);
}

typedef struct {
    float y;
    int32_t id;
} cand;

static int cand_order(const void *a, const void *b) {
    const cand *p = a, *q = b;
    if (p->y != q->y) return p->y > q->y ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

static void sift_down(float *h, int64_t n, int64_t i) {
    float v = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

/* The k-th largest of y = x / t over the row (with multiplicity; -inf if fewer than k values are finite). */
/* Offers eight values to the min-heap of the k largest (heap[0] its smallest): most vectors have none above
 * heap[0], so one compare skips them; the others go in one by one. */
static inline __attribute__((always_inline)) void heap_push8(float *heap, int64_t k, __m256 v) {
    int m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap[0]), _CMP_GT_OQ));
    if (!m) return;
    float vals[8];
    _mm256_storeu_ps(vals, v);
    while (m) {
        int b = __builtin_ctz(m);
        m &= m - 1;
        if (vals[b] > heap[0]) {
            heap[0] = vals[b];
            sift_down(heap, k, 0);
        }
    }
}

static float kth_largest(const float *x, int64_t V, float t, int64_t k, float *heap) {
    for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
    const __m256 tv = _mm256_set1_ps(t);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = load_scaled(x + i, tv, t);
        heap_push8(heap, k, v);
    }
    for (; i < V; i++) {
        float v = x[i] / t;
        if (v > heap[0]) {
            heap[0] = v;
            sift_down(heap, k, 0);
        }
    }
    return heap[0];
}

/* Every finite y >= kth into c (up to cap entries); returns how many there are (may exceed cap). */
static int64_t collect(const float *x, int64_t V, float t, float kth, cand *c, int64_t cap) {
    int64_t n = 0;
    const __m256 tv = _mm256_set1_ps(t), kv = _mm256_set1_ps(kth), ninf = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = load_scaled(x + i, tv, t);
        int m = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, kv, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ)));
        if (!m) continue;
        float vals[8];
        _mm256_storeu_ps(vals, v);
        while (m) {
            int b = __builtin_ctz(m);
            m &= m - 1;
            if (n < cap) c[n] = (cand){vals[b], (int32_t)(i + b)};
            n++;
        }
    }
    for (; i < V; i++) {
        float v = x[i] / t;
        if (v >= kth && v > -INFINITY) {
            if (n < cap) c[n] = (cand){v, (int32_t)i};
            n++;
        }
    }
    return n;
}

/* top-p on sorted candidates: keeps c[j] iff the kept weight ahead of it is < top_p * z (w[j] = 0: dropped).
 * Returns the total weight of the candidates (before the cut). */
static double cut_top_p(int64_t n, float *w, float top_p, float z) {
    double run = 0.0; /* torch's CPU cumsum accumulates in double and rounds each prefix to float */
    for (int64_t j = 0; j < n; j++) {
        run += w[j];
        float ahead = (float)run - w[j];
        if (!(ahead < top_p * z)) w[j] = 0.0f;
    }
    return run;
}

/* The two-level draw over sorted candidates c[0..n) with weights w (0 = dropped; c[0] the row maximum m0):
 * a block b with probability mass_b / sum(mass) by argmax(log mass_b + G(b)), then a token of b by
 * argmax(y - m0 + G(t)) over its kept candidates -- draw.py's draw_sparse. */
static int64_t draw_sorted(const cand *c, int64_t n, const float *w, int64_t V, uint64_t key, int64_t bs) {
    int64_t nb = (V + bs - 1) / bs;
    float *mass = calloc((size_t)nb, sizeof(float));
    for (int64_t j = 0; j < n; j++)
        if (w[j] > 0.0f) mass[c[j].id / bs] += w[j];
    double best = -INFINITY;
    int64_t chosen = c[0].id / bs;
    for (int64_t j = 0; j < n; j++) {
        int64_t b = c[j].id / bs;
        if (!(w[j] > 0.0f) || !(mass[b] > 0.0f)) continue;
        double s = (double)logf(mass[b]) + gumbel(key, b, SALT_BLOCK);
        mass[b] = 0.0f; /* scored: the block's other candidates skip it (a gumbel per block, not per candidate) */
        if (s > best) {
            best = s;
            chosen = b;
        }
    }
    free(mass);
    best = -INFINITY;
    int64_t out = c[0].id;
    for (int64_t j = 0; j < n; j++) {
        if (!(w[j] > 0.0f) || c[j].id / bs != chosen) continue;
        double s = (double)(c[j].y - c[0].y) + gumbel(key, c[j].id, SALT_TOKEN);
        if (s > best) {
            best = s;
            out = c[j].id;
        }
    }
    return out;
}

/* A row with 1 <= top_k: its candidates are the tokens tied with or above the k-th largest. */
static int64_t sample_top_k(const float *x, int64_t V, float t, int64_t k, float top_p, float min_p, uint64_t key,
                            int64_t bs) {
    float *heap = malloc((size_t)k * sizeof(float));
    float kth = kth_largest(x, V, t, k, heap);
    free(heap);
    cand *c = malloc(CAND_CAP * sizeof(cand));
    int64_t n = collect(x, V, t, kth, c, CAND_CAP);
    if (n > CAND_CAP) { /* a tie group at the k-th value wider than the buffer (e.g. uniform logits) */
        free(c);
        c = malloc((size_t)n * sizeof(cand));
        collect(x, V, t, kth, c, n);
    }
    int64_t out = 0; /* every logit -inf: nothing can be drawn (the torch path returns some id too) */
    if (n > 0) {
        qsort(c, (size_t)n, sizeof(cand), cand_order);
        float *w = malloc((size_t)n * sizeof(float));
        float z = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            w[j] = expf(c[j].y - c[0].y);
            if (min_p > 0.0f && w[j] < min_p) w[j] = 0.0f;
            z += w[j];
        }
        if (top_p < 1.0f) cut_top_p(n, w, top_p, z);
        out = draw_sorted(c, n, w, V, key, bs);
        free(w);
    }
    free(c);
    return out;
}

/* draw.py's draw_dense over weights w [V] (0 = dropped): a block by argmax(log sum_b w + G(b)), then a token of
 * that block by argmax(y + G(t)) over its kept tokens. */
static int64_t draw_dense(const float *x, float t, const float *w, int64_t V, uint64_t key, int64_t bs) {
    int64_t nb = (V + bs - 1) / bs, chosen = 0, out = 0;
    double best = -INFINITY;
    for (int64_t b = 0; b < nb; b++) {
        float mass = 0.0f;
        for (int64_t j = b * bs; j < V && j < (b + 1) * bs; j++) mass += w[j];
        if (!(mass > 0.0f)) continue;
        double s = (double)logf(mass) + gumbel(key, b, SALT_BLOCK);
        if (s > best) {
            best = s;
            chosen = b;
        }
    }
    best = -INFINITY;
    for (int64_t j = chosen * bs; j < V && j < (chosen + 1) * bs; j++) {
        if (!(w[j] > 0.0f)) continue;
        double s = (double)(x[j] / t) + gumbel(key, j, SALT_TOKEN);
        if (s > best) {
            best = s;
            out = j;
        }
    }
    return out;
}

#define LOG2E 1.44269504088896341f
#define UNDER2 -126.0f /* exp2_neg's zero: a weight below 2^-126 of the max's */

/* x[j..j+8), the lanes at or past `end` -inf (a row's or a block's short last group). */
static inline __m256 load8_tail(const float *x, int64_t j, int64_t end) {
    if (j + 8 <= end) return _mm256_loadu_ps(x + j);
    float tail[8];
    for (int b = 0; b < 8; b++) tail[b] = j + b < end ? x[j + b] : -INFINITY;
    return _mm256_loadu_ps(tail);
}

/* The bits (log2 units) of x's weight below the row's max x_max: (x - x_max) * c, c = log2(e) / t. */
static inline __m256 bits8(const float *x, int64_t j, int64_t V, __m256 xm, __m256 c) {
    return _mm256_mul_ps(_mm256_sub_ps(load8_tail(x, j, V), xm), c);
}

/* The weights exp(y - m) of x[j..j+8) (y = x / t, m its row max) where kept: y - m >= thr (bits >= thr2, its
 * value in bits) and weight >= min_p (0 = off); 0 elsewhere and past V. */
static inline __m256 kept_weights8(const float *x, int64_t j, int64_t V, __m256 xm, __m256 c, __m256 thr2,
                                   float min_p) {
    __m256 d2 = bits8(x, j, V, xm, c);
    __m256 e = _mm256_and_ps(exp2_neg(d2), _mm256_cmp_ps(d2, thr2, _CMP_GE_OQ));
    if (min_p > 0.0f) e = _mm256_and_ps(e, _mm256_cmp_ps(e, _mm256_set1_ps(min_p), _CMP_GE_OQ));
    return e;
}

/* The token of block `chosen` (kept: weight > 0 in kept_weights8) by argmax(y + G(t)), draw_dense's second level. */
static int64_t draw_in_block(const float *x, int64_t V, float t, float xm, float thr, float min_p, uint64_t key,
                             int64_t bs, int64_t chosen) {
    const __m256 xv = _mm256_set1_ps(xm), c = _mm256_set1_ps(LOG2E / t), thv = _mm256_set1_ps(thr * LOG2E);
    double best = -INFINITY;
    int64_t out = chosen * bs, hi = (chosen + 1) * bs < V ? (chosen + 1) * bs : V;
    for (int64_t j = chosen * bs; j < hi; j += 8) {
        float w[8];
        _mm256_storeu_ps(w, kept_weights8(x, j, hi, xv, c, thv, min_p));
        for (int q = 0; q < 8 && j + q < hi; q++) {
            if (!(w[q] > 0.0f)) continue;
            double sc = (double)(x[j + q] / t) + gumbel(key, j + q, SALT_TOKEN);
            if (sc > best) {
                best = sc;
                out = j + q;
            }
        }
    }
    return out;
}

/* draw_dense over the kept weights (kept_weights8; xm the row's max of x), without a weight buffer: one pass sums
 * each block's kept weight and draws the block as it goes, then the chosen block's token.  *zk (if not NULL): the
 * kept weights' sum, for the drawn token's log probability among them. */
static int64_t draw_dense_pass(const float *x, int64_t V, float t, float xm, float thr, float min_p, uint64_t key,
                               int64_t bs, double *zk) {
    const __m256 xv = _mm256_set1_ps(xm), c = _mm256_set1_ps(LOG2E / t), thv = _mm256_set1_ps(thr * LOG2E);
    int64_t nb = (V + bs - 1) / bs, chosen = -1;
    double best = -INFINITY, z = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t hi = (b + 1) * bs < V ? (b + 1) * bs : V, j = b * bs;
        for (; j + 16 <= hi; j += 16) {
            acc0 = _mm256_add_ps(acc0, kept_weights8(x, j, hi, xv, c, thv, min_p));
            acc1 = _mm256_add_ps(acc1, kept_weights8(x, j + 8, hi, xv, c, thv, min_p));
        }
        for (; j < hi; j += 8) acc0 = _mm256_add_ps(acc0, kept_weights8(x, j, hi, xv, c, thv, min_p));
        float mass = hsum8(_mm256_add_ps(acc0, acc1));
        if (!(mass > 0.0f)) continue;
        z += mass;
        double sc = (double)logf(mass) + gumbel(key, b, SALT_BLOCK);
        if (sc > best) {
            best = sc;
            chosen = b;
        }
    }
    if (zk) *zk = z;
    return chosen < 0 ? 0 : draw_in_block(x, V, t, xm, thr, min_p, key, bs, chosen);
}

/* The largest of x[lo..hi) (-inf past V). */
static inline float max_range(const float *x, int64_t lo, int64_t hi) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = lo;
    for (; j + 8 <= hi; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
    float m = hmax8(mv);
    for (; j < hi; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* A temperature-only row (no min_p, no cut) in one read: block by block (a block stays in L1 between its max and
 * its weights), the running max of x grows, and the block's weight sum is taken against the running max of its
 * time, x_b: its log weight against the final max x_max is log mass_b + (x_b - x_max) / t.  The block draw needs the
 * final max, so it runs on the kept (mass, x_b) pairs after the pass. */
static int64_t draw_dense_one_pass(const float *x, int64_t V, float t, uint64_t key, int64_t bs) {
    const __m256 c = _mm256_set1_ps(LOG2E / t);
    int64_t nb = (V + bs - 1) / bs;
    float *mass = malloc((size_t)nb * sizeof(float)), *at = malloc((size_t)nb * sizeof(float));
    float xm = -INFINITY;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * bs, hi = (b + 1) * bs < V ? (b + 1) * bs : V;
        float bm = max_range(x, lo, hi);
        xm = bm > xm ? bm : xm;
        mass[b] = 0.0f;
        at[b] = xm;
        if (xm == -INFINITY) continue;
        const __m256 xv = _mm256_set1_ps(xm);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t j = lo;
        for (; j + 16 <= hi; j += 16) {
            acc0 = _mm256_add_ps(acc0, exp2_neg(bits8(x, j, hi, xv, c)));
            acc1 = _mm256_add_ps(acc1, exp2_neg(bits8(x, j + 8, hi, xv, c)));
        }
        for (; j < hi; j += 8) acc0 = _mm256_add_ps(acc0, exp2_neg(bits8(x, j, hi, xv, c)));
        mass[b] = hsum8(_mm256_add_ps(acc0, acc1));
    }
    int64_t chosen = -1;
    double best = -INFINITY;
    for (int64_t b = 0; b < nb; b++) {
        if (!(mass[b] > 0.0f)) continue;
        double sc = (double)logf(mass[b]) + ((double)at[b] - xm) / t + gumbel(key, b, SALT_BLOCK);
        if (sc > best) {
            best = sc;
            chosen = b;
        }
    }
    free(mass);
    free(at);
    return chosen < 0 ? 0 : draw_in_block(x, V, t, xm, -INFINITY, 0.0f, key, bs, chosen);
}

/* top-p on a whole row without sorting it (nucleus.py's method): bucket the weights by the top bits of their float
 * pattern (monotone in w >= 0), walk the buckets from the top to the one where the mass reaches the target, keep
 * every token above it, drop every token below it, and order only the boundary bucket's tokens exactly.  Zeroes
 * w of the dropped tokens. */
#define WIDE_SHIFT 16
static inline int64_t bucket(float w) {
    uint32_t b;
    memcpy(&b, &w, sizeof b);
    return (int64_t)(b >> WIDE_SHIFT);
}
static void wide_top_p(const float *x, float t, float *w, int64_t V, float target) {
    const int64_t nbk = (0x3F800000 >> WIDE_SHIFT) + 1;
    double *mass = calloc((size_t)nbk, sizeof(double));
    for (int64_t i = 0; i < V; i++)
        if (w[i] > 0.0f) mass[bucket(w[i])] += w[i];
    double above = 0.0;
    int64_t bstar = 0;
    for (int64_t b = nbk - 1; b >= 0; b--) {
        if (above + mass[b] >= target) {
            bstar = b;
            break;
        }
        above += mass[b];
    }
    free(mass);
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) n += w[i] > 0.0f && bucket(w[i]) == bstar;
    cand *c = malloc((size_t)(n ? n : 1) * sizeof(cand));
    n = 0;
    for (int64_t i = 0; i < V; i++)
        if (w[i] > 0.0f && bucket(w[i]) == bstar) c[n++] = (cand){x[i] / t, (int32_t)i};
    qsort(c, (size_t)n, sizeof(cand), cand_order);
    double run = above;
    for (int64_t j = 0; j < n; j++) {
        float wj = w[c[j].id];
        if (!((float)run < target)) w[c[j].id] = 0.0f;
        run += wj;
    }
    free(c);
    for (int64_t i = 0; i < V; i++)
        if (bucket(w[i]) < bstar) w[i] = 0.0f;
}

/* The tokens with w > 0 and w >= th into c (up to cap; returns how many there are, may exceed cap); w is padded
 * with zeros to a multiple of 8 (V8). */
static int64_t heavy(const float *x, float t, const float *w, int64_t V8, float th, cand *c, int64_t cap) {
    const __m256 tv = _mm256_set1_ps(th), zero = _mm256_setzero_ps();
    int64_t n = 0;
    for (int64_t i = 0; i < V8; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i);
        int m = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, tv, _CMP_GE_OQ), _mm256_cmp_ps(v, zero, _CMP_GT_OQ)));
        while (m) {
            int b = __builtin_ctz(m);
            m &= m - 1;
            if (n < cap) c[n] = (cand){x[i + b] / t, (int32_t)(i + b)};
            n++;
        }
    }
    return n;
}

#define NUM_THETA 6 /* top-p search thresholds on w: 2^-4, 2^-8, ..., 2^-24 */

/* A row without top-k: w = exp(y - max y) over the whole row (min_p applied), then either a dense draw (no
 * top-p) or, for top-p, the candidates w >= theta for the largest theta whose mass above reaches top_p * Z: any
 * token below theta has all of them ahead of it, so top-p drops it (topk_topp.py's rule (d)). */
static int64_t sample_dense(const float *x, int64_t V, float t, float top_p, float min_p, uint64_t key, int64_t bs) {
    if (top_p >= 1.0f && !(min_p > 0.0f)) return draw_dense_one_pass(x, V, t, key, bs);
    if (top_p >= 1.0f) { /* min_p (against the row's max): no weight buffer, one pass after the max */
        float xm = max_range(x, 0, V);
        return xm == -INFINITY ? 0 : draw_dense_pass(x, V, t, xm, -INFINITY, min_p, key, bs, NULL);
    }
    const __m256 tv = _mm256_set1_ps(t);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) mv = _mm256_max_ps(mv, load_scaled(x + i, tv, t));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    float m = -INFINITY;
    for (int b = 0; b < 8; b++) m = lanes[b] > m ? lanes[b] : m;
    for (; i < V; i++) m = x[i] / t > m ? x[i] / t : m;
    if (m == -INFINITY) return 0;

    int64_t V8 = (V + 7) & ~(int64_t)7;
    float *w = malloc((size_t)V8 * sizeof(float));
    const int want_theta = top_p < 1.0f;
    __m256 zacc = _mm256_setzero_ps(), sacc[NUM_THETA], theta[NUM_THETA];
    for (int j = 0; j < NUM_THETA; j++) {
        sacc[j] = _mm256_setzero_ps();
        theta[j] = _mm256_set1_ps(ldexpf(1.0f, -4 * (j + 1)));
    }
    const __m256 mb = _mm256_set1_ps(m), mp = _mm256_set1_ps(min_p);
    for (i = 0; i < V8; i += 8) {
        __m256 v;
        if (i + 8 <= V) {
            v = load_scaled(x + i, tv, t);
        } else { /* the last, short group: pad with -inf */
            float tail[8];
            for (int b = 0; b < 8; b++) tail[b] = i + b < V ? x[i + b] / t : -INFINITY;
            v = _mm256_loadu_ps(tail);
        }
        __m256 e = exp_neg(_mm256_sub_ps(v, mb));
        if (min_p > 0.0f) e = _mm256_and_ps(e, _mm256_cmp_ps(e, mp, _CMP_GE_OQ));
        _mm256_storeu_ps(w + i, e);
        zacc = _mm256_add_ps(zacc, e);
        if (want_theta)
            for (int j = 0; j < NUM_THETA; j++)
                sacc[j] = _mm256_add_ps(sacc[j], _mm256_and_ps(e, _mm256_cmp_ps(e, theta[j], _CMP_GE_OQ)));
    }
    float z = 0.0f;
    _mm256_storeu_ps(lanes, zacc);
    for (int b = 0; b < 8; b++) z += lanes[b];

    if (!want_theta) {
        int64_t out = draw_dense(x, t, w, V, key, bs);
        free(w);
        return out;
    }
    const float target = top_p * z;
    int j0 = NUM_THETA; /* the largest theta whose mass reaches the target (NUM_THETA: every w > 0) */
    for (int j = 0; j < NUM_THETA; j++) {
        _mm256_storeu_ps(lanes, sacc[j]);
        float s = 0.0f;
        for (int b = 0; b < 8; b++) s += lanes[b];
        if (s >= target) {
            j0 = j;
            break;
        }
    }
    int64_t out = -1;
    for (int j = j0; j <= NUM_THETA && out < 0; j++) {
        float th = j < NUM_THETA ? ldexpf(1.0f, -4 * (j + 1)) : 0.0f;
        cand *c = malloc(CAND_CAP * sizeof(cand));
        int64_t n = heavy(x, t, w, V8, th, c, CAND_CAP);
        if (n > CAND_CAP) { /* a wide nucleus: sorting it all would cost more than the bucketed cut */
            free(c);
            wide_top_p(x, t, w, V, target);
            out = draw_dense(x, t, w, V, key, bs);
            break;
        }
        float *cw = malloc((size_t)(n ? n : 1) * sizeof(float));
        qsort(c, (size_t)n, sizeof(cand), cand_order);
        for (int64_t q = 0; q < n; q++) cw[q] = w[c[q].id];
        /* The rows' sums round differently from the lane sums above: if the candidates' own total falls short
         * of the target, tokens below theta could be kept after all -- widen and redo (rare). */
        double total = cut_top_p(n, cw, top_p, z);
        if (total >= target || j == NUM_THETA) out = draw_sorted(c, n, cw, V, key, bs);
        free(cw);
        free(c);
    }
    free(w);
    return out;
}

/* ---- Warped rows with top-k (sample/ops/warpers.py's knobs; rows_cpu.py routes only rows with 1 <= top_k here) ----
 * Same semantics as warpers.py: top_n_sigma (on the logits, before temperature) and dynatemp (entropy of the
 * sigma-masked row at temperature 1) first, then the candidates of top-k / min_p / top-p as sample_top_k, then
 * typical -> epsilon -> eta -> XTC on the renormalised survivors, then the same two-level draw. */
#define SALT_XTC 0x2B7E151628AED2A6ULL
enum { W_TYPICAL, W_EPS, W_ETA, W_SIGMA, W_XTC_P, W_XTC_T, W_DYN_R, W_DYN_E, W_NUM };

/* noise.uniform for (row key, id 0, SALT_XTC): the XTC coin of warpers.xtc_coin. */
static inline double xtc_uniform(uint64_t key) {
    uint64_t z = mix64(key + SALT_XTC);
    return ((double)(z >> 11) + 0.5) * 0x1p-53;
}

typedef struct {
    double s;
    int64_t j;
} sj;

static int sj_order(const void *a, const void *b) {
    const sj *p = a, *q = b;
    return (p->s > q->s) - (p->s < q->s);
}

/* p[j] = w[j] / sum(w) over the kept (w > 0) candidates; returns the entropy of p. */
static double kept_probs(int64_t n, const float *w, double *p) {
    double z = 0.0, h = 0.0;
    for (int64_t j = 0; j < n; j++) z += w[j];
    for (int64_t j = 0; j < n; j++) {
        p[j] = w[j] > 0.0f ? w[j] / z : 0.0;
        if (p[j] > 0.0) h -= p[j] * log(p[j]);
    }
    return h;
}

/* The largest y among the kept candidates (c is sorted by y descending). */
static float kept_top(int64_t n, const cand *c, const float *w) {
    for (int64_t j = 0; j < n; j++)
        if (w[j] > 0.0f) return c[j].y;
    return -INFINITY;
}

static void warp_candidates(int64_t n, const cand *c, float *w, const float *wk, uint64_t key) {
    double *p = malloc((size_t)n * sizeof(double));
    if (wk[W_TYPICAL] < 1.0f) { /* TypicalLogitsWarper: keep |-log p - H| <= the value where the mass reaches it */
        double h = kept_probs(n, w, p);
        sj *o = malloc((size_t)n * sizeof(sj));
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++)
            if (p[j] > 0.0) o[m++] = (sj){fabs(-log(p[j]) - h), j};
        qsort(o, (size_t)m, sizeof(sj), sj_order);
        double cum = 0.0, vstar = m ? o[m - 1].s : 0.0;
        for (int64_t i = 0; i < m; i++) {
            cum += p[o[i].j];
            if (cum >= wk[W_TYPICAL]) {
                vstar = o[i].s;
                break;
            }
        }
        for (int64_t i = 0; i < m; i++)
            if (o[i].s > vstar) w[o[i].j] = 0.0f;
        free(o);
    }
    if (wk[W_EPS] > 0.0f || wk[W_ETA] > 0.0f) { /* Epsilon / EtaLogitsWarper, in that order; the top token stays */
        for (int pass = 0; pass < 2; pass++) {
            float e = pass ? wk[W_ETA] : wk[W_EPS];
            if (!(e > 0.0f)) continue;
            double h = kept_probs(n, w, p);
            double bound = pass ? fmin((double)e, sqrt((double)e) * exp(-h)) : (double)e;
            float top = kept_top(n, c, w);
            for (int64_t j = 0; j < n; j++)
                if (p[j] > 0.0 && p[j] < bound && c[j].y < top) w[j] = 0.0f;
        }
    }
    if (wk[W_XTC_P] > 0.0f && wk[W_XTC_T] <= 0.5f && xtc_uniform(key) < (double)wk[W_XTC_P]) {
        kept_probs(n, w, p);
        int64_t above = 0;
        double least = 2.0;
        for (int64_t j = 0; j < n; j++)
            if (p[j] > 0.0 && p[j] >= wk[W_XTC_T]) {
                above++;
                least = fmin(least, p[j]);
            }
        if (above >= 2)
            for (int64_t j = 0; j < n; j++)
                if (p[j] >= wk[W_XTC_T] && p[j] > least) w[j] = 0.0f;
    }
    free(p);
}

/* Sums over the finite logits x >= lo (8 lanes in float, folded into double every 1024 values):
 * out[0] count, out[1] sum x, out[2] sum (x - c)^2, and with e = exp(x - m): out[3] sum e, out[4] sum e (x - m).
 * `what`: 1 = count and sum, 2 = squares around c, 4 = the exp sums around m. */
static void row_sums(const float *x, int64_t V, float lo, float c, float m, int what, double *out) {
    const __m256 lov = _mm256_set1_ps(lo), ninf = _mm256_set1_ps(-INFINITY), cv = _mm256_set1_ps(c),
                 mv = _mm256_set1_ps(m), one = _mm256_set1_ps(1.0f);
    for (int q = 0; q < 5; q++) out[q] = 0.0;
    int64_t i = 0;
    while (i + 8 <= V) {
        __m256 acc[5] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int64_t end = i + 1024 < V ? i + 1024 : V;
        for (; i + 8 <= end; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, ninf, _CMP_GT_OQ), _mm256_cmp_ps(v, lov, _CMP_GE_OQ));
            if (what & 1) {
                acc[0] = _mm256_add_ps(acc[0], _mm256_and_ps(ok, one));
                acc[1] = _mm256_add_ps(acc[1], _mm256_and_ps(ok, v));
            }
            if (what & 2) {
                __m256 d = _mm256_and_ps(ok, _mm256_sub_ps(v, cv));
                acc[2] = _mm256_fmadd_ps(d, d, acc[2]);
            }
            if (what & 4) {
                __m256 d = _mm256_and_ps(ok, _mm256_sub_ps(v, mv));
                __m256 e = _mm256_and_ps(ok, exp_neg(d));
                acc[3] = _mm256_add_ps(acc[3], e);
                acc[4] = _mm256_fmadd_ps(e, d, acc[4]);
            }
        }
        for (int q = 0; q < 5; q++) out[q] += hsum8(acc[q]);
    }
    for (; i < V; i++) { /* the last V % 8 values */
        if (!(x[i] > -INFINITY && x[i] >= lo)) continue;
        double e = exp((double)x[i] - m);
        if (what & 1) out[0] += 1.0, out[1] += x[i];
        if (what & 2) out[2] += ((double)x[i] - c) * ((double)x[i] - c);
        if (what & 4) out[3] += e, out[4] += e * ((double)x[i] - m);
    }
}

/* kth_largest at temperature 1 (the top-k set does not depend on the temperature) fused with the row's statistics
 * for top_n_sigma: st[0] max, st[1] count, st[2] sum, st[3] sum of squares of the finite logits (float lanes
 * folded into double every 1024 values), so that a sigma row reads its logits no more often than a plain one. */
static float kth_and_stats(const float *x, int64_t V, int64_t k, float *heap, double *st) {
    for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f);
    __m256 mx = ninf;
    st[1] = st[2] = st[3] = 0.0;
    int64_t i = 0;
    while (i + 8 <= V) {
        __m256 cnt = _mm256_setzero_ps(), sum = _mm256_setzero_ps(), sq = _mm256_setzero_ps();
        int64_t end = i + 1024 < V ? i + 1024 : V;
        for (; i + 8 <= end; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256 ok = _mm256_cmp_ps(v, ninf, _CMP_GT_OQ);
            __m256 f = _mm256_and_ps(ok, v);
            mx = _mm256_max_ps(mx, v);
            cnt = _mm256_add_ps(cnt, _mm256_and_ps(ok, one));
            sum = _mm256_add_ps(sum, f);
            sq = _mm256_fmadd_ps(f, f, sq);
            heap_push8(heap, k, v);
        }
        st[1] += hsum8(cnt);
        st[2] += hsum8(sum);
        st[3] += hsum8(sq);
    }
    float m = hmax8(mx);
    for (; i < V; i++) {
        float v = x[i];
        m = v > m ? v : m;
        if (v > -INFINITY) st[1] += 1.0, st[2] += v, st[3] += (double)v * v;
        if (v > heap[0]) {
            heap[0] = v;
            sift_down(heap, k, 0);
        }
    }
    st[0] = m;
    return heap[0];
}

/* T_min + (T_max - T_min) * (h / log n) ^ exponent, at least GREEDY_EPS (warpers.dynatemp). */
static float dyn_temp_from(double h, double n, float t, const float *wk) {
    double norm = h / log(n);
    norm = norm < 0.0 ? 0.0 : norm > 1.0 ? 1.0 : norm;
    double tlo = fmax(0.0, (double)t - wk[W_DYN_R]), thi = (double)t + wk[W_DYN_R];
    return (float)fmax(tlo + (thi - tlo) * pow(norm, wk[W_DYN_E]), 1e-5);
}

/* dynatemp's temperature from the entropy of softmax(x) over the finite x >= lo (m: the row's max). */
static float dyn_temp(const float *x, int64_t V, float lo, float m, float t, const float *wk) {
    double s[5];
    row_sums(x, V, lo, 0.0f, m, 1 | 4, s);
    if (!(s[0] > 1.0)) return t;
    return dyn_temp_from(log(s[3]) - s[4] / s[3], s[0], t, wk);
}

/* dyn_temp over the n candidates c (raw logits, unordered; m: their max): a top-k row's entropy is taken over its
 * top-k candidates (warpers.dynatemp), k values instead of a pass over the vocabulary. */
static float dyn_temp_candidates(int64_t n, const cand *c, float m, float t, const float *wk) {
    if (n < 2) return t;
    double z = 0.0, s = 0.0;
    for (int64_t j = 0; j < n; j++) {
        double d = (double)c[j].y - m, e = exp(d);
        z += e;
        s += e * d;
    }
    return dyn_temp_from(log(z) - s / z, (double)n, t, wk);
}

static int64_t sample_top_k_warped(const float *x, int64_t V, float t, int64_t k, float top_p, float min_p,
                                   uint64_t key, int64_t bs, const float *wk) {
    float *heap = malloc((size_t)k * sizeof(float));
    double st[4];
    float kth = kth_and_stats(x, V, k, heap, st);
    free(heap);
    float bound = -INFINITY;
    if (wk[W_SIGMA] > 0.0f && st[1] > 0.0) {
        double mean = st[2] / st[1], var = fmax(st[3] / st[1] - mean * mean, 0.0);
        bound = (float)(st[0] - wk[W_SIGMA] * sqrt(var));
    }
    /* The candidates on the raw logits (x >= the k-th value and >= the sigma bound), then scaled by 1 / tw. */
    float lim = bound > kth ? bound : kth;
    cand *c = malloc(CAND_CAP * sizeof(cand));
    int64_t n = collect(x, V, 1.0f, lim, c, CAND_CAP);
    if (n > CAND_CAP) {
        free(c);
        c = malloc((size_t)n * sizeof(cand));
        collect(x, V, 1.0f, lim, c, n);
    }
    float tw = wk[W_DYN_R] > 0.0f ? dyn_temp_candidates(n, c, (float)st[0], t, wk) : t;
    int64_t out = 0;
    if (n > 0) {
        for (int64_t j = 0; j < n; j++) c[j].y = tw == 1.0f ? c[j].y : c[j].y / tw;
        qsort(c, (size_t)n, sizeof(cand), cand_order);
        float *w = malloc((size_t)n * sizeof(float));
        float z = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            w[j] = expf(c[j].y - c[0].y);
            if (min_p > 0.0f && w[j] < min_p) w[j] = 0.0f;
            z += w[j];
        }
        if (top_p < 1.0f) cut_top_p(n, w, top_p, z);
        warp_candidates(n, c, w, wk, key);
        out = draw_sorted(c, n, w, V, key, bs);
        free(w);
    }
    free(c);
    return out;
}

/* Epsilon, then eta (p < bound dropped; w = 1, the row's max, stays), then XTC, as masks on the weights w[0..n) that
 * sum to z (a row's weights, zeros included, or the kept ones in id order: the same double sums either way). */
static void warp_masks(float *w, int64_t n, double z, const float *wk, uint64_t key) {
    for (int pass = 0; pass < 2; pass++) {
        float e = pass ? wk[W_ETA] : wk[W_EPS];
        if (!(e > 0.0f)) continue;
        double b = e;
        if (pass) {
            double swl = 0.0;
            for (int64_t i = 0; i < n; i++)
                if (w[i] > 0.0f) swl += w[i] * log((double)w[i]);
            double h = log(z) - swl / z;
            b = fmin((double)e, sqrt((double)e) * exp(-h));
        }
        double cut = b * z, z2 = 0.0;
        for (int64_t i = 0; i < n; i++) {
            if (w[i] > 0.0f && w[i] < cut && w[i] < 1.0f) w[i] = 0.0f;
            z2 += w[i];
        }
        z = z2;
    }
    if (wk[W_XTC_P] > 0.0f && wk[W_XTC_T] <= 0.5f && xtc_uniform(key) < (double)wk[W_XTC_P]) {
        double thr = wk[W_XTC_T] * z, least = INFINITY;
        int64_t above = 0;
        for (int64_t i = 0; i < n; i++)
            if (w[i] > 0.0f && w[i] >= thr) {
                above++;
                least = fmin(least, w[i]);
            }
        if (above >= 2)
            for (int64_t i = 0; i < n; i++)
                if (w[i] >= thr && w[i] > least) w[i] = 0.0f;
    }
}

static int64_t sample_sparse_warped(const float *x, int64_t V, float t, float min_p, uint64_t key, int64_t bs,
                                    const float *wk);

/* A warped row without top-k (and without typical_p, which needs its candidates ordered: rows_cpu.py sends those
 * to the torch path): the whole row's weights after top_n_sigma, dynatemp, min_p and top-p (nucleus.py's bucketed
 * cut), then epsilon / eta / XTC as masks on them, then the dense draw.  Without top-p but with a cut (top_n_sigma,
 * min_p): sample_sparse_warped, the same draw from the kept tokens only. */
/* (Out of line and 64-byte aligned: inlined into the OpenMP body its loops' alignment moved with every unrelated edit
 * of this file, and its whole-row cost with it, by 10-30% in bench.sampler's top_n_sigma_alone / xtc_min_p rows.) */
__attribute__((noinline, aligned(64))) static int64_t sample_dense_warped(const float *x, int64_t V, float t, float top_p, float min_p, uint64_t key,
                                   int64_t bs, const float *wk) {
    if (top_p >= 1.0f && (wk[W_SIGMA] > 0.0f || min_p > 0.0f)) return sample_sparse_warped(x, V, t, min_p, key, bs, wk);
    float one;
    double st[4];
    kth_and_stats(x, V, 1, &one, st); /* st[0]: the row's max */
    if (!(st[1] > 0.0)) return 0;
    float bound = -INFINITY;
    if (wk[W_SIGMA] > 0.0f) {
        double mean = st[2] / st[1], var = fmax(st[3] / st[1] - mean * mean, 0.0);
        bound = (float)(st[0] - wk[W_SIGMA] * sqrt(var));
    }
    float tw = wk[W_DYN_R] > 0.0f ? dyn_temp(x, V, bound, (float)st[0], t, wk) : t;
    float m = (float)st[0] / tw;
    float *w = malloc((size_t)V * sizeof(float));
    double z = 0.0;
    const __m256 tv = _mm256_set1_ps(tw), mv = _mm256_set1_ps(m), bv = _mm256_set1_ps(bound),
                 ninf = _mm256_set1_ps(-INFINITY), mpv = _mm256_set1_ps(min_p);
    int64_t i = 0;
    while (i + 8 <= V) { /* w = exp(y - max y) where kept (sigma, min_p), float lanes folded into double per 1024 */
        __m256 acc = _mm256_setzero_ps();
        int64_t end = i + 1024 < V ? i + 1024 : V;
        for (; i + 8 <= end; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            __m256 ok = _mm256_and_ps(_mm256_cmp_ps(xv, bv, _CMP_GE_OQ), _mm256_cmp_ps(xv, ninf, _CMP_GT_OQ));
            __m256 e = _mm256_and_ps(ok, exp_neg(_mm256_sub_ps(load_scaled(x + i, tv, tw), mv)));
            if (min_p > 0.0f) e = _mm256_and_ps(e, _mm256_cmp_ps(e, mpv, _CMP_GE_OQ));
            _mm256_storeu_ps(w + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        z += hsum8(acc);
    }
    for (; i < V; i++) {
        float e = x[i] >= bound && x[i] > -INFINITY ? expf(x[i] / tw - m) : 0.0f;
        if (min_p > 0.0f && e < min_p) e = 0.0f;
        w[i] = e;
        z += e;
    }
    if (top_p < 1.0f) {
        wide_top_p(x, tw, w, V, (float)(top_p * z));
        z = 0.0;
        for (int64_t i = 0; i < V; i++) z += w[i];
    }
    warp_masks(w, V, z, wk, key);
    int64_t out = draw_dense(x, tw, w, V, key, bs);
    free(w);
    return out;
}

/* ts_sample_rows for rows that may use the warpers: wk [*, W_NUM] per batch row (typical_p, epsilon, eta,
 * top_n_sigma, xtc_probability, xtc_threshold, dynatemp_range, dynatemp_exponent; neutral values: off); rows with
 * top_k 0 must not use typical_p. */
void ts_sample_rows_warped(const float *x, int64_t ldx, int64_t V, const int64_t *rows, int64_t n,
                           const float *temperature, const int64_t *top_k, const float *top_p, const float *min_p,
                           const int64_t *seed_keys, const int64_t *positions, int64_t block_size, const float *wk,
                           int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (n >= 8)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        uint64_t key = mix64((uint64_t)seed_keys[r] + (uint64_t)(positions[r] + 1) * GOLDEN);
        out[i] = top_k[r] > 0 ? sample_top_k_warped(x + r * ldx, V, temperature[r], top_k[r], top_p[r], min_p[r], key,
                                                     block_size, wk + r * W_NUM)
                               : sample_dense_warped(x + r * ldx, V, temperature[r], top_p[r], min_p[r], key,
                                                     block_size, wk + r * W_NUM);
    }
}

/* ---- Mirostat rows (ops/mirostat.py's semantics; temperature only, no top-k / top-p / min-p) ----
 * v2 keeps the tokens with -log2 p <= mu (and the top one); v1 estimates s from the 100 most likely tokens and keeps
 * the top max(int(k), 1), k = ((s - 1) 2^mu / (1 - V^(1 - s)))^(1/s) (ties at the k-th value stay).  Then the dense
 * draw; *lp is the drawn token's log probability among the kept ones (the mu update is done by the caller). */
/* Mirostat 1's k from the n sorted candidates c (the mm most likely and ties): s estimated from log(p_q / p_q+1)
 * of the first mm, k = ((s - 1) 2^mu / (1 - V^(1 - s)))^(1/s), floored into [1, V]. */
static int64_t mirostat1_k(const cand *c, int64_t n, int64_t mm, int64_t V, float mu) {
    double num = 0.0, den = 0.0;
    for (int64_t q = 0; q + 1 < mm && q + 1 < n; q++) {
        double ti = log((double)(q + 2) / (double)(q + 1));
        double bi = (double)c[q].y - (double)c[q + 1].y; /* log(p_q / p_q+1) */
        if (!isfinite(bi)) bi = 0.0;
        num += ti * bi;
        den += ti * ti;
    }
    double sh = num / den, eps = sh - 1.0;
    double k = pow(eps * pow(2.0, (double)mu) / (1.0 - pow((double)V, -eps)), 1.0 / sh);
    if (isnan(k)) k = 1.0;
    if (!(k < (double)V)) k = (double)V;
    if (k < 1.0) k = 1.0;
    return (int64_t)floor(k);
}

/* The draw among the kept candidates c[0..n) (y - m >= thr; m the row's max, every candidate finite) and *lp, the
 * drawn token's log probability among them: the same two-level draw as draw_dense over the kept row. */
static int64_t draw_kept(const cand *c, int64_t n, float m, float thr, int64_t V, uint64_t key, int64_t bs,
                         double *lp) {
    cand *k = malloc((size_t)(n ? n : 1) * sizeof(cand));
    float *w = malloc((size_t)(n ? n : 1) * sizeof(float));
    int64_t nk = 0, top = 0;
    double zk = 0.0;
    for (int64_t j = 0; j < n; j++) {
        if (!(c[j].y - m >= thr)) continue; /* the dense path's test, on the same float values */
        k[nk] = c[j];
        w[nk] = expf(c[j].y - m);
        zk += w[nk];
        if (c[j].y > k[top].y) top = nk;
        nk++;
    }
    if (!nk) {
        free(w);
        free(k);
        return 0;
    }
    cand first = k[0]; /* draw_sorted wants the row's max first (its reference and its fallback block) */
    k[0] = k[top];
    k[top] = first;
    float w0 = w[0];
    w[0] = w[top];
    w[top] = w0;
    int64_t out = draw_sorted(k, nk, w, V, key, bs);
    for (int64_t j = 0; j < nk; j++)
        if (k[j].id == out) *lp = (double)(k[j].y - m) - log(zk);
    free(w);
    free(k);
    return out;
}

/* Left-packing 8 lanes by a mask (AVX2 has no compress): PACK[m] holds the lane indices of m's set bits, in order,
 * one per byte. */
static uint64_t PACK[256];
__attribute__((constructor)) static void pack_init(void) {
    for (int m = 0; m < 256; m++) {
        uint64_t v = 0;
        int n = 0;
        for (int q = 0; q < 8; q++)
            if (m >> q & 1) v |= (uint64_t)q << (8 * n++);
        PACK[m] = v;
    }
}

/* Stores the lanes of v selected by m (movemask bits) at dst, contiguous; writes 8 lanes (dst needs 8 of slack). */
static inline int pack_store(float *dst, __m256 v, int m) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)PACK[m]));
    _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(v, idx));
    return __builtin_popcount(m);
}

static inline int pack_store_i(int32_t *dst, __m256i v, int m) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)PACK[m]));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(v, idx));
    return __builtin_popcount(m);
}

/* The k-th largest (0-based) of a[0..n) (finite values or -inf; a is clobbered, and needs 8 floats of slack), by
 * quickselect with branch-free three-way partitions (compare, left-pack, store: a Hoare partition's branches miss
 * on about every other element, which made selecting among a few thousand values cost as much as the row's pass). */
static float select_desc(float *a, int64_t n, int64_t k) {
    float *bufs = malloc((size_t)(2 * (n + 8)) * sizeof(float));
    float *src = a, *spare[2] = {bufs, bufs + n + 8};
    while (n > 16) {
        float p0 = src[0], p1 = src[n / 2], p2 = src[n - 1]; /* median of three */
        float lo2 = p0 < p1 ? p0 : p1, hi2 = p0 < p1 ? p1 : p0, p = hi2 < p2 ? hi2 : (lo2 > p2 ? lo2 : p2);
        const __m256 pv = _mm256_set1_ps(p);
        float *gt = spare[0], *lt = spare[1];
        int64_t ng = 0, nl = 0, j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_loadu_ps(src + j);
            ng += pack_store(gt + ng, v, _mm256_movemask_ps(_mm256_cmp_ps(v, pv, _CMP_GT_OQ)));
            nl += pack_store(lt + nl, v, _mm256_movemask_ps(_mm256_cmp_ps(v, pv, _CMP_LT_OQ)));
        }
        for (; j < n; j++) {
            if (src[j] > p) gt[ng++] = src[j];
            else if (src[j] < p) lt[nl++] = src[j];
        }
        float *old = src;
        if (k < ng) {
            n = ng;
            src = gt;
            spare[0] = old;
        } else if (k < n - nl) {
            free(bufs);
            return p;
        } else {
            k -= n - nl;
            n = nl;
            src = lt;
            spare[1] = old;
        }
    }
    for (int64_t i = 0; i <= k; i++) { /* a few left: selection by exchange */
        int64_t b = i;
        for (int64_t j = i + 1; j < n; j++) b = src[j] > src[b] ? j : b;
        float tmp = src[i];
        src[i] = src[b];
        src[b] = tmp;
    }
    float out = src[k];
    free(bufs);
    return out;
}

/* -log U for one (row key, id, salt), U as in gumbel (G = -log of it): argmax(log m + G) = argmin(E / m) for m > 0,
 * one log instead of two (and no log of m); the same decision up to rounding. */
static inline double expo(uint64_t key, int64_t id, uint64_t salt) {
    uint64_t z = mix64((uint64_t)id * MIX_ID + key + salt);
    return -log(((double)(z >> 11) + 0.5) * 0x1p-53);
}

/* U of expo's (key, id, salt): E = -log U >= 1 - U, the bound that lets a race skip most logs. */
static inline double unif(uint64_t key, int64_t id, uint64_t salt) {
    return ((double)(mix64((uint64_t)id * MIX_ID + key + salt) >> 11) + 0.5) * 0x1p-53;
}

/* argmin over the n weights w[i] > 0 of E_i / w[i], E_i = -log U(key, ids[i] or base + i, salt) (the exponential race, i.e.
 * argmax(log w + G)): the heaviest first, then an entry's log only where its bound (1 - U) / w can beat the best so
 * far -- most light entries cannot (a log for a few entries, not each; the same choice).  *z (if not NULL): the sum. */
static int64_t race(const float *w, const int32_t *ids, int64_t base, int64_t n, uint64_t key, uint64_t salt,
                    double *z) {
    int64_t top = -1;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!(w[i] > 0.0f)) continue;
        sum += w[i];
        if (top < 0 || w[i] > w[top]) top = i;
    }
    if (z) *z = sum;
    if (top < 0) return -1;
    double best = expo(key, ids ? ids[top] : base + top, salt) / (double)w[top];
    int64_t out = top;
    for (int64_t i = 0; i < n; i++) {
        if (!(w[i] > 0.0f) || i == top) continue;
        const int64_t id = ids ? ids[i] : base + i;
        if (1.0 - unif(key, id, salt) >= best * (double)w[i]) continue; /* E_i / w_i >= best already */
        const double sc = expo(key, id, salt) / (double)w[i];
        if (sc < best) {
            best = sc;
            out = i;
        }
    }
    return out;
}

#define GROUP 32
/* The maxima of four 8-token sub-rows (v0..v3) into s8[0..4); returned as a vector whose lanes hold them (each
 * twice, in the order 0 0 2 2 1 1 3 3): halves folded (v0 | v1 and v2 | v3 per lane), then pairs, then neighbours. */
static inline __m256 sub_maxes4(__m256 v0, __m256 v1, __m256 v2, __m256 v3, float *s8) {
    const __m256 a = _mm256_max_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 b = _mm256_max_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
    const __m256 c = _mm256_max_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
    const __m256 d = _mm256_max_ps(c, _mm256_shuffle_ps(c, c, 0xB1));
    _mm_storeu_ps(s8, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 2, 6, 1, 3, 5, 7))));
    return d;
}

static inline __m256 sub_maxes32(const float *x, float *s8) {
    return sub_maxes4(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24), s8);
}

/* Mirostat 1's read of the row: the max of each 8 consecutive tokens (s8[q] of x[8q, 8q + 8), the tail's -inf
 * padded) and each GROUP's first x (smp: a strided sample, what mirostat1_wide brackets the k-th value with, taken
 * while the row streams by rather than gathered afterwards from memory that has left the cache).  No heap: the
 * largest tokens are found afterwards from s8 (above_kth), reading again only the sub-rows that hold them.  The
 * pass is bound by memory, so the four horizontal maxima per GROUP (and the GROUP's, gmax) cost next to nothing.
 * Returns the number of groups; s8 gets (V + 7) / 8 entries. */
static int64_t row_maxes(const float *x, int64_t V, float *s8, float *gmax, float *smp) {
    int64_t j = 0, g = 0;
    for (; j + GROUP <= V; j += GROUP, g++) {
        const __m256 d = sub_maxes32(x + j, s8 + 4 * g);
        const __m128 e = _mm_max_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
        _mm_store_ss(gmax + g, _mm_max_ps(e, _mm_shuffle_ps(e, e, 0x4E)));
        smp[g] = x[j];
    }
    if (j < V) {
        smp[g] = x[j];
        gmax[g] = -INFINITY;
        for (int64_t q = j; q < V; q += 8) {
            s8[q / 8] = hmax8(load8_tail(x, q, V));
            gmax[g] = s8[q / 8] > gmax[g] ? s8[q / 8] : gmax[g];
        }
        g++;
    }
    return g;
}

/* The sub-rows q < ns whose max s8[q] passes (s8[q] - a) c >= b, listed in sel (ns + 8 entries) without a branch;
 * the test is monotone in the value, so a sub-row whose max fails it holds no token that passes.  Returns their
 * number. */
static int64_t subrows_passing(const float *s8, int64_t ns, float a, float c, float b, int32_t *sel) {
    const __m256 av = _mm256_set1_ps(a), cv = _mm256_set1_ps(c), bv = _mm256_set1_ps(b);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t n = 0, q = 0;
    for (; q + 8 <= ns; q += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s8 + q), av), cv);
        n += pack_store_i(sel + n, _mm256_add_epi32(_mm256_set1_epi32((int32_t)q), lanes),
                          _mm256_movemask_ps(_mm256_cmp_ps(d, bv, _CMP_GE_OQ)));
    }
    for (; q < ns; q++)
        if ((s8[q] - a) * c >= b) sel[n++] = (int32_t)q;
    return n;
}

/* The tokens of the sub-rows sel[0..nsel) of x that pass (x - a) c >= b, packed with their ids into *cx / *cid
 * (allocated here, 8 of slack; packed whether or not a lane passes: a branch here would often miss).  Only those
 * sub-rows are read (the row has just streamed through the cache).  Returns their number. */
static int64_t pack_subrows(const float *x, int64_t V, const int32_t *sel, int64_t nsel, float a, float c, float b,
                            float **cx, int32_t **cid) {
    const __m256 av = _mm256_set1_ps(a), cv = _mm256_set1_ps(c), bv = _mm256_set1_ps(b);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    *cx = malloc((size_t)(8 * nsel + 8) * sizeof(float));
    *cid = malloc((size_t)(8 * nsel + 8) * sizeof(int32_t));
    int64_t n = 0;
    for (int64_t i = 0; i < nsel; i++) {
        const int64_t j = (int64_t)sel[i] * 8;
        const __m256 v = load8_tail(x, j, V);
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(_mm256_sub_ps(v, av), cv), bv, _CMP_GE_OQ));
        pack_store_i(*cid + n, _mm256_add_epi32(_mm256_set1_epi32((int32_t)j), lanes), m);
        n += pack_store(*cx + n, v, m);
    }
    return n;
}

/* The tokens of x at or above tau, packed with their ids into *cx / *cid (pack_subrows): tau is the k-th largest
 * group max (k <= ng: a select among few) or of s8[0..ns) (k <= ns), -inf for a wider k.  The k groups or sub-rows
 * whose maxes are >= tau hold k tokens >= tau, so the k-th largest x is >= tau and these tokens are a superset of
 * the row's k largest, ties included.  Returns their number. */
static int64_t above_kth(const float *x, int64_t V, const float *s8, int64_t ns, const float *gmax, int64_t ng,
                         int64_t k, float **cx, int32_t **cid) {
    float *tmp = malloc((size_t)(ns + 8) * sizeof(float));
    memcpy(tmp, k <= ng ? gmax : s8, (size_t)(k <= ng ? ng : ns) * sizeof(float));
    const float tau = k <= ng ? select_desc(tmp, ng, k - 1) : k <= ns ? select_desc(tmp, ns, k - 1) : -INFINITY;
    int32_t *sel = (int32_t *)tmp; /* (tmp's floats are done) */
    const int64_t n = pack_subrows(x, V, sel, subrows_passing(s8, ns, 0.0f, 1.0f, tau, sel), 0.0f, 1.0f, tau, cx, cid);
    free(tmp);
    return n;
}

/* The two-level draw over weights kept by a cut at the k-th largest y (kv): mass[b] holds each block's kept weight
 * (against xm, the row's max of x); a block by argmin(E_b / mass_b), then a token of it by argmin(E_t / w_t) over its
 * kept tokens (draw_dense's argmaxes of log mass + G and y + G).  *lp: the token's log probability among the kept. */
static int64_t draw_cut(const float *x, int64_t V, float t, float xm, float kv, const float *mass, int64_t nb,
                        uint64_t key, int64_t bs, double *lp) {
    double zk;
    const int64_t chosen = race(mass, NULL, 0, nb, key, SALT_BLOCK, &zk);
    if (chosen < 0) return -1;
    const int64_t lo = chosen * bs, hi = (chosen + 1) * bs < V ? (chosen + 1) * bs : V;
    const float cs = LOG2E / t;
    const __m256 xv = _mm256_set1_ps(xm), cv = _mm256_set1_ps(cs), kvv = _mm256_set1_ps(kv), tv = _mm256_set1_ps(t);
    float *w = malloc((size_t)(hi - lo + 8) * sizeof(float));
    for (int64_t j = lo; j < hi; j += 8) { /* the block's kept weights (0 where dropped); y = x / t as load_scaled */
        const __m256 v = load8_tail(x, j, hi);
        const __m256 keep = _mm256_cmp_ps(t == 1.0f ? v : _mm256_div_ps(v, tv), kvv, _CMP_GE_OQ);
        _mm256_storeu_ps(w + (j - lo), _mm256_and_ps(keep, exp2_neg(_mm256_mul_ps(_mm256_sub_ps(v, xv), cv))));
    }
    const int64_t pick = race(w, NULL, lo, hi - lo, key, SALT_TOKEN, NULL);
    const int64_t out = pick < 0 ? lo : lo + pick;
    free(w);
    *lp = (double)(x[out] / t - xm / t) - log(zk);
    return out;
}

/* The two-level draw among candidates (cx, cid)[0..n) that hold every kept token: kept where (x - xm) log2(e) / t
 * >= thr log2(e) (y - m >= thr, draw_dense_pass's test on the same floats), weights 2^((x - xm) log2(e) / t) summed
 * per block, a block by argmin(E_b / mass_b), a token of it by argmin(E_t / w_t) (draw_dense's argmaxes of
 * log mass + G and y + G), both by race.  kv (-inf: none) cuts on y = x / t itself as well (y >= kv, the torch
 * path's top-k test: mirostat 1's k-th value stays, whatever the rounding of thr's form).  *lp: the token's log
 * probability among the kept.  cx and cid are clobbered (cx needs 8 floats of slack). */
static int64_t draw_candidates_cut(const float *x, float *cx, int32_t *cid, int64_t n, int64_t V, float t,
                                   float xm, float thr, float kv, uint64_t key, int64_t bs, double *lp) {
    const float cs = LOG2E / t;
    const __m256 xv = _mm256_set1_ps(xm), cv = _mm256_set1_ps(cs), thv = _mm256_set1_ps(thr * LOG2E);
    const __m256 tv = _mm256_set1_ps(t), kvv = _mm256_set1_ps(kv);
    for (int64_t q = n; q < ((n + 7) & ~(int64_t)7); q++) cx[q] = -INFINITY;
    for (int64_t q = 0; q < n; q += 8) { /* weights in place, 0 where dropped */
        const __m256 v = _mm256_loadu_ps(cx + q), d2 = _mm256_mul_ps(_mm256_sub_ps(v, xv), cv);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(d2, thv, _CMP_GE_OQ),
                                          _mm256_cmp_ps(t == 1.0f ? v : _mm256_div_ps(v, tv), kvv, _CMP_GE_OQ));
        _mm256_storeu_ps(cx + q, _mm256_and_ps(exp2_neg(d2), keep));
    }
    const int64_t nb = (V + bs - 1) / bs;
    const int sh = (bs & (bs - 1)) == 0 ? __builtin_ctzll((uint64_t)bs) : -1; /* (a shift, not a division, per id) */
    float *mass = calloc((size_t)nb, sizeof(float));
    for (int64_t q = 0; q < n; q++) mass[sh >= 0 ? cid[q] >> sh : cid[q] / bs] += cx[q];
    double zk;
    const int64_t chosen = race(mass, NULL, 0, nb, key, SALT_BLOCK, &zk);
    free(mass);
    int64_t m = 0; /* the chosen block's kept candidates, packed to the front */
    for (int64_t q = 0; q < n; q++)
        if (cid[q] >= chosen * bs && cid[q] < (chosen + 1) * bs && cx[q] > 0.0f) {
            cx[m] = cx[q];
            cid[m++] = cid[q];
        }
    const int64_t pick = race(cx, cid, 0, m, key, SALT_TOKEN, NULL);
    const int64_t out = pick < 0 ? 0 : cid[pick];
    *lp = (double)(x[out] / t - xm / t) - log(zk);
    return out;
}

/* Mirostat 1 for a k wider than above_kth reaches (the 8-token sub-rows): the k-th largest y is bracketed by two pivots from smp[0..ng), the
 * groups' sample (ranks k ng / V +- 4 sigma; smp is clobbered), and a second read of the row sums the weights of the
 * tokens above the upper pivot per block (kept whatever the k-th value is; exp only on groups whose max is above
 * it), counts them, and packs the tokens between the pivots (groups whose max is below the lower one are skipped);
 * the k-th value is then selected among those, their kept weights join their blocks, and draw_cut draws.  xm: the
 * row's max of x.  Returns -1 when the bracket misses (then mirostat1_dense). */
static int64_t mirostat1_wide(const float *x, int64_t V, float t, float xm, int64_t k, float *smp, const float *gmax,
                              int64_t ng, uint64_t key, int64_t bs, double *lp) {
    /* On x itself (x / t keeps the order, and the k-th largest y is the k-th largest x over t). */
    double r = (double)k * (double)ng / (double)V, d = 4.0 * sqrt(r + 1.0) + 8.0;
    int64_t ih = (int64_t)(r - d), il = (int64_t)(r + d);
    float *copy = malloc((size_t)(ng + 8) * sizeof(float));
    memcpy(copy, smp, (size_t)ng * sizeof(float));
    float lo = il >= ng - 1 ? -INFINITY : select_desc(smp, ng, il); /* -inf: the k-th may be the row's last (k = V) */
    float hi = ih <= 0 ? INFINITY : select_desc(copy, ng, ih);
    free(copy);
    int64_t nb = (V + bs - 1) / bs, cap = (int64_t)(3.0 * (2.0 * d + 2.0) * (double)V / (double)ng) + 1024;
    float *mass = calloc((size_t)nb, sizeof(float)), *bx = malloc((size_t)(cap + 8) * sizeof(float));
    float *up = malloc((size_t)(bs + GROUP + 8) * sizeof(float)); /* the current block's tokens above hi, packed */
    int32_t *bid = malloc((size_t)(cap + 8) * sizeof(int32_t));
    int64_t nband = 0, above = 0, nup = 0, cur = 0, sparse = il < ng / 100; /* (few groups reach lo) */
    const float cs = LOG2E / t;
    const __m256 xv = _mm256_set1_ps(xm), cv = _mm256_set1_ps(cs), hv = _mm256_set1_ps(hi), lv = _mm256_set1_ps(lo);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g <= ng; g++) {
        int64_t j = g * GROUP, b = g < ng ? j / bs : -1; /* (groups lie within blocks: bs % GROUP == 0) */
        if (b != cur && nup) { /* the block's kept weights above hi, 8 packed lanes at a time */
            for (int64_t q = nup; q < ((nup + 7) & ~(int64_t)7); q++) up[q] = -INFINITY;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t q = 0; q < nup; q += 8)
                acc = _mm256_add_ps(acc, exp2_neg(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(up + q), xv), cv)));
            mass[cur] = hsum8(acc);
            above += nup;
            nup = 0;
        }
        if (g == ng) break;
        cur = b;
        if (sparse) { /* skip the groups with nothing at or above lo, keeping the prefetcher's stream going */
            _mm_prefetch((const char *)(x + j + 16 * GROUP), _MM_HINT_T0);
            _mm_prefetch((const char *)(x + j + 16 * GROUP + 16), _MM_HINT_T0);
            if (gmax[g] < lo) continue;
        }
        for (int64_t q = j; q < j + GROUP && q < V; q += 8) {
            const __m256 v = load8_tail(x, q, V);
            const int valid = q + 8 <= V ? 0xff : (1 << (V - q)) - 1;
            int u = _mm256_movemask_ps(_mm256_cmp_ps(v, hv, _CMP_GT_OQ)) & valid;
            int in = _mm256_movemask_ps(_mm256_cmp_ps(v, lv, _CMP_GE_OQ)) & ~u & valid;
            nup += pack_store(up + nup, v, u);
            if (!in) continue;
            int64_t at = nband < cap ? nband : cap; /* past cap: counted, not kept (the bracket has missed) */
            pack_store(bx + at, v, in);
            pack_store_i(bid + at, _mm256_add_epi32(_mm256_set1_epi32((int32_t)q), lanes), in);
            nband += __builtin_popcount(in);
        }
    }
    free(up);
    int64_t out = -1;
    if (above < k && k <= above + nband && nband <= cap) {
        float *tmp = malloc((size_t)(nband + 8) * sizeof(float));
        memcpy(tmp, bx, (size_t)nband * sizeof(float));
        const float kv = select_desc(tmp, nband, k - above - 1) / t; /* the k-th largest y */
        free(tmp);
        const __m256 tv = _mm256_set1_ps(t), kvv = _mm256_set1_ps(kv);
        for (int64_t q = nband; q < ((nband + 7) & ~(int64_t)7); q++) bx[q] = -INFINITY; /* (bx has 8 of slack) */
        for (int64_t q = 0; q < nband; q += 8) { /* the kept band tokens' weights join their blocks */
            __m256 v = _mm256_loadu_ps(bx + q), keep = _mm256_cmp_ps(load_scaled(bx + q, tv, t), kvv, _CMP_GE_OQ);
            float e[8];
            _mm256_storeu_ps(e, _mm256_and_ps(keep, exp2_neg(_mm256_mul_ps(_mm256_sub_ps(v, xv), cv))));
            for (int l = 0; l < 8 && q + l < nband; l++) mass[bid[q + l] / bs] += e[l];
        }
        out = draw_cut(x, V, t, xm, kv, mass, nb, key, bs, lp);
    }
    free(bid);
    free(bx);
    free(mass);
    return out;
}

/* Mirostat 1's last resort (a wide k whose bracket missed, or blocks not made of whole groups): the k-th value from
 * a heap of k over the row, then draw_dense_pass with that cut.  xm: the row's max of x. */
static int64_t mirostat1_dense(const float *x, int64_t V, float t, float xm, int64_t k, uint64_t key, int64_t bs,
                               double *lp) {
    float *heap = malloc((size_t)k * sizeof(float));
    const float kv = kth_largest(x, V, t, k, heap), m = xm / t;
    free(heap);
    double zk;
    int64_t out = draw_dense_pass(x, V, t, xm, kv - m, 0.0f, key, bs, &zk);
    *lp = (double)(x[out] / t - m) - log(zk);
    return out;
}

/* Mirostat 1 without a normaliser over the vocabulary (the draw and the mu update only need the kept tokens): one
 * read of the row (row_maxes), then the tokens at or above the 100th largest 8-token max (above_kth: a few hundred
 * sub-rows read again from the cache) hold the 100 largest y, which give s and so k (with mu).  k <= 100: the kept
 * tokens are among those, drawn as a top-k row; k <= the number of sub-rows: above_kth again for k, the k-th value
 * selected among its tokens, draw_candidates_cut with the cut y >= it; a wider k: mirostat1_wide (a second read);
 * every token kept: draw_dense_pass (a second read); when neither holds (a bracket that missed, blocks not made of
 * whole groups), mirostat1_dense. */
static int64_t sample_mirostat1(const float *x, int64_t V, float t, float mu, uint64_t key, int64_t bs, double *lp) {
    const int64_t mm = V < 100 ? V : 100, ns = (V + 7) / 8, ngr = (V + GROUP - 1) / GROUP;
    float *s8 = malloc((size_t)(ns + 2 * (ngr + 8)) * sizeof(float)), *smp = s8 + ns, *gmax = smp + ngr + 8;
    const int64_t ng = row_maxes(x, V, s8, gmax, smp); /* on x: x / t keeps the order */
    float *cx;
    int32_t *cid;
    const int64_t nc = above_kth(x, V, s8, ns, gmax, ng, mm, &cx, &cid);
    cand *top = malloc((size_t)nc * sizeof(cand));
    for (int64_t q = 0; q < nc; q++) top[q] = (cand){cx[q], cid[q]};
    free(cx);
    free(cid);
    qsort(top, (size_t)nc, sizeof(cand), cand_order); /* (a few hundred at most, unless ties reach that far) */
    *lp = 0.0;
    int64_t out = -1, ki = 0;
    const float xmax = top[0].y;
    if (xmax == -INFINITY) {
        out = 0; /* every logit -inf: nothing to draw */
    } else {
        int64_t finite = 0;
        for (int64_t q = 0; q < nc; q++) {
            top[q].y = t == 1.0f ? top[q].y : top[q].y / t;
            finite += q < mm && top[q].y > -INFINITY;
        }
        ki = mirostat1_k(top, finite, mm, V, mu);
        if (ki >= V) { /* every token kept: a dense draw over the row, no k-th value to find */
            double zk;
            out = draw_dense_pass(x, V, t, xmax, -INFINITY, 0.0f, key, bs, &zk);
            *lp = (double)(x[out] / t - xmax / t) - log(zk);
        } else if (ki <= mm) { /* every token with y >= the k-th is among the candidates */
            out = draw_kept(top, nc, top[0].y, top[ki - 1].y - top[0].y, V, key, bs, lp);
        } else if (ki <= ns) {
            const int64_t n = above_kth(x, V, s8, ns, gmax, ng, ki, &cx, &cid);
            float *tmp = malloc((size_t)(n + 8) * sizeof(float));
            memcpy(tmp, cx, (size_t)n * sizeof(float));
            const float kx = select_desc(tmp, n, ki - 1); /* the k-th largest x; the k-th largest y is it over t */
            free(tmp);
            out = draw_candidates_cut(x, cx, cid, n, V, t, xmax, -INFINITY, t == 1.0f ? kx : kx / t, key, bs, lp);
            free(cx);
            free(cid);
        } else if (bs % GROUP == 0) { /* (blocks made of whole groups; else the last resort) */
            out = mirostat1_wide(x, V, t, xmax, ki, smp, gmax, ng, key, bs, lp);
        }
    }
    free(top);
    free(s8);
    return out >= 0 ? out : mirostat1_dense(x, V, t, xmax, ki, key, bs, lp);
}

/* The largest of x[lo..hi) (lo a multiple of 8), and each of its 8-token sub-rows' max into s8 (s8[q] for
 * x[8q, 8q + 8), cut at hi). */
static inline float block_maxes(const float *x, int64_t lo, int64_t hi, float *s8) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = lo;
    for (; j + GROUP <= hi; j += GROUP) mv = _mm256_max_ps(mv, sub_maxes32(x + j, s8 + j / 8));
    float m = hmax8(mv);
    for (; j < hi; j += 8) {
        s8[j / 8] = hmax8(load8_tail(x, j, hi));
        m = s8[j / 8] > m ? s8[j / 8] : m;
    }
    return m;
}

/* Mirostat 2 in one read of the row, block by block (a block stays in L1 between its max and its weights): the
 * running max of x, z = sum exp(y - m) rescaled when the max grows, and each 8-token sub-row's max (block_maxes).
 * The cut, log z - mu ln 2 below the max, is then known; only the sub-rows whose max passes it hold kept tokens, and
 * only those are read again (from the cache), their kept tokens packed and drawn by draw_candidates_cut.  (Blocks
 * that are not whole sub-rows: draw_dense_pass with the cut, a second read of the whole row.) */
static int64_t sample_mirostat2(const float *x, int64_t V, float t, float mu, uint64_t key, int64_t bs, double *lp) {
    const float cs = LOG2E / t;
    const __m256 cv = _mm256_set1_ps(cs);
    const int64_t nb = (V + bs - 1) / bs, ns = (V + 7) / 8;
    float *s8 = bs % 8 == 0 ? malloc((size_t)(ns + 8) * sizeof(float)) : NULL;
    float xm = -INFINITY; /* the running max of x (y's is xm / t) */
    double z = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * bs, hi = (b + 1) * bs < V ? (b + 1) * bs : V;
        const float cm = s8 ? block_maxes(x, lo, hi, s8) : max_range(x, lo, hi);
        if (cm > xm) {
            z = xm == -INFINITY ? 0.0 : z * exp(((double)xm - cm) / t);
            xm = cm;
        }
        if (xm == -INFINITY) continue;
        const __m256 xv = _mm256_set1_ps(xm);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = lo; j < hi; j += 8)
            acc = _mm256_add_ps(acc, exp2_neg(_mm256_mul_ps(_mm256_sub_ps(load8_tail(x, j, hi), xv), cv)));
        z += hsum8(acc);
    }
    *lp = 0.0;
    int64_t out = 0;
    if (xm > -INFINITY) {
        float thr = (float)(log(z) - (double)mu * 0.69314718055994530942);
        thr = thr > 0.0f ? 0.0f : thr;
        if (s8) { /* (the same test draw_candidates_cut keeps by: (x - xm) log2(e) / t >= thr log2(e)) */
            int32_t *sel = malloc((size_t)(ns + 8) * sizeof(int32_t));
            float *cx;
            int32_t *cid;
            const int64_t nsel = subrows_passing(s8, ns, xm, cs, thr * LOG2E, sel);
            const int64_t n = pack_subrows(x, V, sel, nsel, xm, cs, thr * LOG2E, &cx, &cid);
            free(sel);
            out = draw_candidates_cut(x, cx, cid, n, V, t, xm, thr, -INFINITY, key, bs, lp);
            free(cid);
            free(cx);
        } else {
            double zk;
            out = draw_dense_pass(x, V, t, xm, thr, 0.0f, key, bs, &zk);
            *lp = (double)(x[out] / t - xm / t) - log(zk);
        }
    }
    free(s8);
    return out;
}

/* ---- Warped rows without top-k or top-p whose cut (top_n_sigma's bound, min_p) leaves few tokens ----
 * sample_dense_warped writes the whole row's weights and runs epsilon / eta / XTC and the draw over them; here one
 * read gives its statistics (the same sums in the same order, so the same sigma bound) and each 8-token sub-row's
 * max, and only the sub-rows whose max can pass the cut are read again, their kept tokens' weights computed as that
 * path computes them (the same vector exp; the last V % 8 tokens by its scalar expf).  Every later step runs on the
 * kept tokens in id order with that path's arithmetic: z from per-lane float sums per 1024 tokens, folded in the
 * same order; epsilon / eta / XTC's double sums (the dropped tokens' zeros add nothing); block masses summed in id
 * order and the same Gumbel draws.  So the draw is the dense path's, token for token. */
static void stats_maxes(const float *x, int64_t V, double *st, float *s8) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f);
    __m256 mx = ninf;
    st[1] = st[2] = st[3] = 0.0;
    int64_t i = 0;
    while (i + 8 <= V) { /* kth_and_stats's accumulation (per lane, per 1024 tokens) */
        __m256 cnt = _mm256_setzero_ps(), sum = _mm256_setzero_ps(), sq = _mm256_setzero_ps();
        const int64_t end = i + 1024 < V ? i + 1024 : V;
#define ACC(v)                                                 \
    {                                                          \
        const __m256 ok = _mm256_cmp_ps(v, ninf, _CMP_GT_OQ);   \
        const __m256 f = _mm256_and_ps(ok, v);                  \
        cnt = _mm256_add_ps(cnt, _mm256_and_ps(ok, one));       \
        sum = _mm256_add_ps(sum, f);                            \
        sq = _mm256_fmadd_ps(f, f, sq);                         \
    }
        for (; i + GROUP <= end; i += GROUP) {
            const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
            ACC(v0) ACC(v1) ACC(v2) ACC(v3)
            mx = _mm256_max_ps(mx, sub_maxes4(v0, v1, v2, v3, s8 + i / 8));
        }
        for (; i + 8 <= end; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            ACC(v)
            s8[i / 8] = hmax8(v);
            mx = _mm256_max_ps(mx, v);
        }
#undef ACC
        st[1] += hsum8(cnt);
        st[2] += hsum8(sum);
        st[3] += hsum8(sq);
    }
    float m = hmax8(mx);
    if (i < V) s8[i / 8] = hmax8(load8_tail(x, i, V));
    for (; i < V; i++) {
        const float v = x[i];
        m = v > m ? v : m;
        if (v > -INFINITY) st[1] += 1.0, st[2] += v, st[3] += (double)v * v;
    }
    st[0] = m;
}

/* draw_dense over the kept tokens (w[i] > 0, ids ascending): the blocks' masses (float sums in id order, as the
 * dense path's over the row with zeros), argmax log mass + G, then argmax x / t + G within the block. */
static int64_t draw_dense_candidates(const float *x, float t, const float *w, const int32_t *id, int64_t n,
                                     uint64_t key, int64_t bs) {
    int64_t chosen = 0, out = 0;
    double best = -INFINITY;
    for (int64_t q = 0; q < n;) {
        const int64_t b = id[q] / bs;
        float mass = 0.0f;
        for (; q < n && id[q] / bs == b; q++) mass += w[q];
        if (!(mass > 0.0f)) continue;
        const double sc = (double)logf(mass) + gumbel(key, b, SALT_BLOCK);
        if (sc > best) {
            best = sc;
            chosen = b;
        }
    }
    best = -INFINITY;
    for (int64_t q = 0; q < n; q++) {
        if (id[q] / bs != chosen || !(w[q] > 0.0f)) continue;
        const double sc = (double)(x[id[q]] / t) + gumbel(key, id[q], SALT_TOKEN);
        if (sc > best) {
            best = sc;
            out = id[q];
        }
    }
    return out;
}

static int64_t sample_sparse_warped(const float *x, int64_t V, float t, float min_p, uint64_t key, int64_t bs,
                                    const float *wk) {
    const int64_t ns = (V + 7) / 8, vec = V / 8 * 8; /* tokens from vec on: the dense path's scalar tail */
    float *s8 = malloc((size_t)(ns + 8) * sizeof(float));
    double st[4];
    stats_maxes(x, V, st, s8);
    if (!(st[1] > 0.0)) {
        free(s8);
        return 0;
    }
    float bound = -INFINITY;
    if (wk[W_SIGMA] > 0.0f) {
        double mean = st[2] / st[1], var = fmax(st[3] / st[1] - mean * mean, 0.0);
        bound = (float)(st[0] - wk[W_SIGMA] * sqrt(var));
    }
    const float tw = wk[W_DYN_R] > 0.0f ? dyn_temp(x, V, bound, (float)st[0], t, wk) : t;
    const float m = (float)st[0] / tw;
    const __m256 tv = _mm256_set1_ps(tw), mv = _mm256_set1_ps(m), bv = _mm256_set1_ps(bound),
                 ninf = _mm256_set1_ps(-INFINITY), mpv = _mm256_set1_ps(min_p), zero = _mm256_setzero_ps(),
                 slack = _mm256_set1_ps(min_p * 0.999f); /* (for the sub-rows: exp_neg's rounding need not be monotone) */
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int32_t *sel = malloc((size_t)(ns + 8) * sizeof(int32_t));
    int64_t nsel = 0, q = 0;
    for (; q < ns; q += 8) { /* the sub-rows whose max passes the cut */
        const __m256 v = load8_tail(s8, q, ns);
        __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, bv, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ));
        if (min_p > 0.0f)
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(exp_neg(_mm256_sub_ps(tw == 1.0f ? v : _mm256_div_ps(v, tv), mv)),
                                                 slack, _CMP_GE_OQ));
        nsel += pack_store_i(sel + nsel, _mm256_add_epi32(_mm256_set1_epi32((int32_t)q), lanes), _mm256_movemask_ps(ok));
    }
    float *w = malloc((size_t)(8 * nsel + 8) * sizeof(float));
    int32_t *id = malloc((size_t)(8 * nsel + 8) * sizeof(int32_t));
    int64_t n = 0;
    for (int64_t i = 0; i < nsel; i++) { /* the kept tokens' weights, as sample_dense_warped computes them */
        const int64_t j = (int64_t)sel[i] * 8;
        if (j >= vec) {
            for (int64_t l = j; l < V; l++) {
                float e = x[l] >= bound && x[l] > -INFINITY ? expf(x[l] / tw - m) : 0.0f;
                if (min_p > 0.0f && e < min_p) e = 0.0f;
                if (e > 0.0f) w[n] = e, id[n++] = (int32_t)l;
            }
            continue;
        }
        const __m256 xv = _mm256_loadu_ps(x + j);
        const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(xv, bv, _CMP_GE_OQ), _mm256_cmp_ps(xv, ninf, _CMP_GT_OQ));
        __m256 e = _mm256_and_ps(ok, exp_neg(_mm256_sub_ps(load_scaled(x + j, tv, tw), mv)));
        if (min_p > 0.0f) e = _mm256_and_ps(e, _mm256_cmp_ps(e, mpv, _CMP_GE_OQ));
        const int mk = _mm256_movemask_ps(_mm256_cmp_ps(e, zero, _CMP_GT_OQ));
        pack_store_i(id + n, _mm256_add_epi32(_mm256_set1_epi32((int32_t)j), lanes), mk);
        n += pack_store(w + n, e, mk);
    }
    free(sel);
    free(s8);
    /* z as the dense path sums it: float lanes (id % 8) per 1024 tokens, each folded by hsum8 into a double, then
     * the scalar tail's */
    const int64_t nch = (vec + 1023) / 1024;
    float *zl = calloc((size_t)(nch + 1) * 8, sizeof(float));
    double z = 0.0;
    for (int64_t k = 0; k < n && id[k] < vec; k++) zl[(id[k] / 1024) * 8 + id[k] % 8] += w[k];
    for (int64_t c = 0; c < nch; c++) z += hsum8(_mm256_loadu_ps(zl + c * 8));
    for (int64_t k = 0; k < n; k++)
        if (id[k] >= vec) z += w[k];
    free(zl);
    warp_masks(w, n, z, wk, key);
    const int64_t out = draw_dense_candidates(x, tw, w, id, n, key, bs);
    free(id);
    free(w);
    return out;
}

static int64_t sample_mirostat(const float *x, int64_t V, float t, int mode, float mu, uint64_t key, int64_t bs,
                               double *lp) {
    return mode == 2 ? sample_mirostat2(x, V, t, mu, key, bs, lp) : sample_mirostat1(x, V, t, mu, key, bs, lp);
}

void ts_sample_rows_mirostat(const float *x, int64_t ldx, int64_t V, const int64_t *rows, int64_t n,
                             const float *temperature, const int64_t *seed_keys, const int64_t *positions,
                             int64_t block_size, const int64_t *mode, const float *mu, int64_t *out, double *lp) {
#pragma omp parallel for schedule(dynamic, 1) if (n >= 8)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        uint64_t key = mix64((uint64_t)seed_keys[r] + (uint64_t)(positions[r] + 1) * GOLDEN);
        out[i] = sample_mirostat(x + r * ldx, V, temperature[r], (int)mode[i], mu[i], key, block_size, lp + i);
    }
}

/* Draws one token for each of the n rows `rows` of x [*, V] (row stride ldx), with the per-batch-row knobs
 * temperature, top_k (0 = off), top_p, min_p, seed_keys and positions indexed by those rows; out[i] for rows[i]. */
void ts_sample_rows(const float *x, int64_t ldx, int64_t V, const int64_t *rows, int64_t n, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const int64_t *seed_keys,
                    const int64_t *positions, int64_t block_size, int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (n >= 8)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        uint64_t key = mix64((uint64_t)seed_keys[r] + (uint64_t)(positions[r] + 1) * GOLDEN);
        const float *xr = x + r * ldx;
        out[i] = top_k[r] > 0 ? sample_top_k(xr, V, temperature[r], top_k[r], top_p[r], min_p[r], key, block_size)
                              : sample_dense(xr, V, temperature[r], top_p[r], min_p[r], key, block_size);
    }
}

/* torch.argmax(x, -1) of one row: the first index of its largest value, or of its first NaN (torch orders NaN
 * above every number).  Two passes over the row, both vectorised: the maximum (and whether a NaN is present),
 * then the first lane equal to it.  torch's CPU argmax is a scalar reduction: 1.3 ms for [64, 49152] on 2
 * threads, ~2% of a 64-row greedy step of the default model. */
static int64_t argmax_row(const float *x, int64_t V) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    int has_nan = !_mm256_testz_ps(nan, nan);
    for (int64_t j = i; j < V; j++) has_nan |= x[j] != x[j];
    if (has_nan) {
        for (int64_t j = 0; j < V; j++)
            if (x[j] != x[j]) return j;
    }
    float best = hmax8(m); /* no NaN left: hmax8's precondition */
    for (int64_t j = i; j < V; j++) best = x[j] > best ? x[j] : best;
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= V; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < V; i++)
        if (x[i] == best) return i;
    return 0; /* V == 0: unreachable for a vocabulary */
}

/* out[r] = torch.argmax(x[r, :V]) for the n rows of x (row stride ldx): the greedy rows' tokens. */
void ts_argmax_rows(const float *x, int64_t ldx, int64_t V, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (n >= 4)
    for (int64_t r = 0; r < n; r++) out[r] = argmax_row(x + r * ldx, V);
}
