#include "tokenizer_files.h"

#include <cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "file_copy.h"
#include "fileio.h"
#include "json_util.h"
#include "model.h"
#include "status.h"

/* The names transformers' tokenizers save themselves as (each class's
 * vocabulary files, the shared configuration files, and the chat template
 * that recent transformers write apart). A processor's own files
 * (preprocessor_config.json, processor_config.json, chat_template.json) are
 * not the tokenizer's, and stay IN's. */
static const char *const TOKENIZER_NAMES[] = {
    "added_tokens.json", "chat_template.jinja", "merges.txt",      "sentencepiece.bpe.model",
    "special_tokens_map.json", "spiece.model",  "tokenizer.json",  "tokenizer.model",
    "tokenizer_config.json",   "vocab.json",    "vocab.txt",
};

/* A folder holds a tokenizer when it has one of these: every tokenizer
 * transformers saves writes tokenizer_config.json, and the two others are
 * what a tokenizer is loaded from without it. */
static const char *const TOKENIZER_MARKERS[] = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"};

#define NAMES_OF(a) (sizeof(a) / sizeof *(a))

#define CHAT_TEMPLATES_DIR "additional_chat_templates"

int tokenizer_dir_name(const char *name)
{
    return strcmp(name, CHAT_TEMPLATES_DIR) == 0;
}

int tokenizer_file_name(const char *name)
{
    for (size_t i = 0; i < NAMES_OF(TOKENIZER_NAMES); i++)
        if (strcmp(name, TOKENIZER_NAMES[i]) == 0)
            return 1;
    return 0;
}

/* *found: whether `dir` holds one of the marker files. A folder that cannot
 * be searched is the error (NF4_ENOINPUT), not a folder without one. */
static int holds_tokenizer(const char *dir, int *found)
{
    *found = 0;
    for (size_t i = 0; i < NAMES_OF(TOKENIZER_MARKERS) && !*found; i++) {
        char *p = path_join(dir, TOKENIZER_MARKERS[i]);
        struct stat st;
        if (!p)
            return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        int e = lstat(p, &st) == 0 ? 0 : errno;
        free(p);
        if (!e) /* a FIFO, a link to nothing or out of dir: tokenizer_check says what is wrong */
            *found = 1;
        else if (e != ENOENT && e != ENOTDIR)
            return nf4_fail_errno(NF4_ENOINPUT, e, dir, NULL, "cannot look for a tokenizer in it");
    }
    return NF4_OK;
}

/* One entry of the set to take: what copy_path would copy whole, or the
 * failure (NF4_ENOINPUT) naming it. A file must be regular (through a link
 * that stays in `root`) and readable; the templates folder a real folder,
 * not a link (copy_tree leaves those out), readable and searchable. */
static int check_entry(const char *root, const char *p, int want_dir)
{
    const char *what = want_dir ? "folder" : "file";
    struct stat st, lst;
    if (stat(p, &st) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, p, NULL, "the tokenizer's %s: cannot stat", what);
    if (want_dir ? !S_ISDIR(st.st_mode) || lstat(p, &lst) != 0 || S_ISLNK(lst.st_mode) : !S_ISREG(st.st_mode))
        return nf4_fail(NF4_ENOINPUT, p, NULL, "the tokenizer's %s is not a %s", what,
                        want_dir ? "directory (a link to one is not copied)" : "regular file");
    if (!want_dir && !path_stays_in_model(root, p))
        return nf4_fail(NF4_ENOINPUT, p, NULL, "the tokenizer's file links outside %s", root);
    if (access(p, want_dir ? R_OK | X_OK : R_OK) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, p, NULL, "the tokenizer's %s cannot be read", what);
    return NF4_OK;
}

/* Every entry of the set to take must copy: a tokenizer is taken whole, or
 * the run fails before anything is written, naming the entry. The templates
 * folder holds files (transformers writes NAME.jinja there), each checked
 * as the others. A hidden entry that is not a regular file (a notebook's
 * .ipynb_checkpoints) is passed over, as copy_tree passes over it. */
static int tokenizer_check(const char *dir)
{
    char **names;
    size_t n;
    int code = tokenizer_list(dir, &names, &n);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        char *p = path_join(dir, names[i]);
        int want_dir = tokenizer_dir_name(names[i]);
        code = p ? check_entry(dir, p, want_dir) : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        char **inner = NULL;
        size_t ninner = 0;
        if (code == NF4_OK && want_dir)
            code = dir_list(p, NF4_ENOINPUT, &inner, &ninner);
        for (size_t k = 0; code == NF4_OK && k < ninner; k++) {
            char *q = path_join(p, inner[k]);
            struct stat st;
            if (!q)
                code = nf4_fail(NF4_ESOFTWARE, p, NULL, "out of memory");
            else if (inner[k][0] != '.' || (stat(q, &st) == 0 && S_ISREG(st.st_mode)))
                code = check_entry(dir, q, 0);
            free(q);
        }
        dir_names_free(inner, ninner);
        free(p);
    }
    dir_names_free(names, n);
    return code;
}

static int same_dir(const char *a, const char *b)
{
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

static int choose_given(const char *dir, const char *in, struct tokenizer_source *out)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, dir, NULL, "--tokenizer: cannot open");
    if (!S_ISDIR(st.st_mode))
        return nf4_fail(NF4_ENOINPUT, dir, NULL, "--tokenizer: not a directory: give the folder that holds the "
                        "tokenizer's files");
    int holds, code = holds_tokenizer(dir, &holds);
    if (code != NF4_OK)
        return code;
    if (!holds)
        return nf4_fail(NF4_ENOINPUT, dir, NULL, "--tokenizer: holds no tokenizer (no tokenizer.json, "
                        "tokenizer_config.json or tokenizer.model)");
    if (same_dir(dir, in)) /* IN itself: its own files, as without the option */
        return NF4_OK;
    *out = (struct tokenizer_source){TOKENIZER_GIVEN, dir};
    return tokenizer_check(dir);
}

