#include "lora_anima.h"

#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "strbuf.h"
#include "strutil.h"

#define ANIMA_COMFY "diffusion_model."
#define ANIMA_ADAPTER "llm_adapter."
#define ANIMA_CONDITIONER "text_conditioner."
#define ANIMA_TARGET "transformer."

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* _convert_non_diffusers_anima_lora_to_diffusers' rename_dict, in its order:
 * each replaces every occurrence in the key as the earlier ones left it. */
static const char *const RENAMES[][2] = {
    {"blocks.", "transformer_blocks."},
    {"adaln_modulation_self_attn.1", "norm1.linear_1"},
    {"adaln_modulation_self_attn.2", "norm1.linear_2"},
    {"adaln_modulation_cross_attn.1", "norm2.linear_1"},
    {"adaln_modulation_cross_attn.2", "norm2.linear_2"},
    {"adaln_modulation_mlp.1", "norm3.linear_1"},
    {"adaln_modulation_mlp.2", "norm3.linear_2"},
    {"self_attn.q_proj", "attn1.to_q"},
    {"self_attn.k_proj", "attn1.to_k"},
    {"self_attn.v_proj", "attn1.to_v"},
    {"self_attn.output_proj", "attn1.to_out.0"},
    {"cross_attn.q_proj", "attn2.to_q"},
    {"cross_attn.k_proj", "attn2.to_k"},
    {"cross_attn.v_proj", "attn2.to_v"},
    {"cross_attn.output_proj", "attn2.to_out.0"},
    {"mlp.layer1", "ff.net.0.proj"},
    {"mlp.layer2", "ff.net.2"},
    {"final_layer.adaln_modulation.1", "norm_out.linear_1"},
    {"final_layer.adaln_modulation.2", "norm_out.linear_2"},
    {"final_layer.linear", "proj_out"},
    {"t_embedder.1", "time_embed.t_embedder"},
    {"t_embedding_norm", "time_embed.norm"},
    {"x_embedder.proj.1", "patch_embed.proj"},
};

int anima_lora_detect(const struct model *w)
{
    return lora_model_any_key_starting(w, ANIMA_COMFY);
}

/* One key's name as diffusers converts it (allocated; NULL when out of
 * memory). */
static char *anima_name(const char *key)
{
    if (!str_starts_with(key, ANIMA_COMFY))
        return strdup(key);
    const char *rest = key + strlen(ANIMA_COMFY);
    if (str_starts_with(rest, ANIMA_ADAPTER))
        return str_concat(ANIMA_CONDITIONER, rest + strlen(ANIMA_ADAPTER));
    char *renamed = str_replace_in_turn(rest, RENAMES, COUNT(RENAMES));
    char *name = renamed ? str_concat(ANIMA_TARGET, renamed) : NULL;
    free(renamed);
    return name;
}

static int rename_keys(const char *path, struct lora_key *keys, size_t n, const void *how)
{
    (void)how;
    return lora_keys_rename(path, keys, n, anima_name);
}

int anima_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return lora_rewrite_renamed(w, path, warn, rename_keys, NULL, "", out); /* the names are whole */
}
