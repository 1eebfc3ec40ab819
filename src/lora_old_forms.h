/* diffusers' older forms of a LoRA's keys, and their renaming into PEFT's
 * (diffusers 0.42, utils/state_dict_utils.py). Before PEFT, diffusers saved
 * a LoRA's pairs under names of its own attention processors and
 * LoRACompatibleLinear layers, and its training scripts of 2023 (DreamBooth
 * LoRA, Stable Diffusion 1.x, 2.x and XL) still shared them so:
 *   unet.<block>.attn1.processor.to_q_lora.down.weight    [r, in]
 *   unet.<block>.attn1.processor.to_out_lora.up.weight    [out, r]
 *   unet.<module>.lora.down.weight                        (any other layer)
 *   text_encoder.<layer>.self_attn.to_q_lora.down.weight  (DIFFUSERS_OLD)
 *   text_encoder.<layer>.self_attn.q_proj.lora_linear_layer.down.weight
 *   text_encoder.<layer>.mlp.fc1.lora_linear_layer.up.weight  (DIFFUSERS)
 * Every loader still reads them, renaming as it loads:
 * - A denoiser (load_lora_adapter): where the first of its keys has no
 *   "lora_A", each key by convert_unet_state_dict_to_peft.
 * - A text encoder (_load_lora_into_text_encoder): its keys by
 *   convert_state_dict_to_diffusers, then convert_state_dict_to_peft, each
 *   telling their form by what the keys hold, and refusing keys of no form
 *   it knows.
 * Each renaming drops ".processor." first, then replaces the first pattern
 * of its table a key holds. */
#ifndef NF4DEQ_LORA_OLD_FORMS_H
#define NF4DEQ_LORA_OLD_FORMS_H

#include "lora_rewrite.h"
#include "model.h"

/* convert_unet_state_dict_to_peft on one name (a component's key, less the
 * component): 1, or 0 when out of memory (*name then as it was). */
int old_forms_unet_to_peft(char **name);

/* What renaming a text encoder's keys found. */
enum old_forms_result {
    OLD_FORMS_OK,
    OLD_FORMS_UNKNOWN,       /* convert_state_dict_to_diffusers cannot tell their form */
    OLD_FORMS_UNKNOWN_AFTER, /* convert_state_dict_to_peft cannot tell the form that gave */
    OLD_FORMS_OOM,
};

/* Renames a text encoder's keys (names less the component, n of them) into
 * PEFT's, as _load_lora_into_text_encoder does. */
enum old_forms_result old_forms_text_encoder_to_peft(struct lora_key *keys, size_t n);

/* Renames the keys of the component under `prefix` ("unet.",
 * "text_encoder.", ...) of a diffusers LoRA as its loader would: a text
 * encoder's ("text_encoder" before any other text) where any is in an older
 * form (to_q_lora., lora_linear_layer, .lora.down.), a denoiser's where the
 * first of them in the file's order of data has no "lora_A" (and none is
 * LoKr's, which diffusers reads apart). A text encoder's keys in PEFT's
 * names alone are left as they are: diffusers' round trip through its own
 * form gives a CLIP encoder's back, and refuses those of its mlp or
 * text_projection alone, which nf4deq merges as PEFT names them. Keys of the
 * oldest form that the round trip leaves (an attention's to_k_lora without
 * any to_out_lora) are left out with a warning, as PEFT leaves them. For a
 * file in diffusers' own form; a converted one (lora_rewrite.h) already has
 * PEFT's names. NF4_OK, NF4_EDATA naming the file and key where diffusers
 * refuses the keys or two of them would share a name, or where it would
 * leave one unread without a word (a denoiser's key in an older form after
 * a first key in PEFT's; an alpha among renamed keys), or NF4_ESOFTWARE. */
int diffusers_lora_old_names(struct model *weights, const char *prefix);

#endif
