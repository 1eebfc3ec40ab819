#include "inspect.h"

#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bnb_state.h"
#include "control_index.h"
#include "conv1d_layout.h"
#include "expert_layout.h"
#include "fileio.h"
#include "json_util.h"
#include "layout.h"
#include "lora.h"
#include "model.h"
#include "model_dir.h"
#include "modular_index.h"
#include "pipeline_lora.h"
#include "status.h"
#include "tokenizer_files.h"

struct totals {
    uint64_t tensors, quantized, parameters, on_disk, converted;
    uint64_t widened; /* models whose x_embedder a LoRA widens (lora_widen.h) */
};

struct inspect_opts {
    int json;
    enum st_dtype dtype;
    const char *const *lora_dirs;
    size_t nlora;
    const char *tokenizer;          /* --tokenizer, as convert's */
    struct tokenizer_source source; /* what tokenizer_choose made of it, checked before any output */
    FILE *out;
};

/* What inspect_model shows: IN itself, with the whole of --lora, or one
 * component of a pipeline, with the LoRAs it takes (pipeline_loras_for). */
struct model_part {
    const char *component; /* the pipeline's name for it, or NULL for IN itself */
    const char *const *lora_dirs;
    size_t nlora;
    const char *const *lora_key_components; /* as in struct component_loras; NULL for IN itself */
    struct model *const *lora_converted;     /* as in struct component_loras; NULL: none */
    int as_is; /* copied unchanged (a component with no 4-bit weight that no LoRA changes) */
};

/* A name from the file in inspect's table: control bytes as '?' (as in
 * messages, status.h), padded to `width` columns. */
static void put_name(FILE *out, const char *name, int width)
{
    int n = 0;
    for (const char *p = name; *p; n++) {
        size_t c = nf4_control_len(p);
        fputc(c ? '?' : *p, out);
        p += c ? c : 1;
    }
    for (; n < width; n++)
        fputc(' ', out);
}

static void shape_text(char *buf, size_t cap, size_t ndim, const uint64_t *shape)
{
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (size_t d = 0; d < ndim && len < cap; d++)
        len += (size_t)snprintf(buf + len, cap - len, d ? ", %" PRIu64 : "%" PRIu64, shape[d]);
    if (len < cap)
        snprintf(buf + len, cap - len, "]");
}

static cJSON *shape_json(size_t ndim, const uint64_t *shape)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t d = 0; d < ndim && a; d++)
        json_add_to_array(a, cJSON_CreateNumber((double)shape[d]));
    return a;
}

static const char *quant_name(enum quant_type q)
{
    return q == QUANT_FP4 ? "fp4" : "nf4";
}

static const char *adapter_dir(const struct lora_set *s, size_t i)
{
    return s->adapters[i].dir;
}

/* Trained token rows: how many in the table, which ones in JSON. */
static void report_token_rows(const struct lora_set *s, const struct lora_target *t, int json, cJSON *ja, FILE *out)
{
    const struct token_rows *tr = t->tokens;
    if (json) { /* ja NULL: memory ran out, which the report's end finds (never the table instead) */
        cJSON *e = cJSON_CreateObject(), *rows = cJSON_CreateArray();
        cJSON_AddStringToObject(e, "tensor", t->name);
        cJSON_AddStringToObject(e, "adapter", adapter_dir(s, t->tokens_adapter));
        cJSON_AddStringToObject(e, "change", "rows");
        for (uint64_t i = 0; i < tr->n; i++)
            json_add_to_array(rows, cJSON_CreateNumber((double)tr->row[i]));
        json_add_item(e, "rows", rows);
        cJSON_AddStringToObject(e, "dtype", dtype_name(tr->values->t->dtype));
        json_add_to_array(ja, e);
    } else {
        put_name(out, t->name, 48);
        fprintf(out, " %-6s %10s %12s  %s (trainable tokens: %llu row%s, %s)\n", "-", "-", "-",
                adapter_dir(s, t->tokens_adapter), (unsigned long long)tr->n, tr->n == 1 ? "" : "s",
                dtype_name(tr->values->t->dtype));
    }
}

