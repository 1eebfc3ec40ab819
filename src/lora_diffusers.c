#include "lora_diffusers.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json_util.h"
#include "layout.h"
#include "lora_ace_step.h"
#include "lora_alphas.h"
#include "lora_anima.h"
#include "lora_ernie_image.h"
#include "lora_fal.h"
#include "lora_flux2.h"
#include "lora_flux3.h"
#include "lora_hunyuan.h"
#include "lora_ideogram4.h"
#include "lora_kohya.h"
#include "lora_lokr.h"
#include "lora_krea2.h"
#include "lora_lumina2.h"
#include "lora_minimax_h3.h"
#include "lora_prefixed.h"
#include "lora_qwen.h"
#include "lora_rewrite.h"
#include "lora_sd.h"
#include "lora_target.h"
#include "lora_wan.h"
#include "lora_xlabs.h"
#include "lora_zimage.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

/* How many components a message names before "...". */
#define LISTED_COMPONENTS 4
#define KOHYA_REFUSAL                                                                                          \
    "is a kohya or ComfyUI-format LoRA without lora_down/lora_up pairs (LoHa, LoKr...), which nf4deq does not " \
    "read; load it in diffusers (load_lora_weights) and save it again with save_lora_weights, or as a PEFT "  \
    "adapter (a Qwen-Image LoRA is read on the pipeline or its transformer folder, whose class says how)"

/* Whether a path's last segment is one of a PEFT adapter's files. */
static int is_peft_file(const char *path)
{
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    return strcmp(name, ADAPTER_CONFIG_NAME) == 0 || strcmp(name, ADAPTER_WEIGHTS_NAME) == 0 ||
           strcmp(name, ADAPTER_PICKLE_NAME) == 0;
}

/* The one visible *.safetensors file of a folder, as diffusers' load_lora_weights
 * guesses it when the folder has no pytorch_lora_weights.safetensors (a LoRA
 * repository on the Hub, my_flux_lora.safetensors); NULL for none or several. */
static char *only_safetensors(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return NULL;
    char *found = NULL;
    int several = 0;
    const struct dirent *e;
    while ((e = readdir(d)) != NULL && !several) {
        if (e->d_name[0] == '.' || !str_ends_with(e->d_name, ".safetensors") || is_peft_file(e->d_name))
            continue; /* a PEFT adapter without its config is a PEFT adapter */
        if (found)
            several = 1;
        else
            found = path_join(dir, e->d_name);
    }
    closedir(d);
    if (several) {
        free(found);
        found = NULL;
    }
    return found;
}

/* Class-name prefixes and the loader each picks (diffusers 0.42's mixins:
 * pipelines, modular pipelines and the models they load into), tried in
 * order, a longer prefix before a shorter one it extends (LTX2 before LTX,
 * StableDiffusion3 before StableDiffusion). LORA_FAMILY_OTHER stops a class
 * with no loader from reaching a shorter prefix (HunyuanVideo 1.5's
 * pipelines have none, but its modular one has HunyuanVideo's). */
static const struct {
    const char *prefix;
    enum lora_family family;
} CLASS_PREFIXES[] = {
    {"QwenImage", LORA_FAMILY_QWEN_IMAGE},
    /* WanLoraLoaderMixin's pipelines and theirs like it (SkyReels-V2's and
     * Helios's mixins run the same conversions), and their transformers */
    {"Wan", LORA_FAMILY_WAN},
    {"SkyReelsV2", LORA_FAMILY_WAN},
    {"LucyEdit", LORA_FAMILY_WAN},
    {"ChronoEdit", LORA_FAMILY_WAN},
    {"AnyFlow", LORA_FAMILY_WAN},
    {"Helios", LORA_FAMILY_WAN},
    /* LTX-2 has a loader of its own, which EchoModularPipeline has too */
    {"LTX2", LORA_FAMILY_LTX2},
    {"EchoModular", LORA_FAMILY_LTX2},
    {"LTX", LORA_FAMILY_LTX_VIDEO},
    {"HiDreamImage", LORA_FAMILY_HIDREAM},
    {"ZImage", LORA_FAMILY_Z_IMAGE},
    {"HunyuanVideo15Modular", LORA_FAMILY_HUNYUAN_VIDEO},
    {"HunyuanVideo15", LORA_FAMILY_OTHER},
    {"HunyuanVideo", LORA_FAMILY_HUNYUAN_VIDEO},
    {"HunyuanSkyreels", LORA_FAMILY_HUNYUAN_VIDEO},
    {"Flux2", LORA_FAMILY_FLUX2},
    {"Krea2", LORA_FAMILY_KREA2},
    {"Ideogram4", LORA_FAMILY_IDEOGRAM4},
    {"Lumina2", LORA_FAMILY_LUMINA2},
    {"Flux3", LORA_FAMILY_FLUX3},
    {"AceStep", LORA_FAMILY_ACE_STEP},
    {"ErnieImage", LORA_FAMILY_ERNIE_IMAGE},
    {"MiniMaxH3", LORA_FAMILY_MINIMAX_H3},
    /* The loaders whose lora_state_dict converts nothing: their pipelines
     * and transformers. Cosmos' transformer class is Anima's too, whose
     * loader converts: alone, outside a pipeline, it takes diffusers' form
     * only, which both read alike. */
    {"StableDiffusion3", LORA_FAMILY_OWN_FORM},
    {"SD3Transformer2DModel", LORA_FAMILY_OWN_FORM},
    {"AuraFlow", LORA_FAMILY_OWN_FORM},
    {"CogVideoX", LORA_FAMILY_OWN_FORM},
    {"ConsisID", LORA_FAMILY_OWN_FORM},
    {"Mochi", LORA_FAMILY_OWN_FORM},
    {"Sana", LORA_FAMILY_OWN_FORM},
    {"Kandinsky5", LORA_FAMILY_OWN_FORM},
    {"CogView4", LORA_FAMILY_OWN_FORM},
    {"BriaFibo2", LORA_FAMILY_OWN_FORM},
    {"Cosmos2_5_Predict", LORA_FAMILY_OWN_FORM},
    {"CosmosTransformer3DModel", LORA_FAMILY_OWN_FORM},
    {"RFD4Proteina", LORA_FAMILY_OWN_FORM},
    /* StableDiffusionLoraLoaderMixin's and ...XLLoraLoaderMixin's pipelines
     * (not Stable Diffusion 3's, above), and their UNet */
    {"StableDiffusion", LORA_FAMILY_STABLE_DIFFUSION},
    {"AnimateDiff", LORA_FAMILY_STABLE_DIFFUSION},
    {"Kolors", LORA_FAMILY_STABLE_DIFFUSION},
    {"LatentConsistencyModel", LORA_FAMILY_STABLE_DIFFUSION},
    {"PIAPipeline", LORA_FAMILY_STABLE_DIFFUSION},
    {"StableUnCLIP", LORA_FAMILY_STABLE_DIFFUSION},
    {"TextToVideo", LORA_FAMILY_STABLE_DIFFUSION},
    {"VideoToVideoSD", LORA_FAMILY_STABLE_DIFFUSION},
    {"LEditsPPPipelineStableDiffusion", LORA_FAMILY_STABLE_DIFFUSION},
    {"AltDiffusion", LORA_FAMILY_STABLE_DIFFUSION},
    {"CycleDiffusion", LORA_FAMILY_STABLE_DIFFUSION},
    {"UNet2DConditionModel", LORA_FAMILY_STABLE_DIFFUSION},
    {"UNetMotionModel", LORA_FAMILY_STABLE_DIFFUSION},
};

