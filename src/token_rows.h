/* Trainable tokens: rows of an embedding (or of a head) that a LoRA adapter
 * trained whole, with PEFT's trainable_token_indices, instead of the whole
 * matrix.
 *
 * adapter_config.json lists the rows, either as one list for the model's
 * input embedding,
 *   "trainable_token_indices": [128000, 128001]
 * or per module, matched as PEFT matches them (the module's name ends with
 * the key, with no '.' boundary):
 *   "trainable_token_indices": {"embed_tokens": [5, 9], "lm_head": [5, 9]}
 * and the weights file holds, for each module wrapped,
 *   base_model.model.<module>.token_adapter.trainable_tokens_delta   [n, cols]
 * whose row i is the new value of row indices[i] of <module>.weight (despite
 * the name, the values themselves, not a difference). PEFT's merge is an
 * index_copy of those rows, cast to the weight's dtype. */
#ifndef NF4DEQ_TOKEN_ROWS_H
#define NF4DEQ_TOKEN_ROWS_H

#include <cJSON.h>
#include <stdint.h>

#include "dtype.h"
#include "model.h"

#define TOKEN_DELTA_SUFFIX ".token_adapter.trainable_tokens_delta"
#define TOKEN_INDICES_KEY "trainable_token_indices"

/* The rows one adapter replaces in one base tensor. */
struct token_rows {
    const struct model_tensor *values; /* [n, cols]: F32, BF16 or F16 */
    enum st_dtype round_to; /* the base tensor's dtype, which PEFT casts the rows to */
    uint64_t n;
    uint64_t *row; /* ascending */
    uint64_t *src; /* the row of `values` that becomes row[i] */
};

/* Checks the config's trainable_token_indices (`v`, NULL when absent):
 * null, a list of row numbers, or an object of such lists; no row twice in
 * one list (index_copy would keep an undefined one of them). The numbers
 * must be plain integers as written (json_keys_hold_plain_integers): the
 * caller checks the text. NF4_OK or NF4_EDATA naming `path`. */
int token_indices_check(const char *path, const cJSON *v);

/* The list of rows that the config gives `module` (as "model.embed_tokens"):
 * the list itself, or the one object entry whose key ends the module's name.
 * NULL with *ambiguous 0 where none does, 1 where two entries do. */
const cJSON *token_indices_for(const cJSON *v, const char *module, int *ambiguous);

/* Builds the rows of `values` laid by `list` on a base tensor of `rows` x
 * `cols` of dtype `round_to`: checks the values' dtype and shape and each row
 * number against the tensor. NF4_OK, or NF4_EDATA / NF4_ESOFTWARE naming
 * `values` and `wname`. Free with token_rows_free. */
int token_rows_build(const cJSON *list, const struct model_tensor *values, const char *wname, uint64_t rows,
                     uint64_t cols, enum st_dtype round_to, struct token_rows **out);
void token_rows_free(struct token_rows *t);

/* Whether a and b replace the same rows with the same values, element for
 * element in the same dtype (PEFT saves a tied head's rows, the embedding's,
 * under both names). */
int token_rows_same(const struct token_rows *a, const struct token_rows *b, int *same);

/* The first i with row[i] >= first_row, and the first with row[i] > last_row:
 * the rows replaced in [first_row, last_row] are [*begin, *end). */
void token_rows_between(const struct token_rows *t, uint64_t first_row, uint64_t last_row, uint64_t *begin,
                        uint64_t *end);

#endif
