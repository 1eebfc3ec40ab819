// The fused LoRA merge launcher (cuda/merge_launch.cu), for the GPU back end.
#pragma once

#include "launch.cuh"

struct dev_merge;

// Launches the merge kernel for one device chunk on `stream`. Returns NF4_OK or
// an NF4_* code with nf4_fail() set.
int nf4_launch_merge(const struct dev_merge *m, cudaStream_t stream);

// DoRA: rescales nrows merged rows (fp32, `cols` each, at `merged`) by
// magnitude / L2 norm into `out` (out_dtype), counting finite values that
// became infinite into *overflowed. Returns NF4_OK or an NF4_* code.
int nf4_launch_dora_rows(const float *merged, void *out, enum st_dtype out_dtype, const float *magnitude, uint64_t cols,
                         uint64_t nrows, unsigned long long *overflowed, cudaStream_t stream);
