/* `nf4deq bench`: times the fused CUDA kernel on random double-quantized NF4
 * tensors (blocksize 64, nested blocksize 256), next to a device-to-device copy
 * and, with --bnb-lib, next to the bitsandbytes dequantize sequence. */
#include <dlfcn.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "bench_cpu.h"
#include "cli.h"
#include "cpu_path.h"
#include "dtype.h"
#include "exit_handoff.h"
#include "gpu.h"
#include "status.h"

#define BENCH_DEFAULT_ITERS 200
#define BENCH_MIN_ITERS 100
#define BENCH_CPU_DEFAULT_ITERS 10
#define BENCH_CPU_MIN_ITERS 3
#define BENCH_CPU_MAX_LORA_RANK 4096
#define MAX_SHAPES 32
#define N_BASE_VARIANTS 12
#define N_DIAG_VARIANTS 4

struct shape {
    uint64_t rows, cols;
    enum st_dtype dtype;
};

/* The Unsloth puzzle's matrices, and 8192x4096. */
static const struct shape DEFAULT_SHAPES[] = {
    {8192, 2048, DT_F16},  {2048, 8192, DT_F16},   {4096, 1024, DT_BF16}, {1024, 4096, DT_BF16},
    {14336, 4096, DT_BF16}, {4096, 14336, DT_BF16}, {8192, 4096, DT_F16},
};

/* The three MLPs: gate and up are inter x hidden, down is hidden x inter. */
static const struct shape PUZZLE_MATRICES[] = {
    {8192, 2048, DT_F16},   {8192, 2048, DT_F16},   {2048, 8192, DT_F16},
    {4096, 1024, DT_BF16},  {4096, 1024, DT_BF16},  {1024, 4096, DT_BF16},
    {14336, 4096, DT_BF16}, {14336, 4096, DT_BF16}, {4096, 14336, DT_BF16},
};
#define N_PUZZLE (sizeof PUZZLE_MATRICES / sizeof PUZZLE_MATRICES[0])

static const char *VARIANT_NAMES[N_BASE_VARIANTS] = {"default",       "asm-value",      "no-hints",      "asm-value+no-hints",
                                                    "no-store-hint", "asm-mul",        "shuffle-values", "shared-values",
                                                    "c-mul",         "device-offset",  "pdl",           "output-values"};

/* The config column's mark for the table's value path (gpu_bench_result.values). */
static const char *const VALUES_SUFFIX[] = {"", "s", "o"};
#define N_VALUE_PATHS ((int)(sizeof VALUES_SUFFIX / sizeof VALUES_SUFFIX[0]))

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: nf4deq bench [options]\n"
            "\n"
            "Times the CUDA dequantization kernel on random NF4 tensors with a double-quant\n"
            "state (blocksize 64, nested blocksize 256): median of the timed runs (CUDA\n"
            "events), bytes moved, GB/s and the share of device-to-device copy bandwidth\n"
            "measured in the same run. Kernel variants (the asm value path, cache hints\n"
            "off, the code values read by shuffle or from shared memory, each block's\n"
            "outputs read by shuffle, the multiply in asm or in C, the nested offset\n"
            "read from device memory as the PyTorch route passes it) are timed side by\n"
            "side, interleaved. The config column ends in s where the values come by\n"
            "shuffle, o where each block's outputs come by shuffle, m where the multiply\n"
            "is asm, p where stores are plain. With --bnb-lib, identical means with the\n"
            "offset given both ways.\n"
            "\n"
            "  --shape MxK[:fp16|bf16]  a matrix to time (repeatable); default: the Unsloth\n"
            "                           puzzle matrices and 8192x4096\n"
            "  --dtype fp16|bf16        output type of shapes given without one (with no\n"
            "                           --shape: of every default shape)\n"
            "  --iters N                timed runs per variant (default %d, at least %d)\n"
            "  --bnb-lib PATH           also time bitsandbytes (libbitsandbytes_cuda*.so):\n"
            "                           dequantize absmax, add offset, dequantize nf4; and\n"
            "                           compare its output with nf4deq's byte for byte\n"
            "                           (a difference exits 70, after the tables)\n"
            "  --sweep                  also time every launch configuration\n"
            "  --device N               CUDA device (default 0)\n"
            "  --json                   machine-readable output\n"
            "  -h, --help               this help\n"
            "\n"
            "With --cpu it times the CPU kernel instead, on one shape (default 14336x4096,\n"
            "bf16): every vector path this processor has (scalar, sse, avx2, avx512, neon)\n"
            "at each thread count, in GB/s of output, next to memcpy of the output's size\n"
            "and the write floor (the output's size written with non-temporal stores, or\n"
            "by memset where the kernels write through the cache) at the same thread\n"
            "count, measured in the same run. Every path's output is checked against the\n"
            "scalar path's.\n"
            "\n"
            "  --cpu                    time the CPU kernel\n"
            "  --threads N[,N...]       thread counts (default: 1, 2, 4, ... and every core)\n"
            "  --lora-rank R            time the CPU LoRA merge instead: a bf16 base plus one\n"
            "                           rank-R pair of fp32 factors, merged into the shape's\n"
            "                           output type (R 1..%d)\n"
            "                           --iters defaults to %d here, at least %d\n"
            "\n" EXIT_CODES_HELP,
            BENCH_DEFAULT_ITERS, BENCH_MIN_ITERS, BENCH_CPU_MAX_LORA_RANK, BENCH_CPU_DEFAULT_ITERS,
            BENCH_CPU_MIN_ITERS);
}

