/* `nf4deq bench --cpu`: the CPU kernel alone (or with --lora-rank, the CPU
 * LoRA merge), per vector path and per thread count, in GB/s of output, next
 * to memcpy measured in the same run. */
#ifndef NF4DEQ_BENCH_CPU_H
#define NF4DEQ_BENCH_CPU_H

#include <stdint.h>

#include "dtype.h"

#define BENCH_CPU_MAX_THREAD_COUNTS 16

struct bench_cpu_opts {
    uint64_t rows, cols;
    enum st_dtype dtype;
    int iters;
    int thread_counts[BENCH_CPU_MAX_THREAD_COUNTS]; /* 0 entries: powers of two up to every core */
    int n_thread_counts;
    int json;
    uint32_t lora_rank; /* 0: dequantization; else the merge of one rank-r factor pair into a bf16 base */
};

/* Times one shape; prints a table (or JSON) on stdout. NF4_* code. */
int bench_cpu_run(const struct bench_cpu_opts *o);

#endif
