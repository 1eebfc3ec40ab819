#include "expert_layout.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_dir.h"
#include "status.h"
#include "strutil.h"

#define EXPERTS_SEGMENT ".experts."
#define ROUTER_LINEAR_SEGMENT ".router.linear."
/* Experts a layer may have: gpt-oss has 32 or 128; more is not a number
 * of experts but a name that only looks like one. */
#define MAX_EXPERTS 65536u

/* The per-expert projections and the fused tensors they become. */
static const struct {
    const char *per_expert, *fused;
} PROJECTIONS[] = {{"gate_up_projs", "gate_up_proj"}, {"down_projs", "down_proj"}};

/* A tensor of Unsloth's layout, read from its name. */
struct parsed {
    size_t prefix_len; /* M.experts */
    size_t projection; /* in PROJECTIONS */
    uint64_t expert;
    int bias;
};

/* Parses M.experts.<per_expert>.N.(weight|bias), N a decimal number without
 * leading zeros below MAX_EXPERTS. */
static int parse_source(const char *name, struct parsed *p)
{
    const char *seg = NULL;
    for (const char *s = strstr(name, EXPERTS_SEGMENT); s; s = strstr(s + 1, EXPERTS_SEGMENT))
        seg = s;
    if (!seg || seg == name)
        return 0;
    const char *rest = seg + strlen(EXPERTS_SEGMENT);
    for (size_t i = 0; i < sizeof PROJECTIONS / sizeof *PROJECTIONS; i++) {
        size_t len = strlen(PROJECTIONS[i].per_expert);
        if (strncmp(rest, PROJECTIONS[i].per_expert, len) != 0 || rest[len] != '.')
            continue;
        const char *num = rest + len + 1, *end = num;
        uint64_t e = 0;
        while (*end >= '0' && *end <= '9' && e < MAX_EXPERTS)
            e = e * 10 + (uint64_t)(*end++ - '0');
        if (end == num || (*num == '0' && end - num > 1) || e >= MAX_EXPERTS)
            return 0;
        if (strcmp(end, ".weight") != 0 && strcmp(end, ".bias") != 0)
            return 0;
        *p = (struct parsed){.prefix_len = (size_t)(seg - name) + strlen(".experts"), .projection = i, .expert = e,
                             .bias = strcmp(end, ".bias") == 0};
        return 1;
    }
    return 0;
}

static char *fused_name(const char *source, const struct parsed *p)
{
    const char *fused = PROJECTIONS[p->projection].fused;
    size_t len = p->prefix_len + 1 + strlen(fused) + (p->bias ? strlen("_bias") : 0) + 1;
    char *name = malloc(len);
    if (name)
        snprintf(name, len, "%.*s.%s%s", (int)p->prefix_len, source, fused, p->bias ? "_bias" : "");
    return name;
}

static int cmp_source(const void *a, const void *b)
{
    return strcmp(((const struct expert_source *)a)->name, ((const struct expert_source *)b)->name);
}

static int cmp_rename(const void *a, const void *b)
{
    return strcmp(((const struct expert_rename *)a)->from, ((const struct expert_rename *)b)->from);
}

void expert_layout_free(struct expert_layout *x)
{
    if (!x)
        return;
    for (size_t i = 0; i < x->nfused; i++) {
        free(x->fused[i].name);
        free(x->fused[i].sources);
        free(x->fused[i].parts);
        free(x->fused[i].flipped);
    }
    free(x->fused);
    for (size_t i = 0; i < x->nrenames; i++)
        free(x->renames[i].to);
    free(x->renames);
    free(x->sources);
    free(x);
}

/* The fused tensor `name`, added if new. */
static struct fused_experts *fused_for(struct expert_layout *x, char *name, int bias, size_t *cap)
{
    for (size_t i = 0; i < x->nfused; i++)
        if (strcmp(x->fused[i].name, name) == 0) {
            free(name);
            return &x->fused[i];
        }
    if (x->nfused == *cap) {
        size_t grown = *cap ? *cap * 2 : 16;
        struct fused_experts *f = realloc(x->fused, grown * sizeof *f);
        if (!f) {
            free(name);
            return NULL;
        }
        x->fused = f;
        *cap = grown;
    }
    struct fused_experts *f = &x->fused[x->nfused++];
    *f = (struct fused_experts){.name = name, .bias = bias};
    return f;
}

/* The logical shape of tensor mt: its 4-bit weight's, or its own. */
static void logical_shape(const struct model_tensor *mt, const struct bnb_weight *weights, size_t nweights,
                          size_t *ndim, const uint64_t **shape, int *four_bit)
{
    const struct bnb_weight *w = bnb_find(weights, nweights, mt->t->name);
    *four_bit = w != NULL;
    *ndim = w ? w->state.ndim : mt->t->ndim;
    *shape = w ? w->state.shape : mt->t->shape;
}

static int is_fusable_float(enum st_dtype dt)
{
    return dt == DT_F16 || dt == DT_BF16 || dt == DT_F32 || dt == DT_F64;
}

