#include "fileio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

int read_full_at(int fd, void *buf, size_t len, uint64_t offset)
{
    char *p = buf;
    while (len > 0) {
        ssize_t got = pread(fd, p, len, (off_t)offset);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            /* The file is shorter than its header promised: it changed under us. */
            errno = EIO;
            return -1;
        }
        p += got;
        len -= (size_t)got;
        offset += (uint64_t)got;
    }
    return 0;
}

int write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t put = write(fd, p, len);
        if (put < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (put == 0) {
            errno = ENOSPC;
            return -1;
        }
        p += put;
        len -= (size_t)put;
    }
    return 0;
}

int open_regular_file(const char *path, int *fd_out, struct stat *st)
{
    *fd_out = -1;
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer forever. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot open");
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return nf4_fail_errno(NF4_EIO, e, path, NULL, "cannot stat");
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return nf4_fail(NF4_ENOINPUT, path, NULL, "not a regular file");
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return nf4_fail_errno(NF4_EIO, e, path, NULL, "cannot open");
    }
    *fd_out = fd;
    return NF4_OK;
}

int read_small_file(const char *path, size_t max_bytes, char **out, size_t *out_len)
{
    int fd;
    struct stat st;
    int code = open_regular_file(path, &fd, &st);
    if (code != NF4_OK)
        return code;
    if ((uint64_t)st.st_size > max_bytes) {
        close(fd);
        return nf4_fail(NF4_EDATA, path, NULL, "file is %lld bytes, more than the %zu allowed", (long long)st.st_size,
                        max_bytes);
    }
    size_t len = (size_t)st.st_size;
    char *buf = malloc(len + 1);
    if (!buf) {
        close(fd);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    if (read_full_at(fd, buf, len, 0) != 0) {
        int e = errno;
        free(buf);
        close(fd);
        return nf4_fail_errno(NF4_EIO, e, path, NULL, "read failed");
    }
    close(fd);
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return NF4_OK;
}

char *path_dirname(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        return strdup(".");
    if (slash == path)
        return strdup("/");
    return strndup(path, (size_t)(slash - path));
}

char *path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p)
        return NULL;
    memcpy(p, dir, a);
    size_t at = a;
    if (a > 0 && dir[a - 1] != '/')
        p[at++] = '/';
    memcpy(p + at, name, b + 1);
    return p;
}

static char *temp_template(const char *path)
{
    char *dir = path_dirname(path);
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    char *tmpl = NULL;
    if (dir && asprintf(&tmpl, "%s/.%s.nf4deq-XXXXXX", dir, base) < 0)
        tmpl = NULL;
    free(dir);
    return tmpl;
}

/* What a new output may grant beyond its owner: the input's permissions
 * (fileio_limit_modes_to). */
static mode_t modes_limit = 07777;

void fileio_limit_modes_to(mode_t source)
{
    modes_limit = (source & 07777) | S_IRWXU;
}

int limit_modes_to_namesakes(const char *dir, const char *src_dir)
{
    char **names;
    size_t n;
    if (dir_names(dir, &names, &n) != 0)
        return errno == ENOMEM ? nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory")
                               : nf4_fail_errno(NF4_ECANTCREAT, errno, dir, NULL, "cannot list");
    int code = NF4_OK;
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        char *path = path_join(dir, names[i]), *src = path_join(src_dir, names[i]);
        struct stat st, src_st;
        if (!path || !src) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        } else if (lstat(path, &st) == 0 && S_ISREG(st.st_mode) && stat(src, &src_st) == 0) {
            mode_t limited = st.st_mode & (src_st.st_mode | S_IRUSR | S_IWUSR) & 07777;
            if (limited != (st.st_mode & 07777) && chmod(path, limited) != 0)
                code = nf4_fail_errno(NF4_ECANTCREAT, errno, path, NULL, "cannot change its mode");
        }
        free(path);
        free(src);
    }
    dir_names_free(names, n);
    return code;
}

static mode_t creation_mode(mode_t wanted)
{
    /* mkstemp makes files 0600; give the result the mode a plain create would,
     * no more open than the input, as cp gives a copy its source's mode. */
    mode_t mask = umask(0);
    umask(mask);
    return wanted & ~mask & modes_limit;
}

