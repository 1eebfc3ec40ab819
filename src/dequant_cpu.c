#include "dequant.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_path.h"
#include "dequant_simd.h"
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
/* Outputs from this size up are streamed past the caches (dequant_cpu_path):
 * above the last-level cache of the machines nf4deq runs on, or their share of
 * it, and far above the pipeline's chunks. */
#define DEQUANT_STREAM_BYTES (UINT64_C(32) << 20)

static inline void store(void *out, enum st_dtype dt, uint64_t e, uint32_t bits)
{
    if (dt == DT_F32)
        ((uint32_t *)out)[e] = bits;
    else
        ((uint16_t *)out)[e] = (uint16_t)bits;
}

void dequant_cpu_range(const struct dequant_job *job, uint64_t first, uint64_t count)
{
    const float *values = job_code_values(job);
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
        block_lut(values, job_block_absmax(job, block), job->out_dtype, lut);
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

static dequant_blocks_fn path_kernel(enum cpu_path path)
{
    switch (path) {
#if defined(__x86_64__) || defined(__i386__)
    case CPU_PATH_SSE: return dequant_blocks_ssse3;
    case CPU_PATH_AVX2: return dequant_blocks_avx2;
    case CPU_PATH_AVX512: return dequant_blocks_avx512;
#endif
#if defined(__aarch64__)
    case CPU_PATH_NEON: return dequant_blocks_neon;
#endif
    default: return NULL;
    }
}

struct path_job {
    const struct dequant_job *job;
    dequant_blocks_fn blocks_fn; /* NULL: the scalar loop */
    int stream;
};

/* parallel_for's unit is a quantization block: no two threads share a block's
 * table. The vector kernels take whole blocks; a tensor's last, partial block
 * goes through the scalar loop. */
static void block_range(void *ctx, uint64_t first_block, uint64_t blocks)
{
    const struct path_job *pj = ctx;
    const struct dequant_job *job = pj->job;
    uint64_t end = first_block + blocks;
    uint64_t full_blocks = job->n / job->blocksize;
    if (pj->blocks_fn && first_block < full_blocks) {
        uint64_t vector_end = end < full_blocks ? end : full_blocks;
        pj->blocks_fn(job, first_block, vector_end - first_block, pj->stream);
        first_block = vector_end;
    }
    if (first_block < end) {
        uint64_t first = first_block * job->blocksize;
        uint64_t count = (end - first_block) * job->blocksize;
        dequant_cpu_range(job, first, count < job->n - first ? count : job->n - first);
    }
}

int dequant_cpu_streams(const struct dequant_job *job)
{
    /* An output larger than a last-level cache cannot still be in cache when
     * it is next read: stream it to memory (as memcpy does at that size), so
     * each line is written without first being read. The pipeline's chunks
     * are smaller, and stay in cache for the writer. */
    uint64_t out_bytes = job->n * (dtype_bits(job->out_dtype) / 8);
    return out_bytes >= DEQUANT_STREAM_BYTES && ((uintptr_t)job->out & 63) == 0;
}

void dequant_cpu_path(const struct dequant_job *job, int threads, enum cpu_path path)
{
    struct path_job pj = {job, path_kernel(path), dequant_cpu_streams(job)};
    uint64_t blocks = (job->n + job->blocksize - 1) / job->blocksize;
    uint64_t min_blocks = MIN_ELEMENTS_PER_THREAD / job->blocksize;
    parallel_for(blocks, threads, min_blocks ? min_blocks : 1, block_range, &pj);
}

void dequant_cpu(const struct dequant_job *job, int threads)
{
    dequant_cpu_path(job, threads, cpu_path_active());
}
