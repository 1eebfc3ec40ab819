/* The non-tensor side of a model directory: config.json rewriting, the index
 * file's parsing and rendering, and a sharded model whose index and shards
 * disagree; and a pipeline's model_index.json made a control pipeline's. */
#include <cJSON.h>

#include "control_index.h"
#include "model.h"
#include "model_dir.h"
#include "test_util.h"

#define FIXTURE_CONFIG FIXTURES "/tiny-llama-bf16-bnb4/config.json"
#define FIXTURE_SHARDED FIXTURES "/tiny-llama-bf16-bnb4-sharded"

/* ---- model_tied_embedding ---- */

/* A model directory holding tensor `name` (F16 [4, 2]), and `head` where it
 * is not NULL, and config.json `config`. */
static const char *tied_name_of(const char *dir, const char *name, const char *head, const char *config)
{
    tu_sh("rm -rf %s && mkdir %s", dir, dir);
    char *header = head ? tu_strdupf("{\"%s\":{\"dtype\":\"F16\",\"shape\":[4,2],\"data_offsets\":[0,16]},"
                                     "\"%s\":{\"dtype\":\"F16\",\"shape\":[4,2],\"data_offsets\":[16,32]}}",
                                     name, head)
                        : tu_strdupf("{\"%s\":{\"dtype\":\"F16\",\"shape\":[4,2],\"data_offsets\":[0,16]}}", name);
    char *weights = tu_strdupf("%s/model.safetensors", dir), *cfg = tu_strdupf("%s/config.json", dir);
    static const unsigned char zeros[32];
    tu_write_safetensors_raw(weights, header, strlen(header), zeros, head ? 32 : 16);
    tu_write_file(cfg, config, strlen(config));
    struct model *m;
    assert_int_equal(model_open_dir(dir, &m), NF4_OK);
    const char *embedding = NULL;
    assert_int_equal(model_tied_embedding(m, &embedding), NF4_OK);
    model_close(m); /* the names are the table's, not the model's */
    free(header);
    free(weights);
    free(cfg);
    return embedding;
}

/* The embeddings transformers ties lm_head to, under each name; the top-level
 * shared.weight only under a *ForConditionalGeneration (T5EncoderModel, a
 * pipeline's T5 text encoder, stores it with no head); none under a class
 * with no language-model head; an explicit false unties. */
static void test_tied_embedding_names(void **state)
{
    struct tu_scratch *s = *state;
    char *dir = tu_strdupf("%s/m", s->dir);
    static const struct {
        const char *name, *config, *tied; /* tied: NULL where nothing is tied */
    } CASES[] = {
        {"model.embed_tokens.weight", "{}", "model.embed_tokens.weight"},
        {"transformer.wte.weight", "{\"model_type\": \"gpt2\"}", "transformer.wte.weight"},
        {"model.decoder.embed_tokens.weight", "{\"model_type\": \"opt\"}", "model.decoder.embed_tokens.weight"},
        {"model.shared.weight", "{\"architectures\": [\"BartForConditionalGeneration\"]}", "model.shared.weight"},
        {"shared.weight", "{\"architectures\": [\"T5ForConditionalGeneration\"]}", "shared.weight"},
        {"shared.weight", "{\"architectures\": [\"T5EncoderModel\"]}", NULL},
        {"shared.weight", "{\"architectures\": [\"BartModel\"]}", NULL},
        {"shared.weight", "{}", NULL},
        {"backbone.embeddings.weight", "{\"model_type\": \"mamba\"}", "backbone.embeddings.weight"},
        {"transformer.wte.weight", "{\"tie_word_embeddings\": false}", NULL},
        {"wte.weight", "{\"model_type\": \"gpt2\"}", NULL}, /* the headless GPT2Model */
        {"transformer.wte.weight", "{\"architectures\": [\"GPT2LMHeadModel\"]}", "transformer.wte.weight"},
        {"transformer.wte.weight", "{\"architectures\": [\"GPT2DoubleHeadsModel\"]}", "transformer.wte.weight"},
        {"model.embed_tokens.weight", "{\"architectures\": [\"LlamaForCausalLM\"]}", "model.embed_tokens.weight"},
        /* a classifier stores the embedding and a score head, no lm_head */
        {"model.embed_tokens.weight", "{\"architectures\": [\"LlamaForSequenceClassification\"]}", NULL},
        {"transformer.wte.weight", "{\"architectures\": [\"GPT2ForTokenClassification\"]}", NULL},
        {"model.shared.weight", "{\"architectures\": [\"BartForQuestionAnswering\"]}", NULL},
        /* a head under a name that ends in Model */
        {"model.shared.weight", "{\"architectures\": [\"MarianMTModel\"]}", "model.shared.weight"},
        {"shared.weight", "{\"architectures\": [\"SeamlessM4TForTextToText\"]}", "shared.weight"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        const char *got = tied_name_of(dir, CASES[i].name, NULL, CASES[i].config);
        if (CASES[i].tied ? !got || strcmp(got, CASES[i].tied) != 0 : got != NULL)
            fail_msg("%s with config %s: tied to %s, expected %s", CASES[i].name, CASES[i].config,
                     got ? got : "nothing", CASES[i].tied ? CASES[i].tied : "nothing");
    }
    /* llava's forms as transformers saves them: the embedding under
     * language_model.model, tied where no language_model.lm_head is stored. */
    const char *legacy = "language_model.model.embed_tokens.weight";
    const char *got = tied_name_of(dir, legacy, NULL, "{\"architectures\": [\"Gemma3ForConditionalGeneration\"]}");
    if (!got || strcmp(got, legacy) != 0)
        fail_msg("a Gemma 3 saved without its head: tied to %s", got ? got : "nothing");
    got = tied_name_of(dir, legacy, "language_model.lm_head.weight", "{}");
    if (got)
        fail_msg("a LLaVA saved with its head: tied to %s", got);
    free(dir);
}

/* ---- config_rewrite ---- */

static char *rewrite_with(const char *json, const char *dtype, int untie, uint64_t vocab)
{
    char *out = NULL;
    size_t len = 0;
    nf4_clear_error();
    struct config_changes ch = {.dtype_name = dtype, .untie = untie, .vocab_size = vocab};
    int code = config_rewrite("config.json", json, strlen(json), &ch, &out, &len);
    if (code != NF4_OK)
        fail_msg("config_rewrite(%s) = %d: %s", json, code, nf4_last_error());
    assert_int_equal(strlen(out), len);
    return out;
}

static char *rewrite(const char *json, const char *dtype)
{
    return rewrite_with(json, dtype, 0, 0);
}

static void expect_rewrite_with(const char *json, const char *dtype, int untie, uint64_t vocab, const char *want)
{
    char *got = rewrite_with(json, dtype, untie, vocab);
    if (strcmp(got, want) != 0)
        fail_msg("config_rewrite(%s, %s%s, vocab %llu)\n  got:  [%s]\n  want: [%s]", json, dtype ? dtype : "NULL",
                 untie ? ", untie" : "", (unsigned long long)vocab, got, want);
    free(got);
}

static void expect_rewrite(const char *json, const char *dtype, const char *want)
{
    expect_rewrite_with(json, dtype, 0, 0, want);
}

static void test_rewrite_drops_quantization_config_wherever_it_is(void **state)
{
    (void)state;
    expect_rewrite("{\"quantization_config\": {\"a\": 1}, \"b\": 2, \"c\": 3}", NULL, "{\"b\": 2, \"c\": 3}");
    expect_rewrite("{\"a\": 1, \"quantization_config\": {\"x\": [1, {\"y\": \"}\"}]}, \"c\": 3}", NULL,
                   "{\"a\": 1, \"c\": 3}");
    expect_rewrite("{\"a\": 1, \"b\": 2, \"quantization_config\": {}}", NULL, "{\"a\": 1, \"b\": 2}");
    expect_rewrite("{\n  \"a\": 1,\n  \"quantization_config\": {\n    \"q\": true\n  }\n}\n", NULL,
                   "{\n  \"a\": 1\n}\n");
    expect_rewrite("{\"quantization_config\": {\"a\": 1}}", NULL, "{}");
}

static void test_rewrite_sets_existing_dtype_keys(void **state)
{
    (void)state;
    expect_rewrite("{\"torch_dtype\": \"bfloat16\", \"a\": 1, \"dtype\": \"bfloat16\"}", "float16",
                   "{\"torch_dtype\": \"float16\", \"a\": 1, \"dtype\": \"float16\"}");
    expect_rewrite("{\"dtype\": null, \"torch_dtype\": \"float32\"}", "bfloat16",
                   "{\"dtype\": \"bfloat16\", \"torch_dtype\": \"bfloat16\"}");
}

static void test_rewrite_adds_missing_dtype_keys(void **state)
{
    (void)state;
    expect_rewrite("{\"a\": 1, \"b\": 2}", "float16",
                   "{\"a\": 1, \"b\": 2, \"dtype\": \"float16\", \"torch_dtype\": \"float16\"}");
    expect_rewrite("{\"torch_dtype\": \"bfloat16\", \"b\": 2}", "float32",
                   "{\"torch_dtype\": \"float32\", \"b\": 2, \"dtype\": \"float32\"}");
    /* With one member there is no separator to copy; any valid JSON will do. */
    char *out = rewrite("{\"a\": 1}", "float16");
    cJSON *j = cJSON_Parse(out);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "dtype")->valuestring, "float16");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "torch_dtype")->valuestring, "float16");
    assert_int_equal(cJSON_GetObjectItemCaseSensitive(j, "a")->valueint, 1);
    cJSON_Delete(j);
    free(out);
}

