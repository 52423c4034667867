/* Decode attention over a bfloat16 KV cache on an x86 CPU with AVX512-BF16: one new query per row
   (engine/models/native_attention.py builds, checks and calls it).

   For each (row, kv head) one task attends the g query heads of the group to the row's t keys: scores by
   VDPBF16PS (bfloat16 pairs multiplied exactly, summed in float32), 16 keys' sums at once by a transposing
   reduction; an online softmax over blocks of BLOCK keys in float32 (exp by a polynomial, relative error
   below 2e-7); the probabilities rounded to bfloat16 and multiplied into the values by VDPBF16PS over key
   pairs (as torch's bfloat16 SDPA kernel rounds them before its second product), accumulated in float32;
   the output rounded to bfloat16 (nearest even). Masked keys (a row's padding) score -inf; their values are
   never read (a zero row instead: what their probability 0 makes of any finite value), nor, 16 masked in a
   row, their keys. Keys are prefetched 16 ahead of their scores, and a block's valid values while its
   scores are computed (a step reads the cache from memory: unprefetched, each miss stalls the task).
   Tasks run on OpenMP threads (the process's libgomp, the one torch loaded). Groups of 1, 2, 3, 4 and 8
   query heads take copies of the task compiled for that group size (its loops over the group unrolled, the
   accumulators in registers rather than memory); other groups take the copy for any g. Each query head's
   sums run in the same order in every copy, so a head's output does not depend on its group.

   Shapes (elements, strides in elements): q [b, nkv, g, hd], k/v [b, nkv, t, hd] (last dim contiguous),
   valid [b, t] bytes (0 = masked; NULL: every key valid), out [b, nkv, g, hd] contiguous.
   Returns 0, or 1 when the shape is not one this kernel takes (hd not 32, 64 or 128; g > MAX_GROUP). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_simd.h"

#define BLOCK 64      /* keys per online-softmax block */
#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_NV 4      /* 32-value vectors per head row: hd <= 128 */

/* lane i of the result = the sum of the 16 lanes of v[i] (a transpose-and-add in four levels) */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; j++)
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)
        y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    /* z lane 4c + e holds v[4e + c] */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}

/* keys [j, j + 16) that are below t and not masked, as lane bits (mv NULL: every key below t) */
static inline __mmask16 valid_keys(const uint8_t *mv, const int64_t j, const int64_t t) {
    if (j >= t) return 0;
    const __mmask16 in = tail(t - j);
    return mv ? _mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(in, mv + j), _mm_setzero_si128()) : in;
}

