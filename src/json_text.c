#include "json_text.h"

#include <stdlib.h>

/* A minimal scanner, run only on text cJSON has already accepted: it trusts
 * the syntax, and only finds where each member's key and value lie. */

size_t json_text_skip_ws(const char *s, size_t i, size_t len)
{
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

static size_t skip_string(const char *s, size_t i, size_t len)
{
    for (i++; i < len; i++) {
        if (s[i] == '\\')
            i++;
        else if (s[i] == '"')
            return i + 1;
    }
    return len;
}

static size_t skip_value(const char *s, size_t i, size_t len)
{
    if (i >= len)
        return len;
    if (s[i] == '"')
        return skip_string(s, i, len);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        for (; i < len; i++) {
            if (s[i] == '"') {
                i = skip_string(s, i, len) - 1;
            } else if (s[i] == '{' || s[i] == '[') {
                depth++;
            } else if (s[i] == '}' || s[i] == ']') {
                if (--depth == 0)
                    return i + 1;
            }
        }
        return len;
    }
    while (i < len && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\t' && s[i] != '\n' &&
           s[i] != '\r')
        i++;
    return i;
}

static int hex_digit(char h)
{
    if (h >= '0' && h <= '9')
        return h - '0';
    if (h >= 'a' && h <= 'f')
        return h - 'a' + 10;
    if (h >= 'A' && h <= 'F')
        return h - 'A' + 10;
    return -1;
}

int json_member_key_is(const char *s, const struct json_member *m, const char *key)
{
    size_t i = m->key_start + 1, end = m->key_end - 1; /* inside the quotes */
    const unsigned char *k = (const unsigned char *)key;
    while (i < end) {
        unsigned c = (unsigned char)s[i++];
        if (c == '\\') {
            if (i >= end)
                return 0;
            char e = s[i++];
            switch (e) {
            case '"': case '\\': case '/': c = (unsigned char)e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u':
                if (end - i < 4)
                    return 0;
                c = 0;
                for (int d = 0; d < 4; d++) {
                    int v = hex_digit(s[i++]);
                    if (v < 0)
                        return 0;
                    c = c * 16 + (unsigned)v;
                }
                if (c == 0 || c >= 0x80) /* not an ASCII character of `key` */
                    return 0;
                break;
            default:
                return 0;
            }
        }
        if (*k == '\0' || *k != c)
            return 0;
        k++;
    }
    return *k == '\0';
}

struct json_member *json_scan_members(const char *json, size_t open, size_t len, size_t *count)
{
    size_t cap = 16;
    struct json_member *mem = malloc(cap * sizeof *mem);
    *count = 0;
    if (!mem)
        return NULL;
    size_t i = json_text_skip_ws(json, open + 1, len);
    while (i < len && json[i] == '"') {
        if (*count == cap) {
            struct json_member *grown = realloc(mem, 2 * cap * sizeof *mem);
            if (!grown) {
                free(mem);
                return NULL;
            }
            mem = grown;
            cap *= 2;
        }
        struct json_member *m = &mem[(*count)++];
        m->key_start = i;
        m->key_end = skip_string(json, i, len);
        i = json_text_skip_ws(json, m->key_end, len) + 1; /* past ':' */
        m->value_start = json_text_skip_ws(json, i, len);
        m->value_end = skip_value(json, m->value_start, len);
        i = json_text_skip_ws(json, m->value_end, len);
        if (i < len && json[i] == ',')
            i = json_text_skip_ws(json, i + 1, len);
    }
    return mem;
}
