// The DoRA row kernel: rescales merged rows by magnitude / L2 norm, after the
// fused merge kernel (cuda/merge_kernel.cuh) has written them in fp32.
//
// The arithmetic is the CPU's (src/lora_merge.c, merge_dora_rows), operation
// for operation, so the two agree bit for bit:
//   p[lane] = sum over columns c = lane, lane + 32, ... of (double)m * (double)m
//             (__dmul_rn, __dadd_rn: the squares are exact, no fused multiply-add)
//   p[i] += p[i + h] for i < h, h = 16, 8, 4, 2, 1      (__shfl_down_sync)
//   norm   = fp32(sqrt(p[0]))                           (IEEE sqrt, __double2float_rn)
//   out    = (magnitude / norm) * m, rounded once       (__fdiv_rn, __fmul_rn)
#pragma once

#include "merge_kernel.cuh"

#define DORA_WARPS_PER_CTA 8

static_assert(DORA_NORM_LANES == 32, "one warp per DoRA row");

// ---- the kernel -------------------------------------------------------------------
// Warp w of CTA b takes row b * DORA_WARPS_PER_CTA + w of the nrows rows of
// `merged` (cols fp32 values each), and writes it into `out` (out_dtype), both
// starting at the first row.
__global__ void __launch_bounds__(DORA_WARPS_PER_CTA * 32)
    dora_rows_kernel(const float *__restrict__ merged, void *__restrict__ out, enum st_dtype out_dtype,
                     const float *__restrict__ magnitude, uint64_t cols, uint64_t nrows,
                     unsigned long long *overflowed)
{
    const uint64_t row = (uint64_t)blockIdx.x * DORA_WARPS_PER_CTA + threadIdx.x / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= nrows) // a whole warp leaves together: its shuffles stay full
        return;
    const float *m = merged + row * cols;
    double p = 0.0;
    for (uint64_t c = lane; c < cols; c += 32) {
        const double v = (double)m[c];
        p = __dadd_rn(p, __dmul_rn(v, v));
    }
    for (int h = 16; h > 0; h /= 2)
        p = __dadd_rn(p, __shfl_down_sync(0xffffffffu, p, h));
    const float norm = __shfl_sync(0xffffffffu, __double2float_rn(sqrt(p)), 0);
    const float factor = __fdiv_rn(magnitude[row], norm);
    int over = 0;
    for (uint64_t c = lane; c < cols; c += 32)
        over += store_merged(out_dtype, out, row * cols + c, __fmul_rn(factor, m[c]));
    if (over)
        atomicAdd(overflowed, (unsigned long long)over);
}
