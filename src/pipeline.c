#include "pipeline.h"

#include <inttypes.h>
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_path.h"
#include "dequant.h"
#include "engine_clock.h"
#include "exit_handoff.h"
#include "fpconv.h"
#include "gpu.h"
#include "gpu_start.h"
#include "lora_merge.h"
#include "merge_cpu.h"
#include "fileio.h"
#include "source_cache.h"
#include "status.h"
#include "transposed.h"

/* TASK_MERGE: a chunk of a tensor with LoRA deltas, dequantized (or read) in the
 * weight's own dtype, then merged and rounded into the output dtype.
 * TASK_TDEQUANT, TASK_TCAST: a chunk of a transposed item (transposed.h), a
 * 4-bit or a float source (copied or cast). */
enum task_kind { TASK_COPY, TASK_CAST, TASK_DEQUANT, TASK_MERGE, TASK_BATCH, TASK_TDEQUANT, TASK_TCAST };

/* A whole small tensor travelling in a batch: a file of many tiny tensors
 * would otherwise pay a read, two thread handoffs and a write per tensor. */
struct part {
    const struct out_item *it;
    void *in, *out; /* the same for copies */
    uint64_t count; /* elements */
    uint64_t overflowed;
};

#define BATCH_MAX_PARTS 1024
/* Tensors whose input and output take at most 1/BATCH_SHARE of a chunk are batched. */
#define BATCH_SHARE 8

/* FREE: the writer is done with it. CLAIMED: a worker is reading and computing
 * chunk `seq` in it. DONE: chunk `seq` is ready for the writer. */
enum slot_state { SLOT_FREE, SLOT_CLAIMED, SLOT_DONE };

/* One chunk of one output tensor, or a batch of whole small tensors: planned
 * under the lock, then read and computed by one worker without it. */
struct task {
    const struct out_item *it;
    const struct out_item *whole; /* the output tensor: `it`, or the item `it` is a part of */
    enum task_kind kind;
    uint64_t pos;      /* first element (byte, for copies) of the chunk */
    void *in, *out;
    uint64_t count;    /* elements (cast), or bytes (copy) */
    size_t out_len;    /* bytes to write */
    uint64_t at;       /* where they go in the file's tensor data */
    int ends_tensor;
    uint64_t overflowed; /* finite values of this chunk that became infinite */
    struct part *parts; /* TASK_BATCH: whole tensors, outputs back to back from `out` */
    int nparts;
    struct dequant_job job;
    struct merge_job merge;
    struct tchunk tchunk; /* a transposed item's chunk, gathered */
    float nested_code[NESTED_CODE_ENTRIES];
};

struct slot {
    unsigned char *arena;
    enum slot_state state;
    uint64_t seq;
    struct task task;
    struct part *parts; /* BATCH_MAX_PARTS */
};

/* Where the planner is: the next item in writer order, and the next chunk in it. */
struct plan_cursor {
    size_t item;       /* index in writer order */
    size_t part;       /* of an item made of parts: the part the chunks are in */
    uint64_t pos;      /* elements (bytes, for copies) of it already planned */
    uint64_t total, chunk;
    /* Elements between the edges no chunk may cross (a fused experts
     * tensor's experts, lora.h); 0: none. */
    uint64_t edge;
    enum task_kind kind;
    int started;       /* total, chunk and kind are set for `item` */
};

/* OFF: the CPU computes every chunk. STARTING: the GPU is being opened, the
 * CPU computes meanwhile. PINNING: it is open, and a worker is page-locking
 * the slots for fast transfers. ON: chunks go through the GPU. */
enum gpu_state { GPU_OFF, GPU_STARTING, GPU_PINNING, GPU_ON };

struct pipeline {
    struct gpu_start *gpu_start;
    int require_gpu;        /* a GPU that fails to open fails the run */
    int gpu_only;           /* NF4DEQ_GPU_ONLY=1: every chunk on the GPU, none on the CPU */
    int merging;            /* LoRA deltas are merged: the GPU carries the chunks */
    enum gpu_state gpu_state;
    struct gpu_ctx *gpu;    /* once ON */
    int gpu_lanes;          /* chunks through the device at once */
    pthread_mutex_t lane_mu[PIPELINE_GPU_LANES]; /* one chunk at a time per lane */
    int slots_pinned;
    uint64_t chunks_gpu, chunks_cpu; /* dequantized or merged, for the engine line */
    struct engine_clocks clocks; /* dequantization chunks timed while the GPU is on */
    enum cpu_path cpu_path;
    uint64_t slot_bytes;
    uint64_t mem_held;    /* of --mem, what is not for the slots (held before them, the source cache) */
    uint64_t max_chunk;   /* elements; caps chunks below what a slot holds (tests use it) */
    uint64_t chunk_bytes; /* output bytes a chunk aims at */
    struct convert_stats *stats;
    struct progress *progress;
    const char *path; /* the output, for messages */
    int nslots;
    struct slot *slots;
    struct source_cache *sources; /* 4-bit tensors read whole for their transposed chunks; NULL: none */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the persistent workers */
    int nworkers;
    pthread_t *workers;
    uint64_t run;  /* bumped by each pipeline_write */
    int busy;      /* workers inside the current run */
    int quit;
    /* per pipeline_write */
    struct st_writer *wr;
    const struct out_item *items;
    size_t n;
    struct plan_cursor cur;
    uint64_t planned; /* chunks planned so far: the next one's sequence number */
    uint64_t planned_bytes; /* their output bytes: where the next one's output goes */
    int mapped;       /* workers place their output in the file (st_writer_map) */
    int plan_done;
    int failed, fail_code;
    struct nf4_error fail_error;
};

#define ARENA_ALIGN 64u

