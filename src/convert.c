#include "convert.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bnb_state.h"
#include "conv1d_layout.h"
#include "cpu_path.h"
#include "exit_handoff.h"
#include "expert_layout.h"
#include "fileio.h"
#include "gpu_start.h"
#include "layout.h"
#include "lora.h"
#include "mapped_writer.h"
#include "model.h"
#include "model_dir.h"
#include "out_lock.h"
#include "resume.h"
#include "pipeline.h"
#include "pipeline_lora.h"
#include "progress.h"
#include "safetensors.h"
#include "safetensors_writer.h"
#include "source_cache.h"
#include "status.h"
#include "strutil.h"
#include "tokenizer_files.h"
#include "convert_internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "nf4deq reads safetensors data in place and needs a little-endian host"
#endif

void convert_opts_init(struct convert_opts *o)
{
    memset(o, 0, sizeof *o);
    o->dtype = DT_INVALID;
    o->device = DEVICE_AUTO;
    o->progress = PROGRESS_AUTO;
}

/* ---- planning and writing one output file ---- */

/* Points an item at what an adapter does to its tensor: a replacement
 * (modules_to_save, a trained bias, a saved base layer) becomes the item's
 * source (cast to the dtype the base would have had), and LoRA terms are
 * merged into the source, or trained token rows put in it. */
static void plan_lora(struct out_item *it, const struct lora_target *t)
{
    if (!t)
        return;
    if (t->replace && t->nterms)
        it->round_src_to = it->w ? it->w->state.dtype : it->src->t->dtype;
    if (t->replace) {
        it->w = NULL;
        it->src = t->replace;
        /* The base's shape, but for an embedding layer of a resized vocabulary. */
        it->out.ndim = t->replace->t->ndim;
        it->out.shape = t->replace->t->shape;
    }
    if (t->nterms || t->tokens)
        it->lora = t;
}

/* The item that reads base tensor t (a 4-bit weight or not) into `name`. */
static void plan_base_tensor(struct out_item *it, const char *name, const struct model *m, const struct st_tensor *t,
                             const struct bnb_weight *weights, size_t nweights, enum st_dtype dtype)
{
    it->out.name = name;
    it->round_src_to = DT_INVALID;
    const struct bnb_weight *w = bnb_find(weights, nweights, t->name);
    if (w) {
        it->w = w;
        it->out.dtype = dtype != DT_INVALID ? dtype : w->state.dtype;
        it->out.ndim = w->state.ndim;
        it->out.shape = w->state.shape;
    } else {
        it->src = model_find(m, t->name);
        it->out.dtype = (dtype != DT_INVALID && dtype_is_castable_float(t->dtype)) ? dtype : t->dtype;
        it->out.ndim = t->ndim;
        it->out.shape = t->shape;
    }
}

/* ---- weights written transposed (expert_layout.h, conv1d_layout.h) ---- */

/* What an adapter does to weight `mt` ([R, C]), written transposed, [C, R]
 * (`where`: into what): rows and columns swapped, and each term's delta
 * transposed, as on a layer stored [in, out] (fan_in_fan_out). */
static int flip_target(const struct lora_target *t, const struct model_tensor *mt, const char *where,
                       struct lora_target *out)
{
    *out = *t;
    for (size_t i = 0; i < t->nterms; i++) {
        const struct lora_term *x = &t->terms[i];
        if (x->magnitude || x->embedding || x->b_col_step || x->bias || x->kron.w1)
            return nf4_fail(NF4_EDATA, x->a->file->path, x->a->t->name,
                            "a %s on %s, a weight nf4deq writes transposed (%s): only plain LoRA pairs merge there",
                            x->magnitude ? "DoRA pair" : x->kron.w1 ? "LoKr" : "LoRA term of another kind",
                            mt->t->name, where);
        out->terms[i].fan_in_fan_out = !x->fan_in_fan_out;
    }
    if (t->tokens)
        return nf4_fail(NF4_EDATA, mt->file->path, mt->t->name, "trained token rows on a weight written transposed");
    out->rows = t->cols;
    out->cols = t->rows;
    return NF4_OK;
}

/* A replacement of weight `mt` (its rows and cols as stored) that it is
 * written transposed cannot hold: another shape than the weight's. */
static int check_replacement(const struct lora_target *t, const struct model_tensor *mt, size_t ndim, uint64_t rows,
                             uint64_t cols, const char *where)
{
    if (!t || !t->replace)
        return NF4_OK;
    const struct st_tensor *r = t->replace->t;
    if (r->ndim == ndim && r->shape[0] == rows && (ndim == 1 || r->shape[1] == cols))
        return NF4_OK;
    return nf4_fail(NF4_EDATA, t->replace->file->path, r->name, "replaces %s with a tensor of another shape, which %s "
                    "cannot hold", mt->t->name, where);
}

