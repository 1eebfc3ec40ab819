/* FLUX.3 LoRAs in the form they are shared in besides diffusers': BFL's own
 * module names under diffusion_model. (ComfyUI's, and BFL's trainers'):
 *   diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight
 *   diffusion_model.single_blocks.3.mlp_in.lora_B.weight
 *   diffusion_model.txt_mode_blocks.0.attn_out.lora_A.weight
 *
 * diffusers reads a file with a key starting with diffusion_model. (DoRA
 * scales aside) by converting it at load (Flux3LoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_flux3_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads, each key (with the
 * prefix or not) renamed in turn as Python's str.replace renames it:
 * diffusion_model. cut from its start; content_mode_blocks. made
 * mode_blocks., single_blocks. made single_transformer_blocks.; then
 * .q_proj., .k_proj., .v_proj., .attn_out., .mlp_in., .mlp_out. made
 * .attn.to_q., .attn.to_k., .attn.to_v., .attn.to_out.0., .ff.linear_in.,
 * .ff.linear_out.; the whole under transformer.. Every tensor is a byte
 * copy; the file's metadata is kept; DoRA scales are dropped with a warning.
 * Refused (NF4_EDATA, naming the file and key): two keys that become one
 * (diffusers' dict keeps the last), a key longer than 512 bytes; a key
 * without "lora" once converted is refused by lora_diffusers.c, as FLUX.3's
 * load_lora_weights refuses the file. */
#ifndef NF4DEQ_LORA_FLUX3_H
#define NF4DEQ_LORA_FLUX3_H

#include "model.h"

/* Whether diffusers converts `w` when a FLUX.3 pipeline loads it: DoRA
 * scales aside, a key starts with diffusion_model. */
int flux3_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int flux3_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
