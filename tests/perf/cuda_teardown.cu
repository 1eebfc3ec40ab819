// What a process pays for having used CUDA, after its work is done: the
// context's teardown at exit (docs/PERFORMANCE.md, issue 10: the GPU path
// against the CPU path on a sub-second conversion). For each mode it runs
// itself as a child 7 times and prints medians of
//   work    exec to the end of main's work (CUDA start, allocations, the mode's step)
//   exit    the end of main's work to the parent's waitpid: what exit() and the
//           driver still take after the program is done
// Modes (each holds 128 MiB pinned host memory and 1 GiB of device memory,
// as a GPU conversion does; `none` uses no CUDA):
//   none     no CUDA: the bare cost of a process exit
//   exit     return from main with the context alive
//   reset    cudaDeviceReset() on the main thread, then return
//   overlap  cudaDeviceReset() on a helper thread while main does 0.2 s of other
//            work (a sleep), then join and return: how much of the teardown can
//            hide behind the end of a conversion
//
//   make perf-tools && build/perf/cuda_teardown
#include <cuda_runtime.h>

#include <algorithm>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#define RUNS 7
#define PINNED_BYTES (128ull << 20)
#define DEVICE_BYTES (1ull << 30)
#define OTHER_WORK_US 200000

#define cudaCheck(call)                                                                             \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "cuda_teardown: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *reset_on_thread(void *)
{
    cudaSetDevice(0);
    cudaDeviceReset();
    return NULL;
}

// The child: the mode's work, then the monotonic time it ended, on fd 3.
static int child(const char *mode)
{
    if (strcmp(mode, "none") != 0) {
        void *pinned = NULL, *dev = NULL;
        cudaCheck(cudaHostAlloc(&pinned, PINNED_BYTES, cudaHostAllocDefault));
        memset(pinned, 1, PINNED_BYTES);
        cudaCheck(cudaMalloc(&dev, DEVICE_BYTES));
        cudaCheck(cudaMemcpy(dev, pinned, PINNED_BYTES, cudaMemcpyHostToDevice));
        cudaCheck(cudaDeviceSynchronize());
        if (!strcmp(mode, "reset")) {
            cudaCheck(cudaDeviceReset());
        } else if (!strcmp(mode, "overlap")) {
            pthread_t th;
            if (pthread_create(&th, NULL, reset_on_thread, NULL) != 0)
                return 1;
            usleep(OTHER_WORK_US);
            pthread_join(th, NULL);
        } else if (strcmp(mode, "exit") != 0) {
            fprintf(stderr, "cuda_teardown: no mode '%s'\n", mode);
            return 2;
        }
    }
    double done = now();
    return write(3, &done, sizeof done) == (ssize_t)sizeof done ? 0 : 1;
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--child"))
        return child(argv[2]);
    static const char *const MODES[] = {"none", "exit", "reset", "overlap"};
    printf("%-8s %10s %10s   (seconds, median of %d processes)\n", "mode", "work", "exit", RUNS);
    fflush(stdout);
    for (const char *mode : MODES) {
        std::vector<double> work, exit_cost;
        for (int r = 0; r < RUNS; r++) {
            int fds[2];
            if (pipe(fds) != 0)
                return 1;
            double t0 = now();
            pid_t pid = fork();
            if (pid == 0) {
                dup2(fds[1], 3);
                execl("/proc/self/exe", argv[0], "--child", mode, (char *)NULL);
                _exit(127);
            }
            close(fds[1]);
            double done = 0;
            ssize_t got = read(fds[0], &done, sizeof done);
            int st = 0;
            waitpid(pid, &st, 0);
            double t1 = now();
            close(fds[0]);
            if (got != (ssize_t)sizeof done || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "cuda_teardown: the %s child failed\n", mode);
                return 1;
            }
            work.push_back(done - t0);
            exit_cost.push_back(t1 - done);
        }
        printf("%-8s %10.3f %10.3f\n", mode, median(work), median(exit_cost));
        fflush(stdout);
    }
    return 0;
}
