#include "out_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "file_copy.h"
#include "fileio.h"
#include "status.h"
#include "strbuf.h"

#define OWNER_MAGIC "nf4deq-owner 1"
/* A lock file that vanishes or is replaced between open and flock is retried
 * (another run was just ending), and so is one held for a moment (by `nf4deq
 * clean`): LOCK_ATTEMPTS tries LOCK_RETRY_NS apart, about a second in all. */
#define LOCK_ATTEMPTS 20
#define LOCK_RETRY_NS 50000000L
/* `clean` looks this deep below DIR: OUTs sit in DIR or a few levels down. */
#define CLEAN_MAX_DEPTH 4

struct out_lock {
    char *path;   /* the lock file */
    char *dir;    /* OUT's directory */
    char *prefix; /* ".BASE.nf4deq-" */
    int fd;
    int have_previous;
    struct owner_record previous; /* the run that left the lock file, if it did not finish */
};

/* ---- the owner record ---- */

static int parse_ll(const char *s, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < 0)
        return 0;
    *out = v;
    return 1;
}

/* The parser itself, without messages: 0 when the text is not a record. */
static int parse_record(const char *text, size_t len, struct owner_record *out)
{
    memset(out, 0, sizeof *out);
    out->pid = -1;
    out->started = -1;
    if (len > OWNER_RECORD_MAX)
        return 0;
    char buf[OWNER_RECORD_MAX + 1];
    memcpy(buf, text, len);
    buf[len] = '\0';
    if (strlen(buf) != len || len == 0 || buf[len - 1] != '\n')
        return 0;
    char *save = NULL;
    int line_no = 0;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save), line_no++) {
        if (line_no == 0) {
            if (strcmp(line, OWNER_MAGIC) != 0)
                return 0;
            continue;
        }
        char *space = strchr(line, ' ');
        if (!space)
            return 0;
        *space = '\0';
        const char *key = line, *value = space + 1;
        int ok;
        if (strcmp(key, "pid") == 0) {
            ok = out->pid < 0 && parse_ll(value, &out->pid);
        } else if (strcmp(key, "started") == 0) {
            ok = out->started < 0 && parse_ll(value, &out->started);
        } else if (strcmp(key, "host") == 0) {
            ok = !out->host[0] && value[0] && strlen(value) < sizeof out->host;
            for (const unsigned char *p = (const unsigned char *)value; ok && *p; p++)
                ok = *p > 0x20 && *p != 0x7f;
            if (ok)
                strcpy(out->host, value);
        } else {
            ok = 0;
        }
        if (!ok)
            return 0;
    }
    return line_no == 4 && out->pid >= 0 && out->started >= 0 && out->host[0];
}

int owner_record_parse(const char *path, const char *text, size_t len, struct owner_record *out)
{
    if (!parse_record(text, len, out))
        return nf4_fail(NF4_EDATA, path, NULL, "not a valid nf4deq owner record");
    return NF4_OK;
}

static void this_host(char *buf, size_t cap)
{
    if (gethostname(buf, cap) != 0 || !buf[0])
        snprintf(buf, cap, "unknown");
    buf[cap - 1] = '\0';
    for (char *p = buf; *p; p++) /* one word, as the record's syntax needs */
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            *p = '_';
}

void owner_record_describe(const struct owner_record *r, char *buf, size_t cap)
{
    if (!r) {
        snprintf(buf, cap, "pid unknown");
        return;
    }
    char host[256], when[64] = "at an unknown time";
    this_host(host, sizeof host);
    time_t t = (time_t)r->started;
    struct tm tm;
    if (r->started >= 0 && gmtime_r(&t, &tm))
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
    int other = strcmp(host, r->host) != 0;
    snprintf(buf, cap, "pid %lld%s%s, started %s", r->pid, other ? " on " : "", other ? r->host : "", when);
}

/* ---- names ---- */

static int is_random_char(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
}

enum temp_name_kind temp_name_classify(const char *name, size_t *base_len)
{
    size_t n = strlen(name), marker = strlen(TEMP_MARKER);
    if (n < 1 + 1 + marker || name[0] != '.')
        return TEMP_NAME_NONE;
    size_t lock = strlen(LOCK_SUFFIX);
    /* ".B.nf4deq-lock"; a random part may end in "lock" too (".B.nf4deq-ablock"). */
    if (n >= 1 + 1 + marker + lock && strcmp(name + n - lock, LOCK_SUFFIX) == 0 &&
        strncmp(name + n - lock - marker, TEMP_MARKER, marker) == 0) {
        *base_len = n - lock - marker - 1;
        return TEMP_NAME_LOCK;
    }
    size_t tail = TEMP_RANDOM_LEN;
    if (n < 1 + 1 + marker + tail || strncmp(name + n - tail - marker, TEMP_MARKER, marker) != 0)
        return TEMP_NAME_NONE;
    *base_len = n - tail - marker - 1;
    for (size_t i = n - tail; i < n; i++)
        if (!is_random_char(name[i]))
            return TEMP_NAME_NONE;
    return TEMP_NAME_TEMP;
}

