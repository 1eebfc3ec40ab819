#include "lora_xlabs.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define XL_DOWN ".down.weight"
#define XL_UP ".up.weight"
#define XL_A ".lora_A.weight"
#define XL_B ".lora_B.weight"

/* The two kinds of block XLabs trains, and how diffusers names them. */
struct xlabs_block {
    const char *starts[2]; /* what a key starts with */
    const char *number;    /* what the block number follows (re.search(r"double_blocks\.(\d+)")) */
    const char *root;      /* diffusers' name of the block, before its number */
};

static const struct xlabs_block DOUBLE = {
    {"diffusion_model.double_blocks", "double_blocks"}, "double_blocks.", "transformer.transformer_blocks."};
static const struct xlabs_block SINGLE = {
    {"diffusion_model.single_blocks", "single_blocks"}, "single_blocks.", "transformer.single_transformer_blocks."};

static const char *const TO_QKV[] = {".attn.to_q", ".attn.to_k", ".attn.to_v"};
static const char *const ADD_QKV[] = {".attn.add_q_proj", ".attn.add_k_proj", ".attn.add_v_proj"};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), sorted */
    size_t nkeys;
    struct lora_key **order; /* the keys in the order diffusers takes them: the file's */
    struct lora_rewrite rw;
};

/* ---- names ---- */

/* The block number of `key` as diffusers' re.search(number + r"(\d+)")
 * finds it: the digits after the first `number` that has any. *digits, *len:
 * where they are. Refused where there is none (diffusers raises), and where
 * a byte outside ASCII could be one of the Unicode digits \d also reads. */
static int block_number(const struct conversion *cv, const struct lora_key *k, const char *number,
                        const char **digits, size_t *len)
{
    const size_t n = strlen(number);
    for (const char *p = strstr(k->name, number); p; p = strstr(p + 1, number)) {
        const char *d = p + n;
        size_t run = 0;
        while (d[run] >= '0' && d[run] <= '9')
            run++;
        if ((unsigned char)d[run] >= 0x80)
            return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a block number that may not be ASCII digits "
                            "after %s, which nf4deq does not read (Python's \\d reads Unicode digits)", number);
        if (run) {
            *digits = d;
            *len = run;
            return NF4_OK;
        }
    }
    return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has no block number after %s, which diffusers looks for",
                    number);
}

/* Whether `key` starts as a key of block kind `b` does. */
static int starts_block(const char *key, const struct xlabs_block *b)
{
    return str_starts_with(key, b->starts[0]) || str_starts_with(key, b->starts[1]);
}

/* root + the block number + `module` + `factor`. Allocated; NULL when out of memory. */
static char *part_name(const struct xlabs_block *b, const char *digits, size_t len, const char *module,
                       const char *factor)
{
    struct strbuf s = {0};
    strbuf_printf(&s, "%s%.*s%s%s", b->root, (int)len, digits, module, factor);
    return s.oom ? (free(s.p), NULL) : s.p;
}

/* ---- parts ---- */

/* A fused qkv's down `k` and its up (k's name with every ".down.weight" made
 * ".up.weight", which must be there): the down copied to each of `parts`,
 * the up cut into three equal blocks of rows (torch.split). */
static int convert_qkv(struct conversion *cv, struct lora_key *k, const struct xlabs_block *b, const char *digits,
                       size_t len, const char *const parts[3])
{
    char *up_name = str_replace_all(k->name, XL_DOWN, XL_UP);
    if (!up_name)
        return nf4_fail(NF4_ESOFTWARE, cv->path, k->t->t->name, "out of memory");
    k->taken = 1;
    struct lora_key *up = lora_key_find(cv->keys, cv->nkeys, up_name);
    free(up_name);
    if (!up || up->taken) /* diffusers' pop raises */
        return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has no matching up (its name with %s for %s)", XL_UP,
                        XL_DOWN);
    up->taken = 1;
    const struct st_tensor *t = up->t->t;
    if (t->ndim == 0 || t->ndim > 2)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "has %zu dimensions, but diffusers cuts it by rows into "
                        "three equal parts, for q, k and v", t->ndim);
    int code = lora_check_factor_dtype(cv->path, t); /* its rows are copied as bytes: whole ones */
    if (code != NF4_OK)
        return code;
    if (t->shape[0] % 3 != 0 || t->shape[0] == 0)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "has %" PRIu64 " rows, which diffusers cannot cut into three "
                        "equal parts for q, k and v", t->shape[0]);
    for (size_t j = 0; j < 3 && code == NF4_OK; j++) {
        char *a = part_name(b, digits, len, parts[j], XL_A), *bn = part_name(b, digits, len, parts[j], XL_B);
        if (!a || !bn)
            code = nf4_fail(NF4_ESOFTWARE, cv->path, t->name, "out of memory");
        if (code == NF4_OK)
            code = lora_rewrite_add_copy(&cv->rw, a, "", k->t);
        if (code == NF4_OK)
            code = lora_rewrite_add_rows(&cv->rw, bn, "", up->t, j * (t->shape[0] / 3), t->shape[0] / 3);
        free(a);
        free(bn);
    }
    return code;
}

