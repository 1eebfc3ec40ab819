#include "lora_hunyuan.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define HV_TARGET "transformer."
#define HV_COMFY "diffusion_model."
#define HV_KOHYA "lora_unet_"
/* Where diffusers cuts a single block's linear1 lora_B: HunyuanVideo's
 * hidden size, written into its conversion whatever the model's is. */
#define HV_HIDDEN 3072

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* diffusers' TRANSFORMER_KEYS_RENAME_DICT: each replaced everywhere in every
 * key, in this order. */
static const char *const RENAMES[][2] = {
    {"img_in", "x_embedder"},
    {"time_in.mlp.0", "time_text_embed.timestep_embedder.linear_1"},
    {"time_in.mlp.2", "time_text_embed.timestep_embedder.linear_2"},
    {"guidance_in.mlp.0", "time_text_embed.guidance_embedder.linear_1"},
    {"guidance_in.mlp.2", "time_text_embed.guidance_embedder.linear_2"},
    {"vector_in.in_layer", "time_text_embed.text_embedder.linear_1"},
    {"vector_in.out_layer", "time_text_embed.text_embedder.linear_2"},
    {"double_blocks", "transformer_blocks"},
    {"img_attn_q_norm", "attn.norm_q"},
    {"img_attn_k_norm", "attn.norm_k"},
    {"img_attn_proj", "attn.to_out.0"},
    {"txt_attn_q_norm", "attn.norm_added_q"},
    {"txt_attn_k_norm", "attn.norm_added_k"},
    {"txt_attn_proj", "attn.to_add_out"},
    {"img_mod.linear", "norm1.linear"},
    {"img_norm1", "norm1.norm"},
    {"img_norm2", "norm2"},
    {"img_mlp", "ff"},
    {"txt_mod.linear", "norm1_context.linear"},
    {"txt_norm1", "norm1.norm"},
    {"txt_norm2", "norm2_context"},
    {"txt_mlp", "ff_context"},
    {"self_attn_proj", "attn.to_out.0"},
    {"modulation.linear", "norm.linear"},
    {"pre_norm", "norm.norm"},
    {"final_layer.norm_final", "norm_out.norm"},
    {"final_layer.linear", "proj_out"},
    {"fc1", "net.0.proj"},
    {"fc2", "net.2"},
    {"input_embedder", "proj_in"},
};

/* The token refiner's names (remap_txt_in_'s rename_key), in this order. */
static const char *const TXT_IN_RENAMES[][2] = {
    {"individual_token_refiner.blocks", "token_refiner.refiner_blocks"},
    {"adaLN_modulation.1", "norm_out.linear"},
    {"txt_in", "context_embedder"},
    {"t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"},
    {"t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"},
    {"c_embedder", "time_text_embed.text_embedder"},
    {"mlp", "ff"},
};

/* A single block's keys but linear1's factors, in this order. */
static const char *const SINGLE_RENAMES[][2] = {
    {"single_blocks", "single_transformer_blocks"},
    {"linear2", "proj_out"},
    {"q_norm", "attn.norm_q"},
    {"k_norm", "attn.norm_k"},
};

/* The parts of a key diffusers converts by a rule of its own (TRANSFORMER_SPECIAL_KEYS_REMAP). */
enum special { SPECIAL_TXT_IN, SPECIAL_IMG_QKV, SPECIAL_TXT_QKV, SPECIAL_SINGLE, SPECIAL_FINAL_MOD, NSPECIAL };
static const char *const SPECIALS[NSPECIAL] = {
    "txt_in", "img_attn_qkv", "txt_attn_qkv", "single_blocks", "final_layer.adaLN_modulation.1",
};

static const char *const IMG_QKV[] = {"attn.to_q", "attn.to_k", "attn.to_v"};
static const char *const TXT_QKV[] = {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"};
static const char *const LINEAR1[] = {".attn.to_q", ".attn.to_k", ".attn.to_v", ".proj_mlp"};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), renamed as diffusers renames them, sorted */
    size_t nkeys;
    struct lora_rewrite rw;
};

