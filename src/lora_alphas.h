/* Network alphas in a Flux.1 LoRA of diffusers' own form (TheLastBen's
 * form: transformer.transformer_blocks.0.attn.to_q.alpha beside the module's
 * lora_A and lora_B), as diffusers 0.42 reads them:
 * FluxLoraLoaderMixin.lora_state_dict pops every key holding "alpha" (a
 * floating tensor, else ValueError); load_lora_adapter refuses them beside
 * a config in the metadata, keeps those under the component's prefix, and
 * get_peft_kwargs makes the LoRA config of them: lora_alpha the first in the
 * order the file loads in (safetensors' load_file: by data offset), and an
 * alpha_pattern of each other one whose value differs, keyed by its name up
 * to ".lora_A." with ".alpha" cut out (a text encoder's: up to its last '.'
 * before ".down."), later keys of one name taking the earlier's place. PEFT matches those keys as patterns (lora.h), and takes
 * each module's scaling as the alpha tensor over r: a number of the
 * alphas' dtype. */
#ifndef NF4DEQ_LORA_ALPHAS_H
#define NF4DEQ_LORA_ALPHAS_H

#include <cJSON.h>

#include "dtype.h"
#include "model.h"

/* Whether lora_state_dict pops `key` as a network alpha. */
int network_alpha_key(const char *key);

/* NF4_OK, or NF4_EDATA where diffusers refuses w's network alphas whatever
 * component they name: one of no floating dtype (ValueError in
 * lora_state_dict), or any beside a LoRA config in the metadata
 * (load_lora_adapter's "Both network_alphas and metadata"). `has_metadata`:
 * whether w has one diffusers reads. */
int network_alphas_check(const struct model *w, int has_metadata);

/* Sets "lora_alpha" and "alpha_pattern" in cfg from w's network alphas
 * under `prefix` ("transformer."), and *dtype to their dtype; *found is 0
 * where there is none under it (cfg untouched). `label` names the file in
 * messages. w has passed network_alphas_check. NF4_OK; NF4_EDATA for an
 * alpha of the component's nf4deq does not take (not one number, F8, NaN
 * or infinite, or one that differs from lora_alpha in dtype as well as
 * value: PEFT would scale by each one's); NF4_ESOFTWARE. */
int network_alphas_config(const struct model *w, const char *prefix, const char *label, cJSON *cfg,
                          enum st_dtype *dtype, int *found);

#endif
