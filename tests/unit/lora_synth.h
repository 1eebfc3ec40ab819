/* For the tests of LoRA forms diffusers converts (test_lora_fal.c,
 * test_lora_krea2.c): a converted LoRA written back as a file in diffusers'
 * own form, and a synthetic unquantized model for it to merge into. */
#ifndef NF4DEQ_TEST_LORA_SYNTH_H
#define NF4DEQ_TEST_LORA_SYNTH_H

#include "test_util.h"

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

/* dir: a model folder of class `cls` (config.json's _class_name) for the
 * LoRA `m` (keys under "transformer."): for each lora_A [r, in] a BF16
 * weight [rows of its lora_B, in], for each lora_B.bias a BF16 bias, values
 * from 1 to 2 (nothing a rank-r delta of such factors overflows). */
static inline void write_lora_base(const struct model *m, const char *dir, const char *cls)
{
    static const char TARGET[] = "transformer.";
    char (*names)[SYNTH_NAME_MAX] = calloc(SYNTH_MAX_TENSORS, sizeof *names);
    uint64_t (*shapes)[2] = calloc(SYNTH_MAX_TENSORS, sizeof *shapes);
    struct st_out_tensor *outs = calloc(SYNTH_MAX_TENSORS, sizeof *outs);
    size_t n = 0;
    for (size_t i = 0; i < m->count; i++) {
        const struct st_tensor *t = m->tensors[i].t;
        const char *a = strstr(t->name, ".lora_A.weight"), *bias = strstr(t->name, ".lora_B.bias");
        assert_true(strncmp(t->name, TARGET, strlen(TARGET)) == 0);
        const char *module = t->name + strlen(TARGET);
        if (!a && !bias)
            continue;
        assert_true(n < SYNTH_MAX_TENSORS);
        if (a) {
            char b_name[SYNTH_NAME_MAX];
            snprintf(b_name, sizeof b_name, "%.*s.lora_B.weight", (int)(a - t->name), t->name);
            const struct model_tensor *b = model_find(m, b_name);
            assert_non_null(b);
            snprintf(names[n], SYNTH_NAME_MAX, "%.*s.weight", (int)(a - module), module);
            shapes[n][0] = b->t->shape[0];
            shapes[n][1] = t->shape[1];
            outs[n] = (struct st_out_tensor){names[n], DT_BF16, 2, shapes[n]};
        } else {
            snprintf(names[n], SYNTH_NAME_MAX, "%.*s.bias", (int)(bias - module), module);
            shapes[n][0] = t->shape[0];
            outs[n] = (struct st_out_tensor){names[n], DT_BF16, 1, shapes[n]};
        }
        n++;
    }
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config = tu_strdupf("%s/config.json", dir), *json = tu_strdupf("{\"_class_name\": \"%s\"}", cls),
         *weights = tu_strdupf("%s/diffusion_pytorch_model.safetensors", dir);
    tu_write_file(config, json, strlen(json));
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, weights, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        const struct st_out_tensor *o = &outs[st_writer_order(w, k)];
        const uint64_t count = o->shape[0] * (o->ndim == 2 ? o->shape[1] : 1);
        uint16_t *v = malloc(count * 2 + 2);
        for (uint64_t e = 0; e < count; e++)
            v[e] = (uint16_t)(0x3f80u | ((e * 2654435761u + k * 40503u) & 0x7fu)); /* BF16 from 1 to 2 */
        assert_int_equal(st_writer_write(w, v, count * 2), NF4_OK);
        free(v);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    free(config);
    free(json);
    free(weights);
    free(names);
    free(shapes);
    free(outs);
}

#endif
