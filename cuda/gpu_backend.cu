// The GPU conversion back end (src/gpu.h): opening a device, its memory budget,
// pinned host memory, and a job's trip through the device in sub-chunks, with
// copy-in, kernel and copy-out overlapped on two streams.
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_backend.cuh"
#include "launch.cuh"

extern "C" {
#include "gpu.h"
}

#define SUBCHUNK_CAP_ELEMS (1ull << 25) // default sub-chunk cap: overlap needs several
#define DEFAULT_BUDGET_FRACTION 0.5

extern "C" int gpu_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

extern "C" int gpu_open(struct gpu_ctx **out, int device, uint64_t mem_budget)
{
    *out = NULL;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    if (count == 0)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "no CUDA device found");
    if (device < 0 || device >= count)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "CUDA device %d does not exist (%d found)", device, count);
    cudaCheck(cudaSetDevice(device));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    if (prop.major * 10 + prop.minor < 75)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "%s is sm_%d%d; nf4deq needs sm_75 or newer",
                        prop.name, prop.major, prop.minor);
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));

    gpu_ctx *c = (gpu_ctx *)calloc(1, sizeof *c);
    if (!c)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
    c->device = device;
    c->major = prop.major;
    c->minor = prop.minor;
    c->sm_count = prop.multiProcessorCount;
    c->l2_bytes = (size_t)prop.l2CacheSize;
    c->budget = mem_budget ? mem_budget : (uint64_t)(free_b * DEFAULT_BUDGET_FRACTION);
    c->subchunk_cap = SUBCHUNK_CAP_ELEMS;
    snprintf(c->name, sizeof c->name, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
    for (int s = 0; s < NUM_STREAMS; s++) {
        err = cudaStreamCreateWithFlags(&c->streams[s], cudaStreamNonBlocking);
        if (err != cudaSuccess) {
            gpu_close(c);
            return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaStreamCreate: %s", cudaGetErrorString(err));
        }
    }
    err = cudaMalloc(&c->d_code, NESTED_CODE_ENTRIES * sizeof(float));
    if (err != cudaSuccess) {
        gpu_close(c);
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc: %s", cudaGetErrorString(err));
    }
    *out = c;
    return NF4_OK;
}

extern "C" void gpu_close(struct gpu_ctx *c)
{
    if (!c)
        return;
    cudaSetDevice(c->device);
    for (int s = 0; s < NUM_STREAMS; s++) {
        if (c->streams[s]) {
            cudaStreamSynchronize(c->streams[s]);
            cudaStreamDestroy(c->streams[s]);
        }
        if (c->slots[s].mem)
            cudaFree(c->slots[s].mem);
    }
    if (c->d_code)
        cudaFree(c->d_code);
    cudaGetLastError();
    free(c);
}

extern "C" const char *gpu_name(const struct gpu_ctx *c) { return c->name; }
extern "C" uint64_t gpu_mem_budget(const struct gpu_ctx *c) { return c->budget; }
extern "C" void gpu_set_subchunk_limit(struct gpu_ctx *c, uint64_t max_elems) { c->subchunk_cap = max_elems; }
extern "C" uint64_t gpu_last_subchunks(const struct gpu_ctx *c) { return c->last_subchunks; }

// Host allocations carry a header saying whether they are pinned.
#define HOST_HDR 64
extern "C" void *gpu_host_alloc(struct gpu_ctx *c, size_t bytes)
{
    (void)c;
    char *p = NULL;
    if (cudaHostAlloc((void **)&p, bytes + HOST_HDR, cudaHostAllocDefault) == cudaSuccess) {
        p[0] = 1;
        return p + HOST_HDR;
    }
    cudaGetLastError();
    p = (char *)malloc(bytes + HOST_HDR);
    if (!p)
        return NULL;
    p[0] = 0;
    return p + HOST_HDR;
}

