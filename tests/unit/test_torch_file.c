/* Pickled adapters (adapter_model.bin, torch.save): torch_pickle.h reads the
 * state dict without running it, zip_archive.h the archive around it, and
 * torch_file.h places each tensor's bytes in the file. The fixtures hold the
 * same tensors as adapters already tested, one written by the real PEFT, so
 * what they open as and merge into must equal those byte for byte. */
#include "test_util.h"

#include "lora.h"
#include "torch_file.h"
#include "torch_pickle.h"

#define LORA_FIXTURES FIXTURES "/lora"

/* Each pickled adapter, the adapter whose tensors it holds, and its base. */
static const struct {
    const char *pickled, *same_as, *base;
} PAIRS[] = {
    {"adapter-r16-qv-lmhead-pickled", "adapter-r16-qv-lmhead", "base-llama-bf16-bnb4"},  /* PEFT, protocol 2 */
    {"adapter-fp16-r4-pickled", "adapter-fp16-r4", "base-llama-fp16-fp4-bnb4"},          /* protocol 4, _metadata */
    {"adapter-r8-all-linear-pickled", "adapter-r8-all-linear", "base-llama-bf16-bnb4"},  /* views, Parameters */
};
#define NPAIRS (sizeof PAIRS / sizeof *PAIRS)

static void test_pickled_adapters_open_as_their_safetensors(void **state)
{
    (void)state;
    for (size_t i = 0; i < NPAIRS; i++) {
        char *bin = tu_strdupf("%s/%s/" ADAPTER_PICKLE_NAME, LORA_FIXTURES, PAIRS[i].pickled);
        char *st = tu_strdupf("%s/%s/" ADAPTER_WEIGHTS_NAME, LORA_FIXTURES, PAIRS[i].same_as);
        struct st_file *p, *s;
        assert_int_equal(torch_open(bin, &p), NF4_OK);
        assert_int_equal(st_open(st, &s), NF4_OK);
        assert_int_equal(p->count, s->count);
        for (size_t k = 0; k < s->count; k++) {
            const struct st_tensor *want = s->by_name[k], *got = st_find(p, want->name);
            assert_non_null(got);
            assert_int_equal(got->dtype, want->dtype);
            assert_int_equal(got->ndim, want->ndim);
            assert_memory_equal(got->shape, want->shape, want->ndim * sizeof *want->shape);
            assert_int_equal(st_tensor_bytes(got), st_tensor_bytes(want));
            size_t n = (size_t)st_tensor_bytes(want);
            unsigned char *a = malloc(n + 1), *b = malloc(n + 1);
            assert_int_equal(st_read(p, got, 0, a, n), NF4_OK);
            assert_int_equal(st_read(s, want, 0, b, n), NF4_OK);
            assert_memory_equal(a, b, n);
            free(a);
            free(b);
        }
        st_close(p);
        st_close(s);
        free(bin);
        free(st);
    }
}

static void test_pickled_adapters_merge_byte_identical(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const DTYPES[] = {"bf16", "fp16", "fp32"};
    for (size_t i = 0; i < NPAIRS; i++)
        for (size_t d = 0; d < 3; d++) {
            char *base = tu_strdupf("%s/%s", LORA_FIXTURES, PAIRS[i].base);
            char *ad_bin = tu_strdupf("%s/%s", LORA_FIXTURES, PAIRS[i].pickled);
            char *ad_st = tu_strdupf("%s/%s", LORA_FIXTURES, PAIRS[i].same_as);
            char *want = tu_strdupf("%s/want-%zu-%zu", s->dir, i, d), *got = tu_strdupf("%s/got-%zu-%zu", s->dir, i, d);
            struct tu_run a = tu_run("convert", base, want, "--lora", ad_st, "--dtype", DTYPES[d], "-q", NULL);
            struct tu_run b = tu_run("convert", base, got, "--lora", ad_bin, "--dtype", DTYPES[d], "-q", NULL);
            assert_int_equal(a.status, 0);
            assert_int_equal(b.status, 0);
            assert_string_equal(b.err, "");
            tu_sh("diff -r %s %s", want, got);
            tu_run_free(&a);
            tu_run_free(&b);
            free(base);
            free(ad_bin);
            free(ad_st);
            free(want);
            free(got);
        }
}

