#include "lora.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "fileio.h"
#include "fpconv.h"
#include "json_util.h"
#include "lora_alphas.h"
#include "lora_diffusers.h"
#include "lora_experts.h"
#include "lora_lokr.h"
#include "lora_old_forms.h"
#include "lora_rewrite.h"
#include "lora_target.h"
#include "lora_widen.h"
#include "model_dir.h"
#include "pattern.h"
#include "saved_names.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

/* ---- adapter_config.json ---- */


static int config_fail(const char *path, const char *what)
{
    return nf4_fail(NF4_EDATA, path, NULL, "%s", what);
}

/* An optional boolean: absent and null are false. */
static int config_bool(const char *path, const cJSON *root, const char *key, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = 0;
    if (!v || cJSON_IsNull(v))
        return NF4_OK;
    if (!cJSON_IsBool(v))
        return nf4_fail(NF4_EDATA, path, NULL, "\"%s\" must be true or false", key);
    *out = cJSON_IsTrue(v);
    return NF4_OK;
}

static int valid_rank(const cJSON *v)
{
    return cJSON_IsNumber(v) && v->valuedouble >= 1 && v->valuedouble <= LORA_MAX_RANK &&
           v->valuedouble == floor(v->valuedouble);
}

/* PEFT's question for a pattern key: re.match(rf"(.*\.)?({key})$", module). */
static int compile_peft_pattern(const char *key, struct pattern **out, const char **why)
{
    return pattern_compile_peft_key(key, out, why);
}

/* A pattern object: absent, null or {}; string keys that compile, values checked
 * by `ranks`. Each key is compiled once, into (*compiled)[i] for the i-th key;
 * *states adds up the programs' states across both objects. */
static int config_patterns(const char *path, const cJSON *root, const char *key, int ranks, const cJSON **out,
                           struct pattern ***compiled, size_t *states)
{
    const cJSON *obj = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = NULL;
    if (!obj || cJSON_IsNull(obj))
        return NF4_OK;
    if (!cJSON_IsObject(obj))
        return nf4_fail(NF4_EDATA, path, NULL, "\"%s\" must be an object", key);
    *out = obj;
    *compiled = calloc((size_t)cJSON_GetArraySize(obj) + 1, sizeof **compiled);
    if (!*compiled)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    size_t i = 0;
    for (const cJSON *e = obj->child; e; e = e->next, i++) {
        if (ranks ? !valid_rank(e) : !(cJSON_IsNumber(e) && isfinite(e->valuedouble)))
            return nf4_fail(NF4_EDATA, path, NULL, "\"%s\": \"%s\" must be %s", key, e->string,
                            ranks ? "a whole number from 1 to 65536" : "a finite number");
        const char *why = NULL;
        int code = compile_peft_pattern(e->string, &(*compiled)[i], &why);
        if (code == PATTERN_NOMEM)
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        if (code != PATTERN_OK)
            return nf4_fail(NF4_EDATA, path, NULL, "\"%s\": \"%s\" is not a regular expression nf4deq can use: %s",
                            key, e->string, why);
        if ((*states += pattern_states((*compiled)[i])) > LORA_MAX_PATTERN_STATES)
            return nf4_fail(NF4_EDATA, path, NULL, "\"%s\": the pattern keys compile to more than %u states in all, "
                            "at \"%s\"", key, LORA_MAX_PATTERN_STATES, e->string);
    }
    return NF4_OK;
}

/* LoraConfig features nf4deq does not merge, each refused by name, not left
 * to a later key or shape error, or to a merge that loads but is not the
 * model trained. Each is tested as PEFT 0.21 tests it: its bitsandbytes
 * layers test aLoRA, Arrow and VeLoRA against None; its 16-bit layers test
 * every variant by truth, where a config object, even {}, is true; lists
 * count when not empty. (use_qalora acts on GPTQ layers alone: on
 * bitsandbytes and 16-bit ones it is a plain LoRA, and merges as one.) */
enum feature_test { SET_UNLESS_NULL, SET_IF_TRUE };
static const struct {
    const char *key;
    enum feature_test test;
    const char *why;
} UNMERGED_FEATURES[] = {
    {"alora_invocation_tokens", SET_UNLESS_NULL, "is an activated LoRA (alora_invocation_tokens), which acts only "
                                                 "after its invocation tokens: PEFT cannot merge it either"},
    {"arrow_config", SET_UNLESS_NULL, "is an Arrow router (arrow_config): PEFT cannot merge it either"},
    {"velora_config", SET_UNLESS_NULL, "is VeLoRA (velora_config), which PEFT cannot train on bitsandbytes layers "
                                       "and which saves tensors of its own: merging it is not supported"},
    {"kasa_config", SET_IF_TRUE, "is KaSA (kasa_config), which truncates a 16-bit base's singular values before "
                                 "its delta: merging it is not supported"},
    {"use_bdlora", SET_IF_TRUE, "has block-diagonal factors on 16-bit layers (use_bdlora): merging them is not "
                                "supported"},
    {"monteclora_config", SET_IF_TRUE, "is MonteCLoRA on 16-bit layers (monteclora_config), which saves tensors of "
                                       "its own: merging it is not supported"},
    {"layer_replication", SET_IF_TRUE, "replicates layers (layer_replication): the merged model would have layers "
                                       "the base does not have, which is not supported"},
    {"enable_lora", SET_IF_TRUE, "has LoRA on parts of fused layers (enable_lora: PEFT 0.2's MergedLinear, whose "
                                 "lora_B is a grouped convolution), which PEFT itself no longer loads: merging it "
                                 "is not supported"},
};

/* Python's truth of a JSON value, where an object becomes a config object,
 * true even when empty. */
static int feature_set(const cJSON *v, enum feature_test test)
{
    if (!v || cJSON_IsNull(v))
        return 0;
    if (test == SET_UNLESS_NULL || cJSON_IsObject(v))
        return 1;
    if (cJSON_IsArray(v))
        return v->child != NULL;
    if (cJSON_IsBool(v))
        return cJSON_IsTrue(v);
    if (cJSON_IsNumber(v))
        return v->valuedouble != 0;
    return cJSON_IsString(v) && v->valuestring[0];
}

/* init_lora_weights, matched as PEFT matches it. PiSSA, OLoRA, CorDA and
 * LoRA-GA rewrite the base weights when training begins (W - scaling * B0
 * A0), and LoftQ replaces them with its own quantization: the trained weights
 * are a delta of that base, which nf4deq does not have. PEFT converts the
 * first four into a plain adapter on request, saved with init_lora_weights
 * true; a LoftQ adapter goes with the base LoftQ wrote. */
static int check_init_lora_weights(const char *path, const cJSON *root)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "init_lora_weights");
    if (!v || cJSON_IsNull(v) || cJSON_IsBool(v))
        return NF4_OK;
    if (!cJSON_IsString(v))
        return config_fail(path, "\"init_lora_weights\" must be true, false or the name of an initialisation");
    const char *name = v->valuestring;
    if (!name[0] || strcasecmp(name, "gaussian") == 0 || strcmp(name, "eva") == 0 ||
        strcmp(name, "orthogonal") == 0 || strcasecmp(name, "mica") == 0) /* "": false to Python */
        return NF4_OK;
    if (strcmp(name, "loftq") == 0)
        return config_fail(path, "\"init_lora_weights\": \"loftq\" replaced the base weights with LoftQ's own "
                                 "quantization when training began, so the adapter's weights are a delta of that "
                                 "base, which nf4deq does not have: merge it into the base LoftQ wrote, with "
                                 "init_lora_weights set to true");
    if (strncmp(name, "pissa", 5) == 0 || strncmp(name, "corda", 5) == 0 || strcasecmp(name, "olora") == 0 ||
        strcmp(name, "lora_ga") == 0)
        return nf4_fail(NF4_EDATA, path, NULL, "\"init_lora_weights\": \"%s\" rewrote the base weights when "
                        "training began, so the adapter's weights are a delta of a base nf4deq does not have. Save "
                        "it as a plain LoRA first (PEFT's save_pretrained with "
                        "path_initial_model_for_weight_conversion), or merge it into the rewritten base it was "
                        "trained on, with init_lora_weights set to true", name);
    return nf4_fail(NF4_EDATA, path, NULL, "\"init_lora_weights\": \"%s\" is no initialisation PEFT or nf4deq "
                    "knows (true, false, gaussian, eva, orthogonal, mica)", name);
}

static int check_unmerged_features(const char *path, const cJSON *root)
{
    for (size_t i = 0; i < sizeof UNMERGED_FEATURES / sizeof *UNMERGED_FEATURES; i++)
        if (feature_set(cJSON_GetObjectItemCaseSensitive(root, UNMERGED_FEATURES[i].key), UNMERGED_FEATURES[i].test))
            return config_fail(path, UNMERGED_FEATURES[i].why);
    return check_init_lora_weights(path, root);
}

/* target_parameters: a list of names, or none. What PEFT's ParamWrapper
 * refuses beside it is refused where a pair is bound to a parameter
 * (refuse_wrapper_features): with none bound, PEFT wrapped nothing and
 * loaded the adapter. */
static int parse_target_parameters(const char *path, struct lora_config *c)
{
    const cJSON *tp = cJSON_GetObjectItemCaseSensitive(c->root, "target_parameters");
    if (!tp || cJSON_IsNull(tp))
        return NF4_OK;
    if (!cJSON_IsArray(tp))
        return config_fail(path, "\"target_parameters\" must be a list of parameter names");
    for (const cJSON *e = tp->child; e; e = e->next)
        if (!cJSON_IsString(e))
            return config_fail(path, "\"target_parameters\" must be a list of parameter names");
    if (tp->child)
        c->target_parameters = tp;
    return NF4_OK;
}

int lora_config_parse(const char *path, const char *json, size_t len, struct lora_config *c)
{
    memset(c, 0, sizeof *c);
    int code;
    c->root = json_parse_whole(json, len);
    /* Python's json module writes a NaN or infinite lora_alpha as NaN / Infinity. */
    int non_finite = !c->root && (memmem(json, len, "NaN", 3) || memmem(json, len, "Infinity", 8));
    if (!c->root)
        return json_ran_out_of_memory() ? nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory")
               : non_finite ? config_fail(path, "is not valid JSON: it holds NaN or Infinity, and r, lora_alpha and "
                                                "the patterns must be finite numbers")
                            : config_fail(path, "is not valid JSON");
    const cJSON *root = c->root;
    if (!cJSON_IsObject(root))
        return config_fail(path, "is not a JSON object");
    int twice = json_has_duplicate_key(root);
    if (twice)
        return twice < 0 ? nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory")
                         : config_fail(path, "has a duplicate key");
    /* PEFT builds nn.Linear layers of these sizes, which refuse 4.0. */
    static const char *const INTEGER_KEYS[] = {"r", "rank_pattern", TOKEN_INDICES_KEY};
    const char *bad_key;
    if (!json_keys_hold_plain_integers(json, len, INTEGER_KEYS, sizeof INTEGER_KEYS / sizeof *INTEGER_KEYS,
                                       &bad_key))
        return config_fail(path, strcmp(bad_key, "r") == 0 ? "\"r\" must be a whole number from 1 to 65536"
                                 : strcmp(bad_key, "rank_pattern") == 0
                                     ? "\"rank_pattern\" ranks must be whole numbers"
                                     : "\"" TOKEN_INDICES_KEY "\" rows must be whole numbers from 0");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "peft_type");
    if (!cJSON_IsString(type))
        return config_fail(path, "has no \"peft_type\": not a PEFT adapter config");
    c->lokr = strcmp(type->valuestring, "LOKR") == 0;
    if (!c->lokr && strcmp(type->valuestring, "LORA") != 0)
        return nf4_fail(NF4_EDATA, path, NULL, "is a %s adapter; only LoRA and LoKr adapters can be merged",
                        type->valuestring);
    if (c->lokr) {
        /* LoKrConfig has none of LoRA's variants below; rank_dropout,
         * module_dropout and init_weights only shape training, and
         * use_effective_conv2d only convolutions, whose LoKr lora.c refuses. */
        if ((code = config_bool(path, root, "decompose_both", &c->decompose_both)) != NF4_OK)
            return code;
        /* PEFT factors each layer by it: 4.0 would give it sides of floats, which torch refuses */
        static const char *const FACTOR_KEY[] = {"decompose_factor"};
        const cJSON *factor = cJSON_GetObjectItemCaseSensitive(root, "decompose_factor");
        if (!json_keys_hold_plain_integers(json, len, FACTOR_KEY, 1, &bad_key) ||
            (factor && (!cJSON_IsNumber(factor) || fabs(factor->valuedouble) > 1e15)))
            return config_fail(path, "\"decompose_factor\" must be a whole number");
        c->decompose_factor = factor ? (int64_t)factor->valuedouble : -1; /* LoKrConfig's default */
    } else if ((code = config_bool(path, root, "use_dora", &c->use_dora)) != NF4_OK ||
               (code = config_bool(path, root, "use_rslora", &c->use_rslora)) != NF4_OK ||
               (code = config_bool(path, root, "ensure_weight_tying", &c->ensure_weight_tying)) != NF4_OK ||
               (code = config_bool(path, root, "fan_in_fan_out", &c->fan_in_fan_out)) != NF4_OK ||
               (code = config_bool(path, root, "lora_bias", &c->lora_bias)) != NF4_OK) {
        return code;
    }
    /* PEFT's LoraConfig refuses the two together: DoRA's merge has no rule for the bias. */
    if (c->lora_bias && c->use_dora)
        return config_fail(path, "sets both lora_bias and use_dora, which PEFT refuses");
    if (!c->lokr && (code = check_unmerged_features(path, root)) != NF4_OK)
        return code;
    /* LoKrConfig's defaults, r 8 and alpha 8, stand where its keys are absent */
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(root, "r");
    if (!(c->lokr && !r) && !valid_rank(r))
        return config_fail(path, "\"r\" must be a whole number from 1 to 65536");
    c->r = r ? (uint32_t)r->valuedouble : LOKR_DEFAULT_R;
    const cJSON *alpha = cJSON_GetObjectItemCaseSensitive(root, c->lokr ? "alpha" : "lora_alpha");
    if (!(c->lokr && !alpha) && (!cJSON_IsNumber(alpha) || !isfinite(alpha->valuedouble)))
        return config_fail(path, c->lokr ? "\"alpha\" must be a finite number"
                                         : "\"lora_alpha\" must be a finite number");
    c->alpha = alpha ? alpha->valuedouble : LOKR_DEFAULT_ALPHA;
    size_t states = 0;
    if ((code = config_patterns(path, root, "rank_pattern", 1, &c->rank_pattern, &c->rank_compiled, &states)) !=
            NF4_OK ||
        (code = config_patterns(path, root, "alpha_pattern", 0, &c->alpha_pattern, &c->alpha_compiled, &states)) !=
            NF4_OK)
        return code;
    const cJSON *bias_mode = cJSON_GetObjectItemCaseSensitive(root, "bias");
    if (bias_mode && !cJSON_IsNull(bias_mode)) {
        if (!cJSON_IsString(bias_mode) || (strcmp(bias_mode->valuestring, "none") != 0 &&
                                           strcmp(bias_mode->valuestring, "all") != 0 &&
                                           strcmp(bias_mode->valuestring, "lora_only") != 0))
            return config_fail(path, "\"bias\" must be \"none\", \"all\" or \"lora_only\"");
        c->trains_bias = strcmp(bias_mode->valuestring, "none") != 0;
    }
    const cJSON *mts = cJSON_GetObjectItemCaseSensitive(root, "modules_to_save");
    if (mts && !cJSON_IsNull(mts)) {
        if (!cJSON_IsArray(mts))
            return config_fail(path, "\"modules_to_save\" must be a list of module names");
        for (const cJSON *e = mts->child; e; e = e->next)
            if (!cJSON_IsString(e))
                return config_fail(path, "\"modules_to_save\" must be a list of module names");
        c->modules_to_save = mts;
    }
    if ((code = parse_target_parameters(path, c)) != NF4_OK)
        return code;
    c->token_indices = cJSON_GetObjectItemCaseSensitive(root, TOKEN_INDICES_KEY);
    if ((code = token_indices_check(path, c->token_indices)) != NF4_OK)
        return code;
    return lora_target_parse(path, root, &c->targets);
}

