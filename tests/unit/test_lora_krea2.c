/* Krea 2 LoRAs (lora_krea2.h) read as diffusers 0.42 loads them. Each test
 * builds the LoRA lora-krea2.digest lists (make_krea2_fixtures.py: Krea 2's
 * names under ComfyUI's diffusion_model.), and the same tensors in
 * AI-Toolkit's form (base_model.model., with a LoRA config): both convert to
 * what the digests of diffusers' own conversion say, byte for byte; merge
 * through the command line, on the transformer's folder and in a pipeline, as
 * that conversion does with the file's metadata; and what diffusers raises on
 * is refused with one line naming the key, nothing written, no temp file
 * left. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define KREA2_DIGEST FIXTURES "/diffusers/lora-krea2.digest"
#define KREA2_COMFY "diffusion_model."
#define KREA2_TRANSFORMER "Krea2Transformer2DModel"

/* The AI-Toolkit file's LoRA config: alpha 4 over r 2, the feed-forwards at rank 3. */
static const struct st_meta AITK_META = {
    "lora_adapter_metadata",
    "{\"transformer.r\": 2, \"transformer.lora_alpha\": 4, \"transformer.rank_pattern\": {\"ff.gate\": 3, "
    "\"ff.up\": 3, \"ff.down\": 3}, \"transformer.target_modules\": [\"to_q\"]}"};

/* The digest's LoRA in ComfyUI's form (*comfy), and its tensors under
 * AI-Toolkit's base_model.model. (tmlp's without a prefix, no DoRA scale),
 * their values those of the names they had (*aitk). */
static void krea2_recipes(struct recipe *comfy, struct recipe *aitk)
{
    recipe_read(comfy, KREA2_DIGEST);
    aitk->n = 0;
    aitk->values = comfy->values;
    for (size_t i = 0; i < comfy->n; i++) {
        const char *rest = comfy->t[i].name + strlen(KREA2_COMFY);
        assert_true(strncmp(comfy->t[i].name, KREA2_COMFY, strlen(KREA2_COMFY)) == 0);
        if (strstr(rest, "dora_scale"))
            continue;
        char name[RECIPE_NAME_MAX];
        snprintf(name, sizeof name, "%s%s", strncmp(rest, "tmlp.", 5) == 0 ? "" : "base_model.model.", rest);
        struct recipe_tensor *t = recipe_add(aitk, name, comfy->t[i].dtype, comfy->t[i].ndim, comfy->t[i].shape[0],
                                             comfy->t[i].shape[1]);
        t->seeded = 1;
        t->seed = fnv1a32(comfy->t[i].name);
    }
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

/* Both forms convert to what the digests say, byte for byte; the messages
 * name the file. */
static void test_krea2_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe comfy, aitk;
    krea2_recipes(&comfy, &aitk);
    char *comfy_path = tu_strdupf("%s-comfy.safetensors", s->dir), *aitk_path = tu_strdupf("%s-aitk.safetensors", s->dir);
    assert_recipe_converts(&comfy, comfy_path, NULL, 0, LORA_FAMILY_KREA2, KREA2_DIGEST, 1, s->dir, NULL);
    assert_recipe_converts(&aitk, aitk_path, &AITK_META, 1, LORA_FAMILY_KREA2, KREA2_DIGEST, 0, s->dir, NULL);
    unlink(comfy_path);
    unlink(aitk_path);
    free(comfy_path);
    free(aitk_path);
}

/* Merged into a Krea 2-shaped transformer, alone and in a pipeline, each form
 * gives the bytes the conversion the digests check gives, with the file's
 * metadata (the AI-Toolkit file's alpha 4 and rank pattern), which changes
 * the result. */
static void test_krea2_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe comfy, aitk;
    krea2_recipes(&comfy, &aitk);
    char *comfy_path = tu_strdupf("%s/comfy.safetensors", s->dir), *aitk_path = tu_strdupf("%s/aitk.safetensors", s->dir),
         *converted = tu_strdupf("%s/converted.safetensors", s->dir), *comfy_dir = tu_strdupf("%s/comfy", s->dir),
         *aitk_dir = tu_strdupf("%s/aitk", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&comfy, comfy_path, NULL, 0, LORA_FAMILY_KREA2, KREA2_DIGEST, 1, tmp, converted);
    recipe_write(&aitk, aitk_path, aitk.values, &AITK_META, 1);
    /* the comfy file's DoRA scale is left out with a warning */
    char *comfy_out = assert_merges_as_converted(comfy_dir, comfy_path, converted, KREA2_TRANSFORMER, "Krea2Pipeline", 2);
    char *aitk_out = assert_merges_as_converted(aitk_dir, aitk_path, converted, KREA2_TRANSFORMER, "Krea2Pipeline", 1);
    assert_true(tensor_differs(comfy_out, aitk_out, "transformer_blocks.0.attn.to_q.weight"));
    free(comfy_out);
    free(aitk_out);
    free(comfy_path);
    free(aitk_path);
    free(converted);
    free(comfy_dir);
    free(aitk_dir);
    free(tmp);
}

/* A file of the pairs `names` (each [2, 8] and [8, 2], BF16), and `extra`
 * (NULL: none) as an F32 [1]. */
static void write_krea2_lora(const char *path, const char *const *names, size_t n, const char *extra)
{
    struct synth_tensor ts[8];
    char *keys[8];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        keys[k] = tu_strdupf("%s.lora_A.weight", names[i]);
        ts[k] = (struct synth_tensor){keys[k], DT_BF16, 2, 8, 0.5f};
        k++;
        keys[k] = tu_strdupf("%s.lora_B.weight", names[i]);
        ts[k] = (struct synth_tensor){keys[k], DT_BF16, 8, 2, 0.5f};
        k++;
    }
    if (extra) {
        keys[k] = tu_strdupf("%s", extra);
        ts[k] = (struct synth_tensor){keys[k], DT_F32, 1, 0, 4.0f};
        k++;
    }
    write_synth_file(path, ts, k);
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
        assert_lora_open_refused(lora, LORA_FAMILY_KREA2, CASES[i].want, s->dir, i);
    }
    /* Through the command line, on a Krea 2 transformer's folder. */
    char *base = tu_strdupf("%s-base", s->dir);
    static struct recipe comfy, aitk;
    krea2_recipes(&comfy, &aitk);
    recipe_base(&comfy, lora, LORA_FAMILY_KREA2, KREA2_DIGEST, s->dir, base, KREA2_TRANSFORMER);
    write_krea2_lora(lora, CASES[0].pairs, 1, CASES[0].extra);
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
        cmocka_unit_test(test_krea2_family),
        cmocka_unit_test_setup_teardown(test_krea2_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_krea2_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_krea2_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
