#include "model.h"

#include <cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json_util.h"
#include "status.h"

static int cmp_model_tensor(const void *a, const void *b)
{
    const struct model_tensor *x = a, *y = b;
    return strcmp(x->t->name, y->t->name);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_entry(const void *a, const void *b)
{
    const struct index_entry *x = a, *y = b;
    return strcmp(x->tensor, y->tensor);
}

int shard_name_is_safe(const char *name)
{
    if (!name[0] || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return 0;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        if (*p == '/' || *p < 0x20 || *p == 0x7f)
            return 0;
    return 1;
}

static int is_within(const char *inner, const char *outer)
{
    size_t n = strlen(outer);
    return strncmp(inner, outer, n) == 0 && (inner[n] == '/' || inner[n] == '\0' || (n == 1 && outer[0] == '/'));
}

int path_stays_in_model(const char *dir, const char *path)
{
    char real_dir[PATH_MAX], real_path[PATH_MAX];
    if (!realpath(dir, real_dir) || !realpath(path, real_path))
        return 0;
    if (is_within(real_path, real_dir))
        return 1;
    char *slash = strrchr(real_dir, '/');
    if (!slash || slash == real_dir)
        return 0;
    *slash = '\0'; /* .../snapshots */
    char *parent = strrchr(real_dir, '/');
    if (!parent || strcmp(parent + 1, "snapshots") != 0)
        return 0;
    strcpy(parent + 1, "blobs");
    return is_within(real_path, real_dir);
}

void index_free(struct index_entry *entries, size_t nentries, char **files, size_t nfiles)
{
    for (size_t i = 0; i < nentries; i++) {
        free(entries[i].tensor);
        free(entries[i].file);
    }
    free(entries);
    for (size_t i = 0; i < nfiles; i++)
        free(files[i]);
    free(files);
}

int index_parse(const char *path, const char *json, size_t len, struct index_entry **entries_out,
                size_t *nentries_out, char ***files_out, size_t *nfiles_out, char **metadata_json)
{
    *entries_out = NULL;
    *files_out = NULL;
    *nentries_out = *nfiles_out = 0;
    if (metadata_json)
        *metadata_json = NULL;
    cJSON *root = json_parse_whole(json, len);
    if (!root && json_ran_out_of_memory())
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory parsing it");
    if (!root)
        return nf4_fail(NF4_EDATA, path, NULL, "not valid JSON");
    int code = NF4_OK;
    struct index_entry *entries = NULL;
    char **files = NULL;
    size_t n = 0, nfiles = 0;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(root) || !cJSON_IsObject(map)) {
        code = nf4_fail(NF4_EDATA, path, NULL, "has no \"weight_map\" object");
        goto out;
    }
    if (json_has_duplicate_key(root)) {
        code = nf4_fail(NF4_EDATA, path, NULL, "has a top-level key twice");
        goto out;
    }
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (meta && !cJSON_IsObject(meta)) {
        code = nf4_fail(NF4_EDATA, path, NULL, "\"metadata\" is not an object");
        goto out;
    }
    size_t cap = (size_t)cJSON_GetArraySize(map);
    entries = calloc(cap ? cap : 1, sizeof *entries);
    files = calloc(cap ? cap : 1, sizeof *files);
    if (!entries || !files) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        goto out;
    }
    for (const cJSON *c = map->child; c; c = c->next) {
        if (!cJSON_IsString(c)) {
            code = nf4_fail(NF4_EDATA, path, c->string, "weight_map value is not a file name");
            goto out;
        }
        if (!shard_name_is_safe(c->valuestring)) {
            code = nf4_fail(NF4_EDATA, path, c->string,
                            "shard \"%s\" is not a plain file name inside the model directory", c->valuestring);
            goto out;
        }
        entries[n].tensor = strdup(c->string);
        entries[n].file = strdup(c->valuestring);
        files[nfiles] = strdup(c->valuestring);
        n++;
        nfiles++;
        if (!entries[n - 1].tensor || !entries[n - 1].file || !files[nfiles - 1]) {
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
            goto out;
        }
    }
    if (n == 0) {
        code = nf4_fail(NF4_EDATA, path, NULL, "weight_map is empty");
        goto out;
    }
    qsort(entries, n, sizeof *entries, cmp_entry);
    for (size_t i = 1; i < n; i++)
        if (strcmp(entries[i - 1].tensor, entries[i].tensor) == 0) {
            code = nf4_fail(NF4_EDATA, path, entries[i].tensor, "listed twice in weight_map");
            goto out;
        }
    qsort(files, nfiles, sizeof *files, cmp_str);
    size_t unique = 0;
    for (size_t i = 0; i < nfiles; i++) {
        if (unique > 0 && strcmp(files[unique - 1], files[i]) == 0) {
            free(files[i]);
            continue;
        }
        files[unique++] = files[i];
    }
    nfiles = unique;
    if (metadata_json && meta) {
        *metadata_json = cJSON_PrintUnformatted(meta);
        if (!*metadata_json) {
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
            goto out;
        }
    }
out:
    cJSON_Delete(root);
    if (code != NF4_OK) {
        index_free(entries, n, files, nfiles);
        if (metadata_json) {
            free(*metadata_json);
            *metadata_json = NULL;
        }
        return code;
    }
    *entries_out = entries;
    *nentries_out = n;
    *files_out = files;
    *nfiles_out = nfiles;
    return NF4_OK;
}

