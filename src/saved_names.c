#include "saved_names.h"

#include <stdlib.h>
#include <string.h>

#include "status.h"

/* transformers 5.24's renames of a checkpoint's leading names on load
 * (conversion_mapping.py), the other way round: the prefix a model runs
 * with, and the one its checkpoint holds. Each is tried in order, and
 * only a name the base holds is taken, so one that belongs to another
 * model type never is. Renames inside a module's name (HunyuanVL's vision
 * MLP, Gemma 4's vision embedder, LFM3-VL's attention gate, Cosmos3-Edge's
 * projections) are not here: a LoRA on those is refused as matching no
 * tensor. */
static const struct {
    const char *runtime, *saved;
    int multimodal_only; /* the saved prefix is a text model's own */
} SAVED_PREFIXES[] = {
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
};

int saved_name_find(const char *name, int multimodal, saved_name_exists exists, const void *ctx, char **saved)
{
    *saved = NULL;
    for (size_t i = 0; i < sizeof SAVED_PREFIXES / sizeof *SAVED_PREFIXES; i++) {
        size_t k = strlen(SAVED_PREFIXES[i].runtime);
        /* A plain text model holds model.* too: an adapter made for the
         * multimodal one (model.language_model.*) is not for it, and PEFT
         * would leave it out there. */
        if (strncmp(name, SAVED_PREFIXES[i].runtime, k) != 0 || (SAVED_PREFIXES[i].multimodal_only && !multimodal))
            continue;
        size_t len = strlen(SAVED_PREFIXES[i].saved) + strlen(name + k) + 1;
        char *candidate = malloc(len);
        if (!candidate)
            return NF4_ESOFTWARE;
        strcpy(candidate, SAVED_PREFIXES[i].saved);
        strcat(candidate, name + k);
        if (exists(ctx, candidate)) {
            *saved = candidate;
            return NF4_OK;
        }
        free(candidate);
    }
    return NF4_OK;
}
