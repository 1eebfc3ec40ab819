#include "transposed.h"

#include <string.h>

#include "fpconv.h"
#include "safetensors.h"
#include "source_cache.h"
#include "status.h"

#define TILE_ALIGN 64u
/* Tile rows and output rows transposed at a time: 64 x 64 elements of 2
 * bytes are 8 KiB of tile and 8 KiB of output, both in L1. */
#define TRANSPOSE_BLOCK 64u

static uint64_t align_up(uint64_t v)
{
    return (v + TILE_ALIGN - 1) / TILE_ALIGN * TILE_ALIGN;
}

static unsigned elem_size(enum st_dtype dt)
{
    return dtype_bits(dt) / 8;
}

void transposed_shape(const struct out_item *it, uint64_t *rows, uint64_t *cols)
{
    const uint64_t *shape = it->w ? it->w->state.shape : it->src->t->shape;
    *rows = shape[0];
    *cols = shape[1];
}

uint64_t transposed_row_align(const struct out_item *it)
{
    uint64_t rows, cols;
    transposed_shape(it, &rows, &cols);
    return it->w && cols % it->w->state.blocksize == 0 ? it->w->state.blocksize : 1;
}

/* Blocks per tile row for runs of k elements: k / blocksize where runs start
 * on blocks, else enough for a run that starts at the last element of one. */
static uint64_t tile_blocks(const struct out_item *it, uint64_t k)
{
    uint64_t bs = it->w->state.blocksize;
    uint64_t start_max = transposed_row_align(it) == bs ? 0 : bs - 1;
    return (k + start_max + bs - 1) / bs;
}

static uint64_t tile_width(const struct out_item *it, uint64_t k)
{
    return it->w ? tile_blocks(it, k) * it->w->state.blocksize : k;
}

uint64_t transposed_tile_bytes(const struct out_item *it, uint64_t k, enum st_dtype tile_dtype)
{
    uint64_t rows, cols;
    transposed_shape(it, &rows, &cols);
    uint64_t tile = align_up(rows * tile_width(it, k) * elem_size(tile_dtype));
    if (!it->w)
        return tile;
    uint64_t blocks = rows * tile_blocks(it, k);
    return align_up(blocks * it->w->state.blocksize / 2) + align_up(blocks * 4) + tile;
}

/* ---- a 4-bit source ---- */

/* The part of the source that rows [r, r + nrows) of a chunk read: whole
 * blocks [first, last], their packed bytes (clipped at the tensor's end), and
 * their scales. */
struct band {
    uint64_t first, last;
    uint64_t packed_at, packed_len;
    uint64_t nested_first, nested_count;
};

static struct band band_of(const struct out_item *it, uint64_t r, uint64_t nrows, uint64_t c0, uint64_t k)
{
    const struct bnb_state *s = &it->w->state;
    uint64_t cols = s->shape[1], bs = s->blocksize, packed_total = s->n / 2 + (s->n & 1);
    struct band b;
    b.first = (r * cols + c0) / bs;
    b.last = ((r + nrows - 1) * cols + c0 + k - 1) / bs;
    b.packed_at = b.first * bs / 2;
    uint64_t end = (b.last + 1) * bs / 2;
    b.packed_len = (end < packed_total ? end : packed_total) - b.packed_at;
    b.nested_first = s->nested ? b.first / s->nested_blocksize : 0;
    b.nested_count = s->nested ? b.last / s->nested_blocksize - b.nested_first + 1 : 0;
    return b;
}

static uint64_t band_bytes(const struct out_item *it, const struct band *b)
{
    uint64_t blocks = b->last - b->first + 1;
    return align_up(b->packed_len) + align_up(blocks * (it->w->state.nested ? 1 : 4)) + align_up(b->nested_count * 4);
}

uint64_t transposed_band_min(const struct out_item *it, uint64_t k)
{
    if (!it->w)
        return 0; /* a float row too large for the band is read straight into the tile */
    const struct bnb_state *s = &it->w->state;
    /* A run's blocks, and one more where it straddles a nested block's edge. */
    uint64_t blocks = tile_blocks(it, k) + 1;
    uint64_t nested = s->nested ? blocks / s->nested_blocksize + 2 : 0;
    return align_up(blocks * s->blocksize / 2) + align_up(blocks * (s->nested ? 1 : 4)) + align_up(nested * 4);
}

/* Rows from r that one band of band_len bytes holds (at least 1). */
static uint64_t band_rows(const struct out_item *it, uint64_t r, uint64_t c0, uint64_t k, size_t band_len)
{
    const struct bnb_state *s = &it->w->state;
    uint64_t rows = s->shape[0], cols = s->shape[1];
    uint64_t per_row = cols / 2 + 1 + (cols / s->blocksize + 1) * (s->nested ? 1 : 4) + 4;
    uint64_t min = transposed_band_min(it, k);
    uint64_t n = band_len > min ? (band_len - min) / per_row + 1 : 1;
    if (n > rows - r)
        n = rows - r;
    while (n > 1) {
        struct band b = band_of(it, r, n, c0, k);
        if (band_bytes(it, &b) <= band_len)
            break;
        n = n / 2 > 1 ? n - n / 8 - 1 : 1;
    }
    return n;
}