static const char *dt_label(enum st_dtype dt)
{
    return dt == DT_F16 ? "fp16" : dt == DT_BF16 ? "bf16" : "fp32";
}

/* The dtype `what` gives (--dtype, or a --shape's type), in any case and by
 * any name convert takes: fp16 or bf16, the types the kernels are timed for. */
static int parse_dtype(const char *what, const char *s, enum st_dtype *dt)
{
    *dt = dtype_from_cli_name(s);
    if (*dt != DT_F16 && *dt != DT_BF16)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: %s must be fp16 or bf16, not '%s'", what, s);
    return NF4_OK;
}

/* "MxK" or "MxK:dtype"; has_dtype tells whether a dtype was given. */
static int parse_shape(const char *s, struct shape *sh, int *has_dtype)
{
    char *end;
    unsigned long long m = strtoull(s, &end, 10);
    if (end == s || (*end != 'x' && *end != 'X'))
        goto bad;
    const char *k_s = end + 1;
    unsigned long long k = strtoull(k_s, &end, 10);
    if (end == k_s || (*end && *end != ':') || m == 0 || k == 0)
        goto bad;
    sh->rows = m;
    sh->cols = k;
    *has_dtype = 0;
    if (*end == ':') {
        int rc = parse_dtype("the type in --shape", end + 1, &sh->dtype);
        if (rc)
            return rc;
        *has_dtype = 1;
    }
    return NF4_OK;
bad:
    return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --shape wants MxK (e.g. 8192x2048), not '%s'", s);
}

struct shape_result {
    struct shape sh;
    struct gpu_bench_result r;
};

/* A swept configuration's column label: [T]EPTxTHREADS and suffixes. Kernel:
 * p = plain stores, a = asm value path, m = asm multiply only, b = TMA bulk
 * stores, B = bulk stores with an L2 evict_first policy. Traffic floor (T):
 * EPT = 4-byte loads per lane, p = plain stores, n = no L2::256B prefetch. */
static const char *config_label(const struct gpu_bench_variant *v, char *buf, size_t size)
{
    unsigned f = v->flags;
    if (f & GPU_VARIANT_TRAFFIC)
        snprintf(buf, size, "T%dx%d%s%s", v->ept, v->threads, (f & GPU_VARIANT_NO_HINTS) ? "p" : "",
                 (f & GPU_VARIANT_L2_NOPF) ? "n" : "");
    else
        snprintf(buf, size, "%dx%d%s%s%s", v->ept, v->threads, (f & GPU_VARIANT_NO_STORE_HINT) ? "p" : "",
                 (f & GPU_VARIANT_ASM_VALUE) ? "a" : (f & GPU_VARIANT_ASM_MUL) ? "m" : "",
                 (f & GPU_VARIANT_BULK_EVICT_FIRST) ? "B" : (f & GPU_VARIANT_BULK_STORE) ? "b" : "");
    return buf;
}

