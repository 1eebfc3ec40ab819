/* End-to-end conversions: every fixture, in every mode, compared byte for byte
 * with what bitsandbytes wrote; and synthetic weights of awkward sizes compared
 * with an element-by-element reference. */
#include "test_util.h"

#include <cJSON.h>

#include "bnb_state.h"
#include "convert.h"
#include "fpconv.h"
#include "model.h"

/* Compares the tensor `name` of two opened models. */
static void assert_tensor_matches(const struct model *got, const char *got_name, const struct st_file *want,
                                  const char *want_name)
{
    const struct model_tensor *g = model_find(got, got_name);
    const struct st_tensor *w = st_find(want, want_name);
    if (!g || !w)
        fail_msg("tensor %s missing (got %p, want %p)", got_name, (void *)g, (const void *)w);
    if (g->t->dtype != w->dtype)
        fail_msg("%s: dtype %s, expected %s", got_name, dtype_name(g->t->dtype), dtype_name(w->dtype));
    assert_int_equal(g->t->ndim, w->ndim);
    for (size_t d = 0; d < w->ndim; d++)
        assert_int_equal(g->t->shape[d], w->shape[d]);
    uint64_t n = st_tensor_bytes(w);
    assert_int_equal(st_tensor_bytes(g->t), n);
    unsigned char *a = malloc(n + 1), *b = malloc(n + 1);
    assert_int_equal(st_read(g->file, g->t, 0, a, n), NF4_OK);
    assert_int_equal(st_read(want, w, 0, b, n), NF4_OK);
    if (memcmp(a, b, n) != 0) {
        uint64_t k = 0;
        while (a[k] == b[k])
            k++;
        fail_msg("%s: byte %llu is 0x%02x, expected 0x%02x", got_name, (unsigned long long)k, a[k], b[k]);
    }
    free(a);
    free(b);
}

/* Every tensor of `expected` must be in the converted output, identical, and
 * the output must hold nothing else. */
static void assert_output_matches(const char *out, int is_dir, const char *expected)
{
    struct model *got;
    assert_int_equal(is_dir ? model_open_dir(out, &got) : model_open_file(out, &got), NF4_OK);
    struct st_file *want;
    assert_int_equal(st_open(expected, &want), NF4_OK);
    assert_int_equal(got->count, want->count);
    for (size_t i = 0; i < want->count; i++)
        assert_tensor_matches(got, want->tensors[i].name, want, want->tensors[i].name);
    st_close(want);
    model_close(got);
}

static void convert_ok(const char *in, const char *out, const char *dtype)
{
    struct tu_run r = dtype ? tu_run("convert", "-q", "--device", "cpu", "--dtype", dtype, in, out, NULL)
                            : tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    if (r.status != 0)
        fail_msg("convert %s -> %s exited %d: %s", in, out, r.status, r.err);
    assert_string_equal(r.err, "");
    tu_run_free(&r);
}

static void tensor_file_every_dtype(const char *dir)
{
    static const char *const DTYPES[][2] = {{"bf16", "bf16"}, {"fp16", "f16"}, {"fp32", "f32"}};
    for (size_t i = 0; i < 3; i++) {
        char *out = tu_strdupf("%s/out-%s.safetensors", dir, DTYPES[i][0]);
        char *want = tu_strdupf(FIXTURES "/tensors.expected-%s.safetensors", DTYPES[i][1]);
        convert_ok(FIXTURES "/tensors.bnb4.safetensors", out, DTYPES[i][0]);
        assert_output_matches(out, 0, want);
        free(out);
        free(want);
    }
}

static void test_tensor_file_every_dtype(void **state)
{
    struct tu_scratch *s = *state;
    tensor_file_every_dtype(s->dir);
}

/* Weights of no elements, as bitsandbytes writes them: under double quant
 * the quant state's nested_offset is Python's bare NaN. The whole file,
 * header included, is what bitsandbytes returns. */
static void test_weights_of_no_elements(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/empty-weights.safetensors", s->dir);
    convert_ok(FIXTURES "/empty-weights.bnb4.safetensors", out, NULL);
    size_t got_len, want_len;
    char *got = tu_read_file(out, &got_len);
    char *want = tu_read_file(FIXTURES "/empty-weights.expected.safetensors", &want_len);
    assert_int_equal(got_len, want_len);
    assert_memory_equal(got, want, want_len);
    free(got);
    free(want);
    free(out);
}

