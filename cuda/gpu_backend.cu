// The GPU conversion back end (src/gpu.h): opening a device, its memory budget,
// pinned host memory, and a job's trip through the device in sub-chunks, with
// copy-in, kernel and copy-out overlapped on two streams, in one of several
// lanes that host threads use at once.
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_backend.cuh"
#include "launch.cuh"
#include "merge_kernel.cuh" // struct dev_merge
#include "merge_launch.cuh"

extern "C" {
#include "gpu.h"
#include "merge_job.h"
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
    int mode = cudaComputeModeExclusiveProcess; // what a failed query is taken for
    if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device) != cudaSuccess)
        cudaGetLastError();
    c->exclusive = mode != cudaComputeModeDefault;
    c->nlanes = 1;
    for (int l = 0; l < GPU_MAX_LANES; l++) {
        gpu_lane *ln = &c->lanes[l];
        for (int s = 0; s < NUM_STREAMS; s++) {
            err = cudaStreamCreateWithFlags(&ln->streams[s], cudaStreamNonBlocking);
            if (err != cudaSuccess) {
                gpu_close(c);
                return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaStreamCreate: %s", cudaGetErrorString(err));
            }
        }
        err = cudaMalloc(&ln->d_code, NESTED_CODE_ENTRIES * sizeof(float));
        if (err != cudaSuccess) {
            gpu_close(c);
            return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc: %s", cudaGetErrorString(err));
        }
    }
    *out = c;
    return NF4_OK;
}

extern "C" void gpu_close(struct gpu_ctx *c)
{
    if (!c)
        return;
    cudaSetDevice(c->device);
    for (int l = 0; l < GPU_MAX_LANES; l++) {
        gpu_lane *ln = &c->lanes[l];
        for (int s = 0; s < NUM_STREAMS; s++) {
            if (ln->streams[s]) {
                cudaStreamSynchronize(ln->streams[s]);
                cudaStreamDestroy(ln->streams[s]);
            }
            if (ln->slots[s].mem)
                cudaFree(ln->slots[s].mem);
        }
        if (ln->d_code)
            cudaFree(ln->d_code);
        if (ln->factors.mem)
            cudaFree(ln->factors.mem);
    }
    cudaGetLastError();
    free(c);
}

extern "C" const char *gpu_name(const struct gpu_ctx *c) { return c->name; }
extern "C" int gpu_exclusive(const struct gpu_ctx *c) { return c->exclusive; }
extern "C" uint64_t gpu_mem_budget(const struct gpu_ctx *c) { return c->budget; }
extern "C" void gpu_set_subchunk_limit(struct gpu_ctx *c, uint64_t max_elems) { c->subchunk_cap = max_elems; }
extern "C" uint64_t gpu_last_subchunks(const struct gpu_ctx *c) { return c->lanes[0].last_subchunks; }

extern "C" int gpu_use_lanes(struct gpu_ctx *c, int lanes)
{
    c->nlanes = lanes < 1 ? 1 : lanes > GPU_MAX_LANES ? GPU_MAX_LANES : lanes;
    return c->nlanes;
}

// A lane's share of the device-memory budget.
static uint64_t lane_budget(const gpu_ctx *c) { return c->budget / (uint64_t)c->nlanes; }

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

extern "C" int gpu_host_register(struct gpu_ctx *c, void *ptr, size_t bytes)
{
    cudaSetDevice(c->device);
    if (cudaHostRegister(ptr, bytes, cudaHostRegisterDefault) == cudaSuccess)
        return 0;
    cudaGetLastError();
    return -1;
}

extern "C" void gpu_host_unregister(struct gpu_ctx *c, void *ptr)
{
    cudaSetDevice(c->device);
    // Memory that was never registered says so here, harmlessly.
    if (cudaHostUnregister(ptr) != cudaSuccess)
        cudaGetLastError();
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

static int ensure_mem(slot *m, size_t bytes)
{
    if (m->bytes >= bytes)
        return NF4_OK;
    if (m->mem) {
        cudaCheck(cudaFree(m->mem));
        m->mem = NULL;
        m->bytes = 0;
    }
    cudaError_t err = cudaMalloc(&m->mem, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        m->mem = NULL;
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc of %zu bytes failed: %s", bytes,
                        cudaGetErrorString(err));
    }
    m->bytes = bytes;
    return NF4_OK;
}

