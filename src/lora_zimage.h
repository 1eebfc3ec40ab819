/* Z-Image LoRAs in the forms they are shared in besides diffusers' own:
 *   diffusion_model.layers.0.attention.to_q.lora_A.weight   (ai-toolkit's, ComfyUI's; or lora_down /
 *   diffusion_model.layers.0.attention.to_q.alpha             lora_up, with .out for to_out.0)
 *   lora_unet_layers_0_attention_to_q.lora_down.weight      (kohya's names, sd-scripts' and musubi-tuner's;
 *   lora_unet_layers_0_attention_qkv.lora_down.weight        a fused qkv and a bare out where the trainer
 *                                                            wraps Z-Image's own module tree)
 *   diffusion_model.layers.0.attention.to.q.lora.down.weight (dots for underscores, as Anime-Z's)
 *   layers.0.attention.to_q.lora_A.default.weight            (PEFT's with its adapter name left in)
 *
 * diffusers reads them by converting them at load into its own LoRA
 * (ZImageLoraLoaderMixin.lora_state_dict, _convert_non_diffusers_z_image_lora_to_diffusers,
 * diffusers 0.42), and so does nf4deq, into the keys lora_diffusers.h reads:
 * - DoRA scales are dropped with a warning;
 * - "diffusion_model." and "lora_unet_" are removed, kohya's underscores
 *   made dots before the last dot (but inside to_q, to_k, to_v, to_out and
 *   feed_forward), which makes kohya's lora_down.weight lora.down.weight,
 *   a bare out before a factor or alpha made
 *   to_out.0, "default." removed, and Z-Image's own names put back
 *   (noise_refiner, context_refiner, adaLN_modulation, all_x_embedder,
 *   all_final_layer, cap_embedder, t_embedder);
 * - lora_down / lora_up pairs, else lora_A / lora_B pairs, then the
 *   lora.down / lora.up pairs left, each with its alpha folded in as
 *   Qwen-Image's are (lora_rewrite_add_folded); a fused qkv in that form is
 *   split into to_q, to_k, to_v (its down for each, its up in three blocks of
 *   rows), and dropped where the same block has separate ones or where it
 *   has no lora.up, as is a bare out beside a to_out.0 or without its up;
 * - every key then goes under "transformer."; the file's metadata is kept.
 * Where diffusers raises (a factor without its partner, an alpha or any key
 * left over) nf4deq refuses, naming the key; so where diffusers would loop
 * forever (a negative alpha), keep one of two keys that become one, split a
 * qkv into parts that cannot load, or load nothing.
 *
 * A LoKr (a key holding ".lokr_") is converted by its own rules, where a key
 * starts with "diffusion_model." or ends in ".alpha" (lokr_convert_plain,
 * lora_lokr_forms.h), and is read in diffusers' own form otherwise. */
#ifndef NF4DEQ_LORA_ZIMAGE_H
#define NF4DEQ_LORA_ZIMAGE_H

#include "model.h"

/* Whether diffusers converts `w` when a Z-Image pipeline loads it: DoRA
 * scales aside, a key ends in ".alpha" or starts with "diffusion_model.";
 * or, where no key holds ".lokr_", starts with "lora_unet_" or holds
 * "default.". */
int zimage_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int zimage_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
