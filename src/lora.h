/* PEFT LoRA adapters, read for merging into the converted weights.
 *
 * An adapter directory holds adapter_config.json and adapter_model.safetensors.
 * The weights file's keys are
 *   base_model.model.<module>.lora_A.weight   [r, in]
 *   base_model.model.<module>.lora_B.weight   [out, r]
 *   base_model.model.<name>                   a modules_to_save tensor or a
 *                                             trained bias: replaces <name>
 *   base_model.model.<module>.base_layer.<p>  a wrapped module's base layer:
 *                                             replaces <module>.<p>
 * and each LoRA pair changes the base tensor <module>.weight ([out, in], or
 * a 16-bit Conv1D's [in, out]) by scaling * (B @ A), transposed for the
 * latter. scaling is lora_alpha / r, or lora_alpha / sqrt(r) with
 * use_rslora; rank_pattern and alpha_pattern override r and alpha per module.
 * An embedding's pair,
 *   base_model.model.<module>.lora_embedding_A [r, vocab]
 *   base_model.model.<module>.lora_embedding_B [dim, r]
 * changes <module>.weight [vocab, dim] by scaling * (B @ A)^T. With use_dora
 * (DoRA) each layer's pair comes with
 *   base_model.model.<module>.lora_magnitude_vector [out]
 * and each merged row is then multiplied by magnitude / ||row of W + delta||_2.
 * With lora_bias, lora_B has a bias too,
 *   base_model.model.<module>.lora_B.bias     [out]
 * and the base's <module>.bias [out] takes scaling * b: a term of rank 1 on
 * that tensor, seen as [1, out], with L = 1 and R = b.
 * Trained token rows (trainable_token_indices, token_rows.h),
 *   base_model.model.<module>.token_adapter.trainable_tokens_delta [n, cols]
 * replace rows of <module>.weight whole.
 * A LoRA on a MoE layer's fused experts (target_parameters),
 *   base_model.model.<module>(.base_layer).lora_A.weight [r * E, in]
 *   base_model.model.<module>(.base_layer).lora_B.weight [out, r * E]
 * changes each expert's tensors by its own B @ A (lora_experts.h).
 *
 * Everything is checked against the base before any data is read (but for the
 * factors of a tied head and embedding, compared to tell whether they were
 * trained as one): a key that matches no base tensor, a shape that does not
 * fit, a rank that disagrees with the config, DoRA where nf4deq cannot merge
 * it and other adapter types are refused with
 * NF4_EDATA and a message naming the file and the tensor. So is a change that
 * parts a tied lm_head from its embedding (model_dir.h), or resizes the
 * vocabulary, in a base that is one weights file: the output needs a
 * config.json that says so. */
#ifndef NF4DEQ_LORA_H
#define NF4DEQ_LORA_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "bnb_state.h"
#include "merge_job.h" /* LORA_MAX_ADAPTERS */
#include "lora_target.h"
#include "model.h"
#include "token_rows.h"

/* Far above any real rank; a config that claims more is refused before any
 * shape arithmetic. */
#define LORA_MAX_RANK 65536u
/* rank_pattern and alpha_pattern keys together, as compiled (see pattern.h):
 * at most 512 KiB of programs, and at most about 25 ms of matching per module
 * name of 200 characters. Real configs use a few hundred states; a key alone
 * may use 2048. */
#define LORA_MAX_PATTERN_STATES 16384u
#define ADAPTER_CONFIG_NAME "adapter_config.json"
#define ADAPTER_WEIGHTS_NAME "adapter_model.safetensors"
/* What PEFT before safetensors wrote (torch.save), read where there is no
 * ADAPTER_WEIGHTS_NAME. */
#define ADAPTER_PICKLE_NAME "adapter_model.bin"
#define PEFT_KEY_PREFIX "base_model.model."
/* A wrapped module's frozen base layer, saved as M.base_layer.P (lora.h's key list). */
#define BASE_LAYER_SEGMENT ".base_layer."

/* One adapter's LoRA pair on one base tensor. */
/* A LoKr's factors (PEFT's LoKr layer), where w1 is set: W1 is lokr_w1
 * [a, b], or lokr_w1_a [a, r1] @ lokr_w1_b [r1, b] where w1_b is set; W2 is
 * lokr_w2 [c, d], or lokr_w2_a @ lokr_w2_b likewise. The term's delta is
 * scaling * kron(W1, W2), [a * c, b * d], from its row row0 on: all of it,
 * or one projection's rows of a fused one's (Flux.2's to_qkv, lora_lokr.h). */
struct lora_kron {
    const struct model_tensor *w1, *w1_b, *w2, *w2_b;
    uint64_t a, b, c, d, row0;
};