/* The LoRA section: one entry per term, replacement or set of token rows, in tensor order. */
static void report_lora(const struct lora_set *s, cJSON *root, FILE *out)
{
    const int json = root != NULL;
    cJSON *ja = json ? cJSON_AddArrayToObject(root, "lora") : NULL;
    if (!json)
        fprintf(out, "\n%-48s %-6s %10s %12s  %s\n", "CHANGED BY LORA", "R", "ALPHA", "SCALING", "ADAPTER");
    for (size_t i = 0; i < s->ntargets; i++) {
        const struct lora_target *t = &s->targets[i];
        if (t->replace) {
            if (json) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "tensor", t->name);
                cJSON_AddStringToObject(e, "adapter", adapter_dir(s, t->replace_adapter));
                cJSON_AddStringToObject(e, "change", t->replace_widened ? "widened" : "replaced");
                cJSON_AddStringToObject(e, "dtype", dtype_name(t->replace->t->dtype));
                json_add_to_array(ja, e);
            } else {
                put_name(out, t->name, 48);
                fprintf(out, " %-6s %10s %12s  %s (%s, %s)\n", "-", "-", "-", adapter_dir(s, t->replace_adapter),
                        t->replace_widened         ? "base layer widened with zeros"
                        : t->replace_norm          ? "control LoRA norm: replaced"
                        : t->replace_trained_bias  ? "trained bias: replaced"
                        : t->replace_frozen        ? "base layer: replaced"
                                                   : "modules_to_save: replaced",
                        dtype_name(t->replace->t->dtype));
            }
        } /* and a LoRA of the same adapter goes on the replacement, or its token rows */
        if (t->tokens)
            report_token_rows(s, t, json, ja, out);
        for (size_t k = 0; k < t->nterms; k++) {
            const struct lora_term *x = &t->terms[k];
            if (json) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "tensor", t->name);
                cJSON_AddStringToObject(e, "adapter", adapter_dir(s, x->adapter));
                cJSON_AddStringToObject(e, "change", "merged");
                cJSON_AddNumberToObject(e, "r", x->bias ? x->pair_r : x->r);
                cJSON_AddNumberToObject(e, "alpha", x->alpha);
                cJSON_AddNumberToObject(e, "scaling", x->scaling);
                cJSON_AddBoolToObject(e, "fan_in_fan_out", x->fan_in_fan_out && !x->embedding && !x->expert_rows);
                cJSON_AddBoolToObject(e, "embedding", x->embedding);
                cJSON_AddBoolToObject(e, "dora", x->magnitude != NULL);
                cJSON_AddBoolToObject(e, "lora_bias", x->bias);
                cJSON_AddBoolToObject(e, "lokr", x->kron.w1 != NULL);
                if (x->padded_from) /* lora_A padded with zero columns to the layer's inputs */
                    cJSON_AddNumberToObject(e, "lora_A_padded_from", (double)x->padded_from);
                if (x->expert_rows) { /* a LoRA on a fused experts tensor: every expert */
                    cJSON_AddNumberToObject(e, "experts", x->b_col_step);
                    cJSON_AddBoolToObject(e, "is_transposed", x->fan_in_fan_out);
                } else if (x->b_col_step) { /* one expert's part of a LoRA on MoE experts */
                    cJSON_AddNumberToObject(e, "expert", x->b_col0);
                    cJSON_AddNumberToObject(e, "experts", x->b_col_step);
                }
                cJSON_AddStringToObject(e, "dtype", dtype_name(x->a->t->dtype));
                json_add_to_array(ja, e);
            } else {
                char expert[96] = "";
                if (x->expert_rows)
                    snprintf(expert, sizeof expert, " (%u experts, fused%s)", x->b_col_step,
                             x->fan_in_fan_out ? ", is_transposed" : "");
                else if (x->b_col_step)
                    snprintf(expert, sizeof expert, " (expert %u of %u)", x->b_col0, x->b_col_step);
                else if (x->padded_from)
                    snprintf(expert, sizeof expert, " (lora_A padded from %llu to %llu inputs)",
                             (unsigned long long)x->padded_from, (unsigned long long)t->cols);
                put_name(out, t->name, 48);
                fprintf(out, " %-6u %10g %12.9g  %s%s\n", x->bias ? x->pair_r : x->r, x->alpha, (double)x->scaling,
                        adapter_dir(s, x->adapter),
                        x->embedding                           ? " (embedding)"
                        : x->kron.w1                           ? " (LoKr)"
                        : x->magnitude                         ? " (DoRA)"
                        : x->bias                              ? " (lora_bias)"
                        : x->fan_in_fan_out && !x->expert_rows ? " (fan_in_fan_out)"
                                                               : expert);
            }
        }
    }
    if (s->vocab_rows && root) {
        cJSON *v = cJSON_AddObjectToObject(root, "vocab_size");
        cJSON_AddNumberToObject(v, "base", (double)s->base_vocab_rows);
        cJSON_AddNumberToObject(v, "merged", (double)s->vocab_rows);
    } else if (s->vocab_rows) {
        fprintf(out, "\nThe adapters were trained on a vocabulary resized from %llu to %llu rows; config.json: "
                "vocab_size: %llu\n", (unsigned long long)s->base_vocab_rows, (unsigned long long)s->vocab_rows,
                (unsigned long long)s->vocab_rows);
    }
    if (s->in_channels && root) {
        cJSON *v = cJSON_AddObjectToObject(root, "in_channels");
        cJSON_AddNumberToObject(v, "base", (double)s->base_in_channels);
        cJSON_AddNumberToObject(v, "merged", (double)s->in_channels);
    } else if (s->in_channels) {
        fprintf(out, "\nx_embedder is widened from %llu to %llu inputs, as diffusers' Flux.1 loader widens it; "
                "config.json: in_channels: %llu\n", (unsigned long long)s->base_in_channels,
                (unsigned long long)s->in_channels, (unsigned long long)s->in_channels);
    }
    if (!s->untied_embedding)
        return;
    if (root) {
        cJSON *u = cJSON_AddObjectToObject(root, "untied");
        cJSON_AddStringToObject(u, "head", TIED_HEAD_NAME);
        cJSON_AddStringToObject(u, "embedding", s->untied_embedding);
        cJSON_AddBoolToObject(u, "config_unties", !model_tie_flag_ties_more(s->untied_embedding));
    } else {
        fputs("\n" TIED_HEAD_NAME " is written apart from ", out);
        put_name(out, s->untied_embedding, 0);
        fputs(model_tie_flag_ties_more(s->untied_embedding)
                  ? ", which the base ties it to; config.json keeps tie_word_embeddings, which ties the encoder's "
                    "and decoder's embeddings too (transformers 5 loads the head apart)\n"
                  : ", which the base ties it to; config.json: tie_word_embeddings: false\n",
              out);
    }
}