static size_t align_up(size_t v)
{
    return (v + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
}

/* ---- failure shared between threads (each thread has its own error buffer) ---- */

/* Records the first failure; called with mu held. */
static void fail_locked(struct pipeline *p, int code)
{
    if (!p->failed) {
        p->failed = 1;
        p->fail_code = code;
        nf4_error_save(&p->fail_error);
    }
    pthread_cond_broadcast(&p->cv);
}

/* ---- chunk planning ---- */

static unsigned elem_bytes(enum st_dtype dt)
{
    return dtype_bits(dt) / 8;
}

/* The elements of a chunk of `it` that make about chunk_bytes of output, and
 * no more than the cap tests set: small enough that a chunk is still in cache
 * when the writer copies it out, and that many chunks keep every worker busy. */
static uint64_t chunk_cap(const struct pipeline *p, const struct out_item *it)
{
    uint64_t target = p->chunk_bytes / elem_bytes(it->out.dtype);
    return target < p->max_chunk ? target : p->max_chunk;
}

/* Largest chunk of a dequantized tensor that fits a slot and chunk_cap, in
 * elements. Chunks start where a byte, a block and a nested block all start
 * (see dequant.h). */
static uint64_t dequant_chunk(const struct pipeline *p, const struct out_item *it, uint64_t *align_out)
{
    const struct bnb_state *s = &it->w->state;
    uint64_t align = (uint64_t)s->blocksize * (s->nested ? s->nested_blocksize : 1);
    /* Per element: the output, half a packed byte, and at most 4 + 4 bytes of
     * scales per block of >= 32 elements: under one byte besides the output. */
    uint64_t per_element = elem_bytes(it->out.dtype) + 1;
    uint64_t fits = (p->slot_bytes - 4 * ARENA_ALIGN - 16) / per_element;
    uint64_t cap = chunk_cap(p, it);
    uint64_t chunk = fits < cap ? fits : cap;
    chunk = chunk / align * align;
    if (chunk == 0 && align <= fits)
        chunk = align;
    *align_out = align;
    return chunk;
}

/* Slot bytes a merge chunk of n elements takes at most: the base values in the
 * weight's dtype (with the packed input and scales when dequantized), the
 * output, and the factors (see lora_merge.h). */
static uint64_t merge_chunk_bytes(const struct out_item *it, uint64_t n)
{
    enum st_dtype w_dtype = it->w ? it->w->state.dtype : it->src->t->dtype;
    uint64_t per_element = elem_bytes(w_dtype) + elem_bytes(it->out.dtype) + (it->w ? 1 : 0);
    return n * per_element + merge_factor_bytes_max(it->lora, n) + 8 * ARENA_ALIGN + 16;
}

/* Slot bytes a chunk of k output rows of transposed item `it` takes: the
 * gathered tile (transposed.h), then what the chunk's output takes (with a
 * merge's base values and factors, or a cast's values before it is cast),
 * which the gathering reads through first. */
static uint64_t transposed_chunk_bytes(const struct out_item *it, enum task_kind kind, uint64_t k)
{
    uint64_t rows, cols;
    transposed_shape(it, &rows, &cols);
    uint64_t n = k * rows, after;
    enum st_dtype tile_dtype;
    if (kind == TASK_MERGE) {
        tile_dtype = it->w ? it->w->state.dtype : it->src->t->dtype;
        after = merge_chunk_bytes(it, n);
    } else if (kind == TASK_TDEQUANT) {
        tile_dtype = it->out.dtype;
        after = n * elem_bytes(it->out.dtype);
    } else {
        tile_dtype = it->src->t->dtype;
        after = n * elem_bytes(it->out.dtype) + (tile_dtype != it->out.dtype ? align_up(n * elem_bytes(tile_dtype)) : 0);
    }
    uint64_t band = transposed_band_min(it, k);
    return transposed_tile_bytes(it, k, tile_dtype) + (after > band ? after : band) + 2 * ARENA_ALIGN;
}

/* Largest chunk of transposed item `it` that fits a slot and chunk_cap (or
 * the smallest aligned one, where that is more), in elements: whole output
 * rows, a multiple of transposed_row_align of them; 0 if even that many do
 * not fit. *align_out: the elements of that many rows. */
static uint64_t transposed_chunk(const struct pipeline *p, const struct out_item *it, enum task_kind kind,
                                 uint64_t *align_out)
{
    uint64_t rows, cols;
    transposed_shape(it, &rows, &cols);
    uint64_t align = transposed_row_align(it);
    uint64_t cap = rows ? chunk_cap(p, it) / rows : cols;
    if (cap > cols)
        cap = cols;
    uint64_t lo = 0, hi = cap / align + 1;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (transposed_chunk_bytes(it, kind, mid * align) <= p->slot_bytes)
            lo = mid;
        else
            hi = mid;
    }
    if (lo == 0 && transposed_chunk_bytes(it, kind, align) <= p->slot_bytes)
        lo = 1;
    *align_out = align * rows;
    return lo * align * rows;
}

/* What a merge chunk of `it` (not transposed) is a multiple of: a
 * dequantized chunk's alignment where the base is 4-bit, any run of elements
 * otherwise, and DoRA's granule; *total: its elements. */
static uint64_t merge_align(const struct out_item *it, uint64_t *total)
{
    const struct bnb_state *s = it->w ? &it->w->state : NULL;
    uint64_t align = s ? (uint64_t)s->blocksize * (s->nested ? s->nested_blocksize : 1) : 1;
    *total = s ? s->n : it->src->t->nelem;
    if (lora_target_is_dora(it->lora))
        align = dora_granule(align, it->lora->cols, *total);
    return align;
}

/* Largest chunk of a merged tensor that fits a slot and chunk_cap (or the
 * smallest aligned one, where that is more), in elements: aligned as a
 * dequantized chunk when the base is 4-bit, any run of elements otherwise. */
static uint64_t merge_chunk(const struct pipeline *p, const struct out_item *it, uint64_t *align_out)
{
    if (it->transposed)
        return transposed_chunk(p, it, TASK_MERGE, align_out);
    uint64_t total, align = merge_align(it, &total);
    uint64_t cap = chunk_cap(p, it);
    if (cap > total)
        cap = total;
    /* The bytes grow with n: the largest fitting multiple of align, by bisection. */
    uint64_t lo = 0, hi = cap / align + 1;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (merge_chunk_bytes(it, mid * align) <= p->slot_bytes)
            lo = mid;
        else
            hi = mid;
    }
    if (lo == 0 && merge_chunk_bytes(it, align) <= p->slot_bytes)
        lo = 1;
    *align_out = align;
    return lo * align;
}

uint64_t pipeline_slot_bytes_wanted(const struct out_item *it)
{
    if (!it->lora && !it->transposed)
        return 0; /* a chunk of any size fits the smallest slot */
    const uint64_t target = PIPELINE_CHUNK_BYTES / elem_bytes(it->out.dtype);
    if (it->transposed) {
        uint64_t rows, cols;
        transposed_shape(it, &rows, &cols);
        /* Without a merge, the smallest chunk: the slots stay as they were
         * for every shape whose smallest chunk fits them, and transposed
         * chunks take what room a slot has (transposed_chunk). */
        uint64_t align = transposed_row_align(it), k = it->lora && rows ? target / rows : align;
        k = k < align ? align : k / align * align;
        return transposed_chunk_bytes(it, it->lora ? TASK_MERGE : it->w ? TASK_TDEQUANT : TASK_TCAST,
                                      k < cols ? k : cols);
    }
    uint64_t total, align = merge_align(it, &total);
    uint64_t n = target < align ? align : target / align * align;
    return merge_chunk_bytes(it, n < total ? n : total);
}

/* Reads a dequantization chunk into the arena and points t->job at it, with
 * its output (in `out_dtype`) after the inputs. *used: arena bytes taken. */
