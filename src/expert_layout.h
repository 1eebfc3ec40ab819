/* gpt-oss's experts as Unsloth quantizes them, and the fused tensors that
 * transformers loads in their place.
 *
 * Unsloth's bitsandbytes checkpoints of gpt-oss (config.json: model_type
 * "gpt_oss") make each expert a linear layer, so as to quantize it, and the
 * router one too:
 *   M.experts.gate_up_projs.N.weight [2I, H], M.experts.gate_up_projs.N.bias [2I]
 *   M.experts.down_projs.N.weight [H, I],     M.experts.down_projs.N.bias [H]
 *   M.router.linear.weight [E, H],            M.router.linear.bias [E]
 * transformers (GptOssExperts, GptOssTopKRouter), vLLM, SGLang and
 * llama.cpp's converter load the layout of the model's own checkpoints:
 *   M.experts.gate_up_proj [E, H, 2I]   expert N's weight transposed (x @ W)
 *   M.experts.gate_up_proj_bias [E, 2I]
 *   M.experts.down_proj [E, I, H]       likewise
 *   M.experts.down_proj_bias [E, H]
 *   M.router.weight [E, H], M.router.bias [E]
 * The gate and up columns stay interleaved as they are: both layouts take
 * the gate from the even ones. A model directory in Unsloth's layout is
 * written in the fused one. */
#ifndef NF4DEQ_EXPERT_LAYOUT_H
#define NF4DEQ_EXPERT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "bnb_state.h"
#include "lora.h"
#include "model.h"
#include "pipeline.h"

#define UNSLOTH_EXPERTS_MODEL_TYPE "gpt_oss"

/* One fused tensor and the per-expert tensors it is made of. */
struct fused_experts {
    char *name;          /* M.experts.gate_up_proj, ..._bias, M.experts.down_proj, ..._bias */
    int bias;            /* the biases, [E, n], each as it is; else the weights, [E, C, R], each transposed */
    size_t nexperts;
    const struct model_tensor **sources; /* expert e's: a 4-bit weight's packed tensor, or a float tensor */
    uint64_t shape[3];   /* the fused tensor's */
    size_t ndim;
    uint64_t part_shape[2]; /* one expert's part of it: [C, R] for a weight, [n] for a bias */
    /* Planned by convert (convert_plan_experts): the fused tensor, whose
     * parts are expert e's output, and, for a weight, the LoRA targets of
     * its experts turned to the transposed orientation. */
    struct out_item item;
    struct out_item *parts;
    struct lora_target *flipped;
};

struct expert_rename {
    const char *from; /* the checkpoint's name (the model's string) */
    char *to;
};

struct expert_source {
    const char *name; /* the checkpoint's name of an expert's tensor */
    size_t fused, expert;
};

struct expert_layout {
    struct fused_experts *fused;
    size_t nfused;
    struct expert_rename *renames; /* M.router.linear.X -> M.router.X, sorted by from */
    size_t nrenames;
    struct expert_source *sources; /* sorted by name */
    size_t nsources;
};

/* *out: how the model directory `dir`'s model m (its 4-bit `weights`) is
 * written in the fused layout, or NULL where its config.json does not say
 * gpt_oss or it holds nothing in Unsloth's layout. NF4_EDATA, naming the
 * file and tensor, for a layout that cannot be fused: an expert missing or
 * twice, shapes that differ or do not agree (a bias that is not the
 * weight's rows), a weight with no elements, a tensor neither 4-bit nor F16,
 * BF16, F32 or F64, or a fused or renamed name the checkpoint already holds. */
int expert_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct expert_layout **out);
void expert_layout_free(struct expert_layout *x);

/* What becomes of tensor `name` (x may be NULL): expert *expert of
 * *fused, renamed to *renamed, or neither (both NULL). */
void expert_layout_lookup(const struct expert_layout *x, const char *name, const struct fused_experts **fused,
                          size_t *expert, const char **renamed);

#endif
