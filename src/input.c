#include "input.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "hf_cache.h"
#include "status.h"

/* Standard input, reopened by name so that it reads like any file. */
#define STDIN_PATH "/dev/stdin"

static int owned(const char *s, char **out)
{
    if (!(*out = strdup(s)))
        return nf4_fail(NF4_ESOFTWARE, s, NULL, "out of memory");
    return NF4_OK;
}

/* An existing path, or what is no path but a model id, found in the cache;
 * a --revision (IN's only) must go with a model id. */
static int path_or_model_id(const char *arg, const char *revision, char **path)
{
    struct stat st;
    /* ENOTDIR: "org" is a file here, so "org/name" is no path either. */
    int exists = stat(arg, &st) == 0 || (errno != ENOENT && errno != ENOTDIR);
    if (exists || !hf_repo_id_is_valid(arg)) {
        if (revision)
            return nf4_fail(NF4_EUSAGE, arg, NULL, "--revision applies to a Hugging Face model id (ORG/NAME) in the "
                            "cache, and this is %s", exists ? "a path" : "not one");
        return owned(arg, path); /* opening it reports what is wrong */
    }
    return hf_cache_resolve(arg, revision, path);
}

int input_resolve(const char *arg, const char *revision, char **path)
{
    *path = NULL;
    struct stat st;
    if (strcmp(arg, "-") == 0) {
        if (revision)
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "--revision applies to a Hugging Face model id (ORG/NAME), not to "
                            "standard input");
        if (std_stream_was_closed(STDIN_FILENO) || fstat(STDIN_FILENO, &st) != 0)
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "standard input (-) is closed");
        if (S_ISDIR(st.st_mode))
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "standard input (-) is a directory: give a model directory as "
                            "IN by its path");
        if (!S_ISREG(st.st_mode))
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "standard input (-) must be a regular file, not a pipe, terminal "
                            "or device: safetensors are read at random offsets; save it to a file first");
        return owned(STDIN_PATH, path);
    }
    return path_or_model_id(arg, revision, path);
}

int input_resolve_adapter(const char *arg, char **path)
{
    *path = NULL;
    return path_or_model_id(arg, NULL, path);
}
