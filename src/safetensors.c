#include "safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "json_util.h"
#include "status.h"
#include "strutil.h"
#include "zip_archive.h" /* ZIP_LOCAL_HEADER_MAGIC */

/* JSON numbers are doubles in cJSON: integers above 2^53 cannot be told apart. */
#define MAX_EXACT_JSON_INT (UINT64_C(1) << 53)

/* ---- validation helpers ---- */

/* What scan_header found wrong, if anything. */
enum header_scan_fault { SCAN_OK, SCAN_NUMBER, SCAN_DEPTH };

struct header_scan {
    uint64_t values;   /* JSON values, within one: each '{', '[' and ',' outside strings starts one */
    size_t bad_at;     /* the byte where the fault is */
    size_t key_at;     /* the last string opened directly in the top-level object: */
    size_t key_len;    /* the tensor entry a fault is in (raw JSON text, escapes and all) */
};

/* One pass over the header text before parsing, for what cJSON cannot tell.
 * Every number in a safetensors header is a shape entry or an offset, a
 * non-negative integer, and cJSON would accept 1.0, 1e3 or -0 as the same
 * double, so the literal text is checked. Nesting is held to serde_json's
 * depth, the reference reader's. The count of values bounds what parsing
 * will allocate. */
static enum header_scan_fault scan_header(const char *s, size_t len, struct header_scan *scan)
{
    memset(scan, 0, sizeof *scan);
    scan->values = 1;
    int in_string = 0;
    size_t depth = 0, string_at = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\') {
                i++;
            } else if (c == '"') {
                in_string = 0;
                if (depth == 1) {
                    scan->key_at = string_at;
                    scan->key_len = i - string_at;
                }
            }
            continue;
        }
        if (c == '"') {
            in_string = 1;
            string_at = i + 1;
        } else if (c == '{' || c == '[' || c == ',') {
            ++scan->values;
            if (c != ',' && ++depth > ST_MAX_HEADER_DEPTH) {
                scan->bad_at = i;
                return SCAN_DEPTH;
            }
        } else if (c == '}' || c == ']') {
            depth -= depth > 0;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            int plain;
            size_t end = json_number_end(s, len, i, &plain);
            if (!plain) {
                scan->bad_at = i;
                return SCAN_NUMBER;
            }
            i = end - 1;
        }
    }
    return SCAN_OK;
}

/* A scan fault as one line, naming the tensor entry it is in. */
static int scan_fault(const char *path, const char *json, const struct header_scan *scan,
                      enum header_scan_fault fault)
{
    char name[256]; /* the entry's raw key, escapes as written: cut at a character's start */
    size_t n = scan->key_len < sizeof name - 1 ? scan->key_len : sizeof name - 1;
    while (n < scan->key_len && n > 0 && ((unsigned char)json[scan->key_at + n] & 0xc0) == 0x80)
        n--;
    memcpy(name, json + scan->key_at, n);
    name[n] = '\0';
    const char *tensor = n > 0 ? name : NULL;
    if (fault == SCAN_DEPTH)
        return nf4_fail(NF4_EDATA, path, tensor, "header byte %zu: JSON nested more than %d levels deep",
                        scan->bad_at, ST_MAX_HEADER_DEPTH);
    return nf4_fail(NF4_EDATA, path, tensor, "header byte %zu: numbers must be non-negative integers",
                    scan->bad_at);
}

