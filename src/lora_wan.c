#include "lora_wan.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strutil.h"

#define WAN_COMFY "diffusion_model."
#define WAN_MUSUBI "lora_unet_"
#define WAN_TARGET "transformer."
/* Block numbers diffusers' loop would walk: more than this is a broken file. */
#define WAN_MAX_BLOCK_SPAN 100000
/* Room for a name made of a module's name and a block number. */
#define WAN_NAME_MAX 192
/* The identity lora_B diffusers makes for the head's diff is [outputs,
 * outputs]: Wan's heads have 64 (14B) or 192 (5B) outputs. A larger one is
 * no Wan head, and would be written out whole before any shape check. */
#define WAN_MAX_HEAD_OUTPUTS 4096

/* A block's modules: Wan's name and diffusers'. k_img and v_img are read
 * only from an image-to-video LoRA (one with both). */
static const char *const BLOCK_MODULES[][2] = {
    {"self_attn.q", "attn1.to_q"},   {"self_attn.k", "attn1.to_k"},       {"self_attn.v", "attn1.to_v"},
    {"self_attn.o", "attn1.to_out.0"}, {"cross_attn.q", "attn2.to_q"},    {"cross_attn.k", "attn2.to_k"},
    {"cross_attn.v", "attn2.to_v"},  {"cross_attn.o", "attn2.to_out.0"},  {"cross_attn.k_img", "attn2.add_k_proj"},
    {"cross_attn.v_img", "attn2.add_v_proj"}, {"ffn.0", "ffn.net.0.proj"}, {"ffn.2", "ffn.net.2"},
};
#define BLOCK_MODULES_N (sizeof BLOCK_MODULES / sizeof BLOCK_MODULES[0])

static int is_image_module(size_t m)
{
    return strstr(BLOCK_MODULES[m][0], "_img") != NULL;
}

struct conversion {
    const char *path;
    const struct model *w;
    struct lora_key *keys; /* the file's keys, prefix cut, sorted */
    size_t nkeys;
    const char *down, *up; /* the factors' names: lora_A / lora_B where any key has them, else lora_down / lora_up */
    int image; /* an image-to-video LoRA: keys with k_img and with v_img */
    struct lora_rewrite rw;
};

/* ---- keys ---- */

static int any_left_holding(const struct conversion *cv, const char *part)
{
    for (size_t i = 0; i < cv->nkeys; i++)
        if (!cv->keys[i].taken && strstr(cv->keys[i].name, part))
            return 1;
    return 0;
}

static int any_key_holding(const struct conversion *cv, const char *part)
{
    for (size_t i = 0; i < cv->nkeys; i++)
        if (strstr(cv->keys[i].name, part))
            return 1;
    return 0;
}

/* Leaves a key out (diffusers drops it), for the warning. */
static void leave_out(struct conversion *cv, struct lora_key *k)
{
    k->taken = 1;
    lora_rewrite_leave_out(&cv->rw, k->t->t->name, strlen(k->t->t->name), 1);
}

/* Each key of `w` with its first `cut` characters cut, sorted, and refused
 * where two become one (the dict keeps one of them). */
static int cut_keys(struct conversion *cv, size_t cut)
{
    int code = lora_keys_of(cv->path, cv->w, NULL, &cv->keys, &cv->nkeys);
    if (code != NF4_OK)
        return code;
    lora_keys_cut(cv->keys, cv->nkeys, cut);
    lora_keys_sort(cv->keys, cv->nkeys);
    return lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
}

/* ---- tensors ---- */

/* The pair `down`, `up` as WAN_TARGET + module + ".lora_A.weight" /
 * ".lora_B.weight", with `alpha` (or none) folded in. */
