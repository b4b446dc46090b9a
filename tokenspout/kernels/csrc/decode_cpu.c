/* Small-batch decode kernels for x86-64 CPUs with AVX2 + FMA (tokenspout/kernels/cpu.py builds and loads this).
 *
 * Why hand-written: at batch 1..8 a decode step is bound by reading the weights once.  Stock torch GEMV reaches
 * 9-15 GB/s here (it is tuned for larger M), and every small torch op costs a dispatch plus an OpenMP fork/join.
 * These kernels stream each weight row once for all M rows of the batch, run the whole decoder stack in one call
 * (one OpenMP parallel region, with a barrier of their own between dependent steps), and read the paged KV cache
 * in place.
 *
 * Threads: compiled with -fopenmp and loaded into a process where torch already loaded its libgomp, so both share
 * one OpenMP runtime and torch.set_num_threads() governs these kernels too.
 *
 * Layouts (all row-major, float32 activations):
 *   weights  W[N, K] float32, bfloat16 or float16 (the torch layout; 16-bit values widened to float32 in registers), or quantized in groups of 32 along K and packed per block of four
 *            output rows (tokenspout/models/quantize.py): Q8 W = scale * q (q int8), Q4 W = scale * q + min
 *            (q 0..15, four per 16-bit word), Q5 W = scale * q + min (q 0..31, three per 16-bit word); codes Q8
 *            [N/4][K/32][4][32 bytes], Q4 [N/4][K/64 rounded up][4][32 bytes] (pairs of groups, see widen_group), Q5
 *            [N/4][K/96 rounded up][4][64 bytes] (triples of groups, see q5_group), scale/min [N/4][K/32][4] float16
 *            (llama.cpp's Q8_0 / Q4_1 / Q5_1 store them as float16 too); Q6 W = scale * sub * (q - 32) (q 0..63,
 *            sub an int8 per 16 columns: Q6_K's values) [N/4][K/64][208 bytes] (pairs of groups, see q6_load);
 *   KV cache of a layer: [2, slots, Hkv, D] float32 or float16; slot of position p = block_ids[p / bs] * bs + p % bs.
 * Quantized weights take one of two paths by batch size: the row path (block_q, up to TILE_MIN - 1 rows: streams
 * the codes, bound by weight bytes) and the tiled path (blocks_tile, TILE_MIN rows and more: bound by integer
 * multiply-adds, so it widens each block's codes once and reuses them across the batch).  Both multiply the codes
 * by the activations rounded to int16 per group of 32 (ts_qact), or, where a weight asks for it (ts_weight.act8,
 * `--activation-quant int8`), to int8: then int4 / int5 codes take byte kernels (tile_group8 from TILE_MIN8 rows,
 * block_q_a8 below that for int4; the AVX-512 build's tile_group8_512 takes int8 codes too, from TILE_MIN8_Q8 rows,
 * its row path none), as do int6 codes with AVX2 (tile_group6, block_q_a8), and every other case the int16 kernels
 * over the int8 values.  The AVX-512 build's row path for int6 (block_q6_512) is a byte kernel for either
 * activation type (int16 ones split into two bytes).
 */
#include "isa.h"
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "simd.h"

#ifndef TS_AVX512 /* 1 in the AVX-512 build (cpu.py's -DTS_AVX512=1); a value, so C expressions can test it */
#define TS_AVX512 0
#endif
#ifndef TS_BATCH_INVARIANT /* 1 in the batch-invariant build (cpu.py, `--batch-invariant`; AVX2 only): see the row path */
#define TS_BATCH_INVARIANT 0
#endif
#if TS_BATCH_INVARIANT && TS_AVX512
#error "the batch-invariant build is AVX2's: the AVX-512 kernels keep their own summation orders"
#endif

#define WT_F32 0
#define WT_Q8 1
#define WT_Q4 2
#define WT_BF16 3 /* 16-bit float weights [N, K] (bfloat16 / float16, as the checkpoint holds them), float32 math */
#define WT_F16 4
#define WT_Q5 5 /* int5 (a GGUF file's Q5_0 / Q5_1 / Q5_K): W = scale * q + min, q 0..31, three codes per 16-bit word */
#define WT_Q6 6 /* int6 (a GGUF file's Q6_K, its values exactly): W = scale * sub * (q - 32), q 0..63, sub an int8 per 16 columns */
#define IS_FLOAT(wt) ((wt) == WT_F32 || (wt) == WT_BF16 || (wt) == WT_F16)
#define HAS_MIN(wt) ((wt) == WT_Q4 || (wt) == WT_Q5)

typedef struct ts_weight {
    const void *w;         /* float32 [N, K] or packed codes */
    const uint16_t *scale; /* quantized only, float16 */
    const uint16_t *min;   /* Q4 / Q5 only, float16 */
    int64_t wt;
    /* A fused weight of two quantized formats (a GGUF file's Q4_K q / k with a Q6_K v): this one holds rows
     * [0, n_head), `tail` the rest (NULL: one format for all rows).  Both quantized: they share the int16
     * activations. */
    const struct ts_weight *tail;
    int64_t n_head;
    /* Quantized weights: 1 = int8 activations (llama.cpp's numerics, `--activation-quant int8`): the activations are
     * rounded to 255 levels per group of 32 instead of 65535, and the tiled path multiplies int4 codes by them
     * with vpmaddubsw (tile_group8).  A fused weight and its tail share one setting (they share the activations). */
    int64_t act8;
} ts_weight;

/* ---- the barrier between the steps of a layer ------------------------------------------------------------------
 * A decode step at batch 1 passes ~200 barriers (7 per layer), ~40 us apart.  OpenMP's own barrier either spins
 * (OMP_WAIT_POLICY=active: fast on idle cores, ruinous when another process needs one of them) or, as the engine
 * runs it (passive), puts every waiting thread to sleep at once, and a thread that sleeps costs far more than the
 * futex call: on this VM its vCPU halts and comes back only when the host schedules it again, up to milliseconds
 * later (measured: ~13 sleeps per batch-8 step made the step 15-30% slower).  This barrier spins for a bounded
 * time, then sleeps on a futex.  The bound adapts per thread: it shrinks by a quarter each time the spin timed out
 * (another process holds the other core, so spinning only steals its time slice) and doubles each time the
 * barrier opened while spinning (balanced work, idle cores: the common case, where no thread ever sleeps). */
typedef struct {
    atomic_int arrived;  /* threads at the barrier in this round */
    atomic_int gen;      /* round number: the last thread to arrive bumps it; the others wait for that */
    atomic_int sleepers; /* threads sleeping on gen (the last arrival wakes them only if there are any) */
    atomic_int nthr;     /* team size, stored by every thread of the team before its first wait */
} ts_barrier;

#define SPIN_MIN_NS 20000
#define SPIN_MAX_NS 1000000
static _Thread_local int64_t spin_ns = 200000; /* this thread's current spin bound (adaptive, see above) */

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void bar_join(ts_barrier *b) { atomic_store_explicit(&b->nthr, omp_get_num_threads(), memory_order_relaxed); }

static void bar_wait(ts_barrier *b) {
    const int n = atomic_load_explicit(&b->nthr, memory_order_relaxed);
    if (n <= 1) return;
    /* read the round before arriving: it cannot move until this thread has arrived */
    const int g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed); /* published by the seq_cst store below */
        atomic_store(&b->gen, g + 1);
        if (atomic_load(&b->sleepers)) syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    const int64_t t0 = now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != g) {
            spin_ns = spin_ns * 2 > SPIN_MAX_NS ? SPIN_MAX_NS : spin_ns * 2;
            return;
        }
        _mm_pause();
        if (i % 8 == 0 && now_ns() - t0 > spin_ns) break;
    }
    spin_ns = spin_ns - spin_ns / 4 < SPIN_MIN_NS ? SPIN_MIN_NS : spin_ns - spin_ns / 4;
    /* seq_cst on both sides: either the last arrival sees this sleeper, or this thread sees the new round */
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->gen) == g) syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
}

/* Eight weights from p + i as float32: float32, bfloat16 (the top half of a float32: a shift) or float16 (F16C).
 * wt is a literal at every call, so the branches fold away. */
static inline __attribute__((always_inline)) __m256 load8w(const void *p, int64_t i, const int wt) {
    if (wt == WT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    if (wt == WT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

/* float weights (wt: float32 / bfloat16 / float16): four output rows n..n+3 against one or two batch rows (x1 may
 * be NULL): out0[r], out1[r].  With one batch row the k loop runs two steps per iteration into separate
 * accumulators: eight FMA chains hide the FMA latency (not in the batch-invariant build: there one row sums in the
 * order two rows do, as row1_f does).  16-bit weights read half the bytes: at one batch row, bound by the weight
 * bytes, that is twice float32's speed. */
#define LOADF(w, n, K, r, k) load8w((w), ((n) + (r)) * (K) + (k), wt)
static inline __attribute__((always_inline)) void rows4_f(const void *w, const int wt, int64_t n, int64_t K,
                                                          const float *x0, const float *x1, float out0[4],
                                                          float out1[4]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    if (x1 || TS_BATCH_INVARIANT) {
        if (!x1) x1 = x0; /* (the batch-invariant build's one row: computed twice, out1 discarded) */
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
            __m256 w0 = LOADF(w, n, K, 0, k), w1 = LOADF(w, n, K, 1, k);
            __m256 w2 = LOADF(w, n, K, 2, k), w3 = LOADF(w, n, K, 3, k);
            a00 = _mm256_fmadd_ps(w0, xa, a00); a01 = _mm256_fmadd_ps(w1, xa, a01);
            a02 = _mm256_fmadd_ps(w2, xa, a02); a03 = _mm256_fmadd_ps(w3, xa, a03);
            a10 = _mm256_fmadd_ps(w0, xb, a10); a11 = _mm256_fmadd_ps(w1, xb, a11);
            a12 = _mm256_fmadd_ps(w2, xb, a12); a13 = _mm256_fmadd_ps(w3, xb, a13);
        }
        out1[0] = hsum8(a10); out1[1] = hsum8(a11); out1[2] = hsum8(a12); out1[3] = hsum8(a13);
    } else {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x0 + k + 8);
            a00 = _mm256_fmadd_ps(LOADF(w, n, K, 0, k), xa, a00);
            a01 = _mm256_fmadd_ps(LOADF(w, n, K, 1, k), xa, a01);
            a02 = _mm256_fmadd_ps(LOADF(w, n, K, 2, k), xa, a02);
            a03 = _mm256_fmadd_ps(LOADF(w, n, K, 3, k), xa, a03);
            a10 = _mm256_fmadd_ps(LOADF(w, n, K, 0, k + 8), xb, a10);
            a11 = _mm256_fmadd_ps(LOADF(w, n, K, 1, k + 8), xb, a11);
            a12 = _mm256_fmadd_ps(LOADF(w, n, K, 2, k + 8), xb, a12);
            a13 = _mm256_fmadd_ps(LOADF(w, n, K, 3, k + 8), xb, a13);
        }
        for (; k < K; k += 8) {
            __m256 xa = _mm256_loadu_ps(x0 + k);
            a00 = _mm256_fmadd_ps(LOADF(w, n, K, 0, k), xa, a00);
            a01 = _mm256_fmadd_ps(LOADF(w, n, K, 1, k), xa, a01);
            a02 = _mm256_fmadd_ps(LOADF(w, n, K, 2, k), xa, a02);
            a03 = _mm256_fmadd_ps(LOADF(w, n, K, 3, k), xa, a03);
        }
        a00 = _mm256_add_ps(a00, a10); a01 = _mm256_add_ps(a01, a11);
        a02 = _mm256_add_ps(a02, a12); a03 = _mm256_add_ps(a03, a13);
    }
    out0[0] = hsum8(a00); out0[1] = hsum8(a01); out0[2] = hsum8(a02); out0[3] = hsum8(a03);
}

static inline __attribute__((always_inline)) float row1_f(const void *w, const int wt, int64_t n, int64_t K,
                                                          const float *x) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8w(w, n * K + k, wt), _mm256_loadu_ps(x + k), a);
    return hsum8(a);
}

/* ---- quantized weights x int16 activations ----
 * Each batch row is quantized per group of 32 to int16 codes with one float scale (amax / 32767), and the group's
 * float sum is kept for Q4's min term.  A group's dot product is then integer: vpmaddwd multiplies 16 pairs and adds
 * neighbours into int32 (no overflow: 32 * 127 * 32767 < 2^31), so each weight is widened to int16 once per block
 * and never converted to float; one conversion and one FMA per 32 weights and row.  int16 rounds the activations
 * by at most 1/65534 of their group's largest value: the results stay within float32-level error of the
 * dequantized weights' float product (llama.cpp's int8 activations cost ~1 logit of error on the default model and
 * flipped greedy near-ties; this costs ~25% more integer work per row).  At one row the AVX2 path sits between its
 * integer work and memory: in L2 a group of four rows takes ~13 cycles (~7.5 of them the integer dots, the rest the
 * reduction and scaling), from memory with both cache lines prefetched (prefetch2) two threads stream int4 at
 * ~17-24 GB/s where a plain read gets ~27-30; int8 activations (vpmaddubsw) measured only 1.0-1.1x there. */
typedef struct {
    int16_t *q;  /* [M, K]; tiled (mp > 0): pairs of int16 (columns 2t, 2t+1 of a group), see tiled() */
    float *d;    /* [M, G] scale; tiled: [G][mp] */
    float *s;    /* [M, G] sum of the float values; tiled: [G][mp] */
    int64_t mp;  /* 0: row layout; > 0: tiled layout, M rounded up to a multiple of TW (padding rows are zero) */
    float *xt;   /* float weights' tiled path: the activations transposed, [K][mp] (see transpose_act) */
    int8_t *q8;  /* int8 activations (act8; q then holds the same values as int16).  Tiled: quad t (columns
                  * 4t..4t+3) of group g of row m at int32 index (g * 8 + t) * mp + m (tiled8).  Rows: row m's pair
                  * of groups p at byte (m * P + p) * 64 (P = pairs per row), in the row8 layout */
    int64_t act8;
    int32_t *q8s; /* AVX-512, act8, tiled: 128 x the sum of a group's int8 codes, [G][mp] (tile_group8_512's Q8 term) */
    int32_t *q6t; /* act8, tiled, a linear holding int6: per group g, quarter j (16 columns) and row m, at
                   * (2 g + j) * mp + m, AVX2: two int16, -32 x the sum of the int8 activations of columns 4k, 4k + 1
                   * and of 4k + 2, 4k + 3 over the quarter's quads k (tile_group6's start: it multiplies unsigned
                   * codes); AVX-512: -32 x the quarter's sum (tile_group6_512's start) */
    /* AVX-512, the row layout of a linear holding int6 (block_q6_512's bytes): q8 holds row m's pair of groups p at
     * byte (m * P + p) * 64 in column order, the int8 codes (act8) or the low seven bits of the int16 ones (0..127);
     * q8h the int16 codes' high part (code >> 7, -128..127: code = 128 q8h + q8); q6o at (m * P + p) * 4 + j 32 x
     * the sum of the codes of the pair's quarter j (16 columns), what the unsigned codes' product takes back off. */
    int8_t *q8h;
    int32_t *q6o;
} ts_qact;

/* Batch rows from which the quantized linears take the tiled path (blocks_tile).  bench.linear: AVX2's row path
 * loses from 16 rows.  AVX-512: the whole decode step of the default model (in-process, int4, float16 cache, A/B in
 * one run on the EPYC, since the tiled path prefetches its next pass): the tiled path 1.32x the row path's time at
 * 8 rows, 1.02x at 12, 0.82x at 16, 0.90x at 24 (it pads to a multiple of 16 rows). */
#ifndef TILE_MIN
#if TS_AVX512
#define TILE_MIN 14
#else
#define TILE_MIN 16
#endif
#endif

/* Batch rows from which int4 weights with int8 activations (act8) take the tiled path (the byte tile, tile_group8;
 * below it the byte row kernel, block_q_a8).  The tile pads to 16 rows, so from 9 rows it costs what 16 do.
 * ts_linear on 1.7B-shaped int4 layers, 2 threads, AVX2 EPYC: the row path's time over the tile's 0.89x at 8 rows,
 * 0.72x at 10, 0.92x at 12, 1.11x at 16 (before block_q_a8 the row path took the int16 kernels: 1.17-1.29x at 8,
 * and this was 8).  AVX-512 (vpdpbusd's byte tile against the int16 row path, which its act8 rows take; bench.linear
 * --act8, the default model's layer shapes, AVX-512 EPYC): the tile's speed over the row path's 0.82x at 8 rows,
 * 0.97x at 9, 0.91x at 10, 1.11x at 12, 1.14x at 13; int8 weights (TILE_MIN8_Q8, AVX-512 only: AVX2 has no byte
 * tile for them) 0.98x at 8, 1.12x at 9, 1.26x at 10 and 12, 1.40x at 13. */
#ifndef TILE_MIN8
#if TS_AVX512
#define TILE_MIN8 12
#else
#define TILE_MIN8 14
#endif
#endif
#ifndef TILE_MIN8_Q8
#define TILE_MIN8_Q8 9
#endif

/* Batch rows from which int5 weights with int8 activations take the byte tile (their row path takes the int16
 * kernels over the int8 values: the tile at 8 rows 1.18x their speed on the 360M shape's Q5_0 layers). */
#ifndef TILE_MIN5_A8
#if TS_AVX512
#define TILE_MIN5_A8 TILE_MIN
#else
#define TILE_MIN5_A8 8
#endif
#endif

/* Batch rows from which int6 weights take the tiled path: their widening (the codes rebuilt from nibbles and high
 * bits, multiplied by the sub-scales) is shared by every batch row there, on the row path only by its rows.
 * ts_linear on 1.7B-shaped int6 layers, 2 threads, AVX2 EPYC: the tile's time over the row path's 0.99x at 8 rows,
 * 0.80x at 12, 0.75x at 15 (from 4 rows: 1.57x at 4, 1.20x at 6).  AVX-512 (block_q6_512 against the int16 tile,
 * which pads to 16 rows; an 8192 x 2048 int6 linear from memory, 2 threads, AVX-512 EPYC): the tile's time over the
 * row path's 1.08x at 9 rows, 0.79x at 10, 0.72x at 11; with int8 activations (TILE_MIN6_A8: both byte kernels,
 * tile_group6_512) 1.13x at 9, 0.96-1.03x at 10, 0.81x at 11, 0.84x at 12. */
#ifndef TILE_MIN6
#if TS_AVX512
#define TILE_MIN6 10
#else
#define TILE_MIN6 8
#endif
#endif
#ifndef TILE_MIN6_A8
#if TS_AVX512
#define TILE_MIN6_A8 11
#else
#define TILE_MIN6_A8 TILE_MIN6
#endif
#endif

/* TW: batch rows per vector of the tiled path (eight int32 lanes with AVX2, sixteen with AVX-512). */
#if TS_AVX512
#define TW 16
#else
#define TW 8
#endif

/* Tiled layout: pair t (columns 2t, 2t+1) of group g of batch row m, as an int32 index into q.  Per group, per TW
 * batch rows, the 16 pairs of the TW rows: one contiguous run (512 or 1024 bytes) that a tile reads front to back. */
static inline int64_t tiled(int64_t g, int t, int64_t m, int64_t mp) {
    return g * 16 * mp + (m / TW) * (16 * TW) + t * TW + (m % TW);
}

/* int8 tiled layout: quad t (0..7: columns 4t..4t+3) of group g of batch row m, as an int32 index into q8.  Per
 * group and quad, every batch row's four bytes in a row: the eight rows of a tile's vector are 32 contiguous bytes. */
static inline int64_t tiled8(int64_t g, int t, int64_t m, int64_t mp) { return (g * 8 + t) * mp + m; }

/* The row8 layout of int8 activations (the row path, block_q_a8): a pair of groups' 64 bytes in the order
 * block_q_a8's byte shuffles make of an int4 row's 32 bytes, low nibbles [c0..7, c32..39 | c8..15, c40..47]
 * then high nibbles [c16..23, c48..55 | c24..31, c56..63], so that each product pairs a code with its own
 * column: column c of the pair (group c / 32) at byte (q / 2) * 32 + (q % 2) * 16 + (c / 32) * 8 + c % 8,
 * q = (c % 32) / 8. */

/* x [M, K] -> a: per row and group of 32 columns, a scale d, the float sum s and codes round(x / d), |code| <= L
 * (L = 32767; 16383 for a linear holding Q6 weights (narrow: see Q6); 127 with act8).  Tiled (M >= tile_min) the
 * codes go to the tiled layouts (int16, and with act8 also the int8 one). */
static inline void tr8x8(__m256 v[8], __m256 t[8]);

/* dst[t * TW + i] = blk[i][t] (t < 16, i < TW): TW batch rows' 16 pairs of one group into their run of the tiled
 * layout, through register transposes (16 x 16 with AVX-512, two 8 x 8 with AVX2) and whole-vector stores.  Each pair
 * stored on its own (16 strided 4-byte stores per row and group) had quantize_act at ~1/3 more time (perf of the
 * default model's 64-row step in process: 10% of the int4 tile's samples, now 6.6%); the step 0.986-0.996x. */