static int ensure_slot(gpu_lane *ln, int s, size_t bytes) { return ensure_mem(&ln->slots[s], bytes); }

// Makes streams 1 .. nslots - 1 wait for what is queued on stream 0 so far: the
// tables every sub-chunk reads. (The kernels run on non-blocking streams, which
// would not wait for a copy on the legacy stream, and a pageable-source
// cudaMemcpy may return before its DMA lands: so the tables go on stream 0.)
static int share_stream0(gpu_lane *ln, int nslots)
{
    if (nslots < 2)
        return NF4_OK;
    cudaEvent_t ready;
    cudaCheck(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    cudaError_t err = cudaEventRecord(ready, ln->streams[0]);
    for (int s = 1; s < nslots && err == cudaSuccess; s++)
        err = cudaStreamWaitEvent(ln->streams[s], ready, 0);
    cudaEventDestroy(ready);
    cudaCheck(err);
    return NF4_OK;
}

static int upload_code_table(gpu_lane *ln, const float *code)
{
    cudaCheck(cudaMemcpyAsync(ln->d_code, code, NESTED_CODE_ENTRIES * sizeof(float), cudaMemcpyHostToDevice,
                              ln->streams[0]));
    return NF4_OK;
}

// Queues the packed data and scales of elements [start, start + cnt) of a 4-bit
// job into slot memory `mem` (layout L) on `st`, and points d at them.
static int upload_quant(gpu_lane *ln, const dequant_job *j, uint64_t start, uint64_t cnt, char *mem,
                        const slot_layout &L, cudaStream_t st, dev_job *d)
{
    const uint64_t blk0 = start / j->blocksize, blocks = CEIL_DIV(cnt, (uint64_t)j->blocksize);
    memset(d, 0, sizeof *d);
    d->n = cnt;
    d->blocksize = j->blocksize;
    d->nested_blocksize = j->nested_blocksize;
    d->quant_type = j->quant_type;
    d->out_dtype = j->out_dtype;
    d->nested_offset = j->nested_offset;
    d->packed = (const uint8_t *)(mem + L.packed);
    d->out = mem + L.out;
    cudaCheck(cudaMemcpyAsync(mem + L.packed, j->packed + start / 2, CEIL_DIV(cnt, 2ull), cudaMemcpyHostToDevice, st));
    if (j->absmax_code) {
        const uint64_t nb0 = blk0 / j->nested_blocksize, nbs = CEIL_DIV(blocks, (uint64_t)j->nested_blocksize);
        d->absmax_code = (const uint8_t *)(mem + L.codes);
        d->nested_absmax = (const float *)(mem + L.scales);
        d->nested_code = ln->d_code;
        cudaCheck(cudaMemcpyAsync(mem + L.codes, j->absmax_code + blk0, blocks, cudaMemcpyHostToDevice, st));
        cudaCheck(cudaMemcpyAsync(mem + L.scales, j->nested_absmax + nb0, nbs * sizeof(float),
                                  cudaMemcpyHostToDevice, st));
    } else {
        d->absmax = (const float *)(mem + L.scales);
        cudaCheck(cudaMemcpyAsync(mem + L.scales, j->absmax + blk0, blocks * sizeof(float), cudaMemcpyHostToDevice,
                                  st));
    }
    return NF4_OK;
}

// Elements per device sub-chunk: what one of the NUM_STREAMS slots of `budget`
// bytes holds at `per_elem` bytes each, capped so big jobs pipeline, in whole
// granules (at least one), and no more than the job's n.
static uint64_t subchunk_elements(const gpu_ctx *c, uint64_t budget, double per_elem, uint64_t granule, uint64_t n)
{
    uint64_t sub_n = (uint64_t)((double)(budget / NUM_STREAMS) / per_elem);
    if (c->subchunk_cap && sub_n > c->subchunk_cap)
        sub_n = c->subchunk_cap;
    sub_n = sub_n / granule * granule;
    if (sub_n < granule)
        sub_n = granule;
    return sub_n < n ? sub_n : n;
}

// A 4-bit job's sub-chunk granule (where a block and a nested block start) and
// its device bytes per element with `osz`-byte outputs: half a packed byte, the
// output, and its share of a block's scale.
static uint64_t quant_granule(const dequant_job *j)
{
    return (uint64_t)j->blocksize * (j->absmax_code ? j->nested_blocksize : 1u);
}

static double quant_bytes_per_element(const dequant_job *j, size_t osz)
{
    return 0.5 + (double)osz + (j->absmax_code ? 1.0 : 4.0) / j->blocksize;
}

static int run_pipeline(gpu_ctx *c, gpu_lane *ln, const dequant_job *j, unsigned variant, launch_cfg cfg)
{
    const bool nested = j->absmax_code != NULL;
    const size_t osz = out_size(j->out_dtype);
    const uint64_t sub_n =
        subchunk_elements(c, lane_budget(c), quant_bytes_per_element(j, osz), quant_granule(j), j->n);

    slot_layout L = layout_for(j, sub_n);
    int nslots = sub_n < j->n ? NUM_STREAMS : 1;
    for (int s = 0; s < nslots; s++) {
        int rc = ensure_slot(ln, s, L.total);
        if (rc)
            return rc;
    }
    if (nested) {
        int rc = upload_code_table(ln, j->nested_code);
        if (rc == NF4_OK)
            rc = share_stream0(ln, nslots);
        if (rc)
            return rc;
    }

    ln->last_subchunks = 0;
    for (uint64_t start = 0, i = 0; start < j->n; start += sub_n, i++) {
        const int s = (int)(i % nslots);
        cudaStream_t st = ln->streams[s];
        char *mem = (char *)ln->slots[s].mem;
        const uint64_t cnt = j->n - start < sub_n ? j->n - start : sub_n;
        dev_job d;
        int rc = upload_quant(ln, j, start, cnt, mem, L, st, &d);
        if (rc)
            return rc;
        // Poison the device output first: an element the kernel failed to write
        // shows up as 0xA5A5 instead of stale data from an earlier sub-chunk.
        cudaCheck(cudaMemsetAsync(mem + L.out, 0xA5, cnt * osz, st));
        rc = nf4_launch_dequant(&d, cfg, variant, st);
        if (rc)
            return rc;
        cudaCheck(cudaMemcpyAsync((char *)j->out + start * osz, mem + L.out, cnt * osz,
                                  cudaMemcpyDeviceToHost, st));
        ln->last_subchunks++;
    }
    for (int s = 0; s < nslots; s++)
        cudaCheck(cudaStreamSynchronize(ln->streams[s]));
    return NF4_OK;
}

static int dequant_on(struct gpu_ctx *c, gpu_lane *ln, const struct dequant_job *j, unsigned variant, int ept,
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
    int rc = run_pipeline(c, ln, j, variant, cfg);
    if (rc) {
        // Leave nothing in flight that still reads or writes the caller's buffers.
        for (int s = 0; s < NUM_STREAMS; s++)
            cudaStreamSynchronize(ln->streams[s]);
        cudaGetLastError();
    }
    return rc;
}

extern "C" int gpu_dequant_ex(struct gpu_ctx *c, const struct dequant_job *j, unsigned variant, int ept,
                              int threads)
{
    return dequant_on(c, &c->lanes[0], j, variant, ept, threads);
}

extern "C" int gpu_dequant(struct gpu_ctx *c, const struct dequant_job *j)
{
    return dequant_on(c, &c->lanes[0], j, 0, 0, 0);
}

extern "C" int gpu_dequant_lane(struct gpu_ctx *c, int lane, const struct dequant_job *j)
{
    return dequant_on(c, &c->lanes[lane % c->nlanes], j, 0, 0, 0);
}

// ---- LoRA merge ------------------------------------------------------------------
// The chunk's factors go to the device once (ln->factors, with the overflow counter
// in front); the base's data goes in sub-chunks over the two streams, as for a
// dequantization, each merged by one fused launch and copied back.

static int run_merge(gpu_ctx *c, gpu_lane *ln, const dequant_job *dq, const merge_job *mj, uint64_t *overflowed)
{
    const bool dora = mj->magnitude != NULL;
    const uint64_t rows = dora ? mj->n / mj->cols : 0;
    if (dora && (mj->e0 % mj->cols || mj->n % mj->cols))
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "a DoRA chunk that is not whole rows");
    // Factors: counter, then per adapter L then R (a LoKr's W1 then W2), each
    // 256-aligned; DoRA's magnitudes after them.
    size_t foff[LORA_MAX_ADAPTERS][2], fsize[LORA_MAX_ADAPTERS][2], ftotal = 256;
    for (size_t t = 0; t < mj->nfactors; t++) {
        const merge_factor *f = &mj->f[t];
        fsize[t][0] = (f->kron_w1 ? f->kron_a * f->kron_b : f->l_floats) * sizeof(float);
        fsize[t][1] = (f->kron_w1 ? f->kron_c * f->kron_d : (uint64_t)f->rank * mj->cols) * sizeof(float);
        foff[t][0] = ftotal;
        ftotal += align256(fsize[t][0]);
        foff[t][1] = ftotal;
        ftotal += align256(fsize[t][1]);
    }
    const size_t mag_off = ftotal;
    ftotal += align256(rows * sizeof(float));
    if (ftotal >= lane_budget(c) / 2)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "--gpu-mem is too small for the LoRA factors of this tensor "
                        "(%zu MiB)", (ftotal >> 20) + 1);
    const size_t wsz = dq ? 0 : out_size(mj->w_dtype), osz = out_size(mj->out_dtype);
    uint64_t granule = dq ? quant_granule(dq) : 1;
    if (dora) // the pipeline cut the chunk the same way: n is a multiple of it, or the whole tensor
        granule = dora_granule(granule, mj->cols, mj->n);
    // DoRA: the merged rows in fp32, for the row kernel.
    const double per_elem = (dq ? quant_bytes_per_element(dq, osz) : (double)(wsz + osz)) + (dora ? 4.0 : 0.0);
    const uint64_t sub_n = subchunk_elements(c, lane_budget(c) - ftotal, per_elem, granule, mj->n);
    const int nslots = sub_n < mj->n ? NUM_STREAMS : 1;
    slot_layout L;
    if (dq) {
        dequant_job shape = *dq;
        shape.out_dtype = mj->out_dtype;
        L = layout_for(&shape, sub_n);
    } else {
        L.packed = 0;
        L.out = align256(sub_n * wsz);
        L.total = L.out + align256(sub_n * osz);
    }
    const size_t merged_off = L.total;
    if (dora)
        L.total += align256(sub_n * sizeof(float));
    int rc = ensure_mem(&ln->factors, ftotal);
    for (int s = 0; s < nslots && rc == NF4_OK; s++)
        rc = ensure_slot(ln, s, L.total);
    if (rc)
        return rc;

    char *fmem = (char *)ln->factors.mem;
    unsigned long long *d_over = (unsigned long long *)fmem;
    cudaCheck(cudaMemsetAsync(d_over, 0, sizeof *d_over, ln->streams[0]));
    for (size_t t = 0; t < mj->nfactors; t++) {
        const merge_factor *f = &mj->f[t];
        cudaCheck(cudaMemcpyAsync(fmem + foff[t][0], f->kron_w1 ? f->kron_w1 : f->l, fsize[t][0],
                                  cudaMemcpyHostToDevice, ln->streams[0]));
        cudaCheck(cudaMemcpyAsync(fmem + foff[t][1], f->kron_w1 ? f->kron_w2 : f->r, fsize[t][1],
                                  cudaMemcpyHostToDevice, ln->streams[0]));
    }
    if (dora)
        cudaCheck(cudaMemcpyAsync(fmem + mag_off, mj->magnitude, rows * sizeof(float), cudaMemcpyHostToDevice,
                                  ln->streams[0]));
    if (dq && dq->absmax_code)
        rc = upload_code_table(ln, dq->nested_code);
    if (rc == NF4_OK)
        rc = share_stream0(ln, nslots);
    if (rc)
        return rc;

    ln->last_subchunks = 0;
    for (uint64_t start = 0, i = 0; start < mj->n; start += sub_n, i++) {
        const int s = (int)(i % nslots);
        cudaStream_t st = ln->streams[s];
        char *mem = (char *)ln->slots[s].mem;
        const uint64_t cnt = mj->n - start < sub_n ? mj->n - start : sub_n;
        dev_merge m;
        memset(&m, 0, sizeof m);
        if (dq) {
            if ((rc = upload_quant(ln, dq, start, cnt, mem, L, st, &m.dq)) != NF4_OK)
                return rc;
        } else {
            m.w = mem + L.packed;
            cudaCheck(cudaMemcpyAsync(mem + L.packed, (const char *)mj->w + start * wsz, cnt * wsz,
                                      cudaMemcpyHostToDevice, st));
        }
        m.w_dtype = mj->w_dtype;
        m.out_dtype = mj->out_dtype;
        m.out = mem + L.out;
        m.e0 = mj->e0 + start;
        m.n = cnt;
        m.cols = mj->cols;
        m.nfactors = (int)mj->nfactors;
        m.overflowed = d_over;
        for (size_t t = 0; t < mj->nfactors; t++) {
            m.f[t] = mj->f[t];
            const float *first = (const float *)(fmem + foff[t][0]), *second = (const float *)(fmem + foff[t][1]);
            if (m.f[t].kron_w1) {
                m.f[t].kron_w1 = first;
                m.f[t].kron_w2 = second;
            } else {
                m.f[t].l = first;
                m.f[t].r = second;
            }
        }
        // Poisoned, as for a dequantization: an element the kernel missed shows.
        cudaCheck(cudaMemsetAsync(mem + L.out, 0xA5, cnt * osz, st));
        if (dora) { // the merged rows in fp32, then each rescaled into the output
            m.out = mem + merged_off;
            m.out_dtype = DT_F32;
            cudaCheck(cudaMemsetAsync(m.out, 0xA5, cnt * sizeof(float), st));
        }
        if ((rc = nf4_launch_merge(&m, st)) != NF4_OK)
            return rc;
        if (dora && (rc = nf4_launch_dora_rows((const float *)m.out, mem + L.out, mj->out_dtype,
                                               (const float *)(fmem + mag_off) + start / mj->cols, mj->cols,
                                               cnt / mj->cols, d_over, st)) != NF4_OK)
            return rc;
        cudaCheck(cudaMemcpyAsync((char *)mj->out + start * osz, mem + L.out, cnt * osz, cudaMemcpyDeviceToHost, st));
        ln->last_subchunks++;
    }
    unsigned long long over = 0;
    cudaCheck(cudaMemcpyAsync(&over, d_over, sizeof over, cudaMemcpyDeviceToHost, ln->streams[nslots - 1]));
    for (int s = 0; s < nslots; s++)
        cudaCheck(cudaStreamSynchronize(ln->streams[s]));
    *overflowed = over;
    return NF4_OK;
}

