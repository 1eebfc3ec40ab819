/* MiniMax-H3 LoRAs (lora_minimax_h3.h) read as diffusers 0.42's
 * MiniMaxH3LoraLoaderMixin loads them, into the pipeline's two partitions
 * (pipeline_lora.c). The LoRAs the lora-minimax-h3-*.digest files list
 * (make_minimax_h3_fixtures.py: ai-toolkit's, musubi-tuner's and
 * DiffSynth-Studio's forms of every Linear of a tiny MiniMax-H3
 * transformer, and one in diffusers' names with an alpha in its metadata)
 * convert to what the digests of diffusers' own conversion say, byte for
 * byte; the metadata alpha merges as the config diffusers builds from it
 * (lora-minimax-h3-alpha.json); a LoRA goes into transformer or
 * transformer_ref as diffusers' loader sends it; and what diffusers raises
 * on is refused with one line naming the file and key, nothing written, no
 * temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"
#include "strbuf.h"

#define H3_DIGEST(form) FIXTURES "/diffusers/lora-minimax-h3-" form ".digest"
#define H3_ALPHA_CONFIG FIXTURES "/diffusers/lora-minimax-h3-alpha.json"
#define H3_PIPELINE "MiniMaxH3ModularPipeline"
#define H3_TRANSFORMER "MiniMaxH3Transformer3DModel"
#define WEIGHTS "diffusion_pytorch_model.safetensors"

static void test_minimax_h3_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family(H3_PIPELINE), LORA_FAMILY_MINIMAX_H3);
    assert_int_equal(diffusers_lora_family(H3_TRANSFORMER), LORA_FAMILY_MINIMAX_H3);
    assert_int_equal(diffusers_lora_family("MiniMaxMusic3ModularPipeline"), LORA_FAMILY_OTHER);
}

/* Each form's LoRA converts to what its digests say, byte for byte, naming
 * the file; the ai-toolkit file's DoRA scale is left out. */
static void test_minimax_h3_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(H3_DIGEST("aitk"), LORA_FAMILY_MINIMAX_H3, s->dir, "aitk");
    assert_digest_converts(H3_DIGEST("musubi"), LORA_FAMILY_MINIMAX_H3, s->dir, "musubi");
    assert_digest_converts(H3_DIGEST("diffsynth"), LORA_FAMILY_MINIMAX_H3, s->dir, "diffsynth");
    assert_digest_converts(H3_DIGEST("alpha"), LORA_FAMILY_MINIMAX_H3, s->dir, "alpha");
}

/* `nf4deq convert --device cpu IN OUT --lora ARG...` (up to two) succeeds,
 * writing `lines` lines to standard error. */
static void assert_converts(const char *in, const char *out, const char *lora, const char *lora2, int lines)
{
    struct tu_run r = lora2 ? tu_run("convert", "--device", "cpu", in, out, "--lora", lora, "--lora", lora2, NULL)
                            : tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != lines || !strstr(r.err, "with LoRA merged"))
        fail_msg("%s: exit %d, stderr: %s", in, r.status, r.err);
    tu_run_free(&r);
}

/* The file's metadata alpha merges as the LoRA config diffusers builds from
 * it (its ranks, lora_alpha 8, rank_pattern for the rank-2 modules), however
 * Python's float() would read it; text float() does not read is ignored with
 * a warning (alpha = rank, as with no alpha); NaN and infinity are refused;
 * a file with a LoRA config of its own keeps it. */