static inline void store_tiled(int32_t blk[TW][16], int32_t *dst) {
#if TS_AVX512
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(blk[i]);
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: rows i, i + 1 interleaved */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int b = 0; b < 16; b += 4) { /* r[b + c]: rows b..b+3 of pairs c, c + 4, c + 8, c + 12 (lane by lane) */
        r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int c = 0; c < 4; c++) {
        /* lanes 0, 2 (v0, w0) and 1, 3 (v1, w1) of rows 0..7 and 8..15, then those lanes' halves together */
        const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        _mm512_storeu_si512(dst + 16 * c, _mm512_shuffle_i32x4(v0, w0, 0x88));
        _mm512_storeu_si512(dst + 16 * (c + 8), _mm512_shuffle_i32x4(v0, w0, 0xDD));
        _mm512_storeu_si512(dst + 16 * (c + 4), _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_storeu_si512(dst + 16 * (c + 12), _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
#else
    for (int h = 0; h < 16; h += 8) {
        __m256 v[8], t[8];
        for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps((const float *)blk[i] + h);
        tr8x8(v, t);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps((float *)dst + (h + j) * 8, t[j]);
    }
#endif
}

static void quantize_act(const float *x, int64_t ldx, int64_t M, int64_t K, ts_qact *a, int64_t act8,
                         int64_t tile_min, int narrow) {
    const int64_t G = K / 32, mp = M >= tile_min ? (M + TW - 1) / TW * TW : 0;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const float L = act8 ? 127.0f : narrow ? 16383.0f : 32767.0f;
    a->mp = mp;
    a->act8 = act8;
    /* tiled: TW batch rows at a time per group (their codes meet in blk, then go to the layout together) */
    const int64_t step = mp ? TW : 1;
    for (int64_t m0 = 0; m0 < (mp ? mp : M); m0 += step)
        for (int64_t g = 0; g < G; g++) {
            int32_t blk[TW][16];
            for (int64_t m = m0; m < m0 + step; m++) {
                if (m >= M) { /* tiled padding row */
                    a->d[g * mp + m] = a->s[g * mp + m] = 0.0f;
                    memset(blk[m - m0], 0, sizeof blk[0]);
                    if (act8)
                        for (int t = 0; t < 8; t++) ((int32_t *)a->q8)[tiled8(g, t, m, mp)] = 0;
                    if (act8 && TS_AVX512) a->q8s[g * mp + m] = 0;
                    if (act8 && narrow) a->q6t[2 * g * mp + m] = a->q6t[(2 * g + 1) * mp + m] = 0;
                    continue;
                }
                const float *p = x + m * ldx + g * 32;
                __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
                for (int j = 0; j < 4; j++) {
                    v[j] = _mm256_loadu_ps(p + 8 * j);
                    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
                    sm = _mm256_add_ps(sm, v[j]);
                }
                const float amax = hmax8(mx);
                const int64_t i = mp ? g * mp + m : m * G + g;
                a->d[i] = amax / L;
                a->s[i] = hsum8(sm);
                const __m256 mul = _mm256_set1_ps(amax > 0 ? L / amax : 0.0f);
                int16_t row[32], *q = mp ? row : a->q + m * K + g * 32;
                for (int j = 0; j < 4; j += 2) {
                    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], mul));
                    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], mul));
                    /* vpackssdw works per 128-bit lane: the permute restores the element order */
                    _mm256_storeu_si256((__m256i *)(q + 8 * j),
                                        _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
                }
                if (mp) memcpy(blk[m - m0], row, sizeof blk[0]); /* the group's 16 pairs of columns */
                if (TS_AVX512 && narrow && !mp) { /* block_q6_512's bytes (see ts_qact) */
                    const __m256i c0 = _mm256_loadu_si256((const __m256i *)q);
                    const __m256i c1 = _mm256_loadu_si256((const __m256i *)(q + 16));
                    const int64_t i8 = (m * (G / 2) + g / 2) * 64 + (g % 2) * 32;
                    /* (vpacksswb per 128-bit lane: the permute restores the column order; both parts fit a byte) */
                    const __m256i k7 = _mm256_set1_epi16(act8 ? -1 : 127);
                    const __m256i lo = _mm256_packs_epi16(_mm256_and_si256(c0, k7), _mm256_and_si256(c1, k7));
                    _mm256_storeu_si256((__m256i *)(a->q8 + i8), _mm256_permute4x64_epi64(lo, 0xD8));
                    if (!act8) {
                        const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(c0, 7), _mm256_srai_epi16(c1, 7));
                        _mm256_storeu_si256((__m256i *)(a->q8h + i8), _mm256_permute4x64_epi64(hi, 0xD8));
                    }
                    const __m256i one = _mm256_set1_epi16(1);
                    a->q6o[i8 / 16] = 32 * hsum8i(_mm256_madd_epi16(c0, one));
                    a->q6o[i8 / 16 + 1] = 32 * hsum8i(_mm256_madd_epi16(c1, one));
                }
                /* and as bytes (|code| <= 127: the narrowing is exact); the AVX-512 row path has no byte layout but
                 * block_q6_512's above (its other kernels take a->q) */
                if (act8 && (mp || !TS_AVX512)) {
                    /* per 128-bit lane: [columns 0..7, 16..23 | 8..15, 24..31] */
                    const __m256i b = _mm256_packs_epi16(_mm256_loadu_si256((const __m256i *)q),
                                                         _mm256_loadu_si256((const __m256i *)(q + 16)));
                    const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
                    if (!mp) { /* the row8 layout: eight columns of this group every 16 bytes */
                        int8_t *o = a->q8 + (m * ((G + 1) / 2) + g / 2) * 64 + (g % 2) * 8;
                        _mm_storel_epi64((__m128i *)o, b0);                              /* columns 0..7 */
                        _mm_storel_epi64((__m128i *)(o + 16), b1);                       /* 8..15 */
                        _mm_storel_epi64((__m128i *)(o + 32), _mm_unpackhi_epi64(b0, b0)); /* 16..23 */
                        _mm_storel_epi64((__m128i *)(o + 48), _mm_unpackhi_epi64(b1, b1)); /* 24..31 */
                        if (g % 2 == 0 && g + 1 == G) /* a lone last group: its pair's other half is zero */
                            for (int j = 0; j < 4; j++) memset(o + 16 * j + 8, 0, 8);
                    } else { /* the tiled layout (tile_group8): quad t (columns 4t..4t+3) of each group */
                        int32_t cols[8];
                        _mm256_storeu_si256((__m256i *)cols, _mm256_permute4x64_epi64(b, 0xD8)); /* columns in order */
                        for (int t = 0; t < 8; t++) ((int32_t *)a->q8)[tiled8(g, t, m, mp)] = cols[t];
                        if (TS_AVX512) {
                            int32_t sum = 0, half = 0;
                            for (int j = 0; j < 32; j++) sum += q[j], half += j < 16 ? q[j] : 0;
                            a->q8s[g * mp + m] = 128 * sum;
                            if (narrow)
                                a->q6t[2 * g * mp + m] = -32 * half, a->q6t[(2 * g + 1) * mp + m] = -32 * (sum - half);
                        } else if (narrow) /* (|.| <= 32 x 8 x 127: int16) */
                            for (int j = 0; j < 2; j++) {
                                int32_t s0 = 0, s1 = 0;
                                for (int k = 16 * j; k < 16 * j + 16; k += 4) s0 += q[k] + q[k + 1], s1 += q[k + 2] + q[k + 3];
                                a->q6t[(2 * g + j) * mp + m] = (int32_t)((uint32_t)(uint16_t)(int16_t)(-32 * s0) |
                                                                         (uint32_t)(uint16_t)(int16_t)(-32 * s1) << 16);
                            }
                    }
                }
            }
            if (mp) store_tiled(blk, (int32_t *)a->q + tiled(g, 0, m0, mp));
        }
}

/* Q8: one weight row's 32 codes of a group widened to int16, elements 0..15 in *lo and 16..31 in *hi. */
static inline void widen_q8(const uint8_t *c, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
}

/* Q4: quarter i (0..3) of a row's 32-byte pair of groups as sixteen int16 codes: 0, 1 = columns 0..15, 16..31 of the
 * pair's first group, 2, 3 = those of its second (16-bit word j holds columns j, 16+j, 32+j, 48+j in its nibbles,
 * low to high; see widen_group).  i is a literal at every call: one or two instructions. */
static inline __attribute__((always_inline)) __m256i q4_quarter(__m256i raw, const int i) {
    const __m256i nib = _mm256_set1_epi16(0x000F);
    if (i == 3) return _mm256_srli_epi16(raw, 12);
    return _mm256_and_si256(i ? _mm256_srli_epi16(raw, 4 * i) : raw, nib);
}

#ifndef PF256
#define PF256 2048 /* software prefetch distance of the AVX2 row path, bytes of codes ahead */
#endif

/* Both cache lines of the 128 bytes a row-path step reads (one group of Q8, a pair of groups of Q4): prefetching
 * only the first (the AVX2 path until 2026-11-26) left every other line to the hardware prefetcher, and at one
 * batch row the step then waited on memory.  Both lines 2048 bytes ahead: ts_linear on 1.7B-shaped layers at one
 * row (2 threads, interleaved) int4 1.19-1.25x, int8 1.05-1.16x (1024-3072 bytes and the T1 hint within noise). */
static inline void prefetch2(const uint8_t *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T0);
    _mm_prefetch((const char *)(p + 64), _MM_HINT_T0);
}

#define MT 64 /* batch rows per pass: their accumulators live on the stack */

/* Bytes of codes per block of four weight rows (Q8: a byte per weight; Q4: pairs of groups, 32 bytes per row each;
 * Q5: triples of groups, 64 bytes per row each; Q6: pairs of groups, 208 bytes a block each). */
static inline int64_t block_bytes(int64_t wt, int64_t K) {
    const int64_t G = K / 32;
    return wt == WT_Q8 ? G * 4 * 32 : wt == WT_Q5 ? (G + 2) / 3 * 4 * 64 : wt == WT_Q6 ? G / 2 * 208 : (G + 1) / 2 * 4 * 32;
}

/* ---- Q6 (int6: a GGUF file's Q6_K, its values exactly) ----
 * Pairs of groups (K % 64 == 0), 208 bytes per block of four rows ([N/4][K/64][208]): row r's 48 bytes at 48 r, 32
 * of low nibbles (byte t: column t low, 32 + t high) and 16 of the high two bits (byte t: columns t, 16 + t, 32 + t,
 * 48 + t in bits 0-1, 2-3, 4-5, 6-7), then the sixteen int8 sub-scales (Q6_K's per 16 columns) at 192 + 4 i + r
 * (quarter i = columns 16i..16i+15 of row r).  Byte operations rebuild 32 codes per instruction (q - 32 as int8:
 * nibbles masked in place, high bits moved by a per-lane variable shift), one vpmovsxbw each 16 to int16.  Scaled
 * by the sub-scale (sub * (q - 32): |.| <= 128 * 32 = 4096) it is Q8's int16 arithmetic with the group's scale =
 * Q6_K's float16 d (stored per group); the one-row kernel instead scales each quarter's dot in float (block_q1).
 * 7 bits a weight (Q6_K: 6.56; d is stored per group) where the int8 it was converted to before took 8.5 and
 * re-rounded every weight.
 * A group's 32 products can reach 32 * 4096 * 32767 > 2^31: the activations of a linear with Q6 weights are
 * rounded to +-16383 instead (quantize_act), 32 * 4096 * 16383 < 2^31. */
typedef struct {
    __m256i qa, qb; /* q - 32 as int8: columns 0..31, 32..63 */
    __m256i sv;     /* the row's four sub-scales as int16, repeated in every 64 bits */
} q6_row;

/* row r's 64 codes q (0..63) as bytes: columns 0..31 in *qa, 32..63 in *qb */
static inline __attribute__((always_inline)) void q6_codes(const uint8_t *pair, int r, __m256i *qa, __m256i *qb) {
    const uint8_t *c = pair + r * 48;
    const __m256i raw = _mm256_loadu_si256((const __m256i *)c);
    const __m256i hb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(c + 32)));
    const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    /* columns 0..15 take bits 0-1 of hb to 4-5, 16..31 bits 2-3; 32..47 bits 4-5 as they are, 48..63 bits 6-7 (what
     * crosses into a neighbouring byte lands outside 4-5 and is masked off) */
    const __m256i ha = _mm256_and_si256(_mm256_sllv_epi32(hb, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), two);
    const __m256i hbb = _mm256_and_si256(_mm256_srlv_epi32(hb, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), two);
    *qa = _mm256_or_si256(_mm256_and_si256(raw, nib), ha);
    *qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib), hbb);
}

static inline __attribute__((always_inline)) q6_row q6_load(const uint8_t *pair, int r) {
    const __m256i off = _mm256_set1_epi8(32);
    const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), _mm_set1_epi8((char)r));
    __m256i qa, qb;
    q6_codes(pair, r, &qa, &qb);
    return (q6_row){_mm256_sub_epi8(qa, off), _mm256_sub_epi8(qb, off),
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(pair + 192)), pick))};
}

/* quarter i (0..3, a literal: columns 16i..16i+15 of the pair) of a row as int16 q - 32 */
static inline __attribute__((always_inline)) __m256i q6_quarter(q6_row q, const int i) {
    const __m256i v = i < 2 ? q.qa : q.qb;
    return _mm256_cvtepi8_epi16(i % 2 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
}

/* ... times its sub-scale (a set1 from the byte took three instructions where this shuffle takes one) */
static inline __attribute__((always_inline)) __m256i q6_scaled(q6_row q, const int i) {
    return _mm256_mullo_epi16(q6_quarter(q, i), _mm256_shuffle_epi8(q.sv, _mm256_set1_epi16((short)(2 * i | (2 * i + 1) << 8))));
}

/* row r of the pair's four quarters as int16 sub * (q - 32) */
static inline __attribute__((always_inline)) void q6_row_scaled(const uint8_t *pair, int r, __m256i w[4]) {
    const q6_row q = q6_load(pair, r);
    w[0] = q6_scaled(q, 0), w[1] = q6_scaled(q, 1), w[2] = q6_scaled(q, 2), w[3] = q6_scaled(q, 3);
}

/* the next pairs' 208 bytes of a block */
static inline void q6_prefetch(const uint8_t *p) {
    prefetch2(p);
    prefetch2(p + 128);
}

/* ---- Q5 (int5: a GGUF file's Q5_0 / Q5_1 / Q5_K) on the row path ----
 * Codes in triples of groups: a row's 96 codes of groups 3t..3t+2 are 64 bytes, two halves of sixteen 16-bit words;
 * word j of half h holds the codes of the triple's columns 48h + j, 48h + 16 + j and 48h + 32 + j in bits 0-4, 5-9
 * and 10-14 (models/quantize.py), so widening 16 of them to int16 is a mask, a shift and a mask, or a shift: as
 * cheap as Q4's nibbles, for 5.33 bits a code.  (A plane of fifth bits beside Q4's nibbles, 5 bits a code, took
 * three more instructions per 16 codes to merge them: at one batch row, 2 threads, 1.2-1.4x Q4's time per weight;
 * this layout ~1.0-1.1x.)  Scales and minimums as Q4's.  The AVX-512 build runs these AVX2 kernels too. */

/* third s (0..2) of a half (sixteen words) as int16 codes; s a literal */
static inline __attribute__((always_inline)) __m256i q5_third(__m256i v, const int s) {
    if (s == 2) return _mm256_srli_epi16(v, 10);
    return _mm256_and_si256(s ? _mm256_srli_epi16(v, 5) : v, _mm256_set1_epi16(0x1F));
}

/* group i (0..2, a literal) of a row's triple (halves A, B): columns 0..15 in *l, 16..31 in *h */
static inline __attribute__((always_inline)) void q5_group(__m256i A, __m256i B, const int i, __m256i *l, __m256i *h) {
    if (i == 0) { *l = q5_third(A, 0); *h = q5_third(A, 1); }
    else if (i == 1) { *l = q5_third(A, 2); *h = q5_third(B, 0); }
    else { *l = q5_third(B, 1); *h = q5_third(B, 2); }
}

/* group i (0..2, at run time) of the row triple at c */
static inline void q5_group_at(const uint8_t *c, int64_t i, __m256i *l, __m256i *h) {
    const __m256i A = _mm256_loadu_si256((const __m256i *)c), B = _mm256_loadu_si256((const __m256i *)(c + 32));
    if (i == 0) q5_group(A, B, 0, l, h);
    else if (i == 1) q5_group(A, B, 1, l, h);
    else q5_group(A, B, 2, l, h);
}

/* groups g0..g1 (g1 - g0 <= CG) of row r of an int5 block (codes: the block's) as int16 codes in l[g - g0], h[g - g0]:
 * whole triples from two loads where the range holds them, a short triple's groups one at a time */
static inline void q5_widen_row(const uint8_t *codes, int r, int64_t g0, int64_t g1, __m256i *l, __m256i *h) {
    for (int64_t g = g0; g < g1;) {
        const uint8_t *c = codes + ((g / 3) * 4 + r) * 64;
        const int64_t i = g - g0;
        if (g % 3 == 0 && g + 3 <= g1) {
            const __m256i A = _mm256_loadu_si256((const __m256i *)c), B = _mm256_loadu_si256((const __m256i *)(c + 32));
            q5_group(A, B, 0, &l[i], &h[i]);
            q5_group(A, B, 1, &l[i + 1], &h[i + 1]);
            q5_group(A, B, 2, &l[i + 2], &h[i + 2]);
            g += 3;
        } else {
            q5_group_at(c, g % 3, &l[i], &h[i]);
            g++;
        }
    }
}

/* Row r of a block's group g as int16 codes (columns 0..15 in *l, 16..31 in *h), for any quantized format (codes:
 * the block's).  Q4 codes come in pairs of groups: a row's 64 codes of groups 2p and 2p+1 are 32 bytes whose 16-bit
 * word j holds the codes of columns j, 16+j, 32+j and 48+j in its four nibbles (models/quantize.py), so widening
 * them to int16 is a shift and a mask per 16 codes, with no byte-to-word conversion (at one batch row: ~5-10%
 * faster than 16 bytes per group widened with vpmovzxbw). */
static inline __attribute__((always_inline)) void widen_group(const uint8_t *codes, const int wt, int64_t g,
                                                             const int odd, int r, __m256i *l, __m256i *h) {
    if (wt == WT_Q8) widen_q8(codes + (g * 4 + r) * 32, l, h);
    else if (wt == WT_Q5) q5_group_at(codes + ((g / 3) * 4 + r) * 64, g % 3, l, h);
    else if (wt == WT_Q6) {
        const uint8_t *c = codes + g / 2 * 208;
        const q6_row q = q6_load(c, r);
        *l = odd ? q6_scaled(q, 2) : q6_scaled(q, 0);
        *h = odd ? q6_scaled(q, 3) : q6_scaled(q, 1);
    } else { /* odd: g % 2, a literal where the caller knows it (the quarters' shifts are then literals too) */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + (g / 2 * 4 + r) * 32));
        *l = odd ? q4_quarter(raw, 2) : q4_quarter(raw, 0);
        *h = odd ? q4_quarter(raw, 3) : q4_quarter(raw, 1);
    }
}

/* ---- the row path (1 to TILE_MIN - 1 batch rows) ----
 * Per block of four weight rows, groups are taken in pairs: groups g and g+1 are reduced together into one vector
 * [g: rows 0..3 | g+1: rows 0..3], so one conversion and one FMA scale both (their eight float16 scales, and Q4's
 * eight minimums, are one load each: [G][4] is contiguous).  Reducing each group's four rows on their own took ~40%
 * of the instructions per group at one batch row; pairing them: ts_linear on 1.7B-shaped layers (2 threads, one
 * row) int4 1.2-1.3x, int8 1.0-1.2x (closer to its memory bound).
 *
 * One summation order (batch invariance): a row's result should not depend on how many batch rows share the call,
 * since that picks the path (block_q1 at one row, block_q or block_q_inv below TILE_MIN, the tiled path from
 * there).  block_q1, block_q_inv and the AVX2 tiled path compute, per output: each group's exact int32 dot product,
 * converted to float once (D_g); four chains in ascending g, E = fma(D_g, ws_g * dx_g, E) over the even groups, O
 * the same over the odd ones, and (Q4, Q5) EM = fma(min_g, sx_g, EM) over the even groups, OM over the odd ones;
 * the output is (E + EM) + (O + OM).  Here E | O and EM | OM are the 128-bit halves of two accumulators (the min
 * term on its own chain: on the dot products' chain, two dependent FMAs per pair of groups made the one-row int4
 * kernel 5-8% slower); the tiled path keeps E and O in two buffers and adds the minimums' chains at the end of a
 * pass (tile_finish).  The default build's block_q keeps a faster order of its own (see it), the batch-invariant
 * build takes block_q_inv; the AVX-512 build's own kernels keep their orders and are not batch-invariant. */
static inline __m256i dot_rows(__m256i l, __m256i h, __m256i x0, __m256i x1) {
    return _mm256_add_epi32(_mm256_madd_epi16(l, x0), _mm256_madd_epi16(h, x1));
}

/* four rows' int32 dot vectors -> [rows 0..3 over lanes 0..3 | rows 0..3 over lanes 4..7] (unpack + add:
 * single-uop instructions, where each vphaddd is several) */
static inline __m256i rows4(const __m256i d[4]) {
#define PAIR32(u, v) _mm256_add_epi32(_mm256_unpacklo_epi32(u, v), _mm256_unpackhi_epi32(u, v))
    const __m256i d01 = PAIR32(d[0], d[1]), d23 = PAIR32(d[2], d[3]);
#undef PAIR32
    return _mm256_add_epi32(_mm256_unpacklo_epi64(d01, d23), _mm256_unpackhi_epi64(d01, d23));
}

/* rows 0..3 of group A (a[r]) and of group B (b[r]) -> float [A: row 0..3 | B: row 0..3], each the conversion of
 * the group's whole int32 dot (as the tiled path converts it: int8 codes' sums can exceed float's 24 bits) */
static inline __m256 sum4x2(const __m256i a[4], const __m256i b[4]) {
    const __m256i ra = rows4(a), rb = rows4(b);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(ra, rb, 0x20),
                                               _mm256_permute2x128_si256(ra, rb, 0x31)));
}

/* Four scales (float16) of one block and group, duplicated into both 128-bit halves. */
static inline __m256 scales4(const uint16_t *s) {
    const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)s));
    return _mm256_set_m128(v, v);
}

/* [p[0] x 4 | p[1] x 4]: the float of groups g and g + 1 (activation scales or sums) for their rows' lanes */
static inline __m256 pair_bcast(const float *p) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p))),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* acc [E | O] += groups g, g + 1 (A: group g's four rows' dots, B: group g + 1's) scaled by their weight scales (sc)
 * and the activations' (dx); accm [EM | OM] += their minimums (mn, NULL: none) times the activations' group sums (sx) */
static inline __attribute__((always_inline)) void scale_pair(__m256 *acc, __m256 *accm, const __m256i A[4],
                                                             const __m256i B[4], const uint16_t *sc, const uint16_t *mn,
                                                             const float *dx, const float *sx, int64_t g) {
    if (mn) *accm = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g * 4))), pair_bcast(sx + g), *accm);
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * 4)));
    *acc = _mm256_fmadd_ps(sum4x2(A, B), _mm256_mul_ps(ws, pair_bcast(dx + g)), *acc);
}

/* four rows' int32 dots of one group -> their floats (the group's whole sums) */
static inline __m128 sum4x1(const __m256i D[4]) {
    const __m256i r = rows4(D);
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* e (E or O) += group g's dots (D) scaled, em (EM or OM) += its minimums' term, as scale_pair does for a pair */
static inline __attribute__((always_inline)) void scale_one(__m128 *e, __m128 *em, const __m256i D[4],
                                                            const uint16_t *sc, const uint16_t *mn, float dx, float sx,
                                                            int64_t g) {
    if (mn) *em = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(mn + g * 4))), _mm_set1_ps(sx), *em);
    const __m128 ws = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + g * 4)));
    *e = _mm_fmadd_ps(sum4x1(D), _mm_mul_ps(ws, _mm_set1_ps(dx)), *e);
}

