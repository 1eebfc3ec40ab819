/* Edits of a JSON document's text that keep the rest of it byte for byte
 * (config.json, model_index.json): where each member of an object lies, so
 * that one value can be replaced or one member dropped. Run only on text
 * cJSON has already accepted. */
#ifndef NF4DEQ_JSON_TEXT_H
#define NF4DEQ_JSON_TEXT_H

#include <stddef.h>

struct json_member {
    size_t key_start, key_end; /* the key including its quotes */
    size_t value_start, value_end;
};

/* The index of the first character at or after i that is not JSON
 * whitespace, or len. */
size_t json_text_skip_ws(const char *s, size_t i, size_t len);

/* Compares a member's key, as a JSON reader decodes it, with `key` (plain
 * ASCII): an escaped spelling such as "quantization\u005fconfig" names the same
 * key for every reader and must match too. Allocates nothing, so it cannot
 * fail. */
int json_member_key_is(const char *s, const struct json_member *m, const char *key);

/* The members of the JSON object that opens at json[open] ('{'), in order
 * (*count of them); NULL when memory runs out. */
struct json_member *json_scan_members(const char *json, size_t open, size_t len, size_t *count);

#endif
