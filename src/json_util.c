#include "json_util.h"

#include <pthread.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strbuf.h"
#include "strutil.h"

/* cJSON returns NULL both for bad JSON and for a failed allocation; this hook
 * tells the two apart, so running out of memory is not reported as bad input. */
static _Thread_local int parse_ran_out_of_memory;
static _Thread_local unsigned long allocation_failures;
static pthread_once_t hooks_installed = PTHREAD_ONCE_INIT;

static void *tracking_malloc(size_t size)
{
    void *p = malloc(size);
    if (!p) {
        parse_ran_out_of_memory = 1;
        allocation_failures++;
    }
    return p;
}

static void install_hooks(void)
{
    cJSON_Hooks hooks = {tracking_malloc, free};
    cJSON_InitHooks(&hooks);
}

int json_ran_out_of_memory(void)
{
    return parse_ran_out_of_memory;
}

/* Smaller documents leave too little behind to be worth a walk of the heap. */
#define JSON_RELEASE_MIN_BYTES (UINT64_C(1) << 20)

void json_release_heap(size_t text_bytes)
{
#ifdef __GLIBC__
    if (text_bytes >= JSON_RELEASE_MIN_BYTES)
        malloc_trim(0);
#else
    (void)text_bytes;
#endif
}

unsigned long json_allocation_failures(void)
{
    pthread_once(&hooks_installed, install_hooks);
    return allocation_failures;
}

int json_add_item(cJSON *object, const char *key, cJSON *item)
{
    if (item && !cJSON_AddItemToObject(object, key, item)) {
        cJSON_Delete(item);
        return 0;
    }
    return item != NULL;
}

int json_add_to_array(cJSON *array, cJSON *item)
{
    if (item && !cJSON_AddItemToArray(array, item)) {
        cJSON_Delete(item);
        return 0;
    }
    return item != NULL;
}

int json_text_is_strict(const char *json, size_t len)
{
    int in_string = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)json[i];
        if (in_string) {
            if (c == '"')
                in_string = 0;
            else if (c < 0x20)
                return 0;
            else if (c >= 0x80) {
                size_t n = utf8_sequence((const unsigned char *)json + i, len - i);
                if (n == 0)
                    return 0;
                i += n - 1;
            } else if (c == '\\' && i + 1 < len && json[++i] == 'u') {
                /* cJSON reads a malformed \uXXXX as U+0000 instead of failing. */
                unsigned v = 0;
                for (int k = 1; k <= 4; k++) {
                    char h = i + k < len ? json[i + k] : '\0';
                    int d = (h >= '0' && h <= '9') ? h - '0'
                            : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                            : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
                    if (d < 0)
                        return 0;
                    v = v * 16 + (unsigned)d;
                }
                if (v == 0)
                    return 0;
                i += 4;
            }
        } else if (c == '"') {
            in_string = 1;
        } else if ((c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c >= 0x80) {
            return 0;
        }
    }
    return 1;
}

cJSON *json_parse_prefix(const char *json, size_t len, const char **end)
{
    pthread_once(&hooks_installed, install_hooks);
    parse_ran_out_of_memory = 0;
    return cJSON_ParseWithLengthOpts(json, len, end, 0);
}

cJSON *json_parse_whole(const char *json, size_t len)
{
    parse_ran_out_of_memory = 0;
    if (!json_text_is_strict(json, len))
        return NULL;
    const char *end = NULL;
    cJSON *root = json_parse_prefix(json, len, &end);
    if (!root)
        return NULL;
    for (const char *p = end; p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return NULL;
        }
    return root;
}

char *json_python_nonfinite_to_null(const char *json, size_t len, size_t *out_len, size_t *replaced)
{
    static const char *const WORDS[] = {"-Infinity", "Infinity", "NaN"};
    /* null is at most one byte longer than the word it replaces (NaN). */
    size_t cap = len + len / 3 + 1;
    char *out = malloc(cap);
    if (!out)
        return NULL;
    size_t o = 0, n = 0;
    int in_string = 0;
    for (size_t i = 0; i < len;) {
        char c = json[i];
        if (in_string) {
            if (c == '\\' && i + 1 < len)
                out[o++] = json[i++];
            else if (c == '"')
                in_string = 0;
            out[o++] = json[i++];
            continue;
        }
        size_t w = 0;
        while (w < sizeof WORDS / sizeof *WORDS &&
               !(len - i >= strlen(WORDS[w]) && memcmp(json + i, WORDS[w], strlen(WORDS[w])) == 0))
            w++;
        if (w < sizeof WORDS / sizeof *WORDS) {
            memcpy(out + o, "null", 4);
            o += 4;
            i += strlen(WORDS[w]);
            n++;
            continue;
        }
        in_string = c == '"';
        out[o++] = json[i++];
    }
    *out_len = o;
    *replaced = n;
    return out;
}

size_t json_number_end(const char *s, size_t len, size_t i, int *plain_integer)
{
    size_t start = i;
    int plain = 1;
    while (i < len && ((s[i] >= '0' && s[i] <= '9') || s[i] == '-' || s[i] == '+' || s[i] == '.' || s[i] == 'e' ||
                       s[i] == 'E')) {
        if (s[i] < '0' || s[i] > '9')
            plain = 0;
        i++;
    }
    /* Leading zeros ("007") are not JSON; more than 16 digits cannot be exact. */
    if ((i - start > 1 && s[start] == '0') || i - start > 16)
        plain = 0;
    *plain_integer = plain;
    return i;
}