static void test_rewrite_of_compact_one_line_json(void **state)
{
    (void)state;
    expect_rewrite("{\"a\":1,\"quantization_config\":{\"b\":2},\"dtype\":\"bfloat16\"}", "float16",
                   "{\"a\":1,\"dtype\":\"float16\",\"torch_dtype\": \"float16\"}");
}

static void test_rewrite_of_empty_object(void **state)
{
    (void)state;
    expect_rewrite("{}", NULL, "{}");
    expect_rewrite("  {  }  \n", NULL, "  {  }  \n");
    char *out = rewrite("{}", "bfloat16");
    cJSON *j = cJSON_Parse(out);
    if (!j)
        fail_msg("not JSON: [%s]", out);
    assert_int_equal(cJSON_GetArraySize(j), 2);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "dtype")->valuestring, "bfloat16");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "torch_dtype")->valuestring, "bfloat16");
    cJSON_Delete(j);
    free(out);
}

static void test_rewrite_without_dtype_leaves_dtype_alone(void **state)
{
    (void)state;
    expect_rewrite("{\"dtype\": \"bfloat16\", \"quantization_config\": {}, \"torch_dtype\": \"bfloat16\"}", NULL,
                   "{\"dtype\": \"bfloat16\", \"torch_dtype\": \"bfloat16\"}");
    expect_rewrite("{\"a\": 1}", NULL, "{\"a\": 1}");
}

static void test_rewrite_leaves_nested_dtype_keys_alone(void **state)
{
    (void)state;
    expect_rewrite("{\"text_config\": {\"dtype\": \"bfloat16\", \"quantization_config\": {}}, \"x\": [{\"dtype\": 1}]}",
                   "float16",
                   "{\"text_config\": {\"dtype\": \"bfloat16\", \"quantization_config\": {}}, \"x\": [{\"dtype\": "
                   "1}], \"dtype\": \"float16\", \"torch_dtype\": \"float16\"}");
}

/* With --dtype every floating tensor is cast: each part's config (an object
 * that names a model_type, at any depth) says it too in its "dtype" or
 * "torch_dtype" string, as transformers saves a composite model cast to one
 * dtype; other objects (rope_scaling), other values and keys in arrays stay.
 * Beside untie, text_config gets both. */
