#include "strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void strbuf_put(struct strbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void strbuf_puts(struct strbuf *b, const char *s)
{
    strbuf_put(b, s, strlen(s));
}

void strbuf_printf(struct strbuf *b, const char *fmt, ...)
{
    /* Short texts (numbers, most names) format on the stack; longer ones
     * (paths) get the exact size: nothing is ever cut. */
    char tmp[128];
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof tmp) {
        strbuf_put(b, tmp, (size_t)n);
    } else if (n > 0) {
        char *big = malloc((size_t)n + 1);
        if (big && vsnprintf(big, (size_t)n + 1, fmt, again) == n)
            strbuf_put(b, big, (size_t)n);
        else
            b->oom = 1;
        free(big);
    }
    va_end(again);
}

static void put_json_string(struct strbuf *b, const char *s, int for_terminal)
{
    static const char SHORT[0x20] = {['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't'};
    strbuf_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char esc[2] = {'\\', (char)*p};
            strbuf_put(b, esc, 2);
        } else if (*p < 0x20 && SHORT[*p]) {
            char esc[2] = {'\\', SHORT[*p]};
            strbuf_put(b, esc, 2);
        } else if (*p < 0x20 || (for_terminal && *p == 0x7f)) {
            strbuf_printf(b, "\\u%04x", *p);
        } else if (for_terminal && p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) { /* U+0080-U+009F */
            strbuf_printf(b, "\\u%04x", p[1]);
            p++;
        } else {
            strbuf_put(b, (const char *)p, 1);
        }
    }
    strbuf_put(b, "\"", 1);
}

void strbuf_json_string(struct strbuf *b, const char *s)
{
    put_json_string(b, s, 0);
}

void strbuf_json_string_for_terminal(struct strbuf *b, const char *s)
{
    put_json_string(b, s, 1);
}

char *str_concat(const char *a, const char *b)
{
    const size_t na = strlen(a), nb = strlen(b);
    char *s = malloc(na + nb + 1);
    if (s) {
        memcpy(s, a, na);
        memcpy(s + na, b, nb + 1);
    }
    return s;
}

char *str_replace_all(const char *s, const char *from, const char *to)
{
    size_t nf = strlen(from), nt = strlen(to), n = 0;
    for (const char *p = s; (p = strstr(p, from)); p += nf)
        n++;
    char *out = malloc(strlen(s) + n * nt + 1), *o = out;
    if (!out)
        return NULL;
    for (const char *p = s, *hit; (hit = strstr(p, from)) || *p; p = hit + nf) {
        if (!hit) {
            strcpy(o, p);
            return out;
        }
        memcpy(o, p, (size_t)(hit - p));
        o += hit - p;
        memcpy(o, to, nt);
        o += nt;
    }
    *o = '\0';
    return out;
}

int str_replace_in(char **s, const char *from, const char *to)
{
    if (!strstr(*s, from))
        return 1;
    char *r = str_replace_all(*s, from, to);
    if (!r)
        return 0;
    free(*s);
    *s = r;
    return 1;
}

char *str_replace_in_turn(const char *s, const char *const (*pairs)[2], size_t n)
{
    char *out = strdup(s);
    for (size_t i = 0; out && i < n; i++)
        if (!str_replace_in(&out, pairs[i][0], pairs[i][1])) {
            free(out);
            out = NULL;
        }
    return out;
}
