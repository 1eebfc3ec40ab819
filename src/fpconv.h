/* Scalar float conversions with the exact rounding bitsandbytes' CUDA kernels use.
 *
 * Narrowing is round-to-nearest-even with IEEE subnormals, overflow to +-inf, and
 * NaN mapped to the canonical 0x7fff that cvt.rn.f16.f32 / cvt.rn.bf16.f32
 * produce on the GPU, so CPU and GPU output match byte for byte. Header-only so
 * the dequantization loops inline them. */
#ifndef NF4DEQ_FPCONV_H
#define NF4DEQ_FPCONV_H

#include <stdint.h>
#include <string.h>

#include "dtype.h"

#define FP16_CANONICAL_NAN UINT16_C(0x7fff)
#define BF16_CANONICAL_NAN UINT16_C(0x7fff)

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bitsandbytes builds its CUDA code with --use_fast_math, so its multiplies are
 * mul.ftz.f32: subnormal inputs and results become zero of the same sign. The
 * offset add that follows runs in PyTorch's own kernel, with IEEE subnormals. */
static inline float f32_flush_subnormal(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7f800000u) == 0)
        return f32_from_bits(u & 0x80000000u);
    return f;
}

static inline float mul_ftz(float a, float b)
{
    return f32_flush_subnormal(f32_flush_subnormal(a) * f32_flush_subnormal(b));
}

/* GPU arithmetic returns one canonical NaN whatever the operands' payloads. */
static inline uint32_t f32_canonical_bits(float f)
{
    uint32_t u = f32_bits(f);
    return ((u & 0x7fffffffu) > 0x7f800000u) ? UINT32_C(0x7fffffff) : u;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return BF16_CANONICAL_NAN;
    /* Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into
     * the exponent is exactly the right overflow (to the next binade or inf). */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return FP16_CANONICAL_NAN;
    if (a >= 0x477ff000u) /* >= 65520: rounds to inf (and inf stays inf) */
        return sign | 0x7c00u;
    if (a >= 0x38800000u) { /* normal in fp16: exponent >= -14 */
        uint32_t mant_rounded = a + 0xfffu + ((a >> 13) & 1u);
        return sign | (uint16_t)((mant_rounded - 0x38000000u) >> 13);
    }
    if (a < 0x33000000u) /* below half the smallest subnormal (2^-25): +-0 */
        return sign;
    /* Subnormal: shift the full significand into place with RNE on the bits lost. */
    uint32_t exp = a >> 23;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp; /* 14..24 */
    uint32_t kept = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (kept & 1u)))
        kept++;
    return sign | (uint16_t)kept;
}

static inline float bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f)
        return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0)
            return f32_from_bits(sign);
        /* Subnormal: value is mant * 2^-24, exact in fp32. */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Element i of an F16, BF16, F32 or F64 array, as fp32 (F64 narrows as a C cast
 * does, to nearest even, as PyTorch's CPU cast does). */
static inline float f32_from_element(enum st_dtype dt, const void *p, uint64_t i)
{
    switch (dt) {
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_F64: return (float)((const double *)p)[i];
    default: return ((const float *)p)[i];
    }
}

/* Stores m into element i of an F16, BF16 or F32 array (nearest even, NaN
 * canonical); returns 1 if a finite value became infinite. */
static inline int f32_to_element(enum st_dtype dt, void *p, uint64_t i, float m)
{
    uint32_t bits;
    switch (dt) {
    case DT_F16:
        bits = f32_to_f16(m);
        ((uint16_t *)p)[i] = (uint16_t)bits;
        return (bits & 0x7fffu) == 0x7c00u && (f32_bits(m) & 0x7fffffffu) < 0x7f800000u;
    case DT_BF16:
        bits = f32_to_bf16(m);
        ((uint16_t *)p)[i] = (uint16_t)bits;
        return (bits & 0x7fffu) == 0x7f80u && (f32_bits(m) & 0x7fffffffu) < 0x7f800000u;
    default:
        bits = f32_canonical_bits(m);
        memcpy((float *)p + i, &bits, 4);
        return 0;
    }
}

/* Whether element i of an F16, BF16 or F32 array is infinite. */
static inline int element_is_inf(enum st_dtype dt, const void *p, uint64_t i)
{
    switch (dt) {
    case DT_F16: return (((const uint16_t *)p)[i] & 0x7fffu) == 0x7c00u;
    case DT_BF16: return (((const uint16_t *)p)[i] & 0x7fffu) == 0x7f80u;
    default: return (f32_bits(((const float *)p)[i]) & 0x7fffffffu) == 0x7f800000u;
    }
}

/* Casts count elements of dtype `from` (F16, BF16, F32 or F64) at `in` to
 * `to` (F16, BF16 or F32) at `out`, each rounded to nearest even as PyTorch
 * casts; returns how many finite values became infinite. */
static inline uint64_t cast_elements(enum st_dtype from, enum st_dtype to, const void *in, void *out, uint64_t count)
{
    uint64_t overflowed = 0;
    for (uint64_t i = 0; i < count; i++) {
        float f = f32_from_element(from, in, i);
        int finite;
        if (from == DT_F64) {
            double d = ((const double *)in)[i];
            finite = d - d == 0;
        } else {
            finite = f - f == 0;
        }
        uint32_t bits;
        int inf;
        switch (to) {
        case DT_F16:
            bits = f32_to_f16(f);
            ((uint16_t *)out)[i] = (uint16_t)bits;
            inf = (bits & 0x7fffu) == 0x7c00u;
            break;
        case DT_BF16:
            bits = f32_to_bf16(f);
            ((uint16_t *)out)[i] = (uint16_t)bits;
            inf = (bits & 0x7fffu) == 0x7f80u;
            break;
        default:
            ((float *)out)[i] = f;
            inf = (f32_bits(f) & 0x7fffffffu) == 0x7f800000u;
            break;
        }
        if (inf && finite)
            overflowed++;
    }
    return overflowed;
}

#endif
