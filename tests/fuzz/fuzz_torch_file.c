/* torch_open on arbitrary bytes written to a file (an adapter_model.bin): the
 * ZIP directory, the local headers, the pickle and the placing of each tensor.
 * When it accepts, every tensor's bytes must lie in the file and be exactly
 * its elements; a refusal must be bad data with a one-line message. */
#define FUZZ_OWN_INITIALIZE
#include "fuzz_common.h"
#include "torch_file.h"

static const char *path;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    path = fuzz_scratch_init("fuzz-torch", "adapter_model.bin", NULL)->input;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_write_input(data, size);
    nf4_clear_error();
    struct st_file *st;
    int code = torch_open(path, &st);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        return 0;
    }
    for (size_t k = 0; k < st->count; k++) {
        const struct st_tensor *t = &st->tensors[k];
        FUZZ_ASSERT(t->begin <= t->end && t->end <= size, "%s: bytes %llu to %llu of %zu", t->name,
                    (unsigned long long)t->begin, (unsigned long long)t->end, size);
        FUZZ_ASSERT(t->end - t->begin == t->nelem * (dtype_bits(t->dtype) / 8), "%s: size", t->name);
        FUZZ_ASSERT(k == 0 || strcmp(st->by_name[k - 1]->name, st->by_name[k]->name) < 0, "names not sorted");
    }
    st_close(st);
    return 0;
}