static void test_minimax_h3_metadata_alpha(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, H3_DIGEST("alpha"));
    char *lora = tu_strdupf("%s/alpha.safetensors", s->dir),
         *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *with_config = tu_strdupf("%s/config.safetensors", s->dir), *base = tu_strdupf("%s/transformer", s->dir),
         *tmp = tu_strdupf("%s/tmp", s->dir), *want = tu_strdupf("%s/want", s->dir),
         *plain = tu_strdupf("%s/plain", s->dir), *got = tu_strdupf("%s/got", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_MINIMAX_H3, H3_DIGEST("alpha"), 1, tmp, converted);
    struct model *c;
    assert_int_equal(model_open_file(converted, &c), NF4_OK);
    write_lora_base(c, base, H3_TRANSFORMER);
    size_t len = 0;
    char *config = tu_read_file(H3_ALPHA_CONFIG, &len);
    struct st_meta meta[2] = {{"lora_adapter_metadata", config}, {"alpha", "2"}};
    write_model(c, with_config, meta, 1); /* diffusers' tensors, the config diffusers builds */
    model_close(c);
    assert_converts(base, want, with_config, NULL, 1);
    assert_converts(base, plain, converted, NULL, 1); /* no alpha: each module's alpha is its rank */
    char *want_file = tu_strdupf("%s/" WEIGHTS, want), *plain_file = tu_strdupf("%s/" WEIGHTS, plain),
         *got_file = tu_strdupf("%s/" WEIGHTS, got);
    assert_true(tensor_differs(want_file, plain_file, "transformer_blocks.0.adaln_proj.linear.weight"));
    static const char *const READ[] = {"8", " 8.0\n", "0_8", "8e0", "+.8E1", "\xe3\x80\x80" "8"};
    for (size_t i = 0; i < sizeof READ / sizeof READ[0]; i++) {
        struct st_meta alpha = {"alpha", (char *)READ[i]};
        recipe_write(&r, lora, r.values, &alpha, 1);
        assert_converts(base, got, lora, NULL, 1);
        tu_assert_same_tensors(got_file, want_file);
        tu_rmtree(got);
    }
    /* the config in the file wins over its alpha */
    recipe_write(&r, with_config, r.values, meta, 2);
    assert_converts(base, got, with_config, NULL, 1);
    tu_assert_same_tensors(got_file, want_file);
    tu_rmtree(got);
    static const char *const IGNORED[] = {"eight", "0x8", "8_", "1__0", "", "8\x1c"}; /* str.isspace's, not float()'s */
    for (size_t i = 0; i < sizeof IGNORED / sizeof IGNORED[0]; i++) {
        struct st_meta alpha = {"alpha", (char *)IGNORED[i]};
        recipe_write(&r, lora, r.values, &alpha, 1);
        struct tu_run run = tu_run("convert", "--device", "cpu", base, got, "--lora", lora, NULL);
        if (run.status != 0 || tu_lines(run.err) != 2 || !strstr(run.err, "alpha in its metadata is not a number"))
            fail_msg("alpha \"%s\": exit %d, stderr: %s", IGNORED[i], run.status, run.err);
        tu_run_free(&run);
        tu_assert_same_tensors(got_file, plain_file);
        tu_rmtree(got);
    }
    static const char *const REFUSED[][2] = {{"nan", "alpha nan"}, {"-Infinity", "alpha -inf"}, {"1e999", "alpha inf"},
                                             {"\xd9\xa3", "other than ASCII"}};
    for (size_t i = 0; i < sizeof REFUSED / sizeof REFUSED[0]; i++) {
        struct st_meta alpha = {"alpha", (char *)REFUSED[i][0]};
        recipe_write(&r, lora, r.values, &alpha, 1);
        assert_lora_refused(base, got, lora, REFUSED[i][1], tmp);
    }
    free(config);
    free(want_file);
    free(plain_file);
    free(got_file);
    free(lora);
    free(converted);
    free(with_config);
    free(base);
    free(tmp);
    free(want);
    free(plain);
    free(got);
}

/* pipe's modular index, listing a transformer (where `transformer`) and a
 * transformer_ref (where `ref`), each from a repository's subfolder. */
static void write_h3_index(const char *pipe, int transformer, int ref)
{
    struct strbuf index = {0};
    strbuf_puts(&index, "{\"_blocks_class_name\": \"MiniMaxH3Blocks\", \"_class_name\": \"" H3_PIPELINE "\"");
    static const char *const NAMES[] = {"transformer", "transformer_ref"};
    const int listed[] = {transformer, ref};
    for (size_t i = 0; i < 2; i++)
        if (listed[i])
            strbuf_printf(&index, ", \"%s\": [\"diffusers\", \"" H3_TRANSFORMER "\", "
                          "{\"pretrained_model_name_or_path\": \"someone/minimax-h3-bnb-4bit\", "
                          "\"subfolder\": \"%s\"}]",
                          NAMES[i], NAMES[i]);
    strbuf_puts(&index, "}\n");
    char *path = tu_strdupf("%s/modular_model_index.json", pipe);
    tu_write_file(path, index.p, index.len);
    free(path);
    free(index.p);
}

