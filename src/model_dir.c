#include "model_dir.h"

#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bnb_state.h"
#include "fileio.h"
#include "json_text.h"
#include "json_util.h"
#include "model.h"
#include "status.h"
#include "strbuf.h"
#include "strutil.h"

#define TIE_KEY "tie_word_embeddings"

#define VOCAB_KEY "vocab_size"

#define IN_CHANNELS_KEY "in_channels"
#define OUT_CHANNELS_KEY "out_channels"

/* Whether member m's value is JSON's null. */
static int is_null(const char *json, const struct json_member *m)
{
    return m->value_end - m->value_start == 4 && memcmp(json + m->value_start, "null", 4) == 0;
}

/* An object of config.json (json[start, end)): text_config, with, for
 * `untie`, its TIE_KEY set to false, or added as false after its last
 * member (the text model's config class may default to tied, and readers
 * that go by the text config, transformers 4's get_text_config, would tie
 * the head again), and with `vocab` (the number's text), its VOCAB_KEY set
 * where it has one, as transformers' resize_token_embeddings sets the text
 * config's (*vocab_set then 1); and with `dtype` (quoted), where the object
 * is a part's config (it names a model_type), each "dtype" or "torch_dtype"
 * string in it set to that, and so in the configs inside it, as transformers
 * saves a composite model cast to one dtype. Other objects (rope_scaling,
 * task_specific_params) keep theirs. */
static int put_part_config(struct strbuf *b, const char *json, size_t start, size_t end, int untie, const char *vocab,
                           const char *dtype, int *vocab_set)
{
    size_t count;
    struct json_member *mem = json_scan_members(json, start, end, &count);
    if (!mem)
        return -1;
    int is_config = 0;
    for (size_t k = 0; k < count; k++)
        is_config |= json_member_key_is(json, &mem[k], "model_type");
    const char *own_dtype = is_config ? dtype : NULL;
    size_t at = start;
    int tie_set = 0;
    for (size_t k = 0; k < count; k++) {
        const struct json_member *m = &mem[k];
        if (dtype && json[m->value_start] == '{') { /* a config inside it (Qwen2.5-Omni's thinker_config) */
            strbuf_put(b, json + at, m->value_start - at);
            if (put_part_config(b, json, m->value_start, m->value_end, 0, NULL, dtype, vocab_set) != 0) {
                free(mem);
                return -1;
            }
            at = m->value_end;
            continue;
        }
        const char *value = NULL;
        if (untie && json_member_key_is(json, m, TIE_KEY)) {
            value = "false";
            tie_set = 1;
        } else if (vocab && json_member_key_is(json, m, VOCAB_KEY)) {
            value = vocab;
            *vocab_set = 1;
        } else if (own_dtype && json[m->value_start] == '"' &&
                   (json_member_key_is(json, m, "dtype") || json_member_key_is(json, m, "torch_dtype"))) {
            value = own_dtype;
        }
        if (!value)
            continue;
        strbuf_put(b, json + at, m->value_start - at);
        strbuf_puts(b, value);
        at = m->value_end;
    }
    if (untie && !tie_set) { /* after the last member, or inside an empty object */
        size_t after = count ? mem[count - 1].value_end : start + 1;
        strbuf_put(b, json + at, after - at);
        if (count >= 2) { /* the object's own separator */
            strbuf_put(b, json + mem[0].value_end, mem[1].key_start - mem[0].value_end);
        } else if (count == 1) { /* a comma and the space before the first key */
            strbuf_puts(b, mem[0].key_start > start + 1 ? "," : ", ");
            strbuf_put(b, json + start + 1, mem[0].key_start - (start + 1));
        }
        strbuf_puts(b, "\"" TIE_KEY "\": false");
        at = after;
    }
    strbuf_put(b, json + at, end - at);
    free(mem);
    return 0;
}