/* A key of block kind `b`: its rule, a fused qkv's or a projection's; then,
 * unless "qkv" is in it, the key itself under the block's name, its module's
 * and its factor's. */
static int convert_block_key(struct conversion *cv, struct lora_key *k, const struct xlabs_block *b)
{
    const char *digits = NULL, *name = k->name;
    size_t len = 0;
    int code = block_number(cv, k, b->number, &digits, &len);
    if (code != NF4_OK)
        return code;
    const int up = strstr(name, "up") != NULL;
    const char *module = "";
    const char *const *qkv = NULL;
    if (b == &DOUBLE) {
        if (strstr(name, "processor.proj_lora1"))
            module = ".attn.to_out.0";
        else if (strstr(name, "processor.proj_lora2"))
            module = ".attn.to_add_out";
        else if (strstr(name, "processor.qkv_lora2") && !up)
            qkv = ADD_QKV;
        else if (strstr(name, "processor.qkv_lora1") && !up)
            qkv = TO_QKV;
    } else {
        if (strstr(name, "proj_lora"))
            module = ".proj_out";
        else if (strstr(name, "qkv_lora") && !up)
            qkv = TO_QKV;
    }
    /* A key another's qkv split took is an up: "up" and "qkv" in its name, so neither rule below takes it. */
    if (qkv)
        return convert_qkv(cv, k, b, digits, len, qkv);
    if (strstr(name, "qkv")) /* not kept: another key's qkv split pops it, or it is left over */
        return NF4_OK;
    k->taken = 1;
    if (!strstr(name, "down") && !up) { /* under the module's bare name, which PEFT's load skips */
        lora_rewrite_leave_out(&cv->rw, k->t->t->name, strlen(k->t->t->name), 1);
        return NF4_OK;
    }
    char *target = part_name(b, digits, len, module, strstr(name, "down") ? XL_A : XL_B);
    code = target ? lora_rewrite_add_copy(&cv->rw, target, "", k->t)
                  : nf4_fail(NF4_ESOFTWARE, cv->path, k->t->t->name, "out of memory");
    free(target);
    return code;
}

/* Each key in the file's order by the rule of its block, or kept as it is;
 * anything left over (a key with "qkv" in it that no rule took) refused, as
 * diffusers raises ("old_state_dict should be at this point but has"). */
static int convert_keys(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *k = cv->order[i];
        const struct xlabs_block *b = starts_block(k->name, &DOUBLE) ? &DOUBLE
                                      : starts_block(k->name, &SINGLE) ? &SINGLE
                                                                       : NULL;
        if (b)
            code = convert_block_key(cv, k, b);
        else if (!strstr(k->name, "qkv")) {
            k->taken = 1;
            code = lora_rewrite_add_copy(&cv->rw, k->name, "", k->t);
        }
    }
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over where diffusers converts an "
                            "XLabs LoRA: a key with \"qkv\" in it that no rule takes");
    return code;
}

/* ---- the whole ---- */

static int holds_processor(const char *key)
{
    return strstr(key, "processor") != NULL;
}

int xlabs_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, holds_processor);
}

int xlabs_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = lora_keys_of(path, w, lora_is_dora_scale, &cv.keys, &cv.nkeys);
    if (code == NF4_OK) {
        lora_keys_sort(cv.keys, cv.nkeys);
        if (!(cv.order = lora_keys_in_file_order(cv.keys, cv.nkeys)))
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    if (code == NF4_OK)
        code = convert_keys(&cv);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, or a block's keys of no factor (neither down "
                               "nor up in the name), which diffusers does not load", out);
    lora_keys_free(cv.keys, cv.nkeys);
    free(cv.order);
    return code;
}
