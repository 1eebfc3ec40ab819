/* Every vector CPU path this machine supports gives the scalar path's bytes on
 * the synthetic sweep (tests/unit/cpu_sweep.h), and NF4DEQ_CPU selects paths. */
#include "cpu_sweep.h"
#include "test_util.h"

static void sweep_one_path(enum cpu_path path)
{
    if (!cpu_path_supported(path)) {
        print_message("%s: not supported here, skipped\n", cpu_path_name(path));
        skip();
    }
    int cases = 0;
    int failed = sweep_path(path, stderr, &cases);
    print_message("%s: %d cases, %d failed\n", cpu_path_name(path), cases, failed);
    assert_int_equal(failed, 0);
}

static void test_sse_matches_scalar(void **state)
{
    (void)state;
    sweep_one_path(CPU_PATH_SSE);
}

static void test_avx2_matches_scalar(void **state)
{
    (void)state;
    sweep_one_path(CPU_PATH_AVX2);
}

static void test_avx512_matches_scalar(void **state)
{
    (void)state;
    sweep_one_path(CPU_PATH_AVX512);
}

static void test_neon_matches_scalar(void **state)
{
    (void)state;
    sweep_one_path(CPU_PATH_NEON);
}

/* The sweep's reference is dequant_cpu_range; the scalar path through
 * dequant_cpu_path (threads, block shares) must equal it too. */
static void test_scalar_path_matches_reference(void **state)
{
    (void)state;
    sweep_one_path(CPU_PATH_SCALAR);
}

static void test_env_selects_and_refuses(void **state)
{
    (void)state;
    enum cpu_path p;
    assert_int_equal(setenv(CPU_PATH_ENV, "scalar", 1), 0);
    assert_int_equal(cpu_path_from_env(&p), NF4_OK);
    assert_int_equal(p, CPU_PATH_SCALAR);
    assert_int_equal(setenv(CPU_PATH_ENV, "", 1), 0);
    assert_int_equal(cpu_path_from_env(&p), NF4_OK);
    assert_int_equal(p, cpu_path_best());
    assert_int_equal(setenv(CPU_PATH_ENV, "avx3", 1), 0);
    nf4_clear_error();
    assert_int_equal(cpu_path_from_env(&p), NF4_EUSAGE);
    assert_non_null(strstr(nf4_last_error(), "NF4DEQ_CPU=avx3 is not a CPU path"));
    for (int i = 0; i < CPU_PATH_COUNT; i++) {
        assert_int_equal(setenv(CPU_PATH_ENV, cpu_path_name((enum cpu_path)i), 1), 0);
        nf4_clear_error();
        int rc = cpu_path_from_env(&p);
        if (cpu_path_supported((enum cpu_path)i)) {
            assert_int_equal(rc, NF4_OK);
            assert_int_equal(p, i);
        } else {
            assert_int_equal(rc, NF4_EUNAVAILABLE);
            assert_non_null(strstr(nf4_last_error(), "has no"));
        }
    }
    unsetenv(CPU_PATH_ENV);
    /* The best path is one this machine runs. */
    assert_true(cpu_path_supported(cpu_path_best()));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_path_matches_reference),
        cmocka_unit_test(test_sse_matches_scalar),
        cmocka_unit_test(test_avx2_matches_scalar),
        cmocka_unit_test(test_avx512_matches_scalar),
        cmocka_unit_test(test_neon_matches_scalar),
        cmocka_unit_test(test_env_selects_and_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
