#include "hf_cache.h"

#include <ctype.h>
#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

/* A refs/ file is 40 bytes and a newline; anything much larger is not one. */
#define HF_REF_FILE_MAX 4096

static int repo_part_is_valid(const char *s, size_t n)
{
    if (n == 0 || s[0] == '-' || s[0] == '.' || s[n - 1] == '-' || s[n - 1] == '.')
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!isalnum(c) && c != '-' && c != '_' && c != '.')
            return 0;
        if (i > 0 && (c == '-' || c == '.') && s[i - 1] == c)
            return 0;
    }
    return 1;
}

int hf_repo_id_is_valid(const char *id)
{
    size_t len = strlen(id);
    const char *slash = strchr(id, '/');
    if (!slash || strchr(slash + 1, '/') || (len >= 4 && strcmp(id + len - 4, ".git") == 0))
        return 0;
    size_t org = (size_t)(slash - id), name = len - org - 1;
    return org <= HF_REPO_PART_MAX && name <= HF_REPO_PART_MAX && repo_part_is_valid(id, org) &&
           repo_part_is_valid(slash + 1, name);
}

int hf_revision_is_valid(const char *rev)
{
    if (!rev[0] || rev[0] == '/' || strlen(rev) > 255)
        return 0;
    for (const unsigned char *p = (const unsigned char *)rev; *p; p++)
        if (*p < 0x20 || *p == 0x7f || *p == '\\')
            return 0;
    for (const char *part = rev; part;) {
        const char *end = strchr(part, '/');
        size_t n = end ? (size_t)(end - part) : strlen(part);
        if (n == 0 || (n == 1 && part[0] == '.') || (n == 2 && part[0] == '.' && part[1] == '.'))
            return 0;
        part = end ? end + 1 : NULL;
    }
    return 1;
}

