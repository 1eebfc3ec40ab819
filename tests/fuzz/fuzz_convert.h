/* What the fuzzers that run whole conversions share (fuzz_file,
 * fuzz_model_dir): which inputs are small enough to convert, and the failures
 * a conversion may end in. */
#ifndef NF4DEQ_FUZZ_CONVERT_H
#define NF4DEQ_FUZZ_CONVERT_H

#include "bnb_state.h"
#include "fuzz_common.h"
#include "model.h"

/* Converting allocates about chunk-sized buffers, but output sizes follow the
 * header: inputs claiming more data than this are only opened and inspected. */
#define FUZZ_MAX_DATA_BYTES (16u << 20)

static inline int fuzz_data_is_bounded(const struct model *m, const struct bnb_weight *w, size_t nw)
{
    uint64_t total = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        if (m->files[i]->file_size > FUZZ_MAX_DATA_BYTES)
            return 0;
    for (size_t i = 0; i < nw; i++) {
        /* fp32 output of every dequantized weight */
        if (w[i].state.n > FUZZ_MAX_DATA_BYTES / 4)
            return 0;
        total += w[i].state.n * 4;
    }
    return total <= FUZZ_MAX_DATA_BYTES;
}

/* A failure as the contract has it: data (65), memory (70), or a --mem too
 * small for a chunk of blocksize x nested_blocksize elements (2); one line. */
static inline void fuzz_assert_documented_failure(int code, const char *what)
{
    FUZZ_ASSERT(code == NF4_EDATA || code == NF4_ESOFTWARE ||
                    (code == NF4_EUSAGE && strstr(nf4_last_error(), "--mem is too small")),
                "%s failed with %d: %s", what, code, nf4_last_error());
    FUZZ_ASSERT(!strchr(nf4_last_error(), '\n'), "message spans lines: %s", nf4_last_error());
}

#endif
