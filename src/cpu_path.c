#include "cpu_path.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

static const char *const PATH_NAMES[CPU_PATH_COUNT] = {"scalar", "sse", "avx2", "avx512", "neon"};

const char *cpu_path_name(enum cpu_path path)
{
    return (unsigned)path < CPU_PATH_COUNT ? PATH_NAMES[path] : "?";
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* F16C from CPUID directly: clang's __builtin_cpu_supports does not know it.
 * It needs no OS support beyond the YMM state AVX2's check already covers. */
static int has_f16c(void)
{
    /* CPUID traps to the hypervisor in a VM (microseconds), and the library's
     * CPU entry resolves its path on every call: ask once. A race only asks
     * twice and stores the same answer. */
    static int known = -1;
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        unsigned a, b, c, d;
        v = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}
#endif

int cpu_path_supported(enum cpu_path path)
{
    switch (path) {
    case CPU_PATH_SCALAR: return 1;
#if defined(__x86_64__) || defined(__i386__)
    /* libgcc's checks include the OS saving the wider registers (XGETBV). */
    case CPU_PATH_SSE: return __builtin_cpu_supports("ssse3");
    case CPU_PATH_AVX2: return __builtin_cpu_supports("avx2") && has_f16c();
    case CPU_PATH_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx2") && has_f16c();
#endif
#if defined(__aarch64__)
    case CPU_PATH_NEON: return 1; /* Advanced SIMD is part of AArch64 */
#endif
    default: return 0;
    }
}

enum cpu_path cpu_path_best(void)
{
    static const enum cpu_path PREFERENCE[] = {CPU_PATH_AVX512, CPU_PATH_AVX2, CPU_PATH_NEON, CPU_PATH_SSE};
    for (size_t i = 0; i < sizeof PREFERENCE / sizeof PREFERENCE[0]; i++)
        if (cpu_path_supported(PREFERENCE[i]))
            return PREFERENCE[i];
    return CPU_PATH_SCALAR;
}

int cpu_path_from_env(enum cpu_path *out)
{
    const char *want = getenv(CPU_PATH_ENV);
    *out = cpu_path_best();
    if (!want || !*want)
        return NF4_OK;
    for (int p = 0; p < CPU_PATH_COUNT; p++) {
        if (strcmp(want, PATH_NAMES[p]) != 0)
            continue;
        if (!cpu_path_supported((enum cpu_path)p))
            return nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "%s=%s: this processor or build has no %s path",
                            CPU_PATH_ENV, want, want);
        *out = (enum cpu_path)p;
        return NF4_OK;
    }
    return nf4_fail(NF4_EUSAGE, NULL, NULL, "%s=%s is not a CPU path (scalar, sse, avx2, avx512 or neon)",
                    CPU_PATH_ENV, want);
}

static pthread_once_t active_once = PTHREAD_ONCE_INIT;
static enum cpu_path active_path;

static void choose_active(void)
{
    if (cpu_path_from_env(&active_path) != NF4_OK)
        active_path = cpu_path_best();
}

enum cpu_path cpu_path_active(void)
{
    pthread_once(&active_once, choose_active);
    return active_path;
}
