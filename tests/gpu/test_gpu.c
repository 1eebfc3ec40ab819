/* GPU dequantization against the CPU reference (dequant_cpu_range), byte for byte.
 * Plain C with a pass/fail counter (the device machine has no CMocka):
 * prints "N passed, N failed" and exits non-zero on any failure.
 *
 *   test_gpu [--big] [--quick]
 *     --big    also one tensor of more than 2^31 elements (about 13 GB of host memory)
 *     --quick  fewer sizes (for a smoke run) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "nf4deq.h"

#include "bench.h"
#include "dequant.h"
#include "fpconv.h"
#include "gpu.h"
#include "status.h"

#include "gpu_tensor.h"

/* Compares the GPU's output in t->out_gpu with the CPU reference in t->out_cpu,
 * byte for byte, and checks that the guard after it is still poisoned. */
static void compare_with_cpu(const struct tensor *t, const char *what)
{
    const size_t esz = osize(t->job.out_dtype);
    uint64_t d = first_diff(t->out_gpu, t->out_cpu, t->out_bytes, esz);
    if (d != UINT64_MAX) {
        uint32_t g = 0, c = 0;
        memcpy(&g, (const char *)t->out_gpu + d * esz, esz);
        memcpy(&c, (const char *)t->out_cpu + d * esz, esz);
        CHECK(0, "%s: element %llu differs: gpu %08x cpu %08x", what, (unsigned long long)d, g, c);
    } else {
        CHECK(1, "%s", what);
    }
    CHECK(guard_ok(t->out_gpu, t->out_bytes), "%s: wrote past the end", what);
}

/* Runs the GPU (variant/config) and compares with the CPU reference in t->out_cpu. */
static void run_and_compare(struct gpu_ctx *ctx, struct tensor *t, unsigned variant, int ept, int threads,
                            const char *what)
{
    struct dequant_job j = t->job;
    memset(t->out_gpu, POISON, t->out_bytes + GUARD_BYTES);
    j.out = t->out_gpu;
    nf4_clear_error();
    int rc = gpu_dequant_ex(ctx, &j, variant, ept, threads);
    CHECK(rc == NF4_OK, "%s: gpu_dequant failed: %s", what, nf4_last_error());
    if (rc)
        return;
    compare_with_cpu(t, what);
}

static void cpu_reference(struct tensor *t)
{
    struct dequant_job j = t->job;
    memset(t->out_cpu, 0x5A, t->out_bytes + GUARD_BYTES);
    j.out = t->out_cpu;
    dequant_cpu(&j, 8);
}

static void test_matrix(struct gpu_ctx *ctx, int quick)
{
    static const uint64_t SIZES[] = {1, 63, 65, 1023, 1025, (1u << 20) + 3};
    static const enum st_dtype DTS[] = {DT_F16, DT_BF16, DT_F32};
    static const uint32_t NBS[] = {256, 1, 2, 64, 256, 1024, 4096};
    int nsizes = quick ? 3 : 6, k = 0;
    for (int si = 0; si < nsizes; si++)
        for (uint32_t bs = 32; bs <= 4096; bs *= 2)
            for (int qt = 0; qt < 2; qt++)
                for (int nested = 0; nested < 2; nested++)
                    for (int di = 0; di < 3; di++, k++) {
                        uint64_t n = SIZES[si];
                        uint32_t nbs = nested ? NBS[k % 7] : 256;
                        struct tensor t;
                        char what[160];
                        snprintf(what, sizeof what, "n=%llu bs=%u %s %s nbs=%u %s", (unsigned long long)n, bs,
                                 qt ? "fp4" : "nf4", nested ? "nested" : "single", nbs, dtn(DTS[di]));
                        if (tensor_make(ctx, &t, n, bs, nested, nbs, (enum quant_type)qt, DTS[di], 0, 1)) {
                            CHECK(0, "%s: out of host memory", what);
                            tensor_free(ctx, &t);
                            continue;
                        }
                        cpu_reference(&t);
                        run_and_compare(ctx, &t, 0, 0, 0, what);
                        /* Every variant and launch config on a rotating subset. */
                        if (k % 5 == 0) {
                            static const int EPT[] = {16, 32, 32}, THR[] = {64, 128, 256, 1024};
                            char w2[200];
                            unsigned var = (unsigned)(k / 5) % 4 | ((k / 5) % 3 == 0 ? GPU_VARIANT_NO_STORE_HINT : 0) |
                                           ((k / 5) % 5 == 1 ? GPU_VARIANT_ASM_MUL : 0);
                            int e = EPT[(k / 5) % 3], th = THR[(k / 7) % 4];
                            snprintf(w2, sizeof w2, "%s variant=%u cfg=%dx%d", what, var, e, th);
                            run_and_compare(ctx, &t, var, e, th, w2);
                        }
                        tensor_free(ctx, &t);
                    }
}

