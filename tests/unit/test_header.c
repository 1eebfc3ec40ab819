/* safetensors header validation and the writer's layout.
 *
 * Each malformed file goes through the real binary, because what matters to a
 * user is the whole path: exit 65, one line on stderr naming the file (and the
 * tensor where there is one), and nothing left behind in the output directory. */
#include <cJSON.h>

#include "test_util.h"

#define TENSOR "blk.0.w"
#define ENTRY(name, dtype, shape, offsets)                                                                    \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":" offsets "}"
#define GOOD ENTRY(TENSOR, "F32", "[2]", "[0,8]")

struct bad_file {
    const char *what;
    const char *header;     /* JSON text after the length prefix */
    size_t header_len;      /* 0: strlen(header) */
    size_t data_len;        /* zero bytes of tensor data after the header */
    const char *tensor;     /* the message must name it; NULL for file-level faults */
    const char *raw;        /* the whole file instead, for length-prefix faults */
    size_t raw_len;
};

#define RAW(what_, bytes) {.what = what_, .raw = bytes, .raw_len = sizeof bytes - 1}
#define HDR(what_, text, data, tensor_) {.what = what_, .header = text, .data_len = data, .tensor = tensor_}

static const struct bad_file BAD[] = {
    RAW("empty file", ""),
    RAW("file shorter than 8 bytes", "\x02\0\0\0{}"),
    RAW("header length over 100,000,000", "\x01\xe1\xf5\x05\0\0\0\0{}"),
    RAW("header length 2^64-1", "\xff\xff\xff\xff\xff\xff\xff\xff{}"),
    RAW("header length past the end of the file", "\x40\0\0\0\0\0\0\0{}"),
    RAW("header length zero", "\0\0\0\0\0\0\0\0"),
    HDR("header not UTF-8", "{\"blk\xff\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, NULL),
    HDR("overlong UTF-8 encoding of '/'", "{\"\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
        NULL),
    HDR("UTF-8 encoded surrogate", "{\"\xed\xa0\x80\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
        NULL),
    HDR("UTF-8 sequence cut off by the end of the header", "{}\xe2\x82", 0, NULL),
    HDR("header starting with a byte-order mark", "\xef\xbb\xbf{" GOOD "}", 8, NULL),
    HDR("header starting with a letter", "x{" GOOD "}", 8, NULL),
    HDR("JSON 128 levels deep in an unknown key",
        "{\"" TENSOR "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":"
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
        "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
        "}}", 8, TENSOR),
    HDR("JSON array instead of an object", "[{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}]", 8, NULL),
    HDR("invalid JSON (unclosed object)", "{" GOOD, 8, NULL),
    HDR("invalid JSON (unquoted key)", "{blk:{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, NULL),
    HDR("trailing garbage after the JSON", "{" GOOD "}x", 8, NULL),
    HDR("a second JSON value after the object", "{" GOOD "}{}", 8, NULL),
    HDR("unknown dtype", "{" ENTRY(TENSOR, "F17", "[2]", "[0,8]") "}", 8, TENSOR),
    HDR("lowercase dtype bf16", "{" ENTRY(TENSOR, "bf16", "[4]", "[0,8]") "}", 8, TENSOR),
    HDR("dtype not a string", "{\"" TENSOR "\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, TENSOR),
    HDR("missing dtype", "{\"" TENSOR "\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, TENSOR),
    HDR("dtype given twice",
        "{\"" TENSOR "\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, TENSOR),
    HDR("missing data_offsets", "{\"" TENSOR "\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, TENSOR),
    /* Numbers are vetted on the raw text, before parsing; the entry they are in is named. */
    HDR("negative shape", "{" ENTRY(TENSOR, "F32", "[-2]", "[0,8]") "}", 8, TENSOR),
    HDR("shape 1.5", "{" ENTRY(TENSOR, "F32", "[1.5]", "[0,4]") "}", 4, TENSOR),
    HDR("shape 1.0 (float literal)", "{" ENTRY(TENSOR, "F32", "[1.0]", "[0,4]") "}", 4, TENSOR),
    HDR("shape -0", "{" ENTRY(TENSOR, "F32", "[-0]", "[0,0]") "}", 0, TENSOR),
    HDR("shape 1e3", "{" ENTRY(TENSOR, "U8", "[1e3]", "[0,1000]") "}", 1000, TENSOR),
    HDR("number with a leading zero", "{" ENTRY(TENSOR, "F32", "[01]", "[0,4]") "}", 4, TENSOR),
    HDR("huge number 1e30", "{" ENTRY(TENSOR, "F32", "[1e30]", "[0,4]") "}", 4, TENSOR),
    HDR("17-digit integer", "{" ENTRY(TENSOR, "U8", "[12345678901234567]", "[0,1]") "}", 1, TENSOR),
    HDR("a float in an unknown key", "{" ENTRY("a", "F32", "[1]", "[0,4]") ",\"" TENSOR
        "\":{\"dtype\":\"F32\",\"x\":-1.5,\"shape\":[1],\"data_offsets\":[4,8]}}", 8, TENSOR),
    HDR("shape entry a string", "{" ENTRY(TENSOR, "F32", "[\"2\"]", "[0,8]") "}", 8, TENSOR),
    HDR("shape entry null", "{" ENTRY(TENSOR, "F32", "[null]", "[0,8]") "}", 8, TENSOR),
    HDR("shape not an array", "{" ENTRY(TENSOR, "F32", "2", "[0,8]") "}", 8, TENSOR),
    HDR("shape product overflows 64 bits", "{" ENTRY(TENSOR, "U8", "[4294967296,4294967296,16]", "[0,8]") "}", 8,
        TENSOR),
    HDR("data_offsets not a pair (one)", "{" ENTRY(TENSOR, "F32", "[2]", "[0]") "}", 8, TENSOR),
    HDR("data_offsets not a pair (three)", "{" ENTRY(TENSOR, "F32", "[2]", "[0,8,8]") "}", 8, TENSOR),
    HDR("data_offsets not an array", "{" ENTRY(TENSOR, "F32", "[2]", "8") "}", 8, TENSOR),
    HDR("data_offsets strings", "{" ENTRY(TENSOR, "F32", "[2]", "[\"0\",\"8\"]") "}", 8, TENSOR),
    HDR("data_offsets beyond 2^53", "{" ENTRY(TENSOR, "F32", "[2]", "[0,9007199254740993]") "}", 8, TENSOR),
    HDR("data_offsets begin after end", "{" ENTRY(TENSOR, "F32", "[2]", "[8,0]") "}", 8, TENSOR),
    HDR("offsets not starting at 0", "{" ENTRY(TENSOR, "F32", "[2]", "[8,16]") "}", 16, TENSOR),
    HDR("gap between tensors", "{" ENTRY("a", "F32", "[2]", "[0,8]") "," ENTRY(TENSOR, "F32", "[2]", "[12,20]") "}",
        20, TENSOR),
    HDR("overlapping tensors", "{" ENTRY("a", "F32", "[2]", "[0,8]") "," ENTRY(TENSOR, "F32", "[2]", "[4,12]") "}",
        12, TENSOR),
    HDR("data size not shape x dtype", "{" ENTRY(TENSOR, "F32", "[2]", "[0,4]") "}", 4, TENSOR),
    HDR("F4 element count not filling whole bytes", "{" ENTRY(TENSOR, "F4", "[3]", "[0,2]") "}", 2, TENSOR),
    HDR("buffer shorter than the offsets claim", "{" GOOD "}", 4, NULL),
    HDR("extra bytes after the last tensor", "{" GOOD "}", 12, NULL),
    HDR("duplicate tensor name", "{" GOOD "," ENTRY(TENSOR, "F32", "[2]", "[8,16]") "}", 16, TENSOR),
    HDR("duplicate __metadata__", "{\"__metadata__\":{},\"__metadata__\":{}," GOOD "}", 8, NULL),
    HDR("__metadata__ value not a string", "{\"__metadata__\":{\"format\":1}," GOOD "}", 8, NULL),
    HDR("__metadata__ not an object", "{\"__metadata__\":\"pt\"," GOOD "}", 8, NULL),
    HDR("__metadata__ key given twice", "{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}," GOOD "}", 8, NULL),
    HDR("tensor entry not an object", "{\"" TENSOR "\":[2]}", 0, TENSOR),
    {.what = "NUL byte in the header",
     .header = "{\"" TENSOR "\0\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
     .header_len = sizeof("{\"" TENSOR "\0\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}") - 1,
     .data_len = 8},
};
#define N_BAD (sizeof BAD / sizeof BAD[0])

struct scratch {
    char *dir;
    const struct bad_file *bad;
};

static int scratch_setup(void **state)
{
    struct scratch *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    s->bad = *state; /* the table entry, for the malformed-file tests */
    s->dir = tu_mkdtemp();
    nf4_clear_error();
    *state = s;
    return 0;
}

static int scratch_teardown(void **state)
{
    struct scratch *s = *state;
    tu_rmtree(s->dir);
    free(s->dir);
    free(s);
    return 0;
}

static void write_bad_file(const struct bad_file *b, const char *path)
{
    if (b->raw) {
        tu_write_file(path, b->raw, b->raw_len);
        return;
    }
    static const unsigned char ZEROS[1024];
    assert_true(b->data_len <= sizeof ZEROS);
    size_t len = b->header_len ? b->header_len : strlen(b->header);
    tu_write_safetensors_raw(path, b->header, len, ZEROS, b->data_len);
}

static void assert_one_line_error(const struct bad_file *b, const char *cmd, const struct tu_run *r,
                                  const char *in)
{
    if (r->status != NF4_EDATA)
        fail_msg("%s: %s exited %d, expected 65; stderr: %s", b->what, cmd, r->status, r->err);
    if (tu_lines(r->err) != 1 || r->err[strlen(r->err) - 1] != '\n')
        fail_msg("%s: %s: stderr is not exactly one line: [%s]", b->what, cmd, r->err);
    char *prefix = tu_strdupf("nf4deq: %s: ", in);
    if (strncmp(r->err, prefix, strlen(prefix)) != 0)
        fail_msg("%s: %s: stderr does not start with \"%s\": %s", b->what, cmd, prefix, r->err);
    free(prefix);
    if (b->tensor) {
        char *named = tu_strdupf(": %s: ", b->tensor);
        if (!strstr(r->err, named))
            fail_msg("%s: %s: stderr does not name tensor %s: %s", b->what, cmd, b->tensor, r->err);
        free(named);
    }
}

static void test_malformed_file_is_refused(void **state)
{
    struct scratch *s = *state;
    const struct bad_file *b = s->bad;
    char *in = tu_strdupf("%s/in.safetensors", s->dir);
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    write_bad_file(b, in);

    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, NULL);
    assert_one_line_error(b, "convert", &r, in);
    if (tu_count_entries(s->dir) != 1)
        fail_msg("%s: convert left %d entries in the output directory", b->what, tu_count_entries(s->dir) - 1);
    tu_run_free(&r);

    r = tu_run("inspect", in, NULL);
    assert_one_line_error(b, "inspect", &r, in);
    assert_string_equal(r.out, "");
    tu_run_free(&r);
    free(in);
    free(out);
}

/* The table's baseline, unbroken, must convert: otherwise every case above
 * could be failing for the same unrelated reason. */
static void test_baseline_of_the_table_is_accepted(void **state)
{
    struct scratch *s = *state;
    char *in = tu_strdupf("%s/in.safetensors", s->dir);
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    static const unsigned char DATA[8];
    const char *header = "{" GOOD "," ENTRY("z", "F4", "[4]", "[8,10]") "}  ";
    unsigned char data[10] = {0};
    memcpy(data, DATA, sizeof DATA);
    tu_write_safetensors_raw(in, header, strlen(header), data, sizeof data);
    struct tu_run r = tu_run("convert", "--device", "cpu", "-q", in, out, NULL);
    if (r.status != 0)
        fail_msg("baseline exited %d: %s", r.status, r.err);
    assert_string_equal(r.err, "");
    tu_run_free(&r);
    assert_true(tu_exists(out));
    free(in);
    free(out);
}

/* ---- st_parse_header on valid headers ---- */

static void parse_ok(struct st_file *f, const char *json, uint64_t data_len)
{
    nf4_clear_error();
    int code = st_parse_header(f, json, strlen(json), data_len);
    if (code != NF4_OK)
        fail_msg("st_parse_header(%s) = %d: %s", json, code, nf4_last_error());
}

static void test_parse_empty_object_with_no_data(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{}", 0);
    assert_int_equal(f.count, 0);
    assert_false(f.has_metadata);
    assert_null(st_find(&f, "x"));
    st_free_header(&f);
    /* Even with no tensors, stray data bytes are refused. */
    assert_int_equal(st_parse_header(&f, "{}", 2, 1), NF4_EDATA);
    st_free_header(&f);
}

/* A shape of millions of dimensions is a few bytes per value in the header
 * and about 80 in cJSON: refused before parsing, by count, not by memory. */
static void test_parse_refuses_headers_of_too_many_values(void **state)
{
    (void)state;
    const size_t dims = (size_t)ST_MAX_HEADER_VALUES; /* with the object, key and offsets: past the bound */
    const char *head = "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1],\"shape\":[";
    size_t hlen = strlen(head), len = hlen + 2 * dims + 2; /* "1," x dims, the last ',' as ']', then "}}" */
    char *json = malloc(len + 1);
    assert_non_null(json);
    memcpy(json, head, hlen);
    for (size_t i = 0; i < dims; i++)
        memcpy(json + hlen + 2 * i, "1,", 2);
    memcpy(json + len - 3, "]}}", 4);
    struct st_file f = {.path = "mem"};
    nf4_clear_error();
    assert_int_equal(st_parse_header(&f, json, len, 1), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "JSON values"));
    st_free_header(&f);
    free(json);
}

static void test_parse_metadata_only(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"a \\\"quoted\\\" {x}\"}}", 0);
    assert_int_equal(f.count, 0);
    assert_true(f.has_metadata);
    assert_int_equal(f.nmeta, 2);
    assert_string_equal(f.meta[0].key, "format");
    assert_string_equal(f.meta[0].value, "pt");
    assert_string_equal(f.meta[1].key, "note");
    assert_string_equal(f.meta[1].value, "a \"quoted\" {x}");
    st_free_header(&f);
}

/* The reference reads "__metadata__": null as no metadata. */
static void test_parse_null_metadata(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{\"__metadata__\":null," GOOD "}", 8);
    assert_int_equal(f.count, 1);
    assert_int_equal(f.nmeta, 0);
    st_free_header(&f);
}

static void test_parse_zero_sized_tensor(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{" ENTRY("a", "F32", "[2]", "[0,8]") "," ENTRY("z", "F32", "[0,4]", "[8,8]") "}", 8);
    const struct st_tensor *z = st_find(&f, "z");
    assert_non_null(z);
    assert_int_equal(z->ndim, 2);
    assert_int_equal(z->shape[0], 0);
    assert_int_equal(z->shape[1], 4);
    assert_int_equal(z->nelem, 0);
    assert_int_equal(st_tensor_bytes(z), 0);
    st_free_header(&f);
    /* An empty tensor at offset 0 of an otherwise empty buffer. */
    parse_ok(&f, "{" ENTRY("z", "BF16", "[0,4]", "[0,0]") "}", 0);
    assert_int_equal(f.count, 1);
    st_free_header(&f);
}

static void test_parse_scalar_tensor(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{" ENTRY("s", "F64", "[]", "[0,8]") "}", 8);
    const struct st_tensor *t = st_find(&f, "s");
    assert_non_null(t);
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->nelem, 1);
    assert_int_equal(t->dtype, DT_F64);
    st_free_header(&f);
}

static void test_parse_sub_byte_dtype_needs_whole_bytes(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{" ENTRY("q", "F4", "[2,3]", "[0,3]") "}", 3);
    assert_int_equal(st_find(&f, "q")->nelem, 6);
    st_free_header(&f);
    parse_ok(&f, "{" ENTRY("q", "F6_E2M3", "[4]", "[0,3]") "}", 3);
    st_free_header(&f);
    parse_ok(&f, "{" ENTRY("p", "F8_E4M3FNUZ", "[3]", "[0,3]") "," ENTRY("q", "F8_E5M2FNUZ", "[2]", "[3,5]") "}", 5);
    assert_int_equal(st_find(&f, "p")->dtype, DT_F8_E4M3FNUZ);
    assert_int_equal(st_find(&f, "q")->dtype, DT_F8_E5M2FNUZ);
    st_free_header(&f);
    const char *odd = "{" ENTRY("q", "F4", "[3]", "[0,2]") "}";
    nf4_clear_error();
    assert_int_equal(st_parse_header(&f, odd, strlen(odd), 2), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "mem: q: "));
    st_free_header(&f);
}

static void test_parse_header_padded_with_white_space(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, " \t\r\n{" GOOD "}", 8); /* safetensors 0.8 lets writers pad at the front */
    assert_int_equal(f.count, 1);
    st_free_header(&f);
    parse_ok(&f, "{" GOOD "}       ", 8);
    assert_int_equal(f.count, 1);
    const struct st_tensor *t = st_find(&f, TENSOR);
    assert_non_null(t);
    assert_int_equal(t->dtype, DT_F32);
    assert_int_equal(t->begin, 0);
    assert_int_equal(t->end, 8);
    st_free_header(&f);
}

