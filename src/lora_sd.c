#include "lora_sd.h"

#include <cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "grow.h"
#include "json_util.h"
#include "lora_diffusers.h"
#include "lora_old_forms.h"
#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define SD_UNET "lora_unet_"
#define SD_DOWN "lora_down.weight"
#define SD_UP ".lora_up.weight"
#define SD_ALPHA ".alpha"
/* diffusers' _maybe_map_sgm_blocks_to_diffusers splits keys at "_", and the
 * block number is the fifth piece: lora, unet, input, blocks, 4. */
#define SGM_BLOCK_PIECE 4
/* A key of more pieces than this is no UNet module's. */
#define SGM_MAX_PIECES 64
/* layers_per_block's answers besides a number: no config that gives one, and out of memory. */
#define LPB_NONE (-1)
#define LPB_OOM (-2)

enum sd_component { SD_COMP_UNET, SD_COMP_TE, SD_COMP_TE2, SD_COMPONENTS };
static const char *const COMPONENT[SD_COMPONENTS] = {"unet", "text_encoder", "text_encoder_2"};

/* A pair diffusers loads: its module in PEFT's names (no component), and its
 * factors. */
struct sd_pair {
    char *module;
    const struct model_tensor *down, *up;
};

/* A network alpha, under the name diffusers gives it (_get_alpha_name, less
 * the component). */
struct sd_alpha {
    char *name;
    double value;
};

struct sd_part {
    struct sd_pair *pairs;
    size_t npairs, pairs_cap;
    /* Text encoders: the keys in diffusers' older form, before
     * _load_lora_into_text_encoder's renaming: down and up, with tensors. */
    struct lora_key *te_keys;
    size_t nte, te_cap;
    struct sd_alpha *alphas;
    size_t nalphas, alphas_cap;
};

struct conversion {
    const char *path;
    struct lora_key *keys; /* in the order diffusers walks them */
    size_t nkeys;
    struct lora_key **by_name; /* the same, sorted by name */
    const char *unet_config; /* the UNet's config.json, NULL: none; read only where keys have SGM names */
    struct sd_part comp[SD_COMPONENTS];
    struct lora_rewrite rw;
};

static int starts_kohya(const char *key)
{
    return str_starts_with(key, SD_UNET) || str_starts_with(key, "lora_te_") || str_starts_with(key, "lora_te1_") ||
           str_starts_with(key, "lora_te2_");
}

static int not_kohya(const char *key)
{
    return !lora_is_dora_scale(key) && !starts_kohya(key);
}

int sd_lora_detect(const struct model *w)
{
    return w->count > 0 && !lora_model_any_key(w, not_kohya);
}

#define MAP_N(m) (sizeof(m) / sizeof(m)[0])

/* ---- diffusers' names of a kohya key ---- */

/* re.sub(r"\.\d+(?=\D*$)", "", s, count=1): the last run of digits, where a
 * dot comes before it. */
static void drop_last_number(char *s)
{
    char *end = s + strlen(s), *p = end;
    while (p > s && !(p[-1] >= '0' && p[-1] <= '9'))
        p--;
    if (p == s)
        return;
    char *digits_end = p;
    while (p > s && p[-1] >= '0' && p[-1] <= '9')
        p--;
    if (p > s && p[-1] == '.')
        memmove(p - 1, digits_end, (size_t)(end - digits_end) + 1);
}

/* _convert_unet_lora_key, step by step. */
static char *unet_key(const char *key)
{
    static const char *const STEPS[][2] = {
        {"input.blocks.0.0", "conv_in"}, {"out.2", "conv_out"}, {"input.blocks", "down_blocks"},
        {"down.blocks", "down_blocks"}, {"middle.block", "mid_block"}, {"mid.block", "mid_block"},
        {"output.blocks", "up_blocks"}, {"up.blocks", "up_blocks"}, {"transformer.blocks", "transformer_blocks"},
        {"to.q.lora", "to_q_lora"}, {"to.k.lora", "to_k_lora"}, {"to.v.lora", "to_v_lora"},
        {"to.out.0.lora", "to_out_lora"}, {"proj.in", "proj_in"}, {"proj.out", "proj_out"},
        {"emb.layers", "time_emb_proj"}, {"conv.in", "conv_in"}, {"conv.out", "conv_out"},
        {"time.embed.0", "time_embedding.linear_1"}, {"time.embed.2", "time_embedding.linear_2"},
        {"label.emb.0.0", "add_embedding.linear_1"}, {"label.emb.0.2", "add_embedding.linear_2"},
        {"time.embedding.linear.1", "time_embedding.linear_1"}, {"time.embedding.linear.2", "time_embedding.linear_2"},
    };
    char *s = str_replace_all(key, SD_UNET, "");
    for (char *p = s; p && *p; p++)
        if (*p == '_')
            *p = '.';
    int ok = s != NULL;
    for (size_t i = 0; ok && i < MAP_N(STEPS); i++)
        ok = str_replace_in(&s, STEPS[i][0], STEPS[i][1]);
    if (ok && strstr(s, "emb") && !strstr(s, "time.emb.proj")) /* "SDXL specific conversions" */
        drop_last_number(s);
    if (ok && strstr(s, ".in."))
        ok = str_replace_in(&s, "in.layers.2", "conv1");
    if (ok && strstr(s, ".out."))
        ok = str_replace_in(&s, "out.layers.3", "conv2");
    if (ok && (strstr(s, "downsamplers") || strstr(s, "upsamplers")))
        ok = str_replace_in(&s, "op", "conv");
    if (ok && strstr(s, "skip"))
        ok = str_replace_in(&s, "skip.connection", "conv_shortcut");
    if (ok) /* LyCORIS' */
        ok = str_replace_in(&s, "time.emb.proj", "time_emb_proj") && str_replace_in(&s, "conv.shortcut", "conv_shortcut");
    if (ok && strstr(s, "transformer_blocks") && (strstr(s, "attn1") || strstr(s, "attn2")))
        ok = str_replace_in(&s, "attn1", "attn1.processor") && str_replace_in(&s, "attn2", "attn2.processor");
    if (!ok) {
        free(s);
        return NULL;
    }
    return s;
}

