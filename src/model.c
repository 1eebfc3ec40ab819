#include "model.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json_util.h"
#include "model_dir.h"
#include "status.h"
#include "strutil.h"
#include "torch_file.h"

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

/* In the Hugging Face cache, a snapshot (or a folder of one, for a pipeline's
 * components) is .../models--ORG--NAME/snapshots/REV[/...], and its files link
 * into .../models--ORG--NAME/blobs. Cuts real_dir down to that blobs directory;
 * 0 when real_dir is not inside a snapshot. */
static int cache_blobs_of(char *real_dir)
{
    char *snap = NULL;
    for (char *p = strstr(real_dir, "/snapshots/"); p; p = strstr(p + 1, "/snapshots/"))
        snap = p;
    if (!snap || snap == real_dir || snap[strlen("/snapshots/")] == '\0')
        return 0;
    *snap = '\0';
    const char *repo = strrchr(real_dir, '/');
    if (!repo || strncmp(repo + 1, "models--", strlen("models--")) != 0)
        return 0;
    strcat(real_dir, "/blobs"); /* shorter than the "/snapshots/..." it replaces */
    return 1;
}

int path_stays_in_model(const char *dir, const char *path)
{
    char real_dir[PATH_MAX], real_path[PATH_MAX];
    if (!realpath(dir, real_dir) || !realpath(path, real_path))
        return 0;
    if (is_within(real_path, real_dir))
        return 1;
    return cache_blobs_of(real_dir) && is_within(real_path, real_dir);
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
    int twice = json_has_duplicate_key(root);
    if (twice) {
        code = twice < 0 ? nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory")
                         : nf4_fail(NF4_EDATA, path, NULL, "has a top-level key twice");
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
    json_release_heap(len);
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
        if (strcmp(m->tensors[i - 1].t->name, m->tensors[i].t->name) != 0)
            continue;
        else if (m->dir && !m->sharded) /* no index says which file is the model */
            return nf4_fail(NF4_EDATA, m->dir, m->tensors[i].t->name,
                            "is ambiguous: %s and %s both hold this tensor (two variants of one model?); keep "
                            "one of them, or convert each file on its own", m->file_names[m->tensors[i - 1].file_index],
                            m->file_names[m->tensors[i].file_index]);
        else
            return nf4_fail(NF4_EDATA, m->tensors[i].file->path, m->tensors[i].t->name,
                            "tensor is also in %s", m->tensors[i - 1].file->path);
    return NF4_OK;
}

/* A model of the one file `f`, which it takes over (closed on failure too). */
static int model_of_file(const char *path, struct st_file *f, struct model **out)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m) {
        st_close(f);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    m->files = calloc(1, sizeof *m->files);
    m->file_names = calloc(1, sizeof *m->file_names);
    m->config = model_config_new();
    if (m->files)
        m->files[0] = f;
    else
        st_close(f);
    int code = NF4_OK;
    if (!m->files || !m->file_names || !m->config || !(m->file_names[0] = strdup(path)))
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    m->nfiles = m->files ? 1 : 0;
    if (code == NF4_OK)
        code = build_name_table(m);
    if (code == NF4_OK) {
        *out = m;
        return NF4_OK;
    }
    model_close(m);
    return code;
}

static int open_one_file(const char *path, int (*open_file)(const char *, struct st_file **), struct model **out)
{
    *out = NULL;
    struct st_file *f;
    int code = open_file(path, &f);
    return code == NF4_OK ? model_of_file(path, f, out) : code;
}

int model_open_file(const char *path, struct model **out)
{
    return open_one_file(path, st_open, out);
}

int model_open_fd_as(int fd, const char *shown, struct model **out)
{
    *out = NULL;
    struct st_file *f;
    int code = st_open_fd(fd, shown, &f);
    if (code == NF4_OK && (code = model_of_file(shown, f, out)) == NF4_OK)
        (*out)->unnamed = 1;
    return code;
}