/* ---- names ---- */

/* A key's name before one of diffusers' steps, and the key. */
struct name_before {
    char *name;
    const struct lora_key *key;
};

/* NF4_EDATA where key `k`, moved to `name` by one of diffusers' steps, lands
 * on the name `other` has before that step: diffusers' dict then overwrites
 * that key, or renames it with k's value, by their order. */
static int refuse_landing(const struct conversion *cv, const struct lora_key *k, const char *name,
                          const struct lora_key *other)
{
    return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "becomes %s, the name %s has at that step of diffusers' "
                    "renaming: diffusers keeps one of them, by their order", name, other->t->t->name);
}

static int name_before_cmp(const void *a, const void *b)
{
    return strcmp(((const struct name_before *)a)->name, ((const struct name_before *)b)->name);
}

/* The key whose name was `name` among n sorted names before a step, or NULL. */
static const struct lora_key *find_before(const struct name_before *sorted, size_t n, const char *name)
{
    const struct name_before want = {(char *)name, NULL};
    const struct name_before *hit = bsearch(&want, sorted, n, sizeof *sorted, name_before_cmp);
    return hit ? hit->key : NULL;
}

/* The keys' names as they stand, copied and sorted (*names, free with
 * free_names). NF4_OK or NF4_ESOFTWARE. */
static int snapshot_names(const struct conversion *cv, struct name_before **names)
{
    *names = calloc(cv->nkeys ? cv->nkeys : 1, sizeof **names);
    for (size_t i = 0; *names && i < cv->nkeys; i++) {
        (*names)[i] = (struct name_before){strdup(cv->keys[i].name), &cv->keys[i]};
        if (!(*names)[i].name) {
            for (size_t j = 0; j < i; j++)
                free((*names)[j].name);
            free(*names);
            *names = NULL;
        }
    }
    if (!*names)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    qsort(*names, cv->nkeys, sizeof **names, name_before_cmp);
    return NF4_OK;
}

static void free_names(struct name_before *names, size_t n)
{
    for (size_t i = 0; names && i < n; i++)
        free(names[i].name);
    free(names);
}

/* Each key (DoRA scales left out) less "transformer." or else
 * "diffusion_model.", then renamed; sorted. Refused where two become one,
 * and where a key moves onto the name another had before the step, whose
 * outcome in diffusers' dict depends on their order. */
static int rename_keys(struct conversion *cv, const struct model *w)
{
    struct name_before *before = NULL;
    char **renamed = NULL;
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    if (code == NF4_OK)
        code = snapshot_names(cv, &before);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        char *name = cv->keys[i].name;
        const size_t cut = str_starts_with(name, HV_TARGET) ? strlen(HV_TARGET)
                           : str_starts_with(name, HV_COMFY) ? strlen(HV_COMFY)
                                                             : 0;
        memmove(name, name + cut, strlen(name + cut) + 1);
        const struct lora_key *other = cut ? find_before(before, cv->nkeys, name) : NULL;
        if (other)
            code = refuse_landing(cv, &cv->keys[i], name, other);
        else if (str_starts_with(name, HV_KOHYA)) /* diffusers renames it into no module, and cuts its lora_down */
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is in kohya's form (lora_unet_, as "
                            "musubi-tuner saves a HunyuanVideo LoRA), which diffusers' HunyuanVideo loader does "
                            "not convert (a file of such keys fails to load): convert the file to ComfyUI's form "
                            "first (musubi-tuner's convert_lora.py --target other)");
    }
    free_names(before, cv->nkeys);
    before = NULL;
    /* Every key is popped and put back under its new name, one after another. */
    if (code == NF4_OK && (code = snapshot_names(cv, &before)) == NF4_OK &&
        !(renamed = calloc(cv->nkeys ? cv->nkeys : 1, sizeof *renamed)))
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!(renamed[i] = str_replace_in_turn(cv->keys[i].name, RENAMES, COUNT(RENAMES))))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, cv->keys[i].t->t->name, "out of memory");
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const struct lora_key *other =
            strcmp(renamed[i], cv->keys[i].name) ? find_before(before, cv->nkeys, renamed[i]) : NULL;
        if (other)
            code = refuse_landing(cv, &cv->keys[i], renamed[i], other);
    }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        free(cv->keys[i].name);
        cv->keys[i].name = renamed[i];
        renamed[i] = NULL;
    }
    for (size_t i = 0; renamed && i < cv->nkeys; i++)
        free(renamed[i]);
    free(renamed);
    free_names(before, cv->nkeys);
    if (code != NF4_OK)
        return code;
    lora_keys_sort(cv->keys, cv->nkeys);
    return lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
}

