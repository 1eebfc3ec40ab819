/* Flux.2 LoRAs in the forms they are shared in besides diffusers' own:
 *   diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight  [r, in]   (BFL's module names:
 *   diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight  [out, r]   ai-toolkit's and
 *   diffusion_model.single_blocks.0.linear1.lora_A.weight                  ComfyUI's form)
 * (or base_model.model. for diffusion_model., as PEFT saves them), and
 * sd-scripts' and musubi-tuner's kohya names
 *   lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight, .lora_up.weight, .alpha
 *
 * diffusers reads them by converting them at load into its own LoRA
 * (Flux2LoraLoaderMixin.lora_state_dict: _convert_non_diffusers_flux2_lora_to_diffusers
 * and _convert_kohya_flux2_lora_to_diffusers, diffusers 0.42), and so does
 * nf4deq, into the keys lora_diffusers.h reads:
 * - BFL's names become diffusers' (double_blocks.N.img_attn.proj ->
 *   transformer_blocks.N.attn.to_out.0, img_mlp.0 -> ff.linear_in,
 *   single_blocks.N.linear1 -> single_transformer_blocks.N.attn.to_qkv_mlp_proj,
 *   img_in -> x_embedder, final_layer.linear -> proj_out, ...); keys already
 *   under transformer_blocks. or single_transformer_blocks. are kept as
 *   they are.
 * - A double block's fused qkv is split: its lora_A copied to each of to_q,
 *   to_k, to_v (add_q_proj... for txt_attn), its lora_B cut into three
 *   blocks of rows as torch.chunk cuts it. Every tensor is a byte copy: the
 *   BFL form has no alphas.
 * - The kohya form's alphas are folded in and its qkv split as Flux.1's
 *   (lora_kohya.h: kohya_fold_module); keys of modules the conversion does
 *   not know (the text encoder's, Flux.1's modulations) are left out with
 *   a warning, as diffusers leaves them.
 * - DoRA scales are dropped with a warning, before either conversion.
 * - A LoKr (a key holding ".lokr_", and no kohya factors) is converted by
 *   its own rules (lora_lokr_forms.h).
 * Where diffusers raises (a BFL-form key of no rule, an alpha in that form, a
 * block number that is no integer, a kohya factor without its lora_up) nf4deq
 * refuses, naming the key; so where two keys become one, and where diffusers would load nothing
 * (a kohya file with none of the modules it converts: ComfyUI's
 * diffusion_model. names with lora_down / lora_up among them). */
#ifndef NF4DEQ_LORA_FLUX2_H
#define NF4DEQ_LORA_FLUX2_H

#include "model.h"

/* Whether diffusers converts `w` when a Flux.2 pipeline loads it: DoRA
 * scales aside, a key holds ".lora_down.weight", or starts with
 * "diffusion_model." or "base_model.model.", or it is a LoKr that
 * lokr_flux2_converts. */
int flux2_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int flux2_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
