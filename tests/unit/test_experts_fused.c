/* gpt-oss's experts in Unsloth's per-expert layout, written fused
 * (expert_layout.h): each fused tensor compared byte for byte with what
 * bitsandbytes wrote for its experts' weights, transposed; in every chunking,
 * across shards, with float experts among 4-bit ones, with a LoRA merged; and
 * the layouts that cannot be fused refused. The experts are the fixture's
 * weights of every configuration (tensors.bnb4: blocksizes 64 to 256, rows
 * that do not end on a block, single quant, FP4, bf16 storage, an odd count). */
#include "test_util.h"

#include <stdarg.h>
#include <sys/stat.h>

#include "fixture_checkpoint.h"
#include "fpconv.h"

#define EXPERTS 3
#define LAYERS 8 /* one per fixture weight, a to h */
static const char WEIGHTS[LAYERS] = {'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'};
#define RANK 3

/* A bias of n bf16 values that tell the expert and the row. */
static void add_bias(struct checkpoint *c, int file, uint64_t n, int expert, const char *name)
{
    uint16_t *v = malloc(n * 2);
    for (uint64_t i = 0; i < n; i++)
        v[i] = f32_to_bf16((float)(expert * 1000 + (int)i));
    c->s[c->n++] = (struct spec){.name = strdup(name), .dtype = DT_BF16, .ndim = 1, .shape = {n}, .data = v,
                                 .file = file};
}

enum variant {
    PLAIN = 0,
    FLOAT_EXPERT = 1,   /* layer 0's expert 1 is the bf16 original, not quantized */
    SHARDED = 2,        /* two shards: expert 0 in the second, the others in the first */
    MISSING_EXPERT = 4, /* layer 2 has no down_projs.1 */
    BAD_BIAS = 8,       /* layer 1's biases are one value short */
    FUSED_THERE = 16,   /* layer 3 holds mlp.experts.down_proj besides */
    EMPTY_EXPERTS = 32, /* layer 5's gate_up_projs are bf16 [0, 256], their biases [0] */
};

/* dir: a gpt-oss checkpoint (config.json's model_type `type`) in Unsloth's
 * layout: layer L's experts are all fixture weight WEIGHTS[L], gate_up with
 * biases, and its router a linear layer. */
static void write_unsloth_dir(const char *dir, const char *type, int variant)
{
    struct checkpoint *c = calloc(1, sizeof *c);
    assert_int_equal(st_open(FIXTURES "/tensors.bnb4.safetensors", &c->bnb), NF4_OK);
    assert_int_equal(st_open(FIXTURES "/tensors.source.safetensors", &c->source), NF4_OK);
    char name[256];
    for (int l = 0; l < LAYERS; l++) {
        char x = WEIGHTS[l];
        uint64_t rows = fixture_rows(c, x);
        for (int e = 0; e < EXPERTS; e++) {
            int file = (variant & SHARDED) && e == 0;
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_projs.%d.weight", l, e);
            if ((variant & EMPTY_EXPERTS) && l == 5) {
                c->s[c->n++] = (struct spec){.name = strdup(name), .dtype = DT_BF16, .ndim = 2, .shape = {0, 256},
                                             .data = malloc(1), .file = file};
                rows = 0;
            } else if ((variant & FLOAT_EXPERT) && l == 0 && e == 1) {
                char from[32];
                snprintf(from, sizeof from, "model.%c.weight", x);
                add_copy(c, file, c->source, from, "%s", name);
            } else {
                add_weight(c, file, x, name);
            }
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_projs.%d.bias", l, e);
            add_bias(c, file, rows - ((variant & BAD_BIAS) && l == 1), e, name);
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_projs.%d.weight", l, e);
            if (!((variant & MISSING_EXPERT) && l == 2 && e == 1))
                add_weight(c, file, x, name);
        }
        add_copy(c, 0, c->bnb, "model.norm.weight", "model.layers.%d.mlp.router.linear.weight", l);
        if ((variant & FUSED_THERE) && l == 3)
            add_copy(c, 0, c->bnb, "model.norm.weight", "model.layers.%d.mlp.experts.down_proj", l);
    }
    assert_int_equal(mkdir(dir, 0755), 0);
    char *config = tu_strdupf("%s/config.json", dir), *json = tu_strdupf("{\"model_type\": \"%s\"}", type);
    tu_write_file(config, json, strlen(json));
    if (variant & SHARDED) {
        for (int f = 0; f < 2; f++) {
            char *path = tu_strdupf("%s/model-%05d-of-00002.safetensors", dir, f + 1);
            write_shard(c, f, path);
            free(path);
        }
        struct strbuf_lite {
            char *p;
            size_t len;
        } b = {malloc(1 << 20), 0};
        b.len += (size_t)sprintf(b.p, "{\"metadata\": {}, \"weight_map\": {");
        for (size_t i = 0; i < c->n; i++)
            b.len += (size_t)sprintf(b.p + b.len, "%s\"%s\": \"model-%05d-of-00002.safetensors\"", i ? ", " : "",
                                     c->s[i].name, c->s[i].file + 1);
        b.len += (size_t)sprintf(b.p + b.len, "}}");
        char *index = tu_strdupf("%s/model.safetensors.index.json", dir);
        tu_write_file(index, b.p, b.len);
        free(index);
        free(b.p);
    } else {
        char *path = tu_strdupf("%s/model.safetensors", dir);
        write_shard(c, 0, path);
        free(path);
    }
    for (size_t i = 0; i < c->n; i++) {
        free(c->s[i].name);
        free(c->s[i].data);
    }
    st_close(c->bnb);
    st_close(c->source);
    free(c);
    free(config);
    free(json);
}