static void free_compiled(struct pattern **compiled)
{
    for (size_t i = 0; compiled && compiled[i]; i++)
        pattern_free(compiled[i]);
    free(compiled);
}

void lora_config_free(struct lora_config *c)
{
    free_compiled(c->rank_compiled);
    free_compiled(c->alpha_compiled);
    lora_target_free(&c->targets);
    cJSON_Delete(c->root);
    memset(c, 0, sizeof *c);
}

static int parse_config(const char *path, struct lora_config *c)
{
    char *json = NULL;
    size_t len = 0;
    memset(c, 0, sizeof *c);
    int code = read_small_file(path, MAX_JSON_FILE_BYTES, &json, &len);
    if (code == NF4_OK)
        code = lora_config_parse(path, json, len, c);
    free(json);
    return code;
}

int lora_pattern_matches(const char *pattern, const char *module)
{
    struct pattern *p;
    const char *why;
    if (compile_peft_pattern(pattern, &p, &why) != PATTERN_OK)
        return -1;
    int match = pattern_match(p, module);
    pattern_free(p);
    return match;
}

/* The first pattern key (in the config's order) that matches, as PEFT takes it. */
static const cJSON *pattern_for(const cJSON *patterns, struct pattern **compiled, const char *module)
{
    size_t i = 0;
    for (const cJSON *e = patterns ? patterns->child : NULL; e; e = e->next, i++)
        if (pattern_match(compiled[i], module))
            return e;
    return NULL;
}

float lora_scaling(double alpha, uint32_t r, int use_rslora)
{
    /* Python computes the scale in double; torch multiplies an fp32 tensor by it as fp32. */
    return (float)(use_rslora ? alpha / sqrt((double)r) : alpha / (double)r);
}

/* The scaling of a pair under config c: lora_scaling, rounded to the dtype
 * of the alpha tensor it came from (a 0-d BF16 or F16 tensor over r is one
 * of that dtype; lora.h's alphas_given). */
static float config_scaling(const struct lora_config *c, double alpha, uint32_t r)
{
    float s = lora_scaling(alpha, r, c->use_rslora);
    if (c->scaling_dtype == DT_BF16 || c->scaling_dtype == DT_F16) {
        uint16_t half;
        f32_to_element(c->scaling_dtype, &half, 0, s);
        s = f32_from_element(c->scaling_dtype, &half, 0);
    }
    return s;
}

/* PEFT 0.21 (_set_trainable) wraps every module whose name ends with an entry
 * of modules_to_save, by str.endswith with no '.' boundary ("norm" takes each
 * input_layernorm too), and saves all it holds: a tensor is saved when any
 * module above it is one of those. */
static int in_modules_to_save(const struct lora_config *c, const char *tensor)
{
    for (const char *dot = c->modules_to_save ? strchr(tensor, '.') : NULL; dot; dot = strchr(dot + 1, '.'))
        for (const cJSON *e = c->modules_to_save->child; e; e = e->next) {
            size_t n = strlen(e->valuestring), len = (size_t)(dot - tensor);
            if (n <= len && memcmp(dot - n, e->valuestring, n) == 0)
                return 1;
        }
    return 0;
}

/* ---- binding adapter keys to base tensors ---- */

/* One adapter key's effect, before keys on the same base tensor are gathered. */
struct binding {
    char *name;
    uint64_t rows, cols;
    const struct model_tensor *replace;
    int frozen; /* the replacement is a frozen layer PEFT saved whole (lora_target.replace_frozen) */
    int trained_bias; /* the replacement is a bias trained with "bias": "all" or "lora_only" */
    int widened;      /* the replacement is the base weight widened (lora_widen.h) */
    int norm;         /* the replacement is a control LoRA's norm weight */
    struct token_rows *tokens; /* owned until gathered */
    struct lora_term term;
};

struct binder {
    struct lora_set *set; /* what is bound into, which owns the tensors made (lora_widen.h) */
    const struct model *base;
    const char *tied_embedding; /* what the base ties TIED_HEAD_NAME to, or NULL (model_dir.h) */
    /* The same as PEFT names it, the module as it runs: another name where the
     * base holds the embedding under an older one (saved_names.h). */
    const char *tied_runtime;
    /* The first adapter key that parts the tied head from its embedding, or NULL. */
    const char *untie_file, *untie_key, *untie_name;
    /* The first such key that is not the head's own trained token rows, or NULL. */
    const char *other_untie_file, *other_untie_key;
    /* The first trained token rows of the tied embedding, which the head
     * shares unless its own rows part them; or NULL. */
    const char *tokens_tied_file, *tokens_tied_key;
    /* The first embedding copy that ensure_weight_tying keeps tied, or NULL. */
    const char *tie_kept_file, *tie_kept_key;
    /* The rows of the first embedding layer held whole with other rows than
     * the base's (a resized vocabulary; the base's in base_vocab_rows), and
     * its key; 0 and NULL otherwise. */
    uint64_t vocab_rows, base_vocab_rows;
    const char *vocab_file, *vocab_key;
    const struct bnb_weight *weights;
    size_t nweights;
    struct binding *items;
    size_t n, cap;
    /* head_mirrors_embedding's answer for one adapter, which both pairs of
     * the tied layers ask for: it reads both layers' factors whole. */
    const struct lora_adapter *mirror_of;
    int mirrored;
    /* The base's config.json model_type and its text_config's, read for the
     * first LoRA on MoE experts or on a module the base does not hold
     * (read_model_type, lora_experts.h). */
    int model_type_read;
    char *model_type, *text_model_type;
    /* Pairs bound to a parameter target_parameters selects, for the adapter being bound. */
    size_t parameter_pairs;
    /* Whether the base is a transformer whose projections diffusers fuses
     * for a LoKr on to_qkv (base_fuses_qkv): -1 until asked. The first LoKr
     * on a fused projection, and the first term (of any adapter) on one of
     * the projections fusing leaves unused: lora_open_component refuses the
     * two together. */
    int fuses_qkv;
    const char *fused_file, *fused_key, *part_file, *part_key;
};

/* An F32, BF16 or F16 vector of n values (a DoRA magnitude, a LoRA bias). */
static int is_factor_vector(const struct st_tensor *x, uint64_t n)
{
    return lora_is_factor_dtype(x->dtype) && x->ndim == 1 && x->shape[0] == n;
}

static int is_tied_head(const struct binder *b, const char *name)
{
    return b->tied_embedding && strcmp(name, TIED_HEAD_NAME) == 0;
}

/* The base tensor `name`: its 2-D shape, or 0 when it is missing. A tied head
 * the base does not store has its embedding's shape. */
static int base_shape(const struct binder *b, const char *name, size_t *ndim, const uint64_t **shape)
{
    if (is_tied_head(b, name))
        name = b->tied_embedding;
    const struct bnb_weight *w = bnb_find(b->weights, b->nweights, name);
    if (w) {
        *ndim = w->state.ndim;
        *shape = w->state.shape;
        return 1;
    }
    const struct model_tensor *t = model_find(b->base, name);
    if (!t || bnb_is_state_part(name) || !dtype_is_castable_float(t->t->dtype))
        return 0;
    *ndim = t->t->ndim;
    *shape = t->t->shape;
    return 1;
}

/* A multimodal model's input embedding as it runs (and as PEFT names it). */
#define MULTIMODAL_EMBEDDING "model.language_model.embed_tokens.weight"

static int base_holds(const void *ctx, const char *name)
{
    size_t ndim;
    const uint64_t *shape;
    return base_shape(ctx, name, &ndim, &shape);
}

/* The base's name for tensor `name` as the adapter names it (PEFT names the
 * modules as they run): the name itself where the base has it (or it is the
 * tied head), else the one transformers 5 saved it under where the base has
 * that (saved_names.h: a multimodal model's older layout), else the name.
 * Allocated; NULL: out of memory. */
static char *name_in_base(const struct binder *b, const char *name)
{
    char *saved = NULL;
    const struct saved_name_model model = {b->model_type, b->text_model_type};
    if (!base_holds(b, name) && saved_name_find(name, &model, base_holds, b, &saved) != NF4_OK)
        return NULL;
    return saved ? saved : strdup(name);
}

static struct binding *add_binding(struct binder *b, const char *file, const char *name)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        struct binding *items = realloc(b->items, cap * sizeof *items);
        if (!items)
            return NULL;
        b->items = items;
        b->cap = cap;
    }
    struct binding *x = &b->items[b->n];
    memset(x, 0, sizeof *x);
    if (!(x->name = strdup(name))) {
        nf4_fail(NF4_ESOFTWARE, file, NULL, "out of memory");
        return NULL;
    }
    b->n++;
    return x;
}

/* PEFT's EMBEDDING_LAYER_NAMES: with save_embedding_layers (set when the
 * embedding is targeted, or the vocabulary was resized) PEFT saves the input
 * and output embeddings whole, as "M.weight" where nothing wraps them. */
static int is_embedding_layer_weight(const char *name)
{
    static const char *const NAMES[] = {"embed_tokens.weight", "lm_head.weight"};
    for (size_t i = 0; i < sizeof NAMES / sizeof *NAMES; i++) {
        size_t n = strlen(name), k = strlen(NAMES[i]);
        if (n >= k && strcmp(name + n - k, NAMES[i]) == 0 && (n == k || name[n - k - 1] == '.'))
            return 1;
    }
    return 0;
}

/* The wrapper PEFT puts around a layer with trained tokens (token_rows.h). */
#define TOKEN_ADAPTER_SEGMENT ".token_adapter"
/* The parts of its wrapper of a modules_to_save module (bind_wrapper_part). */
#define ORIGINAL_SEGMENT ".original_module."
#define COPY_SEGMENT ".modules_to_save."
#define LORA_A_SUFFIX ".lora_A.weight"
#define LORA_B_SUFFIX ".lora_B.weight"
#define LORA_BIAS_SUFFIX ".lora_B.bias"
#define EMBEDDING_A_SUFFIX ".lora_embedding_A"
#define EMBEDDING_B_SUFFIX ".lora_embedding_B"

/* The two kinds of LoRA pair PEFT saves. A layer's: lora_A [r, in] and
 * lora_B [out, r], B @ A laid on the weight [out, in]. An embedding's:
 * lora_embedding_A [r, vocab] and lora_embedding_B [dim, r], (B @ A)^T laid on
 * the weight [vocab, dim]: the same factors as a transposed layer's. */
struct pair_kind {
    const char *a_suffix, *b_suffix;
    int embedding;
};
static const struct pair_kind LAYER_PAIR = {LORA_A_SUFFIX, LORA_B_SUFFIX, 0};
static const struct pair_kind EMBEDDING_PAIR = {EMBEDDING_A_SUFFIX, EMBEDDING_B_SUFFIX, 1};

/* The module of an adapter key's name (after PEFT_KEY_PREFIX) that ends in
 * the kind's A suffix: "M.lora_A.weight" -> "M", allocated; NULL: out of memory. */
static char *lora_a_module(const char *name, const struct pair_kind *kind)
{
    return strndup(name, strlen(name) - strlen(kind->a_suffix));
}

/* A module's parameter: "M", "bias" -> "M.bias", allocated. */
static char *module_param_name(const char *module, const char *param)
{
    size_t n = strlen(module) + strlen(param) + 2;
    char *w = malloc(n);
    if (w)
        snprintf(w, n, "%s.%s", module, param);
    return w;
}

/* The base tensor a LoRA module changes: "M" -> "M.weight", allocated. */
static char *base_weight_name(const char *module)
{
    return module_param_name(module, "weight");
}

/* name_in_base of module M's weight, "M.weight". */
static char *weight_in_base(const struct binder *b, const char *module)
{
    char *runtime = base_weight_name(module), *in_base = runtime ? name_in_base(b, runtime) : NULL;
    free(runtime);
    return in_base;
}

/* The module of a weight: "M.weight" -> "M", allocated (the inverse of
 * base_weight_name); NULL: out of memory. */
static char *weight_module(const char *wname)
{
    size_t n = strlen(wname), suffix = strlen(".weight");
    return strndup(wname, n >= suffix && strcmp(wname + n - suffix, ".weight") == 0 ? n - suffix : n);
}

/* Whether B @ A ([out, in]) lands on the base tensor `wname` transposed. In
 * PEFT the layer decides, not the config's fan_in_fan_out: its bitsandbytes
 * and nn.Linear layers set it false (a 4-bit weight is always stored
 * [out, in], a GPT-2 Conv1D's too once quantized), and its Conv1D layer true
 * (a 16-bit Conv1D weight is [in, out]). nf4deq cannot see the layer, so a
 * 16-bit base tensor's shape tells, and when it is square, fan_in_fan_out. */
static int delta_transposed(const struct binder *b, const struct lora_config *c, const char *wname, uint64_t out_f,
                            uint64_t in_f, size_t ndim, const uint64_t *shape)
{
    /* A head the base ties to its embedding is an nn.Linear all the same. */
    if (is_tied_head(b, wname) || bnb_find(b->weights, b->nweights, wname) || ndim != 2)
        return 0;
    if (out_f == in_f)
        return c->fan_in_fan_out;
    return shape[0] == in_f && shape[1] == out_f;
}

/* Whether an adapter that changes base tensor `name` parts a tied head from
 * its embedding. In PEFT a modules_to_save copy of either one, or a LoRA on
 * the head, leaves the other as it was; merge_and_unload then finds the two
 * apart and sets tie_word_embeddings: false (for a LoRA on the head it adds
 * B @ A to the one tensor both share instead, changing the embedding too, and
 * warns: nf4deq writes the head apart, as trained). With ensure_weight_tying
 * PEFT keeps the embedding's copy tied to the head, and so does the output. */
static int parts_tied_weights(const struct binder *b, const char *name, int keeps_tie)
{
    return is_tied_head(b, name) || (b->tied_embedding && !keeps_tie && strcmp(name, b->tied_embedding) == 0);
}

static int is_tied_embedding(const struct binder *b, const char *name)
{
    return b->tied_embedding && strcmp(name, b->tied_embedding) == 0;
}

/* Records that adapter key `key` changes `name` (the tied head or its
 * embedding) apart from the other, so the merge writes TIED_HEAD_NAME apart:
 * lora_open refuses it where no config.json can be written to say so, or
 * where trained token rows of the embedding were to go on the head too and
 * something other than the head's own rows parts them. */
static void note_untie(struct binder *b, const char *file, const char *key, const char *name, int by_token_rows)
{
    if (!b->untie_key) {
        b->untie_file = file;
        b->untie_key = key;
        b->untie_name = is_tied_head(b, name) ? TIED_HEAD_NAME : b->tied_embedding;
    }
    if (!by_token_rows && !b->other_untie_key) {
        b->other_untie_file = file;
        b->other_untie_key = key;
    }
}

