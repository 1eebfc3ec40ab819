// Internal interface of the fused-kernel launcher (cuda/dequant_launch.cu),
// shared by its callers in cuda/: the GPU back end, the PyTorch-facing ABI and the
// benchmark. Not seen from C: C code goes through src/gpu.h and the C-callable
// bench/test hooks declared in src/bench.h.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "bench.h"
#include "dequant.h"
#include "status.h"
}

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// Records the first CUDA failure with file:line through nf4_fail() and returns
// its NF4_* code from the calling function. Never exits.
#define cudaCheck(call)                                                                        \
    do {                                                                                       \
        cudaError_t err_ = (call);                                                             \
        if (err_ != cudaSuccess)                                                               \
            return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "CUDA error at %s:%d: %s (%s)",         \
                            __FILE__, __LINE__, cudaGetErrorString(err_), #call);              \
    } while (0)

// Launch configuration: elements per thread and threads per CTA.
struct launch_cfg {
    int ept;     // elements per lane: 16 or 32 (a warp owns 32 * ept consecutive elements)
    int threads; // threads per CTA
    int store_hint; // 1: streaming stores (st.global.cs); 0: plain (output stays in L2)
    int values;         // where the code values come from (cuda/nf4_device.cuh): VALUES_SHARED, a
                        // table in shared memory; VALUES_SHUFFLE, the lanes of each warp, by shuffles
                        // (no shared table, no CTA barrier); VALUES_OUTPUTS, each block's outputs in
                        // the lanes of each half-warp (16-bit output and blocksize >= 64; the
                        // launcher takes VALUES_SHUFFLE for the other jobs)
    int asm_mul;        // 1: each product is one mul.rn.ftz.f32 (inline asm, NF4 with double quant
                        // and 16-bit output, the bench's case); 0: __fmul_rn with explicit flushes
    int pdl;            // 1: programmatic dependent launch (sm_90 only; with the shuffle value path)
};

// The one case the launcher instantiates asm kernels for (launch_cfg.asm_mul, the
// asm bench variants): NF4 with double quant and 16-bit output, the bench's. For
// every other job it ignores the configuration's asm multiply and runs CUDA C, as
// NF4DEQ_ASM=0 builds do for every job.
constexpr bool asm_kernel_case(bool nf4, bool nested, size_t out_bytes)
{
    return nf4 && nested && out_bytes == 2;
}

// A dequant job whose pointers are all DEVICE memory (packed and out 16-byte aligned).
struct dev_job {
    const uint8_t *packed;
    const uint8_t *absmax_code; // double quant, else NULL
    const float *absmax;        // single quant, else NULL
    const float *nested_absmax;
    const float *nested_code;
    float nested_offset;
    const float *nested_offset_ptr; // device scalar that overrides nested_offset (PyTorch keeps it on the GPU)
    uint64_t n;
    uint32_t blocksize;
    uint32_t nested_blocksize;
    enum quant_type quant_type;
    enum st_dtype out_dtype;
    void *out;
};

// Launches the fused kernel on `stream` (one launch). variant: GPU_VARIANT_* bits
// (bench.h). Returns NF4_OK or an NF4_* code with nf4_fail() set.
int nf4_launch_dequant(const struct dev_job *job, struct launch_cfg cfg, unsigned variant,
                       cudaStream_t stream);

// The configuration chosen for compute capability major.minor and n elements.
struct launch_cfg nf4_pick_cfg(int major, int minor, uint64_t n);

static inline bool is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

// ceil(log2(v)): the shift of a power-of-two blocksize.
static inline uint32_t log2u(uint64_t v)
{
    uint32_t r = 0;
    while ((1ull << r) < v)
        r++;
    return r;
}
