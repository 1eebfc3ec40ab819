/* safetensors reading (the writer is in safetensors_writer.h).
 *
 * The reader treats every file as hostile: the header is parsed and validated
 * against the rules of the reference implementation before anything else is
 * trusted, and tensor data is never read all at once (pread per range). */
#ifndef NF4DEQ_SAFETENSORS_H
#define NF4DEQ_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

/* The reference implementation's limit on the JSON header. */
#define ST_MAX_HEADER_BYTES 100000000ull
/* cJSON spends about 80 bytes on each value, so a header of "1," entries (a
 * shape of 15 million dimensions) would take 40 times its size. Real headers
 * hold one value per 15 bytes or more: 6.7 million at the 100 MB limit. This
 * bounds what the parse can take to about 1 GB, the header itself included
 * (985 MB peak RSS measured for 7.1 million values in a 100 MB header). */
#define ST_MAX_HEADER_VALUES 8000000ull
/* serde_json, the reference reader, refuses 128 levels of nesting. */
#define ST_MAX_HEADER_DEPTH 127

struct st_tensor {
    char *name;
    enum st_dtype dtype;
    size_t ndim;
    uint64_t *shape;
    uint64_t nelem;
    uint64_t begin, end; /* byte offsets relative to the start of the data */
    /* Its name in the user's file where nf4deq gave it another (a converted
     * LoRA's key, lora_rewrite.h; a renamed one, model_rename_tensors), for
     * messages; NULL: its name. Set through st_set_origin. */
    char *origin;
};

struct st_meta {
    char *key;
    char *value;
};

struct st_file {
    char *path;
    int fd;
    uint64_t file_size;
    int64_t mtime_ns;    /* at open: a later fstat that differs means the file changed */
    uint64_t data_start; /* 8 + header length */
    size_t count;
    struct st_tensor *tensors; /* in header order */
    struct st_tensor **by_name; /* sorted by name, for lookups */
    int has_metadata;
    size_t nmeta;
    struct st_meta *meta;
    int origins_shown; /* registered with nf4_origins_register */
};

/* Opens and validates `path`. Returns NF4_OK or NF4_ENOINPUT / NF4_EDATA /
 * NF4_EIO / NF4_ESOFTWARE with the reason recorded (naming the file and, where
 * there is one, the tensor). */
int st_open(const char *path, struct st_file **out);
/* st_open of the regular file open on `fd`, which it takes over (closed on
 * failure too); messages name `path`. */
int st_open_fd(int fd, const char *path, struct st_file **out);
void st_close(struct st_file *f);
/* Records `origin` (copied) as t's name in the user's file, f's errors
 * naming t by it from now on (status.h); nothing where it is t's own name.
 * NF4_OK or NF4_ESOFTWARE. */
int st_set_origin(struct st_file *f, struct st_tensor *t, const char *origin);
/* NF4_OK while the file has the size and mtime it had at open; otherwise
 * NF4_EIO naming it, with the sizes before and now. A file truncated, grown
 * or rewritten in place mid-conversion must not pass for a complete input.
 * (A file replaced by a rename is not seen: the open descriptor still reads
 * the old one, whole and consistent.) */
int st_check_unchanged(const struct st_file *f);

/* Validates a header already in memory: `len` bytes of JSON followed by
 * `data_len` bytes of tensor data. Used by st_open, the tests and the fuzzer.
 * On success fills f's tensor table (f->path is only used in messages). */
int st_parse_header(struct st_file *f, const char *json, size_t len, uint64_t data_len);
/* Frees what st_parse_header allocated (not f itself, path or fd). */
void st_free_header(struct st_file *f);

/* Fills f->by_name (allocated for f->count) from f->tensors, sorted; a name
 * twice is NF4_EDATA. For readers of other formats that fill the table too. */
int st_index_names(struct st_file *f);
const struct st_tensor *st_find(const struct st_file *f, const char *name);
uint64_t st_tensor_bytes(const struct st_tensor *t);

/* Reads `len` bytes at `offset` within tensor t. Short reads, EINTR and a file
 * that shrank underneath are all handled; failure is NF4_EIO. */
int st_read(const struct st_file *f, const struct st_tensor *t, uint64_t offset, void *buf, uint64_t len);

/* Checked arithmetic: return 0 on overflow. */
static inline int checked_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline int checked_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

#endif