int model_reopen(const struct model *m, struct model **out)
{
    *out = NULL;
    const char *shown = m->files[0]->path;
    if (!m->unnamed || m->nfiles != 1)
        return nf4_fail(NF4_ESOFTWARE, shown, NULL, "opening again a model that has a name (internal error)");
    int fd = fcntl(m->files[0]->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return nf4_fail_errno(NF4_EIO, errno, shown, NULL, "cannot open again");
    int code = model_open_fd_as(fd, shown, out);
    /* The same header, so the same tensors in the same order: each keeps
     * its name in the user's file. */
    const struct st_file *from = m->files[0];
    struct st_file *to = code == NF4_OK ? (*out)->files[0] : NULL;
    for (size_t i = 0; to && i < to->count && i < from->count && code == NF4_OK; i++)
        if (from->tensors[i].origin)
            code = st_set_origin(to, &to->tensors[i], from->tensors[i].origin);
    if (code != NF4_OK) {
        model_close(*out);
        *out = NULL;
    }
    return code;
}

int model_rename_tensors(struct model *m, int (*rename)(const char *name, void *arg, char **renamed), void *arg)
{
    if (m->nfiles != 1)
        return nf4_fail(NF4_ESOFTWARE, m->dir, NULL, "renaming the tensors of a sharded model (internal error)");
    struct st_file *f = m->files[0];
    int code = NF4_OK;
    for (size_t i = 0; i < f->count && code == NF4_OK; i++) {
        struct st_tensor *t = &f->tensors[i];
        char *renamed = NULL;
        if ((code = rename(t->name, arg, &renamed)) != NF4_OK || !renamed)
            continue;
        /* the new name in, then the old one kept as the file's (unless it
         * already holds one), and put back where that fails */
        char *old = t->name;
        t->name = renamed;
        if ((code = st_set_origin(f, t, old)) == NF4_OK) {
            free(old);
        } else {
            t->name = old;
            free(renamed);
        }
    }
    if (code != NF4_OK)
        return code;
    qsort(m->tensors, m->count, sizeof *m->tensors, cmp_model_tensor);
    for (size_t i = 1; i < m->count; i++) {
        const struct st_tensor *a = m->tensors[i - 1].t, *b = m->tensors[i].t;
        if (strcmp(a->name, b->name) == 0) /* named as in the file: f's index is not rebuilt yet */
            return nf4_fail(NF4_EDATA, f->path, NULL, "%s and %s both become %s once renamed",
                            a->origin ? a->origin : a->name, b->origin ? b->origin : b->name, b->name);
    }
    return st_index_names(f);
}

size_t model_drop_tensors_by(struct model *m, int (*drop)(const char *name, void *arg), void *arg)
{
    size_t kept = 0;
    for (size_t i = 0; i < m->count; i++)
        if (!drop(m->tensors[i].t->name, arg))
            m->tensors[kept++] = m->tensors[i]; /* the order, and so the sort, stays */
    size_t dropped = m->count - kept;
    m->count = kept;
    return dropped;
}

struct name_test {
    int (*drop)(const char *name);
};

static int drop_by_name(const char *name, void *arg)
{
    return ((const struct name_test *)arg)->drop(name);
}

size_t model_drop_tensors(struct model *m, int (*drop)(const char *name))
{
    struct name_test t = {drop};
    return model_drop_tensors_by(m, drop_by_name, &t);
}

int model_open_torch_file(const char *path, struct model **out)
{
    return open_one_file(path, torch_open, out);
}

/* 1 for a regular file, through links (the Hugging Face cache links every
 * file); 0 for anything else; -1 when out of memory. */
static int is_regular_file(const char *dir, const char *name)
{
    char *p = path_join(dir, name);
    if (!p)
        return -1;
    struct stat st;
    int regular = stat(p, &st) == 0 && S_ISREG(st.st_mode);
    free(p);
    return regular;
}

/* Moves names[i] to the end of list (sized for every name): no copy, no failure. */
static void take_name(char **names, size_t i, char ***list, size_t *n)
{
    (*list)[(*n)++] = names[i];
    names[i] = NULL;
}

/* An index's name: PREFIX.safetensors.index.json, or, for a checkpoint
 * saved with a variant (save_pretrained(variant="fp16")), the variant before
 * ".json" as transformers and diffusers insert it:
 * PREFIX.safetensors.index.fp16.json. Its shards are named as the index
 * lists them, so the output keeps the variant's names too. */
static int is_index_name(const char *name)
{
    static const char VARIANT_MARK[] = ".safetensors.index.";
    if (str_ends_with(name, INDEX_FILE_SUFFIX))
        return 1;
    const char *mark = strstr(name, VARIANT_MARK);
    if (!mark || mark == name)
        return 0;
    const char *variant = mark + strlen(VARIANT_MARK), *dot = strchr(variant, '.');
    return dot && dot > variant && strcmp(dot, ".json") == 0;
}

static int is_variant_index_name(const char *name)
{
    return is_index_name(name) && !str_ends_with(name, INDEX_FILE_SUFFIX);
}

int model_dir_scan(const char *dir, struct model_dir_files *out)
{
    memset(out, 0, sizeof *out);
    char **names;
    size_t n;
    int code = dir_list(dir, NF4_ENOINPUT, &names, &n);
    if (code != NF4_OK)
        return code;
    out->indexes = calloc(n ? n : 1, sizeof *out->indexes);
    out->weights = calloc(n ? n : 1, sizeof *out->weights);
    out->hidden_weights = calloc(n ? n : 1, sizeof *out->hidden_weights);
    if (!out->indexes || !out->weights || !out->hidden_weights)
        code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    for (size_t i = 0; i < n && code == NF4_OK; i++) { /* sorted: so are both lists */
        const char *name = names[i];
        int is_index = is_index_name(name), is_weights = str_ends_with(name, WEIGHTS_FILE_SUFFIX);
        if ((name[0] == '.' && !is_weights) || (!is_index && !is_weights))
            continue;
        int regular = is_regular_file(dir, name);
        if (regular < 0)
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        else if (regular && name[0] == '.')
            take_name(names, i, &out->hidden_weights, &out->nhidden_weights);
        else if (regular && is_index)
            take_name(names, i, &out->indexes, &out->nindexes);
        else if (regular)
            take_name(names, i, &out->weights, &out->nweights);
    }
    dir_names_free(names, n);
    if (code != NF4_OK)
        model_dir_files_free(out);
    return code;
}

void model_dir_files_free(struct model_dir_files *f)
{
    dir_names_free(f->indexes, f->nindexes);
    dir_names_free(f->weights, f->nweights);
    dir_names_free(f->hidden_weights, f->nhidden_weights);
    memset(f, 0, sizeof *f);
}

int model_dir_is_model(const struct model_dir_files *f)
{
    return f->nindexes > 0 || f->nweights > 0;
}

/* transformers' name for a PyTorch checkpoint (torch.save): said where it is
 * all a directory holds, since nf4deq converts safetensors only. */
#define PYTORCH_WEIGHTS_NAME "pytorch_model.bin"
#define PYTORCH_INDEX_NAME "pytorch_model.bin.index.json"

static int not_a_model(const char *dir)
{
    static const char *const PICKLED[] = {PYTORCH_INDEX_NAME, PYTORCH_WEIGHTS_NAME};
    const char *pickled = NULL;
    for (size_t i = 0; i < sizeof PICKLED / sizeof *PICKLED && !pickled; i++)
        if (is_regular_file(dir, PICKLED[i]) == 1)
            pickled = PICKLED[i];
    if (pickled)
        return nf4_fail(NF4_ENOINPUT, dir, NULL, "is not a model directory of safetensors: it holds %s, a PyTorch "
                        "checkpoint (torch.save), and no *%s file; nf4deq converts safetensors checkpoints",
                        pickled, WEIGHTS_FILE_SUFFIX);
    return nf4_fail(NF4_ENOINPUT, dir, NULL, "is not a model directory: it has no *%s file and no *%s (such as %s)",
                    WEIGHTS_FILE_SUFFIX, INDEX_FILE_SUFFIX, INDEX_FILE_NAME);
}

int model_dir_require(const char *dir)
{
    struct model_dir_files found;
    int code = model_dir_scan(dir, &found);
    if (code == NF4_OK && !model_dir_is_model(&found))
        code = not_a_model(dir);
    model_dir_files_free(&found);
    return code;
}

/* Which files make the model: the one index and its shards, or every
 * *.safetensors file when there is no index. Two indexes cannot be told apart. */
static int choose_model_files(const char *dir, struct model *m, struct model_dir_files *found)
{
    /* A plain index is the model's where there is one, as transformers and
     * diffusers load it unless told a variant: the variants' indexes are then
     * other checkpoints, left out as their shards are (set_unused_names). */
    size_t nplain = 0, plain = 0;
    for (size_t i = 0; i < found->nindexes; i++)
        if (!is_variant_index_name(found->indexes[i]))
            plain = i, nplain++;
    const size_t candidates = nplain ? nplain : found->nindexes;
    if (candidates > 1) {
        const char *a = NULL, *b = NULL; /* the first two of them */
        for (size_t i = 0; i < found->nindexes && !b; i++) {
            if (nplain && is_variant_index_name(found->indexes[i]))
                continue;
            if (a)
                b = found->indexes[i];
            else
                a = found->indexes[i];
        }
        return nf4_fail(NF4_EDATA, dir, NULL, "is ambiguous: it holds %zu index files (%s and %s); keep the one "
                        "that describes the model", candidates, a, b);
    }
    if (candidates == 1) {
        m->index_name = found->indexes[plain];
        found->indexes[plain] = NULL;
        return NF4_OK;
    }
    if (found->nweights == 0)
        return not_a_model(dir);
    m->file_names = found->weights;
    m->nfiles = found->nweights;
    found->weights = NULL;
    found->nweights = 0;
    return NF4_OK;
}

static int has_name(char *const *names, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (names[i] && strcmp(names[i], name) == 0)
            return 1;
    return 0;
}

/* Takes from found every weights file the model does not use, hidden ones
 * included, sorted. The names move; only the list is allocated. */
static int set_unused_names(struct model *m, struct model_dir_files *found)
{
    size_t cap = found->nweights + found->nhidden_weights + found->nindexes;
    if (!(m->unused_names = calloc(cap ? cap : 1, sizeof *m->unused_names)))
        return nf4_fail(NF4_ESOFTWARE, m->dir, NULL, "out of memory");
    for (size_t i = 0; i < found->nindexes; i++) /* the variants' beside the plain one */
        if (found->indexes[i])
            take_name(found->indexes, i, &m->unused_names, &m->nunused);
    for (size_t i = 0; i < found->nhidden_weights; i++)
        if (!has_name(m->file_names, m->nfiles, found->hidden_weights[i])) /* an index may list one */
            take_name(found->hidden_weights, i, &m->unused_names, &m->nunused);
    for (size_t i = 0; i < found->nweights; i++)
        if (found->weights[i] && !has_name(m->file_names, m->nfiles, found->weights[i]))
            take_name(found->weights, i, &m->unused_names, &m->nunused);
    qsort(m->unused_names, m->nunused, sizeof *m->unused_names, cmp_str);
    return NF4_OK;
}

/* A variant's index is the model's only where nothing else is: a weights
 * file beside it that it does not list (model.safetensors beside
 * model.safetensors.index.fp16.json) is the plain checkpoint transformers
 * would load, another variant of the model. */
static int check_one_variant(const struct model *m)
{
    if (!m->index_name || !is_variant_index_name(m->index_name))
        return NF4_OK;
    for (size_t i = 0; i < m->nunused; i++)
        if (m->unused_names[i][0] != '.')
            return nf4_fail(NF4_EDATA, m->dir, NULL, "is ambiguous: it holds %s, the index of a variant, and %s, "
                            "which it does not list: two variants of one model? keep the one to convert",
                            m->index_name, m->unused_names[i]);
    return NF4_OK;
}

int model_open_dir(const char *dir, struct model **out)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m || !(m->dir = strdup(dir)) || !(m->config = model_config_new())) {
        model_close(m);
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    }
    char *index_path = NULL;
    char *json = NULL;
    struct index_entry *entries = NULL;
    size_t nentries = 0;
    struct model_dir_files found;
    int code = model_dir_scan(dir, &found);
    if (code == NF4_OK)
        code = choose_model_files(dir, m, &found);
    if (code != NF4_OK)
        goto out;
    if (m->index_name) {
        size_t len;
        if (!(index_path = path_join(dir, m->index_name))) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            goto out;
        }
        code = read_small_file(index_path, MAX_JSON_FILE_BYTES, &json, &len);
        if (code == NF4_OK)
            code = index_parse(index_path, json, len, &entries, &nentries, &m->file_names, &m->nfiles,
                               &m->index_metadata_json);
        if (code != NF4_OK)
            goto out;
        m->sharded = 1;
    }
    m->files = calloc(m->nfiles, sizeof *m->files);
    if (!m->files) {
        code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        goto out;
    }
    if ((code = set_unused_names(m, &found)) != NF4_OK || (code = check_one_variant(m)) != NF4_OK)
        goto out;
    for (size_t i = 0; i < m->nfiles && code == NF4_OK; i++) {
        char *p = path_join(dir, m->file_names[i]);
        if (!p) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            break;
        }
        code = st_open(p, &m->files[i]);
        if (code == NF4_OK && !path_stays_in_model(dir, p))
            code = nf4_fail(NF4_EDATA, p, NULL, "is a link to a file outside the model directory (or its Hugging "
                            "Face cache repository), whose bytes nf4deq does not take into OUT: copy the shards "
                            "into one directory");
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
    model_dir_files_free(&found);
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
    dir_names_free(m->unused_names, m->nunused);
    free(m->index_name);
    free(m->dir);
    model_config_free(m->config);
    free(m);
}