static int add_pair(struct conversion *cv, const char *module, struct lora_key *down, struct lora_key *up,
                    struct lora_key *alpha)
{
    const struct st_tensor *dt = down->t->t, *ut = up->t->t;
    down->taken = up->taken = 1;
    int code = lora_check_pair(cv->path, dt, ut);
    if (code != NF4_OK)
        return code;
    char a_name[WAN_NAME_MAX], b_name[WAN_NAME_MAX];
    snprintf(a_name, sizeof a_name, "%s.lora_A.weight", module);
    snprintf(b_name, sizeof b_name, "%s.lora_B.weight", module);
    if (!alpha) { /* diffusers copies the factors */
        code = lora_rewrite_add_copy(&cv->rw, WAN_TARGET, a_name, down->t);
        return code == NF4_OK ? lora_rewrite_add_copy(&cv->rw, WAN_TARGET, b_name, up->t) : code;
    }
    double a;
    float sd, su;
    alpha->taken = 1;
    if ((code = lora_read_alpha(cv->path, alpha->t, &a)) != NF4_OK)
        return code;
    lora_split_scale(a / (double)dt->shape[0], DT_F64, &sd, &su); /* alpha.item() / rank: Python floats */
    code = lora_rewrite_add(&cv->rw, WAN_TARGET, a_name, down->t, dt->dtype, dt->shape[0], dt->shape[1], 0, 0, sd);
    return code == NF4_OK ? lora_rewrite_add(&cv->rw, WAN_TARGET, b_name, up->t, ut->dtype, ut->shape[0],
                                             ut->shape[1], 0, 0, su)
                          : code;
}

/* A diff_b as `target` (WAN_TARGET + module + ".lora_B.bias"). */
static int add_bias(struct conversion *cv, const char *target, struct lora_key *bias)
{
    const struct st_tensor *t = bias->t->t;
    bias->taken = 1;
    if (t->ndim != 1 || !lora_is_factor_dtype(t->dtype) || t->nelem == 0)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "is not a bias (a vector of F32, BF16 or F16)");
    return lora_rewrite_add_copy(&cv->rw, WAN_TARGET, target, bias->t);
}

/* How a module's factors are read. */
enum factors_rule {
    FACTORS_EITHER,   /* each where it is there: diffusers copies each one it finds */
    FACTORS_REQUIRED, /* both: diffusers pops them */
};

/* The module Wan names `theirs`, as diffusers' `ours`: its factors (both
 * needed where `alphas` and it has an alpha, which is folded in), then its
 * diff_b beside them. A diff_b without factors is left for check_left where
 * `bias_needs_factors` (diffusers does not take it), else refused. */
static int convert_module(struct conversion *cv, const char *theirs, const char *ours, enum factors_rule rule,
                          int alphas, int bias_needs_factors)
{
    char down_name[WAN_NAME_MAX], up_name[WAN_NAME_MAX], alpha_name[WAN_NAME_MAX], bias_name[WAN_NAME_MAX];
    snprintf(down_name, sizeof down_name, "%s.%s.weight", theirs, cv->down);
    snprintf(up_name, sizeof up_name, "%s.%s.weight", theirs, cv->up);
    snprintf(alpha_name, sizeof alpha_name, "%s.alpha", theirs);
    snprintf(bias_name, sizeof bias_name, "%s.diff_b", theirs);
    struct lora_key *down = lora_key_available(cv->keys, cv->nkeys, down_name),
                    *up = lora_key_available(cv->keys, cv->nkeys, up_name);
    struct lora_key *alpha = alphas ? lora_key_available(cv->keys, cv->nkeys, alpha_name) : NULL;
    struct lora_key *named = alpha ? alpha : down ? down : up;
    if (!(down && up) && (named || rule == FACTORS_REQUIRED)) {
        /* Where diffusers' pop raises, or it would load a factor alone, which merges nothing. */
        if (!named)
            return nf4_fail(NF4_EDATA, cv->path, NULL, "has keys of %s but not its %s.weight and %s.weight, which "
                            "diffusers needs", theirs, cv->down, cv->up);
        return nf4_fail(NF4_EDATA, cv->path, named->t->t->name, "has no matching %s.weight",
                        down ? cv->up : cv->down);
    }
    int code = down ? add_pair(cv, ours, down, up, alpha) : NF4_OK;
    struct lora_key *bias = lora_key_available(cv->keys, cv->nkeys, bias_name);
    if (code == NF4_OK && bias && !down && !bias_needs_factors)
        /* diffusers would load it with zero factors: the bias alone, and the weight plus 0 */
        return nf4_fail(NF4_EDATA, cv->path, bias->t->t->name, "is a bias change of %s, which has no factors here: "
                        "nf4deq merges a diff_b only beside its module's lora_down and lora_up", theirs);
    if (code == NF4_OK && bias && down) {
        char target[WAN_NAME_MAX];
        snprintf(target, sizeof target, "%s.lora_B.bias", ours);
        code = add_bias(cv, target, bias);
    }
    return code;
}

