/* fp32 -> fp16 / bf16 narrowing and the fp32 helpers of fpconv.h.
 *
 * The output must match the GPU's cvt.rn.* instructions bit for bit, so every
 * rounding boundary is pinned down by exact bit patterns, and two sweeps compare
 * against references that share no code with fpconv.h: gcc's own _Float16
 * conversion (libgcc's soft-float RNE) and a distance-in-double bf16 rounder. */
#include <float.h>
#include <math.h>

#include "fpconv.h"
#include "test_util.h"

#define F(bits) f32_from_bits(UINT32_C(bits))

/* A prime stride visits every exponent and a spread of mantissas in ~17M steps. */
#define SWEEP_STRIDE 251u

static int f32_is_nan_bits(uint32_t u)
{
    return (u & 0x7fffffffu) > 0x7f800000u;
}

static void expect_f16(float in, uint16_t want)
{
    uint16_t got = f32_to_f16(in);
    if (got != want)
        fail_msg("f32_to_f16(0x%08x = %a) = 0x%04x, expected 0x%04x", f32_bits(in), (double)in, got, want);
}

static void expect_bf16(float in, uint16_t want)
{
    uint16_t got = f32_to_bf16(in);
    if (got != want)
        fail_msg("f32_to_bf16(0x%08x = %a) = 0x%04x, expected 0x%04x", f32_bits(in), (double)in, got, want);
}

/* ---- fp16 special values ---- */

static void test_f16_signed_zeros_and_infinities(void **state)
{
    (void)state;
    expect_f16(0.0f, 0x0000);
    expect_f16(-0.0f, 0x8000);
    expect_f16(INFINITY, 0x7c00);
    expect_f16(-INFINITY, 0xfc00);
}

static void test_f16_nan_is_canonical_whatever_the_payload_or_sign(void **state)
{
    (void)state;
    static const uint32_t NANS[] = {0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
                                    0x7fbfffff, 0xffffffff, 0x7fffffff, 0x7fc01234};
    for (size_t i = 0; i < sizeof NANS / sizeof NANS[0]; i++)
        expect_f16(f32_from_bits(NANS[i]), FP16_CANONICAL_NAN);
}

static void test_f16_largest_finite_and_overflow_boundary(void **state)
{
    (void)state;
    expect_f16(65504.0f, 0x7bff);
    expect_f16(-65504.0f, 0xfbff);
    assert_true(f16_to_f32(0x7bff) == 65504.0f);
    /* 65520 is exactly halfway between 65504 and the next binade (2^16): the
     * even neighbour is 2^16, which does not exist, so it is inf. */
    expect_f16(F(0x477fefff), 0x7bff); /* 65519.996: just below the tie */
    expect_f16(65520.0f, 0x7c00);
    expect_f16(-65520.0f, 0xfc00);
    expect_f16(F(0x477ff001), 0x7c00);
    expect_f16(65536.0f, 0x7c00);
    expect_f16(FLT_MAX, 0x7c00);
    expect_f16(-FLT_MAX, 0xfc00);
    /* A tie whose even neighbour is finite stays finite: 65488 lies between
     * 65472 (mantissa 0x3fe, even) and 65504 (0x3ff). */
    expect_f16(65488.0f, 0x7bfe);
}

static void test_f16_smallest_subnormal_and_half_of_it(void **state)
{
    (void)state;
    expect_f16(0x1p-24f, 0x0001);
    expect_f16(-0x1p-24f, 0x8001);
    /* 2^-25 is the tie between 0 and 2^-24; 0 is even. */
    expect_f16(0x1p-25f, 0x0000);
    expect_f16(-0x1p-25f, 0x8000);
    expect_f16(nextafterf(0x1p-25f, 1.0f), 0x0001);
    expect_f16(-nextafterf(0x1p-25f, 1.0f), 0x8001);
    expect_f16(nextafterf(0x1p-25f, 0.0f), 0x0000);
    expect_f16(0x1p-30f, 0x0000);
}

static void test_f16_fp32_subnormals_become_signed_zero(void **state)
{
    (void)state;
    expect_f16(F(0x00000001), 0x0000);
    expect_f16(F(0x007fffff), 0x0000);
    expect_f16(F(0x80000001), 0x8000);
    expect_f16(FLT_MIN, 0x0000);
}

