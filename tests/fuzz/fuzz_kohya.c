/* kohya_lora_convert, xlabs_lora_convert, fal_lora_convert, flux2_lora_convert,
 * qwen_lora_convert, wan_lora_convert, zimage_lora_convert,
 * ltx2_lora_convert, hunyuan_lora_convert, krea2_lora_convert,
 * ideogram4_lora_convert, lumina2_lora_convert, flux3_lora_convert,
 * anima_lora_convert, ace_step_lora_convert, ernie_image_lora_convert,
 * minimax_h3_lora_convert and sd_lora_convert (Flux.2's and Z-Image's LoKr
 * forms among them, lora_lokr_forms.h) on arbitrary bytes written to
 * a file (a kohya, ComfyUI, XLabs or fal Kontext Flux.1 LoRA, a Flux.2,
 * Qwen-Image, Wan, Z-Image, LTX-2, HunyuanVideo, Krea 2, Ideogram 4,
 * Lumina 2, FLUX.3, Anima, ACE-Step, ERNIE-Image or MiniMax-H3 LoRA in
 * another form than diffusers', a
 * kohya Stable Diffusion LoRA, whose conversion reads a UNet config of
 * layers_per_block 2 written beside the scratch folder): the
 * renaming, the alpha, the splits of fused layers, Wan's biases and head
 * diff, and the temp file. When one accepts, every tensor of the result is a diffusers LoRA
 * factor of the transformer (or Flux.1's text encoder), or a Wan bias, or
 * (Flux.2's keys already in diffusers' block names, copied) a key of the
 * transformer with "lora" in it, or (LTX-2's, copied under any component)
 * any key with "lora" in it, or (HunyuanVideo's, each copied or cut by rows)
 * any key of the transformer, or (fal's, each copied or cut by rows, factors and
 * biases; Krea 2's and FLUX.3's, each copied; Lumina 2's, copied or cut by rows) any key
 * of the transformer, or (a LoKr's, whose LoKrConfig diffusers would build
 * must then parse) any key of the transformer, or (Stable
 * Diffusion's, each copied) a factor of its UNet or text encoders, 2-D or a
 * convolution's 4-D, or (XLabs', which keeps keys outside the
 * blocks as they are) any key; a refusal must be bad data with a one-line
 * message; either way the temp file is gone (TMPDIR is a scratch folder that
 * must end up holding the input alone). Then diffusers_lora_old_names renames
 * each component's keys of diffusers' older forms: names stay distinct, a
 * text encoder's keep none of the oldest form (renamed, or left out), and a
 * refusal is bad data with a one-line message. */
#define FUZZ_OWN_INITIALIZE
#include "fuzz_common.h"
#include "lora_ace_step.h"
#include "lora_anima.h"
#include "lora_ernie_image.h"
#include "lora_fal.h"
#include "lora_flux2.h"
#include "lora_flux3.h"
#include "lora_hunyuan.h"
#include "lora_ideogram4.h"
#include "lora_kohya.h"
#include "lora_krea2.h"
#include "lora_lokr.h"
#include "lora_lumina2.h"
#include "lora_minimax_h3.h"
#include "lora_old_forms.h"
#include "lora_prefixed.h"
#include "lora_qwen.h"
#include "lora_sd.h"
#include "lora_wan.h"
#include "lora_xlabs.h"
#include "lora_zimage.h"
#include "model.h"
#include "strutil.h"

static const char *path;
static char *unet_config; /* beside the scratch folder, which must hold the input alone */

static void remove_unet_config(void)
{
    unlink(unet_config);
}

static int sd_convert(const struct model *w, const char *file, int warn, struct model **out)
{
    return sd_lora_convert(w, file, unet_config, warn, out);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    const struct fuzz_scratch *s = fuzz_scratch_init("fuzz-kohya", "lora.safetensors", NULL);
    path = s->input;
    static const char UNET_CONFIG[] = "{\"_class_name\": \"UNet2DConditionModel\", \"layers_per_block\": 2}";
    FILE *f = asprintf(&unet_config, "%s.unet.json", s->dir) < 0 ? NULL : fopen(unet_config, "w");
    if (!f || fputs(UNET_CONFIG, f) < 0 || fclose(f) != 0) {
        perror("fuzz_kohya: the UNet config");
        exit(1);
    }
    atexit(remove_unet_config);
    if (setenv("TMPDIR", s->dir, 1) != 0) {
        perror("fuzz_kohya: TMPDIR");
        exit(1);
    }
    return 0;
}