static void test_parse_orders_lookup_by_name_not_by_offset(void **state)
{
    (void)state;
    struct st_file f = {.path = "mem"};
    parse_ok(&f, "{" ENTRY("c", "U8", "[1]", "[0,1]") "," ENTRY("a", "U8", "[2]", "[1,3]") "," ENTRY("b", "U8", "[3]",
                                                                                                     "[3,6]") "}",
             6);
    assert_string_equal(f.by_name[0]->name, "a");
    assert_string_equal(f.by_name[1]->name, "b");
    assert_string_equal(f.by_name[2]->name, "c");
    assert_string_equal(f.tensors[0].name, "c"); /* header order kept */
    assert_int_equal(st_find(&f, "b")->begin, 3);
    st_free_header(&f);
}

/* ---- writer ---- */

static const uint64_t SHAPE_3[] = {3}, SHAPE_2x2[] = {2, 2}, SHAPE_2[] = {2}, SHAPE_1[] = {1};
static const struct st_out_tensor WRITER_TENSORS[] = {
    {"b.w", DT_U8, 1, SHAPE_3},   {"a.x", DT_BF16, 2, SHAPE_2x2}, {"c", DT_F32, 1, SHAPE_2},
    {"a", DT_F32, 1, SHAPE_1},    {"z", DT_BF16, 1, SHAPE_1},     {"a.u8", DT_U8, 1, SHAPE_1},
};
#define N_WRITER (sizeof WRITER_TENSORS / sizeof WRITER_TENSORS[0])

