/* GPT-2's Conv1D weights written transposed back, [in, out]
 * (conv1d_layout.h): each compared byte for byte with what bitsandbytes
 * wrote for the weight, transposed; in every chunking, for every Conv1D
 * architecture, with a LoRA merged; a linear layer, and another
 * architecture's layers, kept as stored. The weights are the fixture's of
 * every configuration (tensors.bnb4: blocksizes 64 to 256, rows that do not
 * end on a block, single quant, FP4, bf16 storage, an odd count). */
#include "test_util.h"

#include "fixture_checkpoint.h"
#include "resume.h"

#define WEIGHTS 8
/* Fixture weight a to h as a GPT-2's layers, and the head, a linear layer. */
static const char *const CONV1D_NAMES[WEIGHTS] = {
    "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight",
    "transformer.h.0.mlp.c_proj.weight",  "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.q_attn.weight",
    "transformer.h.1.mlp.c_fc.weight",    "transformer.h.1.mlp.c_proj.weight"};
#define HEAD "lm_head.weight"
#define HEAD_FROM 'c'
#define NORM "transformer.ln_f.weight"
#define RANK 3

/* Composite models with a GPT-2 inside: the config.json that says so, the
 * prefix of the GPT-2's weights, and a Conv1D-named weight of the other part
 * (a ViT's, say), which stays as stored. */
static const struct composite {
    const char *type, *config, *prefix, *other;
} COMPOSITES[] = {
    {"vision-encoder-decoder",
     "{\"model_type\": \"vision-encoder-decoder\", \"encoder\": {\"model_type\": \"vit\"}, "
     "\"decoder\": {\"model_type\": \"gpt2\"}}",
     "decoder.", "encoder.encoder.layer.0.output.c_fc.weight"},
    /* BLIP-2 and a vision-text dual encoder: a GPT-2 in text_config */
    {"blip-2",
     "{\"model_type\": \"blip-2\", \"vision_config\": {\"model_type\": \"blip_2_vision_model\"}, "
     "\"text_config\": {\"model_type\": \"gpt2\"}}",
     "language_model.", "vision_model.encoder.layers.0.mlp.c_fc.weight"},
    {"vision-text-dual-encoder",
     "{\"model_type\": \"vision-text-dual-encoder\", \"vision_config\": {\"model_type\": \"vit\"}, "
     "\"text_config\": {\"model_type\": \"gpt2\"}}",
     "text_model.", "vision_model.encoder.layer.0.output.c_fc.weight"},
    {"llava", "{\"model_type\": \"llava\", \"text_config\": {\"model_type\": \"gpt2\"}}",
     "model.language_model.", "model.vision_tower.c_fc.weight"},
};

static const struct composite *composite_of(const char *type)
{
    for (size_t i = 0; i < sizeof COMPOSITES / sizeof COMPOSITES[0]; i++)
        if (strcmp(type, COMPOSITES[i].type) == 0)
            return &COMPOSITES[i];
    return NULL;
}

/* dir: a checkpoint of config.json's model_type `type`: fixture weights a
 * to h as CONV1D_NAMES, the head as fixture weight HEAD_FROM, a bf16 norm;
 * for a composite type, its config, every name under its prefix, and
 * fixture weight b as its other part's weight besides. */