/* One (row, kv head): q rows at q + gi * sq2, keys/values at kb/vb + j * sk2/sv2, valid bytes mv (or NULL). */
static inline __attribute__((always_inline)) void attend(
        const int NV, const int64_t g, const int64_t t, const uint16_t *q, const int64_t sq2,
        const uint16_t *kb, const int64_t sk2, const uint16_t *vb, const int64_t sv2, const uint8_t *mv,
        const float scale, uint16_t *out) {
    __m512bh qv[MAX_GROUP][MAX_NV];
    __m512 acc[MAX_GROUP][2 * MAX_NV];   /* acc[gi][2c] lane 4L+e: d = 32c + 8L + e; [2c+1]: d = 32c + 8L + 4 + e */
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    uint16_t pb[MAX_GROUP][BLOCK] __attribute__((aligned(64)));   /* the block's probabilities in bfloat16 */
    __mmask16 ok16[BLOCK / 16];          /* per 16 keys of the block: the valid ones */
    for (int64_t gi = 0; gi < g; gi++) {
        for (int c = 0; c < NV; c++) {
            qv[gi][c] = (__m512bh)_mm512_loadu_si512(q + gi * sq2 + 32 * c);
            acc[gi][2 * c] = acc[gi][2 * c + 1] = _mm512_setzero_ps();
        }
        m[gi] = -INFINITY;
        l[gi] = 0.f;
    }
    const __m512 scale_v = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < t; j0 += BLOCK) {
        const int64_t n = t - j0 < BLOCK ? t - j0 : BLOCK;
        for (int64_t j = 0; j < n; j += 16) {                           /* scores of 16 keys at a time */
            const __mmask16 ok = ok16[j / 16] = valid_keys(mv, j0 + j, t);
            const uint16_t *kr = kb + (j0 + j) * sk2;
            for (int jj = 0; jj < 16; jj++)                            /* the next 16 keys, ahead */
                for (int c = 0; c < NV; c++) _mm_prefetch((const char *)(kr + (16 + jj) * sk2 + 32 * c), _MM_HINT_T0);
            if (!ok) {
                for (int64_t gi = 0; gi < g; gi++) _mm512_store_ps(&s[gi][j], neg_inf);
                continue;
            }
            const uint16_t *vr = vb + (j0 + j) * sv2;
            for (int jj = 0; jj < 16; jj++)                            /* these keys' values, for the block's end */
                if (ok >> jj & 1)
                    for (int c = 0; c < NV; c++) _mm_prefetch((const char *)(vr + jj * sv2 + 32 * c), _MM_HINT_T0);
            for (int64_t gi = 0; gi < g; gi++) {
                __m512 a[16];
                for (int jj = 0; jj < 16; jj++) {
                    a[jj] = _mm512_setzero_ps();
                    if (j0 + j + jj < t)
                        for (int c = 0; c < NV; c++)
                            a[jj] = _mm512_dpbf16_ps(a[jj], qv[gi][c],
                                                     (__m512bh)_mm512_loadu_si512(kr + jj * sk2 + 32 * c));
                }
                _mm512_store_ps(&s[gi][j], _mm512_mask_mov_ps(neg_inf, ok, _mm512_mul_ps(reduce16(a), scale_v)));
            }
        }
        for (int64_t gi = 0; gi < g; gi++) {                            /* the block's softmax, online */
            __m512 mx = neg_inf;
            for (int64_t j = 0; j < n; j += 16) {
                mx = _mm512_mask_max_ps(mx, tail(n - j), mx, _mm512_load_ps(&s[gi][j]));
            }
            const float bm = fmaxf(m[gi], _mm512_reduce_max_ps(mx));
            if (bm == -INFINITY) {
                memset(pb[gi], 0, sizeof pb[gi]);
                continue;
            }
            const float c = expf(m[gi] - bm);
            const __m512 bmv = _mm512_set1_ps(bm);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16) {
                const __m512 p = _mm512_maskz_mov_ps(tail(n - j), exp512(_mm512_sub_ps(_mm512_load_ps(&s[gi][j]), bmv)));
                _mm256_store_si256((__m256i *)&pb[gi][j], (__m256i)_mm512_cvtneps_pbh(p));
                sum = _mm512_add_ps(sum, p);
            }
            l[gi] = l[gi] * c + _mm512_reduce_add_ps(sum);
            m[gi] = bm;
            if (c != 1.f)
                for (int x = 0; x < 2 * NV; x++) acc[gi][x] = _mm512_mul_ps(acc[gi][x], _mm512_set1_ps(c));
        }
        for (int64_t j = 0; j < n; j += 2) {                            /* values, two keys at a time */
            const unsigned pair = ok16[j / 16] >> (j % 16) & 3u;       /* bit 0: key j valid, bit 1: key j + 1 */
            if (!pair) {
                continue;
            }
            const uint16_t *v0 = vb + (j0 + j) * sv2;
            __m512i lo[MAX_NV], hi[MAX_NV];
            for (int c = 0; c < NV; c++) {
                const __m512i x0 = pair & 1u ? _mm512_loadu_si512(v0 + 32 * c) : _mm512_setzero_si512();
                const __m512i x1 = pair & 2u ? _mm512_loadu_si512(v0 + sv2 + 32 * c) : _mm512_setzero_si512();
                lo[c] = _mm512_unpacklo_epi16(x0, x1);
                hi[c] = _mm512_unpackhi_epi16(x0, x1);
            }
            for (int64_t gi = 0; gi < g; gi++) {
                int32_t p01;                                            /* p[j] low, p[j + 1] high (0 past n) */
                memcpy(&p01, &pb[gi][j], sizeof p01);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(p01);
                for (int c = 0; c < NV; c++) {
                    acc[gi][2 * c] = _mm512_dpbf16_ps(acc[gi][2 * c], pp, (__m512bh)lo[c]);
                    acc[gi][2 * c + 1] = _mm512_dpbf16_ps(acc[gi][2 * c + 1], pp, (__m512bh)hi[c]);
                }
            }
        }
    }
    /* acc's lane order back to d: out lanes [8L, 8L+4) come from acc[2c] lanes [4L, 4L+4), [8L+4, 8L+8) from acc[2c+1] */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t gi = 0; gi < g; gi++) {
        const __m512 inv = _mm512_set1_ps(l[gi] > 0.f ? 1.f / l[gi] : 0.f);
        for (int c = 0; c < NV; c++) {
            const __m512 a = _mm512_mul_ps(acc[gi][2 * c], inv), b = _mm512_mul_ps(acc[gi][2 * c + 1], inv);
            _mm256_storeu_si256((__m256i *)(out + gi * NV * 32 + 32 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, first, b)));
            _mm256_storeu_si256((__m256i *)(out + gi * NV * 32 + 32 * c + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, second, b)));
        }
    }
}

int llmops_decode_attention_bf16(int64_t b, int64_t nkv, int64_t g, int64_t hd, int64_t t,
                                 const uint16_t *q, int64_t sq0, int64_t sq1, int64_t sq2,
                                 const uint16_t *k, int64_t sk0, int64_t sk1, int64_t sk2,
                                 const uint16_t *v, int64_t sv0, int64_t sv1, int64_t sv2,
                                 const uint8_t *valid, int64_t sm0, float scale, uint16_t *out, int threads) {
    if (g < 1 || g > MAX_GROUP || (hd != 32 && hd != 64 && hd != 128)) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < b * nkv; task++) {
        const int64_t bi = task / nkv, h = task % nkv;
        const uint16_t *qb = q + bi * sq0 + h * sq1, *kb = k + bi * sk0 + h * sk1, *vb = v + bi * sv0 + h * sv1;
        const uint8_t *mv = valid ? valid + bi * sm0 : 0;
        uint16_t *ob = out + task * g * hd;
#define ATTEND(NV, G) attend(NV, G, t, qb, sq2, kb, sk2, vb, sv2, mv, scale, ob)
#define ATTEND_GROUPS(NV) switch (g) {                                                  \
            case 1: ATTEND(NV, 1); break;                                               \
            case 2: ATTEND(NV, 2); break;                                               \
            case 3: ATTEND(NV, 3); break;                                               \
            case 4: ATTEND(NV, 4); break;                                               \
            case 8: ATTEND(NV, 8); break;                                               \
            default: ATTEND(NV, g); break;                                              \
        }
        switch (hd) {
            case 32: ATTEND_GROUPS(1); break;
            case 64: ATTEND_GROUPS(2); break;
            default: ATTEND_GROUPS(4); break;
        }
#undef ATTEND_GROUPS
#undef ATTEND
    }
    return 0;
}
