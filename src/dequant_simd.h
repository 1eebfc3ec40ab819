/* The vector CPU kernels behind dequant_cpu (src/dequant_x86.c, src/dequant_neon.c).
 *
 * Each one dequantizes whole blocks: per block it builds the 16 possible
 * outputs (the code values times the block's absmax, rounded into the output
 * type) with vector multiplies and conversions, splits them into byte planes,
 * and expands the packed nibbles with byte shuffles (pshufb / tbl). Every step
 * is the scalar path's arithmetic, so the bytes are the same. */
#ifndef NF4DEQ_DEQUANT_SIMD_H
#define NF4DEQ_DEQUANT_SIMD_H

#include <stdint.h>

#include "dequant.h"
#include "fpconv.h"

/* Dequantizes blocks [first_block, first_block + blocks) of job: each must be a
 * full block (the caller keeps the tensor's last, partial block). `stream`:
 * write the output with non-temporal stores (x86; NEON ignores it), which
 * needs job->out 64-byte aligned. */
typedef void (*dequant_blocks_fn)(const struct dequant_job *job, uint64_t first_block, uint64_t blocks, int stream);

void dequant_blocks_ssse3(const struct dequant_job *job, uint64_t first_block, uint64_t blocks, int stream);
void dequant_blocks_avx2(const struct dequant_job *job, uint64_t first_block, uint64_t blocks, int stream);
void dequant_blocks_avx512(const struct dequant_job *job, uint64_t first_block, uint64_t blocks, int stream);
void dequant_blocks_neon(const struct dequant_job *job, uint64_t first_block, uint64_t blocks, int stream);

/* A block's absmax in bitsandbytes' order: two roundings, the product flushed. */
static inline float job_block_absmax(const struct dequant_job *job, uint64_t block)
{
    if (!job->absmax_code)
        return job->absmax[block];
    float scaled = mul_ftz(job->nested_code[job->absmax_code[block]],
                           job->nested_absmax[block / job->nested_blocksize]);
    return scaled + job->nested_offset;
}

/* The job as the vector kernels read it, copied into a local: their stores go
 * through may-alias vector types, so fields read through the job pointer would
 * be reloaded after every store; and the nested blocksize, a power of two,
 * becomes a shift instead of a 64-bit division per block. */
struct job_view {
    const uint8_t *packed;
    void *out;
    enum st_dtype out_dtype;
    uint64_t blocksize;
    const uint8_t *absmax_code;
    const float *absmax, *nested_absmax, *nested_code;
    float nested_offset;
    unsigned nested_shift;
    const float *values; /* the 16 code values */
    int stream;          /* non-temporal, aligned stores of the output */
};

static inline struct job_view job_view_of(const struct dequant_job *job)
{
    struct job_view v = {job->packed,
                         job->out,
                         job->out_dtype,
                         job->blocksize,
                         job->absmax_code,
                         job->absmax,
                         job->nested_absmax,
                         job->nested_code,
                         job->nested_offset,
                         (unsigned)__builtin_ctz(job->nested_blocksize),
                         job->quant_type == QUANT_FP4 ? FP4_VALUES : NF4_VALUES,
                         0};
    return v;
}

/* job_block_absmax through the view. */
static inline float view_block_absmax(const struct job_view *v, uint64_t block)
{
    if (!v->absmax_code)
        return v->absmax[block];
    return mul_ftz(v->nested_code[v->absmax_code[block]], v->nested_absmax[block >> v->nested_shift]) +
           v->nested_offset;
}

/* The 16 possible outputs of one block, already in the output encoding: each
 * element is then a table lookup, and every value is computed exactly once.
 * The scalar path, and the vector paths' way for the blocks their fast
 * tables do not cover. */
static inline void block_lut(const float *values, float absmax, enum st_dtype out_dtype, uint32_t lut[16])
{
    for (int k = 0; k < 16; k++) {
        float v = mul_ftz(values[k], absmax);
        switch (out_dtype) {
        case DT_F16: lut[k] = f32_to_f16(v); break;
        case DT_BF16: lut[k] = f32_to_bf16(v); break;
        default: lut[k] = f32_canonical_bits(v); break;
        }
    }
}

/* The vector tables take a shortcut where it is exact: when absmax is finite
 * and at least 2^-118, no product is NaN, infinite or subnormal (the smallest
 * nonzero code value is FP4's 0.0052 > 2^-8), so bitsandbytes' flushes and
 * NaN canonicalisation are no-ops and a plain multiply and conversion give
 * its bytes. Any other absmax (NaN, inf, zero, tiny) builds its table with
 * block_lut. The test is on the bits: |absmax| in [2^-118, FLT_MAX]. */
#define FAST_TABLE_MIN_BITS UINT32_C(0x04800000) /* 2^-118 */
#define FAST_TABLE_END_BITS UINT32_C(0x7f800000) /* inf */
static inline int fast_table_ok(float absmax)
{
    return (f32_bits(absmax) & 0x7fffffffu) - FAST_TABLE_MIN_BITS < FAST_TABLE_END_BITS - FAST_TABLE_MIN_BITS;
}

static inline const float *job_code_values(const struct dequant_job *job)
{
    return job->quant_type == QUANT_FP4 ? FP4_VALUES : NF4_VALUES;
}

#endif
