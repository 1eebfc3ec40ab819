// The fused LoRA merge kernel: dequantize a chunk of a 4-bit weight (or read an
// unquantized one), add the rank-r deltas of up to LORA_MAX_ADAPTERS adapters, and
// write the result rounded once into the output dtype. No dequantized copy of W
// and no B @ A product ever reaches global memory.
//
// The arithmetic is the CPU's (src/lora_merge.h), operation for operation:
//   w   = the base value in its own dtype, widened to fp32
//   acc = sum over k ascending of L(row, k) * R(k, col)      (__fmul_rn, __fadd_rn)
//         or, for a LoKr, the one product W1(i, j) * W2(k, m) (__fmul_rn)
//   m   = ((w + acc_1 * s_1) + acc_2 * s_2) + ...            (__fmul_rn, __fadd_rn)
// with IEEE subnormals (this file is not built with fast math), so the GPU and
// the CPU agree bit for bit.
#pragma once

#include "nf4_device.cuh"

extern "C" {
#include "merge_job.h"
}

#define MERGE_THREADS 256    // columns per CTA tile (one per thread)
#define MERGE_ROWS_PER_CTA 8 // rows per CTA tile: each R load feeds 8 accumulators
#define MERGE_KC 32          // ranks staged in shared memory at a time

// A merge chunk whose pointers are all device memory.
struct dev_merge {
    dev_job dq;            // the 4-bit base (QUANTIZED): its packed data, scales and quant type
    const void *w;         // the unquantized base (!QUANTIZED): n values of w_dtype
    enum st_dtype w_dtype; // the base's own dtype: dequantized values are rounded to it
    enum st_dtype out_dtype;
    void *out;
    uint64_t e0, n, cols; // elements [e0, e0 + n) of the tensor, `cols` per row
    int nfactors;
    merge_factor f[LORA_MAX_ADAPTERS]; // l and r (a LoKr's kron_w1 and kron_w2) in device memory
    unsigned long long *overflowed;   // finite merged values that became inf in out_dtype
};

// Rounds v to dtype dt and back: the value the base has in its own dtype.
__device__ __forceinline__ float round_through(enum st_dtype dt, float v)
{
    if (dt == DT_BF16)
        return __bfloat162float(__float2bfloat16_rn(v));
    if (dt == DT_F16)
        return __half2float(__float2half_rn(v));
    return v;
}

__device__ __forceinline__ float load_base(enum st_dtype dt, const void *p, uint64_t i)
{
    if (dt == DT_BF16)
        return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i]);
    if (dt == DT_F16)
        return __half2float(reinterpret_cast<const half *>(p)[i]);
    return reinterpret_cast<const float *>(p)[i];
}

// Stores m; returns 1 if a finite value became infinite. fp32 NaNs are written
// as the CPU writes them (0x7fffffff).
__device__ __forceinline__ int store_merged(enum st_dtype dt, void *p, uint64_t i, float m)
{
    const bool finite = isfinite(m);
    if (dt == DT_BF16) {
        __nv_bfloat16 h = __float2bfloat16_rn(m);
        reinterpret_cast<__nv_bfloat16 *>(p)[i] = h;
        return finite && isinf(__bfloat162float(h));
    }
    if (dt == DT_F16) {
        half h = __float2half_rn(m);
        reinterpret_cast<half *>(p)[i] = h;
        return finite && isinf(__half2float(h));
    }
    reinterpret_cast<uint32_t *>(p)[i] = isnan(m) ? 0x7fffffffu : __float_as_uint(m);
    return 0;
}

// ---- the kernel -------------------------------------------------------------------
// CTA b, tile (x, y) = (b % col_tiles, b / col_tiles), covers columns
// [x * 256, x * 256 + 256) of rows [first_row + y * 8, first_row + y * 8 + 8);
// thread t owns one column of those 8 rows (a 1-D grid: rows can outnumber 65535 * 8). An element of that tile outside [e0, e0 + n) (a chunk may start and end
// inside a row) is computed but not loaded or stored.