static void test_special(struct gpu_ctx *ctx)
{
    static const enum st_dtype DTS[] = {DT_F16, DT_BF16, DT_F32};
    for (int nested = 0; nested < 2; nested++)
        for (int qt = 0; qt < 2; qt++)
            for (int di = 0; di < 3; di++)
                for (unsigned var = 0; var < 4; var++) {
                    unsigned grid = ((var + (unsigned)di) % 2 ? GPU_VARIANT_NO_STORE_HINT : 0) |
                                    (di == 1 ? GPU_VARIANT_ASM_MUL : 0);
                    struct tensor t;
                    char what[160];
                    snprintf(what, sizeof what, "special values: %s %s %s variant=%u", nested ? "nested" : "single",
                             qt ? "fp4" : "nf4", dtn(DTS[di]), var);
                    if (tensor_make(ctx, &t, 100003, 64, nested, 4, (enum quant_type)qt, DTS[di], 1, 1) == 0) {
                        cpu_reference(&t);
                        run_and_compare(ctx, &t, var | grid, 0, 0, what);
                    } else {
                        CHECK(0, "%s: out of host memory", what);
                    }
                    tensor_free(ctx, &t);
                }
}

/* A table of forced variants, each run on every size x output type x single and
 * nested double quant. Case k picks the blocksize (blocksizes[k % nblocksizes]),
 * FP4 where k % fp4_mod == 1 (NF4 otherwise), and special values where
 * k % special_mod == 0. */
struct variant_cfg {
    unsigned variant;
    int ept, threads;
};
struct variant_cases {
    const char *label;
    const uint64_t *sizes;
    size_t nsizes;
    const uint32_t *blocksizes;
    size_t nblocksizes;
    uint32_t nested_blocksize;
    int fp4_mod, special_mod;
    const struct variant_cfg *cfgs;
    size_t ncfgs;
};

static void run_variant_cases(struct gpu_ctx *ctx, const struct variant_cases *vc)
{
    static const enum st_dtype DTS[] = {DT_F16, DT_BF16, DT_F32};
    int k = 0;
    for (size_t si = 0; si < vc->nsizes; si++)
        for (int di = 0; di < 3; di++)
            for (int nested = 0; nested < 2; nested++, k++) {
                struct tensor t;
                char what[200];
                const uint64_t n = vc->sizes[si];
                const uint32_t bs = vc->blocksizes[(size_t)k % vc->nblocksizes];
                const enum quant_type qt = (k % vc->fp4_mod == 1) ? QUANT_FP4 : QUANT_NF4;
                const int special = k % vc->special_mod == 0;
                if (tensor_make(ctx, &t, n, bs, nested, vc->nested_blocksize, qt, DTS[di], special, 1)) {
                    CHECK(0, "%s n=%llu: out of host memory", vc->label, (unsigned long long)n);
                    tensor_free(ctx, &t);
                    continue;
                }
                cpu_reference(&t);
                for (size_t c = 0; c < vc->ncfgs; c++) {
                    const struct variant_cfg *cfg = &vc->cfgs[c];
                    snprintf(what, sizeof what, "%s n=%llu bs=%u %s %s %s%s variant=%u cfg=%dx%d", vc->label,
                             (unsigned long long)n, bs, qt == QUANT_FP4 ? "fp4" : "nf4", nested ? "nested" : "single",
                             dtn(DTS[di]), special ? " special" : "", cfg->variant, cfg->ept, cfg->threads);
                    run_and_compare(ctx, &t, cfg->variant, cfg->ept, cfg->threads, what);
                }
                tensor_free(ctx, &t);
            }
}

