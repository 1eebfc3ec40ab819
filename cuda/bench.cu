// GPU side of `nf4deq bench`: timing of the fused kernel's variants and of the
// bitsandbytes sequence, side by side, with CUDA events on the legacy stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "bench_kernels.cuh"
#include "gpu_backend.cuh"
#include "launch.cuh"

#define BENCH_BLOCKSIZE 64
#define BENCH_NESTED_BLOCKSIZE 256
#define BENCH_ROUNDS 4             // variants are interleaved in this many rounds
#define BENCH_MAX_SETS 16          // rotated input sets
#define BENCH_L2_MULTIPLE 3        // rotate until the sets span this many L2s
#define COPY_BENCH_BYTES (1ull << 30)
#define COPY_BENCH_ITERS 20
#define SPIN_BASE_NS 2000000ull    // holds the GPU while the host queues a batch
#define SPIN_PER_LAUNCH_NS 20000ull

static double median(std::vector<float> &v)
{
    std::sort(v.begin(), v.end());
    size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : 0.5 * ((double)v[m - 1] + v[m]);
}

static int spin(uint64_t launches)
{
    spin_kernel<<<1, 1>>>(SPIN_BASE_NS + SPIN_PER_LAUNCH_NS * launches);
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}

extern "C" int gpu_bench_copy_bw(struct gpu_ctx *c, double *bytes_per_s)
{
    cudaCheck(cudaSetDevice(c->device));
    void *a = NULL, *b = NULL;
    cudaCheck(cudaMalloc(&a, COPY_BENCH_BYTES));
    cudaError_t err = cudaMalloc(&b, COPY_BENCH_BYTES);
    if (err != cudaSuccess) {
        cudaFree(a);
        cudaCheck(err);
    }
    cudaCheck(cudaMemset(a, 0x5a, COPY_BENCH_BYTES));
    cudaEvent_t ev[2 * COPY_BENCH_ITERS];
    for (auto &e : ev)
        cudaCheck(cudaEventCreate(&e));
    for (int i = 0; i < 3; i++)
        cudaCheck(cudaMemcpyAsync(b, a, COPY_BENCH_BYTES, cudaMemcpyDeviceToDevice, 0));
    std::vector<float> ms;
    for (int i = 0; i < COPY_BENCH_ITERS; i++) {
        cudaCheck(cudaEventRecord(ev[2 * i], 0));
        cudaCheck(cudaMemcpyAsync(b, a, COPY_BENCH_BYTES, cudaMemcpyDeviceToDevice, 0));
        cudaCheck(cudaEventRecord(ev[2 * i + 1], 0));
    }
    cudaCheck(cudaDeviceSynchronize());
    for (int i = 0; i < COPY_BENCH_ITERS; i++) {
        float t;
        cudaCheck(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
        ms.push_back(t);
    }
    for (auto &e : ev)
        cudaEventDestroy(e);
    cudaFree(a);
    cudaFree(b);
    *bytes_per_s = 2.0 * COPY_BENCH_BYTES / (median(ms) * 1e-3);
    return NF4_OK;
}

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

struct input_set {
    uint8_t *packed, *codes;
    float *nested;
    void *out, *bnb_absmax, *bnb_out;
};

struct bench_state {
    std::vector<input_set> sets;
    float *d_code = NULL;
    float *d_offset = NULL; // the nested offset in device memory (GPU_VARIANT_DEVICE_OFFSET)
    std::vector<cudaEvent_t> ev;
    ~bench_state()
    {
        for (auto &s : sets) {
            cudaFree(s.packed); cudaFree(s.codes); cudaFree(s.nested);
            cudaFree(s.out); cudaFree(s.bnb_absmax); cudaFree(s.bnb_out);
        }
        cudaFree(d_code);
        cudaFree(d_offset);
        for (auto e : ev)
            cudaEventDestroy(e);
    }
};

// offset_dev: NULL for the offset by value (the CLI), else where the PyTorch route
// keeps it, in device memory.
static dev_job job_for(const input_set &s, const float *d_code, uint64_t n, enum st_dtype dt, float offset,
                       const float *offset_dev = NULL)
{
    dev_job j;
    memset(&j, 0, sizeof j);
    j.packed = s.packed;
    j.absmax_code = s.codes;
    j.nested_absmax = s.nested;
    j.nested_code = d_code;
    j.nested_offset = offset;
    j.nested_offset_ptr = offset_dev;
    j.n = n;
    j.blocksize = BENCH_BLOCKSIZE;
    j.nested_blocksize = BENCH_NESTED_BLOCKSIZE;
    j.quant_type = QUANT_NF4;
    j.out_dtype = dt;
    j.out = s.out;
    return j;
}

static int run_bnb(const gpu_bench_opts *o, const input_set &s, float *d_code, uint64_t n, float offset,
                   cudaStream_t stream = 0)
{
    const int blocks = (int)(n / BENCH_BLOCKSIZE);
    o->bnb_fp32(d_code, s.codes, s.nested, (float *)s.bnb_absmax, BENCH_NESTED_BLOCKSIZE, blocks, stream);
    add_offset_kernel<<<CEIL_DIV(blocks, 256), 256, 0, stream>>>((float *)s.bnb_absmax, offset, blocks);
    cudaCheck(cudaGetLastError());
    o->bnb_4bit(NULL, s.packed, (float *)s.bnb_absmax, s.bnb_out, BENCH_BLOCKSIZE, (int)n, stream);
    return NF4_OK;
}

// Times one candidate as replays of a captured graph of BENCH_GRAPH_LAUNCHES
// back-to-back launches over the rotated input sets: the per-launch time
// without an event pair and a launch gap around every kernel. Median over
// `replays` replays, divided by the launches in one replay.
#define BENCH_GRAPH_LAUNCHES 24
template <typename Launch>
static int time_graph(Launch launch_on, int nsets, int replays, double *per_launch_ms)
{
    cudaStream_t stream;
    cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaCheck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < BENCH_GRAPH_LAUNCHES; i++) {
        int rc = launch_on(stream, i % nsets);
        if (rc) {
            cudaStreamEndCapture(stream, &graph);
            return rc;
        }
    }
    cudaCheck(cudaStreamEndCapture(stream, &graph));
    cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<cudaEvent_t> ev(2 * replays);
    for (auto &e : ev)
        cudaCheck(cudaEventCreate(&e));
    for (int i = 0; i < 3; i++)
        cudaCheck(cudaGraphLaunch(exec, stream));
    for (int i = 0; i < replays; i++) {
        cudaCheck(cudaEventRecord(ev[2 * i], stream));
        cudaCheck(cudaGraphLaunch(exec, stream));
        cudaCheck(cudaEventRecord(ev[2 * i + 1], stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
    std::vector<float> ms;
    for (int i = 0; i < replays; i++) {
        float t;
        cudaCheck(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
        ms.push_back(t);
    }
    for (auto &e : ev)
        cudaEventDestroy(e);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    *per_launch_ms = median(ms) / BENCH_GRAPH_LAUNCHES;
    return NF4_OK;
}

// A monotone 256-entry table in [-1, 1] shaped like bitsandbytes' dynamic map.
static void make_nested_code(float *code)
{
    for (int i = 0; i < 256; i++) {
        double t = (i - 127.5) / 127.5;
        code[i] = (float)(t * t * t * 0.9 + t * 0.1);
    }
    code[0] = -1.0f;
    code[255] = 1.0f;
}

extern "C" int gpu_bench_shape(struct gpu_ctx *c, const struct gpu_bench_opts *o, struct gpu_bench_result *r)
{
    memset(r, 0, sizeof *r);
    if (o->n_variants < 1 || o->n_variants > GPU_BENCH_MAX_VARIANTS || o->iters < 1)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad bench options");
    if (o->n % ((uint64_t)BENCH_BLOCKSIZE * BENCH_NESTED_BLOCKSIZE) || o->n > 0x7fffffffull)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench shapes need a multiple of %d elements, under 2^31",
                        BENCH_BLOCKSIZE * BENCH_NESTED_BLOCKSIZE);
    cudaCheck(cudaSetDevice(c->device));
    const bool bnb = o->bnb_fp32 && o->bnb_4bit && o->out_dtype != DT_F32;
    const uint64_t n = o->n, blocks = n / BENCH_BLOCKSIZE, nblocks = blocks / BENCH_NESTED_BLOCKSIZE;
    const size_t osz = o->out_dtype == DT_F32 ? 4 : 2;
    const float offset = 0.0123f;
    r->bytes = n / 2 + blocks + nblocks * 4 + n * osz + NESTED_CODE_ENTRIES * 4;
    launch_cfg table = nf4_pick_cfg(c->major, c->minor, n);
    r->ept = table.ept;
    r->threads = table.threads;
    r->store_hint = table.store_hint;
    r->values = table.values;
    r->asm_mul = NF4DEQ_ASM && table.asm_mul && asm_kernel_case(true, true, osz); // bench jobs: NF4, nested

    uint64_t set_bytes = r->bytes + (bnb ? blocks * 4 + n * osz : 0);
    uint64_t want = (uint64_t)BENCH_L2_MULTIPLE * (c->l2_bytes ? c->l2_bytes : (64u << 20));
    int nsets = (int)std::min<uint64_t>(BENCH_MAX_SETS, std::max<uint64_t>(1, CEIL_DIV(want, set_bytes)));
    r->input_sets = nsets;

    bench_state st;
    std::vector<uint8_t> h_packed(n / 2), h_codes(blocks);
    std::vector<float> h_nested(nblocks), h_code(256);
    make_nested_code(h_code.data());
    cudaCheck(cudaMalloc(&st.d_code, 256 * sizeof(float)));
    cudaCheck(cudaMemcpy(st.d_code, h_code.data(), 256 * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&st.d_offset, sizeof(float)));
    cudaCheck(cudaMemcpy(st.d_offset, &offset, sizeof(float), cudaMemcpyHostToDevice));
    uint64_t seed = o->seed ? o->seed : 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < nsets; k++) {
        input_set s;
        memset(&s, 0, sizeof s);
        st.sets.push_back(s);
        input_set &d = st.sets.back();
        cudaCheck(cudaMalloc(&d.packed, n / 2));
        cudaCheck(cudaMalloc(&d.codes, blocks));
        cudaCheck(cudaMalloc(&d.nested, nblocks * 4));
        cudaCheck(cudaMalloc(&d.out, n * osz));
        if (bnb) {
            cudaCheck(cudaMalloc(&d.bnb_absmax, blocks * 4));
            cudaCheck(cudaMalloc(&d.bnb_out, n * osz));
        }
        for (uint64_t i = 0; i < n / 2; i += 8) {
            uint64_t x = xorshift(&seed);
            memcpy(&h_packed[i], &x, std::min<uint64_t>(8, n / 2 - i));
        }
        for (uint64_t i = 0; i < blocks; i++)
            h_codes[i] = (uint8_t)(xorshift(&seed) >> 56);
        for (uint64_t i = 0; i < nblocks; i++)
            h_nested[i] = 0.01f + (float)(xorshift(&seed) >> 40) * (0.2f / 16777216.0f);
        cudaCheck(cudaMemcpy(d.packed, h_packed.data(), n / 2, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.codes, h_codes.data(), blocks, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.nested, h_nested.data(), nblocks * 4, cudaMemcpyHostToDevice));
    }

    const int per_round = (int)CEIL_DIV((uint64_t)o->iters, (uint64_t)BENCH_ROUNDS);
    st.ev.resize(2 * per_round);
    for (auto &e : st.ev)
        cudaCheck(cudaEventCreate(&e));

    // The candidates: kernel variants, then the bitsandbytes sequence.
    const int ncand = o->n_variants + (bnb ? 1 : 0);
    std::vector<std::vector<float>> times(ncand);
    auto launch = [&](int cand, const input_set &s, cudaStream_t stream = 0) -> int {
        if (cand < o->n_variants) {
            const gpu_bench_variant &v = o->variants[cand];
            launch_cfg cfg = table;
            if (v.ept)
                cfg.ept = v.ept;
            if (v.threads)
                cfg.threads = v.threads;
            if ((v.flags & GPU_VARIANT_PDL) && c->major >= 9)
                cfg.pdl = 1;
            if (v.flags & GPU_VARIANT_EMPTY) {
                empty_kernel<<<1, 32, 0, stream>>>();
                cudaCheck(cudaGetLastError());
                return NF4_OK;
            }
            if (v.flags & GPU_VARIANT_TRAFFIC) {
                const uint64_t units = n / 8; // 16-bit output: 8 elements per 16-byte store
                const int th = v.threads ? v.threads : 256;
                const bool cs = !(v.flags & GPU_VARIANT_NO_HINTS);
                const bool pf = !(v.flags & GPU_VARIANT_L2_NOPF);
                switch (v.ept) {
                case 2: return launch_traffic<2>(s.packed, (uint4 *)s.out, units, th, cs, pf, stream);
                case 4: return launch_traffic<4>(s.packed, (uint4 *)s.out, units, th, cs, pf, stream);
                default: return launch_traffic<1>(s.packed, (uint4 *)s.out, units, th, cs, pf, stream);
                }
            }
            if (v.flags & GPU_VARIANT_MEMSET) {
                cudaCheck(cudaMemsetAsync(s.out, 0x3c, n * osz, stream));
                return NF4_OK;
            }
            if (v.flags & GPU_VARIANT_READ) {
                const uint64_t n16 = n / 32; // n/2 bytes in 16-byte loads
                read_kernel<<<(unsigned)CEIL_DIV(n16, 1024ull), 256, 0, stream>>>((const uint4 *)s.packed, n16,
                                                                                  (uint32_t *)s.codes);
                cudaCheck(cudaGetLastError());
                return NF4_OK;
            }
            dev_job j = job_for(s, st.d_code, n, o->out_dtype, offset,
                                (v.flags & GPU_VARIANT_DEVICE_OFFSET) ? st.d_offset : NULL);
            return nf4_launch_dequant(&j, cfg, v.flags, stream);
        }
        return run_bnb(o, s, st.d_code, n, offset, stream);
    };

    // Warm-up: every candidate on every set.
    for (int cand = 0; cand < ncand; cand++)
        for (auto &s : st.sets) {
            int rc = launch(cand, s);
            if (rc)
                return rc;
        }
    cudaCheck(cudaDeviceSynchronize());

    int set_i = 0;
    for (int round = 0; round < BENCH_ROUNDS; round++) {
        for (int cand = 0; cand < ncand; cand++) {
            int rc = spin((uint64_t)per_round * (cand < o->n_variants ? 1 : 3));
            if (rc)
                return rc;
            for (int i = 0; i < per_round; i++) {
                cudaCheck(cudaEventRecord(st.ev[2 * i], 0));
                rc = launch(cand, st.sets[set_i]);
                if (rc)
                    return rc;
                cudaCheck(cudaEventRecord(st.ev[2 * i + 1], 0));
                set_i = (set_i + 1) % nsets;
            }
            cudaCheck(cudaDeviceSynchronize());
            for (int i = 0; i < per_round; i++) {
                float t;
                cudaCheck(cudaEventElapsedTime(&t, st.ev[2 * i], st.ev[2 * i + 1]));
                times[cand].push_back(t);
            }
        }
    }
    for (int v = 0; v < o->n_variants; v++)
        r->ms[v] = median(times[v]);

    // The default kernel and the bitsandbytes sequence again, as graph replays.
    const int replays = std::max(100, o->iters / 4);
    // With graph_variants, every kernel variant, the empty launch and the floors
    // too: at small sizes a launch's fixed cost is much of the event-timed time,
    // and graph replays are what a CUDA-graph user (and the Python peers' table)
    // sees, so the floors a kernel is held to must be timed the same way.
    for (int v = 0; v < o->n_variants; v++) {
        r->graph_var_ms[v] = 0;
        if (!o->graph_variants)
            continue;
        int vrc = time_graph([&](cudaStream_t stream, int k) { return launch(v, st.sets[k], stream); }, nsets,
                             replays, &r->graph_var_ms[v]);
        if (vrc)
            return vrc;
    }
    int grc = time_graph(
        [&](cudaStream_t stream, int k) {
            dev_job j = job_for(st.sets[k], st.d_code, n, o->out_dtype, offset);
            return nf4_launch_dequant(&j, table, 0, stream);
        },
        nsets, replays, &r->graph_ms);
    if (grc)
        return grc;
    if (bnb) {
        grc = time_graph([&](cudaStream_t stream, int k) { return run_bnb(o, st.sets[k], st.d_code, n, offset, stream); },
                         nsets, replays, &r->bnb_graph_ms);
        if (grc)
            return grc;
    }

    if (bnb) {
        r->bnb_ms = median(times[o->n_variants]);
        // Byte-for-byte comparison on set 0 with the default kernel, given the offset
        // by value (the CLI) and in device memory (the PyTorch route).
        int rc = run_bnb(o, st.sets[0], st.d_code, n, offset);
        if (rc)
            return rc;
        std::vector<uint8_t> a(n * osz), b(n * osz);
        cudaCheck(cudaMemcpy(b.data(), st.sets[0].bnb_out, n * osz, cudaMemcpyDeviceToHost));
        r->bnb_identical = 1;
        for (const float *offset_dev : {(const float *)NULL, (const float *)st.d_offset}) {
            dev_job j = job_for(st.sets[0], st.d_code, n, o->out_dtype, offset, offset_dev);
            cudaCheck(cudaMemset(st.sets[0].out, 0xA5, n * osz));
            if ((rc = nf4_launch_dequant(&j, table, 0, 0)))
                return rc;
            cudaCheck(cudaMemcpy(a.data(), st.sets[0].out, n * osz, cudaMemcpyDeviceToHost));
            r->bnb_identical &= memcmp(a.data(), b.data(), n * osz) == 0;
        }
    }
    return NF4_OK;
}
