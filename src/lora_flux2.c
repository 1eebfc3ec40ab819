#include "lora_flux2.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_kohya.h"
#include "lora_lokr_forms.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strutil.h"

#define BFL_PREFIX "diffusion_model."
#define PEFT_PREFIX "base_model.model."
#define FLUX2_TARGET "transformer."
#define KOHYA_DOWN ".lora_down.weight"
#define KOHYA_UP ".lora_up.weight"
#define KOHYA_ALPHA ".alpha"
#define KOHYA_UNET "lora_unet_"
#define KOHYA_DOUBLE "lora_unet_double_blocks_"
#define KOHYA_SINGLE "lora_unet_single_blocks_"
/* The longest name built here: a key's module and a factor's suffix. */
#define FLUX2_NAME_MAX 1024

/* A module of BFL's name and diffusers' for it (a fused qkv holds
 * diffusers' three), and whether kohya's conversion knows it too, by BFL's
 * name with underscores for dots (img_attn.qkv: img_attn_qkv). */
struct flux2_map {
    const char *theirs;
    size_t nparts;
    const char *ours[3];
    int kohya;
};

static const struct flux2_map DOUBLE_BLOCK[] = {
    {"img_attn.qkv", 3, {"attn.to_q", "attn.to_k", "attn.to_v"}, 1},
    {"txt_attn.qkv", 3, {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}, 1},
    {"img_attn.proj", 1, {"attn.to_out.0"}, 1},
    {"txt_attn.proj", 1, {"attn.to_add_out"}, 1},
    {"img_mlp.0", 1, {"ff.linear_in"}, 1},
    {"img_mlp.2", 1, {"ff.linear_out"}, 1},
    {"txt_mlp.0", 1, {"ff_context.linear_in"}, 1},
    {"txt_mlp.2", 1, {"ff_context.linear_out"}, 1},
};

static const struct flux2_map SINGLE_BLOCK[] = {
    {"linear1", 1, {"attn.to_qkv_mlp_proj"}, 1},
    {"linear2", 1, {"attn.to_out"}, 1},
};

static const struct flux2_map TOP_LEVEL[] = {
    {"img_in", 1, {"x_embedder"}, 1},
    {"txt_in", 1, {"context_embedder"}, 1},
    {"time_in.in_layer", 1, {"time_guidance_embed.timestep_embedder.linear_1"}, 1},
    {"time_in.out_layer", 1, {"time_guidance_embed.timestep_embedder.linear_2"}, 1},
    {"guidance_in.in_layer", 1, {"time_guidance_embed.guidance_embedder.linear_1"}, 0},
    {"guidance_in.out_layer", 1, {"time_guidance_embed.guidance_embedder.linear_2"}, 0},
    {"final_layer.linear", 1, {"proj_out"}, 1},
    {"final_layer.adaLN_modulation.1", 1, {"norm_out.linear"}, 0},
    {"single_stream_modulation.lin", 1, {"single_stream_modulation.linear"}, 0},
    {"double_stream_modulation_img.lin", 1, {"double_stream_modulation_img.linear"}, 0},
    {"double_stream_modulation_txt.lin", 1, {"double_stream_modulation_txt.linear"}, 0},
};

/* Keys kept as they are, but for their start: some exports already have
 * diffusers' block names ("sformer_blocks.": transformer.transformer_blocks.
 * less the 16 characters of diffusion_model.). */
static const char *const EXPANDED[][2] = {
    {"single_transformer_blocks.", "single_transformer_blocks."},
    {"transformer_blocks.", "transformer_blocks."},
    {"sformer_blocks.", "transformer_blocks."},
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys (DoRA scales aside), renamed as diffusers renames them, sorted */
    size_t nkeys;
    struct lora_rewrite rw;
};

/* Whether BFL's name `theirs` is name[0..len): as it is, or in kohya's
 * form, with underscores for its dots. */
