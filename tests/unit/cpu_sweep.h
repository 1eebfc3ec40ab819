/* The synthetic sweep every CPU path must pass byte for byte against the
 * scalar reference (dequant_cpu_range): both quant types, every output type,
 * every blocksize, with and without double quant, odd sizes, partial last
 * blocks, several threads, and absmax values that reach every rounding corner
 * (NaN, infinities, zeros, fp32 subnormals that are flushed, products that
 * become fp16 subnormals or overflow). Plain C, no test framework: the host
 * CMocka test and the AArch64 cross test (tests/cross) both run it. */
#ifndef NF4DEQ_CPU_SWEEP_H
#define NF4DEQ_CPU_SWEEP_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.h"
#include "fpconv.h"

/* Bytes after the output that no path may touch. */
#define SWEEP_GUARD 64u

static uint64_t sweep_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A scale: mostly ordinary, sometimes one of the corners. */
static float sweep_scale(uint64_t *rng)
{
    static const uint32_t CORNERS[] = {
        0x7fc00000, 0xffc00001, 0x7f800000, 0xff800000, /* NaNs, infinities */
        0x00000000, 0x80000000, 0x00000001, 0x807fffff, /* zeros, fp32 subnormals */
        0x00800000, 0x00c00000, 0x80800001,             /* FLT_MIN and just above: products flush */
        0x7f7fffff, 0x47800000, 0xc77fe000, 0x477ff000, /* overflow in fp16 and bf16 */
        0x33800000, 0x34000000, 0x35a00000, 0xb3c00000, /* products that are fp16 subnormals */
        0x38800000, 0x387fc000, 0x3f800000, 0xbf800000,
    };
    uint64_t r = sweep_rand(rng);
    if (r % 4 == 0)
        return f32_from_bits(CORNERS[(r >> 8) % (sizeof CORNERS / sizeof CORNERS[0])]);
    /* A random float of moderate exponent, either sign. */
    uint32_t bits = (uint32_t)(r >> 16) & 0x807fffffu;
    return f32_from_bits(bits | (uint32_t)(96 + (r >> 40) % 64) << 23);
}

struct sweep_case {
    uint64_t n;
    uint32_t blocksize, nested_blocksize; /* nested_blocksize 0: single quant */
    enum quant_type quant;
    enum st_dtype dtype;
    int threads;
    size_t out_offset; /* bytes past a 64-byte boundary where the output starts */
};

/* Runs one case on `path`; returns the number of differing bytes (0 = pass)
 * and describes the first difference in msg. */
static uint64_t sweep_one(const struct sweep_case *c, enum cpu_path path, uint64_t seed, char *msg, size_t msg_len)
{
    uint64_t rng = seed * 0x9e3779b97f4a7c15u + c->n + 1;
    uint64_t blocks = (c->n + c->blocksize - 1) / c->blocksize;
    unsigned esize = dtype_bits(c->dtype) / 8;
    size_t packed_len = (size_t)(c->n / 2 + (c->n & 1));
    size_t out_len = (size_t)c->n * esize;
    uint8_t *packed = malloc(packed_len + 1);
    uint8_t *codes = malloc(blocks + 1);
    float *absmax = malloc((blocks + 1) * sizeof *absmax);
    uint64_t nested_blocks = c->nested_blocksize ? (blocks + c->nested_blocksize - 1) / c->nested_blocksize : 0;
    float *nested = malloc((nested_blocks + 1) * sizeof *nested);
    float code_table[NESTED_CODE_ENTRIES];
    /* Aligned as callers' tensors usually are: outputs of DEQUANT_STREAM_BYTES
     * and more take the streaming stores then (unless out_offset says not). */
    uint8_t *want = malloc(out_len + SWEEP_GUARD), *got_base = NULL, *got = NULL;
    if (posix_memalign((void **)&got_base, 64, out_len + c->out_offset + SWEEP_GUARD) == 0)
        got = got_base + c->out_offset;
    uint64_t bad = 0;
    if (!packed || !codes || !absmax || !nested || !want || !got) {
        snprintf(msg, msg_len, "out of memory");
        bad = 1;
        goto out;
    }
    for (size_t i = 0; i < packed_len; i++)
        packed[i] = (uint8_t)sweep_rand(&rng);
    for (uint64_t b = 0; b < blocks; b++) {
        codes[b] = (uint8_t)sweep_rand(&rng);
        absmax[b] = sweep_scale(&rng);
    }
    for (unsigned i = 0; i < NESTED_CODE_ENTRIES; i++)
        code_table[i] = i % 3 ? (float)((int)i - 128) / 127.0f : sweep_scale(&rng);
    for (uint64_t i = 0; i < nested_blocks; i++)
        nested[i] = sweep_scale(&rng);
    struct dequant_job job = {
        .packed = packed,
        .n = c->n,
        .blocksize = c->blocksize,
        .nested_blocksize = c->nested_blocksize ? c->nested_blocksize : 1,
        .quant_type = c->quant,
        .out_dtype = c->dtype,
    };
    if (c->nested_blocksize) {
        job.absmax_code = codes;
        job.nested_absmax = nested;
        job.nested_code = code_table;
        job.nested_offset = (seed & 1) ? 0.03125f : -1.5e-39f; /* a subnormal offset is added as IEEE does */
    } else {
        job.absmax = absmax;
    }
    memset(want, 0xa5, out_len + SWEEP_GUARD);
    memset(got, 0x5a, out_len + SWEEP_GUARD); /* a different poison: an unwritten byte differs */
    job.out = want;
    dequant_cpu_range(&job, 0, c->n);
    job.out = got;
    dequant_cpu_path(&job, c->threads, path);
    for (size_t i = 0; i < out_len; i++) {
        if (want[i] == got[i])
            continue;
        if (!bad++) {
            uint64_t e = i / esize, b = e / c->blocksize;
            float a = c->nested_blocksize ? mul_ftz(code_table[codes[b]], nested[b / c->nested_blocksize]) +
                                                job.nested_offset
                                          : absmax[b];
            snprintf(msg, msg_len,
                     "%s: n=%llu blocksize=%u nested=%u %s %s threads=%d: element %llu (block %llu, absmax "
                     "0x%08x) byte %u is 0x%02x, the scalar path gives 0x%02x",
                     cpu_path_name(path), (unsigned long long)c->n, c->blocksize, c->nested_blocksize,
                     c->quant == QUANT_FP4 ? "fp4" : "nf4", dtype_name(c->dtype), c->threads,
                     (unsigned long long)e, (unsigned long long)b, f32_bits(a), (unsigned)(i % esize), got[i],
                     want[i]);
        }
    }
    for (size_t i = out_len; i < out_len + SWEEP_GUARD; i++) {
        if (got[i] != 0x5a && !bad++)
            snprintf(msg, msg_len, "%s: n=%llu blocksize=%u %s: wrote past the output, at byte %zu",
                     cpu_path_name(path), (unsigned long long)c->n, c->blocksize, dtype_name(c->dtype), i);
    }
out:
    free(packed);
    free(codes);
    free(absmax);
    free(nested);
    free(want);
    free(got_base);
    return bad;
}