static int gather_4bit(struct tchunk *tc, unsigned char *arena, unsigned char *buf, size_t band_len,
                       const struct out_item *it, const float *nested_code, const struct cached_source *whole,
                       struct dequant_job *job)
{
    const struct bnb_weight *w = it->w;
    const struct bnb_state *s = &w->state;
    const uint64_t bs = s->blocksize, kb = tc->width / bs, cols = tc->cols;
    uint8_t *packed = arena;
    float *scales = (float *)(arena + align_up(tc->rows * tc->width / 2));
    for (uint64_t r = 0; r < tc->rows;) {
        /* The tensor held whole is one band of every row. */
        uint64_t nrows = whole ? tc->rows : band_rows(it, r, tc->c0, tc->k, band_len);
        struct band b = band_of(it, r, nrows, tc->c0, tc->k);
        uint64_t blocks = b.last - b.first + 1;
        const unsigned char *band_packed, *band_absmax;
        const float *band_nested;
        if (whole) {
            band_packed = whole->packed + b.packed_at;
            band_absmax = whole->absmax + b.first * (s->nested ? 1 : 4);
            band_nested = whole->nested_absmax ? whole->nested_absmax + b.nested_first : NULL;
        } else {
            unsigned char *absmax_at = buf + align_up(b.packed_len);
            float *nested_at = (float *)(absmax_at + align_up(blocks * (s->nested ? 1 : 4)));
            int code = st_read(w->packed->file, w->packed->t, b.packed_at, buf, b.packed_len);
            if (code == NF4_OK)
                code = st_read(w->absmax->file, w->absmax->t, b.first * (s->nested ? 1 : 4), absmax_at,
                               blocks * (s->nested ? 1 : 4));
            if (code == NF4_OK && s->nested)
                code = st_read(w->nested_absmax->file, w->nested_absmax->t, b.nested_first * 4, nested_at,
                               b.nested_count * 4);
            if (code != NF4_OK)
                return code;
            band_packed = buf;
            band_absmax = absmax_at;
            band_nested = nested_at;
        }
        for (uint64_t row = r; row < r + nrows; row++) {
            uint64_t first = (row * cols + tc->c0) / bs, last = (row * cols + tc->c0 + tc->k - 1) / bs;
            uint8_t *prow = packed + row * kb * bs / 2;
            float *srow = scales + row * kb;
            uint64_t from = (first - b.first) * bs / 2, have = (last - first + 1) * bs / 2;
            if (have > b.packed_len - from) /* the tensor's last block, cut short */
                have = b.packed_len - from;
            memcpy(prow, band_packed + from, (size_t)have);
            memset(prow + have, 0, (size_t)(kb * bs / 2 - have));
            for (uint64_t j = 0; j < kb; j++) {
                uint64_t blk = first + j;
                if (blk > last) {
                    srow[j] = 0.0f; /* padding: its outputs are never placed */
                } else if (s->nested) {
                    /* As the kernels resolve it (dequant.h): two roundings, flushed product. */
                    float scaled = mul_ftz(nested_code[band_absmax[blk - b.first]],
                                           band_nested[blk / s->nested_blocksize - b.nested_first]);
                    srow[j] = scaled + s->nested_offset;
                } else {
                    memcpy(&srow[j], band_absmax + (blk - b.first) * 4, 4);
                }
            }
        }
        r += nrows;
    }
    *job = (struct dequant_job){
        .packed = packed,
        .absmax = scales,
        .n = tc->rows * tc->width,
        .blocksize = s->blocksize,
        .nested_blocksize = 1,
        .quant_type = s->quant_type,
        .out_dtype = tc->tile_dtype,
        .out = tc->tile,
    };
    return NF4_OK;
}

/* ---- a float source ---- */

static int gather_float(struct tchunk *tc, unsigned char *buf, size_t band_len, const struct out_item *it)
{
    const struct model_tensor *src = it->src;
    const unsigned size = elem_size(src->t->dtype);
    const uint64_t cols = tc->cols, run = tc->k * size;
    unsigned char *tile = tc->tile;
    for (uint64_t r = 0; r < tc->rows;) {
        /* Rows [r, r + n) span (n - 1) * cols + k elements. */
        uint64_t fit = band_len / size, n = fit >= tc->k ? (fit - tc->k) / cols + 1 : 0;
        if (n > tc->rows - r)
            n = tc->rows - r;
        int code;
        if (n <= 1) {
            n = 1;
            code = st_read(src->file, src->t, (r * cols + tc->c0) * size, tile + r * run, run);
        } else {
            code = st_read(src->file, src->t, (r * cols + tc->c0) * size, buf, ((n - 1) * cols + tc->k) * size);
            for (uint64_t i = 0; code == NF4_OK && i < n; i++)
                memcpy(tile + (r + i) * run, buf + i * cols * size, (size_t)run);
        }
        if (code != NF4_OK)
            return code;
        r += n;
    }
    return NF4_OK;
}

