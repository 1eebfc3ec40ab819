#include "lora_fal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strutil.h"

#define FAL_PREFIX "base_model.model."
#define FAL_TARGET "transformer."
/* FLUX.1's, written into diffusers' conversion whatever the model's. */
#define FAL_DOUBLE_BLOCKS 19
#define FAL_SINGLE_BLOCKS 38
#define FAL_INNER 3072
#define FAL_MLP 12288 /* inner * mlp_ratio 4.0 */
/* Room for any name built here: the longest is under 80 bytes. */
#define FAL_NAME_MAX 160

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* How diffusers carries a module's factors over. */
enum fal_cut {
    CUT_NONE,   /* renamed */
    CUT_QKV,    /* lora_A copied to each part, lora_B cut into three equal blocks of rows */
    CUT_LINEAR1 /* lora_A copied to each part, lora_B cut at FAL_INNER x 3 and FAL_MLP rows */
};

/* Which of a module's biases diffusers converts: it looks for the others
 * under a name it does not pop (or not at all), so they are left over. */
enum fal_bias { NO_BIAS, BOTH_BIASES, B_BIAS };

struct fal_module {
    const char *theirs; /* after the block's name */
    enum fal_cut cut;
    enum fal_bias bias;
    const char *ours[4]; /* diffusers' module, or its parts */
};

/* In the order diffusers pops them, for each factor of a block. */
static const struct fal_module DOUBLE[] = {
    {"img_mod.lin", CUT_NONE, NO_BIAS, {"norm1.linear"}},
    {"txt_mod.lin", CUT_NONE, NO_BIAS, {"norm1_context.linear"}},
    {"img_attn.qkv", CUT_QKV, NO_BIAS, {"attn.to_q", "attn.to_k", "attn.to_v"}},
    {"txt_attn.qkv", CUT_QKV, NO_BIAS, {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}},
    {"img_mlp.0", CUT_NONE, BOTH_BIASES, {"ff.net.0.proj"}},
    {"img_mlp.2", CUT_NONE, BOTH_BIASES, {"ff.net.2"}},
    {"txt_mlp.0", CUT_NONE, BOTH_BIASES, {"ff_context.net.0.proj"}},
    {"txt_mlp.2", CUT_NONE, BOTH_BIASES, {"ff_context.net.2"}},
    {"img_attn.proj", CUT_NONE, BOTH_BIASES, {"attn.to_out.0"}},
    {"txt_attn.proj", CUT_NONE, BOTH_BIASES, {"attn.to_add_out"}},
};
static const struct fal_module SINGLE[] = {
    {"modulation.lin", CUT_NONE, BOTH_BIASES, {"norm.linear"}},
    {"linear1", CUT_LINEAR1, B_BIAS, {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}},
    {"linear2", CUT_NONE, BOTH_BIASES, {"proj_out"}},
};
static const struct fal_module FINAL[] = {
    {"final_layer.linear", CUT_NONE, BOTH_BIASES, {"proj_out"}},
};

/* The double blocks, then the single ones, then the final layer. */
static const struct fal_group {
    const char *theirs, *ours; /* the block's name before its number ("": the model's own module) */
    unsigned blocks;           /* 0: not numbered */
    const struct fal_module *modules;
    size_t nmodules;
} GROUPS[] = {
    {"double_blocks.", "transformer_blocks.", FAL_DOUBLE_BLOCKS, DOUBLE, COUNT(DOUBLE)},
    {"single_blocks.", "single_transformer_blocks.", FAL_SINGLE_BLOCKS, SINGLE, COUNT(SINGLE)},
    {"", "", 0, FINAL, COUNT(FINAL)},
};

static const char FACTORS[2] = {'A', 'B'};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), sorted */
    size_t nkeys;
    struct lora_rewrite rw;
};

/* One module of one block: where its names start, theirs and ours. */
struct fal_place {
    char theirs[FAL_NAME_MAX], ours[FAL_NAME_MAX];
};

static void place_module(struct fal_place *p, const struct fal_group *g, unsigned block, const struct fal_module *m)
{
    char number[16] = "";
    if (g->blocks)
        snprintf(number, sizeof number, "%u.", block);
    snprintf(p->theirs, sizeof p->theirs, FAL_PREFIX "%s%s%s", g->theirs, number, m->theirs);
    snprintf(p->ours, sizeof p->ours, "%s%s", g->ours, number);
}

/* Adds `k` as ours + part + suffix for each part of `m`: lora_A's copied to
 * each, lora_B's cut by rows where the module is fused. */
