#include "lora_kohya.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "fpconv.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define KOHYA_DOWN ".lora_down.weight"
#define KOHYA_UP ".lora_up.weight"
#define KOHYA_ALPHA ".alpha"
#define KOHYA_UNET "lora_unet_"
/* Flux.1's blocks, as far as diffusers' conversion looks for them. */
#define FLUX_DOUBLE_BLOCKS 19
#define FLUX_SINGLE_BLOCKS 38
/* The longest module name read; the names built from one fit their buffers. */
#define KOHYA_NAME_MAX 512

/* A kohya module of a block and the diffusers modules it becomes: one, or
 * the parts of a fused layer, rows in equal parts unless `rows` says. */
struct module_map {
    const char *kohya;
    size_t nparts;
    const char *parts[KOHYA_MAX_PARTS];
    uint64_t rows[KOHYA_MAX_PARTS];
};

static const struct module_map DOUBLE_BLOCK[] = {
    {"img_attn_proj", 1, {"attn.to_out.0"}, {0}},
    {"img_attn_qkv", 3, {"attn.to_q", "attn.to_k", "attn.to_v"}, {0}},
    {"img_mlp_0", 1, {"ff.net.0.proj"}, {0}},
    {"img_mlp_2", 1, {"ff.net.2"}, {0}},
    {"img_mod_lin", 1, {"norm1.linear"}, {0}},
    {"txt_attn_proj", 1, {"attn.to_add_out"}, {0}},
    {"txt_attn_qkv", 3, {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}, {0}},
    {"txt_mlp_0", 1, {"ff_context.net.0.proj"}, {0}},
    {"txt_mlp_2", 1, {"ff_context.net.2"}, {0}},
    {"txt_mod_lin", 1, {"norm1_context.linear"}, {0}},
};

static const struct module_map SINGLE_BLOCK[] = {
    {"linear1", 4, {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}, {3072, 3072, 3072, 12288}},
    {"linear2", 1, {"proj_out"}, {0}},
    {"modulation_lin", 1, {"norm.linear"}, {0}},
};

/* Modules diffusers converts to keys without "transformer.", which
 * load_lora_weights then loads into nothing. */
static const char *const UNLOADED[] = {
    "lora_unet_guidance_in_in_layer", "lora_unet_guidance_in_out_layer", "lora_unet_img_in", "lora_unet_txt_in",
    "lora_unet_time_in_in_layer", "lora_unet_time_in_out_layer", "lora_unet_vector_in_in_layer",
    "lora_unet_vector_in_out_layer", "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_final_layer_linear",
};

/* A key of the LoRA under the name diffusers converts: ComfyUI's renamed. */
struct kohya_key {
    char *name;
    const struct model_tensor *t;
};

struct conversion {
    const char *path;
    struct kohya_key *keys;
    size_t nkeys;
    struct lora_rewrite rw; /* the converted LoRA */
};

/* ---- names ---- */

/* diffusers' _custom_replace: the dots before the first "lora_down",
 * "lora_up" (or "alpha") become underscores, and all of them where there is
 * none. Turns ComfyUI's module paths into kohya's names. */
static void dots_to_underscores(char *key, int with_alpha)
{
    const char *subs[3] = {"lora_down", "lora_up", "alpha"};
    char *first = NULL;
    for (size_t i = 0; i < (with_alpha ? 3u : 2u); i++) {
        char *hit = strstr(key, subs[i]);
        if (hit && (!first || hit < first))
            first = hit;
    }
    char *end = first ? (first > key && first[-1] == '.' ? first - 1 : first) : key + strlen(key);
    for (char *p = key; p < end; p++)
        if (*p == '.')
            *p = '_';
}

/* The CLIP text encoder's module of kohya's lora_te1_<name>, as diffusers'
 * _convert_text_encoder_lora_key and its later conversion to PEFT's keys
 * name it: text_model_encoder_layers_0_self_attn_q_proj ->
 * text_model.encoder.layers.0.self_attn.q_proj. */
