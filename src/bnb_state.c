#include "bnb_state.h"

#include <cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "json_text.h"
#include "json_util.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

static const char *const STATE_PART_SUFFIXES[] = {
    ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", QUANT_STATE_SUFFIX_NF4, QUANT_STATE_SUFFIX_FP4,
};

/* bitsandbytes' 8-bit (LLM.int8) format: not what nf4deq converts. */
static const char *const INT8_SUFFIXES[] = {".SCB", ".weight_format"};

int bnb_is_state_part(const char *name)
{
    for (size_t i = 0; i < sizeof STATE_PART_SUFFIXES / sizeof STATE_PART_SUFFIXES[0]; i++)
        if (str_ends_with(name, STATE_PART_SUFFIXES[i]))
            return 1;
    return 0;
}

/* Half an ulp above FLT_MAX: a double under it rounds to a finite float32, as
 * PyTorch's torch.tensor(x, dtype=float32) does (FLT_MAX's mantissa is odd, so
 * the tie itself rounds to infinity). */
#define FLOAT32_ROUNDS_TO_INF 3.4028235677973366e38

static int is_power_of_two(uint64_t v)
{
    return v && (v & (v - 1)) == 0;
}

static int json_u64(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return 0;
    double d = item->valuedouble;
    if (!(d >= 0) || d >= 9007199254740992.0 || d != floor(d))
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* How many quant states (objects with a "quant_type") stand back to back in
 * json[0, len), filling it; 0 where anything else is there. transformers 5
 * saves a layer it split on load (a fused qkv or gate_up projection) with
 * its parts' quant states concatenated into one tensor. */
static size_t states_back_to_back(const char *json, size_t len)
{
    /* cJSON skips any byte up to 0x20 between values, NUL included. */
    if (!json_text_is_strict(json, len))
        return 0;
    size_t n = 0, i = 0;
    while (i < len) {
        if ((i = json_text_skip_ws(json, i, len)) == len)
            break;
        const char *end = NULL;
        cJSON *part = cJSON_ParseWithLengthOpts(json + i, len - i, &end, 0);
        const int state = cJSON_IsString(cJSON_GetObjectItemCaseSensitive(part, "quant_type"));
        cJSON_Delete(part);
        if (!state || !end || end <= json + i)
            return 0;
        n++;
        i = (size_t)(end - json);
    }
    return n;
}

/* The refusal of a quant state that is not one JSON object, saying why where
 * a known writer made it so. */
static int fail_not_json(const char *file, const char *tensor, const char *json, size_t len)
{
    const size_t n = states_back_to_back(json, len);
    if (n >= 2)
        return nf4_fail(NF4_EDATA, file, tensor, "quant state is not valid JSON: it holds %zu quant states back to "
                        "back, as transformers 5 saves a layer it split on load (a fused qkv or gate_up "
                        "projection), a checkpoint transformers cannot load either", n);
    return nf4_fail(NF4_EDATA, file, tensor, "quant state is not valid JSON");
}

int bnb_parse_state(const char *file, const char *tensor, const char *json, size_t len, struct bnb_state *s)
{
    memset(s, 0, sizeof *s);
    cJSON *root = json_parse_whole(json, len);
    char *python_text = NULL; /* the text with Python's NaN and Infinity as null */
    size_t nonfinite = 0;
    if (!root && !json_ran_out_of_memory()) {
        size_t python_len;
        python_text = json_python_nonfinite_to_null(json, len, &python_len, &nonfinite);
        if (!python_text)
            return nf4_fail(NF4_ESOFTWARE, file, tensor, "out of memory parsing the quant state");
        if (nonfinite && (root = json_parse_whole(python_text, python_len)) != NULL) {
            json = python_text;
            len = python_len;
        }
    }
    if (!root) {
        int oom = json_ran_out_of_memory();
        free(python_text);
        return oom ? nf4_fail(NF4_ESOFTWARE, file, tensor, "out of memory parsing the quant state")
                   : fail_not_json(file, tensor, json, len);
    }
    int code = NF4_OK;
    if (!cJSON_IsObject(root)) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state is not a JSON object");
        goto out;
    }
    int twice = json_has_duplicate_key(root);
    if (twice) {
        code = twice < 0 ? nf4_fail(NF4_ESOFTWARE, file, tensor, "out of memory")
                         : nf4_fail(NF4_EDATA, file, tensor, "quant state has a key twice");
        goto out;
    }
    /* bitsandbytes passes these to torch.Size and its kernels' int arguments,
     * which refuse 64.0; json_u64 below sees only the double. */
    static const char *const INTEGER_KEYS[] = {"blocksize", "shape", "nested_blocksize"};
    const char *bad_key;
    if (!json_keys_hold_plain_integers(json, len, INTEGER_KEYS, sizeof INTEGER_KEYS / sizeof *INTEGER_KEYS,
                                       &bad_key)) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state \"%s\" is not written as an integer", bad_key);
        goto out;
    }
    const cJSON *qt = cJSON_GetObjectItemCaseSensitive(root, "quant_type");
    if (!cJSON_IsString(qt)) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state has no \"quant_type\" string");
        goto out;
    }
    if (strcmp(qt->valuestring, "nf4") == 0)
        s->quant_type = QUANT_NF4;
    else if (strcmp(qt->valuestring, "fp4") == 0)
        s->quant_type = QUANT_FP4;
    else {
        code = nf4_fail(NF4_EDATA, file, tensor, "unsupported quant_type \"%s\" (nf4 or fp4 expected)",
                        qt->valuestring);
        goto out;
    }
    uint64_t v;
    if (!json_u64(cJSON_GetObjectItemCaseSensitive(root, "blocksize"), &v)) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state has no integer \"blocksize\"");
        goto out;
    }
    if (!is_power_of_two(v) || v < NF4_MIN_BLOCKSIZE || v > NF4_MAX_BLOCKSIZE) {
        code = nf4_fail(NF4_EDATA, file, tensor, "blocksize %" PRIu64 " is not a power of two from %u to %u", v,
                        NF4_MIN_BLOCKSIZE, NF4_MAX_BLOCKSIZE);
        goto out;
    }
    s->blocksize = (uint32_t)v;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(root, "dtype");
    if (!cJSON_IsString(dt) || (s->dtype = dtype_from_torch_name(dt->valuestring)) == DT_INVALID) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state dtype %s%s%s is not float16, bfloat16 or float32",
                        cJSON_IsString(dt) ? "\"" : "", cJSON_IsString(dt) ? dt->valuestring : "(missing)",
                        cJSON_IsString(dt) ? "\"" : "");
        goto out;
    }
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(root, "shape");
    if (!cJSON_IsArray(shape)) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state has no \"shape\" array");
        goto out;
    }
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > (int)(sizeof s->shape / sizeof s->shape[0])) {
        code = nf4_fail(NF4_EDATA, file, tensor, "quant state shape has %d dimensions", ndim);
        goto out;
    }
    s->ndim = (size_t)ndim;
    s->n = 1;
    size_t d = 0;
    for (const cJSON *c = shape->child; c; c = c->next, d++) {
        if (!json_u64(c, &s->shape[d])) {
            code = nf4_fail(NF4_EDATA, file, tensor, "quant state shape[%zu] is not a non-negative integer", d);
            goto out;
        }
        if (__builtin_mul_overflow(s->n, s->shape[d], &s->n)) {
            code = nf4_fail(NF4_EDATA, file, tensor, "quant state shape product overflows");
            goto out;
        }
    }
    /* bitsandbytes writes the three nested keys together, or none of them. */
    const cJSON *nbs = cJSON_GetObjectItemCaseSensitive(root, "nested_blocksize");
    const cJSON *ndt = cJSON_GetObjectItemCaseSensitive(root, "nested_dtype");
    const cJSON *noff = cJSON_GetObjectItemCaseSensitive(root, "nested_offset");
    int present = !!nbs + !!ndt + !!noff;
    if (present != 0 && present != 3) {
        code = nf4_fail(NF4_EDATA, file, tensor,
                        "quant state has only some of nested_blocksize, nested_dtype, nested_offset");
        goto out;
    }
    if (present) {
        s->nested = 1;
        if (!json_u64(nbs, &v) || !is_power_of_two(v) || v > MAX_NESTED_BLOCKSIZE) {
            code = nf4_fail(NF4_EDATA, file, tensor, "nested_blocksize is not a power of two up to %u",
                            MAX_NESTED_BLOCKSIZE);
            goto out;
        }
        s->nested_blocksize = (uint32_t)v;
        if (!cJSON_IsString(ndt) || strcmp(ndt->valuestring, "float32") != 0) {
            code = nf4_fail(NF4_EDATA, file, tensor, "nested_dtype must be \"float32\"");
            goto out;
        }
        if (cJSON_IsNull(noff) && nonfinite) {
            /* bitsandbytes' offset is the mean of the absmax: NaN for a weight
             * of no elements (which has no absmax to add it to), infinite for
             * one holding an infinity, which would dequantize to inf and NaN. */
            if (s->n != 0) {
                code = nf4_fail(NF4_EDATA, file, tensor, "nested_offset is NaN or infinite (bitsandbytes "
                                "quantized a weight holding an infinity or NaN), so every element would "
                                "dequantize to inf or NaN");
                goto out;
            }
            s->nested_offset = 0.0f; /* never read: there is no absmax */
            goto out;
        }
        if (!cJSON_IsNumber(noff) || !isfinite(noff->valuedouble) ||
            !(fabs(noff->valuedouble) < FLOAT32_ROUNDS_TO_INF)) {
            code = nf4_fail(NF4_EDATA, file, tensor, "nested_offset is not a finite float32 number");
            goto out;
        }
        /* bitsandbytes rebuilds the offset as torch.tensor(float(x)): one RNE rounding to fp32. */
        s->nested_offset = (float)noff->valuedouble;
    }