enum lora_family diffusers_lora_family(const char *cls)
{
    if (!cls)
        return LORA_FAMILY_OTHER;
    /* AnimaModularPipeline, AnimaTextConditioner; not AnimateDiff... */
    if (str_starts_with(cls, "Anima") && cls[5] >= 'A' && cls[5] <= 'Z')
        return LORA_FAMILY_ANIMA;
    for (size_t i = 0; i < sizeof CLASS_PREFIXES / sizeof CLASS_PREFIXES[0]; i++)
        if (str_starts_with(cls, CLASS_PREFIXES[i].prefix))
            return CLASS_PREFIXES[i].family;
    /* Flux.1's pipelines and transformer; Flux followed by a digit is another
     * generation, whose loader nf4deq does not know */
    if (str_starts_with(cls, "Flux") && !(cls[4] >= '0' && cls[4] <= '9'))
        return LORA_FAMILY_FLUX;
    return LORA_FAMILY_OTHER;
}

int diffusers_flux1_rules(enum lora_family family)
{
    return family == LORA_FAMILY_FLUX || family == LORA_FAMILY_OTHER;
}

int diffusers_loads_sdxl(const char *cls)
{
    static const char *const XL_LOADERS[] = {"StableDiffusionXL", "AnimateDiffSDXL", "Kolors",
                                             "LEditsPPPipelineStableDiffusionXL", "TextToVideoZeroSDXL"};
    for (size_t i = 0; cls && i < sizeof XL_LOADERS / sizeof XL_LOADERS[0]; i++)
        if (strncmp(cls, XL_LOADERS[i], strlen(XL_LOADERS[i])) == 0)
            return 1;
    return 0;
}

int diffusers_loads_transformer_2(const char *cls)
{
    return diffusers_lora_family(cls) == LORA_FAMILY_WAN && strncmp(cls, "Helios", 6) != 0;
}

int diffusers_class_name(const char *dir, const char *name, char **cls)
{
    *cls = NULL;
    char *path = path_join(dir, name), *text = NULL;
    size_t len = 0;
    int oom = !path;
    const int code = path ? read_small_file(path, MAX_JSON_FILE_BYTES, &text, &len) : NF4_ESOFTWARE;
    oom |= code == NF4_ESOFTWARE;
    if (code == NF4_OK) {
        cJSON *root = json_parse_whole(text, len);
        oom |= !root && json_ran_out_of_memory();
        const cJSON *value = cJSON_GetObjectItemCaseSensitive(root, "_class_name");
        if (cJSON_IsString(value))
            oom |= !(*cls = strdup(value->valuestring));
        cJSON_Delete(root);
    }
    nf4_clear_error(); /* a file that cannot be read only has no class */
    free(text);
    free(path);
    return oom ? nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory") : NF4_OK;
}

int diffusers_pipeline_class(const char *dir, char **cls)
{
    const char *index = pipeline_index_name(dir);
    *cls = NULL;
    return index ? diffusers_class_name(dir, index, cls) : NF4_OK;
}

int diffusers_lora_open(const char *path, enum lora_family family, int warn, struct model **out)
{
    return diffusers_lora_open_for(path, family, NULL, warn, out);
}

static int open_weights(const char *path, struct model **out)
{
    return str_ends_with(path, ".bin") ? model_open_torch_file(path, out) : model_open_file(path, out);
}