static void write_gpt2_dir(const char *dir, const char *type)
{
    struct checkpoint *c = calloc(1, sizeof *c);
    assert_int_equal(st_open(FIXTURES "/tensors.bnb4.safetensors", &c->bnb), NF4_OK);
    assert_int_equal(st_open(FIXTURES "/tensors.source.safetensors", &c->source), NF4_OK);
    const struct composite *composite = composite_of(type);
    const char *prefix = composite ? composite->prefix : "";
    char name[256];
    for (int i = 0; i < WEIGHTS; i++) {
        snprintf(name, sizeof name, "%s%s", prefix, CONV1D_NAMES[i]);
        add_weight(c, 0, (char)('a' + i), name);
    }
    snprintf(name, sizeof name, "%s%s", prefix, HEAD);
    add_weight(c, 0, HEAD_FROM, name);
    add_copy(c, 0, c->bnb, "model.norm.weight", "%s%s", prefix, NORM);
    if (composite)
        add_weight(c, 0, 'b', composite->other);
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config = tu_strdupf("%s/config.json", dir),
         *json = composite ? strdup(composite->config) : tu_strdupf("{\"model_type\": \"%s\"}", type),
         *path = tu_strdupf("%s/model.safetensors", dir);
    tu_write_file(config, json, strlen(json));
    write_shard(c, 0, path);
    for (size_t i = 0; i < c->n; i++)
        free(c->s[i].name);
    st_close(c->bnb);
    st_close(c->source);
    free(c);
    free(config);
    free(json);
    free(path);
}

/* out's `name` is `want` ([rows, cols] bf16) transposed: [cols, rows]. */
static void assert_transposed_is(const struct model *out, const char *name, const uint16_t *want, uint64_t rows,
                                 uint64_t cols)
{
    const struct model_tensor *t = model_find(out, name);
    if (!t)
        fail_msg("%s is not in the output", name);
    assert_int_equal(t->t->dtype, DT_BF16);
    assert_int_equal(t->t->ndim, 2);
    if (t->t->shape[0] != cols || t->t->shape[1] != rows)
        fail_msg("%s is [%llu, %llu], expected [%llu, %llu]", name, (unsigned long long)t->t->shape[0],
                 (unsigned long long)t->t->shape[1], (unsigned long long)cols, (unsigned long long)rows);
    uint64_t bytes;
    uint16_t *got = (uint16_t *)read_tensor(out, name, &bytes);
    for (uint64_t c = 0; c < cols; c++)
        for (uint64_t r = 0; r < rows; r++)
            if (got[c * rows + r] != want[r * cols + c])
                fail_msg("%s: [%llu, %llu] is 0x%04x, expected 0x%04x (source [%llu, %llu])", name,
                         (unsigned long long)c, (unsigned long long)r, got[c * rows + r], want[r * cols + c],
                         (unsigned long long)r, (unsigned long long)c);
    free(got);
}

/* What bitsandbytes wrote for fixture weight x, bf16: *rows x *cols. */
static uint16_t *bnb_output(const struct st_file *expected, char x, uint64_t *rows, uint64_t *cols)
{
    char name[32];
    snprintf(name, sizeof name, "model.%c.weight", x);
    const struct st_tensor *t = st_find(expected, name);
    *rows = t->shape[0];
    *cols = t->shape[1];
    uint16_t *v = malloc(*rows * *cols * 2);
    assert_int_equal(st_read(expected, t, 0, v, *rows * *cols * 2), NF4_OK);
    return v;
}

/* out's `name` is bitsandbytes' output for fixture weight x, as stored. */
static void assert_kept(const struct model *out, const struct st_file *expected, const char *name, char x)
{
    uint64_t rows, cols, bytes;
    uint16_t *want = bnb_output(expected, x, &rows, &cols), *got = (uint16_t *)read_tensor(out, name, &bytes);
    assert_int_equal(bytes, rows * cols * 2);
    assert_memory_equal(got, want, bytes);
    assert_int_equal(model_find(out, name)->t->shape[0], rows);
    free(want);
    free(got);
}

/* The output of write_gpt2_dir(type), converted to bf16: each Conv1D weight
 * is bitsandbytes' output transposed, the head (and a composite model's
 * other part's weight) as bitsandbytes wrote it. */
