/* The CPU merge: a chunk in column tiles, each tile's rows in groups of
 * MERGE_GROUP, each group in strips of MERGE_STRIP columns (merge_simd.h).
 *
 * R is read along k, one row of R per step, for all rows of the group. In the
 * tensor those rows lie `cols` floats apart, usually a multiple of 4 KiB, so
 * a strip's pieces of them fall into one set of the L1 cache and miss it at
 * every step. So each tile's strips of R are first copied into a panel,
 * strip after strip, k after k: the kernels then read it front to back, and
 * it stays in L2 (PANEL_FLOATS) while every row of the chunk passes over it.
 * A tile is as many strips as the panel holds, at most the row: for the
 * usual ranks (up to 32 for 4096 columns) one tile is the whole row, so the
 * base values and the output are read and written in order; wider tensors
 * or larger ranks take several tiles of a row. Where the factors' ranks
 * are too large for a panel of one strip (more than PANEL_FLOATS /
 * MERGE_STRIP in all), or there is no memory for it, the kernels read R in
 * place: slower, the same bytes. */
#include "merge_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fpconv.h"
#include "merge_simd.h"
#include "parallel.h"

#define MERGE_MIN_ROWS_PER_THREAD 16
#define PANEL_FLOATS 131072u /* 512 KiB of packed R per thread: it stays in L2 */

/* The values merge_range computes go to `out` (chunk-local, like j->out). */
struct merge_run {
    const struct merge_job *j;
    merge_block_fn block; /* NULL: strip_portable and the scalar finish throughout */
    void *out;
    enum st_dtype out_dtype;
    uint64_t first_row;
    uint64_t overflowed; /* atomic */
};

/* ---- the portable kernels ---- */

/* 4 floats: one SSE or NEON register. A wider GCC vector would not fit the
 * sums of a 4 x 8 block in SSE's sixteen registers, and GCC builds its splats
 * through the stack. */
typedef float v4f __attribute__((vector_size(16)));

/* Macros, not functions: a function returning v4f would change ABI between targets. */
#define LOAD4(dst, p) memcpy(&(dst), (p), sizeof(v4f))
#define SPLAT4(x) ((v4f){(x), (x), (x), (x)})

/* A strip's sums (merge_simd.h) for all MERGE_GROUP rows into acc, in GCC's
 * vector extension (SSE2 on x86-64, NEON on AArch64), a quarter of the strip
 * at a time. Every row pointer is read: a group of fewer rows repeats one. */
static void strip_portable(const float *r, uint64_t r_stride, const float *const l[MERGE_GROUP], uint64_t l_stride,
                           uint32_t rank, float acc[MERGE_GROUP][MERGE_STRIP])
{
    for (int q = 0; q < MERGE_STRIP; q += 8) {
        v4f a00 = SPLAT4(0.0f), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        const float *rk = r + q;
        for (uint32_t k = 0; k < rank; k++, rk += r_stride) {
            v4f r0, r1;
            LOAD4(r0, rk);
            LOAD4(r1, rk + 4);
            const uint64_t lk = (uint64_t)k * l_stride;
            const v4f b0 = SPLAT4(l[0][lk]), b1 = SPLAT4(l[1][lk]), b2 = SPLAT4(l[2][lk]), b3 = SPLAT4(l[3][lk]);
            a00 = a00 + b0 * r0;
            a01 = a01 + b0 * r1;
            a10 = a10 + b1 * r0;
            a11 = a11 + b1 * r1;
            a20 = a20 + b2 * r0;
            a21 = a21 + b2 * r1;
            a30 = a30 + b3 * r0;
            a31 = a31 + b3 * r1;
        }
        memcpy(&acc[0][q], &a00, 16);
        memcpy(&acc[0][q + 4], &a01, 16);
        memcpy(&acc[1][q], &a10, 16);
        memcpy(&acc[1][q + 4], &a11, 16);
        memcpy(&acc[2][q], &a20, 16);
        memcpy(&acc[2][q + 4], &a21, 16);
        memcpy(&acc[3][q], &a30, 16);
        memcpy(&acc[3][q + 4], &a31, 16);
    }
}

