// The GPU back end's context (cuda/gpu_backend.cu): the device, its budget, the
// streams and the device memory slots they cycle through. cuda/bench.cu reads the
// device's properties from it.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#define NUM_STREAMS 2

struct slot {
    void *mem;
    size_t bytes;
};

struct gpu_ctx {
    int device;
    int major, minor;
    int sm_count;
    size_t l2_bytes;
    uint64_t budget;
    uint64_t subchunk_cap;
    uint64_t last_subchunks;
    char name[320];
    cudaStream_t streams[NUM_STREAMS];
    slot slots[NUM_STREAMS];
    float *d_code; // nested code table (256 floats)
    slot factors;  // LoRA factors of the chunk being merged, and its overflow counter
};