extern "C" void gpu_host_free(struct gpu_ctx *c, void *ptr)
{
    (void)c;
    if (!ptr)
        return;
    char *p = (char *)ptr - HOST_HDR;
    if (p[0] == 1)
        cudaFreeHost(p);
    else
        free(p);
}

static size_t out_size(enum st_dtype dt) { return dt == DT_F32 ? 4 : 2; }
static size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

struct slot_layout {
    size_t packed, codes, scales, out, total; // byte offsets / sizes
};

static slot_layout layout_for(const dequant_job *j, uint64_t sub_n)
{
    slot_layout L;
    uint64_t blocks = CEIL_DIV(sub_n, (uint64_t)j->blocksize);
    uint64_t scales = j->absmax_code ? CEIL_DIV(blocks, (uint64_t)j->nested_blocksize) : blocks;
    size_t off = 0;
    L.packed = off; off += align256(CEIL_DIV(sub_n, 2ull));
    L.codes = off; off += j->absmax_code ? align256(blocks) : 0;
    L.scales = off; off += align256(scales * sizeof(float));
    L.out = off; off += align256(sub_n * out_size(j->out_dtype));
    L.total = off;
    return L;
}

static int ensure_slot(gpu_ctx *c, int s, size_t bytes)
{
    if (c->slots[s].bytes >= bytes)
        return NF4_OK;
    if (c->slots[s].mem) {
        cudaCheck(cudaFree(c->slots[s].mem));
        c->slots[s].mem = NULL;
        c->slots[s].bytes = 0;
    }
    cudaError_t err = cudaMalloc(&c->slots[s].mem, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        c->slots[s].mem = NULL;
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc of %zu bytes failed: %s", bytes,
                        cudaGetErrorString(err));
    }
    c->slots[s].bytes = bytes;
    return NF4_OK;
}

