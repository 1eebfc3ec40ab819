// Fused NF4/FP4 dequantization on the GPU, and the src/gpu.h back end.
//
// One launch per job: each warp reads the packed nibbles of 32 * EPT consecutive
// elements, their blocks' absmax codes, nested absmax and nested code entries,
// and writes the outputs. No intermediate buffer in global memory.
//
// Byte-exact with bitsandbytes: absmax = add.rn(mul.rn.ftz(code2[c], absmax2), offset),
// out = cvt.rn(mul.rn.ftz(value4[nibble], absmax)); no FMA anywhere.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.cuh"

extern "C" {
#include "gpu.h"
}

#ifndef NF4DEQ_ASM
#define NF4DEQ_ASM 1
#endif

// ---- constants ------------------------------------------------------------------

#define ASM_UNPACK 1 // prmt/lop3 nibble unpack
#define ASM_MUL 2    // mul.rn.ftz.f32 (else CUDA C flushes around __fmul_rn)
// The inline-asm steps of the nibble->value path the default kernel uses. Measured
// on H200 (docs/KERNEL-NOTES.md): the CUDA C path was 2-4% faster on mid and large
// tensors and equal on small ones, so the default is C; the asm path stays as a
// bench variant (GPU_VARIANT_ASM_VALUE / _ASM_MUL). The cache-hint asm helps and stays.
#define DEFAULT_ASM 0
#define QT_NF4 0
#define QT_FP4 1
#define VALUES_PER_CODE 16
#define SUBCHUNK_CAP_ELEMS (1ull << 25) // default sub-chunk cap: overlap needs several
#define DEFAULT_BUDGET_FRACTION 0.5

// bitsandbytes' NF4 table, and FP4 as sign * magnitude (bit 3 is the sign).
__constant__ float c_values[2][VALUES_PER_CODE] = {
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
     -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
     0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
     0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f},
    {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
     -0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f},
};

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

// ---- the kernel -------------------------------------------------------------------
// Warp-interleaved layout: a warp owns WT = 32 * EPT consecutive elements, cut in
// units of U elements (one 16-byte output store). In step q, lane l handles unit
// q * 32 + l, so every load instruction of a warp reads one contiguous run
// (128 bytes of packed nibbles for 16-bit output) and every store writes 512
// contiguous bytes: whole sectors, no partial writes for L2 to merge.
// A warp tile spans at most 32 quantization blocks (WT <= 1024, blocksize >= 32):
// lane l computes block (first + l)'s absmax once and the others read it by shuffle.

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

template <typename T, int QT, int EPT, bool NESTED, bool HINTS, bool STH, int ASM>
__global__ void dequant4_kernel(const dev_job j, uint32_t bs_log2, uint32_t nbs_log2)
{
    constexpr int U = 16 / (int)sizeof(T); // elements per 16-byte store: 8 (16-bit) or 4 (fp32)
    constexpr int Q = EPT / U;             // units per lane
    constexpr int WT = 32 * EPT;           // elements per warp tile
    static_assert(EPT % U == 0 && WT <= 32 * 32, "EPT: 16 or 32");

    __shared__ float s_tbl[VALUES_PER_CODE];
    if (threadIdx.x < VALUES_PER_CODE)
        s_tbl[threadIdx.x] = c_values[QT][threadIdx.x];

    const uint32_t lane = threadIdx.x & 31u;
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
    __syncthreads();
    if (wbase >= n) // uniform per warp: the shuffles below see full warps
        return;

    char *out = reinterpret_cast<char *>(j.out);
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const uint64_t e0 = wbase + (uint64_t)(q * 32 + lane) * U;
        const uint32_t rel = (uint32_t)((e0 >> bs_log2) - first); // < 32
        const float am = __shfl_sync(0xffffffffu, my_am, rel);
        if (e0 + U <= n) {
            uint32_t off[8];
            unpack8<ASM>(w[q], off);
            float v[U];
#pragma unroll
            for (int i = 0; i < U; i++)
                v[i] = mul_value<ASM>(table_at(s_tbl, off[i]), am);
            uint4 o;
            if constexpr (sizeof(T) == 4) {
                o = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                               __float_as_uint(v[3]));
            } else {
                o = make_uint4(Out<T>::pack2(v[0], v[1]), Out<T>::pack2(v[2], v[3]),
                               Out<T>::pack2(v[4], v[5]), Out<T>::pack2(v[6], v[7]));
            }
            st_out16<STH>(out + e0 * sizeof(T), o);
        } else if (e0 < n) {
            // Tail: the one unit that crosses n, element by element.
            for (uint64_t e = e0; e < n; e++) {
                uint32_t byte = j.packed[e / 2];
                uint32_t nib = (e & 1) ? (byte & 15u) : (byte >> 4);
                Out<T>::store1(out + e * sizeof(T), mul_value<ASM>(s_tbl[nib], am));
            }
        }
    }
}

