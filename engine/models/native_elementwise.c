/* A decoder layer's elementwise work on bfloat16 rows on an x86 CPU with AVX-512
   (engine/models/native_elementwise.py builds, checks and calls it): one pass over the inputs and one write of
   the result, where torch's ops take several passes and a float32 copy.

   Values round where Hugging Face's torch ops round, each product and sum computed in float32 and rounded to
   bfloat16 (nearest even):
     - rms_norm: y = bf16(x * rsqrt(mean(x^2) + eps)) with the statistics in float32, then bf16(weight * y);
       the mean sums in another order than torch's, so y can differ from torch's by one unit in the last place.
     - rope: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), bit for bit torch's (each product of two
       bfloat16 values is exact in float32).
     - silu_mul: bf16(bf16(g / (1 + e^-g)) * up); e^x by a polynomial (relative error below 2e-7) and the
       division as a reciprocal refined by one Newton step, so silu(g) can differ from torch's by one unit in
       the last place before it is rounded.
   Rows run on OpenMP threads (the process's libgomp, the one torch loaded) when there are enough of them.

   Layouts (elements): a "row" is the last dim, contiguous; rows sit at a stride. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native_simd.h"

#define PARALLEL_MIN 32768   /* elements below which one thread does the work (a fork costs more) */

static inline __m512 load16(const uint16_t *p) { return widen16(_mm256_loadu_si256((const __m256i *)p)); }

static inline __m512 load16_masked(const uint16_t *p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }

static inline __m256i round16(__m512 x) {                     /* float32 -> bfloat16, nearest even */
    return (__m256i)_mm512_cvtneps_pbh(x);
}

/* x [rows, h] at row stride sx, weight [h] -> out [rows, h] contiguous */
void llmops_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t h, int64_t sx, const uint16_t *weight, float eps,
                          uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * sx;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            const __m512 v = load16_masked(xr + i, tail(h - i));
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sq) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = tail(h - i);
            const __m512 y = rounded(_mm512_mul_ps(load16_masked(xr + i, m), inv));      /* the normalized row */
            _mm256_mask_storeu_epi16(out + r * h + i, m, round16(_mm512_mul_ps(y, load16_masked(weight + i, m))));
        }
    }
}

/* x [b, s, n, hd] at strides (sxb, sxs, sxn), cos/sin [b or 1, s, hd] at strides (scb, scs) -> out [b, s, n, hd]
   contiguous; hd a multiple of 32 */
void llmops_rope_bf16(const uint16_t *x, int64_t b, int64_t s, int64_t n, int64_t hd, int64_t sxb, int64_t sxs,
                      int64_t sxn, const uint16_t *cos, const uint16_t *sin, int64_t scb, int64_t scs, uint16_t *out,
                      int threads) {
    const int64_t half = hd / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if (b * s * n * hd >= PARALLEL_MIN)
    for (int64_t bs = 0; bs < b * s; bs++) {
        const int64_t bi = bs / s, si = bs % s;
        const uint16_t *c = cos + bi * scb + si * scs, *sn = sin + bi * scb + si * scs;
        for (int64_t h = 0; h < n; h++) {
            const uint16_t *xr = x + bi * sxb + si * sxs + h * sxn;
            uint16_t *o = out + (bs * n + h) * hd;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 x1 = load16(xr + i), x2 = load16(xr + half + i);
                const __m512 a1 = rounded(_mm512_mul_ps(x1, load16(c + i)));
                const __m512 r1 = rounded(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(sn + i)));
                _mm256_storeu_si256((__m256i *)(o + i), round16(_mm512_add_ps(a1, r1)));
                const __m512 a2 = rounded(_mm512_mul_ps(x2, load16(c + half + i)));
                const __m512 r2 = rounded(_mm512_mul_ps(x1, load16(sn + half + i)));
                _mm256_storeu_si256((__m256i *)(o + half + i), round16(_mm512_add_ps(a2, r2)));
            }
        }
    }
}

/* gate, up [rows, k] at row strides sg, su -> out [rows, k] contiguous: silu(gate) * up */
void llmops_silu_mul_bf16(const uint16_t *gate, const uint16_t *up, int64_t rows, int64_t k, int64_t sg, int64_t su,
                          uint16_t *out, int threads) {
    const __m512 one = _mm512_set1_ps(1.f);
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 m = tail(k - i);
            const __m512 g = load16_masked(gate + r * sg + i, m);
            const __m512 d = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            __m512 inv = _mm512_rcp14_ps(d);                          /* 1 / d: 14 bits, then one Newton step */
            inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
            const __m512 act = rounded(_mm512_mul_ps(g, inv));
            _mm256_mask_storeu_epi16(out + r * k + i, m, round16(_mm512_mul_ps(act, load16_masked(up + r * su + i, m))));
        }
    }
}