static void add_totals_json(cJSON *obj, const struct totals *t)
{
    cJSON *jt = cJSON_AddObjectToObject(obj, "totals");
    cJSON_AddNumberToObject(jt, "tensors", (double)t->tensors);
    cJSON_AddNumberToObject(jt, "quantized_weights", (double)t->quantized);
    cJSON_AddNumberToObject(jt, "parameters", (double)t->parameters);
    cJSON_AddNumberToObject(jt, "bytes_on_disk", (double)t->on_disk);
    cJSON_AddNumberToObject(jt, "bytes_after_conversion", (double)t->converted);
}

static void add_totals(struct totals *sum, const struct totals *t)
{
    sum->tensors += t->tensors;
    sum->quantized += t->quantized;
    sum->parameters += t->parameters;
    sum->on_disk += t->on_disk;
    sum->converted += t->converted;
    sum->widened += t->widened;
}

/* The directory's weights files that convert leaves out (model.h). */
static void report_unused(const struct model *m, FILE *out)
{
    if (m->nunused > 0)
        fputs("\nNot part of the model, neither converted nor copied:\n", out);
    for (size_t i = 0; i < m->nunused; i++) {
        char why[NAME_MAX + 32];
        model_unused_reason(m, m->unused_names[i], why, sizeof why);
        fputs("  ", out);
        put_name(out, m->unused_names[i], 0);
        fprintf(out, " (%s)\n", why);
    }
}

static void add_unused_json(const struct model *m, cJSON *obj)
{
    cJSON *list = cJSON_AddArrayToObject(obj, "not_copied");
    for (size_t i = 0; i < m->nunused; i++)
        json_add_to_array(list, cJSON_CreateString(m->unused_names[i]));
}