int diffusers_lora_open_own_form(const char *path, struct model **out)
{
    int code = open_weights(path, out);
    if (code == NF4_OK)
        model_drop_tensors(*out, lora_is_dora_scale);
    return code;
}

int diffusers_lora_open_for(const char *path, enum lora_family family, const char *unet_config, int warn,
                            struct model **out)
{
    int code = open_weights(path, out);
    if (code != NF4_OK)
        return code;
    int (*convert)(const struct model *, const char *, int, struct model **) = NULL;
    switch (family) {
    case LORA_FAMILY_FLUX2: convert = flux2_lora_detect(*out) ? flux2_lora_convert : NULL; break;
    case LORA_FAMILY_QWEN_IMAGE: convert = qwen_lora_detect(*out) ? qwen_lora_convert : NULL; break;
    case LORA_FAMILY_WAN: convert = wan_lora_detect(*out) ? wan_lora_convert : NULL; break;
    case LORA_FAMILY_LTX_VIDEO: convert = prefixed_lora_detect(*out, family) ? ltx_video_lora_convert : NULL; break;
    case LORA_FAMILY_Z_IMAGE: convert = zimage_lora_detect(*out) ? zimage_lora_convert : NULL; break;
    case LORA_FAMILY_LTX2: convert = ltx2_lora_detect(*out) ? ltx2_lora_convert : NULL; break;
    case LORA_FAMILY_HIDREAM: convert = prefixed_lora_detect(*out, family) ? hidream_lora_convert : NULL; break;
    case LORA_FAMILY_HUNYUAN_VIDEO: convert = hunyuan_lora_detect(*out) ? hunyuan_lora_convert : NULL; break;
    case LORA_FAMILY_KREA2: convert = krea2_lora_detect(*out) ? krea2_lora_convert : NULL; break;
    case LORA_FAMILY_IDEOGRAM4: convert = ideogram4_lora_detect(*out) ? ideogram4_lora_convert : NULL; break;
    case LORA_FAMILY_LUMINA2: convert = lumina2_lora_detect(*out) ? lumina2_lora_convert : NULL; break;
    case LORA_FAMILY_FLUX3: convert = flux3_lora_detect(*out) ? flux3_lora_convert : NULL; break;
    case LORA_FAMILY_ANIMA: convert = anima_lora_detect(*out) ? anima_lora_convert : NULL; break;
    case LORA_FAMILY_ACE_STEP: convert = ace_step_lora_detect(*out) ? ace_step_lora_convert : NULL; break;
    case LORA_FAMILY_ERNIE_IMAGE: convert = ernie_image_lora_detect(*out) ? ernie_image_lora_convert : NULL; break;
    case LORA_FAMILY_OWN_FORM: break; /* diffusers' own form only: below */
    case LORA_FAMILY_MINIMAX_H3: convert = minimax_h3_lora_detect(*out) ? minimax_h3_lora_convert : NULL; break;
    case LORA_FAMILY_FLUX:
    case LORA_FAMILY_OTHER: /* Flux.1's loader looks for kohya's form, XLabs', BFL's control, then fal's */
        convert = kohya_lora_detect(*out)         ? kohya_lora_convert
                  : xlabs_lora_detect(*out)       ? xlabs_lora_convert
                  : bfl_control_lora_detect(*out) ? bfl_control_lora_convert
                  : fal_lora_detect(*out)         ? fal_lora_convert
                                                  : NULL;
        break;
    case LORA_FAMILY_STABLE_DIFFUSION: break; /* below: it takes the UNet's config */
    }
    const int sd = family == LORA_FAMILY_STABLE_DIFFUSION && sd_lora_detect(*out);
    if (sd) {
        struct model *original = *out;
        code = sd_lora_convert(original, path, unet_config, warn, out);
        model_close(original);
        if (code != NF4_OK)
            return code;
    } else if (convert) {
        struct model *original = *out;
        code = convert(original, path, warn, out);
        model_close(original);
        if (code != NF4_OK)
            return code;
    } else {
        /* In diffusers' own form: every loader's lora_state_dict drops DoRA
         * scales ("not compatible in Diffusers"), with a warning. */
        size_t n = model_drop_tensors(*out, lora_is_dora_scale);
        if (n && warn)
            nf4_warn("%s: %zu of its tensors are DoRA scales (dora_scale), which diffusers drops: they are not "
                     "merged", path, n);
    }
    /* Every loader's load_lora_weights but Flux.1's (whose rules unknown
     * classes follow), after its conversion: "Invalid LoRA checkpoint" for a
     * key without "lora" (Flux.2's and Z-Image's pass "lokr" too). */
    const int lokr_passes = family == LORA_FAMILY_FLUX2 || family == LORA_FAMILY_Z_IMAGE;
    const int all_lora = !diffusers_flux1_rules(family);
    for (size_t i = 0; all_lora && i < (*out)->count; i++) {
        const char *name = (*out)->tensors[i].t->name;
        if (!strstr(name, "lora") && !(lokr_passes && strstr(name, "lokr"))) {
            code = nf4_fail(NF4_EDATA, path, name, "has no \"lora\" in its name%s, and diffusers refuses a LoRA "
                            "file with such a key", convert || sd ? " once converted" : "");
            model_close(*out);
            *out = NULL;
            return code;
        }
    }
    return NF4_OK;
}