out:
    cJSON_Delete(root);
    free(python_text);
    return code;
}

static int cmp_weight(const void *a, const void *b)
{
    const struct bnb_weight *x = a, *y = b;
    return strcmp(x->name, y->name);
}

const struct bnb_weight *bnb_find(const struct bnb_weight *w, size_t count, const char *name)
{
    return bnb_find_n(w, count, name, strlen(name));
}

/* strcmp(a, the first len bytes of b as a string), for b with no NUL among them. */
static int cmp_with_prefix(const char *a, const char *b, size_t len)
{
    int c = strncmp(a, b, len);
    return c ? c : (unsigned char)a[len];
}

const struct bnb_weight *bnb_find_n(const struct bnb_weight *w, size_t count, const char *name, size_t len)
{
    size_t lo = 0, hi = count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = cmp_with_prefix(w[mid].name, name, len);
        if (c == 0)
            return &w[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const struct bnb_weight *bnb_owner_of(const struct bnb_weight *w, size_t count, const char *part)
{
    size_t len = strlen(part);
    for (size_t k = 0; k < sizeof STATE_PART_SUFFIXES / sizeof STATE_PART_SUFFIXES[0]; k++) {
        size_t s = strlen(STATE_PART_SUFFIXES[k]);
        const struct bnb_weight *o = len > s && strcmp(part + len - s, STATE_PART_SUFFIXES[k]) == 0
                                         ? bnb_find_n(w, count, part, len - s)
                                         : NULL;
        if (o)
            return o;
    }
    return NULL;
}

void bnb_free(struct bnb_weight *w, size_t count)
{
    if (!w)
        return;
    for (size_t i = 0; i < count; i++)
        free(w[i].name);
    free(w);
}

/* *out is NULL when the part is absent. Out of memory is NF4_ESOFTWARE, not a
 * missing part (which would be reported as bad input). */
static int find_part(const struct model *m, const char *file, const char *base, const char *suffix,
                     const struct model_tensor **out)
{
    *out = NULL;
    char *name = str_concat(base, suffix);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, file, base, "out of memory");
    *out = model_find(m, name);
    free(name);
    return NF4_OK;
}

static int expect_part(const struct model_tensor *t, const char *blob_file, const char *base, const char *suffix,
                       enum st_dtype dtype, uint64_t count)
{
    if (!t)
        return nf4_fail(NF4_EDATA, blob_file, base, "missing quant-state tensor %s%s", base, suffix);
    if (t->t->dtype != dtype)
        return nf4_fail(NF4_EDATA, t->file->path, t->t->name, "dtype is %s, expected %s", dtype_name(t->t->dtype),
                        dtype_name(dtype));
    if (t->t->nelem != count)
        return nf4_fail(NF4_EDATA, t->file->path, t->t->name, "holds %" PRIu64 " values, expected %" PRIu64,
                        t->t->nelem, count);
    return NF4_OK;
}

static int load_weight(const struct model *m, const struct model_tensor *blob, struct bnb_weight *w)
{
    const char *path = blob->file->path;
    const char *blob_name = blob->t->name;
    int is_fp4 = str_ends_with(blob_name, QUANT_STATE_SUFFIX_FP4);
    size_t base_len = strlen(blob_name) - strlen(is_fp4 ? QUANT_STATE_SUFFIX_FP4 : QUANT_STATE_SUFFIX_NF4);
    w->name = strndup(blob_name, base_len);
    if (!w->name)
        return nf4_fail(NF4_ESOFTWARE, path, blob_name, "out of memory");
    /* "W.absmax" + suffix, or a blob of a blob: the weight would be planned
     * as a state part and silently left out of the output. */
    if (bnb_is_state_part(w->name))
        return nf4_fail(NF4_EDATA, path, blob_name, "names %s as its packed weight, a name only quant-state parts "
                        "may have", w->name);
    w->state_blob = blob;
    if (blob->t->dtype != DT_U8)
        return nf4_fail(NF4_EDATA, path, blob_name, "quant state blob is %s, expected U8", dtype_name(blob->t->dtype));
    uint64_t len = st_tensor_bytes(blob->t);
    if (len > MAX_QUANT_STATE_BYTES)
        return nf4_fail(NF4_EDATA, path, blob_name, "quant state blob is %" PRIu64 " bytes, over the %u allowed",
                        len, MAX_QUANT_STATE_BYTES);
    char *json = malloc(len ? len : 1);
    if (!json)
        return nf4_fail(NF4_ESOFTWARE, path, blob_name, "out of memory");
    int code = st_read(blob->file, blob->t, 0, json, len);
    if (code == NF4_OK)
        code = bnb_parse_state(path, blob_name, json, len, &w->state);
    free(json);
    if (code != NF4_OK)
        return code;
    struct bnb_state *s = &w->state;
    if ((s->quant_type == QUANT_FP4) != is_fp4)
        return nf4_fail(NF4_EDATA, path, blob_name, "quant_type \"%s\" contradicts the tensor name",
                        s->quant_type == QUANT_FP4 ? "fp4" : "nf4");

    w->packed = model_find(m, w->name);
    if (!w->packed)
        return nf4_fail(NF4_EDATA, path, w->name, "quant state present but the packed weight is missing");
    uint64_t packed_bytes = st_tensor_bytes(w->packed->t);
    uint64_t needed = s->n / 2 + (s->n & 1);
    if (packed_bytes < needed)
        return nf4_fail(NF4_EDATA, w->packed->file->path, w->name,
                        "packed weight is %" PRIu64 " bytes, but shape needs %" PRIu64 " for %" PRIu64 " values",
                        packed_bytes, needed, s->n);
    w->blocks = s->n / s->blocksize + (s->n % s->blocksize != 0);
    if ((code = find_part(m, path, w->name, ".quant_map", &w->quant_map)) != NF4_OK ||
        (code = expect_part(w->quant_map, path, w->name, ".quant_map", DT_F32, 16)) != NF4_OK ||
        (code = find_part(m, path, w->name, ".absmax", &w->absmax)) != NF4_OK ||
        (code = find_part(m, path, w->name, ".nested_absmax", &w->nested_absmax)) != NF4_OK ||
        (code = find_part(m, path, w->name, ".nested_quant_map", &w->nested_quant_map)) != NF4_OK)
        return code;
    if (s->nested) {
        if ((code = expect_part(w->absmax, path, w->name, ".absmax", DT_U8, w->blocks)) != NF4_OK)
            return code;
        w->nested_blocks = w->blocks / s->nested_blocksize + (w->blocks % s->nested_blocksize != 0);
        if ((code = expect_part(w->nested_absmax, path, w->name, ".nested_absmax", DT_F32, w->nested_blocks)) !=
            NF4_OK)
            return code;
        if ((code = expect_part(w->nested_quant_map, path, w->name, ".nested_quant_map", DT_F32,
                                NESTED_CODE_ENTRIES)) != NF4_OK)
            return code;
    } else {
        if ((code = expect_part(w->absmax, path, w->name, ".absmax", DT_F32, w->blocks)) != NF4_OK)
            return code;
        if (w->nested_absmax || w->nested_quant_map)
            return nf4_fail(NF4_EDATA, path, blob_name, "nested tensors present but the quant state is not nested");
    }
    float map[16];
    if ((code = st_read(w->quant_map->file, w->quant_map->t, 0, map, sizeof map)) != NF4_OK)
        return code;
    const float *standard = s->quant_type == QUANT_FP4 ? FP4_VALUES : NF4_VALUES;
    w->quant_map_is_standard = 1;
    for (int k = 0; k < 16; k++)
        /* The stored fp4 map has +0 where the kernel's sign rule gives -0: compare values. */
        if (!(map[k] == standard[k]))
            w->quant_map_is_standard = 0;
    if (!w->quant_map_is_standard)
        nf4_warn("%s: %s: quant_map differs from the standard %s table; bitsandbytes' CUDA kernels ignore it, "
                 "and so does nf4deq",
                 w->quant_map->file->path, w->quant_map->t->name, s->quant_type == QUANT_FP4 ? "fp4" : "nf4");
    return NF4_OK;
}

int bnb_collect(const struct model *m, struct bnb_weight **out, size_t *count)
{
    *out = NULL;
    *count = 0;
    size_t cap = 0;
    for (size_t i = 0; i < m->count; i++) {
        const char *name = m->tensors[i].t->name;
        if (str_ends_with(name, QUANT_STATE_SUFFIX_NF4) || str_ends_with(name, QUANT_STATE_SUFFIX_FP4))
            cap++;
        for (size_t k = 0; k < sizeof INT8_SUFFIXES / sizeof INT8_SUFFIXES[0]; k++)
            if (str_ends_with(name, INT8_SUFFIXES[k]))
                return nf4_fail(NF4_EDATA, m->tensors[i].file->path, name,
                                "bitsandbytes 8-bit (LLM.int8) weights are not supported; only 4-bit nf4/fp4");
    }
    struct bnb_weight *w = calloc(cap ? cap : 1, sizeof *w);
    if (!w)
        return nf4_fail(NF4_ESOFTWARE, m->dir ? m->dir : m->files[0]->path, NULL, "out of memory");
    size_t n = 0;
    int code = NF4_OK;
    for (size_t i = 0; i < m->count && code == NF4_OK; i++) {
        const char *name = m->tensors[i].t->name;
        if (!str_ends_with(name, QUANT_STATE_SUFFIX_NF4) && !str_ends_with(name, QUANT_STATE_SUFFIX_FP4))
            continue;
        code = load_weight(m, &m->tensors[i], &w[n]);
        n++;
    }
    if (code == NF4_OK) {
        qsort(w, n, sizeof *w, cmp_weight);
        for (size_t i = 1; i < n && code == NF4_OK; i++)
            if (strcmp(w[i - 1].name, w[i].name) == 0)
                code = nf4_fail(NF4_EDATA, w[i].state_blob->file->path, w[i].name,
                                "has both an nf4 and an fp4 quant state");
    }
    /* A part whose weight has no quant state would otherwise pass through as if
     * it were a model tensor. */
    for (size_t i = 0; i < m->count && code == NF4_OK; i++) {
        const struct model_tensor *t = &m->tensors[i];
        if (!bnb_is_state_part(t->t->name))
            continue;
        if (!bnb_owner_of(w, n, t->t->name))
            code = nf4_fail(NF4_EDATA, t->file->path, t->t->name,
                            "quant-state tensor belongs to no weight (its quant_state.bitsandbytes__* blob is missing)");
    }
    if (code != NF4_OK) {
        bnb_free(w, n);
        return code;
    }
    *out = w;
    *count = n;
    return NF4_OK;
}