/* Whose tokenizer files convert gives a model directory's output, and which. */
static int report_tokenizer(const char *in, const struct inspect_opts *o, cJSON *root, FILE *out)
{
    const struct tokenizer_source t = o->source;
    char **names = NULL;
    size_t n = 0;
    int code = tokenizer_list(t.dir ? t.dir : in, &names, &n);
    if (code != NF4_OK)
        return code;
    static const char *const ORIGIN[] = {[TOKENIZER_IN] = "base", [TOKENIZER_ADAPTER] = "adapter",
                                         [TOKENIZER_GIVEN] = "directory"};
    if (root) {
        cJSON *jt = cJSON_AddObjectToObject(root, "tokenizer");
        cJSON_AddStringToObject(jt, "from", ORIGIN[t.origin]);
        cJSON_AddStringToObject(jt, "path", t.dir ? t.dir : in);
        cJSON *jf = cJSON_AddArrayToObject(jt, "files");
        for (size_t i = 0; i < n; i++)
            json_add_to_array(jf, cJSON_CreateString(names[i]));
    } else {
        char list[1024];
        tokenizer_names_text(names, n, list, sizeof list);
        fprintf(out, "\nTokenizer: %s%s (%s)\n", t.dir ? t.dir : in,
                t.origin == TOKENIZER_ADAPTER ? ", the one the adapter was trained with" : "",
                n ? list : "no tokenizer files");
    }
    dir_names_free(names, n);
    return NF4_OK;
}

/* One file or model directory: its tensor table and totals line, or its
 * files, tensors and totals added to `obj`. A component copied as it is, or
 * converted only to merge a LoRA, keeps its dtypes: --dtype does not apply.
 * A copied one's tensor bytes after conversion are its tensor bytes now (not
 * its file sizes: the totals count tensor bytes, headers apart, everywhere). */
