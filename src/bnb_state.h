/* bitsandbytes 4-bit quant states: finding a weight's parts and checking that
 * they agree with each other before any arithmetic is done on them.
 *
 * For a weight X (Linear4bit state-dict naming) a checkpoint holds
 *   X                                   packed nibbles, any storage dtype
 *   X.absmax                            U8 codes (double quant) or F32 scales
 *   X.quant_map                         F32[16]
 *   X.nested_absmax, X.nested_quant_map F32, F32[256] (double quant only)
 *   X.quant_state.bitsandbytes__nf4|fp4 U8 bytes of a JSON object */
#ifndef NF4DEQ_BNB_STATE_H
#define NF4DEQ_BNB_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "dequant.h"
#include "model.h"

#define QUANT_STATE_SUFFIX_NF4 ".quant_state.bitsandbytes__nf4"
#define QUANT_STATE_SUFFIX_FP4 ".quant_state.bitsandbytes__fp4"
/* A quant-state blob is a few hundred bytes; refuse absurd ones before reading. */
#define MAX_QUANT_STATE_BYTES (1u << 20)
/* bitsandbytes' largest blockwise blocksize; it always uses 256. */
#define MAX_NESTED_BLOCKSIZE 4096u

/* What the JSON blob says. */
struct bnb_state {
    enum quant_type quant_type;
    uint32_t blocksize;
    enum st_dtype dtype; /* the weight's original dtype: bitsandbytes' default output */
    size_t ndim;
    uint64_t shape[8];
    uint64_t n;
    int nested;
    uint32_t nested_blocksize;
    float nested_offset;
};

struct bnb_weight {
    char *name;
    struct bnb_state state;
    const struct model_tensor *packed, *absmax, *quant_map, *nested_absmax, *nested_quant_map, *state_blob;
    uint64_t blocks;        /* ceil(n / blocksize) */
    uint64_t nested_blocks; /* ceil(blocks / nested_blocksize), double quant only */
    int quant_map_is_standard;
};

/* Parses and validates a quant-state JSON blob. `file` and `tensor` name it in
 * messages. Returns NF4_OK or NF4_EDATA. */
int bnb_parse_state(const char *file, const char *tensor, const char *json, size_t len, struct bnb_state *out);

/* Finds every 4-bit weight in the model, reads and validates its quant state and
 * checks its parts' dtypes and sizes. Also refuses quant-state parts that belong
 * to no weight and 8-bit (LLM.int8) weights. Weights come back sorted by name. */
int bnb_collect(const struct model *m, struct bnb_weight **out, size_t *count);
void bnb_free(struct bnb_weight *w, size_t count);

/* 1 if `name` is one of the parts above other than the packed weight itself. */
int bnb_is_state_part(const char *name);
const struct bnb_weight *bnb_find(const struct bnb_weight *w, size_t count, const char *name);
/* The same for the first len bytes of name (a weight's name inside a part's,
 * "W" of "W.absmax"), which allocates nothing, so it cannot fail. */
const struct bnb_weight *bnb_find_n(const struct bnb_weight *w, size_t count, const char *name, size_t len);
/* The weight quant-state part `part` ("W.absmax", ...) belongs to, or NULL;
 * allocates nothing. */
const struct bnb_weight *bnb_owner_of(const struct bnb_weight *w, size_t count, const char *part);

#endif