/* out[0..3] = (E + EM) + (O + OM) */
static inline void store_eo(__m256 acc, __m256 accm, float *out) {
    const __m256 v = _mm256_add_ps(acc, accm);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

/* the four rows' dots of block group g (codes: the block's) . batch row m, int16 activations */
static inline __attribute__((always_inline)) void group_dots(__m256i D[4], const uint8_t *codes, const int wt,
                                                             const ts_qact *a, int64_t m, int64_t K, int64_t g) {
    const int16_t *x = a->q + m * K + g * 32;
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
    for (int r = 0; r < 4; r++) {
        __m256i l, h;
        widen_group(codes, wt, g, (int)(g % 2), r, &l, &h);
        D[r] = dot_rows(l, h, x0, x1);
    }
}

/* acc, accm += the block's lone last group g (G odd, so g is even: E and EM, the low halves) . batch row m */
static inline __attribute__((always_inline)) void lone_group(__m256 *acc, __m256 *accm, const uint8_t *codes,
                                                             const int wt, const uint16_t *sc, const uint16_t *mn,
                                                             const ts_qact *a, int64_t m, int64_t K, int64_t g) {
    __m256i D[4];
    group_dots(D, codes, wt, a, m, K, g);
    __m128 e = _mm256_castps256_ps128(*acc), em = _mm256_castps256_ps128(*accm);
    scale_one(&e, &em, D, sc, mn, a->d[m * (K / 32) + g], a->s[m * (K / 32) + g], g);
    *acc = _mm256_insertf128_ps(*acc, e, 0);
    *accm = _mm256_insertf128_ps(*accm, em, 0);
}

/* out[0..3] = rows of block b . batch row m (what block_q computes with mt = 1). */
static inline __attribute__((always_inline)) void block_q1(const ts_weight *W, const int wt, int64_t b, int64_t K,
                                                           const ts_qact *a, int64_t m, float *out) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = HAS_MIN(wt) ? W->min + b * G * 4 : NULL;
    const int16_t *xq = a->q + m * K;
    const float *dx = a->d + m * G, *sx = a->s + m * G;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(wt, K);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    __m256i A[4], B[4];
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
        const int16_t *x = xq + g * 32;
        const __m256i xa0 = _mm256_loadu_si256((const __m256i *)x), xa1 = _mm256_loadu_si256((const __m256i *)(x + 16));
        const __m256i xb0 = _mm256_loadu_si256((const __m256i *)(x + 32)), xb1 = _mm256_loadu_si256((const __m256i *)(x + 48));
        if (wt == WT_Q8) { /* groups g, g + 1: 128 bytes each */
            const uint8_t *c = codes + g * 4 * 32;
            prefetch2(c + PF256);
            prefetch2(c + 128 + PF256);
            for (int r = 0; r < 4; r++) {
                __m256i lo, hi;
                widen_q8(c + r * 32, &lo, &hi);
                A[r] = dot_rows(lo, hi, xa0, xa1);
                widen_q8(c + 128 + r * 32, &lo, &hi);
                B[r] = dot_rows(lo, hi, xb0, xb1);
            }
        } else if (wt == WT_Q6 && !TS_BATCH_INVARIANT) {
            /* each quarter's dot on its own, scaled in float by its sub-scale: the sub-scales' vpmullw per 16
             * codes made this kernel compute-bound (ts_linear at one row 1.3x int8's time for 0.82x the bytes) */
            const uint8_t *c = codes + g / 2 * 208;
            q6_prefetch(c + PF256);
            __m256i A1[4], B1[4];
            for (int r = 0; r < 4; r++) {
                const q6_row q = q6_load(c, r);
                A[r] = _mm256_madd_epi16(q6_quarter(q, 0), xa0);
                A1[r] = _mm256_madd_epi16(q6_quarter(q, 1), xa1);
                B[r] = _mm256_madd_epi16(q6_quarter(q, 2), xb0);
                B1[r] = _mm256_madd_epi16(q6_quarter(q, 3), xb1);
            }
            const __m128i sb = _mm_loadu_si128((const __m128i *)(c + 192)); /* [quarter][row] */
            const __m256 ws = scales4(sc + g * 4); /* (both groups': one d) */
            const __m256 s01 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sb)), ws);
            const __m256 s23 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sb, 8))), ws);
            acc = _mm256_fmadd_ps(sum4x2(A, A1), _mm256_mul_ps(s01, _mm256_set1_ps(dx[g])), acc);
            acc = _mm256_fmadd_ps(sum4x2(B, B1), _mm256_mul_ps(s23, _mm256_set1_ps(dx[g + 1])), acc);
            continue;
        } else if (wt == WT_Q6) { /* (the batch-invariant build: sub-scales in the codes, block_q_inv's order) */
            const uint8_t *c = codes + g / 2 * 208;
            q6_prefetch(c + PF256);
            for (int r = 0; r < 4; r++) {
                const q6_row q = q6_load(c, r);
                A[r] = dot_rows(q6_scaled(q, 0), q6_scaled(q, 1), xa0, xa1);
                B[r] = dot_rows(q6_scaled(q, 2), q6_scaled(q, 3), xb0, xb1);
            }
        } else { /* the pair of groups g, g + 1: one 32-byte load per row (see widen_group) */
            const uint8_t *c = codes + g / 2 * 4 * 32;
            prefetch2(c + PF256);
            for (int r = 0; r < 4; r++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + r * 32));
                A[r] = dot_rows(q4_quarter(raw, 0), q4_quarter(raw, 1), xa0, xa1);
                B[r] = dot_rows(q4_quarter(raw, 2), q4_quarter(raw, 3), xb0, xb1);
            }
        }
        scale_pair(&acc, &accm, A, B, sc, mn, dx, sx, g);
    }
    if (g < G) lone_group(&acc, &accm, codes, wt, sc, mn, a, m, K, g);
    store_eo(acc, accm, out);
}

/* Four rows' int32 dots of a pair of groups, each [g, g, g+1, g+1 | g, g, g+1, g+1], reduced to [r0: g, g+1, r1: g, g+1 |
 * r2: ..., r3: ...] as float (block_q_a8's order) */
static inline __m256 a8_rows4(const __m256i R[4]) {
    const __m256i t01 = _mm256_hadd_epi32(R[0], R[1]), t23 = _mm256_hadd_epi32(R[2], R[3]);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(t01, t23, 0x20),
                                               _mm256_permute2x128_si256(t01, t23, 0x31)));
}

/* the float16 terms of a pair of groups ([g: r0..3 | g+1: r0..3] from s) in a8_rows4's order */
static inline __m256 a8_terms(const uint16_t *s) {
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)),
                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The row path with int8 activations (act8, AVX2) for int4 and int6 codes, at 1 to MT batch rows (below TILE_MIN8 /
 * TILE_MIN6): per pair of groups, each weight row's 64 codes are put once in the order of the row8 activations
 * (quantize_act), and every batch row multiplies them with two vpmaddubsw.
 * - int4: the nibbles masked in place and their bytes shuffled so that each 128-bit lane holds eight columns of
 *   group g and eight of g + 1; the column pairs' sums (at most 2 x 15 x 127, twice) add in int16 and one vpmaddwd
 *   by ones widens them to [g, g, g+1, g+1] per lane.
 * - int6: the codes rebuilt as unsigned bytes (q6_codes) and their 64-bit halves regrouped (vpunpck{l,h}qdq) to meet
 *   the activations' lanes (the activations' two halves swapped lanes: [c0..7, c32..39 | c16..23, c48..55] and [c8..15,
 *   c40..47 | c24..31, c56..63]), so that every 16-bit lane sums four products of one quarter (lanes 0-3 of a 128-bit
 *   half: quarter 0 / 1, lanes 4-7: quarter 2 / 3).  32 x the activations' pair sums (vpmaddubsw by 32) come off in
 *   int16, leaving the (q - 32) x sums, |.| <= 4 x 32 x 127 (the wrap of the unsigned sums cancels), and one vpmaddwd
 *   by the quarters' sub-scales widens them to [g, g, g+1, g+1] per lane; d is the scale, no min term.
 * Four weight rows then reduce to [r0: g, g+1, r1: g, g+1 | r2 ... r3 ...] (a8_rows4) for one conversion and one FMA
 * per batch row.  At one row ~0.24 vector instructions a weight for int4 where block_q1 takes ~0.33 (no int16 widening
 * of the codes, one multiply per 32 products); int6 there 1.35x the int16 kernels' speed over the same int8 values. */
typedef struct {
    __m256i u, v, sv; /* int4: the shuffled low / high nibbles; int6: the regrouped codes and the sub-scales */
} a8_codes;

/* weight row r of the pair of groups at c in block_q_a8's order */
static inline __attribute__((always_inline)) a8_codes a8_row(const int wt, const uint8_t *c, int r) {
    if (wt == WT_Q6) {
        __m256i qa, qb;
        q6_codes(c, r, &qa, &qb);
        /* the row's sub-scales (c + 192: [quarter][row]) as 16-bit lanes [s0 x 4, s2 x 4 | s1 x 4, s3 x 4] */
        const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 8, 8, 8, 8, 4, 4, 4, 4, 12, 12, 12, 12),
                                          _mm_set1_epi8((char)r));
        return (a8_codes){_mm256_unpacklo_epi64(qa, qb), _mm256_unpackhi_epi64(qa, qb),
                          _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(c + 192)), pick))};
    }
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + r * 32));
    return (a8_codes){_mm256_shuffle_epi8(_mm256_and_si256(raw, nib), split),
                      _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib), split), _mm256_setzero_si256()};
}

typedef struct {
    __m256i l, h, off; /* the pair of groups' two 32-byte halves (int6: lanes swapped), int6: 32 x their pair sums */
} a8_acts;

static inline __attribute__((always_inline)) a8_acts a8_act(const int wt, const int8_t *xq) {
    const __m256i xl = _mm256_loadu_si256((const __m256i *)xq), xh = _mm256_loadu_si256((const __m256i *)(xq + 32));
    if (wt != WT_Q6) return (a8_acts){xl, xh, _mm256_setzero_si256()};
    const __m256i x1 = _mm256_permute2x128_si256(xl, xh, 0x20), x2 = _mm256_permute2x128_si256(xl, xh, 0x31);
    const __m256i k32 = _mm256_set1_epi8(32);
    return (a8_acts){x1, x2, _mm256_add_epi16(_mm256_maddubs_epi16(k32, x1), _mm256_maddubs_epi16(k32, x2))};
}

/* a weight row's int32 dots with a batch row: [g, g, g+1, g+1] per 128-bit lane */
static inline __attribute__((always_inline)) __m256i a8_dot(const int wt, a8_codes w, a8_acts x) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w.u, x.l), _mm256_maddubs_epi16(w.v, x.h));
    return wt == WT_Q6 ? _mm256_madd_epi16(_mm256_sub_epi16(p, x.off), w.sv) : _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void block_q_a8(const ts_weight *W, const int wt, int64_t b, int64_t K,
                                                             const ts_qact *a, int64_t m0, const int64_t mt, float *out) {
    const int64_t G = K / 32, P = (G + 1) / 2, pair = block_bytes(wt, 64);
    const uint16_t *sc = W->scale + b * G * 4, *mn = wt == WT_Q4 ? W->min + b * G * 4 : NULL;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(wt, K);
    __m256 acc[MT], accm[MT];
    for (int64_t m = 0; m < mt; m++) acc[m] = accm[m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
        const uint8_t *c = codes + g / 2 * pair;
        if (wt == WT_Q6) q6_prefetch(c + PF256);
        else prefetch2(c + PF256);
        const __m256 ws = a8_terms(sc + g * 4), wm = wt == WT_Q4 ? a8_terms(mn + g * 4) : _mm256_setzero_ps();
        a8_codes w[4];
        if (mt > 1) /* (one batch row: each weight row's codes go straight into its dots below, in registers) */
            for (int r = 0; r < 4; r++) w[r] = a8_row(wt, c, r);
        for (int64_t m = 0; m < mt; m++) {
            const int64_t i = (m0 + m) * G + g;
            const a8_acts x = a8_act(wt, a->q8 + (m0 + m) * P * 64 + g / 2 * 64);
            __m256i R[4];
            for (int r = 0; r < 4; r++) R[r] = a8_dot(wt, mt > 1 ? w[r] : a8_row(wt, c, r), x);
            const __m256 dxp = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(a->d + i)));
            acc[m] = _mm256_fmadd_ps(a8_rows4(R), _mm256_mul_ps(ws, dxp), acc[m]);
            if (wt == WT_Q4)
                accm[m] = _mm256_fmadd_ps(wm, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(a->s + i))), accm[m]);
        }
    }
    for (int64_t m = 0; m < mt; m++) {
        float t[8], *o = out + m * 4;
        _mm256_storeu_ps(t, _mm256_add_ps(acc[m], accm[m]));
        for (int r = 0; r < 4; r++) o[r] = t[2 * r] + t[2 * r + 1];
        if (g < G) { /* int4's lone last group: the int16 kernels over the same int8 values */
            float lv[4];
            __m256i D[4];
            group_dots(D, codes, WT_Q4, a, m0 + m, K, g);
            __m128 e = _mm_setzero_ps(), em = _mm_setzero_ps();
            scale_one(&e, &em, D, sc, mn, a->d[(m0 + m) * G + g], a->s[(m0 + m) * G + g], g);
            _mm_storeu_ps(lv, _mm_add_ps(e, em));
            for (int r = 0; r < 4; r++) o[r] += lv[r];
        }
    }
}

/* ---- the row path at 2 to TILE_MIN - 1 batch rows: block_q (and block_q_q5), or block_q_inv ----
 * block_q reduces each group's four int32 dot vectors to half sums (lanes r and r + 4: each half of the group's
 * products, converted and scaled on its own) and shares the widened codes across the batch rows: the fastest
 * order at these sizes, but not block_q1's, so a row's result depends on how many rows share the call.  The
 * batch-invariant build (TS_BATCH_INVARIANT, `--batch-invariant`) takes block_q_inv instead, in block_q1's order:
 * ts_linear on 1.7B-shaped layers, 2 threads, 1.1-1.2x block_q's time at 2-15 rows. */
/* The four int32 vectors of partial sums of rows 0..3 -> one float vector: lane r (and r + 4) holds row r's. */
static inline __m256 sum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    /* unpack + add: single-uop instructions, where each vphaddd is several */
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(s0, s1), _mm256_unpackhi_epi32(s0, s1));
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(s2, s3), _mm256_unpackhi_epi32(s2, s3));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23)));
}

/* Four minimums (float16) of one block and group in lanes 0..3 only: sum4's result holds each row twice, and the
 * min term must be added once. */
static inline __m256 mins4(const uint16_t *m) { return _mm256_blend_ps(scales4(m), _mm256_setzero_ps(), 0xF0); }

/* acc[m] += one group (g) of four weight rows, widened to int16 (row r: elements 0..15 in l[r], 16..31 in h[r]),
 * against batch rows m0..m0+mt-1: an integer dot per row and group, one conversion and one or two FMAs. */
static inline __attribute__((always_inline)) void group_rows(__m256 *acc, const ts_qact *a, int64_t g, int64_t G,
                                                             int64_t K, int64_t m0, int64_t mt, __m256 ws, __m256 wm,
                                                             const int wt, const __m256i l[4], const __m256i h[4]) {
    for (int64_t m = 0; m < mt; m++) {
        const int64_t mg = (m0 + m) * G + g;
        const int16_t *xq = a->q + (m0 + m) * K + g * 32;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq), x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
#define DOTQ(r) _mm256_add_epi32(_mm256_madd_epi16(l[r], x0), _mm256_madd_epi16(h[r], x1))
        const __m256 s = sum4(DOTQ(0), DOTQ(1), DOTQ(2), DOTQ(3));
#undef DOTQ
        __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a->d[mg])), ws, acc[m]);
        if (HAS_MIN(wt)) t = _mm256_fmadd_ps(wm, _mm256_set1_ps(a->s[mg]), t);
        acc[m] = t;
    }
}

/* out rows n..n+3 (block b) for batch rows m0..m0+mt-1 from quantized activations.
 * Q4 codes come in pairs of groups: a row's 64 codes of groups 2p and 2p+1 are 32 bytes whose 16-bit word j holds
 * the codes of columns j, 16+j, 32+j and 48+j in its four nibbles (models/quantize.py), so widening them to int16
 * is a shift and a mask per 16 codes, with no byte-to-word conversion (at one batch row, where the widening is not
 * shared by other rows: ~5-10% faster than 16 bytes per group widened with vpmovzxbw). */
static inline __attribute__((always_inline)) void block_q(const ts_weight *W, const int wt, int64_t b, int64_t K,
                                                          const ts_qact *a, int64_t m0, int64_t mt, float *out) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = HAS_MIN(wt) ? W->min + b * G * 4 : NULL;
    __m256 acc[MT];
    __m256i l[4], h[4];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    if (wt == WT_Q8) {
        const uint8_t *codes = (const uint8_t *)W->w + b * G * 4 * 32;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *c = codes + g * 4 * 32;
            prefetch2(c + PF256);
            for (int r = 0; r < 4; r++) widen_q8(c + r * 32, &l[r], &h[r]);
            group_rows(acc, a, g, G, K, m0, mt, scales4(sc + g * 4), _mm256_setzero_ps(), wt, l, h);
        }
    } else if (wt == WT_Q6) { /* per pair of groups: the four rows' sixteen quarters widened once, for both groups
                               * (each row widened again for its odd group: at 4-8 rows 1.4-1.5x int8's time) */
        const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q6, K);
        for (int64_t g = 0; g < G; g += 2) {
            const uint8_t *c = codes + g / 2 * 208;
            q6_prefetch(c + PF256);
            __m256i wv[4][4];
            for (int r = 0; r < 4; r++) q6_row_scaled(c, r, wv[r]);
            for (int r = 0; r < 4; r++) l[r] = wv[r][0], h[r] = wv[r][1];
            group_rows(acc, a, g, G, K, m0, mt, scales4(sc + g * 4), _mm256_setzero_ps(), wt, l, h);
            for (int r = 0; r < 4; r++) l[r] = wv[r][2], h[r] = wv[r][3];
            group_rows(acc, a, g + 1, G, K, m0, mt, scales4(sc + (g + 1) * 4), _mm256_setzero_ps(), wt, l, h);
        }
    } else {
        const int64_t P = (G + 1) / 2;
        const uint8_t *codes = (const uint8_t *)W->w + b * P * 4 * 32;
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *c = codes + p * 4 * 32;
            prefetch2(c + PF256);
            __m256i raw[4];
            for (int r = 0; r < 4; r++) {
                raw[r] = _mm256_loadu_si256((const __m256i *)(c + r * 32));
                l[r] = q4_quarter(raw[r], 0);
                h[r] = q4_quarter(raw[r], 1);
            }
            int64_t g = 2 * p;
            /* the min term only in lanes 0..3: the sum4 result holds each row twice */
            __m256 wm = mins4(mn + g * 4);
            group_rows(acc, a, g, G, K, m0, mt, scales4(sc + g * 4), wm, wt, l, h);
            if (++g == G) break;
            for (int r = 0; r < 4; r++) {
                l[r] = q4_quarter(raw[r], 2);
                h[r] = q4_quarter(raw[r], 3);
            }
            wm = mins4(mn + g * 4);
            group_rows(acc, a, g, G, K, m0, mt, scales4(sc + g * 4), wm, wt, l, h);
        }
    }
    for (int64_t m = 0; m < mt; m++) {
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        _mm_storeu_ps(out + m * 4, r);
    }
}

/* block_q for Q5: per triple, its three groups widened and passed to group_rows */
static inline __attribute__((always_inline)) void block_q_q5(const ts_weight *W, int64_t b, int64_t K, const ts_qact *a,
                                                             int64_t m0, int64_t mt, float *out) {
    const int64_t G = K / 32, T = (G + 2) / 3;
    const uint16_t *sc = W->scale + b * G * 4, *mn = W->min + b * G * 4;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q5, K);
    __m256 acc[MT];
    __m256i A[4], B[4], l[4], h[4];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *c = codes + t * 4 * 64;
        prefetch2(c + PF256);
        prefetch2(c + 128 + PF256);
        for (int r = 0; r < 4; r++) {
            A[r] = _mm256_loadu_si256((const __m256i *)(c + r * 64));
            B[r] = _mm256_loadu_si256((const __m256i *)(c + r * 64 + 32));
        }
#define Q5_GROUP(i)                                                                                                  \
    {                                                                                                                \
        const int64_t g = 3 * t + (i);                                                                               \
        if (g < G) {                                                                                                 \
            for (int r = 0; r < 4; r++) q5_group(A[r], B[r], i, &l[r], &h[r]);                                       \
            group_rows(acc, a, g, G, K, m0, mt, scales4(sc + g * 4),                                                  \
                       mins4(mn + g * 4), WT_Q5, l, h);                                                                  \
        }                                                                                                            \
    }
        Q5_GROUP(0) Q5_GROUP(1) Q5_GROUP(2)
#undef Q5_GROUP
    }
    for (int64_t m = 0; m < mt; m++) {
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        _mm_storeu_ps(out + m * 4, r);
    }
}

/* block_q_inv's work for group g (of parity par, a literal): its codes widened once (eight vectors, in registers) for
 * all the rows, then per pair of batch rows their dots' sums as one vector [row m: rows 0..3 | row m + 1: ...]
 * (sum4x2's reduction across two batch rows instead of two groups), one conversion and one FMA into the pair's E
 * (par 0) or O (acc), and the minimums' term into its EM or OM (accm, mn: NULL for none); an odd last batch row on
 * its own (128 bits: last, lastm). */
static inline __attribute__((always_inline)) void block_q_inv_group(const uint8_t *codes, const int wt, const uint16_t *sc,
                                                                const uint16_t *mn, const ts_qact *a, int64_t m0,
                                                                int64_t mt, int64_t K, int64_t g, const int par,
                                                                __m256 *acc, __m256 *accm, __m128 *last, __m128 *lastm) {
    const int64_t G = K / 32;
    /* this group's codes and the next ones' (Q8: 128 bytes a group; Q4: 128 a pair; Q5: 256 a triple) */
    if (wt == WT_Q8) prefetch2(codes + g * 128 + PF256);
    else if (wt == WT_Q4 && !par) prefetch2(codes + g / 2 * 128 + PF256);
    else if (wt == WT_Q6 && !par) q6_prefetch(codes + g / 2 * 208 + PF256);
    else if (wt == WT_Q5 && g % 3 == 0) {
        prefetch2(codes + g / 3 * 256 + PF256);
        prefetch2(codes + g / 3 * 256 + 128 + PF256);
    }
    __m256i l[4], h[4];
    for (int r = 0; r < 4; r++) widen_group(codes, wt, g, par, r, &l[r], &h[r]);
    const __m128 ws = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + g * 4)));
    const __m128 wm = HAS_MIN(wt) ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(mn + g * 4))) : _mm_setzero_ps();
    const __m256 ws2 = _mm256_set_m128(ws, ws), wm2 = _mm256_set_m128(wm, wm);
    const int16_t *x = a->q + m0 * K + g * 32;
    const float *dx = a->d + m0 * G + g, *sx = a->s + m0 * G + g;
#define ROW_DOTS(xr)                                                                                                 \
    ({                                                                                                               \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xr));                                                \
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)((xr) + 16));                                         \
        __m256i D[4];                                                                                                \
        for (int r = 0; r < 4; r++) D[r] = dot_rows(l[r], h[r], x0, x1);                                             \
        rows4(D);                                                                                                    \
    })
    const int64_t pairs = mt / 2;
    for (int64_t p = 0; p < pairs; p++, x += 2 * K, dx += 2 * G, sx += 2 * G) {
        const __m256i r0 = ROW_DOTS(x), r1 = ROW_DOTS(x + K);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(r0, r1, 0x20),
                                                             _mm256_permute2x128_si256(r0, r1, 0x31)));
        const __m256 s = _mm256_mul_ps(ws2, _mm256_set_m128(_mm_set1_ps(dx[G]), _mm_set1_ps(dx[0])));
        acc[p] = _mm256_fmadd_ps(f, s, acc[p]);
        if (HAS_MIN(wt))
            accm[p] = _mm256_fmadd_ps(wm2, _mm256_set_m128(_mm_set1_ps(sx[G]), _mm_set1_ps(sx[0])), accm[p]);
    }
    if (mt % 2) { /* (x, dx, sx: the last row's) */
        const __m256i r0 = ROW_DOTS(x);
        const __m128 f = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(r0), _mm256_extracti128_si256(r0, 1)));
        *last = _mm_fmadd_ps(f, _mm_mul_ps(ws, _mm_set1_ps(dx[0])), *last);
        if (HAS_MIN(wt)) *lastm = _mm_fmadd_ps(wm, _mm_set1_ps(sx[0]), *lastm);
    }
#undef ROW_DOTS
}

/* out rows n..n+3 (block b) for batch rows m0..m0+mt-1 (2 <= mt < TILE_MIN), any quantized format: block_q1's
 * order for every row (see above), group by group (block_q_inv_group).  (Per row, 128 bits: 1.1-1.4x the time; pairs
 * of groups as block_q1 takes them, sixteen widened vectors spilled: 1.05-1.15x; the minimums' chains in a loop of
 * their own after the groups: a latency-bound chain, int4 1.1-1.4x.) */
