/* Checkpoints written for a test from the fixture's tensors (what
 * bitsandbytes itself wrote) under other names: a 4-bit weight with all its
 * quant-state parts, a tensor copied, or values given; in one shard or more. */
#ifndef NF4DEQ_FIXTURE_CHECKPOINT_H
#define NF4DEQ_FIXTURE_CHECKPOINT_H

#include "test_util.h"

#include <stdarg.h>

#include "convert.h"
#include "model.h"

/* One tensor of the checkpoint written: copied from a fixture file, or given. */
struct spec {
    char *name;
    const struct st_file *from; /* NULL: `data` */
    const struct st_tensor *t;
    enum st_dtype dtype;
    size_t ndim;
    uint64_t shape[2];
    void *data;
    int file; /* shard */
};

struct checkpoint {
    struct spec s[1024];
    size_t n;
    struct st_file *bnb, *source;
};

static inline void add_copy(struct checkpoint *c, int file, const struct st_file *from, const char *from_name,
                            const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static inline void add_copy(struct checkpoint *c, int file, const struct st_file *from, const char *from_name,
                            const char *fmt, ...)
{
    char name[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    const struct st_tensor *t = st_find(from, from_name);
    assert_non_null(t);
    struct spec *s = &c->s[c->n++];
    *s = (struct spec){.name = strdup(name), .from = from, .t = t, .dtype = t->dtype, .ndim = t->ndim, .file = file};
    memcpy(s->shape, t->shape, t->ndim * sizeof *t->shape);
}

/* A 4-bit weight of the fixture with all its quant-state parts, as `name`. */
static inline void add_weight(struct checkpoint *c, int file, char x, const char *name)
{
    char prefix[32];
    snprintf(prefix, sizeof prefix, "model.%c.weight", x);
    for (size_t i = 0; i < c->bnb->count; i++) {
        const char *n = c->bnb->tensors[i].name;
        if (strncmp(n, prefix, strlen(prefix)) == 0)
            add_copy(c, file, c->bnb, n, "%s%s", name, n + strlen(prefix));
    }
}

static inline uint64_t fixture_rows(const struct checkpoint *c, char x)
{
    char name[32];
    snprintf(name, sizeof name, "model.%c.weight", x);
    return st_find(c->source, name)->shape[0];
}

static inline void write_shard(const struct checkpoint *c, int file, const char *path)
{
    struct st_out_tensor outs[1024] = {{0}};
    size_t idx[1024], n = 0;
    for (size_t i = 0; i < c->n; i++)
        if (c->s[i].file == file) {
            outs[n] = (struct st_out_tensor){c->s[i].name, c->s[i].dtype, c->s[i].ndim, c->s[i].shape};
            idx[n++] = i;
        }
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        const struct spec *s = &c->s[idx[st_writer_order(w, k)]];
        uint64_t bytes = s->from ? st_tensor_bytes(s->t)
                                 : s->shape[0] * (s->ndim > 1 ? s->shape[1] : 1) * dtype_bits(s->dtype) / 8;
        unsigned char *buf = malloc(bytes + 1);
        if (s->from)
            assert_int_equal(st_read(s->from, s->t, 0, buf, bytes), NF4_OK);
        else
            memcpy(buf, s->data, bytes);
        assert_int_equal(st_writer_write(w, buf, bytes), NF4_OK);
        free(buf);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
}

/* The bytes of tensor `name` of an opened model. */
static inline unsigned char *read_tensor(const struct model *m, const char *name, uint64_t *bytes)
{
    const struct model_tensor *t = model_find(m, name);
    if (!t)
        fail_msg("%s is not in the output", name);
    *bytes = st_tensor_bytes(t->t);
    unsigned char *buf = malloc(*bytes + 1);
    assert_int_equal(st_read(t->file, t->t, 0, buf, *bytes), NF4_OK);
    return buf;
}

/* One LoRA pair of a PEFT adapter: on `module` (the base's name, without
 * ".weight"), B @ A of shape [out, in]. */
struct adapter_pair {
    const char *module;
    uint64_t out, in;
};

/* dir: a PEFT adapter (adapter_config.json `config`) of `n` pairs of rank
 * `rank`, fp32 values spread over [-0.5, 0.5), with a DoRA magnitude per
 * pair with `dora`. */
static inline void write_adapter(const char *dir, const char *config, const struct adapter_pair *pairs, size_t npairs,
                                 uint64_t rank, int dora)
{
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config_path = tu_strdupf("%s/adapter_config.json", dir);
    tu_write_file(config_path, config, strlen(config));
    enum { PER_PAIR = 3, MAX_PAIRS = 16 };
    assert_true(npairs <= MAX_PAIRS);
    struct st_out_tensor outs[MAX_PAIRS * PER_PAIR];
    char *names[MAX_PAIRS * PER_PAIR];
    float *values[MAX_PAIRS * PER_PAIR];
    uint64_t shapes[MAX_PAIRS * PER_PAIR][2];
    size_t n = 0;
    for (size_t p = 0; p < npairs; p++) {
        static const char *const KEYS[PER_PAIR] = {"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"};
        const uint64_t SHAPES[PER_PAIR][2] = {{rank, pairs[p].in}, {pairs[p].out, rank}, {pairs[p].out, 0}};
        for (int k = 0; k < (dora ? 3 : 2); k++, n++) {
            names[n] = tu_strdupf("base_model.model.%s.%s", pairs[p].module, KEYS[k]);
            memcpy(shapes[n], SHAPES[k], sizeof shapes[n]);
            uint64_t count = shapes[n][0] * (shapes[n][1] ? shapes[n][1] : 1);
            values[n] = malloc(count * 4);
            for (uint64_t e = 0; e < count; e++)
                values[n][e] = (float)((e * 2654435761u + n * 97u) % 1000u) / 1000.0f - 0.5f;
            outs[n] = (struct st_out_tensor){names[n], DT_F32, shapes[n][1] ? 2u : 1u, shapes[n]};
        }
    }
    char *weights = tu_strdupf("%s/adapter_model.safetensors", dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, weights, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        size_t i = st_writer_order(w, k);
        assert_int_equal(st_writer_write(w, values[i], shapes[i][0] * (shapes[i][1] ? shapes[i][1] : 1) * 4), NF4_OK);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    for (size_t i = 0; i < n; i++) {
        free(names[i]);
        free(values[i]);
    }
    free(weights);
    free(config_path);
}

/* Converts model directory `in` into `out` on the CPU, to bf16, with the
 * adapter in directory `adapter` merged (NULL: none). */
static inline int convert_model_dir(const char *in, const char *out, int threads, uint64_t chunk_elements,
                                    uint64_t mem, const char *adapter, struct convert_stats *st)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.dtype = DT_BF16;
    o.threads = threads;
    o.chunk_elements = chunk_elements;
    o.mem = mem;
    const char *lora[] = {adapter};
    o.lora_dirs = lora;
    o.nlora = adapter != NULL;
    nf4_set_quiet(1);
    return convert_run(in, out, &o, st);
}

/* `nf4deq convert` of `in` into `out` with --lora `adapter` exits 65 with the
 * one line `want` on standard error, and writes nothing. */
static inline void assert_merge_refused(const char *in, const char *out, const char *adapter, const char *want)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", adapter, NULL);
    if (r.status != NF4_EDATA || strcmp(r.err, want) != 0)
        fail_msg("exit %d, stderr:\n%swanted:\n%s", r.status, r.err, want);
    assert_false(tu_exists(out));
    tu_run_free(&r);
}

#endif