static int same_name(const char *theirs, const char *name, size_t len, int kohya)
{
    if (strlen(theirs) != len)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (name[i] != (kohya && theirs[i] == '.' ? '_' : theirs[i]))
            return 0;
    return 1;
}

/* The module of `maps` named name[0..len) (in kohya's form where `kohya`, among those its conversion knows). */
static const struct flux2_map *find_map(const struct flux2_map *maps, size_t n, const char *name, size_t len,
                                        int kohya)
{
    for (size_t i = 0; i < n; i++)
        if ((!kohya || maps[i].kohya) && same_name(maps[i].theirs, name, len, kohya))
            return &maps[i];
    return NULL;
}

/* Whether s[0..len) is a block number as diffusers' f"{i}" writes it. */
static int is_decimal(const char *s, size_t len)
{
    if (len == 0 || len > 18 || (s[0] == '0' && len > 1))
        return 0;
    for (size_t i = 0; i < len; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

static int is_kohya_key(const char *k)
{
    return strstr(k, KOHYA_DOWN) != NULL;
}

static int is_peft_key(const char *k)
{
    return str_starts_with(k, PEFT_PREFIX);
}

static int is_bfl_key(const char *k)
{
    return str_starts_with(k, BFL_PREFIX);
}

static int is_lokr_key(const char *k)
{
    return strstr(k, ".lokr_") != NULL;
}

/* A key whose block number (len bytes at `number`, after the key's first
 * `prefix` bytes) nf4deq does not read: none at all, which diffusers raises
 * on too; or one in Unicode's digits, which Python's int() reads and nf4deq
 * refuses on purpose. */
static int refuse_block_number(const struct conversion *cv, const struct lora_key *k, size_t prefix,
                               const char *number, size_t len)
{
    int unicode = 0;
    for (size_t i = 0; i < len; i++)
        unicode |= (unsigned char)number[i] >= 0x80;
    if (unicode)
        return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a block number that is not ASCII digits after "
                        "%.*s, which nf4deq does not read (Python's int() may read Unicode digits)", (int)prefix,
                        k->name);
    return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has no block number where diffusers reads one (%.*s)",
                    (int)prefix, k->name);
}

/* ---- BFL's names: diffusion_model. ---- */

/* The block number of "double_blocks.N...." (int(k.split(".")[1])): refused
 * where it is no integer (diffusers raises); *decimal: written as diffusers
 * writes the blocks it looks for. */
static int bfl_block(const struct conversion *cv, const struct lora_key *k, const char **number, size_t *len,
                     int *decimal)
{
    *number = strchr(k->name, '.') + 1;
    const char *dot = strchr(*number, '.');
    *len = dot ? (size_t)(dot - *number) : strlen(*number);
    int64_t b;
    if (!lora_python_int(*number, *len, &b))
        return refuse_block_number(cv, k, (size_t)(*number - k->name), *number, *len);
    *decimal = is_decimal(*number, *len);
    return NF4_OK;
}

/* A fused qkv's lora_B as three blocks of rows (torch.chunk(B, 3)): each
 * part's lora_B, bytes as they are. */
static int add_qkv_up(struct conversion *cv, const char *root, const struct flux2_map *m, const struct lora_key *k)
{
    const struct st_tensor *t = k->t->t;
    int code = lora_check_factor_dtype(cv->path, t); /* its rows are copied as bytes: whole ones */
    if (code != NF4_OK)
        return code;
    if (t->ndim != 2 || t->shape[0] % 3 != 0 || t->shape[0] == 0)
        return nf4_fail(NF4_EDATA, cv->path, t->name, "is not a fused qkv's lora_B [3 * out, r], which diffusers "
                        "cuts into equal parts for %s, %s and %s", m->ours[0], m->ours[1], m->ours[2]);
    const uint64_t rows = t->shape[0] / 3;
    for (size_t j = 0; j < 3 && code == NF4_OK; j++) {
        char target[FLUX2_NAME_MAX];
        snprintf(target, sizeof target, "%s%s", root, m->ours[j]);
        code = lora_rewrite_add_rows(&cv->rw, target, ".lora_B.weight", k->t, j * rows, rows);
    }
    return code;
}

