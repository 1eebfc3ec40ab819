/* Reproducers found by the fuzzers (tests/fuzz/), kept in tests/corpus/crashes/,
 * fed through the same APIs the fuzzers call, with the result each one must
 * now give. A new reproducer gets a file there and a test here.
 *
 * The config_rewrite cases all produced a config.json that was not what the
 * function promises: cJSON (and so json_parse_whole) accepted a UTF-8 BOM and
 * any byte up to 0x20 as white space, and raw control bytes inside strings,
 * while the text scanner that rewrites the file knows only space, tab, CR and
 * LF; cJSON decodes a malformed \uXXXX escape as U+0000; and keys spelled
 * with escapes ("quantization\u005fconfig") were not recognised. The output then kept "quantization_config", was not JSON at all,
 * or named "dtype" twice. */
#include <cJSON.h>

#include "bnb_state.h"
#include "json_util.h"
#include "lora.h"
#include "model.h"
#include "test_util.h"

#define CRASHES "tests/corpus/crashes"

static char *read_crash(const char *name, size_t *len)
{
    char *path = tu_strdupf("%s/%s", CRASHES, name);
    char *data = tu_read_file(path, len);
    if (!data)
        fail_msg("cannot read %s (tests run from the repository root)", path);
    free(path);
    return data;
}

static int rewrite(const char *json, size_t len, const char *dtype, char **out, size_t *out_len)
{
    nf4_clear_error();
    *out = NULL;
    struct config_changes ch = {.dtype_name = dtype};
    return config_rewrite("config.json", json, len, &ch, out, out_len);
}

/* Each of these must now be refused as invalid JSON, with and without a dtype. */
static void assert_config_refused(const char *name)
{
    size_t len;
    char *json = read_crash(name, &len);
    char *out;
    size_t out_len;
    for (int k = 0; k < 2; k++) {
        int code = rewrite(json, len, k ? NULL : "bfloat16", &out, &out_len);
        if (code != NF4_EDATA)
            fail_msg("%s: config_rewrite = %d, expected %d (NF4_EDATA); output: %s", name, code, NF4_EDATA,
                     code == NF4_OK ? out : nf4_last_error());
        assert_null(out);
        assert_non_null(strstr(nf4_last_error(), "config.json: not a JSON object"));
    }
    free(json);
}

static void test_config_nul_bytes_in_a_string(void **state)
{
    (void)state;
    assert_config_refused("config-nul-bytes-in-string");
}

static void test_config_utf8_bom(void **state)
{
    (void)state;
    assert_config_refused("config-utf8-bom");
}

static void test_config_vertical_tab_as_white_space(void **state)
{
    (void)state;
    assert_config_refused("config-vertical-tab-whitespace");
}

static void test_config_form_feed_before_a_colon(void **state)
{
    (void)state;
    assert_config_refused("config-formfeed-before-colon");
}

/* "torch_dtype\u((((...e": cJSON decodes a \u without four hex digits as
 * U+0000, so the key read as "torch_dtype" and the output named it twice. */
static void test_config_malformed_u_escape(void **state)
{
    (void)state;
    assert_config_refused("config-malformed-u-escape");
}

/* Escaped keys are valid JSON: the rewrite must see through them. */
static void test_config_escaped_keys_are_recognised(void **state)
{
    (void)state;
    size_t len, out_len;
    char *json = read_crash("config-escaped-keys", &len), *out;
    assert_int_equal(rewrite(json, len, "bfloat16", &out, &out_len), NF4_OK);
    cJSON *root = json_parse_whole(out, out_len);
    assert_true(cJSON_IsObject(root));
    assert_false(json_has_duplicate_key(root));
    assert_null(cJSON_GetObjectItemCaseSensitive(root, "quantization_config"));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(root, "dtype")->valuestring, "bfloat16");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(root, "torch_dtype")->valuestring, "bfloat16");
    cJSON_Delete(root);
    free(out);
    /* Without a dtype the escaped dtype key stays as it was. */
    assert_int_equal(rewrite(json, len, NULL, &out, &out_len), NF4_OK);
    assert_string_equal(out, "{\"d\\u0074ype\":\"float16\"}");
    free(out);
    free(json);
}

/* The same strictness everywhere nf4deq reads JSON. Before, cJSON took a raw
 * control byte in a name, and "\u0000" cut a name short ("w\u0000x" became "w"). */