static int get_u64(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return 0;
    double d = item->valuedouble;
    if (!(d >= 0) || d >= (double)MAX_EXACT_JSON_INT || d != (double)(uint64_t)d)
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* A tensor entry's own keys must each appear once. */
static int count_key(const cJSON *obj, const char *key)
{
    int n = 0;
    for (const cJSON *c = obj->child; c; c = c->next)
        if (c->string && strcmp(c->string, key) == 0)
            n++;
    return n;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    const struct st_tensor *x = *(const struct st_tensor *const *)a;
    const struct st_tensor *y = *(const struct st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    const struct st_tensor *x = *(const struct st_tensor *const *)a;
    const struct st_tensor *y = *(const struct st_tensor *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

int st_index_names(struct st_file *f)
{
    for (size_t i = 0; i < f->count; i++)
        f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->count, sizeof *f->by_name, cmp_tensor_name);
    for (size_t i = 1; i < f->count; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return nf4_fail(NF4_EDATA, f->path, f->by_name[i]->name, "tensor name appears twice in the header");
    return NF4_OK;
}

uint64_t st_tensor_bytes(const struct st_tensor *t)
{
    return t->end - t->begin;
}

void st_free_header(struct st_file *f)
{
    for (size_t i = 0; i < f->count; i++) {
        free(f->tensors[i].name);
        free(f->tensors[i].shape);
        free(f->tensors[i].origin);
    }
    free(f->tensors);
    free(f->by_name);
    for (size_t i = 0; i < f->nmeta; i++) {
        free(f->meta[i].key);
        free(f->meta[i].value);
    }
    free(f->meta);
    f->tensors = NULL;
    f->by_name = NULL;
    f->meta = NULL;
    f->count = f->nmeta = 0;
    f->has_metadata = 0;
}

static int parse_metadata(struct st_file *f, const cJSON *item)
{
    const char *path = f->path;
    if (f->has_metadata)
        return nf4_fail(NF4_EDATA, path, NULL, "header has __metadata__ twice");
    f->has_metadata = 1;
    if (cJSON_IsNull(item)) /* the reference reads null as no metadata */
        return NF4_OK;
    if (!cJSON_IsObject(item))
        return nf4_fail(NF4_EDATA, path, NULL, "__metadata__ is not an object");
    const char *dup;
    int twice = json_first_duplicate_key(item, &dup);
    if (twice < 0)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    if (twice)
        return nf4_fail(NF4_EDATA, path, NULL, "__metadata__ has key \"%s\" twice", dup);
    size_t n = (size_t)cJSON_GetArraySize(item);
    f->meta = calloc(n ? n : 1, sizeof *f->meta);
    if (!f->meta)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (const cJSON *c = item->child; c; c = c->next) {
        if (!cJSON_IsString(c))
            return nf4_fail(NF4_EDATA, path, NULL, "__metadata__ value of \"%s\" is not a string", c->string);
        f->meta[f->nmeta].key = strdup(c->string);
        f->meta[f->nmeta].value = strdup(c->valuestring);
        f->nmeta++;
        if (!f->meta[f->nmeta - 1].key || !f->meta[f->nmeta - 1].value)
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    return NF4_OK;
}

static int parse_tensor(struct st_file *f, const cJSON *item, struct st_tensor *t)
{
    const char *path = f->path;
    const char *name = item->string;
    if (!cJSON_IsObject(item))
        return nf4_fail(NF4_EDATA, path, name, "tensor entry is not an object");
    t->name = strdup(name);
    if (!t->name)
        return nf4_fail(NF4_ESOFTWARE, path, name, "out of memory");
    static const char *const KEYS[] = {"dtype", "shape", "data_offsets"};
    for (size_t k = 0; k < 3; k++) {
        int seen = count_key(item, KEYS[k]);
        if (seen != 1)
            return nf4_fail(NF4_EDATA, path, name, seen ? "\"%s\" appears more than once" : "missing \"%s\"",
                            KEYS[k]);
    }
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsString(dtype))
        return nf4_fail(NF4_EDATA, path, name, "dtype is not a string");
    t->dtype = dtype_from_name(dtype->valuestring);
    if (t->dtype == DT_INVALID)
        return nf4_fail(NF4_EDATA, path, name, "unknown dtype \"%s\"", dtype->valuestring);
    if (!cJSON_IsArray(shape))
        return nf4_fail(NF4_EDATA, path, name, "shape is not an array");
    t->ndim = (size_t)cJSON_GetArraySize(shape);
    t->shape = calloc(t->ndim ? t->ndim : 1, sizeof *t->shape);
    if (!t->shape)
        return nf4_fail(NF4_ESOFTWARE, path, name, "out of memory");
    uint64_t nelem = 1;
    size_t d = 0;
    for (const cJSON *c = shape->child; c; c = c->next, d++) {
        if (!get_u64(c, &t->shape[d]))
            return nf4_fail(NF4_EDATA, path, name, "shape[%zu] is not a non-negative integer", d);
        if (!checked_mul_u64(nelem, t->shape[d], &nelem))
            return nf4_fail(NF4_EDATA, path, name, "shape product overflows");
    }
    t->nelem = nelem;
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2)
        return nf4_fail(NF4_EDATA, path, name, "data_offsets is not a pair");
    if (!get_u64(offsets->child, &t->begin) || !get_u64(offsets->child->next, &t->end))
        return nf4_fail(NF4_EDATA, path, name, "data_offsets are not non-negative integers");
    if (t->end < t->begin)
        return nf4_fail(NF4_EDATA, path, name, "data_offsets end %" PRIu64 " before begin %" PRIu64, t->end,
                        t->begin);
    uint64_t bits;
    if (!checked_mul_u64(nelem, dtype_bits(t->dtype), &bits))
        return nf4_fail(NF4_EDATA, path, name, "byte size overflows");
    if (bits % 8 != 0)
        return nf4_fail(NF4_EDATA, path, name, "%" PRIu64 " elements of %s do not fill whole bytes", nelem,
                        dtype_name(t->dtype));
    if (bits / 8 != t->end - t->begin)
        return nf4_fail(NF4_EDATA, path, name,
                        "data_offsets span %" PRIu64 " bytes but shape and dtype need %" PRIu64,
                        t->end - t->begin, bits / 8);
    return NF4_OK;
}

int st_parse_header(struct st_file *f, const char *json, size_t len, uint64_t data_len)
{
    const char *path = f->path;
    if (!utf8_is_valid((const unsigned char *)json, len))
        return nf4_fail(NF4_EDATA, path, NULL, "header is not valid UTF-8");
    /* JSON white space may come first: writers pad the header at either end. */
    size_t start = 0;
    while (start < len && (json[start] == ' ' || json[start] == '\t' || json[start] == '\n' || json[start] == '\r'))
        start++;
    if (start == len || json[start] != '{')
        return nf4_fail(NF4_EDATA, path, NULL, "header does not start with '{'");
    if (memchr(json, '\0', len))
        return nf4_fail(NF4_EDATA, path, NULL, "header contains a NUL byte");
    /* serde_json, the reference's parser, refuses what cJSON lets through. */
    if (!json_text_is_strict(json, len))
        return nf4_fail(NF4_EDATA, path, NULL,
                        "header is not valid JSON (a raw control character, a malformed \\u escape, or \\u0000)");
    struct header_scan scan;
    enum header_scan_fault fault = scan_header(json, len, &scan);
    if (fault != SCAN_OK)
        return scan_fault(path, json, &scan, fault);
    if (scan.values > ST_MAX_HEADER_VALUES)
        return nf4_fail(NF4_EDATA, path, NULL, "header holds %" PRIu64 " JSON values, more than the %" PRIu64
                        " nf4deq parses (about 80 bytes of memory each)", scan.values,
                        (uint64_t)ST_MAX_HEADER_VALUES);
    const char *end = NULL;
    cJSON *root = json_parse_prefix(json, len, &end);
    if (!root && json_ran_out_of_memory())
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory parsing the header");
    if (!root)
        return nf4_fail(NF4_EDATA, path, NULL, "header is not valid JSON");
    int code = NF4_OK;
    for (const char *p = end; p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            code = nf4_fail(NF4_EDATA, path, NULL, "trailing bytes after the header's JSON");
            goto out;
        }
    if (!cJSON_IsObject(root)) {
        code = nf4_fail(NF4_EDATA, path, NULL, "header is not a JSON object");
        goto out;
    }
    size_t entries = (size_t)cJSON_GetArraySize(root);
    f->tensors = calloc(entries ? entries : 1, sizeof *f->tensors);
    f->by_name = calloc(entries ? entries : 1, sizeof *f->by_name);
    if (!f->tensors || !f->by_name) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        goto out;
    }
    for (const cJSON *c = root->child; c; c = c->next) {
        if (strcmp(c->string, "__metadata__") == 0) {
            code = parse_metadata(f, c);
        } else {
            code = parse_tensor(f, c, &f->tensors[f->count]);
            f->count++; /* counted even on failure so st_free_header frees it */
        }
        if (code != NF4_OK)
            goto out;
    }
    if ((code = st_index_names(f)) != NF4_OK)
        goto out;
    /* Offsets, sorted, must tile the data buffer exactly: no gaps, no overlap. */
    struct st_tensor **by_offset = malloc((f->count ? f->count : 1) * sizeof *by_offset);
    if (!by_offset) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        goto out;
    }
    memcpy(by_offset, f->by_name, f->count * sizeof *by_offset);
    qsort(by_offset, f->count, sizeof *by_offset, cmp_tensor_offset);
    uint64_t expected = 0;
    for (size_t i = 0; i < f->count && code == NF4_OK; i++) {
        if (by_offset[i]->begin != expected)
            code = nf4_fail(NF4_EDATA, path, by_offset[i]->name,
                            "data starts at %" PRIu64 ", expected %" PRIu64 " (offsets must be contiguous from 0)",
                            by_offset[i]->begin, expected);
        expected = by_offset[i]->end;
    }
    free(by_offset);
    if (code == NF4_OK && expected != data_len)
        code = nf4_fail(NF4_EDATA, path, NULL,
                        "tensors cover %" PRIu64 " bytes of data but the file holds %" PRIu64, expected, data_len);
out:
    cJSON_Delete(root);
    return code;
}

/* What a file whose first 8 bytes are no header length is, where it is a
 * checkpoint format people take for safetensors; NULL otherwise. Asked only
 * once the length has failed, since a safetensors header may begin so. */
static const char *other_format(const unsigned char b[8])
{
    if (memcmp(b, ZIP_LOCAL_HEADER_MAGIC, strlen(ZIP_LOCAL_HEADER_MAGIC)) == 0)
        return "a ZIP archive, such as a PyTorch checkpoint (torch.save, pytorch_model.bin)";
    if (b[0] == 0x80 && b[1] >= 2 && b[1] <= 5)
        return "a pickle, such as a PyTorch checkpoint from before torch 1.6";
    if (memcmp(b, "GGUF", 4) == 0)
        return "a GGUF file (llama.cpp)";
    return NULL;
}

static int bad_header_length(const char *path, const unsigned char b[8], const char *why, uint64_t header_len,
                             uint64_t limit)
{
    const char *other = other_format(b);
    if (other)
        return nf4_fail(NF4_EDATA, path, NULL, "is %s, not safetensors: nf4deq converts safetensors checkpoints",
                        other);
    return nf4_fail(NF4_EDATA, path, NULL, why, header_len, limit);
}

int st_open(const char *path, struct st_file **out)
{
    *out = NULL;
    int fd;
    struct stat st;
    int code = open_regular_file(path, &fd, &st);
    return code == NF4_OK ? st_open_fd(fd, path, out) : code;
}

int st_open_fd(int fd, const char *path, struct st_file **out)
{
    *out = NULL;
    struct st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        close(fd);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    f->fd = fd;
    int code = NF4_OK;
    char *header = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "cannot stat");
        goto fail;
    }
    f->file_size = (uint64_t)st.st_size;
    f->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if (f->file_size < 8) {
        code = nf4_fail(NF4_EDATA, path, NULL, "file is %" PRIu64 " bytes, too small for a safetensors header",
                        f->file_size);
        goto fail;
    }
    unsigned char len_bytes[8];
    if (read_full_at(f->fd, len_bytes, 8, 0) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "cannot read the header length");
        goto fail;
    }
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--)
        header_len = (header_len << 8) | len_bytes[i];
    if (header_len > ST_MAX_HEADER_BYTES) {
        code = bad_header_length(path, len_bytes, "header length %" PRIu64 " exceeds the %" PRIu64 "-byte limit",
                                 header_len, ST_MAX_HEADER_BYTES);
        goto fail;
    }
    if (header_len > f->file_size - 8) {
        code = bad_header_length(path, len_bytes, "header length %" PRIu64 " runs past the end of the %" PRIu64
                                 "-byte file", header_len, f->file_size);
        goto fail;
    }
    header = malloc(header_len ? header_len : 1);
    if (!header) {
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory for a %" PRIu64 "-byte header", header_len);
        goto fail;
    }
    if (read_full_at(f->fd, header, header_len, 8) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "cannot read the header");
        goto fail;
    }
    f->data_start = 8 + header_len;
    code = st_parse_header(f, header, header_len, f->file_size - f->data_start);
    if (code != NF4_OK)
        goto fail;
    free(header);
    json_release_heap((size_t)header_len);
    *out = f;
    return NF4_OK;