/* pipe: a modular MiniMax-H3 pipeline holding a transformer (where
 * `transformer`) and a transformer_ref (where `ref`), each made for the
 * diffusers-form LoRA `converted` with the same weights, and listed in its
 * index. */
static void write_h3_pipeline(const char *pipe, const char *converted, int transformer, int ref)
{
    struct model *c;
    assert_int_equal(model_open_file(converted, &c), NF4_OK);
    assert_int_equal(mkdir(pipe, 0755), 0);
    static const char *const NAMES[] = {"transformer", "transformer_ref"};
    const int held[] = {transformer, ref};
    for (size_t i = 0; i < 2; i++) {
        char *dir = tu_strdupf("%s/%s", pipe, NAMES[i]);
        if (held[i])
            write_component_base(c, dir, "transformer.", NULL, "{\"_class_name\": \"" H3_TRANSFORMER "\"}", WEIGHTS);
        free(dir);
    }
    write_h3_index(pipe, transformer, ref);
    model_close(c);
}

/* Whether component `name` of OUT is what folder `want` holds (the
 * component converted alone), or where `want` is NULL IN's, as it was. */
static void assert_component(const char *out, const char *name, const char *want, const char *in)
{
    char *got = tu_strdupf("%s/%s/" WEIGHTS, out, name), *w = tu_strdupf("%s/" WEIGHTS, want),
         *b = tu_strdupf("%s/%s/" WEIGHTS, in, name);
    tu_assert_same_tensors(got, want ? w : b);
    if (want) /* and the LoRA changed it */
        assert_true(tensor_differs(got, b, "transformer_blocks.0.attn.to_out.0.weight") ||
                    tensor_differs(got, b, "transformer_blocks.1.ff.net.2.weight"));
    free(got);
    free(w);
    free(b);
}

/* A LoRA goes where MiniMax-H3's loader sends it: transformer. keys into
 * the transformer (with a warning where the pipeline has both partitions),
 * into transformer_ref where --lora transformer_ref=LORA asks or the
 * pipeline has no transformer (but where the LoRA has transformer_ref. keys
 * too: diffusers leaves that first adapter inactive); transformer_ref. keys
 * into transformer_ref, and refused where the pipeline has none. Each merged
 * component is what its folder converted alone with the same keys gives. */
