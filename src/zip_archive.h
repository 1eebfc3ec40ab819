/* The central directory of a ZIP archive, for the one kind nf4deq reads: a
 * PyTorch checkpoint (torch.save), whose entries are stored, not compressed,
 * so that each tensor's bytes lie in the file as they are and can be read in
 * place (torch_file.h).
 *
 * The reader assumes a hostile file: every offset and length is checked
 * against the bytes there are, ZIP64 fields are taken only where the 32-bit
 * ones say so, and an entry's data must lie before the directory. */
#ifndef NF4DEQ_ZIP_ARCHIVE_H
#define NF4DEQ_ZIP_ARCHIVE_H

#include <stddef.h>
#include <stdint.h>

/* The bytes every ZIP archive (its first local header) starts with. */
#define ZIP_LOCAL_HEADER_MAGIC "PK\003\004"

/* A real checkpoint's directory is a few hundred bytes per tensor; one that
 * claims more than this is refused before it is read. */
#define ZIP_MAX_DIRECTORY_BYTES (64u << 20)

struct zip_entry {
    char *name;
    uint64_t data_offset; /* where the entry's bytes start in the file */
    uint64_t size;        /* stored: as many bytes in the file as uncompressed */
};

struct zip_archive {
    size_t count;
    struct zip_entry *entries; /* sorted by name, each name once */
};

/* Reads the directory of the file open at fd (`size` bytes; `path` only for
 * messages). NF4_OK, or NF4_EDATA for anything but a well-formed archive of
 * stored, unencrypted entries, NF4_EIO for a failed read, NF4_ESOFTWARE when
 * out of memory; the message names the file and, where there is one, the
 * entry. */
int zip_read_directory(const char *path, int fd, uint64_t size, struct zip_archive *out);
void zip_free(struct zip_archive *z);
const struct zip_entry *zip_find(const struct zip_archive *z, const char *name);
/* Reads a stored entry's bytes whole into *out (malloc'd; NULL on failure):
 * NF4_OK, NF4_ESOFTWARE when out of memory, NF4_EIO naming the entry. */
int zip_entry_read(const char *path, int fd, const struct zip_entry *e, unsigned char **out);

#endif