int transposed_fill(struct tchunk *tc, unsigned char *arena, size_t arena_len, const struct out_item *it, uint64_t c0,
                    uint64_t k, enum st_dtype tile_dtype, struct dequant_job *job, float *nested_code,
                    struct source_cache *cache, size_t *used)
{
    uint64_t rows, cols;
    transposed_shape(it, &rows, &cols);
    *tc = (struct tchunk){.tile_dtype = tile_dtype, .rows = rows, .cols = cols, .c0 = c0, .k = k,
                          .width = tile_width(it, k), .blocksize = it->w ? it->w->state.blocksize : 1};
    uint64_t tile_bytes = align_up(rows * tc->width * elem_size(tile_dtype));
    *used = (size_t)transposed_tile_bytes(it, k, tile_dtype);
    tc->tile = arena + *used - tile_bytes;
    unsigned char *band = arena + *used;
    size_t band_len = arena_len - *used;
    if (!it->w)
        return gather_float(tc, band, band_len, it);
    const struct bnb_weight *w = it->w;
    if (w->state.nested) {
        int code = st_read(w->nested_quant_map->file, w->nested_quant_map->t, 0, nested_code,
                           NESTED_CODE_ENTRIES * sizeof(float));
        if (code != NF4_OK)
            return code;
    }
    const struct cached_source *whole;
    int code = source_cache_get(cache, w, &whole);
    if (code == NF4_OK)
        code = gather_4bit(tc, arena, band, band_len, it, nested_code, whole, job);
    source_cache_put(cache, whole);
    return code;
}

/* ---- placing the tile ---- */

/* Where each of the rows [r0, r0 + n) of the tile begins its run. */
static void run_starts(const struct tchunk *tc, uint64_t r0, uint64_t n, uint64_t *start)
{
    for (uint64_t i = 0; i < n; i++) {
        uint64_t r = r0 + i;
        start[i] = r * tc->width + (r * tc->cols + tc->c0) % tc->blocksize;
    }
}

#define PLACE(type)                                                                                               \
    static void place_##type(const struct tchunk *tc, type *out, uint64_t r0, uint64_t r1, uint64_t c0,           \
                             uint64_t c1, const uint64_t *start)                                                  \
    {                                                                                                             \
        const type *tile = tc->tile;                                                                              \
        for (uint64_t c = c0; c < c1; c++) {                                                                      \
            type *dst = out + c * tc->rows;                                                                       \
            for (uint64_t r = r0; r < r1; r++)                                                                    \
                dst[r] = tile[start[r - r0] + c];                                                                 \
        }                                                                                                         \
    }
PLACE(uint16_t)
PLACE(uint32_t)
PLACE(uint64_t)

#ifdef __SSE2__
#include <emmintrin.h>

/* 8 x 8 two-byte elements: rows[i] + c, eight of each, become d[j], the
 * eight elements of column j. Three rounds of interleaves. */
