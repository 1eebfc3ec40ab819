/* src/gpu.h (and the GPU hooks of src/bench.h) for builds without nvcc:
 * there is no device, and opening one says why. */
#include <stdlib.h>

#include "bench.h"
#include "gpu.h"
#include "status.h"

#define NO_CUDA_MSG "this nf4deq was built without CUDA support"

struct gpu_ctx {
    int unused;
};

int gpu_device_count(void)
{
    return 0;
}

int gpu_open(struct gpu_ctx **out, int device, uint64_t mem_budget)
{
    (void)device;
    (void)mem_budget;
    *out = NULL;
    return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, NO_CUDA_MSG);
}

void gpu_close(struct gpu_ctx *ctx)
{
    (void)ctx;
}

const char *gpu_name(const struct gpu_ctx *ctx)
{
    (void)ctx;
    return "none";
}

int gpu_exclusive(const struct gpu_ctx *ctx)
{
    (void)ctx;
    return 0;
}

uint64_t gpu_mem_budget(const struct gpu_ctx *ctx)
{
    (void)ctx;
    return 0;
}

void *gpu_host_alloc(struct gpu_ctx *ctx, size_t bytes)
{
    (void)ctx;
    return malloc(bytes);
}

void gpu_host_free(struct gpu_ctx *ctx, void *p)
{
    (void)ctx;
    free(p);
}

int gpu_host_register(struct gpu_ctx *ctx, void *p, size_t bytes)
{
    (void)ctx;
    (void)p;
    (void)bytes;
    return -1;
}

void gpu_host_unregister(struct gpu_ctx *ctx, void *p)
{
    (void)ctx;
    (void)p;
}

int gpu_use_lanes(struct gpu_ctx *ctx, int lanes)
{
    (void)ctx;
    (void)lanes;
    return 1;
}

int gpu_dequant_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *host_job)
{
    (void)lane;
    return gpu_dequant(ctx, host_job);
}

int gpu_merge_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *dq, const struct merge_job *mj,
                   uint64_t *overflowed)
{
    (void)lane;
    return gpu_merge(ctx, dq, mj, overflowed);
}

int gpu_dequant(struct gpu_ctx *ctx, const struct dequant_job *host_job)
{
    (void)ctx;
    (void)host_job;
    return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, NO_CUDA_MSG);
}

int gpu_merge(struct gpu_ctx *ctx, const struct dequant_job *dq, const struct merge_job *mj, uint64_t *overflowed)
{
    (void)ctx;
    (void)dq;
    (void)mj;
    *overflowed = 0;
    return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, NO_CUDA_MSG);
}

int gpu_dequant_ex(struct gpu_ctx *ctx, const struct dequant_job *host_job, unsigned variant, int ept,
                   int threads)
{
    (void)variant;
    (void)ept;
    (void)threads;
    return gpu_dequant(ctx, host_job);
}

void gpu_set_subchunk_limit(struct gpu_ctx *ctx, uint64_t max_elems)
{
    (void)ctx;
    (void)max_elems;
}

uint64_t gpu_last_subchunks(const struct gpu_ctx *ctx)
{
    (void)ctx;
    return 0;
}

int gpu_bench_copy_bw(struct gpu_ctx *ctx, double *bytes_per_s)
{
    (void)ctx;
    *bytes_per_s = 0;
    return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, NO_CUDA_MSG);
}

int gpu_bench_shape(struct gpu_ctx *ctx, const struct gpu_bench_opts *o, struct gpu_bench_result *r)
{
    (void)ctx;
    (void)o;
    (void)r;
    return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, NO_CUDA_MSG);
}

/* The GPU half of include/nf4deq.h in a build without CUDA. */
#include "api_internal.h"
#include "nf4deq.h"

int nf4deq_dequantize_cuda(const void *packed, const void *absmax, const float *nested_absmax,
                           const float *nested_code, float nested_offset, const float *nested_offset_device,
                           uint64_t n, uint32_t blocksize, uint32_t nested_blocksize, int quant_type,
                           int out_dtype, void *out, void *stream)
{
    (void)nested_offset_device, (void)stream;
    /* Bad arguments are refused as the CUDA build refuses them; good ones find no device. */
    struct dequant_job job;
    int rc = api_make_cuda_job(&job, packed, absmax, nested_absmax, nested_code, nested_offset, n, blocksize,
                               nested_blocksize, quant_type, out_dtype, out);
    if (rc != NF4DEQ_OK || n == 0)
        return rc;
    return nf4_fail(NF4DEQ_ENODEV, NULL, NULL, NO_CUDA_MSG);
}

int nf4deq_empty_cuda(void *stream)
{
    (void)stream;
    nf4_clear_error();
    return nf4_fail(NF4DEQ_ENODEV, NULL, NULL, NO_CUDA_MSG);
}
