/* Strict JSON parsing for the small documents nf4deq reads (quant states,
 * index.json, config.json). */
#ifndef NF4DEQ_JSON_UTIL_H
#define NF4DEQ_JSON_UTIL_H

#include <cJSON.h>
#include <stddef.h>

/* 0 if the text holds what RFC 8259 forbids but cJSON lets through: a byte
 * below 0x20 inside a string, or outside one other than space, tab, LF, CR
 * (cJSON skips every byte up to 0x20 as white space), a byte of 0x80 or more
 * outside a string (a UTF-8 byte-order mark, which cJSON skips). It also
 * refuses the escape \u0000, which would cut a C string short ("a\u0000b"
 * would silently become "a"), and a \u not followed by four hex digits, which
 * cJSON decodes as \u0000 instead of failing. Inside a string, bytes of 0x80
 * or more must be well-formed UTF-8 (RFC 3629: no overlong form, surrogate
 * or code point past U+10FFFF): cJSON copies any bytes, and the official
 * safetensors reader (serde_json) and Python's json refuse a file that is
 * not UTF-8. Python's json module rejects all of these but \u0000. */
int json_text_is_strict(const char *json, size_t len);

/* Parses exactly one JSON value spanning the whole buffer (surrounding white
 * space allowed), which must pass json_text_is_strict. NULL on invalid JSON
 * or trailing bytes. */
cJSON *json_parse_whole(const char *json, size_t len);

/* Python's json module writes a float that is not finite as the bare words
 * NaN, Infinity or -Infinity, which are not JSON; bitsandbytes writes a
 * quant state that way. Returns a copy of the text (*out_len bytes, not
 * NUL-terminated) with each such word outside a string replaced by null, and
 * *replaced set to how many; NULL when out of memory. */
char *json_python_nonfinite_to_null(const char *json, size_t len, size_t *out_len, size_t *replaced);

/* cJSON_ParseWithLengthOpts (no NUL required) with allocation failures
 * tracked for json_ran_out_of_memory(); *end is where the value ended. */
cJSON *json_parse_prefix(const char *json, size_t len, const char **end);

/* 1 if the last json_parse_whole on this thread failed for want of memory
 * rather than because the text is not JSON. */
int json_ran_out_of_memory(void);

/* After a document of `text_bytes` was parsed and its tree deleted: where it
 * was large (a header of many thousand tensors, a big index), hands back to
 * the system the heap its nodes took (about 8 times its text), which glibc's
 * malloc would keep, so that the process does not hold it for nothing while
 * --mem's chunks stream. Does nothing for a smaller one, or without glibc. */
void json_release_heap(size_t text_bytes);

/* How many of cJSON's allocations have failed on this thread so far. cJSON's
 * Add functions say nothing when memory runs out, so a document built with
 * them (inspect --json, convert --json) is whole only if this count did not
 * change while it was built. */
unsigned long json_allocation_failures(void);

/* cJSON_AddItemToObject and cJSON_AddItemToArray that delete `item` where
 * they fail (a NULL container, or no memory for the key), which cJSON leaves
 * to the caller; a NULL item is no change. 1 where `item` was added; 0
 * otherwise, when it is gone and must not be used. */
int json_add_item(cJSON *object, const char *key, cJSON *item);
int json_add_to_array(cJSON *array, cJSON *item);

/* 1 if an object has the same key twice. cJSON keeps the first copy and
 * Python's json module the last, so such a document means two different
 * things to nf4deq and to bitsandbytes: it is refused. */
int json_has_duplicate_key(const cJSON *object);
/* The same, naming a repeated key: 1 and *dup (pointing into the object), 0,
 * or -1 when out of memory (json_has_duplicate_key too). O(n log n); objects
 * of up to 64 keys allocate nothing. */
int json_first_duplicate_key(const cJSON *object, const char **dup);

/* The end of the number token at s[i]; *plain_integer is 1 if it is a plain
 * non-negative integer as written: digits only, no leading zero, at most 16
 * digits (exact in a double). cJSON reads 64, 64.0 and 6.4e1 alike, so a
 * field that must be an integer is checked on the text. */
size_t json_number_end(const char *s, size_t len, size_t i, int *plain_integer);

/* 1 if every number in the values of the given keys of a top-level object
 * (nested arrays and objects included) is a plain integer as above, a minus
 * sign allowed; else 0,
 * with *bad_key. The text must have passed json_text_is_strict. */
int json_keys_hold_plain_integers(const char *s, size_t len, const char *const *keys, size_t nkeys,
                                  const char **bad_key);

/* Sets object[key] = value as a Python dict does: in place where the key is
 * there, else added last. 0 when out of memory (nothing changed). */
int json_set_number(cJSON *object, const char *key, double value);

/* Prints a document as jq does by default: two-space indentation, "key": value,
 * empty containers as {} and [], one value per line, a final newline, DEL as
 * \u007f; the C1 controls are escaped too (strbuf_json_string_for_terminal).
 * NULL when out of memory. */
char *json_print_pretty(const cJSON *item);

#endif