/* adapter_model.safetensors wins where both are there, as in PEFT. */
static void test_safetensors_preferred_to_the_pickle(void **state)
{
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s/ad", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *want = tu_strdupf("%s/want", s->dir), *base = tu_strdupf("%s/base-llama-bf16-bnb4", LORA_FIXTURES);
    tu_sh("cp -r %s/adapter-r8-all-linear %s && printf 'PK not an archive' > %s/" ADAPTER_PICKLE_NAME,
          LORA_FIXTURES, ad, ad);
    char *ad_st = tu_strdupf("%s/adapter-r8-all-linear", LORA_FIXTURES);
    struct tu_run a = tu_run("convert", base, want, "--lora", ad_st, "-q", NULL);
    struct tu_run b = tu_run("convert", base, out, "--lora", ad, "-q", NULL);
    assert_int_equal(a.status, 0);
    assert_int_equal(b.status, 0);
    tu_sh("diff -r %s %s", want, out);
    tu_run_free(&a);
    tu_run_free(&b);
    free(ad);
    free(out);
    free(want);
    free(base);
    free(ad_st);
}

/* ---- pickles, assembled from a line of tokens ---- */

/* Tokens, separated by spaces: opcodes by their pickletools letter ("(" MARK,
 * "}" EMPTY_DICT, ")" EMPTY_TUPLE, "t", "t1".."t3", "]", "a", "e", "l", "d",
 * "s", "u", "N", "T" NEWTRUE, "F" NEWFALSE, "R", "Q", "b", "." STOP), and
 * P:n PROTO, i:n the shortest BININT*, s:text SHORT_BINUNICODE, g:mod:name
 * GLOBAL, p:n BINPUT, h:n BINGET, x:hex raw bytes. */
