/* torch_pickle_read on arbitrary bytes (a data.pkl). When it accepts, every
 * record must be a tensor inside its storage, its element count the product
 * of its shape; a refusal must be bad data with a one-line message. Nothing a
 * pickle names is ever run, so a crash here is the only way to fail. */
#include "fuzz_common.h"
#include "torch_pickle.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *pkl = fuzz_copy(data, size);
    if (!pkl)
        return 0;
    nf4_clear_error();
    struct torch_tensor_record *r;
    size_t n;
    int code = torch_pickle_read("fuzz/data.pkl", (const unsigned char *)pkl, size, &r, &n);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
    } else {
        for (size_t k = 0; k < n; k++) {
            uint64_t product = 1;
            for (size_t d = 0; d < r[k].ndim; d++)
                product *= r[k].shape[d];
            FUZZ_ASSERT(product == r[k].nelem, "%s: shape product %llu, nelem %llu", r[k].name,
                        (unsigned long long)product, (unsigned long long)r[k].nelem);
            FUZZ_ASSERT(r[k].offset + r[k].nelem >= r[k].offset && r[k].offset + r[k].nelem <= r[k].storage_elems,
                        "%s: past its storage", r[k].name);
            FUZZ_ASSERT(r[k].storage[0] && !strchr(r[k].storage, '/'), "%s: storage key %s", r[k].name,
                        r[k].storage);
        }
        torch_records_free(r, n);
    }
    free(pkl);
    return 0;
}
