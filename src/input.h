/* IN as a user gives it, turned into a path: "-" for standard input (a
 * regular file: nf4deq reads at random offsets), an existing path, or a
 * Hugging Face model id (ORG/NAME) found in the local hub cache. */
#ifndef NF4DEQ_INPUT_H
#define NF4DEQ_INPUT_H

/* revision: --revision, or NULL; it is only valid with a model id.
 * *path is malloc'd. NF4_EUSAGE for a "-" that is not a file or a misplaced
 * --revision; NF4_ENOINPUT for a model id the cache lacks. */
int input_resolve(const char *arg, const char *revision, char **path);

#endif