static void test_rewrite_with_every_tensor_cast_sets_the_parts_dtypes(void **state)
{
    (void)state;
    static const char IN[] = "{\"text_config\": {\"dtype\": \"bfloat16\", \"model_type\": \"t\", "
                             "\"tie_word_embeddings\": true}, \"vision_config\": {\"model_type\": \"v\", "
                             "\"torch_dtype\": \"float32\", \"n\": {\"dtype\": \"bfloat16\", \"model_type\": \"n\"}, "
                             "\"m\": {\"dtype\": 1, \"model_type\": \"m\"}}, \"rope_scaling\": {\"dtype\": \"int8\"}, "
                             "\"x\": [{\"dtype\": \"bfloat16\"}], \"dtype\": \"bfloat16\"}";
    struct config_changes ch = {.dtype_name = "float16", .every_tensor = 1, .untie = 1};
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(config_rewrite("config.json", IN, strlen(IN), &ch, &out, &len), NF4_OK);
    assert_string_equal(out, "{\"text_config\": {\"dtype\": \"float16\", \"model_type\": \"t\", "
                             "\"tie_word_embeddings\": false}, \"vision_config\": {\"model_type\": \"v\", "
                             "\"torch_dtype\": \"float16\", \"n\": {\"dtype\": \"float16\", \"model_type\": \"n\"}, "
                             "\"m\": {\"dtype\": 1, \"model_type\": \"m\"}}, \"rope_scaling\": {\"dtype\": \"int8\"}, "
                             "\"x\": [{\"dtype\": \"bfloat16\"}], \"dtype\": \"float16\", "
                             "\"torch_dtype\": \"float16\", \"tie_word_embeddings\": false}");
    free(out);
    /* A diffusers config names no dtype, at the top or below. */
    static const char DIFFUSERS[] = "{\"_diffusers_version\": \"0.42.1\", \"p\": {\"dtype\": \"bfloat16\"}}";
    ch.untie = 0;
    assert_int_equal(config_rewrite("config.json", DIFFUSERS, strlen(DIFFUSERS), &ch, &out, &len), NF4_OK);
    assert_string_equal(out, DIFFUSERS);
    free(out);
}

static void expect_untied(const char *json, const char *dtype, const char *want)
{
    expect_rewrite_with(json, dtype, 1, 0, want);
}

/* A merge that writes lm_head apart from its embedding: tie_word_embeddings
 * becomes false where it is (spacing kept), at the top and in text_config,
 * and is added at the top where it is not; nowhere else changes. */
static void test_rewrite_unties_the_embeddings(void **state)
{
    (void)state;
    expect_untied("{\"a\": 1, \"tie_word_embeddings\" :  true, \"b\": 2}", NULL,
                  "{\"a\": 1, \"tie_word_embeddings\" :  false, \"b\": 2}");
    expect_untied("{\"a\": 1}", NULL, "{\"a\": 1,\n  \"tie_word_embeddings\": false}");
    expect_untied("{}", NULL, "{\n  \"tie_word_embeddings\": false\n}");
    expect_untied("{\n  \"quantization_config\": {},\n  \"tie_word_embeddings\": true\n}", "bfloat16",
                  "{\n  \"tie_word_embeddings\": false,\n  \"dtype\": \"bfloat16\",\n  \"torch_dtype\": \"bfloat16\"\n}");
    expect_untied("{\"text_config\": {\"x\": {\"tie_word_embeddings\": true}, \"tie_word_embeddings\": true}, "
                  "\"vision_config\": {\"tie_word_embeddings\": true}}",
                  NULL,
                  "{\"text_config\": {\"x\": {\"tie_word_embeddings\": true}, \"tie_word_embeddings\": false}, "
                  "\"vision_config\": {\"tie_word_embeddings\": true}, \"tie_word_embeddings\": false}");
    expect_untied("{\"text_config\": null, \"tie_word_embeddings\": false}", NULL,
                  "{\"text_config\": null, \"tie_word_embeddings\": false}");
    /* A text_config without the key gets it too, as its own members are spaced. */
    expect_untied("{\"text_config\": {}, \"b\": 2}", NULL, "{\"text_config\": {\"tie_word_embeddings\": false}, "
                  "\"b\": 2, \"tie_word_embeddings\": false}");
    expect_untied("{\"text_config\": {\"a\": 1}, \"b\": 2}", NULL,
                  "{\"text_config\": {\"a\": 1, \"tie_word_embeddings\": false}, \"b\": 2, "
                  "\"tie_word_embeddings\": false}");
    expect_untied("{\n  \"text_config\": {\n    \"a\": 1\n  }\n}", NULL,
                  "{\n  \"text_config\": {\n    \"a\": 1,\n    \"tie_word_embeddings\": false\n  },\n  "
                  "\"tie_word_embeddings\": false\n}");
    expect_untied("{\"text_config\": {\"a\": 1,  \"b\": [2]}, \"tie_word_embeddings\": true}", NULL,
                  "{\"text_config\": {\"a\": 1,  \"b\": [2],  \"tie_word_embeddings\": false}, "
                  "\"tie_word_embeddings\": false}");
    /* An escaped spelling of the key is the key. */
    expect_untied("{\"tie\\u005fword_embeddings\": true}", NULL, "{\"tie\\u005fword_embeddings\": false}");
}

/* A merge of an adapter trained on a resized vocabulary: vocab_size takes
 * the new rows where the top level or text_config has it (transformers sets
 * the text config's), and is added at the top where neither does; with an
 * untie, both change. */