int create_temp_beside(const char *path, char **tmp_path)
{
    char *tmpl = temp_template(path);
    if (!tmpl) {
        errno = ENOMEM;
        return -1;
    }
    /* Signals wait until the new file is registered: a SIGTERM between
     * mkostemp and temp_register would leave it behind. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int fd = mkostemp(tmpl, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        free(tmpl);
        errno = e;
        return -1;
    }
    temp_register(tmpl, 0);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (fchmod(fd, creation_mode(0666)) != 0) {
        /* Not fatal: the file is still ours and usable. */
    }
    *tmp_path = tmpl;
    return fd;
}

int create_unnamed_temp(const char *dir, const char *prefix, char **shown)
{
    size_t len = strlen(dir) + strlen(prefix) + 32;
    char *name = malloc(len);
    if (!name) {
        errno = ENOMEM;
        return -1;
    }
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) {
        snprintf(name, len, "%s/%s-... (unnamed)", dir, prefix);
        *shown = name;
        return fd;
    }
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) { /* those say: no O_TMPFILE here */
        free(name);
        return -1;
    }
    snprintf(name, len, "%s/%s-XXXXXX", dir, prefix);
    sigset_t all, old; /* no signal handler runs while the name exists */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    fd = mkostemp(name, O_CLOEXEC);
    int e = errno;
    if (fd >= 0)
        unlink(name);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (fd < 0) {
        free(name);
        errno = e;
        return -1;
    }
    snprintf(name + strlen(name), len - strlen(name), " (unnamed)");
    *shown = name;
    return fd;
}

int create_temp_dir_beside(const char *path, char **tmp_path)
{
    char *tmpl = temp_template(path);
    if (!tmpl) {
        errno = ENOMEM;
        return -1;
    }
    sigset_t all, old; /* as in create_temp_beside */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    if (!mkdtemp(tmpl)) {
        int e = errno;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        free(tmpl);
        errno = e;
        return -1;
    }
    temp_register(tmpl, 1);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    /* It stays 0700, mkdtemp's, while it is written (and where a stop keeps
     * it): its files are nobody else's to open before they are finished
     * and given their modes (dir_take_creation_mode). */
    *tmp_path = tmpl;
    return 0;
}

int dir_take_creation_mode(const char *dir)
{
    return chmod(dir, creation_mode(0777));
}

int fsync_parent_dir(const char *path)
{
    /* No allocation: running out of memory here is not an I/O error. */
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    size_t n = !slash ? 0 : slash == path ? 1 : (size_t)(slash - path);
    if (n >= sizeof dir) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(dir, n ? path : ".", n ? n : 1);
    dir[n ? n : 1] = '\0';
    return fsync_dir(dir);
}

int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    /* Some file systems cannot fsync a directory; the rename still happened. */
    if (rc != 0 && (errno == EINVAL || errno == EROFS))
        rc = 0;
    close(fd);
    return rc;
}

int write_file_atomic(const char *path, const void *data, size_t len)
{
    char *tmp = NULL;
    int fd = create_temp_beside(path, &tmp);
    if (fd < 0)
        return nf4_fail_errno(errno == ENOMEM ? NF4_ESOFTWARE : NF4_ECANTCREAT, errno, path, NULL,
                              "cannot create a temp file beside it");
    int code = NF4_OK;
    if (write_full(fd, data, len) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "write failed");
    else if (fsync(fd) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "fsync failed");
    if (close(fd) != 0 && code == NF4_OK)
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "close failed");
    if (code == NF4_OK && rename(tmp, path) != 0)
        code = nf4_fail_errno(NF4_ECANTCREAT, errno, path, NULL, "cannot rename the temp file into place");
    if (code != NF4_OK)
        unlink(tmp);
    temp_unregister(tmp);
    free(tmp);
    return code;
}

/* ---- temp registry ----
 * A fixed table the signal handler can walk without allocating: unlink() and
 * rmdir() are async-signal-safe, malloc and stdio are not. */
#define MAX_TEMPS 4096

