#include "lora_qwen.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define QWEN_DOWN ".lora_down.weight"
#define QWEN_UP ".lora_up.weight"
#define QWEN_A ".lora_A.weight"
#define QWEN_B ".lora_B.weight"
#define QWEN_ALPHA ".alpha"
#define QWEN_UNET "lora_unet_"
#define QWEN_COMFY "diffusion_model."
#define QWEN_PEFT_ADAPTER "default."
#define QWEN_BLOCKS "transformer_blocks"

/* Modules outside the blocks, by kohya's name and diffusers': kohya's names of
 * these are mapped whole, before the blocks' rule (which would garble them). */
static const char *const TOP_LEVEL[][2] = {
    {"img_in", "img_in"},
    {"txt_in", "txt_in"},
    {"proj_out", "proj_out"},
    {"norm_out_linear", "norm_out.linear"},
    {"time_text_embed_timestep_embedder_linear_1", "time_text_embed.timestep_embedder.linear_1"},
    {"time_text_embed_timestep_embedder_linear_2", "time_text_embed.timestep_embedder.linear_2"},
};

/* Runs of a block's name kept whole, with their underscores: the longest
 * first at each word. */
static const char *const KEPT_WHOLE[][3] = {
    {"add", "q", "proj"}, {"add", "k", "proj"}, {"add", "v", "proj"}, {"to", "add", "out"},
    {"to", "q", NULL},    {"to", "k", NULL},    {"to", "v", NULL},    {"to", "out", NULL},
    {"add", "q", NULL},   {"add", "k", NULL},   {"add", "v", NULL},   {"txt", "mlp", NULL},
    {"img", "mlp", NULL}, {"txt", "mod", NULL}, {"img", "mod", NULL},
};

struct conversion {
    const char *path;
    struct lora_key *keys;
    size_t nkeys;
    struct lora_key **order; /* the keys in diffusers' order: their data's in the file */
    struct lora_rewrite rw;
};

static void note_left_out(struct conversion *cv, const char *key)
{
    lora_rewrite_leave_out(&cv->rw, key, strlen(key), 1);
}

/* ---- names ---- */

/* The words of `head` from `i` on start a run kept whole: its length, else 0. */
static size_t kept_whole(char *const *words, size_t n, size_t i)
{
    for (size_t k = 0; k < sizeof KEPT_WHOLE / sizeof KEPT_WHOLE[0]; k++) {
        size_t len = KEPT_WHOLE[k][2] ? 3 : 2;
        size_t j = 0;
        while (j < len && i + j < n && strcmp(words[i + j], KEPT_WHOLE[k][j]) == 0)
            j++;
        if (j == len)
            return len;
    }
    return 0;
}

/* diffusers' convert_key of a kohya name (less "lora_unet_"): a top-level
 * module mapped whole; else, whatever the key holds, its first 19 characters taken
 * for "transformer_blocks_", the rest up to the first dot (and before the
 * last one) split at underscores and joined with dots but for the runs kept
 * whole. Allocated; NULL when out of memory. */
static char *kohya_key(const char *key)
{
    for (size_t k = 0; k < sizeof TOP_LEVEL / sizeof TOP_LEVEL[0]; k++) {
        size_t n = strlen(TOP_LEVEL[k][0]);
        if (strncmp(key, TOP_LEVEL[k][0], n) == 0 && (key[n] == '\0' || key[n] == '.')) {
            struct strbuf b = {0};
            strbuf_printf(&b, "%s%s", TOP_LEVEL[k][1], key + n);
            return b.oom ? (free(b.p), NULL) : b.p;
        }
    }
    const char *last_dot = strrchr(key, '.');
    const size_t base_len = last_dot ? (size_t)(last_dot - key) : strlen(key);
    /* Python slices characters: skip as many UTF-8 sequences (names are valid UTF-8). */
    const char *rest = key, *base_end = key + base_len;
    for (size_t k = 0; k < strlen(QWEN_BLOCKS "_") && rest < base_end; k++)
        do
            rest++;
        while (rest < base_end && ((unsigned char)*rest & 0xC0) == 0x80);
    const char *dot = memchr(rest, '.', (size_t)(base_end - rest));
    const char *head_end = dot ? dot : base_end;
    char *head = strndup(rest, (size_t)(head_end - rest));
    size_t nwords = 1;
    for (const char *p = head; p && *p; p++)
        nwords += *p == '_';
    char **words = head ? calloc(nwords, sizeof *words) : NULL;
    struct strbuf b = {0};
    if (!words) {
        free(head);
        return NULL;
    }
    words[0] = head;
    for (size_t i = 1; i < nwords; i++) {
        words[i] = strchr(words[i - 1], '_');
        *words[i]++ = '\0';
    }
    strbuf_puts(&b, QWEN_BLOCKS ".");
    for (size_t i = 0; i < nwords;) {
        size_t len = kept_whole(words, nwords, i);
        if (!len)
            len = 1;
        for (size_t j = 0; j < len; j++)
            strbuf_printf(&b, "%s%s", j ? "_" : i ? "." : "", words[i + j]);
        i += len;
    }
    strbuf_put(&b, head_end, (size_t)(base_end - head_end)); /* the tail: from the first dot on */
    if (last_dot && last_dot[1])
        strbuf_puts(&b, last_dot); /* the suffix, where not empty */
    free(words);
    free(head);
    return b.oom ? (free(b.p), NULL) : b.p;
}