/* The adapter key of a module's factor, "base_model.model.M<suffix>", allocated. */
static char *factor_key(const struct lora_adapter *ad, const char *module, const char *suffix)
{
    size_t n = strlen(ad->key_prefix) + strlen(module) + strlen(suffix) + 1;
    char *key = malloc(n);
    if (key)
        snprintf(key, n, "%s%s%s", ad->key_prefix, module, suffix);
    return key;
}

/* Rows of x a comparison block holds, times x's columns: 1 MiB of F32 per side. */
#define MIRROR_BLOCK_ELEMENTS (UINT64_C(1) << 18)

/* Whether matrix x [m, n] is matrix y [n, m] transposed, element for element in
 * the same dtype (*equal), reading both a block of x's rows at a time: x is the
 * taller one, so each block reads n short runs of y. */
static int is_transpose_of(const struct model_tensor *x, const struct model_tensor *y, int *equal)
{
    const struct st_tensor *xt = x->t, *yt = y->t;
    *equal = 0;
    if (xt->dtype != yt->dtype || xt->ndim != 2 || yt->ndim != 2 || xt->shape[0] != yt->shape[1] ||
        xt->shape[1] != yt->shape[0])
        return NF4_OK;
    if (xt->shape[0] < xt->shape[1]) {
        const struct model_tensor *t = x;
        x = y;
        y = t;
        xt = x->t;
        yt = y->t;
    }
    const uint64_t m = xt->shape[0], n = xt->shape[1], size = dtype_bits(xt->dtype) / 8;
    if (m == 0 || n == 0) {
        *equal = 1;
        return NF4_OK;
    }
    uint64_t block = MIRROR_BLOCK_ELEMENTS / n;
    block = block ? (block < m ? block : m) : 1;
    unsigned char *xb = malloc(block * n * size), *yb = malloc(block * n * size);
    int code = xb && yb ? NF4_OK : nf4_fail(NF4_ESOFTWARE, x->file->path, xt->name, "out of memory");
    *equal = code == NF4_OK;
    for (uint64_t i0 = 0; code == NF4_OK && *equal && i0 < m; i0 += block) {
        uint64_t rows = m - i0 < block ? m - i0 : block;
        code = st_read(x->file, xt, i0 * n * size, xb, rows * n * size);
        for (uint64_t j = 0; code == NF4_OK && j < n; j++) /* y[j, i0 .. i0 + rows) */
            code = st_read(y->file, yt, (j * m + i0) * size, yb + j * rows * size, rows * size);
        for (uint64_t i = 0; code == NF4_OK && *equal && i < rows; i++)
            for (uint64_t j = 0; *equal && j < n; j++)
                *equal = memcmp(xb + (i * n + j) * size, yb + (j * rows + i) * size, size) == 0;
    }
    free(xb);
    free(yb);
    return code;
}

/* Whether the adapter's LoRA on the tied head is its LoRA on the embedding,
 * transposed (lm_head.lora_A = lora_embedding_B^T, lm_head.lora_B =
 * lora_embedding_A^T): one delta for both layers, as PEFT's
 * ensure_weight_tying trains them when the tie of the factors holds. (PEFT 0.21
 * casts a 16-bit model's factors to fp32 after tying them, so by default each
 * layer trains factors of its own, and they differ.) */
static int head_mirrors_embedding(struct binder *b, const struct lora_adapter *ad, int *mirrored)
{
    if (b->mirror_of == ad) {
        *mirrored = b->mirrored;
        return NF4_OK;
    }
    char *head = weight_module(TIED_HEAD_NAME), *embed = weight_module(b->tied_runtime);
    char *keys[4] = {head ? factor_key(ad, head, LORA_A_SUFFIX) : NULL, head ? factor_key(ad, head, LORA_B_SUFFIX) : NULL,
                     embed ? factor_key(ad, embed, EMBEDDING_B_SUFFIX) : NULL,
                     embed ? factor_key(ad, embed, EMBEDDING_A_SUFFIX) : NULL};
    int code = NF4_OK;
    const struct model_tensor *t[4] = {0};
    *mirrored = 0;
    for (int i = 0; i < 4 && code == NF4_OK; i++)
        if (!keys[i])
            code = nf4_fail(NF4_ESOFTWARE, ad->config_path, NULL, "out of memory");
        else
            t[i] = model_find(ad->weights, keys[i]);
    if (code == NF4_OK && t[0] && t[1] && t[2] && t[3] && (code = is_transpose_of(t[0], t[2], mirrored)) == NF4_OK &&
        *mirrored)
        code = is_transpose_of(t[1], t[3], mirrored);
    for (int i = 0; i < 4; i++)
        free(keys[i]);
    free(head);
    free(embed);
    if (code == NF4_OK) {
        b->mirror_of = ad;
        b->mirrored = *mirrored;
    }
    return code;
}

static int wrapped_for_the_tie(const struct binder *b, const struct lora_config *c, const char *wname)
{
    if (!c->ensure_weight_tying || !is_tied_head(b, wname))
        return 0;
    char *embed = weight_module(b->tied_runtime);
    int wrapped = embed && lora_target_matches(&c->targets, embed) == 1;
    free(embed);
    return wrapped;
}

#define MAGNITUDE_SUFFIX ".lora_magnitude_vector"

/* DoRA (use_dora): the magnitude PEFT saves beside each pair,
 * M.lora_magnitude_vector, one per output row of the layer's [out, in]
 * weight. An embedding's DoRA, and a layer whose delta is transposed (a 16-bit
 * Conv1D), norm along the other dimension: refused. */
static int find_magnitude(const struct lora_adapter *ad, const char *module, const struct pair_kind *kind,
                          int transposed, uint64_t rows, const struct model_tensor *a, const struct model_tensor **out)
{
    const char *file = a->file->path, *aname = a->t->name;
    if (kind->embedding || transposed)
        return nf4_fail(NF4_EDATA, file, aname, "DoRA (use_dora) on %s is not supported",
                        kind->embedding ? "an embedding" : "a transposed weight (fan_in_fan_out, Conv1D)");
    char *key = factor_key(ad, module, MAGNITUDE_SUFFIX);
    if (!key)
        return nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
    const struct model_tensor *m = model_find(ad->weights, key);
    int code = NF4_OK;
    if (!m)
        code = nf4_fail(NF4_EDATA, file, aname, "has no matching %s, which DoRA (use_dora) needs", key);
    else if (!is_factor_vector(m->t, rows))
        code = nf4_fail(NF4_EDATA, m->file->path, key, "must be an F32, BF16 or F16 vector of %llu, one per row of "
                        "the weight", (unsigned long long)rows);
    free(key);
    *out = m;
    return code;
}

/* The shape of the base layer PEFT saved for a LoRA'd embedding layer
 * ("M.base_layer.weight") where it has other rows than the base's: the
 * vocabulary was resized, and the pair was trained on that shape (the base
 * layer itself is bound, and the size checked, by base_shape_fits). NULL
 * otherwise. */
static const uint64_t *resized_layer_shape(const struct binder *b, const struct lora_adapter *ad, const char *module,
                                           const char *wname, size_t ndim, const uint64_t *shape)
{
    if (ndim != 2 || !(is_embedding_layer_weight(wname) || is_tied_head(b, wname)))
        return NULL;
    char *key = factor_key(ad, module, BASE_LAYER_SEGMENT "weight");
    const struct model_tensor *layer = key ? model_find(ad->weights, key) : NULL;
    free(key);
    if (!layer || layer->t->ndim != 2 || layer->t->shape[1] != shape[1] || layer->t->shape[0] == shape[0])
        return NULL;
    return layer->t->shape;
}

/* Module M's rank and alpha: the config's, or its rank_pattern and
 * alpha_pattern entries. Returns whether the rank came from rank_pattern. */
static int module_rank_alpha(const struct lora_config *c, const char *module, uint32_t *r, double *alpha)
{
    const cJSON *rp = pattern_for(c->rank_pattern, c->rank_compiled, module),
                *ap = pattern_for(c->alpha_pattern, c->alpha_compiled, module);
    *r = rp ? (uint32_t)rp->valuedouble : c->r;
    *alpha = ap ? ap->valuedouble : c->alpha;
    return rp != NULL;
}

/* A's columns as the delta's: [r, in] a matrix's, in * k... a convolution's
 * (lora_is_conv_pair), whose delta, B @ A with A seen as [r, in * k...], is
 * the layer's weight [out, in, k...] seen as [out, in * k...]: PEFT's
 * get_delta_weight computes the same product (as a convolution of A by B
 * where the kernel is not 1x1). */
static uint64_t factor_columns(const struct st_tensor *at)
{
    uint64_t cols = 1;
    for (size_t d = 1; d < at->ndim; d++)
        cols *= at->shape[d];
    return cols;
}

/* A pair's A and B, of `file`: F32, BF16 or F16 matrices, or a convolution's
 * (lora_is_conv_pair) where `conv_ok`. */
static int check_factors_of(const char *file, const struct st_tensor *at, const struct st_tensor *btt, int conv_ok)
{
    int code = lora_check_factor_dtype(file, at);
    if (code != NF4_OK || (code = lora_check_factor_dtype(file, btt)) != NF4_OK)
        return code;
    if (conv_ok && lora_is_conv_pair(at, btt))
        return NF4_OK;
    if (at->ndim != 2 || btt->ndim != 2)
        return nf4_fail(NF4_EDATA, file, (at->ndim != 2 ? at : btt)->name, "is not a matrix%s",
                        conv_ok ? ", nor a convolution's LoRA factor (A [r, in, k...], B [out, r, 1...])" : "");
    return NF4_OK;
}

static int check_factors(const char *file, const struct st_tensor *at, const struct st_tensor *btt)
{
    return check_factors_of(file, at, btt, 0);
}

/* NF4_EDATA naming the LoRA_A key `aname` of a pair bound to a parameter
 * (target_parameters) where the config sets what PEFT's ParamWrapper refuses
 * to wrap one with; lora_dropout, which it refuses too, has no part in a
 * merge. NF4_OK otherwise. */
static int refuse_wrapper_features(const struct lora_config *c, const char *file, const char *aname)
{
    const char *feature = c->use_dora ? "use_dora" : c->lora_bias ? "lora_bias" : c->fan_in_fan_out ? "fan_in_fan_out"
                                                                                                      : NULL;
    return feature ? nf4_fail(NF4_EDATA, file, aname, "is a LoRA on a parameter (target_parameters), and the config "
                              "sets %s, which PEFT's ParamWrapper refuses", feature)
                   : NF4_OK;
}

/* Reads the base's config.json model_type and its text_config's, once. */
static int read_model_type(struct binder *b)
{
    if (b->model_type_read)
        return NF4_OK;
    b->model_type_read = 1;
    return model_config_type(b->base, &b->model_type, &b->text_model_type);
}

/* The base tensor a LoRA on `module` changes: M.weight, or, where the base
 * holds no such tensor and its model type saves M under another name
 * (Mixtral's ".block_sparse_moe." for the runtime's ".mlp.": its router, say,
 * through target_parameters; experts_saved_module), that one's weight, which
 * transformers loads into M. Allocated (NULL: out of memory, or *code where
 * config.json could not be read). */
static char *module_weight_in_base(struct binder *b, const char *module, int *code)
{
    size_t ndim;
    const uint64_t *shape;
    char *wname = base_weight_name(module);
    if (!wname || base_shape(b, wname, &ndim, &shape))
        return wname;
    if ((*code = read_model_type(b)) != NF4_OK) {
        free(wname);
        return NULL;
    }
    char *saved = experts_saved_module(b->model_type, b->text_model_type, module);
    char *saved_weight = saved ? base_weight_name(saved) : NULL;
    free(saved);
    if (saved_weight && base_shape(b, saved_weight, &ndim, &shape)) {
        free(wname);
        return saved_weight;
    }
    free(saved_weight);
    char *in_base = name_in_base(b, wname);
    free(wname);
    return in_base;
}

static int note_projection_part(struct binder *b, const char *module, const char *file, const char *key);

/* Keeps `m`, a tensor made for the merge (lora_widen.h), in the set. */
static int keep_made(struct binder *b, struct model *m, const char *file, const char *key)
{
    struct model **made = realloc(b->set->made, (b->set->nmade + 1) * sizeof *made);
    if (!made) {
        model_close(m);
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    }
    made[b->set->nmade++] = m;
    b->set->made = made;
    return NF4_OK;
}

/* The module diffusers' Flux.1 loader widens and records in the config (in_channels). */
#define WIDENED_MODULE "x_embedder"

/* A LoRA pair of `cols` inputs on a layer `wname` of shape[1] others, as
 * diffusers' Flux.1 loader takes it (lora_widen.h): a wider one widens
 * x_embedder (the base replaced by its widened weight, config.json's
 * in_channels set), a narrower one is padded (*a then the padded lora_A).
 * Other widths are left for the caller's refusal. */
static int widen_for_flux1(struct binder *b, size_t index, const char *module, const char *wname,
                           const uint64_t *shape, uint64_t cols, const struct model_tensor **a)
{
    const char *file = (*a)->file->path, *aname = (*a)->t->name;
    struct model *m = NULL;
    int code = NF4_OK;
    if (cols < shape[1]) {
        if ((code = lora_widen_factor(*a, shape[1], &m)) == NF4_OK && (code = keep_made(b, m, file, aname)) == NF4_OK)
            *a = &m->tensors[0];
        return code;
    }
    if (strcmp(module, WIDENED_MODULE) != 0)
        return nf4_fail(NF4_EDATA, file, aname, "has %llu inputs, more than %s (%llu): diffusers widens the layer in "
                        "memory, but only " WIDENED_MODULE "'s width is in the model's config (in_channels), so the "
                        "model it would save does not load; nf4deq does not merge it",
                        (unsigned long long)cols, wname, (unsigned long long)shape[1]);
    if (!b->base->dir)
        return nf4_fail(NF4_EDATA, file, aname, "widens %s from %llu to %llu inputs, which config.json's in_channels "
                        "must then say; convert the transformer's folder, not its weights file", wname,
                        (unsigned long long)shape[1], (unsigned long long)cols);
    if (b->set->in_channels)
        return nf4_fail(NF4_EDATA, file, aname, "widens %s again (another adapter widens it to %llu inputs): merge "
                        "them in separate runs", wname, (unsigned long long)b->set->in_channels);
    const struct bnb_weight *w = bnb_find(b->weights, b->nweights, wname);
    const struct model_tensor *t = w ? w->packed : model_find(b->base, wname);
    if ((code = lora_widen_base(t, w, cols, aname, &m)) != NF4_OK || (code = keep_made(b, m, file, aname)) != NF4_OK)
        return code;
    struct binding *x = add_binding(b, file, wname);
    if (!x)
        return nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
    x->replace = &m->tensors[0];
    x->frozen = x->widened = 1;
    x->term.adapter = index;
    b->set->in_channels = cols;
    b->set->base_in_channels = shape[1];
    return NF4_OK;
}