/* Puts expert e's sources in order and checks that every expert is there
 * once and that their shapes agree: [R, C] for the weights, [R] for the
 * biases. */
static int check_fused(struct fused_experts *f, const struct bnb_weight *weights, size_t nweights)
{
    const struct model_tensor **by_expert = calloc(f->nexperts, sizeof *by_expert);
    if (!by_expert)
        return nf4_fail(NF4_ESOFTWARE, f->sources[0]->file->path, f->name, "out of memory");
    int code = NF4_OK;
    for (size_t i = 0; i < f->nexperts && code == NF4_OK; i++) {
        struct parsed p;
        parse_source(f->sources[i]->t->name, &p);
        if (p.expert >= f->nexperts)
            code = nf4_fail(NF4_EDATA, f->sources[i]->file->path, f->sources[i]->t->name,
                            "expert %" PRIu64 " of %s, which has %zu in Unsloth's per-expert layout: one of experts "
                            "0 to %zu is missing, so they cannot be fused", p.expert, f->name, f->nexperts,
                            f->nexperts - 1);
        else
            by_expert[p.expert] = f->sources[i];
    }
    for (size_t e = 0; e < f->nexperts && code == NF4_OK; e++) {
        const struct model_tensor *mt = by_expert[e];
        size_t ndim;
        const uint64_t *shape;
        int four_bit;
        logical_shape(mt, weights, nweights, &ndim, &shape, &four_bit);
        if (!four_bit && !is_fusable_float(mt->t->dtype))
            code = nf4_fail(NF4_EDATA, mt->file->path, mt->t->name, "an expert's tensor of %s is %s, neither 4-bit "
                            "nor F16, BF16, F32 or F64", f->name, dtype_name(mt->t->dtype));
        else if (ndim != (f->bias ? 1u : 2u))
            code = nf4_fail(NF4_EDATA, mt->file->path, mt->t->name, "an expert's %s of %s has %zu dimensions, not %d",
                            f->bias ? "bias" : "weight", f->name, ndim, f->bias ? 1 : 2);
        else if (!f->bias && (shape[0] == 0 || shape[1] == 0))
            code = nf4_fail(NF4_EDATA, mt->file->path, mt->t->name, "an expert's weight of %s has no elements",
                            f->name);
        else if (e == 0)
            memcpy(f->part_shape, shape, ndim * sizeof *shape);
        else if (shape[0] != f->part_shape[0] || (!f->bias && shape[1] != f->part_shape[1]))
            code = nf4_fail(NF4_EDATA, mt->file->path, mt->t->name, "an expert's %s of %s has another shape than "
                            "expert 0's", f->bias ? "bias" : "weight", f->name);
    }
    if (code == NF4_OK) {
        memcpy(f->sources, by_expert, f->nexperts * sizeof *by_expert);
        f->ndim = f->bias ? 2 : 3;
        f->shape[0] = f->nexperts;
        if (f->bias) {
            f->shape[1] = f->part_shape[0];
        } else { /* [R, C] transposed */
            uint64_t rows = f->part_shape[0];
            f->part_shape[0] = f->part_shape[1];
            f->part_shape[1] = rows;
            f->shape[1] = f->part_shape[0];
            f->shape[2] = f->part_shape[1];
        }
    }
    free(by_expert);
    return code;
}

/* A bias stack must go with its weights: as many experts, one value per row. */
static int check_biases(const struct expert_layout *x)
{
    for (size_t i = 0; i < x->nfused; i++) {
        const struct fused_experts *b = &x->fused[i];
        if (!b->bias)
            continue;
        size_t len = strlen(b->name) - strlen("_bias");
        const struct fused_experts *w = NULL;
        for (size_t k = 0; k < x->nfused; k++)
            if (!x->fused[k].bias && strlen(x->fused[k].name) == len && strncmp(x->fused[k].name, b->name, len) == 0)
                w = &x->fused[k];
        if (!w)
            return nf4_fail(NF4_EDATA, b->sources[0]->file->path, b->sources[0]->t->name,
                            "experts' biases without their weights (Unsloth's per-expert layout, fused here)");
        if (w->nexperts != b->nexperts || w->part_shape[1] != b->part_shape[0])
            return nf4_fail(NF4_EDATA, b->sources[0]->file->path, b->sources[0]->t->name,
                            "experts' biases (%zu of %" PRIu64 ") that do not fit their weights (%zu of [%" PRIu64
                            ", %" PRIu64 "])", b->nexperts, b->part_shape[0], w->nexperts, w->part_shape[1],
                            w->part_shape[0]);
    }
    return NF4_OK;
}