static void assert_gpt2_output(const char *out_dir, const char *type)
{
    struct model *out;
    assert_int_equal(model_open_dir(out_dir, &out), NF4_OK);
    struct st_file *expected;
    assert_int_equal(st_open(FIXTURES "/tensors.expected-bf16.safetensors", &expected), NF4_OK);
    const struct composite *composite = composite_of(type);
    const char *prefix = composite ? composite->prefix : "";
    uint64_t rows, cols;
    char name[256];
    for (int i = 0; i < WEIGHTS; i++) {
        uint16_t *want = bnb_output(expected, (char)('a' + i), &rows, &cols);
        snprintf(name, sizeof name, "%s%s", prefix, CONV1D_NAMES[i]);
        assert_transposed_is(out, name, want, rows, cols);
        free(want);
    }
    snprintf(name, sizeof name, "%s%s", prefix, HEAD);
    assert_kept(out, expected, name, HEAD_FROM);
    if (composite)
        assert_kept(out, expected, composite->other, 'b');
    assert_int_equal(out->count, WEIGHTS + 2 + (composite != NULL));
    st_close(expected);
    model_close(out);
}

/* Every chunking (the smallest chunks a weight allows, a few thousand
 * elements, what a slot holds), one thread and several, each weight held
 * whole (source_cache.h) or read in bands (--mem 40 MiB): bitsandbytes' own
 * bytes, transposed. */
static void test_conv1d_as_bitsandbytes_wrote_them(void **state)
{
    struct tu_scratch *s = *state;
    static const uint64_t CHUNKS[] = {0, 1, 4096};
    static const uint64_t MEM[] = {0, UINT64_C(40) << 20};
    char *in = tu_strdupf("%s/in", s->dir);
    write_gpt2_dir(in, "gpt2");
    for (size_t k = 0; k < sizeof CHUNKS / sizeof *CHUNKS; k++)
        for (size_t mem = 0; mem < 2; mem++)
            for (int threads = 1; threads <= 3; threads += 2) {
                char *out = tu_strdupf("%s/out-%zu-%zu-%d", s->dir, k, mem, threads);
                struct convert_stats st;
                assert_int_equal(convert_model_dir(in, out, threads, CHUNKS[k], MEM[mem], NULL, &st), NF4_OK);
                assert_int_equal(st.dequantized, WEIGHTS + 1);
                assert_gpt2_output(out, "gpt2");
                tu_rmtree(out);
                free(out);
            }
    free(in);
}

/* Each architecture built on Conv1D is transposed back, and a composite
 * model's GPT-2 (a decoder, or a text_config's language or text model; its
 * other part's weights kept); another keeps the weights as stored, in their
 * quant state's shape. */
static void test_which_architectures(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const CONV1D_TYPES[] = {"gpt2",         "openai-gpt",          "imagegpt",
                                               "decision_transformer", "clvp", "clvp_decoder",
                                               "vision-encoder-decoder", "blip-2", "vision-text-dual-encoder",
                                               "llava"};
    for (size_t i = 0; i < sizeof CONV1D_TYPES / sizeof *CONV1D_TYPES; i++) {
        char *in = tu_strdupf("%s/in-%zu", s->dir, i), *out = tu_strdupf("%s/out-%zu", s->dir, i);
        write_gpt2_dir(in, CONV1D_TYPES[i]);
        struct convert_stats st;
        assert_int_equal(convert_model_dir(in, out, 2, 0, 0, NULL, &st), NF4_OK);
        assert_gpt2_output(out, CONV1D_TYPES[i]);
        free(in);
        free(out);
    }
    char *in = tu_strdupf("%s/llama", s->dir), *out = tu_strdupf("%s/llama-out", s->dir);
    write_gpt2_dir(in, "llama");
    struct convert_stats st;
    assert_int_equal(convert_model_dir(in, out, 2, 0, 0, NULL, &st), NF4_OK);
    struct model *m;
    assert_int_equal(model_open_dir(out, &m), NF4_OK);
    const struct model_tensor *t = model_find(m, CONV1D_NAMES[1]);
    assert_int_equal(t->t->shape[0], 384);
    assert_int_equal(t->t->shape[1], 200);
    model_close(m);
    free(in);
    free(out);
}

