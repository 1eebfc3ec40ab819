/* Writes a synthetic bitsandbytes 4-bit checkpoint with real Llama shapes, so
 * memory and speed can be measured without downloading a model.
 *
 *   gen_bnb4 [--preset tinyllama|llama3-8b|llama3-70b|tiny] [--layers N]
 *            [--shard-size SIZE] [--seed N] [--lora-rank R] [--dora] OUTDIR
 *
 * Every linear layer is nf4 with double quant (blocksize 64, nested 256), as
 * transformers saves a BitsAndBytesConfig(load_in_4bit, nf4, double quant)
 * model; embeddings, norms and lm_head are bf16. Values are random but the
 * quant state is consistent. OUTDIR gets config.json, the shards and, with more
 * than one shard, model.safetensors.index.json.
 *
 * With --lora-rank R it also writes OUTDIR-lora/, a PEFT-shaped LoRA adapter
 * for that model (adapter_config.json, adapter_model.safetensors): rank R,
 * lora_alpha 2R, fp32 factors on all seven projections of every layer, B
 * non-zero as after training; with --dora too, a DoRA adapter (use_dora, a
 * lora_magnitude_vector per projection). */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "dequant.h"
#include "fileio.h"
#include "fpconv.h"
#include "model_dir.h"
#include "safetensors.h"
#include "safetensors_writer.h"
#include "status.h"

struct preset {
    const char *name;
    uint64_t hidden, intermediate, layers, vocab, heads, kv_heads;
};

static const struct preset PRESETS[] = {
    {"tinyllama", 2048, 5632, 22, 32000, 32, 4},
    {"llama3-8b", 4096, 14336, 32, 128256, 32, 8},
    {"llama3-70b", 8192, 28672, 80, 128256, 64, 8},
    {"tiny", 512, 1408, 8, 4096, 8, 2}, /* tests: ~25 MB in, ~55 MB out */
};

#define BLOCKSIZE 64u
#define NESTED_BLOCKSIZE 256u

enum part { P_PLAIN, P_PACKED, P_ABSMAX, P_QUANT_MAP, P_NESTED_ABSMAX, P_NESTED_MAP, P_STATE };

struct gen_tensor {
    char name[160];
    enum part part;
    enum st_dtype dtype;
    uint64_t shape[2];
    size_t ndim;
    uint64_t rows, cols; /* the logical weight, for quantized parts */
    char state[256];
    size_t shard;
};

