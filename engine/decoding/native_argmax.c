/* Greedy choice over bfloat16 logits on an x86 CPU with AVX-512 (engine/decoding/native_argmax.py builds,
   checks and calls it).

   Per row, the index of its first maximum, as torch.argmax and torch.max(dim) give it over the values'
   float32 conversion (exact: the same order, ties included); a row holding NaN gives its first NaN (torch
   takes NaN for the maximum). Each of 16 lanes keeps its first maximum (a strictly greater value replaces
   it), then the row's maximum is the lanes' largest and its index the smallest index among the lanes that
   hold it. Rows run on OpenMP threads (the process's libgomp, the one torch loaded) when there are enough
   of them.

   Shapes (elements): x [rows, n] at row stride sx, n below 2^31; out [rows] int64. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN 131072   /* elements below which one thread does the work (a fork costs more) */

static inline int is_nan_bf16(uint16_t u) { return (u & 0x7FFFu) > 0x7F80u; }

static int64_t row_argmax(const uint16_t *x, const int64_t n) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512 best = neg_inf;
    __m512i at = _mm512_setzero_si512(), index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + j)), 16));
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(in, v, best, _CMP_GT_OQ);
        nan |= _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, index);
        index = _mm512_add_epi32(index, sixteen);
    }
    if (nan) {
        for (int64_t j = 0; j < n; j++)
            if (is_nan_bf16(x[j])) return j;
    }
    const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
    return _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), top, at));
}

void llmops_argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t sx, int64_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * sx, n);
}
