#include "convert.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bnb_state.h"
#include "cpu_path.h"
#include "fileio.h"
#include "gpu_start.h"
#include "lora.h"
#include "model.h"
#include "model_dir.h"
#include "pipeline.h"
#include "progress.h"
#include "safetensors.h"
#include "safetensors_writer.h"
#include "status.h"
#include "strutil.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "nf4deq reads safetensors data in place and needs a little-endian host"
#endif

struct ctx {
    const struct convert_opts *opts;
    struct lora_set *lora;
    struct convert_stats *stats;
    struct gpu_start *gpu_start; /* NULL: the CPU only */
    enum cpu_path cpu_path;      /* NF4DEQ_CPU's, or the best this processor has */
    int threads;
    struct pipeline *pipeline;
    struct progress progress;
};

void convert_opts_init(struct convert_opts *o)
{
    memset(o, 0, sizeof *o);
    o->dtype = DT_INVALID;
    o->device = DEVICE_AUTO;
    o->progress = PROGRESS_AUTO;
}

/* ---- planning and writing one output file ---- */

/* Points an item at what an adapter does to its tensor: a modules_to_save
 * replacement becomes the item's source (cast to the dtype the base would have
 * had), LoRA terms are merged. */
static void plan_lora(struct out_item *it, const struct lora_target *t)
{
    if (!t)
        return;
    if (t->replace) {
        it->w = NULL;
        it->src = t->replace;
    } else {
        it->lora = t;
    }
}

static int plan_file(const struct model *m, size_t file_index, const struct bnb_weight *weights, size_t nweights,
                     const struct lora_set *lora, enum st_dtype dtype, struct out_item **items_out, size_t *n_out)
{
    const struct st_file *f = m->files[file_index];
    struct out_item *items = calloc(f->count ? f->count : 1, sizeof *items);
    if (!items)
        return nf4_fail(NF4_ESOFTWARE, f->path, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < f->count; i++) {
        const struct st_tensor *t = &f->tensors[i];
        if (bnb_is_state_part(t->name))
            continue;
        struct out_item *it = &items[n++];
        it->out.name = t->name;
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
        plan_lora(it, lora_find(lora, t->name));
    }
    *items_out = items;
    *n_out = n;
    return NF4_OK;
}

static int write_file(struct ctx *c, const char *path, const struct out_item *items, size_t n,
                      const struct st_file *meta_from, uint64_t *bytes_written)
{
    struct st_out_tensor *outs = calloc(n ? n : 1, sizeof *outs);
    if (!outs)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    for (size_t i = 0; i < n; i++)
        outs[i] = items[i].out;
    struct st_writer *wr;
    int code = st_writer_begin(&wr, path, outs, n, meta_from->meta, meta_from->nmeta);
    free(outs);
    if (code != NF4_OK)
        return code;
    code = pipeline_write(c->pipeline, wr, items, n);
    *bytes_written = st_writer_total_bytes(wr);
    if (code == NF4_OK)
        return st_writer_finish(wr);
    st_writer_abort(wr);
    return code;
}

/* The shapes were overflow-checked when the input was read. */
static uint64_t item_elements(const struct out_item *it)
{
    uint64_t nelem = 1;
    for (size_t d = 0; d < it->out.ndim; d++)
        nelem *= it->out.shape[d];
    return nelem;
}

static uint64_t items_bytes(const struct out_item *items, size_t n)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += item_elements(&items[i]) * dtype_bits(items[i].out.dtype) / 8;
    return total;
}

/* ---- engine ---- */

static int online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int open_device(struct ctx *c);

/* Without --threads: every core for merges, whose arithmetic is the limit;
 * for plain conversions at most PLAIN_THREADS. Four vector-kernel threads
 * outrun any writer, and more only evict the chunks that wait to be written
 * from the caches (measured: docs/PERFORMANCE.md). */
#define PLAIN_THREADS 4
static int default_threads(const struct ctx *c)
{
    int cores = online_cores();
    return c->lora || cores < PLAIN_THREADS ? cores : PLAIN_THREADS;
}

/* Opens the device and the pipeline; `tensors` and `bytes` size the progress line. */
static int open_engine(struct ctx *c, const char *out, uint64_t tensors, uint64_t bytes)
{
    int code = open_device(c);
    if (code != NF4_OK)
        return code;
    uint64_t mem = c->opts->mem ? c->opts->mem : DEFAULT_MEM_BYTES;
    struct pipeline_opts po = {
        .threads = c->threads,
        .mem_bytes = mem,
        .max_chunk_elements = c->opts->chunk_elements,
        .merging = c->lora != NULL,
        .cpu_path = c->cpu_path,
        .gpu_start = c->gpu_start,
        .require_gpu = c->opts->device == DEVICE_CUDA,
    };
    code = pipeline_create(&c->pipeline, out, &po, c->stats, &c->progress);
    if (code == NF4_OK)
        progress_start(&c->progress, c->opts->progress, tensors, bytes);
    return code;
}