/* out's fused tensor `fused` [E, C, R] against `want` ([R, C] bf16 each, one
 * per expert), transposed. */
static void assert_fused_is(const struct model *out, const char *fused, const uint16_t *const *want, uint64_t rows,
                            uint64_t cols)
{
    const struct model_tensor *t = model_find(out, fused);
    if (!t)
        fail_msg("%s is not in the output", fused);
    assert_int_equal(t->t->dtype, DT_BF16);
    assert_int_equal(t->t->ndim, 3);
    assert_int_equal(t->t->shape[0], EXPERTS);
    assert_int_equal(t->t->shape[1], cols);
    assert_int_equal(t->t->shape[2], rows);
    uint64_t bytes;
    uint16_t *got = (uint16_t *)read_tensor(out, fused, &bytes);
    for (int e = 0; e < EXPERTS; e++)
        for (uint64_t c = 0; c < cols; c++)
            for (uint64_t r = 0; r < rows; r++) {
                uint16_t g = got[(e * cols + c) * rows + r], w = want[e][r * cols + c];
                if (g != w)
                    fail_msg("%s: expert %d, [%llu, %llu] is 0x%04x, expected 0x%04x (source [%llu, %llu])", fused, e,
                             (unsigned long long)c, (unsigned long long)r, g, w, (unsigned long long)r,
                             (unsigned long long)c);
            }
    free(got);
}

/* The fused output of write_unsloth_dir(variant), converted to bf16: every
 * expert is what bitsandbytes wrote for its weight (the float one, the
 * original cast), transposed; the biases stacked; the router renamed. */
