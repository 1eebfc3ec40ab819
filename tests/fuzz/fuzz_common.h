/* Shared by the libFuzzer targets: each input runs with a clean error state and
 * no warnings on stderr; an invariant that does not hold aborts with a message,
 * which libFuzzer reports as a crash and saves as a reproducer. */
#ifndef NF4DEQ_FUZZ_COMMON_H
#define NF4DEQ_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#endif