static inline __attribute__((always_inline)) void block_q_inv(const ts_weight *W, const int wt, int64_t b, int64_t K,
                                                          const ts_qact *a, int64_t m0, int64_t mt, float *out) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = HAS_MIN(wt) ? W->min + b * G * 4 : NULL;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(wt, K);
    /* E and O (acc[0], acc[1]), EM and OM (accm) of batch rows 2p, 2p + 1; of an odd last row: last, lastm */
    __m256 acc[2][MT / 2], accm[2][MT / 2];
    __m128 last[2] = {_mm_setzero_ps(), _mm_setzero_ps()}, lastm[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t p = 0; p < mt / 2; p++) acc[0][p] = acc[1][p] = accm[0][p] = accm[1][p] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
        block_q_inv_group(codes, wt, sc, mn, a, m0, mt, K, g, 0, acc[0], accm[0], &last[0], &lastm[0]);
        block_q_inv_group(codes, wt, sc, mn, a, m0, mt, K, g + 1, 1, acc[1], accm[1], &last[1], &lastm[1]);
    }
    if (g < G) block_q_inv_group(codes, wt, sc, mn, a, m0, mt, K, g, 0, acc[0], accm[0], &last[0], &lastm[0]);
    for (int64_t m = 0; m < mt; m++) {
        const int64_t p = m / 2;
#define HALF(v) (m % 2 ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v))
        const int paired = p < mt / 2;
        const __m128 e = paired ? HALF(acc[0][p]) : last[0], o = paired ? HALF(acc[1][p]) : last[1];
        const __m128 em = paired ? HALF(accm[0][p]) : lastm[0], om = paired ? HALF(accm[1][p]) : lastm[1];
#undef HALF
        _mm_storeu_ps(out + m * 4, _mm_add_ps(_mm_add_ps(e, em), _mm_add_ps(o, om)));
    }
}

/* block_q1 for Q5: two triples (six groups, 128 bytes a row) per step, reduced in pairs of groups as block_q1 does
 * (each pair's codes widened as they are multiplied: no spills); the last groups one pair, or one group, at a time. */
static inline __attribute__((always_inline)) void block_q1_q5(const ts_weight *W, int64_t b, int64_t K, const ts_qact *a,
                                                              int64_t m, float *out) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = W->min + b * G * 4;
    const int16_t *xq = a->q + m * K;
    const float *dx = a->d + m * G, *sx = a->s + m * G;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q5, K);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
    /* groups g, g + 1: WIDEN(r) sets la, ha (group g of row r) and lb, hb (group g + 1) */
#define Q5_PAIR(g, WIDEN)                                                                                           \
    {                                                                                                                \
        const int16_t *x = xq + (g) * 32;                                                                            \
        const __m256i xa0 = LD(x), xa1 = LD(x + 16), xb0 = LD(x + 32), xb1 = LD(x + 48);                             \
        __m256i DA[4], DB[4];                                                                                        \
        for (int r = 0; r < 4; r++) {                                                                                \
            __m256i la, ha, lb, hb;                                                                                  \
            WIDEN(r)                                                                                                 \
            DA[r] = dot_rows(la, ha, xa0, xa1);                                                                      \
            DB[r] = dot_rows(lb, hb, xb0, xb1);                                                                      \
        }                                                                                                            \
        scale_pair(&acc, &accm, DA, DB, sc, mn, dx, sx, g);                                                          \
    }
    int64_t g = 0;
    for (; g + 6 <= G; g += 6) {
        const uint8_t *c = codes + (g / 3) * 4 * 64, *d = c + 4 * 64; /* triples g / 3 and g / 3 + 1: 512 bytes */
        prefetch2(c + PF256);
        prefetch2(c + 128 + PF256);
        prefetch2(c + 256 + PF256);
        prefetch2(c + 384 + PF256);
#define W01(r) q5_group(LD(c + (r) * 64), LD(c + (r) * 64 + 32), 0, &la, &ha); \
               q5_group(LD(c + (r) * 64), LD(c + (r) * 64 + 32), 1, &lb, &hb);
#define W23(r) q5_group(LD(c + (r) * 64), LD(c + (r) * 64 + 32), 2, &la, &ha); \
               q5_group(LD(d + (r) * 64), LD(d + (r) * 64 + 32), 0, &lb, &hb);
#define W45(r) q5_group(LD(d + (r) * 64), LD(d + (r) * 64 + 32), 1, &la, &ha); \
               q5_group(LD(d + (r) * 64), LD(d + (r) * 64 + 32), 2, &lb, &hb);
        Q5_PAIR(g, W01)
        Q5_PAIR(g + 2, W23)
        Q5_PAIR(g + 4, W45)
#undef W01
#undef W23
#undef W45
    }
    for (; g + 1 < G; g += 2) { /* a pair of the last groups */
#define WAT(r) q5_group_at(codes + ((g / 3) * 4 + (r)) * 64, g % 3, &la, &ha); \
               q5_group_at(codes + (((g + 1) / 3) * 4 + (r)) * 64, (g + 1) % 3, &lb, &hb);
        Q5_PAIR(g, WAT)
#undef WAT
    }
#undef Q5_PAIR
#undef LD
    if (g < G) lone_group(&acc, &accm, codes, WT_Q5, sc, mn, a, m, K, g); /* a lone last group */
    store_eo(acc, accm, out);
}

#ifndef PF512
#define PF512 4096 /* software prefetch distance of the AVX-512 row path, bytes of codes ahead */
#endif
#if TS_AVX512
/* ---- the row path with AVX-512 VNNI (int8 and int4: the same formats, the same int16 activations) ----
 * A zmm holds sixteen int16 codes of two weight rows side by side (rows r, r+1: columns 0..15 of a group in one
 * register, 16..31 in another), so one vpdpwssd multiplies 32 pairs and adds them into the int32 sums of both rows,
 * against the group's activations broadcast to both halves.  Per group and block of four rows: four vpdpwssd, a
 * fold of the two accumulators into one vector with four lanes per row (two shuffles, an add), one conversion and
 * one multiply-add with the rows' scales times the activations' scale.  Q4's 64 codes per row and pair of groups
 * are 32 bytes (see widen_group), so a 64-byte load is rows r and r+1 of the pair: widening is a shift and a mask.
 * The horizontal sums wait until the block's last group. */
static inline __m512 scales16(const uint16_t *s, __m512i idx) {
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)s))));
}

/* lanes 4r..4r+3 of v summed, r = 0..3 -> out[0..3] */
static inline void store_rows4(__m512 v, float *out) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v)));
}

/* acc[m] += group g of the block (w01/w23: rows 0,1 / 2,3, lo = columns 0..15, hi = 16..31) . batch row m0 + m, and
 * with fold_min the minimum's term (wm: a row's minimum in one of its four lanes); else min_rows512 adds it */
static inline __attribute__((always_inline)) void group_rows512(__m512 *acc, const ts_qact *a, int64_t g, int64_t G,
                                                                int64_t K, int64_t m0, int64_t mt, __m512 ws, __m512 wm,
                                                                const int fold_min, __m512i lo01, __m512i hi01,
                                                                __m512i lo23, __m512i hi23) {
    for (int64_t m = 0; m < mt; m++) {
        const int64_t mg = (m0 + m) * G + g;
        const int16_t *xq = a->q + (m0 + m) * K + g * 32;
        const __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));
        const __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 16)));
        const __m512i z = _mm512_setzero_si512();
        const __m512i s01 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, lo01, x0), hi01, x1);
        const __m512i s23 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, lo23, x0), hi23, x1);
        /* [row0 8 | row1 8] + [row2 8 | row3 8] -> four lanes per row */
        const __m512i f = _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xDD));
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), _mm512_mul_ps(ws, _mm512_set1_ps(a->d[mg])), acc[m]);
        acc[m] = fold_min ? _mm512_fmadd_ps(wm, _mm512_set1_ps(a->s[mg]), t) : t;
    }
}

/* out[m * 4 + r] += sum over the block's groups g of mn[g * 4 + r] x the activations' group sum s[(m0 + m) G + g]:
 * the minimum's term of asymmetric (int4) groups, four groups a vector (their sixteen fp16 minimums converted at
 * once, lane 4j + r), once per block after its dot products.  Folded into every group's step (a conversion, a
 * permute, a broadcast and an FMA a group) it bound the one-row int4 kernel by instructions: an 8192 x 2048 int4
 * linear at one row cycled past the L3 read 24.4 GB/s that way and 30.1 this way, a 2-thread sum() 30.5 (the
 * default model's one-row decode step 0.95x the time, the 1.7B Q4_K_M file's 0.935x).  With more batch rows the
 * conversion is shared by them and the fold stays (this way the 8-row step took 1.03x). */
static inline __attribute__((always_inline)) void min_rows512(const uint16_t *mn, const ts_qact *a, int64_t G,
                                                              int64_t m0, int64_t mt, float *out) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t m = 0; m < mt; m++) {
        const float *sx = a->s + (m0 + m) * G;
        __m512 acc = _mm512_setzero_ps();
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) {
            const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + g * 4)));
            acc = _mm512_fmadd_ps(w, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(sx + g))), acc);
        }
        if (g < G) { /* the last one to three groups, through zeroed copies (nothing read past the block's minimums;
                      * copies, not masked loads: SIMDe's emulated build has no _mm_maskz_loadu_ps) */
            const int64_t n = G - g;
            uint16_t w16[16] = {0};
            float x4[4] = {0};
            memcpy(w16, mn + g * 4, sizeof(uint16_t) * (size_t)(4 * n));
            memcpy(x4, sx + g, sizeof(float) * (size_t)n);
            const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w16));
            acc = _mm512_fmadd_ps(w, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(x4))), acc);
        }
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
        const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(out + m * 4, _mm_add_ps(_mm_loadu_ps(out + m * 4), q));
    }
}

static inline __attribute__((always_inline)) void block_q512(const ts_weight *W, const int wt, int64_t b, int64_t K,
                                                             const ts_qact *a, int64_t m0, int64_t mt, float *out) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = HAS_MIN(wt) ? W->min + b * G * 4 : NULL;
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __mmask16 first = 0x1111; /* the min term in one lane per row: the final sum adds four lanes */
    const int fold_min = HAS_MIN(wt) && mt > 1; /* (one row: min_rows512 after the dot products) */
    __m512 acc[MT];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    if (wt == WT_Q8) {
        const uint8_t *codes = (const uint8_t *)W->w + b * G * 4 * 32;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *c = codes + g * 4 * 32;
            prefetch2(c + PF512);
#define PAIR(r, o) _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(c + (r) * 32 + (o)))), \
                                                               _mm_loadu_si128((const __m128i *)(c + ((r) + 1) * 32 + (o))), 1))
            group_rows512(acc, a, g, G, K, m0, mt, scales16(sc + g * 4, idx), _mm512_setzero_ps(), 0, PAIR(0, 0),
                          PAIR(0, 16), PAIR(2, 0), PAIR(2, 16));
#undef PAIR
        }
    } else {
        const int64_t P = (G + 1) / 2;
        const uint8_t *codes = (const uint8_t *)W->w + b * P * 4 * 32;
        const __m512i nib = _mm512_set1_epi16(0x000F);
        const __m512 zero = _mm512_setzero_ps();
#define min4(p) _mm512_maskz_permutexvar_ps(first, idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p)))))
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *c = codes + p * 4 * 32;
            prefetch2(c + PF512);
            const __m512i r01 = _mm512_loadu_si512((const void *)c), r23 = _mm512_loadu_si512((const void *)(c + 64));
            int64_t g = 2 * p;
            group_rows512(acc, a, g, G, K, m0, mt, scales16(sc + g * 4, idx), fold_min ? min4(mn + g * 4) : zero,
                          fold_min, _mm512_and_si512(r01, nib), _mm512_and_si512(_mm512_srli_epi16(r01, 4), nib),
                          _mm512_and_si512(r23, nib), _mm512_and_si512(_mm512_srli_epi16(r23, 4), nib));
            if (++g == G) break;
            group_rows512(acc, a, g, G, K, m0, mt, scales16(sc + g * 4, idx), fold_min ? min4(mn + g * 4) : zero,
                          fold_min, _mm512_and_si512(_mm512_srli_epi16(r01, 8), nib), _mm512_srli_epi16(r01, 12),
                          _mm512_and_si512(_mm512_srli_epi16(r23, 8), nib), _mm512_srli_epi16(r23, 12));
        }
    }
#undef min4
    for (int64_t m = 0; m < mt; m++) store_rows4(acc[m], out + m * 4);
    if (HAS_MIN(wt) && !fold_min) min_rows512(mn, a, G, m0, mt, out);
}

/* ---- int6 on the AVX-512 row path: unsigned codes x activation bytes (vpdpbusd), each quarter scaled in float ----
 * Until 2026-11-29 block_q512 took int6 too (AVX2's widening, each code times its sub-scale with vpmullw, joined per
 * pair of rows), bound by instructions: ~170 a block and pair of groups.  Here a row's 64 codes of a pair are
 * rebuilt as bytes in column order in one zmm (the nibbles by a per-qword shift of the 32 bytes broadcast, the high
 * bits by a per-qword rotate of their 16 broadcast: six instructions a row), and vpdpbusd multiplies them, unsigned,
 * with the activations' bytes in the same order (quantize_act's q8: the int8 codes with act8; else the int16 ones
 * split into 128 x q8h + q8, two vpdpbusd with a shift between, the same integers exactly).  Lane j of a row's sums
 * holds columns 4j..4j+3, so 128-bit lane i is quarter i: a 4 x 4 transpose of the four rows' sums (sum4x4_512)
 * leaves lane 4i + r = quarter i of row r, in the order of the sub-scales in the block (byte 192 + 4i + r), one
 * subtraction of the activations' 32 x quarter sums (q6o) makes the codes q - 32, and one conversion and one FMA by
 * sub x d x dx scale all sixteen.  The accumulator's four lanes per row are summed once per block. */
static inline __attribute__((always_inline)) __m512i sum4x4_512(__m512i r0, __m512i r1, __m512i r2, __m512i r3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

/* row r's 64 codes q (0..63) of the pair at c, as bytes in column order */
static inline __attribute__((always_inline)) __m512i q6_bytes512(const uint8_t *c, int r) {
    /* qwords 0..3: the low nibbles (columns 0..31), 4..7: the high ones (32..63); the high bits of column 16 L + t sit
     * at bits 2 L, 2 L + 1 of byte t: rotated to bits 4, 5 of byte t of 128-bit lane L (what the rotation brings in
     * from a neighbouring byte lands outside bits 4, 5 and is masked off) */
    const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(c + 48 * r)));
    const __m512i hb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(c + 48 * r + 32)));
    const __m512i n = _mm512_srlv_epi64(raw, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
    const __m512i h =
        _mm512_and_si512(_mm512_rolv_epi64(hb, _mm512_setr_epi64(4, 4, 2, 2, 0, 0, 62, 62)), _mm512_set1_epi8(0x30));
    return _mm512_ternarylogic_epi32(n, _mm512_set1_epi8(0x0F), h, 0xEA); /* (n & 0x0F) | h */
}

static inline __attribute__((always_inline)) void block_q6_512(const ts_weight *W, int64_t b, int64_t K, const ts_qact *a,
                                                               int64_t m0, int64_t mt, float *out) {
    const int64_t G = K / 32, P = G / 2;
    const uint16_t *sc = W->scale + b * G * 4;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q6, K);
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i group = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[MT];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const uint8_t *c = codes + p * 208;
        q6_prefetch(c + PF512);
        const __m512i w0 = q6_bytes512(c, 0), w1 = q6_bytes512(c, 1), w2 = q6_bytes512(c, 2), w3 = q6_bytes512(c, 3);
        /* sub x d per lane 4i + r (the pair's two groups share Q6_K's d: group 2p's) */
        /* (vpmovsxbw then vpmovsxwd: SIMDe's emulation has no vpmovsxbd of 512 bits) */
        const __m512i sub = _mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 192))));
        const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 2 * p * 4)));
        const __m512 ws = _mm512_mul_ps(_mm512_cvtepi32_ps(sub), _mm512_broadcast_f32x4(d));
        for (int64_t m = 0; m < mt; m++) {
            const int64_t i = (m0 + m) * P + p;
            const __m512i xl = _mm512_loadu_si512((const void *)(a->q8 + i * 64)), z = _mm512_setzero_si512();
            __m512i r0, r1, r2, r3;
            if (a->act8) {
                r0 = _mm512_dpbusd_epi32(z, w0, xl), r1 = _mm512_dpbusd_epi32(z, w1, xl);
                r2 = _mm512_dpbusd_epi32(z, w2, xl), r3 = _mm512_dpbusd_epi32(z, w3, xl);
            } else {
                const __m512i xh = _mm512_loadu_si512((const void *)(a->q8h + i * 64));
                r0 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, w0, xh), 7), w0, xl);
                r1 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, w1, xh), 7), w1, xl);
                r2 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, w2, xh), 7), w2, xl);
                r3 = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, w3, xh), 7), w3, xl);
            }
            const __m128i o4 = _mm_loadu_si128((const __m128i *)(a->q6o + i * 4)); /* (the pair's four quarters) */
            const __m512i off = _mm512_permutexvar_epi32(quarter, _mm512_castsi128_si512(o4));
            const double *dx2 = (const double *)(a->d + (m0 + m) * G + 2 * p); /* (both groups' scales) */
            const __m512 dx = _mm512_permutexvar_ps(group, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(dx2))));
            const __m512i q = _mm512_sub_epi32(sum4x4_512(r0, r1, r2, r3), off);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(ws, dx), acc[m]);
        }
    }
    for (int64_t m = 0; m < mt; m++) { /* lane 4i + r -> row r */
        __m512 v = acc[m];
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
        _mm_storeu_ps(out + m * 4, _mm512_castps512_ps128(v));
    }
}
#define BLOCK_Q block_q512
#define BLOCK_Q1(W, wt, b, K, a, m, o) block_q512(W, wt, b, K, a, m, 1, o)
#else
#define BLOCK_Q block_q
#define BLOCK_Q1 block_q1
#endif

/* ---- the tiled path (M >= TILE_MIN) ----
 * With many batch rows the row path above spends most of its instructions on the horizontal reduction, scaling
 * and loads of each (row, group, 4 weight rows) dot, ~3.5 per vpmaddwd.  Here each block's four weight rows are
 * first widened to int16 once (a chunk of CG groups at a time, into L1, shared by every batch row; TB blocks per
 * pass over the activations), and
 * the activations are laid out per pair of columns across eight batch rows (quantize_act's tiled layout), so one
 * vpmaddwd of a broadcast weight pair against eight rows' pairs adds into eight rows' dot products at once: a tile
 * of 4 weight rows x 16 batch rows takes 8 vpmaddwd + 8 vpaddd per column pair, int32 sums in registers, and the
 * scaling (a conversion and one or two FMAs per 8 sums) once per group, with no horizontal sums at all.
 * Measured on one thread, the default model's layer shapes: int4 1.24x the row path at 16 rows, 1.45x at 64 (int8
 * 1.12x, 1.35x); below 16 rows the row path wins (0.5x-0.96x at 4-12 rows), hence TILE_MIN.  The multiply-adds
 * alone run at 5.0-5.7 cycles per 8 vpmaddwd + 8 vpaddd on this Zen 3 (the ports would allow 4); with the scaling
 * ~61 GMAC/s per core in L1, ~51 in a c=64 step. */

/* Groups of columns widened per chunk: the widened codes of a pass (TB blocks x 4 rows) are computed for CG groups at
 * a time into buffers that stay in L1 (TB * 4 * CG * 64 bytes = 16 KiB) and used at once by every batch row.
 * Widening whole blocks first (4 rows x K int16 each: 512 KiB a pass at K = 8192, the 1.7B shape's down_proj) wrote
 * them out to L2 / L3 and read them back: 1.7B-shaped int4 layers, 2 threads, 1.06-1.12x at 16-256 rows; the 1.7B
 * Q4_K_M file's c=16 generation in process 1.05x.  4 or 16 groups measured the same.  Even: an int4 block stores its
 * groups in pairs. */
#ifndef CG
#define CG 8
#endif
_Static_assert(CG % 2 == 0 && CG >= 6, "CG: int4's pairs of groups, int5's chunks of two triples");

typedef struct {
    int16_t *w; /* [4][CG * 32] the block's codes of the current chunk of groups, as int16 */
    float *sc;  /* [G][4] */
    float *mn;  /* [G][4] (Q4, Q5) */
} ts_wtile;

/* The block's scales (and Q4 / Q5 minimums) as float32, once per pass. */
static void widen_scales(const ts_weight *W, const int wt, int64_t b, int64_t K, ts_wtile *t) {
    const int64_t G = K / 32;
    const uint16_t *sc = W->scale + b * G * 4, *mn = HAS_MIN(wt) ? W->min + b * G * 4 : NULL;
    for (int64_t i = 0; i < G * 4; i += 4) {
        _mm_storeu_ps(t->sc + i, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + i))));
        if (mn) _mm_storeu_ps(t->mn + i, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(mn + i))));
    }
}

/* Groups g0..g1 (g0 even, g1 - g0 <= CG) of block b's codes as int16: row r's group g at t->w[r * CG * 32 + (g - g0) * 32]. */
static void widen_codes(const ts_weight *W, const int wt, int64_t b, int64_t K, int64_t g0, int64_t g1, ts_wtile *t) {
    const int64_t G = K / 32, CW = CG * 32;
    if (wt == WT_Q8) {
        const uint8_t *codes = (const uint8_t *)W->w + b * G * 4 * 32;
        for (int64_t g = g0; g < g1; g++)
            for (int r = 0; r < 4; r++) {
                __m256i lo, hi;
                widen_q8(codes + (g * 4 + r) * 32, &lo, &hi);
                _mm256_storeu_si256((__m256i *)(t->w + r * CW + (g - g0) * 32), lo);
                _mm256_storeu_si256((__m256i *)(t->w + r * CW + (g - g0) * 32 + 16), hi);
            }
        return;
    }
    if (wt == WT_Q6) { /* (chunks of CG groups: whole pairs) */
        const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q6, K);
        for (int64_t p = g0 / 2; 2 * p < g1; p++)
            for (int r = 0; r < 4; r++) {
                __m256i w[4];
                q6_row_scaled(codes + p * 208, r, w);
                for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(t->w + r * CW + (2 * p - g0) * 32 + 16 * i), w[i]);
            }
        return;
    }
    if (wt == WT_Q5) { /* (blocks_tile's chunks hold whole triples; a short last triple group by group) */
        const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(WT_Q5, K);
        for (int r = 0; r < 4; r++) {
            __m256i l[CG], h[CG];
            q5_widen_row(codes, r, g0, g1, l, h);
            for (int64_t i = 0; i < g1 - g0; i++) {
                _mm256_storeu_si256((__m256i *)(t->w + r * CW + i * 32), l[i]);
                _mm256_storeu_si256((__m256i *)(t->w + r * CW + i * 32 + 16), h[i]);
            }
        }
        return;
    }
    const int64_t P = (G + 1) / 2;
    const uint8_t *codes = (const uint8_t *)W->w + b * P * 4 * 32;
    for (int64_t p = g0 / 2; 2 * p < g1; p++)
        for (int r = 0; r < 4; r++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + (p * 4 + r) * 32));
            int16_t *o = t->w + r * CW + (2 * p - g0) * 32;
            _mm256_storeu_si256((__m256i *)o, q4_quarter(raw, 0));
            _mm256_storeu_si256((__m256i *)(o + 16), q4_quarter(raw, 1));
            if (2 * p + 1 == G) continue; /* odd last group: its pair's upper half is padding */
            _mm256_storeu_si256((__m256i *)(o + 32), q4_quarter(raw, 2));
            _mm256_storeu_si256((__m256i *)(o + 48), q4_quarter(raw, 3));
        }
}