static void assert_fused_output(const char *out_dir, int variant)
{
    struct model *out;
    assert_int_equal(model_open_dir(out_dir, &out), NF4_OK);
    struct st_file *expected, *source;
    assert_int_equal(st_open(FIXTURES "/tensors.expected-bf16.safetensors", &expected), NF4_OK);
    assert_int_equal(st_open(FIXTURES "/tensors.source.safetensors", &source), NF4_OK);
    char name[256];
    for (int l = 0; l < LAYERS; l++) {
        snprintf(name, sizeof name, "model.%c.weight", WEIGHTS[l]);
        const struct st_tensor *w = st_find(expected, name), *src = st_find(source, name);
        uint64_t rows = w->shape[0], cols = w->shape[1];
        uint16_t *bnb = malloc(rows * cols * 2), *orig = malloc(rows * cols * 2);
        assert_int_equal(st_read(expected, w, 0, bnb, rows * cols * 2), NF4_OK);
        unsigned char *raw = malloc(st_tensor_bytes(src));
        assert_int_equal(st_read(source, src, 0, raw, st_tensor_bytes(src)), NF4_OK);
        for (uint64_t i = 0; i < rows * cols; i++)
            orig[i] = f32_to_bf16(f32_from_element(src->dtype, raw, i));
        const uint16_t *gate_up[EXPERTS], *down[EXPERTS];
        for (int e = 0; e < EXPERTS; e++) {
            gate_up[e] = (variant & FLOAT_EXPERT) && l == 0 && e == 1 ? orig : bnb;
            down[e] = bnb;
        }
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        assert_fused_is(out, name, gate_up, rows, cols);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        assert_fused_is(out, name, down, rows, cols);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj_bias", l);
        uint64_t bytes;
        uint16_t *bias = (uint16_t *)read_tensor(out, name, &bytes);
        assert_int_equal(bytes, EXPERTS * rows * 2);
        for (int e = 0; e < EXPERTS; e++)
            for (uint64_t r = 0; r < rows; r++)
                assert_int_equal(bias[e * rows + r], f32_to_bf16((float)(e * 1000 + (int)r)));
        free(bias);
        snprintf(name, sizeof name, "model.layers.%d.mlp.router.weight", l);
        free(read_tensor(out, name, &bytes));
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_projs.0.weight", l);
        assert_null(model_find(out, name));
        snprintf(name, sizeof name, "model.layers.%d.mlp.router.linear.weight", l);
        assert_null(model_find(out, name));
        free(bnb);
        free(orig);
        free(raw);
    }
    /* Per layer: two weights, one bias and the router. */
    assert_int_equal(out->count, LAYERS * 4);
    st_close(expected);
    st_close(source);
    model_close(out);
}

/* Every chunking (the smallest chunks a weight allows, a few thousand
 * elements, what a slot holds), one thread and several, each weight held
 * whole (source_cache.h) or, where --mem has no room for that beside the
 * slots (40 MiB: the least slots take all of it), read in bands: the same
 * bytes, bitsandbytes' own, transposed. */
static void test_fused_as_bitsandbytes_wrote_them(void **state)
{
    struct tu_scratch *s = *state;
    static const int VARIANTS[] = {PLAIN, FLOAT_EXPERT, SHARDED | FLOAT_EXPERT};
    static const uint64_t CHUNKS[] = {0, 1, 4096};
    static const uint64_t MEM[] = {0, UINT64_C(40) << 20};
    for (size_t v = 0; v < sizeof VARIANTS / sizeof *VARIANTS; v++) {
        char *in = tu_strdupf("%s/in-%zu", s->dir, v);
        write_unsloth_dir(in, "gpt_oss", VARIANTS[v]);
        for (size_t k = 0; k < sizeof CHUNKS / sizeof *CHUNKS; k++)
            for (size_t mem = 0; mem < 2; mem++)
                for (int threads = 1; threads <= 3; threads += 2) {
                    char *out = tu_strdupf("%s/out-%zu-%zu-%zu-%d", s->dir, v, k, mem, threads);
                    struct convert_stats st;
                    assert_int_equal(convert_model_dir(in, out, threads, CHUNKS[k], MEM[mem], NULL, &st), NF4_OK);
                    assert_fused_output(out, VARIANTS[v]);
                    tu_rmtree(out);
                    free(out);
                }
        free(in);
    }
}

/* Only gpt_oss is fused: another model type keeps the per-expert tensors. */
static void test_other_model_types_keep_the_layout(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in", s->dir), *out = tu_strdupf("%s/out", s->dir);
    write_unsloth_dir(in, "llama", PLAIN);
    struct convert_stats st;
    assert_int_equal(convert_model_dir(in, out, 2, 0, 0, NULL, &st), NF4_OK);
    struct model *m;
    assert_int_equal(model_open_dir(out, &m), NF4_OK);
    assert_non_null(model_find(m, "model.layers.0.mlp.experts.gate_up_projs.2.weight"));
    assert_non_null(model_find(m, "model.layers.0.mlp.router.linear.weight"));
    assert_null(model_find(m, "model.layers.0.mlp.experts.gate_up_proj"));
    model_close(m);
    free(in);
    free(out);
}

