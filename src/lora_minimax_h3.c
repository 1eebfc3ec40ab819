#include "lora_minimax_h3.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_util.h"
#include "lora_diffusers.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define H3_TARGET "transformer"
#define H3_COMFY "diffusion_model."
#define H3_MUSUBI "lora_unet_"
/* What makes a key PEFT's (DiffSynth-Studio's and a PEFT dump's). */
#define H3_PEFT_INFIX ".default."
/* The __metadata__ entry lightx2v's files record their training alpha in. */
#define H3_METADATA_ALPHA "alpha"
/* The head width diffusers de-interleaves DiffSynth's fused qkv by: every
 * released MiniMax-H3 partition's. */
#define H3_HEAD_DIM 128u
/* Room for a target module's name: a key is at most LORA_KEY_MAX bytes. */
#define H3_NAME_MAX (LORA_KEY_MAX + 64)

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* The starts of the original checkpoint's names, by which diffusers tells
 * a file it converts. */
static const char *const ORIGINAL_STARTS[] = {H3_COMFY, "blocks.", "token_refiner.blocks.", "final_layer.", H3_MUSUBI};

/* musubi-tuner's flattened module names, as diffusers' table matches each
 * whole (re.fullmatch) and dots it: head, a block number where `numbered`,
 * tail; one row per alternative of its patterns, in their order. */
static const struct {
    const char *flat_head;
    int numbered;
    const char *flat_tail, *dotted_head, *dotted_tail;
} MUSUBI[] = {
    {"blocks_", 1, "_attn_qkv_proj", "blocks.", ".attn.qkv_proj"},
    {"blocks_", 1, "_attn_out_proj", "blocks.", ".attn.out_proj"},
    {"blocks_", 1, "_mlp_fc1", "blocks.", ".mlp.fc1"},
    {"blocks_", 1, "_mlp_fc2", "blocks.", ".mlp.fc2"},
    {"blocks_", 1, "_adaln_proj_linear", "blocks.", ".adaln_proj.linear"},
    {"token_refiner_blocks_", 1, "_attn_qkv_proj", "token_refiner.blocks.", ".attn.qkv_proj"},
    {"token_refiner_blocks_", 1, "_attn_out_proj", "token_refiner.blocks.", ".attn.out_proj"},
    {"token_refiner_blocks_", 1, "_mlp_fc1", "token_refiner.blocks.", ".mlp.fc1"},
    {"token_refiner_blocks_", 1, "_mlp_fc2", "token_refiner.blocks.", ".mlp.fc2"},
    {"video_patch_proj", 0, "", "video_patch_proj", ""},
    {"audio_patch_proj", 0, "", "audio_patch_proj", ""},
    {"condition_proj", 0, "", "condition_proj", ""},
    {"time_embedder_proj_in", 0, "", "time_embedder.proj_in", ""},
    {"time_embedder_proj_out", 0, "", "time_embedder.proj_out", ""},
    {"final_layer_adaln_proj_linear", 0, "", "final_layer.adaln_proj.linear", ""},
    {"final_layer_video_out", 0, "", "final_layer.video_out", ""},
    {"final_layer_audio_out", 0, "", "final_layer.audio_out", ""},
};

/* How diffusers makes a module's pair diffusers' own. */
enum cut {
    CUT_NONE,   /* the pair as it is */
    CUT_QKV,    /* fused qkv: lora_A under each of to_q, to_k, to_v; lora_B in thirds */
    CUT_SWIGLU, /* fused [gate; value]: lora_B's halves swapped into [value; gate] */
};

/* The projections outside the block stack, and their diffusers names. */
static const char *const STANDALONE[][2] = {
    {"video_patch_proj", "proj_in"},
    {"audio_patch_proj", "audio_proj_in"},
    {"condition_proj", "context_embedder"},
    {"time_embedder.proj_in", "time_embedder.linear_1"},
    {"time_embedder.proj_out", "time_embedder.linear_2"},
    {"final_layer.adaln_proj.linear", "norm_out.linear"},
    {"final_layer.video_out", "proj_out"},
    {"final_layer.audio_out", "audio_proj_out"},
};

