/* --resume: the record a directory conversion keeps, inside its temp
 * directory, of the shards it has finished, so that a run that dies (SIGTERM
 * or SIGHUP from a machine or service stopping, which keep them: fileio.h;
 * SIGKILL, an OOM kill, a machine that vanished) can be continued instead of
 * redone. SIGINT and failures remove them.
 *
 * The manifest (RESUME_MANIFEST_NAME, JSON) holds what shapes the output:
 *   - "options": nf4deq's version, --dtype and each --lora adapter (path,
 *     sizes and mtimes of its files);
 *   - "inputs": every file of the input model: name, size, mtime and a hash
 *     of its safetensors header;
 *   - "shards": each output shard finished, fsync'd and renamed into the temp
 *     directory, with its size.
 * It is rewritten atomically after every shard, and removed before the
 * directory is published. A later run keeps a shard only if the options and
 * every input match exactly and the shard is there with its recorded size;
 * everything else is redone, so the result is byte-identical to an
 * uninterrupted run. 64-bit numbers are decimal strings (JSON numbers are
 * doubles). */
#ifndef NF4DEQ_RESUME_H
#define NF4DEQ_RESUME_H

#include <stddef.h>
#include <stdint.h>

#include "convert.h"
#include "model.h"

/* Inside a directory output's temp directory; never published. */
#define RESUME_MANIFEST_NAME ".nf4deq-resume.json"

#define RESUME_FORMAT 1
#define RESUME_MAX_BYTES (16u << 20)

struct resume_input {
    char *file;
    uint64_t size;
    int64_t mtime_ns;
    uint64_t header_hash; /* FNV-1a 64 of the 8-byte length and the header */
};

struct resume_shard {
    char *file;
    uint64_t bytes; /* the shard file's size */
};

struct resume_manifest {
    char *options;
    struct resume_input *inputs;
    size_t ninputs;
    struct resume_shard *shards;
    size_t nshards, shards_cap;
};

/* Validates a manifest document (hostile input: it sits in a temp directory
 * anyone could have written). NF4_EDATA naming `path` when it is not one. */
int resume_manifest_parse(const char *path, const char *json, size_t len, struct resume_manifest *out);
/* The document, as resume_manifest_parse reads it back. NF4_ESOFTWARE
 * (naming `path`) when out of memory. */
int resume_manifest_render(const struct resume_manifest *m, const char *path, char **out, size_t *out_len);
void resume_manifest_free(struct resume_manifest *m);

/* 1 if both describe the same inputs and options (shards are not compared). */
int resume_same_source(const struct resume_manifest *a, const struct resume_manifest *b);
/* Appends a finished shard (copies the name). NF4_ESOFTWARE (naming `path`)
 * when out of memory. */
int resume_add_shard(struct resume_manifest *m, const char *path, const char *file, uint64_t bytes);
/* The recorded size of shard `file`, or -1 when it is not recorded. */
int64_t resume_shard_bytes(const struct resume_manifest *m, const char *file);

/* This run's source: options and every input file of m (no shards yet).
 * `untied`: the embedding the adapters part lm_head from (lora.h), or NULL:
 * it decides what the embedding's shard holds, and comes from config.json,
 * which the inputs do not cover. */
int resume_fingerprint(const struct model *m, const struct convert_opts *o, const char *untied,
                       struct resume_manifest *out);
/* Takes over `dir`, a dead run's temp directory (registered as this run's
 * temp): shards its manifest records for the same source, present with their
 * sizes, are added to `now` and kept; everything else in dir is removed.
 * *kept: how many. A manifest that is damaged or for another source keeps
 * nothing (and says so). */
int resume_adopt(const char *dir, struct resume_manifest *now, size_t *kept);
/* Records a shard just finished (fsync'd and renamed into dir), with its file
 * size: the manifest is rewritten atomically. file NULL writes it as it is
 * (a run's first manifest, before any shard). */
int resume_record_shard(const char *dir, struct resume_manifest *now, const char *file);

#endif