/* ---- GPT-2's Conv1D weights, transposed back (conv1d_layout.h) ---- */

#define CONV1D_WHERE "[in, out], as GPT-2's Conv1D loads it"

int convert_plan_conv1d(struct conv1d_layout *x, const struct model *m, const struct bnb_weight *weights,
                        size_t nweights, const struct lora_set *lora, enum st_dtype dtype,
                        uint64_t *cached_source_bytes)
{
    for (size_t i = 0; x && i < x->n; i++) {
        struct conv1d_weight *cw = &x->weights[i];
        const struct model_tensor *mt = model_find(m, cw->w->name);
        struct out_item *it = &cw->item;
        plan_base_tensor(it, mt->t->name, m, mt->t, weights, nweights, dtype);
        const struct lora_target *t = lora_find(lora, mt->t->name);
        int code = check_replacement(t, mt, 2, cw->shape[1], cw->shape[0], CONV1D_WHERE);
        if (code == NF4_OK && t)
            code = flip_target(t, mt, CONV1D_WHERE, &cw->flipped);
        if (code != NF4_OK)
            return code;
        plan_lora(it, t ? &cw->flipped : NULL);
        it->transposed = 1;
        it->out.shape = cw->shape;
        if (it->w && source_cache_entry_bytes(it->w) > *cached_source_bytes)
            *cached_source_bytes = source_cache_entry_bytes(it->w);
    }
    return NF4_OK;
}

/* ---- gpt-oss's experts, fused (expert_layout.h) ---- */

#define EXPERTS_WHERE "into the fused experts, from Unsloth's per-expert layout"

/* Expert e's part of fused tensor f: its tensor as any other is planned, with
 * its adapter's changes, and for a weight transposed. */
static int plan_expert_part(struct fused_experts *f, size_t e, const struct model *m, const struct bnb_weight *weights,
                            size_t nweights, const struct lora_set *lora, enum st_dtype dtype)
{
    const struct model_tensor *mt = f->sources[e];
    struct out_item *part = &f->parts[e];
    plan_base_tensor(part, mt->t->name, m, mt->t, weights, nweights, dtype);
    const struct lora_target *t = lora_find(lora, mt->t->name);
    int code = f->bias ? check_replacement(t, mt, 1, f->part_shape[0], 0, "its fused experts")
                       : check_replacement(t, mt, 2, f->part_shape[1], f->part_shape[0], "its fused experts");
    if (code == NF4_OK && t && !f->bias) {
        code = flip_target(t, mt, EXPERTS_WHERE, &f->flipped[e]);
        t = &f->flipped[e];
    }
    if (code != NF4_OK)
        return code;
    plan_lora(part, t);
    part->transposed = !f->bias;
    part->out.ndim = f->bias ? 1 : 2;
    part->out.shape = f->part_shape;
    if (part->out.dtype != f->parts[0].out.dtype)
        return nf4_fail(NF4_EDATA, mt->file->path, mt->t->name,
                        "is %s, and expert 0's part of %s is %s: experts fused into one tensor take one dtype "
                        "(give --dtype)", dtype_name(part->out.dtype), f->name, dtype_name(f->parts[0].out.dtype));
    return NF4_OK;
}

int convert_plan_experts(struct expert_layout *x, const struct model *m, const struct bnb_weight *weights,
                         size_t nweights, const struct lora_set *lora, enum st_dtype dtype,
                         uint64_t *cached_source_bytes)
{
    for (size_t i = 0; x && i < x->nfused; i++) {
        struct fused_experts *f = &x->fused[i];
        f->parts = calloc(f->nexperts, sizeof *f->parts);
        f->flipped = f->bias ? NULL : calloc(f->nexperts, sizeof *f->flipped);
        if (!f->parts || (!f->bias && !f->flipped))
            return nf4_fail(NF4_ESOFTWARE, f->sources[0]->file->path, f->name, "out of memory");
        for (size_t e = 0; e < f->nexperts; e++) {
            int code = plan_expert_part(f, e, m, weights, nweights, lora, dtype);
            if (code != NF4_OK)
                return code;
            const struct bnb_weight *w = f->parts[e].w;
            if (w && !f->bias && source_cache_entry_bytes(w) > *cached_source_bytes)
                *cached_source_bytes = source_cache_entry_bytes(w);
        }
        f->item = (struct out_item){.out = {f->name, f->parts[0].out.dtype, f->ndim, f->shape},
                                    .round_src_to = DT_INVALID, .parts = f->parts, .nparts = f->nexperts};
    }
    return NF4_OK;
}