static int fill_dequant(struct task *t, unsigned char *arena, const struct out_item *it, uint64_t e0, uint64_t cnt,
                        enum st_dtype out_dtype, size_t *used)
{
    const struct bnb_weight *w = it->w;
    const struct bnb_state *s = &w->state;
    uint64_t b0 = e0 / s->blocksize;
    uint64_t nblocks = cnt / s->blocksize + (cnt % s->blocksize != 0);
    size_t packed_len = (size_t)(cnt / 2 + (cnt & 1));
    size_t at = 0;
    unsigned char *packed = arena + at;
    at = align_up(at + packed_len);
    unsigned char *absmax = arena + at;
    at = align_up(at + (size_t)nblocks * (s->nested ? 1 : 4));
    t->job = (struct dequant_job){
        .packed = packed,
        .n = cnt,
        .blocksize = s->blocksize,
        .nested_blocksize = s->nested ? s->nested_blocksize : 1,
        .quant_type = s->quant_type,
        .out_dtype = out_dtype,
    };
    int code = st_read(w->packed->file, w->packed->t, e0 / 2, packed, packed_len);
    if (code != NF4_OK)
        return code;
    if (s->nested) {
        uint64_t nb0 = b0 / s->nested_blocksize;
        uint64_t nnested = nblocks / s->nested_blocksize + (nblocks % s->nested_blocksize != 0);
        float *nested = (float *)(arena + at);
        at = align_up(at + (size_t)nnested * 4);
        if ((code = st_read(w->absmax->file, w->absmax->t, b0, absmax, nblocks)) != NF4_OK ||
            (code = st_read(w->nested_absmax->file, w->nested_absmax->t, nb0 * 4, nested, nnested * 4)) != NF4_OK ||
            (code = st_read(w->nested_quant_map->file, w->nested_quant_map->t, 0, t->nested_code,
                            sizeof t->nested_code)) != NF4_OK)
            return code;
        t->job.absmax_code = absmax;
        t->job.nested_absmax = nested;
        t->job.nested_code = t->nested_code;
        t->job.nested_offset = s->nested_offset;
    } else {
        if ((code = st_read(w->absmax->file, w->absmax->t, b0 * 4, absmax, nblocks * 4)) != NF4_OK)
            return code;
        t->job.absmax = (const float *)absmax;
    }
    t->out = arena + at;
    t->job.out = t->out;
    t->out_len = (size_t)(cnt * elem_bytes(out_dtype));
    *used = align_up(at + t->out_len);
    return NF4_OK;
}

/* Gathers the chunk of transposed t->it (transposed.h) into the arena, in
 * tile_dtype; *used: the bytes its tile takes, after which its output goes. */
static int fill_transposed(const struct pipeline *p, struct task *t, unsigned char *arena, size_t arena_len,
                           enum st_dtype tile_dtype, size_t *used)
{
    uint64_t rows, cols;
    transposed_shape(t->it, &rows, &cols);
    return transposed_fill(&t->tchunk, arena, arena_len, t->it, t->pos / rows, t->count / rows, tile_dtype, &t->job,
                           t->nested_code, p->sources, used);
}

/* Rounds n values of dtype `from` at p to dtype `to` in place (a replacement
 * loaded into the base's narrower parameter), where that loses anything:
 * from F32 to BF16 or F16, or between the two 16-bit types. Returns the
 * values' dtype now. */
static enum st_dtype round_in_place(void *p, uint64_t n, enum st_dtype from, enum st_dtype to)
{
    int narrower = from == DT_F32 && (to == DT_BF16 || to == DT_F16);
    int across = (from == DT_BF16 && to == DT_F16) || (from == DT_F16 && to == DT_BF16);
    if (!narrower && !across)
        return from;
    for (uint64_t i = 0; i < n; i++) /* front to back: element i is written at or before where it was read */
        f32_to_element(to, p, i, f32_from_element(from, p, i));
    return to;
}

/* Reads a merge chunk: the base values in their own dtype (a dequantization
 * job when 4-bit, the stored values otherwise), then the factors; the output
 * goes after them. */
static int fill_merge(const struct pipeline *p, struct task *t, unsigned char *arena, size_t arena_len,
                      const struct out_item *it, uint64_t e0, uint64_t cnt)
{
    struct merge_job *mj = &t->merge;
    size_t at = 0;
    int code;
    if (it->transposed) {
        /* The tile now; compute places it, transposed, as the base values. */
        enum st_dtype w_dtype = it->w ? it->w->state.dtype : it->src->t->dtype;
        if ((code = fill_transposed(p, t, arena, arena_len, w_dtype, &at)) != NF4_OK)
            return code;
        mj->w = arena + at;
        mj->w_dtype = w_dtype;
        at = align_up(at + (size_t)(cnt * elem_bytes(w_dtype)));
    } else if (it->w) {
        if ((code = fill_dequant(t, arena, it, e0, cnt, it->w->state.dtype, &at)) != NF4_OK)
            return code;
        mj->w = t->job.out;
        mj->w_dtype = it->w->state.dtype;
    } else {
        unsigned in_size = elem_bytes(it->src->t->dtype);
        if ((code = st_read(it->src->file, it->src->t, e0 * in_size, arena, cnt * in_size)) != NF4_OK)
            return code;
        mj->w = arena;
        mj->w_dtype = it->src->t->dtype;
        if (it->round_src_to != DT_INVALID)
            mj->w_dtype = round_in_place(arena, cnt, mj->w_dtype, it->round_src_to);
        at = align_up((size_t)(cnt * in_size));
    }
    t->out = arena + at;
    t->out_len = (size_t)(cnt * elem_bytes(it->out.dtype));
    at = align_up(at + t->out_len);
    mj->out = t->out;
    mj->out_dtype = it->out.dtype;
    return merge_read_factors(mj, it->lora, e0, cnt, arena + at);
}

/* ---- planning: cutting items into chunks, in writer order, under the lock ---- */

static enum task_kind kind_of(const struct out_item *it)
{
    if (it->lora)
        return TASK_MERGE;
    if (it->transposed)
        return it->w ? TASK_TDEQUANT : TASK_TCAST;
    if (it->w)
        return TASK_DEQUANT;
    return it->src->t->dtype == it->out.dtype ? TASK_COPY : TASK_CAST;
}

/* Output bytes of a whole copied or cast tensor (dtypes may be sub-byte). */
static uint64_t out_bytes_of(const struct out_item *it)
{
    return it->src->t->nelem * dtype_bits(it->out.dtype) / 8;
}

/* The failure of an item whose smallest chunk takes `need` bytes, more than
 * a slot holds: the --mem that gives PIPELINE_MIN_SLOTS slots of that size
 * beside what the process holds (pipeline_create makes slots that large
 * where --mem has room for them). */
static int mem_too_small(const struct pipeline *p, const struct out_item *it, uint64_t need)
{
    const uint64_t mib4 = UINT64_C(4) << 20; /* rounded up to 4 MiB: what the process holds varies a little */
    uint64_t want = pipeline_slot_bytes_wanted(it);
    uint64_t least = (p->mem_held + PIPELINE_MIN_SLOTS * (need + ARENA_ALIGN)) / mib4 * mib4 + mib4;
    uint64_t usual = (p->mem_held + PIPELINE_MIN_SLOTS * (want + ARENA_ALIGN)) / mib4 * mib4 + mib4;
    char more[80] = ""; /* the least --mem cuts the chunks to a row or so, each reading all the factors again */
    if (usual > least)
        snprintf(more, sizeof more, " (%" PRIu64 "M for chunks of the usual size)", usual >> 20);
    return nf4_fail(NF4_EUSAGE, it->w ? it->w->packed->file->path : it->src->file->path, it->out.name,
                    "--mem is too small: one chunk of this tensor needs %" PRIu64 " MiB per slot, and %d slots "
                    "need --mem %" PRIu64 "M or more%s", (need >> 20) + 1, PIPELINE_MIN_SLOTS, least >> 20, more);
}

