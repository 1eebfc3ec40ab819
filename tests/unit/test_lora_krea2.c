/* Krea 2 LoRAs (lora_krea2.h) read as diffusers 0.42 loads them: each of
 * make_krea2_fixtures.py's files (ComfyUI's diffusion_model. form, AI-Toolkit's
 * base_model.model. form with a LoRA config) converts to the tensors of
 * diffusers' own conversion, byte for byte; merges through the command line,
 * on the transformer's folder and in a pipeline, as that conversion does with
 * the file's metadata; and what diffusers raises on is refused with one line
 * naming the key, nothing written, no temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_synth.h"

#define KREA2_COMFY FIXTURES "/diffusers/lora-krea2-comfy.safetensors"
#define KREA2_AITK FIXTURES "/diffusers/lora-krea2-aitk.safetensors"
#define KREA2_CONVERTED FIXTURES "/diffusers/lora-krea2-comfy.diffusers.safetensors"
#define KREA2_TRANSFORMER "Krea2Transformer2DModel"

/* The scratch folder, gone, is no TMPDIR for the next test's. */
static int teardown(void **state)
{
    unsetenv("TMPDIR");
    return tu_scratch_teardown(state);
}

/* The classes of Krea 2's pipelines and transformer pick its conversion. */
static void test_krea2_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family("Krea2Pipeline"), LORA_FAMILY_KREA2);
    assert_int_equal(diffusers_lora_family("Krea2ModularPipeline"), LORA_FAMILY_KREA2);
    assert_int_equal(diffusers_lora_family(KREA2_TRANSFORMER), LORA_FAMILY_KREA2);
    assert_int_equal(diffusers_lora_family("Krea1Pipeline"), LORA_FAMILY_OTHER);
}

/* Both forms convert to diffusers' tensors, byte for byte; the messages name the file. */
static void test_krea2_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0); /* where no temp file may stay */
    static const char *const FILES[] = {KREA2_COMFY, KREA2_AITK};
    for (size_t i = 0; i < 2; i++) {
        struct model *m;
        assert_int_equal(diffusers_lora_open(FILES[i], LORA_FAMILY_KREA2, 0, &m), NF4_OK);
        assert_string_equal(m->files[0]->path, FILES[i]);
        tu_assert_same_st(m->files[0], FILES[i], KREA2_CONVERTED);
        model_close(m);
        assert_int_equal(tu_count_entries(s->dir), 0);
    }
}

/* `nf4deq convert IN OUT --lora LORA` on the CPU succeeds; `lines`: of standard error. */
static void assert_converts(const char *in, const char *out, const char *lora, int lines)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != lines || !strstr(r.err, "with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
}

/* Merged into a Krea 2-shaped transformer, alone and in a pipeline, each form
 * gives the bytes diffusers' conversion gives, with the file's metadata (the
 * AI-Toolkit file's alpha 4 and rank pattern), which changes the result. */
