#include "lora_old_forms.h"

#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define MAP_N(m) (sizeof(m) / sizeof(m)[0])

/* The tables of state_dict_utils.py, in their order: a key takes the first
 * pattern it holds. */
static const char *const UNET_TO_PEFT[][2] = {
    {".to_out_lora.up", ".to_out.0.lora_B"}, {".to_out_lora.down", ".to_out.0.lora_A"},
    {".to_q_lora.down", ".to_q.lora_A"},     {".to_q_lora.up", ".to_q.lora_B"},
    {".to_k_lora.down", ".to_k.lora_A"},     {".to_k_lora.up", ".to_k.lora_B"},
    {".to_v_lora.down", ".to_v.lora_A"},     {".to_v_lora.up", ".to_v.lora_B"},
    {".lora.up", ".lora_B"},                 {".lora.down", ".lora_A"},
    {".to_out.lora_magnitude_vector", ".to_out.0.lora_magnitude_vector"},
};
static const char *const OLD_TO_NEW[][2] = {
    {".to_q_lora.up", ".q_proj.lora_linear_layer.up"},     {".to_q_lora.down", ".q_proj.lora_linear_layer.down"},
    {".to_k_lora.up", ".k_proj.lora_linear_layer.up"},     {".to_k_lora.down", ".k_proj.lora_linear_layer.down"},
    {".to_v_lora.up", ".v_proj.lora_linear_layer.up"},     {".to_v_lora.down", ".v_proj.lora_linear_layer.down"},
    {".to_out_lora.up", ".out_proj.lora_linear_layer.up"}, {".to_out_lora.down", ".out_proj.lora_linear_layer.down"},
    {".to_k.lora_magnitude_vector", ".k_proj.lora_magnitude_vector"},
    {".to_v.lora_magnitude_vector", ".v_proj.lora_magnitude_vector"},
    {".to_q.lora_magnitude_vector", ".q_proj.lora_magnitude_vector"},
    {".to_out.lora_magnitude_vector", ".out_proj.lora_magnitude_vector"},
};
static const char *const PEFT_TO_NEW[][2] = {
    {".q_proj.lora_B", ".q_proj.lora_linear_layer.up"},     {".q_proj.lora_A", ".q_proj.lora_linear_layer.down"},
    {".k_proj.lora_B", ".k_proj.lora_linear_layer.up"},     {".k_proj.lora_A", ".k_proj.lora_linear_layer.down"},
    {".v_proj.lora_B", ".v_proj.lora_linear_layer.up"},     {".v_proj.lora_A", ".v_proj.lora_linear_layer.down"},
    {".out_proj.lora_B", ".out_proj.lora_linear_layer.up"}, {".out_proj.lora_A", ".out_proj.lora_linear_layer.down"},
    {"to_k.lora_A", "to_k.lora.down"},                      {"to_k.lora_B", "to_k.lora.up"},
    {"to_q.lora_A", "to_q.lora.down"},                      {"to_q.lora_B", "to_q.lora.up"},
    {"to_v.lora_A", "to_v.lora.down"},                      {"to_v.lora_B", "to_v.lora.up"},
    {"to_out.0.lora_A", "to_out.0.lora.down"},              {"to_out.0.lora_B", "to_out.0.lora.up"},
};
static const char *const OLD_TO_PEFT[][2] = {
    {".to_q_lora.up", ".q_proj.lora_B"},     {".to_q_lora.down", ".q_proj.lora_A"},
    {".to_k_lora.up", ".k_proj.lora_B"},     {".to_k_lora.down", ".k_proj.lora_A"},
    {".to_v_lora.up", ".v_proj.lora_B"},     {".to_v_lora.down", ".v_proj.lora_A"},
    {".to_out_lora.up", ".out_proj.lora_B"}, {".to_out_lora.down", ".out_proj.lora_A"},
    {".lora_linear_layer.up", ".lora_B"},    {".lora_linear_layer.down", ".lora_A"},
};
static const char *const NEW_TO_PEFT[][2] = {
    {".q_proj.lora_linear_layer.up", ".q_proj.lora_B"},     {".q_proj.lora_linear_layer.down", ".q_proj.lora_A"},
    {".k_proj.lora_linear_layer.up", ".k_proj.lora_B"},     {".k_proj.lora_linear_layer.down", ".k_proj.lora_A"},
    {".v_proj.lora_linear_layer.up", ".v_proj.lora_B"},     {".v_proj.lora_linear_layer.down", ".v_proj.lora_A"},
    {".out_proj.lora_linear_layer.up", ".out_proj.lora_B"}, {".out_proj.lora_linear_layer.down", ".out_proj.lora_A"},
    {".lora_linear_layer.up", ".lora_B"},                   {".lora_linear_layer.down", ".lora_A"},
    {"text_projection.lora.down.weight", "text_projection.lora_A.weight"},
    {"text_projection.lora.up.weight", "text_projection.lora_B.weight"},
};