static int bind_pair(struct binder *b, const struct lora_adapter *ad, size_t index, const struct lora_config *c,
                     const char *module, const struct model_tensor *a, const struct pair_kind *kind)
{
    const char *file = a->file->path, *aname = a->t->name;
    int code = NF4_OK, mirrored = 0;
    char *bname = factor_key(ad, module, kind->b_suffix);
    char *wname = bname ? module_weight_in_base(b, module, &code) : NULL;
    if (code != NF4_OK)
        goto out;
    if (!bname || !wname) {
        code = nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
        goto out;
    }
    const struct model_tensor *bt = model_find(ad->weights, bname);
    if (!bt) {
        code = nf4_fail(NF4_EDATA, file, aname, "has no matching %s", bname);
        goto out;
    }
    if (kind->embedding && bnb_find(b->weights, b->nweights, wname)) {
        code = nf4_fail(NF4_EDATA, file, aname, "is an embedding LoRA, but %s is 4-bit; bitsandbytes never "
                        "quantizes an embedding (an adapter for another model?)", wname);
        goto out;
    }
    size_t ndim;
    const uint64_t *shape;
    if (!base_shape(b, wname, &ndim, &shape)) {
        code = nf4_fail(NF4_EDATA, file, aname, "matches no floating-point tensor %s in the base model "
                        "(an adapter for another model?)", wname);
        goto out;
    }
    const uint64_t *resized = resized_layer_shape(b, ad, module, wname, ndim, shape);
    if (resized)
        shape = resized;
    /* A module the config leaves out: PEFT never wraps it and ignores its
     * weights whatever their rank or shape. (One that is not in the base at
     * all is an adapter for another model, refused above.) With
     * ensure_weight_tying PEFT wraps the tied head whenever it wraps the
     * embedding, and does not list it. A 2-D parameter that target_parameters
     * selects has the same pair and delta (ParamWrapper with one expert). */
    const int parameter = target_parameters_select(c->target_parameters, module, "weight") == 1,
              as_module = lora_target_matches(&c->targets, module) || wrapped_for_the_tie(b, c, wname);
    b->parameter_pairs += parameter;
    if (parameter && (code = refuse_wrapper_features(c, file, aname)) != NF4_OK)
        goto out;
    if (!as_module && !parameter) {
        char shown[NF4_TENSOR_SHOWN_MAX];
        nf4_warn("%s: %s: its module is not one adapter_config.json targets (target_modules, exclude_modules, "
                 "layers_to_transform); PEFT does not load it, and it is not merged", file,
                 nf4_tensor_shown(file, aname, shown, sizeof shown));
        goto out;
    }
    /* A tied pair trained as one (head_mirrors_embedding) merges once, into the
     * embedding, and stays tied; a LoRA on either one alone parts them. */
    if ((is_tied_head(b, wname) || (kind->embedding && is_tied_embedding(b, wname))) &&
        (code = head_mirrors_embedding(b, ad, &mirrored)) != NF4_OK)
        goto out;
    if (mirrored && is_tied_head(b, wname))
        goto out;
    if (parts_tied_weights(b, wname, mirrored))
        note_untie(b, file, aname, wname, 0);
    if ((code = note_projection_part(b, module, file, aname)) != NF4_OK)
        goto out;
    uint32_t r;
    double alpha;
    /* PEFT matches the patterns against a wrapped parameter's "M.weight". */
    int from_pattern = module_rank_alpha(c, as_module ? module : wname, &r, &alpha);
    const struct st_tensor *at = a->t, *btt = bt->t;
    if ((code = check_factors_of(file, at, btt, !kind->embedding)) != NF4_OK)
        goto out;
    const int conv = lora_is_conv_pair(at, btt);
    if (conv && (c->use_dora || parameter)) {
        code = nf4_fail(NF4_EDATA, file, aname, "is a LoRA on a convolution with %s, which nf4deq does not merge",
                        c->use_dora ? "DoRA (use_dora)" : "target_parameters");
        goto out;
    }
    if (c->rank_from_shapes) { /* a diffusers LoRA without its config: r = alpha = the pair's rank */
        if (at->shape[0] == 0 || at->shape[0] > LORA_MAX_RANK) {
            code = nf4_fail(NF4_EDATA, file, aname, "has rank %llu; a rank is from 1 to %u",
                            (unsigned long long)at->shape[0], LORA_MAX_RANK);
            goto out;
        }
        r = (uint32_t)at->shape[0];
        if (!c->alphas_given)
            alpha = r;
    }
    if (at->shape[0] != r || btt->shape[1] != r) {
        code = nf4_fail(NF4_EDATA, file, at->shape[0] != r ? aname : bname,
                        "has rank %llu, but the config says r = %u%s",
                        (unsigned long long)(at->shape[0] != r ? at->shape[0] : btt->shape[1]), r,
                        from_pattern ? " (rank_pattern)" : "");
        goto out;
    }
    uint64_t out_f = btt->shape[0], in_f = factor_columns(at);
    if (conv) { /* the weight [out, in, k...] as [out, in * k...]: PEFT's Conv layers ignore fan_in_fan_out */
        int fits = ndim == at->ndim && shape[0] == out_f;
        for (size_t d = 1; fits && d < ndim; d++)
            fits = shape[d] == at->shape[d];
        if (!fits) {
            code = nf4_fail(NF4_EDATA, file, aname, "is a convolution's LoRA of %llu outputs, whose [in, kernel...] "
                            "does not fit the base tensor %s (%zu dimensions, %llu outputs)", (unsigned long long)out_f,
                            wname, ndim, (unsigned long long)(ndim ? shape[0] : 0));
            goto out;
        }
    }
    int transposed = !conv && (kind->embedding || delta_transposed(b, c, wname, out_f, in_f, ndim, shape));
    uint64_t rows = transposed ? in_f : out_f, cols = transposed ? out_f : in_f, widened_shape[2], padded_from = 0;
    if (ad->flux1_loader && kind == &LAYER_PAIR && !conv && !transposed && !parameter && !c->use_dora && ndim == 2 &&
        shape[0] == rows && shape[1] != cols && cols) {
        if ((code = widen_for_flux1(b, index, module, wname, shape, cols, &a)) != NF4_OK)
            goto out;
        if (cols < shape[1]) { /* lora_A padded */
            padded_from = cols;
            cols = shape[1];
        } else { /* the base replaced by its widened weight */
            widened_shape[0] = rows;
            widened_shape[1] = cols;
            shape = widened_shape;
        }
    }
    if (!conv && (ndim != 2 || shape[0] != rows || shape[1] != cols)) {
        /* the factor at fault: lora_B where A's inputs fit and B's outputs do not */
        const int b_wrong = ndim == 2 && shape[transposed ? 0 : 1] == in_f && shape[transposed ? 1 : 0] != out_f;
        code = nf4_fail(NF4_EDATA, file, b_wrong ? bname : aname, "B @ A%s is %llux%llu but the base tensor %s is "
                        "%s%llux%llu",
                        kind->embedding ? " transposed (an embedding)"
                        : transposed    ? " transposed (fan_in_fan_out)"
                                        : "", (unsigned long long)rows,
                        (unsigned long long)cols, wname, ndim == 2 ? "" : "not a matrix, ",
                        (unsigned long long)shape[0], (unsigned long long)(ndim > 1 ? shape[1] : 0));
        goto out;
    }
    if (rows == 0 || cols == 0) {
        code = nf4_fail(NF4_EDATA, file, aname, "changes %s, which has no elements", wname);
        goto out;
    }
    const struct model_tensor *magnitude = NULL;
    if (c->use_dora && (code = find_magnitude(ad, module, kind, transposed, rows, a, &magnitude)) != NF4_OK)
        goto out;
    struct binding *x = add_binding(b, file, wname);
    if (!x) {
        code = nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
        goto out;
    }
    x->rows = rows;
    x->cols = cols;
    x->term = (struct lora_term){.a = a,
                                 .b = bt,
                                 .r = r,
                                 .alpha = alpha,
                                 .fan_in_fan_out = transposed,
                                 .embedding = kind->embedding,
                                 .magnitude = magnitude,
                                 .scaling = config_scaling(c, alpha, r),
                                 .padded_from = padded_from,
                                 .adapter = index};
    if (!isfinite(x->term.scaling))
        code = nf4_fail(NF4_EDATA, file, aname, "lora_alpha / r is not a finite fp32 number");
out:
    free(bname);
    free(wname);
    return code;
}

static int check_b_has_a(const struct model *m, const char *file, const char *key, const char *suffix,
                         const struct pair_kind *kind);

/* ---- LoKr (lora_lokr.h) ---- */

/* A fused projection diffusers makes of its parts to load a LoKr on it
 * (Attention.fuse_projections: torch.cat of their weights, in this order). */
static const struct {
    const char *fused, *parts[3];
} FUSED_PROJECTIONS[] = {
    {"to_qkv", {"to_q", "to_k", "to_v"}},
    {"to_added_qkv", {"add_q_proj", "add_k_proj", "add_v_proj"}},
};

/* Whether diffusers fuses the base's projections for a LoKr on a fused one
 * (_maybe_fuse_qkv_projections_for_lokr): it does where the model has
 * fuse_qkv_projections, of the classes whose loader reads LoKr only
 * Flux.2's transformer (Z-Image's has none, and PEFT then finds no such
 * module). -1 when out of memory. */
static int base_fuses_qkv(struct binder *b)
{
    if (b->fuses_qkv < 0) {
        char *cls = NULL;
        if (b->base->dir && diffusers_class_name(b->base->dir, CONFIG_FILE_NAME, &cls) != NF4_OK)
            return -1;
        b->fuses_qkv = cls && diffusers_lora_family(cls) == LORA_FAMILY_FLUX2;
        free(cls);
    }
    return b->fuses_qkv;
}

/* Whether `module` is one of the projections FUSED_PROJECTIONS fuses
 * (the last segment of its name). */
static int is_projection_part(const char *module)
{
    const char *dot = strrchr(module, '.'), *last = dot ? dot + 1 : module;
    for (size_t f = 0; f < sizeof FUSED_PROJECTIONS / sizeof *FUSED_PROJECTIONS; f++)
        for (size_t j = 0; j < 3; j++)
            if (strcmp(last, FUSED_PROJECTIONS[f].parts[j]) == 0)
                return 1;
    return 0;
}

/* Notes a term on `module` where it is a projection diffusers' fusing would
 * leave unused (binder.part_key). NF4_OK or NF4_ESOFTWARE. */
static int note_projection_part(struct binder *b, const char *module, const char *file, const char *key)
{
    if (b->part_key || !is_projection_part(module))
        return NF4_OK;
    const int fuses = base_fuses_qkv(b);
    if (fuses < 0)
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    if (fuses) {
        b->part_file = file;
        b->part_key = key;
    }
    return NF4_OK;
}

/* The parts of `module` where it names a fused projection diffusers makes
 * for a LoKr ("...attn.to_qkv"), as base weight names (allocated, parts[3]);
 * 0 where it names none. -1 when out of memory. */
static int fused_parts(struct binder *b, const char *module, char *parts[3])
{
    const char *dot = strrchr(module, '.'), *last = dot ? dot + 1 : module;
    const size_t parent = (size_t)(last - module);
    for (size_t f = 0; f < sizeof FUSED_PROJECTIONS / sizeof *FUSED_PROJECTIONS; f++) {
        const int fuses = strcmp(last, FUSED_PROJECTIONS[f].fused) == 0 ? base_fuses_qkv(b) : 0;
        if (fuses < 0)
            return -1;
        if (!fuses)
            continue;
        for (size_t j = 0; j < 3; j++) {
            struct strbuf w = {0};
            strbuf_printf(&w, "%.*s%s.weight", (int)parent, module, FUSED_PROJECTIONS[f].parts[j]);
            parts[j] = w.p;
            if (w.oom) {
                for (size_t k = 0; k <= j; k++) {
                    free(parts[k]);
                    parts[k] = NULL;
                }
                return -1;
            }
        }
        return 1;
    }
    return 0;
}

/* The base weights a LoKr on `module` changes, and the rows of its delta
 * each takes: its own weight, or the parts of a fused projection, each its
 * rows of the fused [q; k; v]. *out and *in: the layer PEFT builds the
 * LoKr for. NF4_EDATA where the base has no such layer (or parts of other
 * widths); NF4_ESOFTWARE. */
static int lokr_layers(struct binder *b, const struct lora_adapter *ad, const char *file, const char *key,
                       const char *module, char *names[3], uint64_t rows[3], size_t *n, uint64_t *out, uint64_t *in)
{
    int code = NF4_OK;
    size_t ndim;
    const uint64_t *shape;
    *n = 0;
    char *own = module_weight_in_base(b, module, &code);
    if (code != NF4_OK)
        return code;
    if (!own)
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    if (!base_shape(b, own, &ndim, &shape)) {
        int fused = fused_parts(b, module, names);
        if (fused <= 0) {
            code = fused < 0 ? nf4_fail(NF4_ESOFTWARE, file, key, "out of memory")
                             : nf4_fail(NF4_EDATA, file, key, "matches no floating-point tensor %s in the base "
                                        "model (an adapter for another model?)", own);
            free(own);
            return code;
        }
        free(own);
    } else {
        names[0] = own;
        *n = 1;
        /* a layer of a resized vocabulary, which the adapter holds whole: PEFT built the LoKr on it */
        const uint64_t *resized = resized_layer_shape(b, ad, module, own, ndim, shape);
        if (resized)
            shape = resized;
        if (ndim != 2)
            return nf4_fail(NF4_EDATA, file, key, "is a LoKr on %s, which is not a matrix (%zu dimensions): nf4deq "
                            "merges LoKr on linear layers only", names[0], ndim);
        rows[0] = *out = shape[0];
        *in = shape[1];
        return NF4_OK;
    }
    *n = 3;
    *out = 0;
    for (size_t j = 0; j < 3; j++) {
        if (!base_shape(b, names[j], &ndim, &shape) || ndim != 2)
            return nf4_fail(NF4_EDATA, file, key, "is a LoKr on the fused projection %s, but the base has no "
                            "matrix %s to fuse (an adapter for another model?)", module, names[j]);
        if (j && shape[1] != *in)
            return nf4_fail(NF4_EDATA, file, key, "is a LoKr on the fused projection %s, but %s has %llu columns "
                            "and %s %llu: they do not fuse", module, names[0], (unsigned long long)*in, names[j],
                            (unsigned long long)shape[1]);
        rows[j] = shape[0];
        *in = shape[1];
        *out += shape[0];
    }
    return NF4_OK;
}

/* Whether `wname` is named as transformers' input embeddings are (Llama's
 * embed_tokens, GPT-2's wte and wpe, GPT-NeoX's embed_in, BERT's
 * word_embeddings, T5's shared...): layers no LoKr may be on. A checkpoint
 * does not say a layer's type; these names are embeddings' alone there. */
static int is_input_embedding_name(const char *wname)
{
    static const char *const NAMES[] = {"embed_tokens.weight",  "embed_in.weight",
                                        "wte.weight",           "wpe.weight",
                                        "word_embeddings.weight", "position_embeddings.weight",
                                        "token_type_embeddings.weight", "embed_positions.weight",
                                        "tok_embeddings.weight", "shared.weight"};
    for (size_t i = 0; i < sizeof NAMES / sizeof *NAMES; i++) {
        const size_t n = strlen(wname), m = strlen(NAMES[i]);
        if (n >= m && strcmp(wname + n - m, NAMES[i]) == 0 && (n == m || wname[n - m - 1] == '.'))
            return 1;
    }
    return 0;
}

/* Binds the LoKr of the module whose first factor (lokr_w1 or lokr_w1_a) is
 * `first`, key name `name` (after the adapter's prefix). */