int convert_plan_file(const struct model *m, size_t file_index, const struct bnb_weight *weights, size_t nweights,
                      const struct lora_set *lora, const struct expert_layout *experts,
                      const struct conv1d_layout *conv1d, enum st_dtype dtype, struct out_item **items_out,
                      size_t *n_out)
{
    const struct st_file *f = m->files[file_index];
    struct out_item *items = calloc(f->count + 1, sizeof *items); /* + an untied head */
    if (!items)
        return nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < f->count; i++) {
        const struct st_tensor *t = &f->tensors[i];
        if (bnb_is_state_part(t->name))
            continue;
        /* An expert's tensor goes into its fused tensor, written where expert 0's is. */
        const struct fused_experts *fused;
        const char *renamed;
        size_t expert;
        expert_layout_lookup(experts, t->name, &fused, &expert, &renamed);
        if (fused) {
            if (expert == 0 && fused->sources[0]->file_index == file_index)
                items[n++] = fused->item;
            continue;
        }
        const struct conv1d_weight *cw = conv1d_layout_lookup(conv1d, t->name);
        if (cw) {
            items[n++] = cw->item;
            continue;
        }
        struct out_item *it = &items[n++];
        plan_base_tensor(it, renamed ? renamed : t->name, m, t, weights, nweights, dtype);
        plan_lora(it, lora_find(lora, t->name));
        /* The head parted from its embedding starts from the embedding as the
         * base stores it, in the same file, and takes the head's own changes. */
        if (lora && lora->untied_embedding && strcmp(t->name, lora->untied_embedding) == 0) {
            struct out_item *head = &items[n++];
            plan_base_tensor(head, TIED_HEAD_NAME, m, t, weights, nweights, dtype);
            plan_lora(head, lora_find(lora, TIED_HEAD_NAME));
        }
    }
    *items_out = items;
    *n_out = n;
    return NF4_OK;
}

/* Every file of the model as it was opened: a shard truncated, grown or
 * rewritten while it was read would make this output a mix of two inputs. */
static int check_inputs_unchanged(const struct model *m)
{
    for (size_t i = 0; i < m->nfiles; i++) {
        int code = st_check_unchanged(m->files[i]);
        if (code != NF4_OK)
            return code;
    }
    return NF4_OK;
}

int convert_write_file(struct ctx *c, const char *path, const struct out_item *items, size_t n,
                       const struct model *m, size_t file_index, uint64_t *bytes_written)
{
    const struct st_file *meta_from = m->files[file_index];
    struct st_out_tensor *outs = calloc(n ? n : 1, sizeof *outs);
    if (!outs)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < n; i++)
        outs[i] = items[i].out;
    struct st_writer *wr;
    int code = c->to_stdout ? st_writer_begin_stream(&wr, STDOUT_FILENO, path, outs, n, meta_from->meta, meta_from->nmeta)
                            : st_writer_begin(&wr, path, outs, n, meta_from->meta, meta_from->nmeta);
    free(outs);
    if (code != NF4_OK)
        return code;
    code = pipeline_write(c->pipeline, wr, items, n);
    *bytes_written = st_writer_total_bytes(wr);
    if (code == NF4_OK)
        code = check_inputs_unchanged(m);
    if (code == NF4_OK)
        return st_writer_finish(wr);
    st_writer_abort(wr);
    return code;
}

/* The shapes were overflow-checked when the input was read. */
uint64_t out_item_elements(const struct out_item *it)
{
    uint64_t nelem = 1;
    for (size_t d = 0; d < it->out.ndim; d++)
        nelem *= it->out.shape[d];
    return nelem;
}

uint64_t out_items_bytes(const struct out_item *items, size_t n)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += out_item_elements(&items[i]) * dtype_bits(items[i].out.dtype) / 8;
    return total;
}

/* ---- engine ---- */

static int online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int open_device(struct ctx *c, const char *out);

/* Without --threads: every core for merges, whose arithmetic is the limit,
 * and where 4-bit weights are written transposed (Unsloth's gpt-oss experts,
 * expert_layout.h; GPT-2's Conv1D, conv1d_layout.h), whose gathering and
 * placing are: on the H200 host into
 * tmpfs 16 threads wrote four gpt-oss-20b layers in 1.81 s, 8 in 2.34 s
 * (docs/PERFORMANCE.md, "Unsloth's gpt-oss experts, fused"); for plain
 * conversions at most PLAIN_THREADS. Four vector-kernel threads
 * outrun one writer, and more only evict the chunks that wait to be written
 * from the caches (measured: docs/PERFORMANCE.md). Where the workers place
 * their chunks in the output themselves (mapped_writer.h: on tmpfs), each
 * copy faults in fresh pages and the copies scale to MAPPED_PLAIN_THREADS. */
