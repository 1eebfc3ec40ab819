/* src/exit_handoff.c: the process the caller waits for exits at once, while a
 * child keeps the device files, and nothing else, open until it has gone.
 *
 * A FIFO in a scratch directory stands in for the device files: the process
 * under test (P) opens its write end, as CUDA opens /dev/nvidia*, and the
 * hand-off is asked for that directory's prefix. The keeper is stopped before
 * P exits, so what it holds can be read from /proc without a race; this test
 * process is a subreaper, so the keeper comes back to it to be reaped.
 *
 * fork is bound to __wrap_fork (-Wl,--wrap=fork): asked to, it opens one more
 * file just before the hand-off forks, as a thread of the CUDA runtime may while
 * the parent lists its descriptors. The keeper must not hold that one either. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "exit_handoff.h"
#include "test_util.h"

#define P_EXIT_CODE 42
#define WAIT_MS 10000

/* Set in P: the next fork first opens this file (a descriptor that appears after
 * the hand-off listed the parent's). */
static const char *open_before_fork;
/* Set in P: in the child of the next fork, open(2) of /proc/self/fd fails (the
 * keeper's own listing), so the keeper must fall back to the parent's. */
static int fail_listing_after_fork;
static int fail_fd_listing; /* what __wrap_open reads: set only in that child */

int __real_open(const char *path, int flags, ...);
int __wrap_open(const char *path, int flags, ...)
{
    if (fail_fd_listing && strcmp(path, "/proc/self/fd") == 0) {
        errno = EMFILE;
        return -1;
    }
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, int);
        va_end(ap);
    }
    return __real_open(path, flags, mode);
}

pid_t __real_fork(void);
pid_t __wrap_fork(void)
{
    if (open_before_fork) {
        if (open(open_before_fork, O_RDONLY) < 0)
            _exit(103);
        open_before_fork = NULL;
    }
    const pid_t pid = __real_fork();
    if (pid == 0 && fail_listing_after_fork)
        fail_fd_listing = 1;
    fail_listing_after_fork = 0;
    return pid;
}

/* Reads from fd until EOF into buf (NUL-terminated); fails the test on a
 * timeout, so a keeper that still held the pipe would show. */
static size_t read_to_eof(int fd, char *buf, size_t cap)
{
    size_t got = 0;
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, WAIT_MS);
        if (r < 0 && errno == EINTR)
            continue;
        assert_int_equal(r, 1);
        ssize_t n = read(fd, buf + got, cap - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        assert_true(n >= 0);
        if (n == 0)
            break;
        got += (size_t)n;
        assert_true(got < cap - 1);
    }
    buf[got] = '\0';
    return got;
}

/* The targets of a process's open descriptors, one per line. */
static char *fd_targets(pid_t pid, int *count)
{
    char dir[64], *all = calloc(1, 4096);
    assert_non_null(all);
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(dir);
    assert_non_null(d);
    *count = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char link[300], target[512];
        snprintf(link, sizeof link, "%s/%.32s", dir, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        assert_true(n > 0);
        target[n] = '\0';
        strncat(all, target, 4096 - strlen(all) - 2);
        strcat(all, "\n");
        (*count)++;
    }
    closedir(d);
    return all;
}

/* Waits until /proc says `pid` is stopped. */
static void wait_stopped(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    for (int ms = 0; ms < WAIT_MS; ms++) {
        char stat[512] = {0};
        int fd = open(path, O_RDONLY);
        assert_true(fd >= 0);
        ssize_t n = read(fd, stat, sizeof stat - 1); /* /proc files have no size to seek to */
        close(fd);
        assert_true(n > 0);
        const char *end = strrchr(stat, ')'); /* the state follows the command name */
        int stopped = end && end[1] == ' ' && end[2] == 'T';
        if (stopped)
            return;
        usleep(1000);
    }
    fail_msg("the keeper %d did not stop", (int)pid);
}

static void p_on_term(int sig)
{
    (void)sig;
}

