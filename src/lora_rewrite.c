#include "lora_rewrite.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "fileio.h"
#include "fpconv.h"
#include "lora_diffusers.h"
#include "safetensors_writer.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

/* How many left-out names the warning gives before "...". */
#define LISTED_LEFT_OUT 3

int lora_rewrite_add(struct lora_rewrite *rw, const char *target, const char *factor, const struct model_tensor *src,
                     enum st_dtype dtype, uint64_t rows, uint64_t cols, uint64_t row0, uint64_t col0, float scale)
{
    if (rw->nparts == rw->cap) {
        size_t cap = rw->cap ? rw->cap * 2 : 64;
        struct lora_part *p = realloc(rw->parts, cap * sizeof *p);
        if (!p)
            return nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
        rw->parts = p;
        rw->cap = cap;
    }
    struct lora_part *p = &rw->parts[rw->nparts];
    size_t len = strlen(target) + strlen(factor) + 1;
    if (!(p->name = malloc(len)))
        return nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    snprintf(p->name, len, "%s%s", target, factor);
    p->src = src;
    p->dtype = dtype;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->row0 = row0;
    p->col0 = col0;
    p->block = p->stride = 0;
    p->scale = scale;
    p->as_is = p->whole = p->vector = p->identity = 0;
    p->values = NULL;
    rw->nparts++;
    return NF4_OK;
}

int lora_rewrite_add_copy(struct lora_rewrite *rw, const char *target, const char *factor,
                          const struct model_tensor *src)
{
    int code = lora_rewrite_add(rw, target, factor, src, src->t->dtype, 0, 0, 0, 0, 1.0f);
    if (code == NF4_OK)
        rw->parts[rw->nparts - 1].as_is = rw->parts[rw->nparts - 1].whole = 1;
    return code;
}

int lora_rewrite_add_rows(struct lora_rewrite *rw, const char *target, const char *factor,
                          const struct model_tensor *src, uint64_t row0, uint64_t rows)
{
    return lora_rewrite_add_row_blocks(rw, target, factor, src, rows, row0, 0, 0, NULL);
}

int lora_rewrite_add_row_blocks(struct lora_rewrite *rw, const char *target, const char *factor,
                                const struct model_tensor *src, uint64_t rows, uint64_t row0, uint64_t block,
                                uint64_t stride, const float *scale)
{
    const int vector = src->t->ndim == 1;
    int code = lora_rewrite_add(rw, target, factor, src, src->t->dtype, rows, vector ? 1 : src->t->shape[1], row0, 0,
                                scale ? *scale : 1.0f);
    if (code == NF4_OK) {
        struct lora_part *p = &rw->parts[rw->nparts - 1];
        p->as_is = !scale;
        p->vector = (unsigned)vector;
        p->block = block;
        p->stride = stride;
    }
    return code;
}

int lora_rewrite_add_identity(struct lora_rewrite *rw, const char *target, const char *factor,
                              const struct model_tensor *src, enum st_dtype dtype, uint64_t rows, uint64_t cols)
{
    int code = lora_rewrite_add(rw, target, factor, src, dtype, rows, cols, 0, 0, 1.0f);
    if (code == NF4_OK)
        rw->parts[rw->nparts - 1].identity = 1;
    return code;
}

int lora_rewrite_add_values(struct lora_rewrite *rw, const char *target, const char *factor,
                            const struct model_tensor *src, enum st_dtype dtype, uint64_t rows, uint64_t cols,
                            void *values)
{
    int code = lora_rewrite_add(rw, target, factor, src, dtype, rows, cols, 0, 0, 1.0f);
    if (code == NF4_OK)
        rw->parts[rw->nparts - 1].values = values;
    else
        free(values);
    return code;
}

/* The row of p's source that row i of p holds (a vector's value). */
static uint64_t part_source_row(const struct lora_part *p, uint64_t i)
{
    const uint64_t r = p->row0 + (p->block ? (i / p->block) * p->stride + i % p->block : i), n = p->src->t->shape[0];
    return n ? r % n : r; /* none: st_read refuses what is not there */
}