/* Without --dtype each weight comes out in its quant state's dtype, which is
 * what bitsandbytes returns, and other tensors are untouched. */
static void test_tensor_file_natural_dtype(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/natural.safetensors", s->dir);
    convert_ok(FIXTURES "/tensors.bnb4.safetensors", out, NULL);
    struct model *got;
    assert_int_equal(model_open_file(out, &got), NF4_OK);
    static const struct {
        const char *name, *expected;
    } CASES[] = {
        {"model.a.weight", "bf16"}, {"model.b.weight", "f16"}, {"model.c.weight", "bf16"},
        {"model.d.weight", "f16"},  {"model.e.weight", "bf16"}, {"model.f.weight", "bf16"},
        {"model.g.weight", "f16"},  {"model.h.weight", "f32"}, {"model.norm.weight", "bf16"},
    };
    assert_int_equal(got->count, sizeof CASES / sizeof CASES[0]);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        char *want_path = tu_strdupf(FIXTURES "/tensors.expected-%s.safetensors", CASES[i].expected);
        struct st_file *want;
        assert_int_equal(st_open(want_path, &want), NF4_OK);
        assert_tensor_matches(got, CASES[i].name, want, CASES[i].name);
        st_close(want);
        free(want_path);
    }
    model_close(got);
    free(out);
}

static void check_model_dir(const char *in, const char *out, const char *expected_dtype_torch)
{
    /* config.json: quantization_config gone, dtype set. */
    char *cfg_path = tu_strdupf("%s/config.json", out);
    char *cfg = tu_read_file(cfg_path, NULL);
    assert_non_null(cfg);
    cJSON *root = cJSON_Parse(cfg);
    assert_non_null(root);
    assert_null(cJSON_GetObjectItemCaseSensitive(root, "quantization_config"));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(root, "dtype")->valuestring, expected_dtype_torch);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(root, "torch_dtype")->valuestring, expected_dtype_torch);
    cJSON_Delete(root);
    free(cfg);
    free(cfg_path);
    /* Other files copied as they are. */
    char *a = tu_strdupf("%s/generation_config.json", in), *b = tu_strdupf("%s/generation_config.json", out);
    size_t la, lb;
    char *ca = tu_read_file(a, &la), *cb = tu_read_file(b, &lb);
    assert_non_null(cb);
    assert_int_equal(la, lb);
    assert_memory_equal(ca, cb, la);
    free(ca);
    free(cb);
    free(a);
    free(b);
    /* A sharded model keeps its shard names, and its index lists no quant state
     * and adds up to the real size. */
    char *index_in = tu_strdupf("%s/" INDEX_FILE_NAME, in);
    if (tu_exists(index_in)) {
        char *index_out = tu_strdupf("%s/" INDEX_FILE_NAME, out);
        char *text = tu_read_file(index_out, NULL);
        assert_non_null(text);
        cJSON *idx = cJSON_Parse(text);
        assert_non_null(idx);
        const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
        struct model *m;
        assert_int_equal(model_open_dir(out, &m), NF4_OK);
        assert_int_equal((size_t)cJSON_GetArraySize(map), m->count);
        uint64_t total = 0;
        for (size_t i = 0; i < m->count; i++)
            total += st_tensor_bytes(m->tensors[i].t);
        for (const cJSON *c = map->child; c; c = c->next)
            assert_false(bnb_is_state_part(c->string));
        const cJSON *meta = cJSON_GetObjectItemCaseSensitive(idx, "metadata");
        assert_int_equal((uint64_t)cJSON_GetObjectItemCaseSensitive(meta, "total_size")->valuedouble, total);
        for (size_t i = 0; i < m->nfiles; i++) {
            char *shard = tu_strdupf("%s/%s", in, m->file_names[i]);
            assert_true(tu_exists(shard));
            free(shard);
        }
        model_close(m);
        cJSON_Delete(idx);
        free(text);
        free(index_out);
    }
    free(index_in);
}

