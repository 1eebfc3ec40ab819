/* What an input path is: one safetensors file, a model directory (model.h), or
 * a diffusers pipeline, a directory with model_index.json (DiffusionPipeline's)
 * or modular_model_index.json (ModularPipeline's) whose sub-directories are
 * its components. Used by convert and inspect alike. */
#ifndef NF4DEQ_LAYOUT_H
#define NF4DEQ_LAYOUT_H

#include <stddef.h>

#define PIPELINE_INDEX_NAME "model_index.json"
/* ModularPipeline.save_pretrained's index (diffusers 0.42): its components
 * record where they were loaded from, but ModularPipeline.from_pretrained of
 * a folder loads each component whose files the folder holds from the folder
 * (_is_local_component), so a byte copy of it loads the converted ones. */
#define MODULAR_PIPELINE_INDEX_NAME "modular_model_index.json"

enum input_layout { LAYOUT_FILE, LAYOUT_MODEL_DIR, LAYOUT_PIPELINE };

/* The index file that makes folder `dir` a pipeline: PIPELINE_INDEX_NAME
 * where it holds that regular file, else MODULAR_PIPELINE_INDEX_NAME where
 * it holds that one, else NULL. */
const char *pipeline_index_name(const char *dir);

/* Classifies an existing path. NF4_ENOINPUT for what is neither a file nor
 * a directory. */
int layout_of(const char *path, enum input_layout *out);

/* What convert does with each entry, and inspect says it will. */
enum pipeline_entry_kind {
    ENTRY_COMPONENT,  /* a sub-directory that is a model directory: converted or copied */
    ENTRY_DIR,        /* any other sub-directory (tokenizer, scheduler): copied */
    ENTRY_FILE,       /* a regular file (model_index.json, README.md, images): copied */
    ENTRY_CHECKPOINT, /* a *.safetensors file beside the components: not copied,
                         as it would stay quantized */
    ENTRY_OTHER,      /* a link to a directory, to nothing or out of the
                         pipeline, a socket...: not copied */
};

struct pipeline_entry {
    char *name;
    enum pipeline_entry_kind kind;
};

/* The entries of a pipeline's root, sorted by name, without hidden
 * directories (.cache of `hf download --local-dir`, .git). A component that is
 * a link must stay inside the pipeline (or its Hugging Face cache
 * repository), and so must the index (pipeline_index_name): NF4_EDATA
 * otherwise. */
int pipeline_list(const char *root, struct pipeline_entry **out, size_t *n);
void pipeline_entries_free(struct pipeline_entry *e, size_t n);

#endif
