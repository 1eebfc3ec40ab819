/* Lumina 2 LoRAs (lora_lumina2.h) read as diffusers 0.42 loads them. The
 * LoRA lora-lumina2.digest lists (make_lumina2_fixtures.py: Lumina 2's names
 * under ComfyUI's diffusion_model., for a model of the real width) converts
 * to what the digests of diffusers' own conversion say, byte for byte; the
 * same LoRA with narrow lora_A factors merges through the command line, on
 * the transformer's folder and in a pipeline, as its conversion does, its
 * qkv cut into to_q, to_k and to_v; what diffusers raises on is refused with
 * one line naming the file and key, nothing written, no temp file left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define LUMINA2_DIGEST FIXTURES "/diffusers/lora-lumina2.digest"
#define LUMINA2_TRANSFORMER "Lumina2Transformer2DModel"
/* The narrow LoRA's lora_A columns: the modules' inputs in its base. */
#define NARROW_IN 8

/* The classes of Lumina 2's pipeline and transformer pick its conversion. */
static void test_lumina2_family(void **state)
{
    (void)state;
    assert_int_equal(diffusers_lora_family("Lumina2Pipeline"), LORA_FAMILY_LUMINA2);
    assert_int_equal(diffusers_lora_family(LUMINA2_TRANSFORMER), LORA_FAMILY_LUMINA2);
    assert_int_equal(diffusers_lora_family("LuminaPipeline"), LORA_FAMILY_OTHER);
}

/* The digest's LoRA converts to what the digests say, byte for byte, naming
 * the file; its DoRA scale is left out. */
static void test_lumina2_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(LUMINA2_DIGEST, LORA_FAMILY_LUMINA2, s->dir, "lumina2");
}

/* The digest's LoRA with every lora_A NARROW_IN wide merges into a Lumina
 * 2-shaped transformer, alone and in a pipeline, as its conversion does; the
 * query, key and value each take their own rows of the qkv lora_B. */
static void test_lumina2_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, LUMINA2_DIGEST);
    for (size_t i = 0; i < r.n; i++)
        if (strstr(r.t[i].name, ".lora_A."))
            r.t[i].shape[1] = NARROW_IN;
    char *lora = tu_strdupf("%s/lumina2.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *dir = tu_strdupf("%s/merge", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_int_equal(setenv("TMPDIR", tmp, 1), 0);
    recipe_write(&r, lora, r.values, NULL, 0);
    struct model *m;
    if (diffusers_lora_open(lora, LORA_FAMILY_LUMINA2, 0, &m) != NF4_OK)
        fail_msg("%s", nf4_last_error());
    assert_non_null(model_find(m, "transformer.layers.1.attn.to_k.lora_B.weight"));
    assert_int_equal(model_find(m, "transformer.layers.1.attn.to_k.lora_B.weight")->t->shape[0], 768);
    assert_int_equal(model_find(m, "transformer.layers.1.attn.to_q.lora_B.weight")->t->shape[0], 2304);
    write_model(m, converted, NULL, 0);
    model_close(m);
    assert_int_equal(tu_count_entries(tmp), 0);
    /* the DoRA scale is left out with a warning */
    char *out = assert_merges_as_converted(dir, lora, converted, LUMINA2_TRANSFORMER, "Lumina2Pipeline", 2);
    char *base = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", dir);
    static const char *const CHANGED[] = {"noise_refiner.0.attn.to_q.weight", "context_refiner.1.attn.to_v.weight",
                                          "layers.1.attn.to_k.weight", "layers.0.norm1.linear.weight",
                                          "layers.1.feed_forward.linear_2.weight"};
    for (size_t i = 0; i < sizeof CHANGED / sizeof CHANGED[0]; i++)
        assert_true(tensor_differs(out, base, CHANGED[i]));
    free(base);
    free(out);
    free(lora);
    free(converted);
    free(dir);
    free(tmp);
}

#define CASE_MAX 16

/* One refusal: pairs `pairs` (each lora_A [2, 8] and lora_B [8, 2], BF16; a
 * qkv's lora_B `qkv_rows` rows), and `extra` (NULL: none) as an F32 [1]. */
struct lumina2_case {
    const char *pairs[7];
    uint64_t qkv_rows;
    const char *extra;
    const char *want;
};

