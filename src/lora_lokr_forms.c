#include "lora_lokr_forms.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_lokr.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
#define LOKR_TARGET "transformer."
#define LOKR_ALPHA ".alpha"
#define LOKR_NAME_MAX 1024
#define AI_TOOLKIT_NAMES "diffusion_model."
#define PEFT_NAMES "base_model.model." /* Flux.2's loader reads it as AI_TOOLKIT_NAMES */

/* The factors diffusers' Flux.2 conversions carry over (_LOKR_SUFFIXES; not lokr_t2). */
static const char *const CARRIED[] = {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), renamed by the form, sorted */
    size_t nkeys;
    float *scale; /* per key: the alpha baked into it (1 where none is) */
    unsigned char *scaled;
    struct lora_rewrite rw;
};

/* ---- the alphas ---- */

/* The rank an alpha of `module` is divided by: the rows of its lokr_w2_b,
 * else of its lokr_w1_b; 0 where it has neither. */
static int alpha_rank(struct conversion *cv, const struct lora_key *alpha, const char *module, size_t len,
                      uint64_t *rank)
{
    static const char *const HALVES[] = {".lokr_w2_b", ".lokr_w1_b"};
    *rank = 0;
    for (size_t h = 0; h < COUNT(HALVES); h++) {
        char name[LOKR_NAME_MAX];
        snprintf(name, sizeof name, "%.*s%s", (int)len, module, HALVES[h]);
        const struct lora_key *half = lora_key_find(cv->keys, cv->nkeys, name);
        if (!half)
            continue;
        if (half->t->t->ndim == 0 || half->t->t->shape[0] == 0)
            return nf4_fail(NF4_EDATA, cv->path, half->t->t->name, "has no rows to divide %s's alpha by "
                            "(diffusers raises)", alpha->t->t->name);
        *rank = half->t->t->shape[0];
        return NF4_OK;
    }
    return NF4_OK;
}

/* diffusers' _bake_lokr_alpha_: every alpha taken, and where its module is
 * split, alpha / r noted on the module's first factor. */
static int bake_alphas(struct conversion *cv)
{
    cv->scale = malloc((cv->nkeys ? cv->nkeys : 1) * sizeof *cv->scale);
    cv->scaled = calloc(cv->nkeys ? cv->nkeys : 1, 1);
    if (!cv->scale || !cv->scaled)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->nkeys; i++)
        cv->scale[i] = 1.0f;
    for (size_t i = 0; i < cv->nkeys; i++) {
        struct lora_key *alpha = &cv->keys[i];
        if (!str_ends_with(alpha->name, LOKR_ALPHA))
            continue;
        alpha->taken = 1;
        const size_t len = strlen(alpha->name) - strlen(LOKR_ALPHA);
        double value;
        uint64_t rank;
        /* LoKr's alpha only scales W1: a negative one is a sign, as in diffusers */
        int code = lora_read_number(cv->path, alpha->t, &value);
        if (code == NF4_OK && !isfinite(value))
            code = nf4_fail(NF4_EDATA, cv->path, alpha->t->t->name, "is %g; an alpha is a finite number (diffusers "
                            "would merge NaN or infinite weights)", value);
        if (code == NF4_OK)
            code = alpha_rank(cv, alpha, alpha->name, len, &rank);
        if (code != NF4_OK)
            return code;
        if (rank == 0) /* both factors whole: LoKr scales them by nothing, and the alpha goes */
            continue;
        char name[LOKR_NAME_MAX];
        snprintf(name, sizeof name, "%.*s.lokr_w1", (int)len, alpha->name);
        struct lora_key *first = lora_key_find(cv->keys, cv->nkeys, name);
        if (!first) {
            snprintf(name, sizeof name, "%.*s.lokr_w1_a", (int)len, alpha->name);
            first = lora_key_find(cv->keys, cv->nkeys, name);
        }
        if (!first)
            return nf4_fail(NF4_EDATA, cv->path, alpha->t->t->name, "is the alpha of a LoKr without lokr_w1 or "
                            "lokr_w1_a to bake it into (diffusers raises)");
        const size_t k = (size_t)(first - cv->keys);
        cv->scale[k] = (float)(value / (double)rank); /* Python's alpha / rank, then torch's fp32 scalar */
        cv->scaled[k] = 1;
    }
    return NF4_OK;
}

/* ---- the parts ---- */