/* ---- Wan's names: diffusion_model. ---- */

/* The lowest and highest N of keys "blocks.N...." (int(k.split(".")[1])). */
static int block_range(const struct conversion *cv, int64_t *lo, int64_t *hi)
{
    int found = 0;
    for (size_t i = 0; i < cv->nkeys; i++) {
        const char *k = cv->keys[i].name;
        if (!str_starts_with(k, "blocks."))
            continue;
        const char *n = k + strlen("blocks."), *dot = strchr(n, '.');
        int64_t b;
        if (!lora_python_int(n, dot ? (size_t)(dot - n) : strlen(n), &b))
            return nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "has no block number after \"blocks.\"");
        *lo = found && *lo < b ? *lo : b;
        *hi = found && *hi > b ? *hi : b;
        found = 1;
    }
    if (!found)
        return nf4_fail(NF4_EDATA, cv->path, NULL, "has no key of a block (blocks.N.), which diffusers' Wan "
                        "conversion needs");
    if ((uint64_t)*hi - (uint64_t)*lo > WAN_MAX_BLOCK_SPAN) /* hi >= lo: no wrap */
        return nf4_fail(NF4_EDATA, cv->path, NULL, "has keys of blocks %lld to %lld, more than a Wan model has",
                        (long long)*lo, (long long)*hi);
    return NF4_OK;
}

/* What diffusers drops before it converts: diffs of norms ("only zeros"),
 * and a time_projection's keys where it has no weights (AccVideo's LoRAs). */
static int drop_unloaded(struct conversion *cv)
{
    int time_projection_weights = 0;
    for (size_t i = 0; i < cv->nkeys; i++)
        time_projection_weights |= str_starts_with(cv->keys[i].name, "time_projection") &&
                                   str_has_suffix(cv->keys[i].name, ".weight");
    /* In the file's order, as diffusers pops them. */
    struct lora_key **in_file_order = calloc(cv->nkeys ? cv->nkeys : 1, sizeof *in_file_order);
    if (!in_file_order)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t j = 0; j < cv->nkeys; j++)
        in_file_order[cv->keys[j].t - cv->w->tensors] = &cv->keys[j];
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *k = in_file_order[i];
        if ((str_has_suffix(k->name, ".diff") || str_has_suffix(k->name, ".diff_b")) && strstr(k->name, "norm"))
            leave_out(cv, k);
        if (strstr(k->name, "time_projection") && !time_projection_weights) {
            if (k->taken) /* popped twice: diffusers raises KeyError */
                code = nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is both a norm's diff and a "
                                "time_projection's, which diffusers fails on");
            else
                leave_out(cv, k);
        }
    }
    free(in_file_order);
    return code;
}

static int convert_blocks(struct conversion *cv)
{
    int64_t lo = 0, hi = -1;
    int code = block_range(cv, &lo, &hi);
    for (int64_t b = lo; code == NF4_OK && b <= hi; b++)
        for (size_t m = 0; m < BLOCK_MODULES_N && code == NF4_OK; m++) {
            if (is_image_module(m) && !cv->image)
                continue;
            char theirs[WAN_NAME_MAX], ours[WAN_NAME_MAX];
            snprintf(theirs, sizeof theirs, "blocks.%lld.%s", (long long)b, BLOCK_MODULES[m][0]);
            snprintf(ours, sizeof ours, "blocks.%lld.%s", (long long)b, BLOCK_MODULES[m][1]);
            code = convert_module(cv, theirs, ours, FACTORS_EITHER, 1, 0);
        }
    return code;
}

