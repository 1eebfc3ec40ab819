/* One chunk of a LoRA merge, as the CPU (src/lora_merge.c) and the GPU
 * (cuda/merge_kernel.cuh) compute it. Plain C with no other dependency, so nvcc
 * reads it too. The arithmetic is described in src/lora_merge.h. */
#ifndef NF4DEQ_MERGE_JOB_H
#define NF4DEQ_MERGE_JOB_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

#define LORA_MAX_ADAPTERS 8

/* A DoRA row's sum of squares, in one order on the CPU and the GPU (one warp
 * per row): partial p sums the squares of columns p, p + 32, p + 64, ... in
 * fp64, in ascending order; then p[i] += p[i + h] for i < h, h = 16, 8, 4, 2,
 * 1; the row's is p[0]. Squares of fp32 values are exact in fp64. */
#define DORA_NORM_LANES 32

/* A DoRA chunk (and a device sub-chunk of one) is whole rows of `cols`
 * elements, starting where quantization blocks start too (`align` elements):
 * a multiple of their least common multiple, or all `total` elements of the
 * tensor where that is more. */
static inline uint64_t dora_granule(uint64_t align, uint64_t cols, uint64_t total)
{
    uint64_t a = align, b = cols;
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    const uint64_t step = a ? align / a : 1; /* align / gcd(align, cols) */
    if (cols == 0 || step > total / cols)
        return total ? total : 1;
    return step * cols;
}

/* One adapter's factors over a chunk: delta(row, col) = scaling * sum_k L(row, k) * R(k, col).
 * Or, for a LoKr (kron_w1 set; l, r and rank unused, rank 0), PEFT's Kronecker
 * product: delta(row, col) = scaling * (W1(i, j) * W2(k, m)), where
 * row + kron_row0 = i * kron_c + k and col = j * kron_d + m, W1 [kron_a, kron_b]
 * and W2 [kron_c, kron_d] row-major, each already formed in fp32. */
struct merge_factor {
    const float *l; /* L(row, k) = l[(row - l_row0) * l_row_stride + k * l_k_stride] */
    uint64_t l_row0, l_row_stride, l_k_stride;
    uint64_t l_floats; /* floats l holds */
    const float *r;    /* R(k, col) = r[k * cols + col]: rank * cols floats */
    uint32_t rank;
    float scaling;
    const float *kron_w1, *kron_w2;
    uint64_t kron_a, kron_b, kron_c, kron_d, kron_row0;
};

/* Whether any factor of the job is a LoKr's. */
static inline int merge_job_has_kron(const struct merge_factor *f, size_t nfactors)
{
    for (size_t t = 0; t < nfactors; t++)
        if (f[t].kron_w1)
            return 1;
    return 0;
}

struct merge_job {
    const void *w; /* n base values of w_dtype, chunk-local */
    enum st_dtype w_dtype;
    void *out; /* n values of out_dtype */
    enum st_dtype out_dtype;
    uint64_t e0, n, cols; /* elements [e0, e0 + n) of a tensor with `cols` columns */
    size_t nfactors;
    struct merge_factor f[LORA_MAX_ADAPTERS];
    /* DoRA (one factor, whole rows only): each row's magnitude, for rows
     * e0 / cols onward; every merged row is scaled by it over its L2 norm
     * (summed as DORA_NORM_LANES describes). NULL for LoRA. */
    const float *magnitude;
    float *dora_rows; /* DoRA on the CPU: n floats, where the merged rows wait for their norms */
    /* Trained token rows (no factors then), put in place on the host after
     * the chunk is computed (merge_put_token_rows): tensor row tok_row[k]
     * takes the fp32 values tok_values[k * cols ..], rounded to tok_dtype
     * first, as PEFT casts them to the weight's dtype. ntok is 0 without. */
    uint64_t ntok;
    const uint64_t *tok_row;
    const float *tok_values;
    enum st_dtype tok_dtype;
};

#endif
