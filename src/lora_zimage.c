#include "lora_zimage.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_lokr.h"
#include "lora_lokr_forms.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define Z_DOWN ".lora_down.weight"
#define Z_UP ".lora_up.weight"
#define Z_A ".lora_A.weight"
#define Z_B ".lora_B.weight"
#define Z_ALPHA ".alpha"
/* kohya's lora_down once its underscores are dots, or a trainer's own form (Anime-Z's) */
#define Z_DOT_DOWN ".lora.down.weight"
#define Z_DOT_UP ".lora.up.weight"
#define Z_UNET "lora_unet_"
#define Z_COMFY "diffusion_model."
#define Z_PEFT_ADAPTER "default."
#define Z_TARGET "transformer."

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Pairs of kohya's words kept whole, with their underscore. */
static const char *const KEPT_WHOLE[][2] = {
    {"to", "q"}, {"to", "k"}, {"to", "v"}, {"to", "out"}, {"feed", "forward"},
};

/* Z-Image's module names with underscores of their own, which the split
 * into words made dots: put back, in this order, in every key. */
static const char *const NAME_FIXUPS[][2] = {
    {"context.refiner.", "context_refiner."}, {"noise.refiner.", "noise_refiner."},
    {"adaLN.modulation.", "adaLN_modulation."}, {"all.final.layer.", "all_final_layer."},
    {"all.x.embedder.", "all_x_embedder."},    {"cap.embedder.", "cap_embedder."},
    {"t.embedder.", "t_embedder."},
};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside) under diffusers' names, sorted */
    size_t nkeys;
    struct lora_key **order; /* the keys in diffusers' order: their data's in the file */
    unsigned char *in_dot_set; /* per key: left when the lora.down pairs' turn came (diffusers' dot_key_set) */
    struct lora_rewrite rw;
};

/* ---- names ---- */

static int any_key_holds(const struct conversion *cv, const char *part)
{
    for (size_t i = 0; i < cv->nkeys; i++)
        if (strstr(cv->keys[i].name, part))
            return 1;
    return 0;
}

/* diffusers' convert_key: the key before its last dot split at underscores
 * and joined with dots, but for the pairs kept whole; the part after the last
 * dot as it is (none where it is empty). Allocated; NULL when out of memory. */
static char *kohya_key(const char *key)
{
    const char *last_dot = strrchr(key, '.');
    char *base = last_dot ? strndup(key, (size_t)(last_dot - key)) : strdup(key);
    if (!base)
        return NULL;
    size_t nwords = 1;
    for (const char *p = base; *p; p++)
        nwords += *p == '_';
    char **words = calloc(nwords, sizeof *words);
    if (!words) {
        free(base);
        return NULL;
    }
    words[0] = base;
    for (size_t i = 1; i < nwords; i++) {
        words[i] = strchr(words[i - 1], '_');
        *words[i]++ = '\0';
    }
    struct strbuf b = {0};
    for (size_t i = 0; i < nwords; i++) {
        size_t k = 0;
        while (k < COUNT(KEPT_WHOLE) && !(i + 1 < nwords && strcmp(words[i], KEPT_WHOLE[k][0]) == 0 &&
                                          strcmp(words[i + 1], KEPT_WHOLE[k][1]) == 0))
            k++;
        strbuf_printf(&b, "%s%s", i ? "." : "", words[i]);
        if (k < COUNT(KEPT_WHOLE))
            strbuf_printf(&b, "_%s", words[++i]);
    }
    if (last_dot && last_dot[1])
        strbuf_puts(&b, last_dot);
    free(words);
    free(base);
    return b.oom ? (free(b.p), NULL) : b.p;
}

/* diffusers' normalize_out_key: a bare ".out" right before a factor's or an
 * alpha's suffix at the end becomes ".to_out.0", unless the key holds
 * ".to_out". Allocated; NULL when out of memory. */
static char *normalized_out(const char *key)
{
    static const char *const SUFFIXES[] = {".out" Z_DOWN, ".out" Z_UP, ".out" Z_ALPHA};
    for (size_t i = 0; i < COUNT(SUFFIXES) && !strstr(key, ".to_out"); i++)
        if (str_has_suffix(key, SUFFIXES[i])) {
            struct strbuf b = {0};
            strbuf_printf(&b, "%.*s.to_out.0%s", (int)(strlen(key) - strlen(SUFFIXES[i])), key,
                          SUFFIXES[i] + strlen(".out"));
            return b.oom ? (free(b.p), NULL) : b.p;
        }
    return strdup(key);
}