/* The two block stacks (a refiner block is a block without AdaLN), and the
 * modules of a block. */
static const char *const STACKS[][2] = {
    {"blocks.", "transformer_blocks."},
    {"token_refiner.blocks.", "token_refiner.refiner_blocks."},
};
static const struct {
    const char *from, *to;
    enum cut cut;
} BLOCK_MODULES[] = {
    {"attn.qkv_proj", "attn", CUT_QKV},
    {"mlp.fc1", "ff.net.0.proj", CUT_SWIGLU},
    {"attn.out_proj", "attn.to_out.0", CUT_NONE},
    {"mlp.fc2", "ff.net.2", CUT_NONE},
    {"adaln_proj.linear", "adaln_proj.linear", CUT_NONE},
};

struct conversion {
    const char *path;
    struct lora_key *keys; /* the file's keys but DoRA scales, renamed as diffusers renames them, sorted */
    size_t n;
    const char *down, *up; /* the factors' suffixes: kohya's or PEFT's */
    int diffsynth;         /* DiffSynth-Studio's: per-head interleaved qkv */
    struct lora_rewrite rw;
};

/* ---- which form ---- */

static int is_original_name(const char *key)
{
    for (size_t i = 0; i < COUNT(ORIGINAL_STARTS); i++)
        if (str_starts_with(key, ORIGINAL_STARTS[i]))
            return 1;
    return 0;
}

static int holds_peft_weight(const char *key)
{
    return strstr(key, H3_PEFT_INFIX "weight") != NULL;
}

static int is_component_key(const char *key)
{
    return str_starts_with(key, H3_TARGET ".") || str_starts_with(key, MINIMAX_H3_REF ".");
}

/* A PEFT dump: diffusers' module names with PEFT's infix and no component. */
static int is_peft_dump(const struct model *w)
{
    return lora_model_any_key(w, holds_peft_weight) && !lora_model_any_key(w, is_component_key);
}

/* What diffusers reads of the file's metadata alpha. */
enum metadata_alpha { ALPHA_NONE, ALPHA_IGNORED, ALPHA_READ };

/* Whether diffusers reads an alpha from the file's __metadata__: it has no
 * LoRA config and no .alpha tensor (DoRA scales counted: diffusers looks
 * before it drops them), and the entry is there. *text: the entry. */
static enum metadata_alpha metadata_alpha_of(const struct model *w, const char **text)
{
    const struct st_file *f = w->files[0];
    if (diffusers_lora_metadata(w))
        return ALPHA_NONE;
    for (size_t i = 0; i < w->count; i++)
        if (str_ends_with(w->tensors[i].t->name, ".alpha"))
            return ALPHA_NONE;
    for (size_t i = 0; i < f->nmeta; i++)
        if (strcmp(f->meta[i].key, H3_METADATA_ALPHA) == 0) {
            *text = f->meta[i].value;
            return ALPHA_READ;
        }
    return ALPHA_NONE;
}

int minimax_h3_lora_detect(const struct model *w)
{
    const char *text;
    return lora_model_any_key(w, is_original_name) || is_peft_dump(w) || metadata_alpha_of(w, &text) != ALPHA_NONE;
}

/* ---- the original names ---- */

#define ASCII_DIGITS "0123456789"

/* musubi's module `flat` (len bytes) dotted, as diffusers' table dots it
 * (allocated into *dotted), or 0 where no row matches it whole. */
static int musubi_dotted(const char *flat, size_t len, struct strbuf *dotted)
{
    for (size_t i = 0; i < COUNT(MUSUBI); i++) {
        const size_t head = strlen(MUSUBI[i].flat_head);
        if (len < head || strncmp(flat, MUSUBI[i].flat_head, head) != 0)
            continue;
        size_t number = MUSUBI[i].numbered ? strspn(flat + head, ASCII_DIGITS) : 0;
        if (MUSUBI[i].numbered && (number == 0 || head + number > len))
            continue;
        const char *tail = flat + head + number;
        if ((size_t)(flat + len - tail) != strlen(MUSUBI[i].flat_tail) ||
            strncmp(tail, MUSUBI[i].flat_tail, strlen(MUSUBI[i].flat_tail)) != 0)
            continue;
        strbuf_printf(dotted, "%s%.*s%s", MUSUBI[i].dotted_head, (int)number, flat + head, MUSUBI[i].dotted_tail);
        return 1;
    }
    return 0;
}

