/* ERNIE-Image LoRAs in the forms they are shared in besides diffusers':
 * diffusers' own module names under PEFT's base_model.model. or Ostris'
 * AI-Toolkit's diffusion_model.:
 *   base_model.model.layers.0.self_attention.to_q.lora_A.weight
 *   diffusion_model.layers.3.mlp.linear_fc2.lora_B.weight
 *
 * diffusers reads them by renaming at load (ErnieImageLoraLoaderMixin.lora_state_dict,
 * diffusers 0.42), and so does nf4deq, into the keys lora_diffusers.h
 * reads: where a key (DoRA scales aside) starts with base_model.model.,
 * every base_model.model. in every key made diffusion_model.; then where a
 * key starts with diffusion_model., every diffusion_model. in every key made
 * transformer. (Python's str.replace: anywhere in a key, not only at its
 * start). Every tensor is a byte copy; the file's metadata is kept; DoRA
 * scales are dropped with a warning. Refused (NF4_EDATA, naming the file
 * and key): two keys that become one (diffusers' dict keeps the last), a key
 * longer than 512 bytes; a key without "lora" is refused by
 * lora_diffusers.c, as ERNIE-Image's load_lora_weights refuses the file. */
#ifndef NF4DEQ_LORA_ERNIE_IMAGE_H
#define NF4DEQ_LORA_ERNIE_IMAGE_H

#include "model.h"

/* Whether diffusers renames `w` when an ERNIE-Image pipeline loads it: DoRA
 * scales aside, a key starts with base_model.model. or diffusion_model. */
int ernie_image_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int ernie_image_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
