/* Reading a tensor transposed: an output item whose source, [R, C] (a 4-bit
 * weight or a float tensor), is written as [C, R] (out_item.transposed; the
 * fused experts of expert_layout.h). A chunk is output rows [c0, c0 + k): for
 * each of the R source rows, the k elements from column c0. Those are R
 * strided runs of the source, gathered here into a tile [R, width] that the
 * pipeline dequantizes (or casts) as it would any chunk, then placed
 * transposed into the output.
 *
 * A 4-bit source is gathered a block at a time: each tile row holds the
 * whole blocks that cover its run, so the tile is a dequantization job of its
 * own (dequant.h), with the nested scales resolved into fp32 here exactly as
 * the kernels resolve them, and goes to a core or a GPU lane like any chunk.
 * Where C is a multiple of the blocksize and k too, the runs start on blocks
 * and nothing is padded; otherwise a run starts inside its first block, at
 * offset (r * C + c0) % blocksize, and tile rows are padded to the same number
 * of blocks. The source is read in bands of whole rows, a few reads per chunk
 * (a read per row, thousands per chunk, took 4x as long), into the part of
 * the slot the output takes later. */
#ifndef NF4DEQ_TRANSPOSED_H
#define NF4DEQ_TRANSPOSED_H

#include <stddef.h>
#include <stdint.h>

#include "dequant.h"
#include "pipeline.h"

/* A chunk gathered into a slot. */
struct tchunk {
    void *tile;               /* [rows, width] of tile_dtype */
    enum st_dtype tile_dtype; /* the dequantization's output, or the source's dtype */
    uint64_t rows, cols;      /* the source's shape, R and C */
    uint64_t c0, k;           /* the output rows [c0, c0 + k) */
    uint64_t width;           /* elements per tile row */
    uint32_t blocksize;       /* 4-bit: run r starts at (r * cols + c0) % blocksize in its row; else 1 */
};

/* The source's shape [R, C] of transposed item `it`. */
void transposed_shape(const struct out_item *it, uint64_t *rows, uint64_t *cols);
/* Output rows a chunk's row count is a multiple of (but the last): the
 * blocksize where C is a multiple of it (no padding), else 1. */
uint64_t transposed_row_align(const struct out_item *it);
/* Slot bytes the gathering of k output rows takes before the region it reads
 * through (transposed_fill's `band`), and the least that region must be. */
uint64_t transposed_tile_bytes(const struct out_item *it, uint64_t k, enum st_dtype tile_dtype);
uint64_t transposed_band_min(const struct out_item *it, uint64_t k);

/* Gathers output rows [c0, c0 + k) of `it` into the arena's first
 * transposed_tile_bytes (*used): for a 4-bit source the tile's packed input
 * and fp32 scales, with *job the dequantization that makes the tile (in
 * tile_dtype); for a float source the tile itself (*job untouched; tile_dtype
 * must be the source's). A 4-bit source is taken from `cache` where it holds
 * it (source_cache.h; cache may be NULL); otherwise the rest of the arena's
 * arena_len bytes, at least transposed_band_min, is read through and free
 * again on return.
 * `nested_code` holds NESTED_CODE_ENTRIES floats. */
struct source_cache;
int transposed_fill(struct tchunk *tc, unsigned char *arena, size_t arena_len, const struct out_item *it, uint64_t c0,
                    uint64_t k, enum st_dtype tile_dtype, struct dequant_job *job, float *nested_code,
                    struct source_cache *cache, size_t *used);

/* Places the tile, transposed, as k rows of R elements of its own dtype at out. */
void transposed_place(const struct tchunk *tc, void *out);
/* Dequantizes a 4-bit tile on this core (`job`, from transposed_fill) and
 * places it, a band of rows at a time: each band is placed while it is in
 * cache, where the whole tile, written and then read back, went through
 * memory twice. */
void transposed_dequant_place(const struct tchunk *tc, const struct dequant_job *job, void *out, enum cpu_path path);

#endif
