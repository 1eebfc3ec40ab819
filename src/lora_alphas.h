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

/* Sets "lora_alpha" and "alpha_pattern" in cfg from w's network alphas
 * under `prefix` ("transformer."), and *dtype to their dtype; *found is 0
 * where there is none under it (cfg untouched). `label` names the file in
 * messages. NF4_OK; NF4_EDATA for an alpha diffusers refuses (not a
 * floating tensor), or one nf4deq does not take (not one number, F8, or
 * alphas of several dtypes: PEFT would scale by each one's); NF4_ESOFTWARE. */
int network_alphas_config(const struct model *w, const char *prefix, const char *label, cJSON *cfg,
                          enum st_dtype *dtype, int *found);

#endif