static int bind_lokr(struct binder *b, const struct lora_adapter *ad, size_t index, const struct lora_config *c,
                     const char *name, const struct model_tensor *first)
{
    const char *file = first->file->path, *key = first->t->name;
    char *module = strndup(name, strlen(name) - lokr_suffix_len(name)), *names[3] = {NULL, NULL, NULL};
    if (!module)
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    int code = NF4_OK;
    if (!lora_target_matches(&c->targets, module)) {
        char shown[NF4_TENSOR_SHOWN_MAX];
        nf4_warn("%s: %s: its module is not one adapter_config.json targets (target_modules, exclude_modules, "
                 "layers_to_transform); PEFT does not load it, and it is not merged", file,
                 nf4_tensor_shown(file, key, shown, sizeof shown));
        goto out;
    }
    uint64_t rows[3], out_f = 0, in_f = 0;
    size_t n = 0;
    if ((code = lokr_layers(b, ad, file, key, module, names, rows, &n, &out_f, &in_f)) != NF4_OK)
        goto out;
    /* PEFT's LoKr takes Linear and Conv layers: on an embedding it raises (TypeError) */
    if (n == 1 && (is_tied_embedding(b, names[0]) || is_input_embedding_name(names[0]))) {
        code = nf4_fail(NF4_EDATA, file, key, "is a LoKr on the embedding %s, which PEFT's LoKr does not take "
                        "(it raises)", names[0]);
        goto out;
    }
    /* A LoKr on the tied head changes it apart from the embedding, as a LoRA on it does (bind_pair) */
    if (n == 1 && parts_tied_weights(b, names[0], 0))
        note_untie(b, file, key, names[0], 0);
    if (n == 3 && !b->fused_key) {
        b->fused_file = file;
        b->fused_key = key;
    }
    if (n == 1 && (code = note_projection_part(b, module, file, key)) != NF4_OK)
        goto out;
    uint32_t r;
    double alpha;
    module_rank_alpha(c, module, &r, &alpha);
    struct lora_kron k;
    if ((code = lokr_read_factors(ad->weights, file, ad->key_prefix, module, c, r, out_f, in_f, &k)) != NF4_OK)
        goto out;
    const float scaling = lora_scaling(alpha, r, 0);
    if (!isfinite(scaling)) {
        code = nf4_fail(NF4_EDATA, file, key, "alpha / r is not a finite fp32 number");
        goto out;
    }
    for (size_t j = 0; j < n; j++) {
        struct binding *x = add_binding(b, file, names[j]);
        if (!x) {
            code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
            goto out;
        }
        x->rows = rows[j];
        x->cols = in_f;
        x->term = (struct lora_term){.a = k.w1, .r = r, .alpha = alpha, .scaling = scaling, .kron = k,
                                     .adapter = index};
        k.row0 += rows[j]; /* the next part's rows of the fused delta */
    }
out:
    for (size_t j = 0; j < 3; j++)
        free(names[j]);
    free(module);
    return code;
}

/* A LoKr key other than a module's first factor: bound with it; alone, refused. */
static int check_lokr_has_first(const struct lora_adapter *ad, const char *file, const char *key)
{
    const size_t stem = strlen(key) - lokr_suffix_len(key);
    int found = 0;
    for (int split = 0; split < 2 && !found; split++) {
        struct strbuf first = {0};
        strbuf_printf(&first, "%.*s.lokr_w1%s", (int)stem, key, split ? "_a" : "");
        if (first.oom) {
            free(first.p);
            return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        }
        found = model_find(ad->weights, first.p) != NULL;
        free(first.p);
    }
    return found ? NF4_OK : nf4_fail(NF4_EDATA, file, key, "has no matching lokr_w1 or lokr_w1_a");
}

/* Whether A factor `a` of module `wrapped` ("M" or "M.base_layer...") is a
 * LoRA on M's fused MoE experts (lora_experts.h): target_parameters selects a
 * parameter of M, and M has no weight of its own in the base, under its name
 * or the one its model type saves it as. A name such as "down_proj" selects
 * "M.down_proj" for any M, but PEFT wraps only a parameter M has: Mixtral's
 * router mlp.gate, saved as block_sparse_moe.gate, is a weight, not experts.
 * *code: a failure to read config.json, or out of memory. */
static int is_experts_pair(struct binder *b, const struct lora_config *c, const char *file, const char *key,
                           const char *wrapped, int *code)
{
    if (!c->target_parameters)
        return 0;
    size_t depth, ndim;
    const uint64_t *shape;
    const char *params[EXPERTS_NPARAMS];
    char *module = experts_unwrap(wrapped, &depth);
    if (!module) {
        *code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        return 0;
    }
    int experts = 0;
    if (experts_targeted(c->target_parameters, module, params) > 0) {
        char *wname = module_weight_in_base(b, module, code);
        if (!wname && *code == NF4_OK)
            *code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        experts = wname && !base_shape(b, wname, &ndim, &shape);
        free(wname);
    }
    free(module);
    return experts;
}

/* The checkpoint tensor `name` of one expert: [rows, cols], where x is bound. */
static int bind_expert_part(struct binder *b, const char *file, const char *aname, const char *name, uint64_t rows,
                            uint64_t cols, const struct lora_term *term)
{
    size_t ndim;
    const uint64_t *shape;
    if (!base_shape(b, name, &ndim, &shape))
        return nf4_fail(NF4_EDATA, file, aname, "is a LoRA on MoE experts, but the base has no floating-point tensor "
                        "%s (an adapter for another model?)", name);
    if (ndim != 2 || shape[0] != rows || shape[1] != cols)
        return nf4_fail(NF4_EDATA, file, aname, "gives %s a %llux%llu delta, but it is %s%llux%llu", name,
                        (unsigned long long)rows, (unsigned long long)cols, ndim == 2 ? "" : "not a matrix, ",
                        (unsigned long long)shape[0], (unsigned long long)(ndim > 1 ? shape[1] : 0));
    struct binding *x = add_binding(b, file, name);
    if (!x)
        return nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
    x->rows = rows;
    x->cols = cols;
    x->term = *term;
    return NF4_OK;
}

/* The 3-D tensor `name` of the base, where it holds one (the fused experts
 * parameter M.P, lora_experts.h): else NULL. */
static const struct model_tensor *fused_experts_tensor(const struct binder *b, const char *name)
{
    const struct model_tensor *t = model_find(b->base, name);
    return t && t->t->ndim == 3 ? t : NULL;
}

/* A LoRA pair on the fused experts tensor M.P [E, n, m] of the base, held
 * in a fused `form`: one term over the whole tensor, seen as [E * n, m]
 * (lora_term.expert_rows). `term` has the pair's factors, rank and scaling;
 * the pair's delta per expert is [out, in], laid on [n, m] as [in, out]
 * where the form is transposed. */
static int bind_fused_experts(struct binder *b, const char *file, const char *aname, const struct model_tensor *fused,
                              enum experts_form form, uint64_t experts, uint64_t out_f, uint64_t in_f,
                              const struct lora_term *term)
{
    const struct st_tensor *t = fused->t;
    const uint64_t *shape = t->shape;
    if (bnb_find(b->weights, b->nweights, t->name) || !dtype_is_castable_float(t->dtype))
        return nf4_fail(NF4_EDATA, file, aname, "is a LoRA on the fused MoE experts %s, which is %s: nf4deq merges "
                        "one into a floating-point tensor", t->name,
                        dtype_is_castable_float(t->dtype) ? "4-bit" : dtype_name(t->dtype));
    if (shape[0] != experts)
        return nf4_fail(NF4_EDATA, file, aname, "holds %llu experts (r = %u), but the base's %s has %llu",
                        (unsigned long long)experts, term->r, t->name, (unsigned long long)shape[0]);
    /* EXPERTS_FUSED_EITHER: as transformers loads it, as it is where that is the runtime's shape. */
    const int transposed = form == EXPERTS_FUSED_TRANSPOSED ||
                           (form == EXPERTS_FUSED_EITHER && !(out_f == shape[1] && in_f == shape[2]));
    const uint64_t want_in = transposed ? shape[1] : shape[2], want_out = transposed ? shape[2] : shape[1];
    if (in_f != want_in || out_f != want_out)
        return nf4_fail(NF4_EDATA, file, aname, "gives each expert of %s [%llu, %llu, %llu] a %llux%llu delta (out x "
                        "in), but it holds %s", t->name, (unsigned long long)shape[0], (unsigned long long)shape[1],
                        (unsigned long long)shape[2], (unsigned long long)out_f, (unsigned long long)in_f,
                        form == EXPERTS_FUSED_EITHER ? "neither [experts, out, in] nor [experts, in, out]"
                        : transposed                 ? "[experts, in, out] (is_transposed)"
                                                     : "[experts, out, in]");
    struct binding *x = add_binding(b, file, t->name);
    if (!x)
        return nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
    x->rows = shape[0] * shape[1];
    x->cols = shape[2];
    x->term = *term;
    x->term.fan_in_fan_out = transposed;
    x->term.b_col_step = (uint32_t)experts;
    x->term.expert_rows = shape[1];
    return NF4_OK;
}

/* A LoRA on parameter P of MoE experts module M, key "M(.base_layer)^d.lora_A.weight":
 * one term on each expert's checkpoint tensors, or on the fused tensor M.P
 * where the base holds that (lora_experts.h). */
static int bind_experts_pair(struct binder *b, const struct lora_adapter *ad, size_t index,
                             const struct lora_config *c, const char *wrapped, const struct model_tensor *a)
{
    const char *file = a->file->path, *aname = a->t->name, *params[EXPERTS_NPARAMS];
    size_t depth;
    char *module = experts_unwrap(wrapped, &depth), *bname = factor_key(ad, wrapped, LORA_B_SUFFIX);
    char *pkey = NULL, *names[2] = {NULL, NULL};
    int code = NF4_OK;
    if (!module || !bname) {
        code = nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
        goto out;
    }
    if ((code = refuse_wrapper_features(c, file, aname)) != NF4_OK)
        goto out;
    size_t nparams = experts_targeted(c->target_parameters, module, params);
    if (depth >= nparams) {
        code = nf4_fail(NF4_EDATA, file, aname, "is a LoRA on a parameter of %s that target_parameters does not "
                        "name (it selects %zu there)", module, nparams);
        goto out;
    }
    /* PEFT wraps the parameters in order, each wrapper around the one before. */
    const char *param = params[nparams - 1 - depth];
    if ((code = read_model_type(b)) != NF4_OK)
        goto out;
    /* PEFT matches rank_pattern and alpha_pattern against "M.P", the name of the fused tensor. */
    if (!(pkey = module_param_name(module, param))) {
        code = nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
        goto out;
    }
    const struct model_tensor *fused = fused_experts_tensor(b, pkey);
    const enum experts_form form = experts_stored_form(experts_form_of(b->model_type, b->text_model_type), !!fused);
    if (experts_form_is_fused(form) && !fused) {
        code = nf4_fail(NF4_EDATA, file, aname, "is a LoRA on the MoE experts' %s, which the base's model_type saves "
                        "as one 3-D tensor, but the base has no 3-D tensor %s (an adapter for another model?)", param,
                        pkey);
        goto out;
    }
    if (form == EXPERTS_UNKNOWN) {
        code = nf4_fail(NF4_EDATA, file, aname, "is a LoRA on the MoE experts' %s (target_parameters), which nf4deq "
                        "merges for the model types whose saved experts it knows (as Mixtral's, as Qwen2-MoE's, or "
                        "fused: README.md); the base's config.json model_type is %s%s%s", param,
                        b->model_type ? b->model_type : "not given", b->text_model_type ? ", its text_config's " : "",
                        b->text_model_type ? b->text_model_type : "");
        goto out;
    }
    const struct model_tensor *bt = model_find(ad->weights, bname);
    if (!bt) {
        code = nf4_fail(NF4_EDATA, file, aname, "has no matching %s", bname);
        goto out;
    }
    const struct st_tensor *at = a->t, *btt = bt->t;
    if ((code = check_factors(file, at, btt)) != NF4_OK)
        goto out;
    uint32_t r;
    double alpha;
    int from_pattern = module_rank_alpha(c, pkey, &r, &alpha);
    const uint64_t experts = at->shape[0] / r, out_f = btt->shape[0], in_f = at->shape[1];
    if (at->shape[0] % r != 0 || experts == 0 || experts > UINT32_MAX || btt->shape[1] != at->shape[0]) {
        code = nf4_fail(NF4_EDATA, file, btt->shape[1] != at->shape[0] && at->shape[0] % r == 0 ? bname : aname,
                        "has %llu columns, %llu rows in %s: a LoRA on MoE experts has r * experts rows in lora_A and "
                        "as many columns in lora_B, and the config says r = %u%s",
                        (unsigned long long)btt->shape[1], (unsigned long long)at->shape[0], aname, r,
                        from_pattern ? " (rank_pattern)" : "");
        goto out;
    }
    const size_t nparts = strcmp(param, EXPERTS_PARAMS[0]) == 0 && !fused ? 2 : 1;
    if (in_f == 0) {
        code = nf4_fail(NF4_EDATA, file, aname, "has no columns");
        goto out;
    }
    if (out_f % nparts != 0 || out_f == 0) {
        code = nf4_fail(NF4_EDATA, file, bname, "has %llu rows, which do not make the %s of %zu part%s",
                        (unsigned long long)out_f, param, nparts, nparts > 1 ? "s" : "");
        goto out;
    }
    const float scaling = lora_scaling(alpha, r, c->use_rslora);
    if (!isfinite(scaling)) {
        code = nf4_fail(NF4_EDATA, file, aname, "lora_alpha / r is not a finite fp32 number");
        goto out;
    }
    if (fused) {
        const struct lora_term term = {.a = a, .b = bt, .r = r, .alpha = alpha, .scaling = scaling, .adapter = index};
        code = bind_fused_experts(b, file, aname, fused, form, experts, out_f, in_f, &term);
        b->parameter_pairs += code == NF4_OK;
        goto out;
    }
    /* Every expert the factors hold, and no more in the base. */
    for (uint64_t e = 0; e <= experts && code == NF4_OK; e++) {
        if (!experts_tensor_names(form, module, param, e, names)) {
            code = nf4_fail(NF4_ESOFTWARE, file, aname, "out of memory");
            break;
        }
        size_t ndim;
        const uint64_t *shape;
        if (e == experts) {
            if (base_shape(b, names[0], &ndim, &shape))
                code = nf4_fail(NF4_EDATA, file, aname, "holds %llu experts (r = %u), but the base has %s too",
                                (unsigned long long)experts, r, names[0]);
        } else {
            for (size_t p = 0; p < nparts && code == NF4_OK; p++) {
                const struct lora_term term = {.a = a, .b = bt, .r = r, .alpha = alpha, .scaling = scaling,
                                               .a_row0 = e * r, .b_row0 = p * (out_f / nparts),
                                               .b_col0 = (uint32_t)e, .b_col_step = (uint32_t)experts,
                                               .adapter = index};
                code = bind_expert_part(b, file, aname, names[p], out_f / nparts, in_f, &term);
            }
        }
        free(names[0]);
        free(names[1]);
        names[0] = names[1] = NULL;
    }
    b->parameter_pairs += code == NF4_OK;
out:
    free(module);
    free(bname);
    free(pkey);
    return code;
}