/* How many of p's rows from row i on are rows of the source one after another. */
static uint64_t part_run(const struct lora_part *p, uint64_t i)
{
    const uint64_t first = part_source_row(p, i);
    uint64_t n = 1;
    while (i + n < p->shape[0] && part_source_row(p, i + n) == first + n)
        n++;
    return n;
}

/* p's rows of its source, whole (row_bytes each), into `out`, a run at a time. */
static int read_part_rows(const struct lora_part *p, uint64_t row_bytes, unsigned char *out)
{
    int code = NF4_OK;
    for (uint64_t i = 0, run; code == NF4_OK && i < p->shape[0]; i += run) {
        run = part_run(p, i);
        code = st_read(p->src->file, p->src->t, part_source_row(p, i) * row_bytes, out + i * row_bytes,
                       run * row_bytes);
    }
    return code;
}

int lora_part_values(const struct lora_part *p, void *out)
{
    if (p->values) {
        memcpy(out, p->values, p->shape[0] * p->shape[1] * (dtype_bits(p->dtype) / 8));
        return NF4_OK;
    }
    if (p->identity) {
        for (uint64_t i = 0, k = 0; i < p->shape[0]; i++)
            for (uint64_t c = 0; c < p->shape[1]; c++, k++)
                f32_to_element(p->dtype, out, k, i == c ? 1.0f : 0.0f);
        return NF4_OK;
    }
    const struct st_tensor *t = p->src->t;
    if (p->whole)
        return st_read(p->src->file, t, 0, out, st_tensor_bytes(t));
    const uint64_t esize = dtype_bits(t->dtype) / 8;
    if (p->as_is) /* rows of a matrix or a vector */
        return read_part_rows(p, p->shape[1] * esize, out);
    const uint64_t src_cols = t->shape[1];
    unsigned char *rows = malloc(p->shape[0] * src_cols * esize + 1);
    if (!rows)
        return nf4_fail(NF4_ESOFTWARE, p->src->file->path, t->name, "out of memory");
    int code = read_part_rows(p, src_cols * esize, rows);
    for (uint64_t i = 0, k = 0; code == NF4_OK && i < p->shape[0]; i++)
        for (uint64_t c = 0; c < p->shape[1]; c++, k++)
            f32_to_element(p->dtype, out, k, f32_from_element(t->dtype, rows, i * src_cols + p->col0 + c) * p->scale);
    free(rows);
    return code;
}

