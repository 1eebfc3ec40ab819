/* Answers pattern queries for tests/python/check_patterns.py, which asks the
 * same questions of Python's re: reads records "PATTERN\0NAME\0" from stdin and
 * prints, per record, "1" (re.match finds a match), "0" (it does not), or
 * "E reason" (the pattern is refused), one per line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pattern.h"

/* One NUL-terminated field from stdin; NULL at a clean end of input. */
static char *read_field(void)
{
    size_t n = 0, cap = 64;
    char *s = malloc(cap);
    int c;
    while (s && (c = getchar()) != EOF && c != '\0') {
        if (n + 1 == cap) {
            char *t = realloc(s, cap *= 2);
            if (!t)
                free(s);
            s = t;
        }
        if (s)
            s[n++] = (char)c;
    }
    if (!s) {
        fputs("pattern_match: out of memory\n", stderr);
        exit(70);
    }
    if (c == EOF && n == 0) {
        free(s);
        return NULL;
    }
    s[n] = '\0';
    return s;
}

int main(void)
{
    char *pat;
    while ((pat = read_field())) {
        char *name = read_field();
        if (!name) {
            fputs("pattern_match: a pattern without a name\n", stderr);
            return 65;
        }
        struct pattern *p;
        const char *why;
        int code = pattern_compile(pat, &p, &why);
        if (code == PATTERN_NOMEM) {
            fputs("pattern_match: out of memory\n", stderr);
            return 70;
        }
        if (code == PATTERN_INVALID)
            printf("E %s\n", why);
        else
            printf("%d\n", pattern_match(p, name));
        pattern_free(p);
        free(pat);
        free(name);
    }
    return fflush(stdout) == 0 && !ferror(stdout) ? 0 : 74;
}
