/* Diffusers LoRAs: what diffusers' save_lora_weights writes (its training
 * scripts, FluxPipeline.save_lora_weights): one safetensors file,
 * pytorch_lora_weights.safetensors, holding PEFT's keys of each pipeline
 * component under the component's name instead of PEFT's prefix,
 *   transformer.<module>.lora_A.weight   [r, in]
 *   transformer.<module>.lora_B.weight   [out, r]
 *   text_encoder.<module>.lora_A.weight  (another component)
 * (and lora_magnitude_vector, lora_B.bias as PEFT saves them), and from
 * diffusers 0.34 on the adapter's LoraConfig in the file's metadata,
 * DIFFUSERS_LORA_METADATA: one JSON object of the config's keys, each
 * prefixed by its component ("transformer.r": 4). Without it diffusers
 * (0.40 on) takes each module's alpha to be its rank: scaling 1.
 *
 * lora.c binds such a file's keys as a PEFT adapter's, with the component's
 * prefix for PEFT's; this module finds the file, the component and the
 * config. */
#ifndef NF4DEQ_LORA_DIFFUSERS_H
#define NF4DEQ_LORA_DIFFUSERS_H

#include "lora.h"
#include "model.h"

#define DIFFUSERS_LORA_NAME "pytorch_lora_weights.safetensors"
/* What save_lora_weights(safe_serialization=False) writes instead. */
#define DIFFUSERS_LORA_PICKLE_NAME "pytorch_lora_weights.bin"
#define DIFFUSERS_LORA_METADATA "lora_adapter_metadata"
/* diffusers' name for the denoiser of every transformer pipeline (Flux, SD3, Sana, Wan...). */
#define DIFFUSERS_DEFAULT_COMPONENT "transformer"

/* Whether --lora ARG is a diffusers LoRA: a regular file (the weights
 * themselves), or a folder with no ADAPTER_CONFIG_NAME and
 * DIFFUSERS_LORA_NAME, or else DIFFUSERS_LORA_PICKLE_NAME, or one other
 * *.safetensors file. *weights: that file's path (allocated), or NULL for
 * anything else, which is read as a PEFT adapter folder. `warn`: say so when
 * a folder holds both kinds. NF4_OK, NF4_EUSAGE for a PEFT adapter's own
 * file, or NF4_ESOFTWARE when out of memory. */
int diffusers_lora_path(const char *arg, char **weights, int warn);

/* Whose LoRA loader reads a LoRA that is not in diffusers' form: diffusers
 * converts such a LoRA by the pipeline's class. */
enum lora_family {
    LORA_FAMILY_OTHER,      /* unknown: read as Flux.1's loader reads it */
    LORA_FAMILY_FLUX,       /* Flux.1's pipelines and transformer (not Flux2...) */
    LORA_FAMILY_FLUX2,      /* Flux2Pipeline, Flux2KleinPipeline, ... and Flux2Transformer2DModel */
    LORA_FAMILY_QWEN_IMAGE, /* QwenImagePipeline, QwenImageEditPipeline, ... and their transformer */
    LORA_FAMILY_WAN,        /* WanPipeline, WanImageToVideoPipeline, ..., SkyReelsV2..., LucyEdit...,
                               ChronoEdit..., AnyFlow..., Helios... and their transformers */
    LORA_FAMILY_LTX_VIDEO,  /* LTXPipeline, LTXImageToVideoPipeline, ... and LTXVideoTransformer3DModel */
    LORA_FAMILY_LTX2,       /* LTX2Pipeline, LTX2ImageToVideoPipeline, ..., EchoModularPipeline, their
                               transformer and connectors */
    LORA_FAMILY_HIDREAM,    /* HiDreamImagePipeline and its transformer */
    LORA_FAMILY_Z_IMAGE,    /* ZImagePipeline, ZImageImg2ImgPipeline, ... and ZImageTransformer2DModel */
    LORA_FAMILY_HUNYUAN_VIDEO, /* HunyuanVideoPipeline, ...ImageToVideo..., ...Framepack..., HunyuanSkyreels...
                                  HunyuanVideo15ModularPipeline and their transformers (not
                                  HunyuanVideo15Pipeline... or its transformer: no LoRA loader) */
    LORA_FAMILY_KREA2,      /* Krea2Pipeline, Krea2ModularPipeline and Krea2Transformer2DModel */
    LORA_FAMILY_IDEOGRAM4,  /* Ideogram4Pipeline, Ideogram4ModularPipeline and Ideogram4Transformer2DModel */
    LORA_FAMILY_LUMINA2,    /* Lumina2Pipeline and Lumina2Transformer2DModel */
    LORA_FAMILY_FLUX3,      /* Flux3ModularPipeline, ... and Flux3Transformer2DModel */
    LORA_FAMILY_ANIMA,      /* AnimaModularPipeline and AnimaTextConditioner (its transformer's class,
                               CosmosTransformer3DModel, is Cosmos' too, which converts nothing) */
    LORA_FAMILY_ACE_STEP,   /* AceStepPipeline and AceStepTransformer1DModel (and ACE-Step's other classes) */
    LORA_FAMILY_ERNIE_IMAGE, /* ErnieImagePipeline, ErnieImageModularPipeline and ErnieImageTransformer2DModel */
    LORA_FAMILY_MINIMAX_H3, /* MiniMaxH3ModularPipeline and MiniMaxH3Transformer3DModel (whose loader also
                               loads transformer_ref, pipeline_lora.c) */
    LORA_FAMILY_OWN_FORM,   /* the loaders that convert no other form: Stable Diffusion 3's, AuraFlow's,
                               CogVideoX's (and ConsisID's), Mochi's, Sana's, Kandinsky 5's, CogView4's,
                               BriaFibo2's, Cosmos 2.5 Predict's, RFD4Proteina's pipelines and transformers */
    LORA_FAMILY_STABLE_DIFFUSION, /* Stable Diffusion 1.x, 2.x and XL's pipelines (StableDiffusion..., not
                                     ...3; AnimateDiff..., Kolors..., LatentConsistencyModel..., PIA...,
                                     StableUnCLIP..., TextToVideo..., LEditsPP...) and UNet2DConditionModel */
};