/* _convert_text_encoder_lora_key, `prefix` the key's lora_te..._. */
static char *te_key(const char *key, const char *prefix)
{
    static const char *const STEPS[][2] = {
        {"text.model", "text_model"},  {"self.attn", "self_attn"},  {"q.proj.lora", "to_q_lora"},
        {"k.proj.lora", "to_k_lora"},  {"v.proj.lora", "to_v_lora"}, {"out.proj.lora", "to_out_lora"},
        {"text.projection", "text_projection"},
    };
    char *s = str_replace_all(key, prefix, "");
    for (char *p = s; p && *p; p++)
        if (*p == '_')
            *p = '.';
    int ok = s != NULL;
    for (size_t i = 0; ok && i < MAP_N(STEPS); i++)
        ok = str_replace_in(&s, STEPS[i][0], STEPS[i][1]);
    if (ok && !strstr(s, "self_attn") && !strstr(s, "text_projection") && strstr(s, "mlp"))
        ok = str_replace_in(&s, ".lora.", ".lora_linear_layer.");
    if (!ok) {
        free(s);
        return NULL;
    }
    return s;
}

/* ---- the SGM UNet's blocks (_maybe_map_sgm_blocks_to_diffusers) ---- */

static const char *const SGM[3] = {"input_blocks", "middle_block", "output_blocks"};
static const char *const NOT_SGM[3] = {"down_blocks", "mid_block", "up_blocks"};
static const char *const INNER[3] = {"resnets", "attentions", "upsamplers"};

static int holds_any(const char *s, const char *const pats[3])
{
    return strstr(s, pats[0]) || strstr(s, pats[1]) || strstr(s, pats[2]);
}

/* Python's a // b and a % b, b > 0. */
static long floor_div(long a, long b)
{
    return a / b - (a % b != 0 && a < 0);
}

static long floor_mod(long a, long b)
{
    return a - floor_div(a, b) * b;
}

/* key.split("_") into pieces (pointers into `buf`, a copy). 0 where there are
 * more than SGM_MAX_PIECES. */
static size_t split_pieces(char *buf, char **pieces)
{
    size_t n = 0;
    for (char *p = buf;; p++) {
        if (n == SGM_MAX_PIECES)
            return 0;
        pieces[n++] = p;
        p = strchr(p, '_');
        if (!p)
            return n;
        *p = '\0';
    }
}

/* "_".join(pieces[0:a] + mid[0:nmid] + pieces[b:n]), allocated. */
static char *join_pieces(char *const *pieces, size_t n, size_t a, const char *const *mid, size_t nmid, size_t b)
{
    struct strbuf out = {0};
    int first = 1;
    for (size_t i = 0; i < a && i < n; i++, first = 0)
        strbuf_printf(&out, "%s%s", first ? "" : "_", pieces[i]);
    for (size_t i = 0; i < nmid; i++, first = 0)
        strbuf_printf(&out, "%s%s", first ? "" : "_", mid[i]);
    for (size_t i = b; i < n; i++, first = 0)
        strbuf_printf(&out, "%s%s", first ? "" : "_", pieces[i]);
    if (out.oom || !out.p) {
        free(out.p);
        return NULL;
    }
    return out.p;
}

static int python_int_piece(const char *s, long *v)
{
    int64_t x;
    if (!lora_python_int(s, strlen(s), &x) || x < -1000000 || x > 1000000)
        return 0;
    *v = (long)x;
    return 1;
}

/* inner_block_map[i], Python's indexing (from the end for -3..-1). */
static const char *inner_block(long i)
{
    return i >= 0 && i < 3 ? INNER[i] : i < 0 && i >= -3 ? INNER[3 + i] : NULL;
}

/* The new name of an SGM key of block `kind` (0 input, 1 middle, 2 output)
 * number `id`. NULL with *why set where diffusers raises, or NULL where
 * memory ran out. */
static char *sgm_rename(const char *key, int kind, long id, long lpb, const char **why)
{
    char buf[LORA_KEY_MAX + 1], *pieces[SGM_MAX_PIECES], num[24], layer[24];
    snprintf(buf, sizeof buf, "%s", key);
    size_t n = split_pieces(buf, pieces);
    long inner = 0;
    *why = "has no number where diffusers reads the inner block's (the sixth \"_\"-separated piece)";
    if (n == 0 || (kind != 1 && (n <= SGM_BLOCK_PIECE + 1 || !python_int_piece(pieces[SGM_BLOCK_PIECE + 1], &inner))))
        return NULL;
    if (kind == 1) {
        static const char *const MIDDLE[3][2] = {{"resnets", "0"}, {"attentions", "0"}, {"resnets", "1"}};
        *why = "is of a middle block other than 0, 1 and 2, which diffusers refuses";
        if (id < 0 || id > 2)
            return NULL;
        *why = NULL; /* out of memory, from here on */
        return join_pieces(pieces, n, SGM_BLOCK_PIECE, MIDDLE[id], 2, SGM_BLOCK_PIECE + 1);
    }
    const int op = strstr(key, "op") != NULL;
    const long block = kind == 0 ? floor_div(id - 1, lpb + 1) : floor_div(id, lpb + 1);
    const long in_block = kind == 0 ? floor_mod(id - 1, lpb + 1) : floor_mod(id, lpb + 1);
    const char *inner_name = kind == 0 && op ? "downsamplers" : inner_block(inner);
    *why = "has an inner block number past diffusers' three (resnets, attentions, upsamplers)";
    if (!inner_name)
        return NULL;
    snprintf(num, sizeof num, "%ld", block);
    snprintf(layer, sizeof layer, "%ld", (kind == 0 && op) || (kind == 2 && inner >= 2) ? 0L : in_block);
    const char *mid[3] = {num, inner_name, layer};
    *why = NULL; /* out of memory, from here on */
    return join_pieces(pieces, n, SGM_BLOCK_PIECE, mid, 3, SGM_BLOCK_PIECE + 2);
}

/* The block `key` is in: kind 0..2 and its number; 0 where its number does
 * not parse (diffusers raises). */
static int sgm_block_of(const char *key, int *kind, long *id)
{
    char buf[LORA_KEY_MAX + 1], *pieces[SGM_MAX_PIECES];
    snprintf(buf, sizeof buf, "%s", key);
    size_t n = split_pieces(buf, pieces);
    if (n == 0 || !python_int_piece(pieces[(n < SGM_BLOCK_PIECE + 1 ? n : SGM_BLOCK_PIECE + 1) - 1], id))
        return 0;
    *kind = strstr(key, SGM[0]) ? 0 : strstr(key, SGM[1]) ? 1 : 2;
    return 1;
}

/* A block number of a set, and where the set walks it. */
struct walked_id {
    long id;
    size_t pos;
};

