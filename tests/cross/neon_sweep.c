/* The CPU path sweeps (tests/unit/cpu_sweep.h, merge_sweep.h) for an AArch64
 * build, run under qemu-user by `make check-aarch64`: the NEON path against the
 * scalar one, and each path's LoRA merge against the reference. */
#include "../unit/cpu_sweep.h"
#include "../unit/merge_sweep.h"

int main(void)
{
    int total_failed = 0;
    for (int p = 0; p < CPU_PATH_COUNT; p++) {
        if (!cpu_path_supported((enum cpu_path)p))
            continue;
        int cases = 0;
        int failed = sweep_path((enum cpu_path)p, stderr, &cases);
        printf("%-7s %d cases, %d failed\n", cpu_path_name((enum cpu_path)p), cases, failed);
        total_failed += failed;
        cases = 0;
        failed = merge_sweep_path((enum cpu_path)p, stderr, &cases);
        printf("%-7s merge: %d cases, %d failed\n", cpu_path_name((enum cpu_path)p), cases, failed);
        total_failed += failed;
    }
    if (cpu_path_best() != CPU_PATH_NEON) {
        printf("the best path is %s, not neon\n", cpu_path_name(cpu_path_best()));
        total_failed++;
    }
    return total_failed ? 1 : 0;
}