/* The checkpoint must not hold what the fused layout writes. */
static int check_names_free(const struct expert_layout *x, const struct model *m)
{
    for (size_t i = 0; i < x->nfused; i++)
        if (model_find(m, x->fused[i].name))
            return nf4_fail(NF4_EDATA, model_find(m, x->fused[i].name)->file->path, x->fused[i].name,
                            "is there beside the per-expert tensors it is fused from (%s)",
                            x->fused[i].sources[0]->t->name);
    for (size_t i = 0; i < x->nrenames; i++)
        if (model_find(m, x->renames[i].to))
            return nf4_fail(NF4_EDATA, model_find(m, x->renames[i].to)->file->path, x->renames[i].to,
                            "is there beside %s, which nf4deq writes under its name", x->renames[i].from);
    return NF4_OK;
}

static int collect(struct expert_layout *x, const struct model *m)
{
    size_t fused_cap = 0, renames_cap = 0;
    for (size_t i = 0; i < m->count; i++) {
        const struct model_tensor *mt = &m->tensors[i];
        const char *name = mt->t->name;
        if (bnb_is_state_part(name))
            continue;
        struct parsed p;
        const char *router = strstr(name, ROUTER_LINEAR_SEGMENT);
        if (parse_source(name, &p)) {
            char *fname = fused_name(name, &p);
            struct fused_experts *f = fname ? fused_for(x, fname, p.bias, &fused_cap) : NULL;
            const struct model_tensor **grown = f ? realloc(f->sources, (f->nexperts + 1) * sizeof *grown) : NULL;
            if (!grown)
                return nf4_fail(NF4_ESOFTWARE, mt->file->path, name, "out of memory");
            f->sources = grown;
            f->sources[f->nexperts++] = mt;
        } else if (router && router != name &&
                   (strcmp(router, ROUTER_LINEAR_SEGMENT "weight") == 0 ||
                    strcmp(router, ROUTER_LINEAR_SEGMENT "bias") == 0)) {
            if (x->nrenames == renames_cap) {
                renames_cap = renames_cap ? renames_cap * 2 : 16;
                struct expert_rename *r = realloc(x->renames, renames_cap * sizeof *r);
                if (!r)
                    return nf4_fail(NF4_ESOFTWARE, mt->file->path, name, "out of memory");
                x->renames = r;
            }
            size_t keep = (size_t)(router - name) + strlen(".router.");
            char *to = malloc(strlen(name) + 1);
            if (!to)
                return nf4_fail(NF4_ESOFTWARE, mt->file->path, name, "out of memory");
            snprintf(to, strlen(name) + 1, "%.*s%s", (int)keep, name, router + strlen(ROUTER_LINEAR_SEGMENT));
            x->renames[x->nrenames++] = (struct expert_rename){name, to};
        }
    }
    return NF4_OK;
}

static int index_sources(struct expert_layout *x, const char *dir)
{
    for (size_t i = 0; i < x->nfused; i++)
        x->nsources += x->fused[i].nexperts;
    x->sources = calloc(x->nsources ? x->nsources : 1, sizeof *x->sources);
    if (!x->sources)
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < x->nfused; i++)
        for (size_t e = 0; e < x->fused[i].nexperts; e++)
            x->sources[n++] = (struct expert_source){x->fused[i].sources[e]->t->name, i, e};
    qsort(x->sources, n, sizeof *x->sources, cmp_source);
    if (x->nrenames) /* renames is NULL when there are none */
        qsort(x->renames, x->nrenames, sizeof *x->renames, cmp_rename);
    return NF4_OK;
}

int expert_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct expert_layout **out)
{
    *out = NULL;
    char *type;
    int code = model_config_part_type(m, NULL, &type);
    int gpt_oss = code == NF4_OK && type && strcmp(type, UNSLOTH_EXPERTS_MODEL_TYPE) == 0;
    free(type);
    if (!gpt_oss)
        return code;
    struct expert_layout *x = calloc(1, sizeof *x);
    if (!x)
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    code = collect(x, m);
    for (size_t i = 0; i < x->nfused && code == NF4_OK; i++)
        code = check_fused(&x->fused[i], weights, nweights);
    if (code == NF4_OK)
        code = check_biases(x);
    if (code == NF4_OK)
        code = check_names_free(x, m);
    if (code == NF4_OK)
        code = index_sources(x, dir);
    if (code != NF4_OK || (x->nfused == 0 && x->nrenames == 0)) {
        expert_layout_free(x);
        return code;
    }
    *out = x;
    return NF4_OK;
}

void expert_layout_lookup(const struct expert_layout *x, const char *name, const struct fused_experts **fused,
                          size_t *expert, const char **renamed)
{
    *fused = NULL;
    *renamed = NULL;
    *expert = 0;
    if (!x)
        return;
    struct expert_source key = {.name = name};
    const struct expert_source *s = bsearch(&key, x->sources, x->nsources, sizeof *x->sources, cmp_source);
    if (s) {
        *fused = &x->fused[s->fused];
        *expert = s->expert;
        return;
    }
    struct expert_rename rkey = {.from = name};
    const struct expert_rename *r =
        x->nrenames ? bsearch(&rkey, x->renames, x->nrenames, sizeof *x->renames, cmp_rename) : NULL;
    if (r)
        *renamed = r->to;
}