/* The family of a pipeline's or a model's class name (model_index.json's or
 * config.json's _class_name; NULL: LORA_FAMILY_OTHER). */
enum lora_family diffusers_lora_family(const char *cls);
/* Whether a family's loader reads LoRAs by Flux.1's rules: Flux.1's own,
 * and an unknown class's (a weights file alone too), which follow them. */
int diffusers_flux1_rules(enum lora_family family);

/* Whether the LoRA loader of a pipeline of class `cls` is Stable Diffusion
 * XL's (StableDiffusionXLLoraLoaderMixin: StableDiffusionXL..., Kolors...,
 * AnimateDiffSDXL..., ...), the one that maps the SGM UNet's block names by
 * the UNet's config and loads text_encoder_2 too. */
int diffusers_loads_sdxl(const char *cls);

/* Whether the LoRA loader of a pipeline of class `cls` can load a LoRA's
 * transformer keys into its transformer_2 (Wan 2.2's second expert:
 * load_into_transformer_2, in Wan's and SkyReels-V2's loaders). */
int diffusers_loads_transformer_2(const char *cls);

/* *cls: the _class_name of the JSON file dir/name (allocated), or NULL where
 * it cannot be read or names no class. NF4_OK, or NF4_ESOFTWARE when memory
 * runs out (a class is never taken for missing then). */
int diffusers_class_name(const char *dir, const char *name, char **cls);

/* *cls: the class of the pipeline in folder `dir` (allocated): the
 * _class_name of its index (pipeline_index_name: model_index.json where it
 * holds one, else ModularPipeline's modular_model_index.json,
 * Flux3ModularPipeline, AnimaModularPipeline...); NULL where there is none,
 * or it cannot be read or names no class. NF4_OK or NF4_ESOFTWARE. */
int diffusers_pipeline_class(const char *dir, char **cls);

/* Opens a diffusers LoRA's weights: safetensors, or a torch.save pickle
 * (save_lora_weights(safe_serialization=False)), read as torch_file.h reads
 * a pickled PEFT adapter; one in another form as the loader of `family`
 * converts it (Flux.1's and others: kohya and ComfyUI, lora_kohya.h, and
 * XLabs', lora_xlabs.h; Flux.2's, lora_flux2.h; Qwen-Image's, lora_qwen.h;
 * Wan's, lora_wan.h; Z-Image's, lora_zimage.h; HunyuanVideo's,
 * lora_hunyuan.h; Lumina 2's, lora_lumina2.h; FLUX.3's, lora_flux3.h;
 * Anima's, lora_anima.h; ACE-Step's, lora_ace_step.h; ERNIE-Image's,
 * lora_ernie_image.h; MiniMax-H3's, lora_minimax_h3.h;
 * LTX-Video's, LTX-2's and HiDream's, lora_prefixed.h; Stable Diffusion's,
 * lora_sd.h),
 * saying what is left out where `warn`. */
