/* index_parse on arbitrary bytes (a model.safetensors.index.json). */
#include <cJSON.h>

#include "fuzz_common.h"
#include "model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *json = fuzz_copy(data, size);
    if (!json)
        return 0;
    nf4_clear_error();
    struct index_entry *entries = NULL;
    char **files = NULL, *metadata = NULL;
    size_t nentries = 0, nfiles = 0;
    int code = index_parse("fuzz/model.safetensors.index.json", json, size, &entries, &nentries, &files, &nfiles,
                           &metadata);
    if (code != NF4_OK) {
        fuzz_check_failure(code);
        FUZZ_ASSERT(!entries && !files && !metadata && !nentries && !nfiles, "outputs set on failure");
    } else {
        FUZZ_ASSERT(nentries > 0 && nfiles > 0 && nfiles <= nentries, "counts %zu %zu", nentries, nfiles);
        /* Every shard name is safe to join to the model directory, sorted, unique;
         * every entry's file is one of them; tensor names are unique. */
        for (size_t i = 0; i < nfiles; i++) {
            FUZZ_ASSERT(shard_name_is_safe(files[i]), "unsafe shard name %s", files[i]);
            FUZZ_ASSERT(!strchr(files[i], '/'), "slash in %s", files[i]);
            if (i)
                FUZZ_ASSERT(strcmp(files[i - 1], files[i]) < 0, "files not sorted/unique");
        }
        for (size_t i = 0; i < nentries; i++) {
            if (i)
                FUZZ_ASSERT(strcmp(entries[i - 1].tensor, entries[i].tensor) < 0, "entries not sorted/unique");
            int found = 0;
            for (size_t k = 0; k < nfiles && !found; k++)
                found = strcmp(files[k], entries[i].file) == 0;
            FUZZ_ASSERT(found, "entry file %s not listed", entries[i].file);
        }
        if (metadata) {
            cJSON *m = cJSON_Parse(metadata);
            FUZZ_ASSERT(cJSON_IsObject(m), "metadata is not an object: %s", metadata);
            cJSON_Delete(m);
        }
    }
    index_free(entries, nentries, files, nfiles);
    free(metadata);
    free(json);
    return 0;
}