static struct lora_key *find_key(const struct conversion *cv, const char *name)
{
    return lora_key_find(cv->keys, cv->nkeys, name);
}

/* The forms diffusers converts, over the keys but DoRA scales. */
struct forms {
    int alpha, unet, comfy, peft_adapter;
};

static struct forms forms_of(const struct model *w)
{
    struct forms f = {0};
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (lora_is_dora_scale(key))
            continue;
        f.alpha |= str_has_suffix(key, QWEN_ALPHA);
        f.unet |= str_starts_with(key, QWEN_UNET);
        f.comfy |= str_starts_with(key, QWEN_COMFY);
        f.peft_adapter |= strstr(key, QWEN_PEFT_ADAPTER) != NULL;
    }
    return f;
}

int qwen_lora_detect(const struct model *w)
{
    struct forms f = forms_of(w);
    return f.alpha || f.unet || f.comfy || f.peft_adapter;
}

static char *without_comfy_prefix(const char *name)
{
    return strdup(str_starts_with(name, QWEN_COMFY) ? name + strlen(QWEN_COMFY) : name);
}

static char *from_kohya(const char *name)
{
    return kohya_key(str_starts_with(name, QWEN_UNET) ? name + strlen(QWEN_UNET) : name);
}

static char *without_peft_adapter(const char *name)
{
    return str_replace_all(name, QWEN_PEFT_ADAPTER, "");
}

/* Each key (DoRA scales left out) under diffusers' name: each renaming
 * applies to every key where any key, as renamed so far, is of its form, in
 * diffusers' order. Sorted; two keys that become one are refused (diffusers
 * keeps one of them). */
static int rename_keys(struct conversion *cv, const struct model *w)
{
    cv->keys = calloc(w->count ? w->count : 1, sizeof *cv->keys);
    if (!cv->keys)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (lora_is_dora_scale(key)) { /* diffusers: "not compatible ... filter out" */
            note_left_out(cv, key);
            continue;
        }
        if (!(cv->keys[cv->nkeys].name = strdup(key)))
            return nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
        cv->keys[cv->nkeys++].t = &w->tensors[i];
    }
    int code = NF4_OK;
    if (lora_keys_any_start(cv->keys, cv->nkeys, QWEN_COMFY))
        code = lora_keys_rename(cv->path, cv->keys, cv->nkeys, without_comfy_prefix);
    if (code == NF4_OK && lora_keys_any_start(cv->keys, cv->nkeys, QWEN_UNET))
        code = lora_keys_rename(cv->path, cv->keys, cv->nkeys, from_kohya);
    int peft_adapter = 0;
    for (size_t i = 0; i < cv->nkeys; i++)
        peft_adapter |= strstr(cv->keys[i].name, QWEN_PEFT_ADAPTER) != NULL;
    if (code == NF4_OK && peft_adapter)
        code = lora_keys_rename(cv->path, cv->keys, cv->nkeys, without_peft_adapter);
    if (code != NF4_OK)
        return code;
    lora_keys_sort(cv->keys, cv->nkeys);
    if (!(cv->order = lora_keys_in_file_order(cv->keys, cv->nkeys)))
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    return lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
}

/* ---- factors ---- */

/* The pair `down`, `up` (keys of cv) as "transformer." + a_name / b_name,
 * with the alpha at alpha_name if there is one folded in. */