/* Sets the cursor's total and chunk for the item it is at. */
static int start_item(const struct pipeline *p, struct plan_cursor *c, const struct out_item *it)
{
    c->kind = kind_of(it);
    if (c->kind == TASK_TDEQUANT || c->kind == TASK_TCAST) {
        uint64_t align, rows, cols;
        transposed_shape(it, &rows, &cols);
        c->total = rows * cols;
        c->chunk = transposed_chunk(p, it, c->kind, &align);
        if (c->chunk == 0)
            return mem_too_small(p, it, transposed_chunk_bytes(it, c->kind, align / (rows ? rows : 1)));
    } else if (c->kind == TASK_DEQUANT || c->kind == TASK_MERGE) {
        uint64_t align;
        c->total = it->w ? it->w->state.n : it->src->t->nelem;
        c->chunk = c->kind == TASK_MERGE ? merge_chunk(p, it, &align) : dequant_chunk(p, it, &align);
        c->edge = c->kind == TASK_MERGE ? lora_target_expert_rows(it->lora) * it->lora->cols : 0;
        if (c->chunk == 0) {
            uint64_t rows = 1, cols;
            if (it->transposed)
                transposed_shape(it, &rows, &cols);
            uint64_t need = it->transposed && c->kind == TASK_MERGE
                                ? transposed_chunk_bytes(it, TASK_MERGE, align / (rows ? rows : 1))
                            : c->kind == TASK_MERGE ? merge_chunk_bytes(it, align)
                                                    : align * (elem_bytes(it->out.dtype) + 1);
            return mem_too_small(p, it, need);
        }
    } else if (c->kind == TASK_COPY) {
        c->total = st_tensor_bytes(it->src->t);
        c->chunk = p->chunk_bytes < p->slot_bytes ? p->chunk_bytes : p->slot_bytes / ARENA_ALIGN * ARENA_ALIGN;
        if (p->max_chunk < c->chunk / 4)
            c->chunk = p->max_chunk * 4 < ARENA_ALIGN ? ARENA_ALIGN : p->max_chunk * 4;
    } else {
        c->total = it->src->t->nelem;
        c->chunk = (p->slot_bytes - 2 * ARENA_ALIGN) / (elem_bytes(it->src->t->dtype) + elem_bytes(it->out.dtype));
        uint64_t cap = chunk_cap(p, it);
        if (c->chunk > cap)
            c->chunk = cap;
    }
    c->started = 1;
    return NF4_OK;
}

/* Adds the whole small copy or cast `it` to the batch planned in `s`, when it
 * fits. *room_low: where the cast inputs, which grow down from the end of the
 * batch's share of the arena, begin. Returns whether it was added. */
static int add_to_batch(struct slot *s, const struct out_item *it, enum task_kind kind, size_t *room_low)
{
    struct task *t = &s->task;
    uint64_t out_bytes = out_bytes_of(it);
    size_t in_space = kind == TASK_CAST ? align_up((size_t)st_tensor_bytes(it->src->t)) : 0;
    if (t->nparts == BATCH_MAX_PARTS || t->out_len + out_bytes + in_space > *room_low)
        return 0;
    struct part *part = &t->parts[t->nparts++];
    /* Outputs grow from the arena's start without gaps (the writer's dtype
     * order keeps each one aligned to its element size). */
    *part = (struct part){.it = it, .count = it->src->t->nelem, .out = s->arena + t->out_len};
    if (kind == TASK_CAST) {
        *room_low -= in_space;
        part->in = s->arena + *room_low;
    } else {
        part->in = part->out;
    }
    t->out_len += (size_t)out_bytes;
    return 1;
}

/* Plans the next chunk into the free slot `s`, with mu held: one chunk of a
 * large item, or a batch of whole small ones. *planned: 0 when every item is
 * planned already. Does no I/O: a worker reads the chunk's input later. */
static int plan_next(struct pipeline *p, struct slot *s, int *planned)
{
    struct plan_cursor *c = &p->cur;
    struct task *t = &s->task;
    size_t room_low = 0;
    *planned = 0;
    while (c->item < p->n) {
        const struct out_item *whole = &p->items[st_writer_order(p->wr, c->item)];
        const struct out_item *it = whole->nparts ? &whole->parts[c->part] : whole;
        enum task_kind kind = kind_of(it);
        if (!whole->nparts && !c->started && (kind == TASK_COPY || kind == TASK_CAST)) {
            uint64_t in_space = kind == TASK_CAST ? align_up((size_t)st_tensor_bytes(it->src->t)) : 0;
            uint64_t out_bytes = out_bytes_of(it);
            if (in_space + out_bytes <= p->chunk_bytes / BATCH_SHARE) {
                if (!*planned) {
                    *t = (struct task){.kind = TASK_BATCH, .out = s->arena, .parts = s->parts};
                    uint64_t share = p->chunk_bytes < p->slot_bytes ? p->chunk_bytes : p->slot_bytes;
                    room_low = (size_t)share / ARENA_ALIGN * ARENA_ALIGN;
                    *planned = 1;
                }
                if (!add_to_batch(s, it, kind, &room_low))
                    return NF4_OK; /* the batch is full: this item opens the next one */
                c->item++;
                continue;
            }
        }
        if (*planned)
            return NF4_OK; /* a batch ends where a chunked item begins */
        if (!c->started) {
            int code = start_item(p, c, it);
            if (code != NF4_OK)
                return code;
        }
        uint64_t cnt = c->total - c->pos < c->chunk ? c->total - c->pos : c->chunk;
        if (c->edge && cnt > c->edge - c->pos % c->edge)
            cnt = c->edge - c->pos % c->edge;
        int last_part = !whole->nparts || c->part + 1 == whole->nparts;
        *t = (struct task){.it = it, .whole = whole, .kind = c->kind, .pos = c->pos, .count = cnt,
                           .ends_tensor = last_part && c->pos + cnt == c->total};
        c->pos += cnt;
        if (c->pos == c->total)
            *c = last_part ? (struct plan_cursor){.item = c->item + 1}
                           : (struct plan_cursor){.item = c->item, .part = c->part + 1};
        *planned = 1;
        return NF4_OK;
    }
    return NF4_OK;
}

/* The output bytes of a planned chunk, known before it is read: fill sets
 * out_len to the same. */
static uint64_t task_out_bytes(const struct task *t)
{
    switch (t->kind) {
    case TASK_BATCH:
        return t->out_len;
    case TASK_COPY:
        return t->count;
    default:
        return t->count * elem_bytes(t->it->out.dtype);
    }
}

/* ---- reading and computing a chunk: a worker, without the lock ---- */