/* musubi-tuner's keys dotted back: each key's module (up to its first '.',
 * lora_unet_ removed) matched whole against the table, whatever the key
 * starts with, as diffusers does once any key starts with lora_unet_. */
static int unflatten_musubi(struct conversion *cv)
{
    for (size_t i = 0; i < cv->n; i++) {
        const char *key = cv->keys[i].name;
        const char *module = str_starts_with(key, H3_MUSUBI) ? key + strlen(H3_MUSUBI) : key;
        const char *dot = strchr(module, '.');
        const size_t len = dot ? (size_t)(dot - module) : strlen(module);
        struct strbuf name = {0};
        if (!musubi_dotted(module, len, &name)) {
            free(name.p);
            return nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "does not name a MiniMax-H3 module in "
                            "musubi-tuner's flattened lora_unet_ form, which diffusers refuses");
        }
        strbuf_printf(&name, ".%s", dot ? dot + 1 : "");
        if (name.oom) {
            free(name.p);
            return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        }
        free(cv->keys[i].name);
        cv->keys[i].name = name.p;
    }
    return NF4_OK;
}

static int holds_diffsynth_factor(const char *key)
{
    return strstr(key, ".lora_A" H3_PEFT_INFIX "weight") || strstr(key, ".lora_B" H3_PEFT_INFIX "weight");
}

/* The renamings before the pairs are read: diffusion_model. removed,
 * DiffSynth's infix dropped, musubi's names dotted; then the factors'
 * names, sorted, checked to be one each. */
static int rename_original(struct conversion *cv)
{
    lora_keys_remove_prefix(cv->keys, cv->n, H3_COMFY);
    int code = NF4_OK;
    for (size_t i = 0; i < cv->n && !cv->diffsynth; i++)
        cv->diffsynth = holds_diffsynth_factor(cv->keys[i].name);
    if (cv->diffsynth && (code = lora_keys_replace(cv->path, cv->keys, cv->n, ".lora_A" H3_PEFT_INFIX, ".lora_A.")) ==
                             NF4_OK)
        code = lora_keys_replace(cv->path, cv->keys, cv->n, ".lora_B" H3_PEFT_INFIX, ".lora_B.");
    if (code == NF4_OK && lora_keys_any_start(cv->keys, cv->n, H3_MUSUBI))
        code = unflatten_musubi(cv);
    int kohya = 0;
    for (size_t i = 0; i < cv->n && !kohya; i++)
        kohya = strstr(cv->keys[i].name, ".lora_down.weight") != NULL;
    cv->down = kohya ? ".lora_down.weight" : ".lora_A.weight";
    cv->up = kohya ? ".lora_up.weight" : ".lora_B.weight";
    if (code == NF4_OK) {
        lora_keys_sort(cv->keys, cv->n);
        code = lora_keys_check_distinct(cv->path, cv->keys, cv->n); /* diffusers' dict keeps one of them */
    }
    return code;
}

/* Adds the pair down / up (`alpha` folded in, or NULL) under
 * transformer.<target>, cut as `cut` says. */
