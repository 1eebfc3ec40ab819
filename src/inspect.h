/* `nf4deq inspect`: what a checkpoint holds and what converting it would write. */
#ifndef NF4DEQ_INSPECT_H
#define NF4DEQ_INSPECT_H

#include <stdio.h>

#include "dtype.h"

/* Prints a report on `in` (file or model directory) to `out`, as text or JSON.
 * `dtype` is the --dtype the size after conversion is computed for
 * (DT_INVALID: each weight's own). With `nlora` adapter directories it also
 * lists every tensor they change, with r, alpha and scaling, after checking
 * them against `in` as convert --lora does. With adapters or `tokenizer`
 * (convert's --tokenizer, or NULL) it says whose tokenizer files convert
 * would give a model directory's output. Returns an NF4_* code. */
int inspect_run(const char *in, int json, enum st_dtype dtype, const char *const *lora_dirs, size_t nlora,
                const char *tokenizer, FILE *out);

#endif
