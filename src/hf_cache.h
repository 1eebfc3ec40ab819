/* Models fetched with `hf download ORG/NAME`, found in the Hugging Face hub
 * cache without going to the network: HUB/models--ORG--NAME/refs/REV holds a
 * commit hash, and snapshots/HASH/ the files (links into blobs/). */
#ifndef NF4DEQ_HF_CACHE_H
#define NF4DEQ_HF_CACHE_H

#include <stddef.h>

#define HF_REVISION_DEFAULT "main"
#define HF_COMMIT_HEX 40 /* a git SHA-1, as the hub names snapshots */
#define HF_REPO_PART_MAX 96 /* huggingface_hub's limit on ORG and on NAME, each */
#define HF_REPO_ID_MAX (2 * HF_REPO_PART_MAX + 1)

/* 1 if `id` has the form ORG/NAME of a hub model id, as huggingface_hub's
 * validate_repo_id takes it: two parts of at most HF_REPO_PART_MAX letters,
 * digits, '-', '_' and '.', neither starting or ending with '-' or '.', with
 * no "--" or "..", not ending in ".git". */
int hf_repo_id_is_valid(const char *id);

/* 1 if `rev` can name a ref file or snapshot under the repository: not
 * empty, no "." or ".." component, no leading '/', no control characters. */
int hf_revision_is_valid(const char *rev);

/* Parses a refs/ file (`path` only names it in messages): exactly one
 * 40-digit lower-case hex commit hash, optionally followed by white space.
 * NF4_EDATA otherwise. */
int hf_ref_parse(const char *path, const char *text, size_t len, char commit[HF_COMMIT_HEX + 1]);

/* Finds the snapshot of repo_id at `revision` (a branch or tag with a refs/
 * file, or a commit hash; NULL: main) in the first cache that has the
 * repository, in huggingface_hub's order of precedence: $HF_HUB_CACHE,
 * $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub,
 * ~/.cache/huggingface/hub (each with ~ and $VAR expanded, as
 * huggingface_hub expands them). NF4_ENOINPUT, naming the `hf download`
 * command to run, when it is not there. *snapshot is malloc'd. */
int hf_cache_resolve(const char *repo_id, const char *revision, char **snapshot);

#endif
