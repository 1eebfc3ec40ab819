#include "saved_names.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

/* transformers 5.24's renames of a checkpoint's names on load
 * (conversion_mapping.py), the other way round: a part of the name a model
 * runs with, and the one its checkpoint holds. A name is tried with each
 * leading rename (or none), then each inner one (or none), and only a name
 * the base holds is taken, so a rename of another model type is never
 * taken. */
struct rename {
    const char *runtime, *saved;
    int multimodal_only; /* the saved form is what a text model holds of its own */
};

/* Of the name's beginning. */
static const struct rename SAVED_PREFIXES[] = {
    /* llava and the types that take its conversion: aria, aya_vision, fuyu,
     * gemma3, got_ocr2, internvl, llava_next (and its video and onevision
     * forms), mistral3, mllama, paligemma, video_llava, vipllava; audio
     * ones (audioflamingo3, glmasr, qwen2_audio's) too. */
    {"model.language_model.", "language_model.model.", 0},
    {"lm_head.", "language_model.lm_head.", 0},
    {"model.vision_tower.", "vision_tower.", 0},
    {"model.multi_modal_projector.", "multi_modal_projector.", 0},
    {"model.audio_tower.", "audio_tower.", 0},
    {"model.image_tower.", "image_tower.", 0},
    {"model.video_tower.", "video_tower.", 0},
    {"model.vision_embed_tokens.", "vision_embed_tokens.", 0},
    {"model.vision_model.", "vision_model.", 0},
    /* emu3: its text model saved as a causal LM under text_model, its VQ-VAE. */
    {"model.text_model.", "text_model.model.", 0},
    {"lm_head.", "text_model.lm_head.", 0},
    {"model.vqmodel.", "vqmodel.", 0},
    {"model.text_model.", "text_model.", 0},
    /* vibevoice_asr */
    {"model.acoustic_tokenizer_encoder.", "acoustic_tokenizer_encoder.", 0},
    {"model.semantic_tokenizer_encoder.", "semantic_tokenizer_encoder.", 0},
    /* Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni's thinker, PaddleOCR-VL, HunyuanVL. */
    {"model.language_model.", "model.", 1},
    {"model.visual.", "visual.", 0},
    {"model.vision_tower.", "vit.", 0},
    {"model.projector.", "mlp_AR.", 0},
    /* granite_speech */
    {"model.encoder.", "encoder.", 0},
    {"model.projector.", "projector.", 0},
    /* cosmos3_edge: the text model at the top (embed_tokens, layers, norm). */
    {"model.language_model.", "", 1},
};

/* Of a part inside the name (its first occurrence). */
static const struct rename SAVED_INFIXES[] = {
    /* gemma4_unified's vision embedder */
    {"embed_vision.patch_", "vision_embedder.patch_", 0},
    {"embed_vision.pos_", "vision_embedder.pos_", 0},
    {"embed_vision.multimodal_embedder.embedding_projection", "embed_vision.embedding_projection", 0},
    /* lfm3's attention gate, lfm3_vl's vision tower */
    {".self_attn.g_proj.", ".self_attn.gate_proj.", 0},
    {".patch_embed.", ".patchifier.", 0},
    {".q_norm.", ".q_layernorm.", 0},
    {".k_norm.", ".k_layernorm.", 0},
    /* hunyuan_vl's vision MLP and patch merger */
    {"mlp.fc1", "mlp.dense_h_to_4h", 0},
    {"mlp.fc2", "mlp.dense_4h_to_h", 0},
    {"patch_merger.proj_conv.", "perceive.proj.0.", 0},
    {"patch_merger.proj_out.", "perceive.proj.2.", 0},
    {"patch_merger.", "perceive.", 0},
    /* cosmos3_edge's projections */
    {".self_attn.q_proj.", ".self_attn.to_q.", 0},
    {".self_attn.k_proj.", ".self_attn.to_k.", 0},
    {".self_attn.v_proj.", ".self_attn.to_v.", 0},
    {".self_attn.o_proj.", ".self_attn.to_out.", 0},
    {".mlp.fc1.", ".mlp.up_proj.", 0},
    {".mlp.fc2.", ".mlp.down_proj.", 0},
};

#define NPREFIXES (sizeof SAVED_PREFIXES / sizeof *SAVED_PREFIXES)
#define NINFIXES (sizeof SAVED_INFIXES / sizeof *SAVED_INFIXES)

/* `name` with its prefix renamed by p (or not, p = NPREFIXES) and a part by
 * r (or not, r = NINFIXES): allocated; *none where a rename does not apply. */
static char *renamed(const char *name, size_t p, size_t r, int multimodal, int *none)
{
    *none = 0;
    const char *rest = name, *head = "";
    if (p < NPREFIXES) {
        const struct rename *x = &SAVED_PREFIXES[p];
        size_t k = strlen(x->runtime);
        if (strncmp(name, x->runtime, k) != 0 || (x->multimodal_only && !multimodal)) {
            *none = 1;
            return NULL;
        }
        head = x->saved;
        rest = name + k;
    }
    const char *at = NULL, *from = "", *to = "";
    if (r < NINFIXES) {
        from = SAVED_INFIXES[r].runtime;
        to = SAVED_INFIXES[r].saved;
        if (!(at = strstr(rest, from))) {
            *none = 1;
            return NULL;
        }
    }
    size_t before = at ? (size_t)(at - rest) : strlen(rest);
    size_t len = strlen(head) + strlen(rest) - strlen(from) + strlen(to) + 1;
    char *out = malloc(len);
    if (out)
        snprintf(out, len, "%s%.*s%s%s", head, (int)before, rest, to, at ? at + strlen(from) : "");
    return out;
}

int saved_name_find(const char *name, int multimodal, saved_name_exists exists, const void *ctx, char **saved)
{
    *saved = NULL;
    /* Fewest renames first: a leading one alone, an inner one alone, both.
     * (A plain text model holds model.*, and a headless one layers.*, too:
     * an adapter made for the multimodal one, model.language_model.*, is not
     * for it, and PEFT would leave it out there: multimodal_only.) */
    for (int pass = 0; pass < 3; pass++)
        for (size_t p = 0; p <= NPREFIXES; p++)
            for (size_t r = 0; r <= NINFIXES; r++) {
                if ((p < NPREFIXES) + (r < NINFIXES) != (pass == 2 ? 2 : 1) ||
                    (pass == 0 && p == NPREFIXES) || (pass == 1 && r == NINFIXES))
                    continue;
                int none;
                char *candidate = renamed(name, p, r, multimodal, &none);
                if (none)
                    continue;
                if (!candidate)
                    return NF4_ESOFTWARE;
                if (exists(ctx, candidate)) {
                    *saved = candidate;
                    return NF4_OK;
                }
                free(candidate);
            }
    return NF4_OK;
}