/* ---- the lock ---- */

static void lock_free(struct out_lock *lk)
{
    if (!lk)
        return;
    if (lk->fd >= 0)
        close(lk->fd);
    free(lk->path);
    free(lk->dir);
    free(lk->prefix);
    free(lk);
}

/* Reads the record in an open lock file; 0 if there is none or it is not
 * valid (a damaged record is no reason to fail: it only names the owner). */
static int read_record(int fd, struct owner_record *r)
{
    char buf[OWNER_RECORD_MAX + 1];
    ssize_t got = pread(fd, buf, sizeof buf, 0);
    return got > 0 && parse_record(buf, (size_t)got, r);
}

static int write_record(int fd)
{
    char host[256], text[OWNER_RECORD_MAX];
    this_host(host, sizeof host);
    int len = snprintf(text, sizeof text, OWNER_MAGIC "\npid %lld\nhost %s\nstarted %lld\n", (long long)getpid(), host,
                       (long long)time(NULL));
    if (ftruncate(fd, 0) != 0)
        return -1;
    return len > 0 && pwrite(fd, text, (size_t)len, 0) == len ? 0 : -1;
}

enum lock_result { LOCK_TAKEN, LOCK_HELD_BY_OTHER, LOCK_ERROR };

/* Opens (creating it if `create`) and flocks a lock file, retrying when it
 * was replaced meanwhile, and for a moment when someone holds it: `nf4deq
 * clean` holds a dead run's lock briefly, a live run for as long as it lives.
 * LOCK_TAKEN: *fd is ours and *created says whether this call made the file.
 * LOCK_HELD_BY_OTHER: *holder filled when its record is readable (*known).
 * LOCK_ERROR: errno says why (ENOENT without `create` when there is none). */
static enum lock_result open_locked(const char *path, int create, int *fd_out, int *created,
                                    struct owner_record *holder, int *known)
{
    *known = 0;
    for (int attempt = 0; attempt < LOCK_ATTEMPTS; attempt++) {
        *created = 0;
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0 && errno == ENOENT && create) {
            fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
            *created = fd >= 0;
            if (fd < 0 && errno == EEXIST)
                continue; /* made by another run just now */
        }
        if (fd < 0)
            return LOCK_ERROR;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int e = errno;
            *known = read_record(fd, holder);
            close(fd);
            if (e != EWOULDBLOCK) {
                errno = e;
                return LOCK_ERROR;
            }
            if (attempt + 1 < LOCK_ATTEMPTS) {
                struct timespec pause = {0, LOCK_RETRY_NS};
                nanosleep(&pause, NULL);
                continue;
            }
            return LOCK_HELD_BY_OTHER;
        }
        struct stat held, now;
        if (fstat(fd, &held) == 0 && stat(path, &now) == 0 && held.st_dev == now.st_dev &&
            held.st_ino == now.st_ino) {
            *fd_out = fd;
            return LOCK_TAKEN;
        }
        close(fd); /* the run that held it removed it as we opened it: start again */
    }
    errno = EAGAIN;
    return LOCK_ERROR;
}

/* A full or failing disk is a write failure (exit 74), as it is for the data;
 * anything else keeps OUT from being created (73). */
static int lock_errno_code(int e)
{
    return e == ENOSPC || e == EDQUOT || e == EIO ? NF4_EIO : NF4_ECANTCREAT;
}

/* Takes OUT's lock for this run. The path becomes a temp of this run only
 * once the run holds it: a failed attempt must never remove another run's. */
static int take(struct out_lock *lk, const char *out)
{
    struct owner_record r;
    int fd = -1, created, known;
    switch (open_locked(lk->path, 1, &fd, &created, &r, &known)) {
    case LOCK_TAKEN:
        lk->fd = fd;
        temp_register(lk->path, 0);
        temp_keep_with_others(lk->path); /* its record names the run beside what a stop keeps */
        return NF4_OK;
    case LOCK_HELD_BY_OTHER: {
        char who[400];
        owner_record_describe(known ? &r : NULL, who, sizeof who);
        return nf4_fail(NF4_ECANTCREAT, out, NULL, "another nf4deq (%s) is writing it", who);
    }
    default: {
        /* Its directory missing or no directory: say that, not the lock file's name. */
        const int err = errno;
        struct stat st;
        if ((err == ENOENT || err == ENOTDIR) && stat(lk->dir, &st) != 0)
            return nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL, "cannot be created in %s", lk->dir);
        if (err == ENOTDIR || (err == ENOENT && !S_ISDIR(st.st_mode)))
            return nf4_fail(NF4_ECANTCREAT, out, NULL, "cannot be created in %s, which is not a directory", lk->dir);
        return nf4_fail_errno(lock_errno_code(err), err, out, NULL, "cannot take its lock file %s", lk->path);
    }
    }
}

