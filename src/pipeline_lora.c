#include "pipeline_lora.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "lora.h"
#include "lora_diffusers.h"
#include "lora_minimax_h3.h"
#include "modular_index.h"
#include "status.h"
#include "strutil.h"

const char *pipeline_lora_arg(const char *arg, size_t *component_len)
{
    struct stat st;
    size_t n = 0;
    *component_len = 0;
    if (lstat(arg, &st) == 0)
        return arg;
    while ((arg[n] >= 'a' && arg[n] <= 'z') || (arg[n] >= 'A' && arg[n] <= 'Z') || (arg[n] >= '0' && arg[n] <= '9') ||
           arg[n] == '_')
        n++;
    if (n == 0 || arg[n] != '=')
        return arg;
    *component_len = n;
    return arg + n + 1;
}

int pipeline_lora_refuse_components(const char *in, const char *const *args, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t len;
        struct stat st;
        const char *lora = pipeline_lora_arg(args[i], &len);
        /* Where LORA is not there either, the argument is a missing path (66, when it is opened). */
        if (len && stat(lora, &st) == 0)
            return nf4_fail(NF4_EUSAGE, in, NULL, "is not a diffusers pipeline, so --lora %s cannot name a component "
                            "(COMPONENT=LORA is for a pipeline)", args[i]);
    }
    return NF4_OK;
}

/* A pipeline takes diffusers LoRAs only, whose keys name their components
 * (transformer.<module>...): a PEFT adapter is one model's. */
int pipeline_loras_check(const char *in, const char *const *args, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char *file = NULL;
        struct stat st;
        size_t len;
        const char *lora = pipeline_lora_arg(args[i], &len);
        if (stat(lora, &st) != 0)
            return len ? nf4_fail_errno(NF4_ENOINPUT, errno, lora, NULL, "cannot open (the LoRA of --lora %s)", args[i])
                       : nf4_fail_errno(NF4_ENOINPUT, errno, lora, NULL, "cannot open");
        int code = diffusers_lora_path(lora, &file, 1), diffusers = file != NULL;
        free(file);
        if (code != NF4_OK)
            return code;
        if (diffusers)
            continue;
        char *config = path_join(lora, ADAPTER_CONFIG_NAME);
        int peft = config && lstat(config, &st) == 0;
        free(config);
        if (peft) {
            char *example = path_join(in, "transformer"); /* IN may end in a slash */
            code = nf4_fail(NF4_EUSAGE, in, NULL, "is a diffusers pipeline, and %s is a PEFT adapter, which merges "
                            "into one model: give IN the component's directory (such as %s); to merge its weights "
                            "as diffusers' load_lora_weights reads the folder (without its %s), give --lora a copy "
                            "of %s under another name", lora, example ? example : "IN/transformer",
                            ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME);
            free(example);
            return code;
        }
        return nf4_fail(NF4_ENOINPUT, lora, NULL, "is neither a PEFT adapter (%s) nor a diffusers LoRA (%s, "
                        "or one *.safetensors file)", ADAPTER_CONFIG_NAME, DIFFUSERS_LORA_NAME);
    }
    return NF4_OK;
}

/* Whether diffusers' LoRA loader for a pipeline of class `cls`
 * (its index's _class_name) loads a LoRA's keys into `component`: its
 * _lora_loadable_modules (diffusers 0.42, loaders/lora_pipeline.py). Every
 * loader takes the denoiser; the text encoders only Stable Diffusion's (the
 * pipelines of its two mixins, 1.x and XL with AnimateDiff, Kolors and their
 * kin, and 3; XL's and 3's the second encoder too) and Flux.1's; LTX-2's its
 * text connectors; Anima's its text conditioner; MiniMax-H3's its second
 * partition, transformer_ref. */
static int diffusers_loads(const char *cls, const char *component)
{
    if (strcmp(component, "transformer") == 0 || strcmp(component, "unet") == 0)
        return 1;
    if (strcmp(component, "connectors") == 0)
        return diffusers_lora_family(cls) == LORA_FAMILY_LTX2;
    if (strcmp(component, "text_conditioner") == 0)
        return diffusers_lora_family(cls) == LORA_FAMILY_ANIMA;
    if (strcmp(component, MINIMAX_H3_REF) == 0)
        return diffusers_lora_family(cls) == LORA_FAMILY_MINIMAX_H3;
    /* Stable Diffusion XL's loader and 3's load text_encoder_2 too; the
     * Stable Diffusion mixin's and Flux.1's one. */
    const int sdxl_sd3 = diffusers_loads_sdxl(cls) || (cls && strncmp(cls, "StableDiffusion3", 16) == 0);
    const enum lora_family family = diffusers_lora_family(cls);
    int one_encoder = family == LORA_FAMILY_STABLE_DIFFUSION || family == LORA_FAMILY_FLUX;
    if (strcmp(component, "text_encoder") == 0)
        return one_encoder || sdxl_sd3;
    return strcmp(component, "text_encoder_2") == 0 && sdxl_sd3;
}

