// Launching the fused kernel: the compile-time dispatch from a job's output type,
// quantization type, tile size and variant to one kernel instantiation, and the
// per-architecture table that picks the tile size. The kernel itself is in
// cuda/dequant_kernel.cuh, included first.
#include "dequant_kernel.cuh"

// The inline-asm steps of the nibble->value path the default kernel uses. Measured
// on H200 (docs/KERNEL-NOTES.md): the CUDA C path was 2-4% faster on mid and large
// tensors and equal on small ones, so the default is C; the asm path stays as a
// bench variant (GPU_VARIANT_ASM_VALUE / _ASM_MUL). The one exception is the asm
// multiply, which the per-architecture table can pick by size (launch_cfg.asm_mul).
// The cache-hint asm helps and stays.
#define DEFAULT_ASM 0

// ---- launcher -------------------------------------------------------------------

// Bulk-store variants stage a warp tile per warp in dynamic shared memory; kept
// under the 48 KiB a launch gets without opting in (cudaFuncSetAttribute).
#define BULK_MAX_STAGE_BYTES (48u << 10)

template <typename T, int QT, int EPT, bool NESTED, bool HINTS, bool STH, int ASM, int BULK = BULK_NONE,
          int VALUES = VALUES_SHARED, bool PDL = false>
static int launch_one(const dev_job &j, launch_cfg cfg, cudaStream_t stream)
{
    const uint64_t warps = CEIL_DIV(j.n, (uint64_t)(32 * EPT));
    const uint64_t blocks = CEIL_DIV(warps, (uint64_t)(cfg.threads / 32));
    if (blocks > 0x7fffffffull)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "tensor too large for one launch (%llu elements)",
                        (unsigned long long)j.n);
    const size_t stage = BULK != BULK_NONE ? (size_t)cfg.threads * EPT * sizeof(T) : 0;
    if (stage > BULK_MAX_STAGE_BYTES)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bulk stores: %d threads x %d elements stage more than 48 KiB",
                        cfg.threads, EPT);
    const uint32_t bs_log2 = log2u(j.blocksize), nbs_log2 = log2u(j.nested_blocksize);
    if constexpr (PDL) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3((unsigned)blocks);
        lc.blockDim = dim3((unsigned)cfg.threads);
        lc.dynamicSmemBytes = stage;
        lc.stream = stream;
        lc.attrs = attr;
        lc.numAttrs = 1;
        cudaCheck(cudaLaunchKernelEx(&lc, dequant4_kernel<T, QT, EPT, NESTED, HINTS, STH, ASM, BULK, VALUES, PDL>, j,
                                     bs_log2, nbs_log2));
    } else {
        dequant4_kernel<T, QT, EPT, NESTED, HINTS, STH, ASM, BULK, VALUES, PDL>
            <<<(unsigned)blocks, cfg.threads, stage, stream>>>(j, bs_log2, nbs_log2);
    }
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}

// The code values in the lanes (VALUES_SHUFFLE, or VALUES_OUTPUTS where the output is
// 16-bit), with cache hints, and streaming stores or not; launched as a programmatic
// dependent where the configuration says so.
template <typename T, int QT, int EPT, bool NESTED, int ASM, int VALUES>
static int launch_lanes(const dev_job &j, launch_cfg cfg, bool st_hint, cudaStream_t stream)
{
    if (st_hint && cfg.pdl)
        return launch_one<T, QT, EPT, NESTED, true, true, ASM, BULK_NONE, VALUES, true>(j, cfg, stream);
    if (st_hint)
        return launch_one<T, QT, EPT, NESTED, true, true, ASM, BULK_NONE, VALUES>(j, cfg, stream);
    return launch_one<T, QT, EPT, NESTED, true, false, ASM, BULK_NONE, VALUES>(j, cfg, stream);
}

// VALUES_OUTPUTS needs a 16-bit output and two blocks per half-warp at most (a
// block of 64 elements or more); every other job reads the values by shuffle.
template <typename T, int QT, int EPT, bool NESTED, int ASM>
static int launch_shuffle(const dev_job &j, launch_cfg cfg, int values, bool st_hint, cudaStream_t stream)
{
    if constexpr (sizeof(T) == 2) {
        if (values == VALUES_OUTPUTS && j.blocksize >= OUTPUTS_MIN_BLOCKSIZE)
            return launch_lanes<T, QT, EPT, NESTED, ASM, VALUES_OUTPUTS>(j, cfg, st_hint, stream);
    }
    return launch_lanes<T, QT, EPT, NESTED, ASM, VALUES_SHUFFLE>(j, cfg, st_hint, stream);
}

