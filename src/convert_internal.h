/* What the conversion modules share: convert.c (the run, the engine, one
 * output file) and convert_dir.c (model directories and pipelines). */
#ifndef NF4DEQ_CONVERT_INTERNAL_H
#define NF4DEQ_CONVERT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "bnb_state.h"
#include "convert.h"
#include "cpu_path.h"
#include "lora.h"
#include "model.h"
#include "pipeline.h"
#include "progress.h"
#include "tokenizer_files.h"

struct ctx {
    const struct convert_opts *opts;
    struct lora_set *lora;
    /* LoRA deltas are merged: --lora on a model, or on a pipeline component
     * (whose sets are its own, convert_dir.c); the engine is chosen for it. */
    int merging;
    /* The merge's size, which --device auto weighs (convert_note_merge):
     * elements with a LoRA delta, those of them 4-bit in the base, and the
     * elements times the ranks summed over adapters. */
    double merge_elements, merge_4bit_elements, merge_rank_elements;
    struct convert_stats *stats;
    struct gpu_start *gpu_start; /* NULL: the CPU only */
    enum cpu_path cpu_path;      /* NF4DEQ_CPU's, or the best this processor has */
    int threads;
    struct pipeline *pipeline;
    struct progress progress;
    int to_stdout;               /* OUT is "-": the one output file streams to standard output */
    char *resume_dir;            /* --resume: a dead run's temp directory to continue, or NULL */
    char dead_run[400];          /* the run that left it: "pid 1234, started ..." */
    struct tokenizer_source tokenizer; /* a model directory's; zero (IN's own) elsewhere */
    uint64_t cached_source_bytes; /* the largest 4-bit tensor written transposed (pipeline_opts) */
    uint64_t slot_bytes_wanted;   /* the largest slot a planned item wants (pipeline_opts) */
};


struct conv1d_layout;
/* Plans the Conv1D weights of `conv1d` (conv1d_layout.h), each written
 * transposed with its adapters' changes turned with it (NF4_EDATA for DoRA
 * and other terms on one, and a replacement of another shape). Raises
 * *cached_source_bytes to what the largest takes held whole
 * (source_cache.h). */
int convert_plan_conv1d(struct conv1d_layout *conv1d, const struct model *m, const struct bnb_weight *weights,
                        size_t nweights, const struct lora_set *lora, enum st_dtype dtype,
                        uint64_t *cached_source_bytes);
struct expert_layout;
/* Plans the fused tensors of `experts` (expert_layout.h), each expert's part
 * with its adapters' changes (those on a weight turned with it, where they
 * can be: NF4_EDATA for DoRA and other terms on one) and in one dtype
 * (NF4_EDATA otherwise: --dtype makes it one). Raises *cached_source_bytes
 * to what the largest 4-bit part takes held whole (source_cache.h). */
int convert_plan_experts(struct expert_layout *experts, const struct model *m, const struct bnb_weight *weights,
                         size_t nweights, const struct lora_set *lora, enum st_dtype dtype,
                         uint64_t *cached_source_bytes);
/* The output tensors of one input file: every tensor but quant-state parts,
 * each a dequantization, a copy or a cast, with LoRA changes; the tensors of
 * `experts` (NULL: none) fused, each fused tensor in the file of its expert 0,
 * and its renames made; the weights of `conv1d` (NULL: none) as planned,
 * transposed. */
int convert_plan_file(const struct model *m, size_t file_index, const struct bnb_weight *weights, size_t nweights,
                      const struct lora_set *lora, const struct expert_layout *experts,
                      const struct conv1d_layout *conv1d, enum st_dtype dtype, struct out_item **items_out,
                      size_t *n_out);
/* Writes one planned output file of model m's file_index-th input (its
 * metadata is carried over), atomically or to standard output. Fails with
 * NF4_EIO, before the file is published, if any input file of m changed. */
int convert_write_file(struct ctx *c, const char *path, const struct out_item *items, size_t n,
                       const struct model *m, size_t file_index, uint64_t *bytes_written);
/* Raises c->slot_bytes_wanted to what the largest chunk of `items` takes
 * (pipeline_slot_bytes_wanted), before the engine opens. */
void convert_want_slots(struct ctx *c, const struct out_item *items, size_t n);
uint64_t out_item_elements(const struct out_item *it);
uint64_t out_items_bytes(const struct out_item *items, size_t n);

/* Adds the LoRA deltas of set s (on a base with 4-bit `weights`) to what
 * --device auto weighs. */
void convert_note_merge(struct ctx *c, const struct lora_set *s, const struct bnb_weight *weights, size_t nweights);
/* Opens the --lora adapters against the base, before anything is written. */
int convert_open_lora(struct ctx *c, const struct model *m, const struct bnb_weight *weights, size_t nweights);
/* A warning when `in` holds no 4-bit weight and no adapter is merged: the run
 * only copies (or casts, unless `as_is`: a pipeline copies such components
 * whole), and the input is most likely not the one meant. */
void convert_warn_if_nothing_to_do(const struct ctx *c, const char *in, size_t nweights, int as_is);
/* Opens the device and the pipeline; `tensors` and `bytes` size the progress line. */
int convert_open_engine(struct ctx *c, const char *out, uint64_t tensors, uint64_t bytes);
void convert_close_engine(struct ctx *c);

/* A model directory, or a diffusers pipeline, into directory `out`, built in a
 * temp directory beside it and renamed into place (swapped in if `replace`). */
int convert_model_dir(struct ctx *c, const char *in, const char *out, int replace);
int convert_pipeline(struct ctx *c, const char *in, const char *out, int replace);

#endif
