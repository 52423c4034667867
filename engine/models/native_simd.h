/* What the CPU C kernels beside this file share (engine/models/native_*.c; engine.util.native digests it with
   each of them, so an edit here rebuilds both). */
#ifndef LLMOPS_NATIVE_SIMD_H
#define LLMOPS_NATIVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* the first min(n, 16) lanes */
static inline __mmask16 tail(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* 16 bfloat16 -> float32, exactly */
static inline __m512 widen16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* x rounded to bfloat16 (nearest even), back in float32: what a torch op on bfloat16 tensors stores */
static inline __m512 rounded(__m512 x) { return widen16((__m256i)_mm512_cvtneps_pbh(x)); }

/* e^x in 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial; lanes below -87.3 give 0 */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

#endif
