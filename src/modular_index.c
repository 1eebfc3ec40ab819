#include "modular_index.h"

#include <cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json_util.h"
#include "layout.h"
#include "model.h"
#include "status.h"
#include "strbuf.h"

/* The repository a component entry loads from where it is a from_pretrained
 * component with a subfolder (NULL otherwise), and that subfolder. */
static const char *remote_of(const cJSON *entry, const char **subfolder)
{
    if (!cJSON_IsArray(entry) || cJSON_GetArraySize(entry) != 3 || !cJSON_IsString(cJSON_GetArrayItem(entry, 0)))
        return NULL;
    const cJSON *spec = cJSON_GetArrayItem(entry, 2);
    const cJSON *repo = cJSON_GetObjectItemCaseSensitive(spec, "pretrained_model_name_or_path");
    const cJSON *sub = cJSON_GetObjectItemCaseSensitive(spec, "subfolder");
    if (!cJSON_IsString(repo) || !cJSON_IsString(sub) || !sub->valuestring[0])
        return NULL;
    *subfolder = sub->valuestring;
    return repo->valuestring;
}

void modular_index_warn_remote(const char *root)
{
    const char *index = pipeline_index_name(root);
    if (!index || strcmp(index, MODULAR_PIPELINE_INDEX_NAME) != 0)
        return;
    char *path = path_join(root, index), *text = NULL;
    size_t len = 0;
    cJSON *json = NULL;
    if (path && read_small_file(path, MAX_JSON_FILE_BYTES, &text, &len) == NF4_OK)
        json = json_parse_whole(text, len);
    nf4_clear_error(); /* an index nf4deq cannot read is copied as it is */
    struct strbuf names = {0};
    const char *first_repo = NULL;
    const cJSON *entry, *components = cJSON_IsObject(json) ? json : NULL;
    cJSON_ArrayForEach(entry, components) {
        const char *subfolder = NULL, *repo = remote_of(entry, &subfolder);
        char *local = repo ? path_join(root, subfolder) : NULL;
        struct stat st;
        if (local && !(stat(local, &st) == 0 && S_ISDIR(st.st_mode))) {
            strbuf_printf(&names, "%s%s", names.len ? ", " : "", entry->string);
            first_repo = first_repo ? first_repo : repo;
        }
        free(local);
    }
    if (names.len && !names.oom)
        nf4_warn("%s: takes %s from the repositories it names (%s...), which this folder does not hold: nf4deq "
                 "converts only what the folder holds, and ModularPipeline.from_pretrained of the output loads "
                 "those from there, as they are", path, names.p, first_repo);
    free(names.p);
    cJSON_Delete(json);
    free(text);
    free(path);
}