static void model_directories(const char *dir)
{
    static const char *const MODELS[] = {"bf16", "fp16"};
    static const char *const LAYOUTS[] = {"", "-sharded"};
    static const struct {
        const char *arg, *file, *torch;
    } DTYPES[] = {{"bf16", "bf16", "bfloat16"}, {"fp16", "f16", "float16"}, {NULL, NULL, NULL}};
    for (size_t m = 0; m < 2; m++)
        for (size_t l = 0; l < 2; l++)
            for (size_t d = 0; d < 3; d++) {
                char *in = tu_strdupf(FIXTURES "/tiny-llama-%s-bnb4%s", MODELS[m], LAYOUTS[l]);
                char *out = tu_strdupf("%s/%s%s-%s", dir, MODELS[m], LAYOUTS[l], DTYPES[d].arg ? DTYPES[d].arg : "natural");
                /* The natural dtype of a model is the dtype it was quantized from. */
                const char *file = DTYPES[d].file ? DTYPES[d].file : (m == 0 ? "bf16" : "f16");
                const char *torch = DTYPES[d].torch ? DTYPES[d].torch : (m == 0 ? "bfloat16" : "float16");
                char *want = tu_strdupf(FIXTURES "/tiny-llama-%s-bnb4.expected-%s.safetensors", MODELS[m], file);
                convert_ok(in, out, DTYPES[d].arg);
                assert_output_matches(out, 1, want);
                check_model_dir(in, out, torch);
                free(in);
                free(out);
                free(want);
            }
}

static void test_model_directories(void **state)
{
    struct tu_scratch *s = *state;
    model_directories(s->dir);
}

/* The fixtures again on every CPU path this machine has, forced through
 * NF4DEQ_CPU (the converter is a child process: it inherits it). */
static void test_every_cpu_path_on_fixtures(void **state)
{
    struct tu_scratch *s = *state;
    int ran = 0;
    for (int p = 0; p < CPU_PATH_COUNT; p++) {
        const char *name = cpu_path_name((enum cpu_path)p);
        if (!cpu_path_supported((enum cpu_path)p)) {
            print_message("%s: not supported here, skipped\n", name);
            continue;
        }
        char *dir = tu_strdupf("%s/%s", s->dir, name);
        assert_int_equal(mkdir(dir, 0755), 0);
        assert_int_equal(setenv(CPU_PATH_ENV, name, 1), 0);
        tensor_file_every_dtype(dir);
        model_directories(dir);
        unsetenv(CPU_PATH_ENV);
        free(dir);
        ran++;
    }
    assert_true(ran >= 1);
}

/* A bad NF4DEQ_CPU, or an on/off switch that is neither 0 nor 1, stops the
 * run before anything is written. */
static void test_bad_cpu_path_is_refused(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/never.safetensors", s->dir);
    static const struct {
        const char *name, *value, *message;
        int status;
    } CASES[] = {
        {CPU_PATH_ENV, "avx3", "nf4deq: NF4DEQ_CPU=avx3 is not a CPU path (scalar, sse, avx2, avx512 or neon)\n", 2},
#if defined(__x86_64__)
        {CPU_PATH_ENV, "neon", "nf4deq: NF4DEQ_CPU=neon: this processor or build has no neon path\n", 69},
#endif
        {"NF4DEQ_OUTPUT_MAP", "yes", "nf4deq: NF4DEQ_OUTPUT_MAP=yes: set it to 0 or 1\n", 2},
        {"NF4DEQ_GPU_ONLY", "true", "nf4deq: NF4DEQ_GPU_ONLY=true: set it to 0 or 1\n", 2},
        {"NF4DEQ_GPU_HANDOFF", "00", "nf4deq: NF4DEQ_GPU_HANDOFF=00: set it to 0 or 1\n", 2},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        assert_int_equal(setenv(CASES[i].name, CASES[i].value, 1), 0);
        struct tu_run r = tu_run("convert", "--device", "cpu", FIXTURES "/tensors.bnb4.safetensors", out, NULL);
        unsetenv(CASES[i].name);
        assert_int_equal(r.status, CASES[i].status);
        assert_string_equal(r.err, CASES[i].message);
        assert_int_equal(tu_count_entries(s->dir), 0);
        tu_run_free(&r);
    }
    free(out);
}

