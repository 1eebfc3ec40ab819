/* For the tests of LoRA forms diffusers converts (test_lora_fal.c,
 * test_lora_krea2.c, test_lora_ideogram4.c): a converted LoRA written back as
 * a file in diffusers' own form, a synthetic unquantized model for it to
 * merge into, and the merge through the command line compared with the
 * merge of diffusers' own conversion. */
#ifndef NF4DEQ_TEST_LORA_SYNTH_H
#define NF4DEQ_TEST_LORA_SYNTH_H

#include "test_util.h"

#include "fpconv.h"
#include "lora_diffusers.h"
#include "safetensors_writer.h"

#define SYNTH_MAX_TENSORS 1024
#define SYNTH_NAME_MAX 192

/* Writes `m`'s tensors to `path` as they are, with `meta` (NULL: none): a
 * converted LoRA as a file in diffusers' own form. */
static inline void write_model(const struct model *m, const char *path, const struct st_meta *meta, size_t nmeta)
{
    struct st_out_tensor *outs = calloc(m->count + 1, sizeof *outs);
    for (size_t i = 0; i < m->count; i++) {
        const struct st_tensor *t = m->tensors[i].t;
        outs[i] = (struct st_out_tensor){t->name, t->dtype, t->ndim, t->shape};
    }
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, m->count, meta, nmeta), NF4_OK);
    for (size_t k = 0; k < m->count; k++) {
        const struct model_tensor *mt = &m->tensors[st_writer_order(w, k)];
        const uint64_t bytes = st_tensor_bytes(mt->t);
        unsigned char *v = malloc(bytes + 1);
        assert_int_equal(st_read(mt->file, mt->t, 0, v, bytes), NF4_OK);
        assert_int_equal(st_writer_write(w, v, bytes), NF4_OK);
        free(v);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    free(outs);
}

/* dir: the folder of the component whose keys in the LoRA `m` start with
 * `prefix` ("transformer.", "unet."), the others skipped: for each lora_A
 * [r, in] a BF16 weight [rows of its lora_B, in] ([out, in, k, k] for a
 * convolution's [r, in, k, k]), for each lora_B.bias a
 * BF16 bias, values from 1 to 2 (nothing a rank-r delta of such factors
 * overflows); named by the module, less `strip` (NULL: nothing) where it
 * starts with it, in file `weights`, beside config.json holding `config`. */
static inline void write_component_base(const struct model *m, const char *dir, const char *prefix, const char *strip,
                                        const char *config_json, const char *weights_name)
{
    char (*names)[SYNTH_NAME_MAX] = calloc(SYNTH_MAX_TENSORS, sizeof *names);
    uint64_t (*shapes)[4] = calloc(SYNTH_MAX_TENSORS, sizeof *shapes);
    struct st_out_tensor *outs = calloc(SYNTH_MAX_TENSORS, sizeof *outs);
    size_t n = 0;
    for (size_t i = 0; i < m->count; i++) {
        const struct st_tensor *t = m->tensors[i].t;
        const char *a = strstr(t->name, ".lora_A.weight"), *bias = strstr(t->name, ".lora_B.bias");
        if (strncmp(t->name, prefix, strlen(prefix)) != 0 || (!a && !bias))
            continue;
        const char *module = t->name + strlen(prefix);
        if (strip && strncmp(module, strip, strlen(strip)) == 0)
            module += strlen(strip);
        assert_true(n < SYNTH_MAX_TENSORS);
        if (a) {
            char b_name[SYNTH_NAME_MAX];
            snprintf(b_name, sizeof b_name, "%.*s.lora_B.weight", (int)(a - t->name), t->name);
            const struct model_tensor *b = model_find(m, b_name);
            assert_non_null(b);
            snprintf(names[n], SYNTH_NAME_MAX, "%.*s.weight", (int)(a - module), module);
            shapes[n][0] = b->t->shape[0];
            for (size_t d = 1; d < t->ndim && d < 4; d++) /* a convolution's A [r, in, k, k]: its kernel too */
                shapes[n][d] = t->shape[d];
            outs[n] = (struct st_out_tensor){names[n], DT_BF16, t->ndim, shapes[n]};
        } else {
            snprintf(names[n], SYNTH_NAME_MAX, "%.*s.bias", (int)(bias - module), module);
            shapes[n][0] = t->shape[0];
            outs[n] = (struct st_out_tensor){names[n], DT_BF16, 1, shapes[n]};
        }
        n++;
    }
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config = tu_strdupf("%s/config.json", dir), *weights = tu_strdupf("%s/%s", dir, weights_name);
    tu_write_file(config, config_json, strlen(config_json));
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, weights, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        const struct st_out_tensor *o = &outs[st_writer_order(w, k)];
        uint64_t count = 1;
        for (size_t d = 0; d < o->ndim; d++)
            count *= o->shape[d];
        uint16_t *v = malloc(count * 2 + 2);
        for (uint64_t e = 0; e < count; e++)
            v[e] = (uint16_t)(0x3f80u | ((e * 2654435761u + k * 40503u) & 0x7fu)); /* BF16 from 1 to 2 */
        assert_int_equal(st_writer_write(w, v, count * 2), NF4_OK);
        free(v);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    free(config);
    free(weights);
    free(names);
    free(shapes);
    free(outs);
}