/* The TMA bulk-store variants (sm_90; plain stores elsewhere): sizes of exactly
 * one and several warp tiles, a tile and a bit, odd tails, every type. A tile the
 * copy engine failed to write stays poisoned and fails the comparison. */
static void test_bulk_stores(struct gpu_ctx *ctx)
{
    static const uint64_t SIZES[] = {1, 511, 512, 1024, 1025, 3 * 1024 + 17, 65536, (1u << 20) + 3};
    static const uint32_t BS[] = {32, 64, 64};
    static const struct variant_cfg CFGS[] = {
        {GPU_VARIANT_BULK_STORE, 32, 64},
        {GPU_VARIANT_BULK_EVICT_FIRST, 32, 256},
        {GPU_VARIANT_BULK_EVICT_FIRST, 16, 128},
        {GPU_VARIANT_BULK_STORE, 16, 64},
    };
    const struct variant_cases vc = {"bulk stores", SIZES, sizeof SIZES / sizeof SIZES[0], BS, 3, 256, 4, 5,
                                     CFGS, sizeof CFGS / sizeof CFGS[0]};
    run_variant_cases(ctx, &vc);
}

/* Every place the code values come from and both multiplies, each forced whatever
 * the per-architecture table picks for the size: values by shuffle from the lanes
 * of each warp or from the shared table, or each block's 16 outputs by shuffle from
 * the lanes of each half-warp (16-bit output with blocksize >= 64; blocksize 32 and
 * fp32 output must fall back to the values by shuffle), products by one
 * mul.rn.ftz (asm) or by __fmul_rn and explicit flushes (C). Sizes of a partial
 * warp tile (where the shuffle paths read values for units past the end, which
 * must never be stored), tails, one and many tiles; every type, both codes, single
 * and nested, blocksizes 32 to 4096, subnormal and special values (which the two
 * multiplies must flush alike). */
static void test_value_paths(struct gpu_ctx *ctx)
{
    static const uint64_t SIZES[] = {1, 7, 511, 512, 1025, 3 * 1024 + 17, 65536 + 9, (1u << 20) + 3};
    static const uint32_t BS[] = {32, 64, 4096, 256};
    static const struct variant_cfg CFGS[] = {
        {GPU_VARIANT_SHUFFLE_VALUES | GPU_VARIANT_C_MUL, 0, 0},
        {GPU_VARIANT_SHUFFLE_VALUES | GPU_VARIANT_ASM_MUL, 0, 0},
        {GPU_VARIANT_SHUFFLE_VALUES | GPU_VARIANT_C_MUL | GPU_VARIANT_NO_STORE_HINT, 16, 128},
        {GPU_VARIANT_SHUFFLE_VALUES | GPU_VARIANT_ASM_MUL | GPU_VARIANT_NO_STORE_HINT, 16, 128},
        {GPU_VARIANT_SHUFFLE_VALUES | GPU_VARIANT_ASM_MUL, 32, 256},
        {GPU_VARIANT_SHARED_VALUES | GPU_VARIANT_C_MUL, 0, 0},
        {GPU_VARIANT_SHARED_VALUES | GPU_VARIANT_ASM_MUL, 0, 0},
        {GPU_VARIANT_OUTPUT_VALUES | GPU_VARIANT_C_MUL, 0, 0},
        {GPU_VARIANT_OUTPUT_VALUES | GPU_VARIANT_ASM_MUL, 0, 0},
        {GPU_VARIANT_OUTPUT_VALUES | GPU_VARIANT_C_MUL | GPU_VARIANT_NO_STORE_HINT, 16, 128},
        {GPU_VARIANT_OUTPUT_VALUES | GPU_VARIANT_ASM_MUL, 32, 256},
    };
    const struct variant_cases vc = {"value paths", SIZES, sizeof SIZES / sizeof SIZES[0], BS, 4, 16, 3, 4,
                                     CFGS, sizeof CFGS / sizeof CFGS[0]};
    run_variant_cases(ctx, &vc);
}

