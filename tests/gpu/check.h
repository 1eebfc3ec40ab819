/* A pass/fail counter for the GPU test programs: the device machine has no
 * CMocka. Each program prints "N passed, N failed" at the end. */
#ifndef NF4DEQ_GPU_CHECK_H
#define NF4DEQ_GPU_CHECK_H

#include <stdio.h>

static int passed, failed;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            passed++;                                                                              \
        } else {                                                                                   \
            failed++;                                                                              \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                            \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

#endif
