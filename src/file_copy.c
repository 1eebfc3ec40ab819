#include "file_copy.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "model.h"
#include "status.h"

/* Deeper than any real repository; stops a crafted tree from exhausting the stack. */
#define COPY_TREE_MAX_DEPTH 32

int copy_file(const char *from, const char *to)
{
    int in = open(from, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, from, NULL, "cannot open");
    /* The source's permissions less the umask, as cp gives a new file: a
     * private tokenizer.model (0600) must not come out readable by all. */
    struct stat st;
    if (fstat(in, &st) != 0) {
        int e = errno;
        close(in);
        return nf4_fail_errno(NF4_ENOINPUT, e, from, NULL, "cannot stat");
    }
    int outfd = open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, st.st_mode & 0777);
    if (outfd < 0) {
        int e = errno;
        close(in);
        return nf4_fail_errno(NF4_ECANTCREAT, e, to, NULL, "cannot create");
    }
    int code = NF4_OK;
    static _Thread_local char buf[1 << 16];
    for (;;) {
        ssize_t got = read(in, buf, sizeof buf);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            code = nf4_fail_errno(NF4_EIO, errno, from, NULL, "read failed");
            break;
        }
        if (got == 0)
            break;
        if (write_full(outfd, buf, (size_t)got) != 0) {
            code = nf4_fail_errno(NF4_EIO, errno, to, NULL, "write failed");
            break;
        }
    }
    if (code == NF4_OK && fsync(outfd) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, to, NULL, "fsync failed");
    if (close(outfd) != 0 && code == NF4_OK)
        code = nf4_fail_errno(NF4_EIO, errno, to, NULL, "close failed");
    close(in);
    if (code != NF4_OK)
        unlink(to);
    return code;
}

int stat_to_copy(const char *path, struct stat *st)
{
    struct stat lst;
    if (stat(path, st) == 0)
        return 0;
    if (errno == ENOENT && lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode)) {
        nf4_warn("%s: a link to nothing; not copied", path);
        return 1;
    }
    nf4_fail_errno(NF4_ENOINPUT, errno, path, NULL, "cannot stat");
    return -1;
}

static int copy_tree_at(const char *from, const char *to, const char *root, int depth);

/* One entry of a directory being copied. */
static int copy_entry(const char *from, const char *to, const char *name, const char *root, int depth)
{
    struct stat lst, st;
    if (lstat(from, &lst) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, from, NULL, "cannot stat");
    int found = stat_to_copy(from, &st);
    if (found != 0)
        return found > 0 ? NF4_OK : NF4_ENOINPUT;
    if (S_ISDIR(st.st_mode)) {
        if (name[0] == '.')
            return NF4_OK; /* .cache/huggingface of `hf download --local-dir`, .git */
        if (S_ISLNK(lst.st_mode)) {
            nf4_warn("%s: a link to a directory; not copied", from);
            return NF4_OK;
        }
        if (depth >= COPY_TREE_MAX_DEPTH)
            return nf4_fail(NF4_EDATA, from, NULL, "directories nested more than %d deep", COPY_TREE_MAX_DEPTH);
        return copy_tree_at(from, to, root, depth + 1);
    }
    if (!S_ISREG(st.st_mode)) {
        if (name[0] != '.')
            nf4_warn("%s: not a regular file; not copied", from);
        return NF4_OK;
    }
    if (!path_stays_in_model(root, from)) {
        nf4_warn("%s: links to a file outside the model directory; not copied", from);
        return NF4_OK;
    }
    temp_register(to, 0); /* before it exists: a signal must find it */
    return copy_file(from, to);
}

static int copy_tree_at(const char *from, const char *to, const char *root, int depth)
{
    temp_register(to, 1);
    struct stat st; /* the source's mode less the umask, as cp -r gives it (the owner may write in it) */
    if (mkdir(to, stat(from, &st) == 0 ? (st.st_mode & 0777) | S_IRWXU : 0777) != 0)
        return nf4_fail_errno(NF4_ECANTCREAT, errno, to, NULL, "cannot create");
    char **names;
    size_t n;
    int code = dir_list(from, NF4_ENOINPUT, &names, &n);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        char *src = path_join(from, names[i]), *dst = path_join(to, names[i]);
        code = src && dst ? copy_entry(src, dst, names[i], root, depth)
                          : nf4_fail(NF4_ESOFTWARE, from, NULL, "out of memory");
        free(src);
        free(dst);
    }
    dir_names_free(names, n);
    if (code == NF4_OK && fsync_dir(to) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, to, NULL, "fsync failed");
    return code;
}

int copy_tree(const char *from, const char *to, const char *root)
{
    return copy_tree_at(from, to, root, 0);
}

int copy_path(const char *from, const char *to, const char *root)
{
    const char *slash = strrchr(from, '/');
    return copy_entry(from, to, slash ? slash + 1 : from, root, 0);
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    int rc = (type == FTW_DP) ? rmdir(path) : unlink(path);
    return rc != 0 && errno != ENOENT ? -1 : 0;
}

int remove_tree(const char *path)
{
    return nftw(path, remove_entry, 32, FTW_DEPTH | FTW_PHYS);
}

int remove_path(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : -1;
    int rc = S_ISDIR(st.st_mode) ? remove_tree(path) : unlink(path);
    return rc != 0 && errno != ENOENT ? -1 : 0;
}
