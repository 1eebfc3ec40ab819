/* LoRA files too large (or too many) to keep in the tree, built by a test
 * from a recipe, and their conversion checked against digests of diffusers'
 * own (tests/fixtures/diffusers/recipe_digest.py says the form, and writes
 * the digest files; this header makes and reads the same). */
#ifndef NF4DEQ_TEST_LORA_RECIPE_H
#define NF4DEQ_TEST_LORA_RECIPE_H

#include "test_util.h"

#include <inttypes.h>

#include "fpconv.h"
#include "lora_diffusers.h"
#include "lora_synth.h"
#include "safetensors_writer.h"

#define RECIPE_MAX_TENSORS 1024
#define RECIPE_NAME_MAX 128
#define FNV64_START 0xcbf29ce484222325ull

/* How the values of a recipe's tensors are made (recipe_digest.py): the
 * recipe's bits, or their mantissa under an exponent of 0 (from 1 to 2). */
enum recipe_values { RECIPE, FROM_1_TO_2 };

struct recipe_tensor {
    char name[RECIPE_NAME_MAX];
    enum st_dtype dtype;
    size_t ndim; /* 0 to 4 */
    uint64_t shape[4];
    int fixed; /* every element `value` (an alpha), not the recipe's */
    float value;
    int seeded; /* values made as for another name, whose FNV-1a hash is `seed` (a key renamed) */
    uint32_t seed;
};

struct recipe {
    struct recipe_tensor t[RECIPE_MAX_TENSORS];
    size_t n;
    enum recipe_values values;
};

static inline uint32_t fnv1a32(const char *s)
{
    uint32_t h = 0x811c9dc5u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x01000193u;
    return h;
}

static inline uint64_t fnv1a64(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static inline struct recipe_tensor *recipe_add(struct recipe *r, const char *name, enum st_dtype dt, size_t ndim,
                                               uint64_t d0, uint64_t d1)
{
    assert_true(r->n < RECIPE_MAX_TENSORS);
    struct recipe_tensor *t = &r->t[r->n++];
    memset(t, 0, sizeof *t);
    assert_true((size_t)snprintf(t->name, sizeof t->name, "%s", name) < sizeof t->name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    return t;
}

static inline struct recipe_tensor *recipe_find(struct recipe *r, const char *name)
{
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->t[i].name, name) == 0)
            return &r->t[i];
    fail_msg("the recipe has no %s", name);
    return NULL;
}

static inline void recipe_remove(struct recipe *r, const char *name)
{
    struct recipe_tensor *t = recipe_find(r, name);
    *t = r->t[--r->n];
}

