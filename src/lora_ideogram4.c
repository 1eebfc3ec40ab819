#include "lora_ideogram4.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strutil.h"

#define I4_TARGET "transformer."
#define I4_LAYERS "layers."
#define I4_QKV "attention.qkv"
#define I4_ALPHA ".alpha"
#define I4_A ".lora_A.weight"
#define I4_B ".lora_B.weight"
/* The highest layer number read: diffusers walks every number up to the
 * highest it finds (Ideogram 4 has 34 layers). */
#define I4_MAX_LAYER 100000

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* The prefixes diffusers cuts, the first any key starts with. */
static const char *const PREFIXES[] = {"diffusion_model.", "conditional_transformer."};

/* A layer's modules, in diffusers' order, and their names in diffusers' model. */
static const char *const MODULES[][2] = {
    {I4_QKV, NULL}, /* split into attention.to_q, to_k, to_v */
    {"attention.o", "attention.to_out.0"},
    {"feed_forward.w1", "feed_forward.w1"},
    {"feed_forward.w2", "feed_forward.w2"},
    {"feed_forward.w3", "feed_forward.w3"},
    {"adaln_modulation", "adaln_modulation"},
};
static const char *const QKV_PARTS[] = {"attention.to_q", "attention.to_k", "attention.to_v"};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), the prefix cut, sorted */
    size_t nkeys;
    const char *down, *up; /* the factors' suffixes: kohya's or PEFT's */
    struct lora_rewrite rw;
};

/* The pair of module `m` of layer `layer` where its down is there: its up
 * (which must be), its alpha folded in, under diffusers' names. */
static int convert_module(struct conversion *cv, uint64_t layer, const char *const m[2])
{
    char base[128], name[256];
    snprintf(base, sizeof base, I4_LAYERS "%" PRIu64 ".%s", layer, m[0]);
    snprintf(name, sizeof name, "%s%s", base, cv->down);
    struct lora_key *down = lora_key_available(cv->keys, cv->nkeys, name);
    if (!down)
        return NF4_OK;
    down->taken = 1;
    snprintf(name, sizeof name, "%s%s", base, cv->up);
    struct lora_key *up = lora_key_available(cv->keys, cv->nkeys, name);
    if (!up) /* diffusers' pop raises */
        return nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching %s, which diffusers takes with it",
                        cv->up + 1);
    up->taken = 1;
    snprintf(name, sizeof name, "%s" I4_ALPHA, base);
    struct lora_key *alpha = lora_key_available(cv->keys, cv->nkeys, name);
    if (alpha)
        alpha->taken = 1;
    if (m[1]) {
        snprintf(name, sizeof name, I4_TARGET I4_LAYERS "%" PRIu64 ".%s", layer, m[1]);
        return lora_rewrite_add_folded(&cv->rw, name, I4_A, I4_B, down->t, up->t, alpha ? alpha->t : NULL);
    }
    char targets[3][256];
    const char *const parts[3] = {targets[0], targets[1], targets[2]};
    for (size_t j = 0; j < 3; j++)
        snprintf(targets[j], sizeof targets[j], I4_TARGET I4_LAYERS "%" PRIu64 ".%s", layer, QKV_PARTS[j]);
    return lora_rewrite_add_folded_qkv(&cv->rw, parts, I4_A, I4_B, down->t, up->t, alpha ? alpha->t : NULL);
}

/* The number after "layers." at the start of `k`, where diffusers' re.match(
 * r"layers\.(\d+)\.") finds one: 1 with it in *layer, 0 where there is none;
 * NF4_EDATA (as -1) where it may be in Unicode digits or is over I4_MAX_LAYER. */
static int layer_number(const struct conversion *cv, const struct lora_key *k, uint64_t *layer)
{
    if (!str_starts_with(k->name, I4_LAYERS))
        return 0;
    const char *d = k->name + strlen(I4_LAYERS);
    uint64_t v = 0;
    size_t n = 0;
    for (; d[n] >= '0' && d[n] <= '9'; n++)
        if (v <= I4_MAX_LAYER)
            v = v * 10 + (uint64_t)(d[n] - '0');
    if ((unsigned char)d[n] >= 0x80) {
        nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a layer number that may not be ASCII digits, which nf4deq "
                 "does not read (Python's \\d reads Unicode digits)");
        return -1;
    }
    if (n == 0 || d[n] != '.')
        return 0;
    if (v > I4_MAX_LAYER) {
        nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a layer number over %d, every one up to which diffusers "
                 "would walk", I4_MAX_LAYER);
        return -1;
    }
    *layer = v;
    return 1;
}

static int convert_keys(struct conversion *cv)
{
    uint64_t layers = 0; /* diffusers' num_layers */
    for (size_t i = 0; i < cv->nkeys; i++) {
        uint64_t layer;
        int found = layer_number(cv, &cv->keys[i], &layer);
        if (found < 0)
            return NF4_EDATA;
        if (found && layer + 1 > layers)
            layers = layer + 1;
    }
    int code = NF4_OK;
    for (uint64_t layer = 0; layer < layers && code == NF4_OK; layer++)
        for (size_t m = 0; m < COUNT(MODULES) && code == NF4_OK; m++)
            code = convert_module(cv, layer, MODULES[m]);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over where diffusers converts an "
                            "Ideogram 4 LoRA, and raises: a key of no pair it takes (layers.N. then attention.qkv, "
                            "attention.o, feed_forward.w1, w2, w3 or adaln_modulation, with %s and %s, and .alpha)",
                            cv->down + 1, cv->up + 1);
    return code;
}

static int detect_key(const char *key)
{
    return str_starts_with(key, PREFIXES[0]) || strstr(key, "." I4_QKV ".") != NULL;
}

int ideogram4_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, detect_key);
}

static int holds_kohya_down(const char *key)
{
    return strstr(key, ".lora_down.weight") != NULL;
}

int ideogram4_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = lora_keys_of(path, w, lora_is_dora_scale, &cv.keys, &cv.nkeys);
    /* The first prefix any key starts with, cut where a key starts with it (removeprefix). */
    for (size_t p = 0; p < COUNT(PREFIXES) && code == NF4_OK; p++)
        if (lora_keys_any_start(cv.keys, cv.nkeys, PREFIXES[p])) {
            lora_keys_remove_prefix(cv.keys, cv.nkeys, PREFIXES[p]);
            break;
        }
    if (code == NF4_OK) {
        lora_keys_sort(cv.keys, cv.nkeys);
        code = lora_keys_check_distinct(path, cv.keys, cv.nkeys); /* diffusers' dict keeps one of them */
    }
    const int kohya = lora_model_any_key(w, holds_kohya_down);
    cv.down = kohya ? ".lora_down.weight" : I4_A;
    cv.up = kohya ? ".lora_up.weight" : I4_B;
    if (code == NF4_OK)
        code = convert_keys(&cv);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
