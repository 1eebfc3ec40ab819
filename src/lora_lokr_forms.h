/* LoKr files in the forms diffusers 0.42 converts when Flux.2's and
 * Z-Image's pipelines load them (lora_lokr.h says what a LoKr is), each
 * rewritten into diffusers' own form, transformer.<module>.lokr_w1 ...,
 * as lora_rewrite.h rewrites LoRAs:
 * - lokr_convert_plain (_convert_non_diffusers_lokr_to_diffusers): module
 *   paths that are already diffusers' (ai-toolkit's Z-Image LoKr,
 *   SimpleTuner's Flux.2 one), maybe under "diffusion_model.";
 * - lokr_convert_flux2_bfl (_convert_non_diffusers_flux2_lokr_to_diffusers):
 *   BFL's module names under "diffusion_model." (ai-toolkit's Flux.2 LoKr),
 *   a double block's qkv a LoKr on the fused to_qkv / to_added_qkv;
 * - lokr_convert_flux2_lycoris (_convert_lycoris_flux2_lokr_to_diffusers):
 *   LyCORIS' lycoris_transformer_blocks_0_attn_to_q.lokr_w1.
 * Each first bakes every <module>.alpha into the module's first factor as
 * diffusers does (_bake_lokr_alpha_): lokr_w1 (or lokr_w1_a) times
 * alpha.item() / r in Python floats, rounded to its dtype, r the rows of
 * lokr_w2_b (else lokr_w1_b); an alpha of a module with neither is dropped,
 * as LoKr scales whole factors by nothing. DoRA scales are dropped with a
 * warning, as the loaders drop them first. Where diffusers raises (a key
 * the form has no rule for, a non-LoKr key, an alpha of a split module
 * without lokr_w1 or lokr_w1_a, an alpha that is not one number) nf4deq
 * refuses, naming the key; so where two keys become one, and for an alpha
 * that is not finite (whose NaN or infinite weights diffusers would merge). */
#ifndef NF4DEQ_LORA_LOKR_FORMS_H
#define NF4DEQ_LORA_LOKR_FORMS_H

#include "model.h"

/* Whether Flux.2's loader converts the LoKr `w`: DoRA scales aside, a key
 * holds LOKR_MARK, and one starts with "lycoris_", "diffusion_model." or
 * "base_model.model.", or none with "transformer." (the bare form). */
int lokr_flux2_converts(const struct model *w);

/* Each converts `w`, read from `path`, into the diffusers LoRA diffusers
 * makes of it, opened as *out (lora_rewrite_finish), whose messages name
 * `path`; `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE.
 * lokr_convert_plain: Z-Image's loader's. lokr_convert_flux2: Flux.2's,
 * for a LoKr lokr_flux2_converts: "base_model.model." made
 * "diffusion_model." in every key, then the LyCORIS form where a key
 * starts with "lycoris_", else BFL's where one starts with
 * "diffusion_model.", else the plain one. */
int lokr_convert_plain(const struct model *w, const char *path, int warn, struct model **out);
int lokr_convert_flux2(const struct model *w, const char *path, int warn, struct model **out);

#endif
