// How fast can one output file of a given size be filled on tmpfs (or any
// file system), by each way a converter could fill it? Issue 10: on tmpfs the
// CPU path is limited by its single write(2) stream, and the GPU path by the
// same writer plus CUDA's fixed costs. Each mode writes SIZE bytes of a hot
// 4 MiB pattern into a fresh file, median of RUNS, including the close (and
// munmap) but not the unlink:
//   write       one thread, write(2) of 4 MiB pieces: the pipeline's writer today
//   pwrite:T    T threads, pwrite(2) of disjoint 4 MiB pieces
//   mmap:T      ftruncate, one shared mapping, T threads copy their 4 MiB pieces
//               into it (each page fault allocates the page)
//   populate:T  as mmap:T, each piece populated first (MADV_POPULATE_WRITE)
//   falloc:T    fallocate(2) the whole file first (no SIGBUS on a full file
//               system afterwards), then as mmap:T
//   dma:T       the GPU copies 4 MiB pieces from device memory straight into the
//               mapped file, page-locked piece by piece (cudaHostRegister) by T
//               threads each with a stream of its own
//   staged:T    the GPU copies into T pinned staging buffers, and T threads copy
//               them on into the mapped file (the pipeline's slots, with the
//               writer replaced by each worker)
// Also prints the cost of opening CUDA (cudaFree(0)) in this process.
//
//   make perf-tools
//   build/perf/tmpfs_write DIR [SIZE_MB [RUNS]]
#include <cuda_runtime.h>

#include <algorithm>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PIECE (4ull << 20)

#define cudaCheck(call)                                                                          \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "tmpfs_write: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

static double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    perror(what);
    exit(1);
}

struct job {
    const char *mode;
    int fd, t, nthreads;
    char *map;
    unsigned long long size;
    char *src;          // hot 4 MiB pattern
    char *dev;          // device copy of it (dma, staged)
    char *stage;        // this thread's pinned buffer (staged)
    cudaStream_t stream;
};

static void *thread_main(void *arg)
{
    job *j = (job *)arg;
    unsigned long long pieces = (j->size + PIECE - 1) / PIECE;
    for (unsigned long long k = (unsigned long long)j->t; k < pieces; k += (unsigned long long)j->nthreads) {
        unsigned long long off = k * PIECE, len = std::min(PIECE, j->size - off);
        if (!strcmp(j->mode, "pwrite")) {
            if (pwrite(j->fd, j->src, len, (off_t)off) != (ssize_t)len)
                die("pwrite");
        } else if (!strcmp(j->mode, "mmap") || !strcmp(j->mode, "falloc")) {
            memcpy(j->map + off, j->src, len);
        } else if (!strcmp(j->mode, "populate")) {
            if (madvise(j->map + off, len, MADV_POPULATE_WRITE) != 0)
                die("madvise");
            memcpy(j->map + off, j->src, len);
        } else if (!strcmp(j->mode, "dma")) {
            cudaCheck(cudaHostRegister(j->map + off, len, cudaHostRegisterDefault));
            cudaCheck(cudaMemcpyAsync(j->map + off, j->dev, len, cudaMemcpyDeviceToHost, j->stream));
            cudaCheck(cudaStreamSynchronize(j->stream));
            cudaCheck(cudaHostUnregister(j->map + off));
        } else if (!strcmp(j->mode, "staged")) {
            cudaCheck(cudaMemcpyAsync(j->stage, j->dev, len, cudaMemcpyDeviceToHost, j->stream));
            cudaCheck(cudaStreamSynchronize(j->stream));
            memcpy(j->map + off, j->stage, len);
        }
    }
    return NULL;
}

static double falloc_s; // the last fallocate alone

