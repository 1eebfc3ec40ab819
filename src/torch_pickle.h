/* The state dict in a PyTorch checkpoint's data.pkl (torch.save of a dict of
 * tensors), read without running it.
 *
 * Unpickling calls whatever the pickle names, which is why nf4deq used to
 * refuse these files. This reader is a pickle machine that knows only the
 * opcodes a dict of tensors is written with and four kinds of callable:
 * collections.OrderedDict, torch._utils._rebuild_tensor_v2 and
 * _rebuild_parameter, and the torch.*Storage types. It calls none of them: it
 * records what they were asked to build. Anything else the pickle names is
 * refused, as is every opcode outside that set. No recursion, and the
 * memory it takes is bounded by the pickle's size. */
#ifndef NF4DEQ_TORCH_PICKLE_H
#define NF4DEQ_TORCH_PICKLE_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

/* An adapter's data.pkl holds about 150 bytes per tensor (a 70B model's
 * adapter on every linear layer: 1,120 tensors, 170 KB): 8 MiB is fifty
 * thousand tensors. Larger ones are refused before they are read. */
#define TORCH_MAX_PICKLE_BYTES (8u << 20)
/* Objects the machine makes, at most about 160 bytes each with their item
 * lists: 160 MB. A real pickle makes about ten per tensor. Beside them, the
 * shapes made and copied out (8 bytes a dimension, at most as many
 * dimensions as the pickle has bytes: 2 x 64 MB) and the stack, marks and
 * memo (8 bytes for each 1- or 2-byte opcode, 64 MB each at most) bound what
 * a hostile pickle can take to about 480 MB. */
#define TORCH_MAX_PICKLE_VALUES (1u << 20)
#define TORCH_MAX_DIMS 64u
/* torch names storages "0", "1", ... */
#define TORCH_MAX_STORAGE_KEY 64u

struct torch_tensor_record {
    char *name;
    enum st_dtype dtype;
    size_t ndim;
    uint64_t *shape;
    uint64_t nelem;
    char *storage;          /* its key: the bytes are the archive's entry data/KEY */
    uint64_t storage_elems; /* elements of dtype the storage holds, as the pickle says */
    uint64_t offset;        /* the tensor's first element within the storage */
};

/* Reads `len` bytes of data.pkl into records, one per dict entry, in the
 * pickle's order. Tensors must be contiguous and inside their storage's
 * elements. NF4_OK, NF4_EDATA (the message names `path` and, where it is
 * known, the tensor), or NF4_ESOFTWARE when out of memory. */
int torch_pickle_read(const char *path, const unsigned char *pkl, size_t len, struct torch_tensor_record **out,
                      size_t *count);
void torch_records_free(struct torch_tensor_record *r, size_t count);

#endif