static void test_minimax_h3_partitions(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, H3_DIGEST("aitk"));
    char *lora = tu_strdupf("%s/aitk.safetensors", s->dir),
         *converted = tu_strdupf("%s/converted.safetensors", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir),
         *both = tu_strdupf("%s/both", s->dir), *ref = tu_strdupf("%s/ref", s->dir),
         *own = tu_strdupf("%s/own", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *t_lora = tu_strdupf("%s/t.safetensors", s->dir), *r_lora = tu_strdupf("%s/r.safetensors", s->dir),
         *tr_lora = tu_strdupf("%s/tr.safetensors", s->dir), *both_t = tu_strdupf("%s/both/transformer", s->dir),
         *both_ref = tu_strdupf("%s/both/transformer_ref", s->dir), *into = tu_strdupf("transformer_ref=%s", t_lora),
         *into_tr = tu_strdupf("transformer_ref=%s", tr_lora), *t_alone = tu_strdupf("%s/t-alone", s->dir),
         *ref_t_alone = tu_strdupf("%s/ref-t-alone", s->dir), *ref_r_alone = tu_strdupf("%s/ref-r-alone", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_MINIMAX_H3, H3_DIGEST("aitk"), 1, tmp, converted);
    write_h3_pipeline(both, converted, 1, 1);
    write_h3_pipeline(ref, converted, 0, 1);
    write_h3_pipeline(own, converted, 1, 0);
    static const struct synth_tensor T[] = {
        {"transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight", DT_BF16, 2, 256, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight", DT_BF16, 256, 2, 0.25f},
        {"transformer_ref.transformer_blocks.1.ff.net.2.lora_A.weight", DT_BF16, 2, 64, 0.5f},
        {"transformer_ref.transformer_blocks.1.ff.net.2.lora_B.weight", DT_BF16, 256, 2, 0.75f},
    };
    write_synth_file(t_lora, T, 2);
    write_synth_file(r_lora, T + 2, 2);
    write_synth_file(tr_lora, T, 4);
    /* what each partition's folder alone makes of each kind of keys (transformer_ref's takes transformer. keys) */
    assert_converts(both_t, t_alone, t_lora, NULL, 1);
    assert_converts(both_ref, ref_t_alone, t_lora, NULL, 1);
    assert_converts(both_ref, ref_r_alone, r_lora, NULL, 1);
    const struct {
        const char *in, *lora;
        int lines;                /* the summary, and any warning */
        const char *transformer, *transformer_ref; /* what each becomes (NULL: as it was) */
    } CASES[] = {
        {both, t_lora, 2, t_alone, NULL},          /* naming no partition: the transformer, with a warning */
        {both, into, 1, NULL, ref_t_alone},        /* asked for transformer_ref */
        {ref, t_lora, 1, NULL, ref_t_alone},       /* a ref2va pipeline: transformer_ref takes them */
        {both, tr_lora, 1, t_alone, ref_r_alone},  /* each partition its own keys */
        /* asked for transformer_ref, or on a ref2va pipeline, with transformer_ref keys too: diffusers
         * loads the transformer's keys there first, as an adapter the next one leaves inactive */
        {both, into_tr, 2, NULL, ref_r_alone},
        {ref, tr_lora, 2, NULL, ref_r_alone},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        assert_converts(CASES[i].in, out, CASES[i].lora, NULL, CASES[i].lines);
        if (CASES[i].in == both)
            assert_component(out, "transformer", CASES[i].transformer, both);
        assert_component(out, "transformer_ref", CASES[i].transformer_ref, CASES[i].in);
        tu_rmtree(out);
    }
    /* transformer_ref keys with no transformer_ref: refused, as diffusers refuses them */
    assert_lora_refused(own, out, tr_lora, "transformer_ref, a component this pipeline does not load", tmp);
    struct tu_run run = tu_run("convert", "--device", "cpu", own, out, "--lora", into, NULL);
    if (run.status != NF4_EUSAGE || tu_lines(run.err) != 1 || !strstr(run.err, "has no component transformer_ref"))
        fail_msg("exit %d, stderr: %s", run.status, run.err);
    tu_run_free(&run);
    assert_false(tu_exists(out));
    /* What diffusers loads is what the index lists. Both folders, transformer_ref listed alone: a ref2va
     * pipeline, whose transformer/ takes nothing */
    write_h3_index(both, 0, 1);
    char *into_t = tu_strdupf("transformer=%s", t_lora);
    const char *const TO_REF[] = {t_lora, into_t}; /* transformer=LORA too: diffusers has no transformer to load into */
    for (size_t i = 0; i < 2; i++) {
        assert_converts(both, out, TO_REF[i], NULL, 1);
        assert_component(out, "transformer", NULL, both);
        assert_component(out, "transformer_ref", ref_t_alone, both);
        tu_rmtree(out);
    }
    free(into_t);
    write_h3_index(both, 0, 0); /* neither: no denoiser takes a LoRA */
    assert_lora_refused(both, out, t_lora, "has no tensors for a component of this pipeline", tmp);
    /* transformer listed but not held (from its repository): the transformer's keys go there, not here */
    write_h3_index(ref, 1, 1);
    run = tu_run("convert", "--device", "cpu", ref, out, "--lora", t_lora, NULL); /* and the remote one is named */
    if (run.status != NF4_EDATA || tu_lines(run.err) != 2 ||
        !strstr(run.err, "takes transformer from the repositories") ||
        !strstr(run.err, "its keys are for: transformer)"))
        fail_msg("exit %d, stderr: %s", run.status, run.err);
    tu_run_free(&run);
    assert_false(tu_exists(out));
    run = tu_run("convert", "--device", "cpu", ref, out, "--lora", tr_lora, NULL);
    if (run.status != 0 || tu_lines(run.err) != 3 || !strstr(run.err, "2 of its tensors are for transformer, which"))
        fail_msg("exit %d, stderr: %s", run.status, run.err);
    tu_run_free(&run);
    assert_component(out, "transformer_ref", ref_r_alone, ref);
    tu_rmtree(out);
    char *const owned[] = {lora, converted, tmp, both, ref, own, out, t_lora, r_lora, tr_lora, both_t, both_ref, into,
                           into_tr, t_alone, ref_t_alone, ref_r_alone};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++)
        free(owned[i]);
}

/* A PEFT dump (PEFT's .default. infix, no component) is put under
 * transformer. with the infix dropped, every tensor a byte copy. */
