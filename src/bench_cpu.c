#include "bench_cpu.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_path.h"
#include "dequant.h"
#include "fpconv.h"
#include "merge_cpu.h"
#include "parallel.h"
#include "status.h"

/* The GPU bench's tensor: NF4, blocksize 64, double quant with nested blocks of 256. */
#define BENCH_BLOCKSIZE 64u
#define BENCH_NESTED_BLOCKSIZE 256u
/* Output buffers start on a cache line, as a tensor's storage does (PyTorch
 * aligns to 64 bytes): dequant_cpu streams a large output only from there. */
#define OUT_ALIGN 64u
/* memcpy's and the write floor's work unit across threads. */
#define COPY_UNIT_BYTES (UINT64_C(1) << 20)

/* The floors' job: memcpy of src into dst, or the write floor into dst. */
struct floor_job {
    unsigned char *dst;
    const unsigned char *src;
    uint64_t bytes;
    int store_bytes; /* the write floor's: fill_store_bytes */
};

/* Bytes [*begin, *end) of units [first, first + count); *begin is a multiple of OUT_ALIGN. */
static void unit_range(const struct floor_job *f, uint64_t first, uint64_t count, uint64_t *begin, uint64_t *end)
{
    *begin = first * COPY_UNIT_BYTES;
    *end = (first + count) * COPY_UNIT_BYTES;
    if (*end > f->bytes)
        *end = f->bytes;
}

static void copy_units(void *ctx, uint64_t first, uint64_t count)
{
    const struct floor_job *f = ctx;
    uint64_t begin, end;
    unit_range(f, first, count, &begin, &end);
    memcpy(f->dst + begin, f->src + begin, end - begin);
}

/* The write floor: the output's size written as the vector kernels write it.
 * A large aligned output (dequant_cpu_streams) goes out with the widest
 * non-temporal store the processor has: the kernel reads a quarter of what it
 * writes, so it can outrun memcpy, but not this. Otherwise (the kernels write
 * through the cache), and for what is left after the whole lines, memset. */
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx512f"))) static void stream_fill_64(unsigned char *p, uint64_t bytes)
{
    const __m512i v = _mm512_set1_epi8(0x3c);
    for (uint64_t i = 0; i < bytes; i += 64)
        _mm512_stream_si512((void *)(p + i), v);
    _mm_sfence();
}

__attribute__((target("avx"))) static void stream_fill_32(unsigned char *p, uint64_t bytes)
{
    const __m256i v = _mm256_set1_epi8(0x3c);
    for (uint64_t i = 0; i < bytes; i += 32)
        _mm256_stream_si256((__m256i *)(p + i), v);
    _mm_sfence();
}

/* The SSSE3 kernel's 16-byte streamed stores. */
__attribute__((target("sse2"))) static void stream_fill_16(unsigned char *p, uint64_t bytes)
{
    const __m128i v = _mm_set1_epi8(0x3c);
    for (uint64_t i = 0; i < bytes; i += 16)
        _mm_stream_si128((__m128i *)(p + i), v);
    _mm_sfence();
}
#endif

/* How the floor writes: 64, 32 or 16 (bytes per non-temporal store), or 0 (memset). */
static int fill_store_bytes(const struct dequant_job *job)
{
#if defined(__x86_64__) || defined(__i386__)
    if (dequant_cpu_streams(job))
        return cpu_path_supported(CPU_PATH_AVX512) ? 64
               : cpu_path_supported(CPU_PATH_AVX2) ? 32
               : cpu_path_supported(CPU_PATH_SSE)  ? 16
                                                   : 0; /* only the scalar kernel, which never streams */
#endif
    (void)job;
    return 0;
}

static void fill_units(void *ctx, uint64_t first, uint64_t count)
{
    const struct floor_job *f = ctx;
    uint64_t begin, end;
    unit_range(f, first, count, &begin, &end);
    uint64_t lines = f->store_bytes ? (end - begin) / OUT_ALIGN * OUT_ALIGN : 0;
#if defined(__x86_64__) || defined(__i386__)
    if (f->store_bytes == 64)
        stream_fill_64(f->dst + begin, lines);
    else if (f->store_bytes == 32)
        stream_fill_32(f->dst + begin, lines);
    else if (f->store_bytes == 16)
        stream_fill_16(f->dst + begin, lines);
#endif
    memset(f->dst + begin + lines, 0x3c, end - begin - lines);
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) != 0)
            continue;
        char *colon = strchr(line, ':');
        if (colon) {
            colon += 1 + (colon[1] == ' ');
            colon[strcspn(colon, "\n")] = 0;
            snprintf(buf, len, "%s", colon);
        }
        break;
    }
    fclose(f);
}

