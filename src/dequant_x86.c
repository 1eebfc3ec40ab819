/* x86 vector kernels: SSSE3, AVX2 and AVX-512BW. Each function carries its own
 * target attribute, so one build runs on any x86-64 and src/cpu_path.c picks
 * what the processor has. See dequant_simd.h for the scheme.
 *
 * A block's table is built 4 entries to an xmm register: the products, then
 * the output encoding as 32-bit words, then four byte planes (plane k holds
 * byte k of all 16 entries), which pshufb indexes with the nibbles. pshufb
 * works within 128-bit lanes, so a wide register carries one table per lane:
 * lane L of a group serves the elements of packed bytes 16L..16L+15, and the
 * planes of a group spanning several small blocks differ lane by lane. */
#include "dequant_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <float.h>
#include <immintrin.h>

#include "x86_bf16.h"

#define TARGET_SSSE3 __attribute__((target("ssse3")))
#define TARGET_F16C __attribute__((target("ssse3,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* Packed bytes one 128-bit lane expands: 32 elements. */
#define LANE_BYTES 16u

/* ---- one block's table ---------------------------------------------------- */

/* Byte k of 16 words (four xmm of four 32-bit entries) into plane[k]. */
TARGET_SSSE3 INLINE void words_to_planes(const __m128i w[4], __m128i plane[4])
{
    const __m128i by_byte = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i x0 = _mm_shuffle_epi8(w[0], by_byte), x1 = _mm_shuffle_epi8(w[1], by_byte);
    __m128i x2 = _mm_shuffle_epi8(w[2], by_byte), x3 = _mm_shuffle_epi8(w[3], by_byte);
    __m128i a = _mm_unpacklo_epi32(x0, x1), b = _mm_unpacklo_epi32(x2, x3);
    __m128i c = _mm_unpackhi_epi32(x0, x1), d = _mm_unpackhi_epi32(x2, x3);
    plane[0] = _mm_unpacklo_epi64(a, b);
    plane[1] = _mm_unpackhi_epi64(a, b);
    plane[2] = _mm_unpacklo_epi64(c, d);
    plane[3] = _mm_unpackhi_epi64(c, d);
}

/* Any absmax: block_lut's table (the scalar arithmetic, flushes and canonical
 * NaN included), split into planes. Rare: see fast_table_ok. */
TARGET_SSSE3 __attribute__((noinline)) static void lut_planes(const float *values, float absmax,
                                                               enum st_dtype out_dtype, __m128i plane[4])
{
    uint32_t lut[16];
    __m128i w[4];
    block_lut(values, absmax, out_dtype, lut);
    for (int i = 0; i < 4; i++)
        w[i] = _mm_loadu_si128((const __m128i *)(lut + 4 * i));
    words_to_planes(w, plane);
}

/* SSSE3 has no fp16 conversion: fp16 tables come from block_lut. */
TARGET_SSSE3 INLINE void block_planes_ssse3(const struct job_view *job, uint64_t block, __m128i plane[4])
{
    float absmax = view_block_absmax(job, block);
    if (!fast_table_ok(absmax) || job->out_dtype == DT_F16) {
        lut_planes(job->values, absmax, job->out_dtype, plane);
        return;
    }
    const float *values = job->values;
    const __m128 a = _mm_set1_ps(absmax);
    __m128i w[4];
    for (int i = 0; i < 4; i++) {
        __m128i u = _mm_castps_si128(_mm_mul_ps(_mm_loadu_ps(values + 4 * i), a));
        w[i] = job->out_dtype == DT_BF16 ? bf16_words_128(u) : u;
    }
    words_to_planes(w, plane);
}

/* The table with two 8-wide multiplies; fp16 through vcvtps2ph, which rounds
 * to nearest even with IEEE subnormals and overflows to inf as f32_to_f16
 * does. Planes 2 and 3 are set for fp32 outputs only. */