// ---- launcher -------------------------------------------------------------------

static uint32_t log2u(uint64_t v)
{
    uint32_t r = 0;
    while ((1ull << r) < v)
        r++;
    return r;
}

template <typename T, int QT, int EPT, bool NESTED, bool HINTS, bool STH, int ASM>
static int launch_one(const dev_job &j, launch_cfg cfg, cudaStream_t stream)
{
    const uint64_t warps = CEIL_DIV(j.n, (uint64_t)(32 * EPT));
    const uint64_t blocks = CEIL_DIV(warps, (uint64_t)(cfg.threads / 32));
    if (blocks > 0x7fffffffull)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "tensor too large for one launch (%llu elements)",
                        (unsigned long long)j.n);
    dequant4_kernel<T, QT, EPT, NESTED, HINTS, STH, ASM>
        <<<(unsigned)blocks, cfg.threads, 0, stream>>>(j, log2u(j.blocksize), log2u(j.nested_blocksize));
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}

// Every variant for the bench's case (NF4, double quant, fp16/bf16); for everything
// else the default kernel (cache hints, C value path), with or without streaming stores.
template <typename T, int QT, int EPT, bool NESTED>
static int launch_variant(const dev_job &j, launch_cfg cfg, unsigned variant, cudaStream_t stream)
{
    // ASM bits: DEFAULT_ASM unless the variant asks for the asm value path.
    const int asm_bits = !NF4DEQ_ASM                          ? 0
                         : (variant & GPU_VARIANT_ASM_VALUE) ? ASM_UNPACK | ASM_MUL
                         : (variant & GPU_VARIANT_ASM_MUL)   ? ASM_MUL
                                                             : DEFAULT_ASM;
    const bool hints_on = !(variant & GPU_VARIANT_NO_HINTS);
    const bool st_hint = cfg.store_hint && hints_on && !(variant & GPU_VARIANT_NO_STORE_HINT);
    if constexpr (QT == QT_NF4 && NESTED && sizeof(T) == 2) {
#define NF4_LAUNCH_ASM(H, S)                                                                       \
    switch (asm_bits) {                                                                            \
    case ASM_UNPACK | ASM_MUL: return launch_one<T, QT, EPT, NESTED, H, S, ASM_UNPACK | ASM_MUL>(j, cfg, stream); \
    case ASM_MUL: return launch_one<T, QT, EPT, NESTED, H, S, ASM_MUL>(j, cfg, stream);          \
    default: return launch_one<T, QT, EPT, NESTED, H, S, 0>(j, cfg, stream);                     \
    }
        if (hints_on && st_hint)
            NF4_LAUNCH_ASM(true, true)
        if (hints_on)
            NF4_LAUNCH_ASM(true, false)
        NF4_LAUNCH_ASM(false, false)
#undef NF4_LAUNCH_ASM
    } else {
        if (st_hint)
            return launch_one<T, QT, EPT, NESTED, true, true, DEFAULT_ASM>(j, cfg, stream);
        return launch_one<T, QT, EPT, NESTED, true, false, DEFAULT_ASM>(j, cfg, stream);
    }
}

