/* f32_to_bf16 of finite values in x86 vector code, for the dequantization
 * kernels (src/dequant_x86.c) and the merge kernels (src/merge_x86.c): round
 * to nearest even on the bits, each 32-bit lane's bf16 in its low half.
 * NaN is the caller's (the canonical 0x7fff). */
#ifndef NF4DEQ_X86_BF16_H
#define NF4DEQ_X86_BF16_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("ssse3"), always_inline)) static inline __m128i bf16_words_128(__m128i u)
{
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    return _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff))), 16);
}

__attribute__((target("avx2"), always_inline)) static inline __m256i bf16_words_256(__m256i u)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

__attribute__((target("avx512f"), always_inline)) static inline __m512i bf16_words_512(__m512i u)
{
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}
#endif

#endif