/* --device auto takes the GPU where it is the faster engine: for LoRA merges,
 * whose arithmetic (2 x rank flops per element) it does many times faster,
 * and where this processor has only the scalar kernel. A plain conversion
 * with a vector kernel stays on the CPU: a few cores already outrun the
 * writer, and the GPU would add its start (0.2-0.3 s, hidden) and its
 * teardown at exit (0.1 s, not hidden): measured in docs/PERFORMANCE.md. */
static int auto_wants_gpu(const struct ctx *c)
{
    return c->lora != NULL || c->cpu_path == CPU_PATH_SCALAR;
}

/* The CPU, or the GPU opened on a thread of its own while the pipeline starts
 * on the CPU (see pipeline.h): the fixed cost of starting CUDA never delays
 * the conversion. */
static int open_device(struct ctx *c)
{
    const struct convert_opts *o = c->opts;
    c->threads = o->threads > 0 ? o->threads : default_threads(c);
    if (o->device == DEVICE_CPU || (o->device == DEVICE_AUTO && !auto_wants_gpu(c)))
        return NF4_OK;
    return gpu_start_begin(&c->gpu_start, o->gpu_mem);
}

static void close_engine(struct ctx *c)
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

/* Opens the --lora adapters against the base, before anything is written. */
static int open_lora(struct ctx *c, const struct model *m, const struct bnb_weight *weights, size_t nweights)
{
    if (c->opts->nlora == 0)
        return NF4_OK;
    return lora_open(&c->lora, c->opts->lora_dirs, c->opts->nlora, m, weights, nweights);
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
    if ((code = bnb_collect(m, &weights, &nweights)) == NF4_OK &&
        (code = open_lora(c, m, weights, nweights)) == NF4_OK &&
        (code = plan_file(m, 0, weights, nweights, c->lora, c->opts->dtype, &items, &n)) == NF4_OK &&
        (code = open_engine(c, out, n, items_bytes(items, n))) == NF4_OK)
        code = write_file(c, out, items, n, m->files[0], &written);
    c->stats->bytes_out += written;
    free(items);
    bnb_free(weights, nweights);
    model_close(m);
    return code;
}

/* The dtype config.json should name: --dtype, or the weights' common dtype. */
static const char *config_dtype(const struct convert_opts *o, const struct bnb_weight *w, size_t n)
{
    if (o->dtype != DT_INVALID)
        return dtype_torch_name(o->dtype);
    for (size_t i = 1; i < n; i++)
        if (w[i].state.dtype != w[0].state.dtype)
            return NULL;
    return n ? dtype_torch_name(w[0].state.dtype) : NULL;
}

static int cmp_index_entry(const void *a, const void *b)
{
    const struct index_out_entry *x = a, *y = b;
    return strcmp(x->tensor, y->tensor);
}

static int write_index(const char *dir, const struct model *m, struct index_out_entry *entries, size_t n,
                       uint64_t total_size, uint64_t total_params)
{
    char *path = path_join(dir, INDEX_FILE_NAME);
    if (!path)
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    qsort(entries, n, sizeof *entries, cmp_index_entry);
    char *text = NULL;
    size_t len = 0;
    int code = index_render(path, m->index_metadata_json, total_size, total_params, entries, n, &text, &len);
    if (code == NF4_OK) {
        temp_register(path, 0); /* before it exists, as for the shards */
        code = write_file_atomic(path, text, len);
    }
    free(text);
    free(path);
    return code;
}

static int write_config(const char *in_dir, const char *dir, const char *dtype)
{
    char *from = path_join(in_dir, CONFIG_FILE_NAME), *to = path_join(dir, CONFIG_FILE_NAME);
    char *json = NULL, *text = NULL;
    size_t len = 0, text_len = 0;
    int code = (from && to) ? NF4_OK : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    if (code == NF4_OK)
        code = read_small_file(from, MAX_JSON_FILE_BYTES, &json, &len);
    if (code == NF4_OK)
        code = config_rewrite(from, json, len, dtype, &text, &text_len);
    if (code == NF4_OK) {
        temp_register(to, 0); /* before it exists, as for the shards */
        code = write_file_atomic(to, text, text_len);
    }
    free(json);
    free(text);
    free(from);
    free(to);
    return code;
}

static int is_model_file(const struct model *m, const char *name)
{
    if (strcmp(name, INDEX_FILE_NAME) == 0 || strcmp(name, CONFIG_FILE_NAME) == 0)
        return 1;
    for (size_t i = 0; i < m->nfiles; i++)
        if (strcmp(m->file_names[i], name) == 0)
            return 1;
    return 0;
}

