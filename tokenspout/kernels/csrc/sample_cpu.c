/* One-call sampling of top-k rows on the CPU (tokenspout/sample/ops/topk_cpu.py wraps it).
 *
 * Why: the torch path (sample/ops/topk_topp.py, draw.py, noise.py) runs ~160 small ops for a row with top_k, top_p
 * and a temperature; at a few microseconds of dispatch each that is ~0.8 ms per step at batch 1 -- 10-15% of a
 * decode step -- and under the engine's passive OpenMP policy every op that goes parallel wakes a sleeping thread.
 * This kernel does the same computation for one row in one pass over its logits plus work on its ~k survivors.
 *
 * Semantics: exactly those of topk_topp.py (read its docstring) and draw.py, for rows with 1 <= top_k <= the cap:
 *   y = logits / T;  A = {t : y_t >= the k-th largest y} (ties at the k-th value all stay), ordered by (y desc,
 *   id asc);  w = exp(y - max y);  min_p keeps w >= min_p;  top-p keeps t iff the kept mass ahead of t is
 *   < top_p * Z;  then the two-level Gumbel-max draw of draw.py with the counter-based noise of noise.py
 *   (SplitMix64 of (seed key, position, id)).  The noise is bit-identical to the torch path; float32 sums and exp
 *   may round differently, so the two agree token for token except where a decision sits within an ulp of a
 *   boundary (tests/unit/test_sampler_kernel.py compares them on thousands of rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIX_M1 0xBF58476D1CE4E5B9ULL
#define MIX_M2 0x94D049BB133111EBULL
#define MIX_ID 0xD6E8FEB86659FD93ULL
#define SALT_TOKEN 0x243F6A8885A308D3ULL
#define SALT_BLOCK 0x13198A2E03707344ULL
#define STACK_CANDS 4096

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
static float kth_largest(const float *x, int64_t V, float t, int64_t k, float *heap) {
    for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
    const __m256 tv = _mm256_set1_ps(t);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
        int m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap[0]), _CMP_GT_OQ));
        if (!m) continue;
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
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
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

/* Truncates and draws one row; returns the token id. */
static int64_t sample_row(const float *x, int64_t V, float t, int64_t k, float top_p, float min_p, uint64_t key,
                          int64_t bs, float *heap, cand *stack_c) {
    float kth = kth_largest(x, V, t, k, heap);
    cand *c = stack_c;
    int64_t n = collect(x, V, t, kth, c, STACK_CANDS);
    if (n > STACK_CANDS) { /* a tie group at the k-th value wider than the stack buffer (e.g. uniform logits) */
        c = malloc((size_t)n * sizeof(cand));
        collect(x, V, t, kth, c, n);
    }
    int64_t out = 0;
    if (n == 0) goto done; /* every logit is -inf: nothing can be drawn; the torch path returns a top id too */
    qsort(c, (size_t)n, sizeof(cand), cand_order);
    float *w = malloc((size_t)n * sizeof(float));
    float m0 = c[0].y;
    for (int64_t j = 0; j < n; j++) {
        w[j] = expf(c[j].y - m0);
        if (min_p > 0.0f && w[j] < min_p) w[j] = 0.0f;
    }
    if (top_p < 1.0f) {
        float z = 0.0f;
        for (int64_t j = 0; j < n; j++) z += w[j];
        double run = 0.0; /* torch's CPU cumsum accumulates in double and rounds each prefix to float */
        for (int64_t j = 0; j < n; j++) {
            run += w[j];
            float ahead = (float)run - w[j];
            if (!(ahead < top_p * z)) w[j] = 0.0f;
        }
    }
    /* Stage 1: a block with probability mass_b / sum(mass); stage 2: a token of that block by its weight. */
    int64_t nb = (V + bs - 1) / bs;
    float *mass = calloc((size_t)nb, sizeof(float));
    for (int64_t j = 0; j < n; j++)
        if (w[j] > 0.0f) mass[c[j].id / bs] += w[j];
    double best = -INFINITY;
    int64_t chosen = c[0].id / bs;
    for (int64_t j = 0; j < n; j++) {
        if (!(w[j] > 0.0f)) continue;
        int64_t b = c[j].id / bs;
        double s = (double)logf(mass[b]) + gumbel(key, b, SALT_BLOCK);
        if (s > best) {
            best = s;
            chosen = b;
        }
    }
    best = -INFINITY;
    out = c[0].id;
    for (int64_t j = 0; j < n; j++) {
        if (!(w[j] > 0.0f) || c[j].id / bs != chosen) continue;
        double s = (double)(c[j].y - m0) + gumbel(key, c[j].id, SALT_TOKEN);
        if (s > best) {
            best = s;
            out = c[j].id;
        }
    }
    free(mass);
    free(w);
done:
    if (c != stack_c) free(c);
    return out;
}

/* Draws one token for each of the n rows `rows` of x [*, V] (row stride ldx), with the per-batch-row knobs
 * temperature, top_k (1..V), top_p, min_p, seed_keys and positions indexed by those rows; out[i] for rows[i]. */
void ts_sample_topk(const float *x, int64_t ldx, int64_t V, const int64_t *rows, int64_t n, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const int64_t *seed_keys,
                    const int64_t *positions, int64_t block_size, int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (n >= 8)
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int64_t k = top_k[r];
        float *heap = malloc((size_t)k * sizeof(float));
        cand *stack_c = malloc(STACK_CANDS * sizeof(cand));
        uint64_t key = mix64((uint64_t)seed_keys[r] + (uint64_t)(positions[r] + 1) * GOLDEN);
        out[i] = sample_row(x + r * ldx, V, temperature[r], k, top_p[r], min_p[r], key, block_size, heap, stack_c);
        free(stack_c);
        free(heap);
    }
}
