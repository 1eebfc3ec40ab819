/* The JSON files of a Hugging Face model directory: config.json and the
 * *.safetensors.index.json, rewritten for the dequantized model. */
#ifndef NF4DEQ_MODEL_DIR_H
#define NF4DEQ_MODEL_DIR_H

#include <stddef.h>
#include <stdint.h>

/* What a conversion changes in config.json. */
struct config_changes {
    const char *dtype_name; /* the output's torch dtype name, or NULL */
    int untie;              /* a merge wrote lm_head apart from the embedding it was tied to */
    uint64_t vocab_size;    /* the embedding layers' rows where a merge resized them, else 0 */
    /* Where a merge widened a Flux.1 transformer's x_embedder (lora.h): its
     * inputs, and the base's, which out_channels keeps; else 0. */
    uint64_t in_channels, base_in_channels;
    int every_tensor; /* dtype_name is every floating tensor's (--dtype): the parts' configs say it too */
};

/* Rewrites a config.json document: drops the top-level "quantization_config"
 * and, when dtype_name is not NULL, sets (or adds) "dtype" and "torch_dtype",
 * except in a diffusers config (one with "_diffusers_version"), which keeps
 * every other key as it is. With `untie` it sets (or adds)
 * "tie_word_embeddings": false, in "text_config" too. With a vocab_size it
 * sets "vocab_size" where the top level or "text_config" has it, and adds it
 * at the top level where neither does. With in_channels it sets (or adds)
 * "in_channels", and "out_channels" to base_in_channels where it is null or
 * missing: FluxTransformer2DModel takes out_channels None as in_channels.
 * With every_tensor, each "dtype" and "torch_dtype" string in the parts'
 * configs below the top level (objects that name a model_type: text_config,
 * vision_config, ..., and those inside them) is set to dtype_name too. Works on the text, so the rest of the file keeps its exact formatting.
 * Returns NF4_OK or NF4_EDATA (the document is not a JSON object). */
int config_rewrite(const char *path, const char *json, size_t len, const struct config_changes *ch, char **out,
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

/* The output head transformers ties to the input embedding (its
 * _tied_weights_keys: lm_head.weight to model.embed_tokens.weight). */
#define TIED_HEAD_NAME "lm_head.weight"
/* *embedding: the tensor m's head is tied to, when m stores no TIED_HEAD_NAME
 * but an input embedding transformers ties one to (model.embed_tokens.weight,
 * transformer.wte.weight, model.shared.weight, ...) and its config.json
 * (beside a single file) does not say tie_word_embeddings: false; else NULL.
 * A failed read of config.json is the error. */
struct model;
int model_tied_embedding(const struct model *m, const char **embedding);
/* 1 if `embedding` (one model_tied_embedding gives) is an encoder-decoder's
 * shared embedding (T5's shared.weight, BART's model.shared.weight, ...),
 * whose tie_word_embeddings ties the encoder's and decoder's input
 * embeddings to it too (and in the T5 family scales the decoder's output):
 * a head parted from it leaves config.json's flag as it is, and transformers
 * 5, finding the head and the embedding both stored and unequal, loads them
 * apart. */
int model_tie_flag_ties_more(const char *embedding);
/* A model's config.json as read once (struct model's config): made empty
 * with the model, read when first asked for by the calls below, freed with
 * the model. */
struct model_config;
struct model_config *model_config_new(void);
void model_config_free(struct model_config *c);
/* *text, *len: the bytes of m's config.json, NUL-terminated (NULL where
 * there is none), as every call here reads it: the output's config.json is
 * rewritten from them. A model directory's config.json that cannot be read
 * (a directory, a FIFO, too large) is the error, as is one that holds a key
 * twice where nf4deq reads keys; a single file's neighbour is taken only
 * where it is a regular file. */
int model_config_text(const struct model *m, const char **text, size_t *len);
/* *model_type: config.json's "model_type" (allocated), from m's directory or
 * beside its single file; *text_model_type: its "text_config"'s, the
 * language model's of a multimodal one (allocated). Each NULL where there is
 * none. A failed read of config.json is the error. */
int model_config_type(const struct model *m, char **model_type, char **text_model_type);
/* *model_type: the "model_type" of config.json's object `part` (a composite
 * model's "encoder" or "decoder"; NULL: the top level's, as
 * model_config_type reads it), allocated, or NULL where there is none. */
int model_config_part_type(const struct model *m, const char *part, char **model_type);
/* The rows of a causal LM's input embedding (the names above), or 0 where m
 * has none of them. */
uint64_t model_embedding_rows(const struct model *m);

#endif