static int part_cmp(const void *a, const void *b)
{
    const struct lora_part *x = *(const struct lora_part *const *)a, *y = *(const struct lora_part *const *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : strcmp(x->src->t->name, y->src->t->name);
}

int lora_rewrite_check_one_each(const struct lora_rewrite *rw)
{
    const struct lora_part **by_name = calloc(rw->nparts ? rw->nparts : 1, sizeof *by_name);
    if (!by_name)
        return nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    for (size_t i = 0; i < rw->nparts; i++)
        by_name[i] = &rw->parts[i];
    qsort(by_name, rw->nparts, sizeof *by_name, part_cmp);
    int code = NF4_OK;
    for (size_t i = 1; i < rw->nparts && code == NF4_OK; i++)
        if (strcmp(by_name[i - 1]->name, by_name[i]->name) == 0)
            code = nf4_fail(NF4_EDATA, rw->path, by_name[i]->src->t->name, "becomes %s, as %s does",
                            by_name[i]->name, by_name[i - 1]->src->t->name);
    free(by_name);
    return code;
}

static int write_parts(const struct lora_rewrite *rw, int fd, const char *tmp)
{
    struct st_out_tensor *outs = calloc(rw->nparts ? rw->nparts : 1, sizeof *outs);
    if (!outs)
        return nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    for (size_t i = 0; i < rw->nparts; i++) {
        const struct lora_part *p = &rw->parts[i];
        outs[i] = p->whole ? (struct st_out_tensor){p->name, p->dtype, p->src->t->ndim, p->src->t->shape}
                           : (struct st_out_tensor){p->name, p->dtype, p->vector ? 1 : 2, p->shape};
    }
    struct st_writer *w = NULL;
    int code = st_writer_begin_stream(&w, fd, tmp, outs, rw->nparts, rw->meta, rw->nmeta);
    for (size_t k = 0; code == NF4_OK && k < rw->nparts; k++) {
        size_t idx = st_writer_order(w, k);
        uint64_t bytes = st_writer_tensor_bytes(w, idx);
        void *buf = malloc(bytes + 1);
        code = buf ? lora_part_values(&rw->parts[idx], buf) : nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
        if (code == NF4_OK)
            code = st_writer_write(w, buf, bytes);
        free(buf);
    }
    if (code == NF4_OK)
        code = st_writer_finish(w);
    else if (w)
        st_writer_abort(w);
    free(outs);
    return code;
}

static int rewrite_open(const struct lora_rewrite *rw, struct model **out)
{
    /* A file that no name reaches, so that even SIGKILL leaves nothing in TMPDIR. */
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    char *tmp = NULL;
    int fd = create_unnamed_temp(dir, "nf4deq-lora", &tmp);
    if (fd < 0)
        return errno == ENOMEM ? nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory")
                               : nf4_fail_errno(NF4_ECANTCREAT, errno, dir, NULL, "cannot create a temp file for "
                                                "the converted LoRA (set TMPDIR)");
    int code = write_parts(rw, fd, tmp);
    if (code == NF4_OK)
        code = model_open_fd_as(fd, rw->path, out);
    else
        close(fd);
    free(tmp);
    /* Messages about a converted key name the file's key it was made from. */
    struct st_file *f = code == NF4_OK ? (*out)->files[0] : NULL;
    for (size_t i = 0; f && i < rw->nparts && code == NF4_OK; i++) {
        const struct st_tensor *src = rw->parts[i].src->t;
        const struct st_tensor *t = st_find(f, rw->parts[i].name);
        if (t) /* one of f's own tensors, which f (not const) may change */
            code = st_set_origin(f, &f->tensors[t - f->tensors], src->origin ? src->origin : src->name);
    }
    if (code != NF4_OK && f) {
        model_close(*out);
        *out = NULL;
    }
    return code;
}

void lora_rewrite_leave_out(struct lora_rewrite *rw, const char *name, size_t len, size_t n)
{
    rw->nleft += n;
    if (rw->last_listed && strlen(rw->last_listed) == len && strncmp(rw->last_listed, name, len) == 0)
        return;
    if (rw->listed < LISTED_LEFT_OUT)
        strbuf_printf(&rw->left_out, "%s%.*s", rw->listed ? ", " : "", (int)len, name);
    else if (rw->listed == LISTED_LEFT_OUT)
        strbuf_puts(&rw->left_out, ", ...");
    rw->listed++;
    free(rw->last_listed);
    rw->last_listed = strndup(name, len);
}

void lora_rewrite_leave_out_dora(struct lora_rewrite *rw, const struct model *w)
{
    for (size_t i = 0; i < w->count; i++)
        if (lora_is_dora_scale(w->tensors[i].t->name))
            lora_rewrite_leave_out(rw, w->tensors[i].t->name, strlen(w->tensors[i].t->name), 1);
}

int lora_rewrite_use_config(struct lora_rewrite *rw, const struct st_file *f, char *config, struct st_meta **meta)
{
    *meta = calloc(f->nmeta + 1, sizeof **meta);
    if (!*meta)
        return nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < f->nmeta; i++)
        if (strcmp(f->meta[i].key, DIFFUSERS_LORA_METADATA) != 0)
            (*meta)[n++] = f->meta[i];
    (*meta)[n++] = (struct st_meta){(char *)DIFFUSERS_LORA_METADATA, config};
    rw->meta = *meta;
    rw->nmeta = n;
    return NF4_OK;
}