static char *temps[MAX_TEMPS];
static unsigned char temp_is_dir[MAX_TEMPS];
/* What SIGTERM and SIGHUP leave (temp_keep_on_stop): KEEP_ON_STOP always,
 * KEEP_WITH_OTHERS only beside something kept (the lock file, whose record
 * then names the run that left it). */
enum { KEEP_NEVER, KEEP_ON_STOP, KEEP_WITH_OTHERS };
static unsigned char temp_keep[MAX_TEMPS];
static volatile sig_atomic_t temp_count;
static char stop_note[1024];
static volatile sig_atomic_t stop_note_len;

void temp_register(const char *path, int is_dir)
{
    char *copy = strdup(path);
    if (!copy)
        return;
    for (int i = 0; i < temp_count; i++)
        if (!temps[i]) {
            temp_is_dir[i] = (unsigned char)is_dir;
            temp_keep[i] = KEEP_NEVER;
            temps[i] = copy;
            return;
        }
    if (temp_count < MAX_TEMPS) {
        temp_is_dir[temp_count] = (unsigned char)is_dir;
        temp_keep[temp_count] = KEEP_NEVER;
        temps[temp_count] = copy;
        temp_count = temp_count + 1;
    } else {
        free(copy);
    }
}

void temp_unregister(const char *path)
{
    for (int i = 0; i < temp_count; i++)
        if (temps[i] && strcmp(temps[i], path) == 0) {
            char *p = temps[i];
            temps[i] = NULL;
            free(p);
            return;
        }
}

void temp_unregister_prefix(const char *prefix)
{
    size_t n = strlen(prefix);
    for (int i = 0; i < temp_count; i++)
        if (temps[i] && strncmp(temps[i], prefix, n) == 0 && (temps[i][n] == '\0' || temps[i][n] == '/')) {
            char *p = temps[i];
            temps[i] = NULL;
            free(p);
        }
}

static void mark_keep(const char *path, unsigned char how)
{
    for (int i = 0; i < temp_count; i++)
        if (temps[i] && strcmp(temps[i], path) == 0)
            temp_keep[i] = how;
}

void temp_keep_on_stop(const char *path)
{
    mark_keep(path, KEEP_ON_STOP);
}

void temp_keep_with_others(const char *path)
{
    mark_keep(path, KEEP_WITH_OTHERS);
}

void temp_set_stop_note(const char *note)
{
    stop_note_len = 0; /* a signal meanwhile prints nothing rather than half a note */
    size_t n = strlen(note);
    if (n >= sizeof stop_note)
        n = sizeof stop_note - 1;
    memcpy(stop_note, note, n);
    stop_note_len = (sig_atomic_t)n;
}

/* keep_marked: a stopping signal; what is marked to be kept stays. Returns
 * whether anything was kept. */
static int remove_temps_unsafe(int free_names, int keep_marked)
{
    int kept = 0; /* only what is still there: a published temp was renamed away */
    for (int i = 0; keep_marked && i < temp_count; i++)
        kept |= temps[i] && temp_keep[i] == KEEP_ON_STOP && access(temps[i], F_OK) == 0;
    /* Newest first: files inside a temp directory were registered after it. */
    for (int i = temp_count - 1; i >= 0; i--) {
        char *p = temps[i];
        if (!p || (kept && temp_keep[i] != KEEP_NEVER))
            continue;
        if (temp_is_dir[i])
            rmdir(p);
        else
            unlink(p);
        if (free_names) {
            temps[i] = NULL;
            free(p);
        }
    }
    return kept;
}

void cleanup_temps(void)
{
    remove_temps_unsafe(1, 0);
}