/* What a conversion may hold besides 2-D lora_A/lora_B factors. */
enum allowed {
    FACTORS_ONLY,
    WITH_BIASES,     /* 1-D lora_B.bias vectors */
    WITH_LORA_COPIES, /* any tensor under `components` whose name holds "lora" (the file's own, copied) */
    ANY_LORA_KEY,     /* any tensor whose name holds "lora", under any component or none (LTX-2's) */
    WITH_CONV,        /* factors of 2 or 4 dimensions (a convolution's: Stable Diffusion's) */
    ANY_KEY,          /* any tensor under `components` (HunyuanVideo's: diffusers_lora_open checks the names) */
    AS_NAMED          /* any tensor (XLabs' keys outside the blocks, kept as the file names them) */
};

/* One conversion's result: named after the file, only 2-D lora_A/lora_B
 * factors under `components` (NULL-terminated prefixes), and what `allowed`
 * adds. */
static void check_result(int code, struct model *out, const char *const *components, enum allowed allowed)
{
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        return;
    }
    FUZZ_ASSERT(strcmp(out->files[0]->path, path) == 0, "the result names %s", out->files[0]->path);
    /* A LoKr's conversion (Flux.2's, Z-Image's) carries any key under transformer. that its form maps
     * (diffusers_lora_open then checks the names); the config diffusers would build of it must parse. The
     * conversions that keep other keys as they are (AS_NAMED...) keep their own rule. */
    if (lokr_any_key(out, "transformer.")) {
        if (allowed == FACTORS_ONLY || allowed == WITH_LORA_COPIES)
            allowed = ANY_KEY;
        char *json = NULL;
        nf4_clear_error();
        const int built = lokr_inferred_config(out, path, "transformer.", &json);
        if (built == NF4_OK) {
            struct lora_config c;
            const int parsed = lora_config_parse(path, json, strlen(json), &c);
            FUZZ_ASSERT(parsed == NF4_OK && c.lokr, "the LoKr config built is not one: %s", json);
            lora_config_free(&c);
        } else {
            fuzz_check_failure(built);
        }
        free(json);
    }
    for (size_t i = 0; i < out->count; i++) {
        const struct st_tensor *t = out->tensors[i].t;
        int under = 0;
        for (const char *const *c = components; *c; c++)
            under |= strncmp(t->name, *c, strlen(*c)) == 0;
        if (allowed == WITH_LORA_COPIES && under && strstr(t->name + strlen("transformer."), "lora"))
            continue;
        if (allowed == AS_NAMED)
            continue;
        if (allowed == ANY_KEY) {
            FUZZ_ASSERT(under, "%s", t->name);
            continue;
        }
        if (allowed == ANY_LORA_KEY) {
            FUZZ_ASSERT(strstr(t->name, "lora") != NULL, "%s", t->name);
            continue;
        }
        if (allowed == WITH_BIASES && str_ends_with(t->name, ".lora_B.bias")) {
            FUZZ_ASSERT(under && t->ndim == 1 && t->shape[0], "%s: shape", t->name);
            continue;
        }
        FUZZ_ASSERT(under && (str_ends_with(t->name, ".lora_A.weight") || str_ends_with(t->name, ".lora_B.weight")),
                    "%s", t->name);
        FUZZ_ASSERT((t->ndim == 2 || (allowed == WITH_CONV && t->ndim == 4)) && t->nelem, "%s: shape", t->name);
    }
    model_close(out);
}

static const char *const FLUX[] = {"transformer.", "text_encoder.", NULL};
static const char *const TRANSFORMER[] = {"transformer.", NULL};
static const char *const SD[] = {"unet.", "text_encoder.", "text_encoder_2.", NULL};

/* An attention projection's key in diffusers' oldest form. */
static int in_oldest_form(const char *name)
{
    return strstr(name, ".to_q_lora.") || strstr(name, ".to_k_lora.") || strstr(name, ".to_v_lora.") ||
           strstr(name, ".to_out_lora.");
}

/* Each conversion, where its loader would convert the file, and what its
 * result may hold. */
