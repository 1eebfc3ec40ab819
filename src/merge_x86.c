/* x86 merge kernels: AVX2 and AVX-512. Each function carries its own target
 * attribute, so one build runs on any x86-64 and merge_cpu picks what the
 * processor has (src/cpu_path.c). See merge_simd.h for the scheme.
 *
 * The block kernels keep a 4 x 32 block of sums in registers for the whole
 * rank (eight zmm, or eight ymm for each 16-column half), add each factor's
 * to the merged values, and convert those with the bit rules of fpconv.h:
 * bf16 by rounding on the bits, fp16 through vcvtps2ph (nearest even, IEEE
 * subnormals, inf from 65520 up) with NaN made the canonical 0x7fff first. */
#include "merge_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "x86_bf16.h"

#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx2,f16c")))
#define INLINE static inline __attribute__((always_inline))

#define F32_ABS_MASK 0x7fffffff
#define F32_INF_BITS 0x7f800000
/* The smallest magnitudes that round to infinity. */
#define BF16_INF_FROM 0x7f7f8000
#define F16_INF_FROM 0x477ff000 /* 65520 */
/* A quiet NaN that vcvtps2ph turns into FP16_CANONICAL_NAN. */
#define F16_NAN_SOURCE 0x7fffe000

/* ---- AVX2 ----------------------------------------------------------------- */

TARGET_AVX2 INLINE __m256 load8_avx2(const void *p, enum st_dtype dt, uint64_t c)
{
    switch (dt) {
    case DT_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + c))), 16));
    case DT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + c)));
    default: return _mm256_loadu_ps((const float *)p + c);
    }
}

/* Stores 8 merged values; returns how many finite ones became infinite. */
TARGET_AVX2 INLINE unsigned store8_avx2(void *p, enum st_dtype dt, uint64_t c, __m256 m)
{
    const __m256i u = _mm256_castps_si256(m);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(F32_ABS_MASK));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(F32_INF_BITS));
    const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(F32_INF_BITS), mag);
    __m256i overflow;
    switch (dt) {
    case DT_BF16: {
        const __m256i h = _mm256_blendv_epi8(bf16_words_256(u), _mm256_set1_epi32(0x7fff), nan);
        _mm_storeu_si128((__m128i *)((uint16_t *)p + c),
                         _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        overflow = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(BF16_INF_FROM - 1));
        break;
    }
    case DT_F16: {
        const __m256 src = _mm256_blendv_ps(m, _mm256_castsi256_ps(_mm256_set1_epi32(F16_NAN_SOURCE)),
                                            _mm256_castsi256_ps(nan));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + c),
                         _mm256_cvtps_ph(src, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        overflow = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(F16_INF_FROM - 1));
        break;
    }
    default:
        _mm256_storeu_si256((__m256i *)((float *)p + c), _mm256_blendv_epi8(u, _mm256_set1_epi32(F32_ABS_MASK), nan));
        return 0;
    }
    return (unsigned)__builtin_popcount(
        (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(overflow, finite))));
}

/* 16 columns (one half of the strip) of the block: m[g][0..1] hold the merged
 * values of row g, two ymm; each factor's sums are kept in eight more. */
