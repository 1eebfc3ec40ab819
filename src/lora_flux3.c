#include "lora_flux3.h"

#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strutil.h"

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

static int starts_flux3_form(const char *key)
{
    return str_starts_with(key, FLUX3_COMFY);
}

int flux3_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, starts_flux3_form);
}

int flux3_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct lora_rewrite rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta};
    lora_rewrite_leave_out_dora(&rw, w); /* dropped before the conversion, with a warning */
    struct lora_key *keys = NULL;
    size_t n = 0;
    int code = lora_keys_of(path, w, lora_is_dora_scale, &keys, &n);
    if (code == NF4_OK)
        lora_keys_remove_prefix(keys, n, FLUX3_COMFY);
    for (size_t r = 0; r < COUNT(RENAMES) && code == NF4_OK; r++)
        code = lora_keys_replace(path, keys, n, RENAMES[r][0], RENAMES[r][1]);
    if (code == NF4_OK) {
        lora_keys_sort(keys, n);
        code = lora_keys_check_distinct(path, keys, n); /* diffusers' dict keeps one of them */
    }
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        code = lora_rewrite_add_copy(&rw, FLUX3_TARGET, keys[i].name, keys[i].t);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&rw);
    code = lora_rewrite_finish(&rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(keys, n);
    return code;
}