int diffusers_lora_path(const char *arg, char **weights, int warn)
{
    *weights = NULL;
    struct stat st;
    if (stat(arg, &st) != 0)
        return NF4_OK; /* lora_open says what is missing */
    if (S_ISREG(st.st_mode) && is_peft_file(arg))
        return nf4_fail(NF4_EUSAGE, arg, NULL, "is a file of a PEFT adapter: give --lora the adapter's folder");
    if (S_ISREG(st.st_mode))
        return (*weights = strdup(arg)) ? NF4_OK : nf4_fail(NF4_ESOFTWARE, arg, NULL, "out of memory");
    if (!S_ISDIR(st.st_mode))
        return NF4_OK;
    char *config = path_join(arg, ADAPTER_CONFIG_NAME), *file = path_join(arg, DIFFUSERS_LORA_NAME);
    if (!config || !file) {
        free(config);
        free(file);
        return nf4_fail(NF4_ESOFTWARE, arg, NULL, "out of memory");
    }
    /* lstat: in a Hugging Face cache each is a link, maybe to a blob not
     * downloaded; opening it then says so. */
    int peft = lstat(config, &st) == 0 || errno != ENOENT, diffusers = lstat(file, &st) == 0;
    if (!diffusers) { /* the pickle, where there is no safetensors file */
        free(file);
        file = path_join(arg, DIFFUSERS_LORA_PICKLE_NAME);
        diffusers = file && lstat(file, &st) == 0;
    }
    if (peft && diffusers && warn)
        nf4_warn("%s: holds a PEFT adapter (%s) and a diffusers LoRA (%s): merging the PEFT adapter; give --lora "
                 "the file to merge the other", arg, ADAPTER_CONFIG_NAME, file);
    if (!peft && diffusers) {
        *weights = file;
        file = NULL;
    } else if (!peft) {
        *weights = only_safetensors(arg); /* else lora_open says adapter_config.json is missing */
    }
    free(config);
    free(file);
    return NF4_OK;
}

/* The component a key is for: its first segment, `n` bytes long. */
static size_t component_len(const char *key)
{
    const char *dot = strchr(key, '.');
    return dot ? (size_t)(dot - key) : strlen(key);
}

/* Appends the component of `key` to `out` unless listed already (or
 * LISTED_COMPONENTS are): "text_encoder" of "text_encoder.r". */
static void note_component(struct strbuf *out, size_t *listed, const char *key)
{
    size_t n = component_len(key);
    for (const char *at = out->p; at && *at;) { /* ", "-separated */
        size_t len = strcspn(at, ",");
        if (len == n && memcmp(at, key, n) == 0)
            return;
        at += len + (at[len] ? 2 : 0);
    }
    if (*listed == LISTED_COMPONENTS)
        return;
    strbuf_printf(out, "%s%.*s", (*listed)++ ? ", " : "", (int)n, key);
}

static size_t keys_under(const struct model *w, const char *prefix)
{
    size_t n = 0, plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++)
        n += strncmp(w->tensors[i].t->name, prefix, plen) == 0;
    return n;
}

/* The components of the keys not under `prefix` (NULL: every key), for a
 * message: distinct first segments, in key order, at most LISTED_COMPONENTS;
 * returns how many keys. (Flux.1's loader pops every alpha as a network
 * alpha, whatever component it names, and only Flux.1's leaves a file any:
 * lora_alphas.h; they are not counted.) */
static size_t list_components(const struct model *w, const char *prefix, struct strbuf *out)
{
    size_t listed = 0, n = 0, plen = prefix ? strlen(prefix) : 0;
    for (size_t i = 0; i < w->count; i++)
        if ((!prefix || strncmp(w->tensors[i].t->name, prefix, plen) != 0) &&
            !network_alpha_key(w->tensors[i].t->name)) {
            note_component(out, &listed, w->tensors[i].t->name);
            n++;
        }
    return n;
}

/* Whether the keys are kohya's (sd-scripts) or ComfyUI's: lora_unet_..., lora_te...,
 * diffusion_model...; those with lora_down and lora_up pairs were converted on
 * opening (lora_kohya.h). */
static int is_kohya(const struct model *w)
{
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, "lora_unet_", 10) == 0 || strncmp(key, "lora_te", 7) == 0 || strstr(key, ".lora_down.") ||
            strncmp(key, "diffusion_model.", 16) == 0)
            return 1;
    }
    return 0;
}

/* Refuses a LoRA is_kohya finds that was not converted, saying why by its form. */
static int kohya_refusal(const struct model *w)
{
    const char *path = w->files[0]->path;
    for (size_t i = 0; i < w->count; i++)
        if (strstr(w->tensors[i].t->name, ".lora_down."))
            return nf4_fail(NF4_EDATA, path, w->tensors[i].t->name, "is a lora_down key in a form this pipeline's "
                            "diffusers loader does not convert: diffusers loads none of it");
    return nf4_fail(NF4_EDATA, path, NULL, KOHYA_REFUSAL);
}

/* The last segment of a folder's real path: "a/transformer/." -> "transformer". */
static char *folder_name(const char *dir)
{
    char *real = realpath(dir, NULL);
    const char *p = real ? real : dir;
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/')
        n--;
    size_t start = n;
    while (start > 0 && p[start - 1] != '/')
        start--;
    char *name = strndup(p + start, n - start);
    free(real);
    return name;
}

/* The folder `dir` is in, through its real path (allocated; NULL where it
 * cannot be found or out of memory). */