/* Key `k` under `name` (after LOKR_TARGET): its baked alpha in, or its bytes. */
static int add_key(struct conversion *cv, struct lora_key *k, const char *name)
{
    k->taken = 1;
    const size_t i = (size_t)(k - cv->keys);
    if (!cv->scaled[i])
        return lora_rewrite_add_copy(&cv->rw, LOKR_TARGET, name, k->t);
    const struct st_tensor *t = k->t->t;
    int code = lora_check_factor_dtype(cv->path, t);
    if (code != NF4_OK)
        return code;
    if (t->ndim != 2)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "is a LoKr factor of %zu dimensions, not a matrix: nf4deq "
                        "merges LoKr on linear layers only", t->ndim);
    return lora_rewrite_add(&cv->rw, LOKR_TARGET, name, k->t, t->dtype, t->shape[0], t->shape[1], 0, 0,
                            cv->scale[i]);
}

/* The keys: PEFT's "base_model.model." made "diffusion_model." in each
 * where `peft` (str.replace), then `remove_prefix` removed where given;
 * sorted and each once; the alphas baked. */
static int read_keys(struct conversion *cv, const struct model *w, int peft, const char *remove_prefix)
{
    lora_rewrite_leave_out_dora(&cv->rw, w); /* dropped before the conversion, with a warning */
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (strchr(cv->keys[i].name, '\n')) /* where Python's $ would match before it */
            code = nf4_fail(NF4_EDATA, cv->path, NULL, "has a key with a line break in its name, which nf4deq does "
                            "not read as a LoKr's");
    if (code == NF4_OK && peft)
        code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, PEFT_NAMES, AI_TOOLKIT_NAMES);
    if (code != NF4_OK)
        return code;
    if (remove_prefix)
        lora_keys_remove_prefix(cv->keys, cv->nkeys, remove_prefix);
    lora_keys_sort(cv->keys, cv->nkeys);
    code = lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
    return code == NF4_OK ? bake_alphas(cv) : code;
}

static int finish(struct conversion *cv, int code, int warn, struct model **out)
{
    if (code == NF4_OK && cv->rw.nparts == 0)
        code = nf4_fail(NF4_EDATA, cv->path, NULL, "holds no LoKr factor diffusers loads");
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv->rw);
    code = lora_rewrite_finish(&cv->rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(cv->keys, cv->nkeys);
    free(cv->scale);
    free(cv->scaled);
    return code;
}

/* How a form names key `k` in diffusers' own form (after LOKR_TARGET), into
 * `name`: NF4_OK, or NF4_EDATA naming the key where diffusers has no rule
 * for it (and raises). */
typedef int (*lokr_name_fn)(const struct conversion *cv, const struct lora_key *k, char *name, size_t size);

/* The keys read (read_keys: `peft`, `remove_prefix`), each but the alphas
 * under the name `name_of` gives it. */
static int convert(const struct model *w, const char *path, int peft, const char *remove_prefix, lokr_name_fn name_of,
                   int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    int code = read_keys(&cv, w, peft, remove_prefix);
    for (size_t i = 0; i < cv.nkeys && code == NF4_OK; i++) {
        struct lora_key *k = &cv.keys[i];
        char name[LOKR_NAME_MAX];
        if (k->taken)
            continue;
        if ((code = name_of(&cv, k, name, sizeof name)) == NF4_OK)
            code = add_key(&cv, k, name);
    }
    return finish(&cv, code, warn, out);
}

/* ---- module paths that are diffusers' already ---- */

static int plain_name(const struct conversion *cv, const struct lora_key *k, char *name, size_t size)
{
    if (!strstr(k->name, LOKR_MARK))
        return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is not a LoKr key (no \"" LOKR_MARK "\"), which "
                        "diffusers refuses in a LoKr file");
    snprintf(name, size, "%s", k->name);
    return NF4_OK;
}

int lokr_convert_plain(const struct model *w, const char *path, int warn, struct model **out)
{
    return convert(w, path, 0, AI_TOOLKIT_NAMES, plain_name, warn, out);
}

/* ---- Flux.2: BFL's names ---- */