static int copy_other_files(const struct model *m, const char *in_dir, const char *dir)
{
    DIR *d = opendir(in_dir);
    if (!d)
        return nf4_fail_errno(NF4_ENOINPUT, errno, in_dir, NULL, "cannot list");
    int code = NF4_OK;
    struct dirent *ent;
    while (code == NF4_OK && (ent = readdir(d)) != NULL) {
        const char *name = ent->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0 || is_model_file(m, name))
            continue;
        char *from = path_join(in_dir, name), *to = path_join(dir, name);
        struct stat st;
        if (!from || !to) {
            code = nf4_fail(NF4_ESOFTWARE, in_dir, NULL, "out of memory");
        } else if (stat(from, &st) != 0) {
            code = nf4_fail_errno(NF4_ENOINPUT, errno, from, NULL, "cannot stat");
        } else if (S_ISREG(st.st_mode) && str_ends_with(name, ".safetensors")) {
            /* A checkpoint file that is not part of this model (an older
             * model.safetensors beside the shards, say) would be copied still
             * quantized, and transformers may load it first. */
            nf4_warn("%s: not part of the model (not in %s); not copied", from,
                     m->sharded ? INDEX_FILE_NAME : SINGLE_FILE_NAME);
        } else if (S_ISREG(st.st_mode) && !path_stays_in_model(in_dir, from)) {
            nf4_warn("%s: links to a file outside the model directory; not copied", from);
        } else if (S_ISREG(st.st_mode)) {
            temp_register(to, 0);
            code = copy_file(from, to);
        } else if (strncmp(name, ".", 1) != 0) {
            nf4_warn("%s: not a regular file; not copied", from);
        }
        free(from);
        free(to);
    }
    closedir(d);
    return code;
}

static int publish_dir(const char *tmp, const char *out, int replace)
{
    if (!replace) {
        if (rename(tmp, out) != 0)
            return nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL, "cannot rename the finished directory into place");
        return NF4_OK;
    }
    /* Swap the new tree in atomically; the old one ends up at tmp and goes. */
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, out, RENAME_EXCHANGE) != 0) {
        if (errno != EINVAL && errno != ENOSYS)
            return nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL,
                                  "cannot swap the finished directory into place");
        /* No RENAME_EXCHANGE here (NFS, some FUSE file systems): move the old
         * tree aside first. For a moment OUT does not exist, but neither
         * tree is ever lost. */
        char *old = NULL;
        if (create_temp_dir_beside(out, &old) != 0 || rmdir(old) != 0 || rename(out, old) != 0) {
            int e = errno;
            if (old)
                temp_unregister(old);
            free(old);
            return nf4_fail_errno(NF4_ECANTCREAT, e, out, NULL, "cannot move the old directory aside");
        }
        if (rename(tmp, out) != 0) {
            int e = errno;
            rename(old, out);
            temp_unregister(old);
            free(old);
            return nf4_fail_errno(NF4_ECANTCREAT, e, out, NULL, "cannot rename the finished directory into place");
        }
        temp_unregister(old);
        if (remove_tree(old) != 0)
            nf4_warn("%s: could not remove the replaced output: %s", old, strerror(errno));
        free(old);
        return NF4_OK;
    }
    if (remove_tree(tmp) != 0)
        nf4_warn("%s: could not remove the replaced output: %s", tmp, strerror(errno));
    return NF4_OK;
}

