/* Kohya (sd-scripts) and ComfyUI LoRAs for Flux.1 (and, through
 * kohya_fold_module, the fold and split of Flux.2's kohya form, lora_flux2.h),
 * the form most Flux LoRAs are shared in (Civitai, ai-toolkit's kohya export, ComfyUI's LoRA saver):
 *   lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight   [r, in]
 *   lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight     [out, r]
 *   lora_unet_double_blocks_0_img_attn_qkv.alpha              [] (or [1])
 *   lora_te1_text_model_encoder_layers_0_self_attn_q_proj...   the CLIP text encoder
 * or with ComfyUI's names, diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight
 * and text_encoders.clip_l.transformer.text_model.encoder.layers.0....
 *
 * diffusers reads them by converting them at load into its own LoRA
 * (FluxLoraLoaderMixin.lora_state_dict, _convert_kohya_flux_lora_to_diffusers,
 * diffusers 0.42), and so does nf4deq, into the keys lora_diffusers.h reads:
 * - Flux.1's module names become diffusers' (img_attn_proj: transformer_blocks.N.attn.to_out.0, ...).
 * - alpha is folded into the factors: scale = alpha / r, split into
 *   scale_down * scale_up with scale_up a power of two, down * scale_down and
 *   up * scale_up each rounded to the factor's dtype; the LoRA then has
 *   r = alpha = its rank, scaling 1.
 * - A fused layer is split: double blocks' qkv into to_q, to_k, to_v (rows in
 *   thirds), single blocks' linear1 into those and proj_mlp (rows 3072, 3072,
 *   3072, 12288: Flux.1's sizes, which diffusers assumes). Each part takes all
 *   of down and its rows of up; or, where up is block-diagonal (kohya's
 *   split_qkv), its own ranks of down and its block of up.
 * - The text encoder's keys load as _load_lora_into_text_encoder loads them:
 *   the attention projections only where one is out_proj (else diffusers
 *   reads them in a form PEFT leaves out), the mlp always, nothing else.
 * - Modules the conversion gives keys load_lora_weights then loads nowhere
 *   (img_in, txt_in, time_in, vector_in, guidance_in, final_layer), kohya's T5
 *   (lora_te2_), DoRA scales and ComfyUI's extra tensors (position embedding,
 *   T5-XXL, diff and diff_b) are not merged, with one warning.
 * What nf4deq cannot read as diffusers does (LoHa, LoKr, the "mixture" layout,
 * other models' kohya LoRAs) is refused, naming the key. */
#ifndef NF4DEQ_LORA_KOHYA_H
#define NF4DEQ_LORA_KOHYA_H

#include "lora_rewrite.h"
#include "model.h"

/* The most parts diffusers splits one kohya module into (Flux.1's linear1). */
#define KOHYA_MAX_PARTS 4

/* Whether `w` holds kohya's factor pairs (a key with ".lora_down.weight",
 * DoRA scales aside), as diffusers decides to convert a LoRA. */
int kohya_lora_detect(const struct model *w);

/* Converts `w`, a kohya or ComfyUI Flux.1 LoRA read from `path`, into the
 * diffusers LoRA diffusers 0.42 loads from it, opened as *out (a temp file
 * with no name, lora_rewrite.h), whose messages name `path`. `warn`: say what
 * is left out. NF4_OK, NF4_EDATA naming the key for what diffusers would not
 * load, NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int kohya_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

/* sd-scripts' factors of one module: down [r, in], up [out, r], and its
 * alpha, NULL where the file has none. */
struct kohya_factors {
    const struct model_tensor *down, *up, *alpha;
};

/* Adds to `rw` one module's factors as diffusers' sd-scripts conversions
 * (_convert_to_ai_toolkit and _convert_to_ai_toolkit_cat, the same in
 * Flux.1's and Flux.2's) make them: alpha folded in, as the header says, and
 * a fused layer (nparts > 1, at most KOHYA_MAX_PARTS) split into
 * target_root + parts[j], rows as `rows` gives them or in equal parts (NULL).
 * parts NULL: one module, target_root itself, scaled only where it has an
 * alpha (Flux.1's text encoder). NF4_EDATA naming the tensor where the pair
 * is no LoRA pair or the rows do not split; NF4_ESOFTWARE. */
int kohya_fold_module(struct lora_rewrite *rw, const struct kohya_factors *f, const char *target_root,
                      const char *const *parts, const uint64_t *rows, size_t nparts);

#endif
