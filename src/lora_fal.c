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
/* What marks BFL's control form (FluxLoraLoaderMixin.lora_state_dict's is_bfl_control). */
#define CONTROL_MARK "query_norm.scale"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* How diffusers carries a module's factors over. */
enum fal_cut {
    CUT_NONE,    /* renamed */
    CUT_QKV,     /* lora_A copied to each part, lora_B cut into three equal blocks of rows */
    CUT_LINEAR1, /* lora_A copied to each part, lora_B cut at FAL_INNER x 3 and FAL_MLP rows */
    CUT_SWAP     /* each factor's two halves of rows swapped (swap_scale_shift: shift, scale = chunk(2)) */
};

/* Which of a module's biases diffusers converts: it looks for the others
 * under a name it does not pop (or not at all), so they are left over. */
enum fal_bias { NO_BIAS, BOTH_BIASES, B_BIAS };

struct fal_module {
    const char *theirs; /* after the block's name */
    enum fal_cut cut;
    enum fal_bias bias;
    const char *ours[4]; /* diffusers' module, or its parts */
    int guidance;        /* converted only where a key left holds "guidance" */
};

/* A norm's scale a control LoRA holds whole, loaded into the model as its weight. */
struct fal_norm {
    const char *theirs, *ours; /* after the block's name */
};

/* In the order diffusers pops them, for each factor of a block. */
static const struct fal_module DOUBLE[] = {
    {"img_mod.lin", CUT_NONE, NO_BIAS, {"norm1.linear"}, 0},
    {"txt_mod.lin", CUT_NONE, NO_BIAS, {"norm1_context.linear"}, 0},
    {"img_attn.qkv", CUT_QKV, NO_BIAS, {"attn.to_q", "attn.to_k", "attn.to_v"}, 0},
    {"txt_attn.qkv", CUT_QKV, NO_BIAS, {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}, 0},
    {"img_mlp.0", CUT_NONE, BOTH_BIASES, {"ff.net.0.proj"}, 0},
    {"img_mlp.2", CUT_NONE, BOTH_BIASES, {"ff.net.2"}, 0},
    {"txt_mlp.0", CUT_NONE, BOTH_BIASES, {"ff_context.net.0.proj"}, 0},
    {"txt_mlp.2", CUT_NONE, BOTH_BIASES, {"ff_context.net.2"}, 0},
    {"img_attn.proj", CUT_NONE, BOTH_BIASES, {"attn.to_out.0"}, 0},
    {"txt_attn.proj", CUT_NONE, BOTH_BIASES, {"attn.to_add_out"}, 0},
};
static const struct fal_module SINGLE[] = {
    {"modulation.lin", CUT_NONE, BOTH_BIASES, {"norm.linear"}, 0},
    {"linear1", CUT_LINEAR1, B_BIAS, {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}, 0},
    {"linear2", CUT_NONE, BOTH_BIASES, {"proj_out"}, 0},
};
static const struct fal_module FINAL[] = {
    {"final_layer.linear", CUT_NONE, BOTH_BIASES, {"proj_out"}, 0},
};

/* BFL's control form (_convert_bfl_flux_control_lora_to_diffusers): the
 * embedders too, and the final modulation; every bias under the name
 * diffusers pops, whatever a table's `bias` says (lora_A's are refused:
 * PEFT's layer has none), the fused qkvs' lora_B.bias cut as their lora_B;
 * and the blocks' norms. */