static void test_header_control_byte_and_u0000_refused(void **state)
{
    (void)state;
    static const char *const BAD[] = {
        "{\"w\x01\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
        "{\"w\\u0000x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
        "{\"w\\uZZZZx\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
        "{\"w\\u12\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
        "{\x0b\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
        "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}\x0c}",
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        struct st_file f = {.path = "mem", .fd = -1};
        nf4_clear_error();
        int code = st_parse_header(&f, BAD[i], strlen(BAD[i]), 1);
        if (code != NF4_EDATA)
            fail_msg("header %zu: st_parse_header = %d, expected NF4_EDATA", i, code);
        assert_non_null(strstr(nf4_last_error(), "mem: header is not valid JSON"));
        st_free_header(&f);
    }
    /* Escapes other than \u0000 stay valid, and so does UTF-8 up to U+10FFFF. */
    struct st_file f = {.path = "mem", .fd = -1};
    const char *ok = "{\"w\\u0001\\u00e9\\\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    nf4_clear_error();
    assert_int_equal(st_parse_header(&f, ok, strlen(ok), 1), NF4_OK);
    assert_string_equal(f.tensors[0].name, "w\x01\xc3\xa9\"");
    st_free_header(&f);
    const char *raw = "{\"\xc3\xa9\xe2\x82\xac\xed\x9f\xbf\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf\":"
                      "{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    f = (struct st_file){.path = "mem", .fd = -1};
    nf4_clear_error();
    assert_int_equal(st_parse_header(&f, raw, strlen(raw), 1), NF4_OK);
    assert_string_equal(f.tensors[0].name, "\xc3\xa9\xe2\x82\xac\xed\x9f\xbf\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf");
    st_free_header(&f);
}

/* Every JSON file nf4deq reads must be UTF-8, as Python's json and the
 * safetensors reader require: before, a config.json or an index with a stray
 * byte in a string was accepted and its bytes copied into the output. */
static void test_json_that_is_not_utf8_refused(void **state)
{
    (void)state;
    static const char *const BAD[] = {
        "{\"a\":\"w\xff\"}",             /* a stray byte */
        "{\"a\":\"w\xc0\xaf\"}",         /* an overlong '/' */
        "{\"a\":\"w\xed\xa0\x80\"}",     /* a surrogate */
        "{\"a\":\"w\xf4\x90\x80\x80\"}", /* past U+10FFFF */
        "{\"a\":\"w\xe2\x82\"}",         /* cut short */
        "{\"w\x80\":1}",                 /* in a key */
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        assert_false(json_text_is_strict(BAD[i], strlen(BAD[i])));
        char *out;
        size_t out_len;
        if (rewrite(BAD[i], strlen(BAD[i]), "bfloat16", &out, &out_len) != NF4_EDATA)
            fail_msg("config %zu: accepted", i);
        struct st_file f = {.path = "mem", .fd = -1};
        char header[128];
        snprintf(header, sizeof header, "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                                        "\"__metadata__\":%s}", BAD[i]);
        nf4_clear_error();
        assert_int_equal(st_parse_header(&f, header, strlen(header), 1), NF4_EDATA);
        assert_non_null(strstr(nf4_last_error(), "mem: header is not valid UTF-8"));
        st_free_header(&f);
    }
    const char *ok = "{\"a\":\"\xc3\xa9\xe2\x82\xac\xed\x9f\xbf\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf\"}";
    assert_true(json_text_is_strict(ok, strlen(ok)));
}

static void test_quant_state_and_index_control_bytes_refused(void **state)
{
    (void)state;
    struct bnb_state s;
    const char *qs = "{\"quant_type\":\"nf4\",\"blocksize\":64,\"dtype\":\"float16\",\"shape\":[64]}";
    nf4_clear_error();
    assert_int_equal(bnb_parse_state("f", "t", qs, strlen(qs), &s), NF4_OK);
    const char *qs_bad = "\xef\xbb\xbf{\"quant_type\":\"nf4\",\"blocksize\":64,\"dtype\":\"float16\",\"shape\":[64]}";
    nf4_clear_error();
    assert_int_equal(bnb_parse_state("f", "t", qs_bad, strlen(qs_bad), &s), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "quant state is not valid JSON"));

    struct index_entry *e;
    char **files, *meta;
    size_t ne, nf;
    const char *idx = "{\"weight_map\":{\"a\\u0000b\":\"s.safetensors\"}}";
    nf4_clear_error();
    assert_int_equal(index_parse("index.json", idx, strlen(idx), &e, &ne, &files, &nf, &meta), NF4_EDATA);
    assert_null(e);
    assert_null(files);
    assert_null(meta);
    const char *idx_ws = "{\"weight_map\":{\"a\":\"s.safetensors\"}\x1f}";
    nf4_clear_error();
    assert_int_equal(index_parse("index.json", idx_ws, strlen(idx_ws), &e, &ne, &files, &nf, &meta), NF4_EDATA);
}