static size_t assemble(const char *spec, unsigned char *out, size_t cap)
{
    static const struct {
        const char *tok;
        unsigned char op;
    } OPS[] = {{"(", '('}, {"}", '}'},  {")", ')'},  {"t", 't'},  {"t1", 0x85}, {"t2", 0x86}, {"t3", 0x87},
               {"]", ']'}, {"a", 'a'},  {"e", 'e'},  {"l", 'l'},  {"d", 'd'},   {"s", 's'},   {"u", 'u'},
               {"N", 'N'}, {"T", 0x88}, {"F", 0x89}, {"R", 'R'},  {"Q", 'Q'},   {"b", 'b'},   {".", '.'}};
    char *copy = strdup(spec), *save = NULL;
    size_t n = 0;
    for (char *tok = strtok_r(copy, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        assert_true(n + 300 < cap);
        size_t k;
        for (k = 0; k < sizeof OPS / sizeof *OPS; k++)
            if (strcmp(tok, OPS[k].tok) == 0)
                break;
        if (k < sizeof OPS / sizeof *OPS) {
            out[n++] = OPS[k].op;
        } else if (strncmp(tok, "P:", 2) == 0) {
            out[n++] = 0x80;
            out[n++] = (unsigned char)atoi(tok + 2);
        } else if (strncmp(tok, "i:", 2) == 0) {
            long v = atol(tok + 2);
            if (v >= 0 && v < 256) {
                out[n++] = 'K';
                out[n++] = (unsigned char)v;
            } else if (v >= 0 && v < 65536) {
                out[n++] = 'M';
                out[n++] = (unsigned char)v;
                out[n++] = (unsigned char)(v >> 8);
            } else {
                out[n++] = 'J';
                for (int b = 0; b < 4; b++)
                    out[n++] = (unsigned char)((unsigned long)v >> (8 * b));
            }
        } else if (strncmp(tok, "s:", 2) == 0) {
            out[n++] = 0x8c;
            out[n++] = (unsigned char)strlen(tok + 2);
            memcpy(out + n, tok + 2, strlen(tok + 2));
            n += strlen(tok + 2);
        } else if (strncmp(tok, "g:", 2) == 0) {
            out[n++] = 'c';
            for (const char *c = tok + 2; *c; c++)
                out[n++] = *c == ':' ? '\n' : (unsigned char)*c;
            out[n++] = '\n';
        } else if (strncmp(tok, "p:", 2) == 0 || strncmp(tok, "h:", 2) == 0) {
            out[n++] = tok[0] == 'p' ? 'q' : 'h';
            out[n++] = (unsigned char)atoi(tok + 2);
        } else if (strncmp(tok, "x:", 2) == 0) {
            for (const char *c = tok + 2; c[0] && c[1]; c += 2) {
                unsigned v;
                assert_int_equal(sscanf(c, "%2x", &v), 1);
                out[n++] = (unsigned char)v;
            }
        } else {
            fail_msg("unknown token %s", tok);
        }
    }
    free(copy);
    return n;
}

#define STORAGE(type, key, elems) "( s:storage g:torch:" type " s:" key " s:cpu i:" elems " t Q "
#define REBUILD "g:torch._utils:_rebuild_tensor_v2 ( "
#define HOOKS "F g:collections:OrderedDict ) R "
/* w: a 2x3 float tensor at element 1 of a storage of 7. */
#define TENSOR_W "s:w " REBUILD STORAGE("FloatStorage", "0", "7") "i:1 i:2 i:3 t2 i:3 i:1 t2 " HOOKS "t R "
#define DICT_OF(items) "P:2 } ( " items "u ."

static int read_pickle(const char *spec, struct torch_tensor_record **r, size_t *n)
{
    static unsigned char buf[32768];
    size_t len = assemble(spec, buf, sizeof buf);
    nf4_clear_error();
    return torch_pickle_read("t/data.pkl", buf, len, r, n);
}

static void test_pickle_of_one_tensor(void **state)
{
    (void)state;
    struct torch_tensor_record *r;
    size_t n;
    assert_int_equal(read_pickle(DICT_OF(TENSOR_W), &r, &n), NF4_OK);
    assert_int_equal(n, 1);
    assert_string_equal(r[0].name, "w");
    assert_int_equal(r[0].dtype, DT_F32);
    assert_int_equal(r[0].ndim, 2);
    assert_int_equal(r[0].shape[0], 2);
    assert_int_equal(r[0].shape[1], 3);
    assert_int_equal(r[0].nelem, 6);
    assert_string_equal(r[0].storage, "0");
    assert_int_equal(r[0].storage_elems, 7);
    assert_int_equal(r[0].offset, 1);
    torch_records_free(r, n);
    /* The same through the memo, a Parameter, a scalar, and SETITEM. */
    const char *memo = "P:2 } p:0 s:a " REBUILD STORAGE("HalfStorage", "3", "1") "p:1 i:0 ) ) " HOOKS
                       "t R s s:b g:torch._utils:_rebuild_parameter " REBUILD "h:1 i:0 i:1 t1 i:1 t1 " HOOKS
                       "t R T } t3 R s .";
    assert_int_equal(read_pickle(memo, &r, &n), NF4_OK);
    assert_int_equal(n, 2);
    assert_int_equal(r[0].ndim, 0);
    assert_int_equal(r[0].nelem, 1);
    assert_int_equal(r[1].dtype, DT_F16);
    assert_string_equal(r[1].storage, "3");
    torch_records_free(r, n);
}

static void test_hostile_pickles(void **state)
{
    (void)state;
    static const struct {
        const char *spec, *why;
    } CASES[] = {
        {"P:2 g:os:system s:ls t1 R .", "the pickle calls os.system"},
        {"P:2 g:builtins:eval ( t R .", "builtins.eval"},
        {"P:2 s:posix s:system x:93 .", "posix.system"},
        {DICT_OF("s:w g:torch._utils:_rebuild_tensor_v2 ( " STORAGE("FloatStorage", "0", "7")
                 "i:0 i:2 i:3 t2 i:1 i:2 t2 " HOOKS "t R "), "not contiguous"},
        {DICT_OF("s:w " REBUILD STORAGE("FloatStorage", "0", "5") "i:0 i:2 i:3 t2 i:3 i:1 t2 " HOOKS "t R "),
         "run past the 5 of its storage"},
        {DICT_OF(TENSOR_W TENSOR_W), "w: tensor name appears twice"},
        {DICT_OF("s:w i:3 "), "w: holds a int, not a tensor"},
        {DICT_OF("s:w } "), "holds a dict, not a tensor"},
        {"P:2 ] .", "holds a list, not a dict of tensors"},
        {DICT_OF("i:1 i:2 "), "has a int key"},
        {"P:1 } .", "a protocol other than 2 to 5"},
        {"P:2 } . N", "1 bytes after the pickle's STOP"},
        {"P:2 } ", "ends without STOP"},
        {"P:2 x:4e", "ends without STOP"},
        {"P:2 .", "the stack does not hold one object"},
        {"P:2 R .", "the stack is empty"},
        {"P:2 } } .", "does not hold one object"},
        {"P:2 ( } .", "does not hold one object"},
        {"P:2 } p:1 .", "memo key out of order"},
        {"P:2 h:0 .", "memo key never put"},
        {"P:2 x:7830 .", "not an opcode torch.save writes"},      /* '0' POP */
        {"P:2 x:63 s:x .", "cut short, too long or holds a NUL"}, /* GLOBAL without its lines */
        {"P:2 x:58ffffff7f .", "runs past the end"},               /* BINUNICODE of 2 GiB */
        {"P:2 x:8c02c328 .", "not UTF-8"},
        {"P:2 x:8c020061 .", "not UTF-8 without NUL"},
        {"P:2 x:8a09000000000000000000 .", "more than 64 bits"},
        {"P:2 ( s:storage g:torch:FloatStorage s:0 s:cpu t Q .", "persistent id that is not"},
        {"P:2 ( s:storage g:torch:FloatStorage s:a/b s:cpu i:1 t Q .", "not a plain entry name"},
        {"P:2 ( s:storage g:torch:FloatStorage s:.. s:cpu i:1 t Q .", "not a plain entry name"},
        {"P:2 ( s:storage g:torch:ComplexFloatStorage s:0 s:cpu i:1 t Q .", "torch.ComplexFloatStorage"},
        {DICT_OF("s:w " REBUILD STORAGE("FloatStorage", "0", "7") "i:0 i:2 i:3 t2 i:3 i:1 t2 " HOOKS
                 "} s:x i:1 s t R "), "metadata"},
        {DICT_OF("s:w " REBUILD STORAGE("FloatStorage", "0", "7") "i:0 i:2 t1 i:1 i:1 t2 " HOOKS "t R "),
         "_rebuild_tensor_v2 without"},
        {DICT_OF("s:w " REBUILD STORAGE("FloatStorage", "0", "7") "i:0 i:2 i:3 t2 i:3 i:1 t2 " HOOKS "R "),
         "without a tuple of arguments"},
        {DICT_OF("s:w g:torch._utils:_rebuild_parameter i:1 F ) t3 R "), "_rebuild_parameter without"},
        {"P:2 g:collections:OrderedDict i:1 t1 R .", "OrderedDict called with arguments"},
        {"P:2 g:torch:FloatStorage ) R .", "a storage type called"},
        {"P:2 i:1 ) R .", "not a callable"},
        {"P:2 ] s:k i:1 s .", "items set on something not a dict"},
        {"P:2 } i:1 a .", "appended to something not a list"},
        {"P:2 } ( s:k u .", "a key without a value"},
        {"P:2 ( s:k d .", "a key without a value"},
        {"P:2 ] N b .", "state set on something not a dict"},
        {"P:2 t .", "no MARK"},
        {"P:2 i:1 t3 .", "too few items"},
        {"P:2 } x:95ff .", "runs past the end"},
        /* One name and one tensor under two keys, through the memo. */
        {"P:2 } ( s:w p:0 " REBUILD STORAGE("FloatStorage", "0", "7") "i:1 i:2 i:3 t2 i:3 i:1 t2 " HOOKS
         "t R p:1 h:0 h:1 u .", "w: tensor name appears twice"},
        {"P:2 ( s:storage g:torch:FloatStorage "
         "s:0123456789012345678901234567890123456789012345678901234567890123456789 s:cpu i:1 t Q .",
         "at most 64 bytes"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        struct torch_tensor_record *r = NULL;
        size_t n = 0;
        int code = read_pickle(CASES[i].spec, &r, &n);
        if (code != NF4_EDATA || !strstr(nf4_last_error(), CASES[i].why))
            fail_msg("case %zu (%s): %d %s; want %s", i, CASES[i].spec, code, nf4_last_error(), CASES[i].why);
        assert_null(r);
        assert_int_equal(n, 0);
        const char *msg = nf4_last_error();
        assert_true(strncmp(msg, "t/data.pkl: ", 12) == 0);
        assert_null(strchr(msg, '\n'));
    }
}

/* A dict of `tensors` tensors w0, w1, ... of 64 dimensions of one, all
 * through one storage (memo 0) and one size tuple (memo 1) made once. */
static const char *reused_shape_pickle(int tensors)
{
    static char spec[32768];
    size_t at = (size_t)snprintf(spec, sizeof spec, "P:2 } ( s:w0 " REBUILD STORAGE("FloatStorage", "0", "1")
                                 "p:0 i:0 ( ");
    for (int d = 0; d < 64; d++)
        at += (size_t)snprintf(spec + at, sizeof spec - at, "i:1 ");
    at += (size_t)snprintf(spec + at, sizeof spec - at, "t p:1 h:1 " HOOKS "t R ");
    for (int k = 1; k < tensors; k++)
        at += (size_t)snprintf(spec + at, sizeof spec - at, "s:w%d " REBUILD "h:0 i:0 h:1 h:1 " HOOKS "t R ", k);
    snprintf(spec + at, sizeof spec - at, "u .");
    return spec;
}

/* Reused tensor after tensor, that tuple would make shapes that outgrow the
 * pickle many times over. */
static void test_pickle_dimensions_bounded(void **state)
{
    (void)state;
    struct torch_tensor_record *r = NULL;
    size_t n = 0;
    assert_int_equal(read_pickle(reused_shape_pickle(200), &r, &n), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "more tensor dimensions than the pickle has bytes"));
    /* The first few fit: three such tensors are a valid dict. */
    assert_int_equal(read_pickle(reused_shape_pickle(3), &r, &n), NF4_OK);
    assert_int_equal(n, 3);
    assert_int_equal(r[2].ndim, 64);
    torch_records_free(r, n);
}

/* Over the limits: objects and size. */
static void test_pickle_limits(void **state)
{
    (void)state;
    size_t len = (size_t)TORCH_MAX_PICKLE_VALUES + 4; /* one N too many */
    unsigned char *p = malloc((size_t)TORCH_MAX_PICKLE_BYTES + 1);
    p[0] = 0x80;
    p[1] = 2;
    memset(p + 2, 'N', len - 3);
    p[len - 1] = '.';
    struct torch_tensor_record *r;
    size_t n;
    nf4_clear_error();
    assert_int_equal(torch_pickle_read("t/data.pkl", p, len, &r, &n), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "more than"));
    nf4_clear_error();
    assert_int_equal(torch_pickle_read("t/data.pkl", p, (size_t)TORCH_MAX_PICKLE_BYTES + 1, &r, &n), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "over the"));
    free(p);
}

