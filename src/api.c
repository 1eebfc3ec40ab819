#include "nf4deq.h"

#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "api_internal.h"
#include "status.h"

static int is_pow2(uint64_t v)
{
    return v && (v & (v - 1)) == 0;
}

int api_make_job(struct dequant_job *job, const void *packed, const void *absmax, const float *nested_absmax,
                 const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                 uint32_t nested_blocksize, int quant_type, int out_dtype, void *out)
{
    static const enum st_dtype OUT_TYPES[] = {DT_F16, DT_BF16, DT_F32};
    nf4_clear_error();
    if (quant_type != NF4DEQ_NF4 && quant_type != NF4DEQ_FP4)
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "quant_type %d is not NF4DEQ_NF4 or NF4DEQ_FP4", quant_type);
    if (out_dtype < NF4DEQ_FLOAT16 || out_dtype > NF4DEQ_FLOAT32)
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "out_dtype %d is not float16, bfloat16 or float32", out_dtype);
    if (!is_pow2(blocksize) || blocksize < NF4_MIN_BLOCKSIZE || blocksize > NF4_MAX_BLOCKSIZE)
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "blocksize %u is not a power of two from %u to %u", blocksize,
                        NF4_MIN_BLOCKSIZE, NF4_MAX_BLOCKSIZE);
    if (nested_absmax && !is_pow2(nested_blocksize))
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "nested_blocksize %u is not a power of two", nested_blocksize);
    if (n > 0 && (!packed || !absmax || !out || (nested_absmax && !nested_code)))
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "a required pointer is NULL");
    memset(job, 0, sizeof *job);
    job->packed = packed;
    job->n = n;
    job->blocksize = blocksize;
    job->quant_type = (enum quant_type)quant_type;
    job->out_dtype = OUT_TYPES[out_dtype];
    job->out = out;
    if (nested_absmax) {
        job->absmax_code = absmax;
        job->nested_absmax = nested_absmax;
        job->nested_code = nested_code;
        job->nested_offset = nested_offset;
        job->nested_blocksize = nested_blocksize;
    } else {
        job->absmax = absmax;
        job->nested_blocksize = 1;
    }
    return NF4DEQ_OK;
}

int api_make_cuda_job(struct dequant_job *job, const void *packed, const void *absmax, const float *nested_absmax,
                      const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                      uint32_t nested_blocksize, int quant_type, int out_dtype, void *out)
{
    int rc = api_make_job(job, packed, absmax, nested_absmax, nested_code, nested_offset, n, blocksize,
                          nested_blocksize, quant_type, out_dtype, out);
    if (rc == NF4DEQ_OK && n > 0 && (((uintptr_t)packed | (uintptr_t)out) & 15u))
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "packed and out must be 16-byte aligned");
    return rc;
}

/* Host logic only, so a build without CUDA refuses a bad state as the CUDA build
 * does, before it says that there is no device. */
int nf4deq_dequantize_cuda_state(const struct nf4deq_state *s, const void *packed, void *out, void *stream)
{
    if (!s) {
        nf4_clear_error(); /* every entry point reports its own failure, not an earlier one */
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "state is NULL");
    }
    return nf4deq_dequantize_cuda(packed, s->absmax, s->nested_absmax, s->nested_code, s->nested_offset,
                                  s->nested_offset_device, s->n, s->blocksize, s->nested_blocksize, s->quant_type,
                                  s->out_dtype, out, stream);
}

int api_status_from_internal(int code)
{
    switch (code) {
    case NF4_OK: return NF4DEQ_OK;
    case NF4_EUNAVAILABLE: return NF4DEQ_ENODEV;
    case NF4_EUSAGE:
    case NF4_EDATA: return NF4DEQ_EINVAL;
    default: return NF4DEQ_ECUDA;
    }
}

int nf4deq_dequantize_cpu(const void *packed, const void *absmax, const float *nested_absmax,
                          const float *nested_code, float nested_offset, uint64_t n, uint32_t blocksize,
                          uint32_t nested_blocksize, int quant_type, int out_dtype, void *out, int threads)
{
    struct dequant_job job;
    int rc = api_make_job(&job, packed, absmax, nested_absmax, nested_code, nested_offset, n, blocksize,
                          nested_blocksize, quant_type, out_dtype, out);
    if (rc != NF4DEQ_OK)
        return rc;
    if (threads <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cores > 0 ? (int)cores : 1;
    }
    enum cpu_path path;
    if (cpu_path_from_env(&path) != NF4_OK)
        return NF4DEQ_EINVAL; /* a bad NF4DEQ_CPU, named by nf4deq_last_error() */
    dequant_cpu_path(&job, threads, path);
    return NF4DEQ_OK;
}

const char *nf4deq_version(void)
{
    return NF4DEQ_VERSION;
}

int nf4deq_abi_version(void)
{
    return NF4DEQ_ABI_VERSION;
}

const char *nf4deq_last_error(void)
{
    const char *e = nf4_last_error();
    return strcmp(e, "unknown error") == 0 ? "" : e;
}

const char *nf4deq_strerror(int status)
{
    switch (status) {
    case NF4DEQ_OK: return "success";
    case NF4DEQ_EINVAL: return "invalid argument";
    case NF4DEQ_ECUDA: return "CUDA error";
    case NF4DEQ_ENODEV: return "no usable CUDA device";
    case NF4DEQ_ENOMEM: return "out of memory";
    default: return "unknown status";
    }
}