static int fill(const struct pipeline *p, struct slot *s)
{
    struct task *t = &s->task;
    const struct out_item *it = t->it;
    size_t used;
    int code;
    switch (t->kind) {
    case TASK_BATCH:
        for (int i = 0; i < t->nparts; i++) {
            const struct part *part = &t->parts[i];
            code = st_read(part->it->src->file, part->it->src->t, 0, part->in, st_tensor_bytes(part->it->src->t));
            if (code != NF4_OK)
                return code;
        }
        return NF4_OK;
    case TASK_DEQUANT:
        return fill_dequant(t, s->arena, it, t->pos, t->count, it->out.dtype, &used);
    case TASK_MERGE:
        return fill_merge(p, t, s->arena, (size_t)p->slot_bytes, it, t->pos, t->count);
    case TASK_TDEQUANT:
        code = fill_transposed(p, t, s->arena, (size_t)p->slot_bytes, it->out.dtype, &used);
        t->out = s->arena + used;
        t->out_len = (size_t)(t->count * elem_bytes(it->out.dtype));
        return code;
    case TASK_TCAST: {
        /* Cast after it is placed: the placed values first, where dtypes differ. */
        enum st_dtype from = it->src->t->dtype;
        code = fill_transposed(p, t, s->arena, (size_t)p->slot_bytes, from, &used);
        t->in = from != it->out.dtype ? s->arena + used : NULL;
        t->out = s->arena + (t->in ? align_up(used + (size_t)(t->count * elem_bytes(from))) : used);
        t->out_len = (size_t)(t->count * elem_bytes(it->out.dtype));
        return code;
    }
    case TASK_COPY:
        t->in = t->out = s->arena;
        t->out_len = (size_t)t->count;
        return st_read(it->src->file, it->src->t, t->pos, s->arena, t->count);
    case TASK_CAST: {
        unsigned in_size = elem_bytes(it->src->t->dtype);
        t->in = s->arena;
        t->out = s->arena + align_up((size_t)(t->count * in_size));
        t->out_len = (size_t)(t->count * elem_bytes(it->out.dtype));
        return st_read(it->src->file, it->src->t, t->pos * in_size, t->in, t->count * in_size);
    }
    }
    return NF4_OK;
}

/* A tensor's last bytes are computed: count it and report overflows of its
 * cast. An item made of parts counts once, by what its parts were. */
static void finish_tensor(struct pipeline *p, const struct out_item *whole, uint64_t overflowed)
{
    const size_t nparts = whole->nparts ? whole->nparts : 1;
    int merged = 0, dequantized = 0, cast = 0;
    for (size_t i = 0; i < nparts; i++) {
        const struct out_item *it = whole->nparts ? &whole->parts[i] : whole;
        const struct model_tensor *src = it->w ? it->w->packed : it->src;
        merged |= it->lora != NULL;
        dequantized |= it->w != NULL;
        cast |= !it->w && src->t->dtype != it->out.dtype;
        p->stats->bytes_in += st_tensor_bytes(src->t);
        if (it->w)
            p->stats->bytes_in += st_tensor_bytes(it->w->absmax->t) +
                                  (it->w->state.nested ? st_tensor_bytes(it->w->nested_absmax->t) : 0);
    }
    if (overflowed) {
        const struct out_item *it = whole->nparts ? &whole->parts[0] : whole;
        const struct model_tensor *src = it->w ? it->w->packed : it->src;
        /* An adapter's copy, or the embedding an untied head starts from. */
        int renamed = !it->w && strcmp(it->src->t->name, whole->out.name) != 0;
        if (merged)
            nf4_warn("%s: %s: %" PRIu64 " finite values overflowed to inf when the adapter's changes were merged into %s",
                     src->file->path, whole->out.name, overflowed, dtype_name(whole->out.dtype));
        else if (whole->nparts)
            nf4_warn("%s: %s: %" PRIu64 " finite values overflowed to inf when its parts were cast to %s",
                     src->file->path, whole->out.name, overflowed, dtype_name(whole->out.dtype));
        else
            nf4_warn("%s: %s: %" PRIu64 " finite values overflowed to inf when cast from %s to %s%s%s%s",
                     it->src->file->path, it->src->t->name, overflowed, dtype_name(it->src->t->dtype),
                     dtype_name(it->out.dtype), renamed ? " (written as " : "", renamed ? it->out.name : "",
                     renamed ? ")" : "");
        p->stats->overflowed += overflowed;
    }
    p->stats->tensors++;
    if (merged)
        p->stats->merged++;
    else if (!dequantized && cast)
        p->stats->cast++;
    else if (!dequantized)
        p->stats->passed_through++;
    if (dequantized)
        p->stats->dequantized++;
}

/* Whether a worker waits for its lane rather than take a core (take_lane). */
static int waits_for_a_lane(const struct pipeline *p)
{
    return p->gpu_only || p->cpu_path == CPU_PATH_SCALAR;
}

/* A free GPU lane for a dequantization, starting at `lane`, or -1 when every
 * lane is busy: the worker then converts its chunk on its own core, where
 * waiting would only idle that core. With eight workers on four lanes, waiting
 * made the GPU run 1.05x the CPU run's time into tmpfs (docs/PERFORMANCE.md,
 * "The GPU path against the CPU path"). It waits for `lane` under gpu_only, so
 * that the GPU computes every chunk, and where the CPU has only the scalar
 * kernel: there a chunk on a core would hold up the in-order writer far longer
 * than a lane's round trip (that is why --device auto takes the GPU there).
 * The lane returned is held; the caller unlocks it. */
static int take_lane(struct pipeline *p, int lane)
{
    if (waits_for_a_lane(p)) {
        pthread_mutex_lock(&p->lane_mu[lane]);
        return lane;
    }
    for (int k = 0; k < p->gpu_lanes; k++) {
        int l = (lane + k) % p->gpu_lanes;
        if (pthread_mutex_trylock(&p->lane_mu[l]) == 0)
            return l;
    }
    return -1;
}

/* Computes a filled chunk in place: on the GPU (one chunk at a time through
 * each lane), or on this worker's thread with the CPU kernels. Sets *on_gpu
 * to whether the GPU computed it. */
