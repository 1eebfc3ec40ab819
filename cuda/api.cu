// The GPU half of the public ABI (include/nf4deq.h): device pointers, the
// caller's stream, no allocation, no synchronization.
#include "launch.cuh"

extern "C" {
#include "api_internal.h"
#include "nf4deq.h"
}

// Compute capability per device, looked up once: the per-call cost has to stay
// far below a kernel launch (QLoRA dequantizes every weight on every step).
#define MAX_DEVICES 64
static int cc_major[MAX_DEVICES], cc_minor[MAX_DEVICES];

static int device_cc(int dev, int *major, int *minor)
{
    if (dev < 0 || dev >= MAX_DEVICES)
        return nf4_fail(NF4DEQ_EINVAL, NULL, NULL, "device %d out of range", dev);
    if (!__atomic_load_n(&cc_major[dev], __ATOMIC_ACQUIRE)) {
        int ma = 0, mi = 0;
        if (cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
            return nf4_fail(NF4DEQ_ENODEV, NULL, NULL, "cannot query CUDA device %d", dev);
        cc_minor[dev] = mi;
        __atomic_store_n(&cc_major[dev], ma, __ATOMIC_RELEASE);
    }
    *major = cc_major[dev];
    *minor = cc_minor[dev];
    return NF4DEQ_OK;
}

extern "C" int nf4deq_dequantize_cuda(const void *packed, const void *absmax, const float *nested_absmax,
                                      const float *nested_code, float nested_offset,
                                      const float *nested_offset_device, uint64_t n, uint32_t blocksize,
                                      uint32_t nested_blocksize, int quant_type, int out_dtype, void *out,
                                      void *stream)
{
    struct dequant_job job;
    int rc = api_make_cuda_job(&job, packed, absmax, nested_absmax, nested_code, nested_offset, n, blocksize,
                               nested_blocksize, quant_type, out_dtype, out);
    if (rc != NF4DEQ_OK || n == 0)
        return rc;
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return nf4_fail(NF4DEQ_ENODEV, NULL, NULL, "no usable CUDA device");
    if ((rc = device_cc(dev, &major, &minor)) != NF4DEQ_OK)
        return rc;
    dev_job d;
    memset(&d, 0, sizeof d);
    d.packed = (const uint8_t *)job.packed;
    d.absmax_code = job.absmax_code;
    d.absmax = job.absmax;
    d.nested_absmax = job.nested_absmax;
    d.nested_code = job.nested_code;
    d.nested_offset = job.nested_offset;
    d.nested_offset_ptr = job.absmax_code ? nested_offset_device : NULL;
    d.n = n;
    d.blocksize = job.blocksize;
    d.nested_blocksize = job.nested_blocksize;
    d.quant_type = job.quant_type;
    d.out_dtype = job.out_dtype;
    d.out = out;
    rc = nf4_launch_dequant(&d, nf4_pick_cfg(major, minor, n), 0, (cudaStream_t)stream);
    return api_status_from_internal(rc);
}

// nf4deq_dequantize_cuda_state is host logic only: src/api.c.

// An empty kernel, launched as nf4deq_dequantize_cuda launches the real one.
__global__ void nf4deq_empty_kernel() {}

extern "C" int nf4deq_empty_cuda(void *stream)
{
    nf4_clear_error();
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return nf4_fail(NF4DEQ_ENODEV, NULL, NULL, "no usable CUDA device");
    int rc = device_cc(dev, &major, &minor);
    if (rc != NF4DEQ_OK)
        return rc;
    nf4deq_empty_kernel<<<1, 32, 0, (cudaStream_t)stream>>>();
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return nf4_fail(NF4DEQ_ECUDA, NULL, NULL, "empty kernel launch: %s", cudaGetErrorString(err));
    return NF4DEQ_OK;
}