static void test_f16_subnormal_ties_round_to_even(void **state)
{
    (void)state;
    /* 3 * 2^-25 = 1.5 units of 2^-24: even neighbour is 2 units = 2^-23. */
    expect_f16(3.0f * 0x1p-25f, 0x0002);
    /* 5 * 2^-25 = 2.5 units: even neighbour is 2 units. */
    expect_f16(5.0f * 0x1p-25f, 0x0002);
    expect_f16(7.0f * 0x1p-25f, 0x0004);
    expect_f16(-3.0f * 0x1p-25f, 0x8002);
    /* Just off a tie rounds to the nearer side. */
    expect_f16(nextafterf(5.0f * 0x1p-25f, 1.0f), 0x0003);
    expect_f16(nextafterf(3.0f * 0x1p-25f, 0.0f), 0x0001);
}

static void test_f16_largest_subnormal_and_rounding_into_normal_range(void **state)
{
    (void)state;
    expect_f16(1023.0f * 0x1p-24f, 0x03ff);
    assert_true(f16_to_f32(0x03ff) == 1023.0f * 0x1p-24f);
    /* 1023.5 units: the tie between 0x3ff (odd) and 0x400 = 2^-14 (even). */
    expect_f16(1023.5f * 0x1p-24f, 0x0400);
    expect_f16(nextafterf(1023.5f * 0x1p-24f, 0.0f), 0x03ff);
    expect_f16(nextafterf(0x1p-14f, 0.0f), 0x0400);
    expect_f16(0x1p-14f, 0x0400);
    expect_f16(-1023.5f * 0x1p-24f, 0x8400);
    /* 1022.5 units: tie between 0x3fe (even) and 0x3ff. */
    expect_f16(1022.5f * 0x1p-24f, 0x03fe);
}

static void test_f16_normal_range_ties_round_to_even(void **state)
{
    (void)state;
    expect_f16(1.0f, 0x3c00);
    expect_f16(1.0f + 0x1p-11f, 0x3c00);
    expect_f16(1.0f + 3.0f * 0x1p-11f, 0x3c02);
    expect_f16(nextafterf(1.0f + 0x1p-11f, 2.0f), 0x3c01);
    expect_f16(2049.0f, 0x6800); /* between 2048 and 2050 */
    expect_f16(2051.0f, 0x6802); /* between 2050 (odd mantissa) and 2052 */
    /* A tie that carries out of the mantissa into the next binade. */
    expect_f16(2.0f - 0x1p-12f, 0x4000);
    expect_f16(-1.0f - 3.0f * 0x1p-11f, 0xbc02);
}

static void test_f16_negative_values(void **state)
{
    (void)state;
    expect_f16(-1.0f, 0xbc00);
    expect_f16(-2.0f, 0xc000);
    expect_f16(-0.5f, 0xb800);
    expect_f16(-0x1p-14f, 0x8400);
    expect_f16(-3.140625f, 0xc248);
}

/* ---- bf16 special values ---- */

static void test_bf16_signed_zeros_infinities_and_nans(void **state)
{
    (void)state;
    expect_bf16(0.0f, 0x0000);
    expect_bf16(-0.0f, 0x8000);
    expect_bf16(INFINITY, 0x7f80);
    expect_bf16(-INFINITY, 0xff80);
    static const uint32_t NANS[] = {0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
                                    0x7f808000, 0x7fffffff, 0xffffffff, 0x7fbf0000};
    for (size_t i = 0; i < sizeof NANS / sizeof NANS[0]; i++)
        expect_bf16(f32_from_bits(NANS[i]), BF16_CANONICAL_NAN);
}

static void test_bf16_ties_round_to_even(void **state)
{
    (void)state;
    expect_bf16(F(0x3f808000), 0x3f80);
    expect_bf16(F(0x3f818000), 0x3f82);
    expect_bf16(F(0x3f808001), 0x3f81);
    expect_bf16(F(0x3f807fff), 0x3f80);
    expect_bf16(F(0xbf818000), 0xbf82);
    /* A tie that carries into the exponent. */
    expect_bf16(F(0x3fff8000), 0x4000);
}

static void test_bf16_overflow_to_infinity(void **state)
{
    (void)state;
    expect_bf16(FLT_MAX, 0x7f80);
    expect_bf16(-FLT_MAX, 0xff80);
    /* The tie above the largest bf16 (0x7f7f, odd) rounds to the even side, inf. */
    expect_bf16(F(0x7f7f8000), 0x7f80);
    expect_bf16(F(0x7f7f7fff), 0x7f7f);
    expect_bf16(F(0x7f7e8000), 0x7f7e);
}