/* Blocks of four weight rows per pass of the tiled path: each pass reads the activations once (from L2) and every
 * block after the first reuses each tile of them from L1; 8 blocks = 32 output columns, 128 bytes of every batch
 * row's output written together.  (2 blocks per pass: the activation reads and strided partial-line output
 * writes cost ~20% of a c=64 step.) */
#ifndef TB
#define TB 8
#endif

/* The AVX2 tiled path keeps the row path's sums apart (see "the row path"): a pass's buffer f holds E and O at
 * f + fsplit(mp) (tile_scale), and tile_finish adds the minimums' chains and the halves into E.  (The AVX-512
 * build: one sum, the minimums in it, fsplit 0.) */
#define EO_SPLIT (!TS_AVX512)
static inline int64_t fsplit(int64_t mp) { return EO_SPLIT ? 4 * TB * mp : 0; }

/* f[r * mp + m0 + 8j + i] += lane i of c[j][r] (the int32 dots of weight row r and eight batch rows over group g)
 * scaled, and the minimums' term into f's EM / OM buffer (f: E or O): the group's scaling, once per (weight row,
 * eight batch rows).  Locals, so that the stores to f do not make gcc reload every pointer (f could alias them). */
static inline __attribute__((always_inline)) void tile_scale(const ts_wtile *t, const int wt, int64_t g, const ts_qact *a,
                                                             int64_t m0, const int NV, const __m256i c[2][4], float *f) {
    const int64_t mp = a->mp;
    const float *restrict sc = t->sc + g * 4, *restrict mn = t->mn + g * 4;
    const float *restrict d = a->d + g * mp + m0, *restrict sm = a->s + g * mp + m0;
    float *restrict o = f + m0;
    for (int j = 0; j < NV; j++) {
        const __m256 dx = _mm256_loadu_ps(d + 8 * j), sx = _mm256_loadu_ps(sm + 8 * j);
        for (int r = 0; r < 4; r++) {
            float *restrict fo = o + r * mp + 8 * j;
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[j][r]), _mm256_mul_ps(dx, _mm256_set1_ps(sc[r])),
                                       _mm256_loadu_ps(fo));
            if (HAS_MIN(wt) && !EO_SPLIT) v = _mm256_fmadd_ps(sx, _mm256_set1_ps(mn[r]), v);
            _mm256_storeu_ps(fo, v);
        }
    }
}

/* The AVX2 tiled path's last step of a pass (EO_SPLIT): f's E = (E + EM) + (O + OM) for every output, the
 * minimums' chains (Q4, Q5) built here in registers, as scale_pair builds them on the row path (in tile_scale
 * they cost a load and a store of a second buffer per group: int4 at 16-32 rows 1.1-1.2x the time). */
static void tile_finish(const ts_wtile *t, int nb, const int wt, int64_t G, const ts_qact *a, float *f) {
    const int64_t mp = a->mp, split = fsplit(mp);
    for (int i = 0; i < nb; i++)
        for (int64_t m0 = 0; m0 < mp; m0 += 8) {
            /* the block's four rows' chains side by side: eight independent FMA chains (one row's two chains alone
             * waited on the FMA's latency: ~15% of an int4 ts_linear at 16 rows) */
            __m256 em[4], om[4];
            for (int r = 0; r < 4; r++) em[r] = om[r] = _mm256_setzero_ps();
            if (HAS_MIN(wt)) {
                const float *mn = t[i].mn, *sx = a->s + m0;
                int64_t g = 0;
                for (; g + 1 < G; g += 2) {
                    const __m256 se = _mm256_loadu_ps(sx + g * mp), so = _mm256_loadu_ps(sx + (g + 1) * mp);
                    for (int r = 0; r < 4; r++) {
                        em[r] = _mm256_fmadd_ps(se, _mm256_set1_ps(mn[g * 4 + r]), em[r]);
                        om[r] = _mm256_fmadd_ps(so, _mm256_set1_ps(mn[(g + 1) * 4 + r]), om[r]);
                    }
                }
                if (g < G)
                    for (int r = 0; r < 4; r++)
                        em[r] = _mm256_fmadd_ps(_mm256_loadu_ps(sx + g * mp), _mm256_set1_ps(mn[g * 4 + r]), em[r]);
            }
            for (int r = 0; r < 4; r++) {
                float *e = f + (4 * i + r) * mp + m0;
                _mm256_storeu_ps(e, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(e), em[r]),
                                                  _mm256_add_ps(_mm256_loadu_ps(e + split), om[r])));
            }
        }
}

/* f[r * mp + m0 + m] += row r of the block . batch row m0 + m over group g, for m < 8 * NV (NV = 1 or 2). */
static inline __attribute__((always_inline)) void tile_group(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                             const ts_qact *a, int64_t m0, const int NV, float *f) {
    const int64_t mp = a->mp;
    const int32_t *w0 = (const int32_t *)(t->w + gl * 32), *w1 = (const int32_t *)(t->w + CG * 32 + gl * 32);
    const int32_t *w2 = (const int32_t *)(t->w + 2 * CG * 32 + gl * 32), *w3 = (const int32_t *)(t->w + 3 * CG * 32 + gl * 32);
    const int32_t *xq = (const int32_t *)a->q + tiled(g, 0, m0, mp);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + k * 8));
        const __m256i x1 = NV > 1 ? _mm256_loadu_si256((const __m256i *)(xq + 128 + k * 8)) : x0;
#define TAP(cr0, cr1, wr)                                                          \
    {                                                                              \
        const __m256i b = _mm256_set1_epi32(wr[k]);                                \
        cr0 = _mm256_add_epi32(cr0, _mm256_madd_epi16(b, x0));                     \
        if (NV > 1) cr1 = _mm256_add_epi32(cr1, _mm256_madd_epi16(b, x1));         \
    }
        TAP(c00, c01, w0) TAP(c10, c11, w1) TAP(c20, c21, w2) TAP(c30, c31, w3)
#undef TAP
        /* keeps the sums in registers: unrolled, gcc otherwise reassociates them into all 128 products first */
        __asm__("" : "+x"(c00), "+x"(c01), "+x"(c10), "+x"(c11), "+x"(c20), "+x"(c21), "+x"(c30), "+x"(c31));
    }
    const __m256i c[2][4] = {{c00, c10, c20, c30}, {c01, c11, c21, c31}};
    tile_scale(t, wt, g, a, m0, NV, c, f);
}

/* ---- int8 activations (act8) on the tiled path, int4 weights ----
 * vpmaddubsw multiplies unsigned bytes by signed ones and adds adjacent pairs into int16: int4 codes (0..15) by
 * int8 activations (|x| <= 127) give pair sums of at most 3810, so a group's eight quads add up in int16 (at most
 * 30480) and one vpmaddwd by ones per group widens them to int32.  A tile of 4 weight rows x 16 batch rows and one
 * group is then 32 vpmaddubsw + 32 vpaddw + 8 vpmaddwd where the int16 tile takes 64 vpmaddwd + 64 vpaddd: about
 * half the multiply-port work.  What it costs is the activations' precision (see ts_qact). */

/* Groups g0..g1 (g0 even) of an int4 (or int5) block's codes as bytes in column order: row r's group g at
 * t->w (as bytes) + r * CG * 32 + (g - g0) * 32. */
static void widen_codes8(const ts_weight *W, int64_t b, int64_t K, int64_t g0, int64_t g1, ts_wtile *t) {
    const int64_t G = K / 32, CW = CG * 32;
    const uint8_t *codes = (const uint8_t *)W->w + b * block_bytes(W->wt, K);
    uint8_t *w8 = (uint8_t *)t->w;
    if (W->wt == WT_Q8) { /* (AVX-512's byte tile) int8 codes as unsigned bytes, code + 128: see tile_group8_512 */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int64_t g = g0; g < g1; g++)
            for (int r = 0; r < 4; r++)
                _mm256_storeu_si256((__m256i *)(w8 + r * CW + (g - g0) * 32),
                                    _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + (g * 4 + r) * 32)), flip));
        return;
    }
    if (W->wt == WT_Q6) { /* (AVX2's tile_group6) the codes q (0..63) as bytes, and the sub-scales as int16 after
                           * the codes: local group gl's at (int16) 2 * CG * 32 + gl * 8 + [quarter of the group][row] */
        int16_t *sub = t->w + 2 * CG * 32;
        for (int64_t p = g0 / 2; 2 * p < g1; p++) {
            const uint8_t *c = codes + p * 208;
            for (int r = 0; r < 4; r++) {
                __m256i qa, qb;
                q6_codes(c, r, &qa, &qb);
                _mm256_storeu_si256((__m256i *)(w8 + r * CW + (2 * p - g0) * 32), qa);
                _mm256_storeu_si256((__m256i *)(w8 + r * CW + (2 * p - g0) * 32 + 32), qb);
            }
            for (int i = 0; i < 16; i++) sub[(2 * p - g0) * 8 + i] = (int8_t)c[192 + i]; /* (quarters 0..3 x rows) */
        }
        return;
    }
    if (W->wt == WT_Q5) { /* int5 codes (0..31) widened as for the int16 tile, then packed to bytes */
        for (int r = 0; r < 4; r++) {
            __m256i l[CG], h[CG];
            q5_widen_row(codes, r, g0, g1, l, h);
            for (int64_t i = 0; i < g1 - g0; i++)
                _mm256_storeu_si256((__m256i *)(w8 + r * CW + i * 32),
                                    _mm256_permute4x64_epi64(_mm256_packus_epi16(l[i], h[i]), 0xD8));
        }
        return;
    }
    for (int64_t p = g0 / 2; 2 * p < g1; p++)
        for (int r = 0; r < 4; r++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + (p * 4 + r) * 32));
            uint8_t *o = w8 + r * CW + (2 * p - g0) * 32;
            /* vpackuswb packs per 128-bit lane: the permute restores column order */
            _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(
                                                  _mm256_packus_epi16(q4_quarter(raw, 0), q4_quarter(raw, 1)), 0xD8));
            if (2 * p + 1 == G) continue;
            _mm256_storeu_si256((__m256i *)(o + 32), _mm256_permute4x64_epi64(
                                                         _mm256_packus_epi16(q4_quarter(raw, 2), q4_quarter(raw, 3)), 0xD8));
        }
}

/* Quad k (columns 4k..4k+3 of a group) of the byte tiles (tile_group8, tile_group6): cRV += vpmaddubsw(weight row
 * R's four codes (wR[k], bytes), vector V of the batch rows' quads) in int16, for the four weight rows and NV (1, 2)
 * vectors of eight batch rows (tiled8, from xq).  A macro over the caller's named sums: an inline function over an
 * array of them made gcc spill the sums after the loop (the int4 byte tile 0.93-0.95x). */
#define BYTE_QUAD(k)                                                                                         \
    {                                                                                                        \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + (k) * mp));                            \
        const __m256i x1 = NV > 1 ? _mm256_loadu_si256((const __m256i *)(xq + (k) * mp + 8)) : x0;           \
        BYTE_TAP(c00, c01, w0, k) BYTE_TAP(c10, c11, w1, k) BYTE_TAP(c20, c21, w2, k) BYTE_TAP(c30, c31, w3, k) \
        /* keeps the sums in registers: unrolled, gcc otherwise hoists every load and spills */             \
        __asm__("" : "+x"(c00), "+x"(c01), "+x"(c10), "+x"(c11), "+x"(c20), "+x"(c21), "+x"(c30), "+x"(c31)); \
    }
#define BYTE_TAP(cr0, cr1, wr, k)                                                                            \
    {                                                                                                        \
        const __m256i b = _mm256_set1_epi32(wr[k]);                                                          \
        cr0 = _mm256_add_epi16(cr0, _mm256_maddubs_epi16(b, x0));                                            \
        if (NV > 1) cr1 = _mm256_add_epi16(cr1, _mm256_maddubs_epi16(b, x1));                                \
    }

/* tile_group for int4 or int5 codes (wt; widen_codes8) and int8 activations: the same f update.  int5 codes (0..31)
 * give pair sums of at most 7874: four quads still add up in int16 (31496), eight would not, so int5 widens its
 * sums to int32 halfway through the group as well. */
static inline __attribute__((always_inline)) void tile_group8(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                              const ts_qact *a, int64_t m0, const int NV, float *f) {
    const int64_t mp = a->mp;
    const uint8_t *w8 = (const uint8_t *)t->w + gl * 32;
    const int32_t *w0 = (const int32_t *)w8, *w1 = (const int32_t *)(w8 + CG * 32);
    const int32_t *w2 = (const int32_t *)(w8 + 2 * CG * 32), *w3 = (const int32_t *)(w8 + 3 * CG * 32);
    const int32_t *xq = (const int32_t *)a->q8 + tiled8(g, 0, m0, mp);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    __m256i d00 = c00, d01 = c00, d10 = c00, d11 = c00, d20 = c00, d21 = c00, d30 = c00, d31 = c00; /* (int5) */
    const __m256i one = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        BYTE_QUAD(k)
        if (wt == WT_Q5 && k == 3) { /* the first four quads' sums to int32 */
#define W32H(v, d) { d = _mm256_madd_epi16(v, one); v = _mm256_setzero_si256(); }
            W32H(c00, d00) W32H(c10, d10) W32H(c20, d20) W32H(c30, d30)
            if (NV > 1) { W32H(c01, d01) W32H(c11, d11) W32H(c21, d21) W32H(c31, d31) }
#undef W32H
        }
    }
#define W32(v, d) (wt == WT_Q5 ? _mm256_add_epi32(_mm256_madd_epi16(v, one), d) : _mm256_madd_epi16(v, one))
    const __m256i c[2][4] = {{W32(c00, d00), W32(c10, d10), W32(c20, d20), W32(c30, d30)},
                             {W32(c01, d01), W32(c11, d11), W32(c21, d21), W32(c31, d31)}};
#undef W32
    tile_scale(t, WT_Q4, g, a, m0, NV, c, f);
}

/* tile_group for int6 codes and int8 activations (AVX2): the unsigned codes (widen_codes8) times the activations'
 * quads with vpmaddubsw (pair sums at most 2 x 63 x 127), added per quarter (16 columns, four quads) in int16 onto
 * a->q6t's -32 x the activations' pair sums: what is left is the sum of eight (q - 32) x products, |.| <= 32512, so
 * the int16 lanes' wrap on the way cancels; one vpmaddwd by the quarter's sub-scale widens it to int32.  A tile of 4
 * weight rows x 16 batch rows and one group: 64 vpmaddubsw + 64 vpaddw + 16 vpmaddwd + 8 vpaddd, where the int16
 * tile it took before takes 128 vpmaddwd + 128 vpaddd.  ts_linear on 1.7B-shaped int6 layers, 2 threads, AVX2 EPYC:
 * 1.35x the int16 tile's speed at 8 and 64 rows, 1.27x at 16 (the quarter's int32 sums live on the stack). */
static inline __attribute__((always_inline)) void tile_group6(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                              const ts_qact *a, int64_t m0, const int NV, float *f) {
    (void)wt;
    const int64_t mp = a->mp;
    const uint8_t *w8 = (const uint8_t *)t->w + gl * 32;
    const int16_t *sub = t->w + 2 * CG * 32 + gl * 8; /* [quarter][row] */
    const int32_t *xq = (const int32_t *)a->q8 + tiled8(g, 0, m0, mp), *tq = a->q6t + 2 * g * mp + m0;
    const int32_t *w0 = (const int32_t *)w8, *w1 = (const int32_t *)(w8 + CG * 32);
    const int32_t *w2 = (const int32_t *)(w8 + 2 * CG * 32), *w3 = (const int32_t *)(w8 + 3 * CG * 32);
    __m256i c[2][4];
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        const __m256i t0 = _mm256_loadu_si256((const __m256i *)(tq + j * mp));
        const __m256i t1 = NV > 1 ? _mm256_loadu_si256((const __m256i *)(tq + j * mp + 8)) : t0;
        __m256i c00 = t0, c01 = t1, c10 = t0, c11 = t1, c20 = t0, c21 = t1, c30 = t0, c31 = t1;
#pragma GCC unroll 4
        for (int k = 4 * j; k < 4 * j + 4; k++) BYTE_QUAD(k)
        const __m256i q[2][4] = {{c00, c10, c20, c30}, {c01, c11, c21, c31}};
        for (int r = 0; r < 4; r++) {
            const __m256i sv = _mm256_set1_epi16(sub[4 * j + r]);
            for (int v = 0; v < NV; v++) {
                const __m256i d = _mm256_madd_epi16(q[v][r], sv);
                c[v][r] = j ? _mm256_add_epi32(c[v][r], d) : d;
            }
        }
    }
    if (NV == 1)
        for (int r = 0; r < 4; r++) c[1][r] = c[0][r];
    tile_scale(t, WT_Q6, g, a, m0, NV, c, f);
}

#if TS_AVX512
/* tile_scale for sixteen batch rows per vector (one sum: the minimums' term in it). */
static inline __attribute__((always_inline)) void tile_scale512(const ts_wtile *t, const int wt, int64_t g, const ts_qact *a,
                                                                int64_t m0, const int NV, const __m512i c[2][4], float *f) {
    const int64_t mp = a->mp;
    const float *restrict sc = t->sc + g * 4, *restrict mn = t->mn + g * 4;
    const float *restrict d = a->d + g * mp + m0, *restrict sm = a->s + g * mp + m0;
    float *restrict o = f + m0;
    for (int j = 0; j < NV; j++) {
        const __m512 dx = _mm512_loadu_ps(d + 16 * j), sx = _mm512_loadu_ps(sm + 16 * j);
        for (int r = 0; r < 4; r++) {
            float *restrict fo = o + r * mp + 16 * j;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[j][r]), _mm512_mul_ps(dx, _mm512_set1_ps(sc[r])),
                                       _mm512_loadu_ps(fo));
            if (HAS_MIN(wt)) v = _mm512_fmadd_ps(sx, _mm512_set1_ps(mn[r]), v);
            _mm512_storeu_ps(fo, v);
        }
    }
}

/* The same tile with AVX-512 VNNI: sixteen batch rows per vector and vpdpwssd's fused multiply-add-accumulate, so a
 * tile of 4 weight rows x 32 batch rows is 8 vpdpwssd per column pair (the AVX2 tile: 8 vpmaddwd + 8 vpaddd for
 * 16 batch rows). */
static inline __attribute__((always_inline)) void tile_group512(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                                const ts_qact *a, int64_t m0, const int NV, float *f) {
    const int64_t mp = a->mp;
    const int32_t *w0 = (const int32_t *)(t->w + gl * 32), *w1 = (const int32_t *)(t->w + CG * 32 + gl * 32);
    const int32_t *w2 = (const int32_t *)(t->w + 2 * CG * 32 + gl * 32), *w3 = (const int32_t *)(t->w + 3 * CG * 32 + gl * 32);
    const int32_t *xq = (const int32_t *)a->q + tiled(g, 0, m0, mp);
    __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const __m512i x0 = _mm512_loadu_si512((const void *)(xq + k * 16));
        const __m512i x1 = NV > 1 ? _mm512_loadu_si512((const void *)(xq + 256 + k * 16)) : x0;
#define TAP(cr0, cr1, wr)                                                  \
    {                                                                      \
        const __m512i b = _mm512_set1_epi32(wr[k]);                        \
        cr0 = _mm512_dpwssd_epi32(cr0, b, x0);                             \
        if (NV > 1) cr1 = _mm512_dpwssd_epi32(cr1, b, x1);                 \
    }
        TAP(c00, c01, w0) TAP(c10, c11, w1) TAP(c20, c21, w2) TAP(c30, c31, w3)
#undef TAP
#if !TS_SIMDE /* (SIMDe's emulated vectors are structs, which no register constraint takes) */
        __asm__("" : "+v"(c00), "+v"(c01), "+v"(c10), "+v"(c11), "+v"(c20), "+v"(c21), "+v"(c30), "+v"(c31));
#endif
    }
    const __m512i c[2][4] = {{c00, c10, c20, c30}, {c01, c11, c21, c31}};
    tile_scale512(t, wt, g, a, m0, NV, c, f);
}

/* Quad k (columns 4k..4k+3 of a group) of the AVX-512 byte tiles (tile_group8_512, tile_group6_512): cRV +=
 * vpdpbusd(weight row R's four codes (wR[k], broadcast), vector V of sixteen batch rows' quads), for the four weight
 * rows and NV (1, 2) vectors (tiled8, from xq); the caller's named sums, as BYTE_QUAD's. */
#if TS_SIMDE /* (SIMDe's emulated vectors are structs, which no register constraint takes) */
#define KEEP512()
#else
#define KEEP512() __asm__("" : "+v"(c00), "+v"(c01), "+v"(c10), "+v"(c11), "+v"(c20), "+v"(c21), "+v"(c30), "+v"(c31));
#endif
#define TAP512(cr0, cr1, wr, k)                                                                              \
    {                                                                                                        \
        const __m512i b = _mm512_set1_epi32(wr[k]);                                                          \
        cr0 = _mm512_dpbusd_epi32(cr0, b, x0);                                                               \
        if (NV > 1) cr1 = _mm512_dpbusd_epi32(cr1, b, x1);                                                   \
    }
#define BYTE_QUAD512(k)                                                                                      \
    {                                                                                                        \
        const __m512i x0 = _mm512_loadu_si512((const void *)(xq + (k) * mp));                                \
        const __m512i x1 = NV > 1 ? _mm512_loadu_si512((const void *)(xq + (k) * mp + 16)) : x0;            \
        TAP512(c00, c01, w0, k) TAP512(c10, c11, w1, k) TAP512(c20, c21, w2, k) TAP512(c30, c31, w3, k)      \
        KEEP512()                                                                                            \
    }

/* The byte tile with AVX-512 VNNI (int8 activations, act8): vpdpbusd multiplies four unsigned bytes by four signed
 * ones and adds them into an int32 lane, so a tile of 4 weight rows x 16 batch rows and one group is 32 vpdpbusd
 * (the int16 tile: 64 vpdpwssd), with no int16 sums to widen.  int4 / int5 codes are unsigned already; int8 codes
 * are stored as code + 128 (widen_codes8), and 128 x the activations' integer sum (q8s) comes back off in int32,
 * so every path gets the same exact integer dots (|sum| <= 32 * 255 * 127). */
static inline __attribute__((always_inline)) void tile_group8_512(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                                  const ts_qact *a, int64_t m0, const int NV, float *f) {
    const int64_t mp = a->mp;
    const uint8_t *w8 = (const uint8_t *)t->w + gl * 32;
    const int32_t *w0 = (const int32_t *)w8, *w1 = (const int32_t *)(w8 + CG * 32);
    const int32_t *w2 = (const int32_t *)(w8 + 2 * CG * 32), *w3 = (const int32_t *)(w8 + 3 * CG * 32);
    const int32_t *xq = (const int32_t *)a->q8 + tiled8(g, 0, m0, mp);
    __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) BYTE_QUAD512(k)
    if (wt == WT_Q8) {
        const int32_t *qs = a->q8s + g * mp + m0;
        const __m512i s0 = _mm512_loadu_si512((const void *)qs), s1 = NV > 1 ? _mm512_loadu_si512((const void *)(qs + 16)) : s0;
        c00 = _mm512_sub_epi32(c00, s0), c10 = _mm512_sub_epi32(c10, s0), c20 = _mm512_sub_epi32(c20, s0), c30 = _mm512_sub_epi32(c30, s0);
        c01 = _mm512_sub_epi32(c01, s1), c11 = _mm512_sub_epi32(c11, s1), c21 = _mm512_sub_epi32(c21, s1), c31 = _mm512_sub_epi32(c31, s1);
    }
    const __m512i c[2][4] = {{c00, c10, c20, c30}, {c01, c11, c21, c31}};
    tile_scale512(t, wt, g, a, m0, NV, c, f);
}

