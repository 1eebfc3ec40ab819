/* A PyTorch checkpoint of tensors (torch.save of a state dict, as PEFT before 0.7 wrote
 * adapter_model.bin by default), opened as an st_file: the tensors'
 * bytes are read in place from the archive's stored entries, exactly as a
 * safetensors file's are, so everything after the open reads both alike.
 *
 * The archive (zip_archive.h) holds PREFIX/data.pkl, the pickled dict, whose
 * tensors point at storages PREFIX/data/KEY, and PREFIX/byteorder. The pickle
 * is read by torch_pickle.h, which runs nothing. */
#ifndef NF4DEQ_TORCH_FILE_H
#define NF4DEQ_TORCH_FILE_H

#include "safetensors.h"

/* NF4_OK; NF4_ENOINPUT when path cannot be opened; NF4_EDATA for anything
 * but such an archive of contiguous little-endian tensors (the message names
 * the file and the tensor); NF4_EIO; NF4_ESOFTWARE when out of memory. */
int torch_open(const char *path, struct st_file **out);

#endif
