/* model_index.json of a Flux.1 pipeline whose transformer a control LoRA
 * widened (lora_widen.h). The widened x_embedder takes the control image's
 * latents beside the noise's, which only diffusers' FluxControl pipelines
 * give it: DiffusionPipeline.from_pretrained of an index that still says
 * FluxPipeline loads the transformer without a word and feeds it latents of
 * in_channels / 4 channels, noise where the control image should be.
 * diffusers' own route to such a model (FluxControlPipeline.from_pretrained,
 * load_lora_weights, fuse_lora, save_pretrained) writes the control
 * pipeline's index: its _class_name, and none of FluxPipeline's optional
 * image_encoder and feature_extractor, which the control classes lack
 * (diffusers warns of either, null or not, as a config attribute it does not
 * expect). */
#ifndef NF4DEQ_CONTROL_INDEX_H
#define NF4DEQ_CONTROL_INDEX_H

#include <stddef.h>

/* The FluxControl class that uses a widened transformer where a pipeline of
 * class `cls` did: FluxControlPipeline for FluxPipeline,
 * FluxControlImg2ImgPipeline for FluxImg2ImgPipeline,
 * FluxControlInpaintPipeline for FluxInpaintPipeline, and each of those three
 * for itself; NULL for any other class (Kontext, Fill, Redux and ControlNet
 * pipelines have no control form) or none. */
const char *flux_control_class(const char *cls);

/* The index text json[0, len) (file `path`, named in messages) as that
 * control class's: *out (allocated, *out_len bytes) with "_class_name" set to
 * *to and "image_encoder" and "feature_extractor" left out, the rest byte
 * for byte; *out NULL where the class has no control form (*from then the
 * class found, or NULL) or is one already. *from is allocated. NF4_OK,
 * NF4_EDATA (not a JSON object, or a key twice: diffusers would read the
 * last), or NF4_ESOFTWARE. */
int control_index_rewrite(const char *path, const char *json, size_t len, char **from, const char **to, char **out,
                          size_t *out_len);

#endif
