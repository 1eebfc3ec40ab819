#include "lora_lumina2.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"

#define LUMINA2_COMFY "diffusion_model."
#define LUMINA2_TARGET "transformer."
/* A block number of more digits than this is refused: no model has one. */
#define BLOCK_NUMBER_DIGITS 9

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* torch.split(lora_up, [2304, 768, 768]): Lumina-Image 2.0's query rows (24
 * heads of 96) and its key's and value's (8 heads), fixed in diffusers'
 * conversion whatever the model. */
static const uint64_t QKV_ROWS[3] = {2304, 768, 768};
#define QKV_TOTAL 3840
static const char *const QKV[3] = {"attn.to_q", "attn.to_k", "attn.to_v"};

/* The kinds of block in the order diffusers converts them, and whether their
 * blocks have adaLN_modulation.1 (convert_norm). */
static const struct {
    const char *kind;
    int norm;
} KINDS[] = {{"noise_refiner", 1}, {"context_refiner", 0}, {"layers", 1}};

/* A block's modules after its qkv, Lumina 2's names and diffusers', in the
 * order diffusers pops them; the last only where the kind has norms. */
static const char *const MODULES[][2] = {
    {"attention.out", "attn.to_out.0"},
    {"feed_forward.w1", "feed_forward.linear_1"},
    {"feed_forward.w2", "feed_forward.linear_2"},
    {"feed_forward.w3", "feed_forward.linear_3"},
    {"adaLN_modulation.1", "norm1.linear"},
};
#define NORM_MODULE (COUNT(MODULES) - 1)

static const char *const FACTORS[2] = {".lora_A.weight", ".lora_B.weight"};

struct conversion {
    const char *path;
    struct lora_key *keys; /* sorted by their names less the first 16 characters */
    size_t n;
    struct lora_rewrite rw;
};

int lumina2_lora_detect(const struct model *w)
{
    return lora_model_any_key_starting(w, LUMINA2_COMFY);
}

static int cmp_u32(const void *a, const void *b)
{
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* re.search(r"<kind>\.(\d+)\.", key): the number of the leftmost match in
 * *number, 1; 0 where there is none. NF4_EDATA (as -1) where the number may
 * be in Unicode digits, which \d reads, or is too long. */
static int block_number(const struct conversion *cv, const struct lora_key *k, const char *kind, uint32_t *number)
{
    const size_t klen = strlen(kind);
    for (const char *p = strstr(k->name, kind); p; p = strstr(p + 1, kind)) {
        const char *digits = p + klen + 1;
        if (p[klen] != '.')
            continue;
        size_t n = 0;
        while (digits[n] >= '0' && digits[n] <= '9')
            n++;
        if ((unsigned char)digits[n] >= 0x80) {
            nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a block number that may not be ASCII digits, which "
                     "nf4deq does not read (Python's \\d reads Unicode digits)");
            return -1;
        }
        if (n == 0 || digits[n] != '.')
            continue;
        if (n > BLOCK_NUMBER_DIGITS) {
            nf4_fail(NF4_EDATA, cv->path, k->t->t->name, "has a block number of more than %d digits",
                     BLOCK_NUMBER_DIGITS);
            return -1;
        }
        *number = (uint32_t)strtoul(digits, NULL, 10);
        return 1;
    }
    return 0;
}

/* get_num_layers: how many distinct numbers follow "<kind>." in the keys. */
static int count_blocks(const struct conversion *cv, const char *kind, size_t *count)
{
    uint32_t *numbers = calloc(cv->n ? cv->n : 1, sizeof *numbers);
    if (!numbers)
        return nf4_fail(NF4_ESOFTWARE, cv->path, NULL, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < cv->n; i++) {
        const int found = block_number(cv, &cv->keys[i], kind, &numbers[n]);
        if (found < 0) {
            free(numbers);
            return NF4_EDATA;
        }
        n += (size_t)found;
    }
    qsort(numbers, n, sizeof *numbers, cmp_u32);
    *count = 0;
    for (size_t i = 0; i < n; i++)
        *count += i == 0 || numbers[i] != numbers[i - 1];
    free(numbers);
    return NF4_OK;
}

/* state_dict.pop("<kind>.<block>.<module><factor>"): the key, taken; NULL,
 * with NF4_EDATA recorded, where there is none (diffusers' KeyError). */