static int add_pair(struct conversion *cv, const char *target, enum cut cut, const struct model_tensor *down,
                    const struct model_tensor *up, const struct model_tensor *alpha)
{
    const struct st_tensor *dt = down->t, *ut = up->t;
    int code = lora_check_pair(cv->path, dt, ut);
    if (code != NF4_OK)
        return code;
    float sd = 1.0f, su = 1.0f;
    if (alpha) {
        double a;
        if ((code = lora_read_alpha(cv->path, alpha, &a)) != NF4_OK)
            return code;
        lora_split_scale(a / (double)dt->shape[0], DT_F64, &sd, &su); /* alpha.item() / rank: Python floats */
    }
    const float *a_scale = alpha ? &sd : NULL, *b_scale = alpha ? &su : NULL; /* no alpha: factors as they are */
    const uint64_t r = dt->shape[0], rows = ut->shape[0];
    char name[2 * H3_NAME_MAX];
    if (cut == CUT_QKV) {
        if (rows % 3 != 0 || (cv->diffsynth && rows % (3 * H3_HEAD_DIM) != 0))
            return nf4_fail(NF4_EDATA, cv->path, ut->name, "has %llu rows, not a multiple of %u: diffusers refuses it "
                            "as no fused MiniMax-H3 qkv%s", (unsigned long long)rows,
                            cv->diffsynth ? 3 * H3_HEAD_DIM : 3, cv->diffsynth ? " of heads of 128 (DiffSynth's)" : "");
        static const char *const QKV[3] = {"to_q", "to_k", "to_v"};
        for (uint64_t j = 0; j < 3 && code == NF4_OK; j++) {
            snprintf(name, sizeof name, H3_TARGET ".%s.%s", target, QKV[j]);
            code = lora_rewrite_add_row_blocks(&cv->rw, name, ".lora_A.weight", down, r, 0, 0, 0, a_scale);
            /* DiffSynth's rows are [head 0: q k v, head 1: q k v, ...]: to_q takes each head's first 128 */
            const uint64_t row0 = cv->diffsynth ? j * H3_HEAD_DIM : j * (rows / 3),
                           block = cv->diffsynth ? H3_HEAD_DIM : 0;
            if (code == NF4_OK)
                code = lora_rewrite_add_row_blocks(&cv->rw, name, ".lora_B.weight", up, rows / 3, row0, block,
                                                   3 * H3_HEAD_DIM, b_scale);
        }
        return code;
    }
    if (cut == CUT_SWIGLU && rows % 2 != 0)
        return nf4_fail(NF4_EDATA, cv->path, ut->name, "has %llu rows, not an even number: diffusers refuses it as no "
                        "fused MiniMax-H3 SwiGLU projection", (unsigned long long)rows);
    snprintf(name, sizeof name, H3_TARGET ".%s", target);
    code = lora_rewrite_add_row_blocks(&cv->rw, name, ".lora_A.weight", down, r, 0, 0, 0, a_scale);
    /* [gate; value] made [value; gate]: the rows from the middle on, then the first half */
    if (code == NF4_OK)
        code = lora_rewrite_add_row_blocks(&cv->rw, name, ".lora_B.weight", up, rows, cut == CUT_SWIGLU ? rows / 2 : 0,
                                           0, 0, b_scale);
    return code;
}

/* Takes the pair of module `base` (and its alpha) into transformer.<target>:
 * diffusers' pull, which raises where lora_A is there without lora_B. */
static int pull(struct conversion *cv, struct lora_key *down, const char *base, const char *target, enum cut cut)
{
    char name[2 * H3_NAME_MAX];
    snprintf(name, sizeof name, "%s%s", base, cv->up);
    struct lora_key *up = lora_key_available(cv->keys, cv->n, name);
    if (!up)
        return nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no %s%s beside it, without which diffusers "
                        "refuses the file", base, cv->up);
    snprintf(name, sizeof name, "%s.alpha", base);
    struct lora_key *alpha = lora_key_available(cv->keys, cv->n, name);
    down->taken = up->taken = 1;
    if (alpha)
        alpha->taken = 1;
    return add_pair(cv, target, cut, down->t, up->t, alpha ? alpha->t : NULL);
}

/* A module of a block: its key (the down factor's), stack, number and module. */
struct block_pull {
    struct lora_key *down;
    size_t stack, module;
    const char *number; /* into the key's name: digits, len of them */
    size_t len;
};

/* In diffusers' order: stack by stack, block by block (0, 1, 2...), module
 * by module as its loop pulls them; the order the LoRA config's ranks are
 * counted in. */
static int block_pull_cmp(const void *a, const void *b)
{
    const struct block_pull *x = a, *y = b;
    if (x->stack != y->stack)
        return x->stack < y->stack ? -1 : 1;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    int c = strncmp(x->number, y->number, x->len);
    if (c)
        return c;
    return x->module < y->module ? -1 : x->module > y->module;
}