static void test_bf16_keeps_and_rounds_fp32_subnormals(void **state)
{
    (void)state;
    expect_bf16(F(0x00010000), 0x0001);
    expect_bf16(F(0x00000001), 0x0000);
    expect_bf16(F(0x00008000), 0x0000); /* tie -> even 0 */
    expect_bf16(F(0x00018000), 0x0002); /* tie -> even 2 */
    expect_bf16(F(0x00008001), 0x0001);
    expect_bf16(F(0x80010000), 0x8001);
    /* The largest fp32 subnormal rounds up into the smallest normal. */
    expect_bf16(F(0x007fffff), 0x0080);
    expect_bf16(F(0x807fffff), 0x8080);
}

/* ---- sweeps against independent references ---- */

static void test_f16_matches_gcc_float16_on_a_strided_sweep(void **state)
{
    (void)state;
    uint64_t checked = 0;
    for (uint64_t i = 0; i <= UINT32_MAX; i += SWEEP_STRIDE) {
        uint32_t u = (uint32_t)i;
        if (f32_is_nan_bits(u))
            continue;
        float f = f32_from_bits(u);
        volatile float vf = f; /* keep the conversion at run time, in libgcc */
        _Float16 h = (_Float16)vf;
        uint16_t want;
        memcpy(&want, &h, sizeof want);
        uint16_t got = f32_to_f16(f);
        if (got != want)
            fail_msg("f32_to_f16(0x%08x) = 0x%04x, gcc _Float16 gives 0x%04x", u, got, want);
        checked++;
    }
    assert_true(checked > 16000000);
}

/* Rounds to bf16 by choosing between the two bf16 neighbours of f by distance,
 * computed exactly in double; ties go to the even mantissa. */
static uint16_t bf16_reference(uint32_t u)
{
    uint32_t lo = u & 0xffff0000u;
    if (lo == u)
        return (uint16_t)(u >> 16);
    double x = fabs((double)f32_from_bits(u));
    double below = fabs((double)f32_from_bits(lo));
    /* Above the largest finite bf16 the next step up is 2^128, spelled as inf. */
    uint32_t hi = lo + 0x10000u;
    double above = ((hi & 0x7f800000u) == 0x7f800000u) ? 0x1p128 : fabs((double)f32_from_bits(hi));
    double d_below = x - below, d_above = above - x;
    int up = d_above < d_below || (d_above == d_below && ((lo >> 16) & 1u));
    return (uint16_t)((up ? hi : lo) >> 16);
}

static void test_bf16_matches_a_distance_reference_on_a_strided_sweep(void **state)
{
    (void)state;
    uint64_t checked = 0;
    for (uint64_t i = 0; i <= UINT32_MAX; i += SWEEP_STRIDE) {
        uint32_t u = (uint32_t)i;
        if (f32_is_nan_bits(u))
            continue;
        uint16_t want = bf16_reference(u);
        uint16_t got = f32_to_bf16(f32_from_bits(u));
        if (got != want)
            fail_msg("f32_to_bf16(0x%08x) = 0x%04x, reference gives 0x%04x", u, got, want);
        checked++;
    }
    assert_true(checked > 16000000);
    /* The stride skips most ties; check the tie and its neighbours in every binade. */
    for (uint32_t hi16 = 0; hi16 < 0x10000u; hi16++) {
        uint32_t base = hi16 << 16;
        static const uint32_t LOWS[] = {0x7fff, 0x8000, 0x8001, 0xffff, 0x0001};
        for (size_t k = 0; k < sizeof LOWS / sizeof LOWS[0]; k++) {
            uint32_t u = base | LOWS[k];
            if (f32_is_nan_bits(u))
                continue;
            uint16_t want = bf16_reference(u);
            uint16_t got = f32_to_bf16(f32_from_bits(u));
            if (got != want)
                fail_msg("f32_to_bf16(0x%08x) = 0x%04x, reference gives 0x%04x", u, got, want);
        }
    }
}

static void expect_f16_matches_gcc(uint32_t u)
{
    for (int s = 0; s < 2; s++, u ^= 0x80000000u) {
        volatile float vf = f32_from_bits(u);
        _Float16 h = (_Float16)vf;
        uint16_t want;
        memcpy(&want, &h, sizeof want);
        uint16_t got = f32_to_f16(f32_from_bits(u));
        if (got != want)
            fail_msg("f32_to_f16(0x%08x) = 0x%04x, gcc _Float16 gives 0x%04x", u, got, want);
    }
}

/* The stride lands on few exact ties, so every fp16 tie (and the fp32 values on
 * either side of it) is checked against gcc, in every binade. */
