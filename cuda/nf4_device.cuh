// Device helpers of the 4-bit kernels: cache-hinted loads and stores, nibble
// unpacking, bitsandbytes' flushing arithmetic, output conversion and the block
// absmax. Header-only: every kernel family that decodes bnb-4bit includes it.
//
// Byte-exact with bitsandbytes: absmax = add.rn(mul.rn.ftz(code2[c], absmax2), offset),
// out = cvt.rn(mul.rn.ftz(value4[nibble], absmax)); no FMA anywhere.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch.cuh"

#ifndef NF4DEQ_ASM
#define NF4DEQ_ASM 1
#endif

// ---- constants ------------------------------------------------------------------

#define ASM_UNPACK 1 // prmt/lop3 nibble unpack
#define ASM_MUL 2    // mul.rn.ftz.f32 (else CUDA C flushes around __fmul_rn)
#define QT_NF4 0
#define QT_FP4 1
#define VALUES_PER_CODE 16
#define VALUES_SHARED 0  // the value table in shared memory, one load per element
#define VALUES_SHUFFLE 1 // the value table in the lanes of each warp, one shuffle per element
#define VALUES_OUTPUTS 2 // each block's 16 outputs, rounded to the 16-bit output type, in the lanes
                         // of each half-warp: one shuffle per element, no multiply (blocksize >= 64)
#define OUTPUTS_MIN_BLOCKSIZE 64 // VALUES_OUTPUTS: the 64 elements of a half-warp's 8 units in one block

// bitsandbytes' NF4 table, and FP4 as sign * magnitude (bit 3 is the sign).
__constant__ float c_values[2][VALUES_PER_CODE] = {
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
     -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
     0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
     0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f},
    {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
     -0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f},
};

// ---- programmatic dependent launch (sm_90) --------------------------------------
// A kernel launched with programmatic stream serialization may start while the
// kernel before it in the stream is still running. It must not touch global
// memory that kernel may write or read (its inputs, our output) until it has
// completed: cudaGridDependencySynchronize waits for that, and returns at once in
// a launch without the attribute. The trigger then lets the next such launch start
// its CTAs as ours leave the SMs. Elsewhere both are nothing.
template <bool PDL> __device__ __forceinline__ void wait_for_previous_grid()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (PDL) {
        cudaGridDependencySynchronize();
        cudaTriggerProgrammaticLaunchCompletion();
    }
#endif
}

// ---- memory access helpers (inline PTX cache hints) -----------------------------
// With NF4DEQ_ASM=0 the hints fall back to CUDA C intrinsics: __ldg (read-only
// path) for the loads and __stcs (st.global.cs) for the stores.

// Small, shared by many threads: keep them (evict_last).
template <bool HINTS> __device__ __forceinline__ uint32_t ld_code_u8(const uint8_t *p)
{
    uint32_t v;
    if (HINTS) {
#if NF4DEQ_ASM
        asm("ld.global.nc.L1::evict_last.u8 %0, [%1];" : "=r"(v) : "l"(p));
#else
        v = __ldg(p);
#endif
    } else {
        v = *p;
    }
    return v;
}

template <bool HINTS> __device__ __forceinline__ float ld_f32_keep(const float *p)
{
    float v;
    if (HINTS) {
#if NF4DEQ_ASM
        asm("ld.global.nc.L1::evict_last.f32 %0, [%1];" : "=f"(v) : "l"(p));
#else
        v = __ldg(p);
#endif
    } else {
        v = *p;
    }
    return v;
}

// Output is written once and never read back here: streaming store.
template <bool HINTS> __device__ __forceinline__ void st_out16(void *p, uint4 v)
{
    if (HINTS) {
#if NF4DEQ_ASM
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
                     "r"(v.z), "r"(v.w)
                     : "memory");
#else
        __stcs(reinterpret_cast<uint4 *>(p), v);
#endif
    } else {
        *reinterpret_cast<uint4 *>(p) = v;
    }
}

// ---- bulk asynchronous stores (TMA, sm_90) ---------------------------------------
// A bench variant (docs/KERNEL-NOTES.md): a warp stages its output tile in shared
// memory and one lane hands it to the copy engine with cp.async.bulk. Elsewhere
// (older GPUs, the compute_75 PTX, NF4DEQ_ASM=0) the kernel stores unit by unit.

#define BULK_NONE 0
#define BULK_PLAIN 1       // cp.async.bulk, no L2 hint
#define BULK_EVICT_FIRST 2 // with an L2 evict_first policy, as st.global.cs asks
#if NF4DEQ_ASM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BULK_AVAILABLE 1
#else
#define BULK_AVAILABLE 0
#endif