static uint64_t rng_state;
static uint64_t rng64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static uint64_t bytes_of(const struct gen_tensor *t)
{
    uint64_t n = 1;
    for (size_t d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n * dtype_bits(t->dtype) / 8;
}

static struct gen_tensor *tensors;
static size_t ntensors, cap;

static struct gen_tensor *add(const char *name, enum part part, enum st_dtype dt, uint64_t d0, uint64_t d1,
                              size_t ndim)
{
    if (ntensors == cap) {
        cap = cap ? cap * 2 : 256;
        tensors = realloc(tensors, cap * sizeof *tensors);
        if (!tensors) {
            perror("gen_bnb4");
            exit(70);
        }
    }
    struct gen_tensor *t = &tensors[ntensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->part = part;
    t->dtype = dt;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->ndim = ndim;
    return t;
}

static void add_quantized(const char *name, uint64_t rows, uint64_t cols)
{
    uint64_t n = rows * cols, blocks = (n + BLOCKSIZE - 1) / BLOCKSIZE;
    uint64_t nested = (blocks + NESTED_BLOCKSIZE - 1) / NESTED_BLOCKSIZE;
    char buf[200];
    add(name, P_PACKED, DT_U8, (n + 1) / 2, 1, 2)->rows = rows;
    snprintf(buf, sizeof buf, "%s.absmax", name);
    add(buf, P_ABSMAX, DT_U8, blocks, 0, 1);
    snprintf(buf, sizeof buf, "%s.quant_map", name);
    add(buf, P_QUANT_MAP, DT_F32, 16, 0, 1);
    snprintf(buf, sizeof buf, "%s.nested_absmax", name);
    add(buf, P_NESTED_ABSMAX, DT_F32, nested, 0, 1);
    snprintf(buf, sizeof buf, "%s.nested_quant_map", name);
    add(buf, P_NESTED_MAP, DT_F32, 256, 0, 1);
    snprintf(buf, sizeof buf, "%s.quant_state.bitsandbytes__nf4", name);
    struct gen_tensor *s = add(buf, P_STATE, DT_U8, 0, 0, 1);
    int len = snprintf(s->state, sizeof s->state,
                       "{\"quant_type\": \"nf4\", \"blocksize\": %u, \"dtype\": \"bfloat16\", \"shape\": [%" PRIu64
                       ", %" PRIu64 "], \"nested_blocksize\": %u, \"nested_dtype\": \"float32\", "
                       "\"nested_offset\": 0.0517578125}",
                       BLOCKSIZE, rows, cols, NESTED_BLOCKSIZE);
    s->shape[0] = (uint64_t)len;
}

static void fill(const struct gen_tensor *t, unsigned char *buf, uint64_t offset, uint64_t len)
{
    switch (t->part) {
    case P_QUANT_MAP:
    case P_NESTED_MAP:
    case P_NESTED_ABSMAX:
        for (uint64_t i = 0; i < len; i += 4) {
            uint64_t k = (offset + i) / 4;
            float v = t->part == P_QUANT_MAP      ? NF4_VALUES[k]
                      : t->part == P_NESTED_MAP ? -1.0f + 2.0f * (float)k / 255.0f
                                                : 0.02f + (float)(rng64() % 1000) * 1e-5f;
            memcpy(buf + i, &v, 4);
        }
        break;
    case P_STATE:
        memcpy(buf, t->state + offset, len);
        break;
    case P_PLAIN:
        for (uint64_t i = 0; i < len; i += 2) {
            uint16_t h = f32_to_bf16(((float)(rng64() % 20001) - 10000.0f) * 2e-6f);
            memcpy(buf + i, &h, 2);
        }
        break;
    default:
        for (uint64_t i = 0; i < len; i += 8) {
            uint64_t r = rng64();
            memcpy(buf + i, &r, len - i < 8 ? len - i : 8);
        }
        break;
    }
}

static int write_shard(const char *path, size_t shard)
{
    size_t n = 0;
    struct st_out_tensor *outs = calloc(ntensors, sizeof *outs);
    size_t *map = calloc(ntensors, sizeof *map);
    for (size_t i = 0; i < ntensors; i++)
        if (tensors[i].shard == shard) {
            outs[n] = (struct st_out_tensor){tensors[i].name, tensors[i].dtype, tensors[i].ndim, tensors[i].shape};
            map[n++] = i;
        }
    struct st_writer *w;
    int code = st_writer_begin(&w, path, outs, n, NULL, 0);
    enum { STEP = 1 << 24 };
    static unsigned char buf[STEP];
    for (size_t k = 0; k < n && code == NF4_OK; k++) {
        const struct gen_tensor *t = &tensors[map[st_writer_order(w, k)]];
        uint64_t total = bytes_of(t);
        for (uint64_t off = 0; off < total && code == NF4_OK; off += STEP) {
            uint64_t len = total - off < STEP ? total - off : STEP;
            fill(t, buf, off, len);
            code = st_writer_write(w, buf, (size_t)len);
        }
    }
    if (code == NF4_OK)
        code = st_writer_finish(w);
    else
        st_writer_abort(w);
    free(outs);
    free(map);
    return code;
}

/* ---- the LoRA adapter ---- */

struct lora_factor {
    char name[192];
    uint64_t shape[2];
};

static int write_adapter(const char *dir, const struct preset *p, uint64_t rank, int dora)
{
    static const char *const PROJ[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
    uint64_t kv = p->kv_heads * (p->hidden / p->heads);
    uint64_t out_f[7] = {p->hidden, kv, kv, p->hidden, p->intermediate, p->intermediate, p->hidden};
    uint64_t in_f[7] = {p->hidden, p->hidden, p->hidden, p->hidden, p->hidden, p->hidden, p->intermediate};
    const size_t per_module = dora ? 3 : 2; /* lora_A, lora_B, and DoRA's lora_magnitude_vector */
    size_t n = (size_t)p->layers * 7 * per_module;
    struct lora_factor *f = calloc(n ? n : 1, sizeof *f);
    struct st_out_tensor *outs = calloc(n ? n : 1, sizeof *outs);
    if (!f || !outs || mkdir(dir, 0777) != 0) {
        perror(dir);
        return 73;
    }
    uint64_t params = 0;
    for (uint64_t l = 0, i = 0; l < p->layers; l++)
        for (int k = 0; k < 7; k++, i += per_module) {
            snprintf(f[i].name, sizeof f[i].name, "base_model.model.model.layers.%" PRIu64 ".%s.lora_A.weight", l,
                     PROJ[k]);
            f[i].shape[0] = rank;
            f[i].shape[1] = in_f[k];
            snprintf(f[i + 1].name, sizeof f[i + 1].name, "base_model.model.model.layers.%" PRIu64 ".%s.lora_B.weight",
                     l, PROJ[k]);
            f[i + 1].shape[0] = out_f[k];
            f[i + 1].shape[1] = rank;
            params += rank * (in_f[k] + out_f[k]);
            if (dora) {
                snprintf(f[i + 2].name, sizeof f[i + 2].name,
                         "base_model.model.model.layers.%" PRIu64 ".%s.lora_magnitude_vector", l, PROJ[k]);
                f[i + 2].shape[0] = out_f[k];
                params += out_f[k];
            }
        }
    for (size_t i = 0; i < n; i++)
        outs[i] = (struct st_out_tensor){f[i].name, DT_F32, f[i].shape[1] ? 2u : 1u, f[i].shape};
    char *path = path_join(dir, "adapter_model.safetensors");
    struct st_writer *w;
    int code = st_writer_begin(&w, path, outs, n, NULL, 0);
    enum { STEP = 1 << 22 };
    static float buf[STEP];
    for (size_t k = 0; k < n && code == NF4_OK; k++) {
        const struct lora_factor *t = &f[st_writer_order(w, k)];
        int magnitude = t->shape[1] == 0;
        uint64_t total = t->shape[0] * (magnitude ? 1 : t->shape[1]);
        for (uint64_t off = 0; off < total && code == NF4_OK; off += STEP) {
            uint64_t len = total - off < STEP ? total - off : STEP;
            for (uint64_t i = 0; i < len; i++) /* about the size trained factors reach; magnitudes 0.5 to 1.5 */
                buf[i] = magnitude ? 0.5f + (float)(rng64() % 10001) * 1e-4f
                                   : ((float)(rng64() % 20001) - 10000.0f) * 2e-6f;
            code = st_writer_write(w, buf, (size_t)len * 4);
        }
    }
    code = code == NF4_OK ? st_writer_finish(w) : (st_writer_abort(w), code);
    free(path);
    if (code != NF4_OK) {
        fprintf(stderr, "gen_bnb4: %s\n", nf4_last_error());
        return 74;
    }
    char *config;
    int len = asprintf(&config,
                       "{\n  \"base_model_name_or_path\": null,\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n"
                       "  \"lora_alpha\": %" PRIu64 ",\n  \"lora_dropout\": 0.0,\n  \"modules_to_save\": null,\n"
                       "  \"peft_type\": \"LORA\",\n  \"r\": %" PRIu64 ",\n  \"rank_pattern\": {},\n"
                       "  \"alpha_pattern\": {},\n  \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", "
                       "\"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"],\n  \"task_type\": \"CAUSAL_LM\",\n"
                       "  \"use_dora\": %s,\n  \"use_rslora\": false\n}\n",
                       2 * rank, rank, dora ? "true" : "false");
    path = path_join(dir, "adapter_config.json");
    if (len < 0 || write_file_atomic(path, config, (size_t)len) != NF4_OK)
        return 74;
    printf("%s: %s adapter, r = %" PRIu64 ", %zu tensors, %" PRIu64 " parameters\n", dir, dora ? "DoRA" : "LoRA",
           rank, n, params);
    free(path);
    free(config);
    free(f);
    free(outs);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option LONG[] = {{"preset", required_argument, NULL, 'p'},
                                         {"layers", required_argument, NULL, 'l'},
                                         {"shard-size", required_argument, NULL, 's'},
                                         {"seed", required_argument, NULL, 'S'},
                                         {"lora-rank", required_argument, NULL, 'r'},
                                         {"dora", no_argument, NULL, 'd'},
                                         {NULL, 0, NULL, 0}};
    struct preset p = PRESETS[0];
    uint64_t shard_size = UINT64_C(5) << 30, seed = 1, lora_rank = 0;
    long layers = -1;
    int c, dora = 0;
    while ((c = getopt_long(argc, argv, "", LONG, NULL)) != -1) {
        if (c == 'p') {
            size_t i;
            for (i = 0; i < sizeof PRESETS / sizeof PRESETS[0] && strcmp(PRESETS[i].name, optarg); i++)
                ;
            if (i == sizeof PRESETS / sizeof PRESETS[0]) {
                fprintf(stderr, "gen_bnb4: unknown preset '%s'\n", optarg);
                return 2;
            }
            p = PRESETS[i];
        } else if (c == 'l') {
            layers = atol(optarg);
        } else if (c == 's') {
            if (!parse_size(optarg, &shard_size) || !shard_size)
                return 2;
        } else if (c == 'd') {
            dora = 1;
        } else if (c == 'S') {
            seed = strtoull(optarg, NULL, 10);
        } else if (c == 'r') {
            lora_rank = strtoull(optarg, NULL, 10);
            if (lora_rank < 1 || lora_rank > 65536) {
                fprintf(stderr, "gen_bnb4: --lora-rank must be 1 to 65536\n");
                return 2;
            }
        } else {
            return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: gen_bnb4 [--preset NAME] [--layers N] [--shard-size SIZE] [--seed N] [--lora-rank R] "
                        "[--dora] OUTDIR\n");
        return 2;
    }
    if (layers >= 0)
        p.layers = (uint64_t)layers;
    rng_state = seed * 0x9e3779b97f4a7c15ull | 1;
    const char *dir = argv[optind];
    if (mkdir(dir, 0777) != 0) {
        perror(dir);
        return 73;
    }
    uint64_t head_dim = p.hidden / p.heads, kv = p.kv_heads * head_dim;
    char name[160];
    add("model.embed_tokens.weight", P_PLAIN, DT_BF16, p.vocab, p.hidden, 2);
    for (uint64_t l = 0; l < p.layers; l++) {
        static const char *const ATTN[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
        for (int k = 0; k < 4; k++) {
            snprintf(name, sizeof name, "model.layers.%" PRIu64 ".self_attn.%s.weight", l, ATTN[k]);
            add_quantized(name, (k == 1 || k == 2) ? kv : p.hidden, p.hidden);
        }
        snprintf(name, sizeof name, "model.layers.%" PRIu64 ".mlp.gate_proj.weight", l);
        add_quantized(name, p.intermediate, p.hidden);
        snprintf(name, sizeof name, "model.layers.%" PRIu64 ".mlp.up_proj.weight", l);
        add_quantized(name, p.intermediate, p.hidden);
        snprintf(name, sizeof name, "model.layers.%" PRIu64 ".mlp.down_proj.weight", l);
        add_quantized(name, p.hidden, p.intermediate);
        snprintf(name, sizeof name, "model.layers.%" PRIu64 ".input_layernorm.weight", l);
        add(name, P_PLAIN, DT_BF16, p.hidden, 0, 1);
        snprintf(name, sizeof name, "model.layers.%" PRIu64 ".post_attention_layernorm.weight", l);
        add(name, P_PLAIN, DT_BF16, p.hidden, 0, 1);
    }
    add("model.norm.weight", P_PLAIN, DT_BF16, p.hidden, 0, 1);
    add("lm_head.weight", P_PLAIN, DT_BF16, p.vocab, p.hidden, 2);
    /* Shards fill in order, a weight's parts staying together as transformers keeps them. */
    size_t shard = 0;
    uint64_t in_shard = 0, total = 0, params = 0;
    for (size_t i = 0; i < ntensors; i++) {
        uint64_t b = bytes_of(&tensors[i]);
        if (tensors[i].part <= P_PACKED && in_shard > 0 && in_shard + b > shard_size) {
            shard++;
            in_shard = 0;
        }
        tensors[i].shard = shard;
        in_shard += b;
        total += b;
        if (tensors[i].part == P_PLAIN)
            params += b / 2;
        else if (tensors[i].part == P_PACKED)
            params += tensors[i].shape[0] * 2;
    }
    size_t nshards = shard + 1;
    char **files = calloc(nshards, sizeof *files);
    for (size_t s = 0; s < nshards; s++) {
        if (nshards == 1)
            files[s] = strdup("model.safetensors");
        else if (asprintf(&files[s], "model-%05zu-of-%05zu.safetensors", s + 1, nshards) < 0)
            return 70;
        char *path = path_join(dir, files[s]);
        if (write_shard(path, s) != NF4_OK) {
            fprintf(stderr, "gen_bnb4: %s\n", nf4_last_error());
            return 74;
        }
        free(path);
    }
    if (nshards > 1) {
        struct index_out_entry *e = calloc(ntensors, sizeof *e);
        for (size_t i = 0; i < ntensors; i++)
            e[i] = (struct index_out_entry){tensors[i].name, files[tensors[i].shard]};
        for (size_t i = 1; i < ntensors; i++) /* insertion sort: index entries must be sorted */
            for (size_t k = i; k > 0 && strcmp(e[k - 1].tensor, e[k].tensor) > 0; k--) {
                struct index_out_entry t = e[k];
                e[k] = e[k - 1];
                e[k - 1] = t;
            }
        char *text, *path = path_join(dir, "model.safetensors.index.json");
        size_t len;
        if (index_render(path, "{\"total_parameters\": 0}", total, params, e, ntensors, &text, &len) != NF4_OK ||
            write_file_atomic(path, text, len) != NF4_OK) {
            fprintf(stderr, "gen_bnb4: %s\n", nf4_last_error());
            return 74;
        }
        free(text);
        free(path);
        free(e);
    }
    char *config, *path = path_join(dir, "config.json");
    int len = asprintf(&config,
                       "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"dtype\": \"bfloat16\",\n"
                       "  \"hidden_size\": %" PRIu64 ",\n  \"intermediate_size\": %" PRIu64 ",\n"
                       "  \"model_type\": \"llama\",\n  \"num_attention_heads\": %" PRIu64 ",\n"
                       "  \"num_hidden_layers\": %" PRIu64 ",\n  \"num_key_value_heads\": %" PRIu64 ",\n"
                       "  \"quantization_config\": {\n    \"bnb_4bit_compute_dtype\": \"bfloat16\",\n"
                       "    \"bnb_4bit_quant_type\": \"nf4\",\n    \"bnb_4bit_use_double_quant\": true,\n"
                       "    \"load_in_4bit\": true,\n    \"quant_method\": \"bitsandbytes\"\n  },\n"
                       "  \"vocab_size\": %" PRIu64 "\n}\n",
                       p.hidden, p.intermediate, p.heads, p.layers, p.kv_heads, p.vocab);
    if (len < 0 || write_file_atomic(path, config, (size_t)len) != NF4_OK)
        return 74;
    printf("%s: %s, %" PRIu64 " layers, %" PRIu64 " parameters, %" PRIu64 " bytes in %zu shard%s\n", dir, p.name,
           p.layers, params, total, nshards, nshards == 1 ? "" : "s");
    if (lora_rank) {
        char *adapter_dir;
        if (asprintf(&adapter_dir, "%s-lora", dir) < 0)
            return 70;
        int rc = write_adapter(adapter_dir, &p, lora_rank, dora);
        free(adapter_dir);
        return rc;
    }
    return 0;
}
