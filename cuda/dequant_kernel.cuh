// The fused NF4/FP4 dequantization kernel.
//
// One launch per job: each warp reads the packed nibbles of 32 * EPT consecutive
// elements, their blocks' absmax codes, nested absmax and nested code entries,
// and writes the outputs. No intermediate buffer in global memory.
#pragma once

#include "nf4_device.cuh"

// ---- the kernel -------------------------------------------------------------------
// Warp-interleaved layout: a warp owns WT = 32 * EPT consecutive elements, cut in
// units of U elements (one 16-byte output store). In step q, lane l handles unit
// q * 32 + l, so every load instruction of a warp reads one contiguous run
// (128 bytes of packed nibbles for 16-bit output) and every store writes 512
// contiguous bytes: whole sectors, no partial writes for L2 to merge.
// A warp tile spans at most 32 quantization blocks (WT <= 1024, blocksize >= 32):
// lane l computes block (first + l)'s absmax once and the others read it by shuffle.
//
// BULK (a bench variant, sm_90 only; BULK_NONE elsewhere): a whole warp tile is
// staged in shared memory and written by one bulk asynchronous copy (TMA,
// bulk_store_warp), instead of Q 16-byte stores per lane. The launch then gives
// each CTA threads * EPT * sizeof(T) bytes of dynamic shared memory.
//
// VALUES: where the 16 code values are read from. VALUES_SHARED: a table in shared
// memory, filled by the first 16 threads before a CTA barrier, one shared load per
// element. VALUES_SHUFFLE: each lane holds one value and the others read it by
// shuffle: no table to fill and no CTA barrier, which a launch of a single wave of
// CTAs (10 MB) waits for (docs/KERNEL-NOTES.md). The shuffles are taken before the
// per-unit bounds check, by the whole warp, and that keeps the 16-bit kernels at 32
// registers (inside the branch they needed 39, and lost a fifth of the CTA slots).
//
// VALUES_OUTPUTS (16-bit output, blocksize >= 64): in step q the units of lanes
// 16h..16h+7 are 64 aligned elements, so one block, and so are those of lanes
// 16h+8..16h+15. Lane 16h + v computes code v's output for both blocks, rounded to T,
// in one entry word (low block in the low 16 bits); every element then reads its
// entry word by a shuffle from the lane of its nibble and keeps its block's half.
// Two multiplies and one conversion per lane and unit instead of eight and four;
// the same rounding of the same products, so the same bits.
//
// PDL (the bench's pdl variant, sm_90; measured slower, docs/KERNEL-NOTES.md):
// launched with programmatic stream serialization, it waits for the kernel before
// it, if still running, before its first global access.

