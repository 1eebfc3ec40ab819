/* Random 4-bit tensors with their quant state, in pinned host memory, and the
 * byte comparisons the GPU test programs share. Header-only (static functions):
 * each test program includes it once. */
#ifndef NF4DEQ_GPU_TENSOR_H
#define NF4DEQ_GPU_TENSOR_H

#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.h"
#include "gpu.h"
#include "status.h"

#define POISON 0xA5
#define GUARD_BYTES 64

#include "check.h"

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}
static float rnd_unit(void) { return (float)(rnd() >> 40) / 16777216.0f; }

static size_t osize(enum st_dtype dt) { return dt == DT_F32 ? 4 : 2; }
static const char *dtn(enum st_dtype dt) { return dt == DT_F16 ? "f16" : dt == DT_BF16 ? "bf16" : "f32"; }

/* A random tensor with its quant state, in host memory from gpu_host_alloc. */
struct tensor {
    struct dequant_job job;
    uint8_t *packed, *codes;
    float *absmax, *nested_absmax, *nested_code;
    void *out_gpu, *out_cpu;
    size_t out_bytes;
};

static void tensor_free(struct gpu_ctx *ctx, struct tensor *t)
{
    gpu_host_free(ctx, t->packed);
    gpu_host_free(ctx, t->codes);
    gpu_host_free(ctx, t->absmax);
    gpu_host_free(ctx, t->nested_absmax);
    gpu_host_free(ctx, t->nested_code);
    gpu_host_free(ctx, t->out_gpu);
    free(t->out_cpu);
    memset(t, 0, sizeof *t);
}

/* special: sprinkle NaN, infinities, zeros, subnormals and huge scales. */
static int tensor_make(struct gpu_ctx *ctx, struct tensor *t, uint64_t n, uint32_t bs, int nested, uint32_t nbs,
                       enum quant_type qt, enum st_dtype dt, int special, int want_cpu_out)
{
    memset(t, 0, sizeof *t);
    uint64_t blocks = (n + bs - 1) / bs, nblocks = (blocks + nbs - 1) / nbs;
    size_t pbytes = (size_t)((n + 1) / 2);
    t->packed = gpu_host_alloc(ctx, pbytes);
    t->out_bytes = (size_t)n * osize(dt);
    t->out_gpu = gpu_host_alloc(ctx, t->out_bytes + GUARD_BYTES);
    if (want_cpu_out)
        t->out_cpu = malloc(t->out_bytes + GUARD_BYTES);
    if (!t->packed || !t->out_gpu || (want_cpu_out && !t->out_cpu))
        return -1;
    for (size_t i = 0; i < pbytes; i += 8) {
        uint64_t x = rnd();
        memcpy(t->packed + i, &x, pbytes - i < 8 ? pbytes - i : 8);
    }
    static const float SPECIAL[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, -3e-39f, 1e30f, 7e4f, 1e-38f};
    if (nested) {
        t->codes = gpu_host_alloc(ctx, blocks);
        t->nested_absmax = gpu_host_alloc(ctx, nblocks * sizeof(float));
        t->nested_code = gpu_host_alloc(ctx, NESTED_CODE_ENTRIES * sizeof(float));
        if (!t->codes || !t->nested_absmax || !t->nested_code)
            return -1;
        for (uint64_t b = 0; b < blocks; b++)
            t->codes[b] = (uint8_t)(rnd() >> 56);
        for (uint64_t b = 0; b < nblocks; b++)
            t->nested_absmax[b] = 0.001f + rnd_unit() * 0.5f;
        for (unsigned i = 0; i < NESTED_CODE_ENTRIES; i++) {
            double x = (i - 127.5) / 127.5;
            t->nested_code[i] = (float)(x * x * x * 0.8 + x * 0.2);
        }
        if (special) {
            t->nested_code[3] = 1e-39f; /* subnormal code value: flushed by mul.ftz */
            t->nested_code[7] = NAN;
            t->nested_code[9] = INFINITY;
            t->nested_absmax[0] = 1e-38f;
        }
    } else {
        t->absmax = gpu_host_alloc(ctx, blocks * sizeof(float));
        if (!t->absmax)
            return -1;
        for (uint64_t b = 0; b < blocks; b++)
            t->absmax[b] = 0.001f + rnd_unit() * 2.0f;
        if (special)
            for (uint64_t b = 0; b < blocks; b += 3)
                t->absmax[b] = SPECIAL[(b / 3) % (sizeof SPECIAL / sizeof SPECIAL[0])];
    }
    struct dequant_job *j = &t->job;
    j->packed = t->packed;
    j->absmax_code = t->codes;
    j->absmax = t->absmax;
    j->nested_absmax = t->nested_absmax;
    j->nested_code = t->nested_code;
    j->nested_offset = nested ? (special ? -1e-39f : 0.0417f) : 0.0f;
    j->n = n;
    j->blocksize = bs;
    j->nested_blocksize = nbs;
    j->quant_type = qt;
    j->out_dtype = dt;
    return 0;
}

static int guard_ok(const void *out, size_t bytes)
{
    const uint8_t *g = (const uint8_t *)out + bytes;
    for (int i = 0; i < GUARD_BYTES; i++)
        if (g[i] != POISON)
            return 0;
    return 1;
}

static uint64_t first_diff(const void *a, const void *b, size_t bytes, size_t esz)
{
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < bytes; i++)
        if (x[i] != y[i])
            return i / esz;
    return UINT64_MAX;
}

/* Opens device 0 with the default budget, or says why not in the "N passed, N
 * failed" form run-checks.sh reads, and returns NULL. */
static struct gpu_ctx *open_test_device(void)
{
    int count = gpu_device_count();
    printf("CUDA devices: %d\n", count);
    if (count < 1) {
        printf("no CUDA device: check-gpu needs one\n0 passed, 1 failed\n");
        return NULL;
    }
    struct gpu_ctx *ctx = NULL;
    if (gpu_open(&ctx, 0, 0) != NF4_OK) {
        printf("gpu_open: %s\n0 passed, 1 failed\n", nf4_last_error());
        return NULL;
    }
    return ctx;
}

#endif
