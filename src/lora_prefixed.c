#include "lora_prefixed.h"

#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "strbuf.h"
#include "status.h"
#include "strutil.h"

#define COMFY_PREFIX "diffusion_model"

/* The loader's test for its ComfyUI form, and what every key must then start with. */
static const char *required_prefix(enum lora_family family)
{
    return family == LORA_FAMILY_HIDREAM ? COMFY_PREFIX : COMFY_PREFIX ".";
}

static int in_comfy_form(const char *name, enum lora_family family)
{
    return family == LORA_FAMILY_HIDREAM ? strstr(name, COMFY_PREFIX) != NULL : str_starts_with(name, COMFY_PREFIX ".");
}

int prefixed_lora_detect(const struct model *w, enum lora_family family)
{
    for (size_t i = 0; i < w->count; i++) {
        const char *name = w->tensors[i].t->name;
        if (!lora_is_dora_scale(name) && in_comfy_form(name, family))
            return 1;
    }
    return 0;
}

static int prefixed_lora_convert(const struct model *w, const char *path, enum lora_family family, int warn,
                                 struct model **out)
{
    *out = NULL;
    struct lora_rewrite rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta};
    int code = NF4_OK;
    for (size_t i = 0; i < w->count && code == NF4_OK; i++) {
        const struct model_tensor *t = &w->tensors[i];
        const char *name = t->t->name;
        if (lora_is_dora_scale(name)) { /* dropped before the conversion, with a warning */
            lora_rewrite_leave_out(&rw, name, strlen(name), 1);
            continue;
        }
        if (!str_starts_with(name, required_prefix(family))) {
            code = nf4_fail(NF4_EDATA, path, name, "does not start with \"%s\", as every key of %s LoRA in "
                            "ComfyUI's form must (diffusers raises)", required_prefix(family),
                            family == LORA_FAMILY_HIDREAM ? "a HiDream" : "an LTX-Video");
            break;
        }
        const char *rest = str_starts_with(name, COMFY_PREFIX ".") ? name + strlen(COMFY_PREFIX ".") : name;
        code = lora_rewrite_add_copy(&rw, "transformer.", rest, t);
    }
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&rw);
    return lora_rewrite_finish(&rw, code, warn, "are DoRA scales, which diffusers drops", out);
}

int ltx_video_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return prefixed_lora_convert(w, path, LORA_FAMILY_LTX_VIDEO, warn, out);
}

int hidream_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    return prefixed_lora_convert(w, path, LORA_FAMILY_HIDREAM, warn, out);
}

/* ---- LTX-2 ---- */

#define LTX2_CONNECTOR_PREFIX "text_embedding_projection."

/* diffusers' rename_dict for the transformer's keys, applied in its order. */
static const char *const LTX2_TRANSFORMER_RENAMES[][2] = {
    {"patchify_proj", "proj_in"},
    {"audio_patchify_proj", "audio_proj_in"},
    {"av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"},
    {"av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"},
    {"av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"},
    {"av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"},
    {"scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"},
    {"scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"},
    {"q_norm", "norm_q"},
    {"k_norm", "norm_k"},
    {"audio_prompt_adaln_single", "audio_prompt_adaln"},
    {"prompt_adaln_single", "prompt_adaln"},
};

static const char *const LTX2_CONNECTOR_RENAMES[][2] = {
    {"aggregate_embed", "text_proj_in"},
};

static int starts_with_comfy(const char *name)
{
    return str_starts_with(name, COMFY_PREFIX ".");
}

static int starts_with_connector(const char *name)
{
    return str_starts_with(name, LTX2_CONNECTOR_PREFIX);
}

int ltx2_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, starts_with_comfy) || lora_model_any_key(w, starts_with_connector);
}

/* `t` under `component` with its name less `prefix`, renamed as diffusers
 * renames it: `renames` in order, then a leading adaln_single. (or
 * audio_adaln_single.) made time_embed. (audio_time_embed.) wherever it is. */
static int ltx2_add(struct lora_rewrite *rw, const struct model_tensor *t, const char *prefix,
                    const char *const (*renames)[2], size_t nrenames, const char *component)
{
    char *name = str_replace_in_turn(t->t->name + strlen(prefix), renames, nrenames);
    static const char *const TIME_EMBEDS[][2] = {{"adaln_single.", "time_embed."},
                                                 {"audio_adaln_single.", "audio_time_embed."}};
    for (size_t i = 0; name && i < 2; i++)
        if (str_starts_with(name, TIME_EMBEDS[i][0])) {
            if (!str_replace_in(&name, TIME_EMBEDS[i][0], TIME_EMBEDS[i][1])) {
                free(name);
                name = NULL;
            }
            break;
        }
    int code = name ? lora_rewrite_add_copy(rw, component, name, t) : nf4_fail(NF4_ESOFTWARE, rw->path, NULL,
                                                                                 "out of memory");
    free(name);
    return code;
}

int ltx2_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct lora_rewrite rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta};
    const int comfy = lora_model_any_key(w, starts_with_comfy), connector = lora_model_any_key(w, starts_with_connector);
    int code = NF4_OK;
    for (size_t i = 0; i < w->count && code == NF4_OK; i++) {
        const struct model_tensor *t = &w->tensors[i];
        const char *name = t->t->name;
        if (lora_is_dora_scale(name)) /* dropped before the conversion, with a warning */
            lora_rewrite_leave_out(&rw, name, strlen(name), 1);
        else if (comfy && starts_with_comfy(name))
            code = ltx2_add(&rw, t, COMFY_PREFIX ".", LTX2_TRANSFORMER_RENAMES,
                            sizeof LTX2_TRANSFORMER_RENAMES / sizeof LTX2_TRANSFORMER_RENAMES[0], "transformer.");
        else if (!comfy) /* diffusers keeps the file's keys as they are */
            code = lora_rewrite_add_copy(&rw, "", name, t);
        else if (!(connector && starts_with_connector(name)))
            lora_rewrite_leave_out(&rw, name, strlen(name), 1);
        if (code == NF4_OK && connector && starts_with_connector(name) && !lora_is_dora_scale(name))
            code = ltx2_add(&rw, t, LTX2_CONNECTOR_PREFIX, LTX2_CONNECTOR_RENAMES,
                            sizeof LTX2_CONNECTOR_RENAMES / sizeof LTX2_CONNECTOR_RENAMES[0], "connectors.");
    }
    /* load_lora_weights: "Make sure all LoRA param names contain `'lora'` substring" */
    for (size_t i = 0; i < rw.nparts && code == NF4_OK; i++)
        if (!strstr(rw.parts[i].name, "lora"))
            code = nf4_fail(NF4_EDATA, path, rw.parts[i].src->t->name, "becomes %s, with no \"lora\" in its name, "
                            "which diffusers refuses", rw.parts[i].name);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&rw);
    return lora_rewrite_finish(&rw, code, warn,
                               comfy ? "are DoRA scales or keys without \"" COMFY_PREFIX ".\", which diffusers drops "
                                       "from an LTX-2 LoRA"
                                     : "are DoRA scales, which diffusers drops",
                               out);
}
