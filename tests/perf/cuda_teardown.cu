// What a process pays for having used CUDA, after its work is done: the
// context's teardown at exit (docs/PERFORMANCE.md, issue 10: the GPU path
// against the CPU path on a sub-second conversion). For each mode it runs
// itself as a child 7 times and prints medians of
//   work    fork to the end of main's work (exec, CUDA start, allocations, the step)
//   step    the mode's step alone (the reset, or the 0.2 s that hides it)
//   exit    the end of main's work to the parent's waitpid: what exit() and the
//           driver still take after the program is done
// Modes (from `exit` on, each holds 128 MiB pinned host memory and 1 GiB of
// device memory, as a GPU conversion does):
//   none     no CUDA: the bare cost of a process exit
//   driver   the driver initialised (cudaGetDeviceCount), no context
//   context  the primary context created (cudaFree(0)), nothing allocated: the
//            least any process that runs a kernel pays
//   exit     return from main with the context alive
//   reset    cudaDeviceReset() on the main thread, then return
//   overlap  cudaDeviceReset() on a helper thread while main does 0.2 s of other
//            work (a sleep), then join and return: how much of the teardown can
//            hide behind the end of a conversion
//   handoff  fork a child that keeps the device files open until this process
//            has gone, then _exit: the driver tears the context down when the
//            last reference to them closes, which is then the child's, after
//            the parent has been reaped (the step is the fork)
//   handoff-exit  the same fork, then return from main: exit() runs the CUDA
//            runtime's own teardown in the parent all the same
//
//   make perf-tools && build/perf/cuda_teardown
#include <cuda_runtime.h>

#include <algorithm>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
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

static cudaError_t thread_status;

// Forks a child that holds every open file of this process, the device files
// included, until this process has exited, and then exits itself without
// running any of CUDA's exit handlers. Returns 0, or -1 with no child.
static int hand_off_device_files()
{
    int gone[2];
    if (pipe(gone) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int null = open("/dev/null", O_RDWR);
        for (int fd = 0; fd <= 3; fd++)
            if (null >= 0 && fd != null)
                dup2(null, fd);
        close(gone[1]);
        char c;
        while (read(gone[0], &c, 1) < 0) // EOF: the parent's end closed as it exited
            ;
        _exit(0);
    }
    close(gone[0]); // gone[1] stays open until this process exits
    return 0;
}

static void *reset_on_thread(void *)
{
    thread_status = cudaSetDevice(0);
    if (thread_status == cudaSuccess)
        thread_status = cudaDeviceReset();
    return NULL;
}

// The child: the mode's work, then on fd 3 the step's length and the monotonic
// time the work ended.
static int child(const char *mode)
{
    double step = 0;
    if (!strcmp(mode, "driver")) {
        int count = 0;
        cudaCheck(cudaGetDeviceCount(&count));
    } else if (!strcmp(mode, "context")) {
        cudaCheck(cudaFree(0));
        cudaCheck(cudaDeviceSynchronize());
    } else if (strcmp(mode, "none") != 0) {
        void *pinned = NULL, *dev = NULL;
        cudaCheck(cudaHostAlloc(&pinned, PINNED_BYTES, cudaHostAllocDefault));
        memset(pinned, 1, PINNED_BYTES);
        cudaCheck(cudaMalloc(&dev, DEVICE_BYTES));
        cudaCheck(cudaMemcpy(dev, pinned, PINNED_BYTES, cudaMemcpyHostToDevice));
        cudaCheck(cudaDeviceSynchronize());
        const double t0 = now();
        if (!strcmp(mode, "reset")) {
            cudaCheck(cudaDeviceReset());
        } else if (!strcmp(mode, "overlap")) {
            pthread_t th;
            if (pthread_create(&th, NULL, reset_on_thread, NULL) != 0)
                return 1;
            usleep(OTHER_WORK_US);
            pthread_join(th, NULL);
            cudaCheck(thread_status);
        } else if (!strcmp(mode, "handoff") || !strcmp(mode, "handoff-exit")) {
            if (hand_off_device_files() != 0)
                return 1;
        } else if (strcmp(mode, "exit") != 0) {
            fprintf(stderr, "cuda_teardown: no mode '%s'\n", mode);
            return 2;
        }
        step = now() - t0;
    }
    const double report[2] = {step, now()};
    int rc = write(3, report, sizeof report) == (ssize_t)sizeof report ? 0 : 1;
    if (!strcmp(mode, "handoff"))
        _exit(rc);
    return rc;
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
    static const char *const MODES[] = {"none", "driver", "context", "exit", "reset", "overlap", "handoff", "handoff-exit"};
    printf("%-8s %10s %10s %10s   (seconds, median of %d processes)\n", "mode", "work", "step", "exit", RUNS);
    fflush(stdout);
    for (const char *mode : MODES) {
        std::vector<double> work, step, exit_cost;
        for (int r = 0; r < RUNS; r++) {
            int fds[2];
            if (pipe(fds) != 0)
                return 1;
            double t0 = now();
            pid_t pid = fork();
            if (pid < 0)
                return 1;
            if (pid == 0) {
                // The write end becomes fd 3; no other end of the pipe stays open.
                if (fds[1] != 3 && dup2(fds[1], 3) != 3)
                    _exit(127);
                for (int k = 0; k < 2; k++)
                    if (fds[k] != 3)
                        close(fds[k]);
                execl("/proc/self/exe", argv[0], "--child", mode, (char *)NULL);
                _exit(127);
            }
            close(fds[1]);
            double report[2] = {0, 0}; // the step's length, the end of the work
            ssize_t got = read(fds[0], report, sizeof report);
            int st = 0;
            waitpid(pid, &st, 0);
            double t1 = now();
            close(fds[0]);
            if (got != (ssize_t)sizeof report || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "cuda_teardown: the %s child failed\n", mode);
                return 1;
            }
            work.push_back(report[1] - t0);
            step.push_back(report[0]);
            exit_cost.push_back(t1 - report[1]);
        }
        printf("%-8s %10.3f %10.3f %10.3f\n", mode, median(work), median(step), median(exit_cost));
        fflush(stdout);
    }
    return 0;
}
