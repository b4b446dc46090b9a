/* Weights into the kernels' formats, where numpy / torch took most of a first start:
 * - quantization: models/quantize.py's quantize_int8 / quantize_int4 in C, with the same float32 arithmetic step for
 *   step (so the same codes, scales and minimums bit for bit).  torch spends ~11-13 ns a weight on those few ops
 *   (reductions over 32 elements, broadcast divisions, a where, the dequantized copy), so a first start that
 *   quantizes a 1.7B checkpoint spent ~20 s there; one pass in C per group of 32 takes ~1 ns a weight.
 *   Output: codes [rows, K/32, 32] (int8, or uint8 0..15), scales (and int4's minimums) [rows, K/32] float16.
 * - the kernels' packed layout written from those terms (quantize.py's pack_int8 / pack_int4), and a GGUF file's
 *   Q4_K / Q5_K / Q6_K blocks converted straight into it.
 * tests/unit/test_cpu_kernels.py and test_gguf.py compare each with the Python code it replaces. */
#include "isa.h"
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float hmin8(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

/* float -> float16 bits, round to nearest even (torch's .half()) */
static inline uint16_t to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* o[t] = round((v[t] - lo) / s) clamped to [cmin, cmax] (torch.round: to nearest even) for the group's 32 values, as
 * bytes (int8, or uint8 codes 0..15: the same byte); all 0 where s is not positive (torch.where(scale > 0, ...)). */
static inline void group_codes(const __m256 v[4], float lo, float s, float cmin, float cmax, uint8_t *o) {
    if (!(s > 0)) {
        memset(o, 0, 32);
        return;
    }
    int32_t c[32];
    for (int j = 0; j < 4; j++) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[j], _mm256_set1_ps(lo)), _mm256_set1_ps(s)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 clamped = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(cmin)), _mm256_set1_ps(cmax));
        _mm256_storeu_si256((__m256i *)(c + 8 * j), _mm256_cvtps_epi32(clamped));
    }
    for (int t = 0; t < 32; t++) o[t] = (uint8_t)(int8_t)c[t];
}

/* A group's 32 weights as float32 from float32 or (bf16) bfloat16 input: a bfloat16 is the top half of its float32,
 * so a checkpoint's bf16 rows are quantized as they are, with no float32 copy of each chunk (which cost ~5 s of the
 * 1.7B shape's first start: fresh pages to fault in). */
static inline void load_group(const void *w, int64_t i, int bf16, __m256 v[4]) {
    for (int j = 0; j < 4; j++)
        v[j] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i * 32 + 8 * j))), 16))
                    : _mm256_loadu_ps((const float *)w + i * 32 + 8 * j);
}

/* int8 of one group of 32: scale = half(amax|w| / 127), q = round(w / scale) in [-127, 127] (0 where scale is 0) */
static inline void q8_group(const __m256 v[4], int8_t *q, uint16_t *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    const uint16_t h = to_half(hmax8(mx) / 127.0f);
    *scale = h;
    group_codes(v, 0.0f, _cvtsh_ss(h), -127.0f, 127.0f, (uint8_t *)q);
}

/* w: [rows, k] float32, or bfloat16 where bf16 is set */
void ts_quantize_q8(const void *w, int64_t rows, int64_t k, int bf16, int8_t *q, uint16_t *scale) {
    const int64_t groups = rows * (k / 32);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        __m256 v[4];
        load_group(w, i, bf16, v);
        q8_group(v, q + i * 32, scale + i);
    }
}

/* int4: lo = half(min w), scale = half((max w - lo) / 15), q = round((w - lo) / scale) in [0, 15] (0 where scale is
 * 0); W = scale * q + lo */
void ts_quantize_q4(const void *w, int64_t rows, int64_t k, int bf16, uint8_t *q, uint16_t *scale, uint16_t *mins) {
    const int64_t groups = rows * (k / 32);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        __m256 v[4], mx, mn;
        load_group(w, i, bf16, v);
        mx = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
        mn = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
        const uint16_t hl = to_half(hmin8(mn));
        const float lo = _cvtsh_ss(hl);
        const uint16_t h = to_half((hmax8(mx) - lo) / 15.0f);
        scale[i] = h;
        mins[i] = hl;
        group_codes(v, lo, _cvtsh_ss(h), 0.0f, 15.0f, q + i * 32);
    }
}