/* A signal mask of /proc/PID/status ("SigIgn", "SigCgt"). */
static unsigned long long signal_mask(pid_t pid, const char *field)
{
    char *path = tu_strdupf("/proc/%d/status", (int)pid), line[256];
    FILE *f = fopen(path, "r"); /* a file of size 0 to stat */
    assert_non_null(f);
    size_t len = strlen(field);
    int found = 0;
    unsigned long long mask = 0;
    while (!found && fgets(line, sizeof line, f))
        if (strncmp(line, field, len) == 0 && line[len] == ':') {
            mask = strtoull(line + len + 1, NULL, 16);
            found = 1;
        }
    fclose(f);
    free(path);
    assert_true(found);
    return mask;
}

/* P: opens the stand-in device file and an unrelated file, hands off, tells
 * the test the keeper's pid, waits for the word to exit, and _exits. As a run
 * under nohup, it ignores SIGHUP; it handles SIGTERM, as nf4deq does. */
static void run_p(const char *fifo, const char *prefix, const char *late_file, int no_fd_listing, int to_test,
                  int from_test)
{
    signal(SIGHUP, SIG_IGN);
    signal(SIGTERM, p_on_term);
    int dev = open(fifo, O_WRONLY);
    int other = open("/dev/null", O_RDONLY);
    if (dev < 0 || other < 0)
        _exit(100);
    open_before_fork = late_file;
    fail_listing_after_fork = no_fd_listing;
    pid_t keeper = handoff_device_files(prefix);
    dprintf(to_test, "%d\n", (int)keeper);
    char c;
    if (read(from_test, &c, 1) != 1)
        _exit(101);
    _exit(keeper > 0 ? P_EXIT_CODE : 102);
}

/* The keeper while the test holds it stopped: a failed assertion leaves the test
 * there, and the keeper, which on failure may hold this process's stdout, must
 * not stay stopped behind it (a pipeline reading the test's output would wait
 * for it). keeper_teardown kills it. */
static pid_t stopped_keeper;

static int keeper_teardown(void **state)
{
    if (stopped_keeper > 0) {
        kill(stopped_keeper, SIGKILL);
        waitpid(stopped_keeper, NULL, 0);
        stopped_keeper = 0;
    }
    return tu_scratch_teardown(state);
}

/* P hands off; the keeper, stopped, must hold the stand-in device file and its
 * pipe, nothing else; P's exit is seen at once; the keeper then goes. late_file:
 * a file P opens just before the hand-off forks, or NULL; no_fd_listing: the
 * keeper cannot list its own descriptors. */
