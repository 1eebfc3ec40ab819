/* The fused LoRA merge kernel (gpu_merge) against the CPU path (dequant_cpu,
 * then merge_cpu), byte for byte: 4-bit bases (NF4/FP4, single and double
 * quant) and unquantized ones (F16, BF16, F32), every output dtype, ranks on
 * both sides of the kernel's 32-rank stage, one to three adapters, fan_in_fan_out
 * layouts, LoKr factors (a Kronecker product from a row offset) among them, chunks that start and end inside a row, device sub-chunks (a 1 MiB
 * budget), and overflow counts; and DoRA (whole rows rescaled by magnitude over
 * their norm) on the same bases and dtypes, one row or many, rows narrower and
 * wider than a warp's stride, in sub-chunks too. Host outputs are poisoned before each run and
 * guarded past their end; the back end poisons the device output too.
 * Prints "N passed, N failed". */
#include <stdio.h>

#include "bench.h" /* gpu_last_subchunks */
#include "fpconv.h"
#include "gpu.h"
#include "gpu_tensor.h"
#include "lora_merge.h"
#include "merge_cpu.h"
#include "status.h"

struct mcase {
    uint64_t rows, cols;
    uint64_t e0, n; /* the chunk: elements [e0, e0 + n) */
    int quantized;  /* 1: a 4-bit base (nested, nf4), 2: single quant fp4, 0: unquantized w_dtype */
    enum st_dtype w_dtype, out_dtype;
    int nfactors;
    uint32_t ranks[3];
    int fif[3];
    float scaling[3];
    float dora; /* > 0: DoRA, magnitudes of about this size (whole rows only) */
    int kron[3]; /* factor t is a LoKr's Kronecker product (merge_job.h) instead of L @ R */
};

/* Factor storage for one case: L as the CPU reader lays it out, R row-major. */
struct factors {
    float *l[3], *r[3];
};

static float *random_floats(struct gpu_ctx *ctx, uint64_t n, float scale)
{
    float *p = gpu_host_alloc(ctx, (size_t)(n ? n : 1) * sizeof(float));
    if (p)
        for (uint64_t i = 0; i < n; i++)
            p[i] = (rnd_unit() - 0.5f) * scale;
    return p;
}

/* Fills the job's factors as merge_read_factors would for this chunk. */
static int make_factors(struct gpu_ctx *ctx, const struct mcase *c, struct merge_job *mj, struct factors *fs)
{
    uint64_t first_row = c->e0 / c->cols, last_row = (c->e0 + c->n - 1) / c->cols;
    mj->nfactors = (size_t)c->nfactors;
    for (int t = 0; t < c->nfactors; t++) {
        struct merge_factor *f = &mj->f[t];
        uint32_t r = c->ranks[t];
        memset(f, 0, sizeof *f);
        f->scaling = c->scaling[t];
        if (c->kron[t]) { /* W1 [a, b] and W2 [kc, d]: d the largest divisor of cols up to a quarter of them, rows from t on */
            uint64_t d = c->cols / 4 ? c->cols / 4 : 1;
            while (c->cols % d)
                d--;
            f->kron_d = d;
            f->kron_b = c->cols / d;
            f->kron_c = 2 + (uint64_t)t;
            f->kron_row0 = (uint64_t)t;
            f->kron_a = (c->rows + f->kron_row0 + f->kron_c - 1) / f->kron_c;
            fs->l[t] = random_floats(ctx, f->kron_a * f->kron_b, 0.5f);
            fs->r[t] = random_floats(ctx, f->kron_c * f->kron_d, 0.5f);
            if (!fs->l[t] || !fs->r[t])
                return -1;
            f->kron_w1 = fs->l[t];
            f->kron_w2 = fs->r[t];
            continue;
        }
        f->rank = r;
        if (c->fif[t]) { /* L = A^T: all of A [r, rows] */
            f->l_floats = (uint64_t)r * c->rows;
            f->l_row0 = 0;
            f->l_row_stride = 1;
            f->l_k_stride = c->rows;
        } else { /* L = B: the rows the chunk touches */
            f->l_floats = (last_row - first_row + 1) * r;
            f->l_row0 = first_row;
            f->l_row_stride = r;
            f->l_k_stride = 1;
        }
        fs->l[t] = random_floats(ctx, f->l_floats, 0.2f);
        fs->r[t] = random_floats(ctx, (uint64_t)r * c->cols, 0.2f);
        if (!fs->l[t] || !fs->r[t])
            return -1;
        f->l = fs->l[t];
        f->r = fs->r[t];
    }
    return 0;
}