static int inspect_model(const char *in, int is_dir, const struct inspect_opts *o, const struct model_part *part,
                         cJSON *obj, struct totals *tot)
{
    FILE *out = o->out;
    int json = obj != NULL;
    struct model *m;
    int code = is_dir ? model_open_dir(in, &m) : model_open_file(in, &m);
    if (code != NF4_OK)
        return code;
    struct bnb_weight *w = NULL;
    size_t nw = 0;
    struct lora_set *lora = NULL;
    struct expert_layout *experts = NULL;
    struct conv1d_layout *conv1d = NULL;
    if ((code = bnb_collect(m, &w, &nw)) != NF4_OK ||
        (code = conv1d_layout_find(in, m, w, nw, &conv1d)) != NF4_OK ||
        (is_dir && (code = expert_layout_find(in, m, w, nw, &experts)) != NF4_OK) ||
        (part->nlora && (code = lora_open_component(&lora, part->lora_dirs, part->nlora, m, w, nw,
                                                    part->lora_key_components, part->lora_converted)) != NF4_OK)) {
        conv1d_layout_free(conv1d);
        expert_layout_free(experts);
        bnb_free(w, nw);
        model_close(m);
        return code;
    }
    const enum st_dtype dtype = part->as_is || (part->component && nw == 0) ? DT_INVALID : o->dtype;
    memset(tot, 0, sizeof *tot);
    tot->tensors = m->count;
    tot->quantized = nw;
    for (size_t i = 0; i < m->nfiles; i++)
        tot->on_disk += m->files[i]->file_size;
    cJSON *jfiles = json ? cJSON_AddArrayToObject(obj, "files") : NULL;
    cJSON *jtensors = json ? cJSON_AddArrayToObject(obj, "tensors") : NULL;
    for (size_t i = 0; json && i < m->nfiles; i++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "path", m->files[i]->path);
        cJSON_AddNumberToObject(f, "bytes", (double)m->files[i]->file_size);
        cJSON_AddNumberToObject(f, "tensors", (double)m->files[i]->count);
        json_add_to_array(jfiles, f);
    }
    if (!json)
        fprintf(out, "%-48s %-5s %-16s %12s  %s\n", "NAME", "DTYPE", "SHAPE", "BYTES", "QUANTIZATION");
    for (size_t i = 0; i < m->count; i++) {
        const struct model_tensor *mt = &m->tensors[i];
        const struct st_tensor *t = mt->t;
        const struct bnb_weight *q = bnb_find(w, nw, t->name);
        const struct bnb_weight *owner = q ? NULL : (bnb_is_state_part(t->name) ? bnb_owner_of(w, nw, t->name) : NULL);
        enum st_dtype out_dt = DT_INVALID;
        uint64_t nelem = t->nelem;
        if (q) {
            out_dt = dtype != DT_INVALID ? dtype : q->state.dtype;
            nelem = q->state.n;
        } else if (!owner) {
            out_dt = (dtype != DT_INVALID && dtype_is_castable_float(t->dtype)) ? dtype : t->dtype;
        }
        /* An embedding layer of a resized vocabulary has the adapter's rows. */
        const struct lora_target *changed = lora ? lora_find(lora, t->name) : NULL;
        if (changed && changed->replace)
            nelem = changed->replace->t->nelem;
        uint64_t out_bytes = out_dt == DT_INVALID ? 0 : nelem * dtype_bits(out_dt) / 8;
        /* An untied head is the embedding's twin in the output. */
        int twins = lora && lora->untied_embedding && strcmp(t->name, lora->untied_embedding) == 0;
        if (!owner) {
            tot->parameters += nelem << twins;
            tot->converted += out_bytes << twins;
        }
        char shape[128], qshape[128];
        shape_text(shape, sizeof shape, t->ndim, t->shape);
        const struct fused_experts *fused;
        const char *renamed;
        size_t expert;
        expert_layout_lookup(experts, t->name, &fused, &expert, &renamed);
        const struct conv1d_weight *cw = conv1d_layout_lookup(conv1d, t->name);
        if (json) {
            cJSON *jt = cJSON_CreateObject();
            cJSON_AddStringToObject(jt, "name", t->name);
            cJSON_AddStringToObject(jt, "file", mt->file->path);
            cJSON_AddStringToObject(jt, "dtype", dtype_name(t->dtype));
            json_add_item(jt, "shape", shape_json(t->ndim, t->shape));
            cJSON_AddNumberToObject(jt, "bytes", (double)st_tensor_bytes(t));
            if (q) {
                cJSON *jq = cJSON_AddObjectToObject(jt, "quantization");
                cJSON_AddStringToObject(jq, "type", quant_name(q->state.quant_type));
                cJSON_AddNumberToObject(jq, "blocksize", q->state.blocksize);
                cJSON_AddBoolToObject(jq, "double_quant", q->state.nested);
                if (q->state.nested)
                    cJSON_AddNumberToObject(jq, "nested_blocksize", q->state.nested_blocksize);
                cJSON_AddStringToObject(jq, "storage_dtype", dtype_name(t->dtype));
                json_add_item(jq, "shape", shape_json(q->state.ndim, q->state.shape));
                cJSON_AddStringToObject(jq, "output_dtype", dtype_name(out_dt));
                cJSON_AddNumberToObject(jq, "output_bytes", (double)out_bytes);
                if (cw) {
                    json_add_item(jq, "output_shape", shape_json(2, cw->shape));
                    cJSON_AddBoolToObject(jq, "transposed", 1);
                }
            } else if (owner) {
                cJSON_AddStringToObject(jt, "quant_state_of", owner->name);
            } else {
                cJSON_AddStringToObject(jt, "output_dtype", dtype_name(out_dt));
                cJSON_AddNumberToObject(jt, "output_bytes", (double)out_bytes);
            }
            if (fused) {
                cJSON *jf = cJSON_AddObjectToObject(jt, "fused_into");
                cJSON_AddStringToObject(jf, "tensor", fused->name);
                cJSON_AddNumberToObject(jf, "expert", (double)expert);
                cJSON_AddBoolToObject(jf, "transposed", !fused->bias);
            } else if (renamed) {
                cJSON_AddStringToObject(jt, "written_as", renamed);
            }
            json_add_to_array(jtensors, jt);
            continue;
        }
        put_name(out, t->name, 48);
        fprintf(out, " %-5s %-16s %12" PRIu64 "  ", dtype_name(t->dtype), shape, st_tensor_bytes(t));
        if (q) {
            shape_text(qshape, sizeof qshape, q->state.ndim, q->state.shape);
            fprintf(out, "%s blocksize %u, %s, storage %s, %s -> %s (%" PRIu64 " bytes)",
                    quant_name(q->state.quant_type), q->state.blocksize,
                    q->state.nested ? "double quant" : "single quant", dtype_name(t->dtype), qshape,
                    dtype_name(out_dt), out_bytes);
            if (cw) {
                shape_text(qshape, sizeof qshape, 2, cw->shape);
                fprintf(out, ", written transposed, %s", qshape);
            }
        } else if (owner) {
            fputs("quant state of ", out);
            put_name(out, owner->name, 0);
        } else {
            fprintf(out, "-> %s (%" PRIu64 " bytes)", dtype_name(out_dt), out_bytes);
        }
        if (fused) {
            fprintf(out, ", expert %zu of ", expert);
            put_name(out, fused->name, 0);
            fputs(fused->bias ? "" : ", transposed", out);
        } else if (renamed) {
            fputs(", written as ", out);
            put_name(out, renamed, 0);
        }
        fputc('\n', out);
    }
    if (json) {
        add_totals_json(obj, tot);
        if (is_dir && !part->as_is) /* a component copied as it is keeps every file */
            add_unused_json(m, obj);
        if (lora)
            report_lora(lora, obj, out);
    } else {
        fprintf(out,
                "\n%zu tensors in %zu file%s, %zu quantized weights; %" PRIu64 " parameters; %" PRIu64
                " bytes on disk; %" PRIu64 " bytes after conversion\n",
                m->count, m->nfiles, m->nfiles == 1 ? "" : "s", nw, tot->parameters, tot->on_disk, tot->converted);
        if (conv1d)
            fprintf(out, "%zu Conv1D weight%s of a GPT-2 architecture: written transposed, [in, out], the shape the "
                    "model loads\n", conv1d->n, conv1d->n == 1 ? "" : "s");
        if (experts)
            fprintf(out, "gpt-oss experts in Unsloth's per-expert layout: written as %zu fused tensors, as transformers "
                    "and vLLM load them\n", experts->nfused);
        if (!part->as_is)
            report_unused(m, out);
        if (lora) {
            report_lora(lora, NULL, out);
            fprintf(out, "\n%zu tensor%s changed by %zu adapter%s\n", lora->ntargets, lora->ntargets == 1 ? "" : "s",
                    lora->nadapters, lora->nadapters == 1 ? "" : "s");
        }
    }
    tot->widened = lora && lora->in_channels;
    /* Which tokenizer the output gets matters where a PEFT adapter may bring
     * its own; a diffusers LoRA on a pipeline's component has none. */
    int peft = 0;
    for (size_t i = 0; lora && i < lora->nadapters; i++)
        peft |= !lora->adapters[i].diffusers;
    if (is_dir && !part->component && (peft || o->tokenizer))
        code = report_tokenizer(in, o, obj, out);
    lora_close(lora);
    conv1d_layout_free(conv1d);
    expert_layout_free(experts);
    bnb_free(w, nw);
    model_close(m);
    return code;
}