int lora_rewrite_finish(struct lora_rewrite *rw, int code, int warn, const char *why, struct model **out)
{
    *out = NULL;
    if (code == NF4_OK && rw->left_out.oom)
        code = nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    if (code == NF4_OK && warn && rw->nleft)
        nf4_warn("%s: %zu of its tensors (%s) %s: they are not merged", rw->path, rw->nleft, rw->left_out.p, why);
    if (code == NF4_OK)
        code = rewrite_open(rw, out);
    for (size_t i = 0; i < rw->nparts; i++) {
        free(rw->parts[i].name);
        free(rw->parts[i].values);
    }
    free(rw->parts);
    free(rw->left_out.p);
    free(rw->last_listed);
    memset(rw, 0, sizeof *rw);
    return code;
}

/* ---- the file's keys, renamed ---- */

int lora_is_dora_scale(const char *key)
{
    return strstr(key, "dora_scale") != NULL;
}

static int key_cmp(const void *a, const void *b)
{
    return strcmp(((const struct lora_key *)a)->name, ((const struct lora_key *)b)->name);
}

void lora_keys_sort(struct lora_key *keys, size_t n)
{
    qsort(keys, n, sizeof *keys, key_cmp);
}

struct lora_key *lora_key_find(struct lora_key *keys, size_t n, const char *name)
{
    struct lora_key probe = {(char *)name, NULL, 0};
    return bsearch(&probe, keys, n, sizeof *keys, key_cmp);
}

struct lora_key *lora_key_available(struct lora_key *keys, size_t n, const char *name)
{
    struct lora_key *k = name ? lora_key_find(keys, n, name) : NULL;
    return k && !k->taken ? k : NULL;
}

int lora_keys_check_distinct(const char *path, const struct lora_key *keys, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (strcmp(keys[i - 1].name, keys[i].name) == 0)
            return nf4_fail(NF4_EDATA, path, keys[i].t->t->name, "becomes %s, as %s does (diffusers would keep one "
                            "of them)", keys[i].name, keys[i - 1].t->t->name);
    return NF4_OK;
}

int lora_keys_of(const char *path, const struct model *w, int (*skip)(const char *), struct lora_key **keys,
                 size_t *n)
{
    *n = 0;
    if (!(*keys = calloc(w->count ? w->count : 1, sizeof **keys)))
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < w->count; i++) {
        const char *name = w->tensors[i].t->name;
        if (skip && skip(name))
            continue;
        if (strlen(name) > LORA_KEY_MAX)
            return nf4_fail(NF4_EDATA, path, name, "is too long a name for a LoRA key (over %d bytes)", LORA_KEY_MAX);
        if (!((*keys)[*n].name = strdup(name)))
            return nf4_fail(NF4_ESOFTWARE, path, name, "out of memory");
        (*keys)[(*n)++].t = &w->tensors[i];
    }
    return NF4_OK;
}

int lora_keys_replace(const char *path, struct lora_key *keys, size_t n, const char *from, const char *to)
{
    for (size_t i = 0; i < n; i++)
        if (!str_replace_in(&keys[i].name, from, to))
            return nf4_fail(NF4_ESOFTWARE, path, keys[i].t->t->name, "out of memory");
    return NF4_OK;
}

int lora_keys_rename(const char *path, struct lora_key *keys, size_t n, char *(*rename)(const char *name))
{
    for (size_t i = 0; i < n; i++) {
        char *name = rename(keys[i].name);
        if (!name)
            return nf4_fail(NF4_ESOFTWARE, path, keys[i].t->t->name, "out of memory");
        free(keys[i].name);
        keys[i].name = name;
    }
    return NF4_OK;
}

