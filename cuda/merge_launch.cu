// Launching the fused LoRA merge kernel (cuda/merge_kernel.cuh, included first):
// one launch per device chunk, dispatched on whether the base is 4-bit and
// double-quantized; and, for DoRA, the row kernel after it (cuda/dora_kernel.cuh).
#include "dora_kernel.cuh"
#include "merge_kernel.cuh"
#include "merge_launch.cuh"

int nf4_launch_merge(const dev_merge *m, cudaStream_t stream)
{
    if (m->n == 0)
        return NF4_OK;
    if (m->cols == 0 || m->nfactors < 0 || m->nfactors > LORA_MAX_ADAPTERS)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad merge job");
    const uint64_t rows = (m->e0 + m->n - 1) / m->cols - m->e0 / m->cols + 1;
    const uint64_t col_tiles = CEIL_DIV(m->cols, (uint64_t)MERGE_THREADS);
    const uint64_t tiles = col_tiles * CEIL_DIV(rows, (uint64_t)MERGE_ROWS_PER_CTA);
    if (tiles > 0x7fffffffull || col_tiles > 0xffffffffull)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "merge chunk too large for one launch");
    const uint32_t ct = (uint32_t)col_tiles;
    if (!m->w) {
        const uint32_t bs = log2u(m->dq.blocksize), nbs = log2u(m->dq.nested_blocksize);
        if (m->dq.absmax_code)
            merge_kernel<true, true><<<(unsigned)tiles, MERGE_THREADS, 0, stream>>>(*m, ct, bs, nbs);
        else
            merge_kernel<true, false><<<(unsigned)tiles, MERGE_THREADS, 0, stream>>>(*m, ct, bs, nbs);
    } else {
        merge_kernel<false, false><<<(unsigned)tiles, MERGE_THREADS, 0, stream>>>(*m, ct, 0, 0);
    }
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}

int nf4_launch_dora_rows(const float *merged, void *out, enum st_dtype out_dtype, const float *magnitude, uint64_t cols,
                         uint64_t nrows, unsigned long long *overflowed, cudaStream_t stream)
{
    if (nrows == 0)
        return NF4_OK;
    const uint64_t ctas = CEIL_DIV(nrows, (uint64_t)DORA_WARPS_PER_CTA);
    if (cols == 0 || ctas > 0x7fffffffull)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "bad DoRA job");
    dora_rows_kernel<<<(unsigned)ctas, DORA_WARPS_PER_CTA * 32, 0, stream>>>(merged, out, out_dtype, magnitude, cols,
                                                                             nrows, overflowed);
    cudaCheck(cudaGetLastError());
    return NF4_OK;
}