/* dir: a model folder of class `cls` (config.json's _class_name) for the
 * LoRA `m` (keys under "transformer."), as write_component_base makes one. */
static inline void write_lora_base(const struct model *m, const char *dir, const char *cls)
{
    char *json = tu_strdupf("{\"_class_name\": \"%s\"}", cls);
    write_component_base(m, dir, "transformer.", NULL, json, "diffusion_pytorch_model.safetensors");
    free(json);
}

/* `nf4deq convert IN OUT --lora LORA` on the CPU succeeds, writing `lines`
 * lines to standard error (the summary, and any warning). */
static inline void assert_lora_converts(const char *in, const char *out, const char *lora, int lines)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != lines || !strstr(r.err, "with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
}

/* Merged through the command line into a model of class `cls` made for the
 * diffusers-form LoRA file `converted` (write_lora_base), on the model's
 * folder and as the transformer of a pipeline of class `pipeline_cls`,
 * `lora` gives what `converted` gives with `lora`'s metadata, byte for byte;
 * `lines`: what each conversion writes to standard error. Works in folder
 * `dir` (which must not exist); returns the path of the folder's merged
 * weights (allocated). */
static inline char *assert_merges_as_converted(const char *dir, const char *lora, const char *converted,
                                               const char *cls, const char *pipeline_cls, int lines)
{
    assert_int_equal(mkdir(dir, 0755), 0);
    char *base = tu_strdupf("%s/transformer", dir), *pipe = tu_strdupf("%s/pipe", dir),
         *in_pipe = tu_strdupf("%s/pipe/transformer", dir), *index = tu_strdupf("%s/pipe/model_index.json", dir),
         *want_lora = tu_strdupf("%s/want.safetensors", dir),
         *json = tu_strdupf("{\"_class_name\": \"%s\", \"transformer\": [\"diffusers\", \"%s\"]}", pipeline_cls,
                            cls);
    struct model *c, *l;
    assert_int_equal(model_open_file(converted, &c), NF4_OK);
    assert_int_equal(model_open_file(lora, &l), NF4_OK);
    write_lora_base(c, base, cls);
    assert_int_equal(mkdir(pipe, 0755), 0);
    tu_write_file(index, json, strlen(json));
    write_lora_base(c, in_pipe, cls);
    write_model(c, want_lora, l->files[0]->meta, l->files[0]->nmeta); /* diffusers' tensors, the file's config */
    model_close(c);
    model_close(l);
    char *want = tu_strdupf("%s/want", dir), *got = tu_strdupf("%s/got", dir), *got_pipe = tu_strdupf("%s/got-pipe", dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", base, want, "--lora", want_lora, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    assert_lora_converts(base, got, lora, lines);
    assert_lora_converts(pipe, got_pipe, lora, lines);
    char *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *got_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", got),
         *pipe_file = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", got_pipe);
    tu_assert_same_tensors(got_file, want_file);
    tu_assert_same_tensors(pipe_file, want_file);
    free(want_file);
    free(pipe_file);
    free(base);
    free(pipe);
    free(in_pipe);
    free(index);
    free(want_lora);
    free(json);
    free(want);
    free(got);
    free(got_pipe);
    return got_file;
}

/* Whether tensor `name` differs between two safetensors files. */
static inline int tensor_differs(const char *a_path, const char *b_path, const char *name)
{
    struct st_file *a, *b;
    assert_int_equal(st_open(a_path, &a), NF4_OK);
    assert_int_equal(st_open(b_path, &b), NF4_OK);
    const struct st_tensor *ta = st_find(a, name), *tb = st_find(b, name);
    assert_non_null(ta);
    assert_non_null(tb);
    const uint64_t bytes = st_tensor_bytes(ta);
    assert_int_equal(st_tensor_bytes(tb), bytes);
    unsigned char *x = malloc(bytes + 1), *y = malloc(bytes + 1);
    assert_int_equal(st_read(a, ta, 0, x, bytes), NF4_OK);
    assert_int_equal(st_read(b, tb, 0, y, bytes), NF4_OK);
    const int differs = memcmp(x, y, bytes) != 0;
    free(x);
    free(y);
    st_close(a);
    st_close(b);
    return differs;
}

/* One tensor of a hand-made LoRA file: every element `value` in `dtype`
 * (F32, BF16, F16); d1 0: a vector of d0. */
struct synth_tensor {
    const char *name;
    enum st_dtype dtype;
    uint64_t d0, d1;
    float value;
};

/* Writes the `n` tensors `ts` to `path`, with `lora_metadata` as the
 * diffusers LoRA config of its metadata (NULL: none). */
static inline void write_synth_file_with_config(const char *path, const struct synth_tensor *ts, size_t n,
                                                const char *lora_metadata)
{
    struct st_out_tensor *outs = calloc(n + 1, sizeof *outs);
    uint64_t (*shapes)[2] = calloc(n + 1, sizeof *shapes);
    for (size_t i = 0; i < n; i++) {
        shapes[i][0] = ts[i].d0;
        shapes[i][1] = ts[i].d1;
        outs[i] = (struct st_out_tensor){ts[i].name, ts[i].dtype, ts[i].d1 ? 2u : 1u, shapes[i]};
    }
    struct st_meta meta = {(char *)DIFFUSERS_LORA_METADATA, (char *)lora_metadata};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, n, lora_metadata ? &meta : NULL, lora_metadata ? 1 : 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        const struct synth_tensor *t = &ts[st_writer_order(w, k)];
        const uint64_t count = t->d0 * (t->d1 ? t->d1 : 1), bytes = count * (dtype_bits(t->dtype) / 8);
        unsigned char *v = malloc(bytes + 1);
        for (uint64_t e = 0; e < count; e++)
            f32_to_element(t->dtype, v, e, t->value);
        assert_int_equal(st_writer_write(w, v, bytes), NF4_OK);
        free(v);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    free(outs);
    free(shapes);
}

/* Writes the `n` tensors `ts` to `path`. */
static inline void write_synth_file(const char *path, const struct synth_tensor *ts, size_t n)
{
    write_synth_file_with_config(path, ts, n, NULL);
}

/* A scratch folder's teardown where a test pointed TMPDIR into it: the
 * folder, gone, is no TMPDIR for the next test's. */
static inline int lora_synth_teardown(void **state)
{
    unsetenv("TMPDIR");
    return tu_scratch_teardown(state);
}

/* `nf4deq convert --device cpu IN OUT --lora LORA` exits 65 with one line
 * naming LORA and holding `want`, writes no OUT, and leaves folder `dir`
 * empty. */
static inline void assert_lora_refused(const char *in, const char *out, const char *lora, const char *want,
                                       const char *dir)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, want) || !strstr(r.err, lora))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    assert_int_equal(tu_count_entries(dir), 0);
}