static void test_minimax_h3_peft_dump(void **state)
{
    struct tu_scratch *s = *state;
    static const struct synth_tensor DUMP[] = {
        {"transformer_blocks.0.attn.to_q.lora_A.default.weight", DT_BF16, 2, 8, 0.5f},
        {"transformer_blocks.0.attn.to_q.lora_B.default.weight", DT_BF16, 8, 2, 0.25f},
    };
    char *lora = tu_strdupf("%s-dump.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    write_synth_file(lora, DUMP, 2);
    struct model *m;
    assert_int_equal(diffusers_lora_open(lora, LORA_FAMILY_MINIMAX_H3, 0, &m), NF4_OK);
    assert_int_equal(m->count, 2);
    assert_non_null(model_find(m, "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"));
    assert_non_null(model_find(m, "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"));
    model_close(m);
    assert_int_equal(tu_count_entries(s->dir), 0);
    unlink(lora);
    free(lora);
}

/* What diffusers raises on: one line naming the file and key, exit 65,
 * no model, no temp file left. */
static void test_minimax_h3_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        struct synth_tensor t[3];
        const char *want;
    } CASES[] = {
        {{{"lora_unet_blocks_0_attn_qkv_projection.lora_down.weight", DT_BF16, 2, 8, 0.5f}},
         "musubi-tuner's flattened lora_unet_ form"},
        {{{"lora_unet_blocks_0_attn_qkv_proj.lora_down.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.attn.qkv_proj.lora_B.weight", DT_BF16, 9, 2, 0.5f}},
         "musubi-tuner's flattened lora_unet_ form"},
        {{{"blocks.0.attn.qkv_proj.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.attn.qkv_proj.lora_B.weight", DT_BF16, 8, 2, 0.5f}},
         "not a multiple of 3"},
        {{{"blocks.0.attn.qkv_proj.lora_A.default.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.attn.qkv_proj.lora_B.default.weight", DT_BF16, 384 * 2 + 3, 2, 0.5f}},
         "not a multiple of 384"},
        {{{"blocks.1.mlp.fc1.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.1.mlp.fc1.lora_B.weight", DT_BF16, 9, 2, 0.5f}},
         "not an even number"},
        {{{"diffusion_model.final_layer.video_out.lora_A.weight", DT_BF16, 2, 8, 0.5f}},
         "has no final_layer.video_out.lora_B.weight beside it"},
        {{{"blocks.01.mlp.fc2.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.01.mlp.fc2.lora_B.weight", DT_BF16, 8, 2, 0.5f}},
         "is left over by diffusers' conversion"},
        {{{"blocks.0.mlp.fc2.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.mlp.fc2.lora_B.weight", DT_BF16, 8, 2, 0.5f},
          {"blocks.0.mlp.fc2.lora_down.weight", DT_BF16, 2, 8, 0.5f}},
         "has no blocks.0.mlp.fc2.lora_up.weight beside it"},
        {{{"diffusion_model.blocks.0.mlp.fc2.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.mlp.fc2.lora_A.weight", DT_BF16, 2, 8, 0.5f}},
         "becomes blocks.0.mlp.fc2.lora_A.weight"},
        {{{"blocks.0.mlp.fc2.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"blocks.0.mlp.fc2.lora_B.weight", DT_BF16, 8, 2, 0.5f},
          {"blocks.0.mlp.fc2.alpha", DT_BF16, 2, 0, -1.0f}},
         "is not one number"},
        {{{"transformer.transformer_blocks.0.attn.to_q.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"transformer.transformer_blocks.0.attn.to_q.alpha", DT_BF16, 1, 0, 1.0f}},
         "has no \"lora\" in its name"},
    };
    char *lora = tu_strdupf("%s-h3.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        size_t n = 0;
        while (n < 3 && CASES[c].t[n].name)
            n++;
        write_synth_file(lora, CASES[c].t, n);
        assert_lora_open_refused(lora, LORA_FAMILY_MINIMAX_H3, CASES[c].want, s->dir, c);
    }
    unlink(lora);
    free(lora);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_minimax_h3_family),
        cmocka_unit_test_setup_teardown(test_minimax_h3_lora_as_diffusers_loads_it, tu_scratch_setup,
                                        lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_minimax_h3_metadata_alpha, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_minimax_h3_partitions, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_minimax_h3_peft_dump, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_minimax_h3_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