int config_rewrite(const char *path, const char *json, size_t len, const struct config_changes *ch, char **out,
                   size_t *out_len)
{
    const char *dtype_name = ch->dtype_name;
    const int untie = ch->untie;
    char vocab[24] = "", in_channels[24] = "", out_channels[24] = "";
    if (ch->vocab_size)
        snprintf(vocab, sizeof vocab, "%" PRIu64, ch->vocab_size);
    if (ch->in_channels) {
        snprintf(in_channels, sizeof in_channels, "%" PRIu64, ch->in_channels);
        snprintf(out_channels, sizeof out_channels, "%" PRIu64, ch->base_in_channels);
    }
    cJSON *root = json_parse_whole(json, len);
    int is_object = cJSON_IsObject(root);
    cJSON_Delete(root);
    if (!root && json_ran_out_of_memory())
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory parsing it");
    if (!is_object)
        return nf4_fail(NF4_EDATA, path, NULL, "not a JSON object");
    size_t open = json_text_skip_ws(json, 0, len), count;
    struct json_member *mem = json_scan_members(json, open, len, &count);
    if (!mem)
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    /* diffusers reads no dtype from a config; its keys stay as they are. */
    for (size_t k = 0; k < count && dtype_name; k++)
        if (json_member_key_is(json, &mem[k], "_diffusers_version"))
            dtype_name = NULL;
    struct strbuf b = {0};
    char quoted[64] = "";
    if (dtype_name)
        snprintf(quoted, sizeof quoted, "\"%s\"", dtype_name);
    int have_dtype = 0, have_torch_dtype = 0, have_tie = 0, have_vocab = 0, have_in = 0, have_out = 0, written = 0;
    /* The text between the first two members is the file's own separator. */
    const char *sep = ",\n  ";
    size_t sep_len = strlen(sep);
    if (count >= 2) {
        sep = json + mem[0].value_end;
        sep_len = mem[1].key_start - mem[0].value_end;
    }
    strbuf_put(&b, json, count ? mem[0].key_start : open + 1);
    for (size_t k = 0; k < count; k++) {
        const struct json_member *m = &mem[k];
        if (json_member_key_is(json, m, "quantization_config"))
            continue;
        if (written++)
            strbuf_put(&b, sep, sep_len);
        const char *value = NULL; /* a new value for this member */
        if (dtype_name && (json_member_key_is(json, m, "dtype") || json_member_key_is(json, m, "torch_dtype")))
            value = quoted;
        else if (untie && json_member_key_is(json, m, TIE_KEY))
            value = "false";
        else if (ch->vocab_size && json_member_key_is(json, m, VOCAB_KEY))
            value = vocab;
        else if (ch->in_channels && json_member_key_is(json, m, IN_CHANNELS_KEY))
            value = in_channels;
        else if (ch->in_channels && json_member_key_is(json, m, OUT_CHANNELS_KEY) && is_null(json, m))
            value = out_channels;
        have_in |= json_member_key_is(json, m, IN_CHANNELS_KEY);
        have_out |= json_member_key_is(json, m, OUT_CHANNELS_KEY);
        have_dtype |= json_member_key_is(json, m, "dtype");
        have_torch_dtype |= json_member_key_is(json, m, "torch_dtype");
        have_tie |= json_member_key_is(json, m, TIE_KEY);
        have_vocab |= json_member_key_is(json, m, VOCAB_KEY);
        const int text = json_member_key_is(json, m, "text_config");
        if (json[m->value_start] == '{' && ((text && (untie || ch->vocab_size)) || (dtype_name && ch->every_tensor))) {
            /* A multimodal model's text model may say them too, and each part its dtype. */
            strbuf_put(&b, json + m->key_start, m->value_start - m->key_start);
            if (put_part_config(&b, json, m->value_start, m->value_end, text && untie,
                                text && ch->vocab_size ? vocab : NULL, dtype_name && ch->every_tensor ? quoted : NULL,
                                &have_vocab) != 0)
                b.oom = 1;
            continue;
        }
        strbuf_put(&b, json + m->key_start, (value ? m->value_start : m->value_end) - m->key_start);
        if (value)
            strbuf_puts(&b, value);
    }
    /* Keys to add, with their values: what was not there to set. */
    const char *added[6][2] = {{"dtype", quoted},         {"torch_dtype", quoted},
                               {TIE_KEY, "false"},        {VOCAB_KEY, vocab},
                               {IN_CHANNELS_KEY, in_channels}, {OUT_CHANNELS_KEY, out_channels}};
    int add[6] = {dtype_name && !have_dtype, dtype_name && !have_torch_dtype, untie && !have_tie,
                  ch->vocab_size && !have_vocab, ch->in_channels && !have_in, ch->in_channels && !have_out};
    for (int k = 0; k < 6; k++) {
        if (!add[k])
            continue;
        if (written++)
            strbuf_put(&b, sep, sep_len);
        else if (count == 0)
            strbuf_puts(&b, "\n  ");
        strbuf_puts(&b, "\"");
        strbuf_puts(&b, added[k][0]);
        strbuf_puts(&b, "\": ");
        strbuf_puts(&b, added[k][1]);
    }
    size_t tail = count ? mem[count - 1].value_end : open + 1;
    if (count == 0 && written)
        strbuf_puts(&b, "\n");
    strbuf_put(&b, json + tail, len - tail);
    free(mem);
    if (b.oom) {
        free(b.p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    *out = b.p;
    *out_len = b.len;
    return NF4_OK;
}

int index_render(const char *path, const char *metadata_json, uint64_t total_size, uint64_t total_parameters,
                 const struct index_out_entry *entries, size_t n, char **out, size_t *out_len)
{
    struct strbuf b = {0};
    char num[32];
    cJSON *meta = NULL;
    /* metadata_json was printed by cJSON from a valid document: only memory can fail here. */
    if (metadata_json && !(meta = cJSON_Parse(metadata_json)))
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    int have_params = meta && cJSON_GetObjectItemCaseSensitive(meta, "total_parameters");
    strbuf_puts(&b, "{\n  \"metadata\": {");
    int first = 1;
    if (have_params) {
        snprintf(num, sizeof num, "%" PRIu64, total_parameters);
        strbuf_puts(&b, "\n    \"total_parameters\": ");
        strbuf_puts(&b, num);
        first = 0;
    }
    snprintf(num, sizeof num, "%" PRIu64, total_size);
    strbuf_puts(&b, first ? "\n    \"total_size\": " : ",\n    \"total_size\": ");
    strbuf_puts(&b, num);
    for (const cJSON *c = meta ? meta->child : NULL; c; c = c->next) {
        if (strcmp(c->string, "total_size") == 0 || strcmp(c->string, "total_parameters") == 0)
            continue;
        char *value = cJSON_PrintUnformatted(c);
        if (!value) {
            b.oom = 1;
            break;
        }
        strbuf_puts(&b, ",\n    ");
        strbuf_json_string(&b, c->string);
        strbuf_puts(&b, ": ");
        strbuf_puts(&b, value);
        free(value);
    }
    cJSON_Delete(meta);
    strbuf_puts(&b, "\n  },\n  \"weight_map\": {");
    for (size_t i = 0; i < n; i++) {
        strbuf_puts(&b, i ? ",\n    " : "\n    ");
        strbuf_json_string(&b, entries[i].tensor);
        strbuf_puts(&b, ": ");
        strbuf_json_string(&b, entries[i].file);
    }
    strbuf_puts(&b, "\n  }\n}\n");
    if (b.oom) {
        free(b.p);
        return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    }
    *out = b.p;
    *out_len = b.len;
    return NF4_OK;
}

/* The objects of config.json nf4deq reads keys of: the top level, and the
 * parts of a composite model. */
static const char *const CONFIG_PARTS_READ[] = {"text_config", "encoder", "decoder"};

/* A key twice in an object nf4deq reads: Python's json (transformers) keeps
 * the last copy and cJSON the first, so the two would read another model. */
static int check_config_keys_once(const char *path, const cJSON *root)
{
    const cJSON *objects[1 + sizeof CONFIG_PARTS_READ / sizeof *CONFIG_PARTS_READ] = {root};
    for (size_t i = 0; i < sizeof CONFIG_PARTS_READ / sizeof *CONFIG_PARTS_READ; i++)
        objects[i + 1] = cJSON_GetObjectItemCaseSensitive(root, CONFIG_PARTS_READ[i]);
    for (size_t i = 0; i < sizeof objects / sizeof *objects; i++) {
        const char *dup = NULL;
        const int twice = cJSON_IsObject(objects[i]) ? json_first_duplicate_key(objects[i], &dup) : 0;
        if (twice < 0)
            return nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
        if (twice > 0)
            return nf4_fail(NF4_EDATA, path, NULL, "has \"%s\"%s%s twice, which transformers reads as the last and "
                            "nf4deq would not", dup, i ? " in " : "", i ? CONFIG_PARTS_READ[i - 1] : "");
    }
    return NF4_OK;
}

struct model_config {
    int read;    /* read_config ran: what it found stays, and so does its failure */
    int code;    /* what it returned */
    char *text;  /* the file's bytes, NUL-terminated; NULL where there is none */
    size_t len;
    cJSON *root; /* text parsed; NULL where there is none or it is not JSON
                  * (config_rewrite says so when the output's is written) */
};

struct model_config *model_config_new(void)
{
    return calloc(1, sizeof(struct model_config));
}

void model_config_free(struct model_config *c)
{
    if (!c)
        return;
    cJSON_Delete(c->root);
    free(c->text);
    free(c);
}

/* Reads m's config.json into m->config. A model directory's is its own, so
 * anything by that name is read, and a directory or a FIFO there is refused
 * before any shard is written (an output without it would load as another
 * model); a single file's is only a neighbour, taken where it is a regular
 * file. A failed read is the error, and so is memory running out while it
 * is parsed: what config.json says decides what is written (gpt-oss's
 * experts fused, expert_layout.h), so it is never taken for absent. */
static int read_config(const struct model *m, struct model_config *c)
{
    const char *shown = m->dir ? m->dir : m->file_names[0]; /* as the user named the model */
    char *dir = m->dir ? strdup(m->dir) : path_dirname(m->file_names[0]);
    char *path = dir ? path_join(dir, CONFIG_FILE_NAME) : NULL;
    free(dir);
    if (!path)
        return nf4_fail(NF4_ESOFTWARE, shown, NULL, "out of memory");
    int code = NF4_OK;
    struct stat st;
    if (stat(path, &st) == 0 && (m->dir || S_ISREG(st.st_mode)) &&
        (code = read_small_file(path, MAX_JSON_FILE_BYTES, &c->text, &c->len)) == NF4_OK &&
        !(c->root = json_parse_whole(c->text, c->len)) && json_ran_out_of_memory())
        code = nf4_fail(NF4_ESOFTWARE, path, NULL, "out of memory");
    if (code == NF4_OK && c->root)
        code = check_config_keys_once(path, c->root);
    free(path);
    return code;
}

/* *root: m's config.json parsed (NULL where there is none, or it is not
 * JSON), read the first time it is asked for. */
static int model_config(const struct model *m, const cJSON **root)
{
    struct model_config *c = m->config;
    if (!c->read) {
        c->code = read_config(m, c);
        c->read = 1;
    }
    *root = c->code == NF4_OK ? c->root : NULL;
    return c->code;
}

int model_config_text(const struct model *m, const char **text, size_t *len)
{
    const cJSON *root;
    int code = model_config(m, &root);
    *text = code == NF4_OK ? m->config->text : NULL;
    *len = code == NF4_OK ? m->config->len : 0;
    return code;
}

/* *out: obj's string "model_type" (allocated), or NULL. */
static int copy_model_type(const cJSON *obj, const char *shown, char **out)
{
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "model_type");
    if (cJSON_IsString(type) && !(*out = strdup(type->valuestring)))
        return nf4_fail(NF4_ESOFTWARE, shown, NULL, "out of memory");
    return NF4_OK;
}

/* *out: the "model_type" of m's config.json (in its directory or beside its
 * single file), of its object `part` where part is not NULL; and, with
 * text_out, of its "text_config". Each allocated, or NULL where there is none. */
static int read_model_types(const struct model *m, const char *part, char **out, char **text_out)
{
    const cJSON *root;
    int code = model_config(m, &root);
    const char *shown = m->dir ? m->dir : m->file_names[0];
    if (code == NF4_OK)
        code = copy_model_type(part ? cJSON_GetObjectItemCaseSensitive(root, part) : root, shown, out);
    if (code == NF4_OK && text_out)
        code = copy_model_type(cJSON_GetObjectItemCaseSensitive(root, "text_config"), shown, text_out);
    return code;
}

int model_config_type(const struct model *m, char **model_type, char **text_model_type)
{
    *model_type = *text_model_type = NULL;
    return read_model_types(m, NULL, model_type, text_model_type);
}

int model_config_part_type(const struct model *m, const char *part, char **model_type)
{
    *model_type = NULL;
    return read_model_types(m, part, model_type, NULL);
}

/* ---- tied embeddings ---- */

/* The input embeddings a language model's head (TIED_HEAD_NAME) is tied to:
 * the sources of "lm_head.weight" in transformers 5.24's _tied_weights_keys,
 * for 261 of the 265 classes that tie it (left out: three masked LMs, and
 * Pix2Struct's unprefixed "embed_tokens.weight", which a headless model
 * stores too). Where a model stores two (BART's
 * model.shared and its decoder's embed_tokens, when saved), the one
 * transformers ties the head to comes first. A headless *Model saves
 * "embed_tokens.weight" or "wte.weight", with no prefix: no head, so nothing
 * is tied to it (but for T5's "shared.weight": SHARED_AT_TOP). */
static const char *const TIED_EMBEDDINGS[] = {
    "model.embed_tokens.weight",                /* Llama, Qwen, Gemma, Mistral, ... (120 classes) */
    "model.language_model.embed_tokens.weight", /* multimodal *ForConditionalGeneration (72) */
    "language_model.model.embed_tokens.weight", /* the same as transformers saves llava's forms (saved_names.h) */
    "shared.weight",                            /* T5, mT5, UMT5, LongT5, Switch (16): see SHARED_AT_TOP */
    "model.shared.weight",                      /* BART, mBART, Pegasus, Marian, Blenderbot (11) */
    "model.decoder.embed_tokens.weight",        /* OPT, *ForCausalLM of encoder-decoders (14) */
    "transformer.wte.weight",                   /* GPT-2, GPT-BigCode, CodeGen (9) */
    "model.text_model.embed_tokens.weight",     /* Idefics 2/3, Emu3 (6) */
    "backbone.embeddings.weight",               /* Mamba, Mamba 2, FalconMamba */
    "transformer.word_embeddings.weight",       /* BLOOM, Falcon */
    "model.language_model.shared.weight",       /* Florence-2 */
    "led.shared.weight",                        /* LED */
    "prophetnet.word_embeddings.weight",        /* ProphetNet */
    "gpt_neox.embed_in.weight",                 /* GPT-NeoX */
    "transformer.tokens_embed.weight",          /* OpenAI GPT */
    "transformer.w.weight",                     /* CTRL */
    "model.embed_tokens.embed_tokens.weight",   /* Kyutai speech-to-text */
};

/* Embeddings that an encoder-decoder's tie_word_embeddings ties its encoder's
 * and decoder's input embeddings to as well as its head (and that in the T5
 * family says whether the decoder's output is scaled): the flag cannot say
 * false for the head alone. */
static const char *const SHARED_EMBEDDINGS[] = {
    "shared.weight", "model.shared.weight", "led.shared.weight", "model.language_model.shared.weight",
    "prophetnet.word_embeddings.weight",
};

int model_tie_flag_ties_more(const char *embedding)
{
    for (size_t i = 0; i < sizeof SHARED_EMBEDDINGS / sizeof *SHARED_EMBEDDINGS; i++)
        if (strcmp(embedding, SHARED_EMBEDDINGS[i]) == 0)
            return 1;
    return 0;
}

uint64_t model_embedding_rows(const struct model *m)
{
    for (size_t i = 0; i < sizeof TIED_EMBEDDINGS / sizeof *TIED_EMBEDDINGS; i++) {
        const struct model_tensor *t = model_find(m, TIED_EMBEDDINGS[i]);
        if (t && t->t->ndim == 2)
            return t->t->shape[0];
    }
    return 0;
}

/* The head as transformers saves llava's forms (saved_names.h). */
#define SAVED_HEAD_NAME "language_model.lm_head.weight"

/* The top-level "shared.weight" is what T5's *ForConditionalGeneration (and
 * every SeamlessM4T class) ties its head to, and what the headless
 * T5EncoderModel (a pipeline's T5 text encoder), T5Model, BartModel, ...
 * store too: tied to a head only where config.json's "architectures" names
 * one of those. */
#define SHARED_AT_TOP "shared.weight"

static int architectures_have_head(const cJSON *root)
{
    const cJSON *arch;
    cJSON_ArrayForEach(arch, cJSON_GetObjectItemCaseSensitive(root, "architectures"))
        if (cJSON_IsString(arch) && (str_ends_with(arch->valuestring, "ForConditionalGeneration") ||
                                     strncmp(arch->valuestring, "SeamlessM4T", 11) == 0))
            return 1;
    return 0;
}

/* A class that stores the embedding but no language-model head: a
 * classifier's (LlamaForSequenceClassification has model.embed_tokens and a
 * score head). A name ending in Model says nothing: MarianMTModel and
 * GPT2LMHeadModel have heads, and a bare *Model stores its embedding with
 * no prefix TIED_EMBEDDINGS knows (but for T5's: SHARED_AT_TOP). */
static int class_has_no_lm_head(const char *cls)
{
    static const char *const HEADLESS[] = {"ForSequenceClassification", "ForTokenClassification",
                                           "ForQuestionAnswering", "ForMultipleChoice"};
    for (size_t i = 0; i < sizeof HEADLESS / sizeof *HEADLESS; i++)
        if (str_ends_with(cls, HEADLESS[i]))
            return 1;
    return 0;
}

/* 1 where config.json's "architectures" names classes and none has a head. */
static int architectures_are_headless(const cJSON *root)
{
    const cJSON *arch, *list = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    int named = 0;
    cJSON_ArrayForEach(arch, list) {
        if (!cJSON_IsString(arch) || !class_has_no_lm_head(arch->valuestring))
            return 0;
        named = 1;
    }
    return named;
}

int model_tied_embedding(const struct model *m, const char **embedding)
{
    *embedding = NULL;
    if (model_find(m, TIED_HEAD_NAME) || model_find(m, SAVED_HEAD_NAME))
        return NF4_OK; /* a model with its own head has nothing tied to it */
    const char *found = NULL;
    for (size_t i = 0; i < sizeof TIED_EMBEDDINGS / sizeof *TIED_EMBEDDINGS && !found; i++)
        if (model_find(m, TIED_EMBEDDINGS[i]))
            found = TIED_EMBEDDINGS[i];
    if (!found)
        return NF4_OK;
    /* Stored without its head, a causal LM loads only with the head tied to
     * the embedding, whatever config.json leaves out (transformers writes only
     * what differs from the architecture's default): only an explicit false,
     * at the top or in text_config, says otherwise. A single file's config is
     * the one beside it. */
    const cJSON *root;
    int code = model_config(m, &root);
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(root, TIE_KEY);
    if (!cJSON_IsBool(tie))
        tie = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "text_config"), TIE_KEY);
    if (!cJSON_IsFalse(tie) && !architectures_are_headless(root) &&
        (strcmp(found, SHARED_AT_TOP) != 0 || architectures_have_head(root)))
        *embedding = found;
    return code;
}