static char *text_encoder_module(const char *name)
{
    static const char *const FIXES[][2] = {
        {"text.model", "text_model"}, {"self.attn", "self_attn"}, {"q.proj", "q_proj"},
        {"k.proj", "k_proj"},         {"v.proj", "v_proj"},       {"out.proj", "out_proj"},
        {"text.projection", "text_projection"},
    };
    char *m = strdup(name);
    for (char *p = m; p && *p; p++)
        if (*p == '_')
            *p = '.';
    char *fixed = m ? str_replace_in_turn(m, FIXES, sizeof FIXES / sizeof FIXES[0]) : NULL;
    free(m);
    return fixed;
}

static int key_cmp(const void *a, const void *b)
{
    return strcmp(((const struct kohya_key *)a)->name, ((const struct kohya_key *)b)->name);
}

static const struct kohya_key *find_key(const struct conversion *cv, const char *module, const char *suffix)
{
    char name[1024];
    if ((size_t)snprintf(name, sizeof name, "%s%s", module, suffix) >= sizeof name)
        return NULL;
    struct kohya_key probe = {name, NULL};
    return bsearch(&probe, cv->keys, cv->nkeys, sizeof *cv->keys, key_cmp);
}

enum factor { FACTOR_NONE, FACTOR_DOWN, FACTOR_UP, FACTOR_ALPHA };

/* Which factor `key` is, by its suffix, and the length of its module (the
 * key less that suffix). */
static enum factor factor_of(const char *key, size_t *module_len)
{
    static const char *const SUFFIXES[] = {NULL, KOHYA_DOWN, KOHYA_UP, KOHYA_ALPHA};
    enum factor f = FACTOR_NONE;
    for (int k = FACTOR_DOWN; k <= FACTOR_ALPHA && f == FACTOR_NONE; k++)
        if (str_ends_with(key, SUFFIXES[k]))
            f = (enum factor)k;
    *module_len = strlen(key) - (f != FACTOR_NONE ? strlen(SUFFIXES[f]) : 0);
    return f;
}

/* Notes `n` tensors left out, naming the module of `key` in the warning
 * (the first few). */
static void note_left_out(struct conversion *cv, const char *key, size_t n)
{
    size_t len;
    factor_of(key, &len);
    lora_rewrite_leave_out(&cv->rw, key, len, n);
}

static int has_kohya_prefix(const char *key)
{
    return strncmp(key, KOHYA_UNET, strlen(KOHYA_UNET)) == 0 || strncmp(key, "lora_te_", 8) == 0 ||
           strncmp(key, "lora_te1_", 9) == 0;
}

/* The keys under the names diffusers converts, sorted, and what its loading
 * leaves out before converting noted, in its order: DoRA scales; from
 * ComfyUI's names, the position embedding, T5-XXL, diff_b where some kohya
 * module has it, .norm and .diff where some key has both; then every key
 * under none of lora_unet_, lora_te_ and lora_te1_ (kohya's T5, lora_te2_). */
