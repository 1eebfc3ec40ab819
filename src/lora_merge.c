#include "lora_merge.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fpconv.h"
#include "parallel.h"
#include "status.h"

#define MERGE_TILE 256 /* columns per tile: MERGE_ROWS x MERGE_TILE floats stay in L1 */
#define MERGE_ROWS 4   /* full rows per tile: each R load feeds four rows */
#define MERGE_MIN_ROWS_PER_THREAD 16

/* ---- reading the factors ---- */

/* Floats of L a chunk over rows [first_row, last_row] carries: the rows of B it
 * touches, or those columns of A with fan_in_fan_out. */
static uint64_t l_floats(const struct lora_term *t, uint64_t first_row, uint64_t last_row)
{
    return (last_row - first_row + 1) * t->r;
}

/* Bytes of `nrows` trained token rows of `cols`: the row numbers, then the values in fp32. */
static uint64_t token_bytes(uint64_t nrows, uint64_t cols)
{
    return nrows * (sizeof(uint64_t) + cols * sizeof(float));
}

/* The factors' part of merge_factor_bytes. */
static uint64_t factor_bytes(const struct lora_target *t, uint64_t e0, uint64_t n)
{
    uint64_t first_row = e0 / t->cols, last_row = (e0 + (n ? n : 1) - 1) / t->cols, floats = 0;
    for (size_t i = 0; i < t->nterms; i++) {
        const struct lora_term *x = &t->terms[i];
        floats += l_floats(x, first_row, last_row) + (uint64_t)x->r * t->cols;
        if (x->magnitude) /* and the merged rows, held for the rescale */
            floats += last_row - first_row + 1 + n;
        if (x->fan_in_fan_out) /* B is read whole, then transposed into R */
            floats += (uint64_t)x->r * t->cols;
    }
    return floats * 4;
}

uint64_t merge_factor_bytes(const struct lora_target *t, uint64_t e0, uint64_t n)
{
    uint64_t bytes = factor_bytes(t, e0, n);
    if (t->tokens) {
        uint64_t begin, end;
        token_rows_between(t->tokens, e0 / t->cols, (e0 + (n ? n : 1) - 1) / t->cols, &begin, &end);
        bytes += token_bytes(end - begin, t->cols);
    }
    return bytes;
}

uint64_t merge_factor_bytes_max(const struct lora_target *t, uint64_t n)
{
    /* The most rows n elements can touch: n / cols + 2 (a partial row at each end). */
    uint64_t span_rows = n / t->cols + 2, span = span_rows * t->cols;
    uint64_t bytes = factor_bytes(t, 0, span < t->rows * t->cols ? span : t->rows * t->cols);
    if (t->tokens)
        bytes += token_bytes(t->tokens->n < span_rows ? t->tokens->n : span_rows, t->cols);
    return bytes;
}

/* Reads `count` elements from element `first` of an F32, BF16 or F16 tensor
 * into fp32. The raw values land at the end of dst and widen front to back:
 * each is read before the wider value written over its bytes. */
