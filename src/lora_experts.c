#include "lora_experts.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const EXPERTS_PARAMS[EXPERTS_NPARAMS] = {"gate_up_proj", "down_proj"};

/* transformers 5.24's conversion_mapping.py: the model_types whose experts
 * load through the very WeightConverters of Mixtral or Qwen2-MoE (the same
 * source names, MergeModulelist(0), then Concatenate(1) of gate and up), and
 * whose modeling file was read: each of their experts modules registers
 * gate_up_proj [E, 2I, H], then down_proj [E, H, I], and none is
 * is_transposed (gpt_oss, aria and openai_privacy_filter are). Not listed:
 * sarvam_mla and sarvam_moe (no modeling file in 5.24 to read), and
 * deepseek_ocr2, deepseek_v4, mistral_large4_text and minimax_m3_vl, whose
 * conversions also rename the path to the experts (a checkpoint's "layers."
 * or ".ffn." is not the runtime's). A type's other renames (attention,
 * routers, norms) leave the experts' names alone; a LoRA on a module they
 * rename names a tensor the checkpoint lacks, and is refused as an adapter
 * for another model, but for Mixtral's form's router (experts_saved_module,
 * lora.c's module_weight_in_base). So is one on kimi_k25's experts, found
 * through its text_config's deepseek_v3 (lora.c), whose path kimi_k25
 * renames: expert e's tensors are looked up under the runtime's names, and
 * either are there, the same tensors, or are missing. */
static const char *const MIXTRAL_TYPES[] = {"mixtral", "minimax", "minimax_m2", "phimoe", "kimi_linear"};
/* Mixtral's expert names without its ".mlp." rename: the experts stay under
 * their runtime module (lfm2_moe's feed_forward.experts). */
static const char *const W123_TYPES[] = {"lfm2_moe"};
static const char *const QWEN2_MOE_TYPES[] = {
    "qwen2_moe",     "afmoe",        "deepseek_v2",   "deepseek_v3", "deepseek_v32",   "dots1",
    "ernie4_5_moe",  "glm4_moe",     "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe",      "longcat_flash",
    "solar_open",    "mellum",       "qwen3_moe",     "beam",        "qwen3_omni_moe", "qwen3_omni_moe_thinker",
    "qwen3_omni_moe_text", "qwen3_next", "hunyuan_v1_moe", "flex_olmo", "olmoe",       "exaone_moe",
    "cohere2_moe",   "axk1",         "axk2",          "bailing_hybrid", "flint",       "glm5_next",
    "glm5_next_text", "hy_v3",       "jamba",         "kolibri1",    "laguna",         "mimo_v2_flash",
    "qwen3_5_moe_text", "qwen4_exp_text",
};

/* transformers 5.24's model_types whose experts modules register fused
 * parameters that no conversion maps (so a checkpoint holds them as they are),
 * checked end to end by tests/fixtures/lora/check_experts_forms.py: those
 * whose module is_transposed, [E, in, out], and the rest, [E, out, in]. A
 * square parameter (gpt_oss's down_proj, H = I) cannot tell the two apart
 * by its shape; the type does. */
static const char *const FUSED_TRANSPOSED_TYPES[] = {"gpt_oss", "openai_privacy_filter"};
/* Fused, and transposed on load where the shape is not the runtime's (lora_experts.h). */
static const char *const FUSED_EITHER_TYPES[] = {"qwen3_vl_moe"};
static const char *const FUSED_TYPES[] = {"llama4",   "llama4_text",   "gemma4", "gemma4_text",
                                          "mistral4", "granitemoe_swa"};

static int in_list(const char *s, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, list[i]) == 0)
            return 1;
    return 0;
}

#define TYPE_LIST(list) list, sizeof list / sizeof *list

/* Each form's model_types. */
static const struct {
    const char *const *types;
    size_t n;
    enum experts_form form;
} FORM_TYPES[] = {
    {TYPE_LIST(MIXTRAL_TYPES), EXPERTS_MIXTRAL},
    {TYPE_LIST(QWEN2_MOE_TYPES), EXPERTS_QWEN2_MOE},
    {TYPE_LIST(W123_TYPES), EXPERTS_W123},
    {TYPE_LIST(FUSED_TYPES), EXPERTS_FUSED},
    {TYPE_LIST(FUSED_TRANSPOSED_TYPES), EXPERTS_FUSED_TRANSPOSED},
    {TYPE_LIST(FUSED_EITHER_TYPES), EXPERTS_FUSED_EITHER},
};

/* The form of one model_type (NULL: none). */
static enum experts_form form_of_type(const char *model_type)
{
    for (size_t i = 0; model_type && i < sizeof FORM_TYPES / sizeof *FORM_TYPES; i++)
        if (in_list(model_type, FORM_TYPES[i].types, FORM_TYPES[i].n))
            return FORM_TYPES[i].form;
    return EXPERTS_UNKNOWN;
}

enum experts_form experts_form_of(const char *model_type, const char *text_model_type)
{
    enum experts_form form = form_of_type(model_type);
    return form != EXPERTS_UNKNOWN ? form : form_of_type(text_model_type);
}

