/* Merging LoRA deltas into one chunk of a base tensor: the arithmetic, which
 * merge_cpu (src/merge_cpu.h) and the GPU's merge kernel both do, and
 * reading a chunk's factors.
 *
 * For element (row, col) of a rows x cols base tensor, in the order PEFT's
 * fp32 merge rounds:
 *   acc_t = sum over k = 0 .. r_t - 1 of L_t(row, k) * R_t(k, col)    (fp32, k ascending)
 *   m     = fp32(w) + acc_1 * scaling_1 + acc_2 * scaling_2 + ...      (fp32, adapter order)
 *   out   = m rounded once to the output dtype (nearest even)
 * where w is the base value in its own dtype: bitsandbytes' dequantization in
 * the weight's dtype, or the unquantized tensor as stored. L_t = B and R_t = A,
 * or L_t = A^T and R_t = B^T with fan_in_fan_out; for a LoRA bias on a bias
 * vector [1, out], L_t = 1 and R_t = b, so m = w + b * scaling, PEFT's
 * bias + lora_B.bias * scaling. No multiply-add is fused.
 *
 * A LoKr's acc_t is one product, W1(i, j) * W2(k, m), for row = i * c + k
 * and col = j * d + m (from the term's row0 on: lora.h), as PEFT's
 * make_kron forms kron(W1, W2) and then multiplies it by the scaling; each
 * of W1 and W2 is its lokr_w tensor in fp32, or the product of its two
 * halves summed in fp64 and rounded once to fp32.
 *
 * With DoRA (one adapter, j->magnitude set) each whole row is then rescaled:
 *   norm  = sqrt(sum over the row of m * m), summed in fp64 (DORA_NORM_LANES), then fp32
 *   out   = (magnitude[row] / norm) * m, in fp32, rounded once
 *
 * Trained token rows (a tensor with them has no factors) then replace their
 * rows whole: out = the row's fp32 value rounded to the weight's dtype, then
 * to the output dtype (merge_put_token_rows).
 *
 * A chunk is any run of elements [e0, e0 + n): it may start and end inside a
 * row (but for DoRA, whole rows). Its factors are read per chunk, in fp32: the
 * rows of L it touches and all of R. B @ A is never formed beyond a tile of one
 * to four rows (merge_simd.h). */
#ifndef NF4DEQ_LORA_MERGE_H
#define NF4DEQ_LORA_MERGE_H

#include <stdint.h>

#include "lora.h"
#include "merge_job.h"

/* Slot bytes the factors of `t` take for a chunk of n elements starting at e0
 * (with DoRA, and its magnitudes and n floats of merged rows). */
uint64_t merge_factor_bytes(const struct lora_target *t, uint64_t e0, uint64_t n);
/* Upper bound of merge_factor_bytes over any chunk of n elements. */
uint64_t merge_factor_bytes_max(const struct lora_target *t, uint64_t n);

/* Reads the factors for elements [e0, e0 + n) of t into buf (merge_factor_bytes
 * long, 8-byte aligned) and sets j->e0, n, cols, the factors and the trained
 * token rows. NF4_* code. */
int merge_read_factors(struct merge_job *j, const struct lora_target *t, uint64_t e0, uint64_t n, void *buf);

/* Puts the job's trained token rows (j->ntok) into its computed output, on
 * either engine: given how many finite values the computation turned
 * infinite, returns how many the output now holds. */
uint64_t merge_put_token_rows(const struct merge_job *j, uint64_t overflowed);

#endif