/* ---- parts ---- */

/* `k` as it is, named HV_TARGET + name (taken: freed here). */
static int add_copy(struct conversion *cv, char *name, const struct lora_key *k)
{
    int code = name ? lora_rewrite_add_copy(&cv->rw, HV_TARGET, name, k->t)
                    : nf4_fail(NF4_ESOFTWARE, cv->path, k->t->t->name, "out of memory");
    free(name);
    return code;
}

/* `k` as it is under each of names[0..n) (taken: freed here). */
static int add_copies(struct conversion *cv, const struct lora_key *k, char **names, size_t n)
{
    int code = NF4_OK;
    for (size_t j = 0; j < n; j++) {
        if (code == NF4_OK)
            code = add_copy(cv, names[j], k);
        else
            free(names[j]);
    }
    return code;
}

/* Whether `k` can be cut into blocks of rows, as diffusers cuts it: else
 * NF4_EDATA naming it, `what` saying into what. */
static int check_rows(const struct conversion *cv, const struct lora_key *k, const char *what)
{
    const struct st_tensor *t = k->t->t;
    if (t->ndim == 0 || t->ndim > 2)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "has %zu dimensions, but diffusers cuts it by rows into %s "
                        "(as %s)", t->ndim, what, k->name);
    return lora_check_factor_dtype(cv->path, t); /* its rows are copied as bytes: whole ones */
}

/* Rows of `k` one after another, parts[j] getting sizes[j] of them, each
 * named HV_TARGET + names[j] (taken: freed here). */
static int add_row_blocks(struct conversion *cv, const struct lora_key *k, char **names, const uint64_t *sizes,
                          size_t n)
{
    int code = NF4_OK;
    uint64_t row = 0;
    for (size_t j = 0; j < n; j++) {
        if (code == NF4_OK)
            code = names[j] ? lora_rewrite_add_rows(&cv->rw, HV_TARGET, names[j], k->t, row, sizes[j])
                            : nf4_fail(NF4_ESOFTWARE, cv->path, k->t->t->name, "out of memory");
        row += sizes[j];
        free(names[j]);
    }
    return code;
}

/* A fused qkv, `pattern` in the name (img_attn_qkv: parts to_q, to_k, to_v):
 * a key with lora_A in it copied to each part, any other cut into three
 * equal blocks of rows (torch.chunk(3)). */
static int convert_qkv(struct conversion *cv, const struct lora_key *k, const char *pattern, const char *const parts[3])
{
    char *names[3];
    for (size_t j = 0; j < 3; j++)
        names[j] = str_replace_all(k->name, pattern, parts[j]);
    if (strstr(k->name, "lora_A"))
        return add_copies(cv, k, names, 3);
    const struct st_tensor *t = k->t->t;
    int code = check_rows(cv, k, "three equal parts, for q, k and v");
    if (code == NF4_OK && (t->shape[0] % 3 != 0 || t->shape[0] == 0))
        code = nf4_fail(NF4_EDATA, cv->path, t->name, "has %" PRIu64 " rows, which diffusers cuts into parts for "
                        "%s, %s and %s that cannot load (not three equal parts)", t->shape[0], parts[0], parts[1],
                        parts[2]);
    if (code != NF4_OK) {
        for (size_t j = 0; j < 3; j++)
            free(names[j]);
        return code;
    }
    const uint64_t rows = t->shape[0] / 3, sizes[3] = {rows, rows, rows};
    return add_row_blocks(cv, k, names, sizes, 3);
}

