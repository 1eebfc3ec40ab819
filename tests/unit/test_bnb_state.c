/* bitsandbytes 4-bit quant states: the JSON blob, and how a weight's parts must
 * agree with it before any arithmetic runs on them. */
#include <math.h>

#include "bnb_state.h"
#include "dequant.h"
#include "fpconv.h"
#include "model.h"
#include "test_util.h"

#define BLOB_NAME "model.x.weight.quant_state.bitsandbytes__nf4"

/* ---- bnb_parse_state: valid blobs, as bitsandbytes writes them ---- */

static int parse(const char *json, struct bnb_state *s)
{
    nf4_clear_error();
    return bnb_parse_state("f.safetensors", BLOB_NAME, json, strlen(json), s);
}

static void test_parse_nested_nf4_bf16_blob(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(parse("{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [256, "
                           "512], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": "
                           "0.12954378128051758}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.quant_type, QUANT_NF4);
    assert_int_equal(s.blocksize, 64);
    assert_int_equal(s.dtype, DT_BF16);
    assert_int_equal(s.ndim, 2);
    assert_int_equal(s.shape[0], 256);
    assert_int_equal(s.shape[1], 512);
    assert_int_equal(s.n, 256 * 512);
    assert_true(s.nested);
    assert_int_equal(s.nested_blocksize, 256);
    /* One RNE rounding of the JSON double to fp32, as torch.tensor(float(x)) does. */
    assert_int_equal(f32_bits(s.nested_offset), f32_bits((float)0.12954378128051758));
}

static void test_parse_plain_nf4_fp16_blob(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(
        parse("{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float16\", \"shape\": [128, 256]}", &s),
        NF4_OK);
    assert_int_equal(s.quant_type, QUANT_NF4);
    assert_int_equal(s.blocksize, 64);
    assert_int_equal(s.dtype, DT_F16);
    assert_int_equal(s.ndim, 2);
    assert_int_equal(s.n, 128 * 256);
    assert_false(s.nested);
    assert_int_equal(s.nested_blocksize, 0);
    assert_int_equal(f32_bits(s.nested_offset), 0);
}

static void test_parse_fp4_and_fp32_blobs(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(parse("{\"quant_type\": \"fp4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [96, "
                           "320], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": "
                           "0.1301473081111908}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.quant_type, QUANT_FP4);
    assert_int_equal(s.n, 96 * 320);
    assert_int_equal(f32_bits(s.nested_offset), f32_bits((float)0.1301473081111908));
    assert_int_equal(parse("{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [300, "
                           "301], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": "
                           "46.55316925048828}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.dtype, DT_F32);
    assert_int_equal(s.n, 90300);
    assert_int_equal(f32_bits(s.nested_offset), f32_bits((float)46.55316925048828));
}

static void test_parse_extremes_that_are_still_valid(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(parse("{\"quant_type\":\"nf4\",\"blocksize\":32,\"dtype\":\"float16\",\"shape\":[]}", &s), NF4_OK);
    assert_int_equal(s.ndim, 0);
    assert_int_equal(s.n, 1);
    assert_int_equal(parse("{\"quant_type\":\"nf4\",\"blocksize\":4096,\"dtype\":\"float16\",\"shape\":[0,7]}", &s),
                     NF4_OK);
    assert_int_equal(s.blocksize, 4096);
    assert_int_equal(s.n, 0);
    assert_int_equal(parse("{\"quant_type\":\"nf4\",\"blocksize\":64,\"dtype\":\"float16\",\"shape\":[4],"
                           "\"nested_blocksize\":1,\"nested_dtype\":\"float32\",\"nested_offset\":-3.5e38}",
                           &s),
                     NF4_EDATA); /* below -FLT_MAX */
    assert_int_equal(parse("{\"quant_type\":\"nf4\",\"blocksize\":64,\"dtype\":\"float16\",\"shape\":[4],"
                           "\"nested_blocksize\":1,\"nested_dtype\":\"float32\",\"nested_offset\":-3.4e38}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.nested_blocksize, 1);
    assert_true(s.nested_offset == -3.4e38f);
}

/* bitsandbytes' state of a weight of no elements under double quant: the
 * offset is the mean of no absmax, which Python's json writes as NaN. The
 * weight has nothing to dequantize, so the state is read. */
static void test_parse_nan_offset_of_a_weight_of_no_elements(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(parse("{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float16\", \"shape\": [0, "
                           "64], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": NaN}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.n, 0);
    assert_int_equal(s.shape[1], 64);
    assert_true(s.nested);
    assert_int_equal(s.nested_blocksize, 256);
    /* Infinity and -Infinity too; a string holding the word stays a string. */
    assert_int_equal(parse("{\"quant_type\": \"fp4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [64, "
                           "0], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": -Infinity}",
                           &s),
                     NF4_OK);
    assert_int_equal(s.quant_type, QUANT_FP4);
    assert_int_equal(s.n, 0);
    assert_int_equal(parse("{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"NaN\", \"shape\": [0], "
                           "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": NaN}",
                           &s),
                     NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "dtype \"NaN\" is not"));
}

/* ---- bnb_parse_state: invalid blobs ---- */

#define NESTED_KEYS "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": 0.125"
#define HEAD "\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\""

static const struct {
    const char *what, *json;
} BAD_STATES[] = {
    {"not JSON", "quant_type=nf4"},
    {"truncated JSON", "{\"quant_type\": \"nf4\""},
    {"empty", ""},
    {"JSON array", "[\"nf4\", 64]"},
    {"JSON string", "\"nf4\""},
    {"missing quant_type", "{\"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"quant_type int8", "{\"quant_type\": \"int8\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"quant_type NF4 (case)", "{\"quant_type\": \"NF4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"quant_type not a string", "{\"quant_type\": 4, \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize 48", "{\"quant_type\": \"nf4\", \"blocksize\": 48, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize 16", "{\"quant_type\": \"nf4\", \"blocksize\": 16, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize 8192", "{\"quant_type\": \"nf4\", \"blocksize\": 8192, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize 0", "{\"quant_type\": \"nf4\", \"blocksize\": 0, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize -64", "{\"quant_type\": \"nf4\", \"blocksize\": -64, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize \"64\"", "{\"quant_type\": \"nf4\", \"blocksize\": \"64\", \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"blocksize 64.5", "{\"quant_type\": \"nf4\", \"blocksize\": 64.5, \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"missing blocksize", "{\"quant_type\": \"nf4\", \"dtype\": \"bfloat16\", \"shape\": [4]}"},
    {"missing dtype", "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"shape\": [4]}"},
    {"dtype float64", "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float64\", \"shape\": [4]}"},
    {"dtype bf16 (safetensors spelling)", "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"BF16\", "
                                          "\"shape\": [4]}"},
    {"shape missing", "{" HEAD "}"},
    {"shape not an array", "{" HEAD ", \"shape\": 4}"},
    {"shape negative", "{" HEAD ", \"shape\": [4, -1]}"},
    {"shape fraction", "{" HEAD ", \"shape\": [4.5]}"},
    {"shape string", "{" HEAD ", \"shape\": [\"4\"]}"},
    {"shape product overflows", "{" HEAD ", \"shape\": [4294967296, 4294967296, 16]}"},
    {"shape beyond 2^53", "{" HEAD ", \"shape\": [18014398509481984]}"},
    {"shape with 9 dimensions", "{" HEAD ", \"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1]}"},
    {"only nested_blocksize", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256}"},
    {"nested_offset missing", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": \"float32\"}"},
    {"nested_dtype float16", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": \"float16\", "
                             "\"nested_offset\": 0.125}"},
    /* Python's json words for what is not finite: bitsandbytes writes NaN
     * only for a weight of no elements; on one of 4 it would dequantize to NaN. */
    {"nested_offset NaN on 4 elements", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": "
                                        "\"float32\", \"nested_offset\": NaN}"},
    {"nested_offset Infinity on 4 elements", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, "
                                             "\"nested_dtype\": \"float32\", \"nested_offset\": Infinity}"},
    {"nested_offset -Infinity on 4 elements", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, "
                                              "\"nested_dtype\": \"float32\", \"nested_offset\": -Infinity}"},
    {"nested_offset null (no NaN written)", "{" HEAD ", \"shape\": [0], \"nested_blocksize\": 256, "
                                            "\"nested_dtype\": \"float32\", \"nested_offset\": null}"},
    {"blocksize NaN", "{\"quant_type\": \"nf4\", \"blocksize\": NaN, \"dtype\": \"bfloat16\", \"shape\": [0]}"},
    {"shape holding NaN", "{" HEAD ", \"shape\": [NaN], " NESTED_KEYS "}"},
    {"NaN and another fault", "{" HEAD ", \"shape\": [0], \"nested_blocksize\": 256, \"nested_dtype\": "
                              "\"float32\", \"nested_offset\": NaN,}"},
    {"nan (lower case)", "{" HEAD ", \"shape\": [0], \"nested_blocksize\": 256, \"nested_dtype\": "
                         "\"float32\", \"nested_offset\": nan}"},
    {"nested_offset 1e39 (beyond fp32)", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": "
                                         "\"float32\", \"nested_offset\": 1e39}"},
    {"nested_offset 1e400 (beyond double)", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, "
                                            "\"nested_dtype\": \"float32\", \"nested_offset\": 1e400}"},
    {"nested_offset a string", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": "
                               "\"float32\", \"nested_offset\": \"0.125\"}"},
    {"nested_blocksize 0", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 0, \"nested_dtype\": \"float32\", "
                           "\"nested_offset\": 0.125}"},
    {"nested_blocksize 3", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 3, \"nested_dtype\": \"float32\", "
                           "\"nested_offset\": 0.125}"},
    {"nested_blocksize 2^21", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 2097152, \"nested_dtype\": "
                              "\"float32\", \"nested_offset\": 0.125}"},
    /* Python's json keeps the last duplicate, cJSON the first: refused, not guessed. */
    {"nested_offset twice", "{" HEAD ", \"shape\": [4], \"nested_blocksize\": 256, \"nested_dtype\": "
                            "\"float32\", \"nested_offset\": 0.125, \"nested_offset\": 0.25}"},
    {"blocksize twice", "{" HEAD ", \"shape\": [4], \"blocksize\": 128}"},
    {"trailing bytes", "{" HEAD ", \"shape\": [4]} junk"},
};

static void test_parse_rejects_every_bad_blob_naming_the_tensor(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof BAD_STATES / sizeof BAD_STATES[0]; i++) {
        struct bnb_state s;
        int code = parse(BAD_STATES[i].json, &s);
        if (code != NF4_EDATA)
            fail_msg("%s: bnb_parse_state returned %d, expected 65", BAD_STATES[i].what, code);
        if (!strstr(nf4_last_error(), "f.safetensors: " BLOB_NAME ": "))
            fail_msg("%s: message does not name the file and tensor: %s", BAD_STATES[i].what, nf4_last_error());
    }
}

/* Quant states back to back are diagnosed as transformers 5 writes them;
 * the same states with a NUL between them (which cJSON would skip) are no
 * writer's, and get the plain refusal. */
static void test_parse_names_states_back_to_back_only_as_written(void **state)
{
    (void)state;
    static const char STATE[] = "{" HEAD ", \"shape\": [4]}";
    char twice[2 * sizeof STATE];
    struct bnb_state s;
    for (int nul = 0; nul < 2; nul++) {
        memcpy(twice, STATE, sizeof STATE - 1);
        twice[sizeof STATE - 1] = nul ? '\0' : '\n';
        memcpy(twice + sizeof STATE, STATE, sizeof STATE - 1);
        nf4_clear_error();
        assert_int_equal(bnb_parse_state("f.safetensors", BLOB_NAME, twice, 2 * sizeof STATE - 1, &s), NF4_EDATA);
        const char *said = strstr(nf4_last_error(), "holds 2 quant states back to back");
        if (nul ? said != NULL : said == NULL)
            fail_msg("%s between two states: %s", nul ? "NUL" : "newline", nf4_last_error());
    }
}

/* The table above must differ from a valid blob only in its one fault. */
static void test_parse_accepts_the_bad_table_baseline(void **state)
{
    (void)state;
    struct bnb_state s;
    assert_int_equal(parse("{" HEAD ", \"shape\": [4], " NESTED_KEYS "}", &s), NF4_OK);
    assert_int_equal(parse("{" HEAD ", \"shape\": [4]}", &s), NF4_OK);
}

/* ---- bnb_collect on synthetic checkpoints ---- */

#define MAX_PARTS 12

struct part {
    char name[128];
    enum st_dtype dtype;
    size_t ndim;
    uint64_t shape[2];
    const void *data; /* NULL: bytes derived from the name */
    size_t data_len;
};

struct checkpoint {
    size_t n;
    struct part p[MAX_PARTS];
};

struct scratch {
    char *dir;
    char *path;
    struct model *m;
    struct bnb_weight *w;
    size_t nw;
};

static int scratch_setup(void **state)
{
    struct scratch *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    s->dir = tu_mkdtemp();
    s->path = tu_strdupf("%s/in.safetensors", s->dir);
    nf4_set_quiet(1);
    nf4_clear_error();
    *state = s;
    return 0;
}

static int scratch_teardown(void **state)
{
    struct scratch *s = *state;
    bnb_free(s->w, s->nw);
    model_close(s->m);
    tu_rmtree(s->dir);
    free(s->dir);
    free(s->path);
    free(s);
    return 0;
}

static struct part *add_part(struct checkpoint *c, const char *name, enum st_dtype dtype, uint64_t d0, int ndim,
                             uint64_t d1)
{
    assert_true(c->n < MAX_PARTS);
    struct part *p = &c->p[c->n++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->dtype = dtype;
    p->ndim = (size_t)ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    return p;
}

static struct part *find_part(struct checkpoint *c, const char *name)
{
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->p[i].name, name) == 0)
            return &c->p[i];
    fail_msg("no part %s", name);
    return NULL;
}

static void remove_part(struct checkpoint *c, const char *name)
{
    struct part *p = find_part(c, name);
    size_t i = (size_t)(p - c->p);
    memmove(&c->p[i], &c->p[i + 1], (c->n - i - 1) * sizeof *p);
    c->n--;
}

#define W "model.x.weight"
#define STATE_NESTED_63                                                                                       \
    "{\"quant_type\": \"nf4\", \"blocksize\": 32, \"dtype\": \"bfloat16\", \"shape\": [3, 21], "                \
    "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": 0.0625}"

static const float NESTED_CODE[256] = {[0] = -1.0f, [1] = -0.5f, [128] = 0.25f, [255] = 1.0f};
static const float NESTED_ABSMAX[4] = {2.0f, 3.0f, 4.0f, 5.0f};

/* A consistent double-quant nf4 weight with an odd element count: shape [3, 21]
 * is 63 values in 32 bytes, 2 blocks of 32, 1 nested block. */
static void nested_weight(struct checkpoint *c, const char *state_json)
{
    c->n = 0;
    add_part(c, W, DT_U8, 32, 2, 1);
    add_part(c, W ".absmax", DT_U8, 2, 1, 0);
    add_part(c, W ".quant_map", DT_F32, 16, 1, 0)->data = NF4_VALUES;
    struct part *na = add_part(c, W ".nested_absmax", DT_F32, 1, 1, 0);
    na->data = NESTED_ABSMAX;
    add_part(c, W ".nested_quant_map", DT_F32, 256, 1, 0)->data = NESTED_CODE;
    struct part *blob = add_part(c, W ".quant_state.bitsandbytes__nf4", DT_U8, strlen(state_json), 1, 0);
    blob->data = state_json;
    blob->data_len = strlen(state_json);
    add_part(c, "model.norm.weight", DT_BF16, 4, 1, 0);
}

static void write_checkpoint(const struct checkpoint *c, const char *path)
{
    struct st_out_tensor out[MAX_PARTS];
    for (size_t i = 0; i < c->n; i++)
        out[i] = (struct st_out_tensor){c->p[i].name, c->p[i].dtype, c->p[i].ndim, c->p[i].shape};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, out, c->n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < c->n; k++) {
        size_t i = st_writer_order(w, k);
        uint64_t len = st_writer_tensor_bytes(w, i);
        unsigned char *buf = malloc(len ? len : 1);
        assert_non_null(buf);
        if (c->p[i].data && c->p[i].data_len == 0)
            memcpy(buf, c->p[i].data, len); /* a table at least `len` long */
        else if (c->p[i].data)
            memcpy(buf, c->p[i].data, c->p[i].data_len < len ? c->p[i].data_len : len);
        else
            for (uint64_t b = 0; b < len; b++)
                buf[b] = (unsigned char)(b * 37 + 11);
        assert_int_equal(st_writer_write(w, buf, len), NF4_OK);
        free(buf);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
}

static int collect(struct scratch *s, const struct checkpoint *c)
{
    write_checkpoint(c, s->path);
    assert_int_equal(model_open_file(s->path, &s->m), NF4_OK);
    nf4_clear_error();
    return bnb_collect(s->m, &s->w, &s->nw);
}

static void expect_refused(struct scratch *s, const struct checkpoint *c, const char *named)
{
    int code = collect(s, c);
    if (code != NF4_EDATA)
        fail_msg("bnb_collect returned %d, expected 65 (naming %s)", code, named);
    char *want = tu_strdupf(": %s: ", named);
    if (!strstr(nf4_last_error(), want))
        fail_msg("message does not name %s: %s", named, nf4_last_error());
    free(want);
    assert_null(s->w);
    assert_int_equal(s->nw, 0);
}

static void test_collect_accepts_nested_weight_with_odd_element_count(void **state)
{
    struct scratch *s = *state;
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    int code = collect(s, &c);
    if (code != NF4_OK)
        fail_msg("bnb_collect: %s", nf4_last_error());
    assert_int_equal(s->nw, 1);
    const struct bnb_weight *w = bnb_find(s->w, s->nw, W);
    assert_non_null(w);
    assert_string_equal(w->name, W);
    assert_int_equal(w->state.n, 63);
    assert_int_equal(w->blocks, 2);
    assert_int_equal(w->nested_blocks, 1);
    assert_true(w->quant_map_is_standard);
    assert_string_equal(w->packed->t->name, W);
    assert_string_equal(w->absmax->t->name, W ".absmax");
    assert_string_equal(w->nested_absmax->t->name, W ".nested_absmax");
    assert_string_equal(w->nested_quant_map->t->name, W ".nested_quant_map");
    assert_null(bnb_find(s->w, s->nw, "model.norm.weight"));
    assert_true(bnb_is_state_part(W ".absmax"));
    assert_false(bnb_is_state_part(W));
    assert_false(bnb_is_state_part("model.norm.weight"));
}

static void test_collect_accepts_plain_weight_with_f32_absmax(void **state)
{
    struct scratch *s = *state;
    struct checkpoint c;
    nested_weight(&c, "{\"quant_type\": \"nf4\", \"blocksize\": 32, \"dtype\": \"float16\", \"shape\": [3, 21]}");
    remove_part(&c, W ".nested_absmax");
    remove_part(&c, W ".nested_quant_map");
    find_part(&c, W ".absmax")->dtype = DT_F32;
    int code = collect(s, &c);
    if (code != NF4_OK)
        fail_msg("bnb_collect: %s", nf4_last_error());
    assert_int_equal(s->nw, 1);
    assert_false(s->w[0].state.nested);
    assert_null(s->w[0].nested_absmax);
}

static void test_collect_refuses_missing_absmax(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    remove_part(&c, W ".absmax");
    expect_refused(*state, &c, W);
}

static void test_collect_refuses_wrong_absmax_count(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W ".absmax")->shape[0] = 3;
    expect_refused(*state, &c, W ".absmax");
}

static void test_collect_refuses_f32_absmax_with_double_quant(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W ".absmax")->dtype = DT_F32;
    expect_refused(*state, &c, W ".absmax");
}

static void test_collect_refuses_u8_absmax_without_double_quant(void **state)
{
    struct checkpoint c;
    nested_weight(&c, "{\"quant_type\": \"nf4\", \"blocksize\": 32, \"dtype\": \"float16\", \"shape\": [3, 21]}");
    remove_part(&c, W ".nested_absmax");
    remove_part(&c, W ".nested_quant_map");
    expect_refused(*state, &c, W ".absmax");
}

static void test_collect_refuses_nested_parts_without_double_quant(void **state)
{
    struct checkpoint c;
    nested_weight(&c, "{\"quant_type\": \"nf4\", \"blocksize\": 32, \"dtype\": \"float16\", \"shape\": [3, 21]}");
    find_part(&c, W ".absmax")->dtype = DT_F32;
    expect_refused(*state, &c, W ".quant_state.bitsandbytes__nf4");
}

static void test_collect_refuses_wrong_nested_absmax_count(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W ".nested_absmax")->shape[0] = 2;
    expect_refused(*state, &c, W ".nested_absmax");
}

static void test_collect_refuses_nested_quant_map_of_255(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W ".nested_quant_map")->shape[0] = 255;
    expect_refused(*state, &c, W ".nested_quant_map");
}

static void test_collect_refuses_missing_nested_quant_map(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    remove_part(&c, W ".nested_quant_map");
    expect_refused(*state, &c, W);
}

static void test_collect_refuses_missing_quant_map(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    remove_part(&c, W ".quant_map");
    expect_refused(*state, &c, W);
}

static void test_collect_refuses_f16_quant_map(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    struct part *qm = find_part(&c, W ".quant_map");
    qm->dtype = DT_F16;
    qm->data = NULL;
    expect_refused(*state, &c, W ".quant_map");
}

static void test_collect_refuses_short_packed_weight(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W)->shape[0] = 31; /* 63 nibbles need 32 bytes */
    expect_refused(*state, &c, W);
}

static void test_collect_refuses_missing_packed_weight(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    remove_part(&c, W);
    expect_refused(*state, &c, W);
}

static void test_collect_refuses_fp4_state_in_nf4_blob(void **state)
{
    struct checkpoint c;
    nested_weight(&c, "{\"quant_type\": \"fp4\", \"blocksize\": 32, \"dtype\": \"bfloat16\", \"shape\": [3, 21], "
                      "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": 0.0625}");
    expect_refused(*state, &c, W ".quant_state.bitsandbytes__nf4");
}

static void test_collect_refuses_nf4_state_in_fp4_blob(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    snprintf(find_part(&c, W ".quant_state.bitsandbytes__nf4")->name, 128, "%s", W ".quant_state.bitsandbytes__fp4");
    expect_refused(*state, &c, W ".quant_state.bitsandbytes__fp4");
}

static void test_collect_refuses_invalid_blob_json(void **state)
{
    struct checkpoint c;
    nested_weight(&c, "{\"quant_type\": \"nf4\", \"blocksize\": 48, \"dtype\": \"bfloat16\", \"shape\": [3, 21]}");
    expect_refused(*state, &c, W ".quant_state.bitsandbytes__nf4");
}

static void test_collect_refuses_orphan_state_part(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    add_part(&c, "model.y.weight.absmax", DT_U8, 2, 1, 0);
    expect_refused(*state, &c, "model.y.weight.absmax");
}

static void test_collect_refuses_8bit_scb_tensor(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    add_part(&c, "model.z.weight.SCB", DT_F32, 4, 1, 0);
    expect_refused(*state, &c, "model.z.weight.SCB");
}

static void test_collect_refuses_blob_that_is_not_u8(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    struct part *blob = find_part(&c, W ".quant_state.bitsandbytes__nf4");
    blob->dtype = DT_I8;
    expect_refused(*state, &c, W ".quant_state.bitsandbytes__nf4");
}

/* ---- the same faults through the CLI ---- */

static void expect_cli_refuses(struct scratch *s, const struct checkpoint *c, const char *named)
{
    write_checkpoint(c, s->path);
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", s->path, out, NULL);
    if (r.status != NF4_EDATA)
        fail_msg("convert exited %d, expected 65: %s", r.status, r.err);
    assert_int_equal(tu_lines(r.err), 1);
    char *prefix = tu_strdupf("nf4deq: %s: %s: ", s->path, named);
    if (strncmp(r.err, prefix, strlen(prefix)) != 0)
        fail_msg("stderr does not start with \"%s\": %s", prefix, r.err);
    free(prefix);
    assert_int_equal(tu_count_entries(s->dir), 1);
    tu_run_free(&r);
    free(out);
}

static void test_cli_refuses_missing_absmax(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    remove_part(&c, W ".absmax");
    expect_cli_refuses(*state, &c, W);
}

static void test_cli_refuses_short_packed_weight(void **state)
{
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    find_part(&c, W)->shape[0] = 31;
    expect_cli_refuses(*state, &c, W);
}

/* bitsandbytes can store the packed nibbles in any dtype (bnb_4bit_quant_storage);
 * only the bytes matter, so a BF16 or F32 packed tensor converts exactly as U8. */
static void test_cli_converts_packed_weight_stored_as_bf16_or_f32(void **state)
{
    struct scratch *s = *state;
    struct checkpoint c;
    nested_weight(&c, STATE_NESTED_63);
    char *u8_in = tu_strdupf("%s/u8.safetensors", s->dir);
    char *u8_out = tu_strdupf("%s/u8.out.safetensors", s->dir);
    write_checkpoint(&c, u8_in);
    struct tu_run r = tu_run("convert", "--device", "cpu", "-q", u8_in, u8_out, NULL);
    if (r.status != 0)
        fail_msg("U8 storage: exit %d: %s", r.status, r.err);
    tu_run_free(&r);

    static const struct {
        enum st_dtype dtype;
        uint64_t rows;
    } STORAGE[] = {{DT_BF16, 16}, {DT_F32, 8}};
    for (size_t i = 0; i < 2; i++) {
        struct part *packed = find_part(&c, W);
        packed->dtype = STORAGE[i].dtype;
        packed->shape[0] = STORAGE[i].rows; /* 32 bytes either way */
        char *in = tu_strdupf("%s/%s.safetensors", s->dir, dtype_name(STORAGE[i].dtype));
        char *out = tu_strdupf("%s/%s.out.safetensors", s->dir, dtype_name(STORAGE[i].dtype));
        write_checkpoint(&c, in);
        r = tu_run("convert", "--device", "cpu", "-q", in, out, NULL);
        if (r.status != 0)
            fail_msg("%s storage: exit %d: %s", dtype_name(STORAGE[i].dtype), r.status, r.err);
        tu_run_free(&r);
        tu_assert_same_tensors(out, u8_out);
        free(in);
        free(out);
    }
    struct st_file *f;
    assert_int_equal(st_open(u8_out, &f), NF4_OK);
    const struct st_tensor *t = st_find(f, W);
    assert_non_null(t);
    assert_int_equal(t->dtype, DT_BF16);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 3);
    assert_int_equal(t->shape[1], 21);
    assert_null(st_find(f, W ".absmax"));
    st_close(f);
    free(u8_in);
    free(u8_out);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, scratch_setup, scratch_teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_nested_nf4_bf16_blob),
        cmocka_unit_test(test_parse_plain_nf4_fp16_blob),
        cmocka_unit_test(test_parse_fp4_and_fp32_blobs),
        cmocka_unit_test(test_parse_extremes_that_are_still_valid),
        cmocka_unit_test(test_parse_nan_offset_of_a_weight_of_no_elements),
        cmocka_unit_test(test_parse_rejects_every_bad_blob_naming_the_tensor),
        cmocka_unit_test(test_parse_accepts_the_bad_table_baseline),
        cmocka_unit_test(test_parse_names_states_back_to_back_only_as_written),
        T(test_collect_accepts_nested_weight_with_odd_element_count),
        T(test_collect_accepts_plain_weight_with_f32_absmax),
        T(test_collect_refuses_missing_absmax),
        T(test_collect_refuses_wrong_absmax_count),
        T(test_collect_refuses_f32_absmax_with_double_quant),
        T(test_collect_refuses_u8_absmax_without_double_quant),
        T(test_collect_refuses_nested_parts_without_double_quant),
        T(test_collect_refuses_wrong_nested_absmax_count),
        T(test_collect_refuses_nested_quant_map_of_255),
        T(test_collect_refuses_missing_nested_quant_map),
        T(test_collect_refuses_missing_quant_map),
        T(test_collect_refuses_f16_quant_map),
        T(test_collect_refuses_short_packed_weight),
        T(test_collect_refuses_missing_packed_weight),
        T(test_collect_refuses_fp4_state_in_nf4_blob),
        T(test_collect_refuses_nf4_state_in_fp4_blob),
        T(test_collect_refuses_invalid_blob_json),
        T(test_collect_refuses_orphan_state_part),
        T(test_collect_refuses_8bit_scb_tensor),
        T(test_collect_refuses_blob_that_is_not_u8),
        T(test_cli_refuses_missing_absmax),
        T(test_cli_refuses_short_packed_weight),
        T(test_cli_converts_packed_weight_stored_as_bf16_or_f32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