/* ---- archives: the PEFT fixture, altered a field at a time ---- */

static unsigned char *fixture_bin(size_t *len)
{
    unsigned char *b = (unsigned char *)tu_read_file(
        LORA_FIXTURES "/adapter-r16-qv-lmhead-pickled/" ADAPTER_PICKLE_NAME, len);
    assert_non_null(b);
    return b;
}

/* The offset of the last occurrence of `name` (the central directory's copy). */
static size_t last_of(const unsigned char *b, size_t len, const char *name)
{
    size_t n = strlen(name), at = SIZE_MAX;
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp(b + i, name, n) == 0)
            at = i;
    assert_true(at != SIZE_MAX);
    return at;
}

static void rename_everywhere(unsigned char *b, size_t len, const char *from, const char *to)
{
    size_t n = strlen(from);
    assert_int_equal(strlen(to), n);
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp(b + i, from, n) == 0)
            memcpy(b + i, to, n);
}

#define CENTRAL_NAME_AT 46 /* a central directory record's name follows 46 bytes of fields */
#define PKL "adapter_model/data.pkl"
#define STORAGE0 "adapter_model/data/0"

static void test_hostile_archives(void **state)
{
    struct tu_scratch *s = *state;
    enum {
        Z_TRUNCATE, Z_NOT_ZIP, Z_COMPRESSED, Z_ENCRYPTED, Z_LOCAL_NAME, Z_NO_PICKLE, Z_TWO_PICKLES, Z_NO_STORAGE, Z_BIG_ENDIAN,
        Z_DIRECTORY_PAST_END, CASES
    };
    static const struct {
        const char *why;
    } WHY[CASES] = {
        {"no end of central directory record"},
        {"is not a ZIP archive"},
        {PKL ": ZIP entry is compressed (method 8)"},
        {PKL ": ZIP entry is encrypted"},
        {"adapter_model/data.pkx: no local header for this entry"},
        {"holds no */data.pkl"},
        {"archive holds two pickles"},
        {"its storage adapter_model/data/0 is not in the archive"},
        {"not little-endian"},
        {"runs past its end record"},
    };
    for (int c = 0; c < CASES; c++) {
        size_t len = 0;
        unsigned char *b = fixture_bin(&len);
        size_t pkl = last_of(b, len, PKL) - CENTRAL_NAME_AT;
        switch (c) {
        case Z_TRUNCATE:
            len /= 2;
            break;
        case Z_NOT_ZIP:
            memcpy(b, "\x80\x02\x8a\x0a", 4); /* the legacy format's magic number starts so */
            break;
        case Z_COMPRESSED:
            b[pkl + 10] = 8;
            break;
        case Z_ENCRYPTED:
            b[pkl + 8] |= 1;
            break;
        case Z_LOCAL_NAME:
            b[pkl + CENTRAL_NAME_AT + strlen(PKL) - 1] = 'x'; /* the directory's copy only: data.pkx */
            break;
        case Z_NO_PICKLE:
            rename_everywhere(b, len, PKL, "adapter_model/data.pkx");
            break;
        case Z_TWO_PICKLES:
            rename_everywhere(b, len, "adapter_model/version", "adapter_modx/data.pkl");
            break;
        case Z_NO_STORAGE:
            rename_everywhere(b, len, STORAGE0, "adapter_model/data/x"); /* no key of the pickle */
            break;
        case Z_BIG_ENDIAN:
            rename_everywhere(b, len, "little", "LITTLE");
            break;
        case Z_DIRECTORY_PAST_END: {
            size_t eocd = last_of(b, len, "PK\005\006");
            b[eocd + 12] = 0xff; /* the directory's size */
            b[eocd + 13] = 0x7f;
            break;
        }
        }
        char *path = tu_strdupf("%s/case-%d.bin", s->dir, c);
        tu_write_file(path, b, len);
        struct st_file *f = (struct st_file *)1;
        nf4_clear_error();
        int code = torch_open(path, &f);
        if (code != NF4_EDATA || !strstr(nf4_last_error(), WHY[c].why))
            fail_msg("case %d: %d %s; want %s", c, code, nf4_last_error(), WHY[c].why);
        assert_null(f);
        assert_true(strncmp(nf4_last_error(), path, strlen(path)) == 0);
        free(path);
        free(b);
    }
}

