/* resume_manifest_parse on arbitrary bytes: the manifest sits in a temp
 * directory, so a run must survive any content there. An accepted manifest
 * must render and parse back to the same record, with plain file names only
 * (no '/', "." or ".."): --resume keeps and removes files by those names. */
#include "fuzz_common.h"
#include "model.h"
#include "resume.h"

static void assert_same(const struct resume_manifest *a, const struct resume_manifest *b)
{
    FUZZ_ASSERT(resume_same_source(a, b), "options or inputs changed in a round trip");
    FUZZ_ASSERT(a->nshards == b->nshards, "%zu shards became %zu", a->nshards, b->nshards);
    for (size_t i = 0; i < a->nshards; i++)
        FUZZ_ASSERT(strcmp(a->shards[i].file, b->shards[i].file) == 0 && a->shards[i].bytes == b->shards[i].bytes,
                    "shard %zu changed in a round trip", i);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *json = fuzz_copy(data, size);
    if (!json)
        return 0;
    nf4_clear_error();
    struct resume_manifest m;
    int code = resume_manifest_parse("fuzz/.nf4deq-resume.json", json, size, &m);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        free(json);
        return 0;
    }
    for (size_t i = 0; i < m.ninputs; i++)
        FUZZ_ASSERT(shard_name_is_safe(m.inputs[i].file), "input name %s", m.inputs[i].file);
    for (size_t i = 0; i < m.nshards; i++)
        FUZZ_ASSERT(shard_name_is_safe(m.shards[i].file), "shard name %s", m.shards[i].file);
    char *text = NULL;
    size_t len = 0;
    FUZZ_ASSERT(resume_manifest_render(&m, "fuzz", &text, &len) == NF4_OK, "render failed");
    struct resume_manifest again;
    FUZZ_ASSERT(resume_manifest_parse("fuzz/again", text, len, &again) == NF4_OK, "the rendering does not parse: %s",
                nf4_last_error());
    assert_same(&m, &again);
    resume_manifest_free(&again);
    resume_manifest_free(&m);
    free(text);
    free(json);
    return 0;
}
