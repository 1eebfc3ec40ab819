/* AArch64 Advanced SIMD kernel (see dequant_simd.h): tbl expands the nibbles,
 * and st2/st4 interleave the byte planes into 16- or 32-bit elements. */
#include "dequant_simd.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <float.h>

/* Packed bytes per step: 32 elements, the smallest blocksize. */
#define STEP_BYTES 16u

/* The block's 16 outputs as byte planes: plane[k] holds byte k of each entry
 * (planes 2 and 3 unused for 16-bit outputs). The arithmetic is the scalar
 * path's: absmax flushed, products below FLT_MIN flushed to a zero of their
 * sign (the FPCR's FZ bit is clear on Linux), then the output encoding with
 * the canonical NaN. vcvt_f16_f32 rounds to nearest even with subnormals. */
static inline void block_planes(const struct job_view *job, uint64_t block, uint8x16_t plane[4])
{
    static const uint8_t BY_BYTE[4][16] = {
        {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60},
        {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61},
        {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62},
        {3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63},
    };
    const float *values = job->values;
    const float32x4_t a = vdupq_n_f32(f32_flush_subnormal(view_block_absmax(job, block)));
    uint8x16x4_t words;
    for (int i = 0; i < 4; i++) {
        float32x4_t v = vmulq_f32(vld1q_f32(values + 4 * i), a);
        uint32x4_t bits = vreinterpretq_u32_f32(v);
        uint32x4_t tiny = vcltq_f32(vabsq_f32(v), vdupq_n_f32(FLT_MIN));
        bits = vbslq_u32(tiny, vandq_u32(bits, vdupq_n_u32(0x80000000u)), bits);
        uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
        uint32x4_t w;
        switch (job->out_dtype) {
        case DT_F16: {
            float16x4_t h = vcvt_f16_f32(vreinterpretq_f32_u32(bits));
            w = vbslq_u32(nan, vdupq_n_u32(FP16_CANONICAL_NAN), vmovl_u16(vreinterpret_u16_f16(h)));
            break;
        }
        case DT_BF16: {
            uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
            uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), 16);
            w = vbslq_u32(nan, vdupq_n_u32(BF16_CANONICAL_NAN), rounded);
            break;
        }
        default: w = vbslq_u32(nan, vdupq_n_u32(0x7fffffffu), bits); break;
        }
        words.val[i] = vreinterpretq_u8_u32(w);
    }
    for (int k = 0; k < 4; k++)
        plane[k] = vqtbl4q_u8(words, vld1q_u8(BY_BYTE[k]));
}

void dequant_blocks_neon(const struct dequant_job *dequant_job, uint64_t first_block, uint64_t blocks, int stream)
{
    (void)stream; /* AArch64 has no plain-store hint worth taking here */
    const struct job_view view = job_view_of(dequant_job), *job = &view;
    const uint64_t bs = job->blocksize;
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
    for (uint64_t b = first_block; b < first_block + blocks; b++) {
        uint8x16_t plane[4];
        block_planes(job, b, plane);
        for (uint64_t e = b * bs; e < (b + 1) * bs; e += 2 * STEP_BYTES) {
            uint8x16_t packed = vld1q_u8(job->packed + e / 2);
            uint8x16_t hi = vshrq_n_u8(packed, 4), lo = vandq_u8(packed, low4);
            if (job->out_dtype != DT_F32) {
                /* Elements 2i and 2i+1 are the 4 bytes lo(hi_i) hi(hi_i) lo(lo_i) hi(lo_i). */
                uint8x16x4_t o = {{vqtbl1q_u8(plane[0], hi), vqtbl1q_u8(plane[1], hi), vqtbl1q_u8(plane[0], lo),
                                   vqtbl1q_u8(plane[1], lo)}};
                vst4q_u8((uint8_t *)((uint16_t *)job->out + e), o);
                continue;
            }
            uint8x16_t idx[2] = {vzip1q_u8(hi, lo), vzip2q_u8(hi, lo)}; /* elements 0..15, 16..31 */
            for (int i = 0; i < 2; i++) {
                uint8x16x4_t o = {{vqtbl1q_u8(plane[0], idx[i]), vqtbl1q_u8(plane[1], idx[i]),
                                   vqtbl1q_u8(plane[2], idx[i]), vqtbl1q_u8(plane[3], idx[i])}};
                vst4q_u8((uint8_t *)((uint32_t *)job->out + e + 16 * i), o);
            }
        }
    }
}

#endif