/* The byte tile for int6 codes with AVX-512 VNNI (act8): the unsigned codes (widen_codes8) times the activations'
 * quads with vpdpbusd, four quads (a quarter: 16 columns, one sub-scale) summed onto a->q6t's -32 x the quarter's
 * activation sum (the codes' offset), so each int32 lane holds the quarter's exact (q - 32) x products; one vpmulld
 * by the quarter's sub-scale per weight row and vector (|.| <= 16 x 32 x 127 x 128 per quarter).  A tile of 4
 * weight rows x 16 batch rows and one group: 32 vpdpbusd + 8 vpmulld + 4 vpaddd, where the int16 tile takes 64
 * vpdpwssd. */
static inline __attribute__((always_inline)) void tile_group6_512(const ts_wtile *t, const int wt, int64_t gl, int64_t g,
                                                                  const ts_qact *a, int64_t m0, const int NV, float *f) {
    (void)wt;
    const int64_t mp = a->mp;
    const uint8_t *w8 = (const uint8_t *)t->w + gl * 32;
    const int16_t *sub = t->w + 2 * CG * 32 + gl * 8; /* [quarter][row] */
    const int32_t *w0 = (const int32_t *)w8, *w1 = (const int32_t *)(w8 + CG * 32);
    const int32_t *w2 = (const int32_t *)(w8 + 2 * CG * 32), *w3 = (const int32_t *)(w8 + 3 * CG * 32);
    const int32_t *xq = (const int32_t *)a->q8 + tiled8(g, 0, m0, mp), *tq = a->q6t + 2 * g * mp + m0;
    __m512i c[2][4];
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        const __m512i t0 = _mm512_loadu_si512((const void *)(tq + j * mp));
        const __m512i t1 = NV > 1 ? _mm512_loadu_si512((const void *)(tq + j * mp + 16)) : t0;
        __m512i c00 = t0, c01 = t1, c10 = t0, c11 = t1, c20 = t0, c21 = t1, c30 = t0, c31 = t1;
#pragma GCC unroll 4
        for (int k = 4 * j; k < 4 * j + 4; k++) BYTE_QUAD512(k)
        const __m512i q[2][4] = {{c00, c10, c20, c30}, {c01, c11, c21, c31}};
        for (int r = 0; r < 4; r++) {
            const __m512i sv = _mm512_set1_epi32(sub[4 * j + r]);
            for (int v = 0; v < NV; v++) {
                const __m512i d = _mm512_mullo_epi32(q[v][r], sv);
                c[v][r] = j ? _mm512_add_epi32(c[v][r], d) : d;
            }
        }
    }
    tile_scale512(t, WT_Q6, g, a, m0, NV, c, f);
}
#undef BYTE_QUAD512
#undef TAP512
#undef KEEP512
#define TILE_GROUP tile_group512
#define TILE_GROUP8 tile_group8_512
#define TILE_GROUP6 tile_group6_512
#else
#define TILE_GROUP tile_group
#define TILE_GROUP8 tile_group8
#define TILE_GROUP6 tile_group6
#endif

/* One out-of-line copy per (format, width): inlined into the loops over groups, gcc hoists the 64 weight
 * broadcasts of every group out of the loop over batch rows and spills them (measured 2x slower). */
#define TILE_FN(name, KERNEL, WT, NV)                                                                                \
    static __attribute__((noinline)) void name(const ts_wtile *t, int64_t gl, int64_t g, const ts_qact *a, int64_t m0, \
                                               float *f) { KERNEL(t, WT, gl, g, a, m0, NV, f); }
/* (Q5 widens to int16 codes with the same min term as Q4: it takes Q4's int16 tiles) */
TILE_FN(tile_q4x2, TILE_GROUP, WT_Q4, 2)
TILE_FN(tile_q4x1, TILE_GROUP, WT_Q4, 1)
TILE_FN(tile_q8x2, TILE_GROUP, WT_Q8, 2)
TILE_FN(tile_q8x1, TILE_GROUP, WT_Q8, 1)
TILE_FN(tile_q4a8x2, TILE_GROUP8, WT_Q4, 2)
TILE_FN(tile_q4a8x1, TILE_GROUP8, WT_Q4, 1)
TILE_FN(tile_q5a8x2, TILE_GROUP8, WT_Q5, 2)
TILE_FN(tile_q5a8x1, TILE_GROUP8, WT_Q5, 1)
#if TS_AVX512 /* (AVX2's vpmaddubsw would overflow on int8 codes: there they take the int16 tile) */
TILE_FN(tile_q8a8x2, TILE_GROUP8, WT_Q8, 2)
TILE_FN(tile_q8a8x1, TILE_GROUP8, WT_Q8, 1)
#endif
/* (int6 codes: byte tiles of their own, their sub-scales per quarter) */
TILE_FN(tile_q6a8x2, TILE_GROUP6, WT_Q6, 2)
TILE_FN(tile_q6a8x1, TILE_GROUP6, WT_Q6, 1)
#undef TILE_FN

typedef void (*tile_fn)(const ts_wtile *, int64_t, int64_t, const ts_qact *, int64_t, float *);

/* Whether int8 activations have a byte tile for weights of type wt on this ISA level (tile_group8 for int4 / int5,
 * and int8 with AVX-512 (tile_group8_512); tile_group6 / tile_group6_512 for int6); else they take the int16 tile
 * over the int8 values.  tile_for names the kernels. */
static inline int byte_tile(const int wt) {
    return wt == WT_Q4 || wt == WT_Q5 || wt == WT_Q6 || (TS_AVX512 && wt == WT_Q8);
}

/* The tile for weights of type wt over 2 (x2) or 1 vectors of batch rows: the byte tile with int8 activations where
 * there is one (a8: byte_tile), else the int16 one (Q5 takes Q4's: its codes widen to int16 with the same min term). */
static inline tile_fn tile_for(const int wt, const int a8, const int x2) {
    /* (Q6 widens to int16 values with no min term, as Q8's: it takes Q8's int16 tiles, int8 activations too) */
    if (!a8) return wt == WT_Q8 || wt == WT_Q6 ? (x2 ? tile_q8x2 : tile_q8x1) : (x2 ? tile_q4x2 : tile_q4x1);
#if TS_AVX512
    if (wt == WT_Q8) return x2 ? tile_q8a8x2 : tile_q8a8x1;
#endif
    if (wt == WT_Q6) return x2 ? tile_q6a8x2 : tile_q6a8x1;
    if (wt == WT_Q5) return x2 ? tile_q5a8x2 : tile_q5a8x1;
    return x2 ? tile_q4a8x2 : tile_q4a8x1;
}

/* f[(4i + r) * mp + m] (E, and O, EM, OM: see fsplit) = row r of block b + i . batch row m, for the nb (1..TB) blocks
 * from b (their scales already in t[i]) and every batch row m < mp (a multiple of TW).  Chunks of CG groups: the chunk's
 * codes widened (from L2, where the previous pass prefetched them) into t[i].w, then groups outer, batch rows inner:
 * a tile's activations (16 pairs of TW or 2 TW rows) are read from L2 once and from L1 by the other blocks. */
static void blocks_tile(const ts_weight *W, int64_t b, ts_wtile *t, int nb, const int wt, int64_t K, const ts_qact *a,
                        float *f, const char *pf, int64_t pf_bytes) {
    const int64_t G = K / 32, mp = a->mp, pf_step = (pf_bytes / G + 63) / 64 * 64;
    for (int j = 0; j < (EO_SPLIT ? 2 : 1); j++) memset(f + j * fsplit(mp), 0, sizeof(float) * (size_t)(4 * nb * mp));
    /* Q5 widens whole triples of groups: chunks of 6 groups (within the buffers' CG) */
    const int64_t cg = wt == WT_Q5 ? 6 : CG;
    for (int64_t g0 = 0; g0 < G; g0 += cg) {
        const int64_t g1 = g0 + cg < G ? g0 + cg : G;
        const int a8 = a->act8 && byte_tile(wt);
        const tile_fn x2 = tile_for(wt, a8, 1), x1 = tile_for(wt, a8, 0);
        for (int i = 0; i < nb; i++) {
            if (a8) widen_codes8(W, b + i, K, g0, g1, t + i);
            else widen_codes(W, wt, b + i, K, g0, g1, t + i);
        }
        for (int64_t g = g0; g < g1; g++) {
            /* the next pass's codes into L2 while this one computes: widen_codes then reads them from cache instead
             * of waiting on memory (its loads are the step's only reads of the weights from DRAM) */
            for (int64_t o = g * pf_step; pf && o < (g + 1) * pf_step && o < pf_bytes; o += 64) _mm_prefetch(pf + o, _MM_HINT_T1);
            float *fg = f + (g % 2) * fsplit(mp); /* E or O */
            int64_t m0 = 0;
            for (; m0 + 2 * TW <= mp; m0 += 2 * TW)
                for (int i = 0; i < nb; i++) x2(t + i, g - g0, g, a, m0, fg + 4 * i * mp);
            if (m0 < mp)
                for (int i = 0; i < nb; i++) x1(t + i, g - g0, g, a, m0, fg + 4 * i * mp);
        }
    }
    if (EO_SPLIT) tile_finish(t, nb, wt, G, a, f);
}

static inline void store(float *y, int64_t i, float v, const float *bias, int64_t n, int acc) {
    if (bias) v += bias[n];
    y[i] = acc ? y[i] + v : v;
}

/* t[j][r] = v[r][j]: an 8x8 transpose in registers (unpacks, shuffles, lane permutes: 24 single-uop shuffles). */
static inline void tr8x8(__m256 v[8], __m256 t[8]) {
    for (int r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]);
        t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);
    }
    for (int r = 0; r < 8; r += 4)
        for (int i = 0; i < 2; i++) {
            v[r + 2 * i] = _mm256_shuffle_ps(t[r + i], t[r + 2 + i], 0x44);
            v[r + 2 * i + 1] = _mm256_shuffle_ps(t[r + i], t[r + 2 + i], 0xEE);
        }
    /* v[0..3]: columns {0,4}, {1,5}, {2,6}, {3,7} of rows 0..3 (low / high 128 bits); v[4..7]: rows 4..7 */
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_permute2f128_ps(v[j], v[j + 4], 0x20);
        t[j + 4] = _mm256_permute2f128_ps(v[j], v[j + 4], 0x31);
    }
}

/* y[m0..m0+7, 0..7] (+)= f[r * mp + m] for r < 8 (+ bias[r]), rows below M only: the tiled path's output, eight
 * batch rows by eight columns through an 8x8 transpose (scalar stores with their branches were ~5% of a c=64 step). */
static inline void store8x8(const float *f, int64_t mp, int64_t m0, int64_t M, float *y, int64_t ldy, __m256 bv,
                            int acc) {
    __m256 v[8], t[8];
    for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_ps(f + r * mp + m0);
    tr8x8(v, t);
    for (int j = 0; j < 8 && m0 + j < M; j++) {
        float *o = y + (m0 + j) * ldy;
        __m256 r = _mm256_add_ps(t[j], bv);
        if (acc) r = _mm256_add_ps(r, _mm256_loadu_ps(o));
        _mm256_storeu_ps(o, r);
    }
}

/* y[m, 0..n) (+)= f[r * mp + m] (+ bias[r]) for r < n, m < M: one pass's n output columns (n <= 4 * TB), each
 * batch row's columns written together (a row's run of up to 4 * TB floats, whole cache lines, not eight floats
 * in every row per pair of blocks: those strided partial-line writes were ~10% of a c=64 step). */
static void store_pass(const float *f, int64_t mp, int64_t M, int64_t n, float *y, int64_t ldy, const float *bias,
                       int acc) {
    const int64_t n8 = n / 8 * 8;
    for (int64_t m0 = 0; m0 < M; m0 += 8)
        for (int64_t r0 = 0; r0 < n8; r0 += 8)
            store8x8(f + r0 * mp, mp, m0, M, y + r0, ldy, bias ? _mm256_loadu_ps(bias + r0) : _mm256_setzero_ps(), acc);
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = n8; r < n; r++) store(y, m * ldy + r, f[r * mp + m], bias, r, acc);
}

/* Batch rows from which float weights take the float tiled path (below: the row path, rows4_f).  AVX-512 (32 zmm:
 * an 8 x 32 register block): 1.06x the row path at 16 rows, 1.4-1.5x at 64-128.  AVX2 (16 ymm: a 4 x 16 block, 10
 * loads per 16 FMAs) measured 0.76-0.84x of its row path at 16-128 rows: AVX2 keeps the row path at every size. */
#ifndef FTILE_MIN
#if TS_AVX512
#define FTILE_MIN 16
#else
#define FTILE_MIN (1 << 30)
#endif
#endif

/* The activations' buffers for weights of type wt: int16 codes for quantized weights, a transposed float copy for
 * float weights (used from FTILE_MIN rows). */
static ts_qact qact_alloc(int64_t M, int64_t K, int64_t wt) {
    M = (M + TW - 1) / TW * TW; /* room for the tiled layout's padding rows */
    ts_qact a = {NULL, NULL, NULL, 0, NULL, NULL, 0, NULL, NULL, NULL, NULL};
    if (IS_FLOAT(wt)) {
        if (M >= FTILE_MIN) a.xt = (float *)malloc(sizeof(float) * (size_t)(M * K));
        return a;
    }
    a.q = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    a.d = (float *)malloc(sizeof(float) * (size_t)(M * K / 32));
    a.s = (float *)malloc(sizeof(float) * (size_t)(M * K / 32));
    a.q8 = (int8_t *)malloc((size_t)(M * (K + 32))); /* (written only with act8; a row: its pairs of groups) */
    if (TS_AVX512) {
        a.q8s = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * K / 32));
        a.q8h = (int8_t *)malloc((size_t)(M * K));
        a.q6o = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * K / 16));
    }
    a.q6t = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * K / 16));
    return a;
}

static void qact_free(ts_qact *a) {
    free(a->q), free(a->d), free(a->s), free(a->xt), free(a->q8), free(a->q8s), free(a->q6t), free(a->q8h);
    free(a->q6o);
}

/* ---- float weights, many batch rows: the float tiled path ----
 * The row path above re-reads each block of four weight rows (and re-widens 16-bit ones) for every pair of batch
 * rows and reduces every dot product horizontally: at 16+ rows that is 6 loads per 8 FMAs and a horizontal sum per
 * output.  Here the activations are transposed once ([K][mp], transpose_act) and each block of FRW weight rows is
 * widened to float32 once into a k-major buffer ([K][FRW], widen_fblock), so the micro-kernel broadcasts one weight
 * and multiplies it into TW batch rows at once: FRW x 2 vectors of accumulators in registers for the whole K (16 zmm
 * with AVX-512: 8 weight rows x 32 batch rows, 10 loads per 16 FMAs; AVX2 8 ymm: 4 x 16), with no horizontal sums and
 * no partial sums in memory.  Outputs go through the same row-contiguous store as the quantized tiled path. */
#if TS_AVX512
#define FRW 8
typedef __m512 vfl;
#define VFL_LOAD _mm512_loadu_ps
#define VFL_SET1 _mm512_set1_ps
#define VFL_FMA _mm512_fmadd_ps
#define VFL_STORE _mm512_storeu_ps
#define VFL_ZERO _mm512_setzero_ps
#else
#define FRW 4
typedef __m256 vfl;
#define VFL_LOAD _mm256_loadu_ps
#define VFL_SET1 _mm256_set1_ps
#define VFL_FMA _mm256_fmadd_ps
#define VFL_STORE _mm256_storeu_ps
#define VFL_ZERO _mm256_setzero_ps
#endif
#define FCOLS 32 /* output columns per pass: a batch row's 128 bytes of output written together (store_pass) */

/* a->xt[k * mp + m] = x[m, k], zero for the padding rows M <= m < mp; eight rows by eight columns per transpose. */
static void transpose_act(const float *x, int64_t ldx, int64_t M, int64_t K, ts_qact *a) {
    const int64_t mp = M >= FTILE_MIN ? (M + TW - 1) / TW * TW : 0;
    a->mp = mp;
    for (int64_t m0 = 0; m0 < mp; m0 += 8)
        for (int64_t k0 = 0; k0 < K; k0 += 8) {
            __m256 v[8], t[8];
            for (int i = 0; i < 8; i++)
                v[i] = m0 + i < M ? _mm256_loadu_ps(x + (m0 + i) * ldx + k0) : _mm256_setzero_ps();
            tr8x8(v, t);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(a->xt + (k0 + j) * mp + m0, t[j]);
        }
}

/* wb[k * FRW + r] = W[n0 + r, k] as float32 (rows past N repeat row N - 1: computed, never stored). */
static inline __attribute__((always_inline)) void widen_fblock(const void *w, const int wt, int64_t n0, int64_t N,
                                                               int64_t K, float *wb) {
    int64_t rows[8];
    for (int r = 0; r < FRW; r++) rows[r] = (n0 + r < N ? n0 + r : N - 1) * K;
    for (int64_t k0 = 0; k0 < K; k0 += 8) {
        __m256 v[8], t[8];
        for (int r = 0; r < FRW; r++) v[r] = load8w(w, rows[r] + k0, wt);
#if FRW == 8
        tr8x8(v, t);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(wb + (k0 + j) * 8, t[j]);
#else
        /* four rows: the first steps of tr8x8 leave v[j] = [rows 0..3 of column j | of column j + 4] */
        for (int r = 0; r < 4; r += 2) {
            t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]);
            t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);
        }
        for (int i = 0; i < 2; i++) {
            v[2 * i] = _mm256_shuffle_ps(t[i], t[2 + i], 0x44);
            v[2 * i + 1] = _mm256_shuffle_ps(t[i], t[2 + i], 0xEE);
        }
        float *o = wb + k0 * 4;
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(v[0], v[1], 0x20));      /* columns 0, 1 */
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(v[2], v[3], 0x20));  /* 2, 3 */
        _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(v[0], v[1], 0x31)); /* 4, 5 */
        _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(v[2], v[3], 0x31)); /* 6, 7 */
#endif
    }
}

/* f[r * mp + m0 + m] = row r of the widened block wb . batch row m0 + m, for r < FRW, m < TW * NV. */
static inline __attribute__((always_inline)) void ftile(const float *wb, int64_t K, const ts_qact *a, int64_t m0,
                                                        const int NV, float *f) {
    const int64_t mp = a->mp;
    vfl c[FRW][2];
    for (int r = 0; r < FRW; r++) c[r][0] = c[r][1] = VFL_ZERO();
    const float *xk = a->xt + m0;
    for (int64_t k = 0; k < K; k++, xk += mp) {
        const vfl x0 = VFL_LOAD(xk), x1 = NV > 1 ? VFL_LOAD(xk + TW) : x0;
        const float *wk = wb + k * FRW;
        for (int r = 0; r < FRW; r++) {
            const vfl b = VFL_SET1(wk[r]);
            c[r][0] = VFL_FMA(b, x0, c[r][0]);
            if (NV > 1) c[r][1] = VFL_FMA(b, x1, c[r][1]);
        }
    }
    for (int r = 0; r < FRW; r++)
        for (int j = 0; j < NV; j++) VFL_STORE(f + r * mp + m0 + j * TW, c[r][j]);
}
static __attribute__((noinline)) void ftile2(const float *wb, int64_t K, const ts_qact *a, int64_t m0, float *f) {
    ftile(wb, K, a, m0, 2, f);
}
static __attribute__((noinline)) void ftile1(const float *wb, int64_t K, const ts_qact *a, int64_t m0, float *f) {
    ftile(wb, K, a, m0, 1, f);
}

/* y (+)= x . W^T (+ bias) for float weights from transposed activations (a->mp > 0): passes of FCOLS output columns
 * shared out among the threads, each widening its blocks once and running every batch tile over them. */
static void float_tiled(const ts_weight *W, const float *bias, int64_t M, int64_t N, int64_t K, const ts_qact *a,
                        float *y, int64_t ldy, int accumulate) {
    const int64_t mp = a->mp, npass = (N + FCOLS - 1) / FCOLS;
    float *wb = (float *)malloc(sizeof(float) * (size_t)(FCOLS * K));
    float *f = (float *)malloc(sizeof(float) * (size_t)(FCOLS * mp));
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < npass; p++) {
        const int64_t n0 = p * FCOLS, n = N - n0 < FCOLS ? N - n0 : FCOLS, nb = (n + FRW - 1) / FRW;
        for (int64_t i = 0; i < nb; i++) {
            float *wi = wb + i * FRW * K;
            if (W->wt == WT_BF16) widen_fblock(W->w, WT_BF16, n0 + i * FRW, N, K, wi);
            else if (W->wt == WT_F16) widen_fblock(W->w, WT_F16, n0 + i * FRW, N, K, wi);
            else widen_fblock(W->w, WT_F32, n0 + i * FRW, N, K, wi);
        }
        for (int64_t i = 0; i < nb; i++) {
            int64_t m0 = 0;
            for (; m0 + 2 * TW <= mp; m0 += 2 * TW) ftile2(wb + i * FRW * K, K, a, m0, f + i * FRW * mp);
            if (m0 < mp) ftile1(wb + i * FRW * K, K, a, m0, f + i * FRW * mp);
        }
        store_pass(f, mp, M, n, y + n0, ldy, bias ? bias + n0 : NULL, accumulate);
    }
    free(wb);
    free(f);
}

/* The activations of a linear with weights of type wt: int16-quantized (quantized weights) or transposed (float
 * weights, from FTILE_MIN rows). */
static inline void prep_act(const ts_weight *W, const float *x, int64_t ldx, int64_t M, int64_t K, ts_qact *a) {
    if (IS_FLOAT(W->wt)) transpose_act(x, ldx, M, K, a);
    else quantize_act(x, ldx, M, K, a, W->act8,
                      W->act8 && W->wt == WT_Q4   ? TILE_MIN8
                      : TS_AVX512 && W->act8 && W->wt == WT_Q8 ? TILE_MIN8_Q8
                      : W->act8 && W->wt == WT_Q5 ? TILE_MIN5_A8
                      : W->act8 && W->wt == WT_Q6 ? TILE_MIN6_A8
                      : W->wt == WT_Q6            ? TILE_MIN6
                                                  : TILE_MIN,
                      W->wt == WT_Q6 || (W->tail && W->tail->wt == WT_Q6));
}

/* The float row path: blocks of four weight rows shared out among the threads, two batch rows per pass over them. */
static inline __attribute__((always_inline)) void rows_f(const void *w, const int wt, const float *bias, int64_t M,
                                                         int64_t N, int64_t K, const float *x, int64_t ldx, float *y,
                                                         int64_t ldy, int accumulate) {
    const int64_t nblk = N / 4;
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n = b * 4;
        for (int64_t m = 0; m < M; m += 2) {
            float o0[4], o1[4] = {0, 0, 0, 0};
            const float *x1 = m + 1 < M ? x + (m + 1) * ldx : NULL;
            rows4_f(w, wt, n, K, x + m * ldx, x1, o0, o1);
            for (int r = 0; r < 4; r++) {
                store(y, m * ldy + n + r, o0[r], bias, n + r, accumulate);
                if (x1) store(y, (m + 1) * ldy + n + r, o1[r], bias, n + r, accumulate);
            }
        }
    }
#pragma omp for schedule(static) nowait
    for (int64_t n = nblk * 4; n < N; n++)
        for (int64_t m = 0; m < M; m++) store(y, m * ldy + n, row1_f(w, wt, n, K, x + m * ldx), bias, n, accumulate);
}