/* *parent: `dir`'s parent folder, resolved (allocated), or NULL where it
 * cannot be resolved. NF4_OK, or NF4_ESOFTWARE when memory runs out. */
static int real_parent(const char *dir, char **parent)
{
    char *real = realpath(dir, NULL);
    const int oom = !real && errno == ENOMEM;
    *parent = real ? path_join(real, "..") : NULL;
    free(real);
    return oom || (real && !*parent) ? nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory") : NF4_OK;
}

/* The class of the pipeline `dir` is a component of (*cls, NULL: none; see
 * diffusers_pipeline_class), and that pipeline's folder (*pipeline, NULL
 * where its parent holds no pipeline index). NF4_OK or NF4_ESOFTWARE. */
static int parent_pipeline(const char *dir, char **pipeline, char **cls)
{
    *cls = NULL;
    int code = real_parent(dir, pipeline);
    if (code == NF4_OK && *pipeline && !pipeline_index_name(*pipeline)) {
        free(*pipeline);
        *pipeline = NULL;
    }
    if (code == NF4_OK && *pipeline)
        code = diffusers_pipeline_class(*pipeline, cls);
    return code;
}

/* The loader's class for the model in `dir` (diffusers_lora_open_for_dir):
 * its pipeline's where it is a component, else its own (*cls, NULL: none),
 * and the config a Stable Diffusion XL or UNet loader passes (*config). */
static int loader_class(const char *path, const char *dir, char **cls, char **config)
{
    /* none where the parent holds no pipeline index (a regular file) */
    char *pipeline = NULL;
    *cls = *config = NULL;
    int code = dir ? parent_pipeline(dir, &pipeline, cls) : NF4_OK;
    if (code == NF4_OK && *cls) { /* as diffusers_lora_open_for is called for the whole pipeline (pipeline_lora.c) */
        if (diffusers_loads_sdxl(*cls) && !(*config = path_join(pipeline, "unet/" CONFIG_FILE_NAME)))
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    } else if (code == NF4_OK && dir) {
        code = diffusers_class_name(dir, CONFIG_FILE_NAME, cls);
        if (code == NF4_OK && !(*config = path_join(dir, CONFIG_FILE_NAME)))
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    free(pipeline);
    return code;
}

int diffusers_lora_open_for_dir(const char *path, const char *dir, int warn, struct model **out)
{
    char *cls = NULL, *config = NULL;
    int code = loader_class(path, dir, &cls, &config);
    const enum lora_family family = diffusers_lora_family(cls);
    free(cls);
    if (code == NF4_OK)
        code = diffusers_lora_open_for(path, family, config, warn, out);
    free(config);
    return code;
}

int diffusers_lora_family_of_dir(const char *path, const char *dir, enum lora_family *family)
{
    char *cls = NULL, *config = NULL;
    int code = loader_class(path, dir, &cls, &config);
    *family = diffusers_lora_family(cls);
    free(cls);
    free(config);
    return code;
}

/* Whether `dir`, named `own`, is a second transformer its pipeline's
 * loader loads transformer keys into (its parent's pipeline index): the
 * transformer_2 of a Wan pipeline, the transformer_ref of a MiniMax-H3
 * one. */
static int second_transformer(const char *pipeline_cls, const char *own)
{
    return strcmp(own, "transformer_2") == 0  ? diffusers_loads_transformer_2(pipeline_cls)
           : strcmp(own, MINIMAX_H3_REF) == 0 ? diffusers_lora_family(pipeline_cls) == LORA_FAMILY_MINIMAX_H3
                                               : 0;
}

/* Whether the keys name the base's tensors with no component before them:
 * what diffusers' ModelMixin.save_lora_adapter writes (one model's LoRA,
 * its metadata unprefixed too). */
static int keys_fit_unprefixed(const struct model *w, const struct model *base)
{
    static const char SUFFIX[] = ".lora_A.weight";
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        size_t n = strlen(key);
        if (n <= strlen(SUFFIX) || !str_ends_with(key, SUFFIX))
            continue;
        char *name = malloc(n + 1);
        if (!name)
            return 0;
        snprintf(name, n + 1, "%.*s.weight", (int)(n - strlen(SUFFIX)), key);
        int found = model_find(base, name) != NULL;
        free(name);
        if (found)
            return 1;
    }
    return 0;
}

/* The prefix of a component's keys: "transformer" -> "transformer.", allocated. */
static char *key_prefix_of(const char *component)
{
    size_t n = strlen(component) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s.", component);
    return p;
}

size_t diffusers_lora_keys_for(const struct model *weights, const char *component)
{
    size_t n = 0, clen = strlen(component);
    for (size_t i = 0; i < weights->count; i++) {
        const char *key = weights->tensors[i].t->name;
        n += strncmp(key, component, clen) == 0 && key[clen] == '.';
    }
    return n;
}