static inline uint64_t recipe_count(const struct recipe_tensor *t)
{
    uint64_t n = 1;
    for (size_t d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

/* The bytes of `t`: element j holds h = (s + j * 2654435761) mod 2^32, s
 * the FNV-1a hash of its name (or t->seed), mod 0x7c00 (16-bit) or 0x7f800000 (F32); or
 * FROM_1_TO_2, h's mantissa bits under an exponent of 0; or t->value. */
static inline unsigned char *recipe_values(const struct recipe_tensor *t, enum recipe_values values, size_t *len)
{
    const uint64_t n = recipe_count(t);
    const unsigned size = dtype_bits(t->dtype) / 8;
    unsigned char *buf = malloc(n * size + 1);
    assert_non_null(buf);
    const uint32_t s = t->seeded ? t->seed : fnv1a32(t->name);
    for (uint64_t j = 0; j < n; j++) {
        const uint32_t h = s + (uint32_t)j * 2654435761u;
        if (t->fixed) {
            f32_to_element(t->dtype, buf, j, t->value);
        } else if (size == 2) {
            uint16_t v = (uint16_t)(h % 0x7c00u);
            if (values == FROM_1_TO_2)
                v = t->dtype == DT_F16 ? (uint16_t)(0x3c00u | (h & 0x3ffu)) : (uint16_t)(0x3f80u | (h & 0x7fu));
            memcpy(buf + j * 2, &v, 2); /* little-endian host */
        } else {
            const uint32_t v = values == FROM_1_TO_2 ? 0x3f800000u | (h & 0x7fffffu) : h % 0x7f800000u;
            memcpy(buf + j * 4, &v, 4);
        }
    }
    *len = (size_t)(n * size);
    return buf;
}

static inline int recipe_by_name(const void *a, const void *b)
{
    return strcmp(((const struct recipe_tensor *)a)->name, ((const struct recipe_tensor *)b)->name);
}

/* The digest's step for one tensor: name, dtype, shape, each ended by a NUL, then its bytes. */
static inline uint64_t digest_tensor(uint64_t h, const char *name, enum st_dtype dt, size_t ndim,
                                     const uint64_t *shape, const void *data, size_t len)
{
    char head[256];
    int n = snprintf(head, sizeof head, "%s%c%s%c", name, 0, dtype_name(dt), 0);
    for (size_t d = 0; d < ndim; d++)
        n += snprintf(head + n, sizeof head - (size_t)n, "%s%" PRIu64, d ? "," : "", shape[d]);
    head[n++] = 0;
    return fnv1a64(fnv1a64(h, head, (size_t)n), data, len);
}

/* Writes `r` to `path` (sorted by name first) with `values`, and `meta`
 * (NULL: none). Returns the digest of its tensors. */
static inline uint64_t recipe_write(struct recipe *r, const char *path, enum recipe_values values,
                                    const struct st_meta *meta, size_t nmeta)
{
    qsort(r->t, r->n, sizeof r->t[0], recipe_by_name);
    struct st_out_tensor *outs = calloc(r->n + 1, sizeof *outs);
    for (size_t i = 0; i < r->n; i++)
        outs[i] = (struct st_out_tensor){r->t[i].name, r->t[i].dtype, r->t[i].ndim, r->t[i].shape};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, r->n, meta, nmeta), NF4_OK);
    for (size_t k = 0; k < r->n; k++) {
        size_t len, i = st_writer_order(w, k);
        unsigned char *v = recipe_values(&r->t[i], values, &len);
        assert_int_equal(st_writer_write(w, v, len), NF4_OK);
        free(v);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    uint64_t h = FNV64_START;
    for (size_t i = 0; i < r->n; i++) {
        size_t len;
        unsigned char *v = recipe_values(&r->t[i], values, &len);
        h = digest_tensor(h, r->t[i].name, r->t[i].dtype, r->t[i].ndim, r->t[i].shape, v, len);
        free(v);
    }
    free(outs);
    return h;
}

static inline enum st_dtype recipe_dtype(const char *name)
{
    return strcmp(name, "F32") == 0 ? DT_F32 : strcmp(name, "F16") == 0 ? DT_F16 : DT_BF16;
}

/* A "pair KEY DTYPE R IN OUT K [=ALPHA ALPHA_DTYPE]" line: kohya's
 * KEY.lora_down.weight [R, IN] and KEY.lora_up.weight [OUT, R] (K 0), or a
 * convolution's [R, IN, K, K] and [OUT, R, 1, 1], and the 0-dimensional
 * KEY.alpha where given. */
static inline void recipe_read_pair(struct recipe *r, const char *line)
{
    char key[RECIPE_NAME_MAX], dtype[8], alpha[32] = "", alpha_dtype[8] = "", name[RECIPE_NAME_MAX + 32];
    unsigned long long rank, in, out, kernel;
    assert_true(sscanf(line, "pair %127s %7s %llu %llu %llu %llu %31s %7s", key, dtype, &rank, &in, &out, &kernel,
                       alpha, alpha_dtype) >= 6);
    snprintf(name, sizeof name, "%s.lora_down.weight", key);
    struct recipe_tensor *down = recipe_add(r, name, recipe_dtype(dtype), 2, rank, in);
    snprintf(name, sizeof name, "%s.lora_up.weight", key);
    struct recipe_tensor *up = recipe_add(r, name, recipe_dtype(dtype), 2, out, rank);
    if (kernel) {
        down->ndim = up->ndim = 4;
        down->shape[2] = down->shape[3] = kernel;
        up->shape[2] = up->shape[3] = 1;
    }
    if (alpha[0] == '=') {
        snprintf(name, sizeof name, "%s.alpha", key);
        struct recipe_tensor *t = recipe_add(r, name, recipe_dtype(alpha_dtype), 0, 0, 0);
        t->fixed = 1;
        t->value = strtof(alpha + 1, NULL);
    }
}

/* The recipe a digest file lists: its "values" line, its "tensor" lines and
 * its "pair" lines. */
static inline void recipe_read(struct recipe *r, const char *digest_path)
{
    char *text = tu_read_file(digest_path, NULL);
    assert_non_null(text);
    r->n = 0;
    r->values = RECIPE;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (strcmp(line, "values FROM_1_TO_2") == 0)
            r->values = FROM_1_TO_2;
        if (strncmp(line, "pair ", 5) == 0) {
            recipe_read_pair(r, line);
            continue;
        }
        if (strncmp(line, "tensor ", 7) != 0)
            continue;
        char name[RECIPE_NAME_MAX], dtype[8], shape[64], value[32] = "";
        assert_true(sscanf(line, "tensor %127s %7s %63s %31s", name, dtype, shape, value) >= 3);
        const enum st_dtype dt = recipe_dtype(dtype);
        uint64_t d[4] = {0, 0, 0, 0};
        size_t ndim = 0;
        for (char *p = shape; strcmp(shape, "-") != 0 && ndim < 4; ndim++) {
            d[ndim] = strtoull(p, &p, 10);
            if (*p++ != ',') {
                ndim++;
                break;
            }
        }
        struct recipe_tensor *t = recipe_add(r, name, dt, ndim, d[0], d[1]);
        t->shape[2] = d[2];
        t->shape[3] = d[3];
        if (value[0] == '=') {
            t->fixed = 1;
            t->value = strtof(value + 1, NULL);
        }
    }
    free(text);
}

/* The length of the group `name` is in: up to its third dot. */
static inline size_t digest_group_len(const char *name)
{
    const char *p = name;
    for (int dots = 0; *p; p++)
        if (*p == '.' && ++dots == 3)
            break;
    return (size_t)(p - name);
}

