/* XLabs' Flux.1 LoRAs (XLabs-AI's x-flux trainer and its flux-lora-collection):
 *   double_blocks.0.processor.qkv_lora1.down.weight   [r, in]        (image attention's fused qkv;
 *   double_blocks.0.processor.qkv_lora1.up.weight     [3 * out, r]    qkv_lora2: the text's)
 *   double_blocks.0.processor.proj_lora1.down.weight                  (proj_lora2: the text's)
 *   single_blocks.0.processor.qkv_lora.down.weight, proj_lora...
 * (or diffusion_model. before them), no alphas.
 *
 * diffusers reads a file with "processor" in a key (and no kohya
 * lora_down.weight) by converting it at load (FluxLoraLoaderMixin.
 * lora_state_dict, _convert_xlabs_flux_lora_to_diffusers, diffusers 0.42),
 * and so does nf4deq, into the keys lora_diffusers.h reads:
 * - DoRA scales are dropped with a warning;
 * - a key starting with double_blocks (or diffusion_model.double_blocks) goes
 *   under transformer.transformer_blocks.N, N the digits after the first
 *   "double_blocks." followed by any: proj_lora1 as attn.to_out.0, proj_lora2
 *   as attn.to_add_out, qkv_lora1 (qkv_lora2) split into attn.to_q, to_k,
 *   to_v (add_q_proj...): its down copied to each, its up cut into three
 *   equal blocks of rows; single_blocks likewise under
 *   single_transformer_blocks.N, proj_lora as proj_out, qkv_lora as to_q,
 *   to_k, to_v; ".lora_A.weight" after a key with "down" in it,
 *   ".lora_B.weight" after one with "up" (nothing after one with neither);
 * - any other key is kept as it is;
 * - every tensor is a byte copy; the file's metadata is kept.
 * Where diffusers raises (no block number, a qkv key without its up, a qkv up
 * that does not cut into three equal blocks, a key with "qkv" in it that no
 * rule takes) nf4deq refuses, naming the key; so where two keys become one
 * and where a block number is in Unicode's digits, which Python's \d reads. */
#ifndef NF4DEQ_LORA_XLABS_H
#define NF4DEQ_LORA_XLABS_H

#include "model.h"

/* Whether diffusers converts `w` as XLabs' when a Flux.1 pipeline loads it:
 * DoRA scales aside, a key holds "processor" (kohya's form, which diffusers
 * looks for first, aside: lora_kohya.h). */
int xlabs_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int xlabs_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