/* The swept configurations' column headers, after a table's fixed columns. */
static void print_config_headers(const struct gpu_bench_variant *var, int first_cfg, int nvar)
{
    for (int v = first_cfg; v < nvar; v++) {
        char cfg[24];
        printf(" %9s", config_label(&var[v], cfg, sizeof cfg));
    }
}

/* A row's first two columns: the shape as MxK, and its output type. */
static void print_shape_columns(const struct shape *sh)
{
    char name[48];
    snprintf(name, sizeof name, "%llux%llu", (unsigned long long)sh->rows, (unsigned long long)sh->cols);
    printf("%-12s %-5s", name, dt_label(sh->dtype));
}

/* A base variant's column width: its whole name, at least 9. */
static int variant_width(int v)
{
    int len = (int)strlen(VARIANT_NAMES[v]);
    return len > 9 ? len : 9;
}

/* --sweep: the kernel variants and launch configurations again as CUDA-graph
 * replays, where a launch's fixed cost no longer hides the small shapes. */
static void print_graph_sweep(const struct shape_result *res, int nres, const struct gpu_bench_variant *var,
                              int nvar, int first_cfg)
{
    printf("\nthe same as CUDA-graph replays (us per launch; launch = an empty kernel; traffic, memset and\n"
           "read = the floors above):\n"
           "%-12s %-5s %9s %9s %9s %9s %9s", "shape", "dtype", "default", "launch", "traffic", "memset", "read");
    for (int v = 1; v < N_BASE_VARIANTS && v < nvar; v++)
        printf(" %*s", variant_width(v), VARIANT_NAMES[v]);
    print_config_headers(var, first_cfg, nvar);
    printf("\n");
    for (int i = 0; i < nres; i++) {
        const struct gpu_bench_result *r = &res[i].r;
        print_shape_columns(&res[i].sh);
        printf(" %9.2f %9.2f %9.2f %9.2f %9.2f", r->graph_var_ms[0] * 1e3, r->graph_var_ms[N_BASE_VARIANTS + 1] * 1e3,
               r->graph_var_ms[N_BASE_VARIANTS] * 1e3, r->graph_var_ms[N_BASE_VARIANTS + 2] * 1e3,
               r->graph_var_ms[N_BASE_VARIANTS + 3] * 1e3);
        for (int v = 1; v < N_BASE_VARIANTS && v < nvar; v++)
            printf(" %*.2f", variant_width(v), r->graph_var_ms[v] * 1e3);
        for (int v = first_cfg; v < nvar; v++)
            printf(" %9.2f", r->graph_var_ms[v] * 1e3);
        printf("\n");
    }
}