static void run_case(struct gpu_ctx *ctx, const struct mcase *c, const char *what)
{
    struct tensor t;
    struct factors fs;
    memset(&fs, 0, sizeof fs);
    memset(&t, 0, sizeof t);
    struct merge_job mj;
    memset(&mj, 0, sizeof mj);
    mj.e0 = c->e0;
    mj.n = c->n;
    mj.cols = c->cols;
    mj.w_dtype = c->w_dtype;
    mj.out_dtype = c->out_dtype;
    size_t wsz = osize(c->w_dtype), osz = osize(c->out_dtype);
    void *w = NULL, *out_cpu = malloc(c->n * osz + GUARD_BYTES), *out_gpu = gpu_host_alloc(ctx, c->n * osz + GUARD_BYTES);
    int bad = !out_cpu || !out_gpu || make_factors(ctx, c, &mj, &fs) != 0;
    float *magnitude = NULL;
    if (!bad && c->dora > 0) {
        magnitude = random_floats(ctx, c->n / c->cols, c->dora);
        bad = !magnitude;
        for (uint64_t i = 0; magnitude && i < c->n / c->cols; i++)
            magnitude[i] += c->dora; /* 0.5 to 1.5 times c->dora */
        mj.magnitude = magnitude;
        mj.dora_rows = malloc(c->n * sizeof(float));
        bad = bad || !mj.dora_rows;
    }
    if (!bad && c->quantized) {
        /* The chunk's own 4-bit data: a dequant job of n elements whose output is the base in w_dtype. */
        bad = tensor_make(ctx, &t, c->n, c->quantized == 1 ? 64 : 128, c->quantized == 1, 256,
                          c->quantized == 1 ? QUANT_NF4 : QUANT_FP4, c->w_dtype, 0, 0) != 0;
        w = bad ? NULL : malloc(c->n * wsz + 16);
        if (w) {
            struct dequant_job dj = t.job;
            dj.out = w;
            dequant_cpu(&dj, 4);
        }
    } else if (!bad) {
        w = gpu_host_alloc(ctx, c->n * wsz + 16);
        for (uint64_t i = 0; w && i < c->n; i++) {
            float v = (rnd_unit() - 0.5f) * 4.0f;
            if (c->w_dtype == DT_F32)
                ((float *)w)[i] = v;
            else
                ((uint16_t *)w)[i] = c->w_dtype == DT_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
        }
    }
    if (bad || !w) {
        CHECK(0, "%s: out of host memory", what);
        goto out;
    }
    mj.w = w;
    memset(out_cpu, 0x5A, c->n * osz + GUARD_BYTES);
    mj.out = out_cpu;
    uint64_t over_cpu = merge_cpu(&mj, 4), over_gpu = 0;
    memset(out_gpu, POISON, c->n * osz + GUARD_BYTES);
    mj.out = out_gpu;
    if (c->quantized)
        mj.w = NULL; /* the GPU must not need the host's dequantized copy */
    nf4_clear_error();
    int rc = gpu_merge(ctx, c->quantized ? &t.job : NULL, &mj, &over_gpu);
    CHECK(rc == NF4_OK, "%s: gpu_merge failed: %s", what, nf4_last_error());
    if (rc == NF4_OK) {
        uint64_t d = first_diff(out_gpu, out_cpu, c->n * osz, osz);
        if (d != UINT64_MAX) {
            uint32_t g = 0, k = 0;
            memcpy(&g, (char *)out_gpu + d * osz, osz);
            memcpy(&k, (char *)out_cpu + d * osz, osz);
            CHECK(0, "%s: element %llu (of e0 + n = %llu + %llu) differs: gpu %08x cpu %08x", what,
                  (unsigned long long)d, (unsigned long long)c->e0, (unsigned long long)c->n, g, k);
        } else {
            CHECK(1, "%s", what);
        }
        CHECK(guard_ok(out_gpu, c->n * osz), "%s: wrote past the end", what);
        CHECK(over_gpu == over_cpu, "%s: %llu overflows on the GPU, %llu on the CPU", what,
              (unsigned long long)over_gpu, (unsigned long long)over_cpu);
    }
out:
    if (c->quantized)
        free(w);
    else
        gpu_host_free(ctx, w);
    free(out_cpu);
    gpu_host_free(ctx, out_gpu);
    for (int k = 0; k < 3; k++) {
        gpu_host_free(ctx, fs.l[k]);
        gpu_host_free(ctx, fs.r[k]);
    }
    gpu_host_free(ctx, magnitude);
    free(mj.dora_rows);
    tensor_free(ctx, &t);
}

