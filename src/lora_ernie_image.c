#include "lora_ernie_image.h"

#include "lora_rewrite.h"
#include "status.h"

#define ERNIE_PEFT "base_model.model."
#define ERNIE_AI_TOOLKIT "diffusion_model."
#define ERNIE_TARGET "transformer."

int ernie_image_lora_detect(const struct model *w)
{
    return lora_model_any_key_starting(w, ERNIE_PEFT) || lora_model_any_key_starting(w, ERNIE_AI_TOOLKIT);
}

/* Each step runs where a key starts with its prefix, and renames every
 * occurrence in every key. */
static int rename_keys(const char *path, struct lora_key *keys, size_t n, const void *how)
{
    (void)how;
    int code = NF4_OK;
    if (lora_keys_any_start(keys, n, ERNIE_PEFT))
        code = lora_keys_replace(path, keys, n, ERNIE_PEFT, ERNIE_AI_TOOLKIT);
    if (code == NF4_OK && lora_keys_any_start(keys, n, ERNIE_AI_TOOLKIT))
        code = lora_keys_replace(path, keys, n, ERNIE_AI_TOOLKIT, ERNIE_TARGET);
    return code;
}

int ernie_image_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return lora_rewrite_renamed(w, path, warn, rename_keys, NULL, "", out); /* the names are whole */
}