int lora_rewrite_renamed(const struct model *w, const char *path, int warn,
                         int (*rename)(const char *path, struct lora_key *keys, size_t n, const void *how),
                         const void *how, const char *target, struct model **out)
{
    *out = NULL;
    struct lora_rewrite rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta};
    lora_rewrite_leave_out_dora(&rw, w); /* dropped before the conversion, with a warning */
    struct lora_key *keys = NULL;
    size_t n = 0;
    int code = lora_keys_of(path, w, lora_is_dora_scale, &keys, &n);
    if (code == NF4_OK)
        code = rename(path, keys, n, how);
    if (code == NF4_OK) {
        lora_keys_sort(keys, n);
        code = lora_keys_check_distinct(path, keys, n); /* diffusers' dict keeps one of them */
    }
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        code = lora_rewrite_add_copy(&rw, target, keys[i].name, keys[i].t);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&rw);
    code = lora_rewrite_finish(&rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(keys, n);
    return code;
}

int lora_keys_rename_chain(const char *path, struct lora_key *keys, size_t n, const void *how)
{
    const struct lora_rename_chain *chain = how;
    lora_keys_remove_prefix(keys, n, chain->prefix);
    int code = NF4_OK;
    for (size_t r = 0; r < chain->n && code == NF4_OK; r++)
        code = lora_keys_replace(path, keys, n, chain->renames[r][0], chain->renames[r][1]);
    return code;
}

int lora_keys_any_start(const struct lora_key *keys, size_t n, const char *prefix)
{
    for (size_t i = 0; i < n; i++)
        if (str_starts_with(keys[i].name, prefix))
            return 1;
    return 0;
}

int lora_model_any_key(const struct model *w, int (*test)(const char *name))
{
    for (size_t i = 0; i < w->count; i++)
        if (!lora_is_dora_scale(w->tensors[i].t->name) && test(w->tensors[i].t->name))
            return 1;
    return 0;
}

int lora_model_any_key_starting(const struct model *w, const char *prefix)
{
    for (size_t i = 0; i < w->count; i++)
        if (!lora_is_dora_scale(w->tensors[i].t->name) && str_starts_with(w->tensors[i].t->name, prefix))
            return 1;
    return 0;
}

void lora_keys_remove_prefix(struct lora_key *keys, size_t n, const char *prefix)
{
    const size_t len = strlen(prefix);
    for (size_t i = 0; i < n; i++)
        if (str_starts_with(keys[i].name, prefix))
            memmove(keys[i].name, keys[i].name + len, strlen(keys[i].name + len) + 1);
}

void lora_keys_cut(struct lora_key *keys, size_t n, size_t cut)
{
    for (size_t i = 0; i < n; i++) {
        char *p = keys[i].name;
        for (size_t c = 0; c < cut && *p; c++) /* characters: names are UTF-8 */
            do
                p++;
            while (((unsigned char)*p & 0xC0) == 0x80);
        memmove(keys[i].name, p, strlen(p) + 1);
    }
}

/* The length of the character of the whitespace int() and float() strip
 * that the UTF-8 text s[0..n) holds whole, else 0: str.isspace's past
 * ASCII, which CPython makes ' ' before parsing, and in ASCII only what
 * Py_ISSPACE strips (not 0x1C-0x1F, which str.isspace counts: int("8\x1c")
 * raises). */
static size_t python_space(const unsigned char *s, size_t n)
{
    if (n == 1)
        return s[0] == ' ' || (s[0] >= '\t' && s[0] <= '\r');
    if (n == 2)
        return s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0) ? 2 : 0; /* U+0085, U+00A0 */
    if (n != 3)
        return 0;
    /* U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000 */
    const unsigned c = (unsigned)s[0] << 16 | (unsigned)s[1] << 8 | s[2];
    int space = c == 0xE19A80 || (c >= 0xE28080 && c <= 0xE2808A) || c == 0xE280A8 || c == 0xE280A9 ||
                c == 0xE280AF || c == 0xE2819F || c == 0xE38080;
    return space ? 3 : 0;
}

/* Moves *s and *end past the whitespace around the text between them, as
 * Python's int() and float() strip it (Unicode's included). */