static const char *base_name(const struct mcase *c)
{
    return c->quantized == 1 ? "nf4-nested" : c->quantized == 2 ? "fp4-single" : "plain";
}

static void test_matrix(struct gpu_ctx *ctx)
{
    static const enum st_dtype DT[] = {DT_BF16, DT_F16, DT_F32};
    /* rows x cols, chunk start and length (4-bit chunks start on a 64 * 256 granule). */
    static const struct {
        uint64_t rows, cols, e0, n;
    } SHAPES[] = {
        {37, 53, 0, 37 * 53},            /* odd, one chunk */
        {300, 1000, 16384, 200000},      /* starts and ends inside rows */
        {64, 4096, 0, 64 * 4096},        /* aligned */
        {1024, 257, 16384 * 3, 100001},  /* 257 columns: a partial column tile */
        {5, 1, 0, 5},                    /* a column vector */
    };
    static const uint32_t RANKS[][3] = {{1, 0, 0}, {7, 0, 0}, {33, 16, 0}, {64, 8, 5}};
    char what[256];
    for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++)
        for (int q = 0; q < 3; q++)
            for (size_t wd = 0; wd < 3; wd++)
                for (size_t od = 0; od < 3; od++) {
                    size_t rk = (s + q + wd + od) % 4; /* every rank set meets every shape across the loop */
                    struct mcase c = {SHAPES[s].rows, SHAPES[s].cols, SHAPES[s].e0, SHAPES[s].n, q, DT[wd], DT[od],
                                      0, {0}, {0}, {0}, 0, {0}};
                    if (q && (c.e0 % (64 * 256) != 0))
                        continue;
                    for (int t = 0; t < 3 && RANKS[rk][t]; t++) {
                        c.nfactors = t + 1;
                        c.ranks[t] = RANKS[rk][t];
                        c.fif[t] = (t + (int)s) % 2;
                        c.scaling[t] = t == 0 ? 2.0f : t == 1 ? 0.353553385f : 0.75f;
                        c.kron[t] = (t + (int)s + (int)wd) % 3 == 1; /* LoKr factors among the LoRA ones */
                    }
                    snprintf(what, sizeof what, "merge %llux%llu [%llu, +%llu) %s %s->%s, %d adapter(s), r=%u%s%s",
                             (unsigned long long)c.rows, (unsigned long long)c.cols, (unsigned long long)c.e0,
                             (unsigned long long)c.n, base_name(&c), dtn(c.w_dtype), dtn(c.out_dtype), c.nfactors,
                             c.ranks[0], c.fif[0] ? " fif" : "",
                             c.kron[0] || c.kron[1] || c.kron[2] ? " (a LoKr among them)" : "");
                    run_case(ctx, &c, what);
                }
}

/* With a budget of 1 MiB each case's base goes through the device in several
 * sub-chunks. */
static void run_in_subchunks(const struct mcase *cases, size_t n, const char *label)
{
    struct gpu_ctx *small = NULL;
    int rc = gpu_open(&small, 0, 1u << 20);
    CHECK(rc == NF4_OK, "gpu_open with a 1 MiB budget: %s", nf4_last_error());
    if (rc)
        return;
    for (size_t i = 0; i < n; i++) {
        char what[160];
        snprintf(what, sizeof what, "%s sub-chunks: %llux%llu %s", label, (unsigned long long)cases[i].rows,
                 (unsigned long long)cases[i].cols, base_name(&cases[i]));
        run_case(small, &cases[i], what);
        CHECK(gpu_last_subchunks(small) >= 3, "%s: only %llu sub-chunks", what,
              (unsigned long long)gpu_last_subchunks(small));
    }
    gpu_close(small);
}