static struct lora_key *pop(struct conversion *cv, const char *kind, size_t block, const char *module, const char *factor)
{
    char name[LORA_KEY_MAX + 64];
    snprintf(name, sizeof name, "%s.%zu.%s%s", kind, block, module, factor);
    struct lora_key *k = lora_key_available(cv->keys, cv->n, name);
    if (!k) {
        nf4_fail(NF4_EDATA, cv->path, NULL, "has no key %s (after its first 16 characters), which diffusers pops "
                 "converting a Lumina 2 LoRA of %s block %zu, and raises (KeyError)", name, kind, block);
        return NULL;
    }
    k->taken = 1;
    return k;
}

/* process_block: one block's pairs, under diffusers' names. */
static int convert_block(struct conversion *cv, const char *kind, size_t block, int norm)
{
    char target[LORA_KEY_MAX + 64];
    const struct lora_key *a = pop(cv, kind, block, "attention.qkv", FACTORS[0]);
    const struct lora_key *b = a ? pop(cv, kind, block, "attention.qkv", FACTORS[1]) : NULL;
    if (!b)
        return NF4_EDATA;
    const struct st_tensor *bt = b->t->t;
    if (bt->ndim != 2 || bt->shape[0] != QKV_TOTAL)
        return nf4_fail(NF4_EDATA, cv->path, bt->name, "has %s%llu rows, where diffusers cuts a Lumina 2 qkv lora_B "
                        "at rows 2304, 768 and 768 (%d in all)", bt->ndim == 2 ? "" : "no matrix's ",
                        (unsigned long long)(bt->ndim ? bt->shape[0] : 0), QKV_TOTAL);
    int code = NF4_OK;
    uint64_t row0 = 0;
    for (size_t q = 0; q < COUNT(QKV) && code == NF4_OK; q++) {
        snprintf(target, sizeof target, "%s%s.%zu.%s", LUMINA2_TARGET, kind, block, QKV[q]);
        if ((code = lora_rewrite_add_copy(&cv->rw, target, FACTORS[0], a->t)) == NF4_OK)
            code = lora_rewrite_add_rows(&cv->rw, target, FACTORS[1], b->t, row0, QKV_ROWS[q]);
        row0 += QKV_ROWS[q];
    }
    for (size_t m = 0; m < COUNT(MODULES) && code == NF4_OK; m++) {
        if (m == NORM_MODULE && !norm)
            break;
        snprintf(target, sizeof target, "%s%s.%zu.%s", LUMINA2_TARGET, kind, block, MODULES[m][1]);
        for (size_t f = 0; f < COUNT(FACTORS) && code == NF4_OK; f++) {
            const struct lora_key *k = pop(cv, kind, block, MODULES[m][0], FACTORS[f]);
            code = k ? lora_rewrite_add_copy(&cv->rw, target, FACTORS[f], k->t) : NF4_EDATA;
        }
    }
    return code;
}

int lumina2_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct conversion cv = {.path = path, .rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta}};
    lora_rewrite_leave_out_dora(&cv.rw, w); /* dropped before the conversion, with a warning */
    int code = lora_keys_of(path, w, lora_is_dora_scale, &cv.keys, &cv.n);
    if (code == NF4_OK) { /* k[len("diffusion_model."):], each key */
        lora_keys_cut(cv.keys, cv.n, strlen(LUMINA2_COMFY));
        lora_keys_sort(cv.keys, cv.n);
        code = lora_keys_check_distinct(path, cv.keys, cv.n); /* diffusers' dict keeps one of them */
    }
    for (size_t k = 0; k < COUNT(KINDS) && code == NF4_OK; k++) {
        size_t blocks = 0;
        code = count_blocks(&cv, KINDS[k].kind, &blocks);
        for (size_t i = 0; i < blocks && code == NF4_OK; i++)
            code = convert_block(&cv, KINDS[k].kind, i, KINDS[k].norm);
    }
    for (size_t i = 0; i < cv.n && code == NF4_OK; i++)
        if (!cv.keys[i].taken)
            code = nf4_fail(NF4_EDATA, path, cv.keys[i].t->t->name, "is left over where diffusers converts a Lumina "
                            "2 LoRA, and raises: a key of no module it converts (lora_A or lora_B of a noise_refiner, "
                            "context_refiner or layers block's attention.qkv, attention.out, feed_forward.w1, w2, w3 "
                            "or adaLN_modulation.1)");
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&cv.rw);
    code = lora_rewrite_finish(&cv.rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(cv.keys, cv.n);
    return code;
}
