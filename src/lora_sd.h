/* Kohya (sd-scripts) LoRAs for Stable Diffusion 1.x, 2.x and XL, the form
 * most of them are shared in (Civitai, A1111, ComfyUI):
 *   lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight  [r, in]
 *   lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight  [out, r] (XL: the SGM UNet's names)
 *   lora_unet_..._to_q.alpha                                                   [] (or [1])
 *   lora_te_... / lora_te1_... (the CLIP text encoder), lora_te2_... (XL's second)
 *
 * diffusers reads them when a Stable Diffusion pipeline loads them
 * (StableDiffusionLoraLoaderMixin and ...XLLoraLoaderMixin, diffusers 0.42):
 * lora_state_dict maps the SGM UNet's blocks by the UNet's config
 * (_maybe_map_sgm_blocks_to_diffusers), renames each module
 * (_convert_non_diffusers_lora_to_diffusers) and keeps the alphas apart
 * ("network alphas"); load_lora_into_unet and _load_lora_into_text_encoder
 * then rename the keys into PEFT's and make one LoraConfig per component
 * from the ranks and alphas (get_peft_kwargs). nf4deq does the same:
 * - The factors are copied as they are (a convolution's too: LoCon, and SD
 *   1.x's proj_in and proj_out), under PEFT's names:
 *   unet.<module>.lora_A.weight, text_encoder.<module>..., text_encoder_2....
 * - Each component's config is written into the converted file's metadata
 *   (lora_adapter_metadata), as get_peft_kwargs makes it: r the most common
 *   rank, lora_alpha the most common alpha (both the first seen on a tie, in
 *   the file's order of data), rank_pattern and alpha_pattern for the rest,
 *   under the names diffusers gives them (its alpha names for the UNet's
 *   attention projections and the text encoders' attention fit no module,
 *   so those take the common alpha, as in diffusers). Without alphas, each
 *   module's alpha is its rank.
 * - A text encoder's attention projections load only where one of them is
 *   out_proj (else diffusers reads them in a form PEFT leaves out), its mlp
 *   always, its text_projection too; other modules are left out.
 * - DoRA scales are dropped, with a warning.
 * Refused, naming the key: what diffusers' conversion refuses (a key left
 * over, a down without its up, a block number that does not parse, SGM names
 * without the UNet's config), keys two modules would share, and a file
 * holding lora_adapter_metadata and alphas. */
#ifndef NF4DEQ_LORA_SD_H
#define NF4DEQ_LORA_SD_H

#include "model.h"

/* Whether `w` is in kohya's Stable Diffusion form as diffusers decides it:
 * every key (DoRA scales aside) starts with lora_unet_, lora_te_, lora_te1_
 * or lora_te2_. */
int sd_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA with PEFT's keys
 * and its config in the metadata, as the header says, opened as *out (a temp
 * file with no name, lora_rewrite.h). `unet_config`: the UNet's config.json
 * (NULL: none), whose layers_per_block maps the SGM UNet's block numbers, as
 * Stable Diffusion XL's loader passes it (the others pass none, and SGM
 * names are then refused).
 * `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key, NF4_EIO /
 * NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int sd_lora_convert(const struct model *w, const char *path, const char *unet_config, int warn, struct model **out);

#endif
