/* The whole open path on arbitrary bytes written to a file: model_open_file,
 * bnb_collect, inspect, and (for inputs of bounded size) a full CPU conversion
 * with small chunks, as `nf4deq convert --device cpu -j 1` runs it. Whatever
 * happens, the scratch directory must end up holding the input alone: a
 * failed conversion leaves no output and no temp file. */
#include <unistd.h>

#include "bnb_state.h"
#include "convert.h"
#define FUZZ_OWN_INITIALIZE /* it also makes a scratch folder */
#include "fuzz_common.h"
#include "fuzz_convert.h"
#include "inspect.h"
#include "model.h"

#define FUZZ_MEM_BYTES (4u << 20)

static const char *in_path, *out_path;
static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    const struct fuzz_scratch *s = fuzz_scratch_init("fuzz", "in.safetensors", "out.safetensors");
    in_path = s->input;
    out_path = s->extra;
    devnull = fopen("/dev/null", "w");
    if (!devnull) {
        perror("/dev/null");
        exit(1);
    }
    return 0;
}

static void convert_once(enum st_dtype dtype, uint64_t chunk)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.threads = 1;
    o.dtype = dtype;
    o.chunk_elements = chunk;
    /* The default host budget (512 MiB) is allocated per run: far too slow
     * under ASan for inputs of a few KiB. */
    o.mem = FUZZ_MEM_BYTES;
    struct convert_stats stats;
    nf4_clear_error();
    int code = convert_run(in_path, out_path, &o, &stats);
    if (code == NF4_OK) {
        /* The output must itself be a valid safetensors file with no state parts. */
        struct model *m;
        nf4_clear_error();
        int again = model_open_file(out_path, &m);
        FUZZ_ASSERT(again == NF4_OK, "output does not reopen: %s", nf4_last_error());
        for (size_t i = 0; i < m->count; i++)
            FUZZ_ASSERT(!bnb_is_state_part(m->tensors[i].t->name), "state part %s in output",
                        m->tensors[i].t->name);
        model_close(m);
        FUZZ_ASSERT(unlink(out_path) == 0, "output missing after success");
    } else {
        fuzz_assert_documented_failure(code, "convert");
    }
    fuzz_assert_only_input_left(code == NF4_OK ? "a conversion" : "a failed conversion");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_write_input(data, size);
    nf4_clear_error();
    struct model *m = NULL;
    int code = model_open_file(in_path, &m);
    if (code != NF4_OK) {
        FUZZ_ASSERT(code == NF4_EDATA || code == NF4_ESOFTWARE, "open failed with %d: %s", code, nf4_last_error());
        FUZZ_ASSERT(strstr(nf4_last_error(), in_path) == nf4_last_error(), "message does not start with the file: %s",
                    nf4_last_error());
        return 0;
    }
    struct bnb_weight *w = NULL;
    size_t nw = 0;
    nf4_clear_error();
    code = bnb_collect(m, &w, &nw);
    int bounded = code == NF4_OK && fuzz_data_is_bounded(m, w, nw);
    if (code != NF4_OK)
        FUZZ_ASSERT(code == NF4_EDATA || code == NF4_ESOFTWARE, "collect failed with %d: %s", code,
                    nf4_last_error());
    bnb_free(w, nw);
    model_close(m);
    if (code != NF4_OK) {
        /* The same input through convert must fail the same way and leave nothing. */
        convert_once(DT_INVALID, 4096);
        return 0;
    }
    nf4_clear_error();
    FUZZ_ASSERT(inspect_run(in_path, 0, DT_INVALID, NULL, 0, NULL, devnull) == NF4_OK, "inspect failed: %s", nf4_last_error());
    nf4_clear_error();
    FUZZ_ASSERT(inspect_run(in_path, 1, DT_BF16, NULL, 0, NULL, devnull) == NF4_OK, "inspect --json failed: %s", nf4_last_error());
    if (!bounded)
        return 0;
    /* Each weight's own dtype with chunks that cut tensors into many pieces,
     * then every floating tensor to bf16 with the default chunk size. */
    convert_once(DT_INVALID, 64);
    convert_once(DT_BF16, 0);
    return 0;
}
