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

/* Whether torch calls dt floating point, as lora_state_dict asks of every alpha. */
static int is_floating(enum st_dtype dt)
{
    switch (dt) {
    case DT_F16: case DT_BF16: case DT_F32: case DT_F64: case DT_F8_E5M2: case DT_F8_E4M3: case DT_F8_E8M0:
    case DT_F8_E4M3FNUZ: case DT_F8_E5M2FNUZ: return 1;
    default: return 0;
    }
}

int network_alphas_check(const struct model *w, int has_metadata)
{
    const char *path = w->files[0]->path, *first = NULL;
    for (size_t i = 0; i < w->count; i++) {
        const struct st_tensor *t = w->tensors[i].t;
        if (!network_alpha_key(t->name))
            continue;
        if (!is_floating(t->dtype))
            return nf4_fail(NF4_EDATA, path, t->name, "is an alpha of dtype %s, which diffusers refuses (it takes "
                            "floating-point alphas only)", dtype_name(t->dtype));
        first = first ? first : t->name;
    }
    if (first && has_metadata)
        return nf4_fail(NF4_EDATA, path, first, "is an alpha key (a network alpha) beside a LoRA config in the "
                        "metadata, which diffusers refuses together (\"Both network_alphas and metadata cannot be "
                        "specified\")");
    return NF4_OK;
}

/* Reads alpha t's one value: one of the component's, which its layers use. */
static int read_alpha(const char *label, const struct model_tensor *t, double *out)
{
    const struct st_tensor *x = t->t;
    if (!dtype_is_castable_float(x->dtype)) /* F16, BF16, F32, F64 */
        return nf4_fail(NF4_EDATA, label, x->name, "is an alpha of dtype %s; nf4deq reads F16, BF16, F32 and F64 ones",
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
    if (!isfinite(*out)) /* diffusers would merge weights of no finite value */
        return nf4_fail(NF4_EDATA, label, x->name, "is %g: the weights it scales would not be finite", *out);
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
        if (network_alpha_key(t->t->name) && str_starts_with(t->t->name, prefix) &&
            (code = read_alpha(label, t, &alphas[n].value)) == NF4_OK)
            alphas[n++].t = t;
    }
    if (code != NF4_OK || n == 0) {
        free(alphas);
        return code;
    }
    qsort(alphas, n, sizeof *alphas, load_order);
    /* a text encoder's are read by load_lora_into_text_encoder (is_unet False), the rest by load_lora_adapter */
    const int unet = !str_starts_with(prefix, "text_encoder");
    cJSON *pattern = cJSON_CreateObject();
    int ok = pattern && cJSON_AddNumberToObject(cfg, "lora_alpha", alphas[0].value);
    /* the others whose value differs */
    for (size_t i = 1; ok && code == NF4_OK && i < n; i++) {
        if (alphas[i].value == alphas[0].value)
            continue;
        if (alphas[i].t->t->dtype != alphas[0].t->t->dtype) {
            code = nf4_fail(NF4_EDATA, label, alphas[i].t->t->name, "is a %s alpha, and %s, lora_alpha, a %s one: "
                            "PEFT scales each module by its alpha's dtype, and nf4deq takes one dtype for the alphas "
                            "that differ", dtype_name(alphas[i].t->t->dtype), alphas[0].t->t->name,
                            dtype_name(alphas[0].t->t->dtype));
            break;
        }
        char *key = pattern_key(alphas[i].t->t->name + strlen(prefix), unet);
        ok = key && pattern_set(pattern, key, alphas[i].value);
        free(key);
    }
    if (ok && cJSON_AddItemToObject(cfg, "alpha_pattern", pattern))
        pattern = NULL;
    else
        ok = 0;
    cJSON_Delete(pattern);
    *found = ok && code == NF4_OK;
    *dtype = alphas[0].t->t->dtype;
    free(alphas);
    return code != NF4_OK || ok ? code : nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
}