/* Whether any key of the file, as it is named there, holds `part` (and ends
 * with `suffix`): diffusers looks at the whole state dict for the head. */
static int any_file_key(const struct conversion *cv, const char *part, const char *suffix)
{
    for (size_t i = 0; i < cv->w->count; i++) {
        const char *name = cv->w->tensors[i].t->name;
        if (strstr(name, part) && str_has_suffix(name, suffix))
            return 1;
    }
    return 0;
}

/* head.head: its factors, or its weight's diff as lora_A with an identity
 * lora_B [out, out] (lightx2v's distillation LoRAs: diffusers' reading of
 * it), and its diff_b. */
static int convert_head(struct conversion *cv)
{
    char down_name[WAN_NAME_MAX], up_name[WAN_NAME_MAX];
    snprintf(down_name, sizeof down_name, "head.head.%s.weight", cv->down);
    snprintf(up_name, sizeof up_name, "head.head.%s.weight", cv->up);
    struct lora_key *down = NULL, *up = NULL;
    if (any_file_key(cv, down_name, "") && !(down = lora_key_available(cv->keys, cv->nkeys, down_name)))
        return nf4_fail(NF4_EDATA, cv->path, NULL, "has a key holding %s but not that key, which diffusers then "
                        "needs", down_name);
    if (any_file_key(cv, up_name, "") && !(up = lora_key_available(cv->keys, cv->nkeys, up_name)))
        return nf4_fail(NF4_EDATA, cv->path, NULL, "has a key holding %s but not that key, which diffusers then "
                        "needs", up_name);
    struct lora_key *bias = lora_key_available(cv->keys, cv->nkeys, "head.head.diff_b");
    int code = bias ? add_bias(cv, "proj_out.lora_B.bias", bias) : NF4_OK;
    if (code != NF4_OK)
        return code;
    if (!any_file_key(cv, "head.head", ".diff")) {
        if ((down || up) && !(down && up))
            return nf4_fail(NF4_EDATA, cv->path, (down ? down : up)->t->t->name, "has no matching %s.weight",
                            down ? cv->up : cv->down);
        if (bias && !down)
            return nf4_fail(NF4_EDATA, cv->path, bias->t->t->name, "is a bias change of head.head, which has no "
                            "factors here: nf4deq merges a diff_b only beside its module's lora_down and lora_up");
        return down ? add_pair(cv, "proj_out", down, up, NULL) : NF4_OK;
    }
    /* The weight's diff replaces any factors of the head. */
    struct lora_key *diff = lora_key_available(cv->keys, cv->nkeys, "head.head.diff");
    if (!diff)
        return nf4_fail(NF4_EDATA, cv->path, NULL, "has a head.head key ending in .diff but not head.head.diff, "
                        "which diffusers then needs");
    if (!bias)
        return nf4_fail(NF4_EDATA, cv->path, diff->t->t->name, "has no head.head.diff_b, which diffusers needs "
                        "beside it");
    if (down)
        leave_out(cv, down);
    if (up)
        leave_out(cv, up);
    const struct st_tensor *t = diff->t->t;
    diff->taken = 1;
    if (t->ndim != 2 || !lora_is_factor_dtype(t->dtype) || t->nelem == 0)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "is not a weight's diff (a matrix of F32, BF16 or F16)");
    if (t->shape[0] > WAN_MAX_HEAD_OUTPUTS || bias->t->t->nelem > WAN_MAX_HEAD_OUTPUTS)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "has %llu rows, and its diff_b %llu: more outputs than a Wan "
                        "head has (at most %d here), for the identity diffusers makes of them",
                        (unsigned long long)t->shape[0], (unsigned long long)bias->t->t->nelem, WAN_MAX_HEAD_OUTPUTS);
    code = lora_rewrite_add_copy(&cv->rw, WAN_TARGET, "proj_out.lora_A.weight", diff->t);
    /* torch.eye(rows of the diff, outputs of the bias).T */
    return code == NF4_OK ? lora_rewrite_add_identity(&cv->rw, WAN_TARGET, "proj_out.lora_B.weight", diff->t,
                                                      t->dtype, bias->t->t->nelem, t->shape[0])
                          : code;
}

