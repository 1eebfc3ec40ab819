#include "exit_handoff.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

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
    const char *v = getenv("NF4DEQ_GPU_HANDOFF");
    return !(v && strcmp(v, "0") == 0);
}

/* The open descriptors of this process, split into those whose path begins
 * with `prefix` and the rest. Returns the number in fds[], or -1 when they
 * cannot all be listed. */
static int list_fds(const char *prefix, int *fds, int *keep)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0, self = dirfd(d);
    size_t plen = strlen(prefix);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        int fd = atoi(e->d_name);
        if (fd == self)
            continue;
        if (n == HANDOFF_MAX_FDS) {
            closedir(d);
            return -1;
        }
        char link[64], target[256];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t len = readlink(link, target, sizeof target - 1);
        target[len > 0 ? len : 0] = '\0';
        fds[n] = fd;
        keep[n] = len > 0 && strncmp(target, prefix, plen) == 0;
        n++;
    }
    closedir(d);
    return n;
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
    int fds[HANDOFF_MAX_FDS], keep[HANDOFF_MAX_FDS];
    int n = list_fds(prefix, fds, keep);
    int kept = 0;
    for (int i = 0; i < n; i++)
        kept += keep[i];
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
         * and the kernel closes the device files (the teardown) all the same. */
        static const int HANDLED[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
        for (size_t i = 0; i < sizeof HANDLED / sizeof HANDLED[0]; i++)
            signal(HANDLED[i], SIG_DFL);
        prctl(PR_SET_NAME, "nf4deq-teardown", 0, 0, 0);
        for (int i = 0; i < n; i++)
            if (!keep[i])
                close(fds[i]);
        close(gone[1]);
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