/* Where an adapter's config is, for messages. */
static const char *config_name(const struct lora_adapter *ad)
{
    return ad->diffusers ? "its metadata (" DIFFUSERS_LORA_METADATA ")" : ADAPTER_CONFIG_NAME;
}

/* A LoRA bias, M.lora_B.bias [out] (lora_bias): PEFT's layer adds
 * scaling * (B @ A @ x + b), so the merged model's M.bias is the base's plus
 * scaling * b, as PEFT's merge of a 16-bit layer computes it (its merge into
 * a 4-bit layer leaves the scaling out, unlike its forward). A term of rank 1
 * on M.bias seen as [1, out] (lora.h). PEFT cannot merge one into a layer
 * without a bias, and neither does nf4deq. */
static int bind_lora_bias(struct binder *b, const struct lora_adapter *ad, size_t index,
                          const struct lora_config *c, const struct model_tensor *t, const char *name)
{
    const char *file = t->file->path, *key = t->t->name;
    if (!c->lora_bias)
        return nf4_fail(NF4_EDATA, file, key, "is a LoRA bias, but %s does not set lora_bias", config_name(ad));
    int code = check_b_has_a(ad->weights, file, key, LORA_BIAS_SUFFIX, &LAYER_PAIR);
    if (code != NF4_OK)
        return code;
    char *module = strndup(name, strlen(name) - strlen(LORA_BIAS_SUFFIX));
    char *bname = module ? factor_key(ad, module, LORA_B_SUFFIX) : NULL, *wname = module ? base_weight_name(module) : NULL;
    char *runtime_bias = module ? module_param_name(module, "bias") : NULL;
    char *bias_name = runtime_bias ? name_in_base(b, runtime_bias) : NULL;
    free(runtime_bias);
    if (!bname || !wname || !bias_name) {
        code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        goto out;
    }
    /* A module the config leaves out: its pair is not merged (bind_pair warns), nor its bias. */
    if (!lora_target_matches(&c->targets, module) && !wrapped_for_the_tie(b, c, wname))
        goto out;
    const struct model_tensor *bt = model_find(ad->weights, bname);
    const struct st_tensor *x = t->t;
    if (!bt) {
        code = nf4_fail(NF4_EDATA, file, key, "has no matching %s", bname);
        goto out;
    }
    if (bt->t->ndim != 2 || bt->t->shape[0] == 0 || !is_factor_vector(x, bt->t->shape[0])) {
        code = nf4_fail(NF4_EDATA, file, key, "must be an F32, BF16 or F16 vector of %llu, one per row of %s",
                        (unsigned long long)(bt->t->ndim == 2 ? bt->t->shape[0] : 0), bname);
        goto out;
    }
    size_t ndim;
    const uint64_t *shape;
    if (!base_shape(b, bias_name, &ndim, &shape)) {
        code = nf4_fail(NF4_EDATA, file, key, "adds to %s, which the base model does not have: PEFT cannot merge a "
                        "LoRA bias (lora_bias) into a layer without a bias either", bias_name);
        goto out;
    }
    if (ndim != 1 || shape[0] != x->shape[0]) {
        code = nf4_fail(NF4_EDATA, file, key, "has %llu values, but the base tensor %s is not a vector of as many",
                        (unsigned long long)x->shape[0], bias_name);
        goto out;
    }
    uint32_t r;
    double alpha;
    module_rank_alpha(c, module, &r, &alpha);
    if (c->rank_from_shapes) { /* as for its pair (bind_pair checks the rank) */
        r = (uint32_t)(bt->t->shape[1] <= LORA_MAX_RANK ? bt->t->shape[1] : 1);
        if (!c->alphas_given)
            alpha = r;
    }
    struct binding *y = add_binding(b, file, bias_name);
    if (!y) {
        code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        goto out;
    }
    y->rows = 1;
    y->cols = x->shape[0];
    y->term = (struct lora_term){.a = t,
                                 .r = 1,
                                 .pair_r = r,
                                 .alpha = alpha,
                                 .bias = 1,
                                 .scaling = config_scaling(c, alpha, r),
                                 .adapter = index};
    if (!isfinite(y->term.scaling))
        code = nf4_fail(NF4_EDATA, file, key, "lora_alpha / r is not a finite fp32 number");
out:
    free(module);
    free(bname);
    free(wname);
    free(bias_name);
    return code;
}

/* Whether adapter tensor t can stand for the base tensor `name`: NF4_OK, or
 * NF4_EDATA naming both. An embedding layer held whole (or the tied head)
 * may have other rows than the base's, as long as every one of them has the
 * same number: the adapters were trained on a resized vocabulary
 * (lora_set.vocab_rows; check_vocabulary asks for the rest). */
static int base_shape_fits(struct binder *b, const struct model_tensor *t, const char *name)
{
    size_t ndim;
    const uint64_t *shape;
    if (!base_shape(b, name, &ndim, &shape))
        return nf4_fail(NF4_EDATA, t->file->path, t->t->name, "matches no floating-point tensor %s in the base model",
                        name);
    const struct st_tensor *x = t->t;
    if (x->ndim == 2 && ndim == 2 && x->shape[1] == shape[1] && x->shape[0] != shape[0] &&
        dtype_is_castable_float(x->dtype) && (is_embedding_layer_weight(name) || is_tied_head(b, name))) {
        if (x->shape[0] == 0)
            return nf4_fail(NF4_EDATA, t->file->path, x->name, "has no rows: a vocabulary of none");
        if (!b->vocab_rows) {
            b->vocab_rows = x->shape[0];
            b->base_vocab_rows = shape[0];
            b->vocab_file = t->file->path;
            b->vocab_key = x->name;
        } else if (x->shape[0] != b->vocab_rows) {
            return nf4_fail(NF4_EDATA, t->file->path, x->name, "has %llu rows, but %s: %s has %llu: the adapters "
                            "resize the vocabulary two ways", (unsigned long long)x->shape[0], b->vocab_file,
                            b->vocab_key, (unsigned long long)b->vocab_rows);
        }
        return NF4_OK;
    }
    if (!dtype_is_castable_float(x->dtype) || x->ndim != ndim || memcmp(x->shape, shape, ndim * sizeof *shape))
        return nf4_fail(NF4_EDATA, t->file->path, x->name,
                        "does not have the dtype class or shape of %s in the base model", name);
    return NF4_OK;
}

/* What a tensor that replaces the tied head or its embedding says of the tie. */
enum tie_role {
    TIE_PARTED,  /* a copy trained apart (modules_to_save) */
    TIE_KEPT,    /* the embedding's copy, kept tied to the head (ensure_weight_tying) */
    TIE_NEUTRAL, /* the frozen base layer of a module wrapped with LoRA: the base's own values */
};

/* Binds adapter tensor t to replace the base tensor `name` (the base's own name). */
static int bind_replacement_in_base(struct binder *b, size_t index, const struct model_tensor *t, const char *name,
                                    enum tie_role role)
{
    const char *file = t->file->path;
    if (role != TIE_NEUTRAL && parts_tied_weights(b, name, role == TIE_KEPT))
        note_untie(b, file, t->t->name, name, 0);
    else if (role == TIE_KEPT && is_tied_embedding(b, name) && !b->tie_kept_key) {
        b->tie_kept_file = file;
        b->tie_kept_key = t->t->name;
    }
    int code = base_shape_fits(b, t, name);
    if (code != NF4_OK)
        return code;
    struct binding *x = add_binding(b, file, name);
    if (!x)
        return nf4_fail(NF4_ESOFTWARE, file, t->t->name, "out of memory");
    x->replace = t;
    x->frozen = role == TIE_NEUTRAL;
    x->term.adapter = index;
    return NF4_OK;
}

/* The same, for `runtime_name` as the adapter names it (name_in_base). */
static int bind_replacement_of(struct binder *b, size_t index, const struct model_tensor *t,
                               const char *runtime_name, enum tie_role role)
{
    const char *file = t->file->path;
    char *name = name_in_base(b, runtime_name);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, file, t->t->name, "out of memory");
    int code = bind_replacement_in_base(b, index, t, name, role);
    free(name);
    return code;
}

/* With ensure_weight_tying PEFT saves the embedding's modules_to_save copy
 * under the tied head's name as well (it drops lm_head from modules_to_save
 * and ties the head to that copy): the same tensor twice. The embedding's key
 * is the one merged; a head key alone stands for it. */
static int bind_tied_head_copy(struct binder *b, const struct lora_adapter *ad, size_t index,
                               const struct model_tensor *t)
{
    char *key = factor_key(ad, b->tied_runtime, "");
    if (!key)
        return nf4_fail(NF4_ESOFTWARE, t->file->path, t->t->name, "out of memory");
    const struct model_tensor *embed = model_find(ad->weights, key);
    free(key);
    if (!embed)
        return bind_replacement_of(b, index, t, b->tied_embedding, TIE_KEPT);
    const struct st_tensor *x = t->t, *y = embed->t;
    if (x->dtype != y->dtype || x->ndim != y->ndim || memcmp(x->shape, y->shape, x->ndim * sizeof *x->shape) != 0)
        return nf4_fail(NF4_EDATA, t->file->path, x->name, "differs in dtype or shape from %s, the copy "
                        "ensure_weight_tying ties it to", y->name);
    return NF4_OK;
}

/* A tensor the adapter holds whole, which replaces the base's: a
 * modules_to_save module's, a trained bias ("bias": "all" or "lora_only"), or
 * a frozen layer: the base layer of a module PEFT wrapped (with LoRA, or for
 * trained tokens), which it saves as "M.base_layer.P" or
 * "M.token_adapter.base_layer.P" (a bias under a LoRA layer; lm_head or
 * embed_tokens with save_embedding_layers), or an embedding layer nothing
 * wraps, as "M.weight", and loads back into M.P. */
static int bind_replacement(struct binder *b, const struct lora_adapter *ad, size_t index,
                            const struct lora_config *c, const struct model_tensor *t, const char *key_name);

/* The parts of PEFT's wrapper of a modules_to_save module, which it saves too
 * when it saves the embedding layers whole (save_embedding_layers, as for a
 * resized vocabulary): "M.original_module.P", the frozen layer, checked for
 * shape and left (the copy replaces it); and "M.modules_to_save.P", the
 * trained copy again beside "M.P", whose bytes must be the same (alone, it is
 * the copy). `seg` is where the segment starts in key_name. */
static int bind_wrapper_part(struct binder *b, const struct lora_adapter *ad, size_t index,
                             const struct lora_config *c, const struct model_tensor *t, const char *key_name,
                             const char *seg, int original)
{
    size_t at = (size_t)(seg - key_name), skip = strlen(original ? ORIGINAL_SEGMENT : COPY_SEGMENT) - 1;
    char *name = malloc(strlen(key_name) + 1), *twin_key = NULL;
    if (name) {
        memcpy(name, key_name, at);
        strcpy(name + at, seg + skip); /* "M.P" */
        twin_key = factor_key(ad, name, "");
    }
    int code = twin_key ? NF4_OK : nf4_fail(NF4_ESOFTWARE, t->file->path, t->t->name, "out of memory");
    const struct model_tensor *twin = twin_key ? model_find(ad->weights, twin_key) : NULL;
    int same = 0;
    if (code == NF4_OK && original) {
        char *in_base = name_in_base(b, name);
        code = in_base ? base_shape_fits(b, t, in_base) : nf4_fail(NF4_ESOFTWARE, t->file->path, t->t->name,
                                                                   "out of memory");
        free(in_base);
    }
    else if (code == NF4_OK && !twin)
        code = bind_replacement(b, ad, index, c, t, name);
    else if (code == NF4_OK && (code = model_tensors_equal(t, twin, &same)) == NF4_OK && !same)
        code = nf4_fail(NF4_EDATA, t->file->path, t->t->name, "differs from %s, the modules_to_save copy PEFT saves "
                        "it beside", twin_key);
    free(twin_key);
    free(name);
    return code;
}

static int bind_replacement(struct binder *b, const struct lora_adapter *ad, size_t index,
                            const struct lora_config *c, const struct model_tensor *t, const char *key_name)
{
    const char *file = t->file->path;
    const char *original = strstr(key_name, ORIGINAL_SEGMENT), *copy = strstr(key_name, COPY_SEGMENT);
    if (original || copy)
        return bind_wrapper_part(b, ad, index, c, t, key_name, original ? original : copy, original != NULL);
    char *name = strdup(key_name);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, file, t->t->name, "out of memory");
    char *base_layer = strstr(name, BASE_LAYER_SEGMENT);
    if (base_layer) { /* "M.base_layer.P" -> "M.P", and "M.token_adapter.base_layer.P" too */
        const char *rest = base_layer + strlen(BASE_LAYER_SEGMENT) - 1; /* ".P" */
        size_t wrapper = strlen(TOKEN_ADAPTER_SEGMENT);
        if ((size_t)(base_layer - name) > wrapper && memcmp(base_layer - wrapper, TOKEN_ADAPTER_SEGMENT, wrapper) == 0)
            base_layer -= wrapper;
        memmove(base_layer, rest, strlen(rest) + 1);
    }
    const char *last = strrchr(name, '.');
    int mts = in_modules_to_save(c, name);
    /* Frozen layers PEFT saves whole: a wrapped module's base layer, and
     * (save_embedding_layers) the embedding layers. */
    int frozen = base_layer || (!mts && is_embedding_layer_weight(name));
    /* (A frozen head with ensure_weight_tying comes with the frozen embedding,
     * so that taking it for the embedding's copy gives the same.) */
    if (c->ensure_weight_tying && is_tied_head(b, name) && !base_layer) {
        free(name);
        return bind_tied_head_copy(b, ad, index, t);
    }
    if (frozen && is_tied_head(b, name)) {
        /* The shared tensor again, which the base does not store as the head:
         * a head written apart starts from the base's embedding, but from
         * this copy where the vocabulary was resized (then it has the rows). */
        int code = base_shape_fits(b, t, name);
        const struct model_tensor *embed = model_find(b->base, b->tied_embedding);
        if (code == NF4_OK && t->t->shape[0] != embed->t->shape[0])
            code = bind_replacement_of(b, index, t, name, TIE_NEUTRAL);
        free(name);
        return code;
    }
    int saved = frozen || mts || (c->trains_bias && last && strcmp(last + 1, "bias") == 0);
    enum tie_role role = frozen ? TIE_NEUTRAL : c->ensure_weight_tying ? TIE_KEPT : TIE_PARTED;
    int code = saved ? bind_replacement_of(b, index, t, name, role)
                     : nf4_fail(NF4_EDATA, file, t->t->name, "is neither a LoRA weight nor in modules_to_save");
    /* A bias trained with "bias": "all" or "lora_only", saved as M.bias, or as
     * M.base_layer.bias under a LoRA layer (for inspect). */
    if (code == NF4_OK && !mts && c->trains_bias && last && strcmp(last + 1, "bias") == 0)
        b->items[b->n - 1].trained_bias = 1;
    free(name);
    return code;
}

/* The rows adapter tensor t (M.token_adapter.trainable_tokens_delta, for
 * `module` M) replaces in M.weight, which is *rows x *cols. */
