/* Lumina-Image 2.0 LoRAs in the form they are shared in besides diffusers':
 * Lumina 2's own module names under diffusion_model. (ComfyUI's, and
 * diffusion-pipe's), lora_A / lora_B:
 *   diffusion_model.layers.0.attention.qkv.lora_B.weight       [3840, r]
 *   diffusion_model.noise_refiner.1.feed_forward.w2.lora_A.weight
 *   diffusion_model.layers.25.adaLN_modulation.1.lora_A.weight
 *
 * diffusers reads a file with a key starting with diffusion_model. (DoRA
 * scales aside) by converting it at load (Lumina2LoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_lumina2_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads:
 * - the first 16 characters cut off every key (diffusion_model., or as many
 *   of any other);
 * - per kind of block (noise_refiner, context_refiner, layers), as many
 *   blocks as distinct numbers follow "<kind>." anywhere in a key, numbered
 *   from 0, each with attention.qkv (lora_A copied to attn.to_q, to_k and
 *   to_v; lora_B cut at rows 2304, 768 and 768, Lumina-Image 2.0's widths
 *   whatever the model), attention.out (attn.to_out.0), feed_forward.w1, w2,
 *   w3 (feed_forward.linear_1, 2, 3) and, but in the context refiner's,
 *   adaLN_modulation.1 (norm1.linear), under transformer.;
 * - every tensor a byte copy, or rows of one; the file's metadata kept; DoRA
 *   scales dropped with a warning.
 * Refused (NF4_EDATA, naming the file and key) where diffusers raises: a
 * block without one of its keys (KeyError), a qkv lora_B of other than 3840
 * rows, a key left over (an alpha, a module outside the blocks); and where it
 * would load something nf4deq does not take: two keys that become one, a
 * block number that may be in Unicode digits (Python's \d reads them), or
 * of more than 9 digits, a key longer than 512 bytes. */
#ifndef NF4DEQ_LORA_LUMINA2_H
#define NF4DEQ_LORA_LUMINA2_H

#include "model.h"

/* Whether diffusers converts `w` when a Lumina 2 pipeline loads it: DoRA
 * scales aside, a key starts with diffusion_model. */
int lumina2_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int lumina2_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