/* torch writes a ZIP64 end record and locator beside the 32-bit one, whose
 * fields it fills while they fit. With those fields escaped, the reader must
 * take the ZIP64 record's and find the same tensors; with the locator
 * broken as well, refuse. */
static void test_zip64_end_record(void **state)
{
    struct tu_scratch *s = *state;
    size_t len = 0;
    unsigned char *b = fixture_bin(&len);
    size_t eocd = last_of(b, len, "PK\005\006");
    memset(b + eocd + 8, 0xff, 4);   /* entries on this disk, and in all */
    memset(b + eocd + 12, 0xff, 8);  /* the directory's size and offset */
    char *path = tu_strdupf("%s/zip64.bin", s->dir);
    tu_write_file(path, b, len);
    struct st_file *got, *want;
    nf4_clear_error();
    assert_int_equal(torch_open(path, &got), NF4_OK);
    assert_int_equal(torch_open(LORA_FIXTURES "/adapter-r16-qv-lmhead-pickled/" ADAPTER_PICKLE_NAME, &want), NF4_OK);
    assert_int_equal(got->count, want->count);
    for (size_t k = 0; k < want->count; k++) {
        assert_string_equal(got->by_name[k]->name, want->by_name[k]->name);
        assert_int_equal(got->by_name[k]->begin, want->by_name[k]->begin);
        assert_int_equal(got->by_name[k]->end, want->by_name[k]->end);
    }
    st_close(got);
    st_close(want);
    size_t locator = last_of(b, len, "PK\006\007");
    b[locator] = 'X';
    tu_write_file(path, b, len);
    nf4_clear_error();
    assert_int_equal(torch_open(path, &got), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "there is no ZIP64 locator"));
    free(path);
    free(b);
}

