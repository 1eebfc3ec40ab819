/* Shared by the libFuzzer targets: each input runs with a clean error state and
 * no warnings on stderr; an invariant that does not hold aborts with a message,
 * which libFuzzer reports as a crash and saves as a reproducer. */
#ifndef NF4DEQ_FUZZ_COMMON_H
#define NF4DEQ_FUZZ_COMMON_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "status.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Warnings on stderr would drown libFuzzer's output. A target that needs more
 * set-up defines FUZZ_OWN_INITIALIZE and writes its own. */
#ifndef FUZZ_OWN_INITIALIZE
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    return 0;
}
#endif

#define FUZZ_ASSERT(cond, ...)                                                                                \
    do {                                                                                                      \
        if (!(cond)) {                                                                                        \
            fprintf(stderr, "fuzz invariant failed: %s (%s:%d): ", #cond, __FILE__, __LINE__);               \
            fprintf(stderr, __VA_ARGS__);                                                                     \
            fputc('\n', stderr);                                                                              \
            abort();                                                                                          \
        }                                                                                                     \
    } while (0)

/* Every failure must leave a one-line message, and be one of the codes a
 * parser may return for bad input or exhausted memory. */
static inline void fuzz_check_failure(int code)
{
    FUZZ_ASSERT(code == NF4_EDATA || code == NF4_ESOFTWARE, "unexpected code %d: %s", code, nf4_last_error());
    const char *msg = nf4_last_error();
    FUZZ_ASSERT(strcmp(msg, "unknown error") != 0, "code %d without a message", code);
    FUZZ_ASSERT(strchr(msg, '\n') == NULL && strchr(msg, '\r') == NULL, "message spans lines: %s", msg);
}

/* A private copy of the input, not NUL-terminated: the parsers take (ptr, len),
 * and a copy of exactly len bytes lets ASan catch any read past the end. */
static inline char *fuzz_copy(const uint8_t *data, size_t size)
{
    char *p = malloc(size ? size : 1);
    if (p && size)
        memcpy(p, data, size);
    return p;
}

/* The input as a C string, for the APIs that take one (NULL if out of memory). */
static inline char *fuzz_copy_string(const uint8_t *data, size_t size)
{
    char *p = malloc(size + 1);
    if (p) {
        memcpy(p, data, size);
        p[size] = '\0';
    }
    return p;
}

/* ---- a scratch folder, for targets whose inputs are files ---- */

struct fuzz_scratch {
    char *dir;   /* under FUZZ_TMPDIR, else tmpfs (/dev/shm) where writable, else /tmp */
    char *input; /* dir/<name>: where fuzz_write_input puts each input */
    char *extra; /* dir/<name> of a file the target itself may make (NULL: none) */
};

static inline struct fuzz_scratch *fuzz_scratch(void)
{
    static struct fuzz_scratch s;
    return &s;
}

static inline void fuzz_scratch_remove(void)
{
    struct fuzz_scratch *s = fuzz_scratch();
    if (s->input)
        unlink(s->input);
    if (s->extra)
        unlink(s->extra);
    if (s->dir)
        rmdir(s->dir);
}

/* Makes the folder (tmpfs when there is one: conversions fsync) and removes
 * it at exit; `extra` may be NULL. Exits where it cannot. */
static inline const struct fuzz_scratch *fuzz_scratch_init(const char *target, const char *input, const char *extra)
{
    struct fuzz_scratch *s = fuzz_scratch();
    const char *base = getenv("FUZZ_TMPDIR");
    if (!base || !*base)
        base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    if (asprintf(&s->dir, "%s/nf4deq-%s-XXXXXX", base, target) < 0 || !mkdtemp(s->dir) ||
        asprintf(&s->input, "%s/%s", s->dir, input) < 0 || (extra && asprintf(&s->extra, "%s/%s", s->dir, extra) < 0)) {
        perror(target);
        exit(1);
    }
    atexit(fuzz_scratch_remove);
    return s;
}

static inline void fuzz_write_input(const uint8_t *data, size_t size)
{
    const char *path = fuzz_scratch()->input;
    FILE *f = fopen(path, "wb");
    FUZZ_ASSERT(f && fwrite(data, 1, size, f) == size && fclose(f) == 0, "cannot write %s", path);
}

/* The folder holds the input and nothing else: what failed left nothing. */
static inline void fuzz_assert_only_input_left(const char *when)
{
    const struct fuzz_scratch *s = fuzz_scratch();
    const char *input = strrchr(s->input, '/') + 1;
    DIR *d = opendir(s->dir);
    FUZZ_ASSERT(d, "cannot list %s", s->dir);
    for (const struct dirent *e; (e = readdir(d));)
        FUZZ_ASSERT(!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, input),
                    "%s left %s behind in %s", when, e->d_name, s->dir);
    closedir(d);
}

#endif