template <typename T, int QT, bool NESTED>
static int launch_ept(const dev_job &j, launch_cfg cfg, unsigned variant, cudaStream_t stream)
{
    switch (cfg.ept) {
    case 16: return launch_variant<T, QT, 16, NESTED>(j, cfg, variant, stream);
    case 32: return launch_variant<T, QT, 32, NESTED>(j, cfg, variant, stream);
    default: return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad elements per thread %d", cfg.ept);
    }
}

template <typename T>
static int launch_type(const dev_job &j, launch_cfg cfg, unsigned variant, cudaStream_t stream)
{
    const bool nested = j.absmax_code != NULL;
    if (j.quant_type == QUANT_NF4)
        return nested ? launch_ept<T, QT_NF4, true>(j, cfg, variant, stream)
                      : launch_ept<T, QT_NF4, false>(j, cfg, variant, stream);
    return nested ? launch_ept<T, QT_FP4, true>(j, cfg, variant, stream)
                  : launch_ept<T, QT_FP4, false>(j, cfg, variant, stream);
}

static bool is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

int nf4_launch_dequant(const dev_job *j, launch_cfg cfg, unsigned variant, cudaStream_t stream)
{
    if (j->n == 0)
        return NF4_OK;
    if (!is_pow2(j->blocksize) || j->blocksize < NF4_MIN_BLOCKSIZE || j->blocksize > NF4_MAX_BLOCKSIZE)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad blocksize %u", j->blocksize);
    if (j->absmax_code && (!is_pow2(j->nested_blocksize) || !j->nested_absmax || !j->nested_code))
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad double-quant state");
    if (!j->absmax_code && !j->absmax)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "no absmax");
    if (((uintptr_t)j->packed | (uintptr_t)j->out) & 15u)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "device buffers must be 16-byte aligned");
    if (cfg.threads < 32 || cfg.threads > 1024 || cfg.threads % 32)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad threads per block %d", cfg.threads);
    switch (j->out_dtype) {
    case DT_F16: return launch_type<half>(*j, cfg, variant, stream);
    case DT_BF16: return launch_type<__nv_bfloat16>(*j, cfg, variant, stream);
    case DT_F32: return launch_type<float>(*j, cfg, variant, stream);
    default: return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad output dtype %d", (int)j->out_dtype);
    }
}

// ---- per-architecture launch table ------------------------------------------------
// Chosen from measurements (docs/KERNEL-NOTES.md). sm_75 (T4): 1024-element tiles.

struct arch_entry {
    int major, minor;
    uint64_t small_max_n; // jobs up to this many elements use `small`
    launch_cfg small, large;
};
// {elements per lane, threads per CTA, streaming stores}
static const arch_entry ARCH_TABLE[] = {
    // T4: 64 threads x 16 elements = 1024-element CTA tiles.
    {7, 5, 0, {16, 64, 1}, {16, 64, 1}},
    // Ampere / Ada: not measured; the Hopper choice.
    {8, 0, 0, {32, 64, 1}, {32, 64, 1}},
    {8, 6, 0, {32, 64, 1}, {32, 64, 1}},
    {8, 9, 0, {32, 64, 1}, {32, 64, 1}},
    // H100 / H200, measured (docs/KERNEL-NOTES.md): 32 x 64 was best or within 1% of
    // the best at every bench size; streaming stores won at every size (plain stores,
    // which leave the output in L2, did not help even where it fits).
    {9, 0, 0, {32, 64, 1}, {32, 64, 1}},
};

