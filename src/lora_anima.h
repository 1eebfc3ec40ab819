/* Anima LoRAs in the form they are shared in besides diffusers': the
 * original Anima checkpoint's module names (Cosmos-Predict2's DiT and its
 * LLM adapter) under diffusion_model., as ComfyUI and the trainers that
 * target it write them:
 *   diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight
 *   diffusion_model.blocks.3.adaln_modulation_mlp.1.lora_B.weight
 *   diffusion_model.llm_adapter.blocks.0.cross_attn.k_proj.lora_A.weight
 *
 * diffusers reads a file with a key starting with diffusion_model. (DoRA
 * scales aside) by converting it at load (AnimaLoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_anima_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads:
 * - a key not starting with diffusion_model. kept as it is;
 * - diffusion_model.llm_adapter.<rest> made text_conditioner.<rest> (the
 *   AnimaTextConditioner component, whose names are the adapter's);
 * - every other diffusion_model.<rest>: each of diffusers' renames applied
 *   in turn to the whole of <rest>, as str.replace does (blocks. to
 *   transformer_blocks., adaln_modulation_self_attn.1 to norm1.linear_1,
 *   self_attn.q_proj to attn1.to_q, mlp.layer1 to ff.net.0.proj, ...), and
 *   put under transformer. (CosmosTransformer3DModel's names);
 * - every tensor a byte copy; the file's metadata kept; DoRA scales dropped
 *   with a warning.
 * Refused (NF4_EDATA, naming the file and key) where diffusers would load
 * something nf4deq does not take: two keys that become one, a key longer
 * than 512 bytes; a key without "lora" once converted (an alpha) is refused
 * after, as load_lora_weights refuses it (lora_diffusers.c). */
#ifndef NF4DEQ_LORA_ANIMA_H
#define NF4DEQ_LORA_ANIMA_H

#include "model.h"

/* Whether diffusers converts `w` when an Anima pipeline loads it: DoRA
 * scales aside, a key starts with diffusion_model. */
int anima_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int anima_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