static void test_rewrite_resizes_the_vocabulary(void **state)
{
    (void)state;
    expect_rewrite_with("{\"a\": 1, \"vocab_size\" : 512, \"b\": 2}", NULL, 0, 516,
                        "{\"a\": 1, \"vocab_size\" : 516, \"b\": 2}");
    expect_rewrite_with("{\"a\": 1}", NULL, 0, 128256, "{\"a\": 1,\n  \"vocab_size\": 128256}");
    expect_rewrite_with("{\"text_config\": {\"vocab_size\": 10, \"x\": {\"vocab_size\": 3}}, \"y\": {\"vocab_size\": 4}}",
                        NULL, 0, 12,
                        "{\"text_config\": {\"vocab_size\": 12, \"x\": {\"vocab_size\": 3}}, \"y\": {\"vocab_size\": 4}}");
    expect_rewrite_with("{\"vocab_size\": 10, \"text_config\": {\"vocab_size\": 10}}", NULL, 0, 11,
                        "{\"vocab_size\": 11, \"text_config\": {\"vocab_size\": 11}}");
    expect_rewrite_with("{\"text_config\": {\"a\": 1}, \"tie_word_embeddings\": true, \"vocab_size\": 5, "
                        "\"quantization_config\": {}}", "bfloat16", 1, 7,
                        "{\"text_config\": {\"a\": 1, \"tie_word_embeddings\": false}, \"tie_word_embeddings\": false, "
                        "\"vocab_size\": 7, \"dtype\": \"bfloat16\", \"torch_dtype\": \"bfloat16\"}");
}

static void test_rewrite_is_not_fooled_by_strings(void **state)
{
    (void)state;
    /* Braces, brackets, colons, commas and escaped quotes inside strings, and a
     * value that looks like the key being removed. */
    expect_rewrite("{\"s\": \"a}b{\\\"c\\\", \\\"dtype\\\": [\", \"quantization_config\": {\"k\": \"x\\\\\\\"}\"}, "
                   "\"t\": \"quantization_config\", \"u\\\"dtype\": 1}",
                   "float16",
                   "{\"s\": \"a}b{\\\"c\\\", \\\"dtype\\\": [\", \"t\": \"quantization_config\", \"u\\\"dtype\": 1, "
                   "\"dtype\": \"float16\", \"torch_dtype\": \"float16\"}");
}

static void test_rewrite_refuses_non_objects(void **state)
{
    (void)state;
    static const char *const BAD[] = {"[1, 2]", "\"dtype\"", "42", "null", "not json", "", "{\"a\": }", "{\"a\": 1",
                                      "{\"a\": 1} junk", "{\"a\": 1}{}"};
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        char *out = NULL;
        size_t len = 0;
        nf4_clear_error();
        struct config_changes ch = {.dtype_name = "float16"};
        int code = config_rewrite("dir/config.json", BAD[i], strlen(BAD[i]), &ch, &out, &len);
        if (code != NF4_EDATA)
            fail_msg("config_rewrite(%s) = %d, expected 65", BAD[i], code);
        assert_null(out);
        assert_non_null(strstr(nf4_last_error(), "dir/config.json: "));
    }
}

/* ---- control_index_rewrite ---- */

#define CONTROL_INDEX_FIXTURES FIXTURES "/diffusers"

static void expect_control_index(const char *json, const char *want, const char *want_from, const char *want_to)
{
    char *from = NULL, *out = NULL;
    const char *to = NULL;
    size_t len = 0;
    nf4_clear_error();
    int code = control_index_rewrite("pipe/model_index.json", json, strlen(json), &from, &to, &out, &len);
    if (code != NF4_OK)
        fail_msg("control_index_rewrite(%s) = %d: %s", json, code, nf4_last_error());
    if ((want == NULL) != (out == NULL) || (out && (strcmp(out, want) != 0 || strlen(out) != len)))
        fail_msg("control_index_rewrite(%s)\n  got:  [%s]\n  want: [%s]", json, out ? out : "(kept)",
                 want ? want : "(kept)");
    if ((want_from == NULL) != (from == NULL) || (from && strcmp(from, want_from) != 0))
        fail_msg("control_index_rewrite(%s): class %s, want %s", json, from ? from : "(none)",
                 want_from ? want_from : "(none)");
    if ((want_to == NULL) != (to == NULL) || (to && strcmp(to, want_to) != 0))
        fail_msg("control_index_rewrite(%s): control class %s, want %s", json, to ? to : "(none)",
                 want_to ? want_to : "(none)");
    free(from);
    free(out);
}

/* diffusers' FluxPipeline.save_pretrained index becomes, byte for byte, the
 * one FluxControlPipeline.save_pretrained writes of the same components
 * (make_control_index_fixtures.py). */
static void test_control_index_is_what_diffusers_saves(void **state)
{
    (void)state;
    char *plain = tu_read_file(CONTROL_INDEX_FIXTURES "/flux-pipeline.model_index.json", NULL);
    char *control = tu_read_file(CONTROL_INDEX_FIXTURES "/flux-control-pipeline.model_index.json", NULL);
    expect_control_index(plain, control, "FluxPipeline", "FluxControlPipeline");
    expect_control_index(control, NULL, "FluxControlPipeline", "FluxControlPipeline"); /* already one */
    free(plain);
    free(control);
}