/* Chunked dequantization (the smallest chunk a weight allows) writes the same bytes. */
static void test_smallest_chunks_same_bytes(void **state)
{
    struct tu_scratch *s = *state;
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.dtype = DT_BF16;
    o.chunk_elements = 1;
    o.threads = 3;
    struct convert_stats st;
    char *out = tu_strdupf("%s/chunked.safetensors", s->dir);
    nf4_set_quiet(1);
    assert_int_equal(convert_run(FIXTURES "/tensors.bnb4.safetensors", out, &o, &st), NF4_OK);
    assert_int_equal(st.dequantized, 8);
    assert_output_matches(out, 0, FIXTURES "/tensors.expected-bf16.safetensors");
    char *dir_out = tu_strdupf("%s/chunked-dir", s->dir);
    assert_int_equal(convert_run(FIXTURES "/tiny-llama-fp16-bnb4-sharded", dir_out, &o, &st), NF4_OK);
    assert_output_matches(dir_out, 1, FIXTURES "/tiny-llama-fp16-bnb4.expected-bf16.safetensors");
    free(out);
    free(dir_out);
}

/* ---- synthetic weights of awkward sizes ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

struct synth {
    uint64_t n;
    uint32_t blocksize, nested_blocksize;
    int nested;
    enum quant_type qt;
    enum st_dtype storage;
};

/* Writes a one-weight bnb4 file and returns its parts for the reference. */
static void write_synth(const char *path, const struct synth *sy, uint8_t **packed, uint8_t **codes, float **absmax,
                        float **nested_absmax, float *nested_code, float *offset)
{
    uint64_t bytes = sy->n / 2 + (sy->n & 1);
    unsigned item = dtype_bits(sy->storage) / 8;
    uint64_t stored = (bytes + item - 1) / item * item; /* storage rounds up to whole elements */
    uint64_t blocks = (sy->n + sy->blocksize - 1) / sy->blocksize;
    uint64_t nblocks = sy->nested ? (blocks + sy->nested_blocksize - 1) / sy->nested_blocksize : 0;
    *packed = calloc(stored + 1, 1);
    for (uint64_t i = 0; i < stored; i++)
        (*packed)[i] = (uint8_t)rng();
    *codes = calloc(blocks + 1, 1);
    *absmax = calloc(blocks + 1, sizeof(float));
    *nested_absmax = calloc(nblocks + 1, sizeof(float));
    for (uint64_t b = 0; b < blocks; b++) {
        (*codes)[b] = (uint8_t)rng();
        (*absmax)[b] = 0.01f + (float)(rng() % 1000) / 250.0f;
    }
    for (uint64_t b = 0; b < nblocks; b++)
        (*nested_absmax)[b] = 0.5f + (float)(rng() % 1000) / 700.0f;
    for (int k = 0; k < 256; k++)
        nested_code[k] = -1.0f + 2.0f * (float)k / 255.0f;
    *offset = 0.1234567f;

    char state_json[512];
    int len = sy->nested
                  ? snprintf(state_json, sizeof state_json,
                             "{\"quant_type\": \"%s\", \"blocksize\": %u, \"dtype\": \"bfloat16\", \"shape\": [1, %llu], "
                             "\"nested_blocksize\": %u, \"nested_dtype\": \"float32\", \"nested_offset\": %.9g}",
                             sy->qt == QUANT_FP4 ? "fp4" : "nf4", sy->blocksize, (unsigned long long)sy->n,
                             sy->nested_blocksize, (double)*offset)
                  : snprintf(state_json, sizeof state_json,
                             "{\"quant_type\": \"%s\", \"blocksize\": %u, \"dtype\": \"bfloat16\", \"shape\": [1, %llu]}",
                             sy->qt == QUANT_FP4 ? "fp4" : "nf4", sy->blocksize, (unsigned long long)sy->n);
    const float *table = sy->qt == QUANT_FP4 ? FP4_VALUES : NF4_VALUES;
    uint64_t packed_shape[2] = {stored / item, 1}, blocks_shape[1] = {blocks}, nested_shape[1] = {nblocks},
             map_shape[1] = {16}, code_shape[1] = {256}, blob_shape[1] = {(uint64_t)len};
    const char *blob_name = sy->qt == QUANT_FP4 ? "w.weight.quant_state.bitsandbytes__fp4"
                                                : "w.weight.quant_state.bitsandbytes__nf4";
    struct st_out_tensor t[6] = {
        {"w.weight", sy->storage, 2, packed_shape},
        {"w.weight.absmax", sy->nested ? DT_U8 : DT_F32, 1, blocks_shape},
        {"w.weight.quant_map", DT_F32, 1, map_shape},
        {blob_name, DT_U8, 1, blob_shape},
        {"w.weight.nested_absmax", DT_F32, 1, nested_shape},
        {"w.weight.nested_quant_map", DT_F32, 1, code_shape},
    };
    const void *data[6] = {*packed, sy->nested ? (const void *)*codes : (const void *)*absmax, table, state_json,
                           *nested_absmax, nested_code};
    size_t count = sy->nested ? 6 : 4;
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, t, count, NULL, 0), NF4_OK);
    for (size_t k = 0; k < count; k++) {
        size_t idx = st_writer_order(w, k);
        assert_int_equal(st_writer_write(w, data[idx], st_writer_tensor_bytes(w, idx)), NF4_OK);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
}