static int read_f32(const struct model_tensor *mt, uint64_t first, uint64_t count, float *dst)
{
    unsigned size = dtype_bits(mt->t->dtype) / 8;
    unsigned char *raw = (unsigned char *)dst + count * (4 - size);
    int code = st_read(mt->file, mt->t, first * size, raw, count * size);
    if (code != NF4_OK || size == 4)
        return code;
    for (uint64_t i = 0; i < count; i++) {
        uint16_t h;
        memcpy(&h, raw + 2 * i, 2);
        dst[i] = mt->t->dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    return NF4_OK;
}

/* The trained token rows of t in rows [first_row, last_row], from buf (8-byte
 * aligned): their row numbers, then their values in fp32. Returns where
 * the factors go. */
static int read_token_rows(struct merge_job *j, const struct lora_target *t, uint64_t first_row, uint64_t last_row,
                           void *buf, float **after)
{
    j->ntok = 0;
    j->tok_row = NULL;
    j->tok_values = NULL;
    *after = buf;
    if (!t->tokens)
        return NF4_OK;
    const struct token_rows *tr = t->tokens;
    uint64_t begin, end;
    token_rows_between(tr, first_row, last_row, &begin, &end);
    uint64_t *rows = buf;
    float *values = (float *)(rows + (end - begin));
    for (uint64_t k = 0; k < end - begin; k++) {
        rows[k] = tr->row[begin + k];
        int code = read_f32(tr->values, tr->src[begin + k] * t->cols, t->cols, values + k * t->cols);
        if (code != NF4_OK)
            return code;
    }
    j->ntok = end - begin;
    j->tok_row = rows;
    j->tok_values = values;
    j->tok_dtype = tr->round_to;
    *after = values + (end - begin) * t->cols;
    return NF4_OK;
}

int merge_read_factors(struct merge_job *j, const struct lora_target *t, uint64_t e0, uint64_t n, void *buf)
{
    float *at;
    uint64_t first_row = e0 / t->cols, last_row = (e0 + (n ? n : 1) - 1) / t->cols;
    int code = read_token_rows(j, t, first_row, last_row, buf, &at);
    if (code != NF4_OK)
        return code;
    j->e0 = e0;
    j->n = n;
    j->cols = t->cols;
    j->nfactors = t->nterms;
    j->magnitude = NULL;
    j->dora_rows = NULL;
    for (size_t i = 0; i < t->nterms; i++) {
        const struct lora_term *x = &t->terms[i];
        struct merge_factor *f = &j->f[i];
        uint64_t r_floats = (uint64_t)x->r * t->cols, l_count = l_floats(x, first_row, last_row);
        *f = (struct merge_factor){.rank = x->r, .scaling = x->scaling};
        if (!x->fan_in_fan_out) {
            /* L = B [rows, r]: only the rows this chunk touches. R = A [r, cols]. */
            f->l = at;
            f->l_row0 = first_row;
            f->l_row_stride = x->r;
            f->l_k_stride = 1;
            f->l_floats = l_count;
            if ((code = read_f32(x->b, first_row * x->r, l_count, at)) != NF4_OK)
                return code;
            at += l_count;
            f->r = at;
            if ((code = read_f32(x->a, 0, r_floats, at)) != NF4_OK)
                return code;
            at += r_floats;
        } else {
            /* L(row, k) = A[k, row]: A is [r, rows], of which the columns this
             * chunk touches, one run per k (a vocabulary-wide A would not fit a
             * slot). R(k, col) = B[col, k]: B is [cols, r]. */
            uint64_t span = last_row - first_row + 1;
            f->l = at;
            f->l_row0 = first_row;
            f->l_row_stride = 1;
            f->l_k_stride = span;
            f->l_floats = l_count;
            for (uint32_t k = 0; k < x->r; k++)
                if ((code = read_f32(x->a, (uint64_t)k * t->rows + first_row, span, at + (uint64_t)k * span)) != NF4_OK)
                    return code;
            at += l_count;
            float *r = at, *b = at + r_floats;
            if ((code = read_f32(x->b, 0, r_floats, b)) != NF4_OK)
                return code;
            for (uint64_t c = 0; c < t->cols; c++)
                for (uint32_t k = 0; k < x->r; k++)
                    r[k * t->cols + c] = b[c * x->r + k];
            f->r = r;
            at += 2 * r_floats;
        }
        if (x->magnitude) {
            /* Whole rows: the planner cuts a DoRA tensor at row boundaries. */
            if (t->nterms != 1 || e0 % t->cols != 0 || n % t->cols != 0)
                return nf4_fail(NF4_ESOFTWARE, x->magnitude->file->path, t->name,
                                "a DoRA chunk that is not whole rows (internal error)");
            if ((code = read_f32(x->magnitude, first_row, last_row - first_row + 1, at)) != NF4_OK)
                return code;
            j->magnitude = at;
            at += last_row - first_row + 1;
            j->dora_rows = at;
            at += n;
        }
    }
    return NF4_OK;
}

/* ---- the arithmetic ---- */

/* Stores m; returns 1 if a finite value became infinite. */
static int store_value(void *p, enum st_dtype dt, uint64_t i, float m)
{
    uint32_t bits;
    switch (dt) {
    case DT_F16:
        bits = f32_to_f16(m);
        ((uint16_t *)p)[i] = (uint16_t)bits;
        return (bits & 0x7fffu) == 0x7c00u && isfinite(m);
    case DT_BF16:
        bits = f32_to_bf16(m);
        ((uint16_t *)p)[i] = (uint16_t)bits;
        return (bits & 0x7fffu) == 0x7f80u && isfinite(m);
    default:
        bits = f32_canonical_bits(m);
        memcpy((float *)p + i, &bits, 4);
        return 0;
    }
}

/* 8 floats: GCC and Clang lower it to one AVX register in the avx2 clone and
 * to two SSE registers otherwise. */
typedef float v8f __attribute__((vector_size(32)));
#define STRIP 16 /* columns one register block covers: 2 vectors x MERGE_ROWS rows = 8 accumulators */

/* Macros, not functions: a function returning v8f would change ABI between the clones. */
#define LOAD8(dst, p) memcpy(&(dst), (p), sizeof(v8f))
#define SPLAT8(x) ((v8f){(x), (x), (x), (x), (x), (x), (x), (x)})

/* acc[rr][c] = sum over k of L(row + rr, k) * R(k, c0 + c), k ascending, for
 * nrows rows. Each element sees the same multiplies and adds in the same order
 * on every path (separate roundings: the build has -ffp-contract=off), so the
 * register-blocked strips and the scalar edges agree bit for bit. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static void delta_tile(const struct merge_factor *f, uint64_t cols, uint64_t row, int nrows, uint64_t c0,
                       int width, float acc[MERGE_ROWS][MERGE_TILE])
{
    const float *l[MERGE_ROWS];
    for (int rr = 0; rr < nrows; rr++)
        l[rr] = f->l + (row + rr - f->l_row0) * f->l_row_stride;
    const uint64_t ks = f->l_k_stride;
    int c = 0;
    if (nrows == MERGE_ROWS) {
        /* Register-blocked: 4 rows x 16 columns stay in registers for all k;
         * each R load serves four rows. */
        for (; c + STRIP <= width; c += STRIP) {
            v8f a00 = SPLAT8(0.0f), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
            const float *rk = f->r + c0 + (uint64_t)c;
            for (uint32_t k = 0; k < f->rank; k++, rk += cols) {
                v8f r0, r1;
                LOAD8(r0, rk);
                LOAD8(r1, rk + 8);
                const v8f b0 = SPLAT8(l[0][k * ks]), b1 = SPLAT8(l[1][k * ks]);
                const v8f b2 = SPLAT8(l[2][k * ks]), b3 = SPLAT8(l[3][k * ks]);
                a00 = a00 + b0 * r0;
                a01 = a01 + b0 * r1;
                a10 = a10 + b1 * r0;
                a11 = a11 + b1 * r1;
                a20 = a20 + b2 * r0;
                a21 = a21 + b2 * r1;
                a30 = a30 + b3 * r0;
                a31 = a31 + b3 * r1;
            }
            memcpy(&acc[0][c], &a00, 32);
            memcpy(&acc[0][c + 8], &a01, 32);
            memcpy(&acc[1][c], &a10, 32);
            memcpy(&acc[1][c + 8], &a11, 32);
            memcpy(&acc[2][c], &a20, 32);
            memcpy(&acc[2][c + 8], &a21, 32);
            memcpy(&acc[3][c], &a30, 32);
            memcpy(&acc[3][c + 8], &a31, 32);
        }
    }
    /* Partial rows and the columns left over. */
    for (int rr = 0; rr < nrows; rr++)
        for (int cc = c; cc < width; cc++)
            acc[rr][cc] = 0.0f;
    if (c < width)
        for (uint32_t k = 0; k < f->rank; k++) {
            const float *rk = f->r + k * cols + c0;
            for (int rr = 0; rr < nrows; rr++) {
                const float b = l[rr][k * ks];
                float *a = acc[rr];
                for (int cc = c; cc < width; cc++)
                    a[cc] = a[cc] + b * rk[cc];
            }
        }
}