/* ---- writers of the kernels' packed layout (models/quantize.py's PackedWeight) ----
 * Row `row`, group g of a weight with G groups of 32 per row: per block of four rows (row / 4), per group (int8) or
 * pair of groups (int4), lane row % 4.  Every row is independent, so a fused weight's parts (q, k, v) are written at
 * their row offsets straight into the one packed tensor, with no intermediate codes or concatenation: on a 2-core VM
 * each fresh page costs a fault and a clear, and the 8B shape's first start spent ~25 s of ~60 there. */

static inline int64_t lane(int64_t row, int64_t g, int64_t G) { return ((row / 4) * G + g) * 4 + row % 4; }

static inline void put_q8(int8_t *codes, uint16_t *scale, int64_t row, int64_t g, int64_t G, const int8_t *c,
                          uint16_t s) {
    memcpy(codes + lane(row, g, G) * 32, c, 32);
    scale[lane(row, g, G)] = s;
}

/* int4: 16-bit word j of the pair's 32 bytes holds columns j, 16 + j (low byte: the pair's even group) and 32 + j,
 * 48 + j (high byte: its odd group), low nibble first; an odd last group's high bytes are zero. */
static inline void put_q4(uint8_t *codes, uint16_t *scale, uint16_t *mins, int64_t row, int64_t g, int64_t G,
                          const uint8_t *c, uint16_t s, uint16_t m) {
    uint8_t *o = codes + lane(row, g / 2, (G + 1) / 2) * 32 + g % 2; /* (pairs take the place of groups) */
    for (int j = 0; j < 16; j++) o[2 * j] = (uint8_t)(c[j] | (c[16 + j] << 4));
    if (g == G - 1 && g % 2 == 0)
        for (int j = 0; j < 16; j++) o[2 * j + 1] = 0;
    scale[lane(row, g, G)] = s;
    mins[lane(row, g, G)] = m;
}

/* int5: triples of groups, 64 bytes per row each: 16-bit word j of half h (bytes 32h..) holds the codes of the
 * triple's columns 48h + j, 48h + 16 + j, 48h + 32 + j in bits 0-4, 5-9, 10-14 (bit 15 zero).  A triple's first group
 * clears its 64 bytes, so the groups of a row must be written in order (every writer here loops over them so) and a
 * short last triple's missing codes are zero. */
static inline void put_q5(uint8_t *codes, uint16_t *scale, uint16_t *mins, int64_t row, int64_t g, int64_t G,
                          const uint8_t *c, uint16_t s, uint16_t m) {
    uint8_t *o = codes + lane(row, g / 3, (G + 2) / 3) * 64;
    const int i = (int)(g % 3);
    if (i == 0) memset(o, 0, 64);
    for (int t = 0; t < 32; t++) {
        const int col = i * 32 + t, word = (col / 48) * 16 + col % 16, shift = ((col % 48) / 16) * 5;
        uint16_t w;
        memcpy(&w, o + 2 * word, 2);
        w = (uint16_t)(w | (unsigned)(c[t] & 31) << shift);
        memcpy(o + 2 * word, &w, 2);
    }
    scale[lane(row, g, G)] = s;
    mins[lane(row, g, G)] = m;
}

/* codes [rows, G, 32] and scales [rows, G] (int8) -> rows r0.. of the packed weight (pack_int8's layout) */
void ts_pack_q8(const int8_t *q, const uint16_t *scale, int64_t rows, int64_t G, int64_t r0, int8_t *codes,
                uint16_t *oscale) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++) put_q8(codes, oscale, r0 + i, g, G, q + (i * G + g) * 32, scale[i * G + g]);
}

