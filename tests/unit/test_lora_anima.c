/* Anima LoRAs (lora_anima.h) read as diffusers 0.42 loads them, and the
 * modular pipelines (modular_model_index.json) they come with. The LoRA
 * lora-anima.digest lists (make_anima_fixtures.py: the original names under
 * ComfyUI's diffusion_model., every Linear of a tiny Anima transformer and
 * text conditioner) converts to what the digests of diffusers' own
 * conversion say, byte for byte; merges through the command line, into a
 * modular pipeline's two components and into each component's folder alone,
 * as that conversion does; and what diffusers raises on, or would load as
 * nf4deq would not, is refused with one line naming the file and key,
 * nothing written, no temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define ANIMA_DIGEST FIXTURES "/diffusers/lora-anima.digest"
#define ANIMA_PIPELINE "AnimaModularPipeline"
#define WEIGHTS "diffusion_pytorch_model.safetensors"

/* The classes whose loader is Anima's pick its conversion; AnimateDiff's
 * do not, nor Cosmos' transformer class, which Anima's shares (alone, it
 * takes diffusers' form only, as Cosmos' loader does). Modular
 * pipelines take the loader their class has: HunyuanVideo 1.5's modular
 * one HunyuanVideo's (its other pipelines have none), Echo's LTX-2's. */
static void test_anima_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family(ANIMA_PIPELINE), LORA_FAMILY_ANIMA);
    assert_int_equal(diffusers_lora_family("AnimaTextConditioner"), LORA_FAMILY_ANIMA);
    assert_int_equal(diffusers_lora_family("AnimateDiffPipeline"), LORA_FAMILY_STABLE_DIFFUSION);
    assert_int_equal(diffusers_lora_family("Anima"), LORA_FAMILY_OTHER);
    assert_int_equal(diffusers_lora_family("CosmosTransformer3DModel"), LORA_FAMILY_OWN_FORM);
    assert_int_equal(diffusers_lora_family("HunyuanVideo15ModularPipeline"), LORA_FAMILY_HUNYUAN_VIDEO);
    assert_int_equal(diffusers_lora_family("HunyuanVideo15Pipeline"), LORA_FAMILY_OTHER);
    assert_int_equal(diffusers_lora_family("HunyuanVideo15Transformer3DModel"), LORA_FAMILY_OTHER);
    assert_int_equal(diffusers_lora_family("EchoModularPipeline"), LORA_FAMILY_LTX2);
}

/* The digest's LoRA converts to what the digests say, byte for byte, naming
 * the file; its DoRA scale is left out, its diffusers-form key kept. */
static void test_anima_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(ANIMA_DIGEST, LORA_FAMILY_ANIMA, s->dir, "anima");
}

/* pipe: a modular Anima pipeline (modular_model_index.json, as
 * ModularPipeline.save_pretrained writes it) with a transformer and a text
 * conditioner made for the diffusers-form LoRA `converted`. */
static void write_anima_pipeline(const char *pipe, const char *converted)
{
    static const char INDEX[] =
        "{\n  \"_blocks_class_name\": \"AnimaAutoBlocks\",\n  \"_class_name\": \"" ANIMA_PIPELINE "\",\n"
        "  \"text_conditioner\": [\"diffusers\", \"AnimaTextConditioner\", {\"pretrained_model_name_or_path\": "
        "\"someone/anima-bnb-4bit\", \"revision\": null, \"subfolder\": \"text_conditioner\", \"type_hint\": "
        "[\"diffusers\", \"AnimaTextConditioner\"], \"variant\": null}],\n"
        "  \"transformer\": [\"diffusers\", \"CosmosTransformer3DModel\", {\"pretrained_model_name_or_path\": "
        "\"someone/anima-bnb-4bit\", \"revision\": null, \"subfolder\": \"transformer\", \"type_hint\": "
        "[\"diffusers\", \"CosmosTransformer3DModel\"], \"variant\": null}]\n}\n";
    struct model *c;
    assert_int_equal(model_open_file(converted, &c), NF4_OK);
    assert_int_equal(mkdir(pipe, 0755), 0);
    char *index = tu_strdupf("%s/modular_model_index.json", pipe), *tr = tu_strdupf("%s/transformer", pipe),
         *tc = tu_strdupf("%s/text_conditioner", pipe);
    tu_write_file(index, INDEX, strlen(INDEX));
    write_component_base(c, tr, "transformer.", NULL, "{\"_class_name\": \"CosmosTransformer3DModel\"}", WEIGHTS);
    write_component_base(c, tc, "text_conditioner.", NULL, "{\"_class_name\": \"AnimaTextConditioner\"}", WEIGHTS);
    model_close(c);
    free(index);
    free(tr);
    free(tc);
}

static void assert_converts(const char *in, const char *out, const char *lora)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.err, "with LoRA merged"))
        fail_msg("%s: exit %d, stderr: %s", in, r.status, r.err);
    tu_run_free(&r);
}