/* Where `base` is a module of a block, `stack`<N>.<module> with N as
 * Python writes a number: 1 with *p filled (but its key). */
static int block_module(const char *base, struct block_pull *p)
{
    for (size_t s = 0; s < COUNT(STACKS); s++) {
        if (!str_starts_with(base, STACKS[s][0]))
            continue;
        const char *number = base + strlen(STACKS[s][0]);
        const size_t len = strspn(number, ASCII_DIGITS);
        if (len == 0 || (len > 1 && number[0] == '0') || number[len] != '.')
            return 0; /* diffusers pulls blocks 0, 1, 2... by name: "007" is none of them */
        for (size_t m = 0; m < COUNT(BLOCK_MODULES); m++)
            if (strcmp(number + len + 1, BLOCK_MODULES[m].from) == 0) {
                *p = (struct block_pull){NULL, s, m, number, len};
                return 1;
            }
    }
    return 0;
}

/* The module of `key` (a down factor's name), less the suffix, into `base`. */
static void module_of(const struct conversion *cv, const struct lora_key *key, char base[H3_NAME_MAX])
{
    snprintf(base, H3_NAME_MAX, "%.*s", (int)(strlen(key->name) - strlen(cv->down)), key->name);
}

/* Every pair diffusers pulls, converted, in its order (the projections
 * outside the blocks, then block by block); any key left is refused, as
 * diffusers refuses a state dict it has not emptied. */
static int convert_original(struct conversion *cv)
{
    int code = rename_original(cv);
    char base[H3_NAME_MAX], target[H3_NAME_MAX];
    for (size_t s = 0; s < COUNT(STANDALONE) && code == NF4_OK; s++) {
        snprintf(base, sizeof base, "%s%s", STANDALONE[s][0], cv->down);
        struct lora_key *k = lora_key_available(cv->keys, cv->n, base);
        if (k)
            code = pull(cv, k, STANDALONE[s][0], STANDALONE[s][1], CUT_NONE);
    }
    struct block_pull *pulls = code == NF4_OK ? calloc(cv->n ? cv->n : 1, sizeof *pulls) : NULL;
    size_t npulls = 0;
    if (code == NF4_OK && !pulls)
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->n && code == NF4_OK; i++) {
        struct lora_key *k = &cv->keys[i];
        if (k->taken || !str_ends_with(k->name, cv->down))
            continue;
        module_of(cv, k, base);
        if (block_module(base, &pulls[npulls])) {
            pulls[npulls].number = k->name + (pulls[npulls].number - base); /* base is reused */
            pulls[npulls++].down = k;
        }
    }
    if (code == NF4_OK)
        qsort(pulls, npulls, sizeof *pulls, block_pull_cmp);
    for (size_t i = 0; i < npulls && code == NF4_OK; i++) {
        const struct block_pull *p = &pulls[i];
        module_of(cv, p->down, base);
        snprintf(target, sizeof target, "%s%.*s.%s", STACKS[p->stack][1], (int)p->len, p->number,
                 BLOCK_MODULES[p->module].to);
        code = pull(cv, p->down, base, target, BLOCK_MODULES[p->module].cut);
    }
    free(pulls);
    for (size_t i = 0; i < cv->n && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is left over by diffusers' conversion of a "
                            "MiniMax-H3 LoRA in the original checkpoint's names (as %s), which refuses the file",
                            cv->keys[i].name);
    return code;
}

/* ---- the forms kept whole ---- */

/* Every key a byte copy: put under transformer. with PEFT's infix dropped
 * (a PEFT dump), or as it is. */
static int copy_keys(struct conversion *cv, int peft_dump)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->n && code == NF4_OK && peft_dump; i++) {
        char *name = str_replace_all(cv->keys[i].name, H3_PEFT_INFIX, ".");
        char *under = name ? str_concat(H3_TARGET ".", name) : NULL;
        free(name);
        if (!under)
            return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        free(cv->keys[i].name);
        cv->keys[i].name = under;
    }
    lora_keys_sort(cv->keys, cv->n);
    code = lora_keys_check_distinct(cv->path, cv->keys, cv->n);
    /* in the file's order, as diffusers' dict holds them (the LoRA config's ranks are counted so) */
    struct lora_key **order = code == NF4_OK ? lora_keys_in_file_order(cv->keys, cv->n) : NULL;
    if (code == NF4_OK && !order)
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->n && code == NF4_OK; i++)
        code = lora_rewrite_add_copy(&cv->rw, "", order[i]->name, order[i]->t);
    free(order);
    return code;
}