static void test_control_index_classes_and_layouts(void **state)
{
    (void)state;
    static const struct {
        const char *json, *want, *from, *to;
    } CASES[] = {
        {"{\"_class_name\": \"FluxImg2ImgPipeline\", \"vae\": [\"diffusers\", \"AutoencoderKL\"]}",
         "{\"_class_name\": \"FluxControlImg2ImgPipeline\", \"vae\": [\"diffusers\", \"AutoencoderKL\"]}",
         "FluxImg2ImgPipeline", "FluxControlImg2ImgPipeline"},
        {"{\"_class_name\":\"FluxInpaintPipeline\"}", "{\"_class_name\":\"FluxControlInpaintPipeline\"}",
         "FluxInpaintPipeline", "FluxControlInpaintPipeline"},
        /* the dropped members first, last and in the middle; compact and escaped */
        {"{\"image_encoder\":[null,null],\"_class_name\":\"FluxPipeline\",\"feature_extractor\": [ null , null ]}",
         "{\"_class_name\":\"FluxControlPipeline\"}", "FluxPipeline", "FluxControlPipeline"},
        {"{\"a\": 1, \"feature\\u005fextractor\": [null, null], \"_class\\u005fname\": \"FluxPipeline\", \"b\": 2}",
         "{\"a\": 1, \"_class\\u005fname\": \"FluxControlPipeline\", \"b\": 2}", "FluxPipeline",
         "FluxControlPipeline"},
        /* an image encoder the pipeline loads goes too (diffusers would warn of it, unused) */
        {"{\"_class_name\": \"FluxPipeline\", \"image_encoder\": [\"transformers\", "
         "\"CLIPVisionModelWithProjection\"], \"vae\": 1}",
         "{\"_class_name\": \"FluxControlPipeline\", \"vae\": 1}", "FluxPipeline", "FluxControlPipeline"},
        {"{\"_class_name\": \"FluxPipeline\", \"image_encoder\": null}", "{\"_class_name\": \"FluxControlPipeline\"}",
         "FluxPipeline", "FluxControlPipeline"},
        /* a nested _class_name is not the pipeline's */
        {"{\"x\": {\"_class_name\": \"FluxPipeline\"}, \"_class_name\": \"FluxPipeline\"}",
         "{\"x\": {\"_class_name\": \"FluxPipeline\"}, \"_class_name\": \"FluxControlPipeline\"}", "FluxPipeline",
         "FluxControlPipeline"},
        /* classes with no control form, or none: kept */
        {"{\"_class_name\": \"FluxKontextPipeline\", \"image_encoder\": [null, null]}", NULL, "FluxKontextPipeline",
         NULL},
        {"{\"_class_name\": \"FluxFillPipeline\"}", NULL, "FluxFillPipeline", NULL},
        {"{\"_class_name\": \"FluxPipelineX\"}", NULL, "FluxPipelineX", NULL},
        {"{\"_class_name\": 3}", NULL, NULL, NULL},
        {"{}", NULL, NULL, NULL},
        {"{\"_class_name\": \"FluxControlInpaintPipeline\"}", NULL, "FluxControlInpaintPipeline",
         "FluxControlInpaintPipeline"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        expect_control_index(CASES[i].json, CASES[i].want, CASES[i].from, CASES[i].to);
}

static void test_control_index_refuses_non_objects(void **state)
{
    (void)state;
    static const char *const BAD[] = {"[\"FluxPipeline\"]", "\"FluxPipeline\"", "null", "", "{\"_class_name\": }",
                                      "{\"_class_name\": \"FluxPipeline\"} junk"};
    static const struct {
        const char *json, *key;
    } TWICE[] = {
        /* diffusers would read the last of each: a Kontext pipeline's class, or an image encoder */
        {"{\"_class_name\": \"FluxPipeline\", \"_class_name\": \"FluxKontextPipeline\"}", "_class_name"},
        {"{\"_class_name\": \"FluxKontextPipeline\", \"_class_name\": \"FluxPipeline\"}", "_class_name"},
        {"{\"_class_name\": \"FluxPipeline\", \"image_encoder\": [null, null], \"image_encoder\": [\"a\", \"b\"]}",
         "image_encoder"},
    };
    for (size_t i = 0; i < sizeof TWICE / sizeof TWICE[0]; i++) {
        char *from = NULL, *out = NULL;
        const char *to = NULL;
        size_t len = 0;
        nf4_clear_error();
        int code = control_index_rewrite("pipe/model_index.json", TWICE[i].json, strlen(TWICE[i].json), &from, &to,
                                         &out, &len);
        char *want = tu_strdupf("pipe/model_index.json: has \"%s\" twice, which diffusers reads as the last and "
                                "nf4deq would not", TWICE[i].key);
        if (code != NF4_EDATA || out || from || strcmp(nf4_last_error(), want) != 0)
            fail_msg("control_index_rewrite(%s) = %d: %s", TWICE[i].json, code, nf4_last_error());
        free(want);
    }
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        char *from = NULL, *out = NULL;
        const char *to = NULL;
        size_t len = 0;
        nf4_clear_error();
        int code = control_index_rewrite("pipe/model_index.json", BAD[i], strlen(BAD[i]), &from, &to, &out, &len);
        if (code != NF4_EDATA || out || from)
            fail_msg("control_index_rewrite(%s) = %d, expected 65 and nothing made", BAD[i], code);
        assert_string_equal(nf4_last_error(), "pipe/model_index.json: not a JSON object");
    }
}

/* Replaces the first `from` in *s with `to`. */
static void replace_once(char **s, const char *from, const char *to)
{
    char *at = strstr(*s, from);
    if (!at)
        fail_msg("\"%s\" not found", from);
    char *r = tu_strdupf("%.*s%s%s", (int)(at - *s), *s, to, at + strlen(from));
    free(*s);
    *s = r;
}

static void test_rewrite_of_the_fixture_config_keeps_every_other_byte(void **state)
{
    (void)state;
    size_t len = 0;
    char *orig = tu_read_file(FIXTURE_CONFIG, &len);
    assert_non_null(orig);
    char *out = NULL;
    size_t out_len;
    struct config_changes ch = {.dtype_name = "float16"};
    assert_int_equal(config_rewrite(FIXTURE_CONFIG, orig, len, &ch, &out, &out_len), NF4_OK);

    /* The expected text, edited by hand: the quantization_config member and its
     * separator cut out, dtype's value swapped, torch_dtype added at the end. */
    char *want = strdup(orig);
    char *qc = strstr(want, "\"quantization_config\"");
    char *next = strstr(want, "\"rms_norm_eps\"");
    assert_true(qc && next && qc < next);
    memmove(qc, next, strlen(next) + 1);
    replace_once(&want, "\"dtype\": \"bfloat16\"", "\"dtype\": \"float16\"");
    replace_once(&want, "\"vocab_size\": 512\n}", "\"vocab_size\": 512,\n  \"torch_dtype\": \"float16\"\n}");
    if (strcmp(out, want) != 0)
        fail_msg("rewritten fixture config differs:\n%s\n--- expected ---\n%s", out, want);

    cJSON *a = cJSON_Parse(orig), *b = cJSON_Parse(out);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(cJSON_GetObjectItemCaseSensitive(b, "quantization_config"));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(b, "dtype")->valuestring, "float16");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(b, "torch_dtype")->valuestring, "float16");
    for (const cJSON *c = a->child; c; c = c->next) {
        if (!strcmp(c->string, "quantization_config") || !strcmp(c->string, "dtype"))
            continue;
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(b, c->string);
        if (!d || !cJSON_Compare(c, d, 1))
            fail_msg("key %s changed", c->string);
    }
    assert_int_equal(cJSON_GetArraySize(b), cJSON_GetArraySize(a));
    assert_non_null(strstr(out, "\"rms_norm_eps\": 1e-06,"));
    assert_non_null(strstr(out, "\"rope_theta\": 10000.0,"));
    cJSON_Delete(a);
    cJSON_Delete(b);
    free(want);
    free(out);
    free(orig);
}