TARGET_AVX2 INLINE void half_avx2(const struct merge_block *b, uint64_t s, int half, __m256 m[MERGE_GROUP][2])
{
    for (size_t t = 0; t < b->nfactors; t++) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
               a31 = a00;
        const float *rk = b->r[t] + s * b->r_strip[t] + half;
        const float *const *l = b->l[t];
        const uint64_t r_stride = b->r_stride[t], l_stride = b->l_stride[t];
        for (uint32_t k = 0; k < b->rank[t]; k++, rk += r_stride) {
            const __m256 r0 = _mm256_loadu_ps(rk), r1 = _mm256_loadu_ps(rk + 8);
            const uint64_t lk = (uint64_t)k * l_stride;
            const __m256 b0 = _mm256_broadcast_ss(l[0] + lk), b1 = _mm256_broadcast_ss(l[1] + lk);
            const __m256 b2 = _mm256_broadcast_ss(l[2] + lk), b3 = _mm256_broadcast_ss(l[3] + lk);
            a00 = _mm256_add_ps(a00, _mm256_mul_ps(b0, r0));
            a01 = _mm256_add_ps(a01, _mm256_mul_ps(b0, r1));
            a10 = _mm256_add_ps(a10, _mm256_mul_ps(b1, r0));
            a11 = _mm256_add_ps(a11, _mm256_mul_ps(b1, r1));
            a20 = _mm256_add_ps(a20, _mm256_mul_ps(b2, r0));
            a21 = _mm256_add_ps(a21, _mm256_mul_ps(b2, r1));
            a30 = _mm256_add_ps(a30, _mm256_mul_ps(b3, r0));
            a31 = _mm256_add_ps(a31, _mm256_mul_ps(b3, r1));
        }
        const __m256 sc = _mm256_set1_ps(b->scaling[t]);
        m[0][0] = _mm256_add_ps(m[0][0], _mm256_mul_ps(a00, sc));
        m[0][1] = _mm256_add_ps(m[0][1], _mm256_mul_ps(a01, sc));
        m[1][0] = _mm256_add_ps(m[1][0], _mm256_mul_ps(a10, sc));
        m[1][1] = _mm256_add_ps(m[1][1], _mm256_mul_ps(a11, sc));
        m[2][0] = _mm256_add_ps(m[2][0], _mm256_mul_ps(a20, sc));
        m[2][1] = _mm256_add_ps(m[2][1], _mm256_mul_ps(a21, sc));
        m[3][0] = _mm256_add_ps(m[3][0], _mm256_mul_ps(a30, sc));
        m[3][1] = _mm256_add_ps(m[3][1], _mm256_mul_ps(a31, sc));
    }
}

TARGET_AVX2 uint64_t merge_block_avx2(const struct merge_block *b)
{
    uint64_t overflowed = 0;
    for (uint64_t s = 0; s < b->nstrips; s++)
        for (int half = 0; half < MERGE_STRIP; half += 16) {
            const uint64_t col = s * MERGE_STRIP + (uint64_t)half;
            __m256 m[MERGE_GROUP][2];
            for (int g = 0; g < MERGE_GROUP; g++)
                for (int v = 0; v < 2; v++)
                    m[g][v] = g < b->nrows ? load8_avx2(b->w[g], b->w_dtype, col + 8u * v) : _mm256_setzero_ps();
            half_avx2(b, s, half, m);
            for (int g = 0; g < MERGE_GROUP; g++)
                if (g < b->nrows)
                    for (int v = 0; v < 2; v++)
                        overflowed += store8_avx2(b->out[g], b->out_dtype, col + 8u * v, m[g][v]);
        }
    return overflowed;
}

/* ---- AVX-512 -------------------------------------------------------------- */

TARGET_AVX512 INLINE __m512 load16_avx512(const void *p, enum st_dtype dt, uint64_t c)
{
    switch (dt) {
    case DT_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + c))), 16));
    case DT_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + c)));
    default: return _mm512_loadu_ps((const float *)p + c);
    }
}

TARGET_AVX512 INLINE unsigned store16_avx512(void *p, enum st_dtype dt, uint64_t c, __m512 m)
{
    const __m512i u = _mm512_castps_si512(m);
    const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(F32_ABS_MASK));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(F32_INF_BITS));
    const __mmask16 finite = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(F32_INF_BITS));
    __mmask16 overflow;
    switch (dt) {
    case DT_BF16: {
        const __m512i h = _mm512_mask_mov_epi32(bf16_words_512(u), nan, _mm512_set1_epi32(0x7fff));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + c), _mm512_cvtepi32_epi16(h));
        overflow = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(BF16_INF_FROM));
        break;
    }
    case DT_F16: {
        const __m512 src = _mm512_mask_mov_ps(m, nan, _mm512_castsi512_ps(_mm512_set1_epi32(F16_NAN_SOURCE)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + c),
                            _mm512_cvtps_ph(src, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        overflow = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(F16_INF_FROM));
        break;
    }
    default:
        _mm512_storeu_si512((float *)p + c, _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(F32_ABS_MASK)));
        return 0;
    }
    return (unsigned)__builtin_popcount((unsigned)(overflow & finite));
}

