/* PyTorch zip checkpoints as st_files. */
#include "torch_file.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "status.h"
#include "torch_pickle.h"
#include "zip_archive.h"

#define PICKLE_ENTRY "data.pkl"
#define STORAGE_DIR "data/"
#define BYTEORDER_ENTRY "byteorder"
/* "little" or "big": anything longer is not a byteorder record. */
#define MAX_BYTEORDER_BYTES 16u

/* The one PREFIX/data.pkl at the archive's top level (torch names PREFIX after
 * the file it saved to; the reader takes whatever it is). */
static int find_pickle(const char *path, const struct zip_archive *z, const struct zip_entry **pkl)
{
    *pkl = NULL;
    for (size_t i = 0; i < z->count; i++) {
        const char *name = z->entries[i].name, *slash = strchr(name, '/');
        if (!slash || slash == name || strcmp(slash + 1, PICKLE_ENTRY) != 0)
            continue;
        if (*pkl)
            return nf4_fail(NF4_EDATA, path, NULL, "archive holds two pickles, %s and %s", (*pkl)->name, name);
        *pkl = &z->entries[i];
    }
    if (!*pkl)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP archive holds no */%s: not a checkpoint torch.save wrote",
                        PICKLE_ENTRY);
    return NF4_OK;
}

/* PREFIX/DIR NAME, where PREFIX is the pickle entry's folder; NULL when out of memory. */
static char *sibling_name(const struct zip_entry *pkl, const char *dir, const char *name)
{
    int prefix = (int)(strchr(pkl->name, '/') - pkl->name) + 1;
    char *s;
    return asprintf(&s, "%.*s%s%s", prefix, pkl->name, dir, name) < 0 ? NULL : s;
}

/* torch records the byte order since 2.1; before, it was the machine's, and
 * every machine torch ran on was little-endian. */
static int check_byteorder(const char *path, int fd, const struct zip_archive *z, const struct zip_entry *pkl)
{
    char *name = sibling_name(pkl, "", BYTEORDER_ENTRY);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    const struct zip_entry *e = zip_find(z, name);
    free(name);
    if (!e)
        return NF4_OK;
    if (e->size > MAX_BYTEORDER_BYTES)
        return nf4_fail(NF4_EDATA, path, e->name, "is %" PRIu64 " bytes, not a byte order", e->size);
    unsigned char *text;
    int code = zip_entry_read(path, fd, e, &text);
    if (code == NF4_OK && !(e->size == 6 && memcmp(text, "little", 6) == 0))
        code = nf4_fail(NF4_EDATA, path, e->name, "says the tensors are not little-endian; nf4deq reads "
                        "little-endian ones");
    free(text);
    return code;
}

/* One record's tensor: its bytes in place, inside its storage's entry. */
static int place_tensor(const char *path, const struct zip_archive *z, const struct zip_entry *pkl,
                        struct torch_tensor_record *r, struct st_tensor *t)
{
    char *name = sibling_name(pkl, STORAGE_DIR, r->storage);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, path, r->name, "out of memory");
    const struct zip_entry *e = zip_find(z, name);
    uint64_t elsize = dtype_bits(r->dtype) / 8, storage_bytes, skip, bytes;
    int code = NF4_OK;
    if (!e)
        code = nf4_fail(NF4_EDATA, path, r->name, "its storage %s is not in the archive", name);
    /* torch writes a storage's bytes whole and counts the elements they hold,
     * nbytes / element size: a few bytes may be left over, never missing. */
    else if (!checked_mul_u64(r->storage_elems, elsize, &storage_bytes) || storage_bytes > e->size)
        code = nf4_fail(NF4_EDATA, path, r->name, "its storage %s is %" PRIu64 " bytes, too few for %" PRIu64
                        " elements of %s", name, e->size, r->storage_elems, dtype_name(r->dtype));
    free(name);
    if (code != NF4_OK)
        return code;
    /* Inside the storage (torch_pickle_read checked the elements), so no overflow. */
    skip = r->offset * elsize;
    bytes = r->nelem * elsize;
    t->name = r->name;
    t->shape = r->shape;
    r->name = NULL;
    r->shape = NULL;
    t->dtype = r->dtype;
    t->ndim = r->ndim;
    t->nelem = r->nelem;
    t->begin = e->data_offset + skip;
    t->end = t->begin + bytes;
    return NF4_OK;
}

static int read_tensors(struct st_file *f, const struct zip_archive *z)
{
    const struct zip_entry *pkl;
    int code = find_pickle(f->path, z, &pkl);
    if (code == NF4_OK)
        code = check_byteorder(f->path, f->fd, z, pkl);
    if (code != NF4_OK)
        return code;
    if (pkl->size > TORCH_MAX_PICKLE_BYTES)
        return nf4_fail(NF4_EDATA, f->path, pkl->name, "pickle of %" PRIu64 " bytes is over the %u nf4deq reads",
                        pkl->size, TORCH_MAX_PICKLE_BYTES);
    unsigned char *bytes;
    struct torch_tensor_record *r = NULL;
    size_t n = 0;
    if ((code = zip_entry_read(f->path, f->fd, pkl, &bytes)) == NF4_OK)
        code = torch_pickle_read(f->path, bytes, (size_t)pkl->size, &r, &n);
    free(bytes);
    if (code == NF4_OK) {
        f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
        f->by_name = calloc(n ? n : 1, sizeof *f->by_name);
        if (!f->tensors || !f->by_name)
            code = nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    }
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        code = place_tensor(f->path, z, pkl, &r[i], &f->tensors[i]);
        f->count++; /* so that st_free_header frees what was placed */
    }
    torch_records_free(r, n);
    return code == NF4_OK ? st_index_names(f) : code;
}

int torch_open(const char *path, struct st_file **out)
{
    *out = NULL;
    struct st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    f->fd = -1;
    struct stat st;
    struct zip_archive z = {0};
    unsigned char magic[4] = {0};
    int code = open_regular_file(path, &f->fd, &st);
    if (code == NF4_OK) {
        f->file_size = (uint64_t)st.st_size;
        f->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
        if (f->file_size >= sizeof magic && read_full_at(f->fd, magic, sizeof magic, 0) != 0)
            code = nf4_fail_errno(NF4_EIO, errno, path, NULL, "cannot read");
    }
    if (code == NF4_OK && memcmp(magic, ZIP_LOCAL_HEADER_MAGIC, sizeof magic) != 0)
        code = nf4_fail(NF4_EDATA, path, NULL, "is not a ZIP archive: not a checkpoint of torch 1.6 or later "
                        "(an older one, or one saved with _use_new_zipfile_serialization=False, is a bare "
                        "pickle, which nf4deq does not read)");
    if (code == NF4_OK)
        code = zip_read_directory(path, f->fd, f->file_size, &z);
    if (code == NF4_OK)
        code = read_tensors(f, &z);
    zip_free(&z);
    if (code != NF4_OK) {
        st_close(f);
        return code;
    }
    *out = f;
    return NF4_OK;
}
