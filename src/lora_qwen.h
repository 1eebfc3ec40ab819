/* Qwen-Image LoRAs in the forms they are shared in besides diffusers' own:
 *   transformer_blocks.0.attn.to_q.lora_down.weight  [r, in]  (lightx2v's Lightning LoRAs)
 *   transformer_blocks.0.attn.to_q.lora_up.weight    [out, r]
 *   transformer_blocks.0.attn.to_q.alpha             []
 * kohya's names (lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight,
 * lora_unet_img_in...), ComfyUI's (diffusion_model.transformer_blocks.0...,
 * lora_A / lora_B) and PEFT's with its adapter name left in
 * (lora_A.default.weight).
 *
 * diffusers reads them by converting them at load into its own LoRA
 * (QwenImageLoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_qwen_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads:
 * - DoRA scales are dropped (with a warning, as diffusers warns);
 * - "diffusion_model." and "lora_unet_" are removed, kohya's underscores made
 *   dots except inside diffusers' module names (to_q, add_q_proj, img_mlp,
 *   to_add_out, ...), "default." removed;
 * - alpha is folded into the factors: scale = alpha / r in Python floats,
 *   split into scale_down * scale_up with scale_up a power of two, each
 *   factor times its part in fp32, rounded to its dtype; r = alpha = rank;
 * - every key then goes under "transformer."; the file's metadata is kept,
 *   since diffusers then reads the LoRA config from it.
 * An alpha goes to the first pair that names it (in the order of the keys in
 * the file, sorted, as diffusers pops them). Where
 * diffusers' conversion raises (a lora_down without its lora_up, a lora_A
 * without its lora_B or the reverse, a key of neither kind) nf4deq refuses,
 * naming the key; so where it would loop forever (a negative alpha) or
 * silently keep one of two keys that become one. */
#ifndef NF4DEQ_LORA_QWEN_H
#define NF4DEQ_LORA_QWEN_H

#include "model.h"

/* Whether diffusers converts `w` when a Qwen-Image pipeline loads it: a key
 * ending in ".alpha", starting with "lora_unet_" or "diffusion_model.", or
 * holding "default." (DoRA scales aside). */
int qwen_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int qwen_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
