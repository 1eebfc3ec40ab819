#include "safetensors_writer.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fileio.h"
#include "mapped_writer.h"
#include "status.h"
#include "strbuf.h"

struct st_writer {
    char *path;
    char *tmp_path;
    int fd;
    size_t n;
    size_t *order;      /* file order -> caller's index */
    uint64_t *sizes;    /* by caller's index */
    uint64_t total;     /* bytes of tensor data */
    uint64_t written;   /* bytes of tensor data written so far */
    int stream;         /* fd is the caller's (standard output): no temp, no rename */
    uint64_t data_start; /* file offset of the tensor data */
    struct mapped_writer *map; /* tensor data goes through a mapping (st_writer_map), or NULL */
    long index;         /* output files begun before this one (NF4DEQ_TEST_STOP) */
};

/* ---- NF4DEQ_TEST_STOP: a fixed point to stop at, for the tests ----
 * "K" stops the process (SIGSTOP) just before the K-th output file of the run
 * (from 0) begins, "K.5" once half of that file's tensor data is written. The
 * tests of docs/RELIABILITY.md then SIGKILL, truncate an input or start a
 * second run at exactly that point, instead of racing a timer. */
static long test_stop_file = -1;
static int test_stop_half;
static long files_begun;
static pthread_once_t test_stop_once = PTHREAD_ONCE_INIT;

static void read_test_stop(void)
{
    const char *v = getenv("NF4DEQ_TEST_STOP");
    char *end;
    if (!v || !*v)
        return;
    long k = strtol(v, &end, 10);
    if (end == v || k < 0 || (*end && strcmp(end, ".5") != 0))
        return;
    test_stop_file = k;
    test_stop_half = *end != '\0';
}

static void test_stop_at(long file, int half)
{
    pthread_once(&test_stop_once, read_test_stop);
    if (file == test_stop_file && half == test_stop_half)
        raise(SIGSTOP);
}

struct order_key {
    const struct st_out_tensor *t;
    size_t index;
};

/* The reference serializer's order: larger dtypes first, then by name. It keeps
 * every tensor aligned to its element size once the header is 8-aligned. */
static int cmp_out_order(const void *a, const void *b)
{
    const struct order_key *x = a, *y = b;
    if (x->t->dtype != y->t->dtype)
        return x->t->dtype > y->t->dtype ? -1 : 1;
    return strcmp(x->t->name, y->t->name);
}

static int cmp_by_name(const void *a, const void *b)
{
    const struct order_key *x = a, *y = b;
    return strcmp(x->t->name, y->t->name);
}

static int build_header(struct strbuf *b, const struct st_out_tensor *tensors, const struct order_key *keys,
                        size_t n, const uint64_t *sizes, const struct st_meta *meta, size_t nmeta)
{
    strbuf_puts(b, "{\"__metadata__\":{");
    int have_format = 0;
    for (size_t i = 0; i < nmeta; i++)
        if (strcmp(meta[i].key, "format") == 0)
            have_format = 1;
    int first = 1;
    if (!have_format) {
        strbuf_puts(b, "\"format\":\"pt\"");
        first = 0;
    }
    for (size_t i = 0; i < nmeta; i++) {
        if (!first)
            strbuf_puts(b, ",");
        first = 0;
        strbuf_json_string(b, meta[i].key);
        strbuf_puts(b, ":");
        strbuf_json_string(b, meta[i].value);
    }
    strbuf_puts(b, "}");
    uint64_t offset = 0;
    for (size_t k = 0; k < n; k++) {
        const struct st_out_tensor *t = &tensors[keys[k].index];
        strbuf_puts(b, ",");
        strbuf_json_string(b, t->name);
        strbuf_puts(b, ":{\"dtype\":");
        strbuf_json_string(b, dtype_name(t->dtype));
        strbuf_puts(b, ",\"shape\":[");
        for (size_t d = 0; d < t->ndim; d++)
            strbuf_printf(b, d ? ",%" PRIu64 : "%" PRIu64, t->shape[d]);
        uint64_t size = sizes[keys[k].index];
        strbuf_printf(b, "],\"data_offsets\":[%" PRIu64 ",", offset);
        strbuf_printf(b, "%" PRIu64 "]}", offset + size);
        offset += size;
    }
    strbuf_puts(b, "}");
    /* Pad with spaces so tensor data starts 8-byte aligned. */
    while (!b->oom && b->len % 8 != 0)
        strbuf_puts(b, " ");
    return b->oom ? NF4_ESOFTWARE : NF4_OK;
}

