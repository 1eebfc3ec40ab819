#include "pipeline.h"

#include <inttypes.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.h"
#include "fpconv.h"
#include "gpu.h"
#include "lora_merge.h"
#include "status.h"

/* TASK_MERGE: a chunk of a tensor with LoRA deltas, dequantized (or read) in the
 * weight's own dtype, then merged and rounded into the output dtype. */
enum task_kind { TASK_COPY, TASK_CAST, TASK_DEQUANT, TASK_MERGE, TASK_BATCH };

/* A whole small tensor travelling in a batch: a file of many tiny tensors
 * would otherwise pay a read, two thread handoffs and a write per tensor. */
struct part {
    const struct out_item *it;
    void *in, *out; /* the same for copies */
    uint64_t count; /* elements */
};

#define BATCH_MAX_PARTS 1024
/* Tensors whose input and output take at most 1/BATCH_SHARE of a slot are batched. */
#define BATCH_SHARE 8
enum slot_state { SLOT_FREE, SLOT_FILLED, SLOT_COMPUTED };

/* One chunk of one output tensor. */
struct task {
    const struct out_item *it;
    enum task_kind kind;
    void *in, *out;
    uint64_t count;    /* elements (cast), or bytes (copy) */
    size_t out_len;    /* bytes to write */
    int ends_tensor;
    struct part *parts; /* TASK_BATCH: whole tensors, outputs back to back from `out` */
    int nparts;
    struct dequant_job job;
    struct merge_job merge;
    float nested_code[NESTED_CODE_ENTRIES];
};

struct slot {
    unsigned char *arena;
    enum slot_state state;
    struct task task;
    struct part *parts; /* BATCH_MAX_PARTS */
};