/* What convert writes for the index of pipeline `in`, whose transformer a
 * control LoRA widens (control_index.h): the same reading, so that an index
 * convert refuses is refused here too. */
static int report_index_class(const char *in, cJSON *root, FILE *out)
{
    const char *index = pipeline_index_name(in), *control = NULL;
    if (!index) /* gone since the pipeline was listed */
        return nf4_fail(NF4_ENOINPUT, in, NULL, "no longer holds %s", PIPELINE_INDEX_NAME);
    /* a modular index is copied as it is, unread */
    const int plain = strcmp(index, PIPELINE_INDEX_NAME) == 0;
    char *path = path_join(in, index), *json = NULL, *cls = NULL, *text = NULL;
    size_t len = 0, text_len = 0;
    int code = !path ? nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory")
               : plain ? read_small_file(path, MAX_JSON_FILE_BYTES, &json, &len)
                       : NF4_OK;
    if (code == NF4_OK && plain)
        code = control_index_rewrite(path, json, len, &cls, &control, &text, &text_len);
    if (code == NF4_OK && root) {
        cJSON *j = cJSON_AddObjectToObject(root, "index_class");
        json_add_item(j, "from", cls ? cJSON_CreateString(cls) : cJSON_CreateNull());
        json_add_item(j, "to", control ? cJSON_CreateString(control) : cJSON_CreateNull());
    } else if (code == NF4_OK && control && text) {
        /* The file's class name, its control characters as '?', as in the table. */
        fprintf(out, "%s: _class_name ", index);
        put_name(out, cls, 0);
        fprintf(out, " becomes %s, the pipeline that gives the widened transformer its control image\n", control);
    } else if (code == NF4_OK && !control) {
        fprintf(out, "%s: kept as it is", index);
        if (cls) {
            fputs(" (_class_name ", out);
            put_name(out, cls, 0);
            fputs(")", out);
        }
        fputs(": only diffusers' FluxControl pipelines give the widened transformer its control image\n", out);
    }
    /* beside model_index.json, a modular pipeline's index is copied as it is */
    char *modular = plain ? path_join(in, MODULAR_PIPELINE_INDEX_NAME) : NULL;
    struct stat st;
    if (code == NF4_OK && !root && modular && stat(modular, &st) == 0 && S_ISREG(st.st_mode))
        fprintf(out, "%s: kept as it is: only diffusers' FluxControl pipelines give the widened transformer its "
                "control image\n", MODULAR_PIPELINE_INDEX_NAME);
    free(modular);
    free(path);
    free(json);
    free(cls);
    free(text);
    return code;
}

