/* The diffusers loaders that convert no other form (Stable Diffusion 3's,
 * AuraFlow's, CogVideoX's, Mochi's, Sana's, ...) and ERNIE-Image's, which
 * only renames prefixes. A LoRA in Flux.1's kohya or XLabs form, which an
 * unknown class's Flux.1 rules convert, is refused on those: their loaders
 * load none of it (before, an XLabs file merged into a Stable Diffusion 3
 * transformer, whose attention names Flux.1's conversion gives). The LoRA
 * lora-ernie-image.digest lists (make_ernie_image_fixtures.py: diffusers'
 * names under base_model.model., diffusion_model. and transformer.) converts
 * to what the digests of diffusers' own renaming say, byte for byte, and
 * merges through the command line as that renaming does. (MiniMax-H3's
 * loader is test_lora_minimax_h3.c's.) */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"

#define ERNIE_DIGEST FIXTURES "/diffusers/lora-ernie-image.digest"
#define ERNIE_TRANSFORMER "ErnieImageTransformer2DModel"
#define SD3_TRANSFORMER "SD3Transformer2DModel"

/* Each own-form loader's pipelines and transformer, and ERNIE-Image's
 * classes; a pipeline with no LoRA loader stays unknown. */
static void test_own_form_family(void **state)
{
    (void)state;
    static const char *const OWN[] = {
        "StableDiffusion3Pipeline", "StableDiffusion3PAGImg2ImgPipeline", "StableDiffusion3ModularPipeline",
        SD3_TRANSFORMER, "AuraFlowPipeline", "AuraFlowTransformer2DModel", "CogVideoXPipeline",
        "CogVideoXFunControlPipeline", "CogVideoXTransformer3DModel", "ConsisIDPipeline", "MochiPipeline",
        "MochiTransformer3DModel", "SanaPipeline", "SanaSprintImg2ImgPipeline", "SanaVideoPipeline",
        "SanaTransformer2DModel", "Kandinsky5T2VPipeline", "Kandinsky5Transformer3DModel", "CogView4Pipeline",
        "CogView4Transformer2DModel", "BriaFibo2Pipeline", "BriaFibo2Transformer2DModel",
        "Cosmos2_5_PredictBasePipeline", "CosmosTransformer3DModel", "RFD4ProteinaPipeline",
        "RFD4ProteinaTransformer"};
    for (size_t i = 0; i < sizeof OWN / sizeof OWN[0]; i++)
        if (diffusers_lora_family(OWN[i]) != LORA_FAMILY_OWN_FORM)
            fail_msg("%s: family %d", OWN[i], (int)diffusers_lora_family(OWN[i]));
    assert_int_equal(diffusers_lora_family("ErnieImagePipeline"), LORA_FAMILY_ERNIE_IMAGE);
    assert_int_equal(diffusers_lora_family("ErnieImageModularPipeline"), LORA_FAMILY_ERNIE_IMAGE);
    assert_int_equal(diffusers_lora_family(ERNIE_TRANSFORMER), LORA_FAMILY_ERNIE_IMAGE);
    assert_int_equal(diffusers_lora_family("Cosmos3OmniModularPipeline"), LORA_FAMILY_OTHER);
    assert_int_equal(diffusers_lora_family("KandinskyV22Pipeline"), LORA_FAMILY_OTHER);
}

/* A Stable Diffusion 3 transformer's folder, alone and in a pipeline: a
 * diffusers-form LoRA merges; Flux.1's XLabs and kohya forms, which name
 * its attention once Flux.1's rules convert them, are refused in one line,
 * nothing written; so is an alpha, as SD3's loader refuses a key without
 * "lora". */
