#include "json_util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* cJSON returns NULL both for bad JSON and for a failed allocation; this hook
 * tells the two apart, so running out of memory is not reported as bad input. */
static _Thread_local int parse_ran_out_of_memory;
static pthread_once_t hooks_installed = PTHREAD_ONCE_INIT;

static void *tracking_malloc(size_t size)
{
    void *p = malloc(size);
    if (!p)
        parse_ran_out_of_memory = 1;
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
            else if (c == '\\' && i + 1 < len && json[++i] == 'u') {
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

int json_has_duplicate_key(const cJSON *object)
{
    for (const cJSON *a = object->child; a; a = a->next)
        for (const cJSON *b = a->next; b; b = b->next)
            if (a->string && b->string && strcmp(a->string, b->string) == 0)
                return 1;
    return 0;
}
