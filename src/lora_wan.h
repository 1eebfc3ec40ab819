/* Wan LoRAs in the forms they are shared in besides diffusers' own:
 *   diffusion_model.blocks.0.self_attn.q.lora_down.weight  [r, in]   (Wan's own module names:
 *   diffusion_model.blocks.0.self_attn.q.lora_up.weight    [out, r]   ComfyUI's, and the form of
 *   diffusion_model.blocks.0.self_attn.q.alpha             []         lightx2v's and CausVid's LoRAs)
 *   diffusion_model.blocks.0.self_attn.q.diff_b            [out]      (a change of the bias)
 * with lora_A / lora_B instead where any key has them, and musubi-tuner's
 * kohya names (lora_unet_blocks_0_self_attn_q.lora_down.weight, .alpha).
 *
 * diffusers reads them by converting them at load into its own LoRA
 * (WanLoraLoaderMixin.lora_state_dict: _convert_non_diffusers_wan_lora_to_diffusers
 * and _convert_musubi_wan_lora_to_diffusers, diffusers 0.42), and so does
 * nf4deq, into the keys lora_diffusers.h reads:
 * - Wan's names become diffusers' (self_attn.q -> attn1.to_q, cross_attn.k_img
 *   -> attn2.add_k_proj, ffn.0 -> ffn.net.0.proj, time_projection.1 ->
 *   condition_embedder.time_proj, head.head -> proj_out, text_embedding.0 ->
 *   condition_embedder.text_embedder.linear_1, img_emb.proj.1 ->
 *   condition_embedder.image_embedder.ff.net.0.proj, ...);
 * - a block module's alpha is folded into its factors as diffusers folds it
 *   (scale = alpha / r in Python floats, split into down * up with up a power
 *   of two, each factor times its part in fp32, rounded to its dtype);
 *   alphas anywhere else are not read;
 * - diff_b becomes lora_B.bias (PEFT's lora_bias), and head.head.diff, a
 *   whole weight difference (lightx2v's Wan2.2 distillation LoRAs), the
 *   head's lora_A with an identity lora_B;
 * - diffs of norms, a time_projection without its weights, and other
 *   weights' diffs are not loaded: left out with a warning;
 * - every key then goes under "transformer."; the file's metadata is kept.
 * Where diffusers' conversion raises (a key of no rule, a block alpha without
 * both factors, a musubi file without every block module a full LoRA has) nf4deq
 * refuses, naming the key; so where it would load a factor without its
 * partner, or keep one of two keys that become one. */
#ifndef NF4DEQ_LORA_WAN_H
#define NF4DEQ_LORA_WAN_H

#include "model.h"

/* Whether diffusers converts `w` when a Wan pipeline loads it: a key starts
 * with "diffusion_model." or "lora_unet_". */
int wan_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int wan_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