/* A strip of `width` < MERGE_STRIP columns where R ends, read in place. */
static void strip_scalar(const float *r, uint64_t r_stride, const float *const l[MERGE_GROUP], uint64_t l_stride,
                         uint32_t rank, int width, float acc[MERGE_GROUP][MERGE_STRIP])
{
    memset(acc, 0, sizeof(float) * MERGE_GROUP * MERGE_STRIP);
    for (uint32_t k = 0; k < rank; k++) {
        const float *rk = r + (uint64_t)k * r_stride;
        for (int g = 0; g < MERGE_GROUP; g++) {
            const float b = l[g][(uint64_t)k * l_stride];
            for (int c = 0; c < width; c++)
                acc[g][c] = acc[g][c] + b * rk[c];
        }
    }
}

/* A LoKr's products (merge_job.h) for rows [row, row + nrows) and columns
 * [c, c_end): each one product of W1's and W2's values, as torch.kron forms
 * it; a run of columns under one value of W1 at a time, which the compiler
 * makes vector code. Only the rows of the group are written. */
static void strip_kron(const struct merge_factor *f, uint64_t row, int nrows, uint64_t c, uint64_t c_end,
                       float acc[MERGE_GROUP][MERGE_STRIP])
{
    for (int g = 0; g < nrows; g++) {
        const uint64_t kr = row + (uint64_t)g + f->kron_row0;
        const float *w1 = f->kron_w1 + kr / f->kron_c * f->kron_b, *w2 = f->kron_w2 + kr % f->kron_c * f->kron_d;
        for (uint64_t col = c; col < c_end;) {
            const uint64_t m = col % f->kron_d, run = f->kron_d - m < c_end - col ? f->kron_d - m : c_end - col;
            const float x = w1[col / f->kron_d], *y = w2 + m;
            float *a = &acc[g][col - c];
            for (uint64_t q = 0; q < run; q++)
                a[q] = x * y[q];
            col += run;
        }
    }
}

/* The block kernel of `path`, where it names one this processor has. */
static merge_block_fn block_kernel(enum cpu_path path)
{
#if defined(__x86_64__) || defined(__i386__)
    if (path == CPU_PATH_AVX512 && cpu_path_supported(path))
        return merge_block_avx512;
    if (path == CPU_PATH_AVX2 && cpu_path_supported(path))
        return merge_block_avx2;
#else
    (void)path;
#endif
    return NULL;
}

static int vector_dtype(enum st_dtype dt)
{
    return dt == DT_BF16 || dt == DT_F16 || dt == DT_F32;
}

/* ---- the walk over a chunk ---- */

/* Columns [*cb, *ce) of `row` inside the chunk: all but in its first and last row. */
static void row_columns(const struct merge_job *j, uint64_t row, uint64_t *cb, uint64_t *ce)
{
    const uint64_t row_e = row * j->cols, end_e = j->e0 + j->n;
    *cb = row_e < j->e0 ? j->e0 - row_e : 0;
    *ce = row_e + j->cols > end_e ? end_e - row_e : j->cols;
}

/* Strips [s0, s1) of every factor's R into the panel: factor by factor, strip
 * by strip, k by k, MERGE_STRIP floats each, zeros past the last column. */
static void pack_panel(const struct merge_job *j, uint64_t s0, uint64_t s1, float *panel)
{
    for (size_t t = 0; t < j->nfactors; t++) {
        const struct merge_factor *f = &j->f[t];
        for (uint64_t s = s0; s < s1; s++) {
            const uint64_t c = s * MERGE_STRIP, width = j->cols - c < MERGE_STRIP ? j->cols - c : MERGE_STRIP;
            for (uint32_t k = 0; k < f->rank; k++, panel += MERGE_STRIP) {
                memcpy(panel, f->r + (uint64_t)k * j->cols + c, width * sizeof(float));
                memset(panel + width, 0, (MERGE_STRIP - width) * sizeof(float));
            }
        }
    }
}

/* out[i] = fp32(w[i]) + acc[0][i] * scaling[0] + ..., for i < count. Inlined
 * with constant dtypes, so the conversions' switches go. */
static inline __attribute__((always_inline)) uint64_t finish_run(const void *w, enum st_dtype w_dtype, void *out,
                                                                 enum st_dtype out_dtype, const float *const acc[],
                                                                 const float *scaling, size_t nfactors,
                                                                 uint64_t count)
{
    uint64_t overflowed = 0;
    for (uint64_t i = 0; i < count; i++) {
        float m = f32_from_element(w_dtype, w, i);
        for (size_t t = 0; t < nfactors; t++)
            m = m + acc[t][i] * scaling[t];
        overflowed += (uint64_t)f32_to_element(out_dtype, out, i, m);
    }
    return overflowed;
}

