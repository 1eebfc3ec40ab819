/* bnb_parse_state on arbitrary bytes (a quant_state.bitsandbytes__* blob). */
#include <math.h>

#include "bnb_state.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *json = fuzz_copy(data, size);
    if (!json)
        return 0;
    nf4_clear_error();
    struct bnb_state s;
    int code = bnb_parse_state("fuzz.safetensors", "w.quant_state.bitsandbytes__nf4", json, size, &s);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
    } else {
        /* The ranges the dequantizer's buffer arithmetic depends on. */
        FUZZ_ASSERT(s.quant_type == QUANT_NF4 || s.quant_type == QUANT_FP4, "quant_type %d", s.quant_type);
        FUZZ_ASSERT(s.blocksize >= NF4_MIN_BLOCKSIZE && s.blocksize <= NF4_MAX_BLOCKSIZE &&
                        (s.blocksize & (s.blocksize - 1)) == 0, "blocksize %u", s.blocksize);
        FUZZ_ASSERT(s.dtype == DT_F16 || s.dtype == DT_BF16 || s.dtype == DT_F32, "dtype %d", s.dtype);
        FUZZ_ASSERT(s.ndim <= 8, "ndim %zu", s.ndim);
        uint64_t n = 1;
        for (size_t d = 0; d < s.ndim; d++)
            n *= s.shape[d];
        FUZZ_ASSERT(n == s.n, "n");
        if (s.nested) {
            FUZZ_ASSERT(s.nested_blocksize >= 1 && s.nested_blocksize <= MAX_NESTED_BLOCKSIZE &&
                            (s.nested_blocksize & (s.nested_blocksize - 1)) == 0, "nested_blocksize %u",
                        s.nested_blocksize);
            FUZZ_ASSERT(isfinite(s.nested_offset), "nested_offset");
        }
    }
    free(json);
    return 0;
}