/* A diffusers pipeline: each component as a model, what convert does with it
 * (and with --lora, which LoRAs it takes), the other entries, and the totals
 * over the components. */
static int inspect_pipeline(const char *in, const struct inspect_opts *o, cJSON *root)
{
    struct pipeline_entry *e = NULL;
    size_t n = 0;
    int code = pipeline_list(in, &e, &n);
    if (code != NF4_OK)
        return code;
    modular_index_warn_remote(in);
    struct pipeline_loras pl;
    code = pipeline_loras_open(in, o->lora_dirs, o->nlora, e, n, &pl);
    struct component_loras cl = {0};
    if (code == NF4_OK)
        code = component_loras_init(&cl, &pl, in);
    struct totals sum = {0};
    size_t ncomponents = 0, nquantized = 0, nmerged = 0;
    cJSON *jcomponents = root ? cJSON_AddArrayToObject(root, "components") : NULL;
    cJSON *jcopied = root ? cJSON_AddArrayToObject(root, "copied") : NULL;
    cJSON *jskipped = root ? cJSON_AddArrayToObject(root, "not_copied") : NULL;
    size_t ncopied = 0;
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        char *path = path_join(in, e[i].name);
        if (!path) {
            code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
            break;
        }
        if (e[i].kind != ENTRY_COMPONENT) {
            /* As convert_dir.c's pipeline_write_entry: files and directories are
             * copied; checkpoints and links to nothing or outside are not. */
            const int copied = e[i].kind == ENTRY_FILE || e[i].kind == ENTRY_DIR;
            ncopied += copied;
            if (root)
                json_add_to_array(copied ? jcopied : jskipped, cJSON_CreateString(e[i].name));
            free(path);
            continue;
        }
        int quantized = 0;
        /* Whether it has 4-bit weights, or a LoRA changes it, decides what
         * convert does with it. */
        struct model *m;
        if ((code = model_open_dir(path, &m)) == NF4_OK) {
            struct bnb_weight *w = NULL;
            size_t nw = 0;
            code = bnb_collect(m, &w, &nw);
            quantized = nw > 0;
            bnb_free(w, nw);
            model_close(m);
        }
        pipeline_loras_for(&pl, e[i].name, &cl);
        struct model_part part = {e[i].name, cl.dirs, cl.n, cl.key_components, cl.converted, 0};
        part.as_is = !quantized && !part.nlora;
        const char *action = quantized ? "convert" : part.nlora ? "merge" : "copy";
        cJSON *jc = NULL;
        if (code == NF4_OK && root) {
            /* The component's report goes into jc: without it, the run
             * stops here (inspect_model would take a NULL one for the table). */
            jc = cJSON_CreateObject();
            cJSON_AddStringToObject(jc, "name", e[i].name);
            cJSON_AddStringToObject(jc, "path", path);
            cJSON_AddStringToObject(jc, "action", action);
            if (!json_add_to_array(jcomponents, jc)) {
                jc = NULL; /* deleted */
                code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
            }
        } else if (code == NF4_OK) {
            fprintf(o->out, "%s== component ", ncomponents ? "\n" : "");
            put_name(o->out, e[i].name, 0);
            fprintf(o->out, ": %s ==\n", quantized     ? "converted"
                                         : part.nlora ? "no 4-bit weights, converted to merge a LoRA, its dtypes kept"
                                                      : "no 4-bit weights, copied as it is");
        }
        struct totals t = {0};
        if (code == NF4_OK)
            code = inspect_model(path, 1, o, &part, jc, &t);
        free(path);
        add_totals(&sum, &t);
        ncomponents++;
        nquantized += quantized;
        nmerged += !quantized && part.nlora;
    }
    if (code == NF4_OK && root) {
        add_totals_json(root, &sum);
        cJSON *jt = cJSON_GetObjectItemCaseSensitive(root, "totals");
        cJSON_AddNumberToObject(jt, "components", (double)ncomponents);
        cJSON_AddNumberToObject(jt, "converted_components", (double)nquantized);
        if (o->nlora)
            cJSON_AddNumberToObject(jt, "merged_components", (double)nmerged);
    } else if (code == NF4_OK) {
        const size_t nskipped = n - ncomponents - ncopied;
        char merged[64] = "";
        if (nmerged)
            snprintf(merged, sizeof merged, ", %zu more to merge a LoRA", nmerged);
        fprintf(o->out, "\npipeline: %zu component%s (%zu converted%s, %zu copied), %zu other entr%s copied",
                ncomponents, ncomponents == 1 ? "" : "s", nquantized, merged, ncomponents - nquantized - nmerged,
                ncopied, ncopied == 1 ? "y" : "ies");
        if (nskipped)
            fprintf(o->out, ", %zu not (a checkpoint beside the components, or a link to nothing or outside)",
                    nskipped);
        fprintf(o->out, "; %" PRIu64 " tensors, %" PRIu64 " quantized weights, %" PRIu64 " parameters; %" PRIu64
                " bytes on disk; %" PRIu64 " bytes after conversion\n", sum.tensors, sum.quantized, sum.parameters,
                sum.on_disk, sum.converted);
    }
    if (code == NF4_OK && sum.widened)
        code = report_index_class(in, root, o->out);
    component_loras_free(&cl);
    pipeline_loras_close(&pl);
    pipeline_entries_free(e, n);
    return code;
}