int out_lock_acquire(const char *out, struct out_lock **out_lk)
{
    *out_lk = NULL;
    struct out_lock *lk = calloc(1, sizeof *lk);
    if (!lk)
        return nf4_fail(NF4_ESOFTWARE, out, NULL, "out of memory");
    lk->fd = -1;
    const char *slash = strrchr(out, '/');
    const char *base = slash ? slash + 1 : out;
    /* The longest name beside OUT is a temp: "." OUT's name TEMP_MARKER random. */
    const size_t extra = 1 + strlen(TEMP_MARKER) + TEMP_RANDOM_LEN;
    if (strlen(base) + extra > NAME_MAX) {
        free(lk);
        return nf4_fail(NF4_ECANTCREAT, out, NULL, "name is %zu bytes: nf4deq writes its temp files beside OUT under "
                        "names %zu bytes longer, and a name can have %d; choose a shorter one", strlen(base), extra,
                        NAME_MAX);
    }
    struct strbuf prefix = {0}, path = {0};
    lk->dir = path_dirname(out);
    strbuf_printf(&prefix, "." "%s" TEMP_MARKER, base);
    if (lk->dir && !prefix.oom)
        strbuf_printf(&path, "%s/%s" LOCK_SUFFIX, lk->dir, prefix.p);
    lk->prefix = prefix.p;
    lk->path = path.p;
    if (!lk->dir || prefix.oom || path.oom || !lk->prefix || !lk->path) {
        lock_free(lk);
        return nf4_fail(NF4_ESOFTWARE, out, NULL, "out of memory");
    }
    int code = take(lk, out);
    if (code != NF4_OK) {
        lock_free(lk);
        return code;
    }
    lk->have_previous = read_record(lk->fd, &lk->previous);
    if (write_record(lk->fd) != 0) {
        code = nf4_fail_errno(lock_errno_code(errno), errno, out, NULL, "cannot write its lock file %s", lk->path);
        out_lock_release(lk);
        return code;
    }
    *out_lk = lk;
    return NF4_OK;
}

/* Calls fn on every stale temp of OUT (we hold the lock: all of them are). */
static int each_temp(const struct out_lock *lk, int (*fn)(const struct out_lock *, const char *, void *), void *arg)
{
    char **names;
    size_t n;
    int code = dir_list(lk->dir, NF4_ECANTCREAT, &names, &n);
    size_t plen = strlen(lk->prefix);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        size_t base_len;
        if (strncmp(names[i], lk->prefix, plen) != 0 || strlen(names[i]) != plen + TEMP_RANDOM_LEN ||
            temp_name_classify(names[i], &base_len) != TEMP_NAME_TEMP)
            continue;
        char *p = path_join(lk->dir, names[i]);
        code = p ? fn(lk, p, arg) : nf4_fail(NF4_ESOFTWARE, lk->dir, NULL, "out of memory");
        free(p);
    }
    dir_names_free(names, n);
    return code;
}

struct resumable {
    const char *manifest;
    char *best;
    int64_t best_mtime;
};

static int consider_resumable(const struct out_lock *lk, const char *temp, void *arg)
{
    (void)lk;
    struct resumable *r = arg;
    char *m = path_join(temp, r->manifest);
    struct stat st, dir;
    /* Only a real directory of this user: never a link into somewhere else. */
    if (lstat(temp, &dir) == 0 && S_ISDIR(dir.st_mode) && dir.st_uid == geteuid() && m && lstat(m, &st) == 0 &&
        S_ISREG(st.st_mode)) {
        int64_t t = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
        char *copy = (!r->best || t > r->best_mtime) ? strdup(temp) : NULL;
        if (copy) {
            free(r->best);
            r->best = copy;
            r->best_mtime = t;
        }
    }
    free(m);
    return NF4_OK;
}

char *out_lock_find_resumable(const struct out_lock *lk, const char *manifest)
{
    struct resumable r = {manifest, NULL, 0};
    if (each_temp(lk, consider_resumable, &r) != NF4_OK) {
        free(r.best);
        return NULL;
    }
    return r.best;
}