static void test_f16_matches_gcc_float16_at_every_tie(void **state)
{
    (void)state;
    /* Subnormal results: 2^-25 <= |f| < 2^-14; the dropped bits are the low
     * `shift` bits of the full 24-bit significand. */
    for (uint32_t exp = 102; exp <= 112; exp++) {
        uint32_t shift = 126 - exp;
        uint32_t half = 1u << (shift - 1);
        for (uint32_t kept = 0; kept < (1u << (24 - shift)); kept++)
            for (int delta = -1; delta <= 1; delta++) {
                int64_t sig = ((int64_t)kept << shift) + half + delta;
                if (sig < 0x800000 || sig > 0xffffff)
                    continue;
                expect_f16_matches_gcc((exp << 23) | ((uint32_t)sig & 0x7fffffu));
            }
    }
    /* Normal results: the dropped bits are always the low 13. */
    for (uint32_t hi = 113u << 10; hi < (143u << 10); hi++) {
        expect_f16_matches_gcc((hi << 13) | 0x0fffu);
        expect_f16_matches_gcc((hi << 13) | 0x1000u);
        expect_f16_matches_gcc((hi << 13) | 0x1001u);
    }
}

/* ---- widening and round trips ---- */

static void test_every_f16_pattern_round_trips(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        int is_nan = ((h >> 10) & 0x1fu) == 0x1fu && (h & 0x3ffu) != 0;
        float f = f16_to_f32((uint16_t)h);
        if (is_nan) {
            assert_true(isnan(f));
        } else {
            _Float16 ref;
            uint16_t hb = (uint16_t)h;
            memcpy(&ref, &hb, sizeof ref);
            volatile _Float16 vref = ref;
            float want = (float)vref;
            if (f32_bits(f) != f32_bits(want))
                fail_msg("f16_to_f32(0x%04x) = 0x%08x, gcc gives 0x%08x", h, f32_bits(f), f32_bits(want));
        }
        uint16_t back = f32_to_f16(f);
        uint16_t want_back = is_nan ? FP16_CANONICAL_NAN : (uint16_t)h;
        if (back != want_back)
            fail_msg("f16 0x%04x -> f32 0x%08x -> f16 0x%04x, expected 0x%04x", h, f32_bits(f), back, want_back);
    }
}

static void test_every_bf16_pattern_round_trips(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        int is_nan = ((h >> 7) & 0xffu) == 0xffu && (h & 0x7fu) != 0;
        float f = bf16_to_f32((uint16_t)h);
        assert_int_equal(f32_bits(f), h << 16);
        uint16_t back = f32_to_bf16(f);
        uint16_t want_back = is_nan ? BF16_CANONICAL_NAN : (uint16_t)h;
        if (back != want_back)
            fail_msg("bf16 0x%04x -> f32 -> bf16 0x%04x, expected 0x%04x", h, back, want_back);
    }
}

static void test_f16_to_f32_special_values(void **state)
{
    (void)state;
    assert_int_equal(f32_bits(f16_to_f32(0x0000)), 0x00000000);
    assert_int_equal(f32_bits(f16_to_f32(0x8000)), 0x80000000);
    assert_int_equal(f32_bits(f16_to_f32(0x7c00)), 0x7f800000);
    assert_int_equal(f32_bits(f16_to_f32(0xfc00)), 0xff800000);
    assert_true(f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(f16_to_f32(0x8001) == -0x1p-24f);
    assert_true(f16_to_f32(0x0400) == 0x1p-14f);
    assert_true(f16_to_f32(0x3c00) == 1.0f);
    assert_true(isnan(f16_to_f32(0x7e00)));
    assert_true(isnan(f16_to_f32(0xfc01)));
}

/* ---- flush-to-zero multiply and NaN canonicalisation ---- */

static void test_flush_subnormal_keeps_sign_and_leaves_normals(void **state)
{
    (void)state;
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x00000001))), 0x00000000);
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x007fffff))), 0x00000000);
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x80000001))), 0x80000000);
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x807fffff))), 0x80000000);
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x00800000))), 0x00800000);
    assert_int_equal(f32_bits(f32_flush_subnormal(-0.0f)), 0x80000000);
    assert_int_equal(f32_bits(f32_flush_subnormal(INFINITY)), 0x7f800000);
    assert_int_equal(f32_bits(f32_flush_subnormal(F(0x7fc00001))), 0x7fc00001);
    assert_true(f32_flush_subnormal(1.5f) == 1.5f);
}