template <typename T, int QT, int EPT, bool NESTED, bool HINTS, bool STH, int ASM, int BULK, int VALUES, bool PDL>
__global__ void dequant4_kernel(const dev_job j, uint32_t bs_log2, uint32_t nbs_log2)
{
    constexpr int U = 16 / (int)sizeof(T); // elements per 16-byte store: 8 (16-bit) or 4 (fp32)
    constexpr int Q = EPT / U;             // units per lane
    constexpr int WT = 32 * EPT;           // elements per warp tile
    constexpr bool OUTPUTS = VALUES == VALUES_OUTPUTS;
    constexpr bool SHUFFLE = VALUES == VALUES_SHUFFLE || OUTPUTS; // lanes hold the code values
    static_assert(EPT % U == 0 && WT <= 32 * 32, "EPT: 16 or 32");
    static_assert(!OUTPUTS || U == 8, "output entries by shuffle: 16-bit output only");

    const uint32_t lane = threadIdx.x & 31u;
    __shared__ float s_tbl[SHUFFLE ? 1 : VALUES_PER_CODE];
    float lane_value = 0.0f; // VALUES_SHUFFLE, VALUES_OUTPUTS: the value of code lane % 16
    if constexpr (SHUFFLE)
        lane_value = c_values[QT][lane & 15u];
    else if (threadIdx.x < VALUES_PER_CODE)
        s_tbl[threadIdx.x] = c_values[QT][threadIdx.x];
    wait_for_previous_grid<PDL>(); // the value table is constant memory: no kernel writes it

    const uint64_t wbase = (((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * WT;
    const uint64_t n = j.n;

    // Streaming loads first, so they are in flight during the absmax lookups.
    uint32_t w[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const uint64_t e0 = wbase + (uint64_t)(q * 32 + lane) * U;
        w[q] = e0 + U <= n ? ld_packed_unit<U / 2, HINTS>(j.packed + e0 / 2) : 0u;
    }
    // Lane l: absmax of block (first + l); at most 32 blocks per warp tile.
    const uint64_t first = wbase >> bs_log2;
    float my_am = 0.0f;
    if (wbase < n) {
        const uint64_t last = (wbase + WT < n ? wbase + WT : n) - 1;
        if (lane <= (last >> bs_log2) - first)
            my_am = block_absmax<NESTED, HINTS, ASM>(j, first + lane, nbs_log2);
    }
    if constexpr (!SHUFFLE)
        __syncthreads(); // the shared value table is filled
    if (wbase >= n) // uniform per warp: the shuffles below see full warps
        return;

    char *out = reinterpret_cast<char *>(j.out);
    // Bulk stores take whole tiles only (uniform per warp); a tile that crosses n
    // is stored unit by unit as in the default kernel.
    extern __shared__ uint4 s_stage[];
    const bool bulk = BULK_AVAILABLE && BULK != BULK_NONE && wbase + WT <= n;
    uint4 *stage = s_stage + (threadIdx.x >> 5) * (WT * sizeof(T) / 16);
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const uint64_t e0 = wbase + (uint64_t)(q * 32 + lane) * U;
        float am;
        uint32_t pair[U / 2]; // VALUES_OUTPUTS: the unit's output words
        if constexpr (OUTPUTS) {
            const uint64_t half0 = wbase + (uint64_t)(q * 32 + (lane & 16u)) * U; // this half-warp's first element
            const float am_lo = __shfl_sync(0xffffffffu, my_am, (uint32_t)((half0 >> bs_log2) - first));
            const float am_hi = __shfl_sync(0xffffffffu, my_am, (uint32_t)(((half0 + 8 * U) >> bs_log2) - first));
            am = (lane & 8u) ? am_hi : am_lo;
            const uint32_t entry = Out<T>::pack2(mul_value<ASM>(lane_value, am_lo), mul_value<ASM>(lane_value, am_hi));
            const uint32_t half_sel = (lane & 8u) ? 0x7632u : 0x5410u;
#pragma unroll
            for (int k = 0; k < U / 2; k++)
                pair[k] = outputs_by_shuffle(entry, w[q], k, half_sel);
        } else {
            const uint32_t rel = (uint32_t)((e0 >> bs_log2) - first); // < 32
            am = __shfl_sync(0xffffffffu, my_am, rel);
        }
        // Shuffles need the whole warp, so the shuffle paths read their values before
        // the branch below (a unit past n has w[q] == 0: value 0, never stored).
        float v[U];
        if constexpr (SHUFFLE && !OUTPUTS) {
#pragma unroll
            for (int i = 0; i < U; i++)
                v[i] = mul_value<ASM>(value_by_shuffle(lane_value, w[q], i), am);
        }
        if (e0 + U <= n) {
            if constexpr (!SHUFFLE) {
                uint32_t off[8];
                unpack8<ASM>(w[q], off);
#pragma unroll
                for (int i = 0; i < U; i++)
                    v[i] = mul_value<ASM>(table_at(s_tbl, off[i]), am);
            }
            uint4 o;
            if constexpr (OUTPUTS) {
                o = make_uint4(pair[0], pair[1], pair[2], pair[3]);
            } else if constexpr (sizeof(T) == 4) {
                o = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                               __float_as_uint(v[3]));
            } else {
                o = make_uint4(Out<T>::pack2(v[0], v[1]), Out<T>::pack2(v[2], v[3]),
                               Out<T>::pack2(v[4], v[5]), Out<T>::pack2(v[6], v[7]));
            }
            if (bulk)
                stage[q * 32 + lane] = o; // the unit's 16 bytes at its offset in the tile
            else
                st_out16<STH>(out + e0 * sizeof(T), o);
        } else if (e0 < n) {
            // Tail: the one unit that crosses n, element by element.
            for (uint64_t e = e0; e < n; e++) {
                uint32_t byte = j.packed[e / 2];
                uint32_t nib = (e & 1) ? (byte & 15u) : (byte >> 4);
                const float value = SHUFFLE ? c_values[QT][nib] : s_tbl[nib];
                Out<T>::store1(out + e * sizeof(T), mul_value<ASM>(value, am));
            }
        }
    }
    if (bulk)
        bulk_store_warp<BULK>(out + wbase * sizeof(T), stage, WT * sizeof(T), lane);
}
