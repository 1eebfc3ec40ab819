/* Filling the data region of an output file from several threads at once,
 * through a shared mapping, where one write(2) stream is the limit.
 *
 * On tmpfs every write(2) to a file holds the file's lock, so one stream is as
 * fast as any number (measured on the H200 host, tests/perf/tmpfs_write.cu:
 * one thread 2.63 GB/s, four threads with pwrite(2) 2.62), while copies into a
 * shared mapping of the same file reach 3.56 GB/s from 4 threads and 4.40 from
 * 8 (docs/PERFORMANCE.md, "The GPU path against the CPU path"). One thread
 * alone copies into a mapping at 1.32 GB/s, so it takes at least
 * MAPPED_WRITER_MIN_THREADS.
 * On a disk file system the page cache's own write path wins, so it is used
 * only on tmpfs.
 *
 * Space is reserved with fallocate(2) before any byte lands in the mapping, so
 * a full file system fails a write with ENOSPC, as write(2) would, instead of
 * killing the process with SIGBUS. */
#ifndef NF4DEQ_MAPPED_WRITER_H
#define NF4DEQ_MAPPED_WRITER_H

#include <stddef.h>
#include <stdint.h>

/* fallocate(2) granule: the thread that first needs space past what is
 * reserved reserves this much more, so the others rarely wait for it. */
#define MAPPED_WRITER_RESERVE_STEP (UINT64_C(64) << 20)

struct mapped_writer;

/* Threads placing data at once below which one write(2) stream is as fast. */
#define MAPPED_WRITER_MIN_THREADS 2
#define OUTPUT_MAP_ENV "NF4DEQ_OUTPUT_MAP"

/* Whether an output file's data, placed by `threads` threads at once, should
 * go through a mapping: on tmpfs, from MAPPED_WRITER_MIN_THREADS on. The file
 * is the open `fd`, or (fd < 0) one to be created in directory `dir`.
 * NF4DEQ_OUTPUT_MAP=1 or 0 in the environment forces the choice either way,
 * whatever the threads (the tests and benchmarks use both). */
int mapped_writer_wanted(int fd, const char *dir, int threads);

/* Maps `len` bytes of `fd` from offset `start`, which must be the file's size
 * now (everything before it already written). Returns 0, or an errno value
 * with nothing mapped (the caller then writes with write(2)). */
int mapped_writer_open(struct mapped_writer **out, int fd, uint64_t start, uint64_t len);

/* Copies `len` bytes to offset `at` of the data region (start + at in the
 * file), reserving the space first. Safe from several threads at once for
 * disjoint ranges. Returns 0 or an errno value. */
int mapped_writer_write(struct mapped_writer *m, uint64_t at, const void *buf, size_t len);

/* Drops the pages of the data region before `end`, all written by now, from
 * this process's page tables: they stay in the file, and the process's
 * resident memory stays at the chunks in flight, as with write(2). Called in
 * file order, from one thread. */
void mapped_writer_release(struct mapped_writer *m, uint64_t end);

/* Unmaps; what was copied stays in the file, whose size is then start + the
 * space reserved so far. Returns 0 or an errno value. NULL is allowed. */
int mapped_writer_close(struct mapped_writer *m);

#endif