/* Whether diffusers can load a LoRA's transformer keys into `component` of
 * a pipeline of class `cls`, as --lora COMPONENT=LORA asks: the transformer
 * itself, Wan 2.2's second expert (load_into_transformer_2) and MiniMax-H3's
 * second partition (load_into_transformer_ref). */
static int diffusers_loads_into(const char *cls, const char *component)
{
    return strcmp(component, DIFFUSERS_DEFAULT_COMPONENT) == 0 ||
           (strcmp(component, "transformer_2") == 0 && diffusers_loads_transformer_2(cls)) ||
           (strcmp(component, MINIMAX_H3_REF) == 0 && diffusers_lora_family(cls) == LORA_FAMILY_MINIMAX_H3);
}

/* The component --lora args[i] names (pl->into[i], pl->paths[i]): one of the
 * pipeline's that diffusers can load into, else NF4_EUSAGE. */
static int take_into(const char *in, struct pipeline_loras *pl, size_t i, const struct pipeline_entry *e, size_t ne)
{
    size_t len;
    pl->paths[i] = pipeline_lora_arg(pl->args[i], &len);
    if (!len)
        return NF4_OK;
    if (!(pl->into[i] = strndup(pl->args[i], len)))
        return nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    size_t k = 0;
    while (k < ne && !(e[k].kind == ENTRY_COMPONENT && strcmp(e[k].name, pl->into[i]) == 0))
        k++;
    if (k == ne)
        return nf4_fail(NF4_EUSAGE, in, NULL, "has no component %s (--lora %s)", pl->into[i], pl->args[i]);
    if (!diffusers_loads_into(pl->cls, pl->into[i]))
        return nf4_fail(NF4_EUSAGE, in, NULL, "is a %s, and diffusers loads a LoRA into %s only (Wan's loader also "
                        "into transformer_2, MiniMax-H3's into transformer_ref), not into %s (--lora %s)",
                        pl->cls ? pl->cls : "pipeline", DIFFUSERS_DEFAULT_COMPONENT, pl->into[i], pl->args[i]);
    return NF4_OK;
}

/* Whether LoRA i is given as transformer_ref=LORA (load_into_transformer_ref). */
static int asks_ref(const struct pipeline_loras *pl, size_t i)
{
    return pl->into[i] && strcmp(pl->into[i], MINIMAX_H3_REF) == 0;
}

/* Whether MiniMax-H3's loader sends LoRA i's transformer keys into
 * transformer_ref: asked to, or the pipeline loads no transformer
 * (whatever --lora transformer=LORA says). */
static int into_ref(const struct pipeline_loras *pl, size_t i)
{
    return asks_ref(pl, i) || !pl->h3.loads_transformer;
}

/* MiniMax-H3's loader, for LoRA i: it refuses keys under transformer_ref.
 * where the pipeline loads no transformer_ref, and load_into_transformer_ref
 * there; and it says where a LoRA goes that does not name its partition
 * when the pipeline has both. */