/* What cannot be fused is refused with one line naming the file and the
 * tensor, exit 65, and nothing written. */
static void test_unfusable_layouts_refused(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        int variant;
        const char *tensor, *message;
    } CASES[] = {
        {MISSING_EXPERT, "model.layers.2.mlp.experts.down_projs.2.weight",
         "expert 2 of model.layers.2.mlp.experts.down_proj, which has 2 in Unsloth's per-expert layout: one of experts "
         "0 to 1 is missing, so they cannot be fused"},
        {BAD_BIAS, "model.layers.1.mlp.experts.gate_up_projs.0.bias",
         "experts' biases (3 of 383) that do not fit their weights (3 of [384, 200])"},
        {FUSED_THERE, "model.layers.3.mlp.experts.down_proj",
         "is there beside the per-expert tensors it is fused from (model.layers.3.mlp.experts.down_projs.0.weight)"},
        {EMPTY_EXPERTS, "model.layers.5.mlp.experts.gate_up_projs.0.weight",
         "an expert's weight of model.layers.5.mlp.experts.gate_up_proj has no elements"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        char *in = tu_strdupf("%s/in-%zu", s->dir, i), *out = tu_strdupf("%s/out-%zu", s->dir, i);
        write_unsloth_dir(in, "gpt_oss", CASES[i].variant);
        struct tu_run r = tu_run("convert", "--device", "cpu", in, out, NULL);
        char *want = tu_strdupf("nf4deq: %s/model.safetensors: %s: %s\n", in, CASES[i].tensor, CASES[i].message);
        if (r.status != NF4_EDATA || strcmp(r.err, want) != 0)
            fail_msg("case %zu: exit %d, stderr:\n%swanted:\n%s", i, r.status, r.err, want);
        assert_false(tu_exists(out));
        tu_run_free(&r);
        r = tu_run("inspect", in, NULL);
        if (r.status != NF4_EDATA || strcmp(r.err, want) != 0)
            fail_msg("inspect case %zu: exit %d, stderr:\n%s", i, r.status, r.err);
        tu_run_free(&r);
        free(want);
        free(in);
        free(out);
    }
}

/* dir: a PEFT adapter (r = RANK) on layer 2's gate_up_projs.0 and .2 (c, 64
 * x 1000, blocksize 128: runs inside blocks), with a DoRA magnitude on each
 * with `dora`. */
static void write_expert_adapter(const char *dir, int dora)
{
    static const struct adapter_pair PAIRS[] = {{"model.layers.2.mlp.experts.gate_up_projs.0", 64, 1000},
                                                {"model.layers.2.mlp.experts.gate_up_projs.2", 64, 1000}};
    write_adapter(dir,
                  dora ? "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5, \"use_dora\": true}"
                       : "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5}",
                  PAIRS, 2, RANK, dora);
}

/* A LoRA Unsloth trained on the experts' layers merges into the
 * fused tensor: each expert's part is what the merge into that expert's
 * layer (a llama checkpoint of the same tensors keeps the layout) gives,
 * transposed, bit for bit. */