int inspect_run(const char *in, int json, enum st_dtype dtype, const char *const *lora_dirs, size_t nlora,
                const char *tokenizer, FILE *out)
{
    enum input_layout layout;
    int code = layout_of(in, &layout);
    if (code != NF4_OK)
        return code;
    if (layout != LAYOUT_MODEL_DIR && tokenizer)
        return nf4_fail(NF4_EUSAGE, in, NULL, "is %s; --tokenizer applies to a model directory",
                        layout == LAYOUT_FILE ? "a single weights file" : "a diffusers pipeline");
    if (layout == LAYOUT_PIPELINE ? (code = pipeline_loras_check(in, lora_dirs, nlora)) != NF4_OK
                                  : (code = pipeline_lora_refuse_components(in, lora_dirs, nlora)) != NF4_OK)
        return code;
    struct inspect_opts o = {json, dtype, lora_dirs, nlora, tokenizer, {TOKENIZER_IN, NULL}, out};
    /* A bad folder fails before anything is printed. */
    if (layout == LAYOUT_MODEL_DIR && (code = tokenizer_choose(tokenizer, in, lora_dirs, nlora, &o.source)) != NF4_OK)
        return code;
    const unsigned long failures = json_allocation_failures();
    cJSON *root = json ? cJSON_CreateObject() : NULL;
    if (json && !root)
        return nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    struct totals tot;
    if (layout == LAYOUT_PIPELINE) {
        if (root)
            cJSON_AddStringToObject(root, "pipeline", in);
        /* A component found bad (its header, a LoRA's keys for it) fails
         * after others' tables are made: print them only if all are. */
        char *text = NULL;
        size_t len = 0;
        FILE *buffer = root ? NULL : open_memstream(&text, &len);
        if (!root && !buffer) {
            code = nf4_fail_errno(NF4_ESOFTWARE, errno, in, NULL, "cannot buffer the report");
        } else {
            o.out = root ? out : buffer;
            code = inspect_pipeline(in, &o, root);
        }
        if (buffer && fclose(buffer) != 0 && code == NF4_OK)
            code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
        if (code == NF4_OK && text)
            fwrite(text, 1, len, out);
        free(text);
    } else {
        const struct model_part whole = {NULL, lora_dirs, nlora, NULL, NULL, 0};
        code = inspect_model(in, layout == LAYOUT_MODEL_DIR, &o, &whole, root, &tot);
    }
    /* cJSON's Add functions leave out, unsaid, what they had no memory for. */
    if (code == NF4_OK && root && json_allocation_failures() != failures)
        code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
    if (code == NF4_OK && root) {
        char *text = json_print_pretty(root);
        if (text)
            fputs(text, out);
        else
            code = nf4_fail(NF4_ESOFTWARE, in, NULL, "out of memory");
        free(text);
    }
    cJSON_Delete(root);
    return code;
}
