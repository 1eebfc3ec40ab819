/* A model directory on arbitrary bytes, for the layouts nf4deq writes
 * otherwise than stored: the first byte picks config.json's model_type
 * (gpt_oss: Unsloth's experts fused, expert_layout.h; gpt2: Conv1D weights
 * transposed, conv1d_layout.h; llama: every layout kept), the rest is the
 * directory's model.safetensors. model_open_dir, bnb_collect, inspect (text
 * and JSON) and, for inputs of bounded size, a full CPU conversion with
 * small chunks and two workers. A failure is one line of a documented exit
 * code; whatever happens, the scratch directory ends up holding the input
 * directory alone (a failed conversion leaves no output and no temp
 * directory). */
#include <sys/stat.h>
#include <unistd.h>

#include "bnb_state.h"
#include "convert.h"
#define FUZZ_OWN_INITIALIZE /* it also makes a scratch folder */
#include "fuzz_common.h"
#include "fuzz_convert.h"
#include "inspect.h"
#include "model.h"

#define FUZZ_MEM_BYTES (8u << 20)

static const char *const MODEL_TYPES[] = {"gpt_oss", "gpt2", "llama"};

static const char *in_dir, *out_dir;
static char *weights_path, *config_path;
static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    const struct fuzz_scratch *s = fuzz_scratch_init("fuzz-model-dir", "in", "out");
    in_dir = s->input;
    out_dir = s->extra;
    if (mkdir(in_dir, 0755) != 0 || asprintf(&weights_path, "%s/model.safetensors", in_dir) < 0 ||
        asprintf(&config_path, "%s/config.json", in_dir) < 0 || !(devnull = fopen("/dev/null", "w"))) {
        perror("fuzz_model_dir");
        exit(1);
    }
    return 0;
}

static void write_file(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    FUZZ_ASSERT(f && fwrite(data, 1, size, f) == size && fclose(f) == 0, "cannot write %s", path);
}

static void remove_output(void)
{
    char *path;
    FUZZ_ASSERT(asprintf(&path, "%s/model.safetensors", out_dir) >= 0, "out of memory");
    unlink(path);
    free(path);
    /* Whatever else a model directory's conversion copies beside it. */
    FUZZ_ASSERT(asprintf(&path, "%s/config.json", out_dir) >= 0, "out of memory");
    unlink(path);
    free(path);
    FUZZ_ASSERT(rmdir(out_dir) == 0, "output directory holds more than the model: %s", out_dir);
}

static void convert_once(uint64_t chunk)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.threads = 2;
    o.dtype = DT_BF16;
    o.chunk_elements = chunk;
    o.mem = FUZZ_MEM_BYTES;
    struct convert_stats stats;
    nf4_clear_error();
    int code = convert_run(in_dir, out_dir, &o, &stats);
    if (code == NF4_OK) {
        struct model *m;
        nf4_clear_error();
        FUZZ_ASSERT(model_open_dir(out_dir, &m) == NF4_OK, "output does not reopen: %s", nf4_last_error());
        for (size_t i = 0; i < m->count; i++)
            FUZZ_ASSERT(!bnb_is_state_part(m->tensors[i].t->name), "state part %s in output", m->tensors[i].t->name);
        model_close(m);
        remove_output();
    } else {
        fuzz_assert_documented_failure(code, "convert");
    }
    fuzz_assert_only_input_left(code == NF4_OK ? "a conversion" : "a failed conversion");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    char config[64];
    int n = snprintf(config, sizeof config, "{\"model_type\": \"%s\"}",
                     MODEL_TYPES[data[0] % (sizeof MODEL_TYPES / sizeof *MODEL_TYPES)]);
    write_file(config_path, config, (size_t)n);
    write_file(weights_path, data + 1, size - 1);
    nf4_clear_error();
    struct model *m = NULL;
    int code = model_open_dir(in_dir, &m);
    if (code != NF4_OK) {
        FUZZ_ASSERT(code == NF4_EDATA || code == NF4_ESOFTWARE || code == NF4_ENOINPUT, "open failed with %d: %s",
                    code, nf4_last_error());
        return 0;
    }
    struct bnb_weight *w = NULL;
    size_t nw = 0;
    nf4_clear_error();
    code = bnb_collect(m, &w, &nw);
    int bounded = code == NF4_OK && fuzz_data_is_bounded(m, w, nw);
    bnb_free(w, nw);
    model_close(m);
    if (code != NF4_OK) {
        fuzz_assert_documented_failure(code, "collect");
        return 0;
    }
    /* inspect finds the layouts as convert does: it fails only where convert would. */
    nf4_clear_error();
    int inspected = inspect_run(in_dir, 0, DT_INVALID, NULL, 0, NULL, devnull);
    if (inspected != NF4_OK)
        fuzz_assert_documented_failure(inspected, "inspect");
    nf4_clear_error();
    FUZZ_ASSERT(inspect_run(in_dir, 1, DT_BF16, NULL, 0, NULL, devnull) == inspected, "inspect --json and inspect "
                "disagree: %s", nf4_last_error());
    if (!bounded)
        return 0;
    convert_once(64);
    convert_once(0);
    return 0;
}
