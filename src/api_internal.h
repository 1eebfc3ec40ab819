/* Shared by the two halves of the public ABI (src/api.c, cuda/api.cu). */
#ifndef NF4DEQ_API_INTERNAL_H
#define NF4DEQ_API_INTERNAL_H

#include <stdint.h>

#include "dequant.h"

/* Checks the arguments common to both entry points and fills `job` (pointers
 * as given). Returns NF4DEQ_OK or NF4DEQ_EINVAL with the reason recorded. */
int api_make_job(struct dequant_job *job, const void *packed, const void *absmax, const float *nested_absmax,
                 const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                 uint32_t nested_blocksize, int quant_type, int out_dtype, void *out);
/* api_make_job, plus what the CUDA entry point needs of its arguments before it
 * looks for a device: packed and out 16-byte aligned (n > 0). */
int api_make_cuda_job(struct dequant_job *job, const void *packed, const void *absmax, const float *nested_absmax,
                      const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                      uint32_t nested_blocksize, int quant_type, int out_dtype, void *out);
/* Maps an internal NF4_* code (status.h) to an NF4DEQ_* status. */
int api_status_from_internal(int code);

#endif