static int run_pipeline(gpu_ctx *c, const dequant_job *j, unsigned variant, launch_cfg cfg)
{
    const bool nested = j->absmax_code != NULL;
    const uint64_t granule = (uint64_t)j->blocksize * (nested ? j->nested_blocksize : 1u);
    const size_t osz = out_size(j->out_dtype);

    // Sub-chunk: what two slots of the budget hold, capped so big jobs pipeline.
    double per_elem = 0.5 + (double)osz + (nested ? 1.0 : 4.0) / j->blocksize;
    uint64_t sub_n = (uint64_t)((double)(c->budget / NUM_STREAMS) / per_elem);
    if (c->subchunk_cap && sub_n > c->subchunk_cap)
        sub_n = c->subchunk_cap;
    sub_n = sub_n / granule * granule;
    if (sub_n < granule)
        sub_n = granule;
    if (sub_n >= j->n)
        sub_n = j->n;

    slot_layout L = layout_for(j, sub_n);
    int nslots = sub_n < j->n ? NUM_STREAMS : 1;
    for (int s = 0; s < nslots; s++) {
        int rc = ensure_slot(c, s, L.total);
        if (rc)
            return rc;
    }
    if (nested) {
        // The kernels run on non-blocking streams, which would not wait for a
        // copy on the legacy stream (and a pageable-source cudaMemcpy may return
        // before its DMA lands): queue the table on stream 0 and make every
        // other stream wait for it.
        cudaCheck(cudaMemcpyAsync(c->d_code, j->nested_code, NESTED_CODE_ENTRIES * sizeof(float),
                                  cudaMemcpyHostToDevice, c->streams[0]));
        if (nslots > 1) {
            cudaEvent_t table_ready;
            cudaCheck(cudaEventCreateWithFlags(&table_ready, cudaEventDisableTiming));
            cudaError_t err = cudaEventRecord(table_ready, c->streams[0]);
            for (int s = 1; s < nslots && err == cudaSuccess; s++)
                err = cudaStreamWaitEvent(c->streams[s], table_ready, 0);
            cudaEventDestroy(table_ready);
            cudaCheck(err);
        }
    }

    c->last_subchunks = 0;
    for (uint64_t start = 0, i = 0; start < j->n; start += sub_n, i++) {
        const int s = (int)(i % nslots);
        cudaStream_t st = c->streams[s];
        char *mem = (char *)c->slots[s].mem;
        const uint64_t cnt = j->n - start < sub_n ? j->n - start : sub_n;
        const uint64_t blk0 = start / j->blocksize, blocks = CEIL_DIV(cnt, (uint64_t)j->blocksize);

        dev_job d;
        memset(&d, 0, sizeof d);
        d.n = cnt;
        d.blocksize = j->blocksize;
        d.nested_blocksize = j->nested_blocksize;
        d.quant_type = j->quant_type;
        d.out_dtype = j->out_dtype;
        d.nested_offset = j->nested_offset;
        d.packed = (const uint8_t *)(mem + L.packed);
        d.out = mem + L.out;
        cudaCheck(cudaMemcpyAsync(mem + L.packed, j->packed + start / 2, CEIL_DIV(cnt, 2ull),
                                  cudaMemcpyHostToDevice, st));
        if (nested) {
            const uint64_t nb0 = blk0 / j->nested_blocksize, nbs = CEIL_DIV(blocks, (uint64_t)j->nested_blocksize);
            d.absmax_code = (const uint8_t *)(mem + L.codes);
            d.nested_absmax = (const float *)(mem + L.scales);
            d.nested_code = c->d_code;
            cudaCheck(cudaMemcpyAsync(mem + L.codes, j->absmax_code + blk0, blocks, cudaMemcpyHostToDevice, st));
            cudaCheck(cudaMemcpyAsync(mem + L.scales, j->nested_absmax + nb0, nbs * sizeof(float),
                                      cudaMemcpyHostToDevice, st));
        } else {
            d.absmax = (const float *)(mem + L.scales);
            cudaCheck(cudaMemcpyAsync(mem + L.scales, j->absmax + blk0, blocks * sizeof(float),
                                      cudaMemcpyHostToDevice, st));
        }
        // Poison the device output first: an element the kernel failed to write
        // shows up as 0xA5A5 instead of stale data from an earlier sub-chunk.
        cudaCheck(cudaMemsetAsync(mem + L.out, 0xA5, cnt * osz, st));
        int rc = nf4_launch_dequant(&d, cfg, variant, st);
        if (rc)
            return rc;
        cudaCheck(cudaMemcpyAsync((char *)j->out + start * osz, mem + L.out, cnt * osz,
                                  cudaMemcpyDeviceToHost, st));
        c->last_subchunks++;
    }
    for (int s = 0; s < nslots; s++)
        cudaCheck(cudaStreamSynchronize(c->streams[s]));
    return NF4_OK;
}

extern "C" int gpu_dequant_ex(struct gpu_ctx *c, const struct dequant_job *j, unsigned variant, int ept,
                              int threads)
{
    if (j->n == 0)
        return NF4_OK;
    if (!is_pow2(j->blocksize) || j->blocksize < NF4_MIN_BLOCKSIZE || j->blocksize > NF4_MAX_BLOCKSIZE)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad blocksize %u", j->blocksize);
    if (j->absmax_code && !is_pow2(j->nested_blocksize))
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad nested blocksize %u", j->nested_blocksize);
    cudaCheck(cudaSetDevice(c->device));
    launch_cfg cfg = nf4_pick_cfg(c->major, c->minor, j->n);
    if (ept)
        cfg.ept = ept;
    if (threads)
        cfg.threads = threads;
    int rc = run_pipeline(c, j, variant, cfg);
    if (rc) {
        // Leave nothing in flight that still reads or writes the caller's buffers.
        for (int s = 0; s < NUM_STREAMS; s++)
            cudaStreamSynchronize(c->streams[s]);
        cudaGetLastError();
    }
    return rc;
}

extern "C" int gpu_dequant(struct gpu_ctx *c, const struct dequant_job *j)
{
    return gpu_dequant_ex(c, j, 0, 0, 0);
}
