#include "conv1d_layout.h"

#include <stdlib.h>
#include <string.h>

#include "model_dir.h"
#include "status.h"
#include "strutil.h"

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
 * config.json's top level names one, or a composite model's part, named in
 * its "encoder" or "decoder" (vision-encoder-decoder, encoder-decoder: a ViT
 * and a GPT-2 captioner, say), whose weights have that word as a prefix, or
 * in its "text_config" (BLIP-2's language model, under "language_model.",
 * or "model.language_model." where transformers nests it; a
 * vision-text dual encoder's, under "text_model."). */
#define SCOPE_PREFIXES 3
static const struct {
    const char *part;                     /* NULL: the top level */
    const char *prefixes[SCOPE_PREFIXES]; /* of its weights' names; NULL after the last */
} SCOPES[] = {{NULL, {""}},
              {"encoder", {"encoder."}},
              {"decoder", {"decoder."}},
              {"text_config", {"language_model.", "model.language_model.", "text_model."}}};
#define NSCOPES (sizeof SCOPES / sizeof *SCOPES)

/* in[i]: SCOPES[i] is a Conv1D architecture; *typed: config.json names a
 * type at all, the model's or a part's. */
static int conv1d_scopes(const struct model *m, int in[NSCOPES], int *typed)
{
    int code = NF4_OK;
    *typed = 0;
    for (size_t i = 0; i < NSCOPES; i++) {
        char *type = NULL;
        if (code == NF4_OK)
            code = model_config_part_type(m, SCOPES[i].part, &type);
        in[i] = code == NF4_OK && is_conv1d_model_type(type);
        *typed |= type != NULL; /* a composite's part names one too */
        free(type);
    }
    return code;
}

/* With no config.json to name the architecture (a single file alone, say),
 * 4-bit weights named as Conv1D layers stay as recorded: other models name
 * linear layers so too (Qwen's c_attn, CLIP's c_fc), so their shape is not
 * guessed, but the user hears why a GPT-2 would not load them. */
static void warn_untyped(const struct bnb_weight *weights, size_t nweights)
{
    size_t n = 0, first = 0;
    for (size_t i = 0; i < nweights; i++)
        if (is_conv1d_weight(weights[i].name) && weights[i].state.ndim == 2 && n++ == 0)
            first = i;
    if (n)
        nf4_warn("%s: %zu 4-bit weight%s named like GPT-2's Conv1D layers (%s%s), which GPT-2 loads [in, out]; no "
                 "config.json names the model's type, so %s written [out, in], as bitsandbytes recorded %s",
                 weights[first].packed->file->path, n, n == 1 ? " is" : "s are", weights[first].name,
                 n == 1 ? "" : "...", n == 1 ? "it is" : "they are", n == 1 ? "it" : "them");
}

/* Weight `name` is a Conv1D layer's, in a scope that is a Conv1D architecture. */
static int is_conv1d_in_scope(const char *name, const int in[NSCOPES])
{
    for (size_t i = 0; i < NSCOPES; i++)
        for (size_t k = 0; in[i] && k < SCOPE_PREFIXES && SCOPES[i].prefixes[k]; k++)
            if (str_starts_with(name, SCOPES[i].prefixes[k]))
                return is_conv1d_weight(name);
    return 0;
}

int conv1d_layout_find(const char *dir, const struct model *m, const struct bnb_weight *weights, size_t nweights,
                       struct conv1d_layout **out)
{
    *out = NULL;
    int in[NSCOPES], typed;
    int code = conv1d_scopes(m, in, &typed);
    if (code != NF4_OK)
        return code;
    if (!typed)
        warn_untyped(weights, nweights);
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