struct lora_term {
    const struct model_tensor *a; /* lora_A: [r, in]; a LoKr's lokr_w1 or lokr_w1_a (for messages) */
    const struct model_tensor *b; /* lora_B: [out, r] */
    uint32_t r;
    float scaling;
    double alpha;         /* for inspect */
    int fan_in_fan_out;   /* the base tensor is [in, out]: the delta is transposed */
    int embedding;        /* an embedding's lora_embedding_A [r, vocab] and _B [dim, r]:
                             laid on [vocab, dim] as a transposed layer's (fan_in_fan_out set) */
    const struct model_tensor *magnitude; /* DoRA (use_dora): lora_magnitude_vector [rows]; else NULL */
    int bias;             /* a LoRA bias (lora_bias): a is lora_B.bias, read as R [1, out]; b is NULL, L = 1;
                             r = 1, and pair_r is the rank of the module's pair (for inspect) */
    uint32_t pair_r;
    /* One expert's part of a LoRA on a MoE layer's fused experts (PEFT's
     * target_parameters, lora_experts.h): L(row, k) = B[b_row0 + row,
     * b_col0 + k * b_col_step] and R = A's rows a_row0 .. a_row0 + r - 1.
     * b_col_step is 0 for any other pair (all four are 0 then).
     * On a fused experts tensor M.P (lora_experts.h), seen as [E * n, m],
     * one term serves every expert: expert_rows is n, b_col_step E, and
     * a chunk, which lies within one expert's rows, takes a_row0 = e * r
     * and b_col0 = e from its expert e (fan_in_fan_out set where M.P is
     * [E, in, out]: L from A's rows, R from B's columns). 0 otherwise. */
    uint64_t a_row0, b_row0;
    uint32_t b_col0, b_col_step;
    uint64_t expert_rows;
    struct lora_kron kron; /* a LoKr (b is NULL then); else all 0 */
    uint64_t padded_from;  /* lora_A's own columns, where it was padded to the layer's (lora_widen.h); else 0 */
    size_t adapter;       /* index of the adapter, in --lora order */
};

/* Everything the adapters do to one base tensor. */
struct lora_target {
    char *name;        /* the base tensor, e.g. model.layers.0.self_attn.q_proj.weight */
    uint64_t rows, cols; /* the base tensor's shape */
    const struct model_tensor *replace; /* the adapter's tensor that replaces it (then terms go on it); else NULL */
    int replace_frozen; /* it is a frozen layer PEFT saved whole (a base layer, an embedding layer), not a copy trained */
    int replace_trained_bias; /* it is a bias trained with "bias": "all" or "lora_only", not a modules_to_save copy */
    int replace_widened; /* it is the base weight widened for a wider LoRA (lora_widen.h): replace_frozen too */
    int replace_norm;    /* it is a Flux.1 control LoRA's norm weight (lora_adapter.flux1_loader) */
    size_t replace_adapter;
    size_t nterms;
    struct lora_term terms[LORA_MAX_ADAPTERS];
    /* Rows an adapter's trained tokens replace, after everything else (then
     * no term goes on the tensor, and a replacement only as its saved base
     * layer); else NULL. */
    struct token_rows *tokens;
    size_t tokens_adapter;
};

struct lora_adapter {
    char *dir;
    char *config_path; /* adapter_config.json, or a diffusers LoRA's weights file */
    struct model *weights;
    /* What precedes a module's name in its keys: PEFT_KEY_PREFIX, or a
     * diffusers LoRA's component ("transformer.", lora_diffusers.h), whose
     * keys for other components are left out. */
    char *key_prefix;
    int diffusers;
    /* Loaded by diffusers' Flux.1 loader (the base is a Flux.1 pipeline's
     * transformer, or its folder): a lora_A wider or narrower than its layer
     * is widened to fit (lora_widen.h), and a control LoRA's norm weights
     * (keys with norm_q, norm_k, norm_added_q or norm_added_k) replace the
     * model's. */
    int flux1_loader;
};

struct lora_set {
    size_t nadapters;
    struct lora_adapter adapters[LORA_MAX_ADAPTERS];
    size_t ntargets;
    struct lora_target *targets; /* sorted by name */
    /* The embedding the base ties TIED_HEAD_NAME to, where the adapters part
     * the two (a copy of either, or a LoRA on the head, without
     * ensure_weight_tying): the output then has the head as a tensor of its
     * own, the embedding as the base stores it with the targets of
     * TIED_HEAD_NAME applied, and config.json says tie_word_embeddings: false,
     * as PEFT's merge_and_unload leaves it. NULL otherwise. */
    const char *untied_embedding;
    /* Where the adapters were trained on a resized vocabulary
     * (resize_token_embeddings): the rows of the embedding layers they hold
     * whole, which replace the base's (of base_vocab_rows rows) in the
     * output, whose config.json then says vocab_size: vocab_rows. 0 otherwise. */
    uint64_t vocab_rows, base_vocab_rows;
    /* Where an adapter widens x_embedder (lora_widen.h): its inputs, which
     * config.json's in_channels then says, and the base's (its out_channels
     * where it had none of its own); 0 otherwise. */
    uint64_t in_channels, base_in_channels;
    /* The tensors made for the merge (lora_widen.h), each a model of one. */
    struct model **made;
    size_t nmade;
};