/* Each tensor's bytes are its index repeated, so misplaced data shows. */
static void fill_for(size_t index, unsigned char *buf, size_t len)
{
    memset(buf, (int)(0x10 + index), len);
}

static void test_writer_round_trip_layout(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    static const struct st_meta META[] = {{"source", "unit \"test\""}};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, WRITER_TENSORS, N_WRITER, META, 1), NF4_OK);
    static const char *const WANT_ORDER[] = {"a", "c", "a.x", "z", "a.u8", "b.w"};
    for (size_t k = 0; k < N_WRITER; k++) {
        size_t idx = st_writer_order(w, k);
        assert_string_equal(WRITER_TENSORS[idx].name, WANT_ORDER[k]);
        unsigned char buf[16];
        uint64_t n = st_writer_tensor_bytes(w, idx);
        assert_true(n <= sizeof buf);
        fill_for(idx, buf, n);
        assert_int_equal(st_writer_write(w, buf, n), NF4_OK);
    }
    assert_int_equal(st_writer_total_bytes(w), 4 + 8 + 8 + 2 + 1 + 3);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    assert_int_equal(tu_count_entries(s->dir), 1);

    size_t len;
    char *raw = tu_read_file(path, &len);
    assert_non_null(raw);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--)
        header_len = (header_len << 8) | (unsigned char)raw[i];
    assert_int_equal(header_len % 8, 0);
    assert_int_equal(len, 8 + header_len + 26);
    cJSON *h = cJSON_ParseWithLength(raw + 8, header_len);
    assert_non_null(h);
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(h, "__metadata__");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "format")->valuestring, "pt");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "source")->valuestring, "unit \"test\"");
    /* The header lists tensors in file order, each aligned to its element size. */
    size_t k = 0;
    uint64_t expected_begin = 0;
    for (const cJSON *c = h->child; c; c = c->next) {
        if (strcmp(c->string, "__metadata__") == 0)
            continue;
        assert_string_equal(c->string, WANT_ORDER[k]);
        const cJSON *offs = cJSON_GetObjectItemCaseSensitive(c, "data_offsets");
        uint64_t begin = (uint64_t)cJSON_GetArrayItem(offs, 0)->valuedouble;
        assert_int_equal(begin, expected_begin);
        expected_begin = (uint64_t)cJSON_GetArrayItem(offs, 1)->valuedouble;
        enum st_dtype dt = dtype_from_name(cJSON_GetObjectItemCaseSensitive(c, "dtype")->valuestring);
        assert_int_equal((8 + header_len + begin) % (dtype_bits(dt) / 8), 0);
        k++;
    }
    assert_int_equal(k, N_WRITER);
    cJSON_Delete(h);
    free(raw);

    struct st_file *f;
    assert_int_equal(st_open(path, &f), NF4_OK);
    assert_int_equal(f->count, N_WRITER);
    for (size_t i = 0; i < N_WRITER; i++) {
        const struct st_tensor *t = st_find(f, WRITER_TENSORS[i].name);
        assert_non_null(t);
        assert_int_equal(t->dtype, WRITER_TENSORS[i].dtype);
        assert_int_equal(t->ndim, WRITER_TENSORS[i].ndim);
        unsigned char got[16], want[16];
        uint64_t n = st_tensor_bytes(t);
        fill_for(i, want, n);
        assert_int_equal(st_read(f, t, 0, got, n), NF4_OK);
        assert_memory_equal(got, want, n);
    }
    st_close(f);
    free(path);
}

