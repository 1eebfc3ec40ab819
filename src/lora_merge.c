#include "lora_merge.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fpconv.h"
#include "status.h"

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

/* An expert's part of a LoRA on MoE experts (lora_experts.h) keeps r columns
 * of each row of B, r * experts wide. Its rows are contiguous in B, so whole
 * rows are read this many bytes at a time (at least one row): one read
 * instead of one per row, and only the kept values widened to fp32. A read
 * per row made a merge of Qwen3-30B-sized experts on 2 cores 2.65 s; blocks,
 * 2.06 s (PERFORMANCE.md, "LoRA on MoE experts"). */
#define EXPERT_B_BLOCK_BYTES (512u * 1024u)

/* Bytes of one row of B that an expert's part reads whole. */
static uint64_t expert_row_bytes(const struct lora_term *x)
{
    return (uint64_t)x->r * x->b_col_step * (dtype_bits(x->b->t->dtype) / 8);
}

/* Rows of B read at once for `span` rows of an expert's part. */
static uint64_t expert_block_rows(const struct lora_term *x, uint64_t span)
{
    uint64_t rows = EXPERT_B_BLOCK_BYTES / expert_row_bytes(x);
    rows = rows ? rows : 1;
    return rows < span ? rows : span;
}

/* Floats that hold the raw block of expert_block_rows. */
static uint64_t expert_block_floats(const struct lora_term *x, uint64_t span)
{
    return (expert_block_rows(x, span) * expert_row_bytes(x) + 3) / 4;
}

/* The rank of a LoKr's factor that PEFT splits in two (its second half's rows), or 0. */
static uint64_t kron_half_rank(const struct model_tensor *half_b)
{
    return half_b ? half_b->t->shape[0] : 0;
}

/* Floats a LoKr's factors take in any chunk: W1 and W2 whole, and room for
 * the two halves of the larger split one, read before their product (W1's
 * halves and then W2's use the same room). Its products are few (W1 and W2
 * are each about the square root of the layer's size), so each chunk forms
 * them again rather than holding them between chunks. */
static uint64_t kron_floats(const struct lora_kron *k)
{
    const uint64_t h1 = kron_half_rank(k->w1_b) * (k->a + k->b), h2 = kron_half_rank(k->w2_b) * (k->c + k->d);
    return k->a * k->b + k->c * k->d + (h1 > h2 ? h1 : h2);
}