/* ---- index_render ---- */

static const struct index_out_entry RENDER_ENTRIES[] = {
    {"a.weight", "model-00001-of-00002.safetensors"},
    {"b\"quoted\".weight", "model-00001-of-00002.safetensors"},
    {"lm_head.weight", "model-00002-of-00002.safetensors"},
};

static cJSON *render(const char *metadata_json, uint64_t total_size, uint64_t total_parameters)
{
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(index_render("idx", metadata_json, total_size, total_parameters, RENDER_ENTRIES, 3, &out, &len),
                     NF4_OK);
    assert_int_equal(strlen(out), len);
    assert_true(len > 2 && out[len - 1] == '\n');
    cJSON *j = cJSON_Parse(out);
    if (!j)
        fail_msg("index_render output is not JSON:\n%s", out);
    free(out);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
    assert_true(cJSON_IsObject(map));
    size_t k = 0;
    for (const cJSON *c = map->child; c; c = c->next, k++) {
        assert_true(k < 3);
        assert_string_equal(c->string, RENDER_ENTRIES[k].tensor);
        assert_string_equal(c->valuestring, RENDER_ENTRIES[k].file);
    }
    assert_int_equal(k, 3);
    return j;
}

static double meta_number(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "metadata"), key);
    if (!cJSON_IsNumber(v))
        fail_msg("metadata.%s is not a number", key);
    return v->valuedouble;
}

static void test_render_without_input_metadata(void **state)
{
    (void)state;
    cJSON *j = render(NULL, 123456789012, 99);
    assert_true(meta_number(j, "total_size") == 123456789012.0);
    assert_null(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "metadata"), "total_parameters"));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "metadata")), 1);
    cJSON_Delete(j);
}

static void test_render_replaces_totals_and_keeps_other_metadata(void **state)
{
    (void)state;
    cJSON *j = render("{\"total_parameters\": 1, \"total_size\": 2, \"format\": \"pt\", \"nested\": {\"a\": [1, "
                      "\"x\"]}}",
                      4096, 1000);
    assert_true(meta_number(j, "total_size") == 4096.0);
    assert_true(meta_number(j, "total_parameters") == 1000.0);
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(j, "metadata");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "format")->valuestring, "pt");
    cJSON *want_nested = cJSON_Parse("{\"a\": [1, \"x\"]}");
    assert_true(cJSON_Compare(cJSON_GetObjectItemCaseSensitive(meta, "nested"), want_nested, 1));
    cJSON_Delete(want_nested);
    assert_int_equal(cJSON_GetArraySize(meta), 4);
    cJSON_Delete(j);
}

static void test_render_adds_total_parameters_only_when_the_input_had_it(void **state)
{
    (void)state;
    cJSON *j = render("{\"total_size\": 2, \"format\": \"pt\"}", 10, 77);
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(j, "metadata");
    assert_null(cJSON_GetObjectItemCaseSensitive(meta, "total_parameters"));
    assert_true(meta_number(j, "total_size") == 10.0);
    assert_int_equal(cJSON_GetArraySize(meta), 2);
    cJSON_Delete(j);
}

/* ---- index_parse ---- */

static int parse_index(const char *json)
{
    struct index_entry *e;
    size_t ne, nf;
    char **files, *meta;
    nf4_clear_error();
    int code = index_parse("dir/index.json", json, strlen(json), &e, &ne, &files, &nf, &meta);
    if (code == NF4_OK) {
        index_free(e, ne, files, nf);
        free(meta);
    } else {
        assert_null(e);
        assert_null(files);
        assert_null(meta);
    }
    return code;
}

static void test_index_parse_rejects_unsafe_and_malformed_entries(void **state)
{
    (void)state;
    static const struct {
        const char *json, *tensor;
    } BAD[] = {
        {"{\"weight_map\": {\"w\": \"../x.safetensors\"}}", "w"},
        {"{\"weight_map\": {\"w\": \"/abs/x.safetensors\"}}", "w"},
        {"{\"weight_map\": {\"w\": \"sub/dir.safetensors\"}}", "w"},
        {"{\"weight_map\": {\"w\": \".\"}}", "w"},
        {"{\"weight_map\": {\"w\": \"..\"}}", "w"},
        {"{\"weight_map\": {\"w\": \"\"}}", "w"},
        {"{\"weight_map\": {\"w\": \"a\\nb.safetensors\"}}", "w"},
        {"{\"weight_map\": {\"a\": \"ok.safetensors\", \"w\": 3}}", "w"},
        {"{\"weight_map\": {\"w\": null}}", "w"},
        {"{\"weight_map\": {\"w\": [\"x.safetensors\"]}}", "w"},
        {"{\"weight_map\": {\"w\": \"x.safetensors\", \"v\": \"x.safetensors\", \"w\": \"y.safetensors\"}}", "w"},
        {"{\"metadata\": {}}", NULL},
        {"{\"weight_map\": []}", NULL},
        {"{\"weight_map\": {}}", NULL},
        {"{\"weight_map\": {\"w\": \"x.safetensors\"}, \"metadata\": 5}", NULL},
        {"[{\"weight_map\": {\"w\": \"x.safetensors\"}}]", NULL},
        {"{\"weight_map\": {\"w\": \"x.safetensors\"}", NULL},
        {"", NULL},
        {"{\"weight_map\": {\"w\": \"x.safetensors\"}} junk", NULL},
        {"{\"weight_map\": {\"w\": \"x.safetensors\"}, \"weight_map\": {\"v\": \"y.safetensors\"}}", NULL},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        int code = parse_index(BAD[i].json);
        if (code != NF4_EDATA)
            fail_msg("index_parse(%s) = %d, expected 65", BAD[i].json, code);
        char *want = BAD[i].tensor ? tu_strdupf("dir/index.json: %s: ", BAD[i].tensor) : strdup("dir/index.json: ");
        if (strncmp(nf4_last_error(), want, strlen(want)) != 0)
            fail_msg("index_parse(%s): message does not start with \"%s\": %s", BAD[i].json, want, nf4_last_error());
        free(want);
    }
}