#define PLAIN_THREADS 4
#define MAPPED_PLAIN_THREADS 8
static int default_threads(const struct ctx *c, const char *out)
{
    int cores = online_cores();
    if (c->merging || c->cached_source_bytes)
        return cores;
    int plain = PLAIN_THREADS;
    char *dir = c->to_stdout ? NULL : strdup(out);
    if (dir && mapped_writer_wanted(-1, dirname(dir), MAPPED_PLAIN_THREADS))
        plain = MAPPED_PLAIN_THREADS;
    free(dir);
    return cores < plain ? cores : plain;
}

void convert_want_slots(struct ctx *c, const struct out_item *items, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t want = pipeline_slot_bytes_wanted(&items[i]);
        if (want > c->slot_bytes_wanted)
            c->slot_bytes_wanted = want;
    }
}

int convert_open_engine(struct ctx *c, const char *out, uint64_t tensors, uint64_t bytes)
{
    int code = open_device(c, out);
    if (code != NF4_OK)
        return code;
    uint64_t mem = c->opts->mem ? c->opts->mem : DEFAULT_MEM_BYTES;
    struct pipeline_opts po = {
        .threads = c->threads,
        .mem_bytes = mem,
        .max_chunk_elements = c->opts->chunk_elements,
        .merging = c->merging,
        .cpu_path = c->cpu_path,
        .gpu_start = c->gpu_start,
        .require_gpu = c->opts->device == DEVICE_CUDA,
        .cached_source_bytes = c->cached_source_bytes,
        .slot_bytes = c->slot_bytes_wanted,
    };
    code = pipeline_create(&c->pipeline, out, &po, c->stats, &c->progress);
    if (code == NF4_OK)
        progress_start(&c->progress, c->opts->progress, tensors, bytes);
    return code;
}

/* A merge --device auto gives the GPU: its merged elements mostly 4-bit, and
 * their mean rank (summed over adapters), scaled to MERGE_RANK_CORES of the
 * CPU's threads, at least MERGE_GPU_RANK. Measured on the H200 host, 16
 * cores, into tmpfs (docs/PERFORMANCE.md, "Which engine merges faster"): on a
 * 4-bit base the GPU is the faster at r = 64 (1.07x; 1.26x on all 32 layers
 * of Llama-3-8B) and the CPU at r = 16 (1.17x); on 16-bit weights (a LoRA on
 * MoE experts) the CPU at both (1.35x at r = 16, 1.15x at r = 64): their
 * 16-bit values cross to the device and back, where a 4-bit weight's quarter
 * does. The CPU's arithmetic scales with its threads, so fewer of them move
 * the line down in rank. */
#define MERGE_GPU_RANK 48.0
#define MERGE_RANK_CORES 16.0
static int merge_wants_gpu(const struct ctx *c)
{
    if (c->merge_elements <= 0 || 2 * c->merge_4bit_elements < c->merge_elements)
        return 0;
    const double mean_rank = c->merge_rank_elements / c->merge_elements;
    return mean_rank * MERGE_RANK_CORES / (c->threads > 0 ? c->threads : 1) >= MERGE_GPU_RANK;
}

/* --device auto takes the GPU where it is the faster engine: for LoRA merges
 * whose arithmetic (2 x rank flops per element) is the CPU's limit
 * (merge_wants_gpu), and where this processor has only the scalar kernel. A
 * plain conversion with a vector kernel stays on the CPU: a few cores already
 * compute faster than the chunks can be copied into the page cache, which both
 * engines do on the CPU, and the GPU would add its start (0.2-0.3 s on a spare
 * core, which still slows the conversion) and a device round trip per chunk:
 * 1.04-1.07x the CPU's time into tmpfs, most of it the opening of CUDA itself
 * (docs/PERFORMANCE.md, "What the GPU path pays for CUDA into tmpfs"). */
static int auto_wants_gpu(const struct ctx *c)
{
    return (c->merging && merge_wants_gpu(c)) || c->cpu_path == CPU_PATH_SCALAR;
}

void convert_note_merge(struct ctx *c, const struct lora_set *s, const struct bnb_weight *weights, size_t nweights)
{
    for (size_t i = 0; s && i < s->ntargets; i++) {
        const struct lora_target *t = &s->targets[i];
        /* A LoKr's term is one product per element (lora_merge.h): it merges
         * elements, and adds no rank. */
        double rank = 0;
        for (size_t k = 0; k < t->nterms; k++)
            rank += t->terms[k].kron.w1 ? 0 : t->terms[k].r;
        if (t->nterms == 0)
            continue; /* a replacement or trained token rows: no arithmetic */
        const double elements = (double)t->rows * (double)t->cols;
        c->merge_elements += elements;
        c->merge_rank_elements += elements * rank;
        if (bnb_find(weights, nweights, t->name))
            c->merge_4bit_elements += elements;
    }
}

