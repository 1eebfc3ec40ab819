/* lora_rewrite.h's readings of numbers as Python reads them: int() of a
 * block number in a key (Flux.2's, Wan's, Stable Diffusion's conversions)
 * and float() of a metadata alpha (MiniMax-H3's). Each expected result is
 * what CPython 3.11 gives for the same text. */
#include "test_util.h"

#include <math.h>

#include "lora_rewrite.h"

static void test_python_int(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        int ok;
        int64_t value;
    } CASES[] = {
        {"8", 1, 8},
        {" 8 ", 1, 8},
        {"\t8\n", 1, 8},
        {"8\v", 1, 8},
        {"8\f", 1, 8},
        {"8\x1c", 0, 0}, /* str.isspace counts 0x1C-0x1F; int() does not strip them */
        {"\x1f" "8", 0, 0},
        {"+8", 1, 8},
        {"-8", 1, -8},
        {"1_000", 1, 1000},
        {"1__0", 0, 0},
        {"_1", 0, 0},
        {"1_", 0, 0},
        {"08", 1, 8},
        {"0x8", 0, 0},
        {"", 0, 0},
        {" ", 0, 0},
        {"8 8", 0, 0},
        {"\xe3\x80\x80" "8", 1, 8}, /* U+3000 */
        {"8\xe2\x80\xa8", 1, 8},    /* U+2028 */
        {"\xc2\x85" "8", 1, 8},     /* U+0085 */
        {"\xc2\xa0" "8", 1, 8},     /* U+00A0 */
        {"99999999999999999999", 0, 0}, /* Python's int has no bound; nf4deq's reading does */
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        int64_t v = 0;
        const int ok = lora_python_int(CASES[i].text, strlen(CASES[i].text), &v);
        if (ok != CASES[i].ok || (ok && v != CASES[i].value))
            fail_msg("case %zu: %d %lld", i, ok, (long long)v);
    }
}

static void test_python_float(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        int ok;
        double value; /* HUGE_VAL: inf; 0 with nan: NaN */
        int nan;
    } CASES[] = {
        {"8", 1, 8.0, 0},
        {"8.", 1, 8.0, 0},
        {".5", 1, 0.5, 0},
        {".", 0, 0, 0},
        {"1e3", 1, 1000.0, 0},
        {"1E-3", 1, 0.001, 0},
        {"1e", 0, 0, 0},
        {"+.8E1", 1, 8.0, 0},
        {"0_8", 1, 8.0, 0},
        {"1_0.2_5", 1, 10.25, 0},
        {"1._5", 0, 0, 0},
        {"inf", 1, HUGE_VAL, 0},
        {"-Infinity", 1, -HUGE_VAL, 0},
        {"nAn", 1, 0, 1},
        {"infinit", 0, 0, 0},
        {"0x8", 0, 0, 0},
        {"1e999", 1, HUGE_VAL, 0},
        {"4.9e-324", 1, 5e-324, 0},
        {"8\x1c", 0, 0, 0},
        {" 2.5\n", 1, 2.5, 0},
        {"1,5", 0, 0, 0},
        {"\xe3\x80\x80" "8", 1, 8.0, 0},
        {"\xd9\xa3", -1, 0, 0}, /* ARABIC-INDIC DIGIT THREE: Python reads 3.0; nf4deq refuses to guess */
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        double v = 0;
        const int ok = lora_python_float(CASES[i].text, strlen(CASES[i].text), &v);
        if (ok != CASES[i].ok || (ok == 1 && (CASES[i].nan ? !isnan(v) : v != CASES[i].value)))
            fail_msg("case %zu: %d %g", i, ok, v);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_python_int),
        cmocka_unit_test(test_python_float),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