/* One key "<module>.<lora_A|lora_B>.weight" of a module of `maps` under
 * `root` ("transformer.transformer_blocks.0."): 0 where it is none. */
static int bfl_module(struct conversion *cv, const char *rest, const struct flux2_map *maps, size_t n,
                      const char *root, const struct lora_key *k, int *code)
{
    static const char *const FACTORS[] = {".lora_A.weight", ".lora_B.weight"};
    for (size_t f = 0; f < 2; f++) {
        if (!str_ends_with(rest, FACTORS[f]))
            continue;
        const struct flux2_map *m = find_map(maps, n, rest, strlen(rest) - strlen(FACTORS[f]), 0);
        if (!m)
            return 0;
        if (m->nparts == 3 && f == 1) {
            *code = add_qkv_up(cv, root, m, k);
            return 1;
        }
        if (m->nparts == 3 && k->t->t->ndim == 0) { /* torch.cat of a 0-dim tensor raises */
            *code = nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is a single number, not a fused qkv's lora_A");
            return 1;
        }
        for (size_t j = 0; j < m->nparts && *code == NF4_OK; j++) { /* a qkv's lora_A goes to each part */
            char target[FLUX2_NAME_MAX];
            snprintf(target, sizeof target, "%s%s", root, m->ours[j]);
            *code = lora_rewrite_add_copy(&cv->rw, target, FACTORS[f], k->t);
        }
        return 1;
    }
    return 0;
}

/* One key of the BFL form, as _convert_non_diffusers_flux2_lora_to_diffusers
 * takes it; refused where it takes none ("original_state_dict should be
 * empty"). */
static int convert_bfl_key(struct conversion *cv, const struct lora_key *k)
{
    const char *name = k->name;
    for (size_t e = 0; e < COUNT(EXPANDED); e++)
        if (str_starts_with(name, EXPANDED[e][0])) {
            /* load_lora_weights: "Invalid adapter checkpoint" for a key without "lora" or "lokr" */
            if (!strstr(name, "lora") && !strstr(name, "lokr"))
                return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is no LoRA factor (no \"lora\" in its "
                                "name), which diffusers refuses");
            if (!strstr(name, "lora")) /* "lokr" in it, of no LoKr factor: PEFT would leave it out */
                return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is neither a LoRA factor nor a LoKr one");
            char target[FLUX2_NAME_MAX];
            snprintf(target, sizeof target, "%s%s", FLUX2_TARGET, EXPANDED[e][1]);
            return lora_rewrite_add_copy(&cv->rw, target, name + strlen(EXPANDED[e][0]), k->t);
        }
    int code = NF4_OK, double_block = str_starts_with(name, "double_blocks.");
    if (double_block || str_starts_with(name, "single_blocks.")) {
        const char *number = NULL;
        size_t len = 0;
        int decimal = 0;
        if ((code = bfl_block(cv, k, &number, &len, &decimal)) != NF4_OK)
            return code;
        char root[64];
        snprintf(root, sizeof root, "%s%s.%.*s.", FLUX2_TARGET,
                 double_block ? "transformer_blocks" : "single_transformer_blocks", (int)len, number);
        if (decimal && number[len] == '.' &&
            (double_block ? bfl_module(cv, number + len + 1, DOUBLE_BLOCK, COUNT(DOUBLE_BLOCK), root, k, &code)
                          : bfl_module(cv, number + len + 1, SINGLE_BLOCK, COUNT(SINGLE_BLOCK), root, k, &code)))
            return code;
    } else if (bfl_module(cv, name, TOP_LEVEL, COUNT(TOP_LEVEL), FLUX2_TARGET, k, &code)) {
        return code;
    }
    return nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "is not a key diffusers reads from a Flux.2 LoRA in BFL's "
                    "names: only lora_A and lora_B weights of double_blocks.N, single_blocks.N and the embedders, "
                    "under \"" BFL_PREFIX "\", and no alphas");
}