static void test_krea2_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    char *base = tu_strdupf("%s/transformer", s->dir), *pipe = tu_strdupf("%s/pipe", s->dir),
         *want_aitk = tu_strdupf("%s/want-aitk.safetensors", s->dir);
    struct model *converted, *aitk;
    assert_int_equal(model_open_file(KREA2_CONVERTED, &converted), NF4_OK);
    assert_int_equal(model_open_file(KREA2_AITK, &aitk), NF4_OK);
    assert_true(aitk->files[0]->nmeta > 0);
    write_lora_base(converted, base, KREA2_TRANSFORMER);
    write_model(converted, want_aitk, aitk->files[0]->meta, aitk->files[0]->nmeta); /* diffusers' tensors, its config */
    /* The pipeline: its class, and the same transformer folder under it. */
    assert_int_equal(mkdir(pipe, 0755), 0);
    char *index = tu_strdupf("%s/model_index.json", pipe), *in_pipe = tu_strdupf("%s/transformer", pipe);
    static const char INDEX[] = "{\"_class_name\": \"Krea2Pipeline\", \"transformer\": [\"diffusers\", "
                                "\"" KREA2_TRANSFORMER "\"]}";
    tu_write_file(index, INDEX, strlen(INDEX));
    write_lora_base(converted, in_pipe, KREA2_TRANSFORMER);
    model_close(aitk);
    model_close(converted);
    static const struct {
        const char *in, *lora, *want_lora;
        int lines; /* of stderr: the summary, and a warning for the comfy file's DoRA scale */
    } CASES[] = {{"transformer", KREA2_COMFY, KREA2_CONVERTED, 2},
                 {"transformer", KREA2_AITK, NULL, 1},
                 {"pipe", KREA2_COMFY, KREA2_CONVERTED, 2}};
    char *outs[3];
    for (size_t i = 0; i < 3; i++) {
        char *in = tu_strdupf("%s/%s", s->dir, CASES[i].in), *got = tu_strdupf("%s/got-%zu", s->dir, i),
             *want = tu_strdupf("%s/want-%zu", s->dir, i);
        assert_converts(in, got, CASES[i].lora, CASES[i].lines);
        struct tu_run r = tu_run("convert", "--device", "cpu", base, want, "--lora",
                                 CASES[i].want_lora ? CASES[i].want_lora : want_aitk, NULL);
        assert_int_equal(r.status, 0);
        tu_run_free(&r);
        const char *sub = strcmp(CASES[i].in, "pipe") == 0 ? "/transformer" : "";
        char *got_file = tu_strdupf("%s%s/diffusion_pytorch_model.safetensors", got, sub),
             *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want);
        tu_assert_same_tensors(got_file, want_file);
        outs[i] = got_file;
        free(want_file);
        free(in);
        free(got);
        free(want);
    }
    /* The AI-Toolkit file's config (alpha 4 over ranks 2 and 3) is not the comfy file's (scaling 1). */
    struct st_file *a, *b;
    assert_int_equal(st_open(outs[0], &a), NF4_OK);
    assert_int_equal(st_open(outs[1], &b), NF4_OK);
    const struct st_tensor *ta = st_find(a, "transformer_blocks.0.attn.to_q.weight"),
                           *tb = st_find(b, "transformer_blocks.0.attn.to_q.weight");
    assert_non_null(ta);
    assert_non_null(tb);
    const uint64_t bytes = st_tensor_bytes(ta);
    unsigned char *x = malloc(bytes), *y = malloc(bytes);
    assert_int_equal(st_read(a, ta, 0, x, bytes), NF4_OK);
    assert_int_equal(st_read(b, tb, 0, y, bytes), NF4_OK);
    assert_true(memcmp(x, y, bytes) != 0);
    free(x);
    free(y);
    st_close(a);
    st_close(b);
    for (size_t i = 0; i < 3; i++)
        free(outs[i]);
    free(index);
    free(in_pipe);
    free(base);
    free(pipe);
    free(want_aitk);
}

/* A file of the pairs `names` (each [2, 8] and [8, 2], BF16), and `extra`
 * (NULL: none) as an F32 [1]. */
