/* One unit of 4-bit dequantization work, shared by the CPU and CUDA back ends.
 *
 * The job describes a contiguous run of a tensor's elements (the whole tensor, or
 * one chunk of it). Chunks start at a multiple of blocksize * nested_blocksize
 * (blocksize without double quant), so every pointer below points at the chunk's
 * own first byte, block and nested block, and all indexing is chunk-local.
 *
 * The arithmetic, in bitsandbytes' order, with each step rounded to fp32:
 *   absmax[b] = (nested_code[absmax_code[b]] *ftz nested_absmax[b / nested_blocksize]) + nested_offset
 *   out[e]    = value4(nibble(e)) *ftz absmax[e / blocksize]   then RNE into out_dtype
 * where element 2i is the high nibble of packed[i] and 2i+1 the low one.
 * "*ftz" is mul.rn.ftz.f32: bitsandbytes compiles its kernels with
 * --use_fast_math, so both products flush subnormal inputs and results to a
 * zero of the same sign; the "+ offset" is PyTorch's add, with IEEE subnormals
 * (see mul_ftz in fpconv.h). NaN results are the canonical GPU NaN. */
#ifndef NF4DEQ_DEQUANT_H
#define NF4DEQ_DEQUANT_H

#include <stdint.h>

#include "cpu_path.h"
#include "dtype.h"

enum quant_type { QUANT_NF4 = 0, QUANT_FP4 = 1 };

#define NF4_MIN_BLOCKSIZE 32u
#define NF4_MAX_BLOCKSIZE 4096u
#define NESTED_CODE_ENTRIES 256u

struct dequant_job {
    const uint8_t *packed;      /* ceil(n / 2) bytes */
    const uint8_t *absmax_code; /* double quant: ceil(n / blocksize) codes; else NULL */
    const float *absmax;        /* single quant: ceil(n / blocksize) scales; else NULL */
    const float *nested_absmax; /* double quant: ceil(blocks / nested_blocksize) scales */
    const float *nested_code;   /* double quant: NESTED_CODE_ENTRIES entries */
    float nested_offset;
    uint64_t n; /* elements in this job */
    uint32_t blocksize;
    uint32_t nested_blocksize;
    enum quant_type quant_type;
    enum st_dtype out_dtype; /* DT_F16, DT_BF16 or DT_F32 */
    void *out;               /* n elements of out_dtype */
};

/* The 16 values of each 4-bit code, exactly as bitsandbytes' CUDA kernels hold
 * them. bitsandbytes ignores the quant_map stored in the checkpoint when it
 * dequantizes on the GPU, and so does nf4deq. FP4 is applied as
 * (magnitude * absmax) * sign, which equals signed-value * absmax bit for bit. */
extern const float NF4_VALUES[16];
extern const float FP4_VALUES[16];

/* Dequantizes job on the CPU with up to `threads` threads (>= 1), on the
 * active CPU path (cpu_path.h). Cannot fail: the job must already be validated. */
void dequant_cpu(const struct dequant_job *job, int threads);
/* The same on a given path, which must be supported: the pipeline, the library
 * and bench --cpu pass the path they resolved once. */
void dequant_cpu_path(const struct dequant_job *job, int threads, enum cpu_path path);
/* Whether the x86 vector paths write this job's output with non-temporal
 * stores: an output too large to stay in cache, starting on a cache line. The
 * scalar and NEON paths write through the cache whatever this says. */
int dequant_cpu_streams(const struct dequant_job *job);

/* Single-threaded reference over elements [first, first + count) of the job. */
void dequant_cpu_range(const struct dequant_job *job, uint64_t first, uint64_t count);

#endif