static int rename_keys(struct conversion *cv, const struct model *w)
{
    const size_t n = w->count;
    char **renamed = calloc(n ? n : 1, sizeof *renamed);
    cv->keys = calloc(n ? n : 1, sizeof *cv->keys);
    if (!renamed || !cv->keys) {
        free(renamed);
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    int code = NF4_OK, diff_b = 0, norm_diff = 0, with_alpha = 0;
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, "transformer.", 12) == 0)
            code = nf4_fail(NF4_EDATA, cv->path, key, "is a diffusers key in a kohya LoRA (lora_down/lora_up keys); "
                            "nf4deq does not read such a mix");
        else if (strncmp(key, "lora_transformer_", 17) == 0)
            code = nf4_fail(NF4_EDATA, cv->path, key, "is of the kohya \"mixture\" layout (lora_transformer_...), "
                            "which nf4deq does not read");
        if (code != NF4_OK || lora_is_dora_scale(key))
            continue;
        char *a = str_replace_all(key, "diffusion_model.", KOHYA_UNET);
        renamed[i] = a ? str_replace_all(a, "text_encoders.clip_l.transformer.", "lora_te_") : NULL;
        free(a);
        if (!renamed[i])
            code = nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
        else if (strstr(renamed[i], "position_embedding") ||
                 strncmp(renamed[i], "text_encoders.t5xxl.transformer.", 32) == 0) {
            free(renamed[i]);
            renamed[i] = NULL;
        } else {
            diff_b |= has_kohya_prefix(renamed[i]) && strstr(renamed[i], "diff_b");
        }
    }
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        if (renamed[i] && diff_b && strstr(renamed[i], ".diff_b")) {
            free(renamed[i]);
            renamed[i] = NULL;
        } else if (renamed[i]) {
            norm_diff |= strstr(renamed[i], ".norm") && strstr(renamed[i], ".diff");
        }
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        if (renamed[i] && norm_diff && (strstr(renamed[i], ".norm") || strstr(renamed[i], ".diff"))) {
            free(renamed[i]);
            renamed[i] = NULL;
        } else if (renamed[i]) {
            with_alpha |= strstr(renamed[i], "alpha") != NULL;
        }
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        if (!renamed[i] || !has_kohya_prefix(renamed[i])) {
            note_left_out(cv, w->tensors[i].t->name, 1);
            free(renamed[i]);
            renamed[i] = NULL;
            continue;
        }
        dots_to_underscores(renamed[i], with_alpha);
        if (strstr(renamed[i], "text_projection")) { /* diffusers drops it before converting */
            note_left_out(cv, w->tensors[i].t->name, 1);
            free(renamed[i]);
            renamed[i] = NULL;
            continue;
        }
        if (strlen(renamed[i]) >= KOHYA_NAME_MAX) {
            code = nf4_fail(NF4_EDATA, cv->path, w->tensors[i].t->name, "is too long a name for a LoRA key");
            free(renamed[i]);
            renamed[i] = NULL;
            continue;
        }
        cv->keys[cv->nkeys++] = (struct kohya_key){renamed[i], &w->tensors[i]};
        renamed[i] = NULL; /* now cv's */
    }
    if (code != NF4_OK)
        for (size_t i = 0; i < n; i++)
            free(renamed[i]);
    free(renamed);
    if (code != NF4_OK)
        return code;
    qsort(cv->keys, cv->nkeys, sizeof *cv->keys, key_cmp);
    for (size_t i = 1; i < cv->nkeys; i++)
        if (strcmp(cv->keys[i - 1].name, cv->keys[i].name) == 0)
            return nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "names the same factor as %s",
                            cv->keys[i - 1].t->t->name);
    return NF4_OK;
}

/* ---- scales ---- */

/* PyTorch's result dtype of two floating dtypes: the wider; F32 for BF16
 * with F16. */
static enum st_dtype promote(enum st_dtype a, enum st_dtype b)
{
    if (a == b)
        return a;
    if (a == DT_F64 || b == DT_F64)
        return DT_F64;
    return DT_F32;
}

/* The factors' scales of a module, and the dtype its down factor is written
 * in (*a_dtype). `fused`, a layer diffusers splits (_convert_to_ai_toolkit_cat),
 * computes alpha / r as a tensor of alpha's dtype (F32 for an integer alpha),
 * and down times it in the dtype PyTorch promotes the two to: the factor's
 * own for a 0-dim alpha, the wider of the two for one of shape [1]. One to one
 * (_convert_to_ai_toolkit, the text encoder's) takes alpha.item(): Python
 * floats. Without alpha: alpha = r in the factor's dtype. */
