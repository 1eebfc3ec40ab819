/* The names transformers 5 saves a model's tensors under (saved_names.h):
 * each form of a runtime name is found where the base holds it, in the
 * order of fewest renames, and never where the base does not. */
#include "saved_names.h"
#include "test_util.h"

/* The base: a NULL-terminated list of the names it holds. */
static int holds(const void *ctx, const char *name)
{
    for (const char *const *n = ctx; *n; n++)
        if (strcmp(*n, name) == 0)
            return 1;
    return 0;
}

/* types: "MODEL_TYPE/TEXT_MODEL_TYPE", either part empty where there is none. */
static void expect(const char *const *base, const char *name, const char *types, const char *want)
{
    char model_type[64] = "", text_type[64] = "";
    const char *slash = strchr(types, '/');
    snprintf(model_type, sizeof model_type, "%.*s", (int)(slash - types), types);
    snprintf(text_type, sizeof text_type, "%s", slash + 1);
    const struct saved_name_model model = {model_type[0] ? model_type : NULL, text_type[0] ? text_type : NULL};
    char *got = NULL;
    assert_int_equal(saved_name_find(name, &model, holds, base, &got), NF4_OK);
    if (want ? !got || strcmp(got, want) != 0 : got != NULL)
        fail_msg("%s: found %s, expected %s", name, got ? got : "nothing", want ? want : "nothing");
    free(got);
}

static void test_saved_forms_of_runtime_names(void **state)
{
    (void)state;
    static const char *const GEMMA3[] = {"language_model.model.layers.0.self_attn.q_proj.weight",
                                         "language_model.lm_head.weight",
                                         "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
                                         "multi_modal_projector.mm_input_projection_weight", NULL};
    const char *gemma3 = "gemma3/gemma3_text";
    expect(GEMMA3, "model.language_model.layers.0.self_attn.q_proj.weight", gemma3,
           "language_model.model.layers.0.self_attn.q_proj.weight");
    expect(GEMMA3, "lm_head.weight", gemma3, "language_model.lm_head.weight");
    expect(GEMMA3, "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight", gemma3,
           "vision_tower.encoder.layers.0.self_attn.q_proj.weight");
    expect(GEMMA3, "model.language_model.layers.1.self_attn.q_proj.weight", gemma3, NULL); /* not in the base */
    static const char *const QWEN2VL[] = {"model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight",
                                          NULL};
    expect(QWEN2VL, "model.language_model.layers.0.self_attn.q_proj.weight", "qwen2_vl/qwen2_vl_text",
           "model.layers.0.self_attn.q_proj.weight");
    expect(QWEN2VL, "model.visual.blocks.0.attn.qkv.weight", "qwen2_vl/qwen2_vl_text", "visual.blocks.0.attn.qkv.weight");
    /* A plain Llama holds model.layers.* too: the multimodal form is not its. */
    expect(QWEN2VL, "model.language_model.layers.0.self_attn.q_proj.weight", "llama/", NULL);
    /* Renames inside the name, alone and after a leading one, each for its types. */
    static const char *const INNER[] = {"model.vision_embedder.patch_dense.weight",
                                        "model.embed_vision.embedding_projection.weight",
                                        "model.language_model.layers.0.self_attn.gate_proj.weight",
                                        "vit.layers.0.mlp.dense_h_to_4h.weight",
                                        "vit.perceive.proj.0.weight",
                                        "layers.0.self_attn.to_q.weight",
                                        "layers.0.mlp.up_proj.weight", "model.vision_tower.patchifier.weight", NULL};
    expect(INNER, "model.embed_vision.patch_dense.weight", "gemma4_unified/gemma4_unified_text",
           "model.vision_embedder.patch_dense.weight");
    expect(INNER, "model.embed_vision.multimodal_embedder.embedding_projection.weight",
           "gemma4_unified/gemma4_unified_text", "model.embed_vision.embedding_projection.weight");
    expect(INNER, "model.language_model.layers.0.self_attn.g_proj.weight", "lfm3_vl/lfm3",
           "model.language_model.layers.0.self_attn.gate_proj.weight");
    expect(INNER, "model.vision_tower.patch_embed.weight", "lfm3_vl/lfm3", "model.vision_tower.patchifier.weight");
    expect(INNER, "model.vision_tower.layers.0.mlp.fc1.weight", "hunyuan_vl/hunyuan_vl_text",
           "vit.layers.0.mlp.dense_h_to_4h.weight");
    expect(INNER, "model.vision_tower.patch_merger.proj_conv.weight", "hunyuan_vl/hunyuan_vl_text",
           "vit.perceive.proj.0.weight");
    expect(INNER, "model.language_model.layers.0.self_attn.q_proj.weight", "cosmos3_edge/cosmos3_edge_text",
           "layers.0.self_attn.to_q.weight");
    expect(INNER, "model.language_model.layers.0.mlp.fc1.weight", "cosmos3_edge/cosmos3_edge_text",
           "layers.0.mlp.up_proj.weight");
    /* ... and for no other type: a Llama's up_proj is not another model's fc1,
     * a headless model's top-level layers.* not a multimodal one's, nor is
     * fc10 a fc1. */
    expect(INNER, "model.language_model.layers.0.self_attn.q_proj.weight", "llama/", NULL);
    expect(INNER, "model.language_model.layers.0.mlp.fc1.weight", "qwen2_vl/qwen2_vl_text", NULL);
    static const char *const LLAMA[] = {"model.layers.0.mlp.up_proj.weight", "vit.layers.0.mlp.dense_h_to_4h0.weight",
                                        NULL};
    expect(LLAMA, "model.layers.0.mlp.fc1.weight", "llama/", NULL);
    expect(LLAMA, "model.vision_tower.layers.0.mlp.fc10.weight", "hunyuan_vl/hunyuan_vl_text", NULL);
    /* A name no rename applies to. */
    expect(GEMMA3, "transformer.h.0.attn.c_attn.weight", gemma3, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_saved_forms_of_runtime_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