TARGET_AVX512 uint64_t merge_block_avx512(const struct merge_block *b)
{
    uint64_t overflowed = 0;
    for (uint64_t s = 0; s < b->nstrips; s++) {
        const uint64_t col = s * MERGE_STRIP;
        __m512 m[MERGE_GROUP][2]; /* the merged values of row g, two zmm */
        for (int g = 0; g < MERGE_GROUP; g++)
            for (int v = 0; v < 2; v++)
                m[g][v] = g < b->nrows ? load16_avx512(b->w[g], b->w_dtype, col + 16u * v) : _mm512_setzero_ps();
        for (size_t t = 0; t < b->nfactors; t++) {
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00;
            const float *rk = b->r[t] + s * b->r_strip[t];
            const float *const *l = b->l[t];
            const uint64_t r_stride = b->r_stride[t], l_stride = b->l_stride[t];
            for (uint32_t k = 0; k < b->rank[t]; k++, rk += r_stride) {
                const __m512 r0 = _mm512_loadu_ps(rk), r1 = _mm512_loadu_ps(rk + 16);
                const uint64_t lk = (uint64_t)k * l_stride;
                const __m512 b0 = _mm512_set1_ps(l[0][lk]), b1 = _mm512_set1_ps(l[1][lk]);
                const __m512 b2 = _mm512_set1_ps(l[2][lk]), b3 = _mm512_set1_ps(l[3][lk]);
                a00 = _mm512_add_ps(a00, _mm512_mul_ps(b0, r0));
                a01 = _mm512_add_ps(a01, _mm512_mul_ps(b0, r1));
                a10 = _mm512_add_ps(a10, _mm512_mul_ps(b1, r0));
                a11 = _mm512_add_ps(a11, _mm512_mul_ps(b1, r1));
                a20 = _mm512_add_ps(a20, _mm512_mul_ps(b2, r0));
                a21 = _mm512_add_ps(a21, _mm512_mul_ps(b2, r1));
                a30 = _mm512_add_ps(a30, _mm512_mul_ps(b3, r0));
                a31 = _mm512_add_ps(a31, _mm512_mul_ps(b3, r1));
            }
            const __m512 sc = _mm512_set1_ps(b->scaling[t]);
            m[0][0] = _mm512_add_ps(m[0][0], _mm512_mul_ps(a00, sc));
            m[0][1] = _mm512_add_ps(m[0][1], _mm512_mul_ps(a01, sc));
            m[1][0] = _mm512_add_ps(m[1][0], _mm512_mul_ps(a10, sc));
            m[1][1] = _mm512_add_ps(m[1][1], _mm512_mul_ps(a11, sc));
            m[2][0] = _mm512_add_ps(m[2][0], _mm512_mul_ps(a20, sc));
            m[2][1] = _mm512_add_ps(m[2][1], _mm512_mul_ps(a21, sc));
            m[3][0] = _mm512_add_ps(m[3][0], _mm512_mul_ps(a30, sc));
            m[3][1] = _mm512_add_ps(m[3][1], _mm512_mul_ps(a31, sc));
        }
        for (int g = 0; g < MERGE_GROUP; g++)
            if (g < b->nrows)
                for (int v = 0; v < 2; v++)
                    overflowed += store16_avx512(b->out[g], b->out_dtype, col + 16u * v, m[g][v]);
    }
    return overflowed;
}

#endif