/* Merged into a modular Anima pipeline, the LoRA gives what its conversion
 * gives in both components, byte for byte, and changes each; the index is
 * copied as it is (ModularPipeline.from_pretrained of a folder loads the
 * components the folder holds from it). Each component's folder converted
 * alone reads the LoRA as its pipeline does (the transformer's class is
 * Cosmos', so it is the modular index's class that picks the conversion). */
static void test_anima_lora_merges_in_a_modular_pipeline(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, ANIMA_DIGEST);
    char *lora = tu_strdupf("%s/anima.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *tmp = tu_strdupf("%s/tmp", s->dir), *pipe = tu_strdupf("%s/pipe", s->dir),
         *want = tu_strdupf("%s/want", s->dir), *got = tu_strdupf("%s/got", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_ANIMA, ANIMA_DIGEST, 1, tmp, converted);
    write_anima_pipeline(pipe, converted);
    assert_converts(pipe, want, converted); /* diffusers' own form, as the digests say diffusers converts it */
    assert_converts(pipe, got, lora);
    static const char *const CHANGED[][2] = {
        {"transformer", "transformer_blocks.0.attn1.to_q.weight"},
        {"transformer", "time_embed.t_embedder.linear_1.weight"},
        {"transformer", "proj_out.weight"},
        {"text_conditioner", "blocks.0.self_attn.o_proj.weight"},
        {"text_conditioner", "in_proj.weight"},
    };
    for (size_t i = 0; i < sizeof CHANGED / sizeof CHANGED[0]; i++) {
        char *g = tu_strdupf("%s/%s/" WEIGHTS, got, CHANGED[i][0]), *w = tu_strdupf("%s/%s/" WEIGHTS, want, CHANGED[i][0]),
             *b = tu_strdupf("%s/%s/" WEIGHTS, pipe, CHANGED[i][0]);
        tu_assert_same_tensors(g, w);
        assert_true(tensor_differs(g, b, CHANGED[i][1]));
        free(g);
        free(w);
        free(b);
    }
    char *index_in = tu_strdupf("%s/modular_model_index.json", pipe), *index_out = tu_strdupf("%s/modular_model_index.json", got);
    size_t a_len = 0, b_len = 0;
    char *a = tu_read_file(index_in, &a_len), *b = tu_read_file(index_out, &b_len);
    assert_true(a_len == b_len && memcmp(a, b, a_len) == 0);
    free(a);
    free(b);
    static const char *const COMPONENTS[] = {"transformer", "text_conditioner"};
    for (size_t i = 0; i < 2; i++) {
        char *in = tu_strdupf("%s/%s", pipe, COMPONENTS[i]), *out = tu_strdupf("%s/alone-%s", s->dir, COMPONENTS[i]),
             *g = tu_strdupf("%s/" WEIGHTS, out), *w = tu_strdupf("%s/%s/" WEIGHTS, got, COMPONENTS[i]);
        assert_converts(in, out, lora);
        tu_assert_same_tensors(g, w);
        free(in);
        free(out);
        free(g);
        free(w);
    }
    free(index_in);
    free(index_out);
    free(lora);
    free(converted);
    free(tmp);
    free(pipe);
    free(want);
    free(got);
}

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file and key, exit 65, nothing written, no temp file left. */
static void test_anima_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *names[2];
        const char *want;
    } CASES[] = {
        /* both become transformer.transformer_blocks.0.attn1.to_q.lora_A.weight */
        {{"diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight",
          "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight"},
         "transformer_blocks.0.attn1.to_q.lora_A.weight"},
        {{"diffusion_model.blocks.0.self_attn.q_proj.alpha", NULL}, "has no \"lora\" in its name once converted"},
    };
    char *lora = tu_strdupf("%s-anima.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_names_file(lora, CASES[i].names, 2);
        assert_lora_open_refused(lora, LORA_FAMILY_ANIMA, CASES[i].want, s->dir, i);
    }
    /* Through the command line, on a modular Anima pipeline. */
    char *base = tu_strdupf("%s-base", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *converted = tu_strdupf("%s-converted.safetensors", s->dir);
    static struct recipe r;
    recipe_read(&r, ANIMA_DIGEST);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_ANIMA, ANIMA_DIGEST, 1, s->dir, converted);
    write_anima_pipeline(base, converted);
    write_names_file(lora, CASES[1].names, 1);
    assert_lora_refused(base, out, lora, CASES[1].want, s->dir);
    tu_rmtree(base);
    unlink(lora);
    unlink(converted);
    free(base);
    free(lora);
    free(out);
    free(converted);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_anima_family),
        cmocka_unit_test_setup_teardown(test_anima_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_anima_lora_merges_in_a_modular_pipeline, tu_scratch_setup,
                                        lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_anima_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