struct pattern;

/* An adapter_config.json, validated: what the merge needs from it. */
struct lora_config {
    uint32_t r;
    double alpha;
    int use_rslora, fan_in_fan_out;
    int use_dora; /* DoRA: each pair has a lora_magnitude_vector; merged rows are rescaled */
    int lora_bias; /* each lora_B has a bias, added to the base layer's, times scaling */
    int rank_from_shapes; /* a diffusers LoRA without its config: each pair's r and alpha are its rank */
    /* A Flux.1 LoRA in diffusers' form with alpha keys (network alphas,
     * lora_diffusers.h): r is still each pair's rank, but alpha comes from
     * lora_alpha and alpha_pattern, and the scaling, which PEFT computes as
     * the alpha tensor over r, is rounded to the alphas' dtype. */
    int alphas_given;
    enum st_dtype scaling_dtype; /* BF16 or F16: the scaling is rounded to it; any other: not */
    int ensure_weight_tying; /* PEFT keeps modules_to_save copies of tied weights tied */
    int trains_bias; /* "bias": "all" or "lora_only": the adapter holds <module>.bias tensors that replace the base's */
    /* A LoKr config (peft_type "LOKR", lora_lokr.h): r and alpha are its
     * "r" and "alpha"; how PEFT factors each layer's dimensions, and whether
     * it splits W1 too. */
    int lokr, decompose_both;
    int64_t decompose_factor;
    const cJSON *rank_pattern, *alpha_pattern, *modules_to_save; /* into root */
    const cJSON *token_indices; /* trainable_token_indices (token_rows.h), into root; NULL when absent */
    const cJSON *target_parameters; /* a list of parameter names (lora_experts.h), into root; NULL when absent */
    /* Each pattern key compiled, in the object's order, NULL-terminated. */
    struct pattern **rank_compiled, **alpha_compiled;
    struct lora_target_rules targets; /* which modules PEFT would wrap */
    cJSON *root;
};
/* Parses and checks an adapter config's text (`path` names it in messages):
 * NF4_EDATA for what is not a LoRA config nf4deq can merge (other
 * adapter types, features PEFT cannot merge, bad ranks or patterns). The lora_open
 * path and the fuzzer use it. Free with lora_config_free, even on failure. */
int lora_config_parse(const char *path, const char *json, size_t len, struct lora_config *c);
void lora_config_free(struct lora_config *c);

/* Opens each adapter (a PEFT adapter directory, or a diffusers LoRA: its
 * file, or a folder holding it), validates its config and binds every key of its
 * weights to a base tensor: `weights` are the base's 4-bit weights, the other
 * base tensors are looked up in `base`. Returns NF4_OK or NF4_ENOINPUT /
 * NF4_EDATA / NF4_ESOFTWARE with the reason recorded. */
int lora_open(struct lora_set **out, const char *const *dirs, size_t ndirs, const struct model *base,
              const struct bnb_weight *weights, size_t nweights);
/* lora_open for one component of a diffusers pipeline: every adapter is a
 * diffusers LoRA, and adapter i's keys under "<key_components[i]>." are the
 * ones bound (the component's own name, or "transformer" for a LoRA loaded
 * into Wan 2.2's transformer_2). `converted` (NULL, or ndirs entries): each
 * adapter's LoRA as already converted from another form (model_reopen), or
 * NULL to read its file, in diffusers' own form as the pipeline's loader
 * found it (diffusers_lora_open_own_form). */
int lora_open_component(struct lora_set **out, const char *const *dirs, size_t ndirs, const struct model *base,
                        const struct bnb_weight *weights, size_t nweights, const char *const *key_components,
                        struct model *const *converted);
void lora_close(struct lora_set *s);
const struct lora_target *lora_find(const struct lora_set *s, const char *name);
/* Whether t (NULL: no) is merged as DoRA: then it has exactly one term. */
int lora_target_is_dora(const struct lora_target *t);
/* Rows of t (NULL: none) per expert where it is a fused experts tensor that
 * a LoRA changes (lora_term.expert_rows): a chunk must not cross a multiple
 * of them. 0 otherwise. */
uint64_t lora_target_expert_rows(const struct lora_target *t);

/* The scaling PEFT uses: alpha / r, or alpha / sqrt(r) with use_rslora. */
float lora_scaling(double alpha, uint32_t r, int use_rslora);

/* 1 if module name `module` matches a rank_pattern / alpha_pattern key as PEFT
 * matches them: the whole pattern, as a Python regular expression, against the
 * end of the name at a '.' boundary ("(.*\.)?(PATTERN)$"); see pattern.h. -1
 * if the pattern is not one nf4deq can evaluate, or memory ran out. */
int lora_pattern_matches(const char *pattern, const char *module);

#endif