/* The default kernel on both sides of the per-architecture table's size split
 * (on sm_90: up to 5 Mi elements the asm multiply, above it C). */
static void test_table_split(struct gpu_ctx *ctx)
{
    static const uint64_t SIZES[] = {5u << 20, (5u << 20) + 1, (5u << 20) + 1027};
    static const uint32_t BS[] = {64, 128};
    static const struct variant_cfg CFGS[] = {{0, 0, 0}};
    const struct variant_cases vc = {"table split", SIZES, sizeof SIZES / sizeof SIZES[0], BS, 2, 256, 5, 3,
                                     CFGS, sizeof CFGS / sizeof CFGS[0]};
    run_variant_cases(ctx, &vc);
}

/* Copies n bytes of host memory to a new device buffer; NULL for NULL. */
static void *to_device(const void *host, size_t n)
{
    void *d = NULL;
    if (!host)
        return NULL;
    if (cudaMalloc(&d, n) != cudaSuccess)
        return NULL;
    if (cudaMemcpy(d, host, n, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaFree(d);
        return NULL;
    }
    return d;
}

/* The public ABI with device pointers, as the PyTorch route calls it: the nested
 * offset by value and from device memory (with a wrong value beside it, which must
 * be ignored), on poisoned outputs with a guard; partial tiles, tails, both sides
 * of the table's size split, every type, both codes, special values. */
static void test_abi_offsets(struct gpu_ctx *ctx)
{
    static const uint64_t SIZES[] = {1, 7, 1025, 65536 + 9, (1u << 20) + 3, (5u << 20) + 3};
    static const enum st_dtype DTS[] = {DT_F16, DT_BF16, DT_F32};
    int k = 0;
    for (size_t si = 0; si < sizeof SIZES / sizeof SIZES[0]; si++)
        for (int di = 0; di < 3; di++, k++) {
            struct tensor t;
            const uint64_t n = SIZES[si];
            const enum quant_type qt = k % 4 == 1 ? QUANT_FP4 : QUANT_NF4;
            const int special = k % 3 == 0;
            char what[160];
            if (tensor_make(ctx, &t, n, 64, 1, 256, qt, DTS[di], special, 1)) {
                CHECK(0, "abi offsets n=%llu: out of host memory", (unsigned long long)n);
                tensor_free(ctx, &t);
                continue;
            }
            cpu_reference(&t);
            const uint64_t blocks = (n + 63) / 64, nblocks = (blocks + 255) / 256;
            const float offset = t.job.nested_offset;
            uint8_t *d_packed = to_device(t.packed, (size_t)((n + 1) / 2));
            uint8_t *d_codes = to_device(t.codes, blocks);
            float *d_nested = to_device(t.nested_absmax, nblocks * sizeof(float));
            float *d_code = to_device(t.nested_code, NESTED_CODE_ENTRIES * sizeof(float));
            float *d_offset = to_device(&offset, sizeof offset);
            void *d_out = NULL;
            if (cudaMalloc(&d_out, t.out_bytes + GUARD_BYTES) != cudaSuccess)
                d_out = NULL;
            if (!d_packed || !d_codes || !d_nested || !d_code || !d_offset || !d_out) {
                CHECK(0, "abi offsets n=%llu: out of device memory", (unsigned long long)n);
            } else {
                for (int by_ptr = 0; by_ptr < 2; by_ptr++) {
                    snprintf(what, sizeof what, "abi offset %s: n=%llu %s %s%s", by_ptr ? "in device memory" : "by value",
                             (unsigned long long)n, qt == QUANT_FP4 ? "fp4" : "nf4", dtn(DTS[di]),
                             special ? " special" : "");
                    int ok = cudaMemset(d_out, POISON, t.out_bytes + GUARD_BYTES) == cudaSuccess;
                    /* By pointer, the value argument is wrong on purpose: it must be ignored. */
                    int rc = nf4deq_dequantize_cuda(d_packed, d_codes, d_nested, d_code, by_ptr ? 1234.5f : offset,
                                                    by_ptr ? d_offset : NULL, n, 64, 256,
                                                    qt == QUANT_FP4 ? NF4DEQ_FP4 : NF4DEQ_NF4,
                                                    DTS[di] == DT_F16    ? NF4DEQ_FLOAT16
                                                    : DTS[di] == DT_BF16 ? NF4DEQ_BFLOAT16
                                                                         : NF4DEQ_FLOAT32,
                                                    d_out, NULL);
                    ok = ok && rc == NF4DEQ_OK &&
                         cudaMemcpy(t.out_gpu, d_out, t.out_bytes + GUARD_BYTES, cudaMemcpyDeviceToHost) == cudaSuccess;
                    CHECK(ok, "%s: call failed (status %d)", what, rc);
                    if (ok)
                        compare_with_cpu(&t, what);
                }
            }
            cudaFree(d_packed);
            cudaFree(d_codes);
            cudaFree(d_nested);
            cudaFree(d_code);
            cudaFree(d_offset);
            cudaFree(d_out);
            tensor_free(ctx, &t);
        }
}

/* A small budget forces many sub-chunks through the two-stream pipeline. */
static void test_subchunks(void)
{
    static const struct { uint64_t n; uint32_t bs, nbs; int nested; enum st_dtype dt; } CASES[] = {
        {(1u << 22) + 12345, 64, 256, 1, DT_BF16},
        {(1u << 22) + 7, 4096, 1, 1, DT_F16},
        {3000001, 32, 8, 1, DT_F32},
        {(1u << 21) + 1, 128, 256, 0, DT_F16},
    };
    struct gpu_ctx *small = NULL;
    int rc = gpu_open(&small, 0, 1u << 20);
    CHECK(rc == NF4_OK, "gpu_open with a 1 MiB budget: %s", nf4_last_error());
    if (rc)
        return;
    CHECK(gpu_mem_budget(small) == (1u << 20), "budget kept");
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        struct tensor t;
        char what[160];
        snprintf(what, sizeof what, "sub-chunks: n=%llu bs=%u nbs=%u %s %s", (unsigned long long)CASES[i].n,
                 CASES[i].bs, CASES[i].nbs, CASES[i].nested ? "nested" : "single", dtn(CASES[i].dt));
        if (tensor_make(small, &t, CASES[i].n, CASES[i].bs, CASES[i].nested, CASES[i].nbs, QUANT_NF4, CASES[i].dt,
                        0, 1)) {
            CHECK(0, "%s: out of host memory", what);
        } else {
            cpu_reference(&t);
            run_and_compare(small, &t, 0, 0, 0, what);
            CHECK(gpu_last_subchunks(small) >= 3, "%s: only %llu sub-chunks", what,
                  (unsigned long long)gpu_last_subchunks(small));
            /* Twice in a row: the cached slots are reused. */
            run_and_compare(small, &t, 0, 0, 0, what);
        }
        tensor_free(small, &t);
    }
    gpu_close(small);
}