static int merge_on(struct gpu_ctx *c, gpu_lane *ln, const struct dequant_job *dq, const struct merge_job *mj,
                    uint64_t *overflowed)
{
    *overflowed = 0;
    if (mj->n == 0)
        return NF4_OK;
    if (mj->w_dtype != DT_F16 && mj->w_dtype != DT_BF16 && mj->w_dtype != DT_F32)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "the GPU merge takes F16, BF16 or F32 bases");
    if (dq && (!is_pow2(dq->blocksize) || dq->blocksize < NF4_MIN_BLOCKSIZE || dq->blocksize > NF4_MAX_BLOCKSIZE ||
               (dq->absmax_code && !is_pow2(dq->nested_blocksize))))
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad blocksize %u", dq->blocksize);
    cudaCheck(cudaSetDevice(c->device));
    int rc = run_merge(c, ln, dq, mj, overflowed);
    if (rc) {
        for (int s = 0; s < NUM_STREAMS; s++)
            cudaStreamSynchronize(ln->streams[s]);
        cudaGetLastError();
    }
    return rc;
}

extern "C" int gpu_merge(struct gpu_ctx *c, const struct dequant_job *dq, const struct merge_job *mj,
                         uint64_t *overflowed)
{
    return merge_on(c, &c->lanes[0], dq, mj, overflowed);
}

extern "C" int gpu_merge_lane(struct gpu_ctx *c, int lane, const struct dequant_job *dq, const struct merge_job *mj,
                              uint64_t *overflowed)
{
    return merge_on(c, &c->lanes[lane % c->nlanes], dq, mj, overflowed);
}