static int convert_bfl(struct conversion *cv, const struct model *w)
{
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    /* PEFT's form: every "base_model.model." in every key (str.replace), where one starts with it */
    if (code == NF4_OK && lora_model_any_key(w, is_peft_key))
        code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, PEFT_PREFIX, BFL_PREFIX);
    if (code != NF4_OK)
        return code;
    lora_keys_cut(cv->keys, cv->nkeys, strlen(BFL_PREFIX));
    int down_up = 0;
    for (size_t i = 0; i < cv->nkeys; i++)
        down_up |= strstr(cv->keys[i].name, "lora_down") || strstr(cv->keys[i].name, "lora_up");
    if (down_up && (code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, "lora_down", "lora_A")) == NF4_OK)
        code = lora_keys_replace(cv->path, cv->keys, cv->nkeys, "lora_up", "lora_B");
    if (code != NF4_OK)
        return code;
    lora_keys_sort(cv->keys, cv->nkeys);
    code = lora_keys_check_distinct(cv->path, cv->keys, cv->nkeys);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        code = convert_bfl_key(cv, &cv->keys[i]);
    return code;
}

/* ---- kohya's names: lora_unet_ ---- */

static struct lora_key *find(const struct conversion *cv, const char *module, size_t len, const char *suffix)
{
    char name[FLUX2_NAME_MAX];
    if ((size_t)snprintf(name, sizeof name, "%.*s%s", (int)len, module, suffix) >= sizeof name)
        return NULL;
    return lora_key_find(cv->keys, cv->nkeys, name);
}

/* The module of a down factor's key `module` (len bytes) and its target
 * root, where diffusers' conversion looks for it; NULL where it does not. */
static const struct flux2_map *kohya_module(const char *module, size_t len, char *root, size_t size)
{
    static const struct {
        const char *prefix, *ours;
        const struct flux2_map *maps;
        size_t n;
    } BLOCKS[] = {
        {KOHYA_DOUBLE, "transformer_blocks", DOUBLE_BLOCK, COUNT(DOUBLE_BLOCK)},
        {KOHYA_SINGLE, "single_transformer_blocks", SINGLE_BLOCK, COUNT(SINGLE_BLOCK)},
    };
    for (size_t b = 0; b < COUNT(BLOCKS); b++) {
        size_t plen = strlen(BLOCKS[b].prefix);
        if (len <= plen || strncmp(module, BLOCKS[b].prefix, plen) != 0)
            continue;
        const char *number = module + plen, *us = memchr(number, '_', len - plen);
        if (!us || !is_decimal(number, (size_t)(us - number)))
            return NULL;
        snprintf(root, size, "%s%s.%.*s.", FLUX2_TARGET, BLOCKS[b].ours, (int)(us - number), number);
        return find_map(BLOCKS[b].maps, BLOCKS[b].n, us + 1, len - (size_t)(us + 1 - module), 1);
    }
    snprintf(root, size, "%s", FLUX2_TARGET);
    const size_t unet = strlen(KOHYA_UNET);
    return len > unet && strncmp(module, KOHYA_UNET, unet) == 0
               ? find_map(TOP_LEVEL, COUNT(TOP_LEVEL), module + unet, len - unet, 1)
               : NULL;
}

/* diffusers counts the blocks of every key "lora_unet_double_blocks_N..."
 * (int(k.split("_")[4])) before converting: refused where N is no integer. */
static int check_kohya_blocks(const struct conversion *cv)
{
    for (size_t i = 0; i < cv->nkeys; i++) {
        const char *k = cv->keys[i].name;
        if (!str_starts_with(k, KOHYA_DOUBLE) && !str_starts_with(k, KOHYA_SINGLE))
            continue;
        const char *number = k + strlen(KOHYA_DOUBLE), *us = strchr(number, '_'); /* both prefixes are as long */
        int64_t b;
        const size_t len = us ? (size_t)(us - number) : strlen(number);
        if (!lora_python_int(number, len, &b))
            return refuse_block_number(cv, &cv->keys[i], (size_t)(number - k), number, len);
    }
    return NF4_OK;
}

