/* What diffusers' Flux.1 loader (FluxLoraLoaderMixin.load_lora_weights,
 * diffusers 0.42) does to a LoRA whose lora_A is not as wide as the layer,
 * as tensors nf4deq merges (lora.h binds them):
 * - a LoRA wider than x_embedder (BFL's control LoRAs, 128 inputs for
 *   FLUX.1's 64): _maybe_expand_transformer_param_shape_or_error_ replaces
 *   the layer by one that wide, the base weight in its first columns (a
 *   4-bit one dequantized, _maybe_dequantize_weight_for_expanded_lora) and
 *   zeros in the others, and says so in the config's in_channels;
 * - a LoRA narrower than its layer (a Flux.1 LoRA on a control or Fill
 *   model's x_embedder): _maybe_expand_lora_state_dict pads lora_A with
 *   zero columns.
 * Each tensor made is written to a temp file that no name reaches
 * (lora_rewrite.h) and opened as a model of that one tensor. */
#ifndef NF4DEQ_LORA_WIDEN_H
#define NF4DEQ_LORA_WIDEN_H

#include <stdint.h>

#include "bnb_state.h"
#include "model.h"

/* The most elements a tensor made here may have (16 MiB in F32): FLUX.1
 * Fill's x_embedder has 1.2 million. */
#define LORA_WIDEN_MAX_ELEMENTS (UINT64_C(1) << 22)

/* Base tensor `t` (a [rows, cols] matrix; `w` its 4-bit weight, or NULL
 * for a float one) widened to new_cols columns: its values first in each
 * row (bitsandbytes' dequantization in its quant state's dtype, or the
 * tensor's own), zeros after. `why` (the LoRA key that widens it) is named
 * in messages. NF4_OK, NF4_EDATA (too large, or a read fails on bad
 * data), NF4_EIO / NF4_ECANTCREAT, or NF4_ESOFTWARE. */
int lora_widen_base(const struct model_tensor *t, const struct bnb_weight *w, uint64_t new_cols, const char *why,
                    struct model **out);

/* lora_A `a` ([r, cols]) padded with zero columns to new_cols, under its own
 * name. Returns as lora_widen_base. */
int lora_widen_factor(const struct model_tensor *a, uint64_t new_cols, struct model **out);

#endif