TARGET_AVX2 INLINE void block_planes_avx2(const struct job_view *job, uint64_t block, __m128i plane[4])
{
    float absmax = view_block_absmax(job, block);
    if (!fast_table_ok(absmax)) {
        lut_planes(job->values, absmax, job->out_dtype, plane);
        return;
    }
    const float *values = job->values;
    const __m256 a = _mm256_set1_ps(absmax);
    __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(values), a), p1 = _mm256_mul_ps(_mm256_loadu_ps(values + 8), a);
    if (job->out_dtype == DT_F32) {
        /* Per lane, bytes to [b0 x4 | b1 x4 | b2 x4 | b3 x4]; then pair the lanes' dwords. */
        const __m256i by_byte = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1,
                                                 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m256i pair_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i s0 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_castps_si256(p0), by_byte), pair_lanes);
        __m256i s1 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_castps_si256(p1), by_byte), pair_lanes);
        __m256i p02 = _mm256_unpacklo_epi64(s0, s1), p13 = _mm256_unpackhi_epi64(s0, s1);
        plane[0] = _mm256_castsi256_si128(p02);
        plane[1] = _mm256_castsi256_si128(p13);
        plane[2] = _mm256_extracti128_si256(p02, 1);
        plane[3] = _mm256_extracti128_si256(p13, 1);
        return;
    }
    __m256i words; /* the 16 entries as 16-bit words, in order */
    if (job->out_dtype == DT_F16) {
        words = _mm256_set_m128i(_mm256_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                 _mm256_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        __m256i packed = _mm256_packus_epi32(bf16_words_256(_mm256_castps_si256(p0)),
                                             bf16_words_256(_mm256_castps_si256(p1)));
        words = _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)); /* packus interleaves the lanes */
    }
    const __m256i lo_hi = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, lo_hi), _MM_SHUFFLE(3, 1, 2, 0));
    plane[0] = _mm256_castsi256_si128(split);
    plane[1] = _mm256_extracti128_si256(split, 1);
}

static inline int plane_count(const struct job_view *job)
{
    return job->out_dtype == DT_F32 ? 4 : 2;
}

/* ---- SSSE3: 32 elements (16 packed bytes) per step ------------------------- */

/* Nibble indices of 16 packed bytes in element order: the high nibble of byte
 * i is element 2i. first: elements 0..15; second: 16..31. */
TARGET_SSSE3 INLINE void nibbles_128(__m128i packed, __m128i *first, __m128i *second)
{
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    __m128i lo = _mm_and_si128(packed, low4);
    *first = _mm_unpacklo_epi8(hi, lo);
    *second = _mm_unpackhi_epi8(hi, lo);
}

/* Stores of the output: non-temporal when the job streams (see dequant_cpu.c:
 * an output too large to stay in cache skips the read for ownership), which
 * also needs every store aligned: the output starts 64-byte aligned then, and
 * each store lands at a multiple of its width from there. */
TARGET_SSSE3 INLINE void put128(int stream, void *p, __m128i v)
{
    if (stream)
        _mm_stream_si128((__m128i *)p, v);
    else
        _mm_storeu_si128((__m128i *)p, v);
}

TARGET_AVX2 INLINE void put256(int stream, void *p, __m256i v)
{
    if (stream)
        _mm256_stream_si256((__m256i *)p, v);
    else
        _mm256_storeu_si256((__m256i *)p, v);
}

TARGET_AVX512 INLINE void put512(int stream, void *p, __m512i v)
{
    if (stream)
        _mm512_stream_si512(p, v);
    else
        _mm512_storeu_si512(p, v);
}

TARGET_SSSE3 INLINE void expand16_words2(const __m128i plane[4], __m128i idx, uint16_t *out, int stream)
{
    __m128i lo = _mm_shuffle_epi8(plane[0], idx), hi = _mm_shuffle_epi8(plane[1], idx);
    put128(stream, out, _mm_unpacklo_epi8(lo, hi));
    put128(stream, out + 8, _mm_unpackhi_epi8(lo, hi));
}

TARGET_SSSE3 INLINE void expand16_words4(const __m128i plane[4], __m128i idx, uint32_t *out, int stream)
{
    __m128i b0 = _mm_shuffle_epi8(plane[0], idx), b1 = _mm_shuffle_epi8(plane[1], idx);
    __m128i b2 = _mm_shuffle_epi8(plane[2], idx), b3 = _mm_shuffle_epi8(plane[3], idx);
    __m128i lo01 = _mm_unpacklo_epi8(b0, b1), lo23 = _mm_unpacklo_epi8(b2, b3);
    __m128i hi01 = _mm_unpackhi_epi8(b0, b1), hi23 = _mm_unpackhi_epi8(b2, b3);
    put128(stream, out, _mm_unpacklo_epi16(lo01, lo23));
    put128(stream, out + 4, _mm_unpackhi_epi16(lo01, lo23));
    put128(stream, out + 8, _mm_unpacklo_epi16(hi01, hi23));
    put128(stream, out + 12, _mm_unpackhi_epi16(hi01, hi23));
}

