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

static void expect(const char *const *base, const char *name, int multimodal, const char *want)
{
    char *got = NULL;
    assert_int_equal(saved_name_find(name, multimodal, holds, base, &got), NF4_OK);
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
    expect(GEMMA3, "model.language_model.layers.0.self_attn.q_proj.weight", 1,
           "language_model.model.layers.0.self_attn.q_proj.weight");
    expect(GEMMA3, "lm_head.weight", 1, "language_model.lm_head.weight");
    expect(GEMMA3, "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight", 1,
           "vision_tower.encoder.layers.0.self_attn.q_proj.weight");
    expect(GEMMA3, "model.language_model.layers.1.self_attn.q_proj.weight", 1, NULL); /* not in the base */
    static const char *const QWEN2VL[] = {"model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight",
                                          NULL};
    expect(QWEN2VL, "model.language_model.layers.0.self_attn.q_proj.weight", 1,
           "model.layers.0.self_attn.q_proj.weight");
    expect(QWEN2VL, "model.visual.blocks.0.attn.qkv.weight", 1, "visual.blocks.0.attn.qkv.weight");
    /* A plain Llama holds model.layers.* too: the multimodal form is not its. */
    expect(QWEN2VL, "model.language_model.layers.0.self_attn.q_proj.weight", 0, NULL);
    /* Renames inside the name, alone and after a leading one. */
    static const char *const INNER[] = {"model.vision_embedder.patch_dense.weight",
                                        "model.embed_vision.embedding_projection.weight",
                                        "model.language_model.layers.0.self_attn.gate_proj.weight",
                                        "vit.layers.0.mlp.dense_h_to_4h.weight",
                                        "vit.perceive.proj.0.weight",
                                        "layers.0.self_attn.to_q.weight",
                                        "layers.0.mlp.up_proj.weight", "model.vision_tower.patchifier.weight", NULL};
    expect(INNER, "model.embed_vision.patch_dense.weight", 1, "model.vision_embedder.patch_dense.weight");
    expect(INNER, "model.embed_vision.multimodal_embedder.embedding_projection.weight", 1,
           "model.embed_vision.embedding_projection.weight");
    expect(INNER, "model.language_model.layers.0.self_attn.g_proj.weight", 1,
           "model.language_model.layers.0.self_attn.gate_proj.weight");
    expect(INNER, "model.vision_tower.layers.0.mlp.fc1.weight", 1, "vit.layers.0.mlp.dense_h_to_4h.weight");
    expect(INNER, "model.vision_tower.patch_embed.weight", 1, "model.vision_tower.patchifier.weight");
    expect(INNER, "model.vision_tower.patch_merger.proj_conv.weight", 1, "vit.perceive.proj.0.weight");
    expect(INNER, "model.language_model.layers.0.self_attn.q_proj.weight", 1, "layers.0.self_attn.to_q.weight");
    expect(INNER, "model.language_model.layers.0.mlp.fc1.weight", 1, "layers.0.mlp.up_proj.weight");
    /* ... and not for a text model's own top-level layers.* */
    expect(INNER, "model.language_model.layers.0.self_attn.q_proj.weight", 0, NULL);
    /* A name no rename applies to. */
    expect(GEMMA3, "transformer.h.0.attn.c_attn.weight", 1, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_saved_forms_of_runtime_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