launch_cfg nf4_pick_cfg(int major, int minor, uint64_t n)
{
    const arch_entry *best = &ARCH_TABLE[0];
    for (const arch_entry &a : ARCH_TABLE)
        if (a.major < major || (a.major == major && a.minor <= minor))
            best = &a;
    return n <= best->small_max_n ? best->small : best->large;
}

// ---- src/gpu.h ----------------------------------------------------------------

extern "C" int gpu_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

extern "C" int gpu_open(struct gpu_ctx **out, int device, uint64_t mem_budget)
{
    *out = NULL;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    if (count == 0)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "no CUDA device found");
    if (device < 0 || device >= count)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "CUDA device %d does not exist (%d found)", device, count);
    cudaCheck(cudaSetDevice(device));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    if (prop.major * 10 + prop.minor < 75)
        return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "%s is sm_%d%d; nf4deq needs sm_75 or newer",
                        prop.name, prop.major, prop.minor);
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));

    gpu_ctx *c = (gpu_ctx *)calloc(1, sizeof *c);
    if (!c)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
    c->device = device;
    c->major = prop.major;
    c->minor = prop.minor;
    c->sm_count = prop.multiProcessorCount;
    c->l2_bytes = (size_t)prop.l2CacheSize;
    c->budget = mem_budget ? mem_budget : (uint64_t)(free_b * DEFAULT_BUDGET_FRACTION);
    c->subchunk_cap = SUBCHUNK_CAP_ELEMS;
    snprintf(c->name, sizeof c->name, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
    for (int s = 0; s < NUM_STREAMS; s++) {
        err = cudaStreamCreateWithFlags(&c->streams[s], cudaStreamNonBlocking);
        if (err != cudaSuccess) {
            gpu_close(c);
            return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaStreamCreate: %s", cudaGetErrorString(err));
        }
    }
    err = cudaMalloc(&c->d_code, NESTED_CODE_ENTRIES * sizeof(float));
    if (err != cudaSuccess) {
        gpu_close(c);
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc: %s", cudaGetErrorString(err));
    }
    *out = c;
    return NF4_OK;
}

extern "C" void gpu_close(struct gpu_ctx *c)
{
    if (!c)
        return;
    cudaSetDevice(c->device);
    for (int s = 0; s < NUM_STREAMS; s++) {
        if (c->streams[s]) {
            cudaStreamSynchronize(c->streams[s]);
            cudaStreamDestroy(c->streams[s]);
        }
        if (c->slots[s].mem)
            cudaFree(c->slots[s].mem);
    }
    if (c->d_code)
        cudaFree(c->d_code);
    cudaGetLastError();
    free(c);
}

extern "C" const char *gpu_name(const struct gpu_ctx *c) { return c->name; }
extern "C" uint64_t gpu_mem_budget(const struct gpu_ctx *c) { return c->budget; }
extern "C" void gpu_set_subchunk_limit(struct gpu_ctx *c, uint64_t max_elems) { c->subchunk_cap = max_elems; }
extern "C" uint64_t gpu_last_subchunks(const struct gpu_ctx *c) { return c->last_subchunks; }

// Host allocations carry a header saying whether they are pinned.
#define HOST_HDR 64
extern "C" void *gpu_host_alloc(struct gpu_ctx *c, size_t bytes)
{
    (void)c;
    char *p = NULL;
    if (cudaHostAlloc((void **)&p, bytes + HOST_HDR, cudaHostAllocDefault) == cudaSuccess) {
        p[0] = 1;
        return p + HOST_HDR;
    }
    cudaGetLastError();
    p = (char *)malloc(bytes + HOST_HDR);
    if (!p)
        return NULL;
    p[0] = 0;
    return p + HOST_HDR;
}

extern "C" void gpu_host_free(struct gpu_ctx *c, void *ptr)
{
    (void)c;
    if (!ptr)
        return;
    char *p = (char *)ptr - HOST_HDR;
    if (p[0] == 1)
        cudaFreeHost(p);
    else
        free(p);
}

