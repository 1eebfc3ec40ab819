/* ACE-Step 1.5 LoRAs in the form its own trainer saves them: PEFT's keys on
 * the original DiT's module names,
 *   base_model.model.layers.0.self_attn.q_proj.lora_A.weight
 *   base_model.model.layers.3.cross_attn.o_proj.lora_B.weight
 *
 * diffusers reads a file with "q_proj" or "k_proj" anywhere in a key (DoRA
 * scales aside) by converting it at load (AceStepLoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_ace_step_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads, every key renamed in
 * turn as Python's str.replace renames it: base_model.model. cut from its
 * start; .q_proj., .k_proj., .v_proj., .o_proj. made .to_q., .to_k.,
 * .to_v., .to_out.0. (AceStepTransformer1DModel's names); the whole under
 * transformer. (a key already under it too, as diffusers puts it there
 * again). Every tensor is a byte copy; the file's metadata is kept; DoRA
 * scales are dropped with a warning. Such a file holds no alpha, and
 * diffusers reads none from the adapter_config.json beside it: without
 * lora_adapter_metadata each module's alpha is its rank (scaling 1), as
 * diffusers loads it. Refused (NF4_EDATA, naming the file and key): two keys
 * that become one (diffusers' dict keeps the last), a key longer than 512
 * bytes; a key without "lora" once converted is refused by
 * lora_diffusers.c, as ACE-Step's load_lora_weights refuses the file. */
#ifndef NF4DEQ_LORA_ACE_STEP_H
#define NF4DEQ_LORA_ACE_STEP_H

#include "model.h"

/* Whether diffusers converts `w` when an ACE-Step pipeline loads it: DoRA
 * scales aside, a key holds "q_proj" or "k_proj". */
int ace_step_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int ace_step_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