static int add_parts(struct conversion *cv, const struct fal_place *p, const struct fal_module *m,
                     const struct lora_key *k, char factor, const char *suffix)
{
    const struct st_tensor *t = k->t->t;
    const size_t nparts = m->cut == CUT_NONE ? 1 : m->cut == CUT_QKV ? 3 : 4;
    uint64_t sizes[4] = {0};
    int code = NF4_OK;
    if (m->cut != CUT_NONE && factor == 'B') {
        if (t->ndim == 0 || t->ndim > 2)
            return nf4_fail(NF4_EDATA, cv->path, t->name, "has %zu dimensions, but diffusers cuts it by rows for %s, "
                            "%s, %s%s%s", t->ndim, m->ours[0], m->ours[1], m->ours[2], nparts == 4 ? " and " : "",
                            nparts == 4 ? m->ours[3] : "");
        if ((code = lora_check_factor_dtype(cv->path, t)) != NF4_OK) /* its rows are copied as bytes: whole ones */
            return code;
        if (m->cut == CUT_QKV) {
            if (t->shape[0] == 0 || t->shape[0] % 3 != 0)
                return nf4_fail(NF4_EDATA, cv->path, t->name, "has %" PRIu64 " rows, which diffusers cuts into parts "
                                "for %s, %s and %s that cannot load (not three equal parts)", t->shape[0],
                                m->ours[0], m->ours[1], m->ours[2]);
            sizes[0] = sizes[1] = sizes[2] = t->shape[0] / 3;
        } else {
            if (t->shape[0] != 3 * (uint64_t)FAL_INNER + FAL_MLP) /* torch.split raises */
                return nf4_fail(NF4_EDATA, cv->path, t->name, "has %" PRIu64 " rows, but diffusers cuts it into "
                                "FLUX.1's %d, %d, %d and %d, whatever the model's", t->shape[0], FAL_INNER, FAL_INNER,
                                FAL_INNER, FAL_MLP);
            sizes[0] = sizes[1] = sizes[2] = FAL_INNER;
            sizes[3] = FAL_MLP;
        }
    }
    uint64_t row = 0;
    for (size_t j = 0; j < nparts && code == NF4_OK; j++) {
        char factor_name[FAL_NAME_MAX];
        if (snprintf(factor_name, sizeof factor_name, "%s%s.lora_%c.%s", p->ours, m->ours[j], factor, suffix) >=
            (int)sizeof factor_name)
            return nf4_fail(NF4_ESOFTWARE, cv->path, t->name, "a name made for it is too long");
        code = sizes[j] ? lora_rewrite_add_rows(&cv->rw, FAL_TARGET, factor_name, k->t, row, sizes[j])
                        : lora_rewrite_add_copy(&cv->rw, FAL_TARGET, factor_name, k->t);
        row += sizes[j];
    }
    return code;
}

/* One factor of one module: its weight, which must be there, then its bias
 * where diffusers converts one and the file has it. */
static int convert_factor(struct conversion *cv, const struct fal_place *p, const struct fal_module *m, char factor)
{
    char name[FAL_NAME_MAX];
    if (snprintf(name, sizeof name, "%s.lora_%c.weight", p->theirs, factor) >= (int)sizeof name)
        return nf4_fail(NF4_ESOFTWARE, cv->path, p->theirs, "a name made for it is too long");
    struct lora_key *k = lora_key_available(cv->keys, cv->nkeys, name);
    if (!k)
        return nf4_fail(NF4_EDATA, cv->path, name, "is missing: diffusers converts a LoRA with \"base_model\" in a "
                        "key as fal's FLUX.1 Kontext form, which has each factor of every module of FLUX.1's %d double "
                        "blocks, %d single blocks and final layer", FAL_DOUBLE_BLOCKS, FAL_SINGLE_BLOCKS);
    k->taken = 1;
    int code = add_parts(cv, p, m, k, factor, "weight");
    if (code != NF4_OK || !(m->bias == BOTH_BIASES || (m->bias == B_BIAS && factor == 'B')))
        return code;
    if (snprintf(name, sizeof name, "%s.lora_%c.bias", p->theirs, factor) >= (int)sizeof name)
        return nf4_fail(NF4_ESOFTWARE, cv->path, p->theirs, "a name made for it is too long");
    if (!(k = lora_key_available(cv->keys, cv->nkeys, name)))
        return NF4_OK;
    k->taken = 1;
    return add_parts(cv, p, m, k, factor, "bias");
}

/* Every module of every block, in diffusers' order; then anything left
 * over refused, as diffusers raises. */
static int convert_keys(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t g = 0; g < COUNT(GROUPS) && code == NF4_OK; g++) {
        const struct fal_group *group = &GROUPS[g];
        for (unsigned b = 0; b < (group->blocks ? group->blocks : 1) && code == NF4_OK; b++)
            for (size_t f = 0; f < COUNT(FACTORS) && code == NF4_OK; f++)
                for (size_t i = 0; i < group->nmodules && code == NF4_OK; i++) {
                    struct fal_place p;
                    place_module(&p, group, b, &group->modules[i]);
                    code = convert_factor(cv, &p, &group->modules[i], FACTORS[f]);
                }
    }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over where diffusers converts a "
                            "LoRA with \"base_model\" in a key as fal's FLUX.1 Kontext form, and raises: a key of "
                            "none of its modules' factors, or a bias it does not carry over");
    return code;
}

static int holds_base_model(const char *key)
{
    return strstr(key, "base_model") != NULL;
}

/* Whether `key` is under one of GROUPS' names, as fal's are. */
static int in_fal_form(const char *key)
{
    if (!str_starts_with(key, FAL_PREFIX))
        return 0;
    for (size_t g = 0; g < COUNT(GROUPS); g++) {
        const char *root = GROUPS[g].blocks ? GROUPS[g].theirs : GROUPS[g].modules[0].theirs;
        if (str_starts_with(key + strlen(FAL_PREFIX), root))
            return 1;
    }
    return 0;
}

int fal_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_base_model) && lora_model_any_key(w, in_fal_form);
}

int fal_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = lora_keys_of(path, w, lora_is_dora_scale, &cv.keys, &cv.nkeys);
    if (code == NF4_OK) {
        lora_keys_sort(cv.keys, cv.nkeys);
        code = convert_keys(&cv);
    }
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, which diffusers does not load", out);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