static void print_text(const char *dev, const char *date, int iters, double copy_bw,
                       const struct shape_result *res, int nres, const struct gpu_bench_variant *var,
                       int nvar, int have_bnb)
{
    printf("nf4deq bench: %s, %s, median of %d timed runs per variant (CUDA events)\n", dev, date, iters);
    printf("device-to-device copy: %.1f GB/s (bytes read + written)\n\n", copy_bw / 1e9);
    printf("%-12s %-5s %9s %10s %8s %7s", "shape", "dtype", "MB moved", "nf4deq us", "GB/s", "%copy");
    if (have_bnb)
        printf(" %9s %8s %9s", "bnb us", "speedup", "identical");
    printf(" %4s %9s\n", "sets", "config");
    /* The table above times each launch between its own pair of events, so a
     * fixed launch cost of a few us is in every number; the copy rate it is
     * compared with comes from a large copy, where that cost vanishes. */
    for (int i = 0; i < nres; i++) {
        const struct shape_result *s = &res[i];
        double us = s->r.ms[0] * 1e3, gbs = (double)s->r.bytes / (s->r.ms[0] * 1e-3) / 1e9;
        print_shape_columns(&s->sh);
        printf(" %9.2f %10.2f %8.1f %6.1f%%", s->r.bytes / 1e6, us, gbs, 100.0 * gbs * 1e9 / copy_bw);
        if (have_bnb)
            printf(" %9.2f %7.2fx %9s", s->r.bnb_ms * 1e3, s->r.bnb_ms / s->r.ms[0],
                   s->r.bnb_identical ? "yes" : "NO");
        printf(" %4d %3dx%d%s%s%s\n", s->r.input_sets, s->r.ept, s->r.threads, s->r.store_hint ? "" : "p",
               VALUES_SUFFIX[s->r.values < 0 || s->r.values >= N_VALUE_PATHS ? 0 : s->r.values], s->r.asm_mul ? "m" : "");
    }

    /* Puzzle total: the nine matrices of the three MLPs. */
    double tot = 0, tot_bnb = 0;
    unsigned found = 0;
    for (size_t p = 0; p < N_PUZZLE; p++)
        for (int i = 0; i < nres; i++)
            if (res[i].sh.rows == PUZZLE_MATRICES[p].rows && res[i].sh.cols == PUZZLE_MATRICES[p].cols &&
                res[i].sh.dtype == PUZZLE_MATRICES[p].dtype) {
                tot += res[i].r.ms[0];
                tot_bnb += res[i].r.bnb_ms;
                found++;
                break;
            }
    if (found == N_PUZZLE) {
        printf("%-18s %9s %10.2f %8s %7s", "puzzle total (9)", "", tot * 1e3, "", "");
        if (have_bnb)
            printf(" %9.2f %7.2fx", tot_bnb * 1e3, tot_bnb / tot);
        printf("\n");
    }

    printf("\nCUDA graph replays, same run (per launch: %s back-to-back launches per replay,\n"
           "median of replays; how bitsandbytes' 72.6 us figure in the issue was taken):\n",
           "24");
    printf("%-12s %-5s %10s %8s %7s", "shape", "dtype", "nf4deq us", "GB/s", "%copy");
    if (have_bnb)
        printf(" %9s %8s", "bnb us", "speedup");
    printf("\n");
    double gtot = 0, gtot_bnb = 0;
    for (int i = 0; i < nres; i++) {
        const struct shape_result *s = &res[i];
        double gbs = (double)s->r.bytes / (s->r.graph_ms * 1e-3) / 1e9;
        print_shape_columns(&s->sh);
        printf(" %10.2f %8.1f %6.1f%%", s->r.graph_ms * 1e3, gbs, 100.0 * gbs * 1e9 / copy_bw);
        if (have_bnb)
            printf(" %9.2f %7.2fx", s->r.bnb_graph_ms * 1e3, s->r.bnb_graph_ms / s->r.graph_ms);
        printf("\n");
        for (size_t p = 0; p < N_PUZZLE; p++)
            if (s->sh.rows == PUZZLE_MATRICES[p].rows && s->sh.cols == PUZZLE_MATRICES[p].cols &&
                s->sh.dtype == PUZZLE_MATRICES[p].dtype) {
                gtot += s->r.graph_ms;
                gtot_bnb += s->r.bnb_graph_ms;
            }
    }
    if (found == N_PUZZLE) {
        printf("%-18s %10.2f %8s %7s", "puzzle total (9)", gtot * 1e3, "", "");
        if (have_bnb)
            printf(" %9.2f %7.2fx", gtot_bnb * 1e3, gtot_bnb / gtot);
        printf("\n");
    }

    printf("\nvariants, same run (us; ratio = variant time / default time):\n");
    printf("%-12s %-5s", "shape", "dtype");
    for (int v = 0; v < N_BASE_VARIANTS && v < nvar; v++)
        printf(" %20s", VARIANT_NAMES[v]);
    printf("\n");
    for (int i = 0; i < nres; i++) {
        print_shape_columns(&res[i].sh);
        for (int v = 0; v < N_BASE_VARIANTS && v < nvar; v++)
            printf(" %11.2f (%5.3f)", res[i].r.ms[v] * 1e3, res[i].r.ms[v] / res[i].r.ms[0]);
        printf("\n");
    }
    printf("\nfloors, same run (us): traffic = the same loads and stores with no arithmetic;\n"
           "launch = an empty kernel; memset = write the output only; read = read the packed input only\n");
    printf("%-12s %-5s %10s %10s %10s %10s %10s %15s\n", "shape", "dtype", "default", "traffic", "launch",
           "memset", "read", "default/traffic");
    for (int i = 0; i < nres; i++) {
        print_shape_columns(&res[i].sh);
        printf(" %10.2f %10.2f %10.2f %10.2f %10.2f %15.3f\n", res[i].r.ms[0] * 1e3,
               res[i].r.ms[N_BASE_VARIANTS] * 1e3, res[i].r.ms[N_BASE_VARIANTS + 1] * 1e3,
               res[i].r.ms[N_BASE_VARIANTS + 2] * 1e3, res[i].r.ms[N_BASE_VARIANTS + 3] * 1e3,
               res[i].r.ms[0] / res[i].r.ms[N_BASE_VARIANTS]);
    }
    const int first_cfg = N_BASE_VARIANTS + N_DIAG_VARIANTS;
    if (nvar > first_cfg) {
        printf("\nlaunch configurations, same run (us; elements/lane x threads/CTA, p = plain stores,\n"
               "a = asm value path, m = asm multiply only, b = TMA bulk stores, B = bulk + L2 evict_first;\n"
               "TKxN = traffic floor with K loads per lane and N threads, n = no L2::256B prefetch):\n%-12s %-5s",
               "shape", "dtype");
        print_config_headers(var, first_cfg, nvar);
        printf("\n");
        for (int i = 0; i < nres; i++) {
            print_shape_columns(&res[i].sh);
            for (int v = first_cfg; v < nvar; v++)
                printf(" %9.2f", res[i].r.ms[v] * 1e3);
            printf("\n");
        }
        print_graph_sweep(res, nres, var, nvar, first_cfg);
    }
}

