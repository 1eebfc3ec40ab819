/* FLUX.3 LoRAs (lora_flux3.h) read as diffusers 0.42 loads them. The LoRA
 * lora-flux3.digest lists (make_flux3_fixtures.py: BFL's names under
 * ComfyUI's diffusion_model., every Linear of a tiny FLUX.3 transformer)
 * converts to what the digests of diffusers' own conversion say, byte for
 * byte; merges through the command line, on the transformer's folder and in
 * a pipeline, as that conversion does; and what diffusers raises on, or
 * would load as nf4deq would not, is refused with one line naming the file
 * and key, nothing written, no temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define FLUX3_DIGEST FIXTURES "/diffusers/lora-flux3.digest"
#define FLUX3_TRANSFORMER "Flux3Transformer2DModel"

/* The classes of FLUX.3's pipelines and transformer pick its conversion;
 * FLUX.1's and FLUX.2's keep theirs. */
static void test_flux3_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family("Flux3ModularPipeline"), LORA_FAMILY_FLUX3);
    assert_int_equal(diffusers_lora_family(FLUX3_TRANSFORMER), LORA_FAMILY_FLUX3);
    assert_int_equal(diffusers_lora_family("Flux2Pipeline"), LORA_FAMILY_FLUX2);
    assert_int_equal(diffusers_lora_family("FluxPipeline"), LORA_FAMILY_FLUX);
}

/* The digest's LoRA converts to what the digests say, byte for byte, naming
 * the file; its DoRA scale is left out. */
static void test_flux3_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(FLUX3_DIGEST, LORA_FAMILY_FLUX3, s->dir, "flux3");
}

/* Merged into a FLUX.3-shaped transformer, alone and in a pipeline, the LoRA
 * gives the bytes its conversion gives. */
static void test_flux3_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, FLUX3_DIGEST);
    char *lora = tu_strdupf("%s/flux3.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *dir = tu_strdupf("%s/merge", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_FLUX3, FLUX3_DIGEST, 1, tmp, converted);
    /* the DoRA scale is left out with a warning */
    char *out = assert_merges_as_converted(dir, lora, converted, FLUX3_TRANSFORMER, "Flux3ModularPipeline", 2);
    char *base = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", dir);
    static const char *const CHANGED[] = {"mode_blocks.image.0.attn.to_q.weight", "txt_mode_blocks.0.attn.to_out.0.weight",
                                          "single_transformer_blocks.0.ff.linear_in.weight", "proj_out.weight"};
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
static void test_flux3_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *names[2];
        const char *want;
    } CASES[] = {
        /* both become transformer.mode_blocks.image.0.attn.to_q.lora_A.weight */
        {{"diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight",
          "diffusion_model.mode_blocks.image.0.attn.to_q.lora_A.weight"},
         "mode_blocks.image.0.attn.to_q.lora_A.weight"},
        {{"diffusion_model.single_blocks.0.q_proj.alpha", NULL}, "has no \"lora\" in its name once converted"},
    };
    char *lora = tu_strdupf("%s-flux3.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_names_file(lora, CASES[i].names, 2);
        assert_lora_open_refused(lora, LORA_FAMILY_FLUX3, CASES[i].want, s->dir, i);
    }
    /* Through the command line, on a FLUX.3 transformer's folder. */
    char *base = tu_strdupf("%s-base", s->dir), *out = tu_strdupf("%s/out", s->dir);
    static struct recipe r;
    recipe_read(&r, FLUX3_DIGEST);
    recipe_base(&r, lora, LORA_FAMILY_FLUX3, FLUX3_DIGEST, s->dir, base, FLUX3_TRANSFORMER);
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
        cmocka_unit_test(test_flux3_family),
        cmocka_unit_test_setup_teardown(test_flux3_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_flux3_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_flux3_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