static const struct fal_module CONTROL_EMBEDDERS[] = {
    {"time_in.in_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.timestep_embedder.linear_1"}, 0},
    {"time_in.out_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.timestep_embedder.linear_2"}, 0},
    {"vector_in.in_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.text_embedder.linear_1"}, 0},
    {"vector_in.out_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.text_embedder.linear_2"}, 0},
    {"guidance_in.in_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.guidance_embedder.linear_1"}, 1},
    {"guidance_in.out_layer", CUT_NONE, BOTH_BIASES, {"time_text_embed.guidance_embedder.linear_2"}, 1},
    {"txt_in", CUT_NONE, BOTH_BIASES, {"context_embedder"}, 0},
    {"img_in", CUT_NONE, BOTH_BIASES, {"x_embedder"}, 0},
};
static const struct fal_module CONTROL_FINAL[] = {
    {"final_layer.linear", CUT_NONE, BOTH_BIASES, {"proj_out"}, 0},
    {"final_layer.adaLN_modulation.1", CUT_SWAP, BOTH_BIASES, {"norm_out.linear"}, 0},
};
static const struct fal_norm CONTROL_DOUBLE_NORMS[] = {
    {"img_attn.norm.query_norm.scale", "attn.norm_q.weight"},
    {"img_attn.norm.key_norm.scale", "attn.norm_k.weight"},
    {"txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"},
    {"txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"},
};
static const struct fal_norm CONTROL_SINGLE_NORMS[] = {
    {"norm.query_norm.scale", "attn.norm_q.weight"},
    {"norm.key_norm.scale", "attn.norm_k.weight"},
};

/* A form's groups: the double blocks, then the single ones, then the final
 * layer (the control form's embedders first). */
struct fal_group {
    const char *theirs, *ours; /* the block's name before its number ("": the model's own module) */
    unsigned blocks;           /* 0: not numbered */
    const struct fal_module *modules;
    size_t nmodules;
    const struct fal_norm *norms; /* taken after the block's factors */
    size_t nnorms;
};

static const struct fal_group FAL_GROUPS[] = {
    {"double_blocks.", "transformer_blocks.", FAL_DOUBLE_BLOCKS, DOUBLE, COUNT(DOUBLE), NULL, 0},
    {"single_blocks.", "single_transformer_blocks.", FAL_SINGLE_BLOCKS, SINGLE, COUNT(SINGLE), NULL, 0},
    {"", "", 0, FINAL, COUNT(FINAL), NULL, 0},
};
static const struct fal_group CONTROL_GROUPS[] = {
    {"", "", 0, CONTROL_EMBEDDERS, COUNT(CONTROL_EMBEDDERS), NULL, 0},
    {"double_blocks.", "transformer_blocks.", FAL_DOUBLE_BLOCKS, DOUBLE, COUNT(DOUBLE), CONTROL_DOUBLE_NORMS,
     COUNT(CONTROL_DOUBLE_NORMS)},
    {"single_blocks.", "single_transformer_blocks.", FAL_SINGLE_BLOCKS, SINGLE, COUNT(SINGLE), CONTROL_SINGLE_NORMS,
     COUNT(CONTROL_SINGLE_NORMS)},
    {"", "", 0, CONTROL_FINAL, COUNT(CONTROL_FINAL), NULL, 0},
};

/* One of the two BFL-named forms. */
struct fal_form {
    const char *prefix; /* before every key */
    const char *what;   /* for messages: how diffusers tells the form, and its name */
    const char *holds;  /* for messages: what the form has */
    const struct fal_group *groups;
    size_t ngroups;
    int control; /* every bias taken (lora_A's refused), whatever a module's `bias` says */
};

static const struct fal_form FAL_FORM = {
    FAL_PREFIX, "a LoRA with \"base_model\" in a key as fal's FLUX.1 Kontext form",
    "each factor of every module of FLUX.1's 19 double blocks, 38 single blocks and final layer", FAL_GROUPS,
    COUNT(FAL_GROUPS), 0};
static const struct fal_form CONTROL_FORM = {
    "", "a LoRA with \"" CONTROL_MARK "\" in a key as BFL's FLUX.1 control form (Canny, Depth)",
    "each factor of every module of FLUX.1's embedders, 19 double blocks, 38 single blocks and final layer, and the "
    "blocks' query and key norms", CONTROL_GROUPS, COUNT(CONTROL_GROUPS), 1};

static const char FACTORS[2] = {'A', 'B'};

struct conversion {
    const char *path;
    const struct fal_form *form;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), sorted */
    size_t nkeys;
    struct lora_rewrite rw;
};

/* One module of one block: where its names start, theirs and ours. */
struct fal_place {
    char theirs[FAL_NAME_MAX], ours[FAL_NAME_MAX];
};