static int compute(struct pipeline *p, struct gpu_ctx *gpu, int lane, struct task *t, int *on_gpu)
{
    const struct out_item *it = t->it;
    int code = NF4_OK;
    switch (t->kind) {
    case TASK_BATCH:
        for (int i = 0; i < t->nparts; i++) {
            struct part *part = &t->parts[i];
            if (part->in != part->out)
                part->overflowed = cast_elements(part->it->src->t->dtype, part->it->out.dtype, part->in, part->out,
                                                 part->count);
        }
        break;
    case TASK_DEQUANT:
    case TASK_TDEQUANT: {
        int held = gpu ? take_lane(p, lane) : -1;
        if (held >= 0) {
            code = gpu_dequant_lane(gpu, held, &t->job);
            pthread_mutex_unlock(&p->lane_mu[held]);
            *on_gpu = 1;
            if (code == NF4_OK && t->kind == TASK_TDEQUANT)
                transposed_place(&t->tchunk, t->out);
        } else if (t->kind == TASK_TDEQUANT) {
            transposed_dequant_place(&t->tchunk, &t->job, t->out, p->cpu_path);
        } else {
            dequant_cpu_path(&t->job, 1, p->cpu_path);
        }
        break;
    }
    case TASK_TCAST:
        transposed_place(&t->tchunk, t->in ? t->in : t->out);
        if (t->in)
            t->overflowed = cast_elements(it->src->t->dtype, it->out.dtype, t->in, t->out, t->count);
        break;
    case TASK_MERGE:
        if (it->transposed) {
            /* The base values, placed: on this core, as a base a merge reads rather than dequantizes. */
            if (it->w)
                transposed_dequant_place(&t->tchunk, &t->job, (void *)t->merge.w, p->cpu_path);
            else
                transposed_place(&t->tchunk, (void *)t->merge.w);
            if (it->round_src_to != DT_INVALID)
                t->merge.w_dtype = round_in_place((void *)t->merge.w, t->count, t->merge.w_dtype, it->round_src_to);
        }
        const struct dequant_job *dq = it->w && !it->transposed ? &t->job : NULL;
        if (gpu && t->merge.w_dtype != DT_F64) {
            /* One fused kernel: the dequantized base never leaves the device.
             * A merge waits for its lane: on a core it takes several times
             * as long (docs/PERFORMANCE.md, "QLoRA merge"). */
            pthread_mutex_lock(&p->lane_mu[lane]);
            code = gpu_merge_lane(gpu, lane, dq, &t->merge, &t->overflowed);
            pthread_mutex_unlock(&p->lane_mu[lane]);
            *on_gpu = 1;
        } else {
            if (dq)
                dequant_cpu_path(dq, 1, p->cpu_path);
            t->overflowed = merge_cpu_path(&t->merge, 1, p->cpu_path);
        }
        if (code == NF4_OK && t->merge.ntok)
            t->overflowed = merge_put_token_rows(&t->merge, t->overflowed);
        break;
    case TASK_CAST:
        t->overflowed = cast_elements(it->src->t->dtype, it->out.dtype, t->in, t->out, t->count);
        break;
    case TASK_COPY:
        break;
    }
    return code;
}

/* ---- the engine: the CPU, and the GPU from the moment it is open ---- */

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Whether the GPU is to carry the chunks, whatever the engine clocks say:
 * merges, and where workers wait for a lane (NF4DEQ_GPU_ONLY, the scalar CPU
 * kernel). */
static int gpu_carries_the_chunks(const struct pipeline *p)
{
    return p->merging || waits_for_a_lane(p);
}

/* Whether the next dequantization chunk may go to the open GPU: always where
 * the GPU carries the chunks, else where the engine clocks say it is as fast
 * as a core or faster (engine_clock.h). With mu held. */
static int gpu_worth_a_chunk(struct pipeline *p)
{
    return gpu_carries_the_chunks(p) || engine_gpu_worth_a_chunk(&p->clocks);
}

/* The GPU did not open: the run fails when it asked for the GPU, else it goes
 * on with the CPU and says so once. With mu held. */
static void gpu_failed_locked(struct pipeline *p, int code)
{
    p->gpu_state = GPU_OFF;
    if (p->require_gpu) {
        fail_locked(p, code);
    } else if (!gpu_start_found_device(p->gpu_start)) {
        nf4_warn("no CUDA device found; converting on the CPU with %d threads", p->nworkers);
    } else {
        nf4_warn("cannot use the GPU (%s); converting on the CPU", nf4_last_error());
    }
    nf4_clear_error();
}

/* Opens a lane per worker, up to PIPELINE_GPU_LANES, and page-locks every
 * slot, so that copies to and from the device run at full speed and
 * asynchronously (a slot that cannot be locked still works, slower). Not into
 * a mapped output (tmpfs) where the GPU is not to carry the chunks: there
 * locking them cost about 3% of a conversion, the engine clocks leave few
 * chunks to the GPU anyway (docs/PERFORMANCE.md, "What the GPU path pays for
 * CUDA into tmpfs"), and those few go through the driver's own staging. On a disk,
 * pageable slots made the GPU's chunks, and the run, 4% slower. A locked
 * slot is also kept out of any child: the hand-off's fork (exit_handoff.h)
 * would otherwise have to copy every page-locked page into the child, which
 * never reads them. */
static void pin_slots(struct pipeline *p, struct gpu_ctx *gpu)
{
    p->gpu_lanes = gpu_use_lanes(gpu, p->nworkers < PIPELINE_GPU_LANES ? p->nworkers : PIPELINE_GPU_LANES);
    if (p->mapped && !gpu_carries_the_chunks(p))
        return;
    for (int i = 0; i < p->nslots; i++)
        if (gpu_host_register(gpu, p->slots[i].arena, (size_t)p->slot_bytes) == 0)
            madvise(p->slots[i].arena, (size_t)p->slot_bytes, MADV_DONTFORK);
    p->slots_pinned = 1;
}

/* The device to compute the next chunk on, or NULL for this worker's core.
 * Called with mu held; the first worker to find the GPU open pins the slots
 * (without the lock), and the others stay on the CPU until it is done. */
static struct gpu_ctx *engine_for_chunk(struct pipeline *p)
{
    if (p->gpu_only && p->gpu_state == GPU_STARTING) {
        pthread_mutex_unlock(&p->mu);
        int ignored;
        gpu_start_wait(p->gpu_start, &ignored); /* polled again below, with the lock */
        nf4_clear_error();
        pthread_mutex_lock(&p->mu);
    }
    if (p->gpu_state == GPU_STARTING) {
        int code;
        enum gpu_start_state st = gpu_start_poll(p->gpu_start, &code);
        if (st == GPU_START_FAILED) {
            gpu_failed_locked(p, code);
        } else if (st == GPU_START_READY) {
            struct gpu_ctx *gpu = gpu_start_ctx(p->gpu_start);
            p->gpu_state = GPU_PINNING;
            pthread_mutex_unlock(&p->mu);
            pin_slots(p, gpu);
            pthread_mutex_lock(&p->mu);
            p->gpu = gpu;
            p->gpu_state = GPU_ON;
            pthread_cond_broadcast(&p->cv);
        }
    }
    while (p->gpu_only && p->gpu_state == GPU_PINNING)
        pthread_cond_wait(&p->cv, &p->mu);
    return p->gpu_state == GPU_ON ? p->gpu : NULL;
}

/* Settles a start still under way when a file's chunks are all written: a run
 * that asked for the GPU must know it exists before its output is renamed
 * into place. With mu held and no worker busy. */
static void settle_gpu_locked(struct pipeline *p)
{
    if (p->gpu_state != GPU_STARTING)
        return;
    int code;
    if (gpu_start_wait(p->gpu_start, &code) == GPU_START_FAILED)
        gpu_failed_locked(p, code);
}

/* The engine line: the device, and the CPU's share: the chunks converted
 * while it started, and those whose worker found every lane busy. */