static void python_strip(const char **s, const char **end)
{
    for (int more = 1; more;) {
        more = 0;
        for (size_t n = 1; n <= 3 && !more; n++) {
            if ((size_t)(*end - *s) >= n && python_space((const unsigned char *)*s, n)) {
                *s += n;
                more = 1;
            } else if ((size_t)(*end - *s) >= n && python_space((const unsigned char *)*end - n, n)) {
                *end -= n;
                more = 1;
            }
        }
    }
}

int lora_python_int(const char *s, size_t len, int64_t *out)
{
    const char *end = s + len;
    python_strip(&s, &end);
    int negative = s < end && *s == '-';
    if (s < end && (*s == '-' || *s == '+'))
        s++;
    if (s == end || *s < '0' || *s > '9' || end[-1] == '_')
        return 0;
    int64_t v = 0;
    for (; s < end; s++) {
        if (*s == '_' && s[1] != '_')
            continue;
        if (*s < '0' || *s > '9' || v > (INT64_MAX - 9) / 10)
            return 0;
        v = v * 10 + (*s - '0');
    }
    *out = negative ? -v : v;
    return 1;
}

static int is_digit(char c)
{
    return c >= '0' && c <= '9';
}

/* Copies the digits at *s (one or more, single underscores between them)
 * to *to, without the underscores; how many digits. */
static size_t copy_digits(const char **s, const char *end, char **to)
{
    size_t n = 0;
    while (*s < end && (is_digit(**s) || (n && **s == '_' && *s + 1 < end && is_digit((*s)[1])))) {
        if (**s != '_') {
            *(*to)++ = **s;
            n++;
        }
        (*s)++;
    }
    return n;
}

int lora_python_float(const char *s, size_t len, double *out)
{
    const char *end = s + len;
    python_strip(&s, &end);
    for (const char *p = s; p < end; p++)
        if ((unsigned char)*p >= 0x80)
            return -1; /* Unicode's digits, which Python reads too */
    const int negative = s < end && *s == '-';
    if (s < end && (*s == '-' || *s == '+'))
        s++;
    const size_t n = (size_t)(end - s);
    if ((n == 3 && strncasecmp(s, "inf", 3) == 0) || (n == 8 && strncasecmp(s, "infinity", 8) == 0)) {
        *out = negative ? -INFINITY : INFINITY;
        return 1;
    }
    if (n == 3 && strncasecmp(s, "nan", 3) == 0) {
        *out = NAN;
        return 1;
    }
    char *text = malloc(n + 2), *to = text;
    if (!text)
        return -2;
    *to++ = negative ? '-' : '+';
    size_t digits = copy_digits(&s, end, &to);
    if (s < end && *s == '.') {
        *to++ = *s++;
        digits += copy_digits(&s, end, &to);
    }
    int ok = digits > 0;
    if (ok && s < end && (*s == 'e' || *s == 'E')) {
        *to++ = *s++;
        if (s < end && (*s == '-' || *s == '+'))
            *to++ = *s++;
        ok = copy_digits(&s, end, &to) > 0;
    }
    *to = 0;
    ok = ok && s == end;
    if (ok)
        *out = strtod(text, NULL); /* the C locale's: '.' */
    free(text);
    return ok;
}

/* By where each tensor's data starts, then by name (tensors of no bytes share an offset). */
static int file_order_cmp(const void *a, const void *b)
{
    const struct st_tensor *x = (*(struct lora_key *const *)a)->t->t, *y = (*(struct lora_key *const *)b)->t->t;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return strcmp(x->name, y->name);
}

struct lora_key **lora_keys_in_file_order(struct lora_key *keys, size_t n)
{
    struct lora_key **order = calloc(n ? n : 1, sizeof *order);
    for (size_t i = 0; order && i < n; i++)
        order[i] = &keys[i];
    if (order)
        qsort(order, n, sizeof *order, file_order_cmp);
    return order;
}

void lora_keys_free(struct lora_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(keys[i].name);
    free(keys);
}

/* ---- alphas ---- */