static int convert_pair(struct conversion *cv, struct lora_key *down, struct lora_key *up, const char *a_name,
                        const char *b_name, const char *alpha_name)
{
    down->taken = up->taken = 1;
    struct lora_key *alpha = find_key(cv, alpha_name);
    if (alpha && alpha->taken) /* diffusers pops it: a second pair naming it gets none */
        alpha = NULL;
    if (alpha)
        alpha->taken = 1;
    return lora_rewrite_add_folded(&cv->rw, "transformer.", a_name, b_name, down->t, up->t, alpha ? alpha->t : NULL);
}

/* Names from `key` with its suffix `from` replaced (every occurrence, as
 * str.replace). */
struct names {
    char *other, *a, *b, *alpha;
};

static void names_free(struct names *n)
{
    free(n->other);
    free(n->a);
    free(n->b);
    free(n->alpha);
}

/* kohya's factors (lora_down, lora_up): each down with its up, which must be there. */
static int convert_kohya_pairs(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *down = cv->order[i];
        if (!str_has_suffix(down->name, QWEN_DOWN))
            continue;
        struct names n = {str_replace_all(down->name, QWEN_DOWN, QWEN_UP), str_replace_all(down->name, QWEN_DOWN, QWEN_A),
                          NULL, str_replace_all(down->name, QWEN_DOWN, QWEN_ALPHA)};
        n.b = n.other ? str_replace_all(n.other, QWEN_UP, QWEN_B) : NULL;
        struct lora_key *up = n.other ? find_key(cv, n.other) : NULL;
        if (!n.other || !n.a || !n.b || !n.alpha)
            code = nf4_fail(NF4_ESOFTWARE, cv->path, down->t->t->name, "out of memory");
        else if (!up || up->taken) /* diffusers pops each up: a second down naming it finds none */
            code = nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching lora_up.weight");
        else
            code = convert_pair(cv, down, up, n.a, n.b, n.alpha);
        names_free(&n);
    }
    return code;
}

/* PEFT's factors (lora_A, lora_B), with alphas: each A with its B and each B
 * with its A. */
static int convert_peft_pairs(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *a = cv->order[i];
        if (!str_has_suffix(a->name, QWEN_A))
            continue;
        struct names n = {str_replace_all(a->name, QWEN_A, QWEN_B), NULL, NULL,
                          str_replace_all(a->name, QWEN_A, QWEN_ALPHA)};
        struct lora_key *b = n.other ? find_key(cv, n.other) : NULL;
        if (!n.other || !n.alpha)
            code = nf4_fail(NF4_ESOFTWARE, cv->path, a->t->t->name, "out of memory");
        else if (!b || b->taken)
            code = nf4_fail(NF4_EDATA, cv->path, a->t->t->name, "has no matching lora_B.weight");
        else
            code = convert_pair(cv, a, b, a->name, b->name, n.alpha);
        names_free(&n);
    }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (str_has_suffix(cv->keys[i].name, QWEN_B) && !cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "has no matching lora_A.weight");
    return code;
}

/* The factors in kohya's form where any key is one, else PEFT's; then every
 * alpha goes, and what is left is refused (diffusers: "state_dict should be
 * empty"). */
static int convert_factors(struct conversion *cv)
{
    int kohya = 0, peft = 0;
    for (size_t i = 0; i < cv->nkeys; i++) {
        kohya |= strstr(cv->keys[i].name, QWEN_DOWN) || strstr(cv->keys[i].name, QWEN_UP);
        peft |= strstr(cv->keys[i].name, QWEN_A) || strstr(cv->keys[i].name, QWEN_B);
    }
    int code = kohya ? convert_kohya_pairs(cv) : peft ? convert_peft_pairs(cv) : NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *k = &cv->keys[i];
        if (k->taken)
            continue;
        if (!strstr(k->name, QWEN_ALPHA))
            return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is not a LoRA factor diffusers reads from a "
                            "Qwen-Image LoRA in this file (%s)", kohya ? "lora_down/lora_up pairs"
                            : peft ? "lora_A/lora_B pairs" : "it holds no factor pair");
        note_left_out(cv, k->t->t->name); /* an alpha without its pair */
    }
    if (code == NF4_OK && cv->rw.nparts == 0)
        return nf4_fail(NF4_EDATA, cv->path, NULL, "holds no LoRA factor pair (lora_down/lora_up or lora_A/lora_B)");
    return code;
}

int qwen_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    int code = rename_keys(&cv, w);
    if (code == NF4_OK)
        code = convert_factors(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales or alphas without factors, which diffusers "
                               "drops from a Qwen-Image LoRA", out);
    lora_keys_free(cv.keys, cv.nkeys);
    free(cv.order);
    return code;
}
