/* Ideogram 4 LoRAs (lora_ideogram4.h) read as diffusers 0.42 loads them.
 * Each test builds the LoRAs make_ideogram4_fixtures.py's digests list
 * (AI-Toolkit's diffusion_model. form with a fused qkv; kohya's form with
 * alphas of three dtypes and a module without one): each converts to what
 * the digests of diffusers' own conversion say, byte for byte; merges through
 * the command line, on the transformer's folder and in a pipeline, as that
 * conversion does; and what diffusers raises on is refused with one line
 * naming the key, nothing written, no temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define I4_TRANSFORMER "Ideogram4Transformer2DModel"

static const char *const DIGESTS[] = {
    FIXTURES "/diffusers/lora-ideogram4-aitk.digest",
    FIXTURES "/diffusers/lora-ideogram4-kohya.digest",
};

/* The classes of Ideogram 4's pipelines and transformer pick its conversion. */
static void test_ideogram4_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family("Ideogram4Pipeline"), LORA_FAMILY_IDEOGRAM4);
    assert_int_equal(diffusers_lora_family("Ideogram4ModularPipeline"), LORA_FAMILY_IDEOGRAM4);
    assert_int_equal(diffusers_lora_family(I4_TRANSFORMER), LORA_FAMILY_IDEOGRAM4);
    assert_int_equal(diffusers_lora_family("Ideogram3Pipeline"), LORA_FAMILY_OTHER);
}

/* Both forms convert to what the digests say, byte for byte (the kohya
 * file's alphas folded in, the fused qkv split); the messages name the file. */
static void test_ideogram4_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    char *path = tu_strdupf("%s-ideogram4.safetensors", s->dir);
    for (size_t i = 0; i < sizeof DIGESTS / sizeof DIGESTS[0]; i++) {
        recipe_read(&r, DIGESTS[i]);
        assert_recipe_converts(&r, path, NULL, 0, LORA_FAMILY_IDEOGRAM4, DIGESTS[i], 1, s->dir, NULL);
    }
    unlink(path);
    free(path);
}

/* Merged into an Ideogram 4-shaped transformer, alone and in a pipeline, each
 * form gives the bytes the conversion the digests check gives. */
static void test_ideogram4_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    char *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    for (size_t i = 0; i < sizeof DIGESTS / sizeof DIGESTS[0]; i++) {
        char *dir = tu_strdupf("%s/form-%zu", s->dir, i), *lora = tu_strdupf("%s/lora-%zu.safetensors", s->dir, i),
             *converted = tu_strdupf("%s/converted-%zu.safetensors", s->dir, i);
        recipe_read(&r, DIGESTS[i]);
        assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_IDEOGRAM4, DIGESTS[i], 1, tmp, converted);
        /* the AI-Toolkit file's DoRA scale is left out with a warning */
        free(assert_merges_as_converted(dir, lora, converted, I4_TRANSFORMER, "Ideogram4Pipeline", i == 0 ? 2 : 1));
        free(dir);
        free(lora);
        free(converted);
    }
    free(tmp);
}

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file and key, exit 65, nothing written, no temp file left. */
static void test_ideogram4_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define P "diffusion_model."
#define D(m) P "layers.0." m ".lora_down.weight"
#define U(m) P "layers.0." m ".lora_up.weight"
    static const struct {
        struct synth_tensor t[3];
        size_t n;
        const char *want;
    } CASES[] = {
        {{{D("attention.o"), DT_BF16, 2, 8, 0.5f}}, 1,
         "layers.0.attention.o.lora_down.weight: has no matching lora_up.weight, which diffusers takes with it"},
        {{{D("attention.o"), DT_BF16, 2, 8, 0.5f}, {U("attention.o"), DT_BF16, 8, 2, 0.5f},
          {P "layers.0.attention.o.alpha", DT_F32, 1, 0, -1.0f}},
         3, "layers.0.attention.o.alpha: is -1"},
        {{{D("attention.qkv"), DT_BF16, 2, 8, 0.5f}, {U("attention.qkv"), DT_BF16, 7, 2, 0.5f}}, 2,
         U("attention.qkv") ": has 7 rows, which diffusers cuts into parts for to_q, to_k and to_v that cannot load"},
        {{{U("attention.o"), DT_BF16, 8, 2, 0.5f}}, 1, U("attention.o") ": is left over where diffusers converts an "
                                                       "Ideogram 4 LoRA, and raises"},
        {{{D("attention.o"), DT_BF16, 2, 8, 0.5f}, {U("attention.o"), DT_BF16, 8, 2, 0.5f},
          {P "layers.0.attention.norm_q.alpha", DT_F32, 1, 0, 1.0f}},
         3, "layers.0.attention.norm_q.alpha: is left over"},
        {{{P "layers.01.attention.o.lora_down.weight", DT_BF16, 2, 8, 0.5f},
          {P "layers.01.attention.o.lora_up.weight", DT_BF16, 8, 2, 0.5f}},
         2, "layers.01.attention.o.lora_down.weight: is left over"},
        {{{"diffusion_model.layers.0.attention.o.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"layers.0.attention.o.lora_A.weight", DT_BF16, 2, 8, 0.5f}},
         2, "layers.0.attention.o.lora_A.weight"},
        {{{P "layers.100001.attention.o.lora_down.weight", DT_BF16, 2, 8, 0.5f}}, 1, "a layer number over 100000"},
        {{{P "layers.\xd9\xa3.attention.o.lora_down.weight", DT_BF16, 2, 8, 0.5f}}, 1, "may not be ASCII digits"},
        {{{D("attention.o"), DT_BF16, 2, 8, 0.5f}, {U("attention.o"), DT_BF16, 8, 2, 0.5f},
          {P "layers.0.attention.o.lora_A.weight", DT_BF16, 2, 8, 0.5f}},
         3, "layers.0.attention.o.lora_A.weight: is left over"},
    };
#undef P
#undef D
#undef U
    char *lora = tu_strdupf("%s-ideogram4.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_synth_file(lora, CASES[i].t, CASES[i].n);
        assert_lora_open_refused(lora, LORA_FAMILY_IDEOGRAM4, CASES[i].want, s->dir, i);
    }
    /* Through the command line, on an Ideogram 4 transformer's folder. */
    char *base = tu_strdupf("%s-base", s->dir);
    static struct recipe aitk;
    recipe_read(&aitk, DIGESTS[0]);
    recipe_base(&aitk, lora, LORA_FAMILY_IDEOGRAM4, DIGESTS[0], s->dir, base, I4_TRANSFORMER);
    write_synth_file(lora, CASES[0].t, CASES[0].n);
    assert_lora_refused(base, out, lora, CASES[0].want, s->dir);
    tu_rmtree(base);
    unlink(lora);
    free(base);
    free(lora);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ideogram4_family),
        cmocka_unit_test_setup_teardown(test_ideogram4_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ideogram4_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ideogram4_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
