/* The synthetic sweep every CPU merge path must pass byte for byte against a
 * plain reference of the arithmetic src/lora_merge.h states: one to three
 * factors of ranks from 1 to past the panel (R then read in place), with and
 * without fan_in_fan_out, DoRA rows, chunks that start and end inside a row,
 * odd widths (strips cut by the last column), several column tiles, every
 * base and output dtype, one thread and three (on enough rows for three row
 * ranges), and values that reach the corners (NaN, infinities, subnormals,
 * sums that overflow fp16 or bf16, which the count must see, and the least
 * values that do, passed through unchanged where a scaling is 0); LoKr
 * factors (a Kronecker product from a row offset) among them.
 * Plain C, no test framework: the host CMocka test and the AArch64 cross
 * test (tests/cross) both run it. */
#ifndef NF4DEQ_MERGE_SWEEP_H
#define NF4DEQ_MERGE_SWEEP_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_path.h"
#include "cpu_sweep.h" /* sweep_rand, SWEEP_GUARD */
#include "fpconv.h"
#include "merge_cpu.h"

#define MERGE_SWEEP_POISON 0xa5

/* Mostly small values of either sign; one in `corner_odds` a corner. */
static float merge_sweep_value(uint64_t *rng, unsigned corner_odds)
{
    static const uint32_t CORNERS[] = {
        0x7fc00000, 0xffc00001, 0x7f800000, 0xff800000, /* NaNs, infinities */
        0x00000000, 0x80000000, 0x00000001, 0x807fffff, /* zeros, subnormals */
        0x7f7fffff, 0xff7f0000, 0x477fe000, 0xc7000000, /* near bf16's and fp16's largest */
        0x7f7f8000, 0xff7f7fff, 0x477ff000, 0xc77fefff, /* the least that round to inf, and just under */
        0x3f800000, 0x38800000, 0x33800000,             /* 1, fp16's smallest normal and subnormal */
    };
    uint64_t x = sweep_rand(rng);
    if (corner_odds && x % corner_odds == 0)
        return f32_from_bits(CORNERS[(x >> 8) % (sizeof CORNERS / sizeof CORNERS[0])]);
    return ((float)((x >> 16) % 20001) - 10000.0f) * 1e-4f;
}

/* Stores v as element i of an array of dt (F64 keeps it exactly). */
static void merge_sweep_put(enum st_dtype dt, void *p, uint64_t i, float v)
{
    switch (dt) {
    case DT_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
    case DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case DT_F64: ((double *)p)[i] = v; break;
    default: ((float *)p)[i] = v; break;
    }
}

/* m of chunk element i, as src/lora_merge.h states it, one element at a time. */
static float merge_sweep_merged(const struct merge_job *j, uint64_t i)
{
    const uint64_t e = j->e0 + i, row = e / j->cols, col = e % j->cols;
    float m = f32_from_element(j->w_dtype, j->w, i);
    for (size_t t = 0; t < j->nfactors; t++) {
        const struct merge_factor *f = &j->f[t];
        float acc = 0.0f;
        if (f->kron_w1) { /* a LoKr: one product */
            const uint64_t kr = row + f->kron_row0;
            acc = f->kron_w1[kr / f->kron_c * f->kron_b + col / f->kron_d] *
                  f->kron_w2[kr % f->kron_c * f->kron_d + col % f->kron_d];
        }
        for (uint64_t k = 0; k < f->rank; k++)
            acc = acc + f->l[(row - f->l_row0) * f->l_row_stride + k * f->l_k_stride] * f->r[k * j->cols + col];
        m = m + acc * f->scaling;
    }
    return m;
}

/* The reference output of the job into out; returns the overflow count. */
static uint64_t merge_sweep_reference(const struct merge_job *j, void *out)
{
    uint64_t overflowed = 0;
    if (!j->magnitude) {
        for (uint64_t i = 0; i < j->n; i++)
            overflowed += (uint64_t)f32_to_element(j->out_dtype, out, i, merge_sweep_merged(j, i));
        return overflowed;
    }
    for (uint64_t first = 0; first < j->n; first += j->cols) { /* DoRA: whole rows */
        double lane[DORA_NORM_LANES] = {0};
        for (uint64_t c = 0; c < j->cols; c++) {
            const double v = merge_sweep_merged(j, first + c);
            lane[c % DORA_NORM_LANES] += v * v;
        }
        for (int h = DORA_NORM_LANES / 2; h > 0; h /= 2)
            for (int x = 0; x < h; x++)
                lane[x] += lane[x + h];
        const float factor = j->magnitude[first / j->cols] / (float)sqrt(lane[0]);
        for (uint64_t c = 0; c < j->cols; c++)
            overflowed +=
                (uint64_t)f32_to_element(j->out_dtype, out, first + c, factor * merge_sweep_merged(j, first + c));
    }
    return overflowed;
}

