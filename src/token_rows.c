#include "token_rows.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"
#include "status.h"

/* Row numbers are checked against the tensor's rows when bound; a list far
 * longer than any vocabulary is refused here, before anything is sized by it. */
#define TOKEN_MAX_ROWS (UINT64_C(1) << 32)

static int valid_row(const cJSON *e)
{
    return cJSON_IsNumber(e) && e->valuedouble >= 0 && e->valuedouble < 9007199254740992.0 &&
           e->valuedouble == floor(e->valuedouble);
}

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

/* One list of rows: numbers, none twice. */
static int check_list(const char *path, const cJSON *list, const char *module)
{
    const char *where = module ? module : "the input embedding";
    if (!cJSON_IsArray(list))
        return nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\": the rows of %s must be a list of row "
                        "numbers", where);
    size_t n = (size_t)cJSON_GetArraySize(list);
    if (n > TOKEN_MAX_ROWS)
        return nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\": more rows for %s than any vocabulary has",
                        where);
    uint64_t *rows = malloc((n ? n : 1) * sizeof *rows);
    if (!rows)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    size_t i = 0;
    int code = NF4_OK;
    for (const cJSON *e = list->child; e && code == NF4_OK; e = e->next, i++)
        if (!valid_row(e))
            code = nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\": the rows of %s must be whole numbers "
                            "from 0", where);
        else
            rows[i] = (uint64_t)e->valuedouble;
    if (code == NF4_OK) {
        qsort(rows, n, sizeof *rows, cmp_u64);
        for (i = 1; i < n && code == NF4_OK; i++)
            if (rows[i] == rows[i - 1])
                code = nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\": row %llu of %s is listed twice, "
                                "and which of its trained values PEFT's merge keeps is not defined",
                                (unsigned long long)rows[i], where);
    }
    free(rows);
    return code;
}

int token_indices_check(const char *path, const cJSON *v)
{
    if (!v || cJSON_IsNull(v))
        return NF4_OK;
    if (cJSON_IsArray(v))
        return check_list(path, v, NULL);
    if (!cJSON_IsObject(v))
        return nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\" must be a list of row numbers, or an "
                        "object of such lists by module name");
    for (const cJSON *e = v->child; e; e = e->next) {
        if (!*e->string)
            return nf4_fail(NF4_EDATA, path, NULL, "\"" TOKEN_INDICES_KEY "\" has an empty module name");
        int code = check_list(path, e, e->string);
        if (code != NF4_OK)
            return code;
    }
    return NF4_OK;
}

/* PEFT's _set_trainable: key.endswith(target), no '.' boundary. */
static int module_ends_with(const char *module, const char *key)
{
    size_t a = strlen(module), b = strlen(key);
    return a >= b && memcmp(module + a - b, key, b) == 0;
}

const cJSON *token_indices_for(const cJSON *v, const char *module, int *ambiguous)
{
    *ambiguous = 0;
    if (!v || cJSON_IsNull(v))
        return NULL;
    if (cJSON_IsArray(v))
        return v;
    const cJSON *found = NULL;
    for (const cJSON *e = v->child; e; e = e->next)
        if (module_ends_with(module, e->string)) {
            if (found) {
                *ambiguous = 1;
                return NULL;
            }
            found = e;
        }
    return found;
}

void token_rows_free(struct token_rows *t)
{
    if (!t)
        return;
    free(t->row);
    free(t->src);
    free(t);
}

struct row_pair {
    uint64_t row, src;
};

static int cmp_pair(const void *x, const void *y)
{
    return cmp_u64(&((const struct row_pair *)x)->row, &((const struct row_pair *)y)->row);
}

int token_rows_build(const cJSON *list, const struct model_tensor *values, const char *wname, uint64_t rows,
                     uint64_t cols, enum st_dtype round_to, struct token_rows **out)
{
    const char *file = values->file->path, *key = values->t->name;
    const struct st_tensor *vt = values->t;
    uint64_t n = (uint64_t)cJSON_GetArraySize(list);
    *out = NULL;
    if (vt->dtype != DT_F32 && vt->dtype != DT_BF16 && vt->dtype != DT_F16)
        return nf4_fail(NF4_EDATA, file, key, "is %s; trained token rows must be F32, BF16 or F16",
                        dtype_name(vt->dtype));
    if (vt->ndim != 2 || vt->shape[0] != n || vt->shape[1] != cols)
        return nf4_fail(NF4_EDATA, file, key, "must be %llux%llu: a row of %s for each of the %llu rows "
                        "adapter_config.json's " TOKEN_INDICES_KEY " gives it", (unsigned long long)n,
                        (unsigned long long)cols, wname, (unsigned long long)n);
    struct token_rows *t = calloc(1, sizeof *t);
    struct row_pair *pairs = malloc((n ? n : 1) * sizeof *pairs);
    if (t) {
        t->row = malloc((n ? n : 1) * sizeof *t->row);
        t->src = malloc((n ? n : 1) * sizeof *t->src);
    }
    if (!t || !pairs || !t->row || !t->src) {
        free(pairs);
        token_rows_free(t);
        return nf4_fail(NF4_ESOFTWARE, file, key, "out of memory");
    }
    uint64_t i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++)
        pairs[i] = (struct row_pair){(uint64_t)e->valuedouble, i};
    qsort(pairs, n, sizeof *pairs, cmp_pair);
    for (i = 0; i < n; i++) {
        t->row[i] = pairs[i].row;
        t->src[i] = pairs[i].src;
    }
    free(pairs);
    t->values = values;
    t->round_to = round_to;
    t->n = n;
    if (n && t->row[n - 1] >= rows) {
        uint64_t past = t->row[n - 1];
        token_rows_free(t);
        return nf4_fail(NF4_EDATA, file, key, "replaces row %llu, past the %llu rows of %s", (unsigned long long)past,
                        (unsigned long long)rows, wname);
    }
    *out = t;
    return NF4_OK;
}

int token_rows_same(const struct token_rows *a, const struct token_rows *b, int *same)
{
    *same = a->n == b->n && (a->n == 0 || (memcmp(a->row, b->row, a->n * sizeof *a->row) == 0 &&
                                           memcmp(a->src, b->src, a->n * sizeof *a->src) == 0));
    return *same ? model_tensors_equal(a->values, b->values, same) : NF4_OK;
}

void token_rows_between(const struct token_rows *t, uint64_t first_row, uint64_t last_row, uint64_t *begin,
                        uint64_t *end)
{
    uint64_t lo = 0, hi = t->n;
    while (lo < hi) { /* the first row >= first_row */
        uint64_t mid = lo + (hi - lo) / 2;
        if (t->row[mid] < first_row)
            lo = mid + 1;
        else
            hi = mid;
    }
    *begin = lo;
    hi = t->n;
    while (lo < hi) { /* the first row > last_row */
        uint64_t mid = lo + (hi - lo) / 2;
        if (t->row[mid] <= last_row)
            lo = mid + 1;
        else
            hi = mid;
    }
    *end = lo;
}