static inline void transpose8x8_u16(const uint16_t *const rows[8], uint64_t c, __m128i d[8])
{
    __m128i a[8], b[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm_loadu_si128((const __m128i *)(rows[i] + c));
    for (int i = 0; i < 8; i += 2) {
        b[i] = _mm_unpacklo_epi16(a[i], a[i + 1]);
        b[i + 1] = _mm_unpackhi_epi16(a[i], a[i + 1]);
    }
    __m128i c0 = _mm_unpacklo_epi32(b[0], b[2]), c1 = _mm_unpackhi_epi32(b[0], b[2]);
    __m128i c2 = _mm_unpacklo_epi32(b[1], b[3]), c3 = _mm_unpackhi_epi32(b[1], b[3]);
    __m128i c4 = _mm_unpacklo_epi32(b[4], b[6]), c5 = _mm_unpackhi_epi32(b[4], b[6]);
    __m128i c6 = _mm_unpacklo_epi32(b[5], b[7]), c7 = _mm_unpackhi_epi32(b[5], b[7]);
    d[0] = _mm_unpacklo_epi64(c0, c4);
    d[1] = _mm_unpackhi_epi64(c0, c4);
    d[2] = _mm_unpacklo_epi64(c1, c5);
    d[3] = _mm_unpackhi_epi64(c1, c5);
    d[4] = _mm_unpacklo_epi64(c2, c6);
    d[5] = _mm_unpackhi_epi64(c2, c6);
    d[6] = _mm_unpacklo_epi64(c3, c7);
    d[7] = _mm_unpackhi_epi64(c3, c7);
}

static void place_u16_sse2(const struct tchunk *tc, uint16_t *out, uint64_t r0, uint64_t r1, uint64_t c0, uint64_t c1,
                           const uint64_t *start)
{
    const uint16_t *tile = tc->tile;
    uint64_t r8 = r0 + (r1 - r0) / 8 * 8, c8 = c0 + (c1 - c0) / 8 * 8;
    /* Whole cache lines, 32 rows of each output row, stream past the cache
     * where they start on a line: no line is read in to be overwritten. */
    const int lines = (tc->rows * 2) % 64 == 0 && ((uintptr_t)out + r0 * 2) % 64 == 0;
    uint64_t r32 = lines ? r0 + (r8 - r0) / 32 * 32 : r0;
    for (uint64_t c = c0; c < c8; c += 8) {
        for (uint64_t r = r0; r < r32; r += 32) {
            __m128i d[4][8];
            for (int q = 0; q < 4; q++) {
                const uint16_t *rows[8];
                for (int i = 0; i < 8; i++)
                    rows[i] = tile + start[r - r0 + (uint64_t)(8 * q + i)];
                transpose8x8_u16(rows, c, d[q]);
            }
            for (int j = 0; j < 8; j++) {
                __m128i *dst = (__m128i *)(out + (c + (uint64_t)j) * tc->rows + r);
                for (int q = 0; q < 4; q++)
                    _mm_stream_si128(dst + q, d[q][j]);
            }
        }
        for (uint64_t r = r32; r < r8; r += 8) {
            const uint16_t *rows[8];
            __m128i d[8];
            for (int i = 0; i < 8; i++)
                rows[i] = tile + start[r - r0 + (uint64_t)i];
            transpose8x8_u16(rows, c, d);
            for (int j = 0; j < 8; j++)
                _mm_storeu_si128((__m128i *)(out + (c + (uint64_t)j) * tc->rows + r), d[j]);
        }
    }
    place_uint16_t(tc, out, r8, r1, c0, c1, start + (r8 - r0));
    place_uint16_t(tc, out, r0, r8, c8, c1, start);
}
#endif

/* Places tile rows [r0, r1) into their columns of the output. */
static void place_rows(const struct tchunk *tc, void *out, uint64_t r0, uint64_t r1)
{
    uint64_t start[TRANSPOSE_BLOCK];
    for (uint64_t b0 = r0; b0 < r1; b0 += TRANSPOSE_BLOCK) {
        uint64_t b1 = b0 + TRANSPOSE_BLOCK < r1 ? b0 + TRANSPOSE_BLOCK : r1;
        run_starts(tc, b0, b1 - b0, start);
        for (uint64_t c0 = 0; c0 < tc->k; c0 += TRANSPOSE_BLOCK) {
            uint64_t c1 = c0 + TRANSPOSE_BLOCK < tc->k ? c0 + TRANSPOSE_BLOCK : tc->k;
            switch (elem_size(tc->tile_dtype)) {
            case 2:
#ifdef __SSE2__
                place_u16_sse2(tc, out, b0, b1, c0, c1, start);
#else
                place_uint16_t(tc, out, b0, b1, c0, c1, start);
#endif
                break;
            case 4: place_uint32_t(tc, out, b0, b1, c0, c1, start); break;
            default: place_uint64_t(tc, out, b0, b1, c0, c1, start); break;
            }
        }
    }
}

/* The streamed stores in order before anyone reads the output. */
static void stores_done(void)
{
#ifdef __SSE2__
    _mm_sfence();
#endif
}

void transposed_place(const struct tchunk *tc, void *out)
{
    place_rows(tc, out, 0, tc->rows);
    stores_done();
}

void transposed_dequant_place(const struct tchunk *tc, const struct dequant_job *job, void *out, enum cpu_path path)
{
    const uint64_t blocks_per_row = tc->width / tc->blocksize;
    const unsigned size = elem_size(tc->tile_dtype);
    for (uint64_t r0 = 0; r0 < tc->rows; r0 += TRANSPOSE_BLOCK) {
        uint64_t r1 = r0 + TRANSPOSE_BLOCK < tc->rows ? r0 + TRANSPOSE_BLOCK : tc->rows;
        struct dequant_job band = *job;
        band.packed = job->packed + r0 * tc->width / 2;
        band.absmax = job->absmax + r0 * blocks_per_row;
        band.n = (r1 - r0) * tc->width;
        band.out = (unsigned char *)job->out + r0 * tc->width * size;
        dequant_cpu_path(&band, 1, path);
        place_rows(tc, out, r0, r1);
    }
    stores_done();
}