#define FINISH_PAIR(W, O) ((int)(W) * DT_COUNT + (int)(O))
#define FINISH_CASE(W, O)                                                                                       \
    case FINISH_PAIR(W, O):                                                                                   \
        return finish_run(w, W, out, O, acc, scaling, nfactors, count)

/* finish_run for count elements from w and out (pointing at the first). */
static uint64_t finish_scalar(const void *w, enum st_dtype w_dtype, void *out, enum st_dtype out_dtype,
                              const float *const acc[], const float *scaling, size_t nfactors, uint64_t count)
{
    switch (FINISH_PAIR(w_dtype, out_dtype)) {
        FINISH_CASE(DT_BF16, DT_BF16);
        FINISH_CASE(DT_BF16, DT_F16);
        FINISH_CASE(DT_BF16, DT_F32);
        FINISH_CASE(DT_F16, DT_BF16);
        FINISH_CASE(DT_F16, DT_F16);
        FINISH_CASE(DT_F16, DT_F32);
        FINISH_CASE(DT_F32, DT_BF16);
        FINISH_CASE(DT_F32, DT_F16);
        FINISH_CASE(DT_F32, DT_F32);
    default: return finish_run(w, w_dtype, out, out_dtype, acc, scaling, nfactors, count);
    }
}

/* Strips [s0, s1) of rows [row, row + nrows) (at most one row where the chunk
 * cuts it) one by one: each factor's sums by the strip kernel, then the
 * scalar finish of the columns inside the chunk. The path for the chunk's
 * cut rows and the tensor's last, narrower strip, and for the portable
 * kernels. */
static uint64_t strips_by_parts(const struct merge_run *run, const struct merge_block *b, uint64_t row,
                                uint64_t s0, uint64_t s1, uint64_t cb, uint64_t ce, int packed)
{
    const struct merge_job *j = run->j;
    const unsigned w_size = dtype_bits(j->w_dtype) / 8, out_size = dtype_bits(run->out_dtype) / 8;
    float acc[LORA_MAX_ADAPTERS][MERGE_GROUP][MERGE_STRIP] __attribute__((aligned(64)));
    uint64_t overflowed = 0;
    for (uint64_t s = s0; s < s1; s++) {
        const uint64_t c = s * MERGE_STRIP, c_end = c + MERGE_STRIP < j->cols ? c + MERGE_STRIP : j->cols;
        if (c_end <= cb || c >= ce)
            continue;
        for (size_t t = 0; t < j->nfactors; t++) {
            const float *r = b->r[t] + (s - s0) * b->r_strip[t];
            if (j->f[t].kron_w1)
                strip_kron(&j->f[t], row, b->nrows, c, c_end, acc[t]);
            else if (packed || c_end - c == MERGE_STRIP)
                strip_portable(r, b->r_stride[t], b->l[t], b->l_stride[t], b->rank[t], acc[t]);
            else
                strip_scalar(r, b->r_stride[t], b->l[t], b->l_stride[t], b->rank[t], (int)(c_end - c), acc[t]);
        }
        const uint64_t lo = c > cb ? c : cb, hi = c_end < ce ? c_end : ce;
        for (int g = 0; g < b->nrows; g++) {
            const uint64_t i = (row + (uint64_t)g) * j->cols + lo - j->e0;
            const float *accs[LORA_MAX_ADAPTERS];
            for (size_t t = 0; t < j->nfactors; t++)
                accs[t] = acc[t][g] + (lo - c);
            overflowed += finish_scalar((const char *)j->w + i * w_size, j->w_dtype, (char *)run->out + i * out_size,
                                        run->out_dtype, accs, b->scaling, j->nfactors, hi - lo);
        }
    }
    return overflowed;
}

static uint64_t sum_of_ranks(const struct merge_job *j)
{
    uint64_t sum = 0;
    for (size_t t = 0; t < j->nfactors; t++)
        sum += j->f[t].rank;
    return sum;
}

