// The fused LoRA merge launcher (cuda/merge_launch.cu), for the GPU back end.
#pragma once

#include "launch.cuh"

struct dev_merge;

// Launches the merge kernel for one device chunk on `stream`. Returns NF4_OK or
// an NF4_* code with nf4_fail() set.
int nf4_launch_merge(const struct dev_merge *m, cudaStream_t stream);