static int remove_one(const struct out_lock *lk, const char *temp, void *arg)
{
    const char *keep = arg;
    if (keep && strcmp(keep, temp) == 0)
        return NF4_OK;
    char who[400];
    out_lock_describe_previous(lk, who, sizeof who);
    if (remove_path(temp) != 0)
        return nf4_fail_errno(NF4_ECANTCREAT, errno, temp, NULL, "cannot remove stale partial output");
    nf4_note("%s: removed stale partial output from a run that did not finish (%s)", temp, who);
    return NF4_OK;
}

int out_lock_remove_stale(struct out_lock *lk, const char *keep)
{
    return each_temp(lk, remove_one, (void *)keep);
}

void out_lock_describe_previous(const struct out_lock *lk, char *buf, size_t cap)
{
    owner_record_describe(lk->have_previous ? &lk->previous : NULL, buf, cap);
}

void out_lock_release(struct out_lock *lk)
{
    if (!lk)
        return;
    /* Unlinked while still held: a run that opened it meanwhile sees the
     * inode is gone and starts again with a new file. Forgotten as a temp
     * first: a signal in between must not unlink the next run's lock. */
    if (lk->fd >= 0) {
        temp_unregister(lk->path);
        unlink(lk->path);
    }
    lock_free(lk);
}

/* ---- nf4deq clean ---- */

struct clean_ctx {
    int dry_run;
    FILE *out;
    int removed, kept;
};

static int clean_dir(struct clean_ctx *cc, const char *dir, int depth);

/* Removes (or with -n only lists) one stale item, and says so. */
static int remove_stale(struct clean_ctx *cc, const char *path, const char *what)
{
    struct stat st;
    /* A run that let its lock go as it finished renamed its temp into OUT:
     * nothing stale is there, and nothing is said. */
    if (lstat(path, &st) != 0 && errno == ENOENT)
        return NF4_OK;
    if (!cc->dry_run && remove_path(path) != 0)
        return errno == ENOENT ? NF4_OK : nf4_fail_errno(NF4_ECANTCREAT, errno, path, NULL, "cannot remove");
    fprintf(cc->out, "%s %s (stale %s)\n", cc->dry_run ? "would remove" : "removed", path, what);
    cc->removed++;
    return NF4_OK;
}

static void report_kept(struct clean_ctx *cc, const char *path, int known, const struct owner_record *r)
{
    char who[400];
    owner_record_describe(known ? r : NULL, who, sizeof who);
    fprintf(cc->out, "kept %s: a live run is writing it (%s)\n", path, who);
    cc->kept++;
}

/* A temp goes only while `clean` holds its OUT's lock, exactly as a run
 * would: a run starting meanwhile waits, then finds the temp gone, and a
 * live run's lock is never taken from it. */
