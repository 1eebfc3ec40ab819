/* Krea 2 LoRAs in the forms they are shared in besides diffusers': Krea 2's
 * own module names under diffusion_model. (its reference trainer's and
 * ComfyUI's) or base_model.model. (Ostris' AI-Toolkit), lora_A / lora_B:
 *   diffusion_model.blocks.0.attn.wq.lora_A.weight
 *   base_model.model.txtfusion.refiner_blocks.0.mlp.gate.lora_B.weight
 *   diffusion_model.tmlp.0.lora_A.weight
 *
 * diffusers reads a file with a key starting with either (DoRA scales
 * aside) by converting it at load (Krea2LoraLoaderMixin.lora_state_dict,
 * _convert_non_diffusers_krea2_lora_to_diffusers, diffusers 0.42), and so
 * does nf4deq, into the keys lora_diffusers.h reads:
 * - base_model.model., then diffusion_model., cut off the start of every key;
 * - a key ending in .lora_A.weight or .lora_B.weight whose module is a
 *   block's attention (blocks.N.attn.wq, wk, wv, wo, gate: to_q, to_k, to_v,
 *   to_out.0, to_gate) or feed-forward (blocks.N.mlp.gate, up, down: ff.gate,
 *   ff.up, ff.down) goes under transformer.transformer_blocks.N; the same
 *   modules of the text fusion's layerwise and refiner blocks under
 *   transformer.text_fusion.layerwise_blocks.N (refiner_blocks.N); first,
 *   last.linear, tmlp.0, tmlp.2, tproj.1, txtmlp.1, txtmlp.3 and
 *   txtfusion.projector become img_in, final_layer.linear,
 *   time_embed.linear_1, time_embed.linear_2, time_mod_proj, txt_in.linear_1,
 *   txt_in.linear_2 and text_fusion.projector;
 * - every tensor is a byte copy; the file's metadata is kept; DoRA scales are
 *   dropped with a warning.
 * Refused (NF4_EDATA, naming the key) where diffusers raises: a key of no
 * such module (an alpha, a norm, an unknown module: left over); and where it
 * would load something nf4deq does not take: two keys that become one, a
 * block number that may be in Unicode digits (Python's \d reads them), a key
 * with a line break (where Python's $ matches) or longer than 512 bytes. */
#ifndef NF4DEQ_LORA_KREA2_H
#define NF4DEQ_LORA_KREA2_H

#include "model.h"

/* Whether diffusers converts `w` when a Krea 2 pipeline loads it: DoRA
 * scales aside, a key starts with diffusion_model. or base_model.model. */
int krea2_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int krea2_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