/* codes [rows, G, 32] in 0..15 (int5: 0..31), scales and minimums [rows, G] -> rows r0.. of the packed int4 (int5)
 * weight (pack_int4's / pack_int5's) */
void ts_pack_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *mins, int64_t rows, int64_t G, int64_t r0,
                uint8_t *codes, uint16_t *oscale, uint16_t *omin, int64_t int5) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++)
            (int5 ? put_q5 : put_q4)(codes, oscale, omin, r0 + i, g, G, q + (i * G + g) * 32, scale[i * G + g],
                                     mins[i * G + g]);
}

/* ---- a GGUF file's K-quant blocks -> the packed layout (models/gguf_model.py) ----
 * What a Q4_K_M file holds, converted at its first start with the values of the Python steps they replace, bit for
 * bit (tests/unit/test_gguf.py).  raw: the tensor's rows of super-blocks; order: output row i is raw row order[i]
 * (llama.cpp's Q / K row permutation undone without a copy), or NULL. */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 6-bit scale and min of sub-block j (0..7) from Q4_K's / Q5_K's twelve bytes (the gguf package's get_scale_min) */
static inline void scale_min_k4(const uint8_t *sc, int j, int *s6, int *m6) {
    *s6 = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
    *m6 = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
}

/* Q4_K (144 bytes: float16 d and dmin, twelve bytes of 6-bit scales and mins, 128 bytes of nibbles) -> int4 groups
 * of 32 with the file's codes, scale = half(d * sc) and min = half(-dmin * m) (gguf_model._q4k_blocks); Q5_K (176
 * bytes: the same, then 32 bytes of fifth bits before the nibbles) -> int5 likewise (five). */
static void k_to_q45(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, uint8_t *codes,
                     uint16_t *scale, uint16_t *mins, int five) {
    const int64_t S = k / 256, G = k / 32, size = five ? 176 : 144;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t s = 0; s < S; s++) {
            const uint8_t *b = raw + ((order ? order[i] : i) * S + s) * size, *sc = b + 4, *qh = b + 16;
            const uint8_t *qs = b + (five ? 48 : 16);
            const float d = half_at(b), dmin = half_at(b + 2);
            for (int j = 0; j < 8; j++) {
                int s6, m6;
                scale_min_k4(sc, j, &s6, &m6);
                /* sub-block j: the low (j even) or high nibbles of the 32 bytes of chunk j / 2 (and bit j of qh) */
                uint8_t c[32];
                for (int t = 0; t < 32; t++)
                    c[t] = (uint8_t)(((qs[(j / 2) * 32 + t] >> (4 * (j % 2))) & 15) | (five ? ((qh[t] >> j) & 1) << 4 : 0));
                (five ? put_q5 : put_q4)(codes, scale, mins, r0 + i, s * 8 + j, G, c, to_half(d * (float)s6),
                                         to_half(-dmin * (float)m6));
            }
        }
}

void ts_q4k_to_q4(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, uint8_t *codes,
                  uint16_t *scale, uint16_t *mins) {
    k_to_q45(raw, order, rows, k, r0, codes, scale, mins, 0);
}

void ts_q5k_to_q5(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, uint8_t *codes,
                  uint16_t *scale, uint16_t *mins) {
    k_to_q45(raw, order, rows, k, r0, codes, scale, mins, 1);
}

/* Q8_0 (34 bytes: float16 d, 32 int8 codes: W = d * q) -> int8, and Q4_0 (18 bytes: float16 d, 16 bytes of nibbles:
 * W = d * (q - 8)) / Q4_1 (20 bytes: float16 d and m, the nibbles: W = d * q + m) -> int4 (min = half(-8 d) or m),
 * with the file's codes and float16 terms (gguf_model._blocks_of + pack_int8 / pack_int4, bit for bit): one pass
 * from the mapped file into the packed weight, where numpy's copies of codes and terms took most of a first start
 * (an 8B Q8_0 file: ~13 s of copies, ~12 s packing).  Nibble byte t holds elements t (low) and t + 16 (high). */