/* The formula, element by element, with nothing shared with the implementation
 * but the value tables: each absmax is recomputed for every element. */
static uint32_t reference_element(const struct synth *sy, uint64_t e, const uint8_t *packed, const uint8_t *codes,
                                  const float *absmax, const float *nested_absmax, const float *nested_code,
                                  float offset, enum st_dtype out)
{
    uint64_t b = e / sy->blocksize;
    volatile float scale;
    if (sy->nested) {
        volatile float prod = nested_code[codes[b]] * nested_absmax[b / sy->nested_blocksize];
        scale = prod + offset;
    } else {
        scale = absmax[b];
    }
    uint8_t byte = packed[e / 2];
    unsigned nib = (e % 2 == 0) ? (byte >> 4) : (byte & 15);
    const float *table = sy->qt == QUANT_FP4 ? FP4_VALUES : NF4_VALUES;
    volatile float v = table[nib] * scale;
    if (out == DT_F16)
        return f32_to_f16(v);
    if (out == DT_BF16)
        return f32_to_bf16(v);
    return f32_bits(v);
}

static void test_awkward_sizes_match_reference(void **state)
{
    struct tu_scratch *s = *state;
    static const uint64_t SIZES[] = {1, 63, 65, 1023, 1025, (1u << 20) + 3};
    static const uint32_t BLOCKSIZES[] = {32, 64, 128, 256, 512, 1024, 2048, 4096};
    static const enum st_dtype STORAGE[] = {DT_U8, DT_BF16, DT_F32};
    static const enum st_dtype OUTS[] = {DT_F16, DT_BF16, DT_F32};
    static const char *const OUT_NAMES[] = {"fp16", "bf16", "fp32"};
    int cases = 0;
    for (size_t si = 0; si < sizeof SIZES / sizeof SIZES[0]; si++)
        for (size_t bi = 0; bi < sizeof BLOCKSIZES / sizeof BLOCKSIZES[0]; bi++) {
            /* The largest size once per quant variant is enough to cover multi-chunk runs. */
            if (SIZES[si] > 4096 && bi % 3 != 0)
                continue;
            struct synth sy = {
                .n = SIZES[si],
                .blocksize = BLOCKSIZES[bi],
                .nested_blocksize = (bi % 2) ? 256 : 4,
                .nested = (bi + si) % 3 != 0,
                .qt = (bi + si) % 2 ? QUANT_FP4 : QUANT_NF4,
                .storage = STORAGE[(bi + si) % 3],
            };
            size_t oi = (si + bi) % 3;
            char *in = tu_strdupf("%s/synth-%zu-%zu.safetensors", s->dir, si, bi);
            char *out = tu_strdupf("%s/synth-%zu-%zu.out.safetensors", s->dir, si, bi);
            uint8_t *packed, *codes;
            float *absmax, *nested_absmax, nested_code[256], offset;
            write_synth(in, &sy, &packed, &codes, &absmax, &nested_absmax, nested_code, &offset);
            /* A small chunk makes the large sizes run through several chunks. */
            struct convert_opts o;
            convert_opts_init(&o);
            o.device = DEVICE_CPU;
            o.dtype = OUTS[oi];
            o.chunk_elements = 1u << 16;
            struct convert_stats st;
            nf4_set_quiet(1);
            if (convert_run(in, out, &o, &st) != NF4_OK)
                fail_msg("%s: %s", in, nf4_last_error());
            struct st_file *f;
            assert_int_equal(st_open(out, &f), NF4_OK);
            const struct st_tensor *t = st_find(f, "w.weight");
            assert_non_null(t);
            assert_int_equal(t->dtype, OUTS[oi]);
            assert_int_equal(t->nelem, sy.n);
            unsigned osize = dtype_bits(OUTS[oi]) / 8;
            unsigned char *got = malloc(sy.n * osize);
            assert_int_equal(st_read(f, t, 0, got, sy.n * osize), NF4_OK);
            for (uint64_t e = 0; e < sy.n; e++) {
                uint32_t want = reference_element(&sy, e, packed, codes, absmax, nested_absmax, nested_code, offset,
                                                  OUTS[oi]);
                uint32_t have = osize == 2 ? ((uint16_t *)got)[e] : ((uint32_t *)got)[e];
                if (have != want)
                    fail_msg("n=%llu blocksize=%u %s %s %s: element %llu is 0x%x, expected 0x%x",
                             (unsigned long long)sy.n, sy.blocksize, sy.qt == QUANT_FP4 ? "fp4" : "nf4",
                             sy.nested ? "nested" : "single", OUT_NAMES[oi], (unsigned long long)e, have, want);
            }
            st_close(f);
            free(got);
            free(packed);
            free(codes);
            free(absmax);
            free(nested_absmax);
            free(in);
            free(out);
            cases++;
        }
    assert_true(cases >= 30);
}