/* Over 2^31 elements in ONE launch (64-bit indexing), checked in windows
 * (start, around 2^31 and 2^32 bytes/elements, the tail) against the CPU
 * reference, plus a full comparison against the multi-threaded CPU path. */
static void test_big(struct gpu_ctx *ctx)
{
    const uint64_t n = (1ull << 31) + 4096 * 3 + 77; /* odd, past 2^31 */
    struct tensor t;
    time_t t0 = time(NULL);
    if (tensor_make(ctx, &t, n, 4096, 1, 256, QUANT_NF4, DT_F16, 0, 1)) {
        CHECK(0, "big: out of host memory");
        tensor_free(ctx, &t);
        return;
    }
    gpu_set_subchunk_limit(ctx, 0); /* one sub-chunk: one launch over all n */
    struct dequant_job j = t.job;
    memset(t.out_gpu, POISON, t.out_bytes + GUARD_BYTES);
    j.out = t.out_gpu;
    nf4_clear_error();
    int rc = gpu_dequant(ctx, &j);
    gpu_set_subchunk_limit(ctx, 1ull << 25);
    CHECK(rc == NF4_OK, "big: gpu_dequant: %s", nf4_last_error());
    if (rc) {
        tensor_free(ctx, &t);
        return;
    }
    CHECK(gpu_last_subchunks(ctx) == 1, "big: expected one launch, got %llu sub-chunks",
          (unsigned long long)gpu_last_subchunks(ctx));
    static const uint64_t WIN = 1u << 16;
    const uint64_t starts[] = {0, (1ull << 30) - WIN / 2, (1ull << 31) - WIN + 4096, n - WIN}; /* all < n - WIN */
    for (size_t w = 0; w < sizeof starts / sizeof starts[0]; w++) {
        struct dequant_job c = t.job;
        c.out = t.out_cpu;
        dequant_cpu_range(&c, starts[w], WIN);
        uint64_t d = first_diff((char *)t.out_gpu + starts[w] * 2, (char *)t.out_cpu + starts[w] * 2, WIN * 2, 2);
        CHECK(d == UINT64_MAX, "big: window at %llu differs at +%llu", (unsigned long long)starts[w],
              (unsigned long long)d);
    }
    /* Full comparison. */
    struct dequant_job c = t.job;
    c.out = t.out_cpu;
    dequant_cpu(&c, 16);
    uint64_t d = first_diff(t.out_gpu, t.out_cpu, t.out_bytes, 2);
    CHECK(d == UINT64_MAX, "big: n=%llu element %llu differs", (unsigned long long)n, (unsigned long long)d);
    CHECK(guard_ok(t.out_gpu, t.out_bytes), "big: wrote past the end");
    printf("big tensor: n=%llu (> 2^31) checked in full in %lds\n", (unsigned long long)n, (long)(time(NULL) - t0));
    tensor_free(ctx, &t);
}