static const struct {
    const char *what;
    int (*detect)(const struct model *w);
    int (*convert)(const struct model *w, const char *path, int warn, struct model **out);
    const char *const *components;
    enum allowed allowed;
} CONVERSIONS[] = {
    {"a kohya conversion", kohya_lora_detect, kohya_lora_convert, FLUX, FACTORS_ONLY},
    {"an XLabs conversion", xlabs_lora_detect, xlabs_lora_convert, FLUX, AS_NAMED},
    {"a fal Kontext conversion", fal_lora_detect, fal_lora_convert, TRANSFORMER, ANY_KEY},
    /* its norms' scales as the attentions' norm weights */
    {"a BFL control conversion", bfl_control_lora_detect, bfl_control_lora_convert, TRANSFORMER, ANY_KEY},
    {"a Flux.2 conversion", flux2_lora_detect, flux2_lora_convert, TRANSFORMER, WITH_LORA_COPIES},
    {"a Qwen-Image conversion", qwen_lora_detect, qwen_lora_convert, TRANSFORMER, FACTORS_ONLY},
    {"a Wan conversion", wan_lora_detect, wan_lora_convert, TRANSFORMER, WITH_BIASES},
    {"an LTX-2 conversion", ltx2_lora_detect, ltx2_lora_convert, TRANSFORMER, ANY_LORA_KEY},
    {"a Z-Image conversion", zimage_lora_detect, zimage_lora_convert, TRANSFORMER, FACTORS_ONLY},
    {"a HunyuanVideo conversion", hunyuan_lora_detect, hunyuan_lora_convert, TRANSFORMER, ANY_KEY},
    {"a Krea 2 conversion", krea2_lora_detect, krea2_lora_convert, TRANSFORMER, ANY_KEY},
    {"an Ideogram 4 conversion", ideogram4_lora_detect, ideogram4_lora_convert, TRANSFORMER, FACTORS_ONLY},
    {"a Lumina 2 conversion", lumina2_lora_detect, lumina2_lora_convert, TRANSFORMER, ANY_KEY},
    {"a FLUX.3 conversion", flux3_lora_detect, flux3_lora_convert, TRANSFORMER, ANY_KEY},
    /* keys outside diffusion_model. kept as they are */
    {"an Anima conversion", anima_lora_detect, anima_lora_convert, TRANSFORMER, AS_NAMED},
    {"an ACE-Step conversion", ace_step_lora_detect, ace_step_lora_convert, TRANSFORMER, ANY_KEY},
    /* keys without either prefix kept as they are */
    {"an ERNIE-Image conversion", ernie_image_lora_detect, ernie_image_lora_convert, TRANSFORMER, AS_NAMED},
    /* a file in diffusers' form with a metadata alpha kept as it is */
    {"a MiniMax-H3 conversion", minimax_h3_lora_detect, minimax_h3_lora_convert, TRANSFORMER, AS_NAMED},
    {"a Stable Diffusion conversion", sd_lora_detect, sd_convert, SD, WITH_CONV},
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_write_input(data, size);
    nf4_clear_error();
    struct model *m;
    if (model_open_file(path, &m) != NF4_OK)
        return 0;
    for (size_t i = 0; i < sizeof CONVERSIONS / sizeof CONVERSIONS[0]; i++) {
        nf4_clear_error();
        struct model *out = NULL;
        if (!CONVERSIONS[i].detect(m))
            continue;
        check_result(CONVERSIONS[i].convert(m, path, 0, &out), out, CONVERSIONS[i].components, CONVERSIONS[i].allowed);
        fuzz_assert_only_input_left(CONVERSIONS[i].what);
    }
    model_close(m);
    /* diffusers' own form, maybe its older names: renamed per component in place */
    static const char *const PREFIXES[] = {"unet.", "text_encoder.", "text_encoder_2.", "transformer.", ""};
    for (size_t i = 0; i < sizeof PREFIXES / sizeof PREFIXES[0]; i++) {
        nf4_clear_error();
        if (model_open_file(path, &m) != NF4_OK)
            return 0;
        const size_t before = m->count;
        const int code = diffusers_lora_old_names(m, PREFIXES[i]);
        if (code != NF4_OK)
            fuzz_check_failure(code);
        for (size_t k = 0; code == NF4_OK && k < m->count; k++) {
            const char *name = m->tensors[k].t->name;
            FUZZ_ASSERT(k == 0 || strcmp(m->tensors[k - 1].t->name, name) < 0, "%s: names not distinct", name);
            FUZZ_ASSERT(!str_starts_with(PREFIXES[i], "text_encoder") || !str_starts_with(name, PREFIXES[i]) ||
                            !in_oldest_form(name),
                        "%s: left in the oldest form", name);
        }
        FUZZ_ASSERT(code != NF4_OK || m->count <= before, "%zu tensors from %zu", m->count, before);
        model_close(m);
    }
    return 0;
}