static inline int digest_by_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const struct st_tensor *const *)a)->name, (*(const struct st_tensor *const *)b)->name);
}

/* Every group of digest file `digest_path` held by `m` (a converted LoRA),
 * the same count of tensors and the same digest, and no group besides; and
 * where `in` is not 0, the file converted had that digest (the "in" line):
 * the test built what the script made. */
static inline void assert_matches_digest(const struct model *m, const char *digest_path, size_t in_count, uint64_t in)
{
    char *text = tu_read_file(digest_path, NULL);
    assert_non_null(text);
    const struct st_tensor **sorted = malloc((m->count + 1) * sizeof *sorted);
    for (size_t i = 0; i < m->count; i++)
        sorted[i] = m->tensors[i].t;
    qsort(sorted, m->count, sizeof *sorted, digest_by_tensor_name);
    size_t groups = 0, wanted = 0;
    for (size_t i = 0; i < m->count; groups++) {
        const size_t glen = digest_group_len(sorted[i]->name);
        uint64_t h = FNV64_START;
        size_t j = i;
        for (; j < m->count && digest_group_len(sorted[j]->name) == glen &&
               strncmp(sorted[j]->name, sorted[i]->name, glen) == 0;
             j++) {
            const uint64_t bytes = st_tensor_bytes(sorted[j]);
            unsigned char *v = malloc(bytes + 1);
            assert_int_equal(st_read(m->files[0], sorted[j], 0, v, bytes), NF4_OK);
            h = digest_tensor(h, sorted[j]->name, sorted[j]->dtype, sorted[j]->ndim, sorted[j]->shape, v, bytes);
            free(v);
        }
        char want[256];
        snprintf(want, sizeof want, "\ngroup %.*s %zu %016" PRIx64 "\n", (int)glen, sorted[i]->name, j - i, h);
        if (!strstr(text, want))
            fail_msg("%s: diffusers' conversion differs in group %.*s (first tensor %s, %zu tensors, digest %016" PRIx64
                     ")", digest_path, (int)glen, sorted[i]->name, sorted[i]->name, j - i, h);
        i = j;
    }
    for (const char *p = strstr(text, "\ngroup "); p; p = strstr(p + 1, "\ngroup "))
        wanted++;
    assert_int_equal(groups, wanted);
    char in_line[64];
    snprintf(in_line, sizeof in_line, "\nin %zu %016" PRIx64 "\n", in_count, in);
    if (in && !strstr(text, in_line))
        fail_msg("%s: the test built another LoRA than the script (%zu tensors, digest %016" PRIx64 ")", digest_path,
                 in_count, in);
    free(sorted);
    free(text);
}

/* `r` written to `path` (its values, with `meta`), opened by
 * diffusers_lora_open as `family`: the conversion names `path`, matches
 * digest file `digest` group by group (and its "in" line, where `check_in`),
 * and leaves TMPDIR (`dir`) empty. Where `converted` is not NULL, the
 * conversion is written there in diffusers' form (with `meta`). */
static inline void assert_recipe_converts(struct recipe *r, const char *path, const struct st_meta *meta, size_t nmeta,
                                          enum lora_family family, const char *digest, int check_in, const char *dir,
                                          const char *converted)
{
    const uint64_t in = recipe_write(r, path, r->values, meta, nmeta);
    assert_int_equal(setenv("TMPDIR", dir, 1), 0); /* where no temp file may stay */
    struct model *m;
    assert_int_equal(diffusers_lora_open(path, family, 0, &m), NF4_OK);
    assert_string_equal(m->files[0]->path, path); /* messages name the LoRA file */
    assert_matches_digest(m, digest, r->n, check_in ? in : 0);
    if (converted)
        write_model(m, converted, meta, nmeta);
    model_close(m);
    assert_int_equal(tu_count_entries(dir), 0);
}

/* The LoRA digest file `digest` lists, written to DIR-NAME.safetensors,
 * opened as `family`: assert_recipe_converts, its "in" line checked too;
 * the file removed. */
static inline void assert_digest_converts(const char *digest, enum lora_family family, const char *dir,
                                          const char *name)
{
    static struct recipe r;
    recipe_read(&r, digest);
    char *path = tu_strdupf("%s-%s.safetensors", dir, name);
    assert_recipe_converts(&r, path, NULL, 0, family, digest, 1, dir, NULL);
    unlink(path);
    free(path);
}

/* base: a model folder of class `cls` (write_lora_base) for the conversion
 * of `r` (written to `path`, then removed), which must match digest file
 * `digest`; TMPDIR `dir` holds nothing afterwards. */
static inline void recipe_base(struct recipe *r, const char *path, enum lora_family family, const char *digest,
                               const char *dir, const char *base, const char *cls)
{
    char *converted = tu_strdupf("%s.converted", path);
    assert_recipe_converts(r, path, NULL, 0, family, digest, 1, dir, converted);
    struct model *m;
    assert_int_equal(model_open_file(converted, &m), NF4_OK);
    write_lora_base(m, base, cls);
    model_close(m);
    unlink(converted);
    unlink(path);
    free(converted);
}

#endif