static int convert_dir(struct ctx *c, const char *in, const char *out, int replace)
{
    struct model *m;
    int code = model_open_dir(in, &m);
    if (code != NF4_OK)
        return code;
    struct bnb_weight *weights = NULL;
    size_t nweights = 0, nentries = 0;
    struct index_out_entry *entries = NULL;
    struct out_item **plans = NULL;
    size_t *nplan = NULL;
    char *tmp = NULL;
    uint64_t total_size = 0, total_params = 0;
    if ((code = bnb_collect(m, &weights, &nweights)) != NF4_OK || (code = open_lora(c, m, weights, nweights)) != NF4_OK)
        goto out;
    entries = calloc(m->count ? m->count : 1, sizeof *entries);
    plans = calloc(m->nfiles, sizeof *plans);
    nplan = calloc(m->nfiles, sizeof *nplan);
    if (!entries || !plans || !nplan) {
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
        goto out;
    }
    /* Plan every shard first: the progress line needs the totals. */
    uint64_t all_tensors = 0, all_bytes = 0;
    for (size_t i = 0; i < m->nfiles; i++) {
        if ((code = plan_file(m, i, weights, nweights, c->lora, c->opts->dtype, &plans[i], &nplan[i])) != NF4_OK)
            goto out;
        all_tensors += nplan[i];
        all_bytes += items_bytes(plans[i], nplan[i]);
    }
    if ((code = open_engine(c, out, all_tensors, all_bytes)) != NF4_OK)
        goto out;
    if (create_temp_dir_beside(out, &tmp) != 0) {
        code = nf4_fail_errno(errno == ENOMEM ? NF4_ESOFTWARE : NF4_ECANTCREAT, errno, out, NULL,
                              "cannot create a temp directory beside it");
        goto out;
    }
    for (size_t i = 0; i < m->nfiles && code == NF4_OK; i++) {
        struct out_item *items = plans[i];
        size_t n = nplan[i];
        if (n > 0) {
            char *path = path_join(tmp, m->file_names[i]);
            uint64_t written = 0;
            /* Registered before it exists: a signal right after the rename
             * into tmp must still find it, or tmp cannot be removed. */
            if (path)
                temp_register(path, 0);
            code = path ? write_file(c, path, items, n, m->files[i], &written)
                        : nf4_fail(NF4_ESOFTWARE, tmp, NULL, "out of memory");
            c->stats->bytes_out += written;
            total_size += written;
            for (size_t k = 0; k < n; k++) {
                total_params += item_elements(&items[k]);
                entries[nentries++] = (struct index_out_entry){items[k].out.name, m->file_names[i]};
            }
            free(path);
        }
    }
    if (code == NF4_OK && m->sharded)
        code = write_index(tmp, m, entries, nentries, total_size, total_params);
    char *config = path_join(in, CONFIG_FILE_NAME);
    struct stat st;
    if (code == NF4_OK && !config)
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory"); /* not "there is no config.json" */
    if (code == NF4_OK && stat(config, &st) == 0)
        code = write_config(in, tmp, config_dtype(c->opts, weights, nweights));
    free(config);
    if (code == NF4_OK)
        code = copy_other_files(m, in, tmp);
    /* config.json, the index and the copies were renamed or created in tmp
     * after the last shard's fsync: make the whole tree durable first. */
    if (code == NF4_OK && fsync_dir(tmp) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, out, NULL, "fsync of the finished directory failed");
    if (code == NF4_OK)
        code = publish_dir(tmp, out, replace);
    if (code == NF4_OK && fsync_parent_dir(out) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, out, NULL, "fsync of its parent directory failed");
        remove_tree(out); /* a failed run leaves no output, even one renamed into place */
    }
    if (code != NF4_OK && tmp)
        remove_tree(tmp);
out:
    if (tmp)
        temp_unregister_prefix(tmp);
    free(tmp);
    free(entries);
    for (size_t i = 0; plans && i < m->nfiles; i++)
        free(plans[i]);
    free(plans);
    free(nplan);
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

int convert_run(const char *in, const char *out, const struct convert_opts *o, struct convert_stats *stats)
{
    memset(stats, 0, sizeof *stats);
    struct ctx c = {.opts = o, .stats = stats};
    struct stat in_st, out_st;
    /* A bad NF4DEQ_CPU is refused before anything is read or written. */
    int path_code = cpu_path_from_env(&c.cpu_path);
    if (path_code != NF4_OK)
        return path_code;
    if (stat(in, &in_st) != 0)
        return nf4_fail_errno(NF4_ENOINPUT, errno, in, NULL, "cannot open");
    int in_is_dir = S_ISDIR(in_st.st_mode);
    if (!in_is_dir && !S_ISREG(in_st.st_mode))
        return nf4_fail(NF4_ENOINPUT, in, NULL, "neither a file nor a directory");
    int out_exists = stat(out, &out_st) == 0;
    if (!out_exists && errno != ENOENT)
        return nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL, "cannot stat");
    if (out_exists) {
        if (out_st.st_dev == in_st.st_dev && out_st.st_ino == in_st.st_ino)
            return nf4_fail(NF4_EUSAGE, out, NULL, "is the input itself; refusing to overwrite it");
        if (S_ISDIR(out_st.st_mode) != in_is_dir)
            return nf4_fail(NF4_EUSAGE, out, NULL, "input is a %s but output is a %s: give both as files or both as "
                            "directories", in_is_dir ? "directory" : "file", in_is_dir ? "file" : "directory");
        if (!o->force)
            return nf4_fail(NF4_ECANTCREAT, out, NULL, "already exists (use --force to replace it)");
        if (in_is_dir && path_is_within(in, out))
            return nf4_fail(NF4_EUSAGE, out, NULL, "contains the input; refusing to replace it");
    }
    double t0 = progress_now();
    int code = in_is_dir ? convert_dir(&c, in, out, out_exists) : convert_file(&c, in, out);
    close_engine(&c);
    lora_close(c.lora);
    stats->seconds = progress_now() - t0;
    return code;
}