/* A QLoRA on GPT-2's layers: PEFT's bitsandbytes layer merges B @ A
 * ([out, in]) into the weight as bitsandbytes stores it, whatever the
 * config's fan_in_fan_out, so the output is the merge a llama-typed copy of
 * the same checkpoint gets, transposed, bit for bit. */
static void test_lora_merges_then_transposes(void **state)
{
    struct tu_scratch *s = *state;
    char *gpt2_in = tu_strdupf("%s/gpt2", s->dir), *plain_in = tu_strdupf("%s/llama", s->dir);
    write_gpt2_dir(gpt2_in, "gpt2");
    write_gpt2_dir(plain_in, "llama");
    /* c: 64 x 1000, blocksize 128 (runs inside blocks); h: 300 x 301. */
    static const struct adapter_pair PAIRS[] = {{"transformer.h.0.mlp.c_fc", 64, 1000},
                                                {"transformer.h.1.mlp.c_proj", 300, 301}};
    static const char *const CONFIGS[] = {"{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5}",
                                          "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5, "
                                          "\"fan_in_fan_out\": true}"};
    static const uint64_t CHUNKS[] = {0, 1};
    for (size_t a = 0; a < 2; a++) {
        char *adapter = tu_strdupf("%s/adapter-%zu", s->dir, a);
        write_adapter(adapter, CONFIGS[a], PAIRS, 2, RANK, 0);
        for (size_t k = 0; k < 2; k++) {
            char *gpt2_out = tu_strdupf("%s/gpt2-out-%zu-%zu", s->dir, a, k),
                 *plain_out = tu_strdupf("%s/plain-out-%zu-%zu", s->dir, a, k);
            struct convert_stats st;
            assert_int_equal(convert_model_dir(gpt2_in, gpt2_out, 2, CHUNKS[k], 0, adapter, &st), NF4_OK);
            assert_int_equal(st.merged, 2);
            assert_int_equal(convert_model_dir(plain_in, plain_out, 2, CHUNKS[k], 0, adapter, &st), NF4_OK);
            struct model *gpt2, *plain;
            assert_int_equal(model_open_dir(gpt2_out, &gpt2), NF4_OK);
            assert_int_equal(model_open_dir(plain_out, &plain), NF4_OK);
            for (size_t p = 0; p < 2; p++) {
                char *name = tu_strdupf("%s.weight", PAIRS[p].module);
                uint64_t bytes;
                uint16_t *want = (uint16_t *)read_tensor(plain, name, &bytes);
                assert_transposed_is(gpt2, name, want, PAIRS[p].out, PAIRS[p].in);
                free(want);
                free(name);
            }
            model_close(gpt2);
            model_close(plain);
            free(gpt2_out);
            free(plain_out);
        }
        free(adapter);
    }
    /* The merge changed the weight: it is not what a plain conversion gives. */
    char *merged = tu_strdupf("%s/gpt2-out-0-0", s->dir), *unmerged = tu_strdupf("%s/gpt2-plain", s->dir);
    struct convert_stats st;
    assert_int_equal(convert_model_dir(gpt2_in, unmerged, 2, 0, 0, NULL, &st), NF4_OK);
    uint64_t b1, b2;
    struct model *m1, *m2;
    assert_int_equal(model_open_dir(merged, &m1), NF4_OK);
    assert_int_equal(model_open_dir(unmerged, &m2), NF4_OK);
    unsigned char *x = read_tensor(m1, "transformer.h.0.mlp.c_fc.weight", &b1),
                  *y = read_tensor(m2, "transformer.h.0.mlp.c_fc.weight", &b2);
    assert_int_equal(b1, b2);
    assert_true(memcmp(x, y, b1) != 0);
    free(x);
    free(y);
    model_close(m1);
    model_close(m2);
    free(merged);
    free(unmerged);
    free(gpt2_in);
    free(plain_in);
}

