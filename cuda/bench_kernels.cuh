// The yardsticks `nf4deq bench` times beside the fused kernel: a spin that holds
// the stream while launches queue, an empty kernel (launch cost), the fused
// kernel's memory traffic without its arithmetic, a pure read, and the offset add
// of bitsandbytes' sequence. Included by cuda/bench.cu only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.cuh"

// Holds the stream for `ns` so the launches queued behind it run back to back
// and the events time the GPU, not the host's launch rate.
__global__ void spin_kernel(uint64_t ns)
{
#if NF4DEQ_ASM
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
#else
    long long t0 = clock64();
    while ((uint64_t)(clock64() - t0) < 2 * ns) // cycles at <= 2 GHz: at least ns
        ;
#endif
}

__global__ void empty_kernel() {}

// The fused kernel's memory traffic without its arithmetic: K 4-byte packed loads
// per lane, then K 16-byte stores, warp-contiguous as in the real kernel (16-bit out).
template <int K, bool CS, bool PF>
__global__ void traffic_kernel(const uint8_t *packed, uint4 *out, uint64_t units)
{
    const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const uint32_t lane = threadIdx.x & 31u;
    uint32_t w[K];
#pragma unroll
    for (int q = 0; q < K; q++) {
        uint64_t u = warp * 32 * K + q * 32 + lane;
        if (u < units) {
#if NF4DEQ_ASM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
            if (PF)
                asm("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];" : "=r"(w[q]) : "l"(packed + 4 * u));
            else
#endif
#if NF4DEQ_ASM
                asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[q]) : "l"(packed + 4 * u));
#else
                w[q] = __ldg(reinterpret_cast<const unsigned int *>(packed + 4 * u));
#endif
        }
    }
#pragma unroll
    for (int q = 0; q < K; q++) {
        uint64_t u = warp * 32 * K + q * 32 + lane;
        if (u >= units)
            continue;
        uint32_t x = w[q];
        if (CS)
            __stcs(out + u, make_uint4(x, x ^ 1u, x ^ 2u, x ^ 3u));
        else
            out[u] = make_uint4(x, x ^ 1u, x ^ 2u, x ^ 3u);
    }
}

// Reads n bytes with 16-byte loads; one word per CTA goes out so nothing is elided.
__global__ void read_kernel(const uint4 *in, uint64_t n16, uint32_t *sink)
{
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int k = 0; k < 4; k++, i += (uint64_t)gridDim.x * blockDim.x)
        if (i < n16) {
            uint4 v = __ldg(in + i);
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u)
        sink[blockIdx.x] = 1;
}

template <int K>
static int launch_traffic(const uint8_t *packed, uint4 *out, uint64_t units, int threads, bool cs, bool pf,
                          cudaStream_t stream)
{
    unsigned blocks = (unsigned)CEIL_DIV(units, (uint64_t)threads * K);
    if (cs && pf)
        traffic_kernel<K, true, true><<<blocks, threads, 0, stream>>>(packed, out, units);
    else if (cs)
        traffic_kernel<K, true, false><<<blocks, threads, 0, stream>>>(packed, out, units);
    else
        traffic_kernel<K, false, true><<<blocks, threads, 0, stream>>>(packed, out, units);
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}

// Stands for torch's `absmax += offset` in bitsandbytes' dequantize_4bit.
__global__ void add_offset_kernel(float *absmax, float offset, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        absmax[i] = __fadd_rn(absmax[i], offset);
}