int diffusers_lora_check_components(const struct model *weights, const char *const *components, size_t n,
                                    int flux1_rules)
{
    const char *path = weights->files[0]->path;
    struct strbuf missing = {0};
    size_t listed = 0, left = 0, keys = 0;
    /* Flux.1's loader pops every alpha as a network alpha, for no component (lora_alphas.h) */
    int code = flux1_rules ? network_alphas_check(weights, diffusers_lora_metadata(weights) != NULL) : NF4_OK;
    for (size_t i = 0; i < weights->count && code == NF4_OK; i++) {
        const char *key = weights->tensors[i].t->name;
        if (flux1_rules && network_alpha_key(key))
            continue;
        keys++;
        size_t len = component_len(key), k;
        for (k = 0; k < n; k++)
            if (strlen(components[k]) == len && memcmp(components[k], key, len) == 0)
                break;
        if (k < n)
            continue;
        left++;
        note_component(&missing, &listed, key);
    }
    if (code == NF4_OK && missing.oom)
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    else if (code == NF4_OK && left && left == keys && is_kohya(weights))
        code = kohya_refusal(weights);
    else if (code == NF4_OK && left && left == keys) /* other components', or keys with none (save_lora_adapter) */
        code = nf4_fail(NF4_EDATA, path, NULL, "has no tensors for a component of this pipeline that diffusers loads "
                        "LoRAs into (its keys are for: %s); give IN the folder of the component it was trained on",
                        missing.p);
    else if (code == NF4_OK && left)
        nf4_warn("%s: %zu of its tensors are for %s, which this pipeline does not have or diffusers does not load "
                 "LoRAs into: they are not merged", path, left, missing.p);
    free(missing.p);
    return code;
}

int diffusers_lora_prefix(const struct model *weights, const struct model *base, const char *component,
                          char **prefix)
{
    *prefix = NULL;
    const char *path = weights->files[0]->path;
    if (component)
        return (*prefix = key_prefix_of(component)) ? NF4_OK : nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    char *own = base->dir ? folder_name(base->dir) : NULL;
    if (base->dir && !own)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    int own_usable = own && own[0] && strcmp(own, ".") != 0 && strcmp(own, "..") != 0 &&
                     strcmp(own, DIFFUSERS_DEFAULT_COMPONENT) != 0;
    /* A pipeline's component takes its own keys only: another one's
     * transformer keys do not fit it. But Wan 2.2's transformer_2 and
     * MiniMax-H3's transformer_ref are second transformers, which diffusers
     * loads transformer keys into (load_into_transformer_2,
     * load_into_transformer_ref). */
    char *pipeline = NULL, *cls = NULL;
    int code = own_usable ? parent_pipeline(base->dir, &pipeline, &cls) : NF4_OK;
    const char *names[2] = {own_usable ? own : NULL,
                            own_usable && pipeline && !second_transformer(cls, own) ? NULL
                                                                                    : DIFFUSERS_DEFAULT_COMPONENT};
    free(pipeline);
    free(cls);
    for (size_t i = 0; i < 2 && !*prefix && code == NF4_OK; i++)
        if (names[i] && diffusers_lora_keys_for(weights, names[i]) && !(*prefix = key_prefix_of(names[i])))
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    if (code == NF4_OK && !*prefix && keys_fit_unprefixed(weights, base) && !(*prefix = strdup("")))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    struct strbuf others = {0};
    size_t nothers = 0;
    if (code == NF4_OK)
        nothers = list_components(weights, *prefix, &others);
    if (code == NF4_OK && others.oom)
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    else if (code == NF4_OK && !*prefix && keys_under(weights, PEFT_KEY_PREFIX))
        code = nf4_fail(NF4_EDATA, path, NULL, "holds a PEFT adapter's keys (" PEFT_KEY_PREFIX "...): give --lora "
                        "the adapter's folder, with its " ADAPTER_CONFIG_NAME);
    else if (code == NF4_OK && !*prefix && is_kohya(weights))
        code = kohya_refusal(weights);
    else if (code == NF4_OK && !*prefix)
        code = nf4_fail(NF4_EDATA, path, NULL, "is a diffusers LoRA with no tensors for %s%s%s (its keys are for: "
                        "%s); give IN the folder of the pipeline component it was trained on",
                        names[0] ? names[0] : "", names[0] && names[1] ? " or " : "", names[1] ? names[1] : "",
                        others.p ? others.p : "nothing");
    else if (code == NF4_OK && others.p && **prefix)
        nf4_warn("%s: %zu of its tensors are for other pipeline components (%s) than %.*s: they are not merged "
                 "here; convert each such component with this --lora too", path,
                 nothers, others.p, (int)(strlen(*prefix) - 1), *prefix);
    free(others.p);
    free(own);
    if (code != NF4_OK) {
        free(*prefix);
        *prefix = NULL;
    }
    return code;
}

#define CLIP_TEXT_MODEL "text_model."

struct text_model_rename {
    const char *path; /* the LoRA's, for messages */
    const char *prefix;
    size_t plen;
    int base_has; /* the base's tensors are under CLIP_TEXT_MODEL */
    const struct model *base;
};

/* Whether the base has the weight of the module a key (less its component)
 * is of: CLIPTextModelWithProjection's text_projection is outside
 * text_model, in either transformers. */
static int base_has_module_of(const struct model *base, const char *rest)
{
    const char *cut = NULL;
    for (const char *p = strstr(rest, ".lora_"); p; p = strstr(p + 1, ".lora_"))
        cut = p;
    char name[LORA_KEY_MAX + 16];
    if (!cut || (size_t)(cut - rest) > LORA_KEY_MAX)
        return 0;
    snprintf(name, sizeof name, "%.*s.weight", (int)(cut - rest), rest);
    return model_find(base, name) != NULL;
}