int tokenizer_choose(const char *option, const char *in, const char *const *adapters, size_t nadapters,
                     struct tokenizer_source *out)
{
    *out = (struct tokenizer_source){TOKENIZER_IN, NULL};
    if (option && strcmp(option, TOKENIZER_OF_BASE) == 0)
        return NF4_OK;
    if (option)
        return choose_given(option, in, out);
    for (size_t i = nadapters; i-- > 0;) {
        int holds, code = holds_tokenizer(adapters[i], &holds);
        if (code != NF4_OK)
            return code;
        if (holds) {
            *out = (struct tokenizer_source){TOKENIZER_ADAPTER, adapters[i]};
            return tokenizer_check(adapters[i]);
        }
    }
    return NF4_OK;
}

int tokenizer_list(const char *dir, char ***names, size_t *n)
{
    int code = dir_list(dir, NF4_ENOINPUT, names, n);
    size_t kept = 0;
    for (size_t i = 0; i < *n; i++) {
        if (tokenizer_file_name((*names)[i]) || tokenizer_dir_name((*names)[i]))
            (*names)[kept++] = (*names)[i];
        else
            free((*names)[i]);
    }
    *n = kept;
    return code;
}

void tokenizer_names_text(char *const *names, size_t n, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && at < cap; i++) {
        int w = snprintf(buf + at, cap - at, "%s%s", i ? ", " : "", names[i]);
        if (w < 0)
            break;
        at += (size_t)w;
    }
}

/* The longest prefix of `text` that fits `cap` with its NUL and ends on a
 * character boundary: a cut inside a UTF-8 sequence would leave a message
 * (and a --json report) that is no longer UTF-8. */
static void copy_utf8_prefix(char *out, size_t cap, const char *text)
{
    size_t n = strlen(text);
    if (n >= cap) {
        n = cap - 1;
        while (n > 0 && ((unsigned char)text[n] & 0xC0) == 0x80) /* text[n] continues a character */
            n--;
    }
    memcpy(out, text, n);
    out[n] = '\0';
}

/* tokenizer_config.json is small (a Llama 3's: 50 KB), added_tokens.json
 * smaller; one past this is not read. */
#define TOKENIZER_CONFIG_MAX_BYTES (16u << 20)
/* JSON numbers are doubles: ids past this are not exact, so not taken. */
#define MAX_EXACT_ID 9007199254740992.0

/* dir/name as JSON, or NULL: a best-effort check, so nothing here may fail
 * the run or leave a message. read_small_file refuses what is no regular
 * file, or past the size. */
static cJSON *read_tokenizer_json(const char *dir, const char *name)
{
    char *path = path_join(dir, name), *json = NULL;
    size_t len = 0;
    cJSON *root = NULL;
    if (!path || read_small_file(path, TOKENIZER_CONFIG_MAX_BYTES, &json, &len) != NF4_OK)
        nf4_clear_error(); /* what it recorded is no error of the run's */
    else
        root = json_parse_whole(json, len);
    free(json);
    free(path);
    return root;
}

struct highest_added {
    int found;
    uint64_t id;
    char *token;
    size_t cap;
    const char *file;
};

static void consider(struct highest_added *h, uint64_t id, const char *text, const char *file)
{
    if (h->found && id <= h->id)
        return;
    copy_utf8_prefix(h->token, h->cap, text);
    h->id = id;
    h->file = file;
    h->found = 1;
}

int tokenizer_highest_added_id(const char *dir, uint64_t *id, char *token, size_t cap, const char **file)
{
    struct highest_added h = {0, 0, token, cap, NULL};
    /* transformers 4.34 and later: {"id": {"content": text, ...}}. */
    cJSON *root = read_tokenizer_json(dir, TOKENIZER_CONFIG_NAME);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder"), *e;
    if (!cJSON_IsObject(added))
        added = NULL;
    cJSON_ArrayForEach(e, added) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(e->string, &end, 10);
        if (!isdigit((unsigned char)e->string[0]) || *end || errno == ERANGE)
            continue;
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        consider(&h, v, cJSON_IsString(content) ? content->valuestring : "", TOKENIZER_CONFIG_NAME);
    }
    cJSON_Delete(root);
    /* Before 4.34 transformers kept them in added_tokens.json (and, for a
     * fast tokenizer, tokenizer.json, which is large): {text: id}. Older
     * adapters' folders hold it. */
    root = read_tokenizer_json(dir, ADDED_TOKENS_NAME);
    added = cJSON_IsObject(root) ? root : NULL;
    cJSON_ArrayForEach(e, added)
        if (cJSON_IsNumber(e) && e->valuedouble >= 0 && e->valuedouble < MAX_EXACT_ID &&
            e->valuedouble == (double)(uint64_t)e->valuedouble)
            consider(&h, (uint64_t)e->valuedouble, e->string, ADDED_TOKENS_NAME);
    cJSON_Delete(root);
    if (h.found) {
        *id = h.id;
        *file = h.file;
    }
    return h.found;
}

int tokenizer_copy(const char *dir, const char *to_dir)
{
    char **names;
    size_t n;
    int code = tokenizer_list(dir, &names, &n);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        char *from = path_join(dir, names[i]), *to = path_join(to_dir, names[i]);
        /* A file, or the templates folder as a tree; tokenizer_check has
         * vouched for each entry, and copy_path still says what it leaves. */
        code = from && to ? copy_path(from, to, dir) : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
        free(from);
        free(to);
    }
    dir_names_free(names, n);
    return code;
}