/* Plans the layout and writes the header: into a temp file beside `path`, or
 * (stream_fd >= 0) straight into stream_fd, which `path` then only names. */
static int begin(struct st_writer **out, const char *path, int stream_fd, const struct st_out_tensor *tensors,
                 size_t n, const struct st_meta *meta, size_t nmeta)
{
    *out = NULL;
    long index = __atomic_fetch_add(&files_begun, 1, __ATOMIC_RELAXED);
    test_stop_at(index, 0);
    struct st_writer *w = calloc(1, sizeof *w);
    struct order_key *keys = calloc(n ? n : 1, sizeof *keys);
    struct strbuf header = {0};
    int code = NF4_OK;
    if (!w || !keys)
        goto oom;
    w->fd = -1;
    w->n = n;
    w->index = index;
    w->path = strdup(path);
    w->order = calloc(n ? n : 1, sizeof *w->order);
    w->sizes = calloc(n ? n : 1, sizeof *w->sizes);
    if (!w->path || !w->order || !w->sizes)
        goto oom;
    for (size_t i = 0; i < n; i++) {
        uint64_t nelem = 1, bits;
        for (size_t d = 0; d < tensors[i].ndim; d++)
            if (!checked_mul_u64(nelem, tensors[i].shape[d], &nelem)) {
                code = nf4_fail(NF4_EDATA, path, tensors[i].name, "output shape overflows");
                goto fail;
            }
        if (!checked_mul_u64(nelem, dtype_bits(tensors[i].dtype), &bits) ||
            !checked_add_u64(w->total, bits / 8, &w->total)) {
            code = nf4_fail(NF4_EDATA, path, tensors[i].name, "output size overflows");
            goto fail;
        }
        w->sizes[i] = bits / 8;
        keys[i] = (struct order_key){&tensors[i], i};
    }
    qsort(keys, n, sizeof *keys, cmp_by_name);
    for (size_t k = 1; k < n; k++)
        if (strcmp(keys[k - 1].t->name, keys[k].t->name) == 0) {
            code = nf4_fail(NF4_EDATA, path, keys[k].t->name, "two output tensors have this name");
            goto fail;
        }
    qsort(keys, n, sizeof *keys, cmp_out_order);
    for (size_t k = 0; k < n; k++)
        w->order[k] = keys[k].index;
    if (build_header(&header, tensors, keys, n, w->sizes, meta, nmeta) != NF4_OK)
        goto oom;
    /* The input's metadata can make a header no reader would open (the
     * reference's writer refuses it too): nothing is written. */
    if (header.len > ST_MAX_HEADER_BYTES) {
        code = nf4_fail(NF4_EDATA, path, NULL, "its header would take %zu bytes, over the %llu-byte limit of "
                        "safetensors (the input's __metadata__ is too large to carry over)", header.len,
                        ST_MAX_HEADER_BYTES);
        goto fail;
    }
    w->stream = stream_fd >= 0;
    w->fd = w->stream ? stream_fd : create_temp_beside(path, &w->tmp_path);
    if (w->fd < 0) {
        code = nf4_fail_errno(errno == ENOMEM ? NF4_ESOFTWARE : NF4_ECANTCREAT, errno, path, NULL,
                              "cannot create a temp file beside it");
        goto fail;
    }
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; i++)
        len_bytes[i] = (unsigned char)((uint64_t)header.len >> (8 * i));
    if (write_full(w->fd, len_bytes, 8) != 0 || write_full(w->fd, header.p, header.len) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "write failed");
        goto fail;
    }
    w->data_start = 8 + (uint64_t)header.len;
    free(header.p);
    free(keys);
    *out = w;
    return NF4_OK;
oom:
    code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
fail:
    free(header.p);
    free(keys);
    if (w)
        st_writer_abort(w);
    return code;
}

int st_writer_begin(struct st_writer **out, const char *path, const struct st_out_tensor *tensors, size_t n,
                    const struct st_meta *meta, size_t nmeta)
{
    return begin(out, path, -1, tensors, n, meta, nmeta);
}