static size_t out_size(enum st_dtype dt) { return dt == DT_F32 ? 4 : 2; }
static size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

struct slot_layout {
    size_t packed, codes, scales, out, total; // byte offsets / sizes
};

static slot_layout layout_for(const dequant_job *j, uint64_t sub_n)
{
    slot_layout L;
    uint64_t blocks = CEIL_DIV(sub_n, (uint64_t)j->blocksize);
    uint64_t scales = j->absmax_code ? CEIL_DIV(blocks, (uint64_t)j->nested_blocksize) : blocks;
    size_t off = 0;
    L.packed = off; off += align256(CEIL_DIV(sub_n, 2ull));
    L.codes = off; off += j->absmax_code ? align256(blocks) : 0;
    L.scales = off; off += align256(scales * sizeof(float));
    L.out = off; off += align256(sub_n * out_size(j->out_dtype));
    L.total = off;
    return L;
}

static int ensure_slot(gpu_ctx *c, int s, size_t bytes)
{
    if (c->slots[s].bytes >= bytes)
        return NF4_OK;
    if (c->slots[s].mem) {
        cudaCheck(cudaFree(c->slots[s].mem));
        c->slots[s].mem = NULL;
        c->slots[s].bytes = 0;
    }
    cudaError_t err = cudaMalloc(&c->slots[s].mem, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        c->slots[s].mem = NULL;
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cudaMalloc of %zu bytes failed: %s", bytes,
                        cudaGetErrorString(err));
    }
    c->slots[s].bytes = bytes;
    return NF4_OK;
}

