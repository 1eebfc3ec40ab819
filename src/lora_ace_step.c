#include "lora_ace_step.h"

#include <string.h>

#include "lora_rewrite.h"

#define ACE_STEP_PEFT "base_model.model."
#define ACE_STEP_TARGET "transformer."

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* _convert_non_diffusers_ace_step_lora_to_diffusers' _PROJ_RENAMES, in its
 * order. */
static const char *const RENAMES[][2] = {
    {".q_proj.", ".to_q."},
    {".k_proj.", ".to_k."},
    {".v_proj.", ".to_v."},
    {".o_proj.", ".to_out.0."},
};

/* is_original_ace_step: the test is on the whole key, dots or not. */
static int names_original_projection(const char *key)
{
    return strstr(key, "q_proj") != NULL || strstr(key, "k_proj") != NULL;
}

int ace_step_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, names_original_projection);
}

int ace_step_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    static const struct lora_rename_chain CHAIN = {ACE_STEP_PEFT, RENAMES, COUNT(RENAMES)};
    return lora_rewrite_renamed(w, path, warn, lora_keys_rename_chain, &CHAIN, ACE_STEP_TARGET, out);
}