/* The modules outside the blocks, where keys of them are left. */
static int convert_top_level(struct conversion *cv)
{
    int code = NF4_OK;
    if (any_left_holding(cv, "time_projection"))
        code = convert_module(cv, "time_projection.1", "condition_embedder.time_proj", FACTORS_EITHER, 0, 0);
    if (code == NF4_OK && any_left_holding(cv, "head.head"))
        code = convert_head(cv);
    static const char *const EMBEDDINGS[][3] = {
        {"text_embedding", "text_embedding.0", "condition_embedder.text_embedder.linear_1"},
        {"text_embedding", "text_embedding.2", "condition_embedder.text_embedder.linear_2"},
        {"time_embedding", "time_embedding.0", "condition_embedder.time_embedder.linear_1"},
        {"time_embedding", "time_embedding.2", "condition_embedder.time_embedder.linear_2"},
    };
    for (size_t e = 0; e < 4 && code == NF4_OK; e += 2) {
        if (!any_left_holding(cv, EMBEDDINGS[e][0]))
            continue;
        for (size_t j = e; j < e + 2 && code == NF4_OK; j++)
            code = convert_module(cv, EMBEDDINGS[j][1], EMBEDDINGS[j][2],
                                  any_left_holding(cv, EMBEDDINGS[j][1]) ? FACTORS_REQUIRED : FACTORS_EITHER, 0, 0);
    }
    if (code == NF4_OK)
        code = convert_module(cv, "img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj",
                              FACTORS_EITHER, 0, 1);
    if (code == NF4_OK)
        code = convert_module(cv, "img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2", FACTORS_EITHER, 0, 1);
    return code;
}

/* What Wan's names leave: diffusers goes on where every such key holds
 * ".diff" (diffs of weights it does not read), and none ending in it holds
 * "lora"; else it raises. (musubi's converter lets nothing be left.) */
static int check_left(struct conversion *cv)
{
    for (size_t i = 0; i < cv->nkeys; i++) {
        const struct lora_key *k = &cv->keys[i];
        if (!k->taken && !strstr(k->name, ".diff"))
            return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is not a key diffusers reads from a Wan LoRA in "
                            "Wan's names (diffusion_model.)");
    }
    for (size_t i = 0; i < cv->nkeys; i++) {
        struct lora_key *k = &cv->keys[i];
        if (k->taken)
            continue;
        if (str_has_suffix(k->name, ".diff") && strstr(k->name, "lora"))
            return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is a diff of a LoRA key, which diffusers refuses");
        leave_out(cv, k);
    }
    return NF4_OK;
}

static int convert_wan_names(struct conversion *cv)
{
    int code = cut_keys(cv, strlen(WAN_COMFY));
    if (code != NF4_OK)
        return code;
    cv->image = any_key_holding(cv, "k_img") && any_key_holding(cv, "v_img");
    cv->down = any_key_holding(cv, "lora_A") ? "lora_A" : "lora_down";
    cv->up = any_key_holding(cv, "lora_B") ? "lora_B" : "lora_up";
    if ((code = drop_unloaded(cv)) == NF4_OK && (code = convert_blocks(cv)) == NF4_OK &&
        (code = convert_top_level(cv)) == NF4_OK)
        code = check_left(cv);
    return code;
}

/* ---- musubi-tuner's names: lora_unet_ ---- */

static int str_ptr_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* How many blocks diffusers takes the file to have: the distinct N of
 * "blocks_N_" (k.split("blocks_")[1].split("_")[0]), however they are
 * numbered; every key needs "blocks_". */