/* m = the merged fp32 values of rows [row, row + nrows), columns [c0, c0 + width). */
static void merged_tile(const struct merge_job *j, uint64_t row, int nrows, uint64_t c0, int width,
                        float m[MERGE_ROWS][MERGE_TILE])
{
    float acc[MERGE_ROWS][MERGE_TILE];
    for (int rr = 0; rr < nrows; rr++)
        for (int c = 0; c < width; c++)
            m[rr][c] = f32_from_element(j->w_dtype, j->w, (row + rr) * j->cols + c0 + c - j->e0);
    for (size_t t = 0; t < j->nfactors; t++) {
        const float s = j->f[t].scaling;
        delta_tile(&j->f[t], j->cols, row, nrows, c0, width, acc);
        for (int rr = 0; rr < nrows; rr++)
            for (int c = 0; c < width; c++)
                m[rr][c] = m[rr][c] + acc[rr][c] * s;
    }
}

static int tile_width(uint64_t c0, uint64_t c_end)
{
    return c_end - c0 < MERGE_TILE ? (int)(c_end - c0) : MERGE_TILE;
}

/* Merges rows [row, row + nrows), columns [c_begin, c_end) of each. */
static uint64_t merge_rows(const struct merge_job *j, uint64_t row, int nrows, uint64_t c_begin, uint64_t c_end)
{
    float m[MERGE_ROWS][MERGE_TILE];
    uint64_t overflowed = 0;
    for (uint64_t c0 = c_begin; c0 < c_end; c0 += MERGE_TILE) {
        int width = tile_width(c0, c_end);
        merged_tile(j, row, nrows, c0, width, m);
        for (int rr = 0; rr < nrows; rr++)
            for (int c = 0; c < width; c++)
                overflowed += store_value(j->out, j->out_dtype, (row + rr) * j->cols + c0 + c - j->e0, m[rr][c]);
    }
    return overflowed;
}

