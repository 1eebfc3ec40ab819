// The GPU back end's context (cuda/gpu_backend.cu): the device, its budget, and
// its lanes: the streams and the device memory slots they cycle through. cuda/bench.cu reads the
// device's properties from it.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#define NUM_STREAMS 2

struct slot {
    void *mem;
    size_t bytes;
};

// What one job in flight needs of its own: several lanes let several host
// threads each move a chunk through the device at once, so one chunk's copy-in
// overlaps another's kernel and a third's copy-out.
#define GPU_MAX_LANES 4

struct gpu_lane {
    cudaStream_t streams[NUM_STREAMS];
    slot slots[NUM_STREAMS];
    float *d_code; // nested code table (256 floats)
    slot factors;  // LoRA factors of the chunk being merged, and its overflow counter
    uint64_t last_subchunks;
};

struct gpu_ctx {
    int device;
    int major, minor;
    int sm_count;
    size_t l2_bytes;
    uint64_t budget; // shared by the lanes in use
    uint64_t subchunk_cap;
    int nlanes;      // lanes in use (gpu_use_lanes), 1 by default
    int exclusive;   // one process at a time (gpu_exclusive)
    char name[320];
    gpu_lane lanes[GPU_MAX_LANES];
};