/* convert_state_dict on one name: ".processor." always, then the first
 * pattern of `map` (n pairs) the name holds. 1, or 0 when out of memory. */
static int convert_by_map(char **s, const char *const (*map)[2], size_t n)
{
    if (!str_replace_in(s, ".processor.", "."))
        return 0;
    for (size_t i = 0; i < n; i++)
        if (strstr(*s, map[i][0]))
            return str_replace_in(s, map[i][0], map[i][1]);
    return 1;
}

int old_forms_unet_to_peft(char **name)
{
    return convert_by_map(name, UNET_TO_PEFT, MAP_N(UNET_TO_PEFT));
}

static int any_key_holds(const struct lora_key *keys, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (strstr(keys[i].name, s))
            return 1;
    return 0;
}

static int convert_all(struct lora_key *keys, size_t n, const char *const (*map)[2], size_t nmap)
{
    for (size_t i = 0; i < n; i++)
        if (!convert_by_map(&keys[i].name, map, nmap))
            return 0;
    return 1;
}

enum old_forms_result old_forms_text_encoder_to_peft(struct lora_key *keys, size_t n)
{
    /* convert_state_dict_to_diffusers: DIFFUSERS_OLD, PEFT, or already DIFFUSERS */
    int ok = 1;
    if (any_key_holds(keys, n, "to_out_lora"))
        ok = convert_all(keys, n, OLD_TO_NEW, MAP_N(OLD_TO_NEW));
    else if (any_key_holds(keys, n, ".lora_A.weight"))
        ok = convert_all(keys, n, PEFT_TO_NEW, MAP_N(PEFT_TO_NEW));
    else if (!any_key_holds(keys, n, "lora_linear_layer"))
        return OLD_FORMS_UNKNOWN;
    if (!ok)
        return OLD_FORMS_OOM;
    /* convert_state_dict_to_peft: DIFFUSERS_OLD or DIFFUSERS */
    if (any_key_holds(keys, n, "to_out_lora"))
        ok = convert_all(keys, n, OLD_TO_PEFT, MAP_N(OLD_TO_PEFT));
    else if (any_key_holds(keys, n, "lora_linear_layer"))
        ok = convert_all(keys, n, NEW_TO_PEFT, MAP_N(NEW_TO_PEFT));
    else
        return OLD_FORMS_UNKNOWN_AFTER;
    return ok ? OLD_FORMS_OK : OLD_FORMS_OOM;
}

/* ---- a diffusers LoRA's component ---- */

/* A tensor's new name, by its name in the file. */
struct renamed {
    const char *from;
    char *to;
};

struct renames {
    struct renamed *r;
    size_t n;
};

static int cmp_renamed(const void *a, const void *b)
{
    return strcmp(((const struct renamed *)a)->from, ((const struct renamed *)b)->from);
}

static int rename_by_table(const char *name, void *arg, char **renamed)
{
    const struct renames *t = arg;
    const struct renamed probe = {name, NULL};
    struct renamed *hit = bsearch(&probe, t->r, t->n, sizeof *t->r, cmp_renamed);
    if (hit) { /* taken, not copied: each name is renamed once */
        *renamed = hit->to;
        hit->to = NULL;
    }
    return NF4_OK;
}

static int is_lokr_key(const struct lora_key *k)
{
    return strstr(k->name, ".lokr_") != NULL;
}

/* Whether a key (less its component) is in one of diffusers' forms before
 * PEFT: an attention processor's to_q_lora, a layer's .lora.down/.lora.up, a
 * text encoder's lora_linear_layer. */
static int in_older_form(const char *name)
{
    return strstr(name, "_lora.") || strstr(name, ".lora.down.") || strstr(name, ".lora.up.") ||
           strstr(name, "lora_linear_layer");
}

static int any_in_older_form(const struct lora_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (in_older_form(keys[i].name))
            return 1;
    return 0;
}

/* Renames the component's keys (less its prefix, in the order of their data,
 * n of them): NF4_OK, NF4_EDATA where diffusers refuses them, NF4_ESOFTWARE. */