/* The CPU, or the GPU opened on a thread of its own while the pipeline starts
 * on the CPU (see pipeline.h): the fixed cost of starting CUDA never delays
 * the conversion. */
static int open_device(struct ctx *c, const char *out)
{
    const struct convert_opts *o = c->opts;
    c->threads = o->threads > 0 ? o->threads : default_threads(c, out);
    if (o->device == DEVICE_CPU || (o->device == DEVICE_AUTO && !auto_wants_gpu(c)))
        return NF4_OK;
    return gpu_start_begin(&c->gpu_start, o->gpu_mem);
}

void convert_close_engine(struct ctx *c)
{
    if (c->pipeline) {
        pipeline_destroy(c->pipeline);
        progress_finish(&c->progress);
    }
    c->pipeline = NULL;
    gpu_start_free(c->gpu_start); /* waits for a start still under way */
    c->gpu_start = NULL;
}

/* ---- file and directory conversions ---- */

int convert_open_lora(struct ctx *c, const struct model *m, const struct bnb_weight *weights, size_t nweights)
{
    if (c->opts->nlora == 0)
        return NF4_OK;
    int code = lora_open(&c->lora, c->opts->lora_dirs, c->opts->nlora, m, weights, nweights);
    c->merging = code == NF4_OK;
    if (code == NF4_OK)
        convert_note_merge(c, c->lora, weights, nweights);
    if (code == NF4_OK && c->lora->untied_embedding && !model_tie_flag_ties_more(c->lora->untied_embedding))
        nf4_note("%s: the adapters part %s from %s, which the base ties it to: the output has both, and its "
                 "config.json says tie_word_embeddings: false", m->dir, TIED_HEAD_NAME, c->lora->untied_embedding);
    else if (code == NF4_OK && c->lora->untied_embedding)
        nf4_note("%s: the adapters part %s from %s, which the base ties it to: the output has both, and its "
                 "config.json keeps tie_word_embeddings, which ties the encoder's and decoder's embeddings to %s "
                 "too; transformers 5 loads the two apart (and warns that they differ)", m->dir, TIED_HEAD_NAME,
                 c->lora->untied_embedding, c->lora->untied_embedding);
    return code;
}

void convert_warn_if_nothing_to_do(const struct ctx *c, const char *in, size_t nweights, int as_is)
{
    if (nweights == 0 && c->opts->nlora == 0)
        nf4_warn("%s: no bitsandbytes 4-bit weights, so nothing to dequantize: tensors are %s", in,
                 c->opts->dtype != DT_INVALID && !as_is ? "cast to --dtype or copied" : "copied as they are");
}

static int convert_file(struct ctx *c, const char *in, const char *out)
{
    struct model *m;
    int code = model_open_file(in, &m);
    if (code != NF4_OK)
        return code;
    struct bnb_weight *weights = NULL;
    size_t nweights = 0;
    struct out_item *items = NULL;
    size_t n = 0;
    uint64_t written = 0;
    if ((code = bnb_collect(m, &weights, &nweights)) == NF4_OK)
        convert_warn_if_nothing_to_do(c, in, nweights, 0);
    /* A GPT-2's Conv1D weights go by the config.json beside the file. */
    struct conv1d_layout *conv1d = NULL;
    if (code == NF4_OK && (code = convert_open_lora(c, m, weights, nweights)) == NF4_OK &&
        (code = conv1d_layout_find(in, m, weights, nweights, &conv1d)) == NF4_OK &&
        (code = convert_plan_conv1d(conv1d, m, weights, nweights, c->lora, c->opts->dtype,
                                    &c->cached_source_bytes)) == NF4_OK)
        code = convert_plan_file(m, 0, weights, nweights, c->lora, NULL, conv1d, c->opts->dtype, &items, &n);
    if (code == NF4_OK)
        convert_want_slots(c, items, n);
    if (code == NF4_OK && (code = convert_open_engine(c, out, n, out_items_bytes(items, n))) == NF4_OK) {
        /* A file that lies among others' may sit beside the wrong config.json:
         * the user hears which one decided. */
        if (conv1d)
            nf4_note("%s: %zu Conv1D weight%s written transposed, [in, out], as GPT-2 loads %s: the config.json "
                     "beside it names a GPT-2 architecture", in, conv1d->n, conv1d->n == 1 ? "" : "s",
                     conv1d->n == 1 ? "it" : "them");
        code = convert_write_file(c, out, items, n, m, 0, &written);
    }
    c->stats->bytes_out += written;
    conv1d_layout_free(conv1d);
    free(items);
    bnb_free(weights, nweights);
    model_close(m);
    return code;
}