int st_writer_begin_stream(struct st_writer **out, int fd, const char *name, const struct st_out_tensor *tensors,
                           size_t n, const struct st_meta *meta, size_t nmeta)
{
    return begin(out, name, fd, tensors, n, meta, nmeta);
}

size_t st_writer_order(const struct st_writer *w, size_t k)
{
    return w->order[k];
}

uint64_t st_writer_tensor_bytes(const struct st_writer *w, size_t index)
{
    return w->sizes[index];
}

uint64_t st_writer_total_bytes(const struct st_writer *w)
{
    return w->total;
}

int st_writer_map(struct st_writer *w, int threads)
{
    /* Anything that stops the mapping from being set up leaves the plain writes. */
    if (!w->map && !w->stream && w->total > 0 && w->written == 0 && mapped_writer_wanted(w->fd, NULL, threads))
        mapped_writer_open(&w->map, w->fd, w->data_start, w->total);
    return w->map != NULL;
}

int st_writer_write_at(struct st_writer *w, uint64_t at, const void *buf, size_t len)
{
    if (!w->map || at > w->total || len > w->total - at)
        return nf4_fail(NF4_ESOFTWARE, w->path, NULL, "tensor data written outside the data the header declares");
    int err = mapped_writer_write(w->map, at, buf, len);
    if (err)
        return nf4_fail_errno(NF4_EIO, err, w->path, NULL, "write failed");
    return NF4_OK;
}

int st_writer_write(struct st_writer *w, const void *buf, size_t len)
{
    if (len > w->total - w->written)
        return nf4_fail(NF4_ESOFTWARE, w->path, NULL, "more tensor data written than the header declares");
    if (write_full(w->fd, buf, len) != 0)
        return nf4_fail_errno(NF4_EIO, errno, w->path, NULL, "write failed");
    return st_writer_account(w, len);
}

int st_writer_account(struct st_writer *w, size_t len)
{
    if (len > w->total - w->written)
        return nf4_fail(NF4_ESOFTWARE, w->path, NULL, "more tensor data written than the header declares");
    int crossed_half = w->written < w->total / 2 && w->written + len >= w->total / 2;
    w->written += len;
    if (w->map)
        mapped_writer_release(w->map, w->written);
    if (crossed_half)
        test_stop_at(w->index, 1);
    return NF4_OK;
}

int st_writer_finish(struct st_writer *w)
{
    int code = NF4_OK;
    if (w->written != w->total)
        code = nf4_fail(NF4_ESOFTWARE, w->path, NULL, "%" PRIu64 " of %" PRIu64 " data bytes written", w->written,
                        w->total);
    if (w->stream) { /* a pipe cannot be fsync'd; the caller closes its stream */
        st_writer_abort(w);
        return code;
    }
    /* Unmapped first: fsync then covers what went through the mapping too. */
    int err = mapped_writer_close(w->map);
    w->map = NULL;
    if (err && code == NF4_OK)
        code = nf4_fail_errno(NF4_EIO, err, w->path, NULL, "cannot unmap the written data");
    if (code == NF4_OK && fsync(w->fd) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, w->path, NULL, "fsync failed");
    int fd = w->fd;
    w->fd = -1;
    if (close(fd) != 0 && code == NF4_OK)
        code = nf4_fail_errno(NF4_EIO, errno, w->path, NULL, "close failed");
    if (code == NF4_OK && rename(w->tmp_path, w->path) != 0)
        code = nf4_fail_errno(NF4_ECANTCREAT, errno, w->path, NULL, "cannot rename the temp file into place");
    if (code == NF4_OK) {
        temp_unregister(w->tmp_path);
        free(w->tmp_path);
        w->tmp_path = NULL;
        if (fsync_parent_dir(w->path) != 0) {
            code = nf4_fail_errno(NF4_EIO, errno, w->path, NULL, "fsync of its directory failed");
            /* A failed run leaves no output, even one renamed into place. */
            unlink(w->path);
        }
    }
    st_writer_abort(w);
    return code;
}

void st_writer_abort(struct st_writer *w)
{
    if (!w)
        return;
    mapped_writer_close(w->map);
    if (w->fd >= 0 && !w->stream)
        close(w->fd);
    if (w->tmp_path) {
        unlink(w->tmp_path);
        temp_unregister(w->tmp_path);
        free(w->tmp_path);
    }
    free(w->path);
    free(w->order);
    free(w->sizes);
    free(w);
}