static int module_scales(const char *path, const struct kohya_factors *f, int fused, float *sd, float *su,
                         enum st_dtype *a_dtype)
{
    const struct model_tensor *down = f->down;
    uint64_t r = down->t->shape[0];
    double alpha;
    enum st_dtype adt = down->t->dtype;
    *a_dtype = down->t->dtype;
    if (f->alpha) {
        const struct st_tensor *at = f->alpha->t;
        int code = lora_read_alpha(path, f->alpha, &alpha);
        if (code != NF4_OK)
            return code;
        adt = lora_is_factor_dtype(at->dtype) || at->dtype == DT_F64 ? at->dtype : DT_F32;
        if (fused && at->ndim > 0)
            *a_dtype = promote(*a_dtype, adt);
        if (*a_dtype == DT_F64)
            return nf4_fail(NF4_EDATA, path, at->name, "is an F64 alpha of shape [1], with which diffusers "
                            "makes %s's parts F64; LoRA weights must be F32, BF16 or F16", down->t->name);
    } else {
        alpha = lora_round_to(adt, (double)r);
    }
    double scale = alpha / (double)r;
    if (fused && adt == DT_F32)
        scale = (float)alpha / (float)r;
    else if (fused)
        scale = lora_round_to(adt, adt == DT_F64 ? scale : (double)((float)alpha / (float)r));
    lora_split_scale(scale, fused ? adt : DT_F64, sd, su);
    return NF4_OK;
}

/* ---- the converted LoRA ---- */

/* Whether `up` (times `su`) is block-diagonal for these parts: part j's rows
 * hold zeros outside its own `rank` columns. diffusers then gives each part
 * its own ranks. */
static int block_diagonal(const char *path, const struct model_tensor *up, float su, const uint64_t *rows, size_t n,
                          uint64_t rank, int *sparse)
{
    const struct st_tensor *t = up->t;
    struct lora_part whole = {.src = up, .dtype = t->dtype, .shape = {t->shape[0], t->shape[1]}, .scale = su};
    const uint64_t esize = dtype_bits(t->dtype) / 8;
    unsigned char *v = malloc(t->nelem * esize + 1);
    if (!v)
        return nf4_fail(NF4_ESOFTWARE, path, t->name, "out of memory");
    int code = lora_part_values(&whole, v);
    *sparse = 1;
    for (uint64_t j = 0, row = 0; code == NF4_OK && j < n && *sparse; row += rows[j++])
        for (uint64_t i = row; i < row + rows[j] && *sparse; i++)
            for (uint64_t c = 0; c < t->shape[1] && *sparse; c++)
                if (c / rank != j && f32_from_element(t->dtype, v, i * t->shape[1] + c) != 0.0f)
                    *sparse = 0;
    free(v);
    return code;
}

int kohya_fold_module(struct lora_rewrite *rw, const struct kohya_factors *f, const char *target_root,
                      const char *const *parts, const uint64_t *rows_given, size_t nparts)
{
    const struct st_tensor *dt = f->down->t, *ut = f->up->t;
    int code = lora_check_pair(rw->path, dt, ut);
    if (code != NF4_OK)
        return code;
    const uint64_t r = dt->shape[0], in = dt->shape[1], out = ut->shape[0];
    const size_t n = parts ? nparts : 1;
    float sd = 1.0f, su = 1.0f;
    enum st_dtype a_dtype = dt->dtype;
    if ((parts || f->alpha) && (code = module_scales(rw->path, f, n > 1, &sd, &su, &a_dtype)) != NF4_OK)
        return code;
    char target[KOHYA_NAME_MAX + 64]; /* target_root and the longest part's name */
    for (size_t j = 0; j < n; j++)
        if ((size_t)snprintf(target, sizeof target, "%s%s", target_root, parts ? parts[j] : "") >= sizeof target)
            return nf4_fail(NF4_EDATA, rw->path, dt->name, "is of too long a module name for a LoRA key");
    if (n == 1) {
        snprintf(target, sizeof target, "%s%s", target_root, parts ? parts[0] : "");
        if ((code = lora_rewrite_add(rw, target, ".lora_A.weight", f->down, a_dtype, r, in, 0, 0, sd)) == NF4_OK)
            code = lora_rewrite_add(rw, target, ".lora_B.weight", f->up, ut->dtype, out, r, 0, 0, su);
        return code;
    }
    uint64_t rows[KOHYA_MAX_PARTS], sum = 0;
    for (size_t j = 0; j < n; j++)
        sum += rows[j] = rows_given ? rows_given[j] : out / n;
    if (sum != out)
        return nf4_fail(NF4_EDATA, rw->path, ut->name, "has %" PRIu64 " rows; diffusers splits it into %s", out,
                        rows_given ? "Flux.1's 3072 + 3072 + 3072 + 12288"
                                   : "three equal parts (or drops the rows past them from a block-diagonal one, "
                                     "which nf4deq does not)");
    int sparse = 0;
    if (r % n == 0 && (code = block_diagonal(rw->path, f->up, su, rows, n, r / n, &sparse)) != NF4_OK)
        return code;
    const uint64_t pr = sparse ? r / n : r;
    for (size_t j = 0, row = 0; j < n && code == NF4_OK; row += rows[j++]) {
        snprintf(target, sizeof target, "%s%s", target_root, parts[j]);
        if ((code = lora_rewrite_add(rw, target, ".lora_A.weight", f->down, a_dtype, pr, in, sparse ? j * pr : 0, 0,
                                     sd)) == NF4_OK)
            code = lora_rewrite_add(rw, target, ".lora_B.weight", f->up, ut->dtype, rows[j], pr, row,
                                    sparse ? j * pr : 0, su);
    }
    return code;
}