static void print_json(const char *dev, const char *date, int iters, double copy_bw,
                       const struct shape_result *res, int nres, const struct gpu_bench_variant *var,
                       int nvar, int have_bnb)
{
    printf("{\"device\": \"%s\", \"date\": \"%s\", \"iters\": %d, \"copy_gbps\": %.2f, \"shapes\": [", dev, date,
           iters, copy_bw / 1e9);
    for (int i = 0; i < nres; i++) {
        const struct shape_result *s = &res[i];
        double gbs = (double)s->r.bytes / (s->r.ms[0] * 1e-3) / 1e9;
        printf("%s\n  {\"rows\": %llu, \"cols\": %llu, \"dtype\": \"%s\", \"bytes\": %llu, \"us\": %.3f, "
               "\"gbps\": %.2f, \"pct_copy\": %.2f, \"input_sets\": %d, \"ept\": %d, \"threads\": %d, "
               "\"streaming_stores\": %s, \"shuffle_values\": %s, \"output_values\": %s, \"asm_mul\": %s",
               i ? "," : "", (unsigned long long)s->sh.rows, (unsigned long long)s->sh.cols,
               dt_label(s->sh.dtype), (unsigned long long)s->r.bytes, s->r.ms[0] * 1e3, gbs,
               100.0 * gbs * 1e9 / copy_bw, s->r.input_sets, s->r.ept, s->r.threads,
               s->r.store_hint ? "true" : "false", s->r.values != 0 ? "true" : "false", s->r.values == 2 ? "true" : "false",
               s->r.asm_mul ? "true" : "false");
        if (have_bnb)
            printf(", \"bnb_us\": %.3f, \"speedup\": %.4f, \"bnb_identical\": %s", s->r.bnb_ms * 1e3,
                   s->r.bnb_ms / s->r.ms[0], s->r.bnb_identical ? "true" : "false");
        printf(", \"graph_us\": %.3f, \"graph_pct_copy\": %.2f", s->r.graph_ms * 1e3,
               100.0 * (double)s->r.bytes / (s->r.graph_ms * 1e-3) / copy_bw);
        if (have_bnb)
            printf(", \"bnb_graph_us\": %.3f, \"graph_speedup\": %.4f", s->r.bnb_graph_ms * 1e3,
                   s->r.bnb_graph_ms / s->r.graph_ms);
        printf(", \"variants\": [");
        for (int v = 0; v < nvar; v++)
            printf("%s{\"name\": \"%s\", \"asm_value\": %s, \"no_hints\": %s, \"ept\": %d, \"threads\": %d, "
                   "\"flags\": %u, \"us\": %.3f}",
                   v ? ", " : "", v < N_BASE_VARIANTS ? VARIANT_NAMES[v]
                   : (var[v].flags & GPU_VARIANT_TRAFFIC) ? "traffic-floor"
                   : (var[v].flags & GPU_VARIANT_EMPTY)   ? "launch-floor"
                   : (var[v].flags & GPU_VARIANT_MEMSET)  ? "memset-floor"
                   : (var[v].flags & GPU_VARIANT_READ)    ? "read-floor"
                                                          : "config",
                   (var[v].flags & GPU_VARIANT_ASM_VALUE) ? "true" : "false",
                   (var[v].flags & GPU_VARIANT_NO_HINTS) ? "true" : "false", var[v].ept ? var[v].ept : s->r.ept,
                   var[v].threads ? var[v].threads : s->r.threads, var[v].flags, s->r.ms[v] * 1e3);
        printf("]}");
    }
    printf("\n]}\n");
}