int hf_ref_parse(const char *path, const char *text, size_t len, char commit[HF_COMMIT_HEX + 1])
{
    if (len < HF_COMMIT_HEX)
        return nf4_fail(NF4_EDATA, path, NULL, "is not a commit hash (%zu bytes)", len);
    for (size_t i = 0; i < HF_COMMIT_HEX; i++) {
        char c = text[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return nf4_fail(NF4_EDATA, path, NULL, "is not a commit hash (byte %zu)", i);
    }
    for (size_t i = HF_COMMIT_HEX; i < len; i++)
        if (text[i] != '\n' && text[i] != '\r' && text[i] != ' ' && text[i] != '\t')
            return nf4_fail(NF4_EDATA, path, NULL, "holds more than one commit hash");
    memcpy(commit, text, HF_COMMIT_HEX);
    commit[HF_COMMIT_HEX] = '\0';
    return NF4_OK;
}

/* An environment variable, or NULL when unset or empty. */
static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* os.path.expandvars(os.path.expanduser(s)), as huggingface_hub reads its
 * cache variables: a leading "~" becomes $HOME and "~user" that user's home
 * (up to the first '/'), then each $NAME or ${NAME} that is set becomes its
 * value; the rest stays as it is. NULL: out of memory. */
static char *expand_path(const char *s)
{
    struct strbuf b = {0};
    if (s[0] == '~') {
        size_t n = strcspn(s + 1, "/");
        char user[256];
        const char *home = NULL;
        if (n == 0) {
            home = env("HOME");
        } else if (n < sizeof user) {
            memcpy(user, s + 1, n);
            user[n] = '\0';
            const struct passwd *pw = getpwnam(user); /* before any thread: the cache is resolved first */
            home = pw ? pw->pw_dir : NULL;
        }
        if (home) {
            strbuf_puts(&b, home);
            s += 1 + n;
        }
    }
    while (*s) {
        const char *name = s + 1 + (s[1] == '{');
        size_t n = 0;
        while (isalnum((unsigned char)name[n]) || name[n] == '_')
            n++;
        int braced = s[1] == '{', closed = !braced || name[n] == '}';
        char key[256];
        const char *value = NULL;
        if (s[0] == '$' && n > 0 && n < sizeof key && closed) {
            memcpy(key, name, n);
            key[n] = '\0';
            value = getenv(key);
        }
        if (value) {
            strbuf_puts(&b, value);
            s = name + n + braced;
        } else {
            strbuf_put(&b, s++, 1);
        }
    }
    if (b.oom || !b.p) {
        free(b.p);
        return b.oom ? NULL : strdup("");
    }
    return b.p;
}

/* `base`/`tail`, with base expanded; NULL where base is NULL. Sets *oom. */
static char *cache_path(const char *base, const char *tail, int *oom)
{
    if (!base)
        return NULL;
    char *e = expand_path(base), *p = e && tail ? path_join(e, tail) : e;
    if (p != e)
        free(e);
    *oom |= !p;
    return p;
}

/* The cache huggingface_hub uses (its constants.py): HF_HUB_CACHE, else
 * HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, HF_HOME defaulting to
 * $XDG_CACHE_HOME/huggingface, then ~/.cache/huggingface. Only that one: a
 * copy in a cache huggingface_hub no longer reads may be an older revision.
 * *dir is malloc'd, NULL when no variable is set; -1 when out of memory. */
static int cache_dir(char **dir)
{
    int oom = 0;
    if (env("HF_HUB_CACHE"))
        *dir = cache_path(env("HF_HUB_CACHE"), NULL, &oom);
    else if (env("HUGGINGFACE_HUB_CACHE"))
        *dir = cache_path(env("HUGGINGFACE_HUB_CACHE"), NULL, &oom);
    else if (env("HF_HOME"))
        *dir = cache_path(env("HF_HOME"), "hub", &oom);
    else if (env("XDG_CACHE_HOME"))
        *dir = cache_path(env("XDG_CACHE_HOME"), "huggingface/hub", &oom);
    else
        *dir = cache_path(env("HOME"), ".cache/huggingface/hub", &oom);
    return oom ? -1 : 0;
}

static int is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* The one-line hint every "not there" message ends with. */
static const char *download_hint(const char *repo_id, const char *revision, char *buf, size_t cap)
{
    snprintf(buf, cap, "hf download %s%s%s", repo_id, revision ? " --revision " : "", revision ? revision : "");
    return buf;
}

/* The snapshot of repo directory `repo` at `revision`. */
static int snapshot_of(const char *repo_id, const char *repo, const char *revision, char **snapshot)
{
    const char *rev = revision ? revision : HF_REVISION_DEFAULT;
    char hint[HF_REPO_ID_MAX + 300], commit[HF_COMMIT_HEX + 1];
    struct strbuf ref = {0}, snap = {0};
    strbuf_printf(&ref, "%s/refs/%s", repo, rev);
    char *text = NULL;
    size_t len = 0;
    int code = NF4_OK;
    if (ref.oom) {
        code = nf4_fail(NF4_ESOFTWARE, repo_id, NULL, "out of memory");
    } else if (is_file(ref.p)) {
        code = read_small_file(ref.p, HF_REF_FILE_MAX, &text, &len);
        if (code == NF4_OK)
            code = hf_ref_parse(ref.p, text, len, commit);
        if (code == NF4_OK)
            strbuf_printf(&snap, "%s/snapshots/%s", repo, commit);
    } else {
        strbuf_printf(&snap, "%s/snapshots/%s", repo, rev); /* a commit hash itself */
    }
    if (code == NF4_OK && snap.oom)
        code = nf4_fail(NF4_ESOFTWARE, repo_id, NULL, "out of memory");
    if (code == NF4_OK && !is_dir(snap.p))
        code = nf4_fail(NF4_ENOINPUT, repo_id, NULL, "revision %s is not in the Hugging Face cache at %s; download it "
                        "with: %s", rev, repo, download_hint(repo_id, revision, hint, sizeof hint));
    free(text);
    free(ref.p);
    if (code != NF4_OK) {
        free(snap.p);
        return code;
    }
    *snapshot = snap.p;
    return NF4_OK;
}

/* `hf download` links each file of a snapshot to its blob once the blob is
 * complete, so a link to nothing there is a download that did not finish (or
 * a blob deleted since). A weight or JSON file missing that way would fail
 * later as an unreadable input; this says what happened and what to run. The
 * snapshot and its sub-directories (a pipeline's components), a few deep. */
#define HF_SNAPSHOT_MAX_DEPTH 4
static int check_snapshot_links(const char *repo_id, const char *revision, const char *dir, int depth)
{
    char **names;
    size_t n;
    if (dir_names(dir, &names, &n) != 0)
        return NF4_OK; /* reading the model says what is wrong */
    int code = NF4_OK;
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        char *path = path_join(dir, names[i]);
        struct stat lst, st;
        if (!path) {
            code = nf4_fail(NF4_ESOFTWARE, repo_id, NULL, "out of memory");
        } else if (lstat(path, &lst) != 0 || names[i][0] == '.') {
            /* gone since it was listed, or hidden: not the model's */
        } else if (S_ISLNK(lst.st_mode) && stat(path, &st) != 0 && errno == ENOENT &&
                   (str_ends_with(names[i], ".safetensors") || str_ends_with(names[i], ".json"))) {
            char hint[HF_REPO_ID_MAX + 300];
            code = nf4_fail(NF4_ENOINPUT, path, NULL, "links to a blob that is not in the cache: the download did not "
                            "finish; run it again: %s", download_hint(repo_id, revision, hint, sizeof hint));
        } else if (S_ISDIR(lst.st_mode) && depth < HF_SNAPSHOT_MAX_DEPTH) {
            code = check_snapshot_links(repo_id, revision, path, depth + 1);
        }
        free(path);
    }
    dir_names_free(names, n);
    return code;
}

