/* ZIP central directory reader (APPNOTE.TXT 6.3), for stored entries only. */
#include "zip_archive.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "safetensors.h" /* checked_add_u64 */
#include "status.h"

#define EOCD_SIGNATURE 0x06054b50u
#define EOCD_BYTES 22u
#define EOCD_MAX_COMMENT 0xffffu
#define ZIP64_LOCATOR_SIGNATURE 0x07064b50u
#define ZIP64_LOCATOR_BYTES 20u
#define ZIP64_EOCD_SIGNATURE 0x06064b50u
#define ZIP64_EOCD_BYTES 56u
#define CENTRAL_SIGNATURE 0x02014b50u
#define CENTRAL_BYTES 46u
#define LOCAL_SIGNATURE 0x04034b50u
#define LOCAL_BYTES 30u
#define ZIP64_EXTRA_ID 0x0001u
#define FLAG_ENCRYPTED 0x0001u
#define FLAG_STRONG_ENCRYPTION 0x0040u
#define METHOD_STORED 0u
/* A 16- or 32-bit field with this value says "see the ZIP64 field". */
#define ZIP16_ESCAPE 0xffffu
#define ZIP32_ESCAPE 0xffffffffu

static uint16_t le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const unsigned char *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static int read_at(const char *path, int fd, void *buf, size_t len, uint64_t offset, const char *what)
{
    if (read_full_at(fd, buf, len, offset) != 0)
        return nf4_fail_errno(NF4_EIO, errno, path, NULL, "cannot read the ZIP %s", what);
    return NF4_OK;
}

/* Where the directory is and how many entries it holds. */
struct zip_directory {
    uint64_t offset, bytes, entries;
    uint64_t end; /* where the records after it begin: the directory ends there */
};

