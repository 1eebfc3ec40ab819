/* Who owns an output path while it is being written, and what the runs that
 * died left behind.
 *
 * Every temp nf4deq makes for OUT is named after it, beside it:
 * ".BASE.nf4deq-XXXXXX" (a file, or a directory for directory outputs), where
 * BASE is OUT's last component. A run first takes the lock file
 * ".BASE.nf4deq-lock" beside OUT with flock(LOCK_EX), holds it for as long as
 * it lives, and writes its owner record into it (pid, host, start time). So:
 *   - a second run for the same OUT finds the lock held and stops at once;
 *   - a run that finds the lock free owns every temp of OUT: any left there
 *     is from a run that did not finish (a stop that kept it for --resume,
 *     SIGKILL, an OOM kill, a machine that vanished), whose record is still
 *     in the lock file;
 *   - the kernel releases a flock when its process dies, however it dies.
 * The lock file goes when its run ends. */
#ifndef NF4DEQ_OUT_LOCK_H
#define NF4DEQ_OUT_LOCK_H

#include <stddef.h>
#include <stdint.h>

#define TEMP_MARKER ".nf4deq-"
#define TEMP_RANDOM_LEN 6 /* mkstemp's XXXXXX */
#define LOCK_SUFFIX "lock"
#define OWNER_RECORD_MAX 1024

/* What a lock file records about its run. */
struct owner_record {
    long long pid;
    long long started; /* seconds since the epoch */
    char host[256];
};

/* Parses a lock file's text ("nf4deq-owner 1", then "pid N", "host H",
 * "started T" lines). NF4_EDATA for anything else; `path` names it. */
int owner_record_parse(const char *path, const char *text, size_t len, struct owner_record *out);
/* "pid 123 on host, started 2026-11-23 10:01:02 UTC" (host only if not this
 * one), or "pid unknown" for a NULL record (a lock file that could not be read). */
void owner_record_describe(const struct owner_record *r, char *buf, size_t cap);

/* Kinds of nf4deq names in a directory (see above). */
enum temp_name_kind { TEMP_NAME_NONE, TEMP_NAME_TEMP, TEMP_NAME_LOCK };
/* Classifies a directory entry's name; *base_len is BASE's length. */
enum temp_name_kind temp_name_classify(const char *name, size_t *base_len);

struct out_lock;

/* Takes OUT's lock, before any work. NF4_ECANTCREAT "OUT: another nf4deq
 * (pid N, started ...) is writing it" when a live run holds it. The previous
 * owner record, if a run died holding the file, is kept for the messages of
 * out_lock_remove_stale. */
int out_lock_acquire(const char *out, struct out_lock **lk);

/* The stale temp directories of OUT holding a resume manifest named
 * `manifest` (--resume): the newest one, malloc'd, or NULL. Call before
 * out_lock_remove_stale. */
char *out_lock_find_resumable(const struct out_lock *lk, const char *manifest);

/* Removes OUT's stale temps but `keep` (may be NULL), each with a line on
 * stderr naming the run that left it. */
int out_lock_remove_stale(struct out_lock *lk, const char *keep);

/* The run that left the lock file without finishing ("pid 1234, started
 * ..."), or "pid unknown". */
void out_lock_describe_previous(const struct out_lock *lk, char *buf, size_t cap);

/* Removes the lock file and releases the lock (NULL is fine). */
void out_lock_release(struct out_lock *lk);

/* `nf4deq clean [-n] PATH`: every stale temp and lock file under PATH, when
 * it is a directory (searched down to a few levels, links not followed), and
 * those of runs that wrote PATH itself as their OUT, beside it (PATH a file,
 * a directory, or not there: exit 66 only if nothing of it is there either).
 * A temp whose lock is held is a live run's and is left alone, as is every
 * name that is not nf4deq's. Prints one line per item on `out`; with dry_run
 * removes nothing. */
int clean_run(const char *path, int dry_run, void *out_file);

#endif
