/* The public C ABI (include/nf4deq.h): the CPU entry point gives the fixture
 * bytes, bad arguments come back as codes with a message, and the GPU entry
 * point fails cleanly where there is no GPU. */
#include "test_util.h"

#include "gpu.h"
#include "nf4deq.h"

/* Reads a fixture tensor into a malloc'd buffer. */
static void *read_tensor(struct st_file *f, const char *name, uint64_t *bytes)
{
    const struct st_tensor *t = st_find(f, name);
    if (!t)
        fail_msg("fixture lacks %s", name);
    *bytes = st_tensor_bytes(t);
    void *buf = malloc(*bytes + 1);
    assert_int_equal(st_read(f, t, 0, buf, *bytes), NF4_OK);
    return buf;
}

static void test_cpu_entry_point_gives_bitsandbytes_bytes(void **state)
{
    (void)state;
    static const struct {
        const char *weight;
        uint64_t n;
        uint32_t blocksize;
        int nested, quant_type;
    } CASES[] = {
        {"model.a.weight", 256 * 512, 64, 1, NF4DEQ_NF4},  {"model.b.weight", 384 * 200, 64, 1, NF4DEQ_NF4},
        {"model.c.weight", 64 * 1000, 128, 1, NF4DEQ_NF4}, {"model.f.weight", 512 * 128, 64, 1, NF4DEQ_NF4},
        {"model.d.weight", 128 * 256, 64, 0, NF4DEQ_NF4},  {"model.e.weight", 96 * 320, 64, 1, NF4DEQ_FP4},
        {"model.g.weight", 4096, 256, 1, NF4DEQ_NF4},      {"model.h.weight", 300 * 301, 64, 1, NF4DEQ_NF4},
    };
    static const struct {
        int dtype;
        const char *file;
    } OUTS[] = {{NF4DEQ_FLOAT16, "f16"}, {NF4DEQ_BFLOAT16, "bf16"}, {NF4DEQ_FLOAT32, "f32"}};
    /* nested_offset of each weight, as its quant state stores it. */
    static const double OFFSETS[] = {0.12954378128051758, 0.13026687502861023, 0.14219434559345245,
                                     0.12993764877319336, 0, 0.1301473081111908,
                                     0.14574050903320312, 46.55316925048828};
    struct st_file *in;
    assert_int_equal(st_open(FIXTURES "/tensors.bnb4.safetensors", &in), NF4_OK);
    for (size_t o = 0; o < 3; o++) {
        char *path = tu_strdupf(FIXTURES "/tensors.expected-%s.safetensors", OUTS[o].file);
        struct st_file *want;
        assert_int_equal(st_open(path, &want), NF4_OK);
        for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
            char name[128];
            uint64_t b;
            void *packed = read_tensor(in, CASES[i].weight, &b);
            snprintf(name, sizeof name, "%s.absmax", CASES[i].weight);
            void *absmax = read_tensor(in, name, &b);
            void *nested = NULL, *code = NULL;
            if (CASES[i].nested) {
                snprintf(name, sizeof name, "%s.nested_absmax", CASES[i].weight);
                nested = read_tensor(in, name, &b);
                snprintf(name, sizeof name, "%s.nested_quant_map", CASES[i].weight);
                code = read_tensor(in, name, &b);
            }
            uint64_t want_bytes;
            void *expected = read_tensor(want, CASES[i].weight, &want_bytes);
            void *out = malloc(want_bytes);
            memset(out, 0xa5, want_bytes);
            int rc = nf4deq_dequantize_cpu(packed, absmax, nested, code, (float)OFFSETS[i], CASES[i].n,
                                           CASES[i].blocksize, 256, CASES[i].quant_type, OUTS[o].dtype, out, 2);
            if (rc != NF4DEQ_OK)
                fail_msg("%s: %s", CASES[i].weight, nf4deq_last_error());
            assert_string_equal(nf4deq_last_error(), "");
            if (memcmp(out, expected, want_bytes) != 0)
                fail_msg("%s as %s differs from bitsandbytes", CASES[i].weight, OUTS[o].file);
            free(packed);
            free(absmax);
            free(nested);
            free(code);
            free(expected);
            free(out);
        }
        st_close(want);
        free(path);
    }
    st_close(in);
}