/* A file of metadata and no tensor, at DIR/w.safetensors (returned). */
static char *write_metadata_only(const struct scratch *s, const struct st_meta *meta, size_t nmeta)
{
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, NULL, 0, meta, nmeta), NF4_OK);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    return path;
}

/* Metadata is escaped as safetensors' own writer (serde_json) escapes it, so a
 * header comes out byte for byte as the reference writes it. */
static void test_writer_escapes_metadata_as_the_reference(void **state)
{
    static const struct st_meta META[] = {{"note", "a\"b\\c\b\f\n\r\t\x01\x7f\xc2\x85"}};
    char *path = write_metadata_only(*state, META, 1);
    size_t len;
    char *bytes = tu_read_file(path, &len);
    static const char HEADER[] =
        "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"a\\\"b\\\\c\\b\\f\\n\\r\\t\\u0001\x7f\xc2\x85\"}}";
    assert_true(len >= 8 + sizeof HEADER - 1);
    assert_memory_equal(bytes + 8, HEADER, sizeof HEADER - 1);
    free(bytes);
    free(path);
}

/* A header over safetensors' 100 MB limit would be a file no reader opens
 * (the input's metadata can make one): refused, nothing written. */
static void test_writer_refuses_a_header_over_the_limit(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    const size_t n = ST_MAX_HEADER_BYTES / 2; /* newlines, 2 bytes each as \n: over the limit with the rest */
    char *big = malloc(n + 1);
    assert_non_null(big);
    memset(big, '\n', n);
    big[n] = '\0';
    const struct st_meta meta[] = {{"note", big}};
    struct st_writer *w = NULL;
    nf4_clear_error();
    assert_int_equal(st_writer_begin(&w, path, NULL, 0, meta, 1), NF4_EDATA);
    assert_null(w);
    assert_non_null(strstr(nf4_last_error(), "over the 100000000-byte limit of safetensors"));
    assert_int_equal(tu_count_entries(s->dir), 0);
    memset(big + 1000, 'x', n - 1000); /* 1000 newlines then letters: fits, and reads back */
    free(path);
    path = write_metadata_only(s, meta, 1);
    struct st_file *f;
    assert_int_equal(st_open(path, &f), NF4_OK);
    assert_string_equal(f->meta[1].value, big);
    st_close(f);
    free(big);
    free(path);
}