static void write_krea2_lora(const char *path, const char *const *names, size_t n, const char *extra)
{
    struct st_out_tensor outs[8];
    char *keys[8];
    static const uint64_t A[2] = {2, 8}, B[2] = {8, 2}, ONE[1] = {1};
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        keys[k] = tu_strdupf("%s.lora_A.weight", names[i]);
        outs[k] = (struct st_out_tensor){keys[k], DT_BF16, 2, A};
        k++;
        keys[k] = tu_strdupf("%s.lora_B.weight", names[i]);
        outs[k] = (struct st_out_tensor){keys[k], DT_BF16, 2, B};
        k++;
    }
    if (extra) {
        keys[k] = tu_strdupf("%s", extra);
        outs[k] = (struct st_out_tensor){keys[k], DT_F32, 1, ONE};
        k++;
    }
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, k, NULL, 0), NF4_OK);
    static const unsigned char ZEROS[64];
    for (size_t j = 0; j < k; j++) {
        const struct st_out_tensor *o = &outs[st_writer_order(w, j)];
        assert_int_equal(st_writer_write(w, ZEROS, o->ndim == 2 ? 32 : 4), NF4_OK);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    for (size_t j = 0; j < k; j++)
        free(keys[j]);
}

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file and key, exit 65, nothing written, no temp file left. */
static void test_krea2_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *pairs[2];
        const char *extra;
        const char *want;
    } CASES[] = {
        {{"diffusion_model.blocks.0.attn.wq", NULL}, "diffusion_model.blocks.0.attn.wq.alpha",
         "diffusion_model.blocks.0.attn.wq.alpha: is left over where diffusers converts a Krea 2 LoRA, and raises"},
        {{"diffusion_model.blocks.0.attn.norm_q", NULL}, NULL,
         "diffusion_model.blocks.0.attn.norm_q.lora_A.weight: is left over"},
        {{"diffusion_model.blocks.0.mlp.wq", NULL}, NULL, "diffusion_model.blocks.0.mlp.wq.lora_A.weight: is left over"},
        {{"diffusion_model.blocks.0.attn.wq.x", NULL}, NULL, "blocks.0.attn.wq.x.lora_A.weight: is left over"},
        {{"diffusion_model.blocks.x.attn.wq", NULL}, NULL, "blocks.x.attn.wq.lora_A.weight: is left over"},
        {{"diffusion_model.last", NULL}, NULL, "diffusion_model.last.lora_A.weight: is left over"},
        {{"diffusion_model.blocks.0.attn.wq", "transformer.transformer_blocks.0.attn.to_k"}, NULL,
         "transformer.transformer_blocks.0.attn.to_k.lora_A.weight: is left over"},
        {{"diffusion_model.blocks.\xd9\xa3.attn.wq", NULL}, NULL, "may not be ASCII digits"},
        {{"diffusion_model.blocks.0.attn.wq", "base_model.model.blocks.0.attn.wq"}, NULL, "blocks.0.attn.wq"},
        {{"diffusion_model.blocks.0.attn.wq", "diffusion_model.blocks.0.attn.wk\n"}, NULL, "a line break"},
    };
    char *lora = tu_strdupf("%s-krea2.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_krea2_lora(lora, CASES[i].pairs, CASES[i].pairs[1] ? 2 : 1, CASES[i].extra);
        struct model *m = NULL;
        nf4_clear_error();
        if (diffusers_lora_open(lora, LORA_FAMILY_KREA2, 0, &m) != NF4_EDATA ||
            !strstr(nf4_last_error(), CASES[i].want) || !strstr(nf4_last_error(), lora) ||
            strchr(nf4_last_error(), '\n'))
            fail_msg("case %zu: %s", i, nf4_last_error());
        assert_null(m);
        assert_int_equal(tu_count_entries(s->dir), 0);
    }
    /* Through the command line, on a Krea 2 transformer's folder. */
    char *base = tu_strdupf("%s-base", s->dir);
    struct model *converted;
    assert_int_equal(model_open_file(KREA2_CONVERTED, &converted), NF4_OK);
    write_lora_base(converted, base, KREA2_TRANSFORMER);
    model_close(converted);
    write_krea2_lora(lora, CASES[0].pairs, 1, CASES[0].extra);
    struct tu_run r = tu_run("convert", "--device", "cpu", base, out, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, CASES[0].want))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    assert_int_equal(tu_count_entries(s->dir), 0);
    tu_rmtree(base);
    unlink(lora);
    free(base);
    free(lora);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_krea2_family),
        cmocka_unit_test_setup_teardown(test_krea2_lora_as_diffusers_loads_it, tu_scratch_setup, teardown),
        cmocka_unit_test_setup_teardown(test_krea2_lora_merges_as_converted, tu_scratch_setup, teardown),
        cmocka_unit_test_setup_teardown(test_krea2_lora_refusals, tu_scratch_setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