static void place_block(struct fal_place *p, const struct conversion *cv, const struct fal_group *g, unsigned block)
{
    char number[16] = "";
    if (g->blocks)
        snprintf(number, sizeof number, "%u.", block);
    snprintf(p->theirs, sizeof p->theirs, "%s%s%s", cv->form->prefix, g->theirs, number);
    snprintf(p->ours, sizeof p->ours, "%s%s", g->ours, number);
}

static void place_module(struct fal_place *p, const struct conversion *cv, const struct fal_group *g, unsigned block,
                         const struct fal_module *m)
{
    place_block(p, cv, g, block);
    strncat(p->theirs, m->theirs, sizeof p->theirs - strlen(p->theirs) - 1);
}

/* Adds `k` as ours + part + suffix for each part of `m`: lora_A's copied to
 * each, lora_B's cut by rows where the module is fused; or each swapped. */
static int add_parts(struct conversion *cv, const struct fal_place *p, const struct fal_module *m,
                     const struct lora_key *k, char factor, const char *suffix)
{
    const struct st_tensor *t = k->t->t;
    const size_t nparts = m->cut == CUT_QKV ? 3 : m->cut == CUT_LINEAR1 ? 4 : 1;
    uint64_t sizes[4] = {0}, row0 = 0;
    int code = NF4_OK;
    if ((m->cut == CUT_QKV || m->cut == CUT_LINEAR1) && factor == 'B') {
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
    } else if (m->cut == CUT_SWAP) {
        if (t->ndim == 0 || t->ndim > 2)
            return nf4_fail(NF4_EDATA, cv->path, t->name, "has %zu dimensions, but diffusers cuts it by rows into two "
                            "halves (shift and scale), which it swaps", t->ndim);
        if ((code = lora_check_factor_dtype(cv->path, t)) != NF4_OK)
            return code;
        if (t->shape[0] < 2) /* chunk(2) gives one block, which does not unpack into two */
            return nf4_fail(NF4_EDATA, cv->path, t->name, "has fewer than two rows (%" PRIu64 "), but diffusers cuts "
                            "it into two halves (shift and scale)", t->shape[0]);
        sizes[0] = t->shape[0];
        row0 = (t->shape[0] + 1) / 2; /* the second half, then the first: cat([scale, shift]) */
    }
    for (size_t j = 0; j < nparts && code == NF4_OK; j++) {
        char factor_name[FAL_NAME_MAX];
        if (snprintf(factor_name, sizeof factor_name, "%s%s.lora_%c.%s", p->ours, m->ours[j], factor, suffix) >=
            (int)sizeof factor_name)
            return nf4_fail(NF4_ESOFTWARE, cv->path, t->name, "a name made for it is too long");
        code = sizes[j] ? lora_rewrite_add_rows(&cv->rw, FAL_TARGET, factor_name, k->t, row0, sizes[j])
                        : lora_rewrite_add_copy(&cv->rw, FAL_TARGET, factor_name, k->t);
        row0 += m->cut == CUT_SWAP ? 0 : sizes[j];
    }
    return code;
}

static int missing(const struct conversion *cv, const char *name)
{
    return nf4_fail(NF4_EDATA, cv->path, name, "is missing: diffusers converts %s, which has %s", cv->form->what,
                    cv->form->holds);
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
        return missing(cv, name);
    k->taken = 1;
    int code = add_parts(cv, p, m, k, factor, "weight");
    const enum fal_bias bias = cv->form->control ? BOTH_BIASES : m->bias;
    if (code != NF4_OK || !(bias == BOTH_BIASES || (bias == B_BIAS && factor == 'B')))
        return code;
    if (snprintf(name, sizeof name, "%s.lora_%c.bias", p->theirs, factor) >= (int)sizeof name)
        return nf4_fail(NF4_ESOFTWARE, cv->path, p->theirs, "a name made for it is too long");
    if (!(k = lora_key_available(cv->keys, cv->nkeys, name)))
        return NF4_OK;
    k->taken = 1;
    if (cv->form->control && factor == 'A')
        return nf4_fail(NF4_EDATA, cv->path, name, "is a lora_A bias, which PEFT's LoRA layer does not have "
                        "(diffusers loads the file without it, with a warning); nf4deq does not merge such a file");
    return add_parts(cv, p, m, k, factor, "bias");
}

