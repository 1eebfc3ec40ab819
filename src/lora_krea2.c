#include "lora_krea2.h"

#include <stdlib.h>
#include <string.h>

#include "lora_rewrite.h"
#include "status.h"
#include "strbuf.h"

#define KREA2_PEFT "base_model.model."
#define KREA2_COMFY "diffusion_model."
#define KREA2_TARGET "transformer."

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* diffusers' attn_map and ff_map: a block module's last part, and its name. */
static const char *const ATTN[][2] = {
    {"wq", "attn.to_q"}, {"wk", "attn.to_k"}, {"wv", "attn.to_v"}, {"wo", "attn.to_out.0"}, {"gate", "attn.to_gate"},
};
static const char *const FF[][2] = {{"gate", "ff.gate"}, {"up", "ff.up"}, {"down", "ff.down"}};

/* diffusers' standalone_map: AI-Toolkit's names of the modules outside the blocks. */
static const char *const STANDALONE[][2] = {
    {"first", "img_in"},
    {"last.linear", "final_layer.linear"},
    {"tmlp.0", "time_embed.linear_1"},
    {"tmlp.2", "time_embed.linear_2"},
    {"tproj.1", "time_mod_proj"},
    {"txtmlp.1", "txt_in.linear_1"},
    {"txtmlp.3", "txt_in.linear_2"},
    {"txtfusion.projector", "text_fusion.projector"},
};

/* The kinds of block, theirs and diffusers' names before the number. */
static const char *const BLOCKS[][2] = {
    {"blocks.", "transformer_blocks."},
    {"txtfusion.layerwise_blocks.", "text_fusion.layerwise_blocks."},
    {"txtfusion.refiner_blocks.", "text_fusion.refiner_blocks."},
};

static const char *const FACTORS[] = {".lora_A.weight", ".lora_B.weight"};

static const char *lookup(const char *const (*map)[2], size_t n, const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(map[i][0]) == len && strncmp(map[i][0], name, len) == 0)
            return map[i][1];
    return NULL;
}

/* Where module[0..len) is a block's module, as diffusers' re.match(r"blocks\.
 * (\d+)\.(attn|mlp)\.(\w+)$") (and the text fusion's) reads it: its name in
 * *out, or nothing where the last part is none the maps hold. NF4_EDATA
 * where the number may be in Unicode digits, which \d reads. */
static int block_module(const char *path, const char *key, const char *module, size_t len, struct strbuf *out)
{
    for (size_t b = 0; b < COUNT(BLOCKS); b++) {
        const size_t root = strlen(BLOCKS[b][0]);
        if (len <= root || strncmp(module, BLOCKS[b][0], root) != 0)
            continue;
        const char *digits = module + root, *end = module + len;
        size_t n = 0;
        while (digits + n < end && (digits[n] >= '0' && digits[n] <= '9'))
            n++;
        if (digits + n < end && (unsigned char)digits[n] >= 0x80)
            return nf4_fail(NF4_EDATA, path, key, "has a block number that may not be ASCII digits, which nf4deq "
                            "does not read (Python's \\d reads Unicode digits)");
        if (n == 0 || digits + n == end || digits[n] != '.')
            return NF4_OK;
        const char *kind = digits + n + 1, *last = NULL;
        const char *const (*map)[2] = NULL;
        size_t nmap = 0;
        if (end - kind > 5 && strncmp(kind, "attn.", 5) == 0) {
            last = kind + 5, map = ATTN, nmap = COUNT(ATTN);
        } else if (end - kind > 4 && strncmp(kind, "mlp.", 4) == 0) {
            last = kind + 4, map = FF, nmap = COUNT(FF);
        } else {
            return NF4_OK;
        }
        const char *ours = lookup(map, nmap, last, (size_t)(end - last));
        if (ours)
            strbuf_printf(out, "%s%.*s.%s", BLOCKS[b][1], (int)n, digits, ours);
        return NF4_OK;
    }
    return NF4_OK;
}

/* Key `k` (its name without the prefixes) under diffusers' module, or left
 * untaken where diffusers' convert_module gives none. */
static int convert_key(const char *path, struct lora_rewrite *rw, struct lora_key *k)
{
    const size_t len = strlen(k->name);
    for (size_t f = 0; f < COUNT(FACTORS); f++) {
        const size_t flen = strlen(FACTORS[f]);
        if (len < flen || strcmp(k->name + len - flen, FACTORS[f]) != 0)
            continue;
        const size_t mlen = len - flen;
        struct strbuf module = {0};
        int code = block_module(path, k->t->t->name, k->name, mlen, &module);
        const char *standalone = lookup(STANDALONE, COUNT(STANDALONE), k->name, mlen);
        if (code == NF4_OK && !module.len && standalone)
            strbuf_printf(&module, "%s", standalone);
        if (code == NF4_OK && module.oom)
            code = nf4_fail(NF4_ESOFTWARE, path, k->t->t->name, "out of memory");
        if (code == NF4_OK && module.len) {
            strbuf_printf(&module, "%s", FACTORS[f]);
            code = module.oom ? nf4_fail(NF4_ESOFTWARE, path, k->t->t->name, "out of memory")
                              : lora_rewrite_add_copy(rw, KREA2_TARGET, module.p, k->t);
            k->taken = code == NF4_OK;
        }
        free(module.p);
        return code;
    }
    return NF4_OK;
}

int krea2_lora_detect(const struct model *w)
{
    return lora_model_any_key_starting(w, KREA2_COMFY) || lora_model_any_key_starting(w, KREA2_PEFT);
}

int krea2_lora_convert(const struct model *w, const char *path, int warn, struct model **out)
{
    *out = NULL;
    struct lora_rewrite rw = {.path = path, .meta = w->files[0]->meta, .nmeta = w->files[0]->nmeta};
    lora_rewrite_leave_out_dora(&rw, w); /* dropped before the conversion, with a warning */
    struct lora_key *keys = NULL;
    size_t n = 0;
    int code = lora_keys_of(path, w, lora_is_dora_scale, &keys, &n);
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        if (strchr(keys[i].name, '\n') || strchr(keys[i].name, '\r'))
            code = nf4_fail(NF4_EDATA, path, NULL, "has a key with a line break in its name, which nf4deq does not "
                            "read (Python's $ matches before one)");
    if (code == NF4_OK) { /* removeprefix(KREA2_PEFT).removeprefix(KREA2_COMFY), each key */
        lora_keys_remove_prefix(keys, n, KREA2_PEFT);
        lora_keys_remove_prefix(keys, n, KREA2_COMFY);
        lora_keys_sort(keys, n);
        code = lora_keys_check_distinct(path, keys, n); /* diffusers' dict keeps one of them */
    }
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        code = convert_key(path, &rw, &keys[i]);
    for (size_t i = 0; i < n && code == NF4_OK; i++)
        if (!keys[i].taken)
            code = nf4_fail(NF4_EDATA, path, keys[i].t->t->name, "is left over where diffusers converts a Krea 2 "
                            "LoRA, and raises: a key of no module it converts (lora_A or lora_B of a block's "
                            "attention or feed-forward, or of img_in, final_layer.linear, time_embed, "
                            "time_mod_proj, txt_in or text_fusion.projector)");
    if (code == NF4_OK)
        code = lora_rewrite_check_one_each(&rw);
    code = lora_rewrite_finish(&rw, code, warn, "are DoRA scales, which diffusers drops", out);
    lora_keys_free(keys, n);
    return code;
}