int model_is_checkpoint_name(const char *name)
{
    return str_ends_with(name, WEIGHTS_FILE_SUFFIX) || is_index_name(name);
}

void model_unused_reason(const struct model *m, const char *name, char *buf, size_t cap)
{
    if (!has_name(m->unused_names, m->nunused, name))
        snprintf(buf, cap, "not there when the model was read");
    else if (is_index_name(name))
        snprintf(buf, cap, "the index of another variant; the model's is %s", m->index_name);
    else if (name[0] == '.' || !m->index_name) /* without an index, every other weights file is the model */
        snprintf(buf, cap, "a hidden file");
    else
        snprintf(buf, cap, "not listed in %s", m->index_name);
}

/* Bytes compared per block by model_tensors_equal, on each side. */
#define EQUAL_BLOCK_BYTES (UINT64_C(1) << 20)

int model_tensors_equal(const struct model_tensor *a, const struct model_tensor *b, int *equal)
{
    const struct st_tensor *x = a->t, *y = b->t;
    *equal = x->dtype == y->dtype && x->ndim == y->ndim && memcmp(x->shape, y->shape, x->ndim * sizeof *x->shape) == 0;
    uint64_t bytes = *equal ? st_tensor_bytes(x) : 0;
    if (!bytes)
        return NF4_OK;
    uint64_t block = bytes < EQUAL_BLOCK_BYTES ? bytes : EQUAL_BLOCK_BYTES;
    unsigned char *xb = malloc(block), *yb = malloc(block);
    int code = xb && yb ? NF4_OK : nf4_fail(NF4_ESOFTWARE, a->file->path, x->name, "out of memory");
    for (uint64_t at = 0; code == NF4_OK && *equal && at < bytes; at += block) {
        uint64_t len = bytes - at < block ? bytes - at : block;
        if ((code = st_read(a->file, x, at, xb, len)) == NF4_OK && (code = st_read(b->file, y, at, yb, len)) == NF4_OK)
            *equal = memcmp(xb, yb, len) == 0;
    }
    free(xb);
    free(yb);
    return code;
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
