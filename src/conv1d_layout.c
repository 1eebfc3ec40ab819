#include "conv1d_layout.h"

#include <stdlib.h>
#include <string.h>

#include "model_dir.h"
#include "status.h"

/* config.json "model_type"s with Conv1D layers, and those layers' names
 * (transformers' modeling files; decision_transformer holds a GPT-2; CLVP's
 * attention and encoder layers are nn.Linear, its decoder's MLP Conv1D). */
static const char *const CONV1D_MODEL_TYPES[] = {"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp",
                                                 "clvp_decoder"};
static const char *const CONV1D_LAYERS[] = {"c_attn", "c_proj", "c_fc", "q_attn"};

/* The layer of weight `name` ("transformer.h.0.attn.c_attn.weight" ->
 * "c_attn") is a Conv1D one. */
static int is_conv1d_weight(const char *name)
{
    const char *end = strrchr(name, '.');
    if (!end || strcmp(end, ".weight") != 0)
        return 0;
    const char *start = end;
    while (start > name && start[-1] != '.')
        start--;
    for (size_t i = 0; i < sizeof CONV1D_LAYERS / sizeof *CONV1D_LAYERS; i++)
        if ((size_t)(end - start) == strlen(CONV1D_LAYERS[i]) && memcmp(start, CONV1D_LAYERS[i], end - start) == 0)
            return 1;
    return 0;
}

static int is_conv1d_model_type(const char *type)
{
    for (size_t i = 0; type && i < sizeof CONV1D_MODEL_TYPES / sizeof *CONV1D_MODEL_TYPES; i++)
        if (strcmp(type, CONV1D_MODEL_TYPES[i]) == 0)
            return 1;
    return 0;
}

/* Where a Conv1D architecture's weights may be: the whole model, where
 * config.json's top level names one, or a composite model's part
 * (vision-encoder-decoder, encoder-decoder: a ViT and a GPT-2 captioner,
 * say), named in its "encoder" or "decoder", whose weights have that word
 * as a prefix. */
static const struct {
    const char *part;   /* NULL: the top level */
    const char *prefix; /* of its weights' names */
} SCOPES[] = {{NULL, ""}, {"encoder", "encoder."}, {"decoder", "decoder."}};
#define NSCOPES (sizeof SCOPES / sizeof *SCOPES)

/* in[i]: SCOPES[i] is a Conv1D architecture. */
static int conv1d_scopes(const struct model *m, int in[NSCOPES])
{
    int code = NF4_OK;
    for (size_t i = 0; i < NSCOPES; i++) {
        char *type = NULL;
        if (code == NF4_OK)
            code = model_config_part_type(m, SCOPES[i].part, &type);
        in[i] = code == NF4_OK && is_conv1d_model_type(type);
        free(type);
    }
    return code;
}

/* Weight `name` is a Conv1D layer's, in a scope that is a Conv1D architecture. */
static int is_conv1d_in_scope(const char *name, const int in[NSCOPES])
{
    for (size_t i = 0; i < NSCOPES; i++)
        if (in[i] && strncmp(name, SCOPES[i].prefix, strlen(SCOPES[i].prefix)) == 0)
            return is_conv1d_weight(name);
    return 0;
}

int conv1d_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct conv1d_layout **out)
{
    *out = NULL;
    int in[NSCOPES];
    int code = conv1d_scopes(m, in);
    if (code != NF4_OK)
        return code;
    size_t n = 0;
    for (size_t i = 0; i < nweights; i++)
        n += is_conv1d_in_scope(weights[i].name, in);
    if (n == 0)
        return NF4_OK;
    struct conv1d_layout *x = calloc(1, sizeof *x);
    if (!x || !(x->weights = calloc(n, sizeof *x->weights))) {
        free(x);
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    }
    for (size_t i = 0; i < nweights; i++) {
        const struct bnb_weight *w = &weights[i];
        if (!is_conv1d_in_scope(w->name, in))
            continue;
        if (w->state.ndim != 2) {
            conv1d_layout_free(x);
            return nf4_fail(NF4_EDATA, w->packed->file->path, w->name,
                            "is a Conv1D layer's weight (config.json: a GPT-2 architecture), whose quant state "
                            "must be 2-D, [out, in]");
        }
        x->weights[x->n++] = (struct conv1d_weight){.w = w, .shape = {w->state.shape[1], w->state.shape[0]}};
    }
    *out = x;
    return NF4_OK;
}

void conv1d_layout_free(struct conv1d_layout *x)
{
    if (!x)
        return;
    free(x->weights);
    free(x);
}

static int cmp_name(const void *key, const void *elem)
{
    return strcmp(key, ((const struct conv1d_weight *)elem)->w->name);
}

struct conv1d_weight *conv1d_layout_lookup(const struct conv1d_layout *x, const char *name)
{
    return x ? bsearch(name, x->weights, x->n, sizeof *x->weights, cmp_name) : NULL;
}
