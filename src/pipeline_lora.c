#include "pipeline_lora.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "lora.h"
#include "lora_diffusers.h"
#include "status.h"
#include "strutil.h"

/* A pipeline takes diffusers LoRAs only, whose keys name their components
 * (transformer.<module>...): a PEFT adapter is one model's. */
int pipeline_loras_check(const char *in, const char *const *args, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char *file = NULL;
        struct stat st;
        if (stat(args[i], &st) != 0)
            return nf4_fail_errno(NF4_ENOINPUT, errno, args[i], NULL, "cannot open");
        int code = diffusers_lora_path(args[i], &file, 1), diffusers = file != NULL;
        free(file);
        if (code != NF4_OK)
            return code;
        if (diffusers)
            continue;
        char *config = path_join(args[i], ADAPTER_CONFIG_NAME);
        int peft = config && lstat(config, &st) == 0;
        free(config);
        if (peft)
            return nf4_fail(NF4_EUSAGE, in, NULL, "is a diffusers pipeline, and %s is a PEFT adapter, which merges "
                            "into one model: give IN the component's directory (such as %s/transformer)",
                            args[i], in);
        return nf4_fail(NF4_ENOINPUT, args[i], NULL, "is neither a PEFT adapter (%s) nor a diffusers LoRA (%s, "
                        "or one *.safetensors file)", ADAPTER_CONFIG_NAME, DIFFUSERS_LORA_NAME);
    }
    return NF4_OK;
}

/* Whether diffusers' LoRA loader for a pipeline of class `cls`
 * (model_index.json's _class_name) loads a LoRA's keys into `component`: its
 * _lora_loadable_modules (diffusers 0.42, loaders/lora_pipeline.py). Every
 * loader takes the denoiser; the text encoders only Stable Diffusion's (1.x,
 * XL and 3, the last two the second encoder too) and Flux.1's. */
static int diffusers_loads(const char *cls, const char *component)
{
    if (strcmp(component, "transformer") == 0 || strcmp(component, "unet") == 0)
        return 1;
    int sdxl_sd3 = cls && (strncmp(cls, "StableDiffusionXL", 17) == 0 || strncmp(cls, "StableDiffusion3", 16) == 0);
    int one_encoder = cls && ((strncmp(cls, "StableDiffusion", 15) == 0) ||
                              (strncmp(cls, "Flux", 4) == 0 && !(cls[4] >= '0' && cls[4] <= '9')));
    if (strcmp(component, "text_encoder") == 0)
        return one_encoder || sdxl_sd3;
    return strcmp(component, "text_encoder_2") == 0 && sdxl_sd3;
}

int pipeline_loras_open(const char *in, const char *const *args, size_t n, const struct pipeline_entry *e,
                        size_t ne, struct pipeline_loras *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->args = args;
    if (!n)
        return NF4_OK;
    size_t ncomp = 0;
    const char **components = calloc(ne ? ne : 1, sizeof *components);
    pl->weights = calloc(n, sizeof *pl->weights);
    pl->cls = diffusers_class_name(in, PIPELINE_INDEX_NAME);
    int code = components && pl->weights ? NF4_OK : nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    for (size_t i = 0; i < ne && code == NF4_OK; i++)
        if (e[i].kind == ENTRY_COMPONENT && diffusers_loads(pl->cls, e[i].name))
            components[ncomp++] = e[i].name;
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        char *file = NULL;
        if ((code = diffusers_lora_path(args[i], &file, 0)) == NF4_OK && !file)
            code = nf4_fail(NF4_ESOFTWARE, args[i], NULL, "not a diffusers LoRA (internal error)");
        if (code == NF4_OK && (code = diffusers_lora_open(file, diffusers_lora_family(pl->cls), 1, &pl->weights[i])) == NF4_OK)
            code = diffusers_lora_check_components(pl->weights[i], components, ncomp);
        pl->n = i + 1;
        free(file);
    }
    free(components);
    return code;
}

int component_loras_init(struct component_loras *cl, const struct pipeline_loras *pl, const char *in)
{
    memset(cl, 0, sizeof *cl);
    cl->dirs = calloc(pl->n ? pl->n : 1, sizeof *cl->dirs);
    cl->converted = calloc(pl->n ? pl->n : 1, sizeof *cl->converted);
    return cl->dirs && cl->converted ? NF4_OK : nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
}

void component_loras_free(struct component_loras *cl)
{
    free(cl->dirs);
    free(cl->converted);
    memset(cl, 0, sizeof *cl);
}

void pipeline_loras_for(const struct pipeline_loras *pl, const char *component, struct component_loras *cl)
{
    cl->component = component;
    cl->n = 0;
    for (size_t k = 0; k < pl->n && diffusers_loads(pl->cls, component); k++)
        if (diffusers_lora_keys_for(pl->weights[k], component)) {
            cl->dirs[cl->n] = pl->args[k];
            cl->converted[cl->n++] = pl->weights[k]->unnamed ? pl->weights[k] : NULL;
        }
}

void pipeline_loras_close(struct pipeline_loras *pl)
{
    for (size_t i = 0; i < pl->n; i++)
        if (pl->weights[i])
            model_close(pl->weights[i]);
    free(pl->weights);
    free(pl->cls);
    memset(pl, 0, sizeof *pl);
}