/* Refused adapters through the command: one line, exit 65, nothing written. */
static void test_refused_pickle_writes_nothing(void **state)
{
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s/ad", s->dir), *out = tu_strdupf("%s/out", s->dir);
    tu_sh("mkdir %s && cp %s/adapter-r16-qv-lmhead/adapter_config.json %s", ad, LORA_FIXTURES, ad);
    char *base = tu_strdupf("%s/base-llama-bf16-bnb4", LORA_FIXTURES);
    /* The pickle's own bytes altered: its GLOBAL of OrderedDict becomes os.system. */
    size_t len = 0;
    char *bin_path = tu_strdupf("%s/" ADAPTER_PICKLE_NAME, ad);
    unsigned char *b = fixture_bin(&len);
    rename_everywhere(b, len, "collections\nOrderedDict\n", "os\nsystem\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n");
    tu_write_file(bin_path, b, len);
    struct tu_run r = tu_run("convert", base, out, "--lora", ad, NULL);
    assert_int_equal(r.status, 65);
    assert_int_equal(tu_lines(r.err), 1);
    assert_non_null(strstr(r.err, "the pickle calls os.system"));
    assert_false(tu_exists(out));
    assert_int_equal(tu_count_entries(s->dir), 1); /* ad only */
    tu_run_free(&r);
    free(b);
    free(bin_path);
    free(base);
    free(ad);
    free(out);
}