/* fuzz_adapter_config ran out of its 2 GiB in CI (libFuzzer's rss limit):
 * pattern keys went to regcomp(3), and glibc expands counted repeats and builds
 * DFA states that grow with the square of the pattern. "(.*){1,333}x" took 3 s
 * and 200 MB, "((.*)*){1,250}" minutes. Now the first file's patterns are
 * read as Python reads them and matched in linear time; the second's expands
 * to 64,000 states and is refused. */
static void test_adapter_config_patterns_bounded(void **state)
{
    (void)state;
    size_t len;
    char *json = read_crash("adapter-config-regex-blowup", &len);
    struct lora_config c;
    nf4_clear_error();
    assert_int_equal(lora_config_parse("adapter_config.json", json, len, &c), NF4_OK);
    assert_non_null(c.rank_compiled);
    assert_non_null(c.rank_compiled[1]);
    assert_null(c.rank_compiled[2]);
    lora_config_free(&c);
    free(json);
    assert_int_equal(lora_pattern_matches("((.*)*){1,250}", "model.layers.0.mlp"), 1);
    assert_int_equal(lora_pattern_matches("(.*){1,333}x", "model.layers.0.mlp"), 0);
    assert_int_equal(lora_pattern_matches("(.*){1,333}x", "model.layers.0.x"), 1);

    json = read_crash("adapter-config-regex-expansion", &len);
    nf4_clear_error();
    assert_int_equal(lora_config_parse("adapter_config.json", json, len, &c), NF4_EDATA);
    assert_string_equal(nf4_last_error(), "adapter_config.json: \"rank_pattern\": \"((x{40}){40}){40}\" is not a "
                                          "regular expression nf4deq can use: its repeats expand past 2048 states");
    lora_config_free(&c);
    free(json);
}

/* Whatever else lands in crashes/: every API must survive every file (the
 * sanitized build, make check SANITIZE=1, turns a memory error into a failure). */
static void test_every_reproducer_through_every_parser(void **state)
{
    (void)state;
    DIR *d = opendir(CRASHES);
    assert_non_null(d);
    struct dirent *ent;
    int n = 0;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.')
            continue;
        size_t len;
        char *data = read_crash(ent->d_name, &len);
        struct st_file f = {.path = "mem", .fd = -1};
        nf4_clear_error();
        if (len >= 8)
            st_parse_header(&f, data + 8, len - 8, 0);
        st_free_header(&f);
        struct bnb_state s;
        nf4_clear_error();
        bnb_parse_state("f", "t", data, len, &s);
        struct index_entry *e;
        char **files, *meta;
        size_t ne, nf;
        nf4_clear_error();
        if (index_parse("index.json", data, len, &e, &ne, &files, &nf, &meta) == NF4_OK) {
            index_free(e, ne, files, nf);
            free(meta);
        }
        char *out;
        size_t out_len;
        if (rewrite(data, len, "float16", &out, &out_len) == NF4_OK)
            free(out);
        struct lora_config c;
        nf4_clear_error();
        lora_config_parse("adapter_config.json", data, len, &c);
        lora_config_free(&c);
        free(data);
        n++;
    }
    closedir(d);
    assert_true(n > 0);
}

int main(void)
{
    static const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_nul_bytes_in_a_string),
        cmocka_unit_test(test_config_utf8_bom),
        cmocka_unit_test(test_config_vertical_tab_as_white_space),
        cmocka_unit_test(test_config_form_feed_before_a_colon),
        cmocka_unit_test(test_config_malformed_u_escape),
        cmocka_unit_test(test_config_escaped_keys_are_recognised),
        cmocka_unit_test(test_header_control_byte_and_u0000_refused),
        cmocka_unit_test(test_json_that_is_not_utf8_refused),
        cmocka_unit_test(test_quant_state_and_index_control_bytes_refused),
        cmocka_unit_test(test_adapter_config_patterns_bounded),
        cmocka_unit_test(test_every_reproducer_through_every_parser),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
