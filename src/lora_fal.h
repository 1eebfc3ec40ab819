/* The two LoRA forms with BFL's FLUX.1 module names that Flux.1's loader
 * converts by fixed tables.
 *
 * fal's FLUX.1 Kontext LoRAs (fal's Kontext trainer): BFL's module names
 * under PEFT's base_model.model., lora_A / lora_B, some with a bias:
 *   base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight   [r, 3072]
 *   base_model.model.double_blocks.0.img_attn.qkv.lora_B.weight   [9216, r]
 *   base_model.model.single_blocks.0.linear1.lora_B.weight        [21504, r]
 *   base_model.model.final_layer.linear.lora_A.weight, ...
 *
 * diffusers reads a file with "base_model" in a key (once it has found it in
 * none of kohya's, XLabs' and BFL's control forms) by converting it at load
 * (FluxLoraLoaderMixin.lora_state_dict, _convert_fal_kontext_lora_to_diffusers,
 * diffusers 0.42), and so does nf4deq, into the keys lora_diffusers.h reads:
 * - each factor of every module of FLUX.1's 19 double blocks, 38 single
 *   blocks and final layer is taken, in diffusers' order; one missing is
 *   refused, naming it (diffusers' pop raises);
 * - modules renamed (img_mod.lin to norm1.linear, img_mlp.0 to ff.net.0.proj,
 *   img_attn.proj to attn.to_out.0, modulation.lin to norm.linear, linear2 to
 *   proj_out, final_layer.linear to proj_out, ...);
 * - a fused qkv's lora_A copied to to_q, to_k and to_v (add_q_proj... for the
 *   text's), its lora_B cut into three equal blocks of rows (torch.chunk);
 *   linear1's lora_A copied to to_q, to_k, to_v and proj_mlp, its lora_B and
 *   lora_B.bias cut at 3072, 3072, 3072 and 12288 rows, FLUX.1's sizes,
 *   written into the conversion whatever the model's (torch.split);
 * - biases renamed with their module where diffusers looks for them under
 *   the name it pops: the mlps', the projections', the single blocks'
 *   modulation and linear2, the final layer's;
 * - every key under transformer., each tensor a byte copy; the file's
 *   metadata is kept; DoRA scales are dropped with a warning.
 * Any other key is left over, and refused as diffusers raises ("should be
 * empty at this point"): a key without base_model.model., an alpha, the
 * modulations' and qkvs' biases and linear1's lora_A.bias (diffusers looks for
 * those under one name and pops another). */
/* BFL's FLUX.1 control LoRAs (FLUX.1 Canny [dev] LoRA, Depth [dev] LoRA):
 * the same names without a prefix, and more:
 *   img_in.lora_A.weight [r, 128]          x_embedder's, wider than FLUX.1's 64 inputs
 *   double_blocks.0.img_attn.norm.query_norm.scale [128], ...
 *   final_layer.adaLN_modulation.1.lora_B.weight [6144, r]
 * diffusers reads a file with "query_norm.scale" in a key (before fal's
 * form: kohya's and XLabs' come first) by _convert_bfl_flux_control_lora_to_diffusers,
 * and so does nf4deq: fal's tables with the embedders (time_in, vector_in,
 * guidance_in where a key left holds "guidance", txt_in, img_in) before the
 * blocks; every module's biases, the fused qkvs' lora_B.bias cut as their
 * lora_B; each block's query and key norms taken whole as
 * transformer_blocks.N.attn.norm_q.weight, ...; and the final
 * adaLN_modulation's factors with their halves of rows swapped
 * (swap_scale_shift, lora_A's too, as diffusers does). A lora_A.bias is
 * refused (PEFT's layer has none: diffusers loads the file without it, with
 * a warning). What the Flux.1 loader then does with such a LoRA (x_embedder
 * widened, the norms loaded into the model) is lora.h's. */
#ifndef NF4DEQ_LORA_FAL_H
#define NF4DEQ_LORA_FAL_H

#include "model.h"

/* Whether diffusers converts `w` as fal's Kontext form when a Flux.1
 * pipeline loads it: DoRA scales aside, a key holds "base_model" (the forms
 * diffusers looks for first aside: lora_kohya.h, lora_xlabs.h); and some key
 * is fal's, base_model.model. then double_blocks., single_blocks. or
 * final_layer.linear. Without one, diffusers' conversion raises on the first
 * module; nf4deq reads the file on, to say what it is (a PEFT adapter's
 * weights, base_model.model.model.layers...: lora_diffusers.h). */
int fal_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out. NF4_OK, NF4_EDATA naming the key,
 * NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int fal_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

/* Whether diffusers converts `w` as BFL's control form: DoRA scales aside,
 * a key holds "query_norm.scale". */
int bfl_control_lora_detect(const struct model *w);
/* fal_lora_convert for BFL's control form. */
int bfl_control_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