/* Converts one kohya module of the transformer (`map`, under `target_root`:
 * "transformer.transformer_blocks.0.") or of the text encoder (map NULL,
 * `target_root` the whole module with its component). */
static int convert_module(struct conversion *cv, const char *module, const struct module_map *map,
                          const char *target_root)
{
    const struct kohya_key *dk = find_key(cv, module, KOHYA_DOWN), *uk = find_key(cv, module, KOHYA_UP),
                           *ak = find_key(cv, module, KOHYA_ALPHA);
    if (!uk)
        return nf4_fail(NF4_EDATA, cv->path, dk->t->t->name, "has no matching lora_up.weight");
    const struct kohya_factors f = {dk->t, uk->t, ak ? ak->t : NULL};
    return kohya_fold_module(&cv->rw, &f, target_root, map ? map->parts : NULL, map && map->rows[0] ? map->rows : NULL,
                             map ? map->nparts : 1);
}

/* `name` as "<prefix><digits>_<rest>" with the number below `limit` written
 * as diffusers writes it: the block and *rest, else -1. */
static long block_of(const char *name, const char *prefix, long limit, const char **rest)
{
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0)
        return -1;
    const char *p = name + n;
    long i = 0;
    if (!(*p >= '0' && *p <= '9') || (p[0] == '0' && p[1] >= '0' && p[1] <= '9'))
        return -1;
    for (; *p >= '0' && *p <= '9' && i < limit; p++)
        i = i * 10 + (*p - '0');
    if (i >= limit || *p != '_')
        return -1;
    *rest = p + 1;
    return i;
}

static const struct module_map *find_map(const struct module_map *maps, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(maps[i].kohya, name) == 0)
            return &maps[i];
    return NULL;
}

/* A module of the CLIP text encoder, as diffusers' loading treats it: the
 * self-attention projections (which it names to_q_lora... and loads only if
 * one of them is out_proj), the mlp (lora_linear_layer: always), or another
 * (loaded nowhere). */
enum te_kind { TE_ATTN, TE_MLP, TE_OTHER };