static int rename_component(const char *path, const char *prefix, struct lora_key *keys, size_t n)
{
    if (str_starts_with(prefix, "text_encoder")) {
        if (!any_in_older_form(keys, n))
            return NF4_OK; /* PEFT's names alone: see the header */
        switch (old_forms_text_encoder_to_peft(keys, n)) {
        case OLD_FORMS_OK: return NF4_OK;
        case OLD_FORMS_OOM: return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        case OLD_FORMS_UNKNOWN:
        case OLD_FORMS_UNKNOWN_AFTER: break;
        }
        return nf4_fail(NF4_EDATA, path, keys[0].t->t->name, "is a %.*s key, and neither it nor any other of them "
                        "is in a form diffusers tells (PEFT's lora_A of an attention projection, or its own "
                        "to_out_lora or lora_linear_layer): it refuses them (\"Could not automatically infer state "
                        "dict type\")", (int)(strlen(prefix) - 1), prefix);
    }
    for (size_t i = 0; i < n; i++)
        if (is_lokr_key(&keys[i]))
            return NF4_OK;
    if (strstr(keys[0].name, "lora_A")) {
        /* diffusers renames none, and PEFT leaves the older ones unloaded, unsaid */
        for (size_t i = 1; i < n; i++)
            if (in_older_form(keys[i].name))
                return nf4_fail(NF4_EDATA, path, keys[i].t->t->name, "is in diffusers' names before PEFT, but the "
                                "first of the component's keys (%s) is in PEFT's: diffusers then renames none of "
                                "them, and PEFT does not load this one", keys[0].t->t->name);
        return NF4_OK;
    }
    const int older = any_in_older_form(keys, n);
    for (size_t i = 0; i < n; i++) {
        if (!old_forms_unet_to_peft(&keys[i].name))
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        if (older && str_ends_with(keys[i].name, ".alpha")) /* else the binder says what it is */
            return nf4_fail(NF4_EDATA, path, keys[i].t->t->name, "is an alpha among keys in diffusers' names before "
                            "PEFT, which have none: diffusers and PEFT leave it unread, and the scaling it asks "
                            "for unapplied");
    }
    return NF4_OK;
}

/* A key under `prefix` (a text encoder's) that diffusers left in its oldest
 * form: an attention projection's to_q_lora among keys it read as the newer
 * form (no to_out_lora among them), which PEFT then does not load. */
static int is_left_old(const char *name, void *prefix)
{
    static const char *const OLD[] = {".to_q_lora.", ".to_k_lora.", ".to_v_lora.", ".to_out_lora."};
    if (!str_starts_with(name, prefix))
        return 0;
    for (size_t i = 0; i < MAP_N(OLD); i++)
        if (strstr(name, OLD[i]))
            return 1;
    return 0;
}

int diffusers_lora_old_names(struct model *weights, const char *prefix)
{
    const char *path = weights->files[0]->path;
    const size_t plen = strlen(prefix);
    struct lora_key *all = NULL, *mine = NULL;
    const char **from = NULL; /* mine's names in the file: copies, as renaming frees the model's */
    size_t nall = 0, n = 0;
    struct renames t = {0};
    int code = lora_keys_of(path, weights, NULL, &all, &nall);
    struct lora_key **order = code == NF4_OK ? lora_keys_in_file_order(all, nall) : NULL;
    if (code == NF4_OK && (!order || !(mine = calloc(nall ? nall : 1, sizeof *mine)) ||
                           !(from = calloc(nall ? nall : 1, sizeof *from))))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < nall && code == NF4_OK; i++) {
        if (strncmp(order[i]->name, prefix, plen) != 0)
            continue;
        if (!(mine[n].name = strdup(order[i]->name + plen))) {
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        } else {
            from[n] = order[i]->name;
            mine[n++].t = order[i]->t;
        }
    }
    if (code == NF4_OK && n > 0)
        code = rename_component(path, prefix, mine, n);
    if (code == NF4_OK && n > 0 && !(t.r = calloc(n, sizeof *t.r)))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        if (strcmp(from[i] + plen, mine[i].name) == 0)
            continue;
        struct strbuf to = {0};
        strbuf_printf(&to, "%s%s", prefix, mine[i].name);
        if (to.oom || !to.p) {
            free(to.p);
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        } else {
            t.r[t.n++] = (struct renamed){from[i], to.p};
        }
    }
    if (code == NF4_OK && t.n > 0) {
        qsort(t.r, t.n, sizeof *t.r, cmp_renamed);
        code = model_rename_tensors(weights, rename_by_table, &t);
    }
    size_t left = code == NF4_OK && n > 0 && str_starts_with(prefix, "text_encoder")
                      ? model_drop_tensors_by(weights, is_left_old, (void *)prefix) : 0;
    if (left)
        nf4_warn("%s: %zu of its %.*s keys are attention projections in diffusers' oldest form (to_q_lora, "
                 "to_k_lora, to_v_lora) among keys of its newer one (lora_linear_layer), with no to_out_lora: "
                 "diffusers renames none of them, and PEFT does not load them: they are not merged", path, left,
                 (int)(plen - 1), prefix);
    for (size_t i = 0; i < t.n; i++)
        free(t.r[i].to);
    free(t.r);
    lora_keys_free(mine, n);
    free(from);
    free(order);
    lora_keys_free(all, nall);
    return code;
}