static void test_mul_ftz_flushes_subnormal_inputs(void **state)
{
    (void)state;
    /* IEEE would give 2^-149 * 2^100 = 2^-49; the GPU sees a zero input. */
    assert_int_equal(f32_bits(mul_ftz(F(0x00000001), 0x1p100f)), 0x00000000);
    assert_int_equal(f32_bits(mul_ftz(0x1p100f, F(0x00400000))), 0x00000000);
    assert_int_equal(f32_bits(mul_ftz(F(0x80000001), 0x1p100f)), 0x80000000);
    assert_int_equal(f32_bits(mul_ftz(F(0x00000001), -0x1p100f)), 0x80000000);
    assert_int_equal(f32_bits(mul_ftz(F(0x80400000), -2.0f)), 0x00000000);
}

static void test_mul_ftz_flushes_subnormal_results(void **state)
{
    (void)state;
    assert_int_equal(f32_bits(mul_ftz(0x1p-70f, 0x1p-70f)), 0x00000000);
    assert_int_equal(f32_bits(mul_ftz(-0x1p-70f, 0x1p-70f)), 0x80000000);
    assert_int_equal(f32_bits(mul_ftz(-0x1p-70f, -0x1p-70f)), 0x00000000);
    /* Just below the smallest normal flushes; exactly the smallest normal stays. */
    assert_int_equal(f32_bits(mul_ftz(0x1.fffffcp-64f, 0x1p-63f)), 0x00000000);
    assert_int_equal(f32_bits(mul_ftz(0x1p-63f, 0x1p-63f)), 0x00800000);
}

static void test_mul_ftz_is_ieee_for_normal_operands(void **state)
{
    (void)state;
    assert_true(mul_ftz(1.5f, 2.0f) == 3.0f);
    assert_true(mul_ftz(-0.6961928009986877f, 3.25f) == -0.6961928009986877f * 3.25f);
    assert_int_equal(f32_bits(mul_ftz(0x1p100f, 0x1p100f)), 0x7f800000);
    assert_int_equal(f32_bits(mul_ftz(-0.0f, 5.0f)), 0x80000000);
}

static void test_canonical_bits_maps_every_nan_to_one_pattern(void **state)
{
    (void)state;
    static const uint32_t NANS[] = {0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff, 0xffffffff};
    for (size_t i = 0; i < sizeof NANS / sizeof NANS[0]; i++)
        assert_int_equal(f32_canonical_bits(f32_from_bits(NANS[i])), 0x7fffffff);
    assert_int_equal(f32_canonical_bits(INFINITY), 0x7f800000);
    assert_int_equal(f32_canonical_bits(-INFINITY), 0xff800000);
    assert_int_equal(f32_canonical_bits(-0.0f), 0x80000000);
    assert_int_equal(f32_canonical_bits(1.0f), 0x3f800000);
    assert_int_equal(f32_canonical_bits(F(0x00000001)), 0x00000001);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_signed_zeros_and_infinities),
        cmocka_unit_test(test_f16_nan_is_canonical_whatever_the_payload_or_sign),
        cmocka_unit_test(test_f16_largest_finite_and_overflow_boundary),
        cmocka_unit_test(test_f16_smallest_subnormal_and_half_of_it),
        cmocka_unit_test(test_f16_fp32_subnormals_become_signed_zero),
        cmocka_unit_test(test_f16_subnormal_ties_round_to_even),
        cmocka_unit_test(test_f16_largest_subnormal_and_rounding_into_normal_range),
        cmocka_unit_test(test_f16_normal_range_ties_round_to_even),
        cmocka_unit_test(test_f16_negative_values),
        cmocka_unit_test(test_bf16_signed_zeros_infinities_and_nans),
        cmocka_unit_test(test_bf16_ties_round_to_even),
        cmocka_unit_test(test_bf16_overflow_to_infinity),
        cmocka_unit_test(test_bf16_keeps_and_rounds_fp32_subnormals),
        cmocka_unit_test(test_f16_matches_gcc_float16_on_a_strided_sweep),
        cmocka_unit_test(test_f16_matches_gcc_float16_at_every_tie),
        cmocka_unit_test(test_bf16_matches_a_distance_reference_on_a_strided_sweep),
        cmocka_unit_test(test_every_f16_pattern_round_trips),
        cmocka_unit_test(test_every_bf16_pattern_round_trips),
        cmocka_unit_test(test_f16_to_f32_special_values),
        cmocka_unit_test(test_flush_subnormal_keeps_sign_and_leaves_normals),
        cmocka_unit_test(test_mul_ftz_flushes_subnormal_inputs),
        cmocka_unit_test(test_mul_ftz_flushes_subnormal_results),
        cmocka_unit_test(test_mul_ftz_is_ieee_for_normal_operands),
        cmocka_unit_test(test_canonical_bits_maps_every_nan_to_one_pattern),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
