#include "layout.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "model.h"
#include "status.h"
#include "strutil.h"

/* Whether folder `dirfd` holds `name`, a regular file or a link to one
 * (without allocating: an index's absence is not an error). */
static int holds_regular_file(int dirfd, const char *name)
{
    struct stat st;
    return fstatat(dirfd, name, &st, 0) == 0 && S_ISREG(st.st_mode);
}

const char *pipeline_index_name(const char *dir)
{
    const int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    const char *name = holds_regular_file(fd, PIPELINE_INDEX_NAME)           ? PIPELINE_INDEX_NAME
                       : holds_regular_file(fd, MODULAR_PIPELINE_INDEX_NAME) ? MODULAR_PIPELINE_INDEX_NAME
                                                                             : NULL;
    close(fd);
    return name;
}

int layout_of(const char *path, enum input_layout *out)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot open");
    if (S_ISREG(st.st_mode)) {
        *out = LAYOUT_FILE;
        return NF4_OK;
    }
    if (!S_ISDIR(st.st_mode))
        return nf4_fail(NF4_ENOINPUT, path, NULL, "neither a file nor a directory");
    *out = pipeline_index_name(path) ? LAYOUT_PIPELINE : LAYOUT_MODEL_DIR;
    return NF4_OK;
}

/* What entry `path` of pipeline `root` is; `is_index`: it is the index that
 * makes `root` a pipeline, which OUT cannot be one without. */
static int classify(const char *root, const char *path, int is_index, enum pipeline_entry_kind *kind)
{
    struct stat lst, st;
    if (lstat(path, &lst) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot stat");
    if (stat(path, &st) != 0) {
        if (errno != ENOENT || !S_ISLNK(lst.st_mode))
            return nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot stat");
        *kind = ENTRY_OTHER; /* a link to nothing */
        return NF4_OK;
    }
    if (S_ISREG(st.st_mode)) {
        if (S_ISLNK(lst.st_mode) && !path_stays_in_model(root, path) && is_index)
            return nf4_fail(NF4_EDATA, path, NULL, "is the pipeline's index and links outside the pipeline, which "
                            "nf4deq copies no file from: copy the file into the pipeline");
        if (S_ISLNK(lst.st_mode) && !path_stays_in_model(root, path))
            *kind = ENTRY_OTHER;
        else
            *kind = str_ends_with(path, WEIGHTS_FILE_SUFFIX) ? ENTRY_CHECKPOINT : ENTRY_FILE;
        return NF4_OK;
    }
    if (!S_ISDIR(st.st_mode)) {
        *kind = ENTRY_OTHER;
        return NF4_OK;
    }
    struct model_dir_files found;
    int code = model_dir_scan(path, &found);
    if (code != NF4_OK)
        return code;
    int is_model = model_dir_is_model(&found);
    model_dir_files_free(&found);
    if (S_ISLNK(lst.st_mode) && !path_stays_in_model(root, path)) {
        if (is_model)
            return nf4_fail(NF4_EDATA, path, NULL, "is a component that links outside the pipeline");
        *kind = ENTRY_OTHER;
        return NF4_OK;
    }
    *kind = is_model ? ENTRY_COMPONENT : S_ISLNK(lst.st_mode) ? ENTRY_OTHER : ENTRY_DIR;
    return NF4_OK;
}

void pipeline_entries_free(struct pipeline_entry *e, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(e[i].name);
    free(e);
}

int pipeline_list(const char *root, struct pipeline_entry **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    char **names;
    size_t n;
    int code = dir_list(root, NF4_ENOINPUT, &names, &n);
    if (code != NF4_OK)
        return code;
    const char *index = pipeline_index_name(root);
    struct pipeline_entry *e = calloc(n ? n : 1, sizeof *e);
    size_t kept = 0;
    if (!e)
        code = nf4_fail(NF4_ESOFTWARE, root, NULL, "out of memory");
    for (size_t i = 0; i < n && code == NF4_OK; i++) { /* sorted: so are the entries */
        char *path = path_join(root, names[i]);
        enum pipeline_entry_kind kind = ENTRY_OTHER;
        const int is_index = index && strcmp(names[i], index) == 0;
        code = path ? classify(root, path, is_index, &kind) : nf4_fail(NF4_ESOFTWARE, root, NULL, "out of memory");
        free(path);
        if (code != NF4_OK || (names[i][0] == '.' && kind != ENTRY_FILE))
            continue;
        e[kept].name = names[i]; /* moved, not copied */
        names[i] = NULL;
        e[kept++].kind = kind;
    }
    dir_names_free(names, n);
    if (code != NF4_OK) {
        pipeline_entries_free(e, kept);
        return code;
    }
    *out = e;
    *n_out = kept;
    return NF4_OK;
}