/* Merges rows [row_a, row_b) of the chunk into run->out. */
static uint64_t merge_range(const struct merge_run *run, uint64_t row_a, uint64_t row_b)
{
    const struct merge_job *j = run->j;
    const uint64_t strips = (j->cols + MERGE_STRIP - 1) / MERGE_STRIP, ranks = sum_of_ranks(j);
    /* A column tile: as many strips as the panel holds, at most the row. */
    uint64_t tile = PANEL_FLOATS / MERGE_STRIP / (ranks ? ranks : 1);
    tile = tile < strips ? tile : strips;
    float *panel = tile ? malloc(tile * MERGE_STRIP * ranks * sizeof(float)) : NULL;
    const int packed = panel != NULL;
    if (!packed) /* R in place: too large for a panel, or no memory for one */
        tile = strips;
    /* The block kernels know only L @ R: a LoKr's products go strip by strip. */
    const int vector_block = run->block && vector_dtype(j->w_dtype) && vector_dtype(run->out_dtype) &&
                             !merge_job_has_kron(j->f, j->nfactors);
    const unsigned w_size = dtype_bits(j->w_dtype) / 8, out_size = dtype_bits(run->out_dtype) / 8;
    uint64_t overflowed = 0;

    for (uint64_t s0 = 0; s0 < strips; s0 += tile) {
        const uint64_t s1 = s0 + tile < strips ? s0 + tile : strips;
        if (packed)
            pack_panel(j, s0, s1, panel);
        for (uint64_t row = row_a; row < row_b;) {
            uint64_t cb, ce;
            row_columns(j, row, &cb, &ce);
            int nrows = 1;
            if (cb == 0 && ce == j->cols) /* gather following full rows */
                while (nrows < MERGE_GROUP && row + (uint64_t)nrows < row_b) {
                    uint64_t nb, ne;
                    row_columns(j, row + (uint64_t)nrows, &nb, &ne);
                    if (nb != 0 || ne != j->cols)
                        break;
                    nrows++;
                }
            /* Each factor's R from strip s0 (in the panel, or in place) and the group's rows of L. */
            struct merge_block b = {.nfactors = j->nfactors, .nrows = nrows};
            const float *panel_at = panel;
            for (size_t t = 0; t < j->nfactors; t++) {
                const struct merge_factor *f = &j->f[t];
                b.r[t] = packed ? panel_at : f->r + s0 * MERGE_STRIP;
                b.r_stride[t] = packed ? MERGE_STRIP : j->cols;
                b.r_strip[t] = packed ? (uint64_t)f->rank * MERGE_STRIP : MERGE_STRIP;
                for (int g = 0; g < MERGE_GROUP; g++)
                    b.l[t][g] = f->l + (row + (uint64_t)(g < nrows ? g : 0) - f->l_row0) * f->l_row_stride;
                b.l_stride[t] = f->l_k_stride;
                b.rank[t] = f->rank;
                b.scaling[t] = f->scaling;
                if (packed)
                    panel_at += (s1 - s0) * f->rank * MERGE_STRIP;
            }
            /* The strips wholly inside the chunk and the tensor go to the block kernel. */
            uint64_t sa = (cb + MERGE_STRIP - 1) / MERGE_STRIP, sb = ce / MERGE_STRIP;
            sa = sa > s0 ? sa : s0;
            sb = sb < s1 ? sb : s1;
            if (!vector_block || sa >= sb) {
                overflowed += strips_by_parts(run, &b, row, s0, s1, cb, ce, packed);
            } else {
                overflowed += strips_by_parts(run, &b, row, s0, sa, cb, ce, packed);
                struct merge_block whole = b;
                whole.nstrips = sb - sa;
                whole.w_dtype = j->w_dtype;
                whole.out_dtype = run->out_dtype;
                for (size_t t = 0; t < j->nfactors; t++)
                    whole.r[t] = b.r[t] + (sa - s0) * b.r_strip[t];
                for (int g = 0; g < nrows; g++) {
                    const uint64_t i = (row + (uint64_t)g) * j->cols + sa * MERGE_STRIP - j->e0;
                    whole.w[g] = (const char *)j->w + i * w_size;
                    whole.out[g] = (char *)run->out + i * out_size;
                }
                overflowed += run->block(&whole);
                for (size_t t = 0; t < j->nfactors; t++)
                    b.r[t] = b.r[t] + (sb - s0) * b.r_strip[t];
                overflowed += strips_by_parts(run, &b, row, sb, s1, cb, ce, packed);
            }
            row += (uint64_t)nrows;
        }
    }
    free(panel);
    return overflowed;
}

/* ---- DoRA ---- */

