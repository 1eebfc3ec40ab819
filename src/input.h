/* IN as a user gives it, turned into a path: "-" for standard input (a
 * regular file: nf4deq reads at random offsets), an existing path, or a
 * Hugging Face model id (ORG/NAME) found in the local hub cache. */
#ifndef NF4DEQ_INPUT_H
#define NF4DEQ_INPUT_H

/* revision: --revision, or NULL; it is only valid with a model id.
 * *path is malloc'd. NF4_EUSAGE for a "-" that is not a file or a misplaced
 * --revision; NF4_ENOINPUT for a model id the cache lacks. */
int input_resolve(const char *arg, const char *revision, char **path);

/* An adapter folder (--lora) as a user gives it: an existing path, or a model
 * id (ORG/NAME) found in the hub cache at its main revision, as `hf download
 * ORG/NAME` leaves an adapter. *path is malloc'd; NF4_ENOINPUT for an id the
 * cache lacks. */
int input_resolve_adapter(const char *arg, char **path);

#endif
