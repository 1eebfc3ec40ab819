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

/* A composite model (vision-encoder-decoder, encoder-decoder: a ViT and a
 * GPT-2 captioner, say) names its parts' architectures in config.json's
 * "encoder" and "decoder", and prefixes their weights with the same word. */
static const char *const CONV1D_PARTS[] = {"encoder", "decoder"};

/* Which weights are a Conv1D architecture's: every one (*all), or those under
 * "<part>." for each part whose flag in `parts` is set. */
static int conv1d_scope(const struct model *m, int *all, int parts[2])
{
    int code = model_type_is_one_of(m, CONV1D_MODEL_TYPES, sizeof CONV1D_MODEL_TYPES / sizeof *CONV1D_MODEL_TYPES, all);
    for (size_t i = 0; code == NF4_OK && i < 2; i++) {
        char *type;
        code = model_config_part_type(m, CONV1D_PARTS[i], &type);
        parts[i] = code == NF4_OK && is_conv1d_model_type(type);
        free(type);
    }
    return code;
}

static int in_scope(const char *name, int all, const int parts[2])
{
    if (all)
        return 1;
    for (size_t i = 0; i < 2; i++) {
        size_t len = strlen(CONV1D_PARTS[i]);
        if (parts[i] && strncmp(name, CONV1D_PARTS[i], len) == 0 && name[len] == '.')
            return 1;
    }
    return 0;
}

int conv1d_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct conv1d_layout **out)
{
    *out = NULL;
    int all, parts[2];
    int code = conv1d_scope(m, &all, parts);
    if (code != NF4_OK)
        return code;
    size_t n = 0;
    for (size_t i = 0; i < nweights; i++)
        n += in_scope(weights[i].name, all, parts) && is_conv1d_weight(weights[i].name);
    if (n == 0)
        return NF4_OK;
    struct conv1d_layout *x = calloc(1, sizeof *x);
    if (!x || !(x->weights = calloc(n, sizeof *x->weights))) {
        free(x);
        return nf4_fail(NF4_ESOFTWARE, dir, NULL, "out of memory");
    }
    for (size_t i = 0; i < nweights; i++) {
        const struct bnb_weight *w = &weights[i];
        if (!in_scope(w->name, all, parts) || !is_conv1d_weight(w->name))
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
