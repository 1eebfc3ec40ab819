#include "lora_widen.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.h"
#include "dtype.h"
#include "lora_rewrite.h"
#include "source_cache.h"
#include "status.h"

/* Reads 4-bit weight w whole (source_cache.h) and dequantizes it into out
 * (its n elements in dtype dt), as bitsandbytes does (dequant.h). */
static int dequantize_whole(const struct bnb_weight *w, enum st_dtype dt, void *out)
{
    const struct bnb_state *s = &w->state;
    unsigned char *buf = malloc(source_cache_entry_bytes(w) + 1);
    float nested_code[NESTED_CODE_ENTRIES];
    struct cached_source whole;
    int code = buf ? source_read_whole(w, buf, &whole)
                   : nf4_fail(NF4_ESOFTWARE, w->packed->file->path, w->name, "out of memory");
    if (code == NF4_OK && s->nested)
        code = st_read(w->nested_quant_map->file, w->nested_quant_map->t, 0, nested_code, sizeof nested_code);
    if (code == NF4_OK) {
        struct dequant_job job = {
            .packed = whole.packed,
            .absmax_code = s->nested ? whole.absmax : NULL,
            .absmax = s->nested ? NULL : (const float *)whole.absmax,
            .nested_absmax = whole.nested_absmax,
            .nested_code = s->nested ? nested_code : NULL,
            .nested_offset = s->nested ? s->nested_offset : 0.0f,
            .n = s->n,
            .blocksize = s->blocksize,
            .nested_blocksize = s->nested ? s->nested_blocksize : 1,
            .quant_type = s->quant_type,
            .out_dtype = dt,
            .out = out,
        };
        dequant_cpu_range(&job, 0, job.n);
    }
    free(buf);
    return code;
}

/* The one tensor `name` [rows, new_cols] of `dt`, `values` (taken), opened
 * as a model whose messages name `path`. */
static int open_made(const char *path, const struct model_tensor *src, const char *name, enum st_dtype dt,
                     uint64_t rows, uint64_t new_cols, void *values, struct model **out)
{
    struct lora_rewrite rw = {.path = path};
    int code = lora_rewrite_add_values(&rw, "", name, src, dt, rows, new_cols, values);
    return lora_rewrite_finish(&rw, code, 0, "", out);
}

/* Each of `rows` rows of `cols` elements of `esize` bytes in `in`, then
 * zeros to new_cols, into a new buffer (*out); NF4_OK or NF4_ESOFTWARE. */
static int pad_rows(const char *path, const char *name, const unsigned char *in, uint64_t rows, uint64_t cols,
                    uint64_t new_cols, unsigned esize, void **out)
{
    unsigned char *p = calloc(rows * new_cols + 1, esize); /* all-zero bits: +0 in every float dtype */
    if (!p)
        return nf4_fail(NF4_ESOFTWARE, path, name, "out of memory");
    for (uint64_t r = 0; r < rows; r++)
        memcpy(p + r * new_cols * esize, in + r * cols * esize, cols * esize);
    *out = p;
    return NF4_OK;
}

/* The checks both tensors made here pass: a matrix no wider than it
 * becomes, small enough to hold. */
static int check_size(const char *path, const char *name, const char *why, uint64_t rows, uint64_t cols,
                      uint64_t new_cols)
{
    if (new_cols < cols)
        return nf4_fail(NF4_ESOFTWARE, path, name, "narrowed (internal error)");
    if (new_cols && rows > LORA_WIDEN_MAX_ELEMENTS / new_cols)
        return nf4_fail(NF4_EDATA, path, why, "would widen %s to %" PRIu64 " x %" PRIu64 " elements; nf4deq widens "
                        "at most %" PRIu64, name, rows, new_cols, LORA_WIDEN_MAX_ELEMENTS);
    return NF4_OK;
}

int lora_widen_base(const struct model_tensor *t, const struct bnb_weight *w, uint64_t new_cols, const char *why,
                    struct model **out)
{
    *out = NULL;
    const char *path = t->file->path, *name = w ? w->name : t->t->name;
    const enum st_dtype dt = w ? w->state.dtype : t->t->dtype;
    const uint64_t rows = w ? w->state.shape[0] : t->t->shape[0], cols = w ? w->state.shape[1] : t->t->shape[1];
    const unsigned esize = dtype_bits(dt) / 8;
    int code = check_size(path, name, why, rows, cols, new_cols);
    if (code != NF4_OK)
        return code;
    unsigned char *in = malloc(rows * cols * esize + 1);
    void *values = NULL;
    if (!in)
        code = nf4_fail(NF4_ESOFTWARE, path, name, "out of memory");
    else if (w)
        code = dequantize_whole(w, dt, in);
    else
        code = st_read(t->file, t->t, 0, in, rows * cols * esize);
    if (code == NF4_OK)
        code = pad_rows(path, name, in, rows, cols, new_cols, esize, &values);
    free(in);
    return code == NF4_OK ? open_made(path, t, name, dt, rows, new_cols, values, out) : code;
}

int lora_widen_factor(const struct model_tensor *a, uint64_t new_cols, struct model **out)
{
    *out = NULL;
    const struct st_tensor *t = a->t;
    const unsigned esize = dtype_bits(t->dtype) / 8;
    int code = check_size(a->file->path, t->name, t->name, t->shape[0], t->shape[1], new_cols);
    if (code != NF4_OK)
        return code;
    unsigned char *in = malloc(st_tensor_bytes(t) + 1);
    void *values = NULL;
    code = in ? st_read(a->file, t, 0, in, st_tensor_bytes(t)) : nf4_fail(NF4_ESOFTWARE, a->file->path, t->name,
                                                                           "out of memory");
    if (code == NF4_OK)
        code = pad_rows(a->file->path, t->name, in, t->shape[0], t->shape[1], new_cols, esize, &values);
    free(in);
    return code == NF4_OK ? open_made(a->file->path, a, t->name, t->dtype, t->shape[0], new_cols, values, out) : code;
}