/* Each key (DoRA scales left out) under diffusers' name, each renaming
 * applied where diffusers applies it, in its order; sorted, and refused
 * where two become one. */
static int rename_keys(struct conversion *cv, const struct model *w)
{
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const char *name = cv->keys[i].name;
        if (strchr(name, '\n')) /* where Python's $ would match before it */
            code = nf4_fail(NF4_EDATA, cv->path, NULL, "has a key with a line break in its name, which nf4deq "
                            "does not read as a Z-Image LoRA's");
    }
    if (code == NF4_OK && lora_keys_any_start(cv->keys, cv->nkeys, Z_COMFY))
        lora_keys_remove_prefix(cv->keys, cv->nkeys, Z_COMFY);
    if (code == NF4_OK && lora_keys_any_start(cv->keys, cv->nkeys, Z_UNET)) {
        lora_keys_remove_prefix(cv->keys, cv->nkeys, Z_UNET);
        code = lora_keys_rename(cv->path, cv->keys, cv->nkeys, kohya_key);
    }
    if (code == NF4_OK)
        code = lora_keys_rename(cv->path, cv->keys, cv->nkeys, normalized_out);
    if (code == NF4_OK && any_key_holds(cv, Z_PEFT_ADAPTER))
        code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, Z_PEFT_ADAPTER, "");
    for (size_t f = 0; f < COUNT(NAME_FIXUPS) && code == NF4_OK; f++)
        code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, NAME_FIXUPS[f][0], NAME_FIXUPS[f][1]);
    if (code != NF4_OK)
        return code;
    lora_keys_sort(cv->keys, cv->nkeys);
    if (!(cv->order = lora_keys_in_file_order(cv->keys, cv->nkeys)))
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    return lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
}

/* ---- factors ---- */

/* Folds `alpha_name`'s alpha (where diffusers has not popped it) into the
 * pair, named a_name / b_name under "transformer.". */
static int fold_pair(struct conversion *cv, struct lora_key *down, struct lora_key *up, const char *a_name,
                     const char *b_name, const char *alpha_name)
{
    struct lora_key *alpha = lora_key_available(cv->keys, cv->nkeys, alpha_name);
    down->taken = up->taken = 1;
    if (alpha)
        alpha->taken = 1;
    return lora_rewrite_add_folded(&cv->rw, Z_TARGET, a_name, b_name, down->t, up->t, alpha ? alpha->t : NULL);
}

/* Each key ending in `first` with the key its `second` names (which must be
 * there), as kohya's lora_down / lora_up pairs or PEFT's lora_A / lora_B. */
static int convert_pairs(struct conversion *cv, const char *first, const char *second, const char *missing)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *down = cv->order[i];
        if (!str_has_suffix(down->name, first))
            continue;
        char *up_name = str_replace_all(down->name, first, second), *a = str_replace_all(down->name, first, Z_A),
             *b = up_name ? str_replace_all(up_name, second, Z_B) : NULL, *alpha = str_replace_all(down->name, first, Z_ALPHA);
        struct lora_key *up = lora_key_available(cv->keys, cv->nkeys, up_name);
        if (!up_name || !a || !b || !alpha)
            code = nf4_fail(NF4_ESOFTWARE, cv->path, down->t->t->name, "out of memory");
        else if (down->taken || !up) /* diffusers' pop raises */
            code = nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching %s", missing);
        else
            code = fold_pair(cv, down, up, a, b, alpha);
        free(up_name);
        free(a);
        free(b);
        free(alpha);
    }
    return code;
}

/* Whether `name` was left when the lora.down pairs' turn came. */
static int in_dot_set(const struct conversion *cv, const char *name)
{
    struct lora_key *k = lora_key_find(cv->keys, cv->nkeys, name);
    return k && cv->in_dot_set[k - cv->keys];
}

/* A fused qkv's lora.down (`down`, module `block`.qkv) with its up: split
 * into to_q, to_k, to_v, each the down and a third of the up's rows, alpha
 * folded in; left out where the block has separate q, k, v pairs or the up is
 * missing (diffusers drops it, with its alpha). */