static int hex_digit(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* 1 if the JSON string body s[0..len) (escapes undecoded, strict text) reads
 * as `key`: "\u0072" is "r" to cJSON and to Python. */
static int string_body_is(const char *s, size_t len, const char *key)
{
    size_t i = 0;
    for (; i < len && *key; key++) {
        unsigned c = (unsigned char)s[i++];
        if (c == '\\' && i < len) {
            char e = s[i++];
            if (e == 'u' && i + 4 <= len) {
                c = 0;
                for (int k = 0; k < 4; k++)
                    c = c * 16 + (unsigned)hex_digit(s[i++]); /* strict text: four hex digits */
            } else {
                c = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : (unsigned char)e;
            }
        }
        if (c != (unsigned char)*key)
            return 0;
    }
    return i == len && !*key;
}

static int key_is_one_of(const char *s, size_t len, const char *const *keys, size_t nkeys)
{
    for (size_t k = 0; k < nkeys; k++)
        if (string_body_is(s, len, keys[k]))
            return (int)k;
    return -1;
}

int json_keys_hold_plain_integers(const char *s, size_t len, const char *const *keys, size_t nkeys,
                                  const char **bad_key)
{
    int depth = 0, key = -1; /* key: which of `keys` the current top-level value is under */
    size_t str_start = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (c == '"') {
            str_start = ++i;
            while (i < len && s[i] != '"')
                i += s[i] == '\\' ? 2 : 1;
            size_t j = i + 1;
            while (j < len && (s[j] == ' ' || s[j] == '\t' || s[j] == '\n' || s[j] == '\r'))
                j++;
            if (depth == 1 && j < len && s[j] == ':') /* a key of the top-level object */
                key = key_is_one_of(s + str_start, i - str_start, keys, nkeys);
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            depth--;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            /* A sign is allowed: -4096 is written as an integer, and the
             * caller refuses it for what it is. */
            int plain;
            size_t end = json_number_end(s, len, i + (c == '-'), &plain);
            if (key >= 0 && !plain) {
                *bad_key = keys[key];
                return 0;
            }
            i = end - 1;
        }
    }
    return 1;
}

static int cmp_key(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Sorted, not pairwise: a hostile document with a million keys must not take
 * hours. */
int json_first_duplicate_key(const cJSON *object, const char **dup)
{
    *dup = NULL;
    size_t n = 0;
    for (const cJSON *c = object->child; c; c = c->next)
        n += c->string != NULL;
    if (n < 2)
        return 0;
    /* The documents nf4deq reads have tens of keys: no allocation for those. */
    const char *small[64];
    const char **keys = n <= sizeof small / sizeof *small ? small : malloc(n * sizeof *keys);
    if (!keys)
        return -1;
    n = 0;
    for (const cJSON *c = object->child; c; c = c->next)
        if (c->string)
            keys[n++] = c->string;
    qsort(keys, n, sizeof *keys, cmp_key);
    for (size_t i = 1; i < n && !*dup; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            *dup = keys[i];
    if (keys != small)
        free(keys);
    return *dup != NULL;
}

int json_has_duplicate_key(const cJSON *object)
{
    const char *dup;
    return json_first_duplicate_key(object, &dup);
}

/* The shortest decimal that reads back as the same double, as jq 1.7 prints
 * numbers; integers (every size and count nf4deq reports) without a fraction. */
static void put_number(struct strbuf *b, double v)
{
    if (v != v || v == 1.0 / 0.0 || v == -1.0 / 0.0) {
        strbuf_puts(b, "null"); /* JSON has no NaN or infinity */
        return;
    }
    if (v > -9007199254740992.0 && v < 9007199254740992.0 && v == (double)(long long)v) { /* range first: no UB */
        strbuf_printf(b, "%lld", (long long)v);
        return;
    }
    char text[32];
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, v);
        if (strtod(text, NULL) == v)
            break;
    }
    strbuf_puts(b, text);
}

static void put_indent(struct strbuf *b, int depth)
{
    for (int i = 0; i < depth; i++)
        strbuf_puts(b, "  ");
}

static void put_value(struct strbuf *b, const cJSON *item, int depth)
{
    if (cJSON_IsObject(item) || cJSON_IsArray(item)) {
        int object = cJSON_IsObject(item);
        if (!item->child) {
            strbuf_puts(b, object ? "{}" : "[]");
            return;
        }
        strbuf_puts(b, object ? "{\n" : "[\n");
        for (const cJSON *c = item->child; c; c = c->next) {
            put_indent(b, depth + 1);
            if (object) {
                strbuf_json_string_for_terminal(b, c->string);
                strbuf_puts(b, ": ");
            }
            put_value(b, c, depth + 1);
            strbuf_puts(b, c->next ? ",\n" : "\n");
        }
        put_indent(b, depth);
        strbuf_puts(b, object ? "}" : "]");
    } else if (cJSON_IsString(item)) {
        strbuf_json_string_for_terminal(b, item->valuestring);
    } else if (cJSON_IsNumber(item)) {
        put_number(b, item->valuedouble);
    } else if (cJSON_IsBool(item)) {
        strbuf_puts(b, cJSON_IsTrue(item) ? "true" : "false");
    } else {
        strbuf_puts(b, "null");
    }
}

char *json_print_pretty(const cJSON *item)
{
    struct strbuf b = {0};
    put_value(&b, item, 0);
    strbuf_puts(&b, "\n");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

int json_set_number(cJSON *object, const char *key, double value)
{
    cJSON *item = cJSON_CreateNumber(value);
    if (!item)
        return 0;
    const int set = cJSON_GetObjectItemCaseSensitive(object, key) ? cJSON_ReplaceItemInObjectCaseSensitive(object, key, item)
                                                                  : cJSON_AddItemToObject(object, key, item);
    if (!set)
        cJSON_Delete(item);
    return set;
}
