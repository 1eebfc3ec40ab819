#include "resume.h"

#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "file_copy.h"
#include "fileio.h"
#include "json_util.h"
#include "lora.h"
#include "lora_diffusers.h"
#include "status.h"
#include "strbuf.h"

/* A decimal string of at most 20 digits without sign or leading zeros. */
static int parse_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsString(v))
        return 0;
    const char *s = v->valuestring;
    size_t n = strlen(s);
    if (n == 0 || n > 20 || (n > 1 && s[0] == '0'))
        return 0;
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        unsigned d = (unsigned)(s[i] - '0');
        if (x > (UINT64_MAX - d) / 10)
            return 0;
        x = x * 10 + d;
    }
    *out = x;
    return 1;
}

static int parse_hex64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 16)
        return 0;
    uint64_t x = 0;
    for (const char *p = v->valuestring; *p; p++) {
        int d = (*p >= '0' && *p <= '9') ? *p - '0' : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10 : -1;
        if (d < 0)
            return 0;
        x = x << 4 | (uint64_t)d;
    }
    *out = x;
    return 1;
}

/* An object with exactly these keys (no duplicates, no others). */
static int has_exactly(const cJSON *o, const char *const *keys, size_t n)
{
    if (!cJSON_IsObject(o) || json_has_duplicate_key(o) != 0 || (size_t)cJSON_GetArraySize(o) != n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!cJSON_GetObjectItemCaseSensitive(o, keys[i]))
            return 0;
    return 1;
}

/* A shard or input name: a plain file name, as in an index. */
static char *take_name(const cJSON *v)
{
    return cJSON_IsString(v) && shard_name_is_safe(v->valuestring) ? strdup(v->valuestring) : NULL;
}

static int parse_inputs(const cJSON *a, struct resume_manifest *m)
{
    static const char *const KEYS[] = {"file", "size", "mtime_ns", "header_fnv1a64"};
    int n = cJSON_GetArraySize(a);
    m->inputs = calloc(n ? (size_t)n : 1, sizeof *m->inputs);
    if (!m->inputs)
        return 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
        struct resume_input *in = &m->inputs[m->ninputs];
        uint64_t mtime;
        if (!has_exactly(e, KEYS, 4) || !(in->file = take_name(cJSON_GetObjectItemCaseSensitive(e, "file"))))
            return 0;
        m->ninputs++;
        if (!parse_u64(cJSON_GetObjectItemCaseSensitive(e, "size"), &in->size) ||
            !parse_u64(cJSON_GetObjectItemCaseSensitive(e, "mtime_ns"), &mtime) || mtime > INT64_MAX ||
            !parse_hex64(cJSON_GetObjectItemCaseSensitive(e, "header_fnv1a64"), &in->header_hash))
            return 0;
        in->mtime_ns = (int64_t)mtime;
    }
    return 1;
}

static int parse_shards(const cJSON *a, struct resume_manifest *m)
{
    static const char *const KEYS[] = {"file", "bytes"};
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
        uint64_t bytes;
        char *name = has_exactly(e, KEYS, 2) ? take_name(cJSON_GetObjectItemCaseSensitive(e, "file")) : NULL;
        int ok = name && parse_u64(cJSON_GetObjectItemCaseSensitive(e, "bytes"), &bytes) &&
                 resume_shard_bytes(m, name) < 0 && resume_add_shard(m, "resume manifest", name, bytes) == NF4_OK;
        free(name);
        if (!ok)
            return 0;
    }
    return 1;
}

int resume_manifest_parse(const char *path, const char *json, size_t len, struct resume_manifest *out)
{
    static const char *const KEYS[] = {"nf4deq_resume", "options", "inputs", "shards"};
    memset(out, 0, sizeof *out);
    if (len > RESUME_MAX_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "a resume manifest of %zu bytes is too large", len);
    cJSON *root = json_parse_whole(json, len);
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(root, "nf4deq_resume");
    const cJSON *options = cJSON_GetObjectItemCaseSensitive(root, "options");
    const cJSON *inputs = cJSON_GetObjectItemCaseSensitive(root, "inputs");
    const cJSON *shards = cJSON_GetObjectItemCaseSensitive(root, "shards");
    int ok = has_exactly(root, KEYS, 4) && cJSON_IsNumber(format) && format->valuedouble == RESUME_FORMAT &&
             cJSON_IsString(options) && cJSON_IsArray(inputs) && cJSON_IsArray(shards) &&
             (out->options = strdup(options->valuestring)) != NULL && parse_inputs(inputs, out) &&
             parse_shards(shards, out);
    cJSON_Delete(root);
    if (!ok) {
        resume_manifest_free(out);
        return nf4_fail(NF4_EDATA, path, NULL, "not a valid resume manifest");
    }
    return NF4_OK;
}