static int token_rows_of(const struct binder *b, const struct lora_adapter *ad, const struct lora_config *c,
                         const struct model_tensor *t, const char *module, struct token_rows **out, uint64_t *rows,
                         uint64_t *cols)
{
    const char *file = t->file->path, *key = t->t->name;
    int ambiguous;
    *out = NULL;
    const cJSON *list = token_indices_for(c->token_indices, module, &ambiguous);
    if (!list)
        return nf4_fail(NF4_EDATA, file, key, ambiguous ? "is the module of two entries of adapter_config.json's "
                                                          "\"" TOKEN_INDICES_KEY "\""
                                                        : "has no rows in adapter_config.json's \"" TOKEN_INDICES_KEY
                                                          "\"");
    char *wname = weight_in_base(b, module);
    if (!wname)
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    size_t ndim;
    const uint64_t *shape;
    int code;
    if (bnb_find(b->weights, b->nweights, wname))
        code = nf4_fail(NF4_EDATA, file, key, "replaces rows of %s, which is 4-bit; PEFT trains the token rows of "
                        "an embedding or a 16-bit layer (an adapter for another model?)", wname);
    else if (!base_shape(b, wname, &ndim, &shape) || ndim != 2)
        code = nf4_fail(NF4_EDATA, file, key, "matches no floating-point matrix %s in the base model (an adapter "
                        "for another model?)", wname);
    else {
        *rows = shape[0];
        *cols = shape[1];
        /* On a resized vocabulary PEFT saves the layer whole beside its rows:
         * the rows are that layer's. */
        char *layer_key = factor_key(ad, module, TOKEN_ADAPTER_SEGMENT BASE_LAYER_SEGMENT "weight");
        const struct model_tensor *layer = layer_key ? model_find(ad->weights, layer_key) : NULL;
        if (layer && layer->t->ndim == 2 && layer->t->shape[1] == *cols)
            *rows = layer->t->shape[0];
        const struct model_tensor *base = model_find(b->base, is_tied_head(b, wname) ? b->tied_embedding : wname);
        code = layer_key ? token_rows_build(list, t, wname, *rows, *cols, base->t->dtype, out)
                         : nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        free(layer_key);
    }
    free(wname);
    return code;
}

/* Whether the adapter's token rows for the tied head are its rows for the
 * embedding, row for row and value for value: the tie's, which PEFT saves
 * under both names when it saves the layers whole (a grown vocabulary).
 * *has_embedding: whether the adapter has rows of the embedding at all. */
static int head_rows_are_embeddings(const struct binder *b, const struct lora_adapter *ad,
                                    const struct lora_config *c, const struct token_rows *head, int *same,
                                    int *has_embedding)
{
    char *embed = weight_module(b->tied_runtime), *key = embed ? factor_key(ad, embed, TOKEN_DELTA_SUFFIX) : NULL;
    int code = key ? NF4_OK : nf4_fail(NF4_ESOFTWARE, ad->config_path, NULL, "out of memory");
    const struct model_tensor *t = key ? model_find(ad->weights, key) : NULL;
    struct token_rows *rows = NULL;
    uint64_t nrows, ncols;
    *same = 0;
    *has_embedding = t != NULL;
    if (t && (code = token_rows_of(b, ad, c, t, embed, &rows, &nrows, &ncols)) == NF4_OK)
        code = token_rows_same(head, rows, same);
    token_rows_free(rows);
    free(key);
    free(embed);
    return code;
}

/* Trained token rows (token_rows.h) of M.weight. On a tied base the
 * embedding's rows are the head's as well (PEFT ties the head's token layer
 * to the embedding's), and the tie stays; rows of the head's own part them. */
static int bind_token_rows(struct binder *b, const struct lora_adapter *ad, size_t index,
                           const struct lora_config *c, const struct model_tensor *t, const char *name)
{
    const char *file = t->file->path, *key = t->t->name;
    char *module = strndup(name, strlen(name) - strlen(TOKEN_DELTA_SUFFIX));
    char *wname = module ? weight_in_base(b, module) : NULL;
    struct token_rows *rows = NULL;
    uint64_t nrows = 0, ncols = 0;
    int code = wname ? token_rows_of(b, ad, c, t, module, &rows, &nrows, &ncols)
                     : nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    if (code != NF4_OK || rows->n == 0)
        goto out;
    if (is_tied_head(b, wname)) {
        int same, has_embedding;
        if ((code = head_rows_are_embeddings(b, ad, c, rows, &same, &has_embedding)) != NF4_OK || same)
            goto out;
        /* Beside this adapter's own rows of the embedding, trained apart
         * from them; any other adapter's rows of the tied embedding were the
         * head's too, and cannot be both (lora_open refuses). */
        note_untie(b, file, key, wname, has_embedding);
    } else if (is_tied_embedding(b, wname) && !b->tokens_tied_key) {
        b->tokens_tied_file = file;
        b->tokens_tied_key = key;
    }
    struct binding *x = add_binding(b, file, wname);
    if (!x) {
        code = nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
        goto out;
    }
    x->rows = nrows;
    x->cols = ncols;
    x->tokens = rows;
    x->term.adapter = index;
    rows = NULL;
out:
    token_rows_free(rows);
    free(module);
    free(wname);
    return code;
}

/* The kind of pair whose A factor an adapter key's name (after
 * PEFT_KEY_PREFIX) is, or NULL. */
static const struct pair_kind *pair_kind_of(const char *name)
{
    return str_ends_with(name, LORA_A_SUFFIX)        ? &LAYER_PAIR
           : str_ends_with(name, EMBEDDING_A_SUFFIX) ? &EMBEDDING_PAIR
                                                     : NULL;
}

/* A pair's B factor (or DoRA magnitude, or LoRA bias), key ending in
 * `suffix`, is bound with its A; alone it is refused. NF4_OK or NF4_EDATA. */
static int check_b_has_a(const struct model *m, const char *file, const char *key, const char *suffix,
                         const struct pair_kind *kind)
{
    size_t stem = strlen(key) - strlen(suffix), n = stem + strlen(kind->a_suffix) + 1;
    char *akey = malloc(n);
    if (!akey)
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    snprintf(akey, n, "%.*s%s", (int)stem, key, kind->a_suffix);
    int paired = model_find(m, akey) != NULL;
    free(akey);
    return paired ? NF4_OK : nf4_fail(NF4_EDATA, file, key, "has no matching %s", kind->a_suffix + 1);
}

/* PEFT raises "Target modules ... not found" for a config that selects none of
 * the model's modules: such an adapter cannot be loaded there, so it is refused
 * before any of its pairs is bound (or warned about). */
static int refuse_if_nothing_targeted(const struct binder *b, const struct lora_adapter *ad,
                                      const struct lora_config *c)
{
    const struct model *m = ad->weights;
    const size_t plen = strlen(ad->key_prefix);
    size_t pairs = 0, targeted = 0;
    for (size_t i = 0; i < m->count; i++) {
        const char *key = m->tensors[i].t->name;
        const int ours = strncmp(key, ad->key_prefix, plen) == 0;
        const struct pair_kind *kind = ours ? pair_kind_of(key + plen) : NULL;
        const int lokr = ours && c->lokr && lokr_is_first_factor(key + plen);
        if (!kind && !lokr)
            continue;
        char *module = lokr ? strndup(key + plen, strlen(key + plen) - lokr_suffix_len(key + plen))
                            : lora_a_module(key + plen, kind);
        char *wname = module ? weight_in_base(b, module) : NULL;
        if (!wname) {
            free(module);
            return nf4_fail(NF4_ESOFTWARE, m->tensors[i].file->path, key, "out of memory");
        }
        size_t ndim;
        const uint64_t *shape;
        if (base_shape(b, wname, &ndim, &shape)) { /* not in the base: bind_pair names another model */
            pairs++;
            targeted += lora_target_matches(&c->targets, module) != 0 ||
                        target_parameters_select(c->target_parameters, module, "weight") == 1;
        }
        free(module);
        free(wname);
    }
    if (pairs > 0 && targeted == 0)
        return nf4_fail(NF4_EDATA, ad->config_path, NULL, "targets none of the %zu modules its weights are for "
                        "(target_modules, exclude_modules, layers_to_transform); PEFT refuses such an adapter",
                        pairs);
    return NF4_OK;
}

/* Diffusers' Flux.1 loader's _control_lora_supported_norm_keys, which it
 * finds in a key's name. */
static const char *const CONTROL_NORM_KEYS[] = {"norm_q", "norm_k", "norm_added_q", "norm_added_k"};

static int is_control_norm(const char *name)
{
    for (size_t i = 0; i < sizeof CONTROL_NORM_KEYS / sizeof *CONTROL_NORM_KEYS; i++)
        if (strstr(name, CONTROL_NORM_KEYS[i]))
            return 1;
    return 0;
}

/* A control LoRA's norm weight, which diffusers' Flux.1 loader loads into
 * the model (_load_norm_into_transformer, after the LoRA): it replaces the
 * base's, of the same shape (else load_state_dict raises); one the model
 * does not have is ignored with a warning, as diffusers does. */
static int bind_control_norm(struct binder *b, size_t index, const struct model_tensor *t, const char *name)
{
    size_t ndim;
    const uint64_t *shape;
    if (!base_shape(b, name, &ndim, &shape) && !model_find(b->base, name)) { /* 4-bit ones: base_shape's */
        char shown[NF4_TENSOR_SHOWN_MAX];
        nf4_warn("%s: %s: a norm weight the model does not have; diffusers ignores it, and it is not merged",
                 t->file->path, nf4_tensor_shown(t->file->path, t->t->name, shown, sizeof shown));
        return NF4_OK;
    }
    int code = bind_replacement_of(b, index, t, name, TIE_PARTED);
    if (code == NF4_OK)
        b->items[b->n - 1].norm = 1;
    return code;
}

static int bind_adapter(struct binder *b, const struct lora_adapter *ad, size_t index, const struct lora_config *c)
{
    const struct model *m = ad->weights;
    const size_t plen = strlen(ad->key_prefix);
    int code = refuse_if_nothing_targeted(b, ad, c);
    if (code != NF4_OK)
        return code;
    b->parameter_pairs = 0;
    for (size_t i = 0; i < m->count; i++) {
        const struct model_tensor *t = &m->tensors[i];
        const char *key = t->t->name, *file = t->file->path;
        if (strncmp(key, ad->key_prefix, plen) != 0 && ad->diffusers)
            continue; /* another pipeline component's (diffusers_lora_prefix warned) */
        if (strncmp(key, ad->key_prefix, plen) != 0)
            return nf4_fail(NF4_EDATA, file, key, "is not a PEFT key (no \"%s\" prefix)", PEFT_KEY_PREFIX);
        const char *name = key + plen;
        const struct pair_kind *kind = pair_kind_of(name);
        if (str_ends_with(name, MAGNITUDE_SUFFIX)) {
            /* Bound with its pair (find_magnitude); alone, or without use_dora, refused. */
            code = c->use_dora ? check_b_has_a(m, file, key, MAGNITUDE_SUFFIX, &LAYER_PAIR)
                               : nf4_fail(NF4_EDATA, file, key, "is a DoRA magnitude, but %s does not set use_dora",
                                          config_name(ad));
        } else if (lokr_suffix_len(name)) {
            code = !c->lokr                      ? nf4_fail(NF4_EDATA, file, key, "is a LoKr factor, but %s is "
                                                            "a LoRA config", config_name(ad))
                   : lokr_is_first_factor(name) ? bind_lokr(b, ad, index, c, name, t)
                                                : check_lokr_has_first(ad, file, key);
        } else if (c->lokr && (kind || strstr(name, ".lora_") || strstr(name, LOKR_MARK))) {
            /* diffusers loads a file with any LoKr key as a LoKr, and PEFT leaves its other factors out */
            code = nf4_fail(NF4_EDATA, file, key, "is %s, in a LoKr adapter: nf4deq merges an adapter of one kind",
                            strstr(name, LOKR_MARK) ? "a LoKr tensor of no factor nf4deq knows" : "a LoRA tensor");
        } else if (kind) {
            char *module = lora_a_module(name, kind);
            if (!module)
                return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
            int experts = kind == &LAYER_PAIR && is_experts_pair(b, c, file, key, module, &code);
            if (code == NF4_OK)
                code = experts ? bind_experts_pair(b, ad, index, c, module, t)
                               : bind_pair(b, ad, index, c, module, t, kind);
            free(module);
        } else if (str_ends_with(name, LORA_B_SUFFIX)) {
            code = check_b_has_a(m, file, key, LORA_B_SUFFIX, &LAYER_PAIR);
        } else if (str_ends_with(name, EMBEDDING_B_SUFFIX)) {
            code = check_b_has_a(m, file, key, EMBEDDING_B_SUFFIX, &EMBEDDING_PAIR);
        } else if (str_ends_with(name, LORA_BIAS_SUFFIX)) {
            code = bind_lora_bias(b, ad, index, c, t, name);
        } else if (str_ends_with(name, TOKEN_DELTA_SUFFIX)) {
            code = bind_token_rows(b, ad, index, c, t, name);
        } else if (strstr(name, ".lora_") || strncmp(name, "lora_", 5) == 0) {
            code = nf4_fail(NF4_EDATA, file, key, "is a LoRA tensor nf4deq does not know how to merge");
        } else if (ad->flux1_loader && is_control_norm(name)) {
            code = bind_control_norm(b, index, t, name);
        } else {
            code = bind_replacement(b, ad, index, c, t, name);
        }
        if (code != NF4_OK)
            return code;
    }
    /* PEFT warns, and merges the rest, when target_parameters match nothing;
     * an adapter saved with no pair for any of them matched nothing when it
     * was trained. */
    if (c->target_parameters && b->parameter_pairs == 0)
        nf4_warn("%s: target_parameters select no parameter the adapter holds a LoRA for (PEFT matched none "
                 "either); its other pairs are merged", ad->config_path);
    return NF4_OK;
}

static int cmp_binding(const void *x, const void *y)
{
    const struct binding *a = x, *b = y;
    int c = strcmp(a->name, b->name);
    if (c)
        return c;
    return a->term.adapter < b->term.adapter ? -1 : a->term.adapter > b->term.adapter;
}

/* Trained token rows are an adapter's only change to their tensor (PEFT
 * wraps a layer for them or for LoRA, not both), but for the saved base layer
 * they go on: with any other, which one wins where would depend on the order
 * PEFT merges them in. */
static int check_token_rows_alone(const struct lora_set *s, const struct lora_target *t)
{
    if (!t->tokens)
        return NF4_OK;
    int base_layer = t->replace && t->replace_adapter == t->tokens_adapter && t->replace_frozen;
    if (!t->nterms && (!t->replace || base_layer))
        return NF4_OK;
    return nf4_fail(NF4_EDATA, s->adapters[t->tokens_adapter].config_path, t->name,
                    "has trained token rows (" TOKEN_INDICES_KEY ") and is changed otherwise too (a LoRA, a "
                    "modules_to_save copy, or another adapter): merge those changes in a separate run");
}

