/* Small string tests shared by the modules that read tensor and file names. */
#ifndef NF4DEQ_STRUTIL_H
#define NF4DEQ_STRUTIL_H

#include <string.h>

/* 1 if `suffix` ends `s` and something comes before it. */
static inline int str_ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a > b && memcmp(s + a - b, suffix, b) == 0;
}

#endif