static void test_index_parse_accepts_plain_names(void **state)
{
    (void)state;
    assert_int_equal(parse_index("{\"weight_map\": {\"w\": \"..x.safetensors\", \"v\": \"a b.safetensors\"}}"),
                     NF4_OK);
}

static void test_index_parse_of_the_fixture_index(void **state)
{
    (void)state;
    size_t len = 0;
    char *json = tu_read_file(FIXTURE_SHARDED "/" INDEX_FILE_NAME, &len);
    assert_non_null(json);
    struct index_entry *e;
    size_t ne, nf;
    char **files, *meta;
    assert_int_equal(index_parse("idx", json, len, &e, &ne, &files, &nf, &meta), NF4_OK);
    assert_int_equal(nf, 5);
    for (size_t i = 0; i < nf; i++) {
        char want[64];
        snprintf(want, sizeof want, "model-%05zu-of-00005.safetensors", i + 1);
        assert_string_equal(files[i], want);
    }
    cJSON *doc = cJSON_Parse(json);
    assert_int_equal(ne, (size_t)cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(doc, "weight_map")));
    for (size_t i = 1; i < ne; i++)
        assert_true(strcmp(e[i - 1].tensor, e[i].tensor) < 0);
    for (size_t i = 0; i < ne; i++)
        assert_string_equal(
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(doc, "weight_map"), e[i].tensor)
                ->valuestring,
            e[i].file);
    cJSON *m = cJSON_Parse(meta);
    assert_true(cJSON_Compare(m, cJSON_GetObjectItemCaseSensitive(doc, "metadata"), 1));
    cJSON_Delete(m);
    cJSON_Delete(doc);
    index_free(e, ne, files, nf);
    free(meta);
    free(json);
}

/* ---- a sharded model whose index and shards disagree, through the CLI ---- */

struct scratch {
    char *dir, *in, *out;
};

static int sharded_setup(void **state)
{
    struct scratch *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    s->dir = tu_mkdtemp();
    s->in = tu_strdupf("%s/in", s->dir);
    s->out = tu_strdupf("%s/out", s->dir);
    if (mkdir(s->in, 0777) != 0)
        return -1;
    DIR *d = opendir(FIXTURE_SHARDED);
    if (!d)
        return -1;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.')
            continue;
        char *from = tu_strdupf("%s/%s", FIXTURE_SHARDED, ent->d_name);
        char *to = tu_strdupf("%s/%s", s->in, ent->d_name);
        int code = copy_file(from, to);
        free(from);
        free(to);
        if (code != NF4_OK) {
            closedir(d);
            return -1;
        }
    }
    closedir(d);
    *state = s;
    return 0;
}

static int sharded_teardown(void **state)
{
    struct scratch *s = *state;
    tu_rmtree(s->dir);
    free(s->dir);
    free(s->in);
    free(s->out);
    free(s);
    return 0;
}

/* Adds `"tensor": "file",` at the top of the copied index's weight_map. */
static void index_add_entry(struct scratch *s, const char *tensor, const char *file)
{
    char *path = tu_strdupf("%s/%s", s->in, INDEX_FILE_NAME);
    char *json = tu_read_file(path, NULL);
    assert_non_null(json);
    char *entry = tu_strdupf("\"weight_map\": {\n    \"%s\": \"%s\",", tensor, file);
    replace_once(&json, "\"weight_map\": {", entry);
    tu_write_file(path, json, strlen(json));
    free(entry);
    free(json);
    free(path);
}

static struct tu_run convert_expecting(struct scratch *s, int want_status, const char *want_in_message)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", s->in, s->out, NULL);
    if (r.status != want_status)
        fail_msg("convert exited %d, expected %d: %s", r.status, want_status, r.err);
    if (tu_lines(r.err) != 1 || strncmp(r.err, "nf4deq: ", 8) != 0)
        fail_msg("stderr is not one \"nf4deq: \" line: [%s]", r.err);
    if (!strstr(r.err, want_in_message))
        fail_msg("stderr does not mention \"%s\": %s", want_in_message, r.err);
    /* No output directory and no temp directory beside it. */
    assert_false(tu_exists(s->out));
    assert_int_equal(tu_count_entries(s->dir), 1);
    return r;
}

static void test_cli_converts_the_unmodified_copy(void **state)
{
    struct scratch *s = *state;
    struct tu_run r = tu_run("convert", "--device", "cpu", "-q", s->in, s->out, NULL);
    if (r.status != 0)
        fail_msg("convert exited %d: %s", r.status, r.err);
    tu_run_free(&r);
    assert_true(tu_exists(s->out));
}

static void test_cli_index_naming_a_missing_shard_is_missing_input(void **state)
{
    struct scratch *s = *state;
    index_add_entry(s, "ghost.weight", "model-00006-of-00005.safetensors");
    char *shard = tu_strdupf("%s/model-00006-of-00005.safetensors", s->in);
    struct tu_run r = convert_expecting(s, NF4_ENOINPUT, shard);
    tu_run_free(&r);
    free(shard);
}

static void test_cli_deleted_shard_is_missing_input(void **state)
{
    struct scratch *s = *state;
    char *shard = tu_strdupf("%s/model-00003-of-00005.safetensors", s->in);
    assert_int_equal(unlink(shard), 0);
    struct tu_run r = convert_expecting(s, NF4_ENOINPUT, shard);
    tu_run_free(&r);
    free(shard);
}