/* DoRA rescales each row of the [out, in] weight by its norm, a column of
 * what is written: refused, one line naming the adapter's file and key,
 * exit 65, nothing written. */
static void test_dora_on_conv1d_refused(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt2", s->dir), *adapter = tu_strdupf("%s/adapter", s->dir),
         *out = tu_strdupf("%s/out", s->dir);
    write_gpt2_dir(in, "gpt2");
    static const struct adapter_pair PAIRS[] = {{"transformer.h.0.mlp.c_fc", 64, 1000}};
    write_adapter(adapter, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5, \"use_dora\": true}", PAIRS, 1, RANK,
                  1);
    char *want = tu_strdupf("nf4deq: %s/adapter_model.safetensors: base_model.model.transformer.h.0.mlp.c_fc.lora_A."
                            "weight: a DoRA pair on transformer.h.0.mlp.c_fc.weight, a weight nf4deq writes transposed "
                            "([in, out], as GPT-2's Conv1D loads it): only plain LoRA pairs merge there\n", adapter);
    assert_merge_refused(in, out, adapter, want);
    free(want);
    free(in);
    free(adapter);
    free(out);
}

/* dir: a PEFT adapter with a LoRA pair on h.1's c_proj and h.0's c_fc in
 * modules_to_save, its weight replaced by a BF16 [rows, cols] (values in
 * *values, allocated). */
static void write_replacement_adapter(const char *dir, uint64_t rows, uint64_t cols, uint16_t **values)
{
    static const char CONFIG[] = "{\"peft_type\": \"LORA\", \"r\": 1, \"lora_alpha\": 1, \"target_modules\": "
                                 "[\"c_proj\"], \"modules_to_save\": [\"h.0.mlp.c_fc\"]}";
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config = tu_strdupf("%s/adapter_config.json", dir), *weights = tu_strdupf("%s/adapter_model.safetensors", dir);
    tu_write_file(config, CONFIG, strlen(CONFIG));
    const uint64_t a_shape[2] = {1, 301}, b_shape[2] = {300, 1}, r_shape[2] = {rows, cols};
    const struct st_out_tensor outs[3] = {
        {"base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight", DT_BF16, 2, a_shape},
        {"base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight", DT_BF16, 2, b_shape},
        {"base_model.model.transformer.h.0.mlp.c_fc.weight", DT_BF16, 2, r_shape},
    };
    *values = malloc(rows * cols * 2);
    for (uint64_t e = 0; e < rows * cols; e++) /* finite, distinct along a row and down a column */
        (*values)[e] = (uint16_t)(0x3c00u + (e * 2654435761u) % 0x0800u);
    uint16_t *factor = calloc(301, 2);
    for (size_t e = 0; e < 301; e++)
        factor[e] = 0x3f80; /* 1.0 */
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, weights, outs, 3, NULL, 0), NF4_OK);
    for (size_t k = 0; k < 3; k++) {
        size_t i = st_writer_order(w, k);
        assert_int_equal(st_writer_write(w, i == 2 ? (void *)*values : (void *)factor, i == 2 ? rows * cols * 2
                                                                                                : (i == 0 ? 301 : 300) * 2),
                         NF4_OK);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    free(factor);
    free(config);
    free(weights);
}

/* A modules_to_save replacement of a Conv1D weight holds it as the 4-bit
 * weight is stored, [out, in], and is written transposed with it, byte for
 * byte; one already in Conv1D's [in, out] is another shape: refused, one
 * line, nothing written. */