/* A link to a blob never downloaded (an interrupted hf download) is named as
 * what is missing, not the safetensors file the folder never had. */
static void test_missing_pickle_named(void **state)
{
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s/ad", s->dir), *out = tu_strdupf("%s/out", s->dir);
    tu_sh("mkdir %s && cp %s/adapter-r8-all-linear/adapter_config.json %s && ln -s %s/blobs/none %s/"
          ADAPTER_PICKLE_NAME, ad, LORA_FIXTURES, ad, s->dir, ad);
    struct tu_run r = tu_run("convert", LORA_FIXTURES "/base-llama-bf16-bnb4", out, "--lora", ad, NULL);
    assert_int_equal(r.status, 66);
    assert_int_equal(tu_lines(r.err), 1);
    assert_non_null(strstr(r.err, ADAPTER_PICKLE_NAME ": cannot open"));
    assert_false(tu_exists(out));
    tu_run_free(&r);
    free(ad);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pickled_adapters_open_as_their_safetensors),
        cmocka_unit_test_setup_teardown(test_pickled_adapters_merge_byte_identical, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_safetensors_preferred_to_the_pickle, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test(test_pickle_of_one_tensor),
        cmocka_unit_test(test_hostile_pickles),
        cmocka_unit_test(test_pickle_dimensions_bounded),
        cmocka_unit_test(test_pickle_limits),
        cmocka_unit_test_setup_teardown(test_hostile_archives, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_zip64_end_record, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_refused_pickle_writes_nothing, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_missing_pickle_named, tu_scratch_setup, tu_scratch_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