static int cmp_walked(const void *a, const void *b)
{
    const struct walked_id *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

/* The blocks of `kind` (numbers `sorted`, n of them) that list `key`: those
 * whose "<SGM[kind]>_<number>" it holds, as diffusers' comprehension asks (so
 * input_blocks_1 takes input_blocks_10's keys too), each once, into hits
 * (*nhits so far, at most cap: more are not counted). Each such text in the
 * key is followed by a number as Python writes one (no leading zero, "-"
 * before a negative), of at most 7 digits (block numbers parse to no more):
 * its prefixes are the candidates. */
static void blocks_listing(const char *key, int kind, const struct walked_id *sorted, size_t n,
                           struct walked_id *hits, int *hit_kinds, size_t *nhits, size_t cap)
{
    const size_t plen = strlen(SGM[kind]);
    for (const char *at = strstr(key, SGM[kind]); at; at = strstr(at + 1, SGM[kind])) {
        const char *p = at + plen;
        if (*p++ != '_')
            continue;
        const int negative = *p == '-';
        p += negative;
        long value = 0;
        for (int digits = 1; digits <= 7 && p[digits - 1] >= '0' && p[digits - 1] <= '9'; digits++) {
            if (digits > 1 && p[0] == '0')
                break; /* no number Python writes starts with 0 and goes on */
            value = value * 10 + (p[digits - 1] - '0');
            if (negative && value == 0)
                break; /* Python writes no "-0" */
            const struct walked_id probe = {negative ? -value : value, 0};
            const struct walked_id *hit = bsearch(&probe, sorted, n, sizeof *sorted, cmp_walked);
            int seen = 0;
            for (size_t h = 0; hit && h < *nhits && !seen; h++)
                seen = hit_kinds[h] == kind && hits[h].id == hit->id;
            if (hit && !seen && *nhits < cap) {
                hit_kinds[*nhits] = kind;
                hits[(*nhits)++] = *hit;
            }
        }
    }
}

/* A key the SGM mapping renames, by where diffusers' loops reach it: its
 * block's kind, number and place in the set's walk. */
struct renaming {
    size_t key, pos;
    long id;
    int kind;
};

static int cmp_renaming(const void *a, const void *b)
{
    const struct renaming *x = a, *y = b;
    if (x->kind != y->kind)
        return x->kind - y->kind;
    if (x->pos != y->pos)
        return x->pos < y->pos ? -1 : 1;
    return (x->key > y->key) - (x->key < y->key);
}

/* CPython's set of ints (setobject.c): an open-addressed table of a power of
 * two slots, 8 at first; an int goes to the slot its hash gives (the int
 * itself, but -2 for -1), else the first free one of the next 9, else on by
 * i = 5i + 1 + perturb (perturb the hash, shifted right 5 each round); once
 * 3/5 full the table grows to the first power of two over 4 x its ints,
 * which are put again in the old table's order. A set is walked slot by slot,
 * which is the order diffusers' loops over block numbers take. */
#define PYSET_MIN_SLOTS 8u
#define PYSET_LINEAR_PROBES 9u
#define PYSET_PERTURB_SHIFT 5

struct pyset {
    long *keys;
    unsigned char *used;
    size_t mask, n;
};

static uint64_t pyset_hash(long v)
{
    return (uint64_t)(int64_t)(v == -1 ? -2 : v);
}

static void pyset_put(struct pyset *s, long key)
{
    const uint64_t h = pyset_hash(key);
    uint64_t perturb = h;
    size_t i = (size_t)(h & s->mask);
    for (;;) {
        for (size_t j = 0; j <= (i + PYSET_LINEAR_PROBES <= s->mask ? PYSET_LINEAR_PROBES : 0); j++)
            if (!s->used[i + j]) {
                s->used[i + j] = 1;
                s->keys[i + j] = key;
                s->n++;
                return;
            }
        perturb >>= PYSET_PERTURB_SHIFT;
        i = (size_t)((i * 5 + 1 + perturb) & s->mask);
    }
}

static int pyset_alloc(struct pyset *s, size_t slots)
{
    s->keys = calloc(slots, sizeof *s->keys);
    s->used = calloc(slots, 1);
    s->mask = slots - 1;
    s->n = 0;
    return s->keys && s->used;
}

/* Puts `ids` (n distinct ints, in the order they were added) in the order
 * Python's set of them walks. 0 where memory ran out. */
static int python_set_order(long *ids, size_t n)
{
    struct pyset s;
    int ok = pyset_alloc(&s, PYSET_MIN_SLOTS);
    for (size_t k = 0; k < n && ok; k++) {
        pyset_put(&s, ids[k]);
        if (s.n * 5 < s.mask * 3)
            continue;
        size_t slots = PYSET_MIN_SLOTS;
        while (slots <= s.n * (s.n > 50000 ? 2 : 4))
            slots <<= 1;
        struct pyset grown;
        if (!(ok = pyset_alloc(&grown, slots))) {
            free(grown.keys);
            free(grown.used);
            break;
        }
        for (size_t i = 0; i <= s.mask; i++)
            if (s.used[i])
                pyset_put(&grown, s.keys[i]);
        free(s.keys);
        free(s.used);
        s = grown;
    }
    size_t out = 0;
    for (size_t i = 0; ok && i <= s.mask; i++)
        if (s.used[i])
            ids[out++] = s.keys[i];
    free(s.keys);
    free(s.used);
    return ok;
}

static int cmp_place(const void *a, const void *b)
{
    const struct walked_id *x = a, *y = b;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

/* The distinct numbers of `ids` (n, in the order added), in the order
 * Python's set of them walks (python_set_order), sorted by number with that
 * place (*out, allocated; *nout of them). 0 where memory ran out. */
static int walk_ids(const long *ids, size_t n, struct walked_id **out, size_t *nout)
{
    struct walked_id *w = calloc(n ? n : 1, sizeof *w);
    long *distinct = calloc(n ? n : 1, sizeof *distinct);
    *out = NULL;
    *nout = 0;
    if (!w || !distinct) {
        free(w);
        free(distinct);
        return 0;
    }
    for (size_t i = 0; i < n; i++) /* by number, first added first */
        w[i] = (struct walked_id){ids[i], i};
    qsort(w, n, sizeof *w, cmp_walked);
    size_t nd = 0;
    for (size_t i = 0; i < n; i++) {
        size_t first = w[i].pos; /* qsort is not stable: the least place of the run */
        while (i + 1 < n && w[i + 1].id == w[i].id)
            first = w[++i].pos < first ? w[i].pos : first;
        w[nd++] = (struct walked_id){w[i].id, first};
    }
    qsort(w, nd, sizeof *w, cmp_place); /* the order they were added in */
    for (size_t i = 0; i < nd; i++)
        distinct[i] = w[i].id;
    int ok = python_set_order(distinct, nd);
    for (size_t i = 0; ok && i < nd; i++)
        w[i] = (struct walked_id){distinct[i], i};
    if (ok)
        qsort(w, nd, sizeof *w, cmp_walked);
    free(distinct);
    if (!ok) {
        free(w);
        return 0;
    }
    *out = w;
    *nout = nd;
    return 1;
}

/* The UNet's layers_per_block from its config.json, or LPB_NONE where there
 * is none (no file, no key) or it is no whole number from 0 up, or LPB_OOM. */
static long layers_per_block(const char *config)
{
    char *text = NULL;
    size_t len = 0;
    long lpb = LPB_NONE;
    int code = config ? read_small_file(config, MAX_JSON_FILE_BYTES, &text, &len) : NF4_EIO;
    if (code == NF4_ESOFTWARE)
        lpb = LPB_OOM;
    if (code == NF4_OK) {
        cJSON *root = json_parse_whole(text, len);
        /* The last copy of a key given twice, as diffusers (Python's json) reads it. */
        const cJSON *v = NULL, *e;
        for (e = cJSON_IsObject(root) ? root->child : NULL; e; e = e->next)
            if (e->string && strcmp(e->string, "layers_per_block") == 0)
                v = e;
        if (cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble <= 1000 &&
            v->valuedouble == (double)(long)v->valuedouble)
            lpb = (long)v->valuedouble;
        if (!root && json_ran_out_of_memory())
            lpb = LPB_OOM;
        cJSON_Delete(root);
    }
    nf4_clear_error(); /* a config that cannot be read gives nothing; the SGM keys then say so */
    free(text);
    return lpb;
}

/* Renames the keys of the SGM UNet into diffusers' blocks, and puts them in
 * the order diffusers' new dict has them: the keys it passes through, then
 * input, middle and output blocks in the order Python's sets of their
 * numbers walk them (python_set_order), each block's keys in the file's
 * order. */
static int sgm_remap(struct conversion *cv)
{
    int sgm = 0, not_sgm = 0;
    const char *first_sgm = NULL;
    for (size_t i = 0; i < cv->nkeys; i++) {
        if (holds_any(cv->keys[i].name, SGM)) {
            sgm = 1;
            first_sgm = first_sgm ? first_sgm : cv->keys[i].t->t->name;
        } else if (holds_any(cv->keys[i].name, NOT_SGM)) {
            not_sgm = 1;
        }
    }
    if (!sgm)
        return NF4_OK;
    const long lpb = layers_per_block(cv->unet_config);
    if (lpb == LPB_OOM)
        return nf4_fail(NF4_ESOFTWARE, cv->path, first_sgm, "out of memory reading the UNet's config");
    if (lpb < 0) /* no mapping at all: the keys keep names no UNet module has */
        return nf4_fail(NF4_EDATA, cv->path, first_sgm, "is in the SGM UNet's names (input_blocks_...), which "
                        "diffusers maps only in Stable Diffusion XL's loader, by the UNet's config "
                        "(layers_per_block): this is no XL pipeline, or its unet/config.json gives none");
    if (not_sgm) { /* both names: diffusers drops the SGM ones */
        size_t kept = 0;
        for (size_t i = 0; i < cv->nkeys; i++) {
            if (holds_any(cv->keys[i].name, SGM)) {
                lora_rewrite_leave_out(&cv->rw, cv->keys[i].t->t->name, strlen(cv->keys[i].t->t->name), 1);
                free(cv->keys[i].name);
            } else {
                cv->keys[kept++] = cv->keys[i];
            }
        }
        cv->nkeys = kept;
        return NF4_OK;
    }
    const size_t n = cv->nkeys ? cv->nkeys : 1;
    long *added[3] = {calloc(n, sizeof(long)), calloc(n, sizeof(long)), calloc(n, sizeof(long))};
    size_t nadded[3] = {0, 0, 0}, nwalked[3] = {0, 0, 0}, nout = 0, nrn = 0;
    struct walked_id *walked[3] = {NULL, NULL, NULL};
    int *pass = calloc(n, sizeof *pass);
    struct renaming *rn = calloc(n, sizeof *rn);
    struct lora_key *out = calloc(n, sizeof *out);
    int code = added[0] && added[1] && added[2] && pass && rn && out
                   ? NF4_OK
                   : nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        const char *key = cv->keys[i].name;
        int kind;
        long id;
        pass[i] = strstr(key, "text") || !holds_any(key, SGM) || strstr(key, "input_blocks_0_0");
        if (pass[i])
            out[nout++] = cv->keys[i];
        else if (!sgm_block_of(key, &kind, &id))
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "has no block number where diffusers "
                            "reads it (the fifth \"_\"-separated piece)");
        else if (kind == 1 && (id < 0 || id > 2)) /* diffusers raises for the number, whichever keys it lists */
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is of a middle block other than 0, 1 "
                            "and 2, which diffusers refuses");
        else
            added[kind][nadded[kind]++] = id;
    }
    for (int kind = 0; kind < 3 && code == NF4_OK; kind++)
        if (!walk_ids(added[kind], nadded[kind], &walked[kind], &nwalked[kind]))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    /* Each key goes to the one block that lists it; one two list is popped
     * twice (KeyError), one none lists is left over. */
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++) {
        struct walked_id hits[2];
        int kinds[2];
        size_t nhits = 0;
        for (int kind = 0; kind < 3 && !pass[i]; kind++)
            blocks_listing(cv->keys[i].name, kind, walked[kind], nwalked[kind], hits, kinds, &nhits, 2);
        if (pass[i])
            continue;
        if (nhits > 1)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is in the keys of %s %ld and of %s %ld, "
                            "which diffusers cannot map (KeyError)", SGM[kinds[0]], hits[0].id, SGM[kinds[1]],
                            hits[1].id);
        else if (nhits == 0)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is in no block diffusers maps it by "
                            "(\"At this point all state dict entries have to be converted\")");
        else
            rn[nrn++] = (struct renaming){i, hits[0].pos, hits[0].id, kinds[0]};
    }
    if (nrn)
        qsort(rn, nrn, sizeof *rn, cmp_renaming);
    for (size_t j = 0; j < nrn && code == NF4_OK; j++) {
        const char *why;
        struct lora_key *k = &cv->keys[rn[j].key];
        char *renamed = sgm_rename(k->name, rn[j].kind, rn[j].id, lpb, &why);
        if (!renamed)
            code = why ? nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "%s", why)
                       : nf4_fail(NF4_ESOFTWARE, cv->path, k->t->t->name, "out of memory");
        else
            out[nout++] = (struct lora_key){renamed, k->t, 0};
    }
    if (code == NF4_OK) {
        for (size_t i = 0; i < cv->nkeys; i++)
            if (!pass[i])
                free(cv->keys[i].name);
        memcpy(cv->keys, out, nout * sizeof *out);
        cv->nkeys = nout;
    } else {
        size_t npass = 0; /* out holds the keys passed through, then those renamed */
        for (size_t i = 0; pass && i < cv->nkeys; i++)
            npass += pass[i] != 0;
        for (size_t j = npass; out && j < nout; j++)
            free(out[j].name);
    }
    for (int k = 0; k < 3; k++) {
        free(added[k]);
        free(walked[k]);
    }
    free(pass);
    free(rn);
    free(out);
    return code;
}