static int text_model_name(const char *key, void *arg, char **renamed)
{
    const struct text_model_rename *r = arg;
    const size_t tlen = strlen(CLIP_TEXT_MODEL);
    if (strncmp(key, r->prefix, r->plen) != 0 || base_has_module_of(r->base, key + r->plen))
        return NF4_OK;
    const char *rest = key + r->plen;
    int has = strncmp(rest, CLIP_TEXT_MODEL, tlen) == 0;
    if (has == r->base_has)
        return NF4_OK;
    size_t n = strlen(key) + tlen + 1;
    if (!(*renamed = malloc(n)))
        return nf4_fail(NF4_ESOFTWARE, r->path, key, "out of memory");
    snprintf(*renamed, n, "%s%s%s", r->prefix, has ? "" : CLIP_TEXT_MODEL, has ? rest + tlen : rest);
    return NF4_OK;
}

int diffusers_lora_align_text_model(struct model *weights, const char *prefix, const struct model *base)
{
    if (strncmp(prefix, "text_encoder", 12) != 0)
        return NF4_OK;
    struct text_model_rename r = {weights->files[0]->path, prefix, strlen(prefix), 0, base};
    for (size_t i = 0; i < base->count && !r.base_has; i++)
        r.base_has = strncmp(base->tensors[i].t->name, CLIP_TEXT_MODEL, strlen(CLIP_TEXT_MODEL)) == 0;
    return model_rename_tensors(weights, text_model_name, &r);
}

/* Whether a key under `prefix` ends with `suffix`. */
static int has_key_ending(const struct model *w, const char *prefix, const char *suffix)
{
    size_t plen = strlen(prefix);
    for (size_t i = 0; i < w->count; i++) {
        const char *key = w->tensors[i].t->name;
        if (strncmp(key, prefix, plen) == 0 && str_ends_with(key, suffix))
            return 1;
    }
    return 0;
}

/* The metadata's entries of the prefix's component, the prefix taken off,
 * into cfg; *entries: how many. `covered`: the components of the others. */
static int metadata_entries(const char *label, const char *meta, const char *prefix, cJSON *cfg, size_t *entries,
                            struct strbuf *covered)
{
    *entries = 0;
    cJSON *root = json_parse_whole(meta, strlen(meta));
    if (!root)
        return json_ran_out_of_memory() ? nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory")
                                        : nf4_fail(NF4_EDATA, label, NULL, "is not valid JSON");
    int code = NF4_OK, twice = cJSON_IsObject(root) ? json_has_duplicate_key(root) : 0;
    if (!cJSON_IsObject(root))
        code = nf4_fail(NF4_EDATA, label, NULL, "is not a JSON object");
    else if (twice)
        code = twice < 0 ? nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory")
                         : nf4_fail(NF4_EDATA, label, NULL, "has a duplicate key");
    size_t plen = strlen(prefix), listed = 0;
    for (const cJSON *e = code == NF4_OK ? root->child : NULL; e; e = e->next) {
        if (strncmp(e->string, prefix, plen) != 0) {
            note_component(covered, &listed, e->string);
            continue;
        }
        cJSON *copy = cJSON_Duplicate(e, 1);
        if (!copy || !cJSON_AddItemToObject(cfg, e->string + plen, copy)) {
            cJSON_Delete(copy);
            code = nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
            break;
        }
        (*entries)++;
    }
    cJSON_Delete(root);
    return code;
}

/* r and the rank_pattern ranks must be written as whole numbers (4, not
 * 4.0), as lora_config_parse asks of adapter_config.json: checked on the
 * metadata's own text, which cJSON would print again as 4. */
static int check_integers(const char *label, const char *meta, const char *prefix)
{
    struct strbuf r = {0}, ranks = {0};
    strbuf_printf(&r, "%sr", prefix);
    strbuf_printf(&ranks, "%srank_pattern", prefix);
    const char *keys[2] = {r.p, ranks.p}, *bad = NULL;
    int code = NF4_OK;
    if (r.oom || ranks.oom)
        code = nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
    else if (!json_keys_hold_plain_integers(meta, strlen(meta), keys, 2, &bad))
        code = nf4_fail(NF4_EDATA, label, NULL, "%s", bad == keys[0] || strcmp(bad, keys[0]) == 0
                                                        ? "\"r\" must be a whole number from 1 to 65536"
                                                        : "\"rank_pattern\" ranks must be whole numbers");
    free(r.p);
    free(ranks.p);
    return code;
}

/* JSON's whitespace (RFC 8259), which json.loads skips around a value. */
#define JSON_SPACE " \t\n\r"

const char *diffusers_lora_metadata(const struct model *w)
{
    const struct st_file *f = w->files[0];
    for (size_t i = 0; i < f->nmeta; i++) {
        if (strcmp(f->meta[i].key, DIFFUSERS_LORA_METADATA) != 0)
            continue;
        const char *v = f->meta[i].value + strspn(f->meta[i].value, JSON_SPACE);
        size_t n = strlen(v);
        while (n && strchr(JSON_SPACE, v[n - 1]))
            n--;
        const int none = !f->meta[i].value[0] || (n == 4 && strncmp(v, "null", 4) == 0);
        return none ? NULL : f->meta[i].value;
    }
    return NULL;
}

/* A config from the metadata must name target_modules: without them PEFT
 * looks the model's type up in its own table, and a diffusers model has
 * none (_prepare_adapter_config raises KeyError 'model_type'). */
static int require_target_modules(const char *label, const cJSON *cfg, const char *kind)
{
    const cJSON *targets = cJSON_GetObjectItemCaseSensitive(cfg, "target_modules");
    if (!targets || cJSON_IsNull(targets))
        return nf4_fail(NF4_EDATA, label, NULL, "has no target_modules: PEFT builds no %s layers into a diffusers "
                        "model from such a config (it raises)", kind);
    return NF4_OK;
}