static int convert_dot_qkv(struct conversion *cv, struct lora_key *down, const char *block, size_t block_len)
{
    char name[1024], *up_name = str_replace_all(down->name, Z_DOT_DOWN, Z_DOT_UP);
    if (!up_name)
        return nf4_fail(NF4_ESOFTWARE, cv->path, down->t->t->name, "out of memory");
    struct lora_key *up = lora_key_available(cv->keys, cv->nkeys, up_name);
    free(up_name);
    int split = 0;
    for (const char *p = "qkv"; *p; p++)
        for (int form = 0; form < 2; form++) {
            snprintf(name, sizeof name, "%.*s.to%c%c%s", (int)block_len, block, form ? '_' : '.', *p, Z_DOT_DOWN);
            split |= in_dot_set(cv, name);
        }
    snprintf(name, sizeof name, "%.*s.qkv%s", (int)block_len, block, Z_ALPHA);
    struct lora_key *alpha = lora_key_available(cv->keys, cv->nkeys, name);
    down->taken = 1;
    if (up)
        up->taken = 1;
    if (split || !up) {
        lora_rewrite_leave_out(&cv->rw, down->t->t->name, strlen(down->t->t->name), 1 + (up != NULL));
        if (alpha) {
            alpha->taken = 1;
            lora_rewrite_leave_out(&cv->rw, alpha->t->t->name, strlen(alpha->t->t->name), 1);
        }
        return NF4_OK;
    }
    char targets[3][1024];
    const char *const parts[3] = {targets[0], targets[1], targets[2]};
    for (size_t j = 0; j < 3; j++)
        snprintf(targets[j], sizeof targets[j], Z_TARGET "%.*s.to_%c", (int)block_len, block, "qkv"[j]);
    if (alpha)
        alpha->taken = 1;
    return lora_rewrite_add_folded_qkv(&cv->rw, parts, Z_A, Z_B, down->t, up->t, alpha ? alpha->t : NULL);
}

/* The lora.down / lora.up pairs left after the others (dots for kohya's
 * underscores): a fused qkv split, a bare out as to_out.0 (left out beside
 * one), to.q (k, v) as to_q, each alpha where diffusers looks for it. */
static int convert_dot_pairs(struct conversion *cv)
{
    if (!(cv->in_dot_set = calloc(cv->nkeys ? cv->nkeys : 1, 1)))
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    int any = 0;
    for (size_t i = 0; i < cv->nkeys; i++) {
        cv->in_dot_set[i] = !cv->keys[i].taken;
        any |= cv->in_dot_set[i] && strstr(cv->keys[i].name, Z_DOT_DOWN);
    }
    int code = NF4_OK;
    for (size_t i = 0; any && i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *down = cv->order[i];
        if (down->taken || !strstr(down->name, Z_DOT_DOWN))
            continue;
        if (!str_has_suffix(down->name, Z_DOT_DOWN)) /* diffusers would cut 17 characters off it all the same */
            return nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "holds %s but does not end with it, which nf4deq "
                            "does not read as a Z-Image LoRA's", Z_DOT_DOWN);
        const char *name = down->name;
        const size_t base_len = strlen(name) - strlen(Z_DOT_DOWN);
        if (base_len >= 4 && memcmp(name + base_len - 4, ".qkv", 4) == 0) {
            code = convert_dot_qkv(cv, down, name, base_len - 4);
            continue;
        }
        char a[1024], b[1024], alpha[1024];
        char *up_name = str_replace_all(name, Z_DOT_DOWN, Z_DOT_UP);
        if (!up_name)
            return nf4_fail(NF4_ESOFTWARE, cv->path, down->t->t->name, "out of memory");
        struct lora_key *up = lora_key_available(cv->keys, cv->nkeys, up_name);
        free(up_name);
        if (base_len >= 4 && memcmp(name + base_len - 4, ".out", 4) == 0 && !memmem(name, base_len, ".to_out", 7)) {
            /* a bare out: to_out.0, unless the block has one */
            const int block_len = (int)base_len - 4;
            snprintf(a, sizeof a, "%.*s.to_out.0%s", block_len, name, Z_DOT_DOWN);
            if (in_dot_set(cv, a) || !up) {
                down->taken = 1;
                if (up)
                    up->taken = 1;
                lora_rewrite_leave_out(&cv->rw, down->t->t->name, strlen(down->t->t->name), 1 + (up != NULL));
                continue;
            }
            snprintf(a, sizeof a, "%.*s.to_out.0" Z_A, block_len, name);
            snprintf(b, sizeof b, "%.*s.to_out.0" Z_B, block_len, name);
            snprintf(alpha, sizeof alpha, "%.*s.to_out.0" Z_ALPHA, block_len, name);
            code = fold_pair(cv, down, up, a, b, alpha);
            continue;
        }
        if (!up) {
            code = nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching %s", &Z_DOT_UP[1]);
            break;
        }
        /* ".to.q" before the suffix becomes ".to_q" (and k, v); every lora.down in the key becomes lora_A */
        char *norm = strdup(name);
        if (norm && base_len >= 5 && memcmp(name + base_len - 5, ".to.", 4) == 0 && strchr("qkv", name[base_len - 1]))
            norm[base_len - 2] = '_';
        char *na = norm ? str_replace_all(norm, Z_DOT_DOWN, Z_A) : NULL, *nb = norm ? str_replace_all(norm, Z_DOT_DOWN, Z_B) : NULL;
        if (norm)
            snprintf(alpha, sizeof alpha, "%.*s%s", (int)base_len, norm, Z_ALPHA);
        code = na && nb ? fold_pair(cv, down, up, na, nb, alpha)
                        : nf4_fail(NF4_ESOFTWARE, cv->path, down->t->t->name, "out of memory");
        free(norm);
        free(na);
        free(nb);
    }
    return code;
}

