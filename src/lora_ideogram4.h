/* Ideogram 4 LoRAs in the forms they are shared in besides diffusers':
 * Ideogram 4's own module names, under diffusion_model. (Ostris' AI-Toolkit)
 * or conditional_transformer., or none, with PEFT's lora_A / lora_B or
 * kohya's lora_down / lora_up and .alpha:
 *   diffusion_model.layers.0.attention.qkv.lora_A.weight   [r, in]
 *   diffusion_model.layers.0.attention.qkv.lora_B.weight   [3 * out, r]
 *   layers.0.feed_forward.w1.lora_down.weight, .lora_up.weight, .alpha
 *
 * diffusers reads a file with a key starting with diffusion_model. or
 * holding .attention.qkv. (DoRA scales aside) by converting it at load
 * (Ideogram4LoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_ideogram4_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads:
 * - diffusion_model. (or else conditional_transformer.) cut where a key
 *   starts with it;
 * - kohya's form where a key holds .lora_down.weight, PEFT's otherwise;
 * - for each layer N, each pair of layers.N.attention.qkv, attention.o,
 *   feed_forward.w1, w2, w3 and adaln_modulation, its alpha (where there is
 *   one) folded in as for Qwen-Image (lora_rewrite.h); attention.o made
 *   attention.to_out.0, and a fused attention.qkv split into attention.to_q,
 *   to_k and to_v: its down copied to each, its up cut into three equal
 *   blocks of rows;
 * - every key under transformer.; the file's metadata is kept; DoRA scales
 *   are dropped with a warning.
 * Refused (NF4_EDATA, naming the key) where diffusers raises: a down without
 * its up, a key left over (an up without its down, an alpha without a pair,
 * a module of another name, a layer number not written as diffusers writes
 * it); and where it would load something nf4deq does not take: a qkv up that
 * does not cut into three equal parts, a negative, NaN or infinite alpha, a
 * layer number over 100,000 (diffusers walks every number up to it) or one
 * that may be in Unicode digits, two keys that become one, a key longer than
 * 512 bytes. */
#ifndef NF4DEQ_LORA_IDEOGRAM4_H
#define NF4DEQ_LORA_IDEOGRAM4_H

#include "model.h"

/* Whether diffusers converts `w` when an Ideogram 4 pipeline loads it: DoRA
 * scales aside, a key starts with diffusion_model. or holds .attention.qkv. */
int ideogram4_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int ideogram4_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