int lora_is_factor_dtype(enum st_dtype dt)
{
    return dt == DT_F32 || dt == DT_BF16 || dt == DT_F16;
}

int lora_check_factor_dtype(const char *path, const struct st_tensor *t)
{
    return lora_is_factor_dtype(t->dtype) ? NF4_OK
                                          : nf4_fail(NF4_EDATA, path, t->name, "is %s; LoRA weights must be F32, "
                                                     "BF16 or F16", dtype_name(t->dtype));
}

int lora_is_conv_pair(const struct st_tensor *a, const struct st_tensor *b)
{
    if (a->ndim < 3 || a->ndim > 5 || b->ndim != a->ndim)
        return 0;
    for (size_t d = 2; d < b->ndim; d++)
        if (b->shape[d] != 1)
            return 0;
    return 1;
}

int lora_check_pair(const char *path, const struct st_tensor *dt, const struct st_tensor *ut)
{
    int code = lora_check_factor_dtype(path, dt);
    if (code != NF4_OK || (code = lora_check_factor_dtype(path, ut)) != NF4_OK)
        return code;
    if (dt->ndim != 2 || ut->ndim != 2 || ut->shape[1] != dt->shape[0])
        return nf4_fail(NF4_EDATA, path, dt->name, "is %s; with %s it is not a LoRA pair [r, in], [out, r]",
                        dt->ndim == 2 ? "a matrix" : "not a matrix", ut->name);
    if (dt->nelem == 0 || ut->nelem == 0)
        return nf4_fail(NF4_EDATA, path, dt->nelem ? ut->name : dt->name, "is empty");
    return NF4_OK;
}

int lora_read_number(const char *path, const struct model_tensor *mt, double *alpha)
{
    const struct st_tensor *t = mt->t;
    unsigned char buf[8] = {0};
    const enum st_dtype dt = t->dtype;
    /* What .item() makes a Python number of: a bool too (True / r). */
    const int integer = dt == DT_BOOL || dt == DT_U8 || dt == DT_I8 || dt == DT_I16 || dt == DT_U16 || dt == DT_I32 ||
                        dt == DT_U32 || dt == DT_I64 || dt == DT_U64;
    if (t->nelem != 1 || !(lora_is_factor_dtype(dt) || dt == DT_F64 || integer))
        return nf4_fail(NF4_EDATA, path, t->name, "is not one number (an alpha: F16, BF16, F32, F64, an integer or "
                        "a bool)");
    int code = st_read(mt->file, t, 0, buf, dtype_bits(dt) / 8);
    if (code != NF4_OK)
        return code;
    int64_t i64;
    uint64_t u64;
    switch (dt) {
    case DT_F64: memcpy(alpha, buf, 8); break;
    case DT_BOOL: *alpha = buf[0] != 0; break;
    case DT_U8: *alpha = buf[0]; break;
    case DT_U16: *alpha = (uint16_t)(buf[0] | buf[1] << 8); break;
    case DT_U32: *alpha = (uint32_t)buf[0] | (uint32_t)buf[1] << 8 | (uint32_t)buf[2] << 16 | (uint32_t)buf[3] << 24;
        break;
    case DT_U64: memcpy(&u64, buf, 8); *alpha = (double)u64; break;
    case DT_I8: *alpha = (int8_t)buf[0]; break;
    case DT_I16: *alpha = (int16_t)(buf[0] | buf[1] << 8); break;
    case DT_I32: *alpha = (int32_t)((uint32_t)buf[0] | (uint32_t)buf[1] << 8 | (uint32_t)buf[2] << 16 |
                                    (uint32_t)buf[3] << 24);
        break;
    case DT_I64: memcpy(&i64, buf, 8); *alpha = (double)i64; break;
    default: *alpha = f32_from_element(dt, buf, 0); break;
    }
    return NF4_OK;
}

int lora_read_alpha(const char *path, const struct model_tensor *mt, double *alpha)
{
    int code = lora_read_number(path, mt, alpha);
    if (code == NF4_OK && (!isfinite(*alpha) || *alpha < 0))
        return nf4_fail(NF4_EDATA, path, mt->t->name, "is %g; an alpha is a number from 0 up", *alpha);
    return code;
}