void ts_q8_0_to_q8(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int8_t *codes,
                   uint16_t *scale) {
    const int64_t G = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = raw + ((order ? order[i] : i) * G + g) * 34;
            uint16_t d;
            memcpy(&d, b, 2);
            put_q8(codes, scale, r0 + i, g, G, (const int8_t *)(b + 2), d);
        }
}

/* The blocks of 32 of Q4_0 / Q4_1 (five = 0) and Q5_0 / Q5_1 (five = 1: 32 fifth bits after the terms) -> int4 /
 * int5 with the file's codes and float16 terms: min = m (with_min), or -8 d / -16 d (exact: a power of two). */
static void legacy_to_q45(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0,
                          int64_t with_min, int five, uint8_t *codes, uint16_t *scale, uint16_t *mins) {
    const int64_t G = k / 32, size = (five ? 22 : 18) + (with_min ? 2 : 0);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = raw + ((order ? order[i] : i) * G + g) * size, *qs = b + size - 16, *qh = qs - 4;
            uint16_t d, m;
            memcpy(&d, b, 2);
            if (with_min) memcpy(&m, b + 2, 2);
            else m = to_half((five ? -16.0f : -8.0f) * _cvtsh_ss(d));
            const uint32_t bits = five ? (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 |
                                             (uint32_t)qh[3] << 24
                                       : 0;
            uint8_t c[32];
            for (int t = 0; t < 16; t++) {
                c[t] = (uint8_t)((qs[t] & 15) | ((bits >> t) & 1) << 4);
                c[t + 16] = (uint8_t)((qs[t] >> 4) | ((bits >> (t + 16)) & 1) << 4);
            }
            (five ? put_q5 : put_q4)(codes, scale, mins, r0 + i, g, G, c, d, m);
        }
}

void ts_q4_to_q4(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int64_t q41,
                 uint8_t *codes, uint16_t *scale, uint16_t *mins) {
    legacy_to_q45(raw, order, rows, k, r0, q41, 0, codes, scale, mins);
}

/* Q5_0 (22 bytes: float16 d, 32 fifth bits, 16 bytes of nibbles: W = d * (q - 16)) and Q5_1 (24 bytes: float16 d
 * and m, the bits, the nibbles: W = d * q + m) -> int5 with the file's codes and float16 terms: scale = d, min =
 * -16 d (exact: a power of two) or m.  Nibble byte t holds elements t (low) and t + 16 (high); bit j of the
 * little-endian 32-bit qh is element j's fifth bit. */
void ts_q5_to_q5(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int64_t q51,
                 uint8_t *codes, uint16_t *scale, uint16_t *mins) {
    legacy_to_q45(raw, order, rows, k, r0, q51, 1, codes, scale, mins);
}

/* Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales, float16 d) -> its 256
 * 6-bit codes q (W = d * scale * (q - 32)). */
static void q6k_codes(const uint8_t *b, uint8_t *q) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++)     /* halves of 128 weights */
        for (int c = 0; c < 4; c++) /* chunks of 32: low nibbles of ql 0..31 / 32..63, then the high ones */
            for (int l = 0; l < 32; l++)
                q[h * 128 + c * 32 + l] = (uint8_t)(((ql[h * 64 + (c % 2) * 32 + l] >> (4 * (c / 2))) & 15) |
                                                    ((qh[h * 32 + l] >> (2 * c)) & 3) << 4);
}

/* ... -> its 256 values as gguf_model.q6k_rows computes them: (d * scale) * (q - 32) in float32. */
static void q6k_values(const uint8_t *b, float *w) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    uint8_t q[256];
    q6k_codes(b, q);
    for (int e = 0; e < 256; e++) w[e] = (d * (float)sc[e / 16]) * (float)(q[e] - 32);
}

