/* ACE-Step LoRAs (lora_ace_step.h) read as diffusers 0.42 loads them. The
 * LoRA lora-ace-step.digest lists (make_ace_step_fixtures.py: PEFT's keys on
 * the original DiT's names, as ACE-Step 1.5's trainer saves them, every
 * Linear of a tiny ACE-Step transformer) converts to what the digests of
 * diffusers' own conversion say, byte for byte; merges through the command
 * line, on the transformer's folder and in a pipeline, as that conversion
 * does; and what diffusers raises on, or would load as nf4deq would not, is
 * refused with one line naming the file and key, nothing written, no temp
 * file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define ACE_STEP_DIGEST FIXTURES "/diffusers/lora-ace-step.digest"
#define ACE_STEP_TRANSFORMER "AceStepTransformer1DModel"

/* ACE-Step's classes pick its conversion. */
static void test_ace_step_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family("AceStepPipeline"), LORA_FAMILY_ACE_STEP);
    assert_int_equal(diffusers_lora_family(ACE_STEP_TRANSFORMER), LORA_FAMILY_ACE_STEP);
    assert_int_equal(diffusers_lora_family("AceStep"), LORA_FAMILY_ACE_STEP);
    assert_int_equal(diffusers_lora_family("AcePipeline"), LORA_FAMILY_OTHER);
}

/* The digest's LoRA converts to what the digests say, byte for byte, naming
 * the file; its DoRA scale is left out. */
static void test_ace_step_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(ACE_STEP_DIGEST, LORA_FAMILY_ACE_STEP, s->dir, "ace-step");
}

/* Merged into an ACE-Step-shaped transformer, alone and in a pipeline, the
 * LoRA gives the bytes its conversion gives. */
static void test_ace_step_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, ACE_STEP_DIGEST);
    char *lora = tu_strdupf("%s/ace-step.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *dir = tu_strdupf("%s/merge", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_ACE_STEP, ACE_STEP_DIGEST, 1, tmp, converted);
    /* the DoRA scale is left out with a warning */
    char *out = assert_merges_as_converted(dir, lora, converted, ACE_STEP_TRANSFORMER, "AceStepPipeline", 2);
    char *base = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", dir);
    static const char *const CHANGED[] = {"layers.0.self_attn.to_q.weight", "layers.1.cross_attn.to_out.0.weight",
                                          "layers.0.mlp.gate_proj.weight", "time_embed_r.time_proj.weight",
                                          "condition_embedder.weight"};
    for (size_t i = 0; i < sizeof CHANGED / sizeof CHANGED[0]; i++)
        assert_true(tensor_differs(out, base, CHANGED[i]));
    free(base);
    free(out);
    free(lora);
    free(converted);
    free(dir);
    free(tmp);
}

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file and key, exit 65, nothing written, no temp file left. */
static void test_ace_step_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *names[2];
        const char *want;
    } CASES[] = {
        /* both become transformer.layers.0.self_attn.to_q.lora_A.weight */
        {{"base_model.model.layers.0.self_attn.q_proj.lora_A.weight", "layers.0.self_attn.to_q.lora_A.weight"},
         "layers.0.self_attn.to_q.lora_A.weight"},
        {{"layers.0.self_attn.k_proj.alpha", NULL}, "has no \"lora\" in its name once converted"},
    };
    char *lora = tu_strdupf("%s-ace-step.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_names_file(lora, CASES[i].names, 2);
        assert_lora_open_refused(lora, LORA_FAMILY_ACE_STEP, CASES[i].want, s->dir, i);
    }
    /* Through the command line, on an ACE-Step transformer's folder. */
    char *base = tu_strdupf("%s-base", s->dir), *out = tu_strdupf("%s/out", s->dir);
    static struct recipe r;
    recipe_read(&r, ACE_STEP_DIGEST);
    recipe_base(&r, lora, LORA_FAMILY_ACE_STEP, ACE_STEP_DIGEST, s->dir, base, ACE_STEP_TRANSFORMER);
    write_names_file(lora, CASES[1].names, 1);
    assert_lora_refused(base, out, lora, CASES[1].want, s->dir);
    tu_rmtree(base);
    unlink(lora);
    free(base);
    free(lora);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ace_step_family),
        cmocka_unit_test_setup_teardown(test_ace_step_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ace_step_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ace_step_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