int experts_form_is_fused(enum experts_form form)
{
    return form == EXPERTS_FUSED || form == EXPERTS_FUSED_TRANSPOSED || form == EXPERTS_FUSED_EITHER;
}

enum experts_form experts_stored_form(enum experts_form form, int base_holds_fused)
{
    if (form == EXPERTS_UNKNOWN || !base_holds_fused)
        return form;
    return experts_form_is_fused(form) ? form : EXPERTS_FUSED;
}

#define BASE_LAYER_TAIL ".base_layer"

char *experts_unwrap(const char *wrapped, size_t *depth)
{
    size_t n = strlen(wrapped), k = strlen(BASE_LAYER_TAIL);
    *depth = 0;
    while (n > k && memcmp(wrapped + n - k, BASE_LAYER_TAIL, k) == 0) {
        n -= k;
        ++*depth;
    }
    return strndup(wrapped, n);
}

int target_parameters_select(const cJSON *target_parameters, const char *module, const char *param)
{
    size_t len = strlen(module) + 1 + strlen(param) + 1;
    char *key = malloc(len);
    if (!key)
        return -1;
    snprintf(key, len, "%s.%s", module, param);
    int selected = 0;
    for (const cJSON *e = target_parameters ? target_parameters->child : NULL; e && !selected; e = e->next) {
        size_t k = cJSON_IsString(e) ? strlen(e->valuestring) : 0;
        selected = k && (strcmp(key, e->valuestring) == 0 ||
                         (k < len - 2 && key[len - 2 - k] == '.' && strcmp(key + len - 1 - k, e->valuestring) == 0));
    }
    free(key);
    return selected;
}

size_t experts_targeted(const cJSON *target_parameters, const char *module, const char *params[EXPERTS_NPARAMS])
{
    size_t n = 0;
    for (size_t i = 0; i < EXPERTS_NPARAMS; i++)
        if (target_parameters_select(target_parameters, module, EXPERTS_PARAMS[i]) == 1)
            params[n++] = EXPERTS_PARAMS[i];
    return n;
}

/* Mixtral's checkpoint names the runtime's ".mlp." ".block_sparse_moe."
 * (its WeightRenaming, reversed at save). */
#define MIXTRAL_RUNTIME ".mlp."
#define MIXTRAL_SAVED ".block_sparse_moe."

/* module with its last ".mlp." as Mixtral saves it (allocated), or a copy
 * where it has none. */
static char *mixtral_saved_module(const char *module)
{
    const char *at = NULL;
    for (const char *p = strstr(module, MIXTRAL_RUNTIME); p; p = strstr(p + 1, MIXTRAL_RUNTIME))
        at = p;
    if (!at)
        return strdup(module);
    size_t out_len = strlen(module) + strlen(MIXTRAL_SAVED) + 1;
    char *out = malloc(out_len);
    if (out)
        snprintf(out, out_len, "%.*s%s%s", (int)(at - module), module, MIXTRAL_SAVED, at + strlen(MIXTRAL_RUNTIME));
    return out;
}

/* phimoe's WeightRenaming(".gate.weight", ".router.weight"), besides Mixtral's. */
#define PHIMOE_ROUTER_RUNTIME ".router"
#define PHIMOE_ROUTER_SAVED ".gate"

char *experts_saved_module(const char *model_type, const char *text_model_type, const char *module)
{
    if (experts_form_of(model_type, text_model_type) != EXPERTS_MIXTRAL || !strstr(module, MIXTRAL_RUNTIME))
        return NULL;
    char *saved = mixtral_saved_module(module);
    size_t n = saved ? strlen(saved) : 0, k = strlen(PHIMOE_ROUTER_RUNTIME);
    if (saved && model_type && strcmp(model_type, "phimoe") == 0 && n > k &&
        strcmp(saved + n - k, PHIMOE_ROUTER_RUNTIME) == 0) /* ".router" -> ".gate": never longer */
        memcpy(saved + n - k, PHIMOE_ROUTER_SAVED, sizeof PHIMOE_ROUTER_SAVED);
    return saved;
}

size_t experts_tensor_names(enum experts_form form, const char *module, const char *param, uint64_t e,
                            char *names[2])
{
    static const char *const QWEN2[2][2] = {{"gate_proj", "up_proj"}, {"down_proj", NULL}};
    static const char *const MIXTRAL[2][2] = {{"w1", "w3"}, {"w2", NULL}};
    const int down = strcmp(param, EXPERTS_PARAMS[1]) == 0;
    const char *const *parts = form == EXPERTS_QWEN2_MOE ? QWEN2[down] : MIXTRAL[down];
    char *saved = form == EXPERTS_MIXTRAL ? mixtral_saved_module(module) : strdup(module);
    size_t n = 0;
    names[0] = names[1] = NULL;
    for (size_t p = 0; saved && p < 2 && parts[p]; p++) {
        size_t len = strlen(saved) + strlen(parts[p]) + 32;
        if (!(names[p] = malloc(len)))
            break;
        snprintf(names[p], len, "%s.%" PRIu64 ".%s.weight", saved, e, parts[p]);
        n++;
    }
    free(saved);
    if (n != (down ? 1u : 2u)) {
        free(names[0]);
        free(names[1]);
        names[0] = names[1] = NULL;
        return 0;
    }
    return n;
}