/* ---- kohya's modules into diffusers' (_convert_non_diffusers_lora_to_diffusers) ---- */

static int cmp_key_name(const void *a, const void *b)
{
    const struct lora_key *x = *(struct lora_key *const *)a, *y = *(struct lora_key *const *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x > y) - (x < y); /* equal names in walk order */
}

/* cv->by_name: the keys sorted by name, for find_left. */
static int index_keys(struct conversion *cv)
{
    if (!(cv->by_name = calloc(cv->nkeys ? cv->nkeys : 1, sizeof *cv->by_name)))
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < cv->nkeys; i++)
        cv->by_name[i] = &cv->keys[i];
    qsort(cv->by_name, cv->nkeys, sizeof *cv->by_name, cmp_key_name);
    return NF4_OK;
}

/* The first key named `name` the conversion has not taken (a dict's pop), or NULL. */
static struct lora_key *find_left(struct conversion *cv, const char *name)
{
    size_t lo = 0, hi = cv->nkeys;
    while (lo < hi) { /* the first of the name's run */
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(cv->by_name[mid]->name, name) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (; lo < cv->nkeys && strcmp(cv->by_name[lo]->name, name) == 0; lo++)
        if (!cv->by_name[lo]->taken)
            return cv->by_name[lo];
    return NULL;
}

/* Two alphas of one name (diffusers' dict would keep the last) are of two
 * pairs of one module, which lora_rewrite_check_one_each refuses: each is
 * kept here. */
static int add_alpha(struct sd_part *p, const char *name, double value)
{
    if (!grow_array((void **)&p->alphas, &p->alphas_cap, p->nalphas + 1, sizeof *p->alphas))
        return 0;
    if (!(p->alphas[p->nalphas].name = strdup(name)))
        return 0;
    p->alphas[p->nalphas++].value = value;
    return 1;
}

static int add_pair(struct sd_part *p, char *module, const struct model_tensor *down, const struct model_tensor *up)
{
    if (!grow_array((void **)&p->pairs, &p->pairs_cap, p->npairs + 1, sizeof *p->pairs))
        return 0;
    p->pairs[p->npairs++] = (struct sd_pair){module, down, up};
    return 1;
}

static int add_te_key(struct sd_part *p, char *name, const struct model_tensor *t)
{
    if (!grow_array((void **)&p->te_keys, &p->te_cap, p->nte + 1, sizeof *p->te_keys))
        return 0;
    p->te_keys[p->nte++] = (struct lora_key){name, t, 0};
    return 1;
}

/* The module a PEFT factor name is of: `name` less `suffix` (allocated:
 * NULL where memory ran out), or NULL where it does not end so (*other set). */
static char *module_of(const char *name, const char *suffix, int *other)
{
    *other = !str_ends_with(name, suffix);
    return *other ? NULL : strndup(name, strlen(name) - strlen(suffix));
}

/* A UNet pair: its diffusers names turned into PEFT's
 * (convert_unet_state_dict_to_peft), both of one module. */
static int add_unet_pair(struct conversion *cv, const char *dn, const struct model_tensor *down,
                         const struct model_tensor *up)
{
    char *a = strdup(dn), *b = str_replace_all(dn, ".down.", ".up.");
    int ok = a && b && old_forms_unet_to_peft(&a) && old_forms_unet_to_peft(&b);
    int other_a = 0, other_b = 0;
    char *ma = ok ? module_of(a, ".lora_A.weight", &other_a) : NULL,
         *mb = ok ? module_of(b, ".lora_B.weight", &other_b) : NULL;
    int code = NF4_OK;
    if (!ok || (!ma && !other_a) || (!mb && !other_b))
        code = nf4_fail(NF4_ESOFTWARE, cv->path, down->t->name, "out of memory");
    else if (!ma || !mb || strcmp(ma, mb) != 0)
        code = nf4_fail(NF4_EDATA, cv->path, down->t->name, "becomes %s and %s, which are no LoRA pair of one module "
                        "in PEFT's names: diffusers would not load it", a, b);
    else if (!add_pair(&cv->comp[SD_COMP_UNET], ma, down, up))
        code = nf4_fail(NF4_ESOFTWARE, cv->path, down->t->name, "out of memory");
    else
        ma = NULL;
    free(a);
    free(b);
    free(ma);
    free(mb);
    return code;
}

/* A kohya pair: a matrix's (lora_check_pair), or a convolution's (LoCon's,
 * and Stable Diffusion 1.x's proj_in and proj_out): down [r, in, kh, kw], up
 * [out, r, 1, 1], which PEFT loads into the UNet's Conv2d layers. */
static int check_pair(const char *path, const struct st_tensor *dt, const struct st_tensor *ut)
{
    if (dt->ndim != 4 && ut->ndim != 4)
        return lora_check_pair(path, dt, ut);
    int code = lora_check_factor_dtype(path, dt);
    if (code != NF4_OK || (code = lora_check_factor_dtype(path, ut)) != NF4_OK)
        return code;
    if (dt->ndim != 4 || !lora_is_conv_pair(dt, ut) || ut->shape[1] != dt->shape[0])
        return nf4_fail(NF4_EDATA, path, dt->name, "is %s; with %s it is not a convolution's LoRA pair [r, in, kh, "
                        "kw], [out, r, 1, 1]", dt->ndim == 4 ? "4-D" : "not 4-D", ut->name);
    if (dt->nelem == 0 || ut->nelem == 0)
        return nf4_fail(NF4_EDATA, path, dt->nelem ? ut->name : dt->name, "is empty");
    return NF4_OK;
}

/* One kohya module, by its down key: its pair (and alpha) into its component. */
static int convert_module(struct conversion *cv, struct lora_key *down)
{
    const char *key = down->name, *dot = strchr(key, '.');
    const size_t nlen = dot ? (size_t)(dot - key) : strlen(key);
    char name[LORA_KEY_MAX + 32];
    snprintf(name, sizeof name, "%.*s%s", (int)nlen, key, SD_UP);
    struct lora_key *up = find_left(cv, name);
    if (!up)
        return nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "has no matching lora_up.weight (%s)", name);
    int code = check_pair(cv->path, down->t->t, up->t->t);
    if (code != NF4_OK)
        return code;
    down->taken = up->taken = 1;
    enum sd_component c = str_starts_with(key, SD_UNET)    ? SD_COMP_UNET
                          : str_starts_with(key, "lora_te2_") ? SD_COMP_TE2
                                                             : SD_COMP_TE;
    const char *te_prefix = c == SD_COMP_TE2 ? "lora_te2_" : str_starts_with(key, "lora_te1_") ? "lora_te1_" : "lora_te_";
    int ascii = 1;
    for (const char *q = key; *q && ascii; q++)
        ascii = (unsigned char)*q < 0x80;
    if (c == SD_COMP_UNET && !ascii && strstr(key, "emb"))
        return nf4_fail(NF4_EDATA, cv->path, down->t->t->name, "holds a character outside ASCII where diffusers cuts "
                        "a block number from an embedding's name with Python's \\d, which reads Unicode's digits");
    char *dn = c == SD_COMP_UNET ? unet_key(key) : te_key(key, te_prefix);
    if (!dn)
        return nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
    if (c == SD_COMP_UNET) {
        code = add_unet_pair(cv, dn, down->t, up->t);
    } else {
        char *dn_up = str_replace_all(dn, ".down.", ".up."), *dn_down = strdup(dn);
        if (!dn_up || !dn_down || !add_te_key(&cv->comp[c], dn_down, down->t)) {
            free(dn_down);
            free(dn_up);
            code = nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
        } else if (!add_te_key(&cv->comp[c], dn_up, up->t)) {
            free(dn_up);
            code = nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
        }
    }
    snprintf(name, sizeof name, "%.*s%s", (int)nlen, key, SD_ALPHA);
    struct lora_key *alpha = code == NF4_OK ? find_left(cv, name) : NULL;
    if (alpha) { /* _get_alpha_name: the name up to ".lora.", and ".alpha" */
        double value;
        const char *cut = strstr(dn, ".lora.");
        char an[LORA_KEY_MAX + 64];
        snprintf(an, sizeof an, "%.*s.alpha", (int)(cut ? (size_t)(cut - dn) : strlen(dn)), dn);
        alpha->taken = 1;
        if ((code = lora_read_alpha(cv->path, alpha->t, &value)) == NF4_OK && !add_alpha(&cv->comp[c], an, value))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, key, "out of memory");
    }
    free(dn);
    return code;
}