/* A single block's linear1 factor (`kind`: "weight" or "bias"): a key with
 * lora_A in it copied to to_q, to_k, to_v and proj_mlp, any other cut at
 * HV_HIDDEN rows, HV_HIDDEN, HV_HIDDEN and the rest (torch.split). */
static int convert_linear1(struct conversion *cv, const struct lora_key *k, const char *kind)
{
    const int is_a = strstr(k->name, "lora_A") != NULL;
    char *block = str_replace_all(k->name, "single_blocks", "single_transformer_blocks"), suffix[32], *names[4] = {0};
    snprintf(suffix, sizeof suffix, ".linear1.lora_%c.%s", is_a ? 'A' : 'B', kind);
    if (block && str_has_suffix(block, suffix)) /* Python's removesuffix */
        block[strlen(block) - strlen(suffix)] = '\0';
    for (size_t j = 0; block && j < 4; j++) {
        struct strbuf b = {0};
        strbuf_printf(&b, "%s%s.lora_%c.%s", block, LINEAR1[j], is_a ? 'A' : 'B', kind);
        names[j] = b.oom ? (free(b.p), NULL) : b.p;
    }
    free(block);
    if (is_a)
        return add_copies(cv, k, names, 4);
    const struct st_tensor *t = k->t->t;
    int code = check_rows(cv, k, "to_q, to_k, to_v and proj_mlp");
    if (code == NF4_OK && t->shape[0] < 3 * (uint64_t)HV_HIDDEN)
        code = nf4_fail(NF4_EDATA, cv->path, t->name, "has %" PRIu64 " rows, but diffusers cuts %d of them off for "
                        "to_q, to_k and to_v: HunyuanVideo's hidden size (%d), whatever the model's", t->shape[0],
                        3 * HV_HIDDEN, HV_HIDDEN);
    if (code != NF4_OK) {
        for (size_t j = 0; j < 4; j++)
            free(names[j]);
        return code;
    }
    const uint64_t sizes[4] = {HV_HIDDEN, HV_HIDDEN, HV_HIDDEN, t->shape[0] - 3 * (uint64_t)HV_HIDDEN};
    return add_row_blocks(cv, k, names, sizes, 4);
}

/* A single block's key: linear1's factors cut, others renamed. */
static int convert_single(struct conversion *cv, const struct lora_key *k)
{
    if (strstr(k->name, "linear1.lora_A.weight") || strstr(k->name, "linear1.lora_B.weight"))
        return convert_linear1(cv, k, "weight");
    if (strstr(k->name, "linear1.lora_A.bias") || strstr(k->name, "linear1.lora_B.bias"))
        return convert_linear1(cv, k, "bias");
    return add_copy(cv, str_replace_in_turn(k->name, SINGLE_RENAMES, COUNT(SINGLE_RENAMES)), k);
}

/* final_layer.adaLN_modulation.1: norm_out.linear, the two halves of its rows
 * swapped (shift, scale = chunk(2); cat([scale, shift])). */
static int convert_final_modulation(struct conversion *cv, const struct lora_key *k)
{
    const struct st_tensor *t = k->t->t;
    int code = check_rows(cv, k, "two halves, which it swaps");
    if (code == NF4_OK && t->shape[0] < 2)
        code = nf4_fail(NF4_EDATA, cv->path, t->name, "has fewer than two rows (%" PRIu64 "), but diffusers cuts it "
                        "into two halves (shift and scale)", t->shape[0]);
    char *name = code == NF4_OK ? str_replace_all(k->name, SPECIALS[SPECIAL_FINAL_MOD], "norm_out.linear") : NULL;
    if (code == NF4_OK)
        code = name ? lora_rewrite_add_rows(&cv->rw, HV_TARGET, name, k->t, (t->shape[0] + 1) / 2, t->shape[0])
                    : nf4_fail(NF4_ESOFTWARE, cv->path, t->name, "out of memory");
    free(name);
    return code;
}

