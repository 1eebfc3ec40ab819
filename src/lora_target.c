#include "lora_target.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pattern.h"
#include "status.h"

/* PEFT's shorthand, expanded when the model is built to every linear layer but
 * the output head: an adapter holds weights for those only. */
#define ALL_LINEAR "all-linear"

static int rule_fail(const char *path, const char *key, const char *what)
{
    return nf4_fail(NF4_EDATA, path, NULL, "\"%s\" %s", key, what);
}

/* Compiles `fmt` with the config's pattern in it ("%s" once). A pattern
 * src/pattern.c cannot run (look-ahead, say, which multimodal configs use to
 * skip a vision tower) or that is not one on its own (an unbalanced ')' that
 * the wrapping would close) selects nothing out: r->unselective, one warning,
 * and every pair that fits the base is merged, as before nf4deq read these keys. */
static int compile_wrapped(const char *path, const char *key, const char *fmt, const char *src,
                           struct lora_target_rules *r, struct pattern **out)
{
    *out = NULL;
    const char *why = NULL;
    struct pattern *alone = NULL;
    int code = strlen(src) > PATTERN_MAX_SOURCE ? PATTERN_INVALID : pattern_compile(src, &alone, &why);
    pattern_free(alone);
    if (code == PATTERN_OK)
        code = pattern_compile_in(fmt, src, out, &why);
    if (code == PATTERN_NOMEM)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    if (code != PATTERN_OK) {
        nf4_warn("%s: \"%s\": \"%s\" is not a regular expression nf4deq can use (%s); every module of the adapter "
                 "that fits the base is merged", path, key, src, why ? why : "longer than nf4deq takes");
        r->unselective = 1;
    }
    return NF4_OK;
}

/* A list of strings, or a string compiled as re.fullmatch; absent or null: NULL. */
static int parse_names(const char *path, const cJSON *root, const char *key, struct lora_target_rules *r,
                       const cJSON **list, struct pattern **re)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    *list = NULL;
    *re = NULL;
    if (!v || cJSON_IsNull(v))
        return NF4_OK;
    if (cJSON_IsString(v)) {
        if (strcmp(key, "target_modules") == 0 && strcasecmp(v->valuestring, ALL_LINEAR) == 0)
            return NF4_OK;
        return compile_wrapped(path, key, "(?:%s)\\Z", v->valuestring, r, re);
    }
    if (!cJSON_IsArray(v))
        return rule_fail(path, key, "must be a module name pattern or a list of module names");
    for (const cJSON *e = v->child; e; e = e->next)
        if (!cJSON_IsString(e))
            return rule_fail(path, key, "must be a module name pattern or a list of module names");
    *list = v;
    return NF4_OK;
}

static int parse_layers(const char *path, const cJSON *root, struct lora_target_rules *r)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "layers_to_transform");
    if (v && !cJSON_IsNull(v)) {
        int ok = cJSON_IsNumber(v) || cJSON_IsArray(v);
        for (const cJSON *e = cJSON_IsArray(v) ? v->child : NULL; e; e = e->next)
            ok &= cJSON_IsNumber(e);
        if (!ok)
            return rule_fail(path, "layers_to_transform", "must be a layer index or a list of them");
        if (cJSON_IsNumber(v) || cJSON_GetArraySize(v) > 0) /* an empty list selects nothing out */
            r->layers = v;
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "layers_pattern");
    size_t n = 0;
    if (p && !cJSON_IsNull(p)) {
        int ok = cJSON_IsString(p) || cJSON_IsArray(p);
        for (const cJSON *e = cJSON_IsArray(p) ? p->child : NULL; e; e = e->next, n++)
            ok &= cJSON_IsString(e);
        if (!ok)
            return rule_fail(path, "layers_pattern", "must be a pattern or a list of them");
        if (cJSON_IsString(p))
            n = p->valuestring[0] ? 1 : 0; /* "" means any, as None does */
    }
    if (n > LORA_TARGET_MAX_PATTERNS)
        return rule_fail(path, "layers_pattern", "lists more patterns than nf4deq takes");
    r->layer_res = calloc(n + 1, sizeof *r->layer_res);
    if (!r->layer_res)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    const cJSON *e = cJSON_IsArray(p) ? p->child : p;
    for (size_t i = 0; i < n; i++, e = e->next) {
        int code = compile_wrapped(path, "layers_pattern", "(?:.*\\.)?(?:%s)\\Z", e->valuestring, r, &r->layer_res[i]);
        if (code != NF4_OK || r->unselective) /* the entries after a NULL are never read */
            return code;
    }
    return NF4_OK;
}