/* The sum of squares DORA_NORM_LANES describes, of one held row, as fp32.
 * Whole runs of DORA_NORM_LANES columns first, a fixed-length inner loop the
 * compiler turns into vector code; each lane still adds its columns in order. */
static float row_norm(const float *m, uint64_t cols)
{
    double partial[DORA_NORM_LANES] = {0};
    uint64_t c = 0;
    for (; c + DORA_NORM_LANES <= cols; c += DORA_NORM_LANES)
        for (int i = 0; i < DORA_NORM_LANES; i++) {
            const double v = m[c + (uint64_t)i];
            partial[i] = partial[i] + v * v;
        }
    for (; c < cols; c++) {
        const double v = m[c];
        partial[c % DORA_NORM_LANES] = partial[c % DORA_NORM_LANES] + v * v;
    }
    for (int h = DORA_NORM_LANES / 2; h > 0; h /= 2)
        for (int i = 0; i < h; i++)
            partial[i] = partial[i] + partial[i + h];
    return (float)sqrt(partial[0]);
}

/* out[i] = factor * m[i], rounded into out_dtype, for i < count. Inlined with
 * a constant dtype, so the conversion's switch goes. */
static inline __attribute__((always_inline)) uint64_t scale_run(enum st_dtype out_dtype, void *out, const float *m,
                                                                float factor, uint64_t count)
{
    uint64_t overflowed = 0;
    for (uint64_t i = 0; i < count; i++)
        overflowed += (uint64_t)f32_to_element(out_dtype, out, i, factor * m[i]);
    return overflowed;
}

static uint64_t scale_row(enum st_dtype out_dtype, void *out, const float *m, float factor, uint64_t count)
{
    switch (out_dtype) {
    case DT_BF16: return scale_run(DT_BF16, out, m, factor, count);
    case DT_F16: return scale_run(DT_F16, out, m, factor, count);
    default: return scale_run(out_dtype, out, m, factor, count);
    }
}

/* DoRA: whole rows [row_a, row_b), merged in fp32 into j->dora_rows, then each
 * scaled by its magnitude over its L2 norm (the fp32 rounding of the fp64
 * norm, as PEFT's norm is fp32); the factor and the product are fp32,
 * rounded once to the output dtype. */
static uint64_t merge_dora_range(const struct merge_run *run, uint64_t row_a, uint64_t row_b)
{
    const struct merge_job *j = run->j;
    /* Not a copy of *run: other threads add to its count meanwhile. */
    const struct merge_run held = {
        .j = j, .block = run->block, .out = j->dora_rows, .out_dtype = DT_F32, .first_row = run->first_row};
    merge_range(&held, row_a, row_b);
    const unsigned out_size = dtype_bits(j->out_dtype) / 8;
    uint64_t overflowed = 0;
    for (uint64_t row = row_a; row < row_b; row++) {
        const uint64_t first = row * j->cols - j->e0;
        const float *m = j->dora_rows + first;
        const float factor = j->magnitude[row - j->e0 / j->cols] / row_norm(m, j->cols);
        overflowed += scale_row(j->out_dtype, (char *)j->out + first * out_size, m, factor, j->cols);
    }
    return overflowed;
}

/* parallel_for's unit is a row the chunk touches. */
static void merge_row_range(void *ctx, uint64_t first, uint64_t count)
{
    struct merge_run *run = ctx;
    const uint64_t row_a = run->first_row + first, row_b = row_a + count;
    uint64_t overflowed = run->j->magnitude ? merge_dora_range(run, row_a, row_b) : merge_range(run, row_a, row_b);
    __atomic_add_fetch(&run->overflowed, overflowed, __ATOMIC_RELAXED);
}

uint64_t merge_cpu_path(const struct merge_job *j, int threads, enum cpu_path path)
{
    if (j->n == 0)
        return 0;
    struct merge_run run = {.j = j,
                            .block = block_kernel(path),
                            .out = j->out,
                            .out_dtype = j->out_dtype,
                            .first_row = j->e0 / j->cols};
    uint64_t rows = (j->e0 + j->n - 1) / j->cols - run.first_row + 1;
    parallel_for(rows, threads, MERGE_MIN_ROWS_PER_THREAD, merge_row_range, &run);
    return run.overflowed;
}

uint64_t merge_cpu(const struct merge_job *j, int threads)
{
    return merge_cpu_path(j, threads, cpu_path_active());
}
