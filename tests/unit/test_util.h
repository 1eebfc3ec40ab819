/* Helpers shared by the CMocka test programs: fixture paths, scratch
 * directories, running the nf4deq binary, and comparing safetensors files. */
#ifndef NF4DEQ_TEST_UTIL_H
#define NF4DEQ_TEST_UTIL_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "file_copy.h"
#include "model_dir.h"
#include "safetensors.h"
#include "safetensors_writer.h"
#include "status.h"

/* Tests run from the repository root (the Makefile and run-unit.sh do that). */
#define FIXTURES "tests/fixtures"
#ifndef NF4DEQ_BIN
#define NF4DEQ_BIN "build/nf4deq"
#endif

static inline char *tu_strdupf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0)
        s = NULL;
    va_end(ap);
    assert_non_null(s);
    return s;
}

/* A fresh scratch directory under $TMPDIR (or /tmp). */
static inline char *tu_mkdtemp(void)
{
    const char *base = getenv("TMPDIR");
    char *t = tu_strdupf("%s/nf4deq-test-XXXXXX", base && *base ? base : "/tmp");
    assert_non_null(mkdtemp(t));
    return t;
}

static inline void tu_rmtree(const char *dir)
{
    if (dir)
        remove_tree(dir);
}

/* Number of directory entries other than . and .. (temp files left behind show up here). */
/* A scratch directory per test, as a CMocka setup/teardown pair. */
struct tu_scratch {
    char *dir;
};

static inline int tu_scratch_setup(void **state)
{
    struct tu_scratch *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    s->dir = tu_mkdtemp();
    *state = s;
    return 0;
}

static inline int tu_scratch_teardown(void **state)
{
    struct tu_scratch *s = *state;
    tu_rmtree(s->dir);
    free(s->dir);
    free(s);
    return 0;
}

static inline int tu_count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

static inline int tu_exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

static inline void tu_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static inline char *tu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    if (len)
        *len = (size_t)n;
    return buf;
}

/* Writes a safetensors file from a raw header string and data bytes. */
static inline void tu_write_safetensors_raw(const char *path, const char *header, size_t header_len,
                                            const void *data, size_t data_len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; i++)
        len_bytes[i] = (unsigned char)((uint64_t)header_len >> (8 * i));
    assert_int_equal(fwrite(len_bytes, 1, 8, f), 8);
    if (header_len)
        assert_int_equal(fwrite(header, 1, header_len, f), header_len);
    if (data_len)
        assert_int_equal(fwrite(data, 1, data_len, f), data_len);
    assert_int_equal(fclose(f), 0);
}

struct tu_run {
    int status; /* exit code, or 128 + signal */
    char *out;  /* captured stdout */
    char *err;  /* captured stderr */
};

/* In a child: execs the nf4deq binary with a NULL-terminated argument list
 * (without argv[0]); exits 127 if it cannot. */
static inline void tu_exec_nf4deq(char *const *args)
{
    int n = 0;
    while (args[n])
        n++;
    char **argv = calloc((size_t)n + 2, sizeof *argv);
    argv[0] = (char *)NF4DEQ_BIN;
    for (int i = 0; i < n; i++)
        argv[i + 1] = args[i];
    execv(NF4DEQ_BIN, argv);
    _exit(127);
}

/* The exit status of a shell command line (a signal gives -1). */
static inline int tu_sh_status(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *cmd = NULL;
    assert_true(vasprintf(&cmd, fmt, ap) >= 0);
    va_end(ap);
    int rc = system(cmd);
    free(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* Runs a shell command line that must succeed. */
#define tu_sh(...) assert_int_equal(tu_sh_status(__VA_ARGS__), 0)

/* Runs the nf4deq binary with a NULL-terminated argument list (without argv[0]). */
static inline struct tu_run tu_run_argv(char *const *args)
{
    char outp[] = "/tmp/nf4deq-out-XXXXXX", errp[] = "/tmp/nf4deq-err-XXXXXX";
    int ofd = mkstemp(outp), efd = mkstemp(errp);
    assert_true(ofd >= 0 && efd >= 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(ofd, 1);
        dup2(efd, 2);
        tu_exec_nf4deq(args);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    close(ofd);
    close(efd);
    struct tu_run r;
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    r.out = tu_read_file(outp, NULL);
    r.err = tu_read_file(errp, NULL);
    unlink(outp);
    unlink(errp);
    return r;
}

/* tu_run("convert", in, out, NULL) */
static inline struct tu_run tu_run(const char *first, ...)
{
    char *args[64];
    int n = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a && n < 63; a = va_arg(ap, const char *))
        args[n++] = (char *)a;
    va_end(ap);
    args[n] = NULL;
    return tu_run_argv(args);
}

static inline void tu_run_free(struct tu_run *r)
{
    free(r->out);
    free(r->err);
}

/* Counts the lines of a string (a message must be exactly one line). */
static inline int tu_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        if (*s == '\n')
            n++;
    return n;
}

/* Asserts that two safetensors files hold the same tensors: names, dtypes,
 * shapes and data bytes (headers may differ in metadata and layout). */
/* Every tensor of `want_path` in `got` (named got_path in messages), with
 * the same name, dtype, shape and bytes, and no other. */
static inline void tu_assert_same_st(const struct st_file *got, const char *got_path, const char *want_path)
{
    struct st_file *want;
    assert_int_equal(st_open(want_path, &want), NF4_OK);
    if (got->count != want->count)
        fail_msg("%s has %zu tensors, %s has %zu", got_path, got->count, want_path, want->count);
    for (size_t i = 0; i < want->count; i++) {
        const struct st_tensor *w = want->by_name[i];
        const struct st_tensor *g = st_find(got, w->name);
        if (!g)
            fail_msg("%s lacks %s", got_path, w->name);
        if (g->dtype != w->dtype || g->ndim != w->ndim)
            fail_msg("%s: %s: dtype/rank %s/%zu, expected %s/%zu", got_path, w->name, dtype_name(g->dtype), g->ndim,
                     dtype_name(w->dtype), w->ndim);
        for (size_t d = 0; d < w->ndim; d++)
            assert_int_equal(g->shape[d], w->shape[d]);
        uint64_t n = st_tensor_bytes(w);
        assert_int_equal(st_tensor_bytes(g), n);
        unsigned char *a = malloc(n ? n : 1), *b = malloc(n ? n : 1);
        assert_int_equal(st_read(got, g, 0, a, n), NF4_OK);
        assert_int_equal(st_read(want, w, 0, b, n), NF4_OK);
        if (memcmp(a, b, n) != 0) {
            uint64_t k = 0;
            while (a[k] == b[k])
                k++;
            fail_msg("%s: %s: byte %llu differs (0x%02x, expected 0x%02x)", got_path, w->name,
                     (unsigned long long)k, a[k], b[k]);
        }
        free(a);
        free(b);
    }
    st_close(want);
}

static inline void tu_assert_same_tensors(const char *got_path, const char *want_path)
{
    struct st_file *got;
    assert_int_equal(st_open(got_path, &got), NF4_OK);
    tu_assert_same_st(got, got_path, want_path);
    st_close(got);
}

#endif