int diffusers_lora_open(const char *path, enum lora_family family, int warn, struct model **out);

/* diffusers_lora_open, with the denoiser's config.json (`unet_config`, NULL:
 * none), which a Stable Diffusion loader maps the SGM UNet's block names by
 * (lora_sd.h), as a pipeline's loader passes it. */
int diffusers_lora_open_for(const char *path, enum lora_family family, const char *unet_config, int warn,
                            struct model **out);

/* Opens a diffusers LoRA for the model in folder `dir` (NULL: a file alone,
 * read as an unknown class), converted alone, as the loader that would load
 * it reads it: where `dir` is a pipeline's component (its parent holds
 * a pipeline index with a class, diffusers_pipeline_class), the pipeline's, with the UNet's config
 * for Stable Diffusion XL's, as a pipeline's conversion reads it (a text
 * encoder's folder, whose class has no loader, so takes a Stable Diffusion
 * LoRA as its pipeline does); else the folder's own class's, with its own
 * config.json (a UNet folder's maps SGM names by it). */
int diffusers_lora_open_for_dir(const char *path, const char *dir, int warn, struct model **out);
/* The family of the loader diffusers_lora_open_for_dir reads a LoRA `path`
 * for `dir` with. NF4_OK or NF4_ESOFTWARE (*family is then OTHER). */
int diffusers_lora_family_of_dir(const char *path, const char *dir, enum lora_family *family);

/* A pipeline component's own opening of a LoRA that its pipeline's loader
 * read in diffusers' own form (diffusers_lora_open_for gave a model that
 * has its name; a converted one is opened again with model_reopen): the
 * file's weights, DoRA scales dropped, unwarned (the pipeline's opening
 * warned). Not by the component's class, whose loader is not the one that
 * reads it. */
int diffusers_lora_open_own_form(const char *path, struct model **out);

/* The key prefix ("transformer.", allocated) of the component of `weights`
 * that goes on `base`: `component` where given (a pipeline's, lora_open_component),
 * else the base folder's name (transformer/ of a pipeline) where keys start
 * with it, else DIFFUSERS_DEFAULT_COMPONENT, else none where the keys name
 * the base's tensors themselves. Keys of other components are left out, with
 * one warning (not for a pipeline's component). NF4_EDATA, naming the file
 * and the components it holds, when none is the base's. */
int diffusers_lora_prefix(const struct model *weights, const struct model *base, const char *component,
                          char **prefix);

/* diffusers 0.42 with transformers 5, whose CLIPTextModel has no text_model
 * any more, removes "text_model." from the keys it loads into a text
 * encoder; the encoder's tensors on disk may still have it (saved by
 * transformers 4), as transformers maps them on loading. For a text
 * encoder's prefix ("text_encoder.", "text_encoder_2."), renames the keys
 * under it so that they name `base`'s tensors: "text_model." added or
 * removed as the base has it, but for a key whose module the base has as it
 * is (CLIPTextModelWithProjection's text_projection, outside text_model). */
int diffusers_lora_align_text_model(struct model *weights, const char *prefix, const struct model *base);

/* How many keys of `weights` are under "<component>.". */
size_t diffusers_lora_keys_for(const struct model *weights, const char *component);

/* Warns, once per LoRA, about keys for components the pipeline does not have
 * (`components`, n of them), which are not merged; NF4_EDATA when that is
 * every key (another pipeline's LoRA, or one model's with no component
 * before its keys, as ModelMixin.save_lora_adapter writes). Read with
 * Flux.1's rules (`flux1_rules`), its network alphas are checked first
 * (lora_alphas.h) and belong to no component. */
int diffusers_lora_check_components(const struct model *weights, const char *const *components, size_t n,
                                    int flux1_rules);

/* The file's lora_adapter_metadata (DIFFUSERS_LORA_METADATA), or NULL
 * where diffusers reads none (json.loads(raw) if raw else None): no such
 * entry, "", or JSON's null (whitespace around it). Whitespace alone is
 * returned, and refused as no JSON, where diffusers raises. */
const char *diffusers_lora_metadata(const struct model *w);

/* The adapter's config, checked by lora_config_parse, from the metadata's
 * entries of the prefix's component; without any, what diffusers infers:
 * each pair's own rank as r and alpha (c->rank_from_shapes), and use_dora and
 * lora_bias where the keys hold magnitudes or biases; read with Flux.1's
 * rules (`flux1_rules`), alpha from the network alphas where the component
 * has some (lora_alphas.h, c->alphas_given). */
int diffusers_lora_config(const struct model *weights, const char *prefix, int flux1_rules, struct lora_config *c);

#endif