/* The sum of squares DORA_NORM_LANES describes, of columns [c0, c0 + width)
 * of a row, added into its lane partials. */
static void add_squares(double partial[DORA_NORM_LANES], uint64_t c0, int width, const float *m)
{
    for (int c = 0; c < width; c++) {
        const double v = m[c];
        double *p = &partial[(c0 + (uint64_t)c) % DORA_NORM_LANES];
        *p = *p + v * v;
    }
}

static float norm_of(double partial[DORA_NORM_LANES])
{
    for (int h = DORA_NORM_LANES / 2; h > 0; h /= 2)
        for (int i = 0; i < h; i++)
            partial[i] = partial[i] + partial[i + h];
    return (float)sqrt(partial[0]);
}

/* DoRA: whole rows [row, row + nrows), each merged row scaled by its
 * magnitude over its L2 norm (the fp32 rounding of the fp64 norm, as PEFT's
 * norm is fp32); the factor and the product are fp32, rounded once to the
 * output dtype. The merged rows wait in j->dora_rows until their norms are
 * known. */
static uint64_t merge_dora_rows(const struct merge_job *j, uint64_t row, int nrows)
{
    float m[MERGE_ROWS][MERGE_TILE];
    double partial[MERGE_ROWS][DORA_NORM_LANES] = {{0}};
    float *held = j->dora_rows + (row * j->cols - j->e0);
    uint64_t overflowed = 0;
    for (uint64_t c0 = 0; c0 < j->cols; c0 += MERGE_TILE) {
        int width = tile_width(c0, j->cols);
        merged_tile(j, row, nrows, c0, width, m);
        for (int rr = 0; rr < nrows; rr++) {
            add_squares(partial[rr], c0, width, m[rr]);
            memcpy(held + rr * j->cols + c0, m[rr], (size_t)width * sizeof(float));
        }
    }
    for (int rr = 0; rr < nrows; rr++) {
        const float factor = j->magnitude[row + rr - j->e0 / j->cols] / norm_of(partial[rr]);
        for (uint64_t c = 0; c < j->cols; c++)
            overflowed += store_value(j->out, j->out_dtype, (row + rr) * j->cols + c - j->e0,
                                      factor * held[rr * j->cols + c]);
    }
    return overflowed;
}

