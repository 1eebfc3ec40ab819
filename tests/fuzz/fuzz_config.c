/* config_rewrite on arbitrary bytes (a config.json), with and without a dtype.
 * When it succeeds the result must be one JSON object without a top-level
 * "quantization_config", and with a dtype given, "dtype" and "torch_dtype"
 * (as cJSON reads them: the first copy of a key) must name it, except in a
 * diffusers config ("_diffusers_version"), which must come out as it went in
 * less its quantization_config. */
#include <cJSON.h>

#include "fuzz_common.h"
#include "json_util.h"
#include "model_dir.h"

static void check_string_member(const cJSON *root, const char *key, const char *want, const char *text)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    FUZZ_ASSERT(cJSON_IsString(v) && strcmp(v->valuestring, want) == 0, "\"%s\" is not \"%s\" in: %s", key, want,
                text);
}

/* A key twice in any object of the tree: cJSON_Compare then looks up the
 * first copy for both, so it cannot tell the documents apart. */
static int duplicate_anywhere(const cJSON *item)
{
    if (cJSON_IsObject(item) && json_has_duplicate_key(item))
        return 1;
    for (const cJSON *c = item->child; c; c = c->next)
        if (duplicate_anywhere(c))
            return 1;
    return 0;
}

static void run(const char *json, size_t size, const char *dtype, int untie, uint64_t vocab)
{
    nf4_clear_error();
    char *out = NULL;
    size_t out_len = 0;
    struct config_changes ch = {.dtype_name = dtype, .untie = untie, .vocab_size = vocab};
    int code = config_rewrite("fuzz/config.json", json, size, &ch, &out, &out_len);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        return;
    }
    FUZZ_ASSERT(out && out_len == strlen(out), "output length %zu", out_len);
    cJSON *root = json_parse_whole(out, out_len);
    FUZZ_ASSERT(cJSON_IsObject(root), "output is not a JSON object: %s", out);
    /* A key the input had twice stays twice (transformers keeps the last copy,
     * as before), but the rewrite must never add a second copy of its own. */
    cJSON *in = json_parse_whole(json, size);
    if (in && !json_has_duplicate_key(in))
        FUZZ_ASSERT(!json_has_duplicate_key(root), "output has a key twice: %s", out);
    FUZZ_ASSERT(!cJSON_GetObjectItemCaseSensitive(root, "quantization_config"), "quantization_config kept: %s",
                out);
    int diffusers = in && cJSON_GetObjectItemCaseSensitive(in, "_diffusers_version") != NULL;
    if (untie && !duplicate_anywhere(in)) {
        FUZZ_ASSERT(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings")),
                    "untied, but tie_word_embeddings is not false: %s", out);
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        const cJSON *tie = cJSON_GetObjectItemCaseSensitive(text, "tie_word_embeddings");
        FUZZ_ASSERT(!cJSON_IsObject(text) || cJSON_IsFalse(tie),
                    "untied, but text_config's tie_word_embeddings is not false: %s", out);
    }
    if (vocab && !duplicate_anywhere(in)) {
        const cJSON *top = cJSON_GetObjectItemCaseSensitive(root, "vocab_size");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        const cJSON *inner = cJSON_IsObject(text) ? cJSON_GetObjectItemCaseSensitive(text, "vocab_size") : NULL;
        FUZZ_ASSERT((top && cJSON_IsNumber(top) && top->valuedouble == (double)vocab) ||
                        (!top && inner && cJSON_IsNumber(inner) && inner->valuedouble == (double)vocab),
                    "resized, but vocab_size is not %llu: %s", (unsigned long long)vocab, out);
        FUZZ_ASSERT(!inner || (cJSON_IsNumber(inner) && inner->valuedouble == (double)vocab),
                    "resized, but text_config's vocab_size is not %llu: %s", (unsigned long long)vocab, out);
    }
    if (diffusers && !untie && !vocab && !duplicate_anywhere(in)) {
        cJSON_DeleteItemFromObjectCaseSensitive(in, "quantization_config");
        FUZZ_ASSERT(cJSON_Compare(in, root, 1), "a diffusers config changed beyond quantization_config: %s", out);
    }
    cJSON_Delete(in);
    if (dtype && !diffusers) {
        check_string_member(root, "dtype", dtype, out);
        check_string_member(root, "torch_dtype", dtype, out);
    }
    cJSON_Delete(root);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *json = fuzz_copy(data, size);
    if (!json)
        return 0;
    run(json, size, "bfloat16", 0, 0);
    run(json, size, NULL, 0, 0);
    run(json, size, "bfloat16", 1, 0);
    run(json, size, NULL, 1, 128256);
    free(json);
    return 0;
}
