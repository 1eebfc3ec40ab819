/* libnf4deq: bitsandbytes 4-bit (NF4/FP4) dequantization, bit-identical to
 * bitsandbytes.functional.dequantize_4bit, as a small stable C ABI.
 *
 * One call dequantizes one tensor (or any run of it that starts on a block
 * boundary): the packed nibbles, the absmax (uint8 codes with double quant,
 * float32 scales without), and with double quant the nested absmax, the
 * 256-entry nested code table and the offset. Element 2i is the high nibble
 * of packed[i], 2i+1 the low one.
 *
 * Errors are returned, never raised: every function returns NF4DEQ_OK or an
 * NF4DEQ_E* code, and nf4deq_last_error() describes the last failure on the
 * calling thread. Nothing here exits the process or prints.
 *
 * pkg-config --cflags --libs nf4deq */
#ifndef NF4DEQ_H
#define NF4DEQ_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature or a constant below changes meaning. */
#define NF4DEQ_ABI_VERSION 1

enum nf4deq_quant_type { NF4DEQ_NF4 = 0, NF4DEQ_FP4 = 1 };
enum nf4deq_out_dtype { NF4DEQ_FLOAT16 = 0, NF4DEQ_BFLOAT16 = 1, NF4DEQ_FLOAT32 = 2 };

enum nf4deq_status {
    NF4DEQ_OK = 0,
    NF4DEQ_EINVAL = 1, /* an argument is out of range or a pointer is missing/misaligned */
    NF4DEQ_ECUDA = 2,  /* a CUDA call failed */
    NF4DEQ_ENODEV = 3, /* no usable CUDA device, or a library built without CUDA */
    NF4DEQ_ENOMEM = 4, /* out of host memory */
};

/* Dequantizes on the GPU. Every pointer is DEVICE memory on the current
 * device; `packed` and `out` must be 16-byte aligned. The work is queued on
 * `stream` (a cudaStream_t; NULL for the legacy default stream) and the call
 * returns without waiting for it.
 *   absmax           uint8 codes when nested_absmax is not NULL, else float32 scales
 *   nested_absmax    float32, one per nested block; NULL for single quant
 *   nested_code      float32[256]; with double quant
 *   nested_offset    the offset added to every absmax (double quant)
 *   nested_offset_device  if not NULL, a float32 on the device read instead of
 *                    nested_offset (so a caller holding it on the GPU need not
 *                    copy it back)
 *   n                elements; blocksize a power of two from 32 to 4096;
 *                    nested_blocksize a power of two (bitsandbytes uses 256) */
int nf4deq_dequantize_cuda(const void *packed, const void *absmax, const float *nested_absmax,
                           const float *nested_code, float nested_offset, const float *nested_offset_device,
                           uint64_t n, uint32_t blocksize, uint32_t nested_blocksize, int quant_type,
                           int out_dtype, void *out, void *stream);

/* The quantization-state half of nf4deq_dequantize_cuda's arguments, for a
 * caller that dequantizes the same weights again and again (a training loop):
 * it fills one of these per weight once, and each call then passes four
 * arguments instead of thirteen. The fields mean what the arguments of the
 * same names do. */
struct nf4deq_state {
    const void *absmax;
    const float *nested_absmax;
    const float *nested_code;
    const float *nested_offset_device;
    uint64_t n;
    float nested_offset;
    uint32_t blocksize;
    uint32_t nested_blocksize;
    int32_t quant_type;
    int32_t out_dtype;
};

/* nf4deq_dequantize_cuda with its arguments taken from *state. */
int nf4deq_dequantize_cuda_state(const struct nf4deq_state *state, const void *packed, void *out, void *stream);

/* Launches an empty kernel on `stream` through the same steps as
 * nf4deq_dequantize_cuda (current device, cached capability, launch, error
 * check): the floor of a call into this library, for benchmarks that compare
 * a dequantization's host cost with a bare launch. Returns NF4DEQ_OK, or
 * NF4DEQ_ENODEV / NF4DEQ_ECUDA. */
int nf4deq_empty_cuda(void *stream);

/* The same on the CPU with HOST pointers, using up to `threads` threads (<= 0:
 * every online core). Returns when the output is written. The vector kernel is
 * the best the processor has; the environment variable NF4DEQ_CPU (scalar, sse,
 * avx2, avx512 or neon) forces one, and NF4DEQ_EINVAL comes back when it names
 * no path or one this processor lacks. An output of 32 MiB or more that starts
 * on a 64-byte boundary (as a PyTorch tensor's does) is written with
 * non-temporal stores by the x86 vector paths, 1.4-2x faster from one thread
 * than through the cache (docs/PERFORMANCE.md); any other is written through
 * the cache. */
int nf4deq_dequantize_cpu(const void *packed, const void *absmax, const float *nested_absmax,
                          const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                          uint32_t nested_blocksize, int quant_type, int out_dtype, void *out, int threads);

/* "0.1.0" */
const char *nf4deq_version(void);
/* NF4DEQ_ABI_VERSION of the library actually loaded. */
int nf4deq_abi_version(void);
/* The last failure on this thread, one line; "" after a success. */
const char *nf4deq_last_error(void);
/* A fixed description of a status code. */
const char *nf4deq_strerror(int status);

#ifdef __cplusplus
}
#endif

#endif