/* 1 if `inner` is `outer` or lies below it (both must exist). */
static int path_is_within(const char *inner, const char *outer)
{
    char a[PATH_MAX], b[PATH_MAX];
    if (!realpath(inner, a) || !realpath(outer, b))
        return 0;
    size_t n = strlen(b);
    return strncmp(a, b, n) == 0 && (a[n] == '\0' || a[n] == '/' || (n == 1 && b[0] == '/'));
}

/* 1 if standard output (out_st) is `path` or, for a folder, one of the files
 * in it (an adapter's adapter_model.safetensors, opened with 1<> or >>). */
static int stdout_is_within(const char *path, const struct stat *out_st)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    if (!S_ISDIR(st.st_mode))
        return st.st_dev == out_st->st_dev && st.st_ino == out_st->st_ino;
    char **names;
    size_t n;
    if (dir_names(path, &names, &n) != 0)
        return 0;
    int found = 0;
    for (size_t i = 0; i < n && !found; i++) {
        char *p = path_join(path, names[i]);
        found = p && stat(p, &st) == 0 && st.st_dev == out_st->st_dev && st.st_ino == out_st->st_ino;
        free(p);
    }
    dir_names_free(names, n);
    return found;
}

/* OUT is "-": a single file streams to standard output, which must be open
 * and not a terminal. */
static int check_stdout_output(enum input_layout layout, const char *in, const struct convert_opts *o)
{
    if (layout != LAYOUT_FILE)
        return nf4_fail(NF4_EUSAGE, in, NULL, "is a directory, so OUT must be a directory too: only a single file's "
                        "output can go to standard output (-)");
    if (std_stream_was_closed(STDOUT_FILENO))
        return nf4_fail(NF4_EIO, NULL, NULL, "standard output is closed");
    if (isatty(STDOUT_FILENO))
        return nf4_fail(NF4_EUSAGE, NULL, NULL, "refusing to write safetensors data to a terminal: redirect standard "
                        "output, or give OUT");
    /* "convert IN - 1<>IN" or ">> IN": the shell opened the input for writing. */
    struct stat in_st, out_st;
    if (fstat(STDOUT_FILENO, &out_st) != 0)
        return NF4_OK; /* writing to it says what is wrong */
    if (stat(in, &in_st) == 0 && in_st.st_dev == out_st.st_dev && in_st.st_ino == out_st.st_ino)
        return nf4_fail(NF4_EUSAGE, in, NULL, "is also standard output; refusing to overwrite the input");
    for (size_t i = 0; i < o->nlora; i++)
        if (stdout_is_within(o->lora_dirs[i], &out_st))
            return nf4_fail(NF4_EUSAGE, o->lora_dirs[i], NULL, "is, or holds, standard output; refusing to overwrite "
                            "the adapter");
    return NF4_OK;
}

/* The output is renamed into place, so what stands at OUT is replaced, never
 * written through: only a regular file or a directory may be. A link would
 * give way to the output (perhaps on another disk than the one it led to),
 * and a device or FIFO is no place for a checkpoint. */
static int check_replaceable(const char *out, const struct stat *entry)
{
    if (S_ISLNK(entry->st_mode))
        return nf4_fail(NF4_ECANTCREAT, out, NULL, "is a symbolic link, which nf4deq would replace, not write "
                        "through: remove it, or give the path it leads to");
    if (!S_ISREG(entry->st_mode) && !S_ISDIR(entry->st_mode))
        return nf4_fail(NF4_ECANTCREAT, out, NULL, "is not a regular file or a directory (a device, FIFO or "
                        "socket), which nf4deq would replace; for standard output, give -");
    return NF4_OK;
}

/* "." and ".." cannot be renamed over. */
static int names_dot_entry(const char *path)
{
    const char *last = strrchr(path, '/');
    last = last ? last + 1 : path;
    return strcmp(last, ".") == 0 || strcmp(last, "..") == 0;
}

/* OUT against one more input, "WHAT INPUT GIVEN" (the adapter ... given to
 * --lora, the --tokenizer folder ...): exit 2 where OUT is it, holds it, or
 * lies in its folder. */
static int check_out_spares(const char *out, const char *input, const char *what, const char *given)
{
    const int holds = path_is_within(input, out), inside = path_is_within(out, input);
    if (!holds && !inside)
        return NF4_OK;
    return nf4_fail(NF4_EUSAGE, out, NULL, "%s %s %s%s; refusing to replace it",
                    holds && inside ? "is" : holds ? "contains" : "is inside", what, input, given);
}

