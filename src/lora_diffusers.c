#include "lora_diffusers.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json_util.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

/* How many components a message names before "...". */
#define LISTED_COMPONENTS 4

int diffusers_lora_path(const char *arg, char **weights)
{
    *weights = NULL;
    struct stat st;
    if (stat(arg, &st) != 0)
        return NF4_OK; /* lora_open says what is missing */
    if (S_ISREG(st.st_mode))
        return (*weights = strdup(arg)) ? NF4_OK : nf4_fail(NF4_ESOFTWARE, arg, NULL, "out of memory");
    if (!S_ISDIR(st.st_mode))
        return NF4_OK;
    char *config = path_join(arg, ADAPTER_CONFIG_NAME), *file = path_join(arg, DIFFUSERS_LORA_NAME);
    if (!config || !file) {
        free(config);
        free(file);
        return nf4_fail(NF4_ESOFTWARE, arg, NULL, "out of memory");
    }
    /* lstat: in a Hugging Face cache each is a link, maybe to a blob not
     * downloaded; opening it then says so. */
    int peft = lstat(config, &st) == 0 || errno != ENOENT;
    if (!peft && lstat(file, &st) == 0) {
        *weights = file;
        file = NULL;
    }
    free(config);
    free(file);
    return NF4_OK;
}

/* The component a key is for: its first segment, `n` bytes long. */
static size_t component_len(const char *key)
{
    const char *dot = strchr(key, '.');
    return dot ? (size_t)(dot - key) : strlen(key);
}

static size_t keys_under(const struct model *w, const char *prefix)
{
    size_t n = 0, plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++)
        n += strncmp(w->tensors[i].t->name, prefix, plen) == 0;
    return n;
}

/* The components of the keys not under `prefix` (NULL: every key), for a
 * message: distinct first segments, in key order, at most LISTED_COMPONENTS. */
static void list_components(const struct model *w, const char *prefix, struct strbuf *out)
{
    size_t listed = 0, plen = prefix ? strlen(prefix) : 0;
    const char *seen[LISTED_COMPONENTS];
    size_t seen_len[LISTED_COMPONENTS];
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (prefix && strncmp(key, prefix, plen) == 0)
            continue;
        size_t n = component_len(key), k;
        for (k = 0; k < listed; k++)
            if (seen_len[k] == n && memcmp(seen[k], key, n) == 0)
                break;
        if (k < listed)
            continue;
        if (listed == LISTED_COMPONENTS) {
            strbuf_puts(out, ", ...");
            return;
        }
        strbuf_printf(out, "%s%.*s", listed ? ", " : "", (int)n, key);
        seen[listed] = key;
        seen_len[listed++] = n;
    }
}

/* Whether the keys are kohya's (sd-scripts, ComfyUI): lora_unet_... or
 * lora_te..., with lora_down and lora_up, which diffusers converts at load. */
static int is_kohya(const struct model *w)
{
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, "lora_unet_", 10) == 0 || strncmp(key, "lora_te", 7) == 0 || strstr(key, ".lora_down."))
            return 1;
    }
    return 0;
}

/* The last segment of a folder's path, trailing slashes aside: "a/transformer/" -> "transformer". */
static char *folder_name(const char *dir)
{
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    size_t start = n;
    while (start > 0 && dir[start - 1] != '/')
        start--;
    return strndup(dir + start, n - start);
}

int diffusers_lora_prefix(const struct model *weights, const struct model *base, char **prefix)
{
    *prefix = NULL;
    const char *path = weights->files[0]->path;
    char *own = base->dir ? folder_name(base->dir) : NULL;
    if (base->dir && !own)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    int own_usable = own && own[0] && strcmp(own, ".") != 0 && strcmp(own, "..") != 0 &&
                     strcmp(own, DIFFUSERS_DEFAULT_COMPONENT) != 0;
    const char *names[2] = {own_usable ? own : NULL, DIFFUSERS_DEFAULT_COMPONENT};
    int code = NF4_OK;
    for (size_t i = 0; i < 2 && !*prefix && code == NF4_OK; i++) {
        if (!names[i])
            continue;
        size_t n = strlen(names[i]) + 2;
        char *p = malloc(n);
        if (!p) {
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
            break;
        }
        snprintf(p, n, "%s.", names[i]);
        if (keys_under(weights, p))
            *prefix = p;
        else
            free(p);
    }
    struct strbuf others = {0};
    if (code == NF4_OK)
        list_components(weights, *prefix, &others);
    if (code == NF4_OK && others.oom)
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    else if (code == NF4_OK && !*prefix && is_kohya(weights))
        code = nf4_fail(NF4_EDATA, path, NULL, "is a kohya-format LoRA (lora_unet_..., lora_down/lora_up), which "
                        "nf4deq does not read; load it in diffusers (load_lora_weights) and save it again with "
                        "save_lora_weights, or as a PEFT adapter");
    else if (code == NF4_OK && !*prefix)
        code = nf4_fail(NF4_EDATA, path, NULL, "is a diffusers LoRA with no tensors for %s%s%s (its keys are for: "
                        "%s); give the folder of the pipeline component it was trained on",
                        names[0] ? names[0] : "", names[0] ? " or " : "", DIFFUSERS_DEFAULT_COMPONENT,
                        others.p ? others.p : "nothing");
    else if (code == NF4_OK && others.p)
        nf4_warn("%s: %zu of its tensors are for other pipeline components (%s) than %.*s: they are not merged "
                 "here; convert each such component with this --lora too", path,
                 weights->count - keys_under(weights, *prefix), others.p, (int)(strlen(*prefix) - 1), *prefix);
    free(others.p);
    free(own);
    if (code != NF4_OK) {
        free(*prefix);
        *prefix = NULL;
    }
    return code;
}

