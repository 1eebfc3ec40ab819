/* safetensors writing: tensors laid out as the reference serializer does, the
 * file published atomically (temp file in the same directory, fsync, rename). */
#ifndef NF4DEQ_SAFETENSORS_WRITER_H
#define NF4DEQ_SAFETENSORS_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "safetensors.h" /* struct st_meta, the checked arithmetic */

struct st_out_tensor {
    const char *name;
    enum st_dtype dtype;
    size_t ndim;
    const uint64_t *shape;
};

struct st_writer;

/* Plans the layout of `n` tensors, creates a temp file beside `path` and writes
 * the header. Tensors must then be written in the order st_writer_order gives,
 * each exactly st_tensor_bytes long. Metadata is carried over with
 * "format":"pt" added when missing. */
int st_writer_begin(struct st_writer **out, const char *path, const struct st_out_tensor *tensors, size_t n,
                    const struct st_meta *meta, size_t nmeta);
/* The same, written straight into `fd` (standard output) with no temp file:
 * the header needs only the shapes, so it goes first. `name` names the
 * stream in messages. finish and abort leave fd open; after a failure, what
 * was written stays written. */
int st_writer_begin_stream(struct st_writer **out, int fd, const char *name, const struct st_out_tensor *tensors,
                           size_t n, const struct st_meta *meta, size_t nmeta);
/* Index (into the array given to st_writer_begin) of the k-th tensor in file order. */
size_t st_writer_order(const struct st_writer *w, size_t k);
uint64_t st_writer_tensor_bytes(const struct st_writer *w, size_t index);
/* Appends the next `len` bytes of tensor data, in file order. */
int st_writer_write(struct st_writer *w, const void *buf, size_t len);
/* Before any tensor data is written: sends it through a mapping instead of
 * write(2) where that is faster for `threads` threads placing pieces at once
 * (mapped_writer.h: on tmpfs). Returns whether it now does. Then each piece
 * is placed with st_writer_write_at, from any thread and in any order, and
 * counted, in file order, with st_writer_account; st_writer_write is not used. */
int st_writer_map(struct st_writer *w, int threads);
/* Places `len` bytes at offset `at` of the tensor data. Safe from several
 * threads at once for disjoint ranges. */
int st_writer_write_at(struct st_writer *w, uint64_t at, const void *buf, size_t len);
/* Counts the next `len` bytes of tensor data as written (st_writer_write does
 * it for its own bytes); finish checks that every byte was. */
int st_writer_account(struct st_writer *w, size_t len);
/* Checks every byte was written, fsyncs, renames over `path`, fsyncs the directory. */
int st_writer_finish(struct st_writer *w);
/* Removes the temp file. Safe after a failed write or finish; frees w. */
void st_writer_abort(struct st_writer *w);
uint64_t st_writer_total_bytes(const struct st_writer *w);

#endif