/* y[m, n] (+)= sum_k x[m, k] W[n, k] (+ bias[n]), for m < M, n < N; K % 8 == 0 (K % 32 == 0 quantized).
 * Each block of four weight rows is read from memory once and stays in L1 for every batch row.  Quantized
 * weights have N padded to a multiple of 4 (padding rows are computed, never stored) and read x as its int16
 * quantization `a`.  Runs inside a parallel region: the blocks are shared out by an orphaned `omp for`, and y is
 * complete after the barrier `bar` that ends it. */
static void linear_body(const float *x, int64_t ldx, int64_t M, const ts_weight *W, const float *bias, int64_t N,
                        int64_t K, float *y, int64_t ldy, int accumulate, const ts_qact *a, ts_barrier *bar) {
#ifdef SKIP_LINEAR /* benchmarks: the fixed cost of a step without its weight streaming */
    if (W->wt != WT_F32) { bar_wait(bar); return; }
#endif
    if (W->tail) { /* rows [0, n_head) in this weight's format, the rest in the tail's (each call ends on the barrier) */
        ts_weight head = *W;
        head.tail = NULL;
        linear_body(x, ldx, M, &head, bias, W->n_head, K, y, ldy, accumulate, a, bar);
        linear_body(x, ldx, M, W->tail, bias ? bias + W->n_head : NULL, N - W->n_head, K, y + W->n_head, ldy,
                    accumulate, a, bar);
        return;
    }
    if (IS_FLOAT(W->wt)) {
        if (a->mp) float_tiled(W, bias, M, N, K, a, y, ldy, accumulate);
        else if (W->wt == WT_BF16) rows_f(W->w, WT_BF16, bias, M, N, K, x, ldx, y, ldy, accumulate);
        else if (W->wt == WT_F16) rows_f(W->w, WT_F16, bias, M, N, K, x, ldx, y, ldy, accumulate);
        else rows_f(W->w, WT_F32, bias, M, N, K, x, ldx, y, ldy, accumulate);
        bar_wait(bar);
        return;
    }
    const int64_t nblk = (N + 3) / 4;
    if (a->mp) {
        const int64_t G = K / 32;
        ts_wtile t[TB];
        for (int i = 0; i < TB; i++)
            t[i] = (ts_wtile){(int16_t *)malloc(sizeof(int16_t) * (size_t)(4 * CG * 32)),
                              (float *)malloc(sizeof(float) * (size_t)(G * 4)), (float *)malloc(sizeof(float) * (size_t)(G * 4))};
        float *f = (float *)malloc(sizeof(float) * (size_t)(4 * TB * a->mp + fsplit(a->mp)));
        /* guided, not static: the passes are equal work, but a vCPU of a shared host (or a core the API server
         * process wakes on) runs slower for a while, and static shares made the other thread wait for it at the
         * barrier.  Served 1.7B-shaped Q4_1 file, 2-core AVX2 EPYC, bench.serve 32 x 48 tokens at 16 clients,
         * builds alternated three times: static 25.2 / 23.6 / 26.9 tok/s greedy (28.6 median random), guided
         * 27.0 / 28.9 / 28.1 (32.1); ITL p50 485 -> 454 ms.  Guided hands out contiguous runs of passes, so the
         * prefetch of the next pass (blocks_tile's pf) mostly reads this thread's own next pass.  (The row path
         * below: guided too, see there.) */
#pragma omp for schedule(guided) nowait
        for (int64_t b = 0; b < nblk; b += TB) { /* TB blocks (4 * TB weight rows) per pass over the activations */
            const int nb = nblk - b < TB ? (int)(nblk - b) : TB;
            for (int i = 0; i < nb; i++) widen_scales(W, (int)W->wt, b + i, K, t + i);
            const int64_t blk = block_bytes(W->wt, K), next = b + TB < nblk ? (nblk - b - TB < TB ? nblk - b - TB : TB) : 0;
            blocks_tile(W, b, t, nb, (int)W->wt, K, a, f, next ? (const char *)W->w + (b + TB) * blk : NULL, next * blk);
            const int64_t n = N - 4 * b < 4 * nb ? N - 4 * b : 4 * nb; /* the last block's padding rows are not stored */
            store_pass(f, a->mp, M, n, y + 4 * b, ldy, bias ? bias + 4 * b : NULL, accumulate);
        }
        for (int i = 0; i < TB; i++) { free(t[i].w); free(t[i].sc); free(t[i].mn); }
        free(f);
        bar_wait(bar);
        return;
    }
    /* guided, in runs of at least 8 blocks, for the same reason as the tiled path's: the decoder's step in process,
     * schedules alternated step by step in one process (omp_set_schedule), AVX-512 EPYC: the 1.7B Q4_K_M file at one
     * row 0.94-0.97x static's time, the default model (int4) 0.98-0.99x at one row and 0.93x at four; dynamic
     * chunks of 32 or 64 blocks 1.0-1.2x (an AVX2 EPYC had measured guided and static the same). */
#pragma omp for schedule(guided, 8) nowait
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n = b * 4;
        float o[MT * 4];
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = M - m0 < MT ? M - m0 : MT;
            /* a literal weight type per call: the format branches fold away inside the loops */
            if (mt == 1 && W->wt == WT_Q8) BLOCK_Q1(W, WT_Q8, b, K, a, m0, o);
            /* Q5: AVX2 row kernels in every build (int8 activations: the int16 kernels over their values) */
            else if (mt == 1 && W->wt == WT_Q5) block_q1_q5(W, b, K, a, m0, o);
#if TS_AVX512 /* int6: its byte kernel at every batch size and activation type; int4 with int8 activations: the
               * int16 row path over their values (same results; a byte row kernel not measured) */
            else if (W->wt == WT_Q6) block_q6_512(W, b, K, a, m0, mt, o);
#else
            else if (a->act8 && W->wt == WT_Q6 && mt == 1) block_q_a8(W, WT_Q6, b, K, a, m0, 1, o);
            else if (a->act8 && W->wt == WT_Q6) block_q_a8(W, WT_Q6, b, K, a, m0, mt, o);
            else if (a->act8 && W->wt == WT_Q4 && mt == 1) block_q_a8(W, WT_Q4, b, K, a, m0, 1, o);
            else if (a->act8 && W->wt == WT_Q4) block_q_a8(W, WT_Q4, b, K, a, m0, mt, o);
            else if (mt == 1 && W->wt == WT_Q6) block_q1(W, WT_Q6, b, K, a, m0, o);
            else if (TS_BATCH_INVARIANT && !a->act8 && W->wt == WT_Q6) block_q_inv(W, WT_Q6, b, K, a, m0, mt, o);
            else if (W->wt == WT_Q6) block_q(W, WT_Q6, b, K, a, m0, mt, o);
#endif
            else if (TS_BATCH_INVARIANT && !a->act8 && W->wt == WT_Q8) block_q_inv(W, WT_Q8, b, K, a, m0, mt, o);
            else if (TS_BATCH_INVARIANT && !a->act8 && W->wt == WT_Q5) block_q_inv(W, WT_Q5, b, K, a, m0, mt, o);
            else if (TS_BATCH_INVARIANT && !a->act8) block_q_inv(W, WT_Q4, b, K, a, m0, mt, o);
            else if (W->wt == WT_Q5) block_q_q5(W, b, K, a, m0, mt, o);
            else if (mt == 1) BLOCK_Q1(W, WT_Q4, b, K, a, m0, o);
            else if (W->wt == WT_Q8) BLOCK_Q(W, WT_Q8, b, K, a, m0, mt, o);
            else BLOCK_Q(W, WT_Q4, b, K, a, m0, mt, o);
            for (int64_t m = 0; m < mt; m++)
                for (int r = 0; r < 4 && n + r < N; r++) store(y, (m0 + m) * ldy + n + r, o[m * 4 + r], bias, n + r, accumulate);
        }
    }
    bar_wait(bar);
}

void ts_linear(const float *x, int64_t ldx, int64_t M, const ts_weight *W, const float *bias, int64_t N, int64_t K,
               float *y, int64_t ldy, int accumulate) {
    ts_qact a = qact_alloc(M, K, W->wt);
    prep_act(W, x, ldx, M, K, &a);
    ts_barrier bar = {0};
#pragma omp parallel
    {
        bar_join(&bar);
        linear_body(x, ldx, M, W, bias, N, K, y, ldy, accumulate, &a, &bar);
    }
    qact_free(&a);
}

/* out[m] = weight * x[m] / sqrt(mean(x[m]^2) + eps), in float32 like transformers. */
void ts_rmsnorm(const float *x, int64_t M, int64_t K, const float *weight, float eps, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        __m256 s = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            s = _mm256_fmadd_ps(v, v, s);
        }
        const float r = 1.0f / sqrtf(hsum8(s) / (float)K + eps);
        for (int64_t k = 0; k < K; k++) out[m * K + k] = weight[k] * (xr[k] * r);
    }
}

/* act = silu(gate) * up, silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never overflows):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below.  Vectorised: libm's scalar expf was ~3% of a c=64 step. */
static void silu_mul(const float *gu, int64_t M, int64_t I, float *act) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = act + m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_neg(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE in place on nh heads of one token: v[h, :D/2], v[h, D/2:]. */
static void rope(float *v, int64_t nh, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < nh; h++) {
        float *a = v + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/* Eight float vectors -> one: lane j holds the sum of v[j]'s lanes (eight dot products reduced at once). */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight cache values from row p (float32 or, HALF, float16: llama.cpp's default KV type). */
static inline __attribute__((always_inline)) __m256 ldkv(const void *p, int64_t i, const int HALF) {
    return HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* n values (a multiple of 8) into the cache, rounded to float16 when half. */
static inline void store_kv(void *dst, const float *src, int64_t n, int64_t half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

/* Positions ahead whose K rows the score pass prefetches: the rows of a sequence's positions lie in its blocks
 * wherever the allocator put them, so the hardware prefetchers do not follow them from block to block, and every
 * row was a wait on memory (perf: most of the attention's samples on the first load of a row).  Into L2
 * (ATTN_HINT, prefetcht1), not L1: with prefetcht0 the prefetches themselves stalled (perf: 18% of the samples on
 * the instruction after one, the L1's miss buffers full); an item's first ATTN_PF positions' K rows and first
 * ATTN_PC's V rows are asked for as it starts (they were demand misses).  bench.attention, the default model's
 * shape (9 / 3 heads), 64 tokens x 104 positions of a float16 cache, AVX-512 EPYC: 9.0 -> 14.9 GB/s (T2 alike,
 * NTA none, twice the distance slower); the default model's decode step at 64 rows 0.91x the time, at 16 0.93x,
 * at 1 the same. */
#ifndef ATTN_HINT
#define ATTN_HINT _MM_HINT_T1
#endif
/* a position's rows of an item's KV heads (run bytes from p) asked for (always inlined: left as a call inside the
 * score pass, the 135M shape's attention ran 1.8x slower) */
static inline __attribute__((always_inline)) void attn_prefetch(const char *p, int64_t run) {
    for (int64_t off = 0; off < run; off += 64) _mm_prefetch(p + off, ATTN_HINT);
}
#ifndef ATTN_PF
#define ATTN_PF 16
#endif

/* out[d0..d0+8*NV) (+)= w[p] * V[p][d0..] over positions p0 <= p < p1 (the value rows at rows[p] + roff): the sum
 * starts from out's values unless first, and is scaled by inv when last (a value pass in runs of positions, the sum
 * carried in out between runs: the same float operations in the same order as one run).  NV accumulators live in
 * registers (NV a literal at each call). */
static inline __attribute__((always_inline)) void weighted_rows(const char *const *rows, int64_t roff, const float *w,
                                                                int64_t p0, int64_t p1, int64_t d0, int NV, int first,
                                                                int last, float inv, float *out, const int HALF) {
    __m256 acc[8];
    const int64_t off = roff + d0 * (HALF ? 2 : 4);
    for (int j = 0; j < NV; j++) acc[j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + d0 + 8 * j);
    for (int64_t p = p0; p < p1; p++) {
        const __m256 pw = _mm256_set1_ps(w[p]);
        for (int j = 0; j < NV; j++) acc[j] = _mm256_fmadd_ps(pw, ldkv(rows[p] + off, 8 * j, HALF), acc[j]);
    }
    for (int j = 0; j < NV; j++)
        _mm256_storeu_ps(out + d0 + 8 * j, last ? _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)) : acc[j]);
}

#if TS_AVX512
/* The V pass for GB query heads that share a KV head (GQA), AVX-512, over positions p0 <= p < p1 (first / last as
 * in weighted_rows): out_g[d0..d0+16*NV) (+)= w[g * ldw + p] * V[p][d0..], each V row read and widened once for all
 * GB heads (weighted_rows, once per head, read and widened it G times).  GB * NV accumulators + NV rows in zmm
 * registers (GB, NV literals at each call). */
static inline __attribute__((always_inline)) void weighted_rows_heads(const char *const *rows, int64_t roff,
                                                                      const float *w, int64_t ldw, int64_t p0,
                                                                      int64_t p1, int64_t d0, const int NV, const int GB,
                                                                      int first, int last, const float *inv,
                                                                      float *out, int64_t lds, const int HALF) {
    __m512 acc[16];
    const int64_t off = roff + d0 * (HALF ? 2 : 4);
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < NV; j++)
            acc[g * NV + j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + g * lds + d0 + 16 * j);
    for (int64_t p = p0; p < p1; p++) {
        __m512 v[4];
        for (int j = 0; j < NV; j++)
            v[j] = HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rows[p] + off) + j))
                        : _mm512_loadu_ps((const float *)(rows[p] + off) + 16 * j);
        for (int g = 0; g < GB; g++) {
            const __m512 pw = _mm512_set1_ps(w[g * ldw + p]);
            for (int j = 0; j < NV; j++) acc[g * NV + j] = _mm512_fmadd_ps(pw, v[j], acc[g * NV + j]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < NV; j++) {
            const __m512 r = acc[g * NV + j];
            _mm512_storeu_ps(out + g * lds + d0 + 16 * j, last ? _mm512_mul_ps(r, _mm512_set1_ps(inv[g])) : r);
        }
}

/* Every query head of one KV head over positions p0..p1: heads in groups of up to four, 64 dims (or 16) per pass. */
static inline __attribute__((always_inline)) void v_pass_heads(const char *const *rows, int64_t roff, const float *w,
                                                               int64_t ldw, int64_t p0, int64_t p1, int first, int last,
                                                               int64_t G, const float *inv, float *out, int64_t lds,
                                                               int64_t D, const int HALF) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gb = G - g0 < 4 ? G - g0 : 4;
        const float *wg = w + g0 * ldw, *ig = inv + g0;
        float *og = out + g0 * lds;
        int64_t d0 = 0;
#define VPASS(NV)                                                                                               \
    switch (gb) {                                                                                               \
    case 1: weighted_rows_heads(rows, roff, wg, ldw, p0, p1, d0, NV, 1, first, last, ig, og, lds, HALF); break;  \
    case 2: weighted_rows_heads(rows, roff, wg, ldw, p0, p1, d0, NV, 2, first, last, ig, og, lds, HALF); break;  \
    case 3: weighted_rows_heads(rows, roff, wg, ldw, p0, p1, d0, NV, 3, first, last, ig, og, lds, HALF); break;  \
    default: weighted_rows_heads(rows, roff, wg, ldw, p0, p1, d0, NV, 4, first, last, ig, og, lds, HALF); break; \
    }
        for (; d0 + 64 <= D; d0 += 64) VPASS(4)
        for (; d0 + 16 <= D; d0 += 16) VPASS(1)
#undef VPASS
        for (; d0 < D; d0 += 8) /* a last 8 dims (D = 16k + 8) */
            for (int64_t g = 0; g < gb; g++)
                weighted_rows(rows, roff, wg + g * ldw, p0, p1, d0, 1, first, last, ig[g], og + g * lds, HALF);
    }
}
#endif

/* KV heads per work item of the decode attention (at most; see attn_impl), and positions per run of its value pass.
 * ts_attn_decode, 16 tokens x 200 positions of a float16 cache, 32 KV heads of 64 dims: items of 8 heads 13.6 GB/s,
 * 16 15.2, 32 (a token's whole rows) 19.5; runs of 8 or 16 positions alike, 32 slower (the run's rows outgrow L1). */
#ifndef ATTN_HB
#define ATTN_HB 64
#endif
#ifndef ATTN_PC
#define ATTN_PC 16
#endif
/* Positions per chunk (at least: at most ATTN_MAXCH chunks) of a long sequence's attention in a step of few
 * tokens: a sequence of L > ATTN_CH positions is split into equal chunks, each a work item of its own (split-K,
 * "flash decoding"), whose partial results (the chunk's unnormalized value sums, its maximum score and sum of
 * weights) are then combined.  One long sequence (one client, a long chat) otherwise gave the threads one item per
 * KV head: a model with three KV heads kept one of two threads idle a third of the time, a 1.7B model's 32 read
 * 10 GB/s.  Only steps of at most ATTN_SPLIT tokens per thread are split (a larger step has items enough, and a
 * 512-token prompt chunk's partial results would take tens of MB), and never in the batch-invariant build (the
 * split, which changes the rounding, would depend on the step).  Within a split step the chunks are a function of
 * L alone. */
#ifndef ATTN_CH
#define ATTN_CH 256
#endif
#ifndef ATTN_MAXCH
#define ATTN_MAXCH 64
#endif
#ifndef ATTN_SPLIT
#define ATTN_SPLIT 4
#endif
/* Runs of a prompt chunk's tokens (see attn_run): ATTN_RUNROWS query rows (tokens x query heads per KV head) at
 * most, positions in chunks of ATTN_KC, a run's first token attending to ATTN_RUNMIN positions at least (shorter, the
 * masked half of a run's last chunk cost more than the sharing saved: a 16-token prompt of the 1.7B shape 1.5x
 * slower with runs from its first token).  Runs of 32 / 48 / 64 / 96 rows and chunks of 32 / 64 / 128 positions
 * measured within the noise of each other, except on the 1.7B shape (no GQA), whose items (one KV head each) read
 * 128 bytes of each 4 KB position: runs of 16 rows 0.67-0.77x the speed of 48. */
#ifndef ATTN_RUNROWS
#define ATTN_RUNROWS 48
#endif
#ifndef ATTN_KC
#define ATTN_KC 64
#endif
#ifndef ATTN_RUNMIN
#define ATTN_RUNMIN 32
#endif

/* Positions per chunk of a split sequence of L positions (a multiple of 8) and the number of chunks. */
static inline int64_t attn_chunk_len(int64_t L) {
    int64_t n = L > ATTN_CH ? (L + ATTN_CH - 1) / ATTN_CH : 1;
    if (n > ATTN_MAXCH) n = ATTN_MAXCH;
    return ((L + n - 1) / n + 7) / 8 * 8;
}
static inline int64_t attn_chunks(int64_t L) {
    const int64_t c = attn_chunk_len(L);
    return L > c ? (L + c - 1) / c : 1;
}

/* A step's attention plan, the same for every layer: per token its first chunk's index among all tokens' chunks
 * (nck[T]: their count) and the offset of its partial results in part (per chunk and query head: D value sums, the
 * chunk's maximum score and its sum of weights); part NULL where no sequence is split (see ATTN_CH).  run: the
 * step's runs (see attn_run; nrun of them), each its first token and its length; a token in a run has no chunk. */
typedef struct {
    int64_t *nck, *poff;
    float *part;
    int64_t nrun, *run;
} attn_plan;

/* Token b continues token a's sequence: one position more, over the same blocks. */
static inline int attn_next(const int64_t *seq_lens, const int64_t *block_ids, int64_t nb, int64_t bs, int64_t a,
                            int64_t b) {
    return seq_lens[b] == seq_lens[a] + 1 &&
           !memcmp(block_ids + a * nb, block_ids + b * nb, sizeof(int64_t) * (size_t)((seq_lens[b] + bs - 1) / bs));
}

static attn_plan attn_plan_make(const int64_t *seq_lens, const int64_t *block_ids, int64_t nb, int64_t bs, int64_t T,
                                int64_t H, int64_t Hkv, int64_t D) {
    const int threads = omp_get_max_threads(), split = !TS_BATCH_INVARIANT && T <= ATTN_SPLIT * threads;
    /* tokens per run: at most ATTN_RUNROWS query rows, and few enough that the runs' items (one per run and KV
     * head) give every thread several */
    int64_t qb = ATTN_RUNROWS / (H / Hkv);
    while (qb > 2 && T / qb * Hkv < 4 * threads) qb /= 2;
    const int runs = !TS_BATCH_INVARIANT && !split && qb >= 2;
    attn_plan pl = {(int64_t *)malloc(sizeof(int64_t) * (size_t)(4 * T + 1)), NULL, NULL, 0, NULL};
    pl.poff = pl.nck + T + 1;
    pl.run = pl.poff + T;
    pl.nck[0] = 0;
    int64_t po = 0, left = 0; /* left: tokens of the current run after this one */
    for (int64_t t = 0; t < T; t++) {
        if (runs && left == 0 && seq_lens[t] >= ATTN_RUNMIN) {
            int64_t n = 1;
            while (t + n < T && n < qb && attn_next(seq_lens, block_ids, nb, bs, t + n - 1, t + n)) n++;
            if (n >= 2) {
                pl.run[2 * pl.nrun] = t, pl.run[2 * pl.nrun + 1] = n, pl.nrun++;
                left = n;
            }
        }
        const int64_t c = left ? 0 : split ? attn_chunks(seq_lens[t]) : 1;
        if (left) left--;
        pl.nck[t + 1] = pl.nck[t] + c;
        pl.poff[t] = po;
        if (c > 1) po += c * H * (D + 2);
    }
    if (po) pl.part = (float *)malloc(sizeof(float) * (size_t)po);
    return pl;
}

static void attn_plan_free(attn_plan *pl) {
    free(pl->nck);
    free(pl->part);
}

/* One work item: query heads of KV heads h0..h0+hn-1 of one token (query row qt) over its positions c0..c1-1 (the
 * token's block table bt).  The K and V row addresses of every position first (one walk of the block table, no
 * division per position), then the scores eight positions at a time for each of its query heads (eight dot
 * products reduced together, not one horizontal sum each), a vectorised softmax per query head, and the weighted
 * sums of V rows in runs of ATTN_PC positions, every head's run over the same rows (in L1) before the next run,
 * the sums carried in the output between runs, up to 64 dims of accumulators in registers.
 * part NULL (the whole sequence): the attention of query head (h0 + i) * G + g at o + ((h0 + i) * G + g) * D.
 * Else a chunk's partial results: the head's unnormalized sums at part + k * (D + 2) (k its query head), its
 * maximum score and sum of weights after them. */
