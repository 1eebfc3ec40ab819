/* Strict JSON parsing for the small documents nf4deq reads (quant states,
 * index.json, config.json). */
#ifndef NF4DEQ_JSON_UTIL_H
#define NF4DEQ_JSON_UTIL_H

#include <cJSON.h>
#include <stddef.h>

/* Parses exactly one JSON value spanning the whole buffer (surrounding white
 * space allowed). NULL on invalid JSON or trailing bytes. */
cJSON *json_parse_whole(const char *json, size_t len);

/* 1 if an object has the same key twice. cJSON keeps the first copy and
 * Python's json module the last, so such a document means two different
 * things to nf4deq and to bitsandbytes: it is refused. */
int json_has_duplicate_key(const cJSON *object);

#endif
