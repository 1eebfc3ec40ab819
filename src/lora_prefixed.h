/* LoRAs in diffusers' own form but for ComfyUI's "diffusion_model." before
 * each key instead of the component's "transformer.":
 *   diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight
 * LTX-Video's and HiDream's loaders read them by cutting that prefix and
 * putting "transformer." in its place (_convert_non_diffusers_ltxv_lora_to_diffusers,
 * _convert_non_diffusers_hidream_lora_to_diffusers, diffusers 0.42), after
 * dropping DoRA scales; so does nf4deq, copying every tensor as it is into a
 * lora_rewrite, and the result is read as any diffusers LoRA.
 * - LTX-Video (LTXPipeline, LTXImageToVideoPipeline, ...): where a key starts
 *   with "diffusion_model.", every key must (diffusers raises otherwise).
 * - HiDream (HiDreamImagePipeline): where a key holds "diffusion_model",
 *   every key must start with "diffusion_model"; "diffusion_model." is cut
 *   where it is there.
 * - LTX-2 (LTX2Pipeline, LTX2ImageToVideoPipeline, ...; _convert_non_diffusers_ltx2_lora_to_diffusers):
 *   where a key starts with "diffusion_model.", those keys only, renamed
 *   from LTX-2's original names (patchify_proj -> proj_in, adaln_single. ->
 *   time_embed., q_norm -> norm_q, ...), the other keys left out; and where
 *   one starts with "text_embedding_projection.", those keys too, renamed
 *   (aggregate_embed -> text_proj_in) into the text connectors' component,
 *   "connectors.". Every key must then hold "lora" (diffusers raises). */
#ifndef NF4DEQ_LORA_PREFIXED_H
#define NF4DEQ_LORA_PREFIXED_H

#include "lora_diffusers.h"
#include "model.h"

/* Whether the loader of `family` (LORA_FAMILY_LTX_VIDEO or
 * LORA_FAMILY_HIDREAM) converts `w`, DoRA scales aside. */
int prefixed_lora_detect(const struct model *w, enum lora_family family);

/* Converts `w`, read from `path`, as LTX-Video's (HiDream's) loader does,
 * opened as *out (lora_rewrite.h), whose messages name `path`; `warn`: say
 * what is left out (DoRA scales). NF4_OK, NF4_EDATA naming the key, NF4_EIO
 * / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int ltx_video_lora_convert(const struct model *w, const char *path, int warn, struct model **out);
int hidream_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

/* Whether LTX-2's loader converts `w`: DoRA scales aside, a key starts with
 * "diffusion_model." or "text_embedding_projection.". */
int ltx2_lora_detect(const struct model *w);

/* Converts `w` as LTX-2's loader does, as the two above; `warn` also says
 * which keys are left out (those without the prefix). */
int ltx2_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