struct merge_run {
    const struct merge_job *j;
    uint64_t first_row;
    uint64_t overflowed; /* atomic */
};

/* parallel_for's unit is a row the chunk touches. */
static void merge_row_range(void *ctx, uint64_t first, uint64_t count)
{
    struct merge_run *run = ctx;
    const struct merge_job *j = run->j;
    const uint64_t end_e = j->e0 + j->n;
    uint64_t overflowed = 0;
    for (uint64_t u = first; u < first + count;) {
        uint64_t row = run->first_row + u;
        uint64_t row_e = row * j->cols;
        uint64_t cb = row_e < j->e0 ? j->e0 - row_e : 0;
        uint64_t ce = row_e + j->cols > end_e ? end_e - row_e : j->cols;
        int nrows = 1;
        if (cb == 0 && ce == j->cols) /* gather following full rows */
            while (nrows < MERGE_ROWS && u + nrows < first + count && (row + nrows + 1) * j->cols <= end_e)
                nrows++;
        overflowed += j->magnitude ? merge_dora_rows(j, row, nrows) : merge_rows(j, row, nrows, cb, ce);
        u += (uint64_t)nrows;
    }
    __atomic_add_fetch(&run->overflowed, overflowed, __ATOMIC_RELAXED);
}

/* Whether element i of an output of dtype dt is infinite. */
static int out_is_inf(const void *p, enum st_dtype dt, uint64_t i)
{
    switch (dt) {
    case DT_F16:
        return (((const uint16_t *)p)[i] & 0x7fffu) == 0x7c00u;
    case DT_BF16:
        return (((const uint16_t *)p)[i] & 0x7fffu) == 0x7f80u;
    default: {
        float f;
        memcpy(&f, (const float *)p + i, 4);
        return isinf(f);
    }
    }
}

/* v rounded to dtype dt (nearest even), as fp32: PEFT's cast of the trained
 * rows to the weight's dtype. */
static float round_to_dtype(enum st_dtype dt, float v)
{
    switch (dt) {
    case DT_BF16:
        return bf16_to_f32((uint16_t)f32_to_bf16(v));
    case DT_F16:
        return f16_to_f32((uint16_t)f32_to_f16(v));
    default:
        return v;
    }
}

uint64_t merge_put_token_rows(const struct merge_job *j, uint64_t overflowed)
{
    const uint64_t end_e = j->e0 + j->n;
    for (uint64_t k = 0; k < j->ntok; k++) {
        const uint64_t row_e = j->tok_row[k] * j->cols;
        const uint64_t from = row_e > j->e0 ? row_e : j->e0, to = row_e + j->cols < end_e ? row_e + j->cols : end_e;
        for (uint64_t e = from; e < to; e++) {
            const uint64_t i = e - j->e0;
            /* The base value computed here is overwritten: its overflow is not the output's. */
            if (out_is_inf(j->out, j->out_dtype, i) && isfinite(f32_from_element(j->w_dtype, j->w, i)))
                overflowed--;
            const float raw = j->tok_values[k * j->cols + (e - row_e)], v = round_to_dtype(j->tok_dtype, raw);
            store_value(j->out, j->out_dtype, i, v);
            overflowed += out_is_inf(j->out, j->out_dtype, i) && isfinite(raw);
        }
    }
    return overflowed;
}

uint64_t merge_cpu(const struct merge_job *j, int threads)
{
    if (j->n == 0)
        return 0;
    struct merge_run run = {.j = j, .first_row = j->e0 / j->cols};
    uint64_t rows = (j->e0 + j->n - 1) / j->cols - run.first_row + 1;
    parallel_for(rows, threads, MERGE_MIN_ROWS_PER_THREAD, merge_row_range, &run);
    return run.overflowed;
}