static int convert_modules(struct conversion *cv)
{
    int code = NF4_OK;
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken && str_ends_with(cv->keys[i].name, SD_DOWN))
            code = convert_module(cv, &cv->keys[i]);
    for (size_t i = 0; i < cv->nkeys && code == NF4_OK; i++)
        if (!cv->keys[i].taken)
            code = nf4_fail(NF4_EDATA, cv->path, cv->keys[i].t->t->name, "is no lora_down.weight, nor the "
                            "lora_up.weight or alpha of one (nor are LoHa's and LoKr's factors): diffusers refuses "
                            "the file (\"have not been correctly renamed\")");
    return code;
}

/* ---- the text encoders (_load_lora_into_text_encoder) ---- */

/* Where te_rank_order puts a ranked module outside encoder.layers.N: after them. */
#define TE_ORDER_LAST (1L << 30)

/* The text encoder's modules diffusers takes ranks from (the names
 * named_modules gives, in its order: per layer k, v, q, out_proj, fc1, fc2);
 * the sort key of one, or -1 for one it does not. */
static long te_rank_order(const char *module)
{
    static const char *const KINDS[] = {"self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                        "self_attn.out_proj", "mlp.fc1", "mlp.fc2"};
    static const char *const ENDS[] = {".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2"};
    int ranked = 0;
    for (size_t i = 0; i < MAP_N(ENDS) && !ranked; i++)
        ranked = str_ends_with(module, ENDS[i]);
    if (!ranked)
        return -1;
    const char *layers = strstr(module, "encoder.layers.");
    const char *num = layers ? layers + strlen("encoder.layers.") : NULL, *dot = num ? strchr(num, '.') : NULL;
    int64_t layer;
    if (!dot || !lora_python_int(num, (size_t)(dot - num), &layer) || layer < 0 || layer > 100000)
        return TE_ORDER_LAST;
    for (size_t k = 0; k < MAP_N(KINDS); k++)
        if (strcmp(dot + 1, KINDS[k]) == 0)
            return (long)layer * (long)MAP_N(KINDS) + (long)k;
    return TE_ORDER_LAST;
}


/* _load_lora_into_text_encoder's renaming into PEFT's names (lora_old_forms.h);
 * NF4_EDATA where diffusers cannot tell the keys' form. */
static int te_to_peft(struct conversion *cv, struct sd_part *p, enum sd_component c)
{
    switch (old_forms_text_encoder_to_peft(p->te_keys, p->nte)) {
    case OLD_FORMS_OK: return NF4_OK;
    case OLD_FORMS_OOM: return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    case OLD_FORMS_UNKNOWN:
        return nf4_fail(NF4_EDATA, cv->path, p->te_keys[0].t->t->name, "is a %s key, and none of them is of an "
                        "out_proj or mlp module: diffusers cannot tell their form, and refuses this LoRA", COMPONENT[c]);
    case OLD_FORMS_UNKNOWN_AFTER: break;
    }
    return nf4_fail(NF4_EDATA, cv->path, p->te_keys[0].t->t->name, "is a %s key of a form diffusers cannot tell "
                    "(\"Could not automatically infer state dict type\")", COMPONENT[c]);
}

/* The text encoder's pairs: keys named lora_A and lora_B of one module; the
 * rest (names PEFT does not read) left out. */
static int te_pairs(struct conversion *cv, enum sd_component c)
{
    struct sd_part *p = &cv->comp[c];
    if (p->nte == 0)
        return NF4_OK;
    int code = te_to_peft(cv, p, c);
    size_t ranked = 0;
    for (size_t i = 0; i + 1 < p->nte && code == NF4_OK; i += 2) { /* down, up */
        struct lora_key *a = &p->te_keys[i], *b = &p->te_keys[i + 1];
        int other_a, other_b;
        char *ma = module_of(a->name, ".lora_A.weight", &other_a), *mb = module_of(b->name, ".lora_B.weight", &other_b);
        /* transformers 5's CLIPTextModelWithProjection (XL's second encoder)
         * keeps text_model. before all but text_projection: a module without
         * it is none of its own, and neither loaded nor given a rank */
        const int foreign = c == SD_COMP_TE2 && ma && !str_starts_with(ma, "text_model.") &&
                            strcmp(ma, "text_projection") != 0;
        if ((!ma && !other_a) || (!mb && !other_b)) {
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        } else if (ma && mb && strcmp(ma, mb) != 0) {
            code = nf4_fail(NF4_EDATA, cv->path, a->t->t->name, "becomes %s and %s, which are no LoRA pair of one "
                            "module in PEFT's names: diffusers would not load it", a->name, b->name);
        } else if (ma && mb && !foreign) {
            ranked += te_rank_order(ma) >= 0;
            if (add_pair(p, ma, a->t, b->t))
                ma = NULL;
            else
                code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        } else { /* names PEFT does not read */
            lora_rewrite_leave_out(&cv->rw, a->t->t->name, strlen(a->t->t->name), 1);
            lora_rewrite_leave_out(&cv->rw, b->t->t->name, strlen(b->t->t->name), 1);
        }
        free(ma);
        free(mb);
    }
    /* diffusers takes r from the ranks of the modules it ranks, and has none
     * to take (IndexError) where the encoder's keys name none of them */
    if (code == NF4_OK && ranked == 0)
        code = nf4_fail(NF4_EDATA, cv->path, p->te_keys[0].t->t->name, "is a %s key, and none of them is of a "
                        "module diffusers takes a rank from (q_proj, k_proj, v_proj, out_proj, fc1, fc2): it "
                        "cannot make the LoRA's config (IndexError)", COMPONENT[c]);
    return code;
}

/* ---- each component's LoraConfig (get_peft_kwargs) ---- */

struct ranked {
    const struct sd_pair *pair;
    long order;
    size_t index;
};

static int cmp_ranked(const void *a, const void *b)
{
    const struct ranked *x = a, *y = b;
    if (x->order != y->order)
        return x->order < y->order ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int all_equal(const double *v, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (v[i] != v[0])
            return 0;
    return 1;
}

/* alpha_pattern's key for a network alpha's name, as get_peft_kwargs makes
 * it: the UNet's its name up to ".lora_A." with every ".alpha" cut; a text
 * encoder's its name up to ".down.", less its last piece. */
static char *alpha_key(const char *name, enum sd_component c)
{
    if (c == SD_COMP_UNET) {
        const char *cut = strstr(name, ".lora_A.");
        char *head = strndup(name, cut ? (size_t)(cut - name) : strlen(name));
        char *key = head ? str_replace_all(head, ".alpha", "") : NULL;
        free(head);
        return key;
    }
    const char *cut = strstr(name, ".down.");
    size_t len = cut ? (size_t)(cut - name) : strlen(name);
    const char *last = NULL;
    for (const char *p = name; p < name + len; p++)
        if (*p == '.')
            last = p;
    return strndup(name, last ? (size_t)(last - name) : 0);
}

/* Writes component c's config into `meta` under "<component>.": r,
 * lora_alpha, target_modules, rank_pattern and alpha_pattern. */
static int component_config(struct conversion *cv, enum sd_component c, cJSON *meta)
{
    struct sd_part *p = &cv->comp[c];
    struct ranked *rk = calloc(p->npairs ? p->npairs : 1, sizeof *rk);
    double *ranks = calloc(p->npairs ? p->npairs : 1, sizeof *ranks), *alphas = calloc(p->nalphas ? p->nalphas : 1, sizeof *alphas);
    cJSON *rank_pattern = cJSON_CreateObject(), *alpha_pattern = cJSON_CreateObject();
    int code = rk && ranks && alphas && rank_pattern && alpha_pattern ? NF4_OK
                                                                     : nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < p->npairs && code == NF4_OK; i++) {
        long order = c == SD_COMP_UNET ? 0 : te_rank_order(p->pairs[i].module);
        if (order >= 0)
            rk[n++] = (struct ranked){&p->pairs[i], order, i};
    }
    if (code == NF4_OK && n == 0)
        code = nf4_fail(NF4_EDATA, cv->path, p->pairs[0].down->t->name, "is of a %s module diffusers takes no rank "
                        "from, and it takes none from any other: it cannot make the LoRA's config", COMPONENT[c]);
    if (code == NF4_OK)
        qsort(rk, n, sizeof *rk, cmp_ranked);
    for (size_t i = 0; i < n; i++)
        ranks[i] = (double)rk[i].pair->up->t->shape[1];
    double r = code == NF4_OK ? ranks[0] : 0;
    if (code == NF4_OK && !all_equal(ranks, n) && !lora_most_common(ranks, n, &r))
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < n && code == NF4_OK; i++) {
        if (ranks[i] == r)
            continue;
        char key[LORA_KEY_MAX + 64];
        const char *m = rk[i].pair->module;
        if (c != SD_COMP_UNET && str_starts_with(m, "text_model."))
            m += strlen("text_model."); /* transformers 5's CLIPTextModel has none; unanchored, it fits either */
        snprintf(key, sizeof key, "%s%s", c == SD_COMP_UNET ? "^" : "", m);
        if (!json_set_number(rank_pattern, key, ranks[i]))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    /* PEFT builds a module without a rank of its own with r: a text encoder's
     * text_projection, which diffusers takes no rank from. */
    for (size_t i = 0; i < p->npairs && code == NF4_OK; i++)
        if (c != SD_COMP_UNET && te_rank_order(p->pairs[i].module) < 0 && (double)p->pairs[i].up->t->shape[1] != r)
            code = nf4_fail(NF4_EDATA, cv->path, p->pairs[i].down->t->name, "has rank %llu, and diffusers builds %s "
                            "with the %s's common rank %g, which PEFT then cannot load it into",
                            (unsigned long long)p->pairs[i].up->t->shape[1], p->pairs[i].module, COMPONENT[c], r);
    double lora_alpha = r;
    if (code == NF4_OK && p->nalphas == 0 && cJSON_GetArraySize(rank_pattern) > 0) {
        cJSON_Delete(alpha_pattern); /* no alphas: each module's alpha is its rank */
        if (!(alpha_pattern = cJSON_Duplicate(rank_pattern, 1)))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    for (size_t i = 0; i < p->nalphas && code == NF4_OK; i++)
        alphas[i] = p->alphas[i].value;
    if (code == NF4_OK && p->nalphas > 0)
        lora_alpha = alphas[0];
    if (code == NF4_OK && p->nalphas > 0 && !all_equal(alphas, p->nalphas) && !lora_most_common(alphas, p->nalphas, &lora_alpha))
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (size_t i = 0; i < p->nalphas && code == NF4_OK && !all_equal(alphas, p->nalphas); i++) {
        if (alphas[i] == lora_alpha)
            continue;
        char *key = alpha_key(p->alphas[i].name, c);
        if (!key || !json_set_number(alpha_pattern, key, alphas[i]))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        free(key);
    }
    char name[64];
    const char *fields[2] = {"r", "lora_alpha"};
    const double values[2] = {r, lora_alpha};
    for (int f = 0; f < 2 && code == NF4_OK; f++) {
        snprintf(name, sizeof name, "%s.%s", COMPONENT[c], fields[f]);
        if (!cJSON_AddNumberToObject(meta, name, values[f]))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    /* get_peft_kwargs' target_modules: each pair's module (PEFT raises
     * without them; the merge binds by the keys either way). */
    cJSON *targets = code == NF4_OK ? cJSON_CreateArray() : NULL;
    for (size_t i = 0; targets && i < p->npairs; i++)
        if (!cJSON_AddItemToArray(targets, cJSON_CreateString(p->pairs[i].module))) {
            cJSON_Delete(targets);
            targets = NULL;
        }
    snprintf(name, sizeof name, "%s.target_modules", COMPONENT[c]);
    if (code == NF4_OK && (!targets || !cJSON_AddItemToObject(meta, name, targets))) {
        cJSON_Delete(targets);
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    }
    cJSON *patterns[2] = {rank_pattern, alpha_pattern};
    const char *pattern_names[2] = {"rank_pattern", "alpha_pattern"};
    for (int f = 0; f < 2 && code == NF4_OK; f++) {
        snprintf(name, sizeof name, "%s.%s", COMPONENT[c], pattern_names[f]);
        if (!cJSON_AddItemToObject(meta, name, patterns[f]))
            code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
        else if (f == 0)
            rank_pattern = NULL;
        else
            alpha_pattern = NULL;
    }
    cJSON_Delete(rank_pattern);
    cJSON_Delete(alpha_pattern);
    free(rk);
    free(ranks);
    free(alphas);
    return code;
}

/* ---- the converted file ---- */

/* The parts, and the metadata: the file's own, with the components'
 * configs where it has no lora_adapter_metadata (or one diffusers reads as
 * none, "" or "null", which the configs take the place of). *meta: the
 * array made, *made its config text (free both after writing), or NULL. */
static int finish_parts(struct conversion *cv, const struct model *w, struct st_meta **meta, char **made)
{
    *meta = NULL;
    *made = NULL;
    int code = NF4_OK;
    size_t nalphas = 0;
    for (int c = 0; c < SD_COMPONENTS; c++) {
        nalphas += cv->comp[c].nalphas;
        for (size_t i = 0; i < cv->comp[c].npairs && code == NF4_OK; i++) {
            const struct sd_pair *pr = &cv->comp[c].pairs[i];
            char target[LORA_KEY_MAX + 64];
            snprintf(target, sizeof target, "%s.%s", COMPONENT[c], pr->module);
            if ((code = lora_rewrite_add_copy(&cv->rw, target, ".lora_A.weight", pr->down)) == NF4_OK)
                code = lora_rewrite_add_copy(&cv->rw, target, ".lora_B.weight", pr->up);
        }
    }
    if (code != NF4_OK)
        return code;
    if (diffusers_lora_metadata(w))
        return nalphas ? nf4_fail(NF4_EDATA, cv->path, NULL, "holds both alphas and a LoRA config (metadata \"%s\"), "
                                  "which diffusers refuses (\"Both network_alphas and metadata cannot be specified\")",
                                  DIFFUSERS_LORA_METADATA)
                       : NF4_OK; /* the file's config, read as a diffusers LoRA's */
    cJSON *cfg = cJSON_CreateObject();
    if (!cfg)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    for (int c = 0; c < SD_COMPONENTS && code == NF4_OK; c++)
        if (cv->comp[c].npairs)
            code = component_config(cv, c, cfg);
    char *text = code == NF4_OK ? cJSON_PrintUnformatted(cfg) : NULL;
    cJSON_Delete(cfg);
    if (code == NF4_OK && !text)
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    if (code == NF4_OK && (code = lora_rewrite_use_config(&cv->rw, w->files[0], text, meta)) == NF4_OK)
        *made = text;
    else
        free(text);
    return code;
}

static void free_parts(struct conversion *cv)
{
    for (int c = 0; c < SD_COMPONENTS; c++) {
        struct sd_part *p = &cv->comp[c];
        for (size_t i = 0; i < p->npairs; i++)
            free(p->pairs[i].module);
        for (size_t i = 0; i < p->nte; i++)
            free(p->te_keys[i].name);
        for (size_t i = 0; i < p->nalphas; i++)
            free(p->alphas[i].name);
        free(p->pairs);
        free(p->te_keys);
        free(p->alphas);
    }
}

/* The keys but DoRA scales, in the order diffusers walks them: the file's
 * order of data, as safetensors' load_file gives it. */
static int keys_in_order(struct conversion *cv, const struct model *w)
{
    int code = lora_keys_of(cv->path, w, lora_is_dora_scale, &cv->keys, &cv->nkeys);
    struct lora_key **order = code == NF4_OK ? lora_keys_in_file_order(cv->keys, cv->nkeys) : NULL;
    struct lora_key *sorted = order ? calloc(cv->nkeys ? cv->nkeys : 1, sizeof *sorted) : NULL;
    if (code == NF4_OK && !sorted)
        code = nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    if (code == NF4_OK) {
        for (size_t i = 0; i < cv->nkeys; i++)
            sorted[i] = *order[i];
        memcpy(cv->keys, sorted, cv->nkeys * sizeof *sorted);
    }
    free(order);
    free(sorted);
    return code;
}

int sd_lora_convert(const struct model *w, const char *path, const char *unet_config, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {path, w->files[0]->meta, w->files[0]->nmeta}};
    struct st_meta *meta = NULL;
    char *made = NULL;
    cv.unet_config = unet_config;
    lora_rewrite_leave_out_dora(&cv.rw, w);
    int code = keys_in_order(&cv, w);
    if (code == NF4_OK)
        code = sgm_remap(&cv);
    if (code == NF4_OK)
        code = index_keys(&cv);
    if (code == NF4_OK)
        code = convert_modules(&cv);
    for (int c = SD_COMP_TE; c < SD_COMPONENTS && code == NF4_OK; c++)
        code = te_pairs(&cv, c);
    if (code == NF4_OK)
        code = finish_parts(&cv, w, &meta, &made);
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    if (code == NF4_OK && cv.rw.nparts == 0)
        code = nf4_fail(NF4_EDATA, path, NULL, "has none of the keys diffusers loads from a kohya Stable Diffusion "
                        "LoRA (lora_unet_..., lora_te_...) among its %zu tensors", w->count);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are not loaded by diffusers from a kohya Stable Diffusion LoRA",
                               out);
    free(made);
    free(meta);
    free_parts(&cv);
    free(cv.by_name);
    lora_keys_free(cv.keys, cv.nkeys);
    return code;
}