static void check_keeper(struct tu_scratch *s, const char *late_file, int no_fd_listing)
{
    char *fifo = tu_strdupf("%s/nvidia-stand-in", s->dir);
    char *prefix = tu_strdupf("%s/nvidia", s->dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    /* Our read end, open first so that P's open for writing does not block. */
    int dev_r = open(fifo, O_RDONLY | O_NONBLOCK);
    assert_true(dev_r >= 0);
    assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), 0);

    int out[2], in[2];
    assert_int_equal(pipe(out), 0);
    assert_int_equal(pipe(in), 0);
    pid_t p = fork();
    assert_true(p >= 0);
    if (p == 0) {
        close(out[0]);
        close(in[1]);
        close(dev_r);
        run_p(fifo, prefix, late_file, no_fd_listing, out[1], in[0]);
    }
    close(out[1]);
    close(in[0]);

    /* P reports the keeper; stop it before P exits. */
    char line[64] = {0};
    size_t got = 0;
    while (!strchr(line, '\n')) {
        ssize_t n = read(out[0], line + got, sizeof line - 1 - got);
        assert_true(n > 0);
        got += (size_t)n;
    }
    pid_t keeper = (pid_t)atoi(line);
    assert_true(keeper > 0);
    assert_int_equal(kill(keeper, SIGSTOP), 0);
    stopped_keeper = keeper;
    wait_stopped(keeper); /* P's child until P exits: not ours to waitpid yet */
    int st = 0;

    /* No handler of P's in the keeper, but what P ignored stays ignored. */
    unsigned long long ignored = signal_mask(keeper, "SigIgn"), caught = signal_mask(keeper, "SigCgt");
    assert_true(ignored & (1ull << (SIGHUP - 1)));
    assert_false((ignored | caught) & (1ull << (SIGTERM - 1)));

    /* P exits; its stdout reaches EOF although the keeper lives on. */
    assert_int_equal(write(in[1], "x", 1), 1);
    char rest[64];
    read_to_eof(out[0], rest, sizeof rest);
    assert_int_equal(waitpid(p, &st, 0), p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), P_EXIT_CODE);

    /* The keeper holds the stand-in device file, and the pipe on which it
     * waits for P to go; nothing else. */
    int nfds = 0;
    char *targets = fd_targets(keeper, &nfds);
    char *fifo_line = tu_strdupf("%s\n", fifo);
    assert_int_equal(nfds, 2);
    char *at = strstr(targets, fifo_line);
    assert_non_null(at);
    memmove(at, at + strlen(fifo_line), strlen(at + strlen(fifo_line)) + 1);
    assert_int_equal(strncmp(targets, "pipe:", 5), 0);
    free(fifo_line);
    free(targets);
    char c;
    assert_int_equal(read(dev_r, &c, 1), -1); /* a writer is still there: EAGAIN, not EOF */
    assert_int_equal(errno, EAGAIN);

    /* Let go, it sees that P has gone and exits 0; the device file closes. */
    assert_int_equal(kill(keeper, SIGCONT), 0);
    stopped_keeper = 0;
    assert_int_equal(waitpid(keeper, &st, 0), keeper);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(read(dev_r, &c, 1), 0);

    close(dev_r);
    close(out[0]);
    close(in[1]);
    free(fifo);
    free(prefix);
}

static void test_keeper_holds_only_the_device_files(void **state)
{
    check_keeper(*state, NULL, 0);
}

/* A descriptor opened after the parent listed its own (by another thread) is
 * closed in the keeper all the same: the keeper lists what it inherited. With
 * the parent's listing alone the keeper held /dev/zero here. */
static void test_keeper_closes_late_descriptors(void **state)
{
    check_keeper(*state, "/dev/zero", 0);
}

/* Where the keeper cannot list its descriptors, the parent's listing serves: it
 * still closes all but the device file and its pipe (the pipes the hand-off made
 * after that listing included). */
static void test_keeper_falls_back_to_the_parents_listing(void **state)
{
    check_keeper(*state, NULL, 1);
}

/* Without a matching file there is nothing to hand off, and no child. */
static void test_nothing_to_hand_off(void **state)
{
    struct tu_scratch *s = *state;
    char *prefix = tu_strdupf("%s/no-such-device", s->dir);
    assert_int_equal(handoff_device_files(prefix), 0); /* 0: it forked nothing */
    free(prefix);
}

static void test_wanted_unless_switched_off(void **state)
{
    (void)state;
    unsetenv("NF4DEQ_GPU_HANDOFF");
    assert_true(handoff_wanted());
    setenv("NF4DEQ_GPU_HANDOFF", "1", 1);
    assert_true(handoff_wanted());
    setenv("NF4DEQ_GPU_HANDOFF", "0", 1);
    assert_false(handoff_wanted());
    unsetenv("NF4DEQ_GPU_HANDOFF");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_keeper_holds_only_the_device_files, tu_scratch_setup, keeper_teardown),
        cmocka_unit_test_setup_teardown(test_keeper_closes_late_descriptors, tu_scratch_setup, keeper_teardown),
        cmocka_unit_test_setup_teardown(test_keeper_falls_back_to_the_parents_listing, tu_scratch_setup, keeper_teardown),
        cmocka_unit_test_setup_teardown(test_nothing_to_hand_off, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test(test_wanted_unless_switched_off),
    };
    return cmocka_run_group_tests_name("exit_handoff", tests, NULL, NULL);
}