static inline __attribute__((always_inline)) void attn_item(const float *qt, const char *kc, const char *vc,
                                                            const int64_t *bt, int64_t bs, int64_t tok, int64_t h0,
                                                            int64_t hn, int64_t G, int64_t D, int64_t c0, int64_t c1,
                                                            float scale, float *o, float *part, const int HALF) {
    const int64_t esz = HALF ? 2 : 4, hd = D * esz, nq = hn * G;
    const int64_t L = c1 - c0, L8 = (L + 7) / 8 * 8, run = hn * hd; /* bytes of a position's rows */
    /* scores padded to a multiple of 8 (the padding scores -inf: weight 0) per query head, then its weights,
     * and its softmax's 1 / sum; the rows of KV head h0 at every position (head h0 + i: + i * hd) */
    float *sc = (float *)malloc(sizeof(float) * (size_t)(nq * L8 + nq)), *inv = sc + nq * L8;
    const char **krow = (const char **)malloc(sizeof(char *) * (size_t)(2 * L8));
    const char **vrow = krow + L8;
    for (int64_t p = 0, i = c0 / bs, j0 = c0 % bs; p < L; i++, j0 = 0)
        for (int64_t j = j0; j < bs && p < L; j++, p++) {
            const int64_t off = ((bt[i] * bs + j) * tok + h0 * D) * esz;
            krow[p] = kc + off;
            vrow[p] = vc + off;
        }
    for (int64_t p = L; p < L8; p++) krow[p] = krow[0];
    /* the first rows (the passes ask for those further on) */
    for (int64_t p = 0; p < ATTN_PF && p < L; p++) attn_prefetch(krow[p], run);
    for (int64_t p = 0; p < ATTN_PC && p < L; p++) attn_prefetch(vrow[p], run);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t p0 = 0; p0 < L8; p0 += 8) {
        /* the K rows ATTN_PF positions ahead.  (The V rows are the value pass's to prefetch: asked for into L2
         * here, a whole score pass early, a token's 800 KB of them at 200 positions (1.7B) outran L2, 1.2x
         * slower.) */
        for (int64_t p = p0; p + ATTN_PF < L && p < p0 + 8; p++) attn_prefetch(krow[p + ATTN_PF], run);
        for (int64_t i = 0; i < hn; i++)
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qt + ((h0 + i) * G + g) * D;
                __m256 a[8];
                for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + d);
                    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(ldkv(krow[p0 + j] + i * hd, d, HALF), qv, a[j]);
                }
                __m256 s = _mm256_mul_ps(sum8(a), vscale);
                if (p0 + 8 > L) { /* the padding lanes */
                    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
                    s = _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY),
                                         _mm256_cmp_ps(lane, _mm256_set1_ps((float)(L - p0)), _CMP_GE_OQ));
                }
                _mm256_storeu_ps(sc + (i * G + g) * L8 + p0, s);
            }
    }
    float *dst = part ? part + h0 * G * (D + 2) : o + h0 * G * D; /* query head (h0 + i) * G + g at dst + (i * G + g) * lds */
    const int64_t lds = part ? D + 2 : D;
    for (int64_t k = 0; k < nq; k++) {
        float *sg = sc + k * L8;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (int64_t p0 = 0; p0 < L8; p0 += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + p0));
        const float m = hmax8(vmax);
        const __m256 mx = _mm256_set1_ps(m);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t p0 = 0; p0 < L8; p0 += 8) {
            const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sg + p0), mx));
            vsum = _mm256_add_ps(vsum, e);
            _mm256_storeu_ps(sg + p0, e);
        }
        const float sum = hsum8(vsum);
        inv[k] = part ? 1.0f : 1.0f / sum; /* (a chunk's sums stay unnormalized: the combination scales them) */
        if (part) dst[k * lds + D] = m, dst[k * lds + D + 1] = sum;
    }
    for (int64_t p0 = 0; p0 < L; p0 += ATTN_PC) {
        const int64_t p1 = p0 + ATTN_PC < L ? p0 + ATTN_PC : L;
        const int first = p0 == 0, last = p1 == L;
        for (int64_t p = p1; p < p1 + ATTN_PC && p < L; p++) /* the next run's rows (nothing asked for them before) */
            attn_prefetch(vrow[p], run);
        for (int64_t i = 0; i < hn; i++) {
#if TS_AVX512
            v_pass_heads(vrow, i * hd, sc + i * G * L8, L8, p0, p1, first, last, G, inv + i * G, dst + i * G * lds, lds,
                         D, HALF);
#else
            for (int64_t g = 0; g < G; g++) {
                const int64_t k = i * G + g;
                const float *w = sc + k * L8;
                float *og = dst + k * lds;
                int64_t d0 = 0;
                for (; d0 + 64 <= D; d0 += 64) weighted_rows(vrow, i * hd, w, p0, p1, d0, 8, first, last, inv[k], og, HALF);
                for (; d0 + 32 <= D; d0 += 32) weighted_rows(vrow, i * hd, w, p0, p1, d0, 4, first, last, inv[k], og, HALF);
                for (; d0 < D; d0 += 8) weighted_rows(vrow, i * hd, w, p0, p1, d0, 1, first, last, inv[k], og, HALF);
            }
#endif
        }
    }
    free(krow);
    free(sc);
}

/* ---- prompt attention: runs of a sequence's consecutive tokens ----
 * A prompt chunk's tokens attend to the same positions (token j of a run to one more than token j - 1), so a run of
 * them can share each K and V row: per KV head, a run's query rows (its tokens x the KV head's query heads) against
 * a chunk of ATTN_KC positions at a time is two small matrix products, S = K Q^T and O^T += V^T P, with an online
 * softmax between them (flash attention's running maximum and sum per query row).  Token by token (attn_item) every
 * row was read and widened once per token and each of its values fed one FMA per query head; here a widened row in
 * L1 feeds every query row of the run, and the products run as register tiles (mk_tile: 6 x 16 outputs, 12 FMAs
 * per 8 loads).  Runs are formed per step (attn_plan_make) in the default build where the step is not split. */

/* C[i][0 .. 8 NR) for i < NI (row stride ldc) = C * alpha (alpha NULL: 0) + sum over x < X of A[i * sai + x * sax]
 * B[x][0 .. 8 NR) (row stride ldb): a register tile of NI x NR vectors (NI, NR literals at each call). */
static inline __attribute__((always_inline)) void mk_tile(const float *A, int64_t sai, int64_t sax, const float *B,
                                                          int64_t ldb, int64_t X, float *C, int64_t ldc,
                                                          const float *alpha, const int NI, const int NR) {
    __m256 c[6][2];
    for (int i = 0; i < NI; i++)
        for (int j = 0; j < NR; j++)
            c[i][j] = alpha ? _mm256_mul_ps(_mm256_loadu_ps(C + i * ldc + 8 * j), _mm256_loadu_ps(alpha + 8 * j))
                            : _mm256_setzero_ps();
    for (int64_t x = 0; x < X; x++) {
        const __m256 b0 = _mm256_loadu_ps(B + x * ldb), b1 = NR > 1 ? _mm256_loadu_ps(B + x * ldb + 8) : b0;
        for (int i = 0; i < NI; i++) {
            const __m256 a = _mm256_broadcast_ss(A + i * sai + x * sax);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            if (NR > 1) c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    for (int i = 0; i < NI; i++)
        for (int j = 0; j < NR; j++) _mm256_storeu_ps(C + i * ldc + 8 * j, c[i][j]);
}

/* C[I][R8] (row stride R8; R8 a multiple of 8) = C * alpha (NULL: 0) + A B, A[i][x] at A + i * sai + x * sax,
 * B[X][R8] */
static void mk_product(const float *A, int64_t sai, int64_t sax, int64_t I, const float *B, int64_t X, int64_t R8,
                       float *C, const float *alpha) {
    for (int64_t r0 = 0; r0 < R8; r0 += 16) {
        const int two = R8 - r0 >= 16;
        const float *al = alpha ? alpha + r0 : NULL;
        int64_t i0 = 0;
        for (; i0 + 6 <= I; i0 += 6) {
            if (two) mk_tile(A + i0 * sai, sai, sax, B + r0, R8, X, C + i0 * R8 + r0, R8, al, 6, 2);
            else mk_tile(A + i0 * sai, sai, sax, B + r0, R8, X, C + i0 * R8 + r0, R8, al, 6, 1);
        }
#define MK_REST(NI)                                                                                     \
    case NI:                                                                                            \
        if (two) mk_tile(A + i0 * sai, sai, sax, B + r0, R8, X, C + i0 * R8 + r0, R8, al, NI, 2);       \
        else mk_tile(A + i0 * sai, sai, sax, B + r0, R8, X, C + i0 * R8 + r0, R8, al, NI, 1);           \
        break;
        switch (I - i0) {
            MK_REST(1)
            MK_REST(2)
            MK_REST(3)
            MK_REST(4)
            MK_REST(5)
        default: break;
        }
#undef MK_REST
    }
}

/* One run item: tokens t0 .. t0 + n - 1 of one sequence (token j attends to positions 0 .. L0 + j - 1; block table
 * bt), the G query heads of KV head h.  Query row r = j * G + g (query head h * G + g of token t0 + j). */
static inline __attribute__((always_inline)) void attn_run(const float *q, int64_t ldq, const char *kc, const char *vc,
                                                           const int64_t *bt, int64_t bs, int64_t tok, int64_t h,
                                                           int64_t G, int64_t D, int64_t L0, int64_t n, float scale,
                                                           float *out, int64_t ldo, const int HALF) {
    const int64_t esz = HALF ? 2 : 4, R = n * G, R8 = (R + 7) / 8 * 8, L = L0 + n - 1, KC = ATTN_KC;
    float *kf = (float *)malloc(sizeof(float) * (size_t)(2 * KC * D + KC * R8 + 2 * D * R8 + 3 * R8));
    float *vf = kf + KC * D, *s = vf + KC * D, *qt = s + KC * R8, *ot = qt + D * R8, *m = ot + D * R8, *l = m + R8,
          *alpha = l + R8;
    const char *krow[ATTN_KC], *vrow[ATTN_KC];
    /* Q^T, scaled (the padding rows zero: their scores 0, never read back) */
    memset(qt, 0, sizeof(float) * (size_t)(D * R8));
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < G; g++) {
            const float *qr = q + j * ldq + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) qt[d * R8 + j * G + g] = qr[d] * scale;
        }
    memset(ot, 0, sizeof(float) * (size_t)(D * R8));
    for (int64_t r = 0; r < R8; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t p0 = 0; p0 < L; p0 += KC) {
        const int64_t kn = L - p0 < KC ? L - p0 : KC;
        for (int64_t k = 0; k < kn; k++) {
            const int64_t p = p0 + k, off = ((bt[p / bs] * bs + p % bs) * tok + h * D) * esz;
            krow[k] = kc + off;
            vrow[k] = vc + off;
        }
        for (int64_t k = 0; k < kn; k++) /* the chunk's rows widened once (float32: copied) for every query row */
            for (int64_t d = 0; d < D; d += 8) {
                _mm256_storeu_ps(kf + k * D + d, ldkv(krow[k], d, HALF));
                _mm256_storeu_ps(vf + k * D + d, ldkv(vrow[k], d, HALF));
            }
        mk_product(kf, D, 1, kn, qt, D, R8, s, NULL); /* s[k][r] = scale * K[p0 + k] . q_r */
        if (p0 + kn > L0) /* the causal edge: token j sees positions < L0 + j */
            for (int64_t j = 0; j < n; j++)
                for (int64_t k = L0 + j - p0 < 0 ? 0 : L0 + j - p0; k < kn; k++)
                    for (int64_t g = 0; g < G; g++) s[k * R8 + j * G + g] = -INFINITY;
        for (int64_t r = 0; r < R8; r += 8) { /* online softmax, eight query rows a vector */
            __m256 mx = _mm256_loadu_ps(m + r);
            const __m256 m0 = mx;
            for (int64_t k = 0; k < kn; k++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + k * R8 + r));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t k = 0; k < kn; k++) {
                const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + k * R8 + r), mx));
                sum = _mm256_add_ps(sum, e);
                _mm256_storeu_ps(s + k * R8 + r, e);
            }
            const __m256 a = exp_neg(_mm256_sub_ps(m0, mx)); /* (the first chunk: exp(-inf) = 0) */
            _mm256_storeu_ps(alpha + r, a);
            _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
            _mm256_storeu_ps(m + r, mx);
        }
        mk_product(vf, 1, D, D, s, kn, R8, ot, alpha); /* ot[d][r] = alpha_r ot[d][r] + sum_k V[p0 + k][d] w[k][r] */
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = j * G + g;
            const float inv = 1.0f / l[r];
            float *o = out + j * ldo + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = ot[d * R8 + r] * inv;
        }
    free(kf);
}

/* Decode attention over the paged cache, in place (no gather): token t's query heads (row stride ldq) attend to
 * positions 0..seq_lens[t]-1 of its blocks.  Query head h uses KV head h / G (GQA).  Parallel over (t, a run of up
 * to ATTN_HB KV heads, a chunk of positions): a position's K (or V) rows of neighbouring KV heads lie side by side
 * in the cache, so an item reads runs of hb * D values per position where one KV head per item read D (128 bytes
 * at D = 64 in float16, one every 4 KB: 7 GB/s, a third of this VM's read bandwidth, and 20% of a 16-row step of a
 * 1.7B model).  A float16 cache (HALF) halves the bytes read, which bound this at large batches.  Each head's
 * results are those of one head per item.  pl: the step's plan (attn_plan_make); a split sequence's chunks' partial
 * results are combined per query head after the items (a second pass, after a barrier). */
static inline __attribute__((always_inline)) void attn_impl(const float *q, int64_t ldq, const void *kv, int64_t slots,
                                                            const int64_t *block_ids, int64_t nb, const int64_t *seq_lens,
                                                            int64_t bs, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                                            float scale, float *out, int64_t ldo,
                                                            const attn_plan *pl, ts_barrier *bar, const int HALF) {
    const int64_t G = H / Hkv, tok = Hkv * D, esz = HALF ? 2 : 4;
    const char *kc = (const char *)kv, *vc = kc + slots * tok * esz;
    const int64_t *nck = pl->nck, *poff = pl->poff;
    float *part = pl->part;
    /* fewer heads per item where the items would not give every thread two (one short sequence: a 1.7B model's
     * 32 KV heads in 4 items) */
    int64_t hb = Hkv < ATTN_HB ? Hkv : ATTN_HB;
    while (hb > 1 && nck[T] * ((Hkv + hb - 1) / hb) < 2 * omp_get_num_threads()) hb = (hb + 1) / 2;
    const int64_t nhb = (Hkv + hb - 1) / hb;
    const int64_t nri = pl->nrun * Hkv; /* the runs' items (one per run and KV head) first: the largest */
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < nri + nck[T] * nhb; it++) {
        if (it < nri) { /* the last runs first (a prompt's last tokens attend to the most positions) */
            const int64_t *r = pl->run + 2 * (pl->nrun - 1 - it / Hkv), t0 = r[0], n = r[1];
            attn_run(q + t0 * ldq, ldq, kc, vc, block_ids + (t0 + n - 1) * nb, bs, tok, it % Hkv, G, D, seq_lens[t0],
                     n, scale, out + t0 * ldo, ldo, HALF);
            continue;
        }
        const int64_t ci = (it - nri) / nhb, h0 = (it - nri) % nhb * hb, hn = Hkv - h0 < hb ? Hkv - h0 : hb;
        int64_t lo = 0, hi = T - 1; /* the token of chunk ci: the last t with nck[t] <= ci */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (nck[mid] <= ci) lo = mid;
            else hi = mid - 1;
        }
        const int64_t t = lo, c = ci - nck[t], n = nck[t + 1] - nck[t], L = seq_lens[t];
        const int64_t cl = n > 1 ? attn_chunk_len(L) : L, c0 = c * cl, c1 = c0 + cl < L ? c0 + cl : L;
        attn_item(q + t * ldq, kc, vc, block_ids + t * nb, bs, tok, h0, hn, G, D, c0, c1, scale, out + t * ldo,
                  n > 1 ? part + poff[t] + c * H * (D + 2) : NULL, HALF);
    }
    if (part != NULL) { /* the chunks' partial results into each query head's output, in chunk order */
        bar_wait(bar);
#pragma omp for schedule(static) nowait
        for (int64_t tk = 0; tk < T * H; tk++) {
            const int64_t t = tk / H, k = tk % H, n = nck[t + 1] - nck[t], st = H * (D + 2);
            if (n == 1) continue;
            const float *pp = part + poff[t] + k * (D + 2);
            float m = -INFINITY, s = 0.0f;
            for (int64_t c = 0; c < n; c++) m = fmaxf(m, pp[c * st + D]);
            float w[ATTN_MAXCH]; /* (attn_chunks: at most ATTN_MAXCH) */
            for (int64_t c = 0; c < n; c++) {
                w[c] = expf(pp[c * st + D] - m);
                s += w[c] * pp[c * st + D + 1];
            }
            float *ot = out + t * ldo + k * D;
            const __m256 r = _mm256_set1_ps(1.0f / s);
            for (int64_t d = 0; d < D; d += 8) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t c = 0; c < n; c++) a = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(pp + c * st + d), a);
                _mm256_storeu_ps(ot + d, _mm256_mul_ps(a, r));
            }
        }
    }
    bar_wait(bar);
}

static void attn_body(const float *q, int64_t ldq, const void *kv, int64_t slots, const int64_t *block_ids,
                      int64_t nb, const int64_t *seq_lens, int64_t bs, int64_t T, int64_t H, int64_t Hkv,
                      int64_t D, float scale, float *out, int64_t ldo, const attn_plan *pl, ts_barrier *bar,
                      int64_t kv_half) {
#ifdef SKIP_ATTN
    bar_wait(bar); return;
#endif
    if (kv_half) attn_impl(q, ldq, kv, slots, block_ids, nb, seq_lens, bs, T, H, Hkv, D, scale, out, ldo, pl, bar, 1);
    else attn_impl(q, ldq, kv, slots, block_ids, nb, seq_lens, bs, T, H, Hkv, D, scale, out, ldo, pl, bar, 0);
}

/* kv_half: the cache holds float16 (else float32). */
void ts_attn_decode(const float *q, int64_t ldq, const void *kv, int64_t slots, const int64_t *block_ids,
                    int64_t nb, const int64_t *seq_lens, int64_t bs, int64_t T, int64_t H, int64_t Hkv,
                    int64_t D, float scale, float *out, int64_t ldo, int64_t kv_half) {
    ts_barrier bar = {0};
    attn_plan pl = attn_plan_make(seq_lens, block_ids, nb, bs, T, H, Hkv, D);
#pragma omp parallel
    {
        bar_join(&bar);
        attn_body(q, ldq, kv, slots, block_ids, nb, seq_lens, bs, T, H, Hkv, D, scale, out, ldo, &pl, &bar, kv_half);
    }
    attn_plan_free(&pl);
}

/* One decoder layer's weights, as the loader laid them out (fused qkv and gate_up). */
typedef struct {
    const float *ln1, *ln2;
    ts_weight qkv, o, gate_up, down;
    const float *qkv_bias; /* NULL when the model has none */
    void *kv;              /* this layer's cache [2, slots, Hkv, D], float32 or float16 (ts_model.kv_half) */
    const float *q_norm, *k_norm; /* Qwen3's RMSNorm of every q / k head before RoPE, [D] each; NULL: none */
} ts_layer;

typedef struct {
    int64_t num_layers, hidden, inter, H, Hkv, D, slots, block_size;
    float eps, scale;
    const ts_layer *layers;
    const float *cos, *sin; /* [max_pos, D/2] */
    int64_t kv_half;        /* the caches hold float16 */
} ts_model;

/* Every decoder layer for M tokens: x [M, hidden] is updated in place (the residual stream); scratch holds
 * M * (qkv + H*D + 2*inter + inter) floats (each thread keeps its own normalized input).
 * One parallel region for the whole stack: the threads stay in it, and each step that needs every thread's output
 * ends in a barrier (bar_wait, 7 per layer) instead of a fork and a join per parallel loop.  The cheap serial
 * parts (RMSNorm, the activations' int16 quantization) run redundantly on every thread into private buffers, so
 * they need no barrier.
 * lm (NULL: none): then the final norm (weight `norm`) and the vocabulary projection of every row follow in the
 * same region, into logits [M, vocab]: what ts_rmsnorm + ts_linear compute.  As a region of its own the LM head
 * started with one thread: the other, asleep since the layers' region ended (the engine runs OpenMP with
 * OMP_WAIT_POLICY=PASSIVE), took ~0.15 ms to wake on this VM (its vCPU halted), ~2% of a batch-1 step of the
 * default model. */
void ts_decode_layers(const ts_model *md, float *x, int64_t M, const int64_t *positions, const int64_t *slot_mapping,
                      const int64_t *block_ids, int64_t nb, const int64_t *seq_lens, float *scratch,
                      const float *norm, const ts_weight *lm, int64_t vocab, float *logits) {
    const int64_t E = md->hidden, H = md->H, Hkv = md->Hkv, D = md->D, I = md->inter;
    const int64_t nqkv = (H + 2 * Hkv) * D, tok = Hkv * D, half = D / 2, esz = md->kv_half ? 2 : 4;
    float *qkv = scratch, *att = qkv + M * nqkv, *gu = att + M * H * D, *act = gu + M * 2 * I;
    const int64_t wt = md->layers[0].qkv.wt;
    /* (every layer's attention: the same sequence lengths) */
    attn_plan pl = attn_plan_make(seq_lens, block_ids, nb, md->block_size, M, H, Hkv, D);
    ts_barrier bar = {0};
#pragma omp parallel
    {
        bar_join(&bar);
        const int64_t kmax = E > I ? (E > H * D ? E : H * D) : (I > H * D ? I : H * D);
        float *h = (float *)malloc(sizeof(float) * (size_t)(M * E)); /* this thread's normalized input */
        ts_qact a = qact_alloc(M, kmax, wt);
        for (int64_t l = 0; l < md->num_layers; l++) {
            const ts_layer *L = md->layers + l;
            ts_rmsnorm(x, M, E, L->ln1, md->eps, h);
            prep_act(&L->qkv, h, E, M, E, &a);
            linear_body(h, E, M, &L->qkv, L->qkv_bias, nqkv, E, qkv, nqkv, 0, &a, &bar);
#pragma omp for schedule(static) nowait
            for (int64_t m = 0; m < M; m++) {
                float *row = qkv + m * nqkv;
                const float *c = md->cos + positions[m] * half, *s = md->sin + positions[m] * half;
                if (L->q_norm) { /* (in place: ts_rmsnorm reads each value before it writes it) */
                    ts_rmsnorm(row, H, D, L->q_norm, md->eps, row);
                    ts_rmsnorm(row + H * D, Hkv, D, L->k_norm, md->eps, row + H * D);
                }
                rope(row, H, D, c, s);
                rope(row + H * D, Hkv, D, c, s);
                char *k = (char *)L->kv + slot_mapping[m] * tok * esz, *v = k + md->slots * tok * esz;
                store_kv(k, row + H * D, tok, md->kv_half);
                store_kv(v, row + H * D + tok, tok, md->kv_half);
            }
            bar_wait(&bar);
            attn_body(qkv, nqkv, L->kv, md->slots, block_ids, nb, seq_lens, md->block_size, M, H, Hkv, D,
                      md->scale, att, H * D, &pl, &bar, md->kv_half);
            prep_act(&L->o, att, H * D, M, H * D, &a);
            linear_body(att, H * D, M, &L->o, NULL, E, H * D, x, E, 1, &a, &bar);
            ts_rmsnorm(x, M, E, L->ln2, md->eps, h);
            prep_act(&L->gate_up, h, E, M, E, &a);
            linear_body(h, E, M, &L->gate_up, NULL, 2 * I, E, gu, 2 * I, 0, &a, &bar);
#pragma omp for schedule(static) nowait
            for (int64_t m = 0; m < M; m++) silu_mul(gu + m * 2 * I, 1, I, act + m * I);
            bar_wait(&bar);
            prep_act(&L->down, act, I, M, I, &a);
            linear_body(act, I, M, &L->down, NULL, E, I, x, E, 1, &a, &bar);
        }
        if (lm != NULL) { /* x is complete: the down projection's barrier ended the last layer */
            ts_rmsnorm(x, M, E, norm, md->eps, h);
            ts_qact b = qact_alloc(M, E, lm->wt);
            prep_act(lm, h, E, M, E, &b);
            linear_body(h, E, M, lm, NULL, vocab, E, logits, vocab, 0, &b, &bar);
            qact_free(&b);
        }
        free(h);
        qact_free(&a);
    }
    attn_plan_free(&pl);
}