/* A block's modules: BFL's name, then diffusers'. */
static const char *const DOUBLE_BLOCK[][2] = {
    {"img_attn.qkv", "attn.to_qkv"},     {"txt_attn.qkv", "attn.to_added_qkv"},
    {"img_attn.proj", "attn.to_out.0"},  {"txt_attn.proj", "attn.to_add_out"},
    {"img_mlp.0", "ff.linear_in"},       {"img_mlp.2", "ff.linear_out"},
    {"txt_mlp.0", "ff_context.linear_in"}, {"txt_mlp.2", "ff_context.linear_out"},
};
static const char *const SINGLE_BLOCK[][2] = {
    {"linear1", "attn.to_qkv_mlp_proj"},
    {"linear2", "attn.to_out"},
};
static const char *const TOP_LEVEL[][2] = {
    {"img_in", "x_embedder"},
    {"txt_in", "context_embedder"},
    {"time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"},
    {"time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"},
    {"guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"},
    {"guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"},
    {"final_layer.linear", "proj_out"},
    {"final_layer.adaLN_modulation.1", "norm_out.linear"},
    {"single_stream_modulation.lin", "single_stream_modulation.linear"},
    {"double_stream_modulation_img.lin", "double_stream_modulation_img.linear"},
    {"double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"},
};

/* The factor `rest` names after a module (".lokr_w1"), if diffusers carries it. */
static int carried(const char *rest)
{
    for (size_t f = 0; rest[0] == '.' && f < COUNT(CARRIED); f++)
        if (strcmp(rest + 1, CARRIED[f]) == 0)
            return 1;
    return 0;
}

/* The name diffusers gives a key of `n` modules of `map` (`at`: the key
 * after its block's "N."), into `name` under `root`; 0 where it gives none. */
static int mapped(const char *at, const char *const (*map)[2], size_t n, const char *root, char *name, size_t size)
{
    for (size_t m = 0; m < n; m++) {
        const size_t len = strlen(map[m][0]);
        if (strncmp(at, map[m][0], len) == 0 && carried(at + len)) {
            snprintf(name, size, "%s%s%s", root, map[m][1], at + len);
            return 1;
        }
    }
    return 0;
}

/* Whether s[0..len) is how Python's str() writes a block number range() counts to. */
static int canonical_number(const char *s, size_t len)
{
    if (len == 0 || (len > 1 && s[0] == '0'))
        return 0;
    for (size_t i = 0; i < len; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* A key of a block, "double_blocks.N.<module>.<factor>": diffusers counts
 * the blocks by int() of N (raising where it is none), and remaps the keys
 * of the blocks it counted, named as str() writes N. */
static int bfl_block_key(const struct conversion *cv, const struct lora_key *k, int dbl, char *name, size_t size,
                         int *found)
{
    const char *number = strchr(k->name, '.') + 1, *dot = strchr(number, '.');
    const size_t len = dot ? (size_t)(dot - number) : strlen(number);
    int64_t block;
    if (!lora_python_int(number, len, &block))
        return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a block number diffusers' int() does not read "
                        "(it raises)");
    char root[64];
    snprintf(root, sizeof root, "%s.%.*s.", dbl ? "transformer_blocks" : "single_transformer_blocks", (int)len,
             number);
    *found = dot && canonical_number(number, len) &&
             (dbl ? mapped(dot + 1, DOUBLE_BLOCK, COUNT(DOUBLE_BLOCK), root, name, size)
                  : mapped(dot + 1, SINGLE_BLOCK, COUNT(SINGLE_BLOCK), root, name, size));
    return NF4_OK;
}

static int bfl_name(const struct conversion *cv, const struct lora_key *k, char *name, size_t size)
{
    int code = NF4_OK, found = 0;
    const int dbl = str_starts_with(k->name, "double_blocks.");
    if (dbl || str_starts_with(k->name, "single_blocks."))
        code = bfl_block_key(cv, k, dbl, name, size, &found);
    else
        found = mapped(k->name, TOP_LEVEL, COUNT(TOP_LEVEL), "", name, size);
    if (code == NF4_OK && !found)
        code = nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is left over where diffusers converts a Flux.2 LoKr in "
                        "BFL's names (as %s): a module or factor of no rule (it raises)", k->name);
    return code;
}

/* ---- Flux.2: LyCORIS' names ---- */

