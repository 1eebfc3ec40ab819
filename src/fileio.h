/* Low-level file helpers: full reads and writes that survive EINTR and short
 * transfers, and the registry of temp paths removed on failure or on a signal. */
#ifndef NF4DEQ_FILEIO_H
#define NF4DEQ_FILEIO_H

#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/types.h>

/* 0 on success; -1 with errno set (a read past EOF sets errno to EIO... see
 * read_full_at's comment). */
int read_full_at(int fd, void *buf, size_t len, uint64_t offset);
int write_full(int fd, const void *buf, size_t len);

/* Opens an input for reading; anything but a regular file (a FIFO, a
 * device, a directory) is refused without blocking: NF4_ENOINPUT, or NF4_EIO
 * where fstat fails. */
int open_regular_file(const char *path, int *fd, struct stat *st);

/* Reads a whole small file (config.json, index.json) into a NUL-terminated
 * buffer, refusing files over max_bytes. Returns an NF4_* code. */
int read_small_file(const char *path, size_t max_bytes, char **out, size_t *out_len);

/* Writes `data` to `path` atomically (temp file, fsync, rename). NF4_* code. */
int write_file_atomic(const char *path, const void *data, size_t len);

/* Makes a uniquely named temp file beside `path` (same directory), registered
 * for removal. Returns fd or -1 (errno). *tmp_path is malloc'd. */
int create_temp_beside(const char *path, char **tmp_path);
/* Same, for a directory. Returns 0 or -1 (errno). */
int create_temp_dir_beside(const char *path, char **tmp_path);
/* Gives a finished temp directory the mode a plain mkdir would (under
 * fileio_limit_modes_to), before it is published; 0, or -1 with errno. */
int dir_take_creation_mode(const char *dir);
/* A read-write temp file in `dir` that no name reaches, so that no exit, not
 * even SIGKILL, leaves it behind: O_TMPFILE, or where the file system lacks
 * it a mkstemp'd name unlinked before the call returns. Returns fd or -1
 * (errno). *shown (malloc'd) names it in messages: "DIR/PREFIX-... (unnamed)". */
int create_unnamed_temp(const char *dir, const char *prefix, char **shown);

/* Temp paths removed by cleanup_temps() and by the SIGINT/SIGTERM/SIGHUP handler.
 * Files before directories, newest first. */
void temp_register(const char *path, int is_dir);
void temp_unregister(const char *path);
/* Forgets `prefix` and every path below it (once a temp directory is published). */
void temp_unregister_prefix(const char *prefix);
void cleanup_temps(void);
/* New outputs (create_temp_beside's files; create_temp_dir_beside's
 * directories once dir_take_creation_mode is called) get the mode a plain
 * create gives them, less what `source`
 * (the input's mode) does not grant its group and others: a private model
 * converts to a private output, as cp copies it. The owner keeps read and
 * write (and search, for a directory) whatever the input's. */
void fileio_limit_modes_to(mode_t source);
/* Gives each regular file directly in `dir` that has a namesake in `src_dir`
 * no more than that file's permissions (the owner keeps read and write), as
 * cp -r gives each copy its own source's: a converted shard, config.json or
 * index no more open than the input's. NF4_OK, or NF4_ECANTCREAT naming the
 * file it could not change. */
int limit_modes_to_namesakes(const char *dir, const char *src_dir);
/* The signals whose default action ends the process, but for SIGKILL (which
 * cannot be caught), SIGXFSZ and the faults a bug raises (SIGSEGV, SIGBUS,
 * ...): SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGALRM, SIGUSR1, SIGUSR2,
 * SIGVTALRM, SIGPROF, SIGXCPU, SIGIO, SIGPWR, SIGSTKFLT and the real-time
 * signals. *list points to them; returns how many. */
size_t cleanup_signals(const int **list);
/* Removes the temps on each of cleanup_signals, then dies of the signal; one
 * that was ignored at start (nohup's SIGHUP) stays ignored. SIGXFSZ is
 * ignored, so that a write past the file size limit (ulimit -f) fails with
 * EFBIG and is reported as any write error. */
void install_signal_cleanup(void);
/* pthread_create for nf4deq's own threads (workers, the GPU start): they
 * never take the cleanup signals, so the cleanup handler runs on the calling
 * thread, whose temp registrations it cannot race. */
int thread_create_blocking_signals(pthread_t *thread, void *(*fn)(void *), void *arg);
/* SIGTERM and SIGHUP (a machine or service stopping) leave what is marked
 * here, and print the note: a directory conversion's temp directory, its
 * resume manifest and its finished shards, for --resume (resume.h). The lock
 * file is kept only beside them (temp_keep_with_others). SIGINT and any
 * failure still remove everything. */
void temp_keep_on_stop(const char *path);
void temp_keep_with_others(const char *path);
void temp_set_stop_note(const char *note);

/* At start-up: a closed stdin, stdout or stderr is reopened (stdout on
 * /dev/full, the others on /dev/null), so no file nf4deq opens can take its
 * number and receive what was meant for the stream (or be read as stdin).
 * std_stream_was_closed then tells which were. */
void guard_std_streams(void);
int std_stream_was_closed(int fd);

/* fsyncs the directory holding `path` so a rename into it is durable. */
int fsync_parent_dir(const char *path);
/* fsyncs a directory's own entries (what was created or renamed in it). */
int fsync_dir(const char *dir);

/* The entries of a directory but "." and "..", sorted by name (malloc'd).
 * 0, or -1 with errno (ENOMEM when out of memory). */
int dir_names(const char *dir, char ***names, size_t *n);
void dir_names_free(char **names, size_t n);
/* dir_names for callers that report: NF4_OK, or `code` with "DIR: cannot list"
 * and the system's reason (NF4_ESOFTWARE "out of memory" when that was it).
 * On failure *names is NULL and *n 0: a loop over them and the free are no-ops. */
int dir_list(const char *dir, int code, char ***names, size_t *n);

/* Directory part and base name of a path, malloc'd ("." for a bare name). */
char *path_dirname(const char *path);
char *path_join(const char *dir, const char *name);

#endif
