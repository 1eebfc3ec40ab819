// Host cost of one kernel launch, by route: what the eager Python call pays
// under the library (docs/PERFORMANCE.md, issue 11). Launches an empty kernel
// and a kernel with the fused kernel's parameters (a 104-byte job), 200k times
// per route, back to back with no sync, and prints host microseconds per
// launch (median of 5 repeats). Routes:
//   chevrons      kernel<<<grid, block, 0, stream>>>(...), as the library does
//   runtime       cudaLaunchKernel(func, ...) with a prepared argument array
//   driver        cuLaunchKernel on the CUfunction looked up once
//                 (cudaGetFuncBySymbol + cudaGetDriverEntryPointByVersion)
//   library       the public ABI (include/nf4deq.h), as the Python extension calls
//                 it: nf4deq_empty_cuda (its empty column), and
//                 nf4deq_dequantize_cuda_state on a 64-element NF4 job with double
//                 quant and bf16 output (its job column: every check, the
//                 per-architecture table, the fused kernel's launch)
//
//   make perf-tools && build/perf/launch_cost
#include <cuda.h>
#include <cuda_runtime.h>

#include "nf4deq.h"

#include <algorithm>
#include <chrono>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#define LAUNCHES 200000
#define REPEATS 5

#define cudaCheck(call)                                                                             \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "launch_cost: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

struct job104 { // the size of the fused kernel's dev_job
    const void *p[6];
    float f;
    unsigned long long n;
    unsigned u[6];
    void *out;
};

__global__ void empty_kernel() {}
__global__ void job_kernel(const job104 j, unsigned a, unsigned b)
{
    if (j.n == 0xffffffffffffull && a == b) // never: keeps the parameters live
        *(int *)j.out = 1;
}

typedef CUresult (*cu_launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 CUstream, void **, void **);

template <typename F> static double per_launch_us(F launch)
{
    std::vector<double> t;
    for (int r = 0; r < REPEATS + 1; r++) {
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < LAUNCHES; i++)
            launch();
        cudaCheck(cudaDeviceSynchronize());
        auto t1 = std::chrono::steady_clock::now();
        if (r) // the first repeat warms up
            t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / LAUNCHES);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main()
{
    cudaStream_t s;
    cudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *cu = NULL;
    cudaDriverEntryPointQueryResult q;
    cudaCheck(cudaGetDriverEntryPointByVersion("cuLaunchKernel", &cu, 12000, cudaEnableDefault, &q));
    if (!cu || q != cudaDriverEntryPointSuccess) {
        fprintf(stderr, "launch_cost: no cuLaunchKernel entry point\n");
        return 1;
    }
    cu_launch_fn cu_launch = (cu_launch_fn)cu;
    cudaFunction_t f_empty, f_job;
    cudaCheck(cudaGetFuncBySymbol(&f_empty, (const void *)empty_kernel));
    cudaCheck(cudaGetFuncBySymbol(&f_job, (const void *)job_kernel));
    int *sink;
    cudaCheck(cudaMalloc(&sink, 4));
    job104 j = {};
    j.out = sink;
    unsigned a = 6, b = 8;
    void *args[] = {&j, &a, &b};
    const dim3 grid(1), block(32); // the host cost does not depend on the grid; the device stays ahead

    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    printf("launch_cost: %s, %d launches per repeat, median of %d, host us per launch\n", p.name, LAUNCHES,
           REPEATS);
    printf("%-10s %12s %12s\n", "route", "empty", "104-B job");
    double e, k;
    e = per_launch_us([&] { empty_kernel<<<1, 32, 0, s>>>(); });
    k = per_launch_us([&] { job_kernel<<<grid, block, 0, s>>>(j, a, b); });
    printf("%-10s %12.3f %12.3f\n", "chevrons", e, k);
    e = per_launch_us([&] { cudaLaunchKernel((const void *)empty_kernel, dim3(1), dim3(32), NULL, 0, s); });
    k = per_launch_us([&] { cudaLaunchKernel((const void *)job_kernel, grid, block, args, 0, s); });
    printf("%-10s %12.3f %12.3f\n", "runtime", e, k);
    e = per_launch_us([&] { cu_launch((CUfunction)f_empty, 1, 1, 1, 32, 1, 1, 0, (CUstream)s, NULL, NULL); });
    k = per_launch_us([&] { cu_launch((CUfunction)f_job, 1, 1, 1, 32, 1, 1, 0, (CUstream)s, args, NULL); });
    printf("%-10s %12.3f %12.3f\n", "driver", e, k);

    // The library: a 64-element job (one block of 64, one nested block), every
    // buffer on the device; the output is checked once, so a failing call shows.
    uint8_t *packed, *codes;
    float *nested, *code2;
    uint16_t *out;
    cudaCheck(cudaMalloc(&packed, 32));
    cudaCheck(cudaMalloc(&codes, 1));
    cudaCheck(cudaMalloc(&nested, sizeof(float)));
    cudaCheck(cudaMalloc(&code2, 256 * sizeof(float)));
    cudaCheck(cudaMalloc(&out, 64 * sizeof(uint16_t)));
    cudaCheck(cudaMemset(packed, 0xff, 32)); // code 15 everywhere: NF4 value 1.0
    cudaCheck(cudaMemset(codes, 0, 1));
    const float one = 1.0f;
    cudaCheck(cudaMemcpy(nested, &one, sizeof one, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(code2, &one, sizeof one, cudaMemcpyHostToDevice));
    nf4deq_state st = {};
    st.absmax = codes;
    st.nested_absmax = nested;
    st.nested_code = code2;
    st.n = 64;
    st.blocksize = 64;
    st.nested_blocksize = 256;
    st.quant_type = NF4DEQ_NF4;
    st.out_dtype = NF4DEQ_BFLOAT16;
    if (nf4deq_empty_cuda(s) != NF4DEQ_OK || nf4deq_dequantize_cuda_state(&st, packed, out, s) != NF4DEQ_OK) {
        fprintf(stderr, "launch_cost: the library failed: %s\n", nf4deq_last_error());
        return 1;
    }
    uint16_t host[64];
    cudaCheck(cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64; i++)
        if (host[i] != 0x3f80) { // bf16 1.0: 1.0 * (1.0 * 1.0 + 0)
            fprintf(stderr, "launch_cost: the library's output %d is 0x%04x, not 0x3f80\n", i, host[i]);
            return 1;
        }
    e = per_launch_us([&] { nf4deq_empty_cuda(s); });
    k = per_launch_us([&] { nf4deq_dequantize_cuda_state(&st, packed, out, s); });
    printf("%-10s %12.3f %12.3f\n", "library", e, k);
    cudaCheck(cudaGetLastError());
    cudaFree(packed);
    cudaFree(codes);
    cudaFree(nested);
    cudaFree(code2);
    cudaFree(out);
    cudaFree(sink);
    cudaStreamDestroy(s);
    return 0;
}