static int check_partitions(const struct pipeline_loras *pl, size_t i)
{
    const struct model *w = pl->weights[i];
    const size_t own = diffusers_lora_keys_for(w, DIFFUSERS_DEFAULT_COMPONENT),
                 ref = diffusers_lora_keys_for(w, MINIMAX_H3_REF);
    if (ref && !pl->h3.loads_ref)
        return nf4_fail(NF4_EDATA, pl->paths[i], NULL, "has %zu tensors for %s, a component this pipeline does not "
                        "load (diffusers refuses the LoRA)", ref, MINIMAX_H3_REF);
    if (asks_ref(pl, i) && !pl->h3.loads_ref)
        return nf4_fail(NF4_EUSAGE, pl->paths[i], NULL, "cannot go into %s (--lora %s): the pipeline's index does not "
                        "load it", MINIMAX_H3_REF, pl->args[i]);
    if (own && !ref && !pl->into[i] && pl->h3.loads_ref && pl->h3.holds_transformer)
        nf4_warn("%s: names no MiniMax-H3 partition, and the pipeline has both: merging it into %s, as diffusers "
                 "loads it (--lora %s=LORA merges it into the other)", pl->paths[i], DIFFUSERS_DEFAULT_COMPONENT,
                 MINIMAX_H3_REF);
    if (own && ref && into_ref(pl, i))
        nf4_warn("%s: its %zu %s tensors go into %s beside its %s ones, as an adapter that diffusers loads before "
                 "theirs and so leaves inactive: they are not merged", pl->paths[i], own, DIFFUSERS_DEFAULT_COMPONENT,
                 MINIMAX_H3_REF, MINIMAX_H3_REF);
    return NF4_OK;
}

/* Drops from `components` (*n) the partitions MiniMax-H3's pipeline does not
 * load, as its index says, and fills pl->h3; where the transformer's keys go
 * into a transformer_ref the folder holds, "transformer" counts as one of its
 * components, so that they are not taken as another component's. */
static void find_partitions(const char *in, struct pipeline_loras *pl, const char **components, size_t *n)
{
    int held[2] = {0, 0};
    static const char *const NAMES[2] = {DIFFUSERS_DEFAULT_COMPONENT, MINIMAX_H3_REF};
    for (size_t i = 0; i < *n; i++)
        for (size_t j = 0; j < 2; j++)
            held[j] |= strcmp(components[i], NAMES[j]) == 0;
    int loads[2] = {held[0], held[1]}; /* with no index to read, what the folder holds */
    pipeline_index_lists(in, NAMES, 2, loads);
    size_t kept = 0;
    for (size_t i = 0; i < *n; i++)
        if ((strcmp(components[i], NAMES[0]) != 0 || loads[0]) && (strcmp(components[i], NAMES[1]) != 0 || loads[1]))
            components[kept++] = components[i];
    *n = kept;
    pl->h3.loads_transformer = loads[0];
    pl->h3.loads_ref = loads[1];
    pl->h3.holds_transformer = held[0] && loads[0];
    pl->h3.holds_ref = held[1] && loads[1];
    if (pl->h3.holds_ref && !loads[0])
        components[(*n)++] = DIFFUSERS_DEFAULT_COMPONENT;
}

int pipeline_loras_open(const char *in, const char *const *args, size_t n, const struct pipeline_entry *e,
                        size_t ne, struct pipeline_loras *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->args = args;
    if (!n)
        return NF4_OK;
    size_t ncomp = 0;
    const char **components = calloc(ne + 1, sizeof *components); /* and MiniMax-H3's transformer keys */
    static const char *const TRANSFORMER[1] = {DIFFUSERS_DEFAULT_COMPONENT};
    pl->weights = calloc(n, sizeof *pl->weights);
    pl->paths = calloc(n, sizeof *pl->paths);
    pl->into = calloc(n, sizeof *pl->into);
    int code = components && pl->weights && pl->paths && pl->into ? diffusers_pipeline_class(in, &pl->cls)
                                                                  : nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    if (code == NF4_OK)
        pl->n = n; /* what pipeline_loras_close frees */
    for (size_t i = 0; i < ne && code == NF4_OK; i++)
        if (e[i].kind == ENTRY_COMPONENT && diffusers_loads(pl->cls, e[i].name))
            components[ncomp++] = e[i].name;
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        code = take_into(in, pl, i, e, ne);
    pl->h3.partitions = diffusers_lora_family(pl->cls) == LORA_FAMILY_MINIMAX_H3;
    if (code == NF4_OK && pl->h3.partitions)
        find_partitions(in, pl, components, &ncomp);
    /* Stable Diffusion XL's loader maps the SGM UNet's names by the UNet's
     * config; the other loaders pass none (and 1.x's does not map them). */
    char *unet_config = code == NF4_OK && diffusers_loads_sdxl(pl->cls) ? path_join(in, "unet/" CONFIG_FILE_NAME) : NULL;
    if (code == NF4_OK && diffusers_loads_sdxl(pl->cls) && !unet_config)
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        char *file = NULL;
        if ((code = diffusers_lora_path(pl->paths[i], &file, 0)) == NF4_OK && !file)
            code = nf4_fail(NF4_ESOFTWARE, pl->paths[i], NULL, "not a diffusers LoRA (internal error)");
        if (code == NF4_OK)
            code = diffusers_lora_open_for(file, diffusers_lora_family(pl->cls), unet_config, 1, &pl->weights[i]);
        if (code == NF4_OK && pl->h3.partitions)
            code = check_partitions(pl, i);
        const int flux1_rules = diffusers_flux1_rules(diffusers_lora_family(pl->cls));
        if (code == NF4_OK)
            code = pl->into[i] && !pl->h3.partitions
                       ? diffusers_lora_check_components(pl->weights[i], TRANSFORMER, 1, flux1_rules)
                       : diffusers_lora_check_components(pl->weights[i], components, ncomp, flux1_rules);
        free(file);
    }
    free(unet_config);
    free(components);
    return code;
}