static int clean_temp(struct clean_ctx *cc, const char *dir, const char *name, size_t base_len, const char *path,
                      int is_dir)
{
    struct strbuf lock = {0};
    strbuf_printf(&lock, "%s/%.*s" TEMP_MARKER LOCK_SUFFIX, dir, (int)(base_len + 1), name);
    if (lock.oom) {
        free(lock.p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    struct owner_record r;
    int fd = -1, created = 0, known = 0, code = NF4_OK;
    enum lock_result got = open_locked(lock.p, 1, &fd, &created, &r, &known);
    if (got == LOCK_HELD_BY_OTHER) {
        report_kept(cc, path, known, &r);
    } else if (got == LOCK_ERROR) {
        fprintf(cc->out, "kept %s: cannot take its lock %s: %s\n", path, lock.p, strerror(errno));
        cc->kept++;
    } else {
        code = remove_stale(cc, path, is_dir ? "directory" : "file");
        if (created)
            unlink(lock.p); /* made only to hold it: not left behind, even by -n */
        close(fd);
    }
    free(lock.p);
    return code;
}

/* A lock file goes only while `clean` holds it, and only if it is still the
 * file at that path: never from under a run that has just taken it. */
static int clean_lock(struct clean_ctx *cc, const char *path)
{
    struct owner_record r;
    int fd = -1, created = 0, known = 0, code = NF4_OK;
    enum lock_result got = open_locked(path, 0, &fd, &created, &r, &known);
    if (got == LOCK_HELD_BY_OTHER) {
        report_kept(cc, path, known, &r);
    } else if (got == LOCK_ERROR && errno != ENOENT) {
        fprintf(cc->out, "kept %s: %s\n", path, strerror(errno));
        cc->kept++;
    } else if (got == LOCK_TAKEN) {
        char who[400], what[450];
        owner_record_describe(read_record(fd, &r) ? &r : NULL, who, sizeof who);
        snprintf(what, sizeof what, "lock file of %s", who);
        code = remove_stale(cc, path, what);
        close(fd);
    }
    return code;
}

static int clean_entry(struct clean_ctx *cc, const char *dir, const char *name, int depth)
{
    char *path = path_join(dir, name);
    if (!path)
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    struct stat st;
    int code = NF4_OK;
    size_t base_len;
    enum temp_name_kind kind = temp_name_classify(name, &base_len);
    if (lstat(path, &st) != 0) {
        /* gone meanwhile */
    } else if (kind == TEMP_NAME_NONE) {
        if (S_ISDIR(st.st_mode) && depth < CLEAN_MAX_DEPTH)
            code = clean_dir(cc, path, depth + 1);
    } else if (kind == TEMP_NAME_LOCK) {
        code = clean_lock(cc, path);
    } else {
        code = clean_temp(cc, dir, name, base_len, path, S_ISDIR(st.st_mode));
    }
    free(path);
    return code;
}

/* The entries of `dir` to clean: every one, or with `only_out` the temps and
 * lock file of that OUT alone (".OUT.nf4deq-..."), never a folder below. */
static int clean_dir_entries(struct clean_ctx *cc, const char *dir, int depth, const char *only_out)
{
    char **names;
    size_t n;
    if (dir_names(dir, &names, &n) != 0) {
        if (errno == ENOMEM)
            return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        return depth == 0 ? nf4_fail_errno(NF4_ENOINPUT, errno, dir, NULL, "cannot list") : NF4_OK;
    }
    int code = NF4_OK;
    size_t only_len = only_out ? strlen(only_out) : 0;
    /* Temps before lock files (sorted names put "XXXXXX" after "lock" at
     * random), so a lock goes only once its temps are gone. */
    for (int pass = 0; pass < 2 && code == NF4_OK; pass++)
        for (size_t i = 0; i < n && code == NF4_OK; i++) {
            size_t base_len;
            enum temp_name_kind kind = temp_name_classify(names[i], &base_len);
            if (only_out && (kind == TEMP_NAME_NONE || base_len != only_len ||
                             memcmp(names[i] + 1, only_out, only_len) != 0))
                continue;
            if ((kind == TEMP_NAME_LOCK) == pass)
                code = clean_entry(cc, dir, names[i], depth);
        }
    dir_names_free(names, n);
    return code;
}

static int clean_dir(struct clean_ctx *cc, const char *dir, int depth)
{
    return clean_dir_entries(cc, dir, depth, NULL);
}

/* What runs writing `path` itself as their OUT left beside it, in its parent:
 * `nf4deq clean OUT` after a killed `nf4deq convert IN OUT`, where OUT is a
 * file, a directory or not there at all. "." and "/" name no OUT. */
static int clean_beside(struct clean_ctx *cc, const char *path)
{
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/')
        len--;
    char *clean = strndup(path, len);
    char *parent = clean ? path_dirname(clean) : NULL;
    int code = NF4_OK;
    if (!clean || !parent) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    } else {
        const char *slash = strrchr(clean, '/'), *name = slash ? slash + 1 : clean;
        if (*name && strcmp(name, ".") != 0 && strcmp(name, "..") != 0)
            code = clean_dir_entries(cc, parent, 1, name); /* a parent that cannot be listed: nothing there */
    }
    free(parent);
    free(clean);
    return code;
}

int clean_run(const char *path, int dry_run, void *out_file)
{
    struct clean_ctx cc = {dry_run, out_file, 0, 0};
    struct stat st;
    int exists = stat(path, &st) == 0;
    if (!exists && errno != ENOENT)
        return nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot open");
    int code = exists && S_ISDIR(st.st_mode) ? clean_dir(&cc, path, 0) : NF4_OK;
    if (code == NF4_OK)
        code = clean_beside(&cc, path);
    /* A path that is not there, and was no OUT of a dead run: a typo, most likely. */
    if (code == NF4_OK && !exists && cc.removed + cc.kept == 0)
        return nf4_fail_errno(NF4_ENOINPUT, ENOENT, path, NULL, "cannot open (and no run left a partial output of "
                              "it)");
    if (code == NF4_OK)
        fprintf(cc.out, "%s %d stale item%s%s", dry_run ? "would remove" : "removed", cc.removed,
                cc.removed == 1 ? "" : "s", cc.kept ? "" : "\n");
    if (code == NF4_OK && cc.kept)
        fprintf(cc.out, "; kept %d of live runs\n", cc.kept);
    return code;
}