/* --force replaces OUT whole, so an adapter or --tokenizer folder that is
 * OUT, or lies inside it, would go with it: they are inputs as IN is. */
static int check_out_spares_other_inputs(const char *out, const struct convert_opts *o)
{
    int code = NF4_OK;
    for (size_t i = 0; i < o->nlora && code == NF4_OK; i++)
        code = check_out_spares(out, o->lora_dirs[i], "the adapter", " given to --lora");
    if (code == NF4_OK && o->tokenizer && strcmp(o->tokenizer, TOKENIZER_OF_BASE) != 0)
        code = check_out_spares(out, o->tokenizer, "the --tokenizer folder", "");
    return code;
}

/* OUT is a path: it may exist only with --force, and never be the input. */
static int check_path_output(const char *in, int in_is_dir, const char *out, const struct convert_opts *o,
                             int *out_exists)
{
    struct stat in_st, out_st, entry;
    if (stat(in, &in_st) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, in, NULL, "cannot open");
    *out_exists = lstat(out, &entry) == 0; /* a link to nothing exists too */
    if (!*out_exists && errno != ENOENT)
        return nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL, "cannot stat");
    if (!*out_exists)
        return NF4_OK;
    if (stat(out, &out_st) == 0 && out_st.st_dev == in_st.st_dev && out_st.st_ino == in_st.st_ino)
        return nf4_fail(NF4_EUSAGE, out, NULL, "is the input itself; refusing to overwrite it");
    int code = check_replaceable(out, &entry);
    if (code != NF4_OK)
        return code;
    out_st = entry;
    if (S_ISDIR(out_st.st_mode) && names_dot_entry(out))
        return nf4_fail(NF4_EUSAGE, out, NULL, "names a directory by . or .., which cannot be replaced: give its "
                        "name");
    if (S_ISDIR(out_st.st_mode) != in_is_dir)
        return nf4_fail(NF4_EUSAGE, out, NULL, "input is a %s but output is a %s: give both as files or both as "
                        "directories", in_is_dir ? "directory" : "file", in_is_dir ? "file" : "directory");
    if (!o->force)
        return nf4_fail(NF4_ECANTCREAT, out, NULL, "already exists (use --force to replace it)");
    if (in_is_dir && path_is_within(in, out))
        return nf4_fail(NF4_EUSAGE, out, NULL, "contains the input; refusing to replace it");
    return check_out_spares_other_inputs(out, o);
}

/* A directory OUT inside IN would be read as part of IN by the next run, and
 * its temps and lock would sit among IN's files. */
static int check_out_outside_in(const char *in, const char *out)
{
    char *parent = path_dirname(out);
    if (!parent)
        return nf4_fail(NF4_ESOFTWARE, out, NULL, "out of memory");
    int inside = path_is_within(parent, in);
    free(parent);
    return inside ? nf4_fail(NF4_EUSAGE, out, NULL, "is inside the input directory %s; write it elsewhere", in)
                  : NF4_OK;
}

/* One writer per OUT (out_lock.h): the lock, before any work; then what runs
 * that died left: with --resume, the newest resumable temp of a model
 * directory is kept for this run; every other stale temp goes. */
static int take_output(struct ctx *c, enum input_layout layout, const char *out, int *out_exists,
                       struct out_lock **lock)
{
    int code = out_lock_acquire(out, lock);
    if (code != NF4_OK)
        return code;
    struct stat st;
    /* Checked again under the lock: a run that finished meanwhile made it. */
    if (!*out_exists && lstat(out, &st) == 0) {
        if (!c->opts->force)
            code = nf4_fail(NF4_ECANTCREAT, out, NULL, "already exists (use --force to replace it)");
        else if ((code = check_replaceable(out, &st)) != NF4_OK)
            ;
        else if (S_ISDIR(st.st_mode) != (layout != LAYOUT_FILE))
            code = nf4_fail(NF4_ECANTCREAT, out, NULL, "appeared as a %s while this run started",
                            S_ISDIR(st.st_mode) ? "directory" : "file");
        *out_exists = 1;
    }
    if (code == NF4_OK && c->opts->resume && layout == LAYOUT_MODEL_DIR) {
        c->resume_dir = out_lock_find_resumable(*lock, RESUME_MANIFEST_NAME);
        out_lock_describe_previous(*lock, c->dead_run, sizeof c->dead_run);
    }
    if (code == NF4_OK)
        code = out_lock_remove_stale(*lock, c->resume_dir);
    if (code != NF4_OK) {
        out_lock_release(*lock);
        *lock = NULL;
        free(c->resume_dir);
        c->resume_dir = NULL;
    }
    return code;
}

