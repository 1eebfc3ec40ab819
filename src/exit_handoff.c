#include "exit_handoff.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fileio.h"

/* Open descriptors looked at; a process with more than this many keeps the
 * plain exit (nf4deq holds a handful by the time it exits). */
#define HANDOFF_MAX_FDS 256

static atomic_int forbidden, expected;

void handoff_expect(void)
{
    atomic_store(&expected, 1);
}

int handoff_at_exit(void)
{
    return atomic_load(&expected) && handoff_wanted();
}

void handoff_forbid(void)
{
    atomic_store(&forbidden, 1);
}

int handoff_wanted(void)
{
    if (atomic_load(&forbidden))
        return 0;
    const char *v = getenv(HANDOFF_ENV);
    return !(v && strcmp(v, "0") == 0);
}

/* ---- listing descriptors: system calls only -------------------------------
 * The child lists its descriptors again after the fork, where only the forking
 * thread exists, so its table is the snapshot the fork took: nothing opens or
 * closes one between the listing and the closes. (The parent's listing, which
 * decides whether to fork at all, can be overtaken by the CUDA runtime's
 * threads, which open and close descriptors of their own.) No opendir, snprintf
 * or malloc: another thread may have held a lock of theirs at the fork. */

/* "/proc/self/fd/" followed by fd in decimal. */
static void fd_link_path(int fd, char path[32])
{
    static const char HEAD[] = "/proc/self/fd/";
    char digits[12];
    int nd = 0;
    unsigned v = (unsigned)fd;
    do {
        digits[nd++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    memcpy(path, HEAD, sizeof HEAD - 1);
    int at = (int)sizeof HEAD - 1;
    while (nd)
        path[at++] = digits[--nd];
    path[at] = '\0';
}

/* Whether descriptor fd refers to a path beginning with prefix. */
static int fd_has_prefix(int fd, const char *prefix, size_t plen)
{
    char link[32], target[256];
    fd_link_path(fd, link);
    ssize_t len = readlink(link, target, sizeof target - 1);
    return len > 0 && (size_t)len >= plen && memcmp(target, prefix, plen) == 0;
}

/* The descriptors now open, by getdents64 on /proc/self/fd (the directory's own
 * descriptor left out). Returns how many are in fds[], or -1 when they cannot
 * all be listed. */
static int list_fds(int *fds)
{
    int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        return -1;
    /* struct linux_dirent64: d_ino (8), d_off (8), d_reclen (2), d_type (1), d_name */
    enum { RECLEN_AT = 16, NAME_AT = 19 };
    _Alignas(8) char buf[4096];
    int n = 0;
    for (;;) {
        long got = syscall(SYS_getdents64, dir, buf, sizeof buf);
        if (got == 0)
            break;
        if (got < 0) {
            n = -1;
            break;
        }
        for (long at = 0; at < got;) {
            unsigned short reclen;
            memcpy(&reclen, buf + at + RECLEN_AT, sizeof reclen);
            const char *name = buf + at + NAME_AT;
            at += reclen;
            if (name[0] < '0' || name[0] > '9')
                continue;
            int fd = 0;
            for (const char *c = name; *c >= '0' && *c <= '9'; c++)
                fd = fd * 10 + (*c - '0');
            if (fd == dir)
                continue;
            if (n == HANDOFF_MAX_FDS) {
                close(dir);
                return -1;
            }
            fds[n++] = fd;
        }
    }
    close(dir);
    return n;
}

/* Closes every descriptor but those on prefix's files and the two named. When
 * the child's own listing fails, falls back to the parent's (fds[]/keep[]). */
static void child_keep_only(const char *prefix, int spare1, int spare2, const int *fds, const int *keep, int n)
{
    int now[HANDOFF_MAX_FDS];
    int m = list_fds(now);
    if (m < 0) {
        for (int i = 0; i < n; i++)
            if (!keep[i] && fds[i] != spare1 && fds[i] != spare2)
                close(fds[i]);
        return;
    }
    const size_t plen = strlen(prefix);
    for (int i = 0; i < m; i++)
        if (now[i] != spare1 && now[i] != spare2 && !fd_has_prefix(now[i], prefix, plen))
            close(now[i]);
}

/* Waits for EOF on a pipe nobody writes to. */
static void read_to_eof(int fd)
{
    char c;
    for (;;) {
        ssize_t r = read(fd, &c, 1);
        if (r == 0 || (r < 0 && errno != EINTR))
            return;
    }
}

pid_t handoff_device_files(const char *prefix)
{
    /* This listing decides whether to fork at all; the child lists its own
     * descriptors again (child_keep_only) and falls back to this one. */
    int fds[HANDOFF_MAX_FDS], keep[HANDOFF_MAX_FDS];
    const int n = list_fds(fds);
    const size_t plen = strlen(prefix);
    int kept = 0;
    for (int i = 0; i < n; i++)
        kept += keep[i] = fd_has_prefix(fds[i], prefix, plen);
    if (n < 0 || kept == 0)
        return 0;
    /* The child reads until EOF on `gone`: the parent's write end closes only
     * when the parent exits, whether by _exit or by a signal. The parent reads
     * until EOF on `ready`: the child closes its end once it has closed every
     * file but the device files, so that when this returns the child holds
     * nothing the caller may be waiting on. */
    int gone[2], ready[2];
    if (pipe(gone) != 0)
        return 0;
    if (pipe(ready) != 0) {
        close(gone[0]);
        close(gone[1]);
        return 0;
    }
    pid_t pid = fork();
    if (pid < 0) {
        close(gone[0]);
        close(gone[1]);
        close(ready[0]);
        close(ready[1]);
        return 0;
    }
    if (pid == 0) {
        /* Only system calls from here: the fork copied one thread of several.
         * No handler of the parent's runs here: a signal just ends the child,
         * and the kernel closes the device files (the teardown) all the same.
         * One ignored since the start (nohup's SIGHUP) stays ignored, as in
         * the parent. */
        const int *handled; /* listed by install_signal_cleanup before any thread: no lock taken here */
        size_t nhandled = cleanup_signals(&handled);
        for (size_t i = 0; i < nhandled; i++) {
            struct sigaction now;
            if (sigaction(handled[i], NULL, &now) == 0 && now.sa_handler != SIG_IGN)
                signal(handled[i], SIG_DFL);
        }
        prctl(PR_SET_NAME, "nf4deq-teardown", 0, 0, 0);
        child_keep_only(prefix, gone[0], ready[1], fds, keep, n);
        close(gone[1]); /* already closed unless the parent's listing served: it predates the pipes */
        close(ready[0]);
        close(ready[1]);
        read_to_eof(gone[0]);
        _exit(0);
    }
    close(gone[0]);
    close(ready[1]);
    read_to_eof(ready[0]);
    close(ready[0]);
    return pid;
}