static void describe_engine(const struct pipeline *p)
{
    char cpu[96];
    snprintf(cpu, sizeof cpu, "CPU (%d thread%s, %s)", p->nworkers, p->nworkers == 1 ? "" : "s",
             cpu_path_name(p->cpu_path));
    struct convert_stats *st = p->stats;
    if (p->gpu_state == GPU_OFF)
        snprintf(st->engine, sizeof st->engine, "%s", cpu);
    else if (p->chunks_cpu == 0)
        snprintf(st->engine, sizeof st->engine, "%s", gpu_name(gpu_start_ctx(p->gpu_start)));
    else
        snprintf(st->engine, sizeof st->engine, "%s; the %s did %" PRIu64 " of %" PRIu64 " chunks",
                 gpu_name(gpu_start_ctx(p->gpu_start)), cpu, p->chunks_cpu, p->chunks_cpu + p->chunks_gpu);
}

/* ---- the workers and the writer ---- */

/* One run of a worker: claim the next free slot in order, plan a chunk into
 * it, then read and compute it without the lock; until every chunk is planned
 * or the run fails. Called with mu held. */
static void work_run(struct pipeline *p)
{
    for (;;) {
        struct slot *s = &p->slots[p->planned % (uint64_t)p->nslots];
        while (!p->failed && !p->plan_done && s->state != SLOT_FREE) {
            pthread_cond_wait(&p->cv, &p->mu);
            s = &p->slots[p->planned % (uint64_t)p->nslots];
        }
        if (p->failed || p->plan_done)
            return;
        int planned;
        int code = plan_next(p, s, &planned);
        if (code != NF4_OK) {
            fail_locked(p, code);
            return;
        }
        if (!planned) {
            p->plan_done = 1;
            pthread_cond_broadcast(&p->cv);
            return;
        }
        s->state = SLOT_CLAIMED;
        s->seq = p->planned++;
        s->task.at = p->planned_bytes;
        p->planned_bytes += task_out_bytes(&s->task);
        struct gpu_ctx *gpu = engine_for_chunk(p);
        /* Dequantization chunks are timed while the GPU is on, on either engine. */
        const int timed = gpu && (s->task.kind == TASK_DEQUANT || s->task.kind == TASK_TDEQUANT);
        if (timed && !gpu_worth_a_chunk(p))
            gpu = NULL;
        /* Consecutive chunks take turns on the lanes. */
        int lane = gpu ? (int)(s->seq % (uint64_t)p->gpu_lanes) : 0;
        pthread_mutex_unlock(&p->mu);
        code = fill(p, s);
        int on_gpu = 0;
        double t0 = timed ? now_ns() : 0;
        if (code == NF4_OK)
            code = compute(p, gpu, lane, &s->task, &on_gpu);
        /* Every worker places its own output: no single writer copies it all. */
        if (code == NF4_OK && p->mapped)
            code = st_writer_write_at(p->wr, s->task.at, s->task.out, s->task.out_len);
        double took = timed ? now_ns() - t0 : 0;
        pthread_mutex_lock(&p->mu);
        if (s->task.kind == TASK_DEQUANT || s->task.kind == TASK_TDEQUANT || s->task.kind == TASK_MERGE)
            *(on_gpu ? &p->chunks_gpu : &p->chunks_cpu) += 1;
        if (timed && code == NF4_OK)
            engine_clock_add(&p->clocks, on_gpu, took, s->task.out_len);
        if (code != NF4_OK)
            fail_locked(p, code);
        s->state = SLOT_DONE;
        pthread_cond_broadcast(&p->cv);
    }
}

static void *worker_main(void *arg)
{
    struct pipeline *p = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->run == seen)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->quit)
            break;
        seen = p->run;
        p->busy++;
        work_run(p);
        p->busy--;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* The writer (the calling thread): appends chunk after chunk in sequence, and
 * counts each tensor, with the overflows of all its chunks, once its last
 * chunk is written. */