int resume_manifest_render(const struct resume_manifest *m, const char *path, char **out, size_t *out_len)
{
    struct strbuf b = {0};
    strbuf_printf(&b, "{\n  \"nf4deq_resume\": %d,\n  \"options\": ", RESUME_FORMAT);
    strbuf_json_string(&b, m->options);
    strbuf_puts(&b, ",\n  \"inputs\": [");
    for (size_t i = 0; i < m->ninputs; i++) {
        const struct resume_input *in = &m->inputs[i];
        strbuf_puts(&b, i ? ",\n    {\"file\": " : "\n    {\"file\": ");
        strbuf_json_string(&b, in->file);
        strbuf_printf(&b, ", \"size\": \"%" PRIu64 "\", \"mtime_ns\": \"%" PRId64 "\", \"header_fnv1a64\": \"%016" PRIx64
                      "\"}", in->size, in->mtime_ns, in->header_hash);
    }
    strbuf_puts(&b, m->ninputs ? "\n  ],\n  \"shards\": [" : "],\n  \"shards\": [");
    for (size_t i = 0; i < m->nshards; i++) {
        strbuf_puts(&b, i ? ",\n    {\"file\": " : "\n    {\"file\": ");
        strbuf_json_string(&b, m->shards[i].file);
        strbuf_printf(&b, ", \"bytes\": \"%" PRIu64 "\"}", m->shards[i].bytes);
    }
    strbuf_puts(&b, m->nshards ? "\n  ]\n}\n" : "]\n}\n");
    if (b.oom) {
        free(b.p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    *out = b.p;
    *out_len = b.len;
    return NF4_OK;
}

void resume_manifest_free(struct resume_manifest *m)
{
    for (size_t i = 0; m->inputs && i < m->ninputs; i++)
        free(m->inputs[i].file);
    for (size_t i = 0; i < m->nshards; i++)
        free(m->shards[i].file);
    free(m->inputs);
    free(m->shards);
    free(m->options);
    memset(m, 0, sizeof *m);
}

int resume_same_source(const struct resume_manifest *a, const struct resume_manifest *b)
{
    if (!a->options || !b->options || strcmp(a->options, b->options) != 0 || a->ninputs != b->ninputs)
        return 0;
    for (size_t i = 0; i < a->ninputs; i++) {
        const struct resume_input *x = &a->inputs[i], *y = &b->inputs[i];
        if (strcmp(x->file, y->file) != 0 || x->size != y->size || x->mtime_ns != y->mtime_ns ||
            x->header_hash != y->header_hash)
            return 0;
    }
    return 1;
}

int resume_add_shard(struct resume_manifest *m, const char *path, const char *file, uint64_t bytes)
{
    if (m->nshards == m->shards_cap) {
        size_t cap = m->shards_cap ? 2 * m->shards_cap : 16;
        struct resume_shard *p = realloc(m->shards, cap * sizeof *p);
        if (!p)
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        m->shards = p;
        m->shards_cap = cap;
    }
    char *copy = strdup(file);
    if (!copy)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    m->shards[m->nshards++] = (struct resume_shard){copy, bytes};
    return NF4_OK;
}

int64_t resume_shard_bytes(const struct resume_manifest *m, const char *file)
{
    for (size_t i = 0; i < m->nshards; i++)
        if (strcmp(m->shards[i].file, file) == 0)
            return m->shards[i].bytes > INT64_MAX ? -1 : (int64_t)m->shards[i].bytes;
    return -1;
}

/* ---- the source of a run, and a dead run's temp directory ---- */

#define FNV_OFFSET UINT64_C(0xcbf29ce484222325)
#define FNV_PRIME UINT64_C(0x100000001b3)

/* FNV-1a 64 of bytes [0, data_start) of f: the length and the header. */
static int header_hash(const struct st_file *f, uint64_t *out)
{
    static _Thread_local unsigned char buf[1 << 16];
    uint64_t h = FNV_OFFSET;
    for (uint64_t at = 0; at < f->data_start;) {
        size_t n = (size_t)(f->data_start - at < sizeof buf ? f->data_start - at : sizeof buf);
        if (read_full_at(f->fd, buf, n, at) != 0)
            return nf4_fail_errno(NF4_EIO, errno, f->path, NULL, "cannot read the header");
        for (size_t i = 0; i < n; i++)
            h = (h ^ buf[i]) * FNV_PRIME;
        at += n;
    }
    *out = h;
    return NF4_OK;
}

/* "name size mtime" of a file in dir (name NULL: of dir itself, where it is a
 * regular file), for the options string; "-" when it is absent. */
static void describe_file(struct strbuf *b, const char *dir, const char *name)
{
    char *p = name ? path_join(dir, name) : strdup(dir);
    struct stat st;
    if (p && stat(p, &st) == 0 && (name || S_ISREG(st.st_mode)))
        strbuf_printf(b, " %s %lld %lld.%09ld", name ? name : "file", (long long)st.st_size,
                      (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    else
        strbuf_printf(b, " %s -", name ? name : "file");
    free(p);
}

int resume_fingerprint(const struct model *m, const struct convert_opts *o, const char *untied,
                       struct resume_manifest *out)
{
    memset(out, 0, sizeof *out);
    struct strbuf b = {0};
    strbuf_printf(&b, "nf4deq %s; dtype %s", NF4DEQ_VERSION, o->dtype == DT_INVALID ? "each weight's own"
                                                                                   : dtype_torch_name(o->dtype));
    for (size_t i = 0; i < o->nlora; i++) {
        char real[PATH_MAX];
        strbuf_puts(&b, "; lora ");
        strbuf_puts(&b, realpath(o->lora_dirs[i], real) ? real : o->lora_dirs[i]);
        char *diffusers = NULL; /* a diffusers LoRA's file, given or found in the folder */
        if (diffusers_lora_path(o->lora_dirs[i], &diffusers, 0) != NF4_OK)
            nf4_clear_error();
        describe_file(&b, diffusers ? diffusers : o->lora_dirs[i], NULL);
        free(diffusers);
        describe_file(&b, o->lora_dirs[i], ADAPTER_CONFIG_NAME);
        describe_file(&b, o->lora_dirs[i], ADAPTER_WEIGHTS_NAME);
        describe_file(&b, o->lora_dirs[i], ADAPTER_PICKLE_NAME);
    }
    if (untied)
        strbuf_printf(&b, "; lm_head.weight apart from %s", untied);
    /* config.json's model_type decides layouts (gpt-oss's experts fused,
     * GPT-2's Conv1D transposed) that change no shard's size. */
    strbuf_puts(&b, ";");
    describe_file(&b, m->dir, CONFIG_FILE_NAME);
    out->options = b.p;
    out->inputs = calloc(m->nfiles ? m->nfiles : 1, sizeof *out->inputs);
    if (b.oom || !out->inputs) {
        resume_manifest_free(out);
        return nf4_fail(NF4_ESOFTWARE, m->dir, NULL, "out of memory");
    }
    for (size_t i = 0; i < m->nfiles; i++) {
        const struct st_file *f = m->files[i];
        struct resume_input *in = &out->inputs[i];
        if (!(in->file = strdup(m->file_names[i]))) {
            resume_manifest_free(out);
            return nf4_fail(NF4_ESOFTWARE, m->dir, NULL, "out of memory");
        }
        out->ninputs++;
        in->size = f->file_size;
        in->mtime_ns = f->mtime_ns;
        int code = header_hash(f, &in->header_hash);
        if (code != NF4_OK) {
            resume_manifest_free(out);
            return code;
        }
    }
    return NF4_OK;
}

static int is_input_name(const struct resume_manifest *now, const char *name)
{
    for (size_t i = 0; i < now->ninputs; i++)
        if (strcmp(now->inputs[i].file, name) == 0)
            return 1;
    return 0;
}

/* Keeps in `now` each shard of `old` that is in dir with its recorded size.
 * Shards are named as the input files they come from: a manifest naming
 * anything else (it is hostile input) keeps nothing of it. */
static int keep_finished(const char *dir, const struct resume_manifest *old, struct resume_manifest *now)
{
    for (size_t i = 0; i < old->nshards; i++) {
        if (!is_input_name(now, old->shards[i].file))
            continue;
        char *p = path_join(dir, old->shards[i].file);
        struct stat st;
        int ok = p && lstat(p, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size == old->shards[i].bytes;
        free(p);
        if (ok && resume_add_shard(now, dir, old->shards[i].file, old->shards[i].bytes) != NF4_OK)
            return NF4_ESOFTWARE;
    }
    return NF4_OK;
}

/* Empties dir of everything but the manifest and the kept shards (partial
 * shards, their temps, an index or config written before the run died). The
 * kept ones become this run's temps. */
static int prune(const char *dir, const struct resume_manifest *now)
{
    char **names;
    size_t n;
    int code = dir_list(dir, NF4_ECANTCREAT, &names, &n);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        const char *name = names[i];
        char *p = path_join(dir, name);
        if (!p) {
            code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            break;
        }
        if (resume_shard_bytes(now, name) >= 0) { /* kept: a temp of this run now */
            temp_register(p, 0);
            temp_keep_on_stop(p);
        } else if (strcmp(name, RESUME_MANIFEST_NAME) != 0 && remove_path(p) != 0) { /* the manifest is rewritten */
            code = nf4_fail_errno(NF4_ECANTCREAT, errno, p, NULL, "cannot remove");
        }
        free(p);
    }
    dir_names_free(names, n);
    return code;
}

int resume_adopt(const char *dir, struct resume_manifest *now, size_t *kept)
{
    *kept = 0;
    temp_register(dir, 1);
    char *path = path_join(dir, RESUME_MANIFEST_NAME), *json = NULL;
    size_t len = 0;
    struct resume_manifest old = {0};
    int code = path ? read_small_file(path, RESUME_MAX_BYTES, &json, &len)
                    : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    if (code == NF4_OK)
        code = resume_manifest_parse(path, json, len, &old);
    if (code == NF4_OK && resume_same_source(&old, now)) {
        code = keep_finished(dir, &old, now);
    } else if (code == NF4_OK || code == NF4_EDATA) {
        /* A record that does not describe this run's inputs and options is
         * not this run's to use: redo every shard. */
        nf4_note("%s: %s; every shard is redone", dir,
                 code == NF4_OK ? "the inputs or options differ from the run that wrote it" : nf4_last_error());
        nf4_clear_error();
        code = NF4_OK;
    }
    if (code == NF4_OK)
        code = prune(dir, now);
    /* The manifest describes this run from now on: one left from a run with
     * other inputs or options must not outlive it, or a later --resume
     * matching it would keep shards this run rewrote. */
    if (code == NF4_OK)
        code = resume_record_shard(dir, now, NULL);
    *kept = now->nshards;
    resume_manifest_free(&old);
    free(json);
    free(path);
    return code;
}

int resume_record_shard(const char *dir, struct resume_manifest *now, const char *file)
{
    char *text = NULL, *path = path_join(dir, RESUME_MANIFEST_NAME), *shard = file ? path_join(dir, file) : NULL;
    size_t len = 0;
    struct stat st;
    int code = NF4_OK;
    if (!path || (file && !shard))
        code = nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    else if (file && stat(shard, &st) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, shard, NULL, "cannot stat");
    else if (file)
        code = resume_add_shard(now, path, file, (uint64_t)st.st_size);
    if (code == NF4_OK)
        code = resume_manifest_render(now, path, &text, &len);
    if (code == NF4_OK) {
        if (!file) { /* the first write: registered once, not once per shard */
            temp_register(path, 0);
            temp_keep_on_stop(path);
        }
        code = write_file_atomic(path, text, len);
    }
    /* Finished and recorded: a stopping signal leaves it for --resume. */
    if (code == NF4_OK && file)
        temp_keep_on_stop(shard);
    free(text);
    free(path);
    free(shard);
    return code;
}
