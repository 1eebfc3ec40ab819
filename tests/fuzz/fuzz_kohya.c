/* kohya_lora_convert on arbitrary bytes written to a file (a kohya or
 * ComfyUI Flux.1 LoRA): the renaming, the alpha, the splits of fused layers
 * and the temp file. When it accepts, every tensor of the result is a
 * diffusers LoRA factor of the transformer or the text encoder; a refusal
 * must be bad data with a one-line message; either way the temp file is gone
 * (TMPDIR is a scratch folder that must end up holding the input alone). */
#define FUZZ_OWN_INITIALIZE
#include "fuzz_common.h"
#include "lora_kohya.h"
#include "model.h"
#include "strutil.h"

static const char *path;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    nf4_set_quiet(1);
    const struct fuzz_scratch *s = fuzz_scratch_init("fuzz-kohya", "lora.safetensors", NULL);
    path = s->input;
    if (setenv("TMPDIR", s->dir, 1) != 0) {
        perror("fuzz_kohya: TMPDIR");
        exit(1);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_write_input(data, size);
    nf4_clear_error();
    struct model *m, *out = NULL;
    if (model_open_file(path, &m) != NF4_OK || !kohya_lora_detect(m)) {
        if (m)
            model_close(m);
        return 0;
    }
    int code = kohya_lora_convert(m, path, 0, &out);
    model_close(m);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
    } else {
        FUZZ_ASSERT(strcmp(out->files[0]->path, path) == 0, "the result names %s", out->files[0]->path);
        for (size_t i = 0; i < out->count; i++) {
            const struct st_tensor *t = out->tensors[i].t;
            FUZZ_ASSERT((strncmp(t->name, "transformer.", 12) == 0 || strncmp(t->name, "text_encoder.", 13) == 0) &&
                            (str_ends_with(t->name, ".lora_A.weight") || str_ends_with(t->name, ".lora_B.weight")),
                        "%s", t->name);
            FUZZ_ASSERT(t->ndim == 2 && t->shape[0] && t->shape[1], "%s: shape", t->name);
        }
        model_close(out);
    }
    fuzz_assert_only_input_left("a conversion");
    return 0;
}