/* "1,2,8" into o->thread_counts. */
static int parse_thread_counts(const char *s, struct bench_cpu_opts *o)
{
    const char *p = s;
    o->n_thread_counts = 0;
    for (;;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || (*end && *end != ','))
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --threads wants counts from 1 to 4096 like 1,2,8, not '%s'",
                            s);
        if (o->n_thread_counts == BENCH_CPU_MAX_THREAD_COUNTS)
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: at most %d thread counts", BENCH_CPU_MAX_THREAD_COUNTS);
        o->thread_counts[o->n_thread_counts++] = (int)v;
        if (!*end)
            return NF4_OK;
        p = end + 1;
    }
}

/* bench --cpu: one shape (the first given, else 14336x4096). */
static int bench_cpu(struct bench_cpu_opts *o, const struct shape *shapes, int nshapes, const int *shape_has_dtype,
                     enum st_dtype dtype, int iters, int json, int gpu_options)
{
    if (gpu_options)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --bnb-lib, --sweep and --device time the GPU, not --cpu");
    if (nshapes > 1)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --cpu times one --shape");
    if (iters && iters < BENCH_CPU_MIN_ITERS)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --iters must be %d..100000 with --cpu", BENCH_CPU_MIN_ITERS);
    enum cpu_path active;
    int rc = cpu_path_from_env(&active);
    if (rc != NF4_OK)
        return rc;
    o->rows = nshapes ? shapes[0].rows : 14336;
    o->cols = nshapes ? shapes[0].cols : 4096;
    o->dtype = nshapes && shape_has_dtype[0] ? shapes[0].dtype : dtype;
    o->iters = iters ? iters : BENCH_CPU_DEFAULT_ITERS;
    o->json = json;
    if (o->rows * o->cols / o->cols != o->rows || o->rows * o->cols > (UINT64_C(1) << 40))
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: shape too large");
    return bench_cpu_run(o);
}