/* ---- the metadata alpha ---- */

/* A part's number of dimensions and its second one, as the tensor diffusers holds. */
static size_t part_ndim(const struct lora_part *p)
{
    return p->whole ? p->src->t->ndim : p->vector ? 1 : 2;
}

static uint64_t part_dim1(const struct lora_part *p)
{
    return p->whole ? p->src->t->shape[1] : p->shape[1];
}

/* Adds `item` to `meta` as "<component>.<key>", or frees it: 0 where it
 * cannot (out of memory, or no item). */
static int add_entry(cJSON *meta, const char *component, const char *key, cJSON *item)
{
    char *name = item ? malloc(strlen(component) + strlen(key) + 2) : NULL;
    if (name)
        sprintf(name, "%s.%s", component, key);
    const int added = name && cJSON_AddItemToObject(meta, name, item);
    if (!added)
        cJSON_Delete(item);
    free(name);
    return added;
}

/* The LoRA config diffusers builds for `component` from a metadata alpha
 * (get_peft_kwargs on the ranks of its lora_B matrices, then lora_alpha set
 * to the alpha and alpha_pattern emptied), added to `meta` as
 * "<component>.<key>" entries; nothing where it has no lora_B matrix. */
static int component_config(const struct lora_rewrite *rw, const char *component, double alpha, cJSON *meta)
{
    const size_t plen = strlen(component);
    double *ranks = calloc(rw->nparts ? rw->nparts : 1, sizeof *ranks);
    size_t *of = calloc(rw->nparts ? rw->nparts : 1, sizeof *of), n = 0;
    int dora = 0, bias = 0, ok = ranks && of;
    for (size_t i = 0; ok && i < rw->nparts; i++) {
        const struct lora_part *p = &rw->parts[i];
        if (strncmp(p->name, component, plen) != 0 || p->name[plen] != '.')
            continue;
        const char *key = p->name + plen + 1;
        dora |= strstr(key, "lora_magnitude_vector") != NULL;
        bias |= strstr(key, "lora_B") && str_ends_with(key, ".bias");
        if (strstr(key, "lora_B") && part_ndim(p) > 1) {
            ranks[n] = (double)part_dim1(p);
            of[n++] = i;
        }
    }
    double r = 0;
    ok = ok && lora_most_common(ranks, n, &r);
    cJSON *rank_pattern = ok && n ? cJSON_CreateObject() : NULL, *targets = rank_pattern ? cJSON_CreateArray() : NULL;
    ok = ok && (!n || (rank_pattern && targets));
    for (size_t i = 0; ok && i < n; i++) {
        if (ranks[i] == r)
            continue;
        const char *key = rw->parts[of[i]].name + plen + 1, *cut = strstr(key, ".lora_B.");
        char *pattern = str_concat("^", key);
        if (pattern && cut)
            pattern[1 + (cut - key)] = 0;
        ok = pattern && json_set_number(rank_pattern, pattern, ranks[i]);
        free(pattern);
    }
    /* target_modules: the modules of its keys (diffusers injects by the keys all the same) */
    for (size_t i = 0; ok && n && i < rw->nparts; i++) {
        const struct lora_part *p = &rw->parts[i];
        if (strncmp(p->name, component, plen) != 0 || p->name[plen] != '.')
            continue;
        const char *key = p->name + plen + 1, *lora = strstr(key, ".lora");
        char *module = lora ? strndup(key, (size_t)(lora - key)) : strdup(key);
        int seen = 0;
        for (cJSON *t = targets->child; module && t && !seen; t = t->next)
            seen = strcmp(t->valuestring, module) == 0;
        cJSON *s = module && !seen ? cJSON_CreateString(module) : NULL;
        ok = module && (seen || (s && cJSON_AddItemToArray(targets, s)));
        if (!ok)
            cJSON_Delete(s);
        free(module);
    }
    if (ok && n) { /* get_peft_kwargs' keys, lora_alpha and alpha_pattern as MiniMax-H3's loader sets them */
        static const char *const KEYS[] = {"r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules",
                                           "use_dora", "lora_bias"};
        cJSON *items[] = {cJSON_CreateNumber(r), cJSON_CreateNumber(alpha), rank_pattern, cJSON_CreateObject(),
                          targets, cJSON_CreateBool(dora), cJSON_CreateBool(bias)};
        rank_pattern = targets = NULL; /* each item is added, or freed */
        for (size_t i = 0; i < COUNT(KEYS); i++)
            if (ok)
                ok = add_entry(meta, component, KEYS[i], items[i]);
            else
                cJSON_Delete(items[i]);
    }
    cJSON_Delete(rank_pattern);
    cJSON_Delete(targets);
    free(ranks);
    free(of);
    return ok ? NF4_OK : nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
}

