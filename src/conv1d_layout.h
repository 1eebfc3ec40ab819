/* GPT-2's Conv1D weights as bitsandbytes stores them, and the shape the
 * model loads.
 *
 * transformers' Conv1D (the attention and MLP layers of GPT-2, OpenAI GPT,
 * ImageGPT and the Decision Transformer, and the MLP of CLVP's decoder)
 * stores its weight [in, out] and computes x @ W. bitsandbytes has only a
 * linear layer, [out, in], so transformers transposes a Conv1D's weight
 * before quantizing it, and the quant state records [out, in]. Written as
 * recorded, the model cannot load it (or, for a square c_proj, loads it
 * silently transposed), and transformers' own dequantize() makes the layers
 * nn.Linear, which a GPT-2 checkpoint cannot hold. In a model whose
 * config.json (in its directory, or beside a single file) names one of these
 * architectures (or a composite model whose "encoder" or "decoder" does: then
 * the weights under "encoder." or "decoder."; or whose "text_config" does:
 * those of its language or text model), each 4-bit Conv1D weight is written
 * transposed back, [in, out]: the shape of the model's own checkpoints. */
#ifndef NF4DEQ_CONV1D_LAYOUT_H
#define NF4DEQ_CONV1D_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "bnb_state.h"
#include "lora.h"
#include "pipeline.h"

/* One 4-bit Conv1D weight. */
struct conv1d_weight {
    const struct bnb_weight *w;
    uint64_t shape[2]; /* written: [in, out], its quant state's shape swapped */
    /* Planned by convert (convert_plan_conv1d): the item that writes it
     * transposed, and its LoRA targets turned with it. */
    struct out_item item;
    struct lora_target flipped;
};

struct conv1d_layout {
    struct conv1d_weight *weights; /* sorted by name, as the bnb weights are */
    size_t n;
};

/* *out: the 4-bit Conv1D weights of model m (directory or file `dir`, its
 * 4-bit `weights`), or NULL where config.json names no Conv1D architecture
 * or m holds no 4-bit Conv1D weight; where no config.json names a type at
 * all, a warning for weights named like Conv1D layers. NF4_EDATA, naming the
 * file and weight, for a Conv1D weight whose quant state is not 2-D. */
int conv1d_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct conv1d_layout **out);
void conv1d_layout_free(struct conv1d_layout *x);

/* The Conv1D weight named `name`, or NULL (x may be NULL). */
struct conv1d_weight *conv1d_layout_lookup(const struct conv1d_layout *x, const char *name);

#endif