/* kohya's pairs where any key has one, else PEFT's; then the lora.down
 * pairs; what is left (an alpha included) is refused, as diffusers raises
 * ("state_dict should be empty"). */
static int convert_factors(struct conversion *cv)
{
    int kohya = 0, peft = 0;
    for (size_t i = 0; i < cv->nkeys; i++) {
        kohya |= strstr(cv->keys[i].name, Z_DOWN) || strstr(cv->keys[i].name, Z_UP);
        peft |= strstr(cv->keys[i].name, Z_A) || strstr(cv->keys[i].name, Z_B);
    }
    int code = kohya  ? convert_pairs(cv, Z_DOWN, Z_UP, "lora_up.weight")
               : peft ? convert_pairs(cv, Z_A, Z_B, "lora_B.weight")
                      : NF4_OK;
    if (code == NF4_OK)
        code = convert_dot_pairs(cv);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            return nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over where diffusers converts a "
                            "Z-Image LoRA (as %s): a factor without its partner, an alpha of no pair, or a key of "
                            "another kind", cv->keys[i].name);
    if (code == NF4_OK && cv->rw.nparts == 0)
        return nf4_fail(NF4_EDATA, cv->path, NULL, "holds no LoRA factor pair (lora_down/lora_up, lora_A/lora_B or "
                        "lora.down/lora.up): diffusers would load nothing of it");
    return code;
}

/* ---- the whole ---- */

static int is_lokr_key(const char *k)
{
    return strstr(k, LOKR_MARK) != NULL;
}

static int is_alpha_key(const char *k)
{
    return str_has_suffix(k, Z_ALPHA);
}

int zimage_lora_detect(const struct model *w)
{
    /* a LoKr is converted where a key starts with diffusion_model. or is an alpha (lora_lokr_forms.h) */
    if (lora_model_any_key(w, is_lokr_key))
        return lora_model_any_key_starting(w, Z_COMFY) || lora_model_any_key(w, is_alpha_key);
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (!lora_is_dora_scale(key) && (str_has_suffix(key, Z_ALPHA) || str_starts_with(key, Z_UNET) ||
                                         str_starts_with(key, Z_COMFY) || strstr(key, Z_PEFT_ADAPTER)))
            return 1;
    }
    return 0;
}

int zimage_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    if (lora_model_any_key(w, is_lokr_key))
        return lokr_convert_plain(w, path, warn, out);
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = rename_keys(&cv, w);
    if (code == NF4_OK)
        code = convert_factors(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, or fused layers beside their parts or "
                               "without their lora.up, which diffusers drops from a Z-Image LoRA", out);
    lora_keys_free(cv.keys, cv.nkeys);
    free(cv.order);
    free(cv.in_dot_set);
    return code;
}