static void on_fatal_signal(int sig)
{
    int kept = remove_temps_unsafe(0, sig == SIGTERM || sig == SIGHUP);
    if (kept && stop_note_len > 0 && write(STDERR_FILENO, stop_note, (size_t)stop_note_len) < 0) {
        /* nothing more can be done in a signal handler */
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static const int FIXED_CLEANUP_SIGNALS[] = {
    SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGALRM, SIGUSR1, SIGUSR2, SIGVTALRM, SIGPROF, SIGXCPU, SIGIO,
#ifdef SIGPWR
    SIGPWR,
#endif
#ifdef SIGSTKFLT
    SIGSTKFLT,
#endif
};
/* The fixed ones, then the real-time signals, whose range the C library
 * sets at run time (it keeps the first few for itself). */
static int CLEANUP_SIGNALS[sizeof FIXED_CLEANUP_SIGNALS / sizeof *FIXED_CLEANUP_SIGNALS + 64];
static size_t cleanup_count;
static pthread_once_t cleanup_listed = PTHREAD_ONCE_INIT;

static void list_cleanup_signals(void)
{
    for (size_t i = 0; i < sizeof FIXED_CLEANUP_SIGNALS / sizeof *FIXED_CLEANUP_SIGNALS; i++)
        CLEANUP_SIGNALS[cleanup_count++] = FIXED_CLEANUP_SIGNALS[i];
    for (int sig = SIGRTMIN; sig <= SIGRTMAX && cleanup_count < sizeof CLEANUP_SIGNALS / sizeof *CLEANUP_SIGNALS;
         sig++)
        CLEANUP_SIGNALS[cleanup_count++] = sig;
}

size_t cleanup_signals(const int **list)
{
    pthread_once(&cleanup_listed, list_cleanup_signals);
    *list = CLEANUP_SIGNALS;
    return cleanup_count;
}

int thread_create_blocking_signals(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    sigset_t set, old;
    sigemptyset(&set);
    const int *sigs;
    for (size_t i = 0, n = cleanup_signals(&sigs); i < n; i++)
        sigaddset(&set, sigs[i]);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    int rc = pthread_create(thread, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

void install_signal_cleanup(void)
{
    const int *sigs;
    for (size_t i = 0, n = cleanup_signals(&sigs); i < n; i++) {
        struct sigaction sa;
        /* A signal ignored when we start stays ignored: nohup(1) ignores HUP
         * and a shell's background job INT, and a run they start must go on. */
        if (sigaction(sigs[i], NULL, &sa) == 0 && sa.sa_handler == SIG_IGN)
            continue;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
    signal(SIGXFSZ, SIG_IGN);
}

static int closed_std_streams; /* bit fd for each of 0, 1, 2 found closed */

void guard_std_streams(void)
{
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF)
            continue;
        /* stdout reopens on /dev/full, so whatever is printed to it fails as
         * it would have; stdin and stderr on /dev/null. */
        int got = open(fd == STDOUT_FILENO ? "/dev/full" : "/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY);
        if (got >= 0 && got != fd) {
            dup2(got, fd);
            close(got);
        }
        closed_std_streams |= 1 << fd;
    }
}

int std_stream_was_closed(int fd)
{
    return fd >= 0 && fd <= 2 && (closed_std_streams & (1 << fd)) != 0;
}

static int cmp_dir_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int dir_names(const char *dir, char ***names_out, size_t *n_out)
{
    *names_out = NULL;
    *n_out = 0;
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    char **names = NULL;
    size_t n = 0, cap = 0;
    int failed = 0;
    struct dirent *e;
    while (!failed && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (n == cap) {
            size_t grown = cap ? 2 * cap : 32;
            char **p = realloc(names, grown * sizeof *p);
            if (!p) {
                failed = 1;
                break;
            }
            names = p;
            cap = grown;
        }
        if (!(names[n] = strdup(e->d_name)))
            failed = 1;
        else
            n++;
    }
    closedir(d);
    if (failed) {
        dir_names_free(names, n);
        errno = ENOMEM;
        return -1;
    }
    if (n)
        qsort(names, n, sizeof *names, cmp_dir_name);
    *names_out = names;
    *n_out = n;
    return 0;
}

int dir_list(const char *dir, int code, char ***names, size_t *n)
{
    if (dir_names(dir, names, n) == 0)
        return NF4_OK;
    return errno == ENOMEM ? nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory")
                           : nf4_fail_errno(code, errno, dir, NULL, "cannot list");
}

void dir_names_free(char **names, size_t n)
{
    for (size_t i = 0; names && i < n; i++)
        free(names[i]);
    free(names);
}