/* Whether a key not yet taken holds "guidance" (the control form's has_guidance, asked for each factor). */
static int guidance_left(const struct conversion *cv)
{
    for (size_t i = 0; i < cv->nkeys; i++)
        if (!cv->keys[i].taken && strstr(cv->keys[i].name, "guidance"))
            return 1;
    return 0;
}

/* A block's norms: each scale there, copied whole under diffusers' name. */
static int convert_norms(struct conversion *cv, const struct fal_group *g, unsigned block)
{
    int code = NF4_OK;
    for (size_t i = 0; i < g->nnorms && code == NF4_OK; i++) {
        struct fal_place p;
        place_block(&p, cv, g, block);
        char theirs[FAL_NAME_MAX], ours[FAL_NAME_MAX];
        if (snprintf(theirs, sizeof theirs, "%s%s", p.theirs, g->norms[i].theirs) >= (int)sizeof theirs ||
            snprintf(ours, sizeof ours, "%s%s", p.ours, g->norms[i].ours) >= (int)sizeof ours)
            return nf4_fail(NF4_ESOFTWARE, cv->path, p.theirs, "a name made for it is too long");
        struct lora_key *k = lora_key_available(cv->keys, cv->nkeys, theirs);
        if (!k)
            return missing(cv, theirs);
        k->taken = 1;
        code = lora_rewrite_add_copy(&cv->rw, FAL_TARGET, ours, k->t);
    }
    return code;
}

/* Every module of every block, in diffusers' order; then anything left
 * over refused, as diffusers raises. */
static int convert_keys(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t g = 0; g < cv->form->ngroups && code == NF4_OK; g++) {
        const struct fal_group *group = &cv->form->groups[g];
        for (unsigned b = 0; b < (group->blocks ? group->blocks : 1) && code == NF4_OK; b++) {
            for (size_t f = 0; f < COUNT(FACTORS) && code == NF4_OK; f++) {
                const int guidance = guidance_left(cv);
                for (size_t i = 0; i < group->nmodules && code == NF4_OK; i++) {
                    if (group->modules[i].guidance && !guidance)
                        continue;
                    struct fal_place p;
                    place_module(&p, cv, group, b, &group->modules[i]);
                    code = convert_factor(cv, &p, &group->modules[i], FACTORS[f]);
                }
            }
            if (code == NF4_OK)
                code = convert_norms(cv, group, b);
        }
    }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over where diffusers converts %s, "
                            "and raises: a key of none of its modules' factors%s, or a bias it does not carry over",
                            cv->form->what, cv->form->control ? " or norms" : "");
    return code;
}

static int holds_base_model(const char *key)
{
    return strstr(key, "base_model") != NULL;
}

/* Whether `key` is under one of the fal form's names, as fal's are. */
static int in_fal_form(const char *key)
{
    if (!str_starts_with(key, FAL_PREFIX))
        return 0;
    for (size_t g = 0; g < COUNT(FAL_GROUPS); g++) {
        const char *root = FAL_GROUPS[g].blocks ? FAL_GROUPS[g].theirs : FAL_GROUPS[g].modules[0].theirs;
        if (str_starts_with(key + strlen(FAL_PREFIX), root))
            return 1;
    }
    return 0;
}

int fal_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_base_model) && lora_model_any_key(w, in_fal_form);
}

static int holds_control_mark(const char *key)
{
    return !lora_is_dora_scale(key) && strstr(key, CONTROL_MARK) != NULL;
}

int bfl_control_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_control_mark);
}

static int convert_form(const struct model *w, const char *path, const struct fal_form *form, int warn,
                        struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .form = form, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
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

int fal_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return convert_form(w, path, &FAL_FORM, warn, out);
}

int bfl_control_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return convert_form(w, path, &CONTROL_FORM, warn, out);
}
