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
    /* The model types (config.json's, or its text_config's) whose conversion
     * makes it, space-separated; NULL: a leading name no text model holds. */
    const char *types;
};

/* Of the name's beginning. */
static const struct rename SAVED_PREFIXES[] = {
    /* llava and the types that take its conversion: aria, aya_vision, fuyu,
     * gemma3, got_ocr2, internvl, llava_next (and its video and onevision
     * forms), mistral3, mllama, paligemma, video_llava, vipllava; audio
     * ones (audioflamingo3, glmasr, qwen2_audio's) too. */
    {"model.language_model.", "language_model.model.", 0, NULL},
    {"lm_head.", "language_model.lm_head.", 0, NULL},
    {"model.vision_tower.", "vision_tower.", 0, NULL},
    {"model.multi_modal_projector.", "multi_modal_projector.", 0, NULL},
    {"model.audio_tower.", "audio_tower.", 0, NULL},
    {"model.image_tower.", "image_tower.", 0, NULL},
    {"model.video_tower.", "video_tower.", 0, NULL},
    {"model.vision_embed_tokens.", "vision_embed_tokens.", 0, NULL},
    {"model.vision_model.", "vision_model.", 0, NULL},
    /* emu3: its text model saved as a causal LM under text_model, its VQ-VAE. */
    {"model.text_model.", "text_model.model.", 0, NULL},
    {"lm_head.", "text_model.lm_head.", 0, NULL},
    {"model.vqmodel.", "vqmodel.", 0, NULL},
    {"model.text_model.", "text_model.", 0, NULL},
    /* vibevoice_asr */
    {"model.acoustic_tokenizer_encoder.", "acoustic_tokenizer_encoder.", 0, NULL},
    {"model.semantic_tokenizer_encoder.", "semantic_tokenizer_encoder.", 0, NULL},
    /* Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni's thinker, PaddleOCR-VL, HunyuanVL. */
    {"model.language_model.", "model.", 1, NULL},
    {"model.visual.", "visual.", 0, NULL},
    {"model.vision_tower.", "vit.", 0, NULL},
    {"model.projector.", "mlp_AR.", 0, NULL},
    /* granite_speech */
    {"model.encoder.", "encoder.", 0, NULL},
    {"model.projector.", "projector.", 0, NULL},
    /* cosmos3_edge: the text model at the top (embed_tokens, layers, norm). */
    {"model.language_model.", "", 1, "cosmos3_edge"},
};

/* Of a part inside the name (its first occurrence), each only for the types
 * whose checkpoints have it: a plain model's own names must not be taken
 * for another's (a Llama's mlp.up_proj for Cosmos3-Edge's mlp.fc1). */
static const struct rename SAVED_INFIXES[] = {
    /* gemma4_unified's vision embedder */
    {".embed_vision.patch_", ".vision_embedder.patch_", 0, "gemma4_unified"},
    {".embed_vision.pos_", ".vision_embedder.pos_", 0, "gemma4_unified"},
    {".embed_vision.multimodal_embedder.embedding_projection.", ".embed_vision.embedding_projection.", 0,
     "gemma4_unified"},
    /* lfm3's attention gate, lfm3_vl's vision tower */
    {".self_attn.g_proj.", ".self_attn.gate_proj.", 0, "lfm3 lfm3_vl"},
    {".patch_embed.", ".patchifier.", 0, "lfm3_vl"},
    {".q_norm.", ".q_layernorm.", 0, "lfm3_vl"},
    {".k_norm.", ".k_layernorm.", 0, "lfm3_vl"},
    /* hunyuan_vl's vision MLP and patch merger */
    {".mlp.fc1.", ".mlp.dense_h_to_4h.", 0, "hunyuan_vl"},
    {".mlp.fc2.", ".mlp.dense_4h_to_h.", 0, "hunyuan_vl"},
    {".patch_merger.proj_conv.", ".perceive.proj.0.", 0, "hunyuan_vl"},
    {".patch_merger.proj_out.", ".perceive.proj.2.", 0, "hunyuan_vl"},
    {".patch_merger.", ".perceive.", 0, "hunyuan_vl"},
    /* cosmos3_edge's projections */
    {".self_attn.q_proj.", ".self_attn.to_q.", 0, "cosmos3_edge"},
    {".self_attn.k_proj.", ".self_attn.to_k.", 0, "cosmos3_edge"},
    {".self_attn.v_proj.", ".self_attn.to_v.", 0, "cosmos3_edge"},
    {".self_attn.o_proj.", ".self_attn.to_out.", 0, "cosmos3_edge"},
    {".mlp.fc1.", ".mlp.up_proj.", 0, "cosmos3_edge"},
    {".mlp.fc2.", ".mlp.down_proj.", 0, "cosmos3_edge"},
};

#define NPREFIXES (sizeof SAVED_PREFIXES / sizeof *SAVED_PREFIXES)
#define NINFIXES (sizeof SAVED_INFIXES / sizeof *SAVED_INFIXES)

/* Whether rename x is the base's: of one of its model types, or of any. */
static int for_types(const struct rename *x, const struct saved_name_model *model)
{
    if (x->multimodal_only && !model->text_model_type)
        return 0;
    if (!x->types)
        return 1;
    const char *const mine[2] = {model->model_type, model->text_model_type};
    for (int i = 0; i < 2; i++) {
        size_t n = mine[i] ? strlen(mine[i]) : 0;
        for (const char *t = x->types; n && (t = strstr(t, mine[i])) != NULL; t += n)
            if ((t == x->types || t[-1] == ' ') && (t[n] == ' ' || t[n] == '\0'))
                return 1;
    }
    return 0;
}

/* `name` with its prefix renamed by p (or not, p = NPREFIXES), then a part
 * of that by r (or not, r = NINFIXES): allocated; *none where a rename does
 * not apply. */
static char *renamed(const char *name, size_t p, size_t r, const struct saved_name_model *model, int *none)
{
    *none = 0;
    const char *rest = name, *head = "";
    if (p < NPREFIXES) {
        const struct rename *x = &SAVED_PREFIXES[p];
        size_t k = strlen(x->runtime);
        if (strncmp(name, x->runtime, k) != 0 || !for_types(x, model)) {
            *none = 1;
            return NULL;
        }
        head = x->saved;
        rest = name + k;
    }
    if (r < NINFIXES && !for_types(&SAVED_INFIXES[r], model)) {
        *none = 1;
        return NULL;
    }
    size_t len = strlen(head) + strlen(rest) + 1;
    char *whole = malloc(len);
    if (!whole)
        return NULL;
    snprintf(whole, len, "%s%s", head, rest);
    if (r == NINFIXES)
        return whole;
    const char *from = SAVED_INFIXES[r].runtime, *to = SAVED_INFIXES[r].saved, *at = strstr(whole, from);
    if (!at) {
        free(whole);
        *none = 1;
        return NULL;
    }
    len = strlen(whole) - strlen(from) + strlen(to) + 1;
    char *out = malloc(len);
    if (out)
        snprintf(out, len, "%.*s%s%s", (int)(at - whole), whole, to, at + strlen(from));
    free(whole);
    return out;
}

int saved_name_find(const char *name, const struct saved_name_model *model, saved_name_exists exists, const void *ctx,
                    char **saved)
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
                char *candidate = renamed(name, p, r, model, &none);
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