int hf_cache_resolve(const char *repo_id, const char *revision, char **snapshot)
{
    *snapshot = NULL;
    char hint[HF_REPO_ID_MAX + 300];
    if (!hf_repo_id_is_valid(repo_id))
        return nf4_fail(NF4_ENOINPUT, repo_id, NULL, "neither a file nor a Hugging Face model id (ORG/NAME)");
    if (revision && !hf_revision_is_valid(revision))
        return nf4_fail(NF4_EUSAGE, repo_id, NULL, "invalid --revision '%s'", revision);
    char *dir = NULL;
    int code = cache_dir(&dir) == 0 ? NF4_OK : nf4_fail(NF4_ESOFTWARE, repo_id, NULL, "out of memory");
    char folder[HF_REPO_ID_MAX + 16] = "models--";
    size_t at = strlen(folder);
    for (const char *p = repo_id; *p; p++) { /* ORG/NAME -> models--ORG--NAME */
        if (*p == '/') {
            folder[at++] = '-';
            folder[at++] = '-';
        } else {
            folder[at++] = *p;
        }
    }
    folder[at] = '\0';
    char *repo = code == NF4_OK && dir ? path_join(dir, folder) : NULL;
    if (code == NF4_OK && dir && !repo)
        code = nf4_fail(NF4_ESOFTWARE, repo_id, NULL, "out of memory");
    if (code == NF4_OK && repo && is_dir(repo)) {
        code = snapshot_of(repo_id, repo, revision, snapshot);
        if (code == NF4_OK && (code = check_snapshot_links(repo_id, revision, *snapshot, 0)) != NF4_OK) {
            free(*snapshot);
            *snapshot = NULL;
        }
    } else if (code == NF4_OK) {
        code = nf4_fail(NF4_ENOINPUT, repo_id, NULL, "not a file, and not in the Hugging Face cache (looked in %s); "
                        "download it with: %s", dir ? dir : "no cache: HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and "
                        "HOME are unset", download_hint(repo_id, revision, hint, sizeof hint));
    }
    free(repo);
    free(dir);
    return code;
}