// dst: 16-byte aligned global address; bytes: a multiple of 16. Every lane of
// the warp has written its part of src. Returns once the copy engine has read
// src (so the CTA may exit); the global writes complete by the kernel's end.
template <int BULK>
__device__ __forceinline__ void bulk_store_warp(void *dst, const void *src, uint32_t bytes, uint32_t lane)
{
#if BULK_AVAILABLE
    // Make this lane's shared-memory writes visible to the async proxy, then
    // wait for the whole warp before one lane issues the copy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
        const uint32_t s = (uint32_t)__cvta_generic_to_shared(src);
        if (BULK == BULK_EVICT_FIRST) {
            uint64_t policy;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                         ::"l"(dst), "r"(s), "r"(bytes), "l"(policy)
                         : "memory");
        } else {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(s),
                         "r"(bytes)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
#else
    (void)dst, (void)src, (void)bytes, (void)lane;
#endif
}

// ---- nibble -> table offset ----------------------------------------------------
// A 32-bit word holds 8 elements: byte k = (e[2k] << 4) | e[2k+1]. off[j] is the
// byte offset of element j's value in the 16-float shared table (4 * nibble).

template <int ASM> __device__ __forceinline__ void unpack8(uint32_t w, uint32_t off[8])
{
#if NF4DEQ_ASM
    if (ASM & ASM_UNPACK) {
        // Two shifts and masks put 4*nibble into byte lanes (lop3 for the mask),
        // then one prmt per element moves a lane to the low byte, zero-filled.
        uint32_t hi, lo;
        asm("{\n\t"
            ".reg .b32 t0, t1;\n\t"
            "shr.b32 t0, %2, 2;\n\t"
            "shl.b32 t1, %2, 2;\n\t"
            "lop3.b32 %0, t0, 0x3c3c3c3c, 0, 0xc0;\n\t" // a & b (LUT 0xf0 & 0xcc)
            "lop3.b32 %1, t1, 0x3c3c3c3c, 0, 0xc0;\n\t"
            "}"
            : "=r"(hi), "=r"(lo)
            : "r"(w));
        asm("prmt.b32 %0, %8, 0, 0x4440;\n\t"
            "prmt.b32 %1, %9, 0, 0x4440;\n\t"
            "prmt.b32 %2, %8, 0, 0x4441;\n\t"
            "prmt.b32 %3, %9, 0, 0x4441;\n\t"
            "prmt.b32 %4, %8, 0, 0x4442;\n\t"
            "prmt.b32 %5, %9, 0, 0x4442;\n\t"
            "prmt.b32 %6, %8, 0, 0x4443;\n\t"
            "prmt.b32 %7, %9, 0, 0x4443;"
            : "=r"(off[0]), "=r"(off[1]), "=r"(off[2]), "=r"(off[3]), "=r"(off[4]),
              "=r"(off[5]), "=r"(off[6]), "=r"(off[7])
            : "r"(hi), "r"(lo));
    } else
#endif
    {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t byte = (w >> (8 * k)) & 0xffu;
            off[2 * k] = (byte >> 4) * 4u;
            off[2 * k + 1] = (byte & 15u) * 4u;
        }
    }
}

__device__ __forceinline__ float table_at(const float *s_tbl, uint32_t byte_off)
{
    return *reinterpret_cast<const float *>(reinterpret_cast<const char *>(s_tbl) + byte_off);
}

// The value of element i (0..7) of a unit whose packed word is w, read by a shuffle
// from the lane of its nibble: lanes k and k + 16 hold value k (lane_value =
// values[lane & 15]). Width-16 shuffles take the source index modulo 16, so the
// shifted word needs no mask. Every lane of the warp must take part.
__device__ __forceinline__ float value_by_shuffle(float lane_value, uint32_t w, int i)
{
    const int shift = 8 * (i / 2) + ((i & 1) ? 0 : 4); // byte i/2: high nibble first
    return __shfl_sync(0xffffffffu, lane_value, (int)(w >> shift), 16);
}

// Elements 2k and 2k+1 (byte k of the unit's packed word w, high nibble first)
// as one 32-bit output word: each element's entry word is read by a shuffle from
// the lane of its nibble (width 16: the source index is taken modulo 16, so the
// shifted word needs no mask), and the lane keeps the half of its own block
// (half_sel: 0x5410 for the low half, 0x7632 for the high). Every lane of the warp
// must take part.
__device__ __forceinline__ uint32_t outputs_by_shuffle(uint32_t entry, uint32_t w, int k, uint32_t half_sel)
{
    const uint32_t a = __shfl_sync(0xffffffffu, entry, (int)(w >> (8 * k + 4)), 16);
    const uint32_t b = __shfl_sync(0xffffffffu, entry, (int)(w >> (8 * k)), 16);
    return __byte_perm(a, b, half_sel);
}