int component_loras_init(struct component_loras *cl, const struct pipeline_loras *pl, const char *in)
{
    memset(cl, 0, sizeof *cl);
    cl->dirs = calloc(pl->n ? pl->n : 1, sizeof *cl->dirs);
    cl->key_components = calloc(pl->n ? pl->n : 1, sizeof *cl->key_components);
    cl->converted = calloc(pl->n ? pl->n : 1, sizeof *cl->converted);
    return cl->dirs && cl->key_components && cl->converted ? NF4_OK
                                                           : nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
}

void component_loras_free(struct component_loras *cl)
{
    free(cl->dirs);
    free(cl->key_components);
    free(cl->converted);
    memset(cl, 0, sizeof *cl);
}

/* Adds LoRA k of pl, its keys under `keys`, to cl. */
static void take_lora(struct component_loras *cl, const struct pipeline_loras *pl, size_t k, const char *keys)
{
    cl->dirs[cl->n] = pl->paths[k];
    cl->key_components[cl->n] = keys;
    cl->converted[cl->n++] = pl->weights[k]->unnamed ? pl->weights[k] : NULL;
}

/* MiniMax-H3's loader: transformer_ref takes the keys under its name, and
 * the transformer's where they go there (into_ref) and it has none of its
 * own (diffusers would load the transformer's first, as an adapter that the
 * next one leaves inactive); the transformer takes its own keys otherwise.
 * (A partition the index does not load is no component of pl's: a LoRA
 * with keys for it was refused, or its keys left out, when it was opened.) */
static void partition_loras_for(const struct pipeline_loras *pl, const char *component, struct component_loras *cl)
{
    const int ref = strcmp(component, MINIMAX_H3_REF) == 0;
    for (size_t k = 0; k < pl->n; k++) {
        const int own = diffusers_lora_keys_for(pl->weights[k], DIFFUSERS_DEFAULT_COMPONENT) != 0,
                  refs = diffusers_lora_keys_for(pl->weights[k], MINIMAX_H3_REF) != 0;
        const int here = ref ? into_ref(pl, k) && !refs
                             : !into_ref(pl, k) && strcmp(component, DIFFUSERS_DEFAULT_COMPONENT) == 0;
        if (own && here)
            take_lora(cl, pl, k, DIFFUSERS_DEFAULT_COMPONENT);
        if (ref && refs)
            take_lora(cl, pl, k, MINIMAX_H3_REF);
    }
}

void pipeline_loras_for(const struct pipeline_loras *pl, const char *component, struct component_loras *cl)
{
    cl->component = component;
    cl->n = 0;
    if (pl->h3.partitions) {
        partition_loras_for(pl, component, cl);
        return;
    }
    for (size_t k = 0; k < pl->n; k++) {
        /* given to a component, the LoRA goes there alone; else where its keys say */
        const char *keys = pl->into[k] ? DIFFUSERS_DEFAULT_COMPONENT : component;
        if (pl->into[k] ? strcmp(pl->into[k], component) != 0
                        : !diffusers_loads(pl->cls, component) || !diffusers_lora_keys_for(pl->weights[k], component))
            continue;
        take_lora(cl, pl, k, keys);
    }
}

void pipeline_loras_close(struct pipeline_loras *pl)
{
    for (size_t i = 0; i < pl->n; i++)
        if (pl->weights[i])
            model_close(pl->weights[i]);
    for (size_t i = 0; i < pl->n; i++)
        free(pl->into[i]);
    free(pl->into);
    free(pl->paths);
    free(pl->weights);
    free(pl->cls);
    memset(pl, 0, sizeof *pl);
}