/* Gathers the bindings of each base tensor, in adapter order, into one target. */
static int gather(struct lora_set *s, struct binder *b)
{
    int code;
    qsort(b->items, b->n, sizeof *b->items, cmp_binding);
    s->targets = calloc(b->n ? b->n : 1, sizeof *s->targets);
    if (!s->targets)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
    for (size_t i = 0; i < b->n; i++) {
        struct binding *x = &b->items[i];
        struct lora_target *t = s->ntargets ? &s->targets[s->ntargets - 1] : NULL;
        if (!t || strcmp(t->name, x->name) != 0) {
            t = &s->targets[s->ntargets++];
            t->name = x->name;
            x->name = NULL;
        }
        if (!x->replace) { /* a replacement's binding has no shape of its own */
            t->rows = x->rows;
            t->cols = x->cols;
        }
        const char *file = s->adapters[x->term.adapter].config_path;
        if (x->tokens) {
            if (t->tokens)
                return nf4_fail(NF4_EDATA, file, t->name, "has rows replaced by the trained tokens of two adapters: "
                                "merge them in separate runs");
            t->tokens = x->tokens;
            t->tokens_adapter = x->term.adapter;
            x->tokens = NULL;
            if ((code = check_token_rows_alone(s, t)) != NF4_OK)
                return code;
            continue;
        }
        /* One adapter may replace a tensor and change it too (PEFT saves the
         * base layer of a LoRA'd lm_head): the change goes on the replacement.
         * Across adapters the order PEFT would apply them in is not this one. */
        if (x->replace && t->replace)
            return nf4_fail(NF4_EDATA, file, t->name, t->replace_adapter == x->term.adapter
                                                          ? "is held whole twice (modules_to_save, base_layer)"
                                                          : "is replaced by two adapters: merge them separately");
        int other_adapter = x->replace ? (t->nterms && t->terms[0].adapter != x->term.adapter)
                                       : (t->replace && t->replace_adapter != x->term.adapter);
        if (other_adapter)
            return nf4_fail(NF4_EDATA, file, t->name,
                            "is replaced by one adapter (a modules_to_save copy, a trained bias or a saved base "
                            "layer) and changed by another: merge these adapters separately");
        if (x->replace) {
            t->replace = x->replace;
            t->replace_frozen = x->frozen;
            t->replace_trained_bias = x->trained_bias;
            t->replace_widened = x->widened;
            t->replace_norm = x->norm;
            t->replace_adapter = x->term.adapter;
        } else {
            /* A guard: an adapter binds a tensor once (a LoKr on a fused projection beside one on its part is
             * refused before, in lora_open_component), so the terms stay within LORA_MAX_ADAPTERS. */
            for (size_t k = 0; k < t->nterms; k++)
                if (t->terms[k].adapter == x->term.adapter)
                    return nf4_fail(NF4_EDATA, file, t->name, "is changed twice by one adapter");
            t->terms[t->nterms++] = x->term;
        }
        if ((code = check_token_rows_alone(s, t)) != NF4_OK)
            return code;
        /* PEFT rescales each DoRA merge by a norm of the base weight plus that
         * adapter's delta alone: one adapter's change only. */
        if (t->nterms > 1 && (t->terms[0].magnitude || x->term.magnitude))
            return nf4_fail(NF4_EDATA, file, t->name, "is changed by a DoRA adapter and by another adapter: "
                            "merge them in separate runs");
        /* The planner cuts a fused experts tensor at its experts (lora_target_expert_rows): every term on
         * one is a LoRA on its experts, of the one shape. Only such a LoRA names M.P, so this is a guard. */
        if (t->nterms > 1 && t->terms[0].expert_rows != x->term.expert_rows)
            return nf4_fail(NF4_EDATA, file, t->name, "is changed as fused MoE experts by one adapter and otherwise "
                            "by another: merge them in separate runs");
    }
    return NF4_OK;
}

/* A resized vocabulary (base_shape_fits) must resize every layer the
 * vocabulary sizes: each embedding layer the base stores, and the head where
 * it is written apart from its tied embedding, replaced by one with the new
 * rows (transformers' resize_token_embeddings resizes both, and PEFT's
 * save_embedding_layers saves both). Else the output would not load. */
static int check_vocabulary(const struct lora_set *s, const struct binder *b, int head_apart)
{
    if (!b->vocab_rows)
        return NF4_OK;
    const char *missed = NULL;
    for (size_t i = 0; i < b->base->count && !missed; i++) {
        const char *name = b->base->tensors[i].t->name;
        if (is_embedding_layer_weight(name) && !bnb_is_state_part(name) &&
            !bnb_find(b->weights, b->nweights, name)) {
            const struct lora_target *t = lora_find(s, name);
            if (!t || !t->replace || t->replace->t->shape[0] != b->vocab_rows)
                missed = name;
        }
    }
    if (!missed && head_apart) {
        const struct lora_target *t = lora_find(s, TIED_HEAD_NAME);
        if (!t || !t->replace || t->replace->t->shape[0] != b->vocab_rows)
            missed = TIED_HEAD_NAME;
    }
    if (missed)
        return nf4_fail(NF4_EDATA, b->vocab_file, b->vocab_key, "resizes the vocabulary from %llu to %llu rows, but the "
                        "adapters hold no %s with the new rows (PEFT leaves out a layer it neither trains nor wraps "
                        "when another is targeted), so the merged model would not load",
                        (unsigned long long)b->base_vocab_rows, (unsigned long long)b->vocab_rows, missed);
    if (!b->base->dir)
        return nf4_fail(NF4_EDATA, b->vocab_file, b->vocab_key, "resizes the vocabulary from %llu to %llu rows: "
                        "config.json must then say vocab_size: %llu; convert the model's directory, not its weights "
                        "file, so that nf4deq writes it", (unsigned long long)b->base_vocab_rows,
                        (unsigned long long)b->vocab_rows, (unsigned long long)b->vocab_rows);
    return NF4_OK;
}

/* adapter_model.safetensors, or where there is none, the adapter_model.bin
 * that PEFT before 0.7 (December 2023; save_pretrained(safe_serialization=False) since)
 * wrote with torch.save: read without unpickling (torch_file.h). */
static int open_adapter_weights(const char *dir, const char *path, struct model **out)
{
    struct stat st;
    if (stat(path, &st) != 0 && errno == ENOENT) {
        char *pickle = path_join(dir, ADAPTER_PICKLE_NAME);
        if (!pickle)
            return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        /* lstat: a link to a blob not downloaded is this file, missing. */
        int found = lstat(pickle, &st) == 0;
        int code = found ? model_open_torch_file(pickle, out) : NF4_OK;
        free(pickle);
        if (found)
            return code;
    }
    return model_open_file(path, out);
}

int lora_open(struct lora_set **out, const char *const *dirs, size_t ndirs, const struct model *base,
              const struct bnb_weight *weights, size_t nweights)
{
    return lora_open_component(out, dirs, ndirs, base, weights, nweights, NULL, NULL);
}

/* Reads diffusers LoRA ad's config as the loader of `base`'s class reads
 * it: with Flux.1's rules (its pipelines' and transformer's, an unknown
 * class's, a weights file's alone: diffusers_lora_open_for_dir) its network
 * alphas (lora_alphas.h). And whether Flux.1's loader loads it into `base`
 * (lora_adapter.flux1_loader): its transformer keys, into a Flux.1
 * pipeline's transformer or a Flux.1 transformer's folder, or into a
 * weights file alone, there to say why it cannot widen. */
static int read_diffusers_config(struct lora_adapter *ad, const struct model *base, struct lora_config *c)
{
    enum lora_family family = LORA_FAMILY_OTHER;
    int code = base->dir ? diffusers_lora_family_of_dir(ad->config_path, base->dir, &family) : NF4_OK;
    const int flux1_rules = diffusers_flux1_rules(family);
    if (code == NF4_OK)
        code = diffusers_lora_config(ad->weights, ad->key_prefix, flux1_rules, c);
    ad->flux1_loader = (family == LORA_FAMILY_FLUX || !base->dir) && strcmp(ad->key_prefix, "transformer.") == 0;
    /* popped by Flux.1's loader, every one, and read into c; no other loader leaves any */
    if (code == NF4_OK && flux1_rules && !c->lokr)
        model_drop_tensors(ad->weights, network_alpha_key);
    return code;
}

int lora_open_component(struct lora_set **out, const char *const *dirs, size_t ndirs, const struct model *base,
                        const struct bnb_weight *weights, size_t nweights, const char *const *key_components,
                        struct model *const *converted)
{
    *out = NULL;
    if (ndirs > LORA_MAX_ADAPTERS)
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "at most %d --lora adapters", LORA_MAX_ADAPTERS);
    struct lora_set *s = calloc(1, sizeof *s);
    if (!s)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
    struct binder b = {.set = s, .base = base, .weights = weights, .nweights = nweights, .fuses_qkv = -1};
    int code = model_tied_embedding(base, &b.tied_embedding);
    if (code == NF4_OK) /* name_in_base asks whether it is multimodal */
        code = read_model_type(&b);
    b.tied_runtime = b.tied_embedding;
    if (code == NF4_OK && b.tied_embedding) {
        char *in_base = name_in_base(&b, MULTIMODAL_EMBEDDING);
        if (!in_base)
            code = nf4_fail(NF4_ESOFTWARE, base->dir ? base->dir : base->file_names[0], NULL, "out of memory");
        else if (strcmp(in_base, b.tied_embedding) == 0)
            b.tied_runtime = MULTIMODAL_EMBEDDING;
        free(in_base);
    }
    for (size_t i = 0; i < ndirs && code == NF4_OK; i++) {
        struct lora_adapter *ad = &s->adapters[s->nadapters++];
        const char *component = key_components ? key_components[i] : NULL;
        struct lora_config c = {0};
        char *wpath = NULL;
        ad->dir = strdup(dirs[i]);
        if (!ad->dir)
            code = nf4_fail(NF4_ESOFTWARE, dirs[i], NULL, "out of memory");
        if (code == NF4_OK)
            code = diffusers_lora_path(dirs[i], &ad->config_path, !component);
        if (code == NF4_OK && ad->config_path) {
            ad->diffusers = 1;
            /* a pipeline's component takes the LoRA as the pipeline's loader read it */
            if ((code = converted && converted[i] ? model_reopen(converted[i], &ad->weights)
                        : component           ? diffusers_lora_open_own_form(ad->config_path, &ad->weights)
                                              : diffusers_lora_open_for_dir(ad->config_path, base->dir, 1,
                                                                            &ad->weights)) == NF4_OK &&
                (code = diffusers_lora_prefix(ad->weights, base, component, &ad->key_prefix)) == NF4_OK &&
                /* in diffusers' own form, maybe its older one; converted, PEFT's already */
                (ad->weights->unnamed || (code = diffusers_lora_old_names(ad->weights, ad->key_prefix)) == NF4_OK) &&
                (code = diffusers_lora_align_text_model(ad->weights, ad->key_prefix, base)) == NF4_OK)
                code = read_diffusers_config(ad, base, &c);
        } else if (code == NF4_OK && component) {
            code = nf4_fail(NF4_ESOFTWARE, dirs[i], NULL, "a PEFT adapter for a pipeline component (internal error)");
        } else if (code == NF4_OK) {
            ad->config_path = path_join(dirs[i], ADAPTER_CONFIG_NAME);
            ad->key_prefix = strdup(PEFT_KEY_PREFIX);
            wpath = path_join(dirs[i], ADAPTER_WEIGHTS_NAME);
            if (!ad->config_path || !ad->key_prefix || !wpath)
                code = nf4_fail(NF4_ESOFTWARE, dirs[i], NULL, "out of memory");
            if (code == NF4_OK && (code = parse_config(ad->config_path, &c)) == NF4_OK)
                code = open_adapter_weights(dirs[i], wpath, &ad->weights);
        }
        if (code == NF4_OK)
            code = bind_adapter(&b, ad, i, &c);
        lora_config_free(&c);
        free(wpath);
    }
    /* To load a LoKr on a fused projection diffusers fuses every block's
     * projections first (refusing where an adapter is on them already), and
     * the fused model computes without any adapter on the projections it
     * fused: what it merges there is not what it ran. */
    if (code == NF4_OK && b.fused_key && b.part_key)
        code = nf4_fail(NF4_EDATA, b.fused_file, b.fused_key,
                        "is a LoKr on a fused projection, for which diffusers fuses every attention's projections, "
                        "and %s: %s changes one of those, which the fused model does not compute with (or "
                        "diffusers refuses to fuse): merge them in separate runs", b.part_file, b.part_key);
    /* The tensor of the two that the untying key does not change. */
    const char *other = b.untie_name == b.tied_embedding ? TIED_HEAD_NAME : b.tied_embedding;
    /* The head would be both the kept copy and something else: which one
     * PEFT ends with depends on how the adapters are loaded and merged. */
    if (code == NF4_OK && b.untie_key && b.tie_kept_key)
        code = nf4_fail(NF4_EDATA, b.untie_file, b.untie_key,
                        "changes %s apart from %s, but %s: %s is a copy of the embedding kept tied to the head "
                        "(ensure_weight_tying): merge these changes separately", b.untie_name, other,
                        b.tie_kept_file, b.tie_kept_key);
    /* PEFT ties the head's token rows to the embedding's; parted by another
     * change, which values the head trained with is PEFT's internal order. */
    if (code == NF4_OK && b.tokens_tied_key && b.other_untie_key)
        code = nf4_fail(NF4_EDATA, b.other_untie_file, b.other_untie_key,
                        "changes %s apart from %s, but %s: %s replaces rows of the embedding, which the head shares "
                        "(trainable tokens of a tied embedding): merge these changes separately", b.untie_name, other,
                        b.tokens_tied_file, b.tokens_tied_key);
    if (code == NF4_OK && b.untie_key && !base->dir && !model_tie_flag_ties_more(b.tied_embedding))
        code = nf4_fail(NF4_EDATA, b.untie_file, b.untie_key,
                        "changes %s, which the base ties to %s (tie_word_embeddings): merged, the head is written "
                        "apart from the embedding, and config.json must say tie_word_embeddings: false; convert "
                        "the model's directory, not its weights file, so that nf4deq writes both",
                        b.untie_name, other);
    if (code == NF4_OK)
        code = gather(s, &b);
    if (code == NF4_OK)
        code = check_vocabulary(s, &b, b.untie_key != NULL);
    if (code == NF4_OK && b.untie_key)
        s->untied_embedding = b.tied_embedding;
    s->vocab_rows = b.vocab_rows;
    s->base_vocab_rows = b.base_vocab_rows;
    for (size_t i = 0; i < b.n; i++) {
        free(b.items[i].name);
        token_rows_free(b.items[i].tokens);
    }
    free(b.items);
    free(b.model_type);
    free(b.text_model_type);
    if (code != NF4_OK) {
        lora_close(s);
        return code;
    }
    *out = s;
    return NF4_OK;
}

void lora_close(struct lora_set *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->nadapters; i++) {
        free(s->adapters[i].dir);
        free(s->adapters[i].config_path);
        free(s->adapters[i].key_prefix);
        if (s->adapters[i].weights)
            model_close(s->adapters[i].weights);
    }
    for (size_t i = 0; i < s->ntargets; i++) {
        free(s->targets[i].name);
        token_rows_free(s->targets[i].tokens);
    }
    free(s->targets);
    for (size_t i = 0; i < s->nmade; i++)
        model_close(s->made[i]);
    free(s->made);
    free(s);
}

static int cmp_target_name(const void *key, const void *elem)
{
    return strcmp(key, ((const struct lora_target *)elem)->name);
}

const struct lora_target *lora_find(const struct lora_set *s, const char *name)
{
    if (!s || !s->ntargets)
        return NULL;
    return bsearch(name, s->targets, s->ntargets, sizeof *s->targets, cmp_target_name);
}

int lora_target_is_dora(const struct lora_target *t)
{
    return t && t->nterms == 1 && t->terms[0].magnitude != NULL;
}

uint64_t lora_target_expert_rows(const struct lora_target *t)
{
    /* Every term on a fused tensor is one, with its shape (gather). */
    return t && t->nterms ? t->terms[0].expert_rows : 0;
}