static void test_replacement_written_transposed(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt2", s->dir), *adapter = tu_strdupf("%s/adapter", s->dir),
         *out = tu_strdupf("%s/out", s->dir);
    write_gpt2_dir(in, "gpt2");
    uint16_t *replacement;
    write_replacement_adapter(adapter, 64, 1000, &replacement); /* c_fc of h.0: fixture weight c, 64 x 1000 */
    struct convert_stats st;
    assert_int_equal(convert_model_dir(in, out, 2, 0, 0, adapter, &st), NF4_OK);
    struct model *m;
    assert_int_equal(model_open_dir(out, &m), NF4_OK);
    assert_transposed_is(m, "transformer.h.0.mlp.c_fc.weight", replacement, 64, 1000);
    model_close(m);
    free(replacement);
    tu_rmtree(adapter);
    write_replacement_adapter(adapter, 1000, 64, &replacement);
    char *want = tu_strdupf("nf4deq: %s/adapter_model.safetensors: base_model.model.transformer.h.0.mlp.c_fc.weight: "
                            "does not have the dtype class or shape of transformer.h.0.mlp.c_fc.weight in the base "
                            "model\n", adapter);
    char *refused_out = tu_strdupf("%s/refused", s->dir);
    assert_merge_refused(in, refused_out, adapter, want);
    free(replacement);
    free(want);
    free(refused_out);
    free(in);
    free(adapter);
    free(out);
}

/* inspect says, in text and JSON, which weights are written transposed and
 * in what shape; a linear layer's line says nothing of it. */
static void test_inspect_says_which_are_transposed(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt2", s->dir);
    write_gpt2_dir(in, "gpt2");
    struct tu_run r = tu_run("inspect", in, NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "[384, 200] -> F16 (153600 bytes), written transposed, [200, 384]\n") ||
        !strstr(r.out, "[64, 1000] -> BF16 (128000 bytes)\n") ||
        !strstr(r.out, "8 Conv1D weights of a GPT-2 architecture: written transposed, [in, out]"))
        fail_msg("inspect printed:\n%s", r.out);
    tu_run_free(&r);
    r = tu_run("inspect", "--json", in, NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "\"output_bytes\": 153600,\n        \"output_shape\": [\n          200,\n          384\n        ],\n"
                       "        \"transposed\": true\n"))
        fail_msg("inspect --json printed:\n%s", r.out);
    tu_run_free(&r);
    free(in);
}

/* A single file goes by the config.json beside it: a GPT-2's, transposed
 * back as its directory is, with a note naming that config.json, inspect
 * saying so; a composite model's whose decoder is a GPT-2; none at all, kept as
 * bitsandbytes recorded them with one warning that says why (convert and
 * inspect alike); another architecture's, kept without a word. */
