/* PEFT's target_parameters on the experts of a mixture-of-experts layer
 * (PEFT 0.21's lora.ParamWrapper), mapped onto the tensors a checkpoint holds.
 *
 * transformers 5 loads a MoE layer's experts as two fused parameters of a
 * module M (e.g. model.layers.0.mlp.experts):
 *   M.gate_up_proj [E, 2I, H]   each expert's gate rows, then its up rows
 *   M.down_proj    [E, H, I]
 * and saves them back as the checkpoint has them, one tensor per expert and
 * projection (its conversion mapping, reversed; bitsandbytes never quantizes
 * the fused parameters, and a checkpoint made before transformers 5 holds
 * per-expert 4-bit weights):
 *   Qwen2-MoE's form (qwen2_moe, qwen3_moe, deepseek_v3, olmoe, glm4_moe, ...):
 *     M.e.gate_proj.weight, M.e.up_proj.weight [I, H], M.e.down_proj.weight [H, I]
 *   Mixtral's form (mixtral, minimax, minimax_m2, phimoe, kimi_linear), M's
 *   ".mlp." saved as ".block_sparse_moe.":
 *     ...block_sparse_moe.experts.e.w1.weight (gate), w3 (up), w2 (down)
 *   the same names under M itself (lfm2_moe):
 *     M.e.w1.weight (gate), w3 (up), w2 (down)
 * A model whose experts transformers 5.24 loads without a conversion saves
 * them as it holds them, M.gate_up_proj and M.down_proj themselves:
 *   [E, out, in] as above (llama4, gemma4, mistral4, ...), or, where the
 *   experts module is_transposed (gpt_oss, openai_privacy_filter), [E, in,
 *   out]: gpt_oss's gate_up_proj [E, H, 2I], gate and up columns
 *   interleaved, and down_proj [E, I, H]. Still 16-bit in a bitsandbytes
 *   checkpoint. (aria's is_transposed experts are saved renamed, as fc1 and
 *   fc2: not known.) qwen3_vl_moe's are either (EXPERTS_FUSED_EITHER).
 * A multimodal model's language model has its own model_type, in config.json's
 * text_config (qwen3_5_moe's qwen3_5_moe_text), and its own conversion.
 *
 * A LoRA on parameter P of M, with rank r, is one pair
 *   M.lora_A.weight [r * E, in]   expert e's rows e * r .. e * r + r - 1
 *   M.lora_B.weight [out, r * E]  expert e's columns e, E + e, 2E + e, ...
 * (PEFT reshapes A to [E, r, in] and B to [out, r, E]), and expert e's delta
 * is scaling * B_e @ A_e, [out, in] = [2I, H] or [H, I], or its transpose
 * [in, out] where the module is_transposed. Into a fused tensor it goes as
 * a whole: viewed as [E * out, in], row e * out + o takes L(o, k) =
 * B[o, k * E + e] and R(k, i) = A[e * r + k, i]; viewed as [E * in, out]
 * (is_transposed), row e * in + i takes L(i, k) = A[e * r + k, i] and
 * R(k, o) = B[o, k * E + e]. Where both
 * parameters are targeted PEFT nests the wrappers in the order the module
 * registers its parameters (gate_up_proj, then down_proj): the last one
 * wraps the others, so its keys are M.lora_A.weight and the one before it
 * has M.base_layer.lora_A.weight. */
#ifndef NF4DEQ_LORA_EXPERTS_H
#define NF4DEQ_LORA_EXPERTS_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

/* How the base's checkpoint holds its experts. */
enum experts_form {
    EXPERTS_UNKNOWN, /* a model_type nf4deq does not know the fusing of, or none */
    EXPERTS_QWEN2_MOE,
    EXPERTS_MIXTRAL,
    EXPERTS_W123, /* Mixtral's names, under M as it is */
    EXPERTS_FUSED, /* M.gate_up_proj and M.down_proj themselves, [E, out, in] */
    EXPERTS_FUSED_TRANSPOSED, /* the same, [E, in, out]: the module is_transposed */
    /* The same, [E, out, in] where that is its shape, else [E, in, out]: what
     * transformers' Transpose(1, 2, check_dims=True) loads (qwen3_vl_moe,
     * whose own checkpoints hold [E, in, out] and transformers 5.24's saves
     * [E, out, in]; a square one as it is). */
    EXPERTS_FUSED_EITHER,
};

/* The form transformers 5.24's conversion mapping gives config.json's
 * model_type, or, where that type has no conversion of experts (a multimodal
 * model's own), its text_config's, which transformers applies to the language
 * model (NULL: none). */
enum experts_form experts_form_of(const char *model_type, const char *text_model_type);

/* An experts module's parameters PEFT wraps, in the order it wraps them. */
#define EXPERTS_NPARAMS 2
extern const char *const EXPERTS_PARAMS[EXPERTS_NPARAMS];

/* "M(.base_layer)^depth" -> M (allocated; NULL: out of memory) and depth. */
char *experts_unwrap(const char *wrapped, size_t *depth);

/* Whether the config's target_parameters (a JSON list of strings, or NULL)
 * select parameter P of module M as PEFT's _inject_parameters matches them:
 * an entry is "M.P", or "M.P" ends in "." and the entry. -1: out of memory. */
int target_parameters_select(const cJSON *target_parameters, const char *module, const char *param);

/* Which of EXPERTS_PARAMS target_parameters select on module M, filled into
 * params in the order PEFT wraps them; returns how many. */
size_t experts_targeted(const cJSON *target_parameters, const char *module, const char *params[EXPERTS_NPARAMS]);

/* The form in which a base holds parameter M.P of a model_type in `form`,
 * given whether it holds a 3-D tensor M.P: then fused (`form` where that is
 * a fused one, else [E, out, in]), whatever transformers converts the type's
 * per-expert tensors from; else `form`. EXPERTS_UNKNOWN stays. */
enum experts_form experts_stored_form(enum experts_form form, int base_holds_fused);

/* Whether `form` keeps M.P as one 3-D tensor. */
int experts_form_is_fused(enum experts_form form);

/* The name under which a checkpoint of `model_type` (experts_form_of's
 * arguments) saves runtime module M, where transformers renames it on load:
 * in Mixtral's form its last ".mlp." is ".block_sparse_moe.", and phimoe's
 * router, "M.router", is "M.gate" too. Allocated; NULL where it renames
 * nothing, or out of memory. */
char *experts_saved_module(const char *model_type, const char *text_model_type, const char *module);

/* The checkpoint tensors of expert e's part of parameter `param` of M in
 * `form`: gate_up_proj has two (gate, then up: each half of the rows), down_proj
 * one. Fills names (allocated) and returns how many, or 0 when out of memory. */
size_t experts_tensor_names(enum experts_form form, const char *module, const char *param, uint64_t e,
                            char *names[2]);

#endif
