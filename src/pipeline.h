/* Producing the tensor data of one output file, with reading, dequantizing and
 * writing overlapped. A pool of worker threads, started once, takes chunks in
 * order: each plans the next chunk into a free slot of the ring, reads its
 * input with pread and dequantizes or casts it (on its own core, or through
 * the GPU), all while the calling thread writes finished chunks out in order.
 * Chunks are a few MiB, so the writer copies them out of cache, and the
 * ring's memory is all the host memory the data ever takes, whatever the size
 * of the model or its tensors (but for the few whole 4-bit tensors a
 * transposed item's chunks gather from, source_cache.h, within --mem). */
#ifndef NF4DEQ_PIPELINE_H
#define NF4DEQ_PIPELINE_H

#include <stdint.h>

#include "bnb_state.h"
#include "cpu_path.h"
#include "convert.h"
#include "lora.h"
#include "progress.h"
#include "safetensors.h"
#include "safetensors_writer.h"

/* What one output tensor is made of: a copy or cast of `src`, or the
 * dequantization of `w`; either with the LoRA deltas of `lora` merged in,
 * and either maybe transposed. Or the outputs of `parts`, one after another. */
struct out_item {
    struct st_out_tensor out;
    const struct model_tensor *src;
    const struct bnb_weight *w;
    const struct lora_target *lora; /* NULL, or terms to merge or token rows to put (never a replacement: that is `src`) */
    /* A replacement with terms on it is first rounded to the dtype of the
     * base tensor it replaces, as PEFT loads it into the base's parameter
     * before merging; DT_INVALID: the source is merged as stored. */
    enum st_dtype round_src_to;
    /* The source, [R, C], written transposed as out [C, R] (transposed.h). */
    int transposed;
    /* A tensor made of others back to back (a fused experts tensor,
     * expert_layout.h): nparts items, each planned as one of its own, whose
     * outputs make this one's; src, w and lora are then unused. */
    const struct out_item *parts;
    size_t nparts;
};

/* Output bytes a chunk aims at. Measured on the 1.1B preset into tmpfs
 * (docs/PERFORMANCE.md): large enough that per-chunk costs vanish, small enough
 * that a chunk is still in cache when written and the ring fills and drains
 * fast. A chunk is never less than one block of blocksize x nested blocksize. */
#define PIPELINE_CHUNK_BYTES (UINT64_C(4) << 20)
/* Slots beyond one per worker: the chunk being written, and one ready next. */
#define PIPELINE_SPARE_SLOTS 2
#define PIPELINE_MIN_SLOTS 3
#define PIPELINE_MAX_SLOTS 64
/* Headroom under --mem for what grows after the slots are made: thread stacks,
 * headers and plans of later shards. */
#define PIPELINE_RESERVE_BYTES (UINT64_C(24) << 20)
/* Chunks in flight through the GPU at once, each on a lane of its own
 * (gpu_use_lanes): enough that one's copy-in, another's kernel and a third's
 * copy-out overlap. */
#define PIPELINE_GPU_LANES 4
/* With --device cuda, "1" makes the workers wait for the GPU (pipeline_opts). */
#define GPU_ONLY_ENV "NF4DEQ_GPU_ONLY"
/* What the process may hold before the slots, the tensors' list, without a
 * warning that --mem leaves the chunks no room: below it, a tiny --mem is
 * the documented floor's business. */
#define PIPELINE_LIST_WARN_BYTES (UINT64_C(32) << 20)
/* Host memory the CUDA runtime takes once a device is open (measured on the
 * H200 host: docs/PERFORMANCE.md), kept out of the slots while it opens. */
#define PIPELINE_GPU_RUNTIME_BYTES (UINT64_C(160) << 20)
/* A slot's size: one holds any chunk, with its inputs; with merges its LoRA
 * factors too (all of R, and L for the rows the chunk touches).
 * Where --mem cannot hold a slot per worker, there are fewer slots and
 * workers, down to PIPELINE_MIN_SLOTS whatever --mem says. */
#ifndef PIPELINE_MIN_SLOT_BYTES /* the fuzz build lowers both to fuzz faster */
#define PIPELINE_MIN_SLOT_BYTES (UINT64_C(8) << 20)
#define PIPELINE_MIN_MERGE_SLOT_BYTES (UINT64_C(40) << 20)
#endif

struct gpu_start;
struct pipeline;

struct pipeline_opts {
    int threads;                 /* workers (fewer when --mem allows fewer slots) */
    uint64_t mem_bytes;          /* --mem: what the whole process may hold */
    uint64_t max_chunk_elements; /* caps chunks (tests); 0: no cap */
    int merging;                 /* LoRA deltas are merged: slots hold merge chunks */
    enum cpu_path cpu_path;      /* the CPU kernel */
    /* NULL to convert on the CPU only. Otherwise the GPU being opened
     * (gpu_start.h), which must outlive the pipeline: until it is open, the
     * workers compute on their cores; from then on dequantization chunks go
     * through its lanes while it does them as fast as a core (engine_clock.h),
     * and a worker that finds every lane busy dequantizes its chunk on its
     * core instead of waiting (merges, and the scalar kernel, always take the
     * GPU and wait). If it
     * fails to open, require_gpu (--device cuda) fails the run; otherwise the
     * run goes on with the CPU and a warning. A file's output is
     * not finished before the start has ended either way. With require_gpu
     * and NF4DEQ_GPU_ONLY=1 in the environment, the workers wait for the GPU
     * and its lanes instead, and it computes every chunk (the GPU tests use
     * it). */
    struct gpu_start *gpu_start;
    int require_gpu;
    /* The largest 4-bit tensor written transposed, held whole (source_cache.h);
     * 0: none. Its entries come out of --mem before the slots, where there is room. */
    uint64_t cached_source_bytes;
    /* The largest slot a planned item wants (pipeline_slot_bytes_wanted); 0:
     * the smallest slot is enough. Slots are made that large where --mem has
     * room for PIPELINE_MIN_SLOTS of them. */
    uint64_t slot_bytes;
};

/* Slot bytes `it` wants: for a merge, what a chunk of about
 * PIPELINE_CHUNK_BYTES of output takes with its inputs and its LoRA factors
 * (which come into every chunk); for what is written transposed, what its
 * smallest chunk takes; 0 for the rest, whose chunks fit any slot. */
uint64_t pipeline_slot_bytes_wanted(const struct out_item *it);

/* Allocates the ring and starts the workers: a slot per worker and
 * PIPELINE_SPARE_SLOTS more, as many as fit in what o->mem_bytes leaves once
 * the process's current resident memory (and the CUDA runtime's, with a GPU)
 * is counted; pinned once the GPU is open. `path` (the output) names it in
 * messages and must outlive the pipeline. stats->engine names what computed. */
int pipeline_create(struct pipeline **out, const char *path, const struct pipeline_opts *o,
                    struct convert_stats *stats, struct progress *progress);
void pipeline_destroy(struct pipeline *p);
/* Writes every tensor of `items` into `wr`, in the writer's order. */
int pipeline_write(struct pipeline *p, struct st_writer *wr, const struct out_item *items, size_t n);

#endif