/* Every case on `path`. Returns the number of failing cases, printing each
 * failure's first difference to `log`; *cases counts the cases run. */
static int sweep_path(enum cpu_path path, FILE *log, int *cases)
{
    static const uint32_t BLOCKSIZES[] = {32, 64, 128, 256, 1024, 4096};
    static const uint32_t NESTED[] = {0, 256, 1, 2};
    static const enum st_dtype DTYPES[] = {DT_F16, DT_BF16, DT_F32};
    int failed = 0;
    *cases = 0;
    for (size_t bi = 0; bi < sizeof BLOCKSIZES / sizeof BLOCKSIZES[0]; bi++) {
        uint32_t bs = BLOCKSIZES[bi];
        /* Block counts around the 2- and 4-block groups, partial last blocks, odd n. */
        const uint64_t sizes[] = {1,          2,          (uint64_t)bs - 1, bs,         (uint64_t)bs + 1,
                                  2ull * bs,  3ull * bs,  5ull * bs + 3,    7ull * bs,  9ull * bs + bs / 2,
                                  33ull * bs, 33ull * bs + 31};
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
            for (size_t ni = 0; ni < sizeof NESTED / sizeof NESTED[0]; ni++)
                for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++)
                    for (int q = 0; q < 2; q++) {
                        struct sweep_case c = {sizes[si], bs, NESTED[ni], q ? QUANT_FP4 : QUANT_NF4, DTYPES[di], 1, 0};
                        char msg[512];
                        ++*cases;
                        if (sweep_one(&c, path, (uint64_t)*cases, msg, sizeof msg)) {
                            fprintf(log, "%s\n", msg);
                            failed++;
                        }
                    }
    }
    /* Large enough that parallel_for splits it: shares start at arbitrary blocks. */
    for (size_t bi = 0; bi < sizeof BLOCKSIZES / sizeof BLOCKSIZES[0]; bi++)
        for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
            struct sweep_case c = {(1u << 20) + 5ull * BLOCKSIZES[bi] + 17, BLOCKSIZES[bi], 256, QUANT_NF4,
                                   DTYPES[di], 3, 0};
            char msg[512];
            ++*cases;
            if (sweep_one(&c, path, (uint64_t)*cases, msg, sizeof msg)) {
                fprintf(log, "%s\n", msg);
                failed++;
            }
        }
    /* Outputs of 32 MiB and more: written with streaming stores when aligned
     * (dequant_cpu.c), with plain ones when not. */
    static const struct sweep_case STREAMED[] = {
        {(1u << 24) + 5 * 64 + 17, 64, 256, QUANT_NF4, DT_BF16, 3, 0},
        {(1u << 24) + 3 * 4096 + 1, 4096, 256, QUANT_FP4, DT_F16, 2, 0},
        {(1u << 23) + 7 * 32 + 9, 32, 0, QUANT_NF4, DT_F32, 3, 0},
        {(1u << 24) + 5 * 64 + 17, 64, 256, QUANT_NF4, DT_BF16, 3, 16},
    };
    for (size_t i = 0; i < sizeof STREAMED / sizeof STREAMED[0]; i++) {
        char msg[512];
        ++*cases;
        if (sweep_one(&STREAMED[i], path, (uint64_t)*cases, msg, sizeof msg)) {
            fprintf(log, "%s\n", msg);
            failed++;
        }
    }
    return failed;
}

#endif