static uint64_t next_random(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* What the path columns time: a dequantization, or a merge (merge set). */
struct bench_kernel {
    struct dequant_job *dequant;
    struct merge_job *merge;
};

static void run_kernel(const struct bench_kernel *k, int threads, enum cpu_path path)
{
    if (k->merge)
        merge_cpu_path(k->merge, threads, path);
    else
        dequant_cpu_path(k->dequant, threads, path);
}

static void set_output(const struct bench_kernel *k, void *out)
{
    if (k->merge)
        k->merge->out = out;
    else
        k->dequant->out = out;
}

/* The merge bench's job: a random bf16 base of n elements (w) and factors L
 * [rows, rank] and R [rank, cols] in fp32, scaling 2. */
static void fill_merge(struct merge_job *mj, const struct bench_cpu_opts *o, uint16_t *w, float *l, float *r,
                       uint64_t *rng)
{
    const uint64_t n = o->rows * o->cols;
    for (uint64_t i = 0; i < n; i++)
        w[i] = f32_to_bf16(((float)(next_random(rng) % 2001) - 1000.0f) * 1e-4f);
    for (uint64_t i = 0; i < o->rows * o->lora_rank; i++)
        l[i] = ((float)(next_random(rng) % 2001) - 1000.0f) * 1e-4f;
    for (uint64_t i = 0; i < (uint64_t)o->lora_rank * o->cols; i++)
        r[i] = ((float)(next_random(rng) % 2001) - 1000.0f) * 1e-4f;
    *mj = (struct merge_job){.w = w, .w_dtype = DT_BF16, .out_dtype = o->dtype, .n = n, .cols = o->cols,
                             .nfactors = 1};
    mj->f[0] = (struct merge_factor){.l = l, .l_row_stride = o->lora_rank, .l_k_stride = 1,
                                     .l_floats = o->rows * o->lora_rank, .r = r, .rank = o->lora_rank,
                                     .scaling = 2.0f};
}

/* Columns of the table: memcpy, the write floor, then every supported path. */
#define FLOOR_COLUMNS 2
#define MAX_COLUMNS (FLOOR_COLUMNS + CPU_PATH_COUNT)

int bench_cpu_run(const struct bench_cpu_opts *o)
{
    uint64_t n = o->rows * o->cols;
    uint64_t blocks = (n + BENCH_BLOCKSIZE - 1) / BENCH_BLOCKSIZE;
    uint64_t nested_blocks = (blocks + BENCH_NESTED_BLOCKSIZE - 1) / BENCH_NESTED_BLOCKSIZE;
    uint64_t out_bytes = n * (dtype_bits(o->dtype) / 8);
    uint64_t in_bytes = (n + 1) / 2 + blocks + nested_blocks * 4 + NESTED_CODE_ENTRIES * 4;
    unsigned char *packed = malloc((size_t)(n + 1) / 2), *codes = malloc((size_t)blocks);
    float *nested = malloc((size_t)nested_blocks * sizeof *nested);
    size_t out_alloc = ((size_t)out_bytes + OUT_ALIGN - 1) / OUT_ALIGN * OUT_ALIGN;
    unsigned char *out = aligned_alloc(OUT_ALIGN, out_alloc), *ref = aligned_alloc(OUT_ALIGN, out_alloc);
    float code_table[NESTED_CODE_ENTRIES];
    const uint64_t rank = o->lora_rank;
    uint16_t *merge_w = rank ? malloc((size_t)n * 2) : NULL;
    float *merge_l = rank ? malloc((size_t)(o->rows * rank) * sizeof(float)) : NULL;
    float *merge_r = rank ? malloc((size_t)(rank * o->cols) * sizeof(float)) : NULL;
    int rc = NF4_OK;
    if (!packed || !codes || !nested || !out || !ref || (rank && (!merge_w || !merge_l || !merge_r))) {
        rc = nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bench: out of memory for a %" PRIu64 "-element tensor", n);
        goto done;
    }
    uint64_t rng = 0x2545f4914f6cdd1dull;
    for (uint64_t i = 0; i < (n + 1) / 2; i++)
        packed[i] = (unsigned char)next_random(&rng);
    for (uint64_t i = 0; i < blocks; i++)
        codes[i] = (unsigned char)next_random(&rng);
    for (uint64_t i = 0; i < nested_blocks; i++)
        nested[i] = 0.01f + (float)(next_random(&rng) % 1000) * 1e-4f;
    for (unsigned i = 0; i < NESTED_CODE_ENTRIES; i++)
        code_table[i] = ((float)i - 127.5f) / 127.5f;
    struct dequant_job job = {
        .packed = packed,
        .absmax_code = codes,
        .nested_absmax = nested,
        .nested_code = code_table,
        .nested_offset = 0.0213f,
        .n = n,
        .blocksize = BENCH_BLOCKSIZE,
        .nested_blocksize = BENCH_NESTED_BLOCKSIZE,
        .quant_type = QUANT_NF4,
        .out_dtype = o->dtype,
        .out = ref,
    };
    struct merge_job mj;
    struct bench_kernel kernel = {&job, NULL};
    if (rank) {
        fill_merge(&mj, o, merge_w, merge_l, merge_r, &rng);
        kernel.merge = &mj;
        in_bytes = n * 2 + (o->rows + o->cols) * rank * sizeof(float);
    }

    enum cpu_path paths[CPU_PATH_COUNT];
    int npaths = 0;
    for (int p = 0; p < CPU_PATH_COUNT; p++)
        if (cpu_path_supported((enum cpu_path)p))
            paths[npaths++] = (enum cpu_path)p;

    int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1)
        cores = 1;
    int threads[BENCH_CPU_MAX_THREAD_COUNTS], nthreads = 0;
    if (o->n_thread_counts) {
        memcpy(threads, o->thread_counts, sizeof threads);
        nthreads = o->n_thread_counts;
    } else {
        for (int t = 1; t < cores && nthreads < BENCH_CPU_MAX_THREAD_COUNTS - 1; t *= 2)
            threads[nthreads++] = t;
        threads[nthreads++] = cores;
    }

    /* Every path must give the scalar bytes; this also faults the pages in. */
    int identical = 1;
    set_output(&kernel, ref);
    run_kernel(&kernel, cores, CPU_PATH_SCALAR);
    set_output(&kernel, out);
    for (int p = 0; p < npaths; p++) {
        memset(out, 0x5a, (size_t)out_bytes);
        run_kernel(&kernel, cores, paths[p]);
        if (memcmp(out, ref, (size_t)out_bytes) != 0) {
            identical = 0;
            rc = nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bench: the %s path's output differs from the scalar path's",
                          cpu_path_name(paths[p]));
        }
    }

    /* [thread count][column] medians in seconds; the runs interleave every
     * column and thread count, so drift hits them alike. */
    double med[BENCH_CPU_MAX_THREAD_COUNTS][MAX_COLUMNS];
    double *runs = malloc(sizeof(double) * (size_t)o->iters * BENCH_CPU_MAX_THREAD_COUNTS * MAX_COLUMNS);
    if (!runs) {
        rc = nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bench: out of memory");
        goto done;
    }
    /* Merges write through the cache: their floor is memset. */
    struct floor_job floors = {out, ref, out_bytes, rank ? 0 : fill_store_bytes(&job)};
    uint64_t copy_units_total = (out_bytes + COPY_UNIT_BYTES - 1) / COPY_UNIT_BYTES;
    for (int it = 0; it < o->iters; it++)
        for (int t = 0; t < nthreads; t++)
            for (int col = 0; col < FLOOR_COLUMNS + npaths; col++) {
                double t0 = now_seconds();
                if (col == 0)
                    parallel_for(copy_units_total, threads[t], 1, copy_units, &floors);
                else if (col == 1)
                    parallel_for(copy_units_total, threads[t], 1, fill_units, &floors);
                else
                    run_kernel(&kernel, threads[t], paths[col - FLOOR_COLUMNS]);
                runs[((size_t)t * MAX_COLUMNS + (size_t)col) * (size_t)o->iters + (size_t)it] = now_seconds() - t0;
            }
    for (int t = 0; t < nthreads; t++)
        for (int col = 0; col < FLOOR_COLUMNS + npaths; col++)
            med[t][col] = median(&runs[((size_t)t * MAX_COLUMNS + (size_t)col) * (size_t)o->iters], o->iters);
    free(runs);

    char model[256], date[32];
    cpu_model(model, sizeof model);
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", &tm);
    const char *dt = dtype_name(o->dtype);
    if (o->json) {
        printf("{\n  \"cpu\": \"%s\",\n  \"online_cores\": %d,\n  \"date\": \"%s\",\n  \"iters\": %d,\n"
               "  \"rows\": %" PRIu64 ",\n  \"cols\": %" PRIu64 ",\n  \"dtype\": \"%s\",\n  \"out_bytes\": %" PRIu64
               ",\n  \"in_bytes\": %" PRIu64 ",\n  \"lora_rank\": %" PRIu64 ",\n  \"identical\": %s,\n"
               "  \"streamed\": %s,\n  \"results\": [",
               model, cores, date, o->iters, o->rows, o->cols, dt, out_bytes, in_bytes, rank,
               identical ? "true" : "false", floors.store_bytes ? "true" : "false");
        for (int t = 0; t < nthreads; t++) {
            printf("%s\n    {\"threads\": %d, \"memcpy_gbps\": %.3f, \"write_floor_gbps\": %.3f", t ? "," : "",
                   threads[t], out_bytes / med[t][0] / 1e9, out_bytes / med[t][1] / 1e9);
            for (int p = 0; p < npaths; p++)
                printf(", \"%s_gbps\": %.3f", cpu_path_name(paths[p]),
                       out_bytes / med[t][p + FLOOR_COLUMNS] / 1e9);
            printf("}");
        }
        printf("\n  ]\n}\n");
    } else {
        printf("nf4deq bench --cpu: %s, %d online cores, %s, median of %d runs\n", model, cores, date, o->iters);
        if (rank)
            printf("%" PRIu64 "x%" PRIu64 " bf16 base + LoRA rank %" PRIu64 " (fp32 factors) -> %s: %.2f MB out, "
                   "%.2f MB in; GFLOP/s = GB/s x %.1f\n",
                   o->rows, o->cols, rank, dt, out_bytes / 1e6, in_bytes / 1e6, 2.0 * (double)rank * (double)n /
                   (double)out_bytes);
        else
            printf("%" PRIu64 "x%" PRIu64 " nf4 (blocksize %u, double quant) -> %s: %.2f MB out, %.2f MB in\n",
                   o->rows, o->cols, BENCH_BLOCKSIZE, dt, out_bytes / 1e6, in_bytes / 1e6);
        printf("GB/s of output; in brackets: x the scalar path, and the share of memcpy (%.2f MB copied)\n",
               out_bytes / 1e6);
        if (floors.store_bytes)
            printf("write: the output's size in %d-byte non-temporal stores, as the kernels stream it\n\n",
                   floors.store_bytes);
        else
            printf("write: memset of the output's size (the kernels write it through the cache)\n\n");
        printf("%-8s %12s %12s", "threads", "memcpy", "write");
        for (int p = 0; p < npaths; p++)
            printf(" %24s", cpu_path_name(paths[p]));
        printf("\n");
        for (int t = 0; t < nthreads; t++) {
            printf("%-8d %12.2f %12.2f", threads[t], out_bytes / med[t][0] / 1e9, out_bytes / med[t][1] / 1e9);
            for (int p = 0; p < npaths; p++) {
                const double path_s = med[t][p + FLOOR_COLUMNS], scalar_s = med[t][FLOOR_COLUMNS];
                char cell[64];
                snprintf(cell, sizeof cell, "%.2f (%.2fx, %3.0f%%)", out_bytes / path_s / 1e9, scalar_s / path_s,
                         100.0 * med[t][0] / path_s);
                printf(" %24s", cell);
            }
            printf("\n");
        }
        printf("\nidentical to the scalar path: %s; %s uses %s\n", identical ? "yes, every path" : "NO",
               rank ? "merge_cpu" : "dequant_cpu", cpu_path_name(cpu_path_active()));
        if (rank)
            printf("the merge's scalar and sse paths run its portable kernel; avx2 and avx512 their own\n");
    }
done:
    free(packed);
    free(codes);
    free(nested);
    free(out);
    free(ref);
    free(merge_w);
    free(merge_l);
    free(merge_r);
    return rc;
}
