/* Opening the GPU on a thread of its own. Starting the CUDA runtime and a
 * context takes a fixed 0.2-0.5 s, as long as converting a small model from
 * tmpfs; the pipeline converts on the CPU meanwhile and moves to the GPU the
 * moment it is ready (see pipeline.h). */
#ifndef NF4DEQ_GPU_START_H
#define NF4DEQ_GPU_START_H

#include <stdint.h>

struct gpu_ctx;
struct gpu_start;

enum gpu_start_state { GPU_START_PENDING, GPU_START_READY, GPU_START_FAILED };

/* Starts opening CUDA device 0 with a device-memory budget (0: the default). */
int gpu_start_begin(struct gpu_start **out, uint64_t mem_budget);
/* Where the start is, without waiting. Once it has failed, the failure is
 * recorded in the caller's thread (nf4_last_error) and its code returned in
 * *code. */
enum gpu_start_state gpu_start_poll(struct gpu_start *s, int *code);
/* Waits for the start to end; then as gpu_start_poll. */
enum gpu_start_state gpu_start_wait(struct gpu_start *s, int *code);
/* The opened device, once READY (NULL before). It stays owned by `s`. */
struct gpu_ctx *gpu_start_ctx(const struct gpu_start *s);
/* Once it has ended: whether the driver listed any device (a failed start
 * with none is "no CUDA device", not a broken one). */
int gpu_start_found_device(const struct gpu_start *s);
/* Waits for the start to end, then closes the device. */
void gpu_start_free(struct gpu_start *s);

#endif
