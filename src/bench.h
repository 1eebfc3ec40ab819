/* `nf4deq bench`, and the GPU hooks it (and tests/gpu) use beyond src/gpu.h.
 * The hooks are implemented in cuda/ and stubbed in src/gpu_none.c. */
#ifndef NF4DEQ_BENCH_H
#define NF4DEQ_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "dequant.h"

struct gpu_ctx;

/* argv[0] is "bench". Returns an NF4_* exit code; errors through nf4_fail(). */
int cmd_bench(int argc, char **argv);

/* ---- kernel variants (bits; 0 = the default kernel) ---------------------- */
#define GPU_VARIANT_ASM_VALUE 1u /* asm nibble->value path: prmt/lop3 unpack + mul.rn.ftz */
#define GPU_VARIANT_NO_HINTS 2u /* plain loads/stores: no no_allocate/evict_last/.cs */
/* Bench-only diagnostics (not dequantization): */
#define GPU_VARIANT_TRAFFIC 4u /* same loads and stores, no arithmetic: the kernel's floor */
#define GPU_VARIANT_EMPTY 8u   /* an empty kernel: the launch floor */
#define GPU_VARIANT_L2_NOPF 16u /* traffic floor without the L2::256B prefetch hint */
#define GPU_VARIANT_MEMSET 64u  /* cudaMemset of the output: the write-only floor */
#define GPU_VARIANT_READ 128u   /* read the packed input only: the read-only floor */
/* (TRAFFIC: ept = 4-byte loads per lane, threads = CTA size, NO_HINTS = plain stores) */
#define GPU_VARIANT_NO_STORE_HINT 256u /* loads hinted, plain stores */
#define GPU_VARIANT_ASM_MUL 512u /* only the multiply in asm (mul.rn.ftz), C unpack */
#define GPU_VARIANT_C_MUL 16384u /* the multiply in CUDA C, whatever the table picks */
/* Bench only: the nested offset read from device memory, as the PyTorch route passes it */
#define GPU_VARIANT_DEVICE_OFFSET 32768u
#define GPU_VARIANT_BULK_STORE 1024u /* sm_90: each warp's tile through shared memory, one TMA bulk store */
#define GPU_VARIANT_BULK_EVICT_FIRST 2048u /* the same with an L2 evict_first policy */
/* These three force where the code values come from, whatever the per-architecture table picks: */
#define GPU_VARIANT_SHUFFLE_VALUES 4096u /* from each warp's lanes, by shuffle */
#define GPU_VARIANT_SHARED_VALUES 8192u  /* from a table in shared memory */
/* each block's 16 outputs, rounded to the 16-bit output type, in the lanes of each half-warp
 * (blocksize >= 64; other jobs read the values by shuffle) */
#define GPU_VARIANT_OUTPUT_VALUES 131072u
/* sm_90: launched as a programmatic dependent (the shuffle value path; elsewhere the default) */
#define GPU_VARIANT_PDL 65536u
/* (NF4DEQ_ASM=0 builds ignore the ASM variants: no inline asm at all) */

/* bitsandbytes entry points, as exported by libbitsandbytes_cuda*.so
 * (csrc/pythonInterface.cpp). The stream is a cudaStream_t. */
typedef void (*bnb_dequant_fp32_fn)(float *code, unsigned char *A, float *absmax, float *out,
                                    int blocksize, int n, void *stream);
typedef void (*bnb_dequant_4bit_fn)(float *code, unsigned char *A, float *absmax, void *out,
                                    int blocksize, int n, void *stream);

/* One kernel variant to time: GPU_VARIANT_* bits and a launch config
 * (ept/threads 0 = the per-architecture table's choice). */
struct gpu_bench_variant {
    unsigned flags;
    int ept, threads;
};

#define GPU_BENCH_MAX_VARIANTS 48

struct gpu_bench_opts {
    uint64_t n;              /* elements (blocksize 64, nested blocksize 256) */
    enum st_dtype out_dtype; /* DT_F16 or DT_BF16 (DT_F32 works too, no bnb) */
    int iters;               /* timed runs per variant (>= 1) */
    const struct gpu_bench_variant *variants; /* timed side by side, interleaved */
    int n_variants;                           /* 1..GPU_BENCH_MAX_VARIANTS */
    bnb_dequant_fp32_fn bnb_fp32; /* NULL: no bitsandbytes comparison */
    bnb_dequant_4bit_fn bnb_4bit; /* the fp16 or bf16 nf4 entry point */
    uint64_t seed;
    int graph_variants; /* also time each kernel variant (and the empty launch) as graph replays */
};

struct gpu_bench_result {
    double ms[GPU_BENCH_MAX_VARIANTS]; /* median kernel time per variant (ms) */
    double bnb_ms;     /* median of the bitsandbytes sequence (ms), 0 if not run */
    /* The same two, per launch, from replays of a CUDA graph of back-to-back
     * launches (rotating input sets): no per-launch event and launch gaps. */
    double graph_ms, bnb_graph_ms;
    /* With graph_variants: per variant, the same from graph replays; 0 where
     * not timed (the traffic, memset and read floors). */
    double graph_var_ms[GPU_BENCH_MAX_VARIANTS];
    int bnb_identical; /* 1 if bitsandbytes' output equals nf4deq's byte for byte */
    uint64_t bytes;    /* bytes the fused kernel must move */
    int input_sets;    /* rotated input sets */
    int ept, threads, store_hint, asm_mul; /* the per-arch table's config for this size */
    int values; /* its code values: 0 shared table, 1 by shuffle, 2 outputs by shuffle (VALUES_*) */
};

/* Device-to-device copy bandwidth (bytes read + written per second), median. */
int gpu_bench_copy_bw(struct gpu_ctx *ctx, double *bytes_per_s);
int gpu_bench_shape(struct gpu_ctx *ctx, const struct gpu_bench_opts *o, struct gpu_bench_result *r);

/* ---- test hooks ---------------------------------------------------------- */
/* Largest sub-chunk gpu_dequant uses, in elements (0: only the budget limits it). */
void gpu_set_subchunk_limit(struct gpu_ctx *ctx, uint64_t max_elems);
/* Runs job (HOST pointers) like gpu_dequant with the given variant and config
 * (0, 0, 0 = defaults). */
int gpu_dequant_ex(struct gpu_ctx *ctx, const struct dequant_job *host_job, unsigned variant,
                   int ept, int threads);
/* Sub-chunks the last gpu_dequant call used (to check the pipeline ran). */
uint64_t gpu_last_subchunks(const struct gpu_ctx *ctx);

#endif