/* The factors' part of merge_factor_bytes. */
static uint64_t factor_bytes(const struct lora_target *t, uint64_t e0, uint64_t n)
{
    uint64_t first_row = e0 / t->cols, last_row = (e0 + (n ? n : 1) - 1) / t->cols, floats = 0;
    for (size_t i = 0; i < t->nterms; i++) {
        const struct lora_term *x = &t->terms[i];
        if (x->kron.w1) {
            floats += kron_floats(&x->kron);
            continue;
        }
        floats += l_floats(x, first_row, last_row) + (uint64_t)x->r * t->cols;
        if (x->magnitude) /* and the merged rows, held for the rescale */
            floats += last_row - first_row + 1 + n;
        if (x->fan_in_fan_out) /* B is read whole, then transposed into R */
            floats += (uint64_t)x->r * t->cols;
        if (x->b_col_step) /* whole rows of B, a block at a time, of which an expert's columns are kept: */
            floats += expert_block_floats(x, x->fan_in_fan_out ? t->cols /* all of them, for R */
                                                               : last_row - first_row + 1 /* those of L */);
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

/* A LoKr's factor W [rows, cols] into `out`: `w` as it is, or, where PEFT
 * splits it, w [rows, r] @ w_b [r, cols] summed in fp64 and rounded once to
 * fp32. torch's fp32 matmul sums the products in an order of its own; where
 * they nearly cancel, an fp32 sum in another order can land farther from the
 * exact product than the merge's tolerance allows (a review found elements
 * of zero-valued bases so), and one rounding lands nearest it. The halves
 * are read into `halves`. */
static int read_kron_factor(const struct model_tensor *w, const struct model_tensor *w_b, uint64_t rows,
                            uint64_t cols, float *out, float *halves)
{
    if (!w_b)
        return read_f32(w, 0, rows * cols, out);
    const uint64_t r = kron_half_rank(w_b);
    float *ha = halves, *hb = halves + rows * r;
    int code = read_f32(w, 0, rows * r, ha);
    if (code == NF4_OK)
        code = read_f32(w_b, 0, r * cols, hb);
    if (code != NF4_OK)
        return code;
    for (uint64_t i = 0; i < rows; i++)
        for (uint64_t c = 0; c < cols; c++) {
            double sum = 0;
            for (uint64_t k = 0; k < r; k++)
                sum += (double)ha[i * r + k] * (double)hb[k * cols + c];
            out[i * cols + c] = (float)sum;
        }
    return NF4_OK;
}

/* A LoKr term's factor for a chunk: W1 and W2 formed at `at` (kron_floats long). */
static int read_kron(struct merge_factor *f, const struct lora_term *x, float *at)
{
    const struct lora_kron *k = &x->kron;
    float *w1 = at, *w2 = w1 + k->a * k->b, *halves = w2 + k->c * k->d;
    *f = (struct merge_factor){.scaling = x->scaling,
                               .kron_w1 = w1,
                               .kron_w2 = w2,
                               .kron_a = k->a,
                               .kron_b = k->b,
                               .kron_c = k->c,
                               .kron_d = k->d,
                               .kron_row0 = k->row0};
    int code = read_kron_factor(k->w1, k->w1_b, k->a, k->b, w1, halves);
    return code == NF4_OK ? read_kron_factor(k->w2, k->w2_b, k->c, k->d, w2, halves) : code;
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

/* Expert x->b_col0's columns of B (lora_experts.h), rows first_row onward:
 * l[i * r + k] = B[b_row0 + first_row + i, b_col0 + k * b_col_step], L of
 * an expert's part, or (read for all of B's rows) R transposed where the
 * term is fan_in_fan_out. Whole rows of B are read a block at a time into
 * `raw` (expert_block_floats) and the expert's r columns of each are
 * widened into `l`. */
static int read_expert_rows(const struct lora_term *x, uint64_t first_row, uint64_t span, float *l, void *raw)
{
    const enum st_dtype dt = x->b->t->dtype;
    const uint64_t width = (uint64_t)x->r * x->b_col_step, row_bytes = expert_row_bytes(x);
    const uint64_t block = expert_block_rows(x, span);
    for (uint64_t i0 = 0; i0 < span; i0 += block) {
        const uint64_t rows = span - i0 < block ? span - i0 : block;
        int code = st_read(x->b->file, x->b->t, (x->b_row0 + first_row + i0) * row_bytes, raw, rows * row_bytes);
        if (code != NF4_OK)
            return code;
        for (uint64_t i = 0; i < rows; i++)
            for (uint32_t k = 0; k < x->r; k++)
                l[(i0 + i) * x->r + k] = f32_from_element(dt, raw, i * width + x->b_col0 + (uint64_t)k * x->b_col_step);
    }
    return NF4_OK;
}

/* The term `x` as it applies to rows [first_row, last_row], and the first of
 * those rows as its factors count them (*local_row), with the width of A's
 * rows that fan_in_fan_out reads L from (*a_width): x itself, first_row and
 * the tensor's rows, but for a term on a fused experts tensor, whose chunk
 * lies within one expert e's rows: e's rows of A and columns of B, from the
 * expert's first row (lora.h). */
static int term_for_rows(const struct lora_target *t, const struct lora_term *x, uint64_t first_row,
                         uint64_t last_row, struct lora_term *out, uint64_t *local_row, uint64_t *a_width)
{
    *out = *x;
    *local_row = first_row;
    *a_width = t->rows;
    if (!x->expert_rows)
        return NF4_OK;
    const uint64_t e = first_row / x->expert_rows;
    if (last_row / x->expert_rows != e)
        return nf4_fail(NF4_ESOFTWARE, x->a->file->path, t->name,
                        "a chunk across two experts of a fused tensor (internal error)");
    out->a_row0 = e * x->r;
    out->b_col0 = (uint32_t)e;
    *local_row = first_row - e * x->expert_rows;
    *a_width = x->expert_rows;
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
        if (t->terms[i].kron.w1) {
            if ((code = read_kron(&j->f[i], &t->terms[i], at)) != NF4_OK)
                return code;
            at += kron_floats(&t->terms[i].kron);
            continue;
        }
        struct lora_term term;
        const struct lora_term *x = &term;
        uint64_t local_row, a_width;
        if ((code = term_for_rows(t, &t->terms[i], first_row, last_row, &term, &local_row, &a_width)) != NF4_OK)
            return code;
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
            if (x->bias) /* L = 1, R = lora_B.bias [1, out]: rank 1, one row */
                at[0] = 1.0f;
            else if (x->b_col_step) /* one expert of a LoRA on MoE experts */
                code = read_expert_rows(x, local_row, last_row - first_row + 1, at, at + l_count + r_floats);
            else
                code = read_f32(x->b, first_row * x->r, l_count, at);
            if (code != NF4_OK)
                return code;
            at += l_count;
            f->r = at; /* A's rows a_row0 onward: 0, but for an expert */
            if ((code = read_f32(x->a, x->a_row0 * t->cols, r_floats, at)) != NF4_OK)
                return code;
            at += r_floats;
        } else {
            /* L(row, k) = A[k, row]: A is [r, rows], of which the columns this
             * chunk touches, one run per k (a vocabulary-wide A would not fit a
             * slot). R(k, col) = B[col, k]: B is [cols, r]. (For an expert of
             * a fused tensor, A's rows a_row0 onward, of a_width columns, and
             * B's columns of that expert.) */
            uint64_t span = last_row - first_row + 1;
            f->l = at;
            f->l_row0 = first_row;
            f->l_row_stride = 1;
            f->l_k_stride = span;
            f->l_floats = l_count;
            for (uint32_t k = 0; k < x->r; k++)
                if ((code = read_f32(x->a, (x->a_row0 + k) * a_width + local_row, span, at + (uint64_t)k * span)) !=
                    NF4_OK)
                    return code;
            at += l_count;
            float *r = at, *b = at + r_floats;
            code = x->b_col_step ? read_expert_rows(x, 0, t->cols, b, b + r_floats) : read_f32(x->b, 0, r_floats, b);
            if (code != NF4_OK)
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

/* ---- trained token rows ---- */

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
            if (element_is_inf(j->out_dtype, j->out, i) && isfinite(f32_from_element(j->w_dtype, j->w, i)))
                overflowed--;
            const float raw = j->tok_values[k * j->cols + (e - row_e)], v = round_to_dtype(j->tok_dtype, raw);
            f32_to_element(j->out_dtype, j->out, i, v);
            overflowed += element_is_inf(j->out_dtype, j->out, i) && isfinite(raw);
        }
    }
    return overflowed;
}