/* Thousands of tiny tensors travel in batches of whole tensors: several batches,
 * mixed source dtypes, casts with overflow, and every byte where it belongs. */
static void test_many_small_tensors_in_batches(void **state)
{
    struct tu_scratch *s = *state;
    enum { N = 3000 };
    struct st_out_tensor *t = calloc(N, sizeof *t);
    uint64_t *shapes = calloc(N, sizeof *shapes);
    char (*names)[16] = calloc(N, sizeof *names);
    float **values = calloc(N, sizeof *values);
    uint64_t expect_overflow = 0;
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "t.%05d", i);
        shapes[i] = (uint64_t)(i % 37); /* zero-sized ones too */
        t[i] = (struct st_out_tensor){names[i], i % 3 == 0 ? DT_F32 : DT_BF16, 1, &shapes[i]};
        values[i] = calloc(shapes[i] + 1, sizeof(float));
        for (uint64_t e = 0; e < shapes[i]; e++) {
            float v = (float)((int)(rng() % 20001) - 10000) * 0.37f;
            if (e == 3 && t[i].dtype == DT_F32 && i % 7 == 0) {
                v = 1e6f; /* finite in fp32, inf in fp16 */
                expect_overflow++;
            }
            values[i][e] = t[i].dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
        }
    }
    char *in = tu_strdupf("%s/many.safetensors", s->dir), *out = tu_strdupf("%s/many.out.safetensors", s->dir);
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, in, t, N, NULL, 0), NF4_OK);
    for (size_t k = 0; k < N; k++) {
        size_t i = st_writer_order(w, k);
        for (uint64_t e = 0; e < shapes[i]; e++) {
            if (t[i].dtype == DT_F32) {
                assert_int_equal(st_writer_write(w, &values[i][e], 4), NF4_OK);
            } else {
                uint16_t h = f32_to_bf16(values[i][e]);
                assert_int_equal(st_writer_write(w, &h, 2), NF4_OK);
            }
        }
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.dtype = DT_F16;
    o.mem = 1; /* the smallest slots: the batches fill and roll over */
    struct convert_stats st;
    nf4_set_quiet(1);
    assert_int_equal(convert_run(in, out, &o, &st), NF4_OK);
    assert_int_equal(st.tensors, N);
    assert_int_equal(st.overflowed, expect_overflow);
    struct st_file *f;
    assert_int_equal(st_open(out, &f), NF4_OK);
    for (int i = 0; i < N; i++) {
        const struct st_tensor *g = st_find(f, names[i]);
        assert_non_null(g);
        assert_int_equal(g->dtype, DT_F16);
        uint16_t got[64];
        assert_int_equal(st_read(f, g, 0, got, shapes[i] * 2), NF4_OK);
        for (uint64_t e = 0; e < shapes[i]; e++)
            if (got[e] != f32_to_f16(values[i][e]))
                fail_msg("%s[%llu] is 0x%04x, expected 0x%04x", names[i], (unsigned long long)e, got[e],
                         f32_to_f16(values[i][e]));
    }
    st_close(f);
    for (int i = 0; i < N; i++)
        free(values[i]);
    free(values);
    free(names);
    free(shapes);
    free(t);
    free(in);
    free(out);
}

