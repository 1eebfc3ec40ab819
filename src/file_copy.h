/* Copies and removals of files and directory trees, for the parts of a model
 * or pipeline that are not converted (tokenizers, schedulers, READMEs,
 * unquantized components) and for replaced or failed outputs. */
#ifndef NF4DEQ_FILE_COPY_H
#define NF4DEQ_FILE_COPY_H

#include <sys/stat.h>

/* Copies a regular file, fsyncing the copy, with the source's permission
 * bits less the umask (as cp). Returns an NF4_* code. */
int copy_file(const char *from, const char *to);

/* Creates `to` (registered as a temp) and copies directory `from` into it:
 * regular files (through links that stay inside `root` or its Hugging Face
 * cache repository, see path_stays_in_model) and sub-directories, each
 * registered as a temp before it exists. Hidden directories (.cache, .git) are
 * left out; links to directories, other file types and links that escape are
 * left out with a warning. Every copy and directory is fsync'd. */
int copy_tree(const char *from, const char *to, const char *root);

/* One entry of a directory, as copy_tree copies it: a regular file (links
 * checked against `root`), a directory (a tree), or, with a warning, nothing. */
int copy_path(const char *from, const char *to, const char *root);

/* stat() of an entry of a directory to copy. A link to nothing (a blob
 * missing from a Hugging Face cache, say) is not an error: it is reported as
 * not copied, and the result is 1. 0 with *st filled, or -1 with the failure
 * recorded as NF4_ENOINPUT. */
int stat_to_copy(const char *path, struct stat *st);

/* Removes a directory tree (for --force replacing an old output). */
int remove_tree(const char *path);
/* Removes a file, or a directory with everything in it (never through a
 * link). 0 (also when it is already gone), or -1 with errno. */
int remove_path(const char *path);

#endif
