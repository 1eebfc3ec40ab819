/* Exiting without waiting for the GPU driver.
 *
 * The CUDA driver tears a context down when the process closes its device
 * files: 0.04-0.12 s after the work is done, every run (docs/PERFORMANCE.md,
 * "How much of the teardown could hide"), which is as long as a whole small
 * conversion into tmpfs. When the output is complete, a child can take over
 * the device files: the process that the caller waits for then exits at once,
 * and the driver does its teardown when the child, the last holder, closes
 * them after the parent has gone. The child holds nothing else: not the
 * standard streams (a shell reading OUT=$(nf4deq ...) sees EOF with the
 * parent's exit), not the output, not any pipe the caller passed in. */
#ifndef NF4DEQ_EXIT_HANDOFF_H
#define NF4DEQ_EXIT_HANDOFF_H

#include <sys/types.h>

/* The files CUDA holds open: /dev/nvidiactl, /dev/nvidia0, /dev/nvidia-uvm. */
#define HANDOFF_DEVICE_PREFIX "/dev/nvidia"

#define HANDOFF_ENV "NF4DEQ_GPU_HANDOFF"

/* Whether the hand-off is wanted: yes, unless NF4DEQ_GPU_HANDOFF=0 (then the
 * process pays the teardown itself before it exits; the benchmarks compare),
 * or handoff_forbid was called. */
int handoff_wanted(void);

/* Called once by the command-line tool's main(), which hands its device files
 * off when it exits: from then on handoff_at_exit() is true (unless the
 * hand-off is not wanted). Library callers never call it. */
void handoff_expect(void);

/* Whether this process will hand its device files to a child as it exits.
 * Then what it holds on the GPU, and the host memory it page-locked, need not
 * be freed first: the driver frees both with the device files, in the child,
 * after this process has gone. Freeing them took 5-7 ms of the 0.5 s a 1.1B
 * conversion into tmpfs takes (docs/PERFORMANCE.md, "What the GPU path pays
 * for CUDA into tmpfs"). */
int handoff_at_exit(void);

/* Called by whoever opens a device that admits one process at a time
 * (gpu_exclusive): there a command run right after nf4deq, such as
 * `nf4deq convert ... && python train.py`, could not open the GPU while the
 * child still held it, so this process waits for the teardown itself. Safe
 * from any thread. */
void handoff_forbid(void);

/* If this process has open files whose path begins with `prefix`, forks a
 * child that keeps exactly those open until this process has exited, then
 * exits itself, running no exit handlers. Returns the child's pid when it
 * holds them: the caller must then leave with _exit, since exit() would run
 * the CUDA runtime's own teardown here all the same. Returns 0, with no child,
 * when there is nothing to hand off or the fork failed: the caller exits as
 * usual. */
pid_t handoff_device_files(const char *prefix);

#endif