/* A LoKr file's metadata entries (in cfg) as LoKrConfig(**entries) takes
 * them: another key raises TypeError; peft_type becomes LOKR. */
static int lokr_metadata_config(const char *label, cJSON *cfg)
{
    for (const cJSON *e = cfg->child; e; e = e->next)
        if (!lokr_config_field(e->string))
            return nf4_fail(NF4_EDATA, label, NULL, "holds \"%s\", which is no field of PEFT's LoKrConfig: "
                            "diffusers cannot build this LoKr's config from it (TypeError)", e->string);
    int code = require_target_modules(label, cfg, "LoKr");
    if (code != NF4_OK)
        return code;
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "peft_type");
    return cJSON_AddStringToObject(cfg, "peft_type", "LOKR") ? NF4_OK
                                                              : nf4_fail(NF4_ESOFTWARE, label, NULL, "out of memory");
}

int diffusers_lora_config(const struct model *weights, const char *prefix, int flux1_rules, struct lora_config *c)
{
    memset(c, 0, sizeof *c);
    const struct st_file *f = weights->files[0];
    const char *meta = diffusers_lora_metadata(weights);
    struct strbuf label = {0};
    strbuf_printf(&label, "%s (metadata \"%s\")", f->path, DIFFUSERS_LORA_METADATA);
    cJSON *cfg = cJSON_CreateObject();
    if (label.oom || !cfg) {
        free(label.p);
        cJSON_Delete(cfg);
        return nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    }
    size_t entries = 0;
    struct strbuf covered = {0};
    int code = meta ? metadata_entries(label.p, meta, prefix, cfg, &entries, &covered) : NF4_OK;
    /* Metadata for other components only: diffusers would give this one
     * LoraConfig's defaults (r = 8, alpha = 8), which fit no saved LoRA. */
    if (code == NF4_OK && meta && entries == 0)
        code = covered.oom ? nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory")
                           : nf4_fail(NF4_EDATA, label.p, NULL, "holds the LoRA config of %s, not of %.*s: merge it into "
                                      "the component it is for", covered.p ? covered.p : "no component",
                                      (int)(strlen(prefix) ? strlen(prefix) - 1 : 0), prefix);
    if (code == NF4_OK && meta)
        code = check_integers(label.p, meta, prefix);
    /* A LoKr (any LoKr key): diffusers builds a LoKrConfig, from the
     * metadata's entries (PEFT's dataclass takes its own fields alone, and
     * sets peft_type) or from the factors' shapes (lora_lokr.h). */
    const int lokr = code == NF4_OK && lokr_any_key(weights, prefix);
    char *text = NULL;
    if (lokr && meta)
        code = lokr_metadata_config(label.p, cfg);
    else if (lokr)
        code = lokr_inferred_config(weights, f->path, prefix, &text);
    else if (code == NF4_OK && meta)
        code = require_target_modules(label.p, cfg, "LoRA");
    /* Network alphas (lora_alphas.h), which Flux.1's loader alone leaves
     * in a file in diffusers' form: diffusers refuses them beside metadata. */
    const int any_alpha = code == NF4_OK && flux1_rules && !lokr && lora_model_any_key(weights, network_alpha_key);
    if (any_alpha)
        code = network_alphas_check(weights, meta != NULL);
    /* No metadata: diffusers then takes r and alpha from each pair's shape
     * (alpha from the network alphas, where some are the component's), and
     * DoRA and LoRA biases from the keys. */
    int inferred = code == NF4_OK && !meta && !lokr, alphas_given = 0;
    enum st_dtype alpha_dtype = DT_INVALID;
    if (inferred && any_alpha &&
        (code = network_alphas_config(weights, prefix, f->path, cfg, &alpha_dtype, &alphas_given)) != NF4_OK)
        inferred = 0;
    if (inferred && ((!alphas_given && !cJSON_AddNumberToObject(cfg, "lora_alpha", 1)) ||
                     !cJSON_AddNumberToObject(cfg, "r", 1) ||
                     !cJSON_AddBoolToObject(cfg, "use_dora", has_key_ending(weights, prefix, ".lora_magnitude_vector")) ||
                     !cJSON_AddBoolToObject(cfg, "lora_bias", has_key_ending(weights, prefix, ".lora_B.bias"))))
        code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    /* diffusers hands the entries to LoraConfig, which is PEFT's LoRA (and
     * sets peft_type so, whatever the entries say). */
    if (code == NF4_OK && !lokr) {
        cJSON_DeleteItemFromObjectCaseSensitive(cfg, "peft_type");
        if (!cJSON_AddStringToObject(cfg, "peft_type", "LORA"))
            code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    }
    if (code == NF4_OK && !text)
        text = cJSON_PrintUnformatted(cfg);
    if (code == NF4_OK && !text)
        code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    if (code == NF4_OK) {
        code = lora_config_parse(label.p, text, strlen(text), c);
        c->rank_from_shapes = inferred;
        c->alphas_given = alphas_given;
        c->scaling_dtype = alpha_dtype;
        /* diffusers injects the adapter by its keys (inject_adapter_in_model
         * with the state dict), so every key under the prefix is merged,
         * whatever target_modules, exclude_modules and layers_to_transform say. */
        lora_target_free(&c->targets);
    }
    free(text);
    free(covered.p);
    cJSON_Delete(cfg);
    free(label.p);
    return code;
}
