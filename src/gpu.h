/* The CUDA back end, seen from C. Implemented in cuda/ (compiled by nvcc, cudart
 * linked statically). Every entry point is safe to call on a machine with no GPU
 * and no driver: gpu_open then fails with NF4_EUNAVAILABLE and a reason. */
#ifndef NF4DEQ_GPU_H
#define NF4DEQ_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "dequant.h"

struct gpu_ctx;

/* Number of usable CUDA devices; 0 with no driver or no device (never fails). */
int gpu_device_count(void);

/* Opens device `device` with a device-memory budget in bytes (0: a default
 * fraction of free memory). Returns NF4_OK, or NF4_EUNAVAILABLE / NF4_ESOFTWARE
 * with the reason recorded through nf4_fail(). */
int gpu_open(struct gpu_ctx **out, int device, uint64_t mem_budget);
void gpu_close(struct gpu_ctx *ctx);
/* "NVIDIA H100 80GB HBM3 (sm_90)" */
const char *gpu_name(const struct gpu_ctx *ctx);
/* Whether the device admits one process at a time (an exclusive compute mode,
 * or a mode that could not be read): there the next process can open it only
 * once this process's context is torn down. */
int gpu_exclusive(const struct gpu_ctx *ctx);
uint64_t gpu_mem_budget(const struct gpu_ctx *ctx);

/* Page-locked host memory, so transfers run at full speed and asynchronously.
 * Falls back to plain malloc'd memory if pinning fails; free with gpu_host_free. */
void *gpu_host_alloc(struct gpu_ctx *ctx, size_t bytes);
void gpu_host_free(struct gpu_ctx *ctx, void *p);
/* Page-locks memory the caller allocated (page-aligned), for the same speed;
 * returns 0, or -1 when it stays pageable (still usable, slower). Undo with
 * gpu_host_unregister before freeing it. */
int gpu_host_register(struct gpu_ctx *ctx, void *p, size_t bytes);
void gpu_host_unregister(struct gpu_ctx *ctx, void *p);

/* Dequantizes a job whose pointers are HOST memory (ideally from gpu_host_alloc):
 * copies inputs in, runs the fused kernel, copies the result to job->out. Splits
 * the job into sub-chunks that fit the budget and overlaps copy-in, kernel and
 * copy-out between them. Returns NF4_OK or an NF4_* code with nf4_fail() set. */
int gpu_dequant(struct gpu_ctx *ctx, const struct dequant_job *host_job);

/* Lanes: what one job in flight needs on the device (streams, buffers). With
 * n lanes (1 to 4; 1 after gpu_open), n host threads may each run a job at
 * once on a lane of their own, and the device overlaps one's copy-in with
 * another's kernel and copy-out. The budget is shared among the lanes.
 * Returns the lanes now in use. Call it with no job in flight. */
int gpu_use_lanes(struct gpu_ctx *ctx, int lanes);
/* gpu_dequant and gpu_merge on lane `lane` (taken modulo the lanes in use):
 * safe while other threads use the other lanes; gpu_dequant and gpu_merge use
 * lane 0. */
int gpu_dequant_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *host_job);

struct merge_job;
/* Merges LoRA deltas into a chunk with the fused kernel (cuda/merge_kernel.cuh):
 * `dq` is the 4-bit base's dequantization job (its out and out_dtype are not
 * used: the base is rounded to mj->w_dtype on the device), or NULL when mj->w
 * holds the unquantized base (F16, BF16 or F32). All pointers are HOST memory;
 * the result lands in mj->out. *overflowed: finite values that became
 * infinite. Returns NF4_OK or an NF4_* code with nf4_fail() set. */
int gpu_merge(struct gpu_ctx *ctx, const struct dequant_job *dq, const struct merge_job *mj, uint64_t *overflowed);
int gpu_merge_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *dq, const struct merge_job *mj,
                   uint64_t *overflowed);

#endif
