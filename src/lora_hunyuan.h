/* HunyuanVideo LoRAs in the form they are shared in besides diffusers' own:
 * HunyuanVideo's own module names (diffusion-pipe's and ComfyUI's form),
 *   diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight   [r, in]
 *   diffusion_model.double_blocks.0.img_attn_qkv.lora_B.weight   [3 * out, r]
 *   diffusion_model.single_blocks.0.linear1.lora_A.weight
 *   diffusion_model.txt_in.individual_token_refiner.blocks.0.mlp.fc1.lora_A.weight
 * (or transformer. for diffusion_model., or neither).
 *
 * diffusers reads a file with an img_attn_qkv key by converting it at load
 * into its own LoRA (HunyuanVideoLoraLoaderMixin.lora_state_dict,
 * _convert_hunyuan_video_lora_to_diffusers, diffusers 0.42), and so does
 * nf4deq, into the keys lora_diffusers.h reads:
 * - DoRA scales are dropped with a warning;
 * - "transformer." or else "diffusion_model." is removed from each key, and
 *   HunyuanVideo's names are made diffusers' by one list of replacements in
 *   its order (double_blocks -> transformer_blocks, img_mlp -> ff,
 *   fc1 -> net.0.proj, img_mod.linear -> norm1.linear, ...);
 * - the token refiner's keys (txt_in) get its own names (context_embedder.
 *   token_refiner.refiner_blocks, mlp -> ff, ...);
 * - a fused img_attn_qkv (txt_attn_qkv): a key with lora_A in it copied to
 *   to_q, to_k, to_v (add_q_proj...), any other cut into three blocks of rows;
 * - a single block's linear1 lora_A copied to to_q, to_k, to_v and proj_mlp,
 *   its lora_B (weight or bias) cut at 3072 rows, 3072, 3072 and the rest:
 *   HunyuanVideo's hidden size, whatever the model's; its other keys renamed
 *   (linear2 -> proj_out);
 * - final_layer.adaLN_modulation.1 becomes norm_out.linear with the two
 *   halves of its rows swapped (torch.chunk(2), then cat(scale, shift)), in
 *   lora_A as in lora_B, as diffusers does;
 * - every key then goes under "transformer."; the file's metadata is kept.
 * Every tensor is a byte copy: the form has no alphas. Where diffusers raises
 * (a key with two of the parts it converts, a block it cannot cut into the
 * parts it names, the token refiner's fused qkv, whose lora_A it cuts by
 * rank, musubi-tuner's kohya names) nf4deq refuses, naming the key; so where
 * two keys become one, where one of diffusers' steps (a prefix cut, the
 * renames, a rule's parts, "transformer." put back) moves a key onto the name
 * another has at that step (diffusers' dict keeps one of them, by their
 * order), and for a key without "lora" once converted, as load_lora_weights
 * refuses the file. */
#ifndef NF4DEQ_LORA_HUNYUAN_H
#define NF4DEQ_LORA_HUNYUAN_H

#include "model.h"

/* Whether diffusers converts `w` when a HunyuanVideo pipeline loads it: DoRA
 * scales aside, a key holds "img_attn_qkv". */
int hunyuan_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int hunyuan_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
