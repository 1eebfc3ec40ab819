/* The tolerance of tests/fixtures/lora/README.md, which a LoRA's (or a
 * LoKr's) merge is checked against: each element equal to the fp32 merge's,
 * or no farther from the fp64 merge than the fp32 merge is, plus one unit in
 * the last place of the output dtype. */
#ifndef NF4DEQ_TEST_MERGE_TOLERANCE_H
#define NF4DEQ_TEST_MERGE_TOLERANCE_H

#include "test_util.h"

#include <math.h>

#include "fpconv.h"
#include "model.h"

static inline double value_of(enum st_dtype dt, const unsigned char *p, uint64_t i)
{
    uint16_t h;
    float f;
    switch (dt) {
    case DT_BF16: memcpy(&h, p + 2 * i, 2); return bf16_to_f32(h);
    case DT_F16: memcpy(&h, p + 2 * i, 2); return f16_to_f32(h);
    default: memcpy(&f, p + 4 * i, 4); return f;
    }
}

/* One unit in the last place of dtype `dt` at magnitude |x|. */
static inline double ulp_of(enum st_dtype dt, double x)
{
    int mant = dt == DT_BF16 ? 7 : dt == DT_F16 ? 10 : 23;
    int min_exp = dt == DT_F16 ? -14 : -126; /* below it the spacing stays that of the smallest normal */
    int e;
    frexp(fabs(x), &e); /* |x| = m * 2^e, m in [0.5, 1) */
    e -= 1;
    if (x == 0 || e < min_exp)
        e = min_exp;
    return ldexp(1.0, e - mant);
}

struct tally {
    uint64_t merged, exact;
};

/* Checks the tensor `name` of `got` against the fp32 and fp64 expected files:
 * byte-identical to the fp32 file when `has_lora` is 0 (no LoRA, or a LoRA
 * bias); within the tolerance
 * otherwise (the fp64 files of the tied cases hold only merged tensors). */
static inline void check_tensor(const struct model *got, const struct st_file *e32, const struct st_file *e64,
                         const char *name, int has_lora, struct tally *tally)
{
    const struct model_tensor *g = model_find(got, name);
    const struct st_tensor *w32 = st_find(e32, name), *w64 = st_find(e64, name);
    if (!g || !w32 || (has_lora && !w64))
        fail_msg("%s: missing from the output or the expected files", name);
    if (g->t->dtype != w32->dtype || g->t->nelem != w32->nelem)
        fail_msg("%s: %s with %llu elements, expected %s with %llu", name, dtype_name(g->t->dtype),
                 (unsigned long long)g->t->nelem, dtype_name(w32->dtype), (unsigned long long)w32->nelem);
    uint64_t n = st_tensor_bytes(w32);
    unsigned char *a = malloc(n + 1), *b = malloc(n + 1), *c = malloc(n + 1);
    assert_true(a && b && c);
    assert_int_equal(st_read(g->file, g->t, 0, a, n), NF4_OK);
    assert_int_equal(st_read(e32, w32, 0, b, n), NF4_OK);
    if (!has_lora) {
        if (memcmp(a, b, n) != 0)
            fail_msg("%s: differs from the expected file (a plain conversion, or an exact merge)", name);
    } else {
        assert_int_equal(st_read(e64, w64, 0, c, n), NF4_OK);
        unsigned size = dtype_bits(w32->dtype) / 8;
        for (uint64_t i = 0; i < w32->nelem; i++) {
            tally->merged++;
            if (memcmp(a + i * size, b + i * size, size) == 0) {
                tally->exact++;
                continue;
            }
            double v = value_of(w32->dtype, a, i), v32 = value_of(w32->dtype, b, i), v64 = value_of(w32->dtype, c, i);
            if (!(fabs(v - v64) <= fabs(v32 - v64) + ulp_of(w32->dtype, v64)))
                fail_msg("%s[%llu] = %.9g: fp32 merge %.9g, fp64 merge %.9g: outside the tolerance", name,
                         (unsigned long long)i, v, v32, v64);
        }
    }
    free(a);
    free(b);
    free(c);
}

#endif