static int read_zip64_end(const char *path, int fd, uint64_t eocd_at, struct zip_directory *d)
{
    if (eocd_at < ZIP64_LOCATOR_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory needs ZIP64 fields, and there is no ZIP64 locator");
    unsigned char loc[ZIP64_LOCATOR_BYTES];
    int code = read_at(path, fd, loc, sizeof loc, eocd_at - ZIP64_LOCATOR_BYTES, "ZIP64 locator");
    if (code != NF4_OK)
        return code;
    if (le32(loc) != ZIP64_LOCATOR_SIGNATURE)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory needs ZIP64 fields, and there is no ZIP64 locator");
    uint64_t at = le64(loc + 8);
    if (le32(loc + 4) != 0 || le32(loc + 16) > 1)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP archive spans several disks");
    uint64_t end;
    if (!checked_add_u64(at, ZIP64_EOCD_BYTES, &end) || end > eocd_at - ZIP64_LOCATOR_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP64 end record at %" PRIu64 " is not before its locator", at);
    unsigned char rec[ZIP64_EOCD_BYTES];
    if ((code = read_at(path, fd, rec, sizeof rec, at, "ZIP64 end record")) != NF4_OK)
        return code;
    if (le32(rec) != ZIP64_EOCD_SIGNATURE)
        return nf4_fail(NF4_EDATA, path, NULL, "no ZIP64 end record at %" PRIu64, at);
    if (le32(rec + 16) != 0 || le32(rec + 20) != 0 || le64(rec + 24) != le64(rec + 32))
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP archive spans several disks");
    d->entries = le64(rec + 32);
    d->bytes = le64(rec + 40);
    d->offset = le64(rec + 48);
    d->end = at;
    return NF4_OK;
}

/* The end of central directory record: the last one whose comment ends the file. */
static int read_end(const char *path, int fd, uint64_t size, struct zip_directory *d)
{
    if (size < EOCD_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "file is %" PRIu64 " bytes, too small for a ZIP archive", size);
    size_t tail = (size_t)(size < EOCD_BYTES + EOCD_MAX_COMMENT ? size : EOCD_BYTES + EOCD_MAX_COMMENT);
    unsigned char *buf = malloc(tail);
    if (!buf)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    int code = read_at(path, fd, buf, tail, size - tail, "end record");
    const unsigned char *eocd = NULL;
    for (size_t i = tail - EOCD_BYTES + 1; code == NF4_OK && i-- > 0;)
        if (le32(buf + i) == EOCD_SIGNATURE && i + EOCD_BYTES + le16(buf + i + 20) == tail) {
            eocd = buf + i;
            break;
        }
    if (code == NF4_OK && !eocd)
        code = nf4_fail(NF4_EDATA, path, NULL, "not a ZIP archive (no end of central directory record)");
    if (code == NF4_OK) {
        uint64_t eocd_at = size - tail + (uint64_t)(eocd - buf);
        uint16_t disk = le16(eocd + 4), cd_disk = le16(eocd + 6);
        uint16_t on_disk = le16(eocd + 8), total = le16(eocd + 10);
        uint32_t bytes = le32(eocd + 12), offset = le32(eocd + 16);
        if (total == ZIP16_ESCAPE || bytes == ZIP32_ESCAPE || offset == ZIP32_ESCAPE) {
            code = read_zip64_end(path, fd, eocd_at, d);
        } else if (disk != 0 || cd_disk != 0 || on_disk != total) {
            code = nf4_fail(NF4_EDATA, path, NULL, "ZIP archive spans several disks");
        } else {
            *d = (struct zip_directory){.offset = offset, .bytes = bytes, .entries = total, .end = eocd_at};
        }
    }
    free(buf);
    return code;
}

/* The ZIP64 extended information field overrides, in this order, each of the
 * sizes and the offset whose 32-bit field is the escape. */
static int apply_zip64_extra(const char *path, const char *name, const unsigned char *extra, size_t len,
                             uint64_t *usize, uint64_t *csize, uint64_t *local)
{
    uint64_t *fields[] = {usize, csize, local};
    for (size_t at = 0; at + 4 <= len;) {
        uint16_t id = le16(extra + at), n = le16(extra + at + 2);
        if (n > len - at - 4)
            return nf4_fail(NF4_EDATA, path, name, "ZIP extra field runs past its entry");
        if (id == ZIP64_EXTRA_ID) {
            size_t used = 0;
            for (size_t k = 0; k < 3; k++) {
                if (*fields[k] != ZIP32_ESCAPE)
                    continue;
                if (used + 8 > n)
                    return nf4_fail(NF4_EDATA, path, name, "ZIP64 extra field is too short");
                *fields[k] = le64(extra + at + 4 + used);
                used += 8;
            }
            return NF4_OK;
        }
        at += 4 + (size_t)n;
    }
    return NF4_OK;
}

/* The entry's data follows its local header, whose name must be the directory's. */
static int locate_data(const char *path, int fd, const struct zip_directory *d, struct zip_entry *e, uint64_t local)
{
    size_t name_len = strlen(e->name);
    uint64_t after;
    if (!checked_add_u64(local, LOCAL_BYTES + name_len, &after) || after > d->offset)
        return nf4_fail(NF4_EDATA, path, e->name, "ZIP local header at %" PRIu64 " is not before the directory",
                        local);
    unsigned char head[LOCAL_BYTES];
    char *name = malloc(name_len);
    if (!name)
        return nf4_fail(NF4_ESOFTWARE, path, e->name, "out of memory");
    int code = read_at(path, fd, head, sizeof head, local, "local header");
    if (code == NF4_OK)
        code = read_at(path, fd, name, name_len, local + LOCAL_BYTES, "local header");
    if (code == NF4_OK && (le32(head) != LOCAL_SIGNATURE || le16(head + 26) != name_len ||
                           memcmp(name, e->name, name_len) != 0))
        code = nf4_fail(NF4_EDATA, path, e->name, "no local header for this entry at %" PRIu64, local);
    free(name);
    if (code != NF4_OK)
        return code;
    uint64_t end;
    if (!checked_add_u64(after, le16(head + 28), &e->data_offset) ||
        !checked_add_u64(e->data_offset, e->size, &end) || end > d->offset)
        return nf4_fail(NF4_EDATA, path, e->name, "ZIP entry of %" PRIu64 " bytes runs into the directory",
                        e->size);
    return NF4_OK;
}

/* One central directory record at cd[*at], of `left` bytes. */
static int read_entry(const char *path, int fd, const struct zip_directory *d, const unsigned char *cd,
                      size_t *at, struct zip_entry *e)
{
    size_t left = (size_t)d->bytes - *at;
    const unsigned char *p = cd + *at;
    if (left < CENTRAL_BYTES || le32(p) != CENTRAL_SIGNATURE)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory entry is cut short or has no signature");
    size_t name_len = le16(p + 28), extra_len = le16(p + 30), comment_len = le16(p + 32);
    if (CENTRAL_BYTES + name_len + extra_len + comment_len > left)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory entry runs past the directory");
    const char *raw = (const char *)p + CENTRAL_BYTES;
    if (name_len == 0 || memchr(raw, '\0', name_len))
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP entry with an empty name or a NUL in its name");
    if (!(e->name = strndup(raw, name_len)))
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    *at += CENTRAL_BYTES + name_len + extra_len + comment_len;
    uint16_t flags = le16(p + 8), method = le16(p + 10);
    if (flags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION))
        return nf4_fail(NF4_EDATA, path, e->name, "ZIP entry is encrypted");
    if (method != METHOD_STORED)
        return nf4_fail(NF4_EDATA, path, e->name, "ZIP entry is compressed (method %u); torch.save stores its "
                        "entries, and nf4deq reads only stored ones", method);
    uint64_t csize = le32(p + 20), usize = le32(p + 24), local = le32(p + 42);
    int code = apply_zip64_extra(path, e->name, p + CENTRAL_BYTES + name_len, extra_len, &usize, &csize, &local);
    if (code != NF4_OK)
        return code;
    if (csize != usize)
        return nf4_fail(NF4_EDATA, path, e->name, "stored ZIP entry of %" PRIu64 " bytes claims %" PRIu64
                        " uncompressed", csize, usize);
    e->size = usize;
    return locate_data(path, fd, d, e, local);
}

static int cmp_entry_name(const void *a, const void *b)
{
    return strcmp(((const struct zip_entry *)a)->name, ((const struct zip_entry *)b)->name);
}

int zip_read_directory(const char *path, int fd, uint64_t size, struct zip_archive *out)
{
    memset(out, 0, sizeof *out);
    struct zip_directory d = {0};
    int code = read_end(path, fd, size, &d);
    if (code != NF4_OK)
        return code;
    uint64_t cd_end;
    if (!checked_add_u64(d.offset, d.bytes, &cd_end) || cd_end > d.end)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory of %" PRIu64 " bytes at %" PRIu64
                        " runs past its end record", d.bytes, d.offset);
    if (d.bytes > ZIP_MAX_DIRECTORY_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory of %" PRIu64 " bytes is over the %u nf4deq reads",
                        d.bytes, ZIP_MAX_DIRECTORY_BYTES);
    if (d.entries > d.bytes / CENTRAL_BYTES)
        return nf4_fail(NF4_EDATA, path, NULL, "ZIP directory of %" PRIu64 " bytes cannot hold %" PRIu64
                        " entries", d.bytes, d.entries);
    unsigned char *cd = malloc(d.bytes ? (size_t)d.bytes : 1);
    out->entries = calloc(d.entries ? (size_t)d.entries : 1, sizeof *out->entries);
    if (!cd || !out->entries) {
        free(cd);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    code = read_at(path, fd, cd, (size_t)d.bytes, d.offset, "directory");
    size_t at = 0;
    for (uint64_t i = 0; i < d.entries && code == NF4_OK; i++)
        code = read_entry(path, fd, &d, cd, &at, &out->entries[out->count++]);
    free(cd);
    if (code == NF4_OK && at != d.bytes)
        code = nf4_fail(NF4_EDATA, path, NULL, "ZIP directory holds %" PRIu64 " bytes more than its %" PRIu64
                        " entries", d.bytes - at, d.entries);
    if (code == NF4_OK) {
        qsort(out->entries, out->count, sizeof *out->entries, cmp_entry_name);
        for (size_t i = 1; i < out->count && code == NF4_OK; i++)
            if (strcmp(out->entries[i - 1].name, out->entries[i].name) == 0)
                code = nf4_fail(NF4_EDATA, path, out->entries[i].name, "ZIP entry name appears twice");
    }
    if (code != NF4_OK)
        zip_free(out);
    return code;
}

void zip_free(struct zip_archive *z)
{
    for (size_t i = 0; i < z->count; i++)
        free(z->entries[i].name);
    free(z->entries);
    z->entries = NULL;
    z->count = 0;
}

int zip_entry_read(const char *path, int fd, const struct zip_entry *e, unsigned char **out)
{
    *out = malloc(e->size ? (size_t)e->size : 1);
    if (!*out)
        return nf4_fail(NF4_ESOFTWARE, path, e->name, "out of memory");
    if (read_full_at(fd, *out, (size_t)e->size, e->data_offset) != 0) {
        int code = nf4_fail_errno(NF4_EIO, errno, path, e->name, "cannot read");
        free(*out);
        *out = NULL;
        return code;
    }
    return NF4_OK;
}

const struct zip_entry *zip_find(const struct zip_archive *z, const char *name)
{
    struct zip_entry key = {.name = (char *)name};
    return z->count ? bsearch(&key, z->entries, z->count, sizeof *z->entries, cmp_entry_name) : NULL;
}