fail:
    free(header);
    st_close(f);
    return code;
}

static const char *origin_of(const void *owner, const char *tensor)
{
    const struct st_tensor *t = st_find(owner, tensor);
    return t ? t->origin : NULL;
}

int st_set_origin(struct st_file *f, struct st_tensor *t, const char *origin)
{
    if (t->origin || strcmp(origin, t->name) == 0)
        return NF4_OK; /* the first name it was given stays the user's */
    if (!(t->origin = strdup(origin)))
        return nf4_fail(NF4_ESOFTWARE, f->path, origin, "out of memory");
    if (!f->origins_shown)
        nf4_origins_register(f, f->path, origin_of);
    f->origins_shown = 1;
    return NF4_OK;
}

void st_close(struct st_file *f)
{
    if (!f)
        return;
    if (f->origins_shown)
        nf4_origins_unregister(f);
    st_free_header(f);
    if (f->fd >= 0)
        close(f->fd);
    free(f->path);
    free(f);
}

const struct st_tensor *st_find(const struct st_file *f, const char *name)
{
    size_t lo = 0, hi = f->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid]->name, name);
        if (c == 0)
            return f->by_name[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int st_read(const struct st_file *f, const struct st_tensor *t, uint64_t offset, void *buf, uint64_t len)
{
    uint64_t size = st_tensor_bytes(t);
    if (offset > size || len > size - offset)
        return nf4_fail(NF4_ESOFTWARE, f->path, t->name, "read of %" PRIu64 " bytes at %" PRIu64
                        " is outside the tensor", len, offset);
    if (read_full_at(f->fd, buf, (size_t)len, f->data_start + t->begin + offset) != 0) {
        int e = errno;
        int code = st_check_unchanged(f); /* a file cut short reads as an I/O error: say what happened */
        return code != NF4_OK ? code : nf4_fail_errno(NF4_EIO, e, f->path, t->name, "read failed");
    }
    return NF4_OK;
}

int st_check_unchanged(const struct st_file *f)
{
    struct stat st;
    if (fstat(f->fd, &st) != 0)
        return nf4_fail_errno(NF4_EIO, errno, f->path, NULL, "cannot stat");
    int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if ((uint64_t)st.st_size != f->file_size)
        return nf4_fail(NF4_EIO, f->path, NULL, "changed while it was being converted: it %s from %" PRIu64
                        " to %" PRIu64 " bytes", (uint64_t)st.st_size < f->file_size ? "shrank" : "grew",
                        f->file_size, (uint64_t)st.st_size);
    if (mtime != f->mtime_ns)
        return nf4_fail(NF4_EIO, f->path, NULL, "changed while it was being converted: modified again (%" PRIu64
                        " bytes, the same size)", f->file_size);
    return NF4_OK;
}
