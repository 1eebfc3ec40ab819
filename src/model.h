/* A checkpoint as a set of safetensors files with one tensor namespace: a single
 * file, or a model directory. A directory is a model when it holds exactly one
 * *.safetensors.index.json (model., diffusion_pytorch_model., ...) with the
 * shards it lists, or one or more *.safetensors files and no index. A bnb
 * weight's parts may sit in different shards; lookups here find them wherever
 * they are. */
#ifndef NF4DEQ_MODEL_H
#define NF4DEQ_MODEL_H

#include <stddef.h>

#include "safetensors.h"

#define INDEX_FILE_NAME "model.safetensors.index.json" /* transformers' name, in messages */
#define INDEX_FILE_SUFFIX ".safetensors.index.json"
#define WEIGHTS_FILE_SUFFIX ".safetensors"
#define CONFIG_FILE_NAME "config.json"
/* index.json and config.json are small; anything larger is not one of them. */
#define MAX_JSON_FILE_BYTES (64u << 20)

struct model_tensor {
    struct st_file *file;
    const struct st_tensor *t;
    size_t file_index;
};

struct model {
    char *dir;           /* NULL when the model is one file */
    int sharded;         /* has an index.json */
    char *index_name;    /* its file name in dir; NULL when not sharded */
    size_t nfiles;
    struct st_file **files;
    char **file_names;   /* names relative to dir (or the path itself for a single file) */
    size_t count;
    struct model_tensor *tensors; /* every tensor of every file, sorted by name */
    char *index_metadata_json;    /* the index's "metadata" object, printed compactly; NULL if none */
    /* The directory's other *.safetensors files (ones its index does not list,
     * hidden ones) and the indexes of other variants beside a plain one,
     * sorted: convert neither converts nor copies them, since transformers
     * could load one still quantized (or an index list tensors OUT no longer
     * has), and inspect names them. */
    char **unused_names;
    size_t nunused;
    int unnamed; /* one file no name reaches (model_open_fd_as): opened again only by model_reopen */
    /* config.json, in dir or beside the file: read when first asked for
     * (model_dir.h), then kept, so that everything it decides in a run and the
     * output's copy of it come from one reading. */
    struct model_config *config;
};

/* The candidate files of a directory, each list sorted by name. */
struct model_dir_files {
    char **indexes;  /* *.safetensors.index.json */
    size_t nindexes;
    char **weights;  /* *.safetensors */
    size_t nweights;
    char **hidden_weights; /* .*.safetensors: never candidates */
    size_t nhidden_weights;
};
/* Lists a directory's candidates (regular files through links; hidden names
 * are set apart). model_dir_is_model: any candidate at all. */
int model_dir_scan(const char *dir, struct model_dir_files *out);
void model_dir_files_free(struct model_dir_files *f);
int model_dir_is_model(const struct model_dir_files *f);
/* NF4_ENOINPUT, as model_open_dir says it, when dir holds no candidate at all. */
int model_dir_require(const char *dir);

int model_open_file(const char *path, struct model **out);
/* A model of the safetensors file open on `fd`, which it takes over (closed
 * on failure too), named `shown`: a file nf4deq wrote in place of `shown`
 * that has no name of its own (a converted LoRA, lora_rewrite.h). */
int model_open_fd_as(int fd, const char *shown, struct model **out);
/* `m`, a model of a file with no name (m->unnamed), opened again on a
 * duplicate of its descriptor: its own header and names, the same bytes. */
int model_reopen(const struct model *m, struct model **out);
/* Renames tensors of a one-file model: rename(name, arg, &new) gives each a
 * new name (allocated) or leaves *new NULL to keep it, and returns an NF4_*
 * code. NF4_EDATA where two tensors would then share a name. */
int model_rename_tensors(struct model *m, int (*rename)(const char *name, void *arg, char **renamed), void *arg);
/* Leaves out of the model (its lookups and its list; the file keeps them)
 * the tensors whose names `drop` says to; returns how many went. */
size_t model_drop_tensors(struct model *m, int (*drop)(const char *name));
/* The same, drop(name, arg) saying which. */
size_t model_drop_tensors_by(struct model *m, int (*drop)(const char *name, void *arg), void *arg);
/* A PyTorch checkpoint of tensors as a one-file model (torch_file.h). */
int model_open_torch_file(const char *path, struct model **out);
int model_open_dir(const char *dir, struct model **out);
void model_close(struct model *m);
const struct model_tensor *model_find(const struct model *m, const char *name);
/* Whether two tensors hold the same bytes in the same dtype and shape
 * (*equal), compared a bounded block at a time. NF4_OK, or a read's error. */
int model_tensors_equal(const struct model_tensor *a, const struct model_tensor *b, int *equal);
/* 1 for a name a checkpoint's file has: *.safetensors, or an index's
 * (PREFIX.safetensors.index.json, or a variant's, .index.fp16.json). */
int model_is_checkpoint_name(const char *name);
/* Why a weights file (or another variant's index) is not part of the model,
 * as a phrase for messages ("not listed in model.safetensors.index.json", "a
 * hidden file", "the index of another variant; ...", or, for one that is not
 * in m->unused_names, "not there when the model was read"). */
void model_unused_reason(const struct model *m, const char *name, char *buf, size_t cap);

/* Validates an index.json document and returns the shard file names it lists
 * (sorted, unique) and, per weight_map entry, name -> file. Pure: used by
 * model_open_dir, the tests and the fuzzer. `path` is only used in messages. */
struct index_entry {
    char *tensor;
    char *file;
};
int index_parse(const char *path, const char *json, size_t len, struct index_entry **entries, size_t *nentries,
                char ***files, size_t *nfiles, char **metadata_json);
void index_free(struct index_entry *entries, size_t nentries, char **files, size_t nfiles);

/* 1 if `path` (a file in model directory `dir`, maybe a symlink) resolves to a
 * place inside `dir`, or inside the blobs/ of the Hugging Face cache repository
 * `dir` is a snapshot of, or a folder of (.../models--X/snapshots/REV[/...] ->
 * .../models--X/blobs), which is how the hub cache stores every file.
 * Anything else escapes. */
int path_stays_in_model(const char *dir, const char *path);

/* 1 if `name` is acceptable as a shard file name: a plain file name inside the
 * model directory (no '/', not "." or "..", no control characters). */
int shard_name_is_safe(const char *name);

#endif