static void test_subchunks(void)
{
    static const struct mcase cases[] = {
        {1536, 2048, 0, 1536 * 2048, 1, DT_BF16, DT_BF16, 2, {16, 4, 0}, {0, 1, 0}, {2.0f, 0.5f, 0}, 0, {0}},
        {700, 3001, 0, 700 * 3001 - 5, 0, DT_F16, DT_F32, 1, {8, 0, 0}, {0, 0, 0}, {1.5f, 0, 0}, 0, {0}},
        /* a LoKr beside a LoRA */
        {1536, 2048, 0, 1536 * 2048, 1, DT_BF16, DT_BF16, 2, {0, 4, 0}, {0, 0, 0}, {1.0f, 0.5f, 0}, 0, {1, 0, 0}},
    };
    run_in_subchunks(cases, sizeof cases / sizeof cases[0], "merge");
}

/* DoRA: whole-row chunks, each row's fp64 sum of squares in the one order
 * merge_job.h gives, then magnitude / norm times the row. */
static void test_dora(struct gpu_ctx *ctx)
{
    static const enum st_dtype DT[] = {DT_BF16, DT_F16, DT_F32};
    static const struct {
        uint64_t rows, cols;
    } SHAPES[] = {
        {37, 53},   /* rows shorter than a warp's stride twice over */
        {1, 4096},  /* one row */
        {300, 352}, /* down_proj-like rows of 352, not a multiple of 64 */
        {96, 257},  /* a partial column tile */
        {5, 1},     /* one column: 31 lanes sum nothing */
        {3, 40000}, /* long rows */
    };
    char what[256];
    for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++)
        for (int q = 0; q < 3; q++)
            for (size_t wd = 0; wd < 3; wd++)
                for (size_t od = 0; od < 3; od++) {
                    uint64_t n = SHAPES[s].rows * SHAPES[s].cols;
                    struct mcase c = {SHAPES[s].rows, SHAPES[s].cols, 0, n, q, DT[wd], DT[od], 1,
                                      {(s + od) % 2 ? 33u : 8u, 0, 0}, {0}, {2.0f, 0, 0}, 1.0f, {0}};
                    snprintf(what, sizeof what, "dora %llux%llu %s %s->%s r=%u", (unsigned long long)c.rows,
                             (unsigned long long)c.cols, base_name(&c), dtn(c.w_dtype), dtn(c.out_dtype), c.ranks[0]);
                    run_case(ctx, &c, what);
                }
    /* Rows of a later chunk: magnitudes and rows counted from e0. */
    struct mcase later = {64, 4096, 16384 * 4, 16 * 4096, 1, DT_BF16, DT_BF16, 1, {16, 0, 0}, {0}, {0.5f, 0, 0}, 0.7f, {0}};
    run_case(ctx, &later, "dora: a chunk of rows 16 to 31");
    struct mcase over = {96, 640, 0, 96 * 640, 0, DT_F32, DT_F16, 1, {4, 0, 0}, {0}, {3.0f, 0, 0}, 3e6f, {0}};
    run_case(ctx, &over, "dora: magnitudes that overflow fp16");
    static const struct mcase sub[] = {
        {1536, 2048, 0, 1536 * 2048, 1, DT_BF16, DT_BF16, 1, {16, 0, 0}, {0}, {2.0f, 0, 0}, 1.0f, {0}},
        {700, 3001, 0, 700 * 3001, 0, DT_F16, DT_F32, 1, {8, 0, 0}, {0}, {1.5f, 0, 0}, 1.0f, {0}},
    };
    run_in_subchunks(sub, sizeof sub / sizeof sub[0], "dora");
}

/* A scaling that overflows fp16: the counts must match the CPU's. */
static void test_overflow(struct gpu_ctx *ctx)
{
    struct mcase c = {96, 640, 0, 96 * 640, 0, DT_F32, DT_F16, 1, {4, 0, 0}, {0, 0, 0}, {3e6f, 0, 0}, 0, {0}};
    run_case(ctx, &c, "merge overflow to fp16 inf");
}

int main(void)
{
    struct gpu_ctx *ctx = open_test_device();
    if (!ctx)
        return 1;
    printf("device: %s\n", gpu_name(ctx));
    test_matrix(ctx);
    test_subchunks();
    test_overflow(ctx);
    test_dora(ctx);
    gpu_close(ctx);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
