/* Weight quantization for the kernels' formats: models/quantize.py's quantize_int8 / quantize_int4 in C, with the same
 * float32 arithmetic step for step (so the same codes, scales and minimums bit for bit; tests/unit/test_cpu_kernels.py
 * compares them).  Why: torch spends ~11-13 ns a weight on those few ops (reductions over 32 elements, broadcast
 * divisions, a where, the dequantized copy), so a first start that quantizes a 1.7B checkpoint spent ~20 s there;
 * one pass in C per group of 32 takes ~1 ns a weight.
 *
 * Output: codes [rows, K/32, 32] (int8, or uint8 0..15), scales (and int4's minimums) [rows, K/32] float16; the
 * kernels' block layout is made from them by models/quantize.py's pack_int8 / pack_int4. */
#include <immintrin.h>
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

/* int8: scale = half(amax|w| / 127), q = round(w / scale) in [-127, 127] (0 where scale is 0) */
void ts_quantize_q8(const float *w, int64_t rows, int64_t k, int8_t *q, uint16_t *scale) {
    const int64_t groups = rows * (k / 32);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        const float *p = w + i * 32;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(p + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        const uint16_t h = to_half(hmax8(mx) / 127.0f);
        scale[i] = h;
        group_codes(v, 0.0f, _cvtsh_ss(h), -127.0f, 127.0f, (uint8_t *)(q + i * 32));
    }
}

/* int4: lo = half(min w), scale = half((max w - lo) / 15), q = round((w - lo) / scale) in [0, 15] (0 where scale is
 * 0); W = scale * q + lo */
void ts_quantize_q4(const float *w, int64_t rows, int64_t k, uint8_t *q, uint16_t *scale, uint16_t *mins) {
    const int64_t groups = rows * (k / 32);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        const float *p = w + i * 32;
        __m256 v[4], mx, mn;
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
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