static double one_run(const char *dir, const char *mode, int nthreads, unsigned long long size, char *src, char *dev,
                      std::vector<char *> &stages, std::vector<cudaStream_t> &streams)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tmpfs_write.out", dir);
    unlink(path);
    double t0 = now();
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        die("open");
    char *map = NULL;
    if (!strcmp(mode, "write")) {
        for (unsigned long long off = 0; off < size; off += PIECE) {
            unsigned long long len = std::min(PIECE, size - off);
            if (write(fd, src, len) != (ssize_t)len)
                die("write");
        }
    } else {
        if (strcmp(mode, "pwrite") != 0) {
            if (!strcmp(mode, "falloc")) {
                double f0 = now();
                if (fallocate(fd, 0, 0, (off_t)size) != 0)
                    die("fallocate");
                falloc_s = now() - f0;
            } else if (ftruncate(fd, (off_t)size) != 0) {
                die("ftruncate");
            }
            map = (char *)mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (map == MAP_FAILED)
                die("mmap");
        }
        std::vector<pthread_t> th(nthreads);
        std::vector<job> jobs(nthreads);
        for (int t = 0; t < nthreads; t++) {
            jobs[t] = job{mode, fd, t, nthreads, map, size, src, dev, stages.empty() ? NULL : stages[t],
                          streams.empty() ? (cudaStream_t)0 : streams[t]};
            pthread_create(&th[t], NULL, thread_main, &jobs[t]);
        }
        for (int t = 0; t < nthreads; t++)
            pthread_join(th[t], NULL);
        if (map && munmap(map, size) != 0)
            die("munmap");
    }
    if (close(fd) != 0)
        die("close");
    double t1 = now();
    unlink(path);
    return t1 - t0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: tmpfs_write DIR [SIZE_MB [RUNS]]\n");
        return 2;
    }
    const char *dir = argv[1];
    unsigned long long size = (argc > 2 ? strtoull(argv[2], NULL, 10) : 2200) << 20;
    int runs = argc > 3 ? atoi(argv[3]) : 5;
    char *src = (char *)aligned_alloc(4096, PIECE);
    for (unsigned long long i = 0; i < PIECE; i++)
        src[i] = (char)(i * 131 + 7);

    double c0 = now();
    int have_gpu = cudaFree(0) == cudaSuccess;
    double c1 = now();
    printf("size %.2f GB, %d runs; CUDA %s in %.3f s\n", (double)size / 1e9, runs, have_gpu ? "opened" : "absent",
           c1 - c0);
    char *dev = NULL;
    std::vector<char *> stages;
    std::vector<cudaStream_t> streams;
    const int max_threads = 16;
    if (have_gpu) {
        cudaCheck(cudaMalloc(&dev, PIECE));
        cudaCheck(cudaMemcpy(dev, src, PIECE, cudaMemcpyHostToDevice));
        for (int t = 0; t < max_threads; t++) {
            char *s;
            cudaStream_t st;
            cudaCheck(cudaHostAlloc(&s, PIECE, cudaHostAllocDefault));
            cudaCheck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            stages.push_back(s);
            streams.push_back(st);
        }
    }
    struct { const char *mode; int threads; } modes[] = {
        {"write", 1},    {"pwrite", 4},   {"mmap", 1},     {"mmap", 4},   {"mmap", 8},  {"mmap", 16},
        {"populate", 4}, {"populate", 8}, {"falloc", 1},   {"falloc", 4}, {"falloc", 8}, {"falloc", 16},
        {"dma", 4},      {"staged", 4},   {"staged", 8},
    };
    for (auto &m : modes) {
        if (!have_gpu && (!strcmp(m.mode, "dma") || !strcmp(m.mode, "staged")))
            continue;
        std::vector<double> t;
        for (int r = 0; r < runs; r++)
            t.push_back(one_run(dir, m.mode, m.threads, size, src, dev, stages, streams));
        std::sort(t.begin(), t.end());
        double med = t[t.size() / 2];
        printf("%-9s %2d threads  median %.3f s  %6.2f GB/s   min %.3f max %.3f", m.mode, m.threads, med,
               (double)size / med / 1e9, t.front(), t.back());
        if (!strcmp(m.mode, "falloc"))
            printf("   (fallocate alone, last run: %.3f s)", falloc_s);
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
