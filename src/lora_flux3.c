#include "lora_flux3.h"

#include <string.h>

#include "lora_rewrite.h"

#define FLUX3_COMFY "diffusion_model."
#define FLUX3_TARGET "transformer."

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* _convert_non_diffusers_flux3_lora_to_diffusers' replacements, in its
 * order: the blocks' names, then block_mapping's. */
static const char *const RENAMES[][2] = {
    {"content_mode_blocks.", "mode_blocks."},
    {"single_blocks.", "single_transformer_blocks."},
    {".q_proj.", ".attn.to_q."},
    {".k_proj.", ".attn.to_k."},
    {".v_proj.", ".attn.to_v."},
    {".attn_out.", ".attn.to_out.0."},
    {".mlp_in.", ".ff.linear_in."},
    {".mlp_out.", ".ff.linear_out."},
};

int flux3_lora_detect(const struct model *w)
{
    return lora_model_any_key_starting(w, FLUX3_COMFY);
}

int flux3_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    static const struct lora_rename_chain CHAIN = {FLUX3_COMFY, RENAMES, COUNT(RENAMES)};
    return lora_rewrite_renamed(w, path, warn, lora_keys_rename_chain, &CHAIN, FLUX3_TARGET, out);
}