static void test_writer_keeps_a_given_format_once(void **state)
{
    static const struct st_meta META[] = {{"format", "pt"}};
    char *path = write_metadata_only(*state, META, 1);
    struct st_file *f;
    assert_int_equal(st_open(path, &f), NF4_OK);
    assert_int_equal(f->count, 0);
    assert_int_equal(f->nmeta, 1);
    assert_string_equal(f->meta[0].value, "pt");
    st_close(f);
    free(path);
}

static void test_writer_finish_fails_on_short_data_and_leaves_nothing(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, WRITER_TENSORS, N_WRITER, NULL, 0), NF4_OK);
    unsigned char buf[8] = {0};
    assert_int_equal(st_writer_write(w, buf, sizeof buf), NF4_OK);
    assert_int_not_equal(st_writer_finish(w), NF4_OK);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(path);
}

static void test_writer_refuses_writing_past_the_declared_size(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, WRITER_TENSORS, 1, NULL, 0), NF4_OK);
    unsigned char buf[4] = {0};
    assert_int_not_equal(st_writer_write(w, buf, sizeof buf), NF4_OK);
    st_writer_abort(w);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(path);
}

static void test_writer_abort_leaves_nothing(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, WRITER_TENSORS, N_WRITER, NULL, 0), NF4_OK);
    assert_int_equal(tu_count_entries(s->dir), 1); /* the temp file */
    unsigned char buf[4] = {0};
    assert_int_equal(st_writer_write(w, buf, sizeof buf), NF4_OK);
    st_writer_abort(w);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(path);
}