static int musubi_block_count(const struct conversion *cv, size_t *n)
{
    char **ids = calloc(cv->nkeys ? cv->nkeys : 1, sizeof *ids);
    if (!ids)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const char *at = strstr(cv->keys[i].name, "blocks_");
        if (!at) {
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is not a key of a block "
                            "(lora_unet_blocks_N_...), which diffusers needs of every key of a musubi-tuner Wan LoRA");
            break;
        }
        at += strlen("blocks_");
        const char *next = strstr(at, "blocks_"), *end = next ? next : at + strlen(at);
        const char *us = memchr(at, '_', (size_t)(end - at));
        if (!(ids[i] = strndup(at, (size_t)((us ? us : end) - at))))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    *n = 0;
    if (code == NF4_OK) {
        qsort(ids, cv->nkeys, sizeof *ids, str_ptr_cmp);
        for (size_t i = 0; i < cv->nkeys; i++)
            *n += i == 0 || strcmp(ids[i - 1], ids[i]) != 0;
    }
    for (size_t i = 0; i < cv->nkeys; i++)
        free(ids[i]);
    free(ids);
    return code;
}

/* musubi-tuner's module name of BLOCK_MODULES[m] in block b: blocks_b_ + Wan's name, "." as "_". */
static void musubi_name(char *out, size_t size, size_t b, size_t m)
{
    snprintf(out, size, "blocks_%zu_%s", b, BLOCK_MODULES[m][0]);
    for (char *p = out; *p; p++)
        if (*p == '.')
            *p = '_';
}

static int convert_musubi(struct conversion *cv)
{
    int code = cut_keys(cv, strlen(WAN_MUSUBI));
    size_t nblocks = 0;
    if (code == NF4_OK)
        code = musubi_block_count(cv, &nblocks);
    cv->image = any_key_holding(cv, "k_img") && any_key_holding(cv, "v_img");
    for (size_t b = 0; b < nblocks && code == NF4_OK; b++)
        for (size_t m = 0; m < BLOCK_MODULES_N && code == NF4_OK; m++) {
            if (is_image_module(m) && !cv->image)
                continue;
            char theirs[WAN_NAME_MAX], ours[WAN_NAME_MAX], down[WAN_NAME_MAX + 32], up[WAN_NAME_MAX + 32],
                alpha[WAN_NAME_MAX + 32];
            musubi_name(theirs, sizeof theirs, b, m);
            snprintf(ours, sizeof ours, "blocks.%zu.%s", b, BLOCK_MODULES[m][1]);
            snprintf(down, sizeof down, "%s.lora_down.weight", theirs);
            snprintf(up, sizeof up, "%s.lora_up.weight", theirs);
            snprintf(alpha, sizeof alpha, "%s.alpha", theirs);
            struct lora_key *d = lora_key_available(cv->keys, cv->nkeys, down),
                            *u = lora_key_available(cv->keys, cv->nkeys, up),
                            *a = lora_key_available(cv->keys, cv->nkeys, alpha);
            if (!d || !u || !a)
                code = nf4_fail(NF4_EDATA, cv->path, NULL, "has no %s%s, which diffusers needs: a musubi-tuner Wan "
                                "LoRA has every module of each of its %zu blocks", WAN_MUSUBI,
                                !d ? down : !u ? up : alpha, nblocks);
            else
                code = add_pair(cv, ours, d, u, a);
        }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) /* diffusers: "state_dict should be empty" */
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is not a key diffusers reads from a Wan "
                            "LoRA in musubi-tuner's names (lora_unet_blocks_N_...)");
    return code;
}

/* ---- both ---- */

static int any_starts_with(const struct model *w, const char *prefix)
{
    for (size_t i = 0; i < w->count; i++)
        if (str_starts_with(w->tensors[i].t->name, prefix))
            return 1;
    return 0;
}

int wan_lora_detect(const struct model *w)
{
    return any_starts_with(w, WAN_COMFY) || any_starts_with(w, WAN_MUSUBI);
}

int wan_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .w = w, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    int code = any_starts_with(w, WAN_COMFY) ? convert_wan_names(&cv) : convert_musubi(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are ones diffusers does not load from a Wan LoRA", out);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
