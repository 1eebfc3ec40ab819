/* MiniMax-H3 LoRAs as diffusers' MiniMaxH3LoraLoaderMixin reads them
 * (lora_state_dict, _convert_non_diffusers_minimax_h3_lora_to_diffusers,
 * diffusers 0.42), into the keys lora_diffusers.h reads:
 *
 * - The original checkpoint's module names, where a key (DoRA scales aside)
 *   starts with diffusion_model., blocks., token_refiner.blocks.,
 *   final_layer. or lora_unet_: ai-toolkit's (under diffusion_model.), the
 *   reference code's and ComfyUI's (no prefix), musubi-tuner's (flattened
 *   under lora_unet_: lora_unet_blocks_0_attn_qkv_proj), DiffSynth-Studio's
 *   (PEFT's .default. infix). diffusion_model. is removed; DiffSynth's infix
 *   dropped; musubi's names dotted back by its table of modules (a name
 *   outside it is refused); lora_down / lora_up read as lora_A / lora_B; an
 *   .alpha folded into the factors as diffusers folds it (alpha / rank,
 *   split, lora_rewrite_add_folded); then, under transformer.:
 *     attn.qkv_proj       to_q, to_k, to_v: lora_A each, lora_B cut in three
 *                         (DiffSynth's per-head interleaved rows, heads of
 *                         128, de-interleaved first)
 *     mlp.fc1             ff.net.0.proj, lora_B's two halves swapped
 *     attn.out_proj       attn.to_out.0;   mlp.fc2   ff.net.2
 *     blocks.N.           transformer_blocks.N.;
 *     token_refiner.blocks.N.   token_refiner.refiner_blocks.N.
 *     and the projections outside the blocks (video_patch_proj to proj_in,
 *     condition_proj to context_embedder, final_layer.video_out to
 *     proj_out, ...).
 *   A key the conversion does not take is refused, as diffusers refuses it.
 * - A PEFT dump: a key holds ".default.weight" and none starts with
 *   transformer. or transformer_ref.: each key put under transformer., every
 *   ".default." in it made ".".
 * - Else the keys as they are (transformer. and transformer_ref.).
 * - The alpha of the file's metadata (__metadata__ "alpha", as lightx2v's
 *   files record it), where the file has no lora_adapter_metadata and no
 *   .alpha tensor: read as Python's float() reads it, it is every module's
 *   alpha, scaling alpha / the module's rank. nf4deq writes the LoRA config
 *   diffusers builds from it (r, lora_alpha, rank_pattern "^module" for the
 *   ranks that are not the most common) into the converted file's
 *   lora_adapter_metadata, for each of transformer and transformer_ref
 *   that has keys. Text that float() does not read is ignored with a
 *   warning, as diffusers ignores it; a value that is not finite is refused.
 *
 * Every other tensor is a byte copy; a factor is scaled only where an alpha
 * is folded in. Which partition (transformer, transformer_ref) a LoRA goes
 * into is pipeline_lora.c's. */
#ifndef NF4DEQ_LORA_MINIMAX_H3_H
#define NF4DEQ_LORA_MINIMAX_H3_H

#include "model.h"

/* MiniMax-H3's second partition, the transformer the ref2va workflow
 * denoises with: a pipeline component of the transformer's class. */
#define MINIMAX_H3_REF "transformer_ref"

/* Whether diffusers changes `w` when a MiniMax-H3 pipeline loads it: its
 * keys are in the original checkpoint's names or a PEFT dump's, or its
 * metadata holds an alpha that diffusers reads. */
int minimax_h3_lora_detect(const struct model *w);

/* Converts `w`, read from `path`, into the diffusers LoRA diffusers 0.42
 * loads from it, opened as *out (lora_rewrite.h), whose messages name
 * `path`. `warn`: say what is left out or ignored. NF4_OK, NF4_EDATA naming
 * the key, NF4_EIO / NF4_ECANTCREAT for the temp file, or NF4_ESOFTWARE. */
int minimax_h3_lora_convert(const struct model *w, const char *path, int warn, struct model **out);

#endif