struct counted {
    double value;
    size_t first;
};

static int cmp_counted(const void *a, const void *b)
{
    const struct counted *x = a, *y = b;
    if (x->value != y->value)
        return x->value < y->value ? -1 : 1;
    return (x->first > y->first) - (x->first < y->first);
}

int lora_most_common(const double *v, size_t n, double *out)
{
    struct counted *c = calloc(n ? n : 1, sizeof *c);
    if (!c)
        return 0;
    for (size_t i = 0; i < n; i++)
        c[i] = (struct counted){v[i], i};
    qsort(c, n, sizeof *c, cmp_counted);
    size_t best_count = 0, best_first = 0;
    *out = n ? v[0] : 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && c[j].value == c[i].value)
            j++;
        if (j - i > best_count || (j - i == best_count && c[i].first < best_first)) {
            best_count = j - i;
            best_first = c[i].first;
            *out = c[i].value;
        }
        i = j;
    }
    free(c);
    return 1;
}

double lora_round_to(enum st_dtype dt, double v)
{
    unsigned char b[8];
    if (dt == DT_F64)
        return v;
    f32_to_element(dt, b, 0, (float)v);
    return f32_from_element(dt, b, 0);
}

/* lora_rewrite_add_folded over `nparts` targets (1, or a qkv's 3), `up` cut
 * into that many equal blocks of rows. */
static int add_folded_parts(struct lora_rewrite *rw, const char *const *targets, size_t nparts, const char *a_name,
                            const char *b_name, const struct model_tensor *down, const struct model_tensor *up,
                            const struct model_tensor *alpha)
{
    const struct st_tensor *dt = down->t, *ut = up->t;
    int code = lora_check_pair(rw->path, dt, ut);
    if (code != NF4_OK)
        return code;
    if (ut->shape[0] % nparts != 0)
        return nf4_fail(NF4_EDATA, rw->path, ut->name, "has %llu rows, which diffusers cuts into parts for to_q, "
                        "to_k and to_v that cannot load (not three equal parts)", (unsigned long long)ut->shape[0]);
    const uint64_t r = dt->shape[0], rows = ut->shape[0] / nparts;
    float sd = 1.0f, su = 1.0f;
    if (alpha) {
        double a;
        if ((code = lora_read_alpha(rw->path, alpha, &a)) != NF4_OK)
            return code;
        lora_split_scale(a / (double)r, DT_F64, &sd, &su); /* alpha.item() / rank: Python floats */
    }
    for (size_t j = 0; j < nparts && code == NF4_OK; j++) {
        code = lora_rewrite_add(rw, targets[j], a_name, down, dt->dtype, r, dt->shape[1], 0, 0, sd);
        if (code == NF4_OK)
            code = lora_rewrite_add(rw, targets[j], b_name, up, ut->dtype, rows, r, j * rows, 0, su);
    }
    return code;
}

int lora_rewrite_add_folded(struct lora_rewrite *rw, const char *prefix, const char *a_name, const char *b_name,
                            const struct model_tensor *down, const struct model_tensor *up,
                            const struct model_tensor *alpha)
{
    return add_folded_parts(rw, &prefix, 1, a_name, b_name, down, up, alpha);
}

int lora_rewrite_add_folded_qkv(struct lora_rewrite *rw, const char *const targets[3], const char *a_name,
                                const char *b_name, const struct model_tensor *down, const struct model_tensor *up,
                                const struct model_tensor *alpha)
{
    return add_folded_parts(rw, targets, 3, a_name, b_name, down, up, alpha);
}

void lora_split_scale(double scale, enum st_dtype dt, float *down, float *up)
{
    double d = scale, u = 1.0;
    while (d * 2 < lora_round_to(dt, u)) {
        d *= 2;
        u /= 2;
    }
    *down = (float)d;
    *up = (float)u;
}