static void test_writer_refuses_duplicate_names(void **state)
{
    struct scratch *s = *state;
    char *path = tu_strdupf("%s/w.safetensors", s->dir);
    const struct st_out_tensor dup[] = {{"x", DT_U8, 1, SHAPE_1}, {"x", DT_F32, 1, SHAPE_1}};
    struct st_writer *w = NULL;
    assert_int_equal(st_writer_begin(&w, path, dup, 2, NULL, 0), NF4_EDATA);
    assert_null(w);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(path);
}

#define FIXTURE_TEST(fn) cmocka_unit_test_setup_teardown(fn, scratch_setup, scratch_teardown)

int main(void)
{
    static const struct CMUnitTest fixed[] = {
        FIXTURE_TEST(test_baseline_of_the_table_is_accepted),
        cmocka_unit_test(test_parse_empty_object_with_no_data),
        cmocka_unit_test(test_parse_metadata_only),
        cmocka_unit_test(test_parse_refuses_headers_of_too_many_values),
        cmocka_unit_test(test_parse_null_metadata),
        cmocka_unit_test(test_parse_zero_sized_tensor),
        cmocka_unit_test(test_parse_scalar_tensor),
        cmocka_unit_test(test_parse_sub_byte_dtype_needs_whole_bytes),
        cmocka_unit_test(test_parse_header_padded_with_white_space),
        cmocka_unit_test(test_parse_orders_lookup_by_name_not_by_offset),
        FIXTURE_TEST(test_writer_round_trip_layout),
        FIXTURE_TEST(test_writer_keeps_a_given_format_once),
        FIXTURE_TEST(test_writer_escapes_metadata_as_the_reference),
        FIXTURE_TEST(test_writer_refuses_a_header_over_the_limit),
        FIXTURE_TEST(test_writer_finish_fails_on_short_data_and_leaves_nothing),
        FIXTURE_TEST(test_writer_refuses_writing_past_the_declared_size),
        FIXTURE_TEST(test_writer_abort_leaves_nothing),
        FIXTURE_TEST(test_writer_refuses_duplicate_names),
    };
    /* One named test per malformed file, so a failure report says which rule broke. */
    struct CMUnitTest tests[N_BAD + sizeof fixed / sizeof fixed[0]];
    for (size_t i = 0; i < N_BAD; i++)
        tests[i] = (struct CMUnitTest){
            .name = BAD[i].what,
            .test_func = test_malformed_file_is_refused,
            .setup_func = scratch_setup,
            .teardown_func = scratch_teardown,
            .initial_state = (void *)&BAD[i],
        };
    memcpy(tests + N_BAD, fixed, sizeof fixed);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
