/* The LoRA merge of one chunk on the CPU: the arithmetic src/lora_merge.h
 * states, by the vector kernels of merge_simd.h. */
#ifndef NF4DEQ_MERGE_CPU_H
#define NF4DEQ_MERGE_CPU_H

#include <stdint.h>

#include "cpu_path.h"
#include "merge_job.h"

/* Computes the job with up to `threads` threads, with the kernels of `path`
 * (AVX-512 or AVX2 where it names one this processor has, else the portable
 * vector code). Every path gives the same bytes. Returns how many finite
 * merged values became infinite in the output dtype. */
uint64_t merge_cpu_path(const struct merge_job *j, int threads, enum cpu_path path);
/* merge_cpu_path with cpu_path_active()'s path. */
uint64_t merge_cpu(const struct merge_job *j, int threads);

#endif
