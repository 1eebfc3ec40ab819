/* Producing the tensor data of one output file, with reading, dequantizing and
 * writing overlapped: a reader thread fills a ring of slots with input chunks,
 * the calling thread dequantizes or casts them (CPU threads or the GPU), and a
 * writer thread writes them out in order. The ring's memory is all the host
 * memory the data ever takes, whatever the size of the model or its tensors. */
#ifndef NF4DEQ_PIPELINE_H
#define NF4DEQ_PIPELINE_H

#include <stdint.h>

#include "bnb_state.h"
#include "convert.h"
#include "lora.h"
#include "progress.h"
#include "safetensors.h"
#include "safetensors_writer.h"

/* What one output tensor is made of: a copy or cast of `src`, or the
 * dequantization of `w`; either with the LoRA deltas of `lora` merged in. */
struct out_item {
    struct st_out_tensor out;
    const struct model_tensor *src;
    const struct bnb_weight *w;
    const struct lora_target *lora; /* NULL, or terms to merge (never a replacement: that is `src`) */
};

#define PIPELINE_SLOTS 3
/* Below this a slot cannot hold one block of the largest blocksize with its
 * nested block in fp32; --mem is raised to it. */
/* Headroom under --mem for what grows after the slots are made: thread stacks,
 * headers and plans of later shards. */
#define PIPELINE_RESERVE_BYTES (UINT64_C(24) << 20)
#ifndef PIPELINE_MIN_SLOT_BYTES /* the fuzz build lowers it to fuzz faster */
#define PIPELINE_MIN_SLOT_BYTES (UINT64_C(40) << 20)
#endif

struct gpu_ctx;
struct pipeline;

/* Allocates the ring: PIPELINE_SLOTS slots sharing what `mem_bytes` leaves once
 * the process's current resident memory is counted (pinned through the GPU
 * when there is one). `path` (the output) names it in messages and
 * must outlive the pipeline. */
int pipeline_create(struct pipeline **out, const char *path, struct gpu_ctx *gpu, int threads, uint64_t mem_bytes,
                    uint64_t max_chunk_elements, struct convert_stats *stats, struct progress *progress);
void pipeline_destroy(struct pipeline *p);
/* Writes every tensor of `items` into `wr`, in the writer's order. */
int pipeline_write(struct pipeline *p, struct st_writer *wr, const struct out_item *items, size_t n);

#endif