static enum te_kind te_kind_of(const char *module)
{
    static const char *const ATTN[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"};
    for (size_t i = 0; i < sizeof ATTN / sizeof ATTN[0]; i++)
        if (str_ends_with(module, ATTN[i]))
            return TE_ATTN;
    return strstr(module, "self_attn") ? TE_OTHER : strstr(module, "mlp") ? TE_MLP : TE_OTHER;
}

/* The text encoder's module of a kohya key's module ("lora_te1_..."), or NULL
 * for a key of the transformer; *oom on failure. */
static char *te_module(const char *module, int *oom)
{
    const char *te = strncmp(module, "lora_te_", 8) == 0    ? module + 8
                     : strncmp(module, "lora_te1_", 9) == 0 ? module + 9
                                                            : NULL;
    char *m = te ? text_encoder_module(te) : NULL;
    *oom = te && !m;
    return m;
}

/* One module of the transformer, by its kohya name (the key of its down
 * factor, less KOHYA_DOWN). */
static int convert_transformer_module(struct conversion *cv, const char *module, const char *key)
{
    char root[64];
    const char *rest;
    long i;
    const struct module_map *map = NULL;
    if ((i = block_of(module, "lora_unet_double_blocks_", FLUX_DOUBLE_BLOCKS, &rest)) >= 0 &&
        (map = find_map(DOUBLE_BLOCK, sizeof DOUBLE_BLOCK / sizeof DOUBLE_BLOCK[0], rest))) {
        snprintf(root, sizeof root, "transformer.transformer_blocks.%ld.", i);
        return convert_module(cv, module, map, root);
    }
    if ((i = block_of(module, "lora_unet_single_blocks_", FLUX_SINGLE_BLOCKS, &rest)) >= 0 &&
        (map = find_map(SINGLE_BLOCK, sizeof SINGLE_BLOCK / sizeof SINGLE_BLOCK[0], rest))) {
        snprintf(root, sizeof root, "transformer.single_transformer_blocks.%ld.", i);
        return convert_module(cv, module, map, root);
    }
    for (size_t k = 0; k < sizeof UNLOADED / sizeof UNLOADED[0]; k++)
        if (strcmp(module, UNLOADED[k]) == 0) {
            if (!find_key(cv, module, KOHYA_UP))
                return nf4_fail(NF4_EDATA, cv->path, key, "has no matching lora_up.weight");
            note_left_out(cv, key, 2 + (find_key(cv, module, KOHYA_ALPHA) != NULL));
            return NF4_OK;
        }
    return nf4_fail(NF4_EDATA, cv->path, key, "is not of a Flux.1 module diffusers converts from kohya's names "
                    "(lora_unet_double_blocks_0..18, single_blocks_0..37, lora_te1_...): a LoRA for another model?");
}

/* The key's module (less its suffix) into `module` (KOHYA_NAME_MAX bytes,
 * which rename_keys bounds the keys by), and which factor it is. */
static enum factor split_key(const char *key, char *module)
{
    size_t len;
    enum factor f = factor_of(key, &len);
    memcpy(module, key, len);
    module[len] = '\0';
    return f;
}

/* The transformer's keys: every down converted, an up or alpha without its
 * down refused (diffusers: "Incompatible keys"), final_layer's left out. */
static int convert_transformer(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const char *key = cv->keys[i].name, *original = cv->keys[i].t->t->name;
        char module[KOHYA_NAME_MAX];
        if (strncmp(key, KOHYA_UNET, strlen(KOHYA_UNET)) != 0)
            continue;
        const enum factor suffix = split_key(key, module);
        /* assign_remaining_weights takes final_layer's factors one by one, and every final_layer alpha */
        if ((suffix != FACTOR_NONE && suffix != FACTOR_ALPHA && (strcmp(module, "lora_unet_final_layer_adaLN_modulation_1") == 0 ||
                                                 strcmp(module, "lora_unet_final_layer_linear") == 0)) ||
            (suffix == FACTOR_ALPHA && strstr(key, "final_layer"))) {
            if (!find_key(cv, module, KOHYA_DOWN))
                note_left_out(cv, original, 1);
            else if (suffix == FACTOR_DOWN)
                note_left_out(cv, original, 1 + (find_key(cv, module, KOHYA_UP) != NULL) +
                                                (find_key(cv, module, KOHYA_ALPHA) != NULL));
            continue;
        }
        if (suffix == FACTOR_NONE)
            return nf4_fail(NF4_EDATA, cv->path, original, "is not a kohya LoRA factor (lora_down.weight, "
                            "lora_up.weight or alpha)");
        if (suffix != FACTOR_DOWN) {
            if (!find_key(cv, module, KOHYA_DOWN))
                return nf4_fail(NF4_EDATA, cv->path, original, "has no matching lora_down.weight");
            continue;
        }
        code = convert_transformer_module(cv, module, original);
    }
    return code;
}