/* Writes `lora` holding a BF16 [2, 8] tensor of 0.5s for each of the first
 * `max` of `names` up to a NULL: a file that only its names make wrong. */
static inline void write_names_file(const char *lora, const char *const *names, size_t max)
{
    struct synth_tensor ts[8];
    size_t n = 0;
    while (n < max && n < sizeof ts / sizeof ts[0] && names[n]) {
        ts[n] = (struct synth_tensor){names[n], DT_BF16, 2, 8, 0.5f};
        n++;
    }
    write_synth_file(lora, ts, n);
}

/* diffusers_lora_open of the file `lora` as `family` refuses it: NF4_EDATA
 * in one line naming `lora` and holding `want`, no model, and nothing left in
 * TMPDIR `dir` (case `i` of a table, for the message). */
static inline void assert_lora_open_refused(const char *lora, enum lora_family family, const char *want,
                                            const char *dir, size_t i)
{
    struct model *m = NULL;
    nf4_clear_error();
    if (diffusers_lora_open(lora, family, 0, &m) != NF4_EDATA || !strstr(nf4_last_error(), want) ||
        !strstr(nf4_last_error(), lora) || strchr(nf4_last_error(), '\n'))
        fail_msg("case %zu: %s", i, nf4_last_error());
    assert_null(m);
    assert_int_equal(tu_count_entries(dir), 0);
}

#endif