static void test_errors(struct gpu_ctx *ctx)
{
    struct dequant_job j;
    memset(&j, 0, sizeof j);
    uint8_t p[8] = {0};
    float a[1] = {1.0f};
    uint16_t out[16];
    j.packed = p;
    j.absmax = a;
    j.n = 16;
    j.blocksize = 48; /* not a power of two */
    j.out_dtype = DT_F16;
    j.out = out;
    nf4_clear_error();
    CHECK(gpu_dequant(ctx, &j) != NF4_OK && nf4_last_error()[0], "bad blocksize rejected");
    j.n = 0;
    j.blocksize = 64;
    CHECK(gpu_dequant(ctx, &j) == NF4_OK, "n = 0 is a no-op");
    struct gpu_ctx *bad = NULL;
    nf4_clear_error();
    CHECK(gpu_open(&bad, 1000, 0) == NF4_EUNAVAILABLE && bad == NULL, "device 1000 unavailable");
}

int main(int argc, char **argv)
{
    int big = 0, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--big"))
            big = 1;
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
    }
    struct gpu_ctx *ctx = open_test_device();
    if (!ctx)
        return 1;
    printf("device: %s, budget %llu MiB\n", gpu_name(ctx), (unsigned long long)(gpu_mem_budget(ctx) >> 20));
    test_errors(ctx);
    test_special(ctx);
    test_bulk_stores(ctx);
    test_value_paths(ctx);
    test_table_split(ctx);
    test_abi_offsets(ctx);
    test_subchunks();
    test_matrix(ctx, quick);
    if (big)
        test_big(ctx);
    gpu_close(ctx);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
