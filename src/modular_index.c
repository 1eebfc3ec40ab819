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

/* Pipeline folder `root`'s index, `index` (a name pipeline_index_name
 * gave), parsed: NULL where it cannot be read or parsed, no error recorded
 * (an index nf4deq cannot read is copied as it is). *path: its path
 * (allocated, or NULL). */
static cJSON *read_index(const char *root, const char *index, char **path)
{
    char *text = NULL;
    size_t len = 0;
    cJSON *json = NULL;
    *path = path_join(root, index);
    if (*path && read_small_file(*path, MAX_JSON_FILE_BYTES, &text, &len) == NF4_OK)
        json = json_parse_whole(text, len);
    nf4_clear_error();
    free(text);
    return json;
}

int pipeline_index_lists(const char *root, const char *const *names, size_t n, int *listed)
{
    const char *index = pipeline_index_name(root);
    char *path = NULL;
    cJSON *json = index ? read_index(root, index, &path) : NULL;
    const int readable = cJSON_IsObject(json);
    for (size_t i = 0; readable && i < n; i++) {
        /* [library, class(, spec)]: [null, null] is a component the pipeline does not load */
        const cJSON *entry = cJSON_GetObjectItemCaseSensitive(json, names[i]);
        listed[i] = cJSON_IsArray(entry) && cJSON_IsString(cJSON_GetArrayItem(entry, 0));
    }
    cJSON_Delete(json);
    free(path);
    return readable ? 0 : -1;
}

void modular_index_warn_remote(const char *root)
{
    const char *index = pipeline_index_name(root);
    if (!index || strcmp(index, MODULAR_PIPELINE_INDEX_NAME) != 0)
        return;
    char *path = NULL;
    cJSON *json = read_index(root, index, &path);
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
    free(path);
}