/* Elements [e, e + 32) with one block's planes. */
TARGET_SSSE3 INLINE void expand32_ssse3(const struct job_view *job, const __m128i plane[4], uint64_t e)
{
    __m128i first, second;
    nibbles_128(_mm_loadu_si128((const __m128i *)(job->packed + e / 2)), &first, &second);
    if (job->out_dtype == DT_F32) {
        expand16_words4(plane, first, (uint32_t *)job->out + e, job->stream);
        expand16_words4(plane, second, (uint32_t *)job->out + e + 16, job->stream);
    } else {
        expand16_words2(plane, first, (uint16_t *)job->out + e, job->stream);
        expand16_words2(plane, second, (uint16_t *)job->out + e + 16, job->stream);
    }
}

TARGET_SSSE3 static void blocks_ssse3(const struct job_view *job, uint64_t first_block, uint64_t blocks)
{
    const uint64_t bs = job->blocksize;
    for (uint64_t b = first_block; b < first_block + blocks; b++) {
        __m128i plane[4];
        block_planes_ssse3(job, b, plane);
        for (uint64_t e = b * bs; e < (b + 1) * bs; e += 2 * LANE_BYTES)
            expand32_ssse3(job, plane, e);
    }
}

/* ---- AVX2: 64 elements (32 packed bytes, two lanes) per step --------------- */

TARGET_AVX2 INLINE void nibbles_256(__m256i packed, __m256i *first, __m256i *second)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    __m256i lo = _mm256_and_si256(packed, low4);
    *first = _mm256_unpacklo_epi8(hi, lo);  /* lane 0: elements 0..15, lane 1: 32..47 */
    *second = _mm256_unpackhi_epi8(hi, lo); /* lane 0: 16..31, lane 1: 48..63 */
}

/* Elements [e, e + 64): lane 0 of the planes for [e, e + 32), lane 1 for the rest. */
TARGET_AVX2 INLINE void expand64_avx2(const struct job_view *job, const __m256i plane[4], uint64_t e)
{
    __m256i idx[2];
    nibbles_256(_mm256_loadu_si256((const __m256i *)(job->packed + e / 2)), &idx[0], &idx[1]);
    if (job->out_dtype != DT_F32) {
        uint16_t *out = (uint16_t *)job->out + e;
        __m256i r[4]; /* r[2i]: lane 0 elements 16i..16i+7, lane 1 the same plus 32; r[2i+1]: +8 */
        for (int i = 0; i < 2; i++) {
            __m256i lo = _mm256_shuffle_epi8(plane[0], idx[i]), hi = _mm256_shuffle_epi8(plane[1], idx[i]);
            r[2 * i] = _mm256_unpacklo_epi8(lo, hi);
            r[2 * i + 1] = _mm256_unpackhi_epi8(lo, hi);
        }
        put256(job->stream, out, _mm256_permute2x128_si256(r[0], r[1], 0x20));
        put256(job->stream, out + 16, _mm256_permute2x128_si256(r[2], r[3], 0x20));
        put256(job->stream, out + 32, _mm256_permute2x128_si256(r[0], r[1], 0x31));
        put256(job->stream, out + 48, _mm256_permute2x128_si256(r[2], r[3], 0x31));
        return;
    }
    uint32_t *out = (uint32_t *)job->out + e;
    for (int i = 0; i < 2; i++) { /* elements 16i..16i+15 of each lane */
        __m256i b0 = _mm256_shuffle_epi8(plane[0], idx[i]), b1 = _mm256_shuffle_epi8(plane[1], idx[i]);
        __m256i b2 = _mm256_shuffle_epi8(plane[2], idx[i]), b3 = _mm256_shuffle_epi8(plane[3], idx[i]);
        __m256i lo01 = _mm256_unpacklo_epi8(b0, b1), lo23 = _mm256_unpacklo_epi8(b2, b3);
        __m256i hi01 = _mm256_unpackhi_epi8(b0, b1), hi23 = _mm256_unpackhi_epi8(b2, b3);
        __m256i q0 = _mm256_unpacklo_epi16(lo01, lo23), q1 = _mm256_unpackhi_epi16(lo01, lo23);
        __m256i q2 = _mm256_unpacklo_epi16(hi01, hi23), q3 = _mm256_unpackhi_epi16(hi01, hi23);
        uint32_t *o = out + 16 * i;
        put256(job->stream, o, _mm256_permute2x128_si256(q0, q1, 0x20));
        put256(job->stream, o + 8, _mm256_permute2x128_si256(q2, q3, 0x20));
        put256(job->stream, o + 32, _mm256_permute2x128_si256(q0, q1, 0x31));
        put256(job->stream, o + 40, _mm256_permute2x128_si256(q2, q3, 0x31));
    }
}

