/* A growable string for the JSON nf4deq writes (safetensors headers, index.json,
 * config.json). Appends after an allocation failure are dropped and `oom` set,
 * so a writer checks once at the end. */
#ifndef NF4DEQ_STRBUF_H
#define NF4DEQ_STRBUF_H

#include <stddef.h>

#include "status.h"

struct strbuf {
    char *p; /* NUL-terminated once anything was appended */
    size_t len, cap;
    int oom;
};

void strbuf_put(struct strbuf *b, const char *s, size_t n);
void strbuf_puts(struct strbuf *b, const char *s);
void strbuf_printf(struct strbuf *b, const char *fmt, ...) NF4_PRINTF(2, 3);
/* Appends s as a JSON string literal, escaped as serde_json (the safetensors
 * writer) escapes it: quotes, backslashes, \b \f \n \r \t, other control
 * characters as \u00XX, every other byte (UTF-8 included) as it is. */
void strbuf_json_string(struct strbuf *b, const char *s);
/* The same, for what reaches a terminal (the --json reports): DEL and the C1
 * controls U+0080-U+009F escaped too, so no name can drive the terminal. */
void strbuf_json_string_for_terminal(struct strbuf *b, const char *s);

/* a followed by b: allocated, NULL when out of memory. */
char *str_concat(const char *a, const char *b);

/* `s` with every `from` (not empty) replaced by `to`, as Python's str.replace:
 * allocated, NULL when out of memory. */
char *str_replace_all(const char *s, const char *from, const char *to);

/* Replaces every `from` in the malloc'd *s by `to` (str_replace_all): 1, or 0
 * when out of memory, *s then as it was. */
int str_replace_in(char **s, const char *from, const char *to);

/* `s` with each pair's first replaced by its second, in turn, as a chain of
 * Python's str.replace calls does: allocated, NULL when out of memory. */
char *str_replace_in_turn(const char *s, const char *const (*pairs)[2], size_t n);

#endif