/* Whether a key under `prefix` ends with `suffix`. */
static int has_key_ending(const struct model *w, const char *prefix, const char *suffix)
{
    size_t plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, prefix, plen) == 0 && str_ends_with(key, suffix))
            return 1;
    }
    return 0;
}

/* The metadata's entries of the prefix's component, the prefix taken off,
 * into cfg; *entries: how many. */
static int metadata_entries(const char *label, const char *meta, const char *prefix, cJSON *cfg, size_t *entries)
{
    *entries = 0;
    cJSON *root = json_parse_whole(meta, strlen(meta));
    if (!root)
        return json_ran_out_of_memory() ? nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory")
                                        : nf4_fail(NF4_EDATA, label, NULL, "is not valid JSON");
    int code = NF4_OK, twice = cJSON_IsObject(root) ? json_has_duplicate_key(root) : 0;
    if (!cJSON_IsObject(root))
        code = nf4_fail(NF4_EDATA, label, NULL, "is not a JSON object");
    else if (twice)
        code = twice < 0 ? nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory")
                         : nf4_fail(NF4_EDATA, label, NULL, "has a duplicate key");
    size_t plen = strlen(prefix);
    for (const cJSON *e = code == NF4_OK ? root->child : NULL; e; e = e->next) {
        if (strncmp(e->string, prefix, plen) != 0)
            continue;
        cJSON *copy = cJSON_Duplicate(e, 1);
        if (!copy || !cJSON_AddItemToObject(cfg, e->string + plen, copy)) {
            cJSON_Delete(copy);
            code = nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
            break;
        }
        (*entries)++;
    }
    cJSON_Delete(root);
    return code;
}

int diffusers_lora_config(const struct model *weights, const char *prefix, struct lora_config *c)
{
    memset(c, 0, sizeof *c);
    const struct st_file *f = weights->files[0];
    const char *meta = NULL;
    for (size_t i = 0; i < f->nmeta && !meta; i++)
        if (strcmp(f->meta[i].key, DIFFUSERS_LORA_METADATA) == 0)
            meta = f->meta[i].value;
    struct strbuf label = {0};
    strbuf_printf(&label, "%s (metadata \"%s\")", f->path, DIFFUSERS_LORA_METADATA);
    cJSON *cfg = cJSON_CreateObject();
    if (label.oom || !cfg) {
        free(label.p);
        cJSON_Delete(cfg);
        return nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    }
    size_t entries = 0;
    int code = meta ? metadata_entries(label.p, meta, prefix, cfg, &entries) : NF4_OK;
    /* No config for this component: diffusers then takes r and alpha from
     * each pair's shape, and DoRA and LoRA biases from the keys. */
    int inferred = code == NF4_OK && entries == 0;
    if (inferred && (!cJSON_AddNumberToObject(cfg, "r", 1) || !cJSON_AddNumberToObject(cfg, "lora_alpha", 1) ||
                     !cJSON_AddBoolToObject(cfg, "use_dora", has_key_ending(weights, prefix, ".lora_magnitude_vector")) ||
                     !cJSON_AddBoolToObject(cfg, "lora_bias", has_key_ending(weights, prefix, ".lora_B.bias"))))
        code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    /* diffusers hands the entries to LoraConfig, which is PEFT's LoRA. */
    if (code == NF4_OK && !cJSON_GetObjectItemCaseSensitive(cfg, "peft_type") &&
        !cJSON_AddStringToObject(cfg, "peft_type", "LORA"))
        code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    char *text = code == NF4_OK ? cJSON_PrintUnformatted(cfg) : NULL;
    if (code == NF4_OK && !text)
        code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    if (code == NF4_OK) {
        code = lora_config_parse(label.p, text, strlen(text), c);
        c->rank_from_shapes = inferred;
    }
    free(text);
    cJSON_Delete(cfg);
    free(label.p);
    return code;
}