int cmd_bench(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"shape", required_argument, NULL, 's'}, {"dtype", required_argument, NULL, 'd'},
        {"iters", required_argument, NULL, 'i'}, {"bnb-lib", required_argument, NULL, 'b'},
        {"json", no_argument, NULL, 'j'},        {"sweep", no_argument, NULL, 'w'},
        {"device", required_argument, NULL, 'D'}, {"help", no_argument, NULL, 'h'},
        {"cpu", no_argument, NULL, 'c'},          {"threads", required_argument, NULL, 't'},
        {"lora-rank", required_argument, NULL, 'r'}, {NULL, 0, NULL, 0},
    };
    struct shape shapes[MAX_SHAPES];
    int shape_has_dtype[MAX_SHAPES];
    int nshapes = 0, iters = 0, json = 0, sweep = 0, device = 0, dtype_given = 0, device_given = 0, cpu = 0;
    struct bench_cpu_opts cpu_opts = {0};
    enum st_dtype dtype = DT_F16;
    const char *bnb_path = NULL;
    int rc;

    struct cli_opt_scan scan;
    optind = 1;
    opterr = 0;
    int c;
    while ((c = cli_getopt(&scan, argc, argv, ":h", longopts)) != -1) {
        switch (c) {
        case 's':
            if (nshapes == MAX_SHAPES)
                return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: at most %d shapes", MAX_SHAPES);
            if ((rc = parse_shape(optarg, &shapes[nshapes], &shape_has_dtype[nshapes])))
                return rc;
            nshapes++;
            break;
        case 'd':
            if ((rc = parse_dtype("--dtype", optarg, &dtype)))
                return rc;
            dtype_given = 1;
            break;
        case 'i': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || end == optarg || v < 1 || v > 100000)
                return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: bad --iters '%s'", optarg);
            iters = (int)v;
            break;
        }
        case 'b': bnb_path = optarg; break;
        case 'j': json = 1; break;
        case 'w': sweep = 1; break;
        case 'D': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || end == optarg || v < 0 || v > 1024)
                return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: bad --device '%s'", optarg);
            device = (int)v;
            device_given = 1;
            break;
        }
        case 'c': cpu = 1; break;
        case 't':
            if ((rc = parse_thread_counts(optarg, &cpu_opts)))
                return rc;
            break;
        case 'r': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || end == optarg || v < 1 || v > BENCH_CPU_MAX_LORA_RANK)
                return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: bad --lora-rank '%s' (1..%d)", optarg,
                                BENCH_CPU_MAX_LORA_RANK);
            cpu_opts.lora_rank = (uint32_t)v;
            break;
        }
        case 'h': usage(stdout); return NF4_OK;
        default: return cli_option_error("bench", argv, &scan, c);
        }
    }
    if (optind < argc)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: unexpected argument '%s'", argv[optind]);
    if (cpu)
        return bench_cpu(&cpu_opts, shapes, nshapes, shape_has_dtype, dtype_given ? dtype : DT_BF16, iters, json,
                         bnb_path || sweep || device_given);
    if (cpu_opts.n_thread_counts)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --threads goes with --cpu");
    if (cpu_opts.lora_rank)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --lora-rank goes with --cpu");
    if (!iters)
        iters = BENCH_DEFAULT_ITERS;
    if (iters < BENCH_MIN_ITERS)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: --iters must be %d..100000", BENCH_MIN_ITERS);
    if (nshapes == 0) {
        nshapes = (int)(sizeof DEFAULT_SHAPES / sizeof DEFAULT_SHAPES[0]);
        for (int i = 0; i < nshapes; i++) {
            shapes[i] = DEFAULT_SHAPES[i];
            if (dtype_given)
                shapes[i].dtype = dtype;
        }
    } else {
        for (int i = 0; i < nshapes; i++)
            if (!shape_has_dtype[i])
                shapes[i].dtype = dtype;
    }
    for (int i = 0; i < nshapes; i++) {
        uint64_t n = shapes[i].rows * shapes[i].cols;
        if (shapes[i].cols && n / shapes[i].cols != shapes[i].rows)
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "bench: shape too large");
    }

    bnb_dequant_fp32_fn bnb_fp32 = NULL;
    bnb_dequant_4bit_fn bnb_fp16 = NULL, bnb_bf16 = NULL;
    void *lib = NULL;
    if (bnb_path) {
        lib = dlopen(bnb_path, RTLD_NOW | RTLD_LOCAL);
        if (!lib)
            return nf4_fail(NF4_ENOINPUT, bnb_path, NULL, "cannot load bitsandbytes: %s", dlerror());
        *(void **)&bnb_fp32 = dlsym(lib, "cdequantize_blockwise_fp32");
        *(void **)&bnb_fp16 = dlsym(lib, "cdequantize_blockwise_fp16_nf4");
        *(void **)&bnb_bf16 = dlsym(lib, "cdequantize_blockwise_bf16_nf4");
        if (!bnb_fp32 || !bnb_fp16 || !bnb_bf16) {
            dlclose(lib);
            return nf4_fail(NF4_EDATA, bnb_path, NULL,
                            "not a bitsandbytes CUDA library (cdequantize_blockwise_* missing)");
        }
    }

    struct gpu_ctx *ctx = NULL;
    if ((rc = gpu_open(&ctx, device, 0))) {
        if (lib)
            dlclose(lib);
        return rc;
    }
    if (gpu_exclusive(ctx))
        handoff_forbid();

    struct gpu_bench_variant var[GPU_BENCH_MAX_VARIANTS];
    int nvar = 0;
    var[nvar++] = (struct gpu_bench_variant){0, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_VALUE, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_NO_HINTS, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_VALUE | GPU_VARIANT_NO_HINTS, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_NO_STORE_HINT, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_MUL, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_SHUFFLE_VALUES, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_SHARED_VALUES, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_C_MUL, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_DEVICE_OFFSET, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_PDL, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_OUTPUT_VALUES, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC, 4, 256};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_EMPTY, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_MEMSET, 0, 0};
    var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_READ, 0, 0};
    if (sweep) {
        static const int EPTS[] = {16, 32}, THREADS[] = {64, 128, 256, 512, 1024};
        for (size_t e = 0; e < 2; e++)
            for (size_t t = 0; t < 5; t++)
                var[nvar++] = (struct gpu_bench_variant){0, EPTS[e], THREADS[t]};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_NO_STORE_HINT, 32, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_NO_STORE_HINT, 32, 512};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_VALUE, 32, 64};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_VALUE, 16, 128};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_ASM_MUL, 16, 128};
        /* Traffic floors: 4-byte loads per lane x CTA size; p = plain stores, n = no L2 prefetch. */
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC, 1, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC | GPU_VARIANT_L2_NOPF, 1, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC | GPU_VARIANT_L2_NOPF, 4, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC, 2, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_TRAFFIC | GPU_VARIANT_NO_HINTS, 4, 256};
        /* Hopper bulk (TMA) stores of each warp's tile, at the default shape and with more bytes per CTA. */
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_BULK_STORE, 32, 64};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_BULK_EVICT_FIRST, 32, 64};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_BULK_STORE, 32, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_BULK_EVICT_FIRST, 32, 256};
        var[nvar++] = (struct gpu_bench_variant){GPU_VARIANT_BULK_EVICT_FIRST, 16, 128};
    }

    double copy_bw = 0;
    struct shape_result res[MAX_SHAPES];
    int nres = 0;
    if ((rc = gpu_bench_copy_bw(ctx, &copy_bw)))
        goto out;
    for (int i = 0; i < nshapes; i++) {
        struct gpu_bench_opts o = {
            .n = shapes[i].rows * shapes[i].cols,
            .out_dtype = shapes[i].dtype,
            .iters = iters,
            .variants = var,
            .n_variants = nvar,
            .bnb_fp32 = bnb_fp32,
            .bnb_4bit = shapes[i].dtype == DT_BF16 ? bnb_bf16 : bnb_fp16,
            .seed = 0x1234567ull + (uint64_t)i,
            .graph_variants = sweep,
        };
        res[nres].sh = shapes[i];
        if ((rc = gpu_bench_shape(ctx, &o, &res[nres].r)))
            goto out;
        nres++;
        if (!json)
            fprintf(stderr, "bench: %llux%llu done\n", (unsigned long long)shapes[i].rows,
                    (unsigned long long)shapes[i].cols);
    }
    {
        char date[32];
        time_t now = time(NULL);
        struct tm tm;
        gmtime_r(&now, &tm);
        strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", &tm);
        if (json)
            print_json(gpu_name(ctx), date, iters, copy_bw, res, nres, var, nvar, lib != NULL);
        else
            print_text(gpu_name(ctx), date, iters, copy_bw, res, nres, var, nvar, lib != NULL);
    }
    for (int i = 0; i < nres; i++)
        if (lib && !res[i].r.bnb_identical) {
            rc = nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bench: output differs from bitsandbytes for %llux%llu",
                          (unsigned long long)res[i].sh.rows, (unsigned long long)res[i].sh.cols);
            break;
        }
out:
    gpu_close(ctx);
    /* The bitsandbytes library stays loaded: its CUDA runtime may still hold
     * state that it tears down at exit. */
    return rc;
}
