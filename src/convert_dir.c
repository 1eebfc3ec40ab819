/* Directory conversions: a model directory (its shards, index, config.json and
 * other files), and a diffusers pipeline (each quantized component converted
 * as a model directory, everything else copied). Either is built in a temp
 * directory beside OUT and renamed into place once complete and durable. */
#include "convert_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "control_index.h"
#include "conv1d_layout.h"
#include "expert_layout.h"
#include "file_copy.h"
#include "fileio.h"
#include "layout.h"
#include "pipeline_lora.h"
#include "model_dir.h"
#include "modular_index.h"
#include "out_lock.h"
#include "resume.h"
#include "status.h"
#include "strutil.h"

/* The dtype config.json should name: --dtype, or the weights' common dtype. */
static const char *config_dtype(enum st_dtype dtype, const struct bnb_weight *w, size_t n)
{
    if (dtype != DT_INVALID)
        return dtype_torch_name(dtype);
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

/* The output index keeps the input's name (model., diffusion_pytorch_model.). */
static int write_index(const char *dir, const struct model *m, struct index_out_entry *entries, size_t n,
                       uint64_t total_size, uint64_t total_params)
{
    char *path = path_join(dir, m->index_name);
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

/* OUT's config.json: m's, as it was read for this run's decisions
 * (model_config_text), rewritten with ch. */
static int write_config(const struct model *m, const char *dir, const struct config_changes *ch)
{
    const char *json;
    size_t len;
    char *from = path_join(m->dir, CONFIG_FILE_NAME), *to = path_join(dir, CONFIG_FILE_NAME), *text = NULL;
    size_t text_len = 0;
    int code = (from && to) ? model_config_text(m, &json, &len) : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    if (code == NF4_OK && json)
        code = config_rewrite(from, json, len, ch, &text, &text_len);
    if (code == NF4_OK && json) {
        temp_register(to, 0); /* before it exists, as for the shards */
        code = write_file_atomic(to, text, text_len);
    }
    free(text);
    free(from);
    free(to);
    return code;
}

static int is_model_file(const struct model *m, const char *name)
{
    if ((m->index_name && strcmp(name, m->index_name) == 0) || strcmp(name, CONFIG_FILE_NAME) == 0)
        return 1;
    for (size_t i = 0; i < m->nfiles; i++)
        if (strcmp(m->file_names[i], name) == 0)
            return 1;
    return 0;
}

/* Every file of in_dir but the model's own, into dir; IN's tokenizer files
 * only where the tokenizer is IN's (tokenizer_files.h), else `tok`'s. */
static int copy_other_files(const struct model *m, const char *in_dir, const char *dir,
                            const struct tokenizer_source *tok)
{
    char **names;
    size_t n;
    int code = dir_list(in_dir, NF4_ENOINPUT, &names, &n);
    for (size_t i = 0; code == NF4_OK && i < n; i++) {
        const char *name = names[i];
        size_t base_len;
        if (is_model_file(m, name) ||
            temp_name_classify(name, &base_len) != TEMP_NAME_NONE || /* another run's temp or lock */
            (tok->origin != TOKENIZER_IN && (tokenizer_file_name(name) || tokenizer_dir_name(name))))
            continue;
        char *from = path_join(in_dir, name), *to = path_join(dir, name);
        struct stat st;
        int found = -1;
        if (!from || !to) {
            code = nf4_fail(NF4_ESOFTWARE, in_dir, NULL, "out of memory");
        } else if ((found = stat_to_copy(from, &st)) != 0) {
            code = found > 0 ? NF4_OK : NF4_ENOINPUT;
        } else if (S_ISREG(st.st_mode) && model_is_checkpoint_name(name)) {
            /* Not one of the model's files (those were skipped above): one of
             * m->unused_names, or one that appeared since the model was read. */
            char why[NAME_MAX + 32];
            model_unused_reason(m, name, why, sizeof why);
            nf4_warn("%s: not part of the model (%s); not copied", from, why);
        } else if (S_ISREG(st.st_mode) || (S_ISDIR(st.st_mode) && tokenizer_dir_name(name))) {
            /* A model directory is flat: files only, and the tokenizer's folder. */
            code = copy_path(from, to, in_dir);
        } else if (strncmp(name, ".", 1) != 0) {
            nf4_warn("%s: not a regular file; not copied", from);
        }
        free(from);
        free(to);
    }
    dir_names_free(names, n);
    if (code == NF4_OK && tok->origin != TOKENIZER_IN)
        code = tokenizer_copy(tok->dir, dir);
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
         * tree aside first. For a moment OUT does not exist; if the process
         * dies in that moment, the old tree waits beside OUT under a temp name
         * (and the next run to OUT removes it as a dead run's). */
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

/* One model directory, opened and planned: everything needed to write it. */
struct model_job {
    char *in;
    struct model *m;
    struct bnb_weight *weights;
    size_t nweights;
    /* What --lora does to this model: c->lora for a model directory, or a
     * pipeline component's own set (owned; lora_open_component); NULL: nothing. */
    struct lora_set *lora;
    int owns_lora;
    enum st_dtype dtype; /* the output dtype of its floating tensors: --dtype's, or DT_INVALID (each its own) */
    struct expert_layout *experts; /* gpt-oss's experts in Unsloth's layout, fused; NULL: none */
    struct conv1d_layout *conv1d;  /* GPT-2's 4-bit Conv1D weights, transposed back; NULL: none */
    struct out_item **plans; /* per shard */
    size_t *nplan;
    uint64_t tensors, bytes; /* output totals, for the progress line */
};

static void model_job_close(struct model_job *j)
{
    for (size_t i = 0; j->plans && i < j->m->nfiles; i++)
        free(j->plans[i]);
    free(j->plans);
    free(j->nplan);
    expert_layout_free(j->experts);
    conv1d_layout_free(j->conv1d);
    bnb_free(j->weights, j->nweights);
    if (j->owns_lora)
        lora_close(j->lora);
    model_close(j->m);
    free(j->in);
    memset(j, 0, sizeof *j);
}

/* Opens the model in `in` and plans every shard (the progress line needs the
 * totals before anything is written). `with_lora`: open --lora against it,
 * all of it (cl NULL: a model directory) or a pipeline component's part (cl->n
 * of them, pipeline_lora.h). */
static int model_job_open(struct ctx *c, const char *in, int with_lora, const struct component_loras *cl,
                          struct model_job *j)
{
    memset(j, 0, sizeof *j);
    if (!(j->in = strdup(in)))
        return nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    int code = model_open_dir(in, &j->m);
    if (code != NF4_OK)
        goto fail;
    if ((code = bnb_collect(j->m, &j->weights, &j->nweights)) != NF4_OK)
        goto fail;
    if (with_lora && !cl && (code = convert_open_lora(c, j->m, j->weights, j->nweights)) == NF4_OK) {
        j->lora = c->lora;
    } else if (with_lora && cl && cl->n &&
               (code = lora_open_component(&j->lora, cl->dirs, cl->n, j->m, j->weights, j->nweights,
                                           cl->key_components, cl->converted)) == NF4_OK) {
        j->owns_lora = 1;
        c->merging = 1;
        convert_note_merge(c, j->lora, j->weights, j->nweights);
    }
    if (code != NF4_OK)
        goto fail;
    /* A pipeline component converted only for a LoRA keeps its dtypes, as it
     * would have been copied: --dtype is for what bitsandbytes quantized. */
    j->dtype = cl && j->nweights == 0 ? DT_INVALID : c->opts->dtype;
    j->plans = calloc(j->m->nfiles, sizeof *j->plans);
    j->nplan = calloc(j->m->nfiles, sizeof *j->nplan);
    if (!j->plans || !j->nplan) {
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
        goto fail;
    }
    if ((code = expert_layout_find(in, j->m, j->weights, j->nweights, &j->experts)) != NF4_OK ||
        (code = convert_plan_experts(j->experts, j->m, j->weights, j->nweights, j->lora, j->dtype,
                                     &c->cached_source_bytes)) != NF4_OK ||
        (code = conv1d_layout_find(in, j->m, j->weights, j->nweights, &j->conv1d)) != NF4_OK ||
        (code = convert_plan_conv1d(j->conv1d, j->m, j->weights, j->nweights, j->lora, j->dtype,
                                    &c->cached_source_bytes)) != NF4_OK)
        goto fail;
    for (size_t i = 0; i < j->m->nfiles; i++) {
        code = convert_plan_file(j->m, i, j->weights, j->nweights, j->lora, j->experts, j->conv1d, j->dtype,
                                 &j->plans[i], &j->nplan[i]);
        if (code != NF4_OK)
            goto fail;
        j->tensors += j->nplan[i];
        j->bytes += out_items_bytes(j->plans[i], j->nplan[i]);
        convert_want_slots(c, j->plans[i], j->nplan[i]);
    }
    return NF4_OK;
fail:
    model_job_close(j);
    return code;
}

/* Writes the planned model into directory `dir` (which exists and is a temp):
 * shards under their own names, the index, config.json, the other files.
 * With `record`, each shard it lists is already there (resumed) and each one
 * written is added to it, in dir's resume manifest, which goes at the end. */
static int model_job_write(struct ctx *c, const struct model_job *j, const char *dir, struct resume_manifest *record)
{
    const struct model *m = j->m;
    size_t planned = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        planned += j->nplan[i];
    struct index_out_entry *entries = calloc(planned ? planned : 1, sizeof *entries);
    if (!entries)
        return nf4_fail(NF4_ESOFTWARE, j->in, NULL, "out of memory");
    size_t nentries = 0;
    uint64_t total_size = 0, total_params = 0;
    int code = NF4_OK;
    for (size_t i = 0; i < m->nfiles && code == NF4_OK; i++) {
        const struct out_item *items = j->plans[i];
        size_t n = j->nplan[i];
        if (n == 0)
            continue;
        char *path = path_join(dir, m->file_names[i]);
        uint64_t written = 0;
        int64_t resumed = record ? resume_shard_bytes(record, m->file_names[i]) : -1;
        if (resumed >= 0) { /* its file is there, with the recorded size */
            written = out_items_bytes(items, n);
            c->stats->resumed_shards++;
        } else {
            /* Registered before it exists: a signal right after the rename
             * into dir must still find it, or dir cannot be removed. */
            if (path)
                temp_register(path, 0);
            code = path ? convert_write_file(c, path, items, n, m, i, &written)
                        : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
            if (code == NF4_OK && record)
                code = resume_record_shard(dir, record, m->file_names[i]);
        }
        if (resumed < 0) /* bytes_out: written by this run, as bytes_in is read by it */
            c->stats->bytes_out += written;
        total_size += written;
        for (size_t k = 0; k < n; k++) {
            total_params += out_item_elements(&items[k]);
            entries[nentries++] = (struct index_out_entry){items[k].out.name, m->file_names[i]};
        }
        free(path);
    }
    if (code == NF4_OK && m->sharded)
        code = write_index(dir, m, entries, nentries, total_size, total_params);
    free(entries);
    struct config_changes ch = {
        .dtype_name = config_dtype(j->dtype, j->weights, j->nweights),
        .untie = j->lora && j->lora->untied_embedding && !model_tie_flag_ties_more(j->lora->untied_embedding),
        .vocab_size = j->lora ? j->lora->vocab_rows : 0,
        .in_channels = j->lora ? j->lora->in_channels : 0,
        .base_in_channels = j->lora ? j->lora->base_in_channels : 0,
        .every_tensor = j->dtype != DT_INVALID,
    };
    if (code == NF4_OK)
        code = write_config(j->m, dir, &ch);
    if (code == NF4_OK)
        code = copy_other_files(m, j->in, dir, &c->tokenizer);
    if (code == NF4_OK)
        code = limit_modes_to_namesakes(dir, j->in);
    char *manifest = record ? path_join(dir, RESUME_MANIFEST_NAME) : NULL;
    if (code == NF4_OK && record && (!manifest || (unlink(manifest) != 0 && errno != ENOENT)))
        code = manifest ? nf4_fail_errno(NF4_ECANTCREAT, errno, manifest, NULL, "cannot remove")
                        : nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    free(manifest);
    /* config.json, the index and the copies were renamed or created in dir
     * after the last shard's fsync: make the whole tree durable. */
    if (code == NF4_OK && fsync_dir(dir) != 0)
        code = nf4_fail_errno(NF4_EIO, errno, dir, NULL, "fsync failed");
    return code;
}

/* The temp directory that becomes `out`; messages name its files in out. */
static int make_temp_dir(const char *out, char **tmp)
{
    if (create_temp_dir_beside(out, tmp) == 0) {
        nf4_show_dir_as(*tmp, out);
        return NF4_OK;
    }
    *tmp = NULL;
    return nf4_fail_errno(errno == ENOMEM ? NF4_ESOFTWARE : NF4_ECANTCREAT, errno, out, NULL,
                          "cannot create a temp directory beside it");
}

/* Publishes a finished temp tree as `out`, or removes it after a failure. */
static int finish_dir(int code, char *tmp, const char *out, int replace)
{
    if (!tmp)
        return code;
    if (code == NF4_OK && dir_take_creation_mode(tmp) != 0)
        code = nf4_fail_errno(NF4_ECANTCREAT, errno, out, NULL, "cannot set its mode");
    if (code == NF4_OK)
        code = publish_dir(tmp, out, replace);
    if (code == NF4_OK && fsync_parent_dir(out) != 0) {
        code = nf4_fail_errno(NF4_EIO, errno, out, NULL, "fsync of its parent directory failed");
        remove_tree(out); /* a failed run leaves no output, even one renamed into place */
    }
    if (code != NF4_OK)
        remove_tree(tmp);
    temp_unregister_prefix(tmp);
    nf4_show_dir_as(NULL, NULL);
    free(tmp);
    return code;
}

/* The temp directory: a dead run's, taken over with --resume (out_lock.h
 * found it), or a new one. */
static int open_temp_dir(struct ctx *c, const char *out, size_t shards, struct resume_manifest *record, char **tmp)
{
    int code;
    size_t kept = 0;
    if (!c->resume_dir) {
        /* A manifest from the start: whenever this run dies, --resume finds it. */
        if ((code = make_temp_dir(out, tmp)) == NF4_OK)
            code = resume_record_shard(*tmp, record, NULL);
    } else if (!(*tmp = strdup(c->resume_dir))) {
        code = nf4_fail(NF4_ESOFTWARE, out, NULL, "out of memory");
    } else if ((code = resume_adopt(*tmp, record, &kept)) == NF4_OK) {
        nf4_note("%s: resuming from %s: kept %zu of %zu shards finished by a run that did not finish (%s)", out,
                 *tmp, kept, shards, c->dead_run);
        nf4_show_dir_as(*tmp, out); /* from here on, as make_temp_dir's */
    }
    if (code != NF4_OK)
        return code;
    /* A machine or service stopping (SIGTERM, SIGHUP) leaves the finished
     * shards for --resume; Ctrl-C and failures still remove everything. */
    temp_keep_on_stop(*tmp);
    char note[1024];
    snprintf(note, sizeof note, "nf4deq: %s: stopped by a signal; the shards finished so far stay in %s: rerun with "
             "--resume to continue them, or without it to start over\n", out, *tmp);
    temp_set_stop_note(note);
    return NF4_OK;
}

/* Says where the output's tokenizer comes from when it is not IN's, and
 * warns when IN's is kept for a vocabulary the adapters resized, or when the
 * one taken has added tokens past the output's embedding rows, which the
 * merged model could not embed (another model's tokenizer, most likely). */
static int say_tokenizer(const struct ctx *c, const struct model *m, const char *in, const char *out)
{
    const struct tokenizer_source *t = &c->tokenizer;
    const struct lora_set *l = c->lora;
    if (t->origin == TOKENIZER_IN) {
        if (l && l->vocab_rows)
            nf4_warn("%s: the adapters were trained on a vocabulary resized from %llu to %llu rows: the output has "
                     "its embedding layers and config.json says vocab_size: %llu, but the tokenizer files are %s's; "
                     "give it the tokenizer the adapter was trained with (--tokenizer DIR)", in,
                     (unsigned long long)l->base_vocab_rows, (unsigned long long)l->vocab_rows,
                     (unsigned long long)l->vocab_rows, in);
        return NF4_OK;
    }
    char **names;
    size_t n;
    int code = tokenizer_list(t->dir, &names, &n);
    if (code != NF4_OK)
        return code;
    char list[1024], rows[96] = "";
    tokenizer_names_text(names, n, list, sizeof list);
    dir_names_free(names, n);
    if (l && l->vocab_rows)
        snprintf(rows, sizeof rows, ", for the %llu rows of the resized vocabulary",
                 (unsigned long long)l->vocab_rows);
    if (t->origin == TOKENIZER_ADAPTER)
        nf4_note("%s: the tokenizer is the one %s was trained with (%s) instead of %s's%s; --tokenizer %s keeps "
                 "%s's", out, t->dir, list, in, rows, TOKENIZER_OF_BASE, in);
    else
        nf4_note("%s: the tokenizer is %s's (%s) instead of %s's%s", out, t->dir, list, in, rows);
    uint64_t embedding_rows = l && l->vocab_rows ? l->vocab_rows : model_embedding_rows(m), id;
    char token[64];
    const char *says;
    if (embedding_rows && tokenizer_highest_added_id(t->dir, &id, token, sizeof token, &says) &&
        id >= embedding_rows) {
        char *named = path_join(t->dir, says);
        nf4_warn("%s: adds token %llu (\"%s\"), but the output's embedding has %llu rows (0 to %llu): the merged "
                 "model cannot embed it. Is this the tokenizer of this model?", named ? named : t->dir,
                 (unsigned long long)id, token, (unsigned long long)embedding_rows,
                 (unsigned long long)embedding_rows - 1);
        free(named);
    }
    return NF4_OK;
}

int convert_model_dir(struct ctx *c, const char *in, const char *out, int replace)
{
    struct model_job j;
    int code = model_job_open(c, in, 1, NULL, &j);
    if (code == NF4_OK &&
        (code = tokenizer_choose(c->opts->tokenizer, in, c->opts->lora_dirs, c->opts->nlora, &c->tokenizer)) == NF4_OK)
        code = say_tokenizer(c, j.m, in, out);
    if (code != NF4_OK) {
        if (j.m)
            model_job_close(&j);
        return code;
    }
    convert_warn_if_nothing_to_do(c, in, j.nweights, 0);
    char *tmp = NULL;
    struct resume_manifest record = {0};
    size_t shards = 0;
    for (size_t i = 0; i < j.m->nfiles; i++)
        shards += j.nplan[i] > 0;
    const char *untied = c->lora ? c->lora->untied_embedding : NULL;
    if ((code = resume_fingerprint(j.m, c->opts, untied, &record)) == NF4_OK &&
        (code = convert_open_engine(c, out, j.tensors, j.bytes)) == NF4_OK &&
        (code = open_temp_dir(c, out, shards, &record, &tmp)) == NF4_OK)
        code = model_job_write(c, &j, tmp, &record);
    code = finish_dir(code, tmp, out, replace);
    resume_manifest_free(&record);
    model_job_close(&j);
    return code;
}

/* ---- diffusers pipelines ---- */

/* A component with no 4-bit weight (a VAE, a CLIP text encoder) is copied as
 * it is, byte for byte, whatever --dtype says: bitsandbytes never touched it,
 * and a cast would change what the pipeline's author chose to ship; unless a
 * diffusers LoRA of --lora has keys for it, which are merged into it. */
static int pipeline_open_components(struct ctx *c, const char *in, const struct pipeline_entry *e, size_t n,
                                    struct model_job *jobs, uint64_t *tensors, uint64_t *bytes)
{
    struct pipeline_loras pl;
    int code = pipeline_loras_open(in, c->opts->lora_dirs, c->opts->nlora, e, n, &pl);
    struct component_loras cl = {0};
    if (code == NF4_OK)
        code = component_loras_init(&cl, &pl, in);
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        if (e[i].kind != ENTRY_COMPONENT)
            continue;
        pipeline_loras_for(&pl, e[i].name, &cl);
        char *path = path_join(in, e[i].name);
        code = path ? model_job_open(c, path, cl.n > 0, &cl, &jobs[i])
                    : nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
        free(path);
        if (code != NF4_OK)
            break;
        if (jobs[i].nweights == 0 && !jobs[i].lora) {
            model_job_close(&jobs[i]);
            continue;
        }
        *tensors += jobs[i].tensors;
        *bytes += jobs[i].bytes;
    }
    component_loras_free(&cl);
    pipeline_loras_close(&pl);
    return code;
}

/* A job whose LoRA widened its transformer's x_embedder (lora_widen.h). */
static int job_widens(const struct model_job *job)
{
    return job->m && job->lora && job->lora->in_channels;
}

/* The pipeline's index `from`, where a control LoRA widened its transformer:
 * written as the control pipeline's (control_index.h), or copied as it is
 * with a warning where its class has none. */
static int write_control_index(const char *from, const char *to, const char *in)
{
    char *json = NULL, *cls = NULL, *text = NULL;
    const char *control = NULL;
    size_t len = 0, text_len = 0;
    int code = read_small_file(from, MAX_JSON_FILE_BYTES, &json, &len);
    if (code == NF4_OK)
        code = control_index_rewrite(from, json, len, &cls, &control, &text, &text_len);
    if (code == NF4_OK && text) {
        temp_register(to, 0);
        code = write_file_atomic(to, text, text_len);
    } else if (code == NF4_OK) {
        if (!control && cls)
            nf4_warn("%s: _class_name %s kept: the widened transformer takes a control image, which only "
                     "diffusers' FluxControl pipelines give it", from, cls);
        else if (!control)
            nf4_warn("%s: names no _class_name, and is copied as it is: the widened transformer takes a control "
                     "image, which only diffusers' FluxControl pipelines give it", from);
        code = copy_path(from, to, in);
    }
    free(json);
    free(cls);
    free(text);
    return code;
}

/* One entry of the pipeline's root into dir: a converted component, or a copy;
 * its index as a control pipeline's where `widened`. */
static int pipeline_write_entry(struct ctx *c, const char *in, const struct pipeline_entry *e,
                                const struct model_job *job, int widened, const char *dir)
{
    char *from = path_join(in, e->name), *to = path_join(dir, e->name);
    int code = NF4_OK;
    if (!from || !to) {
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    } else if (job->m) {
        temp_register(to, 1);
        struct stat st; /* no more open than the component it comes from, as cp -r makes it */
        if (mkdir(to, stat(from, &st) == 0 ? (st.st_mode & 0777) | S_IRWXU : 0777) != 0)
            code = nf4_fail_errno(NF4_ECANTCREAT, errno, to, NULL, "cannot create");
        else
            code = model_job_write(c, job, to, NULL);
    } else if (e->kind == ENTRY_COMPONENT || e->kind == ENTRY_DIR) {
        code = copy_tree(from, to, in);
    } else if (e->kind == ENTRY_CHECKPOINT) {
        /* A checkpoint beside the components (a single-file export) would be
         * copied still quantized. */
        nf4_warn("%s: a checkpoint outside every component; not copied (convert it on its own)", from);
    } else if (widened && e->kind == ENTRY_FILE && strcmp(e->name, PIPELINE_INDEX_NAME) == 0) {
        code = write_control_index(from, to, in);
    } else {
        if (widened && e->kind == ENTRY_FILE && strcmp(e->name, MODULAR_PIPELINE_INDEX_NAME) == 0)
            nf4_warn("%s: copied as it is: the widened transformer takes a control image, which only "
                     "diffusers' FluxControl pipelines give it", from);
        code = copy_path(from, to, in); /* a file, or a warning */
    }
    free(from);
    free(to);
    return code;
}

int convert_pipeline(struct ctx *c, const char *in, const char *out, int replace)
{
    struct pipeline_entry *e = NULL;
    size_t n = 0;
    int code = pipeline_list(in, &e, &n);
    if (code != NF4_OK)
        return code;
    modular_index_warn_remote(in);
    struct model_job *jobs = calloc(n ? n : 1, sizeof *jobs);
    uint64_t tensors = 0, bytes = 0;
    char *tmp = NULL;
    if (!jobs)
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    if (code == NF4_OK && (code = pipeline_open_components(c, in, e, n, jobs, &tensors, &bytes)) == NF4_OK)
        convert_warn_if_nothing_to_do(c, in, tensors, 1); /* components with 4-bit weights (none with --lora) */
    if (code == NF4_OK && (code = convert_open_engine(c, out, tensors, bytes)) == NF4_OK &&
        (code = make_temp_dir(out, &tmp)) == NF4_OK) {
        int widened = 0;
        for (size_t i = 0; i < n; i++)
            widened |= job_widens(&jobs[i]);
        for (size_t i = 0; i < n && code == NF4_OK; i++)
            code = pipeline_write_entry(c, in, &e[i], &jobs[i], widened, tmp);
        if (code == NF4_OK && fsync_dir(tmp) != 0)
            code = nf4_fail_errno(NF4_EIO, errno, out, NULL, "fsync of the finished directory failed");
    }
    code = finish_dir(code, tmp, out, replace);
    for (size_t i = 0; jobs && i < n; i++)
        model_job_close(&jobs[i]);
    free(jobs);
    pipeline_entries_free(e, n);
    return code;
}