static void test_own_form_loaders_convert_nothing(void **state)
{
    struct tu_scratch *s = *state;
    char *diffusers = tu_strdupf("%s/diffusers.safetensors", s->dir), *base = tu_strdupf("%s/transformer", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir), *in_pipe = tu_strdupf("%s/pipe/transformer", s->dir),
         *index = tu_strdupf("%s/pipe/model_index.json", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *tmp = tu_strdupf("%s/tmp", s->dir), *lora = tu_strdupf("%s/lora.safetensors", s->dir);
    static const struct synth_tensor DIFFUSERS[] = {
        {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight", DT_BF16, 2, 8, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_q.lora_B.weight", DT_BF16, 8, 2, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight", DT_BF16, 2, 8, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_k.lora_B.weight", DT_BF16, 8, 2, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_v.lora_A.weight", DT_BF16, 2, 8, 0.5f},
        {"transformer.transformer_blocks.0.attn.to_v.lora_B.weight", DT_BF16, 8, 2, 0.5f},
    };
    write_synth_file(diffusers, DIFFUSERS, sizeof DIFFUSERS / sizeof DIFFUSERS[0]);
    struct model *m;
    assert_int_equal(model_open_file(diffusers, &m), NF4_OK);
    write_lora_base(m, base, SD3_TRANSFORMER);
    assert_int_equal(mkdir(pipe, 0755), 0);
    static const char INDEX[] = "{\"_class_name\": \"StableDiffusion3Pipeline\", \"transformer\": [\"diffusers\", \""
                                SD3_TRANSFORMER "\"]}";
    tu_write_file(index, INDEX, strlen(INDEX));
    write_lora_base(m, in_pipe, SD3_TRANSFORMER);
    model_close(m);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_int_equal(setenv("TMPDIR", tmp, 1), 0);
    const char *const INS[] = {base, pipe};
    for (size_t i = 0; i < 2; i++) {
        assert_lora_converts(INS[i], out, diffusers, 1);
        tu_rmtree(out);
    }
    static const struct {
        struct synth_tensor t[3];
        const char *want;
    } CASES[] = {
        {{{"double_blocks.0.processor.qkv_lora1.down.weight", DT_BF16, 2, 8, 0.5f},
          {"double_blocks.0.processor.qkv_lora1.up.weight", DT_BF16, 24, 2, 0.5f}},
         "no tensors for"},
        {{{"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", DT_BF16, 2, 8, 0.5f},
          {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", DT_BF16, 24, 2, 0.5f},
          {"lora_unet_double_blocks_0_img_attn_qkv.alpha", DT_F32, 1, 1, 2.0f}},
         "in a form this pipeline's diffusers loader does not convert"},
        {{{"transformer.transformer_blocks.0.attn.to_q.lora_A.weight", DT_BF16, 2, 8, 0.5f},
          {"transformer.transformer_blocks.0.attn.to_q.lora_B.weight", DT_BF16, 8, 2, 0.5f},
          {"transformer.transformer_blocks.0.attn.to_q.alpha", DT_F32, 1, 1, 2.0f}},
         "has no \"lora\" in its name"},
    };
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        size_t n = 0;
        while (n < 3 && CASES[c].t[n].name)
            n++;
        write_synth_file(lora, CASES[c].t, n);
        for (size_t i = 0; i < 2; i++)
            assert_lora_refused(INS[i], out, lora, CASES[c].want, tmp);
    }
    tu_rmtree(base);
    tu_rmtree(pipe);
    free(diffusers);
    free(base);
    free(pipe);
    free(in_pipe);
    free(index);
    free(out);
    free(tmp);
    free(lora);
}

/* The digest's LoRA converts to what the digests say, byte for byte, naming
 * the file; its DoRA scale is left out. */
static void test_ernie_image_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(ERNIE_DIGEST, LORA_FAMILY_ERNIE_IMAGE, s->dir, "ernie-image");
}

/* Merged into an ERNIE-Image-shaped transformer, alone and in a pipeline,
 * the LoRA gives the bytes its renaming gives; two keys that become one are
 * refused. */
static void test_ernie_image_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe r;
    recipe_read(&r, ERNIE_DIGEST);
    char *lora = tu_strdupf("%s/ernie.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *dir = tu_strdupf("%s/merge", s->dir), *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_recipe_converts(&r, lora, NULL, 0, LORA_FAMILY_ERNIE_IMAGE, ERNIE_DIGEST, 1, tmp, converted);
    /* the DoRA scale is left out with a warning */
    char *out = assert_merges_as_converted(dir, lora, converted, ERNIE_TRANSFORMER, "ErnieImagePipeline", 2);
    char *base = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", dir);
    static const char *const CHANGED[] = {"layers.0.self_attention.to_q.weight", "layers.1.mlp.linear_fc2.weight",
                                          "final_linear.weight"};
    for (size_t i = 0; i < sizeof CHANGED / sizeof CHANGED[0]; i++)
        assert_true(tensor_differs(out, base, CHANGED[i]));
    free(base);
    free(out);
    static const struct synth_tensor BOTH[] = {
        {"base_model.model.layers.0.mlp.up_proj.lora_A.weight", DT_BF16, 2, 8, 0.5f},
        {"transformer.layers.0.mlp.up_proj.lora_A.weight", DT_BF16, 2, 8, 0.5f},
    };
    write_synth_file(lora, BOTH, 2);
    assert_int_equal(setenv("TMPDIR", tmp, 1), 0);
    assert_lora_open_refused(lora, LORA_FAMILY_ERNIE_IMAGE, "transformer.layers.0.mlp.up_proj.lora_A.weight", tmp, 0);
    free(lora);
    free(converted);
    free(dir);
    free(tmp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_own_form_family),
        cmocka_unit_test_setup_teardown(test_own_form_loaders_convert_nothing, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ernie_image_lora_as_diffusers_loads_it, tu_scratch_setup,
                                        lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_ernie_image_lora_merges_as_converted, tu_scratch_setup,
                                        lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