static int run_pipeline(gpu_ctx *c, const dequant_job *j, unsigned variant, launch_cfg cfg)
{
    const bool nested = j->absmax_code != NULL;
    const uint64_t granule = (uint64_t)j->blocksize * (nested ? j->nested_blocksize : 1u);
    const size_t osz = out_size(j->out_dtype);

    // Sub-chunk: what two slots of the budget hold, capped so big jobs pipeline.
    double per_elem = 0.5 + (double)osz + (nested ? 1.0 : 4.0) / j->blocksize;
    uint64_t sub_n = (uint64_t)((double)(c->budget / NUM_STREAMS) / per_elem);
    if (c->subchunk_cap && sub_n > c->subchunk_cap)
        sub_n = c->subchunk_cap;
    sub_n = sub_n / granule * granule;
    if (sub_n < granule)
        sub_n = granule;
    if (sub_n >= j->n)
        sub_n = j->n;

    slot_layout L = layout_for(j, sub_n);
    int nslots = sub_n < j->n ? NUM_STREAMS : 1;
    for (int s = 0; s < nslots; s++) {
        int rc = ensure_slot(c, s, L.total);
        if (rc)
            return rc;
    }
    if (nested) {
        // The kernels run on non-blocking streams, which would not wait for a
        // copy on the legacy stream (and a pageable-source cudaMemcpy may return
        // before its DMA lands): queue the table on stream 0 and make every
        // other stream wait for it.
        cudaCheck(cudaMemcpyAsync(c->d_code, j->nested_code, NESTED_CODE_ENTRIES * sizeof(float),
                                  cudaMemcpyHostToDevice, c->streams[0]));
        if (nslots > 1) {
            cudaEvent_t table_ready;
            cudaCheck(cudaEventCreateWithFlags(&table_ready, cudaEventDisableTiming));
            cudaError_t err = cudaEventRecord(table_ready, c->streams[0]);
            for (int s = 1; s < nslots && err == cudaSuccess; s++)
                err = cudaStreamWaitEvent(c->streams[s], table_ready, 0);
            cudaEventDestroy(table_ready);
            cudaCheck(err);
        }
    }

    c->last_subchunks = 0;
    for (uint64_t start = 0, i = 0; start < j->n; start += sub_n, i++) {
        const int s = (int)(i % nslots);
        cudaStream_t st = c->streams[s];
        char *mem = (char *)c->slots[s].mem;
        const uint64_t cnt = j->n - start < sub_n ? j->n - start : sub_n;
        const uint64_t blk0 = start / j->blocksize, blocks = CEIL_DIV(cnt, (uint64_t)j->blocksize);

        dev_job d;
        memset(&d, 0, sizeof d);
        d.n = cnt;
        d.blocksize = j->blocksize;
        d.nested_blocksize = j->nested_blocksize;
        d.quant_type = j->quant_type;
        d.out_dtype = j->out_dtype;
        d.nested_offset = j->nested_offset;
        d.packed = (const uint8_t *)(mem + L.packed);
        d.out = mem + L.out;
        cudaCheck(cudaMemcpyAsync(mem + L.packed, j->packed + start / 2, CEIL_DIV(cnt, 2ull),
                                  cudaMemcpyHostToDevice, st));
        if (nested) {
            const uint64_t nb0 = blk0 / j->nested_blocksize, nbs = CEIL_DIV(blocks, (uint64_t)j->nested_blocksize);
            d.absmax_code = (const uint8_t *)(mem + L.codes);
            d.nested_absmax = (const float *)(mem + L.scales);
            d.nested_code = c->d_code;
            cudaCheck(cudaMemcpyAsync(mem + L.codes, j->absmax_code + blk0, blocks, cudaMemcpyHostToDevice, st));
            cudaCheck(cudaMemcpyAsync(mem + L.scales, j->nested_absmax + nb0, nbs * sizeof(float),
                                      cudaMemcpyHostToDevice, st));
        } else {
            d.absmax = (const float *)(mem + L.scales);
            cudaCheck(cudaMemcpyAsync(mem + L.scales, j->absmax + blk0, blocks * sizeof(float),
                                      cudaMemcpyHostToDevice, st));
        }
        // Poison the device output first: an element the kernel failed to write
        // shows up as 0xA5A5 instead of stale data from an earlier sub-chunk.
        cudaCheck(cudaMemsetAsync(mem + L.out, 0xA5, cnt * osz, st));
        int rc = nf4_launch_dequant(&d, cfg, variant, st);
        if (rc)
            return rc;
        cudaCheck(cudaMemcpyAsync((char *)j->out + start * osz, mem + L.out, cnt * osz,
                                  cudaMemcpyDeviceToHost, st));
        c->last_subchunks++;
    }
    for (int s = 0; s < nslots; s++)
        cudaCheck(cudaStreamSynchronize(c->streams[s]));
    return NF4_OK;
}

extern "C" int gpu_dequant_ex(struct gpu_ctx *c, const struct dequant_job *j, unsigned variant, int ept,
                              int threads)
{
    if (j->n == 0)
        return NF4_OK;
    if (!is_pow2(j->blocksize) || j->blocksize < NF4_MIN_BLOCKSIZE || j->blocksize > NF4_MAX_BLOCKSIZE)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad blocksize %u", j->blocksize);
    if (j->absmax_code && !is_pow2(j->nested_blocksize))
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad nested blocksize %u", j->nested_blocksize);
    cudaCheck(cudaSetDevice(c->device));
    launch_cfg cfg = nf4_pick_cfg(c->major, c->minor, j->n);
    if (ept)
        cfg.ept = ept;
    if (threads)
        cfg.threads = threads;
    int rc = run_pipeline(c, j, variant, cfg);
    if (rc) {
        // Leave nothing in flight that still reads or writes the caller's buffers.
        for (int s = 0; s < NUM_STREAMS; s++)
            cudaStreamSynchronize(c->streams[s]);
        cudaGetLastError();
    }
    return rc;
}

extern "C" int gpu_dequant(struct gpu_ctx *c, const struct dequant_job *j)
{
    return gpu_dequant_ex(c, j, 0, 0, 0);
}
