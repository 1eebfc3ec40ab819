#include "dequant.h"

#include <stdlib.h>
#include <string.h>

#include "fpconv.h"
#include "parallel.h"

const float NF4_VALUES[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

/* Bit 3 is the sign; code 0b1000 is -0.0, as (0 * absmax) * -1 gives. */
const float FP4_VALUES[16] = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
    -0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f,
};

/* Below this many elements a thread costs more than it saves. */
#define MIN_ELEMENTS_PER_THREAD (1u << 18)

static float block_absmax(const struct dequant_job *job, uint64_t block)
{
    if (!job->absmax_code)
        return job->absmax[block];
    float scaled = mul_ftz(job->nested_code[job->absmax_code[block]],
                           job->nested_absmax[block / job->nested_blocksize]);
    return scaled + job->nested_offset;
}

/* The 16 possible outputs of one block, already in the output encoding: each
 * element is then a table lookup, and every value is computed exactly once. */
static void block_lut(const float *values, float absmax, enum st_dtype out_dtype, uint32_t lut[16])
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

static inline void store(void *out, enum st_dtype dt, uint64_t e, uint32_t bits)
{
    if (dt == DT_F32)
        ((uint32_t *)out)[e] = bits;
    else
        ((uint16_t *)out)[e] = (uint16_t)bits;
}

void dequant_cpu_range(const struct dequant_job *job, uint64_t first, uint64_t count)
{
    const float *values = job->quant_type == QUANT_FP4 ? FP4_VALUES : NF4_VALUES;
    uint64_t end = first + count;
    if (end > job->n)
        end = job->n;
    uint64_t e = first;
    while (e < end) {
        uint64_t block = e / job->blocksize;
        uint64_t block_end = (block + 1) * job->blocksize;
        if (block_end > end)
            block_end = end;
        uint32_t lut[16];
        block_lut(values, block_absmax(job, block), job->out_dtype, lut);
        if (job->out_dtype != DT_F32 && (e & 1) == 0) {
            uint16_t *out = (uint16_t *)job->out;
            for (; e + 1 < block_end; e += 2) {
                uint8_t byte = job->packed[e / 2];
                out[e] = (uint16_t)lut[byte >> 4];
                out[e + 1] = (uint16_t)lut[byte & 15];
            }
        }
        for (; e < block_end; e++) {
            uint8_t byte = job->packed[e / 2];
            store(job->out, job->out_dtype, e, lut[(e & 1) ? (byte & 15) : (byte >> 4)]);
        }
    }
}

/* parallel_for's unit is a quantization block: no two threads share a block's table. */
static void block_range(void *ctx, uint64_t first_block, uint64_t blocks)
{
    const struct dequant_job *job = ctx;
    uint64_t first = first_block * job->blocksize;
    uint64_t count = blocks * job->blocksize;
    dequant_cpu_range(job, first, count < job->n - first ? count : job->n - first);
}

void dequant_cpu(const struct dequant_job *job, int threads)
{
    uint64_t blocks = (job->n + job->blocksize - 1) / job->blocksize;
    uint64_t min_blocks = MIN_ELEMENTS_PER_THREAD / job->blocksize;
    parallel_for(blocks, threads, min_blocks ? min_blocks : 1, block_range, (void *)job);
}