/* _LYCORIS_FLUX2_SUBPATH_MAP: LyCORIS' flattened sub-path, then diffusers'. */
static const char *const LYCORIS_SUBPATH[][2] = {
    {"attn_to_q", "attn.to_q"},
    {"attn_to_k", "attn.to_k"},
    {"attn_to_v", "attn.to_v"},
    {"attn_to_out_0", "attn.to_out.0"},
    {"attn_to_add_out", "attn.to_add_out"},
    {"attn_add_q_proj", "attn.add_q_proj"},
    {"attn_add_k_proj", "attn.add_k_proj"},
    {"attn_add_v_proj", "attn.add_v_proj"},
    {"attn_to_qkv_mlp_proj", "attn.to_qkv_mlp_proj"},
    {"attn_to_out", "attn.to_out"},
    {"ff_linear_in", "ff.linear_in"},
    {"ff_linear_out", "ff.linear_out"},
    {"ff_context_linear_in", "ff_context.linear_in"},
    {"ff_context_linear_out", "ff_context.linear_out"},
};

/* re.match(r"^lycoris_((?:single_)?transformer_blocks)_(\d+)_(.+)\.(.+)$")
 * and the sub-path map: the name diffusers gives key `k`, or 0. Only ASCII
 * digits are read as the block's (Python's \d takes others, whose name then
 * matches no module: refused all the same). */
static int lycoris_name(const char *k, char *name, size_t size)
{
    static const char *const CONTAINERS[] = {"single_transformer_blocks", "transformer_blocks"};
    if (!str_starts_with(k, "lycoris_"))
        return 0;
    const char *at = k + strlen("lycoris_");
    for (size_t c = 0; c < COUNT(CONTAINERS); c++) {
        const size_t clen = strlen(CONTAINERS[c]);
        if (strncmp(at, CONTAINERS[c], clen) != 0 || at[clen] != '_')
            continue;
        const char *number = at + clen + 1;
        const size_t digits = strspn(number, "0123456789");
        if (digits == 0 || number[digits] != '_')
            return 0;
        const char *sub = number + digits + 1, *dot = strrchr(sub, '.');
        if (dot && dot[1] == '\0') { /* (.+) after the last dot takes at least one character */
            const char *prev = dot;
            dot = NULL;
            for (const char *p = sub; p < prev; p++)
                if (*p == '.')
                    dot = p;
        }
        if (!dot || dot == sub)
            return 0;
        for (size_t m = 0; m < COUNT(LYCORIS_SUBPATH); m++)
            if (strlen(LYCORIS_SUBPATH[m][0]) == (size_t)(dot - sub) &&
                strncmp(sub, LYCORIS_SUBPATH[m][0], (size_t)(dot - sub)) == 0) {
                snprintf(name, size, "%s.%.*s.%s.%s", CONTAINERS[c], (int)digits, number, LYCORIS_SUBPATH[m][1],
                         dot + 1);
                return 1;
            }
        return 0;
    }
    return 0;
}

static int lycoris_key_name(const struct conversion *cv, const struct lora_key *k, char *name, size_t size)
{
    return lycoris_name(k->name, name, size)
               ? NF4_OK
               : nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is not a key of a LyCORIS Flux.2 LoKr "
                          "(lycoris_transformer_blocks_N_<module>.<factor>, of a module diffusers maps): diffusers "
                          "raises");
}

/* ---- Flux.2's choice ---- */

static int is_lycoris_key(const char *k)
{
    return str_starts_with(k, "lycoris_");
}

static int is_ai_toolkit_key(const char *k)
{
    return str_starts_with(k, AI_TOOLKIT_NAMES) || str_starts_with(k, PEFT_NAMES);
}

static int is_diffusers_key(const char *k)
{
    return str_starts_with(k, LOKR_TARGET);
}

static int is_lokr_key(const char *k)
{
    return strstr(k, LOKR_MARK) != NULL;
}

int lokr_flux2_converts(const struct model *w)
{
    return lora_model_any_key(w, is_lokr_key) &&
           (lora_model_any_key(w, is_lycoris_key) || lora_model_any_key(w, is_ai_toolkit_key) ||
            !lora_model_any_key(w, is_diffusers_key));
}

int lokr_convert_flux2(const struct model *w, const char *path, int warn, struct model **out)
{
    /* PEFT's prefix is made ai-toolkit's in every key first, whichever form follows */
    const int peft = lora_model_any_key_starting(w, PEFT_NAMES);
    if (lora_model_any_key(w, is_lycoris_key))
        return convert(w, path, peft, NULL, lycoris_key_name, warn, out);
    if (lora_model_any_key(w, is_ai_toolkit_key))
        return convert(w, path, peft, AI_TOOLKIT_NAMES, bfl_name, warn, out);
    return convert(w, path, peft, AI_TOOLKIT_NAMES, plain_name, warn, out);
}