static int run(const char *in, const char *out, int out_is_dir_syntax, const struct convert_opts *o,
               struct convert_stats *stats);

int convert_run(const char *in, const char *out, const struct convert_opts *o, struct convert_stats *stats)
{
    /* "out/" names the directory "out": its temps and lock go beside it. */
    size_t n = strlen(out);
    while (n > 1 && out[n - 1] == '/')
        n--;
    char *clean = strndup(out, n);
    if (!clean) {
        memset(stats, 0, sizeof *stats);
        return nf4_fail(NF4_ESOFTWARE, out, NULL, "out of memory");
    }
    int code = run(in, clean, out[n] == '/', o, stats);
    free(clean);
    return code;
}

/* The environment's on/off switches (the man page's ENVIRONMENT) take 0 or 1,
 * or nothing: another value, a typo most likely, is refused as a bad
 * NF4DEQ_CPU is, not taken for the default. */
static int check_env_switches(void)
{
    static const char *const SWITCHES[] = {GPU_ONLY_ENV, HANDOFF_ENV, OUTPUT_MAP_ENV};
    for (size_t i = 0; i < sizeof SWITCHES / sizeof *SWITCHES; i++) {
        const char *v = getenv(SWITCHES[i]);
        if (v && *v && strcmp(v, "0") != 0 && strcmp(v, "1") != 0)
            return nf4_fail(NF4_EUSAGE, NULL, NULL, "%s=%s: set it to 0 or 1", SWITCHES[i], v);
    }
    return NF4_OK;
}

static int run(const char *in, const char *out, int out_is_dir_syntax, const struct convert_opts *o,
               struct convert_stats *stats)
{
    memset(stats, 0, sizeof *stats);
    struct ctx c = {.opts = o, .stats = stats, .to_stdout = strcmp(out, "-") == 0};
    /* A bad NF4DEQ_CPU or switch is refused before anything is read or written. */
    int code = check_env_switches();
    if (code == NF4_OK)
        code = cpu_path_from_env(&c.cpu_path);
    enum input_layout layout = LAYOUT_FILE;
    int out_exists = 0;
    if (code == NF4_OK)
        code = layout_of(in, &layout);
    if (code != NF4_OK)
        return code;
    stats->layout = layout;
    struct stat in_st;
    if (stat(in, &in_st) == 0)
        fileio_limit_modes_to(in_st.st_mode);
    /* As cp: "OUT/" is a directory, and a single file's output is a file. */
    if (out_is_dir_syntax && layout == LAYOUT_FILE)
        return nf4_fail(NF4_EUSAGE, out, NULL, "was given with a trailing '/', but the input is a single file: OUT "
                        "names the output file");
    if (c.to_stdout)
        code = check_stdout_output(layout, in, o);
    else
        code = check_path_output(in, layout != LAYOUT_FILE, out, o, &out_exists);
    if (code == NF4_OK && layout == LAYOUT_MODEL_DIR)
        code = model_dir_require(in); /* "not a model" before anything about OUT */
    if (code == NF4_OK && !c.to_stdout && layout != LAYOUT_FILE)
        code = check_out_outside_in(in, out);
    if (code == NF4_OK)
        code = layout == LAYOUT_PIPELINE ? pipeline_loras_check(in, o->lora_dirs, o->nlora)
                                         : pipeline_lora_refuse_components(in, o->lora_dirs, o->nlora);
    if (code == NF4_OK && layout != LAYOUT_MODEL_DIR && o->tokenizer)
        code = nf4_fail(NF4_EUSAGE, in, NULL, "is %s; --tokenizer gives a model directory its tokenizer",
                        layout == LAYOUT_FILE ? "a single weights file" : "a diffusers pipeline");
    if (code != NF4_OK)
        return code;
    struct out_lock *lock = NULL;
    if (!c.to_stdout && (code = take_output(&c, layout, out, &out_exists, &lock)) != NF4_OK)
        return code;
    const char *target = c.to_stdout ? "standard output" : out;
    double t0 = progress_now();
    if (layout == LAYOUT_PIPELINE)
        code = convert_pipeline(&c, in, out, out_exists);
    else if (layout == LAYOUT_MODEL_DIR)
        code = convert_model_dir(&c, in, out, out_exists);
    else
        code = convert_file(&c, in, target);
    convert_close_engine(&c);
    lora_close(c.lora);
    free(c.resume_dir);
    out_lock_release(lock);
    stats->seconds = progress_now() - t0;
    return code;
}