static void test_lora_merges_into_fused_experts(void **state)
{
    struct tu_scratch *s = *state;
    char *fused_in = tu_strdupf("%s/gpt-oss", s->dir), *plain_in = tu_strdupf("%s/llama", s->dir);
    write_unsloth_dir(fused_in, "gpt_oss", PLAIN);
    write_unsloth_dir(plain_in, "llama", PLAIN);
    char *adapter = tu_strdupf("%s/adapter", s->dir);
    write_expert_adapter(adapter, 0);
    static const uint64_t CHUNKS[] = {0, 1};
    for (size_t k = 0; k < 2; k++) {
        char *fused_out = tu_strdupf("%s/fused-out-%zu", s->dir, k), *plain_out = tu_strdupf("%s/plain-out-%zu", s->dir, k);
        struct convert_stats st;
        assert_int_equal(convert_model_dir(fused_in, fused_out, 2, CHUNKS[k], 0, adapter, &st), NF4_OK);
        assert_int_equal(st.merged, 1);
        assert_int_equal(convert_model_dir(plain_in, plain_out, 2, CHUNKS[k], 0, adapter, &st), NF4_OK);
        assert_int_equal(st.merged, 2);
        struct model *fused, *plain;
        assert_int_equal(model_open_dir(fused_out, &fused), NF4_OK);
        assert_int_equal(model_open_dir(plain_out, &plain), NF4_OK);
        const uint16_t *want[EXPERTS];
        uint64_t bytes;
        for (int e = 0; e < EXPERTS; e++) {
            char *name = tu_strdupf("model.layers.2.mlp.experts.gate_up_projs.%d.weight", e);
            want[e] = (uint16_t *)read_tensor(plain, name, &bytes);
            free(name);
        }
        assert_true(memcmp(want[0], want[1], bytes) != 0); /* the merge changed expert 0 */
        assert_fused_is(fused, "model.layers.2.mlp.experts.gate_up_proj", want, 64, 1000);
        for (int e = 0; e < EXPERTS; e++)
            free((void *)want[e]);
        model_close(fused);
        model_close(plain);
        free(fused_out);
        free(plain_out);
    }
    free(adapter);
    free(fused_in);
    free(plain_in);
}

/* DoRA rescales each row of the layer it trains by the norm of its merged
 * row, which in the fused tensor is a column: refused, with one line naming
 * the adapter's file and key, exit 65, nothing written. */
static void test_dora_on_an_expert_refused(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt-oss", s->dir), *adapter = tu_strdupf("%s/adapter", s->dir),
         *out = tu_strdupf("%s/out", s->dir);
    write_unsloth_dir(in, "gpt_oss", PLAIN);
    write_expert_adapter(adapter, 1);
    char *want = tu_strdupf("nf4deq: %s/adapter_model.safetensors: base_model.model.model.layers.2.mlp.experts."
                            "gate_up_projs.0.lora_A.weight: a DoRA pair on model.layers.2.mlp.experts.gate_up_projs.0."
                            "weight, a weight nf4deq writes transposed (into the fused experts, from Unsloth's "
                            "per-expert layout): only plain LoRA pairs merge there\n", adapter);
    assert_merge_refused(in, out, adapter, want);
    free(want);
    free(in);
    free(adapter);
    free(out);
}

/* inspect says, in text and JSON, which fused tensor each expert's tensor
 * goes into and what the router is written as. */
static void test_inspect_says_where_experts_go(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/gpt-oss", s->dir);
    write_unsloth_dir(in, "gpt_oss", PLAIN);
    struct tu_run r = tu_run("inspect", in, NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "-> BF16 (128000 bytes), expert 2 of model.layers.2.mlp.experts.down_proj, transposed\n") ||
        !strstr(r.out, "-> BF16 (128 bytes), expert 1 of model.layers.2.mlp.experts.gate_up_proj_bias\n") ||
        !strstr(r.out, ", written as model.layers.0.mlp.router.weight\n") ||
        !strstr(r.out, "gpt-oss experts in Unsloth's per-expert layout: written as 24 fused tensors"))
        fail_msg("inspect printed:\n%s", r.out);
    tu_run_free(&r);
    r = tu_run("inspect", "--json", in, NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "\"fused_into\": {\n        \"tensor\": \"model.layers.2.mlp.experts.down_proj\",\n        "
                       "\"expert\": 2,\n        \"transposed\": true\n") ||
        !strstr(r.out, "\"written_as\": \"model.layers.0.mlp.router.weight\""))
        fail_msg("inspect --json printed:\n%s", r.out);
    tu_run_free(&r);
    free(in);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fused_as_bitsandbytes_wrote_them, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_other_model_types_keep_the_layout, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_unfusable_layouts_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_lora_merges_into_fused_experts, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_dora_on_an_expert_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_inspect_says_where_experts_go, tu_scratch_setup, tu_scratch_teardown),
    };
    return cmocka_run_group_tests_name("fused experts", tests, NULL, NULL);
}