/* The length of a key's module: the key less its factor's suffix. */
static size_t kohya_module_len(const char *key)
{
    static const char *const SUFFIXES[] = {KOHYA_DOWN, KOHYA_UP, KOHYA_ALPHA};
    for (size_t i = 0; i < COUNT(SUFFIXES); i++)
        if (str_ends_with(key, SUFFIXES[i]))
            return strlen(key) - strlen(SUFFIXES[i]);
    return strlen(key);
}

static int convert_kohya(struct conversion *cv, const struct model *w)
{
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    if (code != NF4_OK)
        return code;
    lora_keys_sort(cv->keys, cv->nkeys);
    if ((code = check_kohya_blocks(cv)) != NF4_OK)
        return code;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct lora_key *down = &cv->keys[i];
        if (!str_has_suffix(down->name, KOHYA_DOWN))
            continue;
        size_t len = strlen(down->name) - strlen(KOHYA_DOWN);
        char root[FLUX2_NAME_MAX];
        const struct flux2_map *m = kohya_module(down->name, len, root, sizeof root);
        if (!m)
            continue;
        struct lora_key *up = find(cv, down->name, len, KOHYA_UP), *alpha = find(cv, down->name, len, KOHYA_ALPHA);
        if (!up) {
            code = nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching lora_up.weight");
            break;
        }
        down->taken = up->taken = 1;
        if (alpha)
            alpha->taken = 1;
        const struct kohya_factors f = {down->t, up->t, alpha ? alpha->t : NULL};
        code = kohya_fold_module(&cv->rw, &f, root, m->ours, NULL, m->nparts);
    }
    /* diffusers: "Unsupported keys for Kohya Flux2 LoRA conversion", a warning */
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken) /* named by its module, once */
            lora_rewrite_leave_out(&cv->rw, cv->keys[i].t->t->name, kohya_module_len(cv->keys[i].name), 1);
    if (code == NF4_OK && cv->rw.nparts == 0)
        code = nf4_fail(NF4_EDATA, cv->path, NULL, "has none of the modules diffusers converts from a kohya Flux.2 "
                        "LoRA (lora_unet_double_blocks_N_..., lora_unet_single_blocks_N_...)%s: diffusers would "
                        "load nothing of it", lora_model_any_key(w, is_bfl_key) ? "; its diffusion_model. keys with lora_down "
                        "and lora_up are read as kohya's, and none of them converts" : "");
    return code;
}

/* ---- both ---- */

int flux2_lora_detect(const struct model *w)
{
    return lora_model_any_key(w, is_kohya_key) || lora_model_any_key(w, is_peft_key) ||
           lora_model_any_key(w, is_bfl_key) || lokr_flux2_converts(w);
}

int flux2_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    const int kohya = lora_model_any_key(w, is_kohya_key);
    /* diffusers reads a file with kohya's factors as kohya's (its LoKr keys left out), else any LoKr key makes
     * it a LoKr */
    if (!kohya && lora_model_any_key(w, is_lokr_key))
        return lokr_convert_flux2(w, path, warn, out);
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    for (size_t i = 0; i < w->count; i++) /* dropped before either conversion, with a warning */
        if (lora_is_dora_scale(w->tensors[i].t->name))
            lora_rewrite_leave_out(&cv.rw, w->tensors[i].t->name, strlen(w->tensors[i].t->name), 1);
    int code = kohya ? convert_kohya(&cv, w) : convert_bfl(&cv, w);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn,
                               kohya ? "are DoRA scales or keys diffusers does not convert from a kohya Flux.2 LoRA"
                                     : "are DoRA scales, which diffusers drops",
                               out);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
