#include "lora_alphas.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fpconv.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

int network_alpha_key(const char *key)
{
    return strstr(key, "alpha") != NULL;
}

struct alpha {
    const struct model_tensor *t;
    double value;
};

/* The order safetensors' load_file gives a file's tensors: by data offset
 * (a pickled file's: where the archive holds their storages, which
 * torch.save writes in the order of the dict). */
static int load_order(const void *x, const void *y)
{
    const struct model_tensor *a = ((const struct alpha *)x)->t, *b = ((const struct alpha *)y)->t;
    if (a->file != b->file)
        return strcmp(a->file->path, b->file->path);
    return a->t->begin < b->t->begin ? -1 : a->t->begin > b->t->begin;
}

/* Reads alpha t's one value. */
static int read_alpha(const char *label, const struct model_tensor *t, double *out)
{
    const struct st_tensor *x = t->t;
    if (x->dtype != DT_F16 && x->dtype != DT_BF16 && x->dtype != DT_F32 && x->dtype != DT_F64)
        return nf4_fail(NF4_EDATA, label, x->name, "is an alpha of dtype %s: diffusers takes a floating-point alpha "
                        "only (it raises for this one), and nf4deq reads F16, BF16, F32 and F64 ones",
                        dtype_name(x->dtype));
    if (x->nelem != 1)
        return nf4_fail(NF4_EDATA, label, x->name, "holds %llu values; an alpha is one number",
                        (unsigned long long)x->nelem);
    unsigned char v[8];
    int code = st_read(t->file, x, 0, v, dtype_bits(x->dtype) / 8);
    if (code != NF4_OK)
        return code;
    if (x->dtype == DT_F64)
        memcpy(out, v, sizeof *out);
    else
        *out = f32_from_element(x->dtype, v, 0);
    return NF4_OK;
}

/* get_peft_kwargs' alpha_pattern key for alpha `name` (prefix cut): a
 * denoiser's (is_unet) name.split(".lora_A.")[0].replace(".alpha", ""), a
 * text encoder's ".".join(name.split(".down.")[0].split(".")[:-1]). */
static char *pattern_key(const char *name, int unet)
{
    const char *cut = strstr(name, unet ? ".lora_A." : ".down.");
    size_t len = cut ? (size_t)(cut - name) : strlen(name);
    if (!unet) { /* up to the last '.' of the head, or nothing */
        const char *dot = NULL;
        for (const char *p = name; p < name + len; p++)
            if (*p == '.')
                dot = p;
        len = dot ? (size_t)(dot - name) : 0;
    }
    char *head = strndup(name, len);
    char *key = head && unet ? str_replace_all(head, ".alpha", "") : head;
    if (key != head)
        free(head);
    return key;
}

/* Sets key in the object `pattern` to v: a key there already keeps its place. */
static int pattern_set(cJSON *pattern, const char *key, double v)
{
    cJSON *old = cJSON_GetObjectItemCaseSensitive(pattern, key);
    if (old) {
        cJSON_SetNumberValue(old, v);
        return 1;
    }
    return cJSON_AddNumberToObject(pattern, key, v) != NULL;
}

int network_alphas_config(const struct model *w, const char *prefix, const char *label, cJSON *cfg,
                          enum st_dtype *dtype, int *found)
{
    *found = 0;
    *dtype = DT_INVALID;
    struct alpha *alphas = calloc(w->count + 1, sizeof *alphas);
    if (!alphas)
        return nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
    size_t n = 0;
    int code = NF4_OK;
    for (size_t i = 0; i < w->count && code == NF4_OK; i++) {
        const struct model_tensor *t = &w->tensors[i];
        if (!network_alpha_key(t->t->name))
            continue;
        code = read_alpha(label, t, &alphas[n].value); /* every one popped is checked, whatever its prefix */
        if (code == NF4_OK && str_starts_with(t->t->name, prefix))
            alphas[n++].t = t;
    }
    for (size_t i = 1; i < n && code == NF4_OK; i++)
        if (alphas[i].t->t->dtype != alphas[0].t->t->dtype)
            code = nf4_fail(NF4_EDATA, label, alphas[i].t->t->name, "is a %s alpha, and %s a %s one: PEFT scales each "
                            "module by its alpha's dtype; nf4deq merges a file whose alphas share one",
                            dtype_name(alphas[i].t->t->dtype), alphas[0].t->t->name,
                            dtype_name(alphas[0].t->t->dtype));
    if (code != NF4_OK || n == 0) {
        free(alphas);
        return code;
    }
    qsort(alphas, n, sizeof *alphas, load_order);
    /* a text encoder's are read by load_lora_into_text_encoder (is_unet False), the rest by load_lora_adapter */
    const int unet = !str_starts_with(prefix, "text_encoder");
    cJSON *pattern = cJSON_CreateObject();
    int ok = pattern && cJSON_AddNumberToObject(cfg, "lora_alpha", alphas[0].value);
    /* the others whose value differs (a NaN from every one) */
    for (size_t i = 1; ok && i < n; i++) {
        if (alphas[i].value == alphas[0].value)
            continue;
        char *key = pattern_key(alphas[i].t->t->name + strlen(prefix), unet);
        ok = key && pattern_set(pattern, key, alphas[i].value);
        free(key);
    }
    if (ok && cJSON_AddItemToObject(cfg, "alpha_pattern", pattern))
        pattern = NULL;
    else
        ok = 0;
    cJSON_Delete(pattern);
    *found = ok;
    *dtype = alphas[0].t->t->dtype;
    free(alphas);
    return ok ? NF4_OK : nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
}
