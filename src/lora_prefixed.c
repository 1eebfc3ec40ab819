#include "lora_prefixed.h"

#include <string.h>

#include "lora_rewrite.h"
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