// ---- arithmetic ------------------------------------------------------------------
// bitsandbytes is built with --use_fast_math: its multiplies are mul.rn.ftz.f32
// (subnormal inputs and results flushed to a zero of the same sign). The offset
// add runs in PyTorch, with IEEE subnormals: add.rn.f32 (__fadd_rn, no -ftz here).

__device__ __forceinline__ float flush_subnormal(float x)
{
    uint32_t u = __float_as_uint(x);
    return (u & 0x7f800000u) ? x : __uint_as_float(u & 0x80000000u);
}

template <int ASM> __device__ __forceinline__ float mul_ftz(float a, float b)
{
#if NF4DEQ_ASM
    if (ASM & ASM_MUL) {
        float r;
        asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
        return r;
    }
#endif
    return flush_subnormal(__fmul_rn(flush_subnormal(a), flush_subnormal(b)));
}

// The value table holds no subnormals, so only absmax needs flushing before the
// per-element multiply; the product is flushed after it.
template <int ASM> __device__ __forceinline__ float mul_value(float value, float absmax_flushed)
{
#if NF4DEQ_ASM
    if (ASM & ASM_MUL)
        return mul_ftz<ASM>(value, absmax_flushed);
#endif
    return flush_subnormal(__fmul_rn(value, absmax_flushed));
}

// ---- output conversion --------------------------------------------------------

template <typename T> struct Out;
template <> struct Out<half> {
    static constexpr int SIZE = 2;
    __device__ static __forceinline__ uint32_t pack2(float a, float b)
    {
        __half2 h = __floats2half2_rn(a, b); // a -> low half (lower address)
        return *reinterpret_cast<uint32_t *>(&h);
    }
    __device__ static __forceinline__ void store1(void *p, float a)
    {
        *reinterpret_cast<half *>(p) = __float2half_rn(a);
    }
};
template <> struct Out<__nv_bfloat16> {
    static constexpr int SIZE = 2;
    __device__ static __forceinline__ uint32_t pack2(float a, float b)
    {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    __device__ static __forceinline__ void store1(void *p, float a)
    {
        *reinterpret_cast<__nv_bfloat16 *>(p) = __float2bfloat16_rn(a);
    }
};
template <> struct Out<float> {
    static constexpr int SIZE = 4;
    __device__ static __forceinline__ void store1(void *p, float a) { *reinterpret_cast<float *>(p) = a; }
};

// ---- absmax ---------------------------------------------------------------------

// Returns the block's absmax already flushed (as mul.ftz would see it).
template <bool NESTED, bool HINTS, int ASM>
__device__ __forceinline__ float block_absmax(const dev_job &j, uint64_t block, uint32_t nbs_log2)
{
    float a;
    if (NESTED) {
        uint32_t code = ld_code_u8<HINTS>(j.absmax_code + block);
        float scale = ld_f32_keep<HINTS>(j.nested_absmax + (block >> nbs_log2));
        float c = ld_f32_keep<HINTS>(j.nested_code + code);
        float offset = j.nested_offset_ptr ? ld_f32_keep<HINTS>(j.nested_offset_ptr) : j.nested_offset;
        a = __fadd_rn(mul_ftz<ASM>(c, scale), offset);
    } else {
        a = ld_f32_keep<HINTS>(j.absmax + block);
    }
    return flush_subnormal(a);
}

// The packed nibbles of one output unit: 4 bytes (8 elements) or 2 bytes (4).
template <int BYTES, bool HINTS> __device__ __forceinline__ uint32_t ld_packed_unit(const uint8_t *p)
{
    uint32_t v;
    if (BYTES == 4) {
        if (HINTS) {
#if NF4DEQ_ASM
            asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
#else
            v = __ldg(reinterpret_cast<const unsigned int *>(p));
#endif
        } else {
            v = *reinterpret_cast<const uint32_t *>(p);
        }
    } else {
        if (HINTS) {
#if NF4DEQ_ASM
            unsigned short h;
            asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(h) : "l"(p));
            v = h;
#else
            v = __ldg(reinterpret_cast<const unsigned short *>(p));
#endif
        } else {
            v = *reinterpret_cast<const uint16_t *>(p);
        }
    }
    return v;
}
