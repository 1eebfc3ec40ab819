/* The JSON files of a Hugging Face model directory: config.json and the
 * *.safetensors.index.json, rewritten for the dequantized model. */
#ifndef NF4DEQ_MODEL_DIR_H
#define NF4DEQ_MODEL_DIR_H

#include <stddef.h>
#include <stdint.h>

/* Rewrites a config.json document: drops the top-level "quantization_config"
 * and, when dtype_name is not NULL, sets (or adds) "dtype" and "torch_dtype",
 * except in a diffusers config (one with "_diffusers_version"), which keeps
 * every other key as it is.
 * Works on the text, so the rest of the file keeps its exact formatting.
 * Returns NF4_OK or NF4_EDATA (the document is not a JSON object). */
int config_rewrite(const char *path, const char *json, size_t len, const char *dtype_name, char **out,
                   size_t *out_len);

struct index_out_entry {
    const char *tensor;
    const char *file;
};
/* Builds a model.safetensors.index.json the way transformers writes it (2-space
 * indent, sorted keys). metadata_json is the input index's "metadata" object or
 * NULL; total_size and total_parameters in it are replaced. `entries` must be
 * sorted by tensor name. */
int index_render(const char *path, const char *metadata_json, uint64_t total_size, uint64_t total_parameters,
                 const struct index_out_entry *entries, size_t n, char **out, size_t *out_len);

#endif
