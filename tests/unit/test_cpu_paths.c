/* Every vector CPU path this machine supports gives the scalar path's bytes on
 * the synthetic sweep (tests/unit/cpu_sweep.h), its LoRA merge gives the
 * reference's bytes (tests/unit/merge_sweep.h), and NF4DEQ_CPU selects paths. */
#include "cpu_sweep.h"
#include "merge_sweep.h"
#include "test_util.h"

/* Runs `sweep` on the path in the test's state (skipped where this machine
 * lacks it); every case must pass. */
static void sweep_state_path(void **state, int (*sweep)(enum cpu_path, FILE *, int *), const char *what)
{
    enum cpu_path path = *(const enum cpu_path *)*state;
    if (!cpu_path_supported(path)) {
        print_message("%s: not supported here, skipped\n", cpu_path_name(path));
        skip();
    }
    int cases = 0;
    int failed = sweep(path, stderr, &cases);
    print_message("%s%s: %d cases, %d failed\n", cpu_path_name(path), what, cases, failed);
    assert_int_equal(failed, 0);
}

/* One test per path. The scalar path through dequant_cpu_path (threads, block
 * shares) must equal the sweep's reference, dequant_cpu_range, too. */
static void test_path_matches_scalar(void **state)
{
    sweep_state_path(state, sweep_path, "");
}

/* The merge on each path against the plain reference. */
static void test_merge_path_matches_reference(void **state)
{
    sweep_state_path(state, merge_sweep_path, " merge");
}

static const enum cpu_path PATHS[] = {CPU_PATH_SCALAR, CPU_PATH_SSE, CPU_PATH_AVX2, CPU_PATH_AVX512, CPU_PATH_NEON};

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
        {"scalar path matches the scalar reference", test_path_matches_scalar, NULL, NULL, (void *)&PATHS[0]},
        {"sse path matches the scalar reference", test_path_matches_scalar, NULL, NULL, (void *)&PATHS[1]},
        {"avx2 path matches the scalar reference", test_path_matches_scalar, NULL, NULL, (void *)&PATHS[2]},
        {"avx512 path matches the scalar reference", test_path_matches_scalar, NULL, NULL, (void *)&PATHS[3]},
        {"neon path matches the scalar reference", test_path_matches_scalar, NULL, NULL, (void *)&PATHS[4]},
        {"scalar path merges as the reference", test_merge_path_matches_reference, NULL, NULL, (void *)&PATHS[0]},
        {"sse path merges as the reference", test_merge_path_matches_reference, NULL, NULL, (void *)&PATHS[1]},
        {"avx2 path merges as the reference", test_merge_path_matches_reference, NULL, NULL, (void *)&PATHS[2]},
        {"avx512 path merges as the reference", test_merge_path_matches_reference, NULL, NULL, (void *)&PATHS[3]},
        {"neon path merges as the reference", test_merge_path_matches_reference, NULL, NULL, (void *)&PATHS[4]},
        cmocka_unit_test(test_env_selects_and_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
