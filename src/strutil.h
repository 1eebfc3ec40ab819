/* Small string tests shared by the modules that read tensor and file names,
 * JSON text and patterns. */
#ifndef NF4DEQ_STRUTIL_H
#define NF4DEQ_STRUTIL_H

#include <string.h>

/* 1 if `suffix` ends `s` and something comes before it. */
static inline int str_ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a > b && memcmp(s + a - b, suffix, b) == 0;
}

static inline int str_starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Python's str.endswith: the whole of `s` may be the suffix. */
static inline int str_has_suffix(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && memcmp(s + a - b, suffix, b) == 0;
}

/* The length of the well-formed UTF-8 sequence at s, with `left` bytes
 * readable (at least 1): 1 to 4, or 0 if it is not one (RFC 3629: no overlong
 * form, no surrogate, nothing past U+10FFFF). */
static inline size_t utf8_sequence(const unsigned char *s, size_t left)
{
    if (s[0] < 0x80)
        return 1;
    size_t n = s[0] >= 0xC2 && s[0] <= 0xDF ? 2 : s[0] >= 0xE0 && s[0] <= 0xEF ? 3 : s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : 0;
    if (n == 0 || n > left)
        return 0;
    for (size_t k = 1; k < n; k++)
        if ((s[k] & 0xC0) != 0x80)
            return 0;
    /* The second byte's range is what rules out the overlong forms, the
     * surrogates and what lies past U+10FFFF. */
    if ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] > 0x9F) || (s[0] == 0xF0 && s[1] < 0x90) ||
        (s[0] == 0xF4 && s[1] > 0x8F))
        return 0;
    return n;
}

static inline int utf8_is_valid(const unsigned char *s, size_t len)
{
    for (size_t i = 0, n; i < len; i += n)
        if ((n = utf8_sequence(s + i, len - i)) == 0)
            return 0;
    return 1;
}

#endif