/* A directory conversion's temp directory is named as the OUT it becomes,
 * and nothing else is: a sibling that only starts with its name keeps its own. */
static void test_messages_name_the_temp_dir_as_out(void **state)
{
    (void)state;
    static const struct {
        const char *file, *want;
    } CASES[] = {
        {"/m/.out.nf4deq-AbC123/model-00001-of-00002.safetensors", "/m/out/model-00001-of-00002.safetensors"},
        {"/m/.out.nf4deq-AbC123/transformer/config.json", "/m/out/transformer/config.json"},
        {"/m/.out.nf4deq-AbC123", "/m/out"},
        {"/m/.out.nf4deq-AbC1234/config.json", "/m/.out.nf4deq-AbC1234/config.json"},
        {"/m/in/model.safetensors", "/m/in/model.safetensors"},
    };
    for (int shown = 0; shown < 3; shown++) {
        /* "out/" as the user typed it: no doubled slash in what is shown. */
        nf4_show_dir_as(shown ? "/m/.out.nf4deq-AbC123" : NULL, shown == 1 ? "/m/out" : "/m/out//");
        for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
            nf4_clear_error();
            assert_int_equal(nf4_fail_errno(NF4_EIO, ENOSPC, CASES[i].file, NULL, "write failed"), NF4_EIO);
            const char *want = shown ? CASES[i].want : CASES[i].file;
            char text[512];
            snprintf(text, sizeof text, "%s: write failed: %s", want, strerror(ENOSPC));
            assert_string_equal(nf4_last_error(), text);
            assert_string_equal(nf4_last_error_record()->file, want);
        }
    }
    nf4_show_dir_as(NULL, NULL);
    nf4_clear_error();
    nf4_fail(NF4_EIO, CASES[0].file, "t", "x");
    assert_string_equal(nf4_last_error(), "/m/.out.nf4deq-AbC123/model-00001-of-00002.safetensors: t: x");
    nf4_clear_error();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_tensor_file_every_dtype, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_tensor_file_natural_dtype, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_weights_of_no_elements, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_model_directories, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_every_cpu_path_on_fixtures, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_bad_cpu_path_is_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_smallest_chunks_same_bytes, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_awkward_sizes_match_reference, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_many_small_tensors_in_batches, tu_scratch_setup, tu_scratch_teardown),
    };
    /* Once with the output written as this file system wants it (write(2), or
     * a mapping on tmpfs), then again through a mapping whatever the file
     * system, then again with write(2) alone: each way must give the same bytes. */
    int failed = cmocka_run_group_tests_name("convert", tests, NULL, NULL);
    setenv("NF4DEQ_OUTPUT_MAP", "1", 1);
    failed += cmocka_run_group_tests_name("convert, output through a mapping", tests, NULL, NULL);
    setenv("NF4DEQ_OUTPUT_MAP", "0", 1);
    failed += cmocka_run_group_tests_name("convert, output with write(2)", tests, NULL, NULL);
    const struct CMUnitTest once[] = {cmocka_unit_test(test_messages_name_the_temp_dir_as_out)};
    failed += cmocka_run_group_tests_name("messages", once, NULL, NULL);
    return failed;
}