/* One random job of the sweep, case number `index`, run on `path` and against
 * the reference. Returns 1 on a mismatch (said on `log`). Kinds of case, by
 * index: every 23rd (5 mod 23) ranks past the panel, R read in place; every
 * 11th (7 mod 11) ranks of 150-300 on 1000 or 4097 columns, so several column
 * tiles and a last strip cut short; every 5th (2 mod 5) 40-90 rows, enough
 * for three threads' row ranges. */
static int merge_sweep_case(enum cpu_path path, uint64_t index, FILE *log)
{
    static const uint64_t COLS[] = {1, 7, 31, 32, 33, 64, 95, 160, 257, 4096};
    static const uint64_t WIDE_COLS[] = {1000, 4097};
    static const uint32_t RANKS[] = {1, 2, 5, 8, 16, 64};
    static const enum st_dtype W_DTYPES[] = {DT_BF16, DT_F16, DT_F32, DT_F64};
    static const enum st_dtype OUT_DTYPES[] = {DT_BF16, DT_F16, DT_F32};
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ (index * 0x2545f4914f6cdd1dull);
    sweep_rand(&rng);
    const int wide = index % 11 == 7, tall = index % 5 == 2 && !wide;
    const uint64_t cols = wide ? WIDE_COLS[(index / 11) % 2] : COLS[index % (sizeof COLS / sizeof COLS[0])];
    const int dora = index % 7 == 3, huge_rank = index % 23 == 5 && cols < 1000;
    const uint64_t rows = wide ? 1 + sweep_rand(&rng) % 6
                          : tall ? 40 + sweep_rand(&rng) % (cols > 1000 ? 11 : 51)
                                 : 1 + sweep_rand(&rng) % (cols > 1000 ? 6 : 20);
    /* The chunk: whole rows for DoRA, else any run of elements. */
    uint64_t e0, n;
    if (tall && dora) { /* nearly every row, for several row ranges */
        e0 = sweep_rand(&rng) % 3 * cols;
        n = rows * cols - e0;
    } else if (tall) { /* cut inside the first and the last row */
        e0 = sweep_rand(&rng) % cols;
        n = rows * cols - e0 - sweep_rand(&rng) % cols;
    } else if (dora) {
        const uint64_t r0 = sweep_rand(&rng) % rows;
        e0 = r0 * cols;
        n = (1 + sweep_rand(&rng) % (rows - r0)) * cols;
    } else {
        e0 = sweep_rand(&rng) % (rows * cols);
        n = 1 + sweep_rand(&rng) % (rows * cols - e0);
    }
    const uint64_t first_row = e0 / cols, last_row = (e0 + n - 1) / cols, span = last_row - first_row + 1;
    struct merge_job j;
    memset(&j, 0, sizeof j);
    j.w_dtype = W_DTYPES[sweep_rand(&rng) % 4];
    j.out_dtype = OUT_DTYPES[sweep_rand(&rng) % 3];
    j.e0 = e0;
    j.n = n;
    j.cols = cols;
    j.nfactors = dora ? 1 : 1 + (size_t)(sweep_rand(&rng) % 3);
    const unsigned corner_odds = index % 3 == 0 ? 40 : 0;
    float *owned[LORA_MAX_ADAPTERS * 4 + 2] = {0};
    size_t nowned = 0;
    for (size_t t = 0; t < j.nfactors; t++) {
        struct merge_factor *f = &j.f[t];
        f->rank = huge_rank ? 4100 + (uint32_t)t
                  : wide    ? 150 + (uint32_t)(sweep_rand(&rng) % 151)
                            : RANKS[sweep_rand(&rng) % 6];
        /* Now and then 0, so the base's corners reach the output unchanged. */
        const uint64_t pick = sweep_rand(&rng) % 8;
        f->scaling = pick == 0 ? 1e4f : pick == 1 ? 0.0f : (float)(sweep_rand(&rng) % 64) / 16.0f + 0.25f;
        const int fan_in_fan_out = sweep_rand(&rng) % 2;
        f->l_row0 = first_row;
        f->l_row_stride = fan_in_fan_out ? 1 : f->rank;
        f->l_k_stride = fan_in_fan_out ? span : 1;
        f->l_floats = span * f->rank;
        float *l = malloc(f->l_floats * sizeof(float)), *r = malloc(f->rank * cols * sizeof(float));
        for (uint64_t x = 0; x < f->l_floats; x++)
            l[x] = merge_sweep_value(&rng, corner_odds * 4);
        for (uint64_t x = 0; x < f->rank * cols; x++)
            r[x] = merge_sweep_value(&rng, corner_odds * 4);
        f->l = owned[nowned++] = l;
        f->r = owned[nowned++] = r;
        if (!dora && (index + t) % 4 == 1) { /* a LoKr's instead, beside the others (merge_job.h) */
            uint64_t d = 1 + sweep_rand(&rng) % cols;
            while (cols % d)
                d--;
            f->kron_d = d;
            f->kron_b = cols / d;
            f->kron_c = 1 + sweep_rand(&rng) % 7;
            f->kron_row0 = sweep_rand(&rng) % 6; /* a part of a fused projection's rows */
            const uint64_t a = (rows + f->kron_row0 + f->kron_c - 1) / f->kron_c;
            float *w1 = malloc(a * f->kron_b * sizeof(float)), *w2 = malloc(f->kron_c * d * sizeof(float));
            for (uint64_t x = 0; x < a * f->kron_b; x++)
                w1[x] = merge_sweep_value(&rng, corner_odds * 4);
            for (uint64_t x = 0; x < f->kron_c * d; x++)
                w2[x] = merge_sweep_value(&rng, corner_odds * 4);
            f->kron_w1 = owned[nowned++] = w1;
            f->kron_w2 = owned[nowned++] = w2;
            f->rank = 0;
        }
    }
    const unsigned w_size = dtype_bits(j.w_dtype) / 8, out_size = dtype_bits(j.out_dtype) / 8;
    void *w = malloc(n * w_size);
    for (uint64_t i = 0; i < n; i++)
        merge_sweep_put(j.w_dtype, w, i, merge_sweep_value(&rng, corner_odds));
    j.w = w;
    if (dora) {
        float *mag = malloc(span * sizeof(float));
        for (uint64_t x = 0; x < span; x++)
            mag[x] = merge_sweep_value(&rng, corner_odds);
        j.magnitude = owned[nowned++] = mag;
        j.dora_rows = owned[nowned++] = malloc(n * sizeof(float));
    }
    /* SWEEP_GUARD bytes before and after the output, which no path may touch. */
    unsigned char *guarded = malloc(n * out_size + 2 * SWEEP_GUARD), *want = malloc(n * out_size);
    unsigned char *got = guarded + SWEEP_GUARD;
    memset(guarded, MERGE_SWEEP_POISON, n * out_size + 2 * SWEEP_GUARD);
    j.out = got;
    const int threads = tall || index % 2 ? 3 : 1;
    const uint64_t over_got = merge_cpu_path(&j, threads, path), over_want = merge_sweep_reference(&j, want);

    int failed = 0;
    for (uint64_t i = 0; i < n && !failed; i++)
        if (memcmp(got + i * out_size, want + i * out_size, out_size) != 0) {
            uint32_t g = 0, x = 0;
            memcpy(&g, got + i * out_size, out_size);
            memcpy(&x, want + i * out_size, out_size);
            fprintf(log,
                    "merge case %llu (%s): element %llu of [%llu, +%llu), %llu columns, %zu factors%s, %s -> %s, "
                    "%d threads: 0x%x, want 0x%x\n",
                    (unsigned long long)index, cpu_path_name(path), (unsigned long long)i, (unsigned long long)e0,
                    (unsigned long long)n, (unsigned long long)cols, j.nfactors, dora ? " (DoRA)" : "",
                    dtype_name(j.w_dtype), dtype_name(j.out_dtype), threads, g, x);
            failed = 1;
        }
    for (unsigned x = 0; x < SWEEP_GUARD && !failed; x++)
        if (got[n * out_size + x] != MERGE_SWEEP_POISON || guarded[x] != MERGE_SWEEP_POISON) {
            fprintf(log, "merge case %llu (%s): wrote outside the output\n", (unsigned long long)index,
                    cpu_path_name(path));
            failed = 1;
        }
    if (!failed && over_got != over_want) {
        fprintf(log, "merge case %llu (%s): %llu values overflowed, want %llu\n", (unsigned long long)index,
                cpu_path_name(path), (unsigned long long)over_got, (unsigned long long)over_want);
        failed = 1;
    }
    for (size_t x = 0; x < nowned; x++)
        free(owned[x]);
    free(w);
    free(guarded);
    free(want);
    return failed;
}

#define MERGE_SWEEP_CASES 600u

/* Runs the sweep on `path`: the number of failed cases; *cases counts them all. */
static int merge_sweep_path(enum cpu_path path, FILE *log, int *cases)
{
    int failed = 0;
    for (uint64_t index = 0; index < MERGE_SWEEP_CASES; index++) {
        failed += merge_sweep_case(path, index, log);
        ++*cases;
    }
    return failed;
}

#endif