/* Q6_K -> int6 (decode_cpu.c's WT_Q6, see q6_load) with the file's codes, sub-scales and d: per pair of groups and
 * block of four rows, 208 bytes at codes + ((r / 4) * K/64 + pair) * 208; row r's 48 at (r % 4) * 48: byte t of the
 * first 32 holds the low nibbles of the pair's columns t (low) and 32 + t (high), byte 32 + t the high two bits of
 * columns t, 16 + t, 32 + t, 48 + t (bits 0-1, 2-3, 4-5, 6-7); the sub-scale of columns 16i..16i+15 at 192 + 4 i +
 * r % 4; every group's scale is the super-block's d. */
void ts_q6k_to_q6(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, uint8_t *codes,
                  uint16_t *scale) {
    const int64_t S = k / 256, G = k / 32, P = k / 64;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t s = 0; s < S; s++) {
            const uint8_t *b = raw + ((order ? order[i] : i) * S + s) * 210;
            const int64_t row = r0 + i;
            uint8_t q[256];
            q6k_codes(b, q);
            for (int pp = 0; pp < 4; pp++) {
                uint8_t *blk = codes + ((row / 4) * P + s * 4 + pp) * 208, *o = blk + (row % 4) * 48;
                const uint8_t *v = q + pp * 64;
                for (int t = 0; t < 32; t++) o[t] = (uint8_t)((v[t] & 15) | (v[32 + t] & 15) << 4);
                for (int t = 0; t < 16; t++)
                    o[32 + t] = (uint8_t)((v[t] >> 4) | (v[16 + t] >> 4) << 2 | (v[32 + t] >> 4) << 4 | (v[48 + t] >> 4) << 6);
                for (int j = 0; j < 4; j++) blk[192 + 4 * j + row % 4] = b[192 + pp * 4 + j];
            }
            uint16_t d;
            memcpy(&d, b + 208, 2);
            for (int g = 0; g < 8; g++) scale[((row / 4) * G + s * 8 + g) * 4 + row % 4] = d;
        }
}

/* Q5_K (176 bytes: float16 d and dmin, twelve bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 bytes of
 * nibbles) -> its 256 values as the gguf package computes them: (d * sc) * q - dmin * m in float32, the product
 * rounded before the subtraction (no fused multiply-add: hence fp-contract off). */
__attribute__((optimize("fp-contract=off"))) static void q5k_values(const uint8_t *b, float *w) {
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; j++) { /* sub-block j: nibbles (low: j even) of bytes 32 (j / 2).., bit j of qh */
        int s6, m6;
        scale_min_k4(sc, j, &s6, &m6);
        const float ds = d * (float)s6, dm = dmin * (float)m6;
        for (int l = 0; l < 32; l++) {
            const int q = ((qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15) | (((qh[l] >> j) & 1) << 4);
            const float p = ds * (float)q;
            w[j * 32 + l] = p - dm;
        }
    }
}

/* Super-blocks of `size` bytes -> their values (`values`), then int8 per group of 32 as ts_quantize_q8. */
static void k_to_q8(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int8_t *codes,
                    uint16_t *scale, int64_t size, void (*values)(const uint8_t *, float *)) {
    const int64_t S = k / 256, G = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t s = 0; s < S; s++) {
            float w[256];
            values(raw + ((order ? order[i] : i) * S + s) * size, w);
            for (int g = 0; g < 8; g++) {
                int8_t c[32];
                uint16_t h;
                __m256 v[4];
                load_group(w, g, 0, v);
                q8_group(v, c, &h);
                put_q8(codes, scale, r0 + i, s * 8 + g, G, c, h);
            }
        }
}

/* Q6_K / Q5_K -> int8 (a layer whose parts have three formats: a Q5_K_M file's Q8_0 / Q5_K / Q6_K q / k / v) */
void ts_q6k_to_q8(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int8_t *codes,
                  uint16_t *scale) {
    k_to_q8(raw, order, rows, k, r0, codes, scale, 210, q6k_values);
}

void ts_q5k_to_q8(const uint8_t *raw, const int64_t *order, int64_t rows, int64_t k, int64_t r0, int8_t *codes,
                  uint16_t *scale) {
    k_to_q8(raw, order, rows, k, r0, codes, scale, 176, q5k_values);
}
