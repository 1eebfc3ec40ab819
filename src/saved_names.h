/* The names transformers 5 saves a model's tensors under, where they are not
 * the names the model runs with: on load it renames a checkpoint's older
 * layout (its conversion_mapping.py), and on save it renames back, so that a
 * llava-form multimodal model's checkpoint (Gemma 3, PaliGemma, Mistral 3,
 * LLaVA, InternVL, ...) holds language_model.model.* and
 * language_model.lm_head where the model runs model.language_model.* and
 * lm_head, and Qwen2-VL's holds model.* and visual.* for
 * model.language_model.* and model.visual.*. A PEFT adapter names the
 * modules as they run; these are the names to look for in the base. Some
 * types rename inside names too (Gemma 4's vision embedder, LFM3's attention
 * gate, HunyuanVL's vision MLP, Cosmos3-Edge's projections). */
#ifndef NF4DEQ_SAVED_NAMES_H
#define NF4DEQ_SAVED_NAMES_H

/* Whether the base holds tensor `name` (a saved name). */
typedef int (*saved_name_exists)(const void *ctx, const char *name);

/* The base's config.json: its model_type and its text_config's (NULL where
 * there is none; a text_config's is what says the model is multimodal). */
struct saved_name_model {
    const char *model_type, *text_model_type;
};

/* *saved: the first saved form of runtime tensor `name` that `exists` finds,
 * allocated; NULL where none is (or `name` has none). The forms that a text
 * model's own names could be taken for (Qwen2-VL's model.*, the renames
 * inside names) are tried only for the model types whose conversion makes
 * them. NF4_OK, or NF4_ESOFTWARE when memory runs out (the caller names what
 * for). */
int saved_name_find(const char *name, const struct saved_name_model *model, saved_name_exists exists, const void *ctx,
                    char **saved);

#endif