static void test_cli_index_entry_absent_from_its_shard_is_bad_data(void **state)
{
    struct scratch *s = *state;
    index_add_entry(s, "ghost.weight", "model-00001-of-00005.safetensors");
    struct tu_run r = convert_expecting(s, NF4_EDATA, ": ghost.weight: ");
    assert_non_null(strstr(r.err, INDEX_FILE_NAME));
    tu_run_free(&r);
}

static void test_cli_index_entry_pointing_at_the_wrong_shard_is_bad_data(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/%s", s->in, INDEX_FILE_NAME);
    char *json = tu_read_file(path, NULL);
    /* Shard 3 stays listed through its other tensors, so it is opened. */
    replace_once(&json, "\"model.layers.0.input_layernorm.weight\": \"model-00003-of-00005.safetensors\"",
                 "\"model.layers.0.input_layernorm.weight\": \"model-00004-of-00005.safetensors\"");
    tu_write_file(path, json, strlen(json));
    free(json);
    free(path);
    struct tu_run r = convert_expecting(s, NF4_EDATA, ": model.layers.0.input_layernorm.weight: ");
    assert_non_null(strstr(r.err, "model-00003-of-00005.safetensors"));
    tu_run_free(&r);
}

static void test_cli_tensor_in_two_shards_is_bad_data(void **state)
{
    struct scratch *s = *state;
    /* A sixth shard holding its own tensor plus lm_head.weight, which shard 1 also has. */
    static const uint64_t SHAPE[] = {2};
    const struct st_out_tensor extra[] = {{"extra.weight", DT_BF16, 1, SHAPE}, {"lm_head.weight", DT_BF16, 1, SHAPE}};
    char *shard = tu_strdupf("%s/extra.safetensors", s->in);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, shard, extra, 2, NULL, 0), NF4_OK);
    static const unsigned char ZEROS[8];
    assert_int_equal(st_writer_write(w, ZEROS, 8), NF4_OK);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    index_add_entry(s, "extra.weight", "extra.safetensors");
    struct tu_run r = convert_expecting(s, NF4_EDATA, ": lm_head.weight: ");
    tu_run_free(&r);
    free(shard);
}

/* A FIFO where a shard or config.json should be: opening it for reading would
 * wait for a writer forever. Run under timeout(1), so a hang fails (124)
 * instead of stalling the suite. */
static void test_cli_fifo_shard_or_config_is_missing_input_not_a_hang(void **state)
{
    struct scratch *s = *state;
    static const char *const NAMES[] = {"model-00005-of-00005.safetensors", "config.json"};
    for (size_t i = 0; i < sizeof NAMES / sizeof *NAMES; i++) {
        char *path = tu_strdupf("%s/%s", s->in, NAMES[i]), *saved = tu_strdupf("%s.saved", path);
        assert_int_equal(rename(path, saved), 0);
        assert_int_equal(mkfifo(path, 0600), 0);
        assert_int_equal(tu_sh_status("timeout 60 %s convert --device cpu %s %s 2>/dev/null", NF4DEQ_BIN, s->in,
                                      s->out),
                         NF4_ENOINPUT);
        assert_false(tu_exists(s->out));
        if (i == 0) /* inspect reads the shards, not config.json */
            assert_int_equal(tu_sh_status("timeout 60 %s inspect %s >/dev/null 2>&1", NF4DEQ_BIN, s->in),
                             NF4_ENOINPUT);
        assert_int_equal(unlink(path), 0);
        assert_int_equal(rename(saved, path), 0);
        free(path);
        free(saved);
    }
}

#define SHARDED(fn) cmocka_unit_test_setup_teardown(fn, sharded_setup, sharded_teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_tied_embedding_names, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test(test_rewrite_drops_quantization_config_wherever_it_is),
        cmocka_unit_test(test_rewrite_sets_existing_dtype_keys),
        cmocka_unit_test(test_rewrite_adds_missing_dtype_keys),
        cmocka_unit_test(test_rewrite_of_compact_one_line_json),
        cmocka_unit_test(test_rewrite_of_empty_object),
        cmocka_unit_test(test_rewrite_without_dtype_leaves_dtype_alone),
        cmocka_unit_test(test_rewrite_unties_the_embeddings),
        cmocka_unit_test(test_rewrite_resizes_the_vocabulary),
        cmocka_unit_test(test_rewrite_leaves_nested_dtype_keys_alone),
        cmocka_unit_test(test_rewrite_with_every_tensor_cast_sets_the_parts_dtypes),
        cmocka_unit_test(test_rewrite_is_not_fooled_by_strings),
        cmocka_unit_test(test_rewrite_refuses_non_objects),
        cmocka_unit_test(test_rewrite_of_the_fixture_config_keeps_every_other_byte),
        cmocka_unit_test(test_control_index_is_what_diffusers_saves),
        cmocka_unit_test(test_control_index_classes_and_layouts),
        cmocka_unit_test(test_control_index_refuses_non_objects),
        cmocka_unit_test(test_render_without_input_metadata),
        cmocka_unit_test(test_render_replaces_totals_and_keeps_other_metadata),
        cmocka_unit_test(test_render_adds_total_parameters_only_when_the_input_had_it),
        cmocka_unit_test(test_index_parse_rejects_unsafe_and_malformed_entries),
        cmocka_unit_test(test_index_parse_accepts_plain_names),
        cmocka_unit_test(test_index_parse_of_the_fixture_index),
        SHARDED(test_cli_converts_the_unmodified_copy),
        SHARDED(test_cli_index_naming_a_missing_shard_is_missing_input),
        SHARDED(test_cli_deleted_shard_is_missing_input),
        SHARDED(test_cli_index_entry_absent_from_its_shard_is_bad_data),
        SHARDED(test_cli_index_entry_pointing_at_the_wrong_shard_is_bad_data),
        SHARDED(test_cli_tensor_in_two_shards_is_bad_data),
        SHARDED(test_cli_fifo_shard_or_config_is_missing_input_not_a_hang),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