/* The text encoder's keys (lora_te_, lora_te1_), as diffusers loads them: the
 * self-attention projections where one of them is out_proj, the mlp always,
 * nothing else; none of the LoRA where neither is there (it cannot tell their
 * form). Keys of neither kind, and an up or alpha without its down, are left
 * out ("Unsupported keys"); a down without its up is refused. */
static int convert_text_encoder(struct conversion *cv)
{
    int has_out = 0, has_mlp = 0, oom = 0;
    const char *first = NULL;
    for (size_t i = 0; i < cv->nkeys && !oom; i++) {
        char module[KOHYA_NAME_MAX];
        if (split_key(cv->keys[i].name, module) != FACTOR_DOWN)
            continue;
        char *m = te_module(module, &oom);
        if (!m)
            continue;
        first = first ? first : cv->keys[i].t->t->name;
        enum te_kind kind = te_kind_of(m);
        has_out |= kind == TE_ATTN && str_ends_with(m, "out_proj");
        has_mlp |= kind == TE_MLP;
        free(m);
    }
    if (oom)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    if (first && !has_out && !has_mlp)
        return nf4_fail(NF4_EDATA, cv->path, first, "is a text encoder key, and none of them is of an out_proj or mlp "
                        "module: diffusers cannot tell their form, and loads none of this LoRA");
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const char *key = cv->keys[i].name, *original = cv->keys[i].t->t->name;
        char module[KOHYA_NAME_MAX];
        const enum factor suffix = split_key(key, module);
        char *m = te_module(module, &oom);
        if (oom)
            return nf4_fail(NF4_ESOFTWARE, cv->path, original, "out of memory");
        if (!m)
            continue;
        enum te_kind kind = te_kind_of(m);
        int loaded = kind == TE_MLP || (kind == TE_ATTN && has_out);
        if (suffix != FACTOR_DOWN) {
            if (!find_key(cv, module, KOHYA_DOWN))
                note_left_out(cv, original, 1);
        } else if (!find_key(cv, module, KOHYA_UP)) {
            code = nf4_fail(NF4_EDATA, cv->path, original, "has no matching lora_up.weight");
        } else if (!loaded) {
            note_left_out(cv, original, 2 + (find_key(cv, module, KOHYA_ALPHA) != NULL));
        } else {
            char root[KOHYA_NAME_MAX + 32]; /* "text_encoder." and a module of KOHYA_NAME_MAX */
            snprintf(root, sizeof root, "text_encoder.%s", m);
            code = convert_module(cv, module, NULL, root);
        }
        free(m);
    }
    return code;
}

static int holds_kohya_down(const char *key)
{
    return strstr(key, KOHYA_DOWN) != NULL;
}

int kohya_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_kohya_down); /* DoRA scales aside: diffusers drops them first */
}

int kohya_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    int code = rename_keys(&cv, w);
    if (code == NF4_OK)
        code = convert_transformer(&cv);
    if (code == NF4_OK)
        code = convert_text_encoder(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    if (code == NF4_OK && cv.rw.nparts == 0)
        code = nf4_fail(NF4_EDATA, path, NULL, "has none of the keys diffusers loads from a kohya Flux.1 LoRA "
                        "(lora_unet_double_blocks_N_..., lora_unet_single_blocks_N_..., lora_te1_...) among its %zu "
                        "tensors: a LoRA for another model?", w->count);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are for modules diffusers does not load from a kohya LoRA",
                               out);
    for (size_t i = 0; i < cv.nkeys; i++)
        free(cv.keys[i].name);
    free(cv.keys);
    return code;
}