int lora_target_parse(const char *path, const cJSON *root, struct lora_target_rules *r)
{
    memset(r, 0, sizeof *r);
    int code;
    if ((code = parse_names(path, root, "target_modules", r, &r->targets, &r->target_re)) != NF4_OK ||
        (code = parse_names(path, root, "exclude_modules", r, &r->excludes, &r->exclude_re)) != NF4_OK)
        return code;
    return parse_layers(path, root, r);
}

void lora_target_free(struct lora_target_rules *r)
{
    pattern_free(r->target_re);
    pattern_free(r->exclude_re);
    for (size_t i = 0; r->layer_res && r->layer_res[i]; i++)
        pattern_free(r->layer_res[i]);
    free(r->layer_res);
    memset(r, 0, sizeof *r);
}

int lora_name_listed(const cJSON *names, const char *module)
{
    size_t mlen = strlen(module);
    for (const cJSON *e = names->child; e; e = e->next) {
        size_t elen = strlen(e->valuestring);
        if (strcmp(module, e->valuestring) == 0 ||
            (mlen > elen && module[mlen - elen - 1] == '.' && strcmp(module + mlen - elen, e->valuestring) == 0))
            return 1;
    }
    return 0;
}

static int is_name_exactly_listed(const cJSON *names, const char *module)
{
    for (const cJSON *e = names->child; e; e = e->next)
        if (strcmp(module, e->valuestring) == 0)
            return 1;
    return 0;
}

/* At a segment of digits that a '.' follows: its value, saturated past any
 * real layer count; else -1. */
static int64_t index_at(const char *seg)
{
    const char *p = seg;
    int64_t v = 0;
    for (; *p >= '0' && *p <= '9'; p++)
        v = v > INT32_MAX ? v : v * 10 + (*p - '0');
    return p > seg && *p == '.' ? v : -1;
}

/* PEFT 0.21's layer index: the first numbered segment that fits,
 * re.match(r".*?\.[^.]*\.(\d+)\.", module) (at least two segments before
 * it), or with layers_pattern, re.match(rf"(?:^|.*?\.){P}\.(\d+)\.", module)
 * for the first P that matches: the lazy ".*?" takes the layer's index in
 * "model.layers.1.mlp.experts.0.down_proj", not the expert's. nf4deq takes the
 * first index whose name up to it ends in P (which is PEFT's for any P whose
 * matches have one length, such as "layers" or "h"). -1: none. */
static int64_t layer_index(const struct lora_target_rules *r, const char *module)
{
    size_t len = strlen(module);
    if (!r->layer_res[0]) {
        for (size_t i = 2; i < len; i++) /* i: where the digits start, after a '.' */
            if (module[i - 1] == '.' && index_at(module + i) >= 0 && memchr(module, '.', i - 1))
                return index_at(module + i); /* a '.' before the segment ahead of the index */
        return -1;
    }
    char *prefix = malloc(len + 1);
    if (!prefix)
        return -1;
    int64_t found = -1;
    for (size_t k = 0; r->layer_res[k] && found < 0; k++)
        for (size_t i = 2; i < len && found < 0; i++) {
            if (module[i - 1] != '.' || index_at(module + i) < 0)
                continue;
            memcpy(prefix, module, i - 1); /* the name up to the '.' before the digits */
            prefix[i - 1] = '\0';
            if (pattern_match(r->layer_res[k], prefix))
                found = index_at(module + i);
        }
    free(prefix);
    return found;
}

static int layer_selected(const cJSON *layers, int64_t index)
{
    if (index < 0)
        return 0;
    if (cJSON_IsNumber(layers))
        return layers->valuedouble == (double)index;
    for (const cJSON *e = layers->child; e; e = e->next)
        if (e->valuedouble == (double)index)
            return 1;
    return 0;
}

int lora_target_matches(const struct lora_target_rules *r, const char *module)
{
    if (r->unselective)
        return 1;
    if (r->exclude_re && pattern_match(r->exclude_re, module))
        return 0;
    if (r->excludes && lora_name_listed(r->excludes, module))
        return 0;
    if (r->target_re)
        return pattern_match(r->target_re, module);
    if (!r->targets)
        return 1;
    if (is_name_exactly_listed(r->targets, module))
        return 1; /* PEFT checks the layer index only for names matched by suffix */
    if (!lora_name_listed(r->targets, module))
        return 0;
    return !r->layers || layer_selected(r->layers, layer_index(r, module));
}