/* Each key by the one rule of diffusers' that takes it, or as it is. */
static int convert_keys(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const struct lora_key *k = &cv->keys[i];
        int first = -1, second = -1;
        for (int s = 0; s < NSPECIAL; s++)
            if (strstr(k->name, SPECIALS[s]))
                *(first < 0 ? &first : &second) = s;
        if (second >= 0) /* the second rule pops a key the first has taken */
            return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "holds both %s and %s (as %s), which diffusers' "
                            "conversion cannot take", SPECIALS[first], SPECIALS[second], k->name);
        const size_t first_part = cv->rw.nparts;
        switch (first) {
        case SPECIAL_TXT_IN:
            if (strstr(k->name, "self_attn_qkv"))
                return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is of the token refiner's fused qkv "
                                "(self_attn_qkv), which diffusers cuts in three by rows, lora_A too, into parts that "
                                "cannot load");
            code = add_copy(cv, str_replace_in_turn(k->name, TXT_IN_RENAMES, COUNT(TXT_IN_RENAMES)), k);
            break;
        case SPECIAL_IMG_QKV: code = convert_qkv(cv, k, SPECIALS[first], IMG_QKV); break;
        case SPECIAL_TXT_QKV: code = convert_qkv(cv, k, SPECIALS[first], TXT_QKV); break;
        case SPECIAL_SINGLE: code = convert_single(cv, k); break;
        case SPECIAL_FINAL_MOD: code = convert_final_modulation(cv, k); break;
        default: code = add_copy(cv, strdup(k->name), k); break;
        }
        /* A rule's parts go in beside the keys not yet taken, under their names as they stand. */
        for (size_t p = first_part; first >= 0 && code == NF4_OK && p < cv->rw.nparts; p++) {
            const char *name = cv->rw.parts[p].name + strlen(HV_TARGET);
            const struct lora_key *other = lora_key_find(cv->keys, cv->nkeys, name);
            if (other)
                code = refuse_landing(cv, k, name, other);
        }
    }
    /* Then every key is popped and put back under "transformer.", one after
     * another: one whose name is another's with that prefix lands on it. */
    for (size_t p = 0; p < cv->rw.nparts && code == NF4_OK; p++) {
        const char *name = cv->rw.parts[p].name + strlen(HV_TARGET);
        for (size_t q = 0; str_starts_with(name, HV_TARGET) && q < cv->rw.nparts && code == NF4_OK; q++)
            if (strcmp(cv->rw.parts[q].name, name) == 0)
                code = nf4_fail(NF4_EDATA, cv->path, cv->rw.parts[q].src->t->name, "becomes %s, as %s does once "
                                "diffusers puts transformer. before every key (which keeps one of them, by their "
                                "order)", cv->rw.parts[q].name, cv->rw.parts[p].src->t->name);
    }
    /* load_lora_weights then refuses the file for a key without "lora" (named here as the file names it). */
    for (size_t p = 0; p < cv->rw.nparts && code == NF4_OK; p++)
        if (!strstr(cv->rw.parts[p].name, "lora"))
            code = nf4_fail(NF4_EDATA, cv->path, cv->rw.parts[p].src->t->name, "becomes %s, with no \"lora\" in "
                            "its name, and diffusers refuses a LoRA file with such a key", cv->rw.parts[p].name);
    return code;
}

/* ---- the whole ---- */

static int holds_fused_qkv(const char *key)
{
    return strstr(key, SPECIALS[SPECIAL_IMG_QKV]) != NULL;
}

int hunyuan_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_fused_qkv);
}

int hunyuan_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = rename_keys(&cv, w);
    if (code == NF4_OK)
        code = convert_keys(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