static void test_bad_arguments_return_einval_with_a_message(void **state)
{
    (void)state;
    unsigned char packed[32] = {0}, codes[2] = {0};
    float nested[1] = {1}, code[256] = {0}, scales[2] = {1, 1};
    uint16_t out[64];
    struct {
        const char *why;
        int rc;
    } cases[] = {
        {"blocksize 48", nf4deq_dequantize_cpu(packed, scales, NULL, NULL, 0, 64, 48, 0, 0, 0, out, 1)},
        {"blocksize 8192", nf4deq_dequantize_cpu(packed, scales, NULL, NULL, 0, 64, 8192, 0, 0, 0, out, 1)},
        {"quant type 7", nf4deq_dequantize_cpu(packed, scales, NULL, NULL, 0, 64, 32, 0, 7, 0, out, 1)},
        {"out dtype -1", nf4deq_dequantize_cpu(packed, scales, NULL, NULL, 0, 64, 32, 0, 0, -1, out, 1)},
        {"nested blocksize 3", nf4deq_dequantize_cpu(packed, codes, nested, code, 0, 64, 32, 3, 0, 0, out, 1)},
        {"NULL out", nf4deq_dequantize_cpu(packed, scales, NULL, NULL, 0, 64, 32, 0, 0, 0, NULL, 1)},
        {"nested without code", nf4deq_dequantize_cpu(packed, codes, nested, NULL, 0, 64, 32, 256, 0, 0, out, 1)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].rc != NF4DEQ_EINVAL)
            fail_msg("%s: status %d, expected NF4DEQ_EINVAL", cases[i].why, cases[i].rc);
    assert_non_null(strstr(nf4deq_last_error(), "nested_code") ? "" : strstr(nf4deq_last_error(), "NULL"));
    assert_string_equal(nf4deq_strerror(NF4DEQ_EINVAL), "invalid argument");
    /* n = 0 is a valid, empty tensor. */
    assert_int_equal(nf4deq_dequantize_cpu(NULL, NULL, NULL, NULL, 0, 0, 64, 0, 0, 0, NULL, 1), NF4DEQ_OK);
}

static void test_versions(void **state)
{
    (void)state;
    assert_int_equal(nf4deq_abi_version(), NF4DEQ_ABI_VERSION);
    assert_string_equal(nf4deq_version(), NF4DEQ_VERSION);
}

static void test_cuda_entry_point_without_gpu_fails_cleanly(void **state)
{
    (void)state;
    if (gpu_device_count() > 0)
        skip();
    unsigned char packed[32] __attribute__((aligned(16))) = {0};
    float scales[2] = {1, 1};
    uint16_t out[64] __attribute__((aligned(16)));
    int rc = nf4deq_dequantize_cuda(packed, scales, NULL, NULL, 0, NULL, 64, 32, 0, 0, 0, out, NULL);
    assert_true(rc == NF4DEQ_ENODEV || rc == NF4DEQ_ECUDA);
    assert_true(strlen(nf4deq_last_error()) > 0);
    assert_int_equal(tu_lines(nf4deq_last_error()), 0);
}

/* The state form checks what the long form checks, and the empty launch says
 * why it cannot run. (On a GPU, bindings/python/tests/test_gpu.py drives the
 * state form against bitsandbytes on every case.) */
static void test_state_entry_and_empty_launch_without_gpu(void **state)
{
    (void)state;
    assert_int_equal(nf4deq_dequantize_cuda_state(NULL, NULL, NULL, NULL), NF4DEQ_EINVAL);
    assert_non_null(strstr(nf4deq_last_error(), "state"));
    unsigned char packed[32] __attribute__((aligned(16))) = {0};
    float scales[2] = {1, 1};
    uint16_t out[64] __attribute__((aligned(16)));
    struct nf4deq_state st = {.absmax = scales, .n = 64, .blocksize = 48, .quant_type = NF4DEQ_NF4,
                              .out_dtype = NF4DEQ_BFLOAT16};
    assert_int_equal(nf4deq_dequantize_cuda_state(&st, packed, out, NULL), NF4DEQ_EINVAL); /* blocksize 48 */
    if (gpu_device_count() > 0)
        return;
    st.blocksize = 32;
    int rc = nf4deq_dequantize_cuda_state(&st, packed, out, NULL);
    assert_true(rc == NF4DEQ_ENODEV || rc == NF4DEQ_ECUDA);
    rc = nf4deq_empty_cuda(NULL);
    assert_true(rc == NF4DEQ_ENODEV || rc == NF4DEQ_ECUDA);
    assert_int_equal(tu_lines(nf4deq_last_error()), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_state_entry_and_empty_launch_without_gpu),
        cmocka_unit_test(test_cpu_entry_point_gives_bitsandbytes_bytes),
        cmocka_unit_test(test_bad_arguments_return_einval_with_a_message),
        cmocka_unit_test(test_versions),
        cmocka_unit_test(test_cuda_entry_point_without_gpu_fails_cleanly),
    };
    return cmocka_run_group_tests_name("api", tests, NULL, NULL);
}
