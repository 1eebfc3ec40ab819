/* st_parse_header on arbitrary bytes. The first 8 bytes give the length of the
 * tensor data that follows the header (mod 2^32, so tiling checks see both
 * matching and absurd values); the rest is the header's JSON text. */
#include "fuzz_common.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8)
        return 0;
    uint64_t data_len = 0;
    for (int i = 7; i >= 0; i--)
        data_len = (data_len << 8) | data[i];
    data_len %= UINT64_C(1) << 32;
    char *json = fuzz_copy(data + 8, size - 8);
    if (!json)
        return 0;
    nf4_clear_error();
    struct st_file f = {.path = "fuzz.safetensors", .fd = -1};
    int code = st_parse_header(&f, json, size - 8, data_len);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
    } else {
        /* What a caller relies on: sorted unique names, offsets tiling the data,
         * every byte size equal to shape x dtype. */
        uint64_t total = 0;
        for (size_t i = 0; i < f.count; i++) {
            const struct st_tensor *t = &f.tensors[i];
            FUZZ_ASSERT(st_find(&f, t->name) == t, "lookup of %s", t->name);
            FUZZ_ASSERT(t->end >= t->begin && t->end <= data_len, "%s: offsets [%llu,%llu)", t->name,
                        (unsigned long long)t->begin, (unsigned long long)t->end);
            FUZZ_ASSERT((t->nelem * dtype_bits(t->dtype)) / 8 == st_tensor_bytes(t), "%s: size", t->name);
            total += st_tensor_bytes(t);
            if (i)
                FUZZ_ASSERT(strcmp(f.by_name[i - 1]->name, f.by_name[i]->name) < 0, "by_name order");
        }
        FUZZ_ASSERT(total == data_len, "tensors cover %llu of %llu bytes", (unsigned long long)total,
                    (unsigned long long)data_len);
    }
    st_free_header(&f);
    free(json);
    return 0;
}