TARGET_AVX2 static void blocks_avx2(const struct job_view *job, uint64_t first_block, uint64_t blocks)
{
    const uint64_t bs = job->blocksize, end = first_block + blocks;
    const int nplanes = plane_count(job);
    uint64_t b = first_block;
    __m128i p0[4], p1[4];
    __m256i plane[4];
    if (bs == 2 * LANE_BYTES) { /* two blocks per step, one per lane */
        for (; b + 2 <= end; b += 2) {
            block_planes_avx2(job, b, p0);
            block_planes_avx2(job, b + 1, p1);
            for (int k = 0; k < nplanes; k++)
                plane[k] = _mm256_set_m128i(p1[k], p0[k]);
            expand64_avx2(job, plane, b * bs);
        }
        if (b < end) {
            block_planes_avx2(job, b, p0);
            expand32_ssse3(job, p0, b * bs);
        }
        return;
    }
    for (; b < end; b++) {
        block_planes_avx2(job, b, p0);
        for (int k = 0; k < nplanes; k++)
            plane[k] = _mm256_broadcastsi128_si256(p0[k]);
        for (uint64_t e = b * bs; e < (b + 1) * bs; e += 4 * LANE_BYTES)
            expand64_avx2(job, plane, e);
    }
}

/* ---- AVX-512BW: 128 elements (64 packed bytes, four lanes) per step -------- */

TARGET_AVX512 INLINE void nibbles_512(__m512i packed, __m512i *first, __m512i *second)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    __m512i lo = _mm512_and_si512(packed, low4);
    *first = _mm512_unpacklo_epi8(hi, lo);  /* lane L: elements 32L..32L+15 */
    *second = _mm512_unpackhi_epi8(hi, lo); /* lane L: 32L+16..32L+31 */
}

/* out[k] = lane k of r[0], r[1], r[2], r[3], in that order. */
TARGET_AVX512 INLINE void transpose_lanes(const __m512i r[4], __m512i out[4])
{
    __m512i a = _mm512_shuffle_i64x2(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)); /* r0.0 r0.2 r1.0 r1.2 */
    __m512i b = _mm512_shuffle_i64x2(r[2], r[3], _MM_SHUFFLE(2, 0, 2, 0)); /* r2.0 r2.2 r3.0 r3.2 */
    __m512i c = _mm512_shuffle_i64x2(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)); /* r0.1 r0.3 r1.1 r1.3 */
    __m512i d = _mm512_shuffle_i64x2(r[2], r[3], _MM_SHUFFLE(3, 1, 3, 1));
    out[0] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = _mm512_shuffle_i64x2(c, d, _MM_SHUFFLE(2, 0, 2, 0));
    out[2] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    out[3] = _mm512_shuffle_i64x2(c, d, _MM_SHUFFLE(3, 1, 3, 1));
}