struct pipeline {
    struct gpu_ctx *gpu;
    int threads;
    uint64_t slot_bytes;
    uint64_t max_chunk; /* elements; caps chunks below what a slot holds (tests use it) */
    struct convert_stats *stats;
    struct progress *progress;
    const char *path; /* the output, for messages */
    struct slot slots[PIPELINE_SLOTS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* per pipeline_write */
    struct st_writer *wr;
    const struct out_item *items;
    size_t n;
    uint64_t produced;
    int reader_done;
    int failed, fail_code;
    char fail_msg[1024];
};

#define ARENA_ALIGN 64u

static size_t align_up(size_t v)
{
    return (v + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
}

/* ---- failure shared between threads (each thread has its own error buffer) ---- */

static void pipeline_fail(struct pipeline *p, int code)
{
    pthread_mutex_lock(&p->mu);
    if (!p->failed) {
        p->failed = 1;
        p->fail_code = code;
        snprintf(p->fail_msg, sizeof p->fail_msg, "%s", nf4_last_error());
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Waits until slot `k` reaches `state`, or the run ends or fails. Returns the
 * slot, or NULL when the caller should stop. Called with mu unlocked. */
static struct slot *wait_slot(struct pipeline *p, uint64_t k, enum slot_state state, int producer)
{
    struct slot *s = &p->slots[k % PIPELINE_SLOTS];
    pthread_mutex_lock(&p->mu);
    while (!p->failed && s->state != state && (producer || !(p->reader_done && k == p->produced)))
        pthread_cond_wait(&p->cv, &p->mu);
    int go = !p->failed && s->state == state;
    pthread_mutex_unlock(&p->mu);
    return go ? s : NULL;
}

static void set_state(struct pipeline *p, struct slot *s, enum slot_state state)
{
    pthread_mutex_lock(&p->mu);
    s->state = state;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* ---- chunk planning ---- */

static unsigned elem_bytes(enum st_dtype dt)
{
    return dtype_bits(dt) / 8;
}

/* Largest chunk of a dequantized tensor that fits a slot, in elements. Chunks
 * start where a byte, a block and a nested block all start (see dequant.h). */
static uint64_t dequant_chunk(const struct pipeline *p, const struct out_item *it, uint64_t *align_out)
{
    const struct bnb_state *s = &it->w->state;
    uint64_t align = (uint64_t)s->blocksize * (s->nested ? s->nested_blocksize : 1);
    /* Per element: the output, half a packed byte, and at most 4 + 4 bytes of
     * scales per block of >= 32 elements: under one byte besides the output. */
    uint64_t per_element = elem_bytes(it->out.dtype) + 1;
    uint64_t fits = (p->slot_bytes - 4 * ARENA_ALIGN - 16) / per_element;
    uint64_t chunk = fits < p->max_chunk ? fits : p->max_chunk;
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

/* Largest chunk of a merged tensor that fits a slot, in elements: aligned as a
 * dequantized chunk when the base is 4-bit, any run of elements otherwise. */
static uint64_t merge_chunk(const struct pipeline *p, const struct out_item *it, uint64_t *align_out)
{
    const struct bnb_state *s = it->w ? &it->w->state : NULL;
    uint64_t align = s ? (uint64_t)s->blocksize * (s->nested ? s->nested_blocksize : 1) : 1;
    uint64_t total = s ? s->n : it->src->t->nelem;
    uint64_t cap = p->max_chunk < total ? p->max_chunk : total;
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

/* Reads a merge chunk: the base values in their own dtype (a dequantization
 * job when 4-bit, the stored values otherwise), then the factors; the output
 * goes after them. */
static int fill_merge(struct task *t, unsigned char *arena, const struct out_item *it, uint64_t e0, uint64_t cnt)
{
    struct merge_job *mj = &t->merge;
    size_t at = 0;
    int code;
    if (it->w) {
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
        at = align_up((size_t)(cnt * in_size));
    }
    t->out = arena + at;
    t->out_len = (size_t)(cnt * elem_bytes(it->out.dtype));
    at = align_up(at + t->out_len);
    mj->out = t->out;
    mj->out_dtype = it->out.dtype;
    return merge_read_factors(mj, it->lora, e0, cnt, arena + at);
}

/* ---- the three stages ---- */

/* Hands a filled slot to the compute stage. */
static void submit(struct pipeline *p, struct slot *s, uint64_t *k)
{
    pthread_mutex_lock(&p->mu);
    s->state = SLOT_FILLED;
    p->produced = ++*k;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void *reader_main(void *arg)
{
    struct pipeline *p = arg;
    uint64_t k = 0;
    /* The open batch: outputs grow from the arena's start without gaps (the
     * writer's dtype order keeps each one aligned to its element size), cast
     * inputs from its end. */
    struct slot *batch = NULL;
    size_t out_used = 0, in_low = 0;
    for (size_t i = 0; i < p->n; i++) {
        const struct out_item *it = &p->items[st_writer_order(p->wr, i)];
        enum task_kind kind = it->lora ? TASK_MERGE
                              : it->w  ? TASK_DEQUANT
                                       : (it->src->t->dtype == it->out.dtype ? TASK_COPY : TASK_CAST);
        if (kind == TASK_COPY || kind == TASK_CAST) {
            uint64_t in_bytes = st_tensor_bytes(it->src->t);
            uint64_t out_bytes = it->src->t->nelem * dtype_bits(it->out.dtype) / 8;
            size_t in_space = kind == TASK_CAST ? align_up((size_t)in_bytes) : 0;
            if (in_space + out_bytes <= p->slot_bytes / BATCH_SHARE) {
                if (batch && (batch->task.nparts == BATCH_MAX_PARTS || out_used + out_bytes + in_space > in_low)) {
                    submit(p, batch, &k);
                    batch = NULL;
                }
                if (!batch) {
                    if (!(batch = wait_slot(p, k, SLOT_FREE, 1)))
                        goto done;
                    batch->task = (struct task){.kind = TASK_BATCH, .out = batch->arena, .parts = batch->parts};
                    out_used = 0;
                    in_low = (size_t)p->slot_bytes / ARENA_ALIGN * ARENA_ALIGN;
                }
                struct part *part = &batch->task.parts[batch->task.nparts++];
                part->it = it;
                part->count = it->src->t->nelem;
                part->out = batch->arena + out_used;
                if (kind == TASK_CAST) {
                    in_low -= in_space;
                    part->in = batch->arena + in_low;
                } else {
                    part->in = part->out;
                }
                out_used += (size_t)out_bytes;
                batch->task.out_len = out_used;
                int code = st_read(it->src->file, it->src->t, 0, part->in, in_bytes);
                if (code != NF4_OK) {
                    pipeline_fail(p, code);
                    goto done;
                }
                continue;
            }
        }
        if (batch) {
            submit(p, batch, &k);
            batch = NULL;
        }
        uint64_t total, chunk;
        if (kind == TASK_DEQUANT || kind == TASK_MERGE) {
            uint64_t align;
            total = it->w ? it->w->state.n : it->src->t->nelem;
            chunk = kind == TASK_MERGE ? merge_chunk(p, it, &align) : dequant_chunk(p, it, &align);
            if (chunk == 0) {
                uint64_t need = kind == TASK_MERGE ? merge_chunk_bytes(it, align) : align * (elem_bytes(it->out.dtype) + 1);
                int code = nf4_fail(NF4_EUSAGE, it->w ? it->w->packed->file->path : it->src->file->path, it->out.name,
                                    "--mem is too small: one chunk of this tensor needs %" PRIu64 " MiB per slot",
                                    (need >> 20) + 1);
                pipeline_fail(p, code);
                break;
            }
        } else if (kind == TASK_COPY) {
            total = st_tensor_bytes(it->src->t);
            chunk = p->slot_bytes / ARENA_ALIGN * ARENA_ALIGN;
            if (p->max_chunk < chunk / 4)
                chunk = p->max_chunk * 4 < ARENA_ALIGN ? ARENA_ALIGN : p->max_chunk * 4;
        } else {
            total = it->src->t->nelem;
            chunk = (p->slot_bytes - 2 * ARENA_ALIGN) / (elem_bytes(it->src->t->dtype) + elem_bytes(it->out.dtype));
            if (chunk > p->max_chunk)
                chunk = p->max_chunk;
        }
        uint64_t pos = 0;
        do {
            uint64_t cnt = total - pos < chunk ? total - pos : chunk;
            struct slot *s = wait_slot(p, k, SLOT_FREE, 1);
            if (!s)
                goto done;
            struct task *t = &s->task;
            t->it = it;
            t->kind = kind;
            t->count = cnt;
            t->ends_tensor = pos + cnt == total;
            int code = NF4_OK;
            size_t used;
            if (kind == TASK_DEQUANT) {
                code = fill_dequant(t, s->arena, it, pos, cnt, it->out.dtype, &used);
            } else if (kind == TASK_MERGE) {
                code = fill_merge(t, s->arena, it, pos, cnt);
            } else if (kind == TASK_COPY) {
                t->in = t->out = s->arena;
                t->out_len = (size_t)cnt;
                code = st_read(it->src->file, it->src->t, pos, s->arena, cnt);
            } else {
                unsigned in_size = elem_bytes(it->src->t->dtype);
                t->in = s->arena;
                t->out = s->arena + align_up((size_t)(cnt * in_size));
                t->out_len = (size_t)(cnt * elem_bytes(it->out.dtype));
                code = st_read(it->src->file, it->src->t, pos * in_size, t->in, cnt * in_size);
            }
            if (code != NF4_OK) {
                pipeline_fail(p, code);
                goto done;
            }
            submit(p, s, &k);
            pos += cnt;
        } while (pos < total);
    }
    if (batch)
        submit(p, batch, &k);
done:
    pthread_mutex_lock(&p->mu);
    p->reader_done = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void *writer_main(void *arg)
{
    struct pipeline *p = arg;
    for (uint64_t k = 0;; k++) {
        struct slot *s = wait_slot(p, k, SLOT_COMPUTED, 0);
        if (!s)
            break;
        int code = st_writer_write(p->wr, s->task.out, s->task.out_len);
        if (code != NF4_OK) {
            pipeline_fail(p, code);
            break;
        }
        if (p->progress)
            progress_add(p->progress, s->task.out_len,
                         s->task.kind == TASK_BATCH ? (uint64_t)s->task.nparts : (uint64_t)s->task.ends_tensor);
        set_state(p, s, SLOT_FREE);
    }
    return NULL;
}

/* Returns how many finite values became infinite. */
static uint64_t cast_elements(enum st_dtype from, enum st_dtype to, const void *in, void *out, uint64_t count)
{
    uint64_t overflowed = 0;
    for (uint64_t i = 0; i < count; i++) {
        float f = f32_from_element(from, in, i);
        int finite;
        if (from == DT_F64) {
            double d = ((const double *)in)[i];
            finite = d - d == 0;
        } else {
            finite = f - f == 0;
        }
        uint32_t bits;
        int inf;
        switch (to) {
        case DT_F16:
            bits = f32_to_f16(f);
            ((uint16_t *)out)[i] = (uint16_t)bits;
            inf = (bits & 0x7fffu) == 0x7c00u;
            break;
        case DT_BF16:
            bits = f32_to_bf16(f);
            ((uint16_t *)out)[i] = (uint16_t)bits;
            inf = (bits & 0x7fffu) == 0x7f80u;
            break;
        default:
            ((float *)out)[i] = f;
            inf = (f32_bits(f) & 0x7fffffffu) == 0x7f800000u;
            break;
        }
        if (inf && finite)
            overflowed++;
    }
    return overflowed;
}

/* A tensor's last bytes are computed: count it and report overflows of its cast. */
static void finish_tensor(struct pipeline *p, const struct out_item *it, uint64_t overflowed)
{
    const struct model_tensor *src = it->w ? it->w->packed : it->src;
    if (overflowed) {
        if (it->lora)
            nf4_warn("%s: %s: %" PRIu64 " finite values overflowed to inf when the LoRA delta was merged into %s",
                     src->file->path, it->out.name, overflowed, dtype_name(it->out.dtype));
        else
            nf4_warn("%s: %s: %" PRIu64 " finite values overflowed to inf when cast from %s to %s",
                     it->src->file->path, it->src->t->name, overflowed, dtype_name(it->src->t->dtype),
                     dtype_name(it->out.dtype));
        p->stats->overflowed += overflowed;
    }
    p->stats->tensors++;
    if (it->lora)
        p->stats->merged++;
    p->stats->bytes_in += st_tensor_bytes(src->t);
    if (it->w) {
        p->stats->dequantized++;
        p->stats->bytes_in += st_tensor_bytes(it->w->absmax->t) +
                              (it->w->state.nested ? st_tensor_bytes(it->w->nested_absmax->t) : 0);
    }
}

static int compute(struct pipeline *p, struct task *t, uint64_t *tensor_overflow)
{
    const struct out_item *it = t->it;
    int code = NF4_OK;
    switch (t->kind) {
    case TASK_BATCH:
        for (int i = 0; i < t->nparts; i++) {
            const struct part *part = &t->parts[i];
            uint64_t overflowed = 0;
            if (part->in != part->out)
                overflowed = cast_elements(part->it->src->t->dtype, part->it->out.dtype, part->in, part->out,
                                           part->count);
            finish_tensor(p, part->it, overflowed);
        }
        return NF4_OK;
    case TASK_DEQUANT:
        if (p->gpu)
            code = gpu_dequant(p->gpu, &t->job);
        else
            dequant_cpu(&t->job, p->threads);
        break;
    case TASK_MERGE:
        if (p->gpu && t->merge.w_dtype != DT_F64) {
            /* One fused kernel: the dequantized base never leaves the device. */
            uint64_t overflowed = 0;
            code = gpu_merge(p->gpu, it->w ? &t->job : NULL, &t->merge, &overflowed);
            *tensor_overflow += overflowed;
        } else {
            if (it->w)
                dequant_cpu(&t->job, p->threads);
            *tensor_overflow += merge_cpu(&t->merge, p->threads);
        }
        break;
    case TASK_CAST:
        *tensor_overflow += cast_elements(it->src->t->dtype, it->out.dtype, t->in, t->out, t->count);
        break;
    case TASK_COPY:
        break;
    }
    if (t->ends_tensor) {
        finish_tensor(p, it, *tensor_overflow);
        *tensor_overflow = 0;
    }
    return code;
}

int pipeline_write(struct pipeline *p, struct st_writer *wr, const struct out_item *items, size_t n)
{
    p->wr = wr;
    p->items = items;
    p->n = n;
    p->produced = 0;
    p->reader_done = 0;
    p->failed = 0;
    for (int i = 0; i < PIPELINE_SLOTS; i++)
        p->slots[i].state = SLOT_FREE;
    pthread_t reader, writer;
    if (pthread_create(&reader, NULL, reader_main, p) != 0)
        return nf4_fail(NF4_ESOFTWARE, p->path, NULL, "cannot start the reader thread");
    if (pthread_create(&writer, NULL, writer_main, p) != 0) {
        pipeline_fail(p, nf4_fail(NF4_ESOFTWARE, p->path, NULL, "cannot start the writer thread"));
        pthread_join(reader, NULL);
        return p->fail_code;
    }
    uint64_t overflow = 0;
    for (uint64_t k = 0;; k++) {
        struct slot *s = wait_slot(p, k, SLOT_FILLED, 0);
        if (!s)
            break;
        int code = compute(p, &s->task, &overflow);
        if (code != NF4_OK) {
            pipeline_fail(p, code);
            break;
        }
        set_state(p, s, SLOT_COMPUTED);
    }
    pthread_join(reader, NULL);
    pthread_join(writer, NULL);
    if (p->failed)
        return nf4_fail(p->fail_code, NULL, NULL, "%s", p->fail_msg);
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

int pipeline_create(struct pipeline **out, const char *path, struct gpu_ctx *gpu, int threads, uint64_t mem_bytes,
                    uint64_t max_chunk_elements, struct convert_stats *stats, struct progress *progress)
{
    *out = NULL;
    struct pipeline *p = calloc(1, sizeof *p);
    if (!p)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    p->gpu = gpu;
    p->path = path;
    p->threads = threads;
    p->stats = stats;
    p->progress = progress;
    p->max_chunk = max_chunk_elements ? max_chunk_elements : UINT64_MAX;
    /* --mem bounds the whole process: the slots get what is left after what it
     * already holds (the CUDA runtime alone is ~120 MB once a device is open). */
    uint64_t held = resident_bytes() + PIPELINE_RESERVE_BYTES;
    uint64_t for_slots = mem_bytes > held ? mem_bytes - held : 0;
    p->slot_bytes = for_slots / PIPELINE_SLOTS / ARENA_ALIGN * ARENA_ALIGN;
    if (p->slot_bytes < PIPELINE_MIN_SLOT_BYTES)
        p->slot_bytes = PIPELINE_MIN_SLOT_BYTES;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < PIPELINE_SLOTS; i++) {
        p->slots[i].arena = gpu ? gpu_host_alloc(gpu, (size_t)p->slot_bytes) : malloc((size_t)p->slot_bytes);
        p->slots[i].parts = calloc(BATCH_MAX_PARTS, sizeof *p->slots[i].parts);
        if (!p->slots[i].arena || !p->slots[i].parts) {
            uint64_t mib = (p->slot_bytes * PIPELINE_SLOTS) >> 20; /* p is freed below */
            pipeline_destroy(p);
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory for %" PRIu64 " MiB of buffers", mib);
        }
    }
    *out = p;
    return NF4_OK;
}

void pipeline_destroy(struct pipeline *p)
{
    if (!p)
        return;
    for (int i = 0; i < PIPELINE_SLOTS; i++) {
        free(p->slots[i].parts);
        if (!p->slots[i].arena)
            continue;
        if (p->gpu)
            gpu_host_free(p->gpu, p->slots[i].arena);
        else
            free(p->slots[i].arena);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