/* Where any component has pairs: the LoRA config diffusers builds from the
 * file's metadata alpha, made rw's lora_adapter_metadata
 * (lora_rewrite_use_config: *meta and *config, to free after the rewrite
 * is finished); else nothing (both NULL). NF4_EDATA for an alpha that is
 * not finite. */
static int use_alpha_config(const struct model *w, struct lora_rewrite *rw, double alpha, struct st_meta **meta,
                            char **config)
{
    *meta = NULL;
    *config = NULL;
    cJSON *json = cJSON_CreateObject();
    int code = json ? NF4_OK : nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    if (code == NF4_OK && (code = component_config(rw, H3_TARGET, alpha, json)) == NF4_OK)
        code = component_config(rw, MINIMAX_H3_REF, alpha, json);
    const int used = code == NF4_OK && json->child;
    char *text = used && isfinite(alpha) ? cJSON_PrintUnformatted(json) : NULL;
    cJSON_Delete(json);
    if (!used)
        return code;
    if (!isfinite(alpha))
        return nf4_fail(NF4_EDATA, rw->path, NULL, "has the alpha %g in its metadata, with which diffusers' merge "
                        "gives no finite weights", alpha);
    code = text ? lora_rewrite_use_config(rw, w->files[0], text, meta)
                : nf4_fail(NF4_ESOFTWARE, rw->path, NULL, "out of memory");
    if (code == NF4_OK)
        *config = text;
    else
        free(text);
    return code;
}

/* ---- the conversion ---- */

int minimax_h3_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta}};
    const char *alpha_text = NULL;
    double alpha = 0;
    enum metadata_alpha how = metadata_alpha_of(w, &alpha_text);
    int code = NF4_OK;
    if (how == ALPHA_READ) {
        int read = lora_python_float(alpha_text, strlen(alpha_text), &alpha);
        if (read == -2)
            code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        else if (read < 0)
            code = nf4_fail(NF4_EDATA, path, NULL, "has an alpha in its metadata with other than ASCII in it, which "
                            "nf4deq does not read as Python's float() does");
        else if (read == 0) {
            how = ALPHA_IGNORED;
            if (warn)
                nf4_warn("%s: the alpha in its metadata is not a number, which diffusers ignores: each module's alpha "
                         "is its rank", path);
        }
    }
    if (code != NF4_OK)
        return code;
    const int original = lora_model_any_key(w, is_original_name), peft_dump = !original && is_peft_dump(w);
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    code = lora_keys_of(path, w, lora_is_dora_scale, &cv.keys, &cv.n);
    if (code == NF4_OK)
        code = original ? convert_original(&cv) : copy_keys(&cv, peft_dump);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    struct st_meta *meta = NULL;
    char *config = NULL;
    if (code == NF4_OK && how == ALPHA_READ)
        code = use_alpha_config(w, &cv.rw, alpha, &meta, &config);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, which diffusers drops", out);
    free(meta);
    free(config);
    lora_keys_free(cv.keys, cv.n);
    return code;
}
