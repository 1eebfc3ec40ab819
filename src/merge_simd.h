/* The vector kernels behind merge_cpu (src/merge_cpu.c, src/merge_x86.c).
 *
 * merge_cpu walks a chunk in strips of MERGE_STRIP columns by groups of up to
 * MERGE_GROUP rows. For each factor a block kernel sums the rank-r products
 * of the group's rows of L with the strip's columns of R in registers, then
 * adds them, scaled, to the base values and rounds them into the output. Each
 * element sees the multiplies and adds of src/lora_merge.h in its order
 * (separate roundings: the build has -ffp-contract=off), so every kernel gives
 * the same bytes as the scalar edges and as the GPU. */
#ifndef NF4DEQ_MERGE_SIMD_H
#define NF4DEQ_MERGE_SIMD_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "merge_job.h"

#define MERGE_STRIP 32 /* columns of a strip: two zmm, four ymm */
#define MERGE_GROUP 4  /* rows of a group: each load of R serves four rows */

/* A strip's sums, for factor t, row g of the group and column c of the strip:
 *   acc[g][c] = sum over k ascending of l[t][g][k * l_stride[t]] * r[t][k * r_stride[t] + c]
 * from 0.0f. */

/* `nstrips` strips of MERGE_STRIP columns of up to MERGE_GROUP rows, all
 * factors, from base values to output: each factor's sums as above,
 * then m = fp32(w) + acc_1 * scaling_1 + acc_2 * scaling_2 + ..., rounded
 * into the output. Strip s of row g reads MERGE_STRIP base values from
 * w[g] + s * MERGE_STRIP elements and writes as many output values there in
 * out[g]; factor t's R for it starts at r[t] + s * r_strip[t]. */
struct merge_block {
    uint64_t nstrips;
    size_t nfactors;
    const float *r[LORA_MAX_ADAPTERS];
    uint64_t r_stride[LORA_MAX_ADAPTERS]; /* from R's row k to row k + 1 */
    uint64_t r_strip[LORA_MAX_ADAPTERS];  /* from one strip to the next */
    const float *l[LORA_MAX_ADAPTERS][MERGE_GROUP]; /* every row pointer is read */
    uint64_t l_stride[LORA_MAX_ADAPTERS];
    uint32_t rank[LORA_MAX_ADAPTERS];
    float scaling[LORA_MAX_ADAPTERS];
    int nrows;
    const void *w[MERGE_GROUP];
    enum st_dtype w_dtype; /* F16, BF16 or F32 */
    void *out[MERGE_GROUP];
    enum st_dtype out_dtype; /* F16, BF16 or F32 */
};

/* Computes the block; returns how many finite merged values became infinite. */
typedef uint64_t (*merge_block_fn)(const struct merge_block *b);

uint64_t merge_block_avx2(const struct merge_block *b);
uint64_t merge_block_avx512(const struct merge_block *b);

#endif