/* Elements [e, e + 128): lane L of the planes serves [e + 32L, e + 32L + 32). */
TARGET_AVX512 INLINE void expand128_avx512(const struct job_view *job, const __m512i plane[4], uint64_t e)
{
    __m512i idx[2], r[4], o[4];
    nibbles_512(_mm512_loadu_si512((const void *)(job->packed + e / 2)), &idx[0], &idx[1]);
    if (job->out_dtype != DT_F32) {
        uint16_t *out = (uint16_t *)job->out + e;
        for (int i = 0; i < 2; i++) {
            __m512i lo = _mm512_shuffle_epi8(plane[0], idx[i]), hi = _mm512_shuffle_epi8(plane[1], idx[i]);
            r[2 * i] = _mm512_unpacklo_epi8(lo, hi);     /* lane L: 32L + 16i + 0..7 */
            r[2 * i + 1] = _mm512_unpackhi_epi8(lo, hi); /* lane L: 32L + 16i + 8..15 */
        }
        transpose_lanes(r, o);
        for (int k = 0; k < 4; k++)
            put512(job->stream, out + 32 * k, o[k]);
        return;
    }
    uint32_t *out = (uint32_t *)job->out + e;
    for (int i = 0; i < 2; i++) {
        __m512i b0 = _mm512_shuffle_epi8(plane[0], idx[i]), b1 = _mm512_shuffle_epi8(plane[1], idx[i]);
        __m512i b2 = _mm512_shuffle_epi8(plane[2], idx[i]), b3 = _mm512_shuffle_epi8(plane[3], idx[i]);
        __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), lo23 = _mm512_unpacklo_epi8(b2, b3);
        __m512i hi01 = _mm512_unpackhi_epi8(b0, b1), hi23 = _mm512_unpackhi_epi8(b2, b3);
        r[0] = _mm512_unpacklo_epi16(lo01, lo23); /* lane L: 32L + 16i + 0..3 */
        r[1] = _mm512_unpackhi_epi16(lo01, lo23); /* + 4..7 */
        r[2] = _mm512_unpacklo_epi16(hi01, hi23); /* + 8..11 */
        r[3] = _mm512_unpackhi_epi16(hi01, hi23); /* + 12..15 */
        transpose_lanes(r, o);
        for (int k = 0; k < 4; k++)
            put512(job->stream, out + 32 * k + 16 * i, o[k]);
    }
}

TARGET_AVX512 static void blocks_avx512(const struct job_view *job, uint64_t first_block, uint64_t blocks)
{
    const uint64_t bs = job->blocksize, end = first_block + blocks;
    const uint64_t step = 8 * LANE_BYTES; /* elements per step */
    const int nplanes = plane_count(job);
    __m128i lane[4][4];
    __m512i plane[4];
    uint64_t b = first_block;
    if (bs < step) { /* bs 32 or 64: a step spans step / bs blocks */
        const uint64_t per_step = step / bs;
        for (; b + per_step <= end; b += per_step) {
            for (uint64_t i = 0; i < per_step; i++)
                block_planes_avx2(job, b + i, lane[i]);
            for (int k = 0; k < nplanes; k++) {
                __m512i z = _mm512_castsi128_si512(lane[0][k]);
                z = _mm512_inserti32x4(z, lane[1 * per_step / 4][k], 1);
                z = _mm512_inserti32x4(z, lane[2 * per_step / 4][k], 2);
                z = _mm512_inserti32x4(z, lane[3 * per_step / 4][k], 3);
                plane[k] = z;
            }
            expand128_avx512(job, plane, b * bs);
        }
        if (b < end)
            blocks_avx2(job, b, end - b);
        return;
    }
    for (; b < end; b++) {
        block_planes_avx2(job, b, lane[0]);
        for (int k = 0; k < nplanes; k++)
            plane[k] = _mm512_broadcast_i32x4(lane[0][k]);
        for (uint64_t e = b * bs; e < (b + 1) * bs; e += step)
            expand128_avx512(job, plane, e);
    }
}

/* ---- entry points ---------------------------------------------------------- */

/* Each entry point is compiled for its own instruction set (TARGET_*), so the
 * kernel it calls inlines its helpers with those instructions. */
#define DEQUANT_ENTRY(name, TARGET)                                                                                 \
    TARGET void dequant_blocks_##name(const struct dequant_job *job, uint64_t first_block, uint64_t blocks,        \
                                      int stream)                                                                  \
    {                                                                                                              \
        struct job_view view = job_view_of(job);                                                                   \
        view.stream = stream;                                                                                      \
        blocks_##name(&view, first_block, blocks);                                                                 \
        if (stream)                                                                                                \
            _mm_sfence(); /* the streamed stores are visible before another thread reads them */                   \
    }

DEQUANT_ENTRY(ssse3, TARGET_SSSE3)
DEQUANT_ENTRY(avx2, TARGET_AVX2)
DEQUANT_ENTRY(avx512, TARGET_AVX512)

#endif