static int write_in_order(struct pipeline *p)
{
    uint64_t tensor_overflow = 0;
    for (uint64_t k = 0;; k++) {
        struct slot *s = &p->slots[k % (uint64_t)p->nslots];
        pthread_mutex_lock(&p->mu);
        while (!p->failed && !(s->state == SLOT_DONE && s->seq == k) && !(p->plan_done && k == p->planned))
            pthread_cond_wait(&p->cv, &p->mu);
        int go = !p->failed && s->state == SLOT_DONE && s->seq == k;
        pthread_mutex_unlock(&p->mu);
        if (!go)
            break;
        struct task *t = &s->task;
        int code = p->mapped ? st_writer_account(p->wr, t->out_len) : st_writer_write(p->wr, t->out, t->out_len);
        if (code != NF4_OK) {
            pthread_mutex_lock(&p->mu);
            fail_locked(p, code);
            pthread_mutex_unlock(&p->mu);
            break;
        }
        if (t->kind == TASK_BATCH) {
            for (int i = 0; i < t->nparts; i++)
                finish_tensor(p, t->parts[i].it, t->parts[i].overflowed);
        } else {
            tensor_overflow += t->overflowed;
            if (t->ends_tensor) {
                finish_tensor(p, t->whole, tensor_overflow);
                tensor_overflow = 0;
            }
        }
        if (p->progress)
            progress_add(p->progress, t->out_len,
                         t->kind == TASK_BATCH ? (uint64_t)t->nparts : (uint64_t)t->ends_tensor);
        pthread_mutex_lock(&p->mu);
        s->state = SLOT_FREE;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_lock(&p->mu);
    int failed = p->failed;
    pthread_mutex_unlock(&p->mu);
    return failed ? p->fail_code : NF4_OK;
}

int pipeline_write(struct pipeline *p, struct st_writer *wr, const struct out_item *items, size_t n)
{
    pthread_mutex_lock(&p->mu);
    p->wr = wr;
    p->items = items;
    p->n = n;
    p->cur = (struct plan_cursor){0};
    p->planned = 0;
    p->planned_bytes = 0;
    p->mapped = st_writer_map(wr, p->nworkers);
    source_cache_clear(p->sources);
    p->plan_done = 0;
    p->failed = 0;
    for (int i = 0; i < p->nslots; i++)
        p->slots[i].state = SLOT_FREE;
    p->run++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    int code = write_in_order(p);
    /* The workers may still be reading or computing chunks of a failed run:
     * they touch the caller's items and files until they leave it. */
    pthread_mutex_lock(&p->mu);
    p->plan_done = 1;
    pthread_cond_broadcast(&p->cv);
    while (p->busy > 0)
        pthread_cond_wait(&p->cv, &p->mu);
    if (code == NF4_OK) {
        settle_gpu_locked(p);
        code = p->failed ? p->fail_code : NF4_OK;
        describe_engine(p);
    }
    pthread_mutex_unlock(&p->mu);
    if (code != NF4_OK)
        return nf4_error_restore(p->fail_code, &p->fail_error);
    return NF4_OK;
}

/* Resident memory of this process now, from /proc (0 where there is none). */
static uint64_t resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%llu %llu", &size, &resident) != 2)
        resident = 0;
    fclose(f);
    return (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Slots: one per worker and PIPELINE_SPARE_SLOTS more, so workers run ahead of
 * the writer; fewer where --mem cannot hold that many of `min_slot` bytes. */
static int slot_count(int workers, uint64_t for_slots, uint64_t min_slot)
{
    uint64_t n = (uint64_t)workers + PIPELINE_SPARE_SLOTS;
    if (n > PIPELINE_MAX_SLOTS)
        n = PIPELINE_MAX_SLOTS;
    while (n > PIPELINE_MIN_SLOTS && for_slots / n < min_slot)
        n--;
    return (int)n;
}

int pipeline_create(struct pipeline **out, const char *path, const struct pipeline_opts *o,
                    struct convert_stats *stats, struct progress *progress)
{
    *out = NULL;
    struct pipeline *p = calloc(1, sizeof *p);
    if (!p)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    p->gpu_start = o->gpu_start;
    p->require_gpu = o->require_gpu;
    const char *only = getenv(GPU_ONLY_ENV);
    p->gpu_only = o->require_gpu && only && strcmp(only, "1") == 0;
    p->merging = o->merging;
    p->gpu_state = o->gpu_start ? GPU_STARTING : GPU_OFF;
    p->path = path;
    p->cpu_path = o->cpu_path;
    p->stats = stats;
    p->progress = progress;
    p->max_chunk = o->max_chunk_elements ? o->max_chunk_elements : UINT64_MAX;
    p->chunk_bytes = PIPELINE_CHUNK_BYTES;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < PIPELINE_GPU_LANES; i++)
        pthread_mutex_init(&p->lane_mu[i], NULL);
    /* --mem bounds the whole process: the slots get what is left after what it
     * already holds, and what the CUDA runtime will once the device is open. */
    const uint64_t resident = resident_bytes();
    uint64_t held = resident + PIPELINE_RESERVE_BYTES + (o->gpu_start ? PIPELINE_GPU_RUNTIME_BYTES : 0);
    uint64_t for_slots = o->mem_bytes > held ? o->mem_bytes - held : 0;
    p->mem_held = held;
    uint64_t min_slot = o->merging ? PIPELINE_MIN_MERGE_SLOT_BYTES : PIPELINE_MIN_SLOT_BYTES;
    /* The tensors' list (headers, index, plans: about 1 KiB a tensor, a few
     * for a 4-bit weight) is held whole, outside what --mem bounds: said
     * where it alone leaves less than the fewest slots. */
    if (resident >= PIPELINE_LIST_WARN_BYTES && for_slots < PIPELINE_MIN_SLOTS * min_slot)
        nf4_warn("%s: the list of the input's tensors (headers, index, plans) takes %" PRIu64 " MiB, which leaves "
                 "--mem no room for the chunks' buffers: the run holds more than --mem (%" PRIu64 " MiB)", path,
                 resident >> 20, o->mem_bytes >> 20);
    int workers = o->threads > 0 ? o->threads : 1;
    /* Every slot is the smallest that holds any chunk: chunks aim at
     * chunk_bytes whatever --mem allows, so more would only be pinned and
     * resident for nothing. A merge whose factors alone fill that (a LoRA A
     * of rank 512 on a row of 28672, 59 MB in fp32) gets slots that hold a
     * chunk of that size beside them, where --mem has room for the fewest
     * slots of it; --mem bounds the count. */
    uint64_t slot = o->slot_bytes > min_slot ? o->slot_bytes : min_slot;
    /* The tensors written transposed are held whole where --mem has room for
     * them beside a slot per worker; else their chunks read bands. */
    uint64_t cache_bytes = SOURCE_CACHE_ENTRIES * o->cached_source_bytes;
    if (o->cached_source_bytes && o->cached_source_bytes <= SOURCE_CACHE_MAX_BYTES &&
        for_slots >= cache_bytes + (uint64_t)(workers + PIPELINE_SPARE_SLOTS) * slot) {
        int code = source_cache_create(&p->sources, o->cached_source_bytes, path);
        if (code != NF4_OK) {
            pipeline_destroy(p);
            return code;
        }
        for_slots -= cache_bytes;
        p->mem_held += cache_bytes;
    }
    if (slot > min_slot && slot > for_slots / PIPELINE_MIN_SLOTS)
        slot = for_slots / PIPELINE_MIN_SLOTS > min_slot ? for_slots / PIPELINE_MIN_SLOTS : min_slot;
    slot = (slot + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    p->nslots = slot_count(workers, for_slots, slot);
    p->slot_bytes = slot;
    if (workers > p->nslots - 1)
        workers = p->nslots - 1;
    p->slots = calloc((size_t)p->nslots, sizeof *p->slots);
    p->workers = calloc((size_t)workers, sizeof *p->workers);
    if (!p->slots || !p->workers) {
        pipeline_destroy(p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    for (int i = 0; i < p->nslots; i++) {
        /* Plain chunks touch only chunk_bytes and a little more of a slot: the
         * rest is resident only for merges, or once pinned for the GPU. A
         * mapping of its own lets the GPU pin it where it lies, and pin_slots
         * keep it out of a fork without touching anything else. */
        void *arena = mmap(NULL, (size_t)p->slot_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        p->slots[i].arena = arena == MAP_FAILED ? NULL : arena;
        p->slots[i].parts = calloc(BATCH_MAX_PARTS, sizeof *p->slots[i].parts);
        if (!p->slots[i].arena || !p->slots[i].parts) {
            uint64_t mib = (p->slot_bytes * (uint64_t)p->nslots) >> 20; /* p is freed below */
            pipeline_destroy(p);
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory for %" PRIu64 " MiB of buffers", mib);
        }
    }
    for (int i = 0; i < workers; i++) {
        if (thread_create_blocking_signals(&p->workers[i], worker_main, p) != 0)
            break; /* fewer workers are slower, not wrong */
        p->nworkers++;
    }
    if (p->nworkers == 0) {
        pipeline_destroy(p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "cannot start a worker thread");
    }
    *out = p;
    return NF4_OK;
}

void pipeline_destroy(struct pipeline *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nworkers; i++)
        pthread_join(p->workers[i], NULL);
    free(p->workers);
    /* Page-locked slots stay as they are when the process is about to exit
     * and hand the device files over: the driver unlocks them there. */
    int keep_pinned = p->slots_pinned && handoff_at_exit();
    for (int i = 0; p->slots && i < p->nslots; i++) {
        free(p->slots[i].parts);
        if (!p->slots[i].arena || keep_pinned)
            continue;
        if (p->slots_pinned)
            gpu_host_unregister(p->gpu, p->slots[i].arena);
        munmap(p->slots[i].arena, (size_t)p->slot_bytes);
    }
    free(p->slots);
    source_cache_destroy(p->sources);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    for (int i = 0; i < PIPELINE_GPU_LANES; i++)
        pthread_mutex_destroy(&p->lane_mu[i]);
    free(p);
}