static int build_name_table(struct model *m)
{
    size_t total = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        total += m->files[i]->count;
    m->tensors = calloc(total ? total : 1, sizeof *m->tensors);
    if (!m->tensors)
        return nf4_fail(NF4_ESOFTWARE, m->dir ? m->dir : m->files[0]->path, NULL, "out of memory");
    for (size_t i = 0; i < m->nfiles; i++)
        for (size_t k = 0; k < m->files[i]->count; k++)
            m->tensors[m->count++] = (struct model_tensor){m->files[i], &m->files[i]->tensors[k], i};
    qsort(m->tensors, m->count, sizeof *m->tensors, cmp_model_tensor);
    for (size_t i = 1; i < m->count; i++)
        if (strcmp(m->tensors[i - 1].t->name, m->tensors[i].t->name) == 0)
            return nf4_fail(NF4_EDATA, m->tensors[i].file->path, m->tensors[i].t->name,
                            "tensor is also in %s", m->tensors[i - 1].file->path);
    return NF4_OK;
}

int model_open_file(const char *path, struct model **out)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    m->files = calloc(1, sizeof *m->files);
    m->file_names = calloc(1, sizeof *m->file_names);
    int code = NF4_OK;
    if (!m->files || !m->file_names || !(m->file_names[0] = strdup(path))) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        goto fail;
    }
    m->nfiles = 1;
    code = st_open(path, &m->files[0]);
    if (code == NF4_OK)
        code = build_name_table(m);
    if (code == NF4_OK) {
        *out = m;
        return NF4_OK;
    }
fail:
    model_close(m);
    return code;
}

int model_open_dir(const char *dir, struct model **out)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m || !(m->dir = strdup(dir))) {
        free(m);
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    }
    int code = NF4_OK;
    char *index_path = path_join(dir, INDEX_FILE_NAME);
    char *json = NULL;
    struct index_entry *entries = NULL;
    size_t nentries = 0;
    struct stat st;
    if (!index_path) {
        code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        goto out;
    }
    if (stat(index_path, &st) == 0) {
        size_t len;
        code = read_small_file(index_path, MAX_JSON_FILE_BYTES, &json, &len);
        if (code == NF4_OK)
            code = index_parse(index_path, json, len, &entries, &nentries, &m->file_names, &m->nfiles,
                               &m->index_metadata_json);
        if (code != NF4_OK)
            goto out;
        m->sharded = 1;
    } else if (errno != ENOENT) {
        code = nf4_fail_errno(NF4_ENOINPUT, errno, index_path, NULL, "cannot stat");
        goto out;
    } else {
        m->file_names = calloc(1, sizeof *m->file_names);
        if (!m->file_names || !(m->file_names[0] = strdup(SINGLE_FILE_NAME))) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            goto out;
        }
        m->nfiles = 1;
        char *single = path_join(dir, SINGLE_FILE_NAME);
        int missing = single && stat(single, &st) != 0 && errno == ENOENT;
        free(single);
        if (missing) {
            code = nf4_fail(NF4_ENOINPUT, dir, NULL, "has neither %s nor %s", INDEX_FILE_NAME, SINGLE_FILE_NAME);
            goto out;
        }
    }
    m->files = calloc(m->nfiles, sizeof *m->files);
    if (!m->files) {
        code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < m->nfiles && code == NF4_OK; i++) {
        char *p = path_join(dir, m->file_names[i]);
        if (!p) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            break;
        }
        code = st_open(p, &m->files[i]);
        if (code == NF4_OK && !path_stays_in_model(dir, p))
            code = nf4_fail(NF4_EDATA, p, NULL, "is a link to a file outside the model directory");
        free(p);
    }
    if (code == NF4_OK)
        code = build_name_table(m);
    /* Every index entry must point at a tensor its shard really holds. */
    for (size_t i = 0; i < nentries && code == NF4_OK; i++) {
        const struct model_tensor *mt = model_find(m, entries[i].tensor);
        if (!mt)
            code = nf4_fail(NF4_EDATA, index_path, entries[i].tensor, "listed in %s, which has no such tensor",
                            entries[i].file);
        else if (strcmp(m->file_names[mt->file_index], entries[i].file) != 0)
            code = nf4_fail(NF4_EDATA, index_path, entries[i].tensor, "listed in %s but stored in %s",
                            entries[i].file, m->file_names[mt->file_index]);
    }
    if (code == NF4_OK && m->sharded && nentries != m->count)
        nf4_warn("%s: %zu tensors in the shards are not listed in the index; they are converted too",
                 index_path, m->count - nentries);
out:
    index_free(entries, nentries, NULL, 0);
    free(json);
    free(index_path);
    if (code != NF4_OK) {
        model_close(m);
        return code;
    }
    *out = m;
    return NF4_OK;
}

void model_close(struct model *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->nfiles; i++) {
        if (m->files)
            st_close(m->files[i]);
        if (m->file_names)
            free(m->file_names[i]);
    }
    free(m->files);
    free(m->file_names);
    free(m->tensors);
    free(m->index_metadata_json);
    free(m->dir);
    free(m);
}

const struct model_tensor *model_find(const struct model *m, const char *name)
{
    size_t lo = 0, hi = m->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(m->tensors[mid].t->name, name);
        if (c == 0)
            return &m->tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}