static void test_single_file_goes_by_the_config_beside_it(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt2", s->dir), *file = tu_strdupf("%s/gpt2/model.safetensors", s->dir),
         *config = tu_strdupf("%s/gpt2/config.json", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *out_file = tu_strdupf("%s/out/model.safetensors", s->dir);
    write_gpt2_dir(in, "gpt2");
    assert_int_equal(mkdir(out, 0755), 0);
    struct tu_run r = tu_run("convert", "--device", "cpu", "--dtype", "bf16", file, out_file, NULL);
    if (r.status != 0 || tu_lines(r.err) != 2 ||
        !strstr(r.err, "/gpt2/model.safetensors: 8 Conv1D weights written transposed, [in, out], as GPT-2 loads "
                       "them: the config.json beside it names a GPT-2 architecture\n"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_gpt2_output(out, "gpt2");
    /* a composite model's config, which names the type of its decoder alone */
    char *ved = tu_strdupf("%s/ved", s->dir), *ved_file = tu_strdupf("%s/ved/model.safetensors", s->dir),
         *ved_out = tu_strdupf("%s/ved-out", s->dir), *ved_out_file = tu_strdupf("%s/ved-out/m.safetensors", s->dir);
    write_gpt2_dir(ved, "vision-encoder-decoder");
    assert_int_equal(mkdir(ved_out, 0755), 0);
    r = tu_run("convert", "--device", "cpu", "--dtype", "bf16", ved_file, ved_out_file, NULL);
    if (r.status != 0 || tu_lines(r.err) != 2 || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_gpt2_output(ved_out, "vision-encoder-decoder");
    free(ved);
    free(ved_file);
    free(ved_out);
    free(ved_out_file);
    r = tu_run("inspect", file, NULL);
    if (r.status != 0 || !strstr(r.out, "8 Conv1D weights of a GPT-2 architecture: written transposed, [in, out]"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    static const char *const WARNING =
        "/gpt2/model.safetensors: 8 4-bit weights are named like GPT-2's Conv1D layers "
        "(transformer.h.0.attn.c_attn.weight...), which GPT-2 loads [in, out]; no config.json names the model's type, "
        "so they are written [out, in], as bitsandbytes recorded them\n";
    for (int untyped = 1; untyped >= 0; untyped--) {
        const char *json = untyped ? "{\"architectures\": [\"GPT2LMHeadModel\"]}" : "{\"model_type\": \"qwen\"}";
        tu_write_file(config, json, strlen(json));
        r = tu_run("convert", "--device", "cpu", "--dtype", "bf16", "--force", file, out_file, NULL);
        if (r.status != 0 || tu_lines(r.err) != 1 + untyped || (untyped && !strstr(r.err, WARNING)))
            fail_msg("exit %d, stderr: %s", r.status, r.err);
        tu_run_free(&r);
        struct model *m;
        assert_int_equal(model_open_dir(out, &m), NF4_OK);
        struct st_file *expected;
        assert_int_equal(st_open(FIXTURES "/tensors.expected-bf16.safetensors", &expected), NF4_OK);
        for (int i = 0; i < WEIGHTS; i++)
            assert_kept(m, expected, CONV1D_NAMES[i], (char)('a' + i));
        st_close(expected);
        model_close(m);
        r = tu_run("inspect", file, NULL);
        if (r.status != 0 || strstr(r.out, "Conv1D") || (untyped && !strstr(r.err, WARNING)) ||
            (!untyped && r.err[0]))
            fail_msg("exit %d, stdout: %s\nstderr: %s", r.status, r.out, r.err);
        tu_run_free(&r);
    }
    free(in);
    free(file);
    free(config);
    free(out);
    free(out_file);
}

/* config.json decides which layout is written, and the layout changes no
 * shard's size: a resume must not take shards written under another
 * model_type. */
static void test_resume_record_holds_the_config(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt2", s->dir), *config = tu_strdupf("%s/gpt2/config.json", s->dir);
    write_gpt2_dir(in, "gpt2");
    struct convert_opts o;
    convert_opts_init(&o);
    struct model *m;
    assert_int_equal(model_open_dir(in, &m), NF4_OK);
    struct resume_manifest before, after;
    assert_int_equal(resume_fingerprint(m, &o, NULL, &before), NF4_OK);
    const char *llama = "{\"model_type\": \"llama\", \"padding\": 1}"; /* another size, whatever the clock */
    tu_write_file(config, llama, strlen(llama));
    assert_int_equal(resume_fingerprint(m, &o, NULL, &after), NF4_OK);
    assert_false(resume_same_source(&before, &after));
    assert_true(resume_same_source(&after, &after));
    resume_manifest_free(&before);
    resume_manifest_free(&after);
    model_close(m);
    free(in);
    free(config);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_conv1d_as_bitsandbytes_wrote_them, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_which_architectures, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_lora_merges_then_transposes, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_dora_on_conv1d_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_replacement_written_transposed, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_inspect_says_which_are_transposed, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_resume_record_holds_the_config, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_single_file_goes_by_the_config_beside_it, tu_scratch_setup,
                                        tu_scratch_teardown),
    };
    return cmocka_run_group_tests_name("GPT-2's Conv1D weights", tests, NULL, NULL);
}