static void write_lumina2_case(const char *path, const struct lumina2_case *c)
{
    struct synth_tensor ts[CASE_MAX];
    char *keys[CASE_MAX];
    size_t k = 0;
    for (size_t i = 0; i < 7 && c->pairs[i]; i++) {
        const int qkv = strstr(c->pairs[i], "attention.qkv") != NULL;
        keys[k] = tu_strdupf("%s.lora_A.weight", c->pairs[i]);
        ts[k] = (struct synth_tensor){keys[k], DT_BF16, 2, 8, 0.5f};
        k++;
        keys[k] = tu_strdupf("%s.lora_B.weight", c->pairs[i]);
        ts[k] = (struct synth_tensor){keys[k], DT_BF16, qkv ? c->qkv_rows : 8, 2, 0.5f};
        k++;
    }
    if (c->extra) {
        keys[k] = tu_strdupf("%s", c->extra);
        ts[k] = (struct synth_tensor){keys[k], DT_F32, 1, 0, 4.0f};
        k++;
    }
    write_synth_file(path, ts, k);
    for (size_t j = 0; j < k; j++)
        free(keys[j]);
}

#define L0 "diffusion_model.layers.0."
#define FULL_L0 L0 "attention.qkv", L0 "attention.out", L0 "feed_forward.w1", L0 "feed_forward.w2", \
                L0 "feed_forward.w3", L0 "adaLN_modulation.1"

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file (and the key where there is one), exit 65, nothing
 * written, no temp file left. */
static void test_lumina2_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct lumina2_case CASES[] = {
        {{L0 "attention.qkv", NULL}, 3840, NULL,
         "has no key layers.0.attention.out.lora_A.weight (after its first 16 characters), which diffusers pops"},
        {{FULL_L0}, 3839, NULL, L0 "attention.qkv.lora_B.weight: has 3839 rows, where diffusers cuts"},
        {{FULL_L0}, 3840, L0 "attention.qkv.alpha", L0 "attention.qkv.alpha: is left over"},
        {{FULL_L0}, 3840, "diffusion_model.x_embedder.lora_A.weight", "x_embedder.lora_A.weight: is left over"},
        {{"diffusion_model.layers.1.attention.qkv", NULL}, 3840, NULL, "has no key layers.0.attention.qkv.lora_A"},
        {{"diffusion_model.layers.\xd9\xa3.attention.qkv", NULL}, 3840, NULL, "may not be ASCII digits"},
        {{"diffusion_model.layers.1234567890.attention.qkv", NULL}, 3840, NULL, "more than 9 digits"},
        {{FULL_L0}, 3840, "DIFFUSION_MODEL.layers.0.attention.out.lora_A.weight", "layers.0.attention.out.lora_A"},
        {{"diffusion_model.context_refiner.0.attention.qkv", "diffusion_model.context_refiner.0.attention.out",
          "diffusion_model.context_refiner.0.feed_forward.w1", "diffusion_model.context_refiner.0.feed_forward.w2",
          "diffusion_model.context_refiner.0.feed_forward.w3", "diffusion_model.context_refiner.0.adaLN_modulation.1"},
         3840, NULL, "context_refiner.0.adaLN_modulation.1.lora_A.weight: is left over"},
    };
    char *lora = tu_strdupf("%s-lumina2.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        write_lumina2_case(lora, &CASES[i]);
        assert_lora_open_refused(lora, LORA_FAMILY_LUMINA2, CASES[i].want, s->dir, i);
    }
    /* A full block converts (the cases' refusals are theirs alone), and a
     * bad one is refused through the command line, on a transformer's folder. */
    static const struct lumina2_case GOOD = {{FULL_L0}, 3840, NULL, NULL};
    write_lumina2_case(lora, &GOOD);
    struct model *m = NULL;
    if (diffusers_lora_open(lora, LORA_FAMILY_LUMINA2, 0, &m) != NF4_OK)
        fail_msg("%s", nf4_last_error());
    char *base = tu_strdupf("%s-base", s->dir), *converted = tu_strdupf("%s-converted.safetensors", s->dir);
    write_model(m, converted, NULL, 0);
    model_close(m);
    assert_int_equal(model_open_file(converted, &m), NF4_OK);
    write_lora_base(m, base, LUMINA2_TRANSFORMER);
    model_close(m);
    write_lumina2_case(lora, &CASES[1]);
    assert_lora_refused(base, out, lora, CASES[1].want, s->dir);
    tu_rmtree(base);
    unlink(converted);
    unlink(lora);
    free(base);
    free(converted);
    free(lora);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lumina2_family),
        cmocka_unit_test_setup_teardown(test_lumina2_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_lumina2_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_lumina2_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
