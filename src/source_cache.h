/* A few whole 4-bit tensors held in memory for the chunks that each read
 * every row of one: the chunks of a tensor written transposed (transposed.h),
 * each of which gathers a few columns from all the rows. Read in bands of
 * whole rows, a tensor was read once per chunk, a dozen times over for
 * gpt-oss's experts (PERFORMANCE.md, "Unsloth's gpt-oss experts, fused");
 * held here, it is read once, by the first worker that needs it, while the
 * others that do wait for it. The workers share it: a tensor stays while a
 * chunk uses it, and the one least recently used gives way to the next. A
 * tensor larger than an entry, or one that finds every entry in use, is read
 * in bands as before, so the cache never holds up a chunk for lack of room. */
#ifndef NF4DEQ_SOURCE_CACHE_H
#define NF4DEQ_SOURCE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "bnb_state.h"

/* Entries: the tensor the chunks are in, the next one, and one more. */
#define SOURCE_CACHE_ENTRIES 3
/* The largest tensor held (its packed bytes and scales): gpt-oss's
 * gate_up_projs.N take 8.6 MB. */
#define SOURCE_CACHE_MAX_BYTES (UINT64_C(24) << 20)

/* A tensor held: its packed bytes, absmax (codes or scales) and nested
 * absmax, all of them, from element 0. */
struct cached_source {
    const unsigned char *packed;
    const unsigned char *absmax;
    const float *nested_absmax;
};

struct source_cache;

/* The bytes w's entry takes: what source_cache_bytes counts and an entry must hold. */
uint64_t source_cache_entry_bytes(const struct bnb_weight *w);
/* Reads w whole into buf (source_cache_entry_bytes(w) bytes, aligned for
 * floats: each part starts a multiple of 64 bytes in), *view pointing at its
 * parts there: what an entry holds, for a reader outside the cache
 * (lora_widen.h). A read's failure is returned. */
int source_read_whole(const struct bnb_weight *w, unsigned char *buf, struct cached_source *view);
/* A cache of SOURCE_CACHE_ENTRIES entries of entry_bytes each (at most
 * SOURCE_CACHE_MAX_BYTES), mapped now and touched as tensors are read;
 * `path` (the output) names it in messages. */
int source_cache_create(struct source_cache **out, uint64_t entry_bytes, const char *path);
void source_cache_destroy(struct source_cache *c);
/* Forgets every tensor, with none borrowed: the next output's weights are
 * others, which may lie where these lay. c may be NULL. */
void source_cache_clear(struct source_cache *c);

/* Borrows w whole, read now by this thread or already by another (waits
 * while another reads it): *held points at it until source_cache_put. NULL
 * in *held where it is larger than an entry or every entry is in use: the
 * caller reads what it needs itself. A read's failure is returned (and the
 * entry left empty). c may be NULL. */
int source_cache_get(struct source_cache *c, const struct bnb_weight *w, const struct cached_source **held);
void source_cache_put(struct source_cache *c, const struct cached_source *held);

#endif