template <bool QUANTIZED, bool NESTED>
__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(const dev_merge m, uint32_t col_tiles, uint32_t bs_log2, uint32_t nbs_log2)
{
    __shared__ float s_tbl[VALUES_PER_CODE];
    __shared__ float s_l[MERGE_ROWS_PER_CTA][MERGE_KC];
    const int qt = m.dq.quant_type == QUANT_FP4 ? QT_FP4 : QT_NF4;
    if (QUANTIZED && threadIdx.x < VALUES_PER_CODE)
        s_tbl[threadIdx.x] = c_values[qt][threadIdx.x];

    const uint64_t first_row = m.e0 / m.cols;
    const uint64_t last_row = (m.e0 + m.n - 1) / m.cols;
    const uint64_t row0 = first_row + (uint64_t)(blockIdx.x / col_tiles) * MERGE_ROWS_PER_CTA;
    const uint64_t col = (uint64_t)(blockIdx.x % col_tiles) * MERGE_THREADS + threadIdx.x;
    const bool col_ok = col < m.cols;
    __syncthreads();

    // The base values, in fp32.
    float v[MERGE_ROWS_PER_CTA];
#pragma unroll
    for (int rr = 0; rr < MERGE_ROWS_PER_CTA; rr++) {
        v[rr] = 0.0f;
        const uint64_t e = (row0 + rr) * m.cols + col;
        if (!col_ok || e < m.e0 || e >= m.e0 + m.n)
            continue;
        const uint64_t i = e - m.e0; // chunk-local
        if (QUANTIZED) {
            const uint32_t byte = m.dq.packed[i / 2];
            const uint32_t nib = (i & 1) ? (byte & 15u) : (byte >> 4);
            const float am = block_absmax<NESTED, true, 0>(m.dq, i >> bs_log2, nbs_log2);
            v[rr] = round_through(m.w_dtype, mul_value<0>(s_tbl[nib], am));
        } else {
            v[rr] = load_base(m.w_dtype, m.w, i);
        }
    }

    for (int t = 0; t < m.nfactors; t++) {
        const merge_factor &f = m.f[t];
        float acc[MERGE_ROWS_PER_CTA];
#pragma unroll
        for (int rr = 0; rr < MERGE_ROWS_PER_CTA; rr++) {
            acc[rr] = 0.0f;
            // A LoKr (rank 0: the loop below does nothing): W1 and W2 through L2, one product.
            const uint64_t kr = row0 + rr + f.kron_row0;
            if (f.kron_w1 && col_ok && row0 + rr <= last_row)
                acc[rr] = __fmul_rn(__ldg(f.kron_w1 + kr / f.kron_c * f.kron_b + col / f.kron_d),
                                    __ldg(f.kron_w2 + kr % f.kron_c * f.kron_d + col % f.kron_d));
        }
        for (uint32_t k0 = 0; k0 < f.rank; k0 += MERGE_KC) {
            // Stage L(row0 .. row0 + 7, k0 .. k0 + 31): one value per thread.
            {
                const int rr = threadIdx.x / MERGE_KC, kk = threadIdx.x % MERGE_KC;
                const uint64_t row = row0 + rr;
                float x = 0.0f;
                if (row <= last_row && k0 + kk < f.rank)
                    x = f.l[(row - f.l_row0) * f.l_row_stride + (uint64_t)(k0 + kk) * f.l_k_stride];
                s_l[rr][kk] = x;
            }
            __syncthreads();
            const uint32_t kn = f.rank - k0 < MERGE_KC ? f.rank - k0 : MERGE_KC;
            if (col_ok) {
                const float *rk = f.r + (uint64_t)k0 * m.cols + col;
                for (uint32_t kk = 0; kk < kn; kk++, rk += m.cols) {
                    const float r = __ldg(rk);
#pragma unroll
                    for (int rr = 0; rr < MERGE_ROWS_PER_CTA; rr++)
                        acc[rr] = __fadd_rn(acc[rr], __fmul_rn(s_l[rr][kk], r));
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int rr = 0; rr < MERGE_ROWS_PER_CTA; rr++)
            v[rr] = __fadd_rn(v[rr], __fmul_rn(acc[rr], f.scaling));
    }

    int overflowed = 0;
#pragma unroll
    for (int rr = 0; rr < MERGE_ROWS_PER_CTA; rr++) {
        const uint64_t e = (row0 + rr) * m.cols + col;
        if (col_ok && e >= m.e0 && e < m.e0 + m.n)
            overflowed += store_merged(m.out_dtype, m.out, e - m.e0, v[rr]);
    }
    if (overflowed)
        atomicAdd(m.overflowed, (unsigned long long)overflowed);
}