// Every variant for the bench's case (NF4, double quant, fp16/bf16); for everything
// else the default kernel (cache hints, C value path), with or without streaming stores.
template <typename T, int QT, int EPT, bool NESTED>
static int launch_variant(const dev_job &j, launch_cfg cfg, unsigned variant, cudaStream_t stream)
{
    constexpr bool ASM_KERNELS = asm_kernel_case(QT == QT_NF4, NESTED, sizeof(T));
    // ASM bits: what a variant asks for, else the configuration's multiply.
    const int asm_bits = !NF4DEQ_ASM                          ? 0
                         : (variant & GPU_VARIANT_ASM_VALUE) ? ASM_UNPACK | ASM_MUL
                         : (variant & GPU_VARIANT_ASM_MUL)   ? ASM_MUL
                         : (variant & GPU_VARIANT_C_MUL)     ? DEFAULT_ASM
                         : (cfg.asm_mul && ASM_KERNELS)      ? ASM_MUL
                                                             : DEFAULT_ASM;
    const bool hints_on = !(variant & GPU_VARIANT_NO_HINTS);
    const bool st_hint = cfg.store_hint && hints_on && !(variant & GPU_VARIANT_NO_STORE_HINT);
    // Bulk stores (every type; hinted loads, the default value path). The
    // units a bulk tile does not cover still take streaming stores.
    if (variant & GPU_VARIANT_BULK_EVICT_FIRST)
        return launch_one<T, QT, EPT, NESTED, true, true, DEFAULT_ASM, BULK_EVICT_FIRST>(j, cfg, stream);
    if (variant & GPU_VARIANT_BULK_STORE)
        return launch_one<T, QT, EPT, NESTED, true, true, DEFAULT_ASM, BULK_PLAIN>(j, cfg, stream);
    // The value table in the lanes (the configuration's choice, or forced either way
    // by a bench variant): with cache hints, and the C or (where asm kernels exist)
    // the asm multiply.
    const int values = (variant & GPU_VARIANT_OUTPUT_VALUES)    ? VALUES_OUTPUTS
                       : (variant & GPU_VARIANT_SHUFFLE_VALUES) ? VALUES_SHUFFLE
                       : (variant & GPU_VARIANT_SHARED_VALUES)  ? VALUES_SHARED
                                                                : cfg.values;
    const bool shuffle = values != VALUES_SHARED;
    if (shuffle && hints_on && asm_bits == DEFAULT_ASM)
        return launch_shuffle<T, QT, EPT, NESTED, DEFAULT_ASM>(j, cfg, values, st_hint, stream);
    if constexpr (ASM_KERNELS) {
        if (shuffle && hints_on && asm_bits == ASM_MUL)
            return launch_shuffle<T, QT, EPT, NESTED, ASM_MUL>(j, cfg, values, st_hint, stream);
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

// sm_90: jobs of up to 5 Mi elements (a 5120 x 1024 projection) take the asm multiply.
#define SM90_ASM_MUL_MAX_N (5ull << 20)

struct arch_entry {
    int major, minor;
    uint64_t small_max_n; // jobs up to this many elements use `small`
    launch_cfg small, large;
};
// {elements per lane, threads per CTA, streaming stores, values (VALUES_*), asm multiply}
static const arch_entry ARCH_TABLE[] = {
    // T4: 64 threads x 16 elements = 1024-element CTA tiles.
    {7, 5, 0, {16, 64, 1, VALUES_SHARED, 0}, {16, 64, 1, VALUES_SHARED, 0}},
    // Ampere / Ada: not measured; the Hopper tile, and the shared value table.
    {8, 0, 0, {32, 64, 1, VALUES_SHARED, 0}, {32, 64, 1, VALUES_SHARED, 0}},
    {8, 6, 0, {32, 64, 1, VALUES_SHARED, 0}, {32, 64, 1, VALUES_SHARED, 0}},
    {8, 9, 0, {32, 64, 1, VALUES_SHARED, 0}, {32, 64, 1, VALUES_SHARED, 0}},
    // H100 / H200, measured (docs/KERNEL-NOTES.md): 32 x 64 was best or within 1% of
    // the best at every bench size; streaming stores won at every size (plain stores,
    // which leave the output in L2, did not help even where it fits); values by
    // shuffle were 4% faster at 10 MB and no slower at any larger size. With the
    // shuffle, the asm multiply is 2-5% faster up to 5 Mi elements, even at 5.25 Mi,
    // and 2-8% slower from 6 Mi up (why was not established): hence the small
    // configuration.
    // Each block's outputs by shuffle (VALUES_OUTPUTS) were slower at every size, 4%
    // at 10 MB (2026-11-26): 13% more instructions than this path with the asm
    // multiply, and every value shuffle waits for the block's absmax there.
    {9, 0, SM90_ASM_MUL_MAX_N, {32, 64, 1, VALUES_SHUFFLE, 1}, {32, 64, 1, VALUES_SHUFFLE, 0}},
};

launch_cfg nf4_pick_cfg(int major, int minor, uint64_t n)
{
    const arch_entry *best = &ARCH_TABLE[0];
    for (const arch_entry &a : ARCH_TABLE)
        if (a.major < major || (a.major == major && a.minor <= minor))
            best = &a;
    return n <= best->small_max_n ? best->small : best->large;
}
