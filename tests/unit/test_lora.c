/* Merging QLoRA adapters while converting: the PEFT-written fixtures checked
 * against their fp32 and fp64 merges with the tolerance of
 * tests/fixtures/lora/README.md; synthetic adapters of odd shapes (several
 * adapters, fan_in_fan_out, rsLoRA, rank and alpha patterns, unquantized
 * bases, what PEFT saves beside the pairs) checked byte for byte against an element-by-element reference; and
 * the refusals, which must write nothing. */
#include "test_util.h"

#include <cJSON.h>
#include <math.h>

#include "convert.h"
#include "fpconv.h"
#include "lora.h"
#include "lora_diffusers.h"
#include "lora_synth.h"
#include "merge_tolerance.h"
#include "model.h"
#include "resume.h"
#include "strbuf.h"
#include "strutil.h"

#define LORA_FIXTURES FIXTURES "/lora"

/* Tensor g of file gf has the dtype, shape and bytes of tensor w of wf
 * (`want`, in messages). */
static void assert_same_tensor(const struct st_file *gf, const struct st_tensor *g, const struct st_file *wf,
                               const struct st_tensor *w, const char *want)
{
    if (g->dtype != w->dtype || g->ndim != w->ndim || g->nelem != w->nelem)
        fail_msg("%s: dtype or shape differs from %s", g->name, want);
    uint64_t n = st_tensor_bytes(w);
    unsigned char *a = malloc(n + 1), *b = malloc(n + 1);
    assert_true(a && b);
    assert_int_equal(st_read(gf, g, 0, a, n), NF4_OK);
    assert_int_equal(st_read(wf, w, 0, b, n), NF4_OK);
    if (memcmp(a, b, n) != 0)
        fail_msg("%s: differs from %s", g->name, want);
    free(a);
    free(b);
}

/* Tensor `name` of `got` has the dtype, shape and bytes it has in `want`. */
static void assert_same_model_tensor(const struct model *got, const struct model *want, const char *name)
{
    const struct model_tensor *g = model_find(got, name), *w = model_find(want, name);
    if (!g || !w)
        fail_msg("%s: missing from the output", name);
    assert_same_tensor(g->file, g->t, w->file, w->t, "the plain conversion's, and no LoRA merges into it");
}

#define TIED_BASE "base-llama-bf16-bnb4-tied"
#define BIAS_BASE "base-llama-bf16-bnb4-bias"
#define GPT2_TIED_BASE "base-gpt2-bf16-bnb4-tied"
#define BART_TIED_BASE "base-bart-fp16-fp4-bnb4-tied"

struct lora_case {
    const char *base, *adapter, *expected;
    uint64_t merged;
    /* The expected files hold only the merged tensors; the others are the
     * base's plain conversion. */
    int partial;
};

static const struct lora_case CASES[] = {
    {"base-llama-bf16-bnb4", "adapter-r8-all-linear", "merged-r8-all-linear", 14, 0},
    {"base-llama-bf16-bnb4", "adapter-r16-qv-lmhead", "merged-r16-qv-lmhead", 4, 0},
    {"base-llama-fp16-fp4-bnb4", "adapter-fp16-r4", "merged-fp16-r4", 4, 0},
    /* A tied base (README.md, "Tied embeddings"): the head written apart from
     * the embedding, from the base's embedding, a copy, or with a LoRA; and an
     * embedding copy that ensure_weight_tying keeps tied. */
    {TIED_BASE, "adapter-tied-embed", "merged-tied-embed", 4, 0},
    {TIED_BASE, "adapter-tied-head", "merged-tied-head", 4, 1},
    {TIED_BASE, "adapter-tied-embed-head", "merged-tied-embed-head", 4, 1},
    {TIED_BASE, "adapter-tied-head-lora", "merged-tied-head-lora", 3, 1},
    {TIED_BASE, "adapter-tied-ensure", "merged-tied-ensure", 2, 1},
    /* Embedding LoRA (README.md, "Embedding LoRA"): on an untied base; on a
     * tied one, which it parts; with ensure_weight_tying, the two layers'
     * factors trained apart (PEFT's default), which parts them too, or as one
     * (the head's the embedding's, transposed), which keeps the tie. */
    {"base-llama-bf16-bnb4", "adapter-embed-lora", "merged-embed-lora", 3, 1},
    {TIED_BASE, "adapter-tied-embed-lora", "merged-tied-embed-lora", 3, 1},
    {TIED_BASE, "adapter-tied-embed-lora-ensure", "merged-tied-embed-lora-ensure", 4, 1},
    {TIED_BASE, "adapter-tied-embed-lora-mirror", "merged-tied-embed-lora-mirror", 3, 1},
    /* DoRA (README.md, "DoRA"): q, v and down_proj (rows of 352) in 4-bit, and
     * the 16-bit lm_head, each merged row rescaled by its magnitude over its norm. */
    {"base-llama-bf16-bnb4", "adapter-dora", "merged-dora", 7, 1},
    /* Trainable tokens (README.md, "Trainable tokens"): rows of the embedding,
     * and of the head, replaced whole; on a tied base shared by the head, or
     * the head's own rows, which part them. */
    {"base-llama-bf16-bnb4", "adapter-tokens", "merged-tokens", 5, 1},
    {"base-llama-bf16-bnb4", "adapter-tokens-dict", "merged-tokens-dict", 4, 1},
    {TIED_BASE, "adapter-tied-tokens", "merged-tied-tokens", 3, 1},
    {TIED_BASE, "adapter-tied-tokens-apart", "merged-tied-tokens-apart", 4, 1},
    /* A resized vocabulary (README.md, "A resized vocabulary"): the embedding
     * layers of 516 rows, frozen with the new rows trained, or trained whole. */
    {"base-llama-bf16-bnb4", "adapter-resized-tokens", "merged-resized-tokens", 3, 1},
    {"base-llama-bf16-bnb4", "adapter-resized-copies", "merged-resized-copies", 2, 1},
    {TIED_BASE, "adapter-tied-resized-tokens", "merged-tied-resized-tokens", 3, 1},
    {TIED_BASE, "adapter-tied-resized-copy", "merged-tied-resized-copy", 2, 1},
    {"base-llama-bf16-bnb4", "adapter-resized-lora", "merged-resized-lora", 4, 1},
    /* LoRA biases (README.md, "LoRA biases"): scaling * lora_B.bias added to
     * the attention projections' biases, after the trained bias that
     * "bias": "all" saves where there is one. */
    {BIAS_BASE, "adapter-lora-bias", "merged-lora-bias", 16, 0},
    {BIAS_BASE, "adapter-lora-bias-all", "merged-lora-bias-all", 8, 1},
    /* fp32 trained biases (rounded to the base's bf16 first, as PEFT loads
     * them), bf16 factors, scalings of rsLoRA and alpha_pattern that are not
     * powers of two. */
    {BIAS_BASE, "adapter-lora-bias-fp32", "merged-lora-bias-fp32", 8, 1},
    /* A LoRA on MoE experts (README.md, "LoRA on MoE experts"): PEFT's
     * target_parameters on the fused gate_up_proj and down_proj of three
     * experts, each expert's part merged into its own tensors, and v_proj. */
    {"base-qwen3moe-bf16-bnb4", "adapter-experts", "merged-experts", 10, 1},
    /* Heads tied to other embeddings (README.md, "Heads tied to other
     * embeddings"): GPT-2's transformer.wte, parted by a copy of it (beside a
     * LoRA on the Conv1D c_attn) or by a LoRA on the head; BART's
     * model.shared, parted by a copy of the head. */
    {GPT2_TIED_BASE, "adapter-gpt2-tied-wte", "merged-gpt2-tied-wte", 1, 1},
    {GPT2_TIED_BASE, "adapter-gpt2-tied-head-lora", "merged-gpt2-tied-head-lora", 1, 1},
    {BART_TIED_BASE, "adapter-bart-tied-head", "merged-bart-tied-head", 3, 1},
    /* Multimodal bases transformers saves in their older layout (README.md,
     * "Multimodal bases"), the adapters naming the modules as they run:
     * Gemma 3's language_model.model.* and vision_tower.*, its tied head
     * parted by a copy; Qwen2-VL's model.*. */
    {"base-gemma3-bf16-bnb4", "adapter-gemma3-qv-head", "merged-gemma3-qv-head", 4, 1},
    {"base-qwen2vl-bf16-bnb4", "adapter-qwen2vl-qv", "merged-qwen2vl-qv", 2, 1},
    /* ... and Gemma 3's embedding copy kept tied to the head (ensure_weight_tying). */
    {"base-gemma3-bf16-bnb4", "adapter-gemma3-ensure", "merged-gemma3-ensure", 2, 1},
};

static void check_merge(const char *out, const char *base, const char *adapter, const char *e32_path,
                        const char *e64_path, const char *plain);

static void check_case(const struct lora_case *lc, const char *out)
{
    char *e32_path = tu_strdupf(LORA_FIXTURES "/%s.expected.safetensors", lc->expected);
    char *e64_path = tu_strdupf(LORA_FIXTURES "/%s.expected.fp64.safetensors", lc->expected);
    char *adapter = tu_strdupf(LORA_FIXTURES "/%s", lc->adapter);
    char *base = tu_strdupf(LORA_FIXTURES "/%s", lc->base);
    char *plain = NULL;
    if (lc->partial) { /* the tensors no LoRA changes, as a plain conversion writes them */
        plain = tu_strdupf("%s-plain", out);
        struct convert_opts o;
        convert_opts_init(&o);
        o.device = DEVICE_CPU;
        o.progress = PROGRESS_NONE;
        struct convert_stats st;
        nf4_set_quiet(1);
        assert_int_equal(convert_run(base, plain, &o, &st), NF4_OK);
    }
    check_merge(out, base, adapter, e32_path, e64_path, plain);
    if (plain)
        tu_rmtree(plain); /* a test may check another case into the same `out` */
    free(plain);
    free(e32_path);
    free(e64_path);
    free(adapter);
    free(base);
}

/* The merged model dir `out` of `adapter` on `base` against the fp32 and
 * fp64 expected files, with the tolerance. With `plain` (a plain conversion
 * of the base) the expected files hold only the merged tensors, and every
 * other tensor must equal plain's byte for byte. */
static void check_merge(const char *out, const char *base, const char *adapter, const char *e32_path,
                        const char *e64_path, const char *plain)
{
    struct model *got, *bm;
    struct st_file *e32, *e64;
    assert_int_equal(model_open_dir(out, &got), NF4_OK);
    assert_int_equal(st_open(e32_path, &e32), NF4_OK);
    assert_int_equal(st_open(e64_path, &e64), NF4_OK);
    assert_int_equal(model_open_dir(base, &bm), NF4_OK);
    struct bnb_weight *w;
    size_t nw;
    assert_int_equal(bnb_collect(bm, &w, &nw), NF4_OK);
    struct lora_set *set;
    const char *dirs[1] = {adapter};
    assert_int_equal(lora_open(&set, dirs, 1, bm, w, nw), NF4_OK);
    struct tally tally = {0};
    if (plain) {
        struct model *pm;
        assert_int_equal(model_open_dir(plain, &pm), NF4_OK);
        size_t not_plain = 0; /* a head parted from its tied embedding: written, where plain has none */
        for (size_t i = 0; i < e32->count; i++) {
            const struct lora_target *t = lora_find(set, e32->tensors[i].name);
            if (!t && model_find(pm, e32->tensors[i].name))
                fail_msg("%s: in %s, but no adapter changes it", e32->tensors[i].name, e32_path);
            not_plain += !model_find(pm, e32->tensors[i].name);
            check_tensor(got, e32, e64, e32->tensors[i].name, t && t->nterms > 0 && !t->terms[0].bias, &tally);
        }
        assert_int_equal(got->count, pm->count + not_plain);
        for (size_t i = 0; i < pm->count; i++) {
            const char *name = pm->tensors[i].t->name;
            if (st_find(e32, name))
                continue;
            if (lora_find(set, name))
                fail_msg("%s: merged, but not in %s", name, e32_path);
            assert_same_model_tensor(got, pm, name);
        }
        model_close(pm);
    } else {
        assert_int_equal(got->count, e32->count);
    }
    for (size_t i = 0; !plain && i < e32->count; i++) {
        const char *name = e32->tensors[i].name;
        const struct lora_target *t = lora_find(set, name);
        /* A LoRA bias is one multiply and one add, in PEFT's order: exact. */
        check_tensor(got, e32, e64, name, t && t->nterms > 0 && !t->terms[0].bias, &tally);
    }
    /* The README's bar: at least 99.9% of merged elements equal the fp32 merge. */
    assert_true(tally.merged > 0);
    if (tally.exact * 1000 < tally.merged * 999)
        fail_msg("%s: only %llu of %llu merged elements equal the fp32 merge", e32_path,
                 (unsigned long long)tally.exact, (unsigned long long)tally.merged);
    lora_close(set);
    bnb_free(w, nw);
    model_close(bm);
    st_close(e32);
    st_close(e64);
    model_close(got);
}

/* convert --device cpu IN OUT with the adapters in `dirs`, quietly, in this
 * process (chunk 0 and threads 0: the defaults): its status, and its stats
 * in *st; nf4_last_error() is this run's error. */
static int convert_on_cpu(const char *in, const char *out, const char **dirs, size_t ndirs, uint64_t chunk,
                          int threads, enum st_dtype dtype, struct convert_stats *st)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.chunk_elements = chunk;
    o.threads = threads;
    o.dtype = dtype;
    o.lora_dirs = dirs;
    o.nlora = ndirs;
    o.progress = PROGRESS_NONE;
    nf4_set_quiet(1);
    nf4_clear_error(); /* the first error is kept: one an earlier test left must not stand for this run's */
    return convert_run(in, out, &o, st);
}

/* convert_on_cpu, which must succeed: the number of tensors it merged. */
static uint64_t merge_on_cpu(const char *in, const char *out, const char **dirs, size_t ndirs, uint64_t chunk,
                             int threads, enum st_dtype dtype)
{
    struct convert_stats st;
    if (convert_on_cpu(in, out, dirs, ndirs, chunk, threads, dtype, &st) != NF4_OK)
        fail_msg("convert %s --lora %s...: %s", in, dirs[0], nf4_last_error());
    return st.merged;
}

static void run_case(const struct lora_case *lc, const char *out, uint64_t chunk, int threads, enum st_dtype dtype)
{
    char *base = tu_strdupf(LORA_FIXTURES "/%s", lc->base), *adapter = tu_strdupf(LORA_FIXTURES "/%s", lc->adapter);
    const char *dirs[1] = {adapter};
    assert_int_equal(merge_on_cpu(base, out, dirs, 1, chunk, threads, dtype), lc->merged);
    free(base);
    free(adapter);
}

static void test_fixtures_within_tolerance(void **state)
{
    struct tu_scratch *s = *state;
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        char *out = tu_strdupf("%s/out-%zu", s->dir, i);
        run_case(&CASES[i], out, 0, 0, DT_INVALID);
        check_case(&CASES[i], out);
        free(out);
    }
}

/* Chunks of one quantization block, started and ended mid-row, on 3 threads. */
static void test_fixtures_smallest_chunks(void **state)
{
    struct tu_scratch *s = *state;
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        char *out = tu_strdupf("%s/small-%zu", s->dir, i);
        run_case(&CASES[i], out, 1, 3, DT_INVALID);
        check_case(&CASES[i], out);
        free(out);
    }
}

/* --dtype fp32 writes the merged fp32 values themselves: rounding them to the
 * weights' bf16 must give the default output, bit for bit (one rounding). */
static void test_fp32_output_is_the_unrounded_merge(void **state)
{
    struct tu_scratch *s = *state;
    char *narrow = tu_strdupf("%s/bf16", s->dir), *wide = tu_strdupf("%s/fp32", s->dir);
    run_case(&CASES[0], narrow, 0, 2, DT_INVALID);
    run_case(&CASES[0], wide, 0, 2, DT_F32);
    struct model *a, *b;
    assert_int_equal(model_open_dir(narrow, &a), NF4_OK);
    assert_int_equal(model_open_dir(wide, &b), NF4_OK);
    for (size_t i = 0; i < a->count; i++) {
        const struct model_tensor *x = &a->tensors[i], *y = model_find(b, x->t->name);
        assert_non_null(y);
        assert_int_equal(x->t->dtype, DT_BF16);
        assert_int_equal(y->t->dtype, DT_F32);
        uint64_t n = x->t->nelem;
        uint16_t *h = malloc(n * 2 + 2);
        float *f = malloc(n * 4 + 4);
        assert_int_equal(st_read(x->file, x->t, 0, h, n * 2), NF4_OK);
        assert_int_equal(st_read(y->file, y->t, 0, f, n * 4), NF4_OK);
        for (uint64_t k = 0; k < n; k++)
            if (f32_to_bf16(f[k]) != h[k])
                fail_msg("%s[%llu]: fp32 %.9g rounds to 0x%04x, bf16 output 0x%04x", x->t->name,
                         (unsigned long long)k, (double)f[k], f32_to_bf16(f[k]), h[k]);
        free(h);
        free(f);
    }
    model_close(a);
    model_close(b);
    free(narrow);
    free(wide);
}

/* ---- synthetic adapters against an element-by-element reference ---- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static float rnd(float scale)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return scale * ((float)(rng_state >> 40) / (float)(1 << 24) - 0.5f);
}

static uint32_t encode(enum st_dtype dt, float v)
{
    return dt == DT_BF16 ? f32_to_bf16(v) : dt == DT_F16 ? f32_to_f16(v) : f32_bits(v);
}

static float decoded(enum st_dtype dt, uint32_t bits)
{
    return dt == DT_BF16 ? bf16_to_f32((uint16_t)bits) : dt == DT_F16 ? f16_to_f32((uint16_t)bits) : f32_from_bits(bits);
}

/* A tensor held as float values already representable in its dtype. */
struct syn_tensor {
    const char *name;
    enum st_dtype dtype;
    uint64_t shape[3]; /* shape[1] 0: a vector; shape[2] 0: not 3-D */
    float *v;
};

static unsigned syn_ndim(const struct syn_tensor *t)
{
    return t->shape[2] ? 3 : t->shape[1] ? 2 : 1;
}

static uint64_t syn_count(const struct syn_tensor *t)
{
    uint64_t n = 1;
    for (unsigned d = 0; d < syn_ndim(t); d++)
        n *= t->shape[d];
    return n;
}

static void syn_fill(struct syn_tensor *t, float scale)
{
    uint64_t n = syn_count(t);
    t->v = malloc(n * sizeof *t->v + 4);
    for (uint64_t i = 0; i < n; i++)
        t->v[i] = decoded(t->dtype, encode(t->dtype, rnd(scale)));
}

static void syn_write(const char *path, struct syn_tensor *ts, size_t n)
{
    struct st_out_tensor outs[48] = {{0}};
    assert_true(n <= 48);
    for (size_t i = 0; i < n; i++)
        outs[i] = (struct st_out_tensor){ts[i].name, ts[i].dtype, syn_ndim(&ts[i]), ts[i].shape};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        size_t i = st_writer_order(w, k);
        uint64_t count = syn_count(&ts[i]);
        unsigned size = dtype_bits(ts[i].dtype) / 8;
        unsigned char *buf = malloc(count * size + 4);
        for (uint64_t e = 0; e < count; e++) {
            uint32_t bits = encode(ts[i].dtype, ts[i].v[e]);
            memcpy(buf + e * size, &bits, size); /* little-endian host */
        }
        assert_int_equal(st_writer_write(w, buf, count * size), NF4_OK);
        free(buf);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
}

/* One adapter's pair for one base tensor, for the reference. */
struct syn_term {
    const struct syn_tensor *a, *b;
    uint32_t r;
    float scaling;
    int fif;
};

/* The README's formula, one element at a time, sharing nothing with the
 * implementation's tiling: acc summed k ascending, then added in adapter order. */
static float reference_merge(float w, const struct syn_term *terms, size_t nterms, uint64_t row, uint64_t col)
{
    volatile float m = w;
    for (size_t t = 0; t < nterms; t++) {
        const struct syn_term *x = &terms[t];
        volatile float acc = 0.0f;
        for (uint32_t k = 0; k < x->r; k++) {
            /* B is [out, r] and A is [r, in]; the base is [out, in], or [in, out] with fan_in_fan_out. */
            float bv = x->fif ? x->b->v[col * x->r + k] : x->b->v[row * x->r + k];
            float av = x->fif ? x->a->v[k * x->a->shape[1] + row] : x->a->v[k * x->a->shape[1] + col];
            volatile float prod = bv * av;
            acc = acc + prod;
        }
        volatile float d = acc * x->scaling;
        m = m + d;
    }
    return m;
}

/* What element e of a merged tensor must be, before its rounding to the output dtype. */
typedef float (*element_reference)(const void *ctx, uint64_t e);

/* Every element of tensor `name` of output `f` (written with chunks of
 * `chunk` elements) is reference(ctx, e) rounded to want_dt, bit for bit. */
static void assert_tensor_is_reference(const struct st_file *f, const char *name, enum st_dtype want_dt,
                                       uint64_t chunk, element_reference reference, const void *ctx)
{
    const struct st_tensor *t = st_find(f, name);
    assert_non_null(t);
    assert_int_equal(t->dtype, want_dt);
    unsigned size = dtype_bits(want_dt) / 8;
    unsigned char *buf = malloc(t->nelem * size + 4);
    assert_int_equal(st_read(f, t, 0, buf, t->nelem * size), NF4_OK);
    for (uint64_t e = 0; e < t->nelem; e++) {
        uint32_t want_bits = encode(want_dt, reference(ctx, e)), got_bits = 0;
        memcpy(&got_bits, buf + e * size, size);
        if (got_bits != want_bits)
            fail_msg("%s[%llu] (chunk %llu, %s): 0x%x, reference 0x%x", name, (unsigned long long)e,
                     (unsigned long long)chunk, dtype_name(want_dt), got_bits, want_bits);
    }
    free(buf);
}

/* A synthetic tensor's reference: its terms merged, or (no terms) its values. */
struct syn_reference {
    const struct syn_tensor *base;
    const struct syn_term *terms;
    size_t nterms;
};

static float syn_element(const void *ctx, uint64_t e)
{
    const struct syn_reference *x = ctx;
    const uint64_t cols = x->base->shape[1] ? x->base->shape[1] : 1;
    return x->nterms ? reference_merge(x->base->v[e], x->terms, x->nterms, e / cols, e % cols) : x->base->v[e];
}

static void write_config(const char *dir, const char *json)
{
    char *path = tu_strdupf("%s/" ADAPTER_CONFIG_NAME, dir);
    tu_write_file(path, json, strlen(json));
    free(path);
}

static void test_synthetic_adapters_match_reference(void **state)
{
    struct tu_scratch *s = *state;
    /* The base: three unquantized matrices of odd shapes and a vector no adapter touches. */
    struct syn_tensor base[4] = {
        {"m.a.weight", DT_BF16, {37, 53}, NULL},
        {"m.b.weight", DT_F16, {29, 31}, NULL},
        {"m.c.weight", DT_F32, {5, 7}, NULL},
        {"m.norm.weight", DT_F32, {37, 0}, NULL},
    };
    for (int i = 0; i < 4; i++) {
        if (!base[i].shape[1]) {
            base[i].v = malloc(37 * sizeof(float));
            for (int k = 0; k < 37; k++)
                base[i].v[k] = rnd(2.0f);
        } else {
            syn_fill(&base[i], 2.0f);
        }
    }
    char *base_path = tu_strdupf("%s/base.safetensors", s->dir);
    syn_write(base_path, base, 4);

    /* Adapter 1: bf16 factors, rsLoRA, r = 3 with rank_pattern c -> 2 and alpha_pattern a -> 5. */
    char *ad1 = tu_strdupf("%s/ad1", s->dir), *ad2 = tu_strdupf("%s/ad2", s->dir);
    assert_int_equal(mkdir(ad1, 0755), 0);
    assert_int_equal(mkdir(ad2, 0755), 0);
    struct syn_tensor f1[4] = {
        {PEFT_KEY_PREFIX "m.a.lora_A.weight", DT_BF16, {3, 53}, NULL},
        {PEFT_KEY_PREFIX "m.a.lora_B.weight", DT_BF16, {37, 3}, NULL},
        {PEFT_KEY_PREFIX "m.c.lora_A.weight", DT_BF16, {2, 7}, NULL},
        {PEFT_KEY_PREFIX "m.c.lora_B.weight", DT_BF16, {5, 2}, NULL},
    };
    for (int i = 0; i < 4; i++)
        syn_fill(&f1[i], 1.0f);
    char *w1 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad1);
    syn_write(w1, f1, 4);
    write_config(ad1, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 6, \"use_rslora\": true, "
                      "\"rank_pattern\": {\"c\": 2}, \"alpha_pattern\": {\"m\\\\.a\": 5}}");
    /* Adapter 2: fp16 factors, fan_in_fan_out (the base is [in, out]), r = 4, on a and b. */
    struct syn_tensor f2[4] = {
        {PEFT_KEY_PREFIX "m.a.lora_A.weight", DT_F16, {4, 37}, NULL},
        {PEFT_KEY_PREFIX "m.a.lora_B.weight", DT_F16, {53, 4}, NULL},
        {PEFT_KEY_PREFIX "m.b.lora_A.weight", DT_F16, {4, 29}, NULL},
        {PEFT_KEY_PREFIX "m.b.lora_B.weight", DT_F16, {31, 4}, NULL},
    };
    for (int i = 0; i < 4; i++)
        syn_fill(&f2[i], 1.0f);
    char *w2 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad2);
    syn_write(w2, f2, 4);
    write_config(ad2, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 3, \"fan_in_fan_out\": true}");

    struct syn_term ta[2] = {{&f1[0], &f1[1], 3, (float)(5 / sqrt(3.0)), 0}, {&f2[0], &f2[1], 4, 0.75f, 1}};
    struct syn_term tb[1] = {{&f2[2], &f2[3], 4, 0.75f, 1}};
    struct syn_term tc[1] = {{&f1[2], &f1[3], 2, (float)(6 / sqrt(2.0)), 0}};
    const struct syn_term *terms[3] = {ta, tb, tc};
    const size_t nterms[3] = {2, 1, 1};

    static const uint64_t CHUNKS[] = {0, 1, 7, 64};
    static const enum st_dtype DTYPES[] = {DT_INVALID, DT_F16, DT_F32};
    const char *dirs[2] = {ad1, ad2};
    for (size_t ci = 0; ci < sizeof CHUNKS / sizeof CHUNKS[0]; ci++) {
        for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
            char *out = tu_strdupf("%s/out-%zu-%zu.safetensors", s->dir, ci, di);
            assert_int_equal(merge_on_cpu(base_path, out, dirs, 2, CHUNKS[ci], 3, DTYPES[di]), 3);
            struct st_file *f;
            assert_int_equal(st_open(out, &f), NF4_OK);
            for (int i = 0; i < 4; i++) {
                const struct syn_reference ref = {&base[i], i < 3 ? terms[i] : NULL, i < 3 ? nterms[i] : 0};
                assert_tensor_is_reference(f, base[i].name, DTYPES[di] != DT_INVALID ? DTYPES[di] : base[i].dtype,
                                           CHUNKS[ci], syn_element, &ref);
            }
            st_close(f);
            free(out);
        }
    }
    for (int i = 0; i < 4; i++) {
        free(base[i].v);
        free(f1[i].v);
        free(f2[i].v);
    }
    free(base_path);
    free(ad1);
    free(ad2);
    free(w1);
    free(w2);
}

/* ---- LoRA on MoE experts (target_parameters, lora_experts.h) ---- */

static void assert_lora_warns_once(const char *in, const char *out, const char *lora, const char *warning,
                                   const char *merged);

#define SYN_EXPERTS 3
#define SYN_HIDDEN 7
#define SYN_INTERMEDIATE 5

/* One expert's part of a LoRA on fused experts, for the reference: L(row, k)
 * = B[b_row0 + row, k * experts + e], R(k, col) = A[e * r + k, col]. */
struct syn_expert_term {
    const struct syn_tensor *a, *b;
    uint32_t r;
    float scaling;
    uint64_t b_row0;
};

/* The README's formula for element (row, col) of expert e's tensor. */
static float reference_expert_merge(float w, const struct syn_expert_term *terms, size_t nterms, uint64_t e,
                                    uint64_t row, uint64_t col)
{
    volatile float m = w;
    for (size_t t = 0; t < nterms; t++) {
        const struct syn_expert_term *x = &terms[t];
        const uint64_t width = (uint64_t)x->r * SYN_EXPERTS;
        volatile float acc = 0.0f;
        for (uint32_t k = 0; k < x->r; k++) {
            volatile float prod = x->b->v[(x->b_row0 + row) * width + k * SYN_EXPERTS + e] *
                                  x->a->v[(e * x->r + k) * x->a->shape[1] + col];
            acc = acc + prod;
        }
        volatile float d = acc * x->scaling;
        m = m + d;
    }
    return m;
}

/* Expert `expert`'s tensor `base` with its terms merged. */
struct expert_reference {
    const struct syn_tensor *base;
    const struct syn_expert_term *terms;
    size_t nterms;
    uint64_t expert;
};

static float expert_element(const void *ctx, uint64_t e)
{
    const struct expert_reference *x = ctx;
    const uint64_t cols = x->base->shape[1];
    return reference_expert_merge(x->base->v[e], x->terms, x->nterms, x->expert, e / cols, e % cols);
}

/* A model folder `dir`: model.safetensors of the n tensors ts, and config.json `config`. */
static void write_model_dir(const char *dir, const char *config, struct syn_tensor *ts, size_t n)
{
    assert_int_equal(mkdir(dir, 0755), 0);
    char *path = tu_strdupf("%s/model.safetensors", dir), *config_path = tu_strdupf("%s/config.json", dir);
    syn_write(path, ts, n);
    tu_write_file(config_path, config, strlen(config));
    free(path);
    free(config_path);
}

/* A LoRA whose factors alone are more than a merge's smallest slot (A of
 * rank 64 on a row of 200003 in fp32: 51 MB, each chunk reads all of it):
 * the slots are made large enough under the default --mem, the merge is the
 * reference's in every byte; under a --mem too small for 3 such slots, exit 2
 * names the tensor and the --mem that works, and that --mem does. */
static void test_factors_larger_than_a_slot(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor base[1] = {{"m.wide.weight", DT_BF16, {3, 200003}, NULL}};
    syn_fill(&base[0], 2.0f);
    char *base_dir = tu_strdupf("%s/base", s->dir), *ad = tu_strdupf("%s/ad", s->dir);
    write_model_dir(base_dir, "{\"model_type\": \"llama\"}", base, 1);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor f[2] = {
        {PEFT_KEY_PREFIX "m.wide.lora_A.weight", DT_F32, {64, 200003}, NULL},
        {PEFT_KEY_PREFIX "m.wide.lora_B.weight", DT_F32, {3, 64}, NULL},
    };
    syn_fill(&f[0], 1.0f);
    syn_fill(&f[1], 0.25f);
    char *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(w, f, 2);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 64, \"lora_alpha\": 16, \"target_modules\": [\"wide\"]}");
    struct syn_term t[1] = {{&f[0], &f[1], 64, 0.25f, 0}};
    const struct syn_reference ref = {&base[0], t, 1};

    char *out = tu_strdupf("%s/out", s->dir), *out2 = tu_strdupf("%s/out2", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", base_dir, out, "--lora", ad, NULL);
    if (r.status != 0)
        fail_msg("convert: %s", r.err);
    tu_run_free(&r);
    char *merged = tu_strdupf("%s/model.safetensors", out);
    struct st_file *got;
    assert_int_equal(st_open(merged, &got), NF4_OK);
    assert_tensor_is_reference(got, "m.wide.weight", DT_BF16, 0, syn_element, &ref);
    st_close(got);

    r = tu_run("convert", "--device", "cpu", "--mem", "100M", base_dir, out2, "--lora", ad, NULL);
    assert_int_equal(r.status, 2);
    const char *advice = strstr(r.err, "slots need --mem ");
    if (!advice || !strstr(r.err, "model.safetensors: m.wide.weight: --mem is too small") ||
        strchr(r.err, '\n') != r.err + strlen(r.err) - 1)
        fail_msg("unexpected: %s", r.err);
    char mem[32];
    assert_int_equal(sscanf(advice, "slots need --mem %30s", mem), 1);
    tu_run_free(&r);
    assert_false(tu_exists(out2));
    r = tu_run("convert", "--device", "cpu", "--mem", mem, base_dir, out2, "--lora", ad, NULL);
    if (r.status != 0)
        fail_msg("convert --mem %s: %s", mem, r.err);
    tu_run_free(&r);
    char *merged2 = tu_strdupf("%s/model.safetensors", out2);
    assert_int_equal(tu_sh_status("cmp -s %s %s", merged, merged2), 0);
    free(merged2);
    free(merged);
    free(base[0].v);
    free(f[0].v);
    free(f[1].v);
    free(w);
    free(out);
    free(out2);
    free(base_dir);
    free(ad);
}

/* A base of SYN_EXPERTS experts in `dir`, with config.json `config`: the
 * tensors "<module>.e.<part>.weight" for parts[0] (gate) and parts[1] (up),
 * [I, H] in bf16, and parts[2] (down), [H, I] in f16. Values preset in base
 * are kept (a second base of the same values); else random. The names live
 * in `names` (3 * SYN_EXPERTS of them), as long as base is used. */
static void write_experts_base_named(const char *dir, const char *config, const char *module,
                                     const char *const parts[3], struct syn_tensor *base, char (*names)[96])
{
    for (int e = 0; e < SYN_EXPERTS; e++)
        for (int p = 0; p < 3; p++) {
            struct syn_tensor *t = &base[e * 3 + p];
            float *v = t->v;
            snprintf(names[e * 3 + p], sizeof names[0], "%s.%d.%s.weight", module, e, parts[p]);
            *t = (struct syn_tensor){names[e * 3 + p], p < 2 ? DT_BF16 : DT_F16,
                                     {p < 2 ? SYN_INTERMEDIATE : SYN_HIDDEN, p < 2 ? SYN_HIDDEN : SYN_INTERMEDIATE},
                                     v};
            if (!v)
                syn_fill(t, 2.0f);
        }
    write_model_dir(dir, config, base, 3 * SYN_EXPERTS);
}

/* A Mixtral-form base (config.json saying `model_type`): w1, w3 and w2 under
 * model.layers.0.block_sparse_moe.experts. */
static void write_experts_base(const char *dir, const char *model_type, struct syn_tensor *base)
{
    static char names[3 * SYN_EXPERTS][96];
    static const char *const PARTS[3] = {"w1", "w3", "w2"};
    char *json = tu_strdupf("{\"model_type\": \"%s\"}", model_type);
    write_experts_base_named(dir, json, "model.layers.0.block_sparse_moe.experts", PARTS, base, names);
    free(json);
}

/* Two adapters on a Mixtral-form base's experts, checked element by element
 * against the reference for several chunk sizes and output dtypes: one on
 * gate_up_proj alone (its pair under M), with rsLoRA and bf16 factors; one
 * on gate_up_proj and down_proj (gate_up_proj's pair under M.base_layer),
 * fp32 factors, down_proj with rank_pattern and alpha_pattern; expert e's
 * gate rows into w1, its up rows into w3, its down_proj into w2. */
static void test_experts_lora_matches_reference(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor base[3 * SYN_EXPERTS] = {{0}};
    char *base_dir = tu_strdupf("%s/base", s->dir);
    write_experts_base(base_dir, "mixtral", base);
    char *ad1 = tu_strdupf("%s/ad1", s->dir), *ad2 = tu_strdupf("%s/ad2", s->dir);
    assert_int_equal(mkdir(ad1, 0755), 0);
    assert_int_equal(mkdir(ad2, 0755), 0);
#define M PEFT_KEY_PREFIX "model.layers.0.mlp.experts"
    struct syn_tensor f1[2] = {
        {M ".lora_A.weight", DT_BF16, {2 * SYN_EXPERTS, SYN_HIDDEN}, NULL},
        {M ".lora_B.weight", DT_BF16, {2 * SYN_INTERMEDIATE, 2 * SYN_EXPERTS}, NULL},
    };
    struct syn_tensor f2[4] = {
        {M ".base_layer.lora_A.weight", DT_F32, {3 * SYN_EXPERTS, SYN_HIDDEN}, NULL},
        {M ".base_layer.lora_B.weight", DT_F32, {2 * SYN_INTERMEDIATE, 3 * SYN_EXPERTS}, NULL},
        {M ".lora_A.weight", DT_F32, {1 * SYN_EXPERTS, SYN_INTERMEDIATE}, NULL},
        {M ".lora_B.weight", DT_F32, {SYN_HIDDEN, 1 * SYN_EXPERTS}, NULL},
    };
#undef M
    for (int i = 0; i < 4; i++) {
        if (i < 2)
            syn_fill(&f1[i], 1.0f);
        syn_fill(&f2[i], 1.0f);
    }
    char *w1 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad1), *w2 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad2);
    syn_write(w1, f1, 2);
    syn_write(w2, f2, 4);
    write_config(ad1, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 3, \"use_rslora\": true, "
                      "\"target_modules\": null, \"target_parameters\": [\"gate_up_proj\"]}");
    write_config(ad2, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 6, \"target_modules\": [\"q_proj\"], "
                      "\"target_parameters\": [\"mlp.experts.down_proj\", \"mlp.experts.gate_up_proj\"], "
                      "\"rank_pattern\": {\"down_proj\": 1}, \"alpha_pattern\": {\"experts\\\\.down_proj\": 5}}");
    const float s1 = (float)(3 / sqrt(2.0));
    /* Per part (w1, w3, w2): the terms in adapter order. */
    const struct syn_expert_term gate[2] = {{&f1[0], &f1[1], 2, s1, 0}, {&f2[0], &f2[1], 3, 2.0f, 0}};
    const struct syn_expert_term up[2] = {{&f1[0], &f1[1], 2, s1, SYN_INTERMEDIATE},
                                          {&f2[0], &f2[1], 3, 2.0f, SYN_INTERMEDIATE}};
    const struct syn_expert_term down[1] = {{&f2[2], &f2[3], 1, 5.0f, 0}};
    const struct syn_expert_term *terms[3] = {gate, up, down};
    const size_t nterms[3] = {2, 2, 1};

    static const uint64_t CHUNKS[] = {0, 1, 6, 64};
    static const enum st_dtype DTYPES[] = {DT_INVALID, DT_F32};
    const char *dirs[2] = {ad1, ad2};
    for (size_t ci = 0; ci < sizeof CHUNKS / sizeof CHUNKS[0]; ci++) {
        for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
            char *out = tu_strdupf("%s/out-%zu-%zu", s->dir, ci, di), *file = tu_strdupf("%s/model.safetensors", out);
            assert_int_equal(merge_on_cpu(base_dir, out, dirs, 2, CHUNKS[ci], 3, DTYPES[di]), 3 * SYN_EXPERTS);
            struct st_file *f;
            assert_int_equal(st_open(file, &f), NF4_OK);
            for (int i = 0; i < 3 * SYN_EXPERTS; i++) {
                const struct expert_reference ref = {&base[i], terms[i % 3], nterms[i % 3], (uint64_t)i / 3};
                assert_tensor_is_reference(f, base[i].name, DTYPES[di] != DT_INVALID ? DTYPES[di] : base[i].dtype,
                                           CHUNKS[ci], expert_element, &ref);
            }
            st_close(f);
            free(file);
            free(out);
        }
    }
    for (int i = 0; i < 3 * SYN_EXPERTS; i++)
        free(base[i].v);
    for (int i = 0; i < 4; i++) {
        if (i < 2)
            free(f1[i].v);
        free(f2[i].v);
    }
    free(base_dir);
    free(ad1);
    free(ad2);
    free(w1);
    free(w2);
}

/* PEFT's all-linear on a transformers 5 Mixtral targets the router's
 * gate.weight beside the experts' down_proj (target_parameters): the
 * router's pair, under mlp.gate, is no experts pair though "down_proj"
 * selects mlp.gate.down_proj by name (PEFT wraps only a parameter the module
 * has), and merges into block_sparse_moe.gate.weight, as the experts' pair
 * into each w2. */
static void test_experts_lora_beside_the_router(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor base[3 * SYN_EXPERTS + 1] = {{0}};
    static char names[3 * SYN_EXPERTS][96];
    static const char *const PARTS[3] = {"w1", "w3", "w2"};
    base[3 * SYN_EXPERTS] = (struct syn_tensor){"model.layers.0.block_sparse_moe.gate.weight", DT_BF16,
                                                {SYN_EXPERTS, SYN_HIDDEN}, NULL};
    syn_fill(&base[3 * SYN_EXPERTS], 2.0f);
    for (int e = 0; e < SYN_EXPERTS; e++)
        for (int p = 0; p < 3; p++) {
            struct syn_tensor *t = &base[e * 3 + p];
            snprintf(names[e * 3 + p], sizeof names[0], "model.layers.0.block_sparse_moe.experts.%d.%s.weight", e,
                     PARTS[p]);
            *t = (struct syn_tensor){names[e * 3 + p], p < 2 ? DT_BF16 : DT_F16,
                                     {p < 2 ? SYN_INTERMEDIATE : SYN_HIDDEN, p < 2 ? SYN_HIDDEN : SYN_INTERMEDIATE},
                                     NULL};
            syn_fill(t, 2.0f);
        }
    char *base_dir = tu_strdupf("%s/base", s->dir), *ad = tu_strdupf("%s/ad", s->dir);
    write_model_dir(base_dir, "{\"model_type\": \"mixtral\"}", base, 3 * SYN_EXPERTS + 1);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor f[4] = {
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_A.weight", DT_F32, {2 * SYN_EXPERTS, SYN_INTERMEDIATE}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_B.weight", DT_F32, {SYN_HIDDEN, 2 * SYN_EXPERTS}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.mlp.gate.lora_A.weight", DT_F32, {2, SYN_HIDDEN}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.mlp.gate.lora_B.weight", DT_F32, {SYN_EXPERTS, 2}, NULL},
    };
    for (int i = 0; i < 4; i++)
        syn_fill(&f[i], 1.0f);
    char *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(w, f, 4);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": null, "
                     "\"target_parameters\": [\"gate.weight\", \"down_proj\"]}");
    const char *dirs[1] = {ad};
    char *out = tu_strdupf("%s/out", s->dir), *file = tu_strdupf("%s/model.safetensors", out);
    assert_int_equal(merge_on_cpu(base_dir, out, dirs, 1, 0, 2, DT_INVALID), SYN_EXPERTS + 1);
    struct st_file *got;
    assert_int_equal(st_open(file, &got), NF4_OK);
    const struct syn_term router = {&f[2], &f[3], 2, 2.0f, 0};
    const struct syn_reference router_ref = {&base[3 * SYN_EXPERTS], &router, 1};
    assert_tensor_is_reference(got, base[3 * SYN_EXPERTS].name, DT_BF16, 0, syn_element, &router_ref);
    const struct syn_expert_term down = {&f[0], &f[1], 2, 2.0f, 0};
    for (int e = 0; e < SYN_EXPERTS; e++) {
        const struct expert_reference ref = {&base[e * 3 + 2], &down, 1, (uint64_t)e};
        assert_tensor_is_reference(got, base[e * 3 + 2].name, DT_F16, 0, expert_element, &ref);
    }
    st_close(got);
    for (int i = 0; i < 3 * SYN_EXPERTS + 1; i++)
        free(base[i].v);
    for (int i = 0; i < 4; i++)
        free(f[i].v);
    free(w);
    free(out);
    free(file);
    free(base_dir);
    free(ad);
}

/* The forms of lora_experts.h beyond Mixtral's own, each merging the same
 * adapter (both parameters) into a base of the same values under its names
 * to the same bytes as Mixtral's form, which test_experts_lora_matches_reference
 * checks against the formula: phimoe (Mixtral's names and rename), lfm2_moe
 * (Mixtral's names under feed_forward.experts, no rename), and qwen3_5_moe,
 * whose config names the experts' conversion in text_config (Qwen2-MoE's
 * names under model.language_model). A text_config of no such type is
 * refused, naming both types. */
static void test_experts_lora_forms(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const W123[3] = {"w1", "w3", "w2"}, *const QWEN2[3] = {"gate_proj", "up_proj", "down_proj"};
    static const struct {
        const char *config, *saved, *runtime;
        const char *const *parts;
    } FORMS[] = {
        {"{\"model_type\": \"mixtral\"}", "model.layers.0.block_sparse_moe.experts", "model.layers.0.mlp.experts",
         W123},
        {"{\"model_type\": \"phimoe\"}", "model.layers.0.block_sparse_moe.experts", "model.layers.0.mlp.experts",
         W123},
        {"{\"model_type\": \"lfm2_moe\"}", "model.layers.0.feed_forward.experts", "model.layers.0.feed_forward.experts",
         W123},
        {"{\"model_type\": \"qwen3_5_moe\", \"text_config\": {\"model_type\": \"qwen3_5_moe_text\"}}",
         "model.language_model.layers.0.mlp.experts", "model.language_model.layers.0.mlp.experts", QWEN2},
        {"{\"model_type\": \"qwen3_5\", \"text_config\": {\"model_type\": \"qwen3_5_text\"}}",
         "model.language_model.layers.0.mlp.experts", "model.language_model.layers.0.mlp.experts", QWEN2},
    };
    const size_t nforms = sizeof FORMS / sizeof FORMS[0];
    struct syn_tensor base[3 * SYN_EXPERTS] = {{0}};
    static char names[3 * SYN_EXPERTS][96];
    float *factor_values[4] = {NULL};
    char *outs[sizeof FORMS / sizeof FORMS[0]];
    for (size_t i = 0; i < nforms; i++) {
        char *base_dir = tu_strdupf("%s/base-%zu", s->dir, i), *ad = tu_strdupf("%s/ad-%zu", s->dir, i),
             *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
        write_experts_base_named(base_dir, FORMS[i].config, FORMS[i].saved, FORMS[i].parts, base, names);
        char *keys[4] = {
            tu_strdupf(PEFT_KEY_PREFIX "%s.base_layer.lora_A.weight", FORMS[i].runtime),
            tu_strdupf(PEFT_KEY_PREFIX "%s.base_layer.lora_B.weight", FORMS[i].runtime),
            tu_strdupf(PEFT_KEY_PREFIX "%s.lora_A.weight", FORMS[i].runtime),
            tu_strdupf(PEFT_KEY_PREFIX "%s.lora_B.weight", FORMS[i].runtime),
        };
        struct syn_tensor f[4] = {
            {keys[0], DT_F32, {2 * SYN_EXPERTS, SYN_HIDDEN}, factor_values[0]},
            {keys[1], DT_F32, {2 * SYN_INTERMEDIATE, 2 * SYN_EXPERTS}, factor_values[1]},
            {keys[2], DT_F32, {2 * SYN_EXPERTS, SYN_INTERMEDIATE}, factor_values[2]},
            {keys[3], DT_F32, {SYN_HIDDEN, 2 * SYN_EXPERTS}, factor_values[3]},
        };
        for (int k = 0; k < 4; k++)
            if (!f[k].v) { /* the first form's factors, for every form */
                syn_fill(&f[k], 1.0f);
                factor_values[k] = f[k].v;
            }
        assert_int_equal(mkdir(ad, 0755), 0);
        syn_write(w, f, 4);
        write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": null, "
                         "\"target_parameters\": [\"experts.gate_up_proj\", \"experts.down_proj\"]}");
        outs[i] = tu_strdupf("%s/out-%zu", s->dir, i);
        if (i + 1 < nforms) {
            const char *dirs[1] = {ad};
            assert_int_equal(merge_on_cpu(base_dir, outs[i], dirs, 1, 0, 2, DT_INVALID), 3 * SYN_EXPERTS);
        } else {
            struct tu_run r = tu_run("convert", "--device", "cpu", base_dir, outs[i], "--lora", ad, NULL);
            if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
                !strstr(r.err, "config.json model_type is qwen3_5, its text_config's qwen3_5_text"))
                fail_msg("exit %d, stderr: %s", r.status, r.err);
            tu_run_free(&r);
            assert_int_equal(access(outs[i], F_OK), -1); /* refused: nothing written */
        }
        for (int k = 0; k < 4; k++)
            free(keys[k]);
        free(base_dir);
        free(ad);
        free(w);
    }
    /* Expert e's part p, by name in each output, holds the same bytes as in Mixtral's. */
    struct st_file *ref;
    char *ref_file = tu_strdupf("%s/model.safetensors", outs[0]);
    assert_int_equal(st_open(ref_file, &ref), NF4_OK);
    for (size_t i = 1; i + 1 < nforms; i++) {
        char *file = tu_strdupf("%s/model.safetensors", outs[i]);
        struct st_file *got;
        assert_int_equal(st_open(file, &got), NF4_OK);
        for (int e = 0; e < SYN_EXPERTS; e++)
            for (int p = 0; p < 3; p++) {
                char *want_name = tu_strdupf("%s.%d.%s.weight", FORMS[0].saved, e, FORMS[0].parts[p]),
                     *got_name = tu_strdupf("%s.%d.%s.weight", FORMS[i].saved, e, FORMS[i].parts[p]);
                const struct st_tensor *a = st_find(ref, want_name), *b = st_find(got, got_name);
                if (!a || !b)
                    fail_msg("%s: %s or %s is missing", FORMS[i].config, got_name, want_name);
                char *want = tu_strdupf("%s, Mixtral's form's (this base's config: %s)", want_name, FORMS[i].config);
                assert_same_tensor(got, b, ref, a, want);
                free(want);
                free(want_name);
                free(got_name);
            }
        st_close(got);
        free(file);
    }
    st_close(ref);
    free(ref_file);
    for (size_t i = 0; i < nforms; i++)
        free(outs[i]);
    for (int i = 0; i < 3 * SYN_EXPERTS; i++)
        free(base[i].v);
    for (int k = 0; k < 4; k++)
        free(factor_values[k]);
}

/* B's rows wider than the block merge_read_factors reads them in: r * E
 * floats of 204,804 bytes, of which 2 fit a read, so a part's 5 rows are read
 * as 2, 2 and 1, and a small chunk's rows start inside a block. */
static void test_experts_lora_wide_rows_of_b(void **state)
{
    struct tu_scratch *s = *state;
    enum { R = 17067 };
    struct syn_tensor base[3 * SYN_EXPERTS] = {{0}};
    char *base_dir = tu_strdupf("%s/base", s->dir), *ad = tu_strdupf("%s/ad", s->dir);
    write_experts_base(base_dir, "mixtral", base);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor f[2] = {
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_A.weight", DT_F32, {R * SYN_EXPERTS, SYN_HIDDEN}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_B.weight", DT_F32, {2 * SYN_INTERMEDIATE, R * SYN_EXPERTS},
         NULL},
    };
    syn_fill(&f[0], 1.0f);
    syn_fill(&f[1], 1.0f);
    char *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(w, f, 2);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 17067, \"lora_alpha\": 17067, \"target_modules\": null, "
                     "\"target_parameters\": [\"gate_up_proj\"]}");
    const struct syn_expert_term gate = {&f[0], &f[1], R, 1.0f, 0}, up = {&f[0], &f[1], R, 1.0f, SYN_INTERMEDIATE};
    const struct syn_expert_term *terms[3] = {&gate, &up, NULL};
    static const uint64_t CHUNKS[] = {0, 6};
    const char *dirs[1] = {ad};
    for (size_t ci = 0; ci < sizeof CHUNKS / sizeof CHUNKS[0]; ci++) {
        char *out = tu_strdupf("%s/out-%zu", s->dir, ci), *file = tu_strdupf("%s/model.safetensors", out);
        assert_int_equal(merge_on_cpu(base_dir, out, dirs, 1, CHUNKS[ci], 2, DT_INVALID), 2 * SYN_EXPERTS);
        struct st_file *o;
        assert_int_equal(st_open(file, &o), NF4_OK);
        for (int i = 0; i < 3 * SYN_EXPERTS; i++) {
            const struct expert_reference ref = {&base[i], terms[i % 3], terms[i % 3] != NULL, (uint64_t)i / 3};
            assert_tensor_is_reference(o, base[i].name, base[i].dtype, CHUNKS[ci], expert_element, &ref);
        }
        st_close(o);
        free(file);
        free(out);
    }
    for (int i = 0; i < 3 * SYN_EXPERTS; i++)
        free(base[i].v);
    free(f[0].v);
    free(f[1].v);
    free(base_dir);
    free(ad);
    free(w);
}

/* ---- LoRA on fused experts tensors (lora_experts.h's EXPERTS_FUSED) ---- */

#define FUSED_MODULE "model.layers.0.mlp.experts"

/* A fused experts tensor [E, n, m] with its terms merged, for the
 * reference: expert e's delta [out, in] is the per-expert form's (b_row0 0),
 * laid on [n, m] as [in, out] where `transposed`. */
struct fused_reference {
    const struct syn_tensor *base; /* [E, n, m] */
    const struct syn_expert_term *terms;
    size_t nterms;
    int transposed;
};

static float fused_element(const void *ctx, uint64_t e)
{
    const struct fused_reference *x = ctx;
    const uint64_t n = x->base->shape[1], m = x->base->shape[2];
    const uint64_t ex = e / (n * m), i = e / m % n, j = e % m;
    return reference_expert_merge(x->base->v[e], x->terms, x->nterms, ex, x->transposed ? j : i,
                                  x->transposed ? i : j);
}

/* A base holding FUSED_MODULE's gate_up_proj [E, 7, 10] (bf16) and
 * down_proj [E, 6, 6] (f16, square: only the model type tells its
 * orientation), config.json saying `model_type`; random values. */
static void write_fused_base(const char *dir, const char *model_type, struct syn_tensor base[2])
{
    base[0] = (struct syn_tensor){FUSED_MODULE ".gate_up_proj", DT_BF16, {SYN_EXPERTS, 7, 10}, NULL};
    base[1] = (struct syn_tensor){FUSED_MODULE ".down_proj", DT_F16, {SYN_EXPERTS, 6, 6}, NULL};
    syn_fill(&base[0], 2.0f);
    syn_fill(&base[1], 2.0f);
    char *json = tu_strdupf("{\"model_type\": \"%s\"}", model_type);
    write_model_dir(dir, json, base, 2);
    free(json);
}

/* Two adapters on a base that holds its experts fused, checked element by
 * element against the reference for several chunk sizes (chunks may not
 * cross an expert: 64 elements would), thread counts and output dtypes: one
 * on both parameters (gate_up_proj's pair under M.base_layer), bf16 factors,
 * down_proj with rank_pattern; one on gate_up_proj alone with rsLoRA, fp32.
 * gpt_oss's experts module is_transposed ([E, in, out]); gemma4_text's is
 * not ([E, out, in]), so the same tensors take factors of other shapes;
 * qwen3_moe's, saved per expert by transformers, is taken as it is here; and
 * qwen3_vl_moe's is either, by its shape: gate_up_proj [E, in, out] as Qwen's
 * checkpoints hold it, or [E, out, in], and the square down_proj as it is,
 * as transformers loads them. */
static void test_experts_lora_fused_matches_reference(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *model_type;
        int transposed, down_transposed; /* gate_up_proj's, down_proj's */
    } TYPES[] = {{"gpt_oss", 1, 1},      {"gemma4_text", 0, 0},  {"qwen3_moe", 0, 0},
                 {"qwen3_vl_moe", 1, 0}, {"qwen3_vl_moe", 0, 0}};
    for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++) {
        const int tr = TYPES[ti].transposed;
        struct syn_tensor base[2];
        char *base_dir = tu_strdupf("%s/base-%zu", s->dir, ti), *ad1 = tu_strdupf("%s/ad1-%zu", s->dir, ti),
             *ad2 = tu_strdupf("%s/ad2-%zu", s->dir, ti);
        write_fused_base(base_dir, TYPES[ti].model_type, base);
        /* gate_up_proj [E, 7, 10]: in 7 and out 10 where transposed, else in 10 and out 7. */
        const uint64_t gu_in = tr ? 7 : 10, gu_out = tr ? 10 : 7;
#define M PEFT_KEY_PREFIX FUSED_MODULE
        struct syn_tensor f1[4] = {
            {M ".base_layer.lora_A.weight", DT_BF16, {2 * SYN_EXPERTS, gu_in}, NULL},
            {M ".base_layer.lora_B.weight", DT_BF16, {gu_out, 2 * SYN_EXPERTS}, NULL},
            {M ".lora_A.weight", DT_BF16, {1 * SYN_EXPERTS, 6}, NULL},
            {M ".lora_B.weight", DT_BF16, {6, 1 * SYN_EXPERTS}, NULL},
        };
        struct syn_tensor f2[2] = {
            {M ".lora_A.weight", DT_F32, {3 * SYN_EXPERTS, gu_in}, NULL},
            {M ".lora_B.weight", DT_F32, {gu_out, 3 * SYN_EXPERTS}, NULL},
        };
#undef M
        for (int i = 0; i < 4; i++) {
            syn_fill(&f1[i], 1.0f);
            if (i < 2)
                syn_fill(&f2[i], 1.0f);
        }
        assert_int_equal(mkdir(ad1, 0755), 0);
        assert_int_equal(mkdir(ad2, 0755), 0);
        char *w1 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad1), *w2 = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad2);
        syn_write(w1, f1, 4);
        syn_write(w2, f2, 2);
        write_config(ad1, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": null, "
                          "\"target_parameters\": [\"experts.gate_up_proj\", \"experts.down_proj\"], "
                          "\"rank_pattern\": {\"down_proj\": 1}}");
        write_config(ad2, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 3, \"use_rslora\": true, "
                          "\"target_modules\": null, \"target_parameters\": [\"mlp.experts.gate_up_proj\"]}");
        const struct syn_expert_term gate_up[2] = {{&f1[0], &f1[1], 2, 2.0f, 0},
                                                   {&f2[0], &f2[1], 3, (float)(3 / sqrt(3.0)), 0}};
        const struct syn_expert_term down[1] = {{&f1[2], &f1[3], 1, 4.0f, 0}};
        const struct fused_reference refs[2] = {{&base[0], gate_up, 2, tr},
                                                {&base[1], down, 1, TYPES[ti].down_transposed}};

        static const uint64_t CHUNKS[] = {0, 1, 6, 64};
        static const enum st_dtype DTYPES[] = {DT_INVALID, DT_F32};
        const char *dirs[2] = {ad1, ad2};
        for (size_t ci = 0; ci < sizeof CHUNKS / sizeof CHUNKS[0]; ci++)
            for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
                char *out = tu_strdupf("%s/out-%zu-%zu-%zu", s->dir, ti, ci, di),
                     *file = tu_strdupf("%s/model.safetensors", out);
                assert_int_equal(merge_on_cpu(base_dir, out, dirs, 2, CHUNKS[ci], 1 + (int)ci % 3, DTYPES[di]), 2);
                struct st_file *f;
                assert_int_equal(st_open(file, &f), NF4_OK);
                for (int i = 0; i < 2; i++) {
                    const struct st_tensor *t = st_find(f, base[i].name);
                    assert_non_null(t);
                    assert_int_equal(t->ndim, 3);
                    assert_memory_equal(t->shape, base[i].shape, sizeof base[i].shape);
                    assert_tensor_is_reference(f, base[i].name, DTYPES[di] != DT_INVALID ? DTYPES[di] : base[i].dtype,
                                               CHUNKS[ci], fused_element, &refs[i]);
                }
                st_close(f);
                free(file);
                free(out);
            }
        for (int i = 0; i < 4; i++) {
            free(f1[i].v);
            if (i < 2) {
                free(f2[i].v);
                free(base[i].v);
            }
        }
        free(base_dir);
        free(ad1);
        free(ad2);
        free(w1);
        free(w2);
    }
}

/* LoRAs on fused experts that do not fit the base: exit 65, one line naming
 * the file and the key, and no output. */
static void test_experts_lora_fused_refusals(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor fused[2], per_expert[3 * SYN_EXPERTS] = {{0}};
    static char names[3 * SYN_EXPERTS][96];
    static const char *const PARTS[3] = {"gate_proj", "up_proj", "down_proj"};
    char *gpt_oss = tu_strdupf("%s/gpt_oss", s->dir), *llama = tu_strdupf("%s/llama", s->dir),
         *split = tu_strdupf("%s/split", s->dir), *ints = tu_strdupf("%s/ints", s->dir),
         *qwen3_vl_moe = tu_strdupf("%s/qwen3_vl_moe", s->dir);
    write_fused_base(gpt_oss, "gpt_oss", fused);
    free(fused[0].v);
    free(fused[1].v);
    write_fused_base(qwen3_vl_moe, "qwen3_vl_moe", fused);
    free(fused[0].v);
    free(fused[1].v);
    write_fused_base(llama, "llama", fused);
    free(fused[0].v);
    free(fused[1].v);
    write_experts_base_named(split, "{\"model_type\": \"gpt_oss\"}", FUSED_MODULE, PARTS, per_expert, names);
    /* gpt_oss's gate_up_proj as I32 */
    struct syn_tensor int_base = {FUSED_MODULE ".gate_up_proj", DT_I32, {SYN_EXPERTS, 7, 10}, NULL};
    syn_fill(&int_base, 2.0f);
    write_model_dir(ints, "{\"model_type\": \"gpt_oss\"}", &int_base, 1);
    static const struct {
        const char *base, *want;
        uint64_t a_shape[2], b_shape[2];
    } BAD[] = {
        {"gpt_oss", "gives each expert of " FUSED_MODULE ".gate_up_proj [3, 7, 10] a 7x10 delta (out x in), but it "
         "holds [experts, in, out] (is_transposed)", {6, 10}, {7, 6}},
        {"gpt_oss", "holds 2 experts (r = 2), but the base's " FUSED_MODULE ".gate_up_proj has 3", {4, 7}, {10, 4}},
        {"qwen3_vl_moe", "gives each expert of " FUSED_MODULE ".gate_up_proj [3, 7, 10] a 9x7 delta (out x in), but "
         "it holds neither [experts, out, in] nor [experts, in, out]", {6, 7}, {9, 6}},
        {"gpt_oss", "has 6 columns, 5 rows in", {5, 7}, {10, 6}},
        {"split", "which the base's model_type saves as one 3-D tensor, but the base has no 3-D tensor "
         FUSED_MODULE ".gate_up_proj", {6, 7}, {10, 6}},
        {"llama", "config.json model_type is llama", {6, 7}, {10, 6}},
        {"ints", "is a LoRA on the fused MoE experts " FUSED_MODULE ".gate_up_proj, which is I32", {6, 7}, {10, 6}},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        char *ad = tu_strdupf("%s/ad-%zu", s->dir, i), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
        assert_int_equal(mkdir(ad, 0755), 0);
        struct syn_tensor f[2] = {
            {PEFT_KEY_PREFIX FUSED_MODULE ".lora_A.weight", DT_F32, {BAD[i].a_shape[0], BAD[i].a_shape[1]}, NULL},
            {PEFT_KEY_PREFIX FUSED_MODULE ".lora_B.weight", DT_F32, {BAD[i].b_shape[0], BAD[i].b_shape[1]}, NULL}};
        syn_fill(&f[0], 1.0f);
        syn_fill(&f[1], 1.0f);
        syn_write(w, f, 2);
        write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, "
                         "\"target_parameters\": [\"gate_up_proj\"]}");
        char *in = tu_strdupf("%s/%s", s->dir, BAD[i].base), *out = tu_strdupf("%s/out", s->dir);
        struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", ad, NULL);
        if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, BAD[i].want) ||
            !strstr(r.err, PEFT_KEY_PREFIX FUSED_MODULE ".lora_A.weight"))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        assert_int_equal(access(out, F_OK), -1);
        tu_run_free(&r);
        free(f[0].v);
        free(f[1].v);
        free(in);
        free(out);
        free(ad);
        free(w);
    }
    for (int i = 0; i < 3 * SYN_EXPERTS; i++)
        free(per_expert[i].v);
    free(int_base.v);
    free(gpt_oss);
    free(llama);
    free(split);
    free(ints);
    free(qwen3_vl_moe);
}

/* A LoRA on Mixtral's router through target_parameters ("mlp.gate.weight",
 * as PEFT names the runtime's module; phimoe's "mlp.router.weight"): the
 * checkpoint saves it as ".block_sparse_moe.gate", as transformers renames
 * it, and the pair merges into that tensor, by the formula. Under a model
 * type that renames nothing the same adapter names a tensor the base lacks,
 * and is refused. */
static void test_lora_on_renamed_router(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *model_type, *module, *parameter; /* the runtime's, as the adapter names them */
        int merges;
    } ROUTERS[] = {{"mixtral", "model.layers.0.mlp.gate", "mlp.gate.weight", 1},
                   {"phimoe", "model.layers.0.mlp.router", "mlp.router.weight", 1},
                   {"llama", "model.layers.0.mlp.gate", "mlp.gate.weight", 0}};
    struct syn_tensor base = {"model.layers.0.block_sparse_moe.gate.weight", DT_BF16, {SYN_EXPERTS, SYN_HIDDEN}, NULL};
    syn_fill(&base, 2.0f);
    for (size_t i = 0; i < sizeof ROUTERS / sizeof ROUTERS[0]; i++) {
        char *a_key = tu_strdupf(PEFT_KEY_PREFIX "%s.lora_A.weight", ROUTERS[i].module),
             *b_key = tu_strdupf(PEFT_KEY_PREFIX "%s.lora_B.weight", ROUTERS[i].module);
        struct syn_tensor f[2] = {{a_key, DT_F32, {2, SYN_HIDDEN}, NULL}, {b_key, DT_F32, {SYN_EXPERTS, 2}, NULL}};
        syn_fill(&f[0], 1.0f);
        syn_fill(&f[1], 1.0f);
        char *ad = tu_strdupf("%s/ad-%zu", s->dir, i), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad),
             *dir = tu_strdupf("%s/base-%zu", s->dir, i), *out = tu_strdupf("%s/out-%zu", s->dir, i),
             *config = tu_strdupf("{\"model_type\": \"%s\"}", ROUTERS[i].model_type),
             *adapter_config = tu_strdupf("{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                                          "\"target_modules\": null, \"target_parameters\": [\"%s\"]}",
                                          ROUTERS[i].parameter);
        assert_int_equal(mkdir(ad, 0755), 0);
        syn_write(w, f, 2);
        write_config(ad, adapter_config);
        write_model_dir(dir, config, &base, 1);
        if (ROUTERS[i].merges) {
            const struct syn_term term = {&f[0], &f[1], 2, 2.0f, 0};
            const struct syn_reference ref = {&base, &term, 1};
            const char *dirs[1] = {ad};
            assert_int_equal(merge_on_cpu(dir, out, dirs, 1, 0, 2, DT_INVALID), 1);
            char *file = tu_strdupf("%s/model.safetensors", out);
            struct st_file *got;
            assert_int_equal(st_open(file, &got), NF4_OK);
            assert_tensor_is_reference(got, base.name, DT_BF16, 0, syn_element, &ref);
            st_close(got);
            free(file);
        } else {
            struct tu_run r = tu_run("convert", "--device", "cpu", dir, out, "--lora", ad, NULL);
            if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
                !strstr(r.err, "matches no floating-point tensor model.layers.0.mlp.gate.weight in the base model"))
                fail_msg("exit %d, stderr: %s", r.status, r.err);
            tu_run_free(&r);
            assert_int_equal(access(out, F_OK), -1);
        }
        free(f[0].v);
        free(f[1].v);
        free(a_key);
        free(b_key);
        free(ad);
        free(w);
        free(dir);
        free(out);
        free(config);
        free(adapter_config);
    }
    free(base.v);
}

/* LoRAs on MoE experts that PEFT could not have written for the base, or
 * that nf4deq cannot place: exit 65, one line naming the file and the key,
 * and no output. */
static void test_experts_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor base[3 * SYN_EXPERTS] = {{0}};
    char *mixtral = tu_strdupf("%s/mixtral", s->dir), *llama = tu_strdupf("%s/llama", s->dir);
    write_experts_base(mixtral, "mixtral", base);
    write_experts_base(llama, "llama", base);
    static const char GATE_UP[] = "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, "
                                  "\"target_parameters\": [\"gate_up_proj\"]}";
    static const struct {
        const char *base, *config, *want;
        const char *a_key, *b_key; /* after PEFT_KEY_PREFIX "model.layers.0.mlp.experts" */
        uint64_t a_shape[2], b_shape[2];
        enum st_dtype dtype;
    } BAD[] = {
        {"llama", GATE_UP, "merges for the model types whose saved experts it knows (as Mixtral's, as Qwen2-MoE's, "
         "or fused: README.md); the base's config.json model_type is llama", ".lora_A.weight", ".lora_B.weight",
         {6, 7}, {10, 6}, DT_F32},
        {"mixtral", GATE_UP, "has 6 columns, 5 rows in", ".lora_A.weight", ".lora_B.weight", {5, 7}, {10, 6},
         DT_F32},
        {"mixtral", GATE_UP, "has 8 columns, 6 rows in", ".lora_A.weight", ".lora_B.weight", {6, 7}, {10, 8},
         DT_F32},
        {"mixtral", GATE_UP, "holds 2 experts (r = 2), but the base has "
         "model.layers.0.block_sparse_moe.experts.2.w1.weight too", ".lora_A.weight", ".lora_B.weight", {4, 7},
         {10, 4}, DT_F32},
        {"mixtral", GATE_UP, "the base has no floating-point tensor model.layers.0.block_sparse_moe.experts.3.w1.weight",
         ".lora_A.weight", ".lora_B.weight", {8, 7}, {10, 8}, DT_F32},
        {"mixtral", GATE_UP, "has 9 rows, which do not make the gate_up_proj of 2 parts", ".lora_A.weight",
         ".lora_B.weight", {6, 7}, {9, 6}, DT_F32},
        {"mixtral", GATE_UP, "gives model.layers.0.block_sparse_moe.experts.0.w1.weight a 5x6 delta, but it is 5x7",
         ".lora_A.weight", ".lora_B.weight", {6, 6}, {10, 6}, DT_F32},
        {"mixtral", GATE_UP, "is a LoRA on a parameter of model.layers.0.mlp.experts that target_parameters does not "
         "name (it selects 1 there)", ".base_layer.lora_A.weight", ".base_layer.lora_B.weight", {6, 7}, {10, 6},
         DT_F32},
        {"mixtral", GATE_UP, "is I32; LoRA weights must be F32, BF16 or F16", ".lora_A.weight", ".lora_B.weight",
         {6, 7}, {10, 6}, DT_I32},
        {"mixtral", GATE_UP, "has no matching base_model.model.model.layers.0.mlp.experts.lora_B.weight",
         ".lora_A.weight", ".other.weight", {6, 7}, {10, 6}, DT_F32},
        {"mixtral", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"use_dora\": true, "
         "\"target_parameters\": [\"gate_up_proj\"]}", "is a LoRA on a parameter (target_parameters), and the "
         "config sets use_dora, which PEFT's ParamWrapper refuses", ".lora_A.weight", ".lora_B.weight", {6, 7},
         {10, 6}, DT_F32},
        {"mixtral", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"lora_bias\": true, "
         "\"target_parameters\": [\"gate_up_proj\"]}", "sets lora_bias, which PEFT's ParamWrapper refuses",
         ".lora_A.weight", ".lora_B.weight", {6, 7}, {10, 6}, DT_F32},
        {"mixtral", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"fan_in_fan_out\": true, "
         "\"target_parameters\": [\"gate_up_proj\"]}", "sets fan_in_fan_out, which PEFT's ParamWrapper refuses",
         ".lora_A.weight", ".lora_B.weight", {6, 7}, {10, 6}, DT_F32},
        {"mixtral", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"target_parameters\": \"gate_up_proj\"}",
         "\"target_parameters\" must be a list of parameter names", ".lora_A.weight", ".lora_B.weight", {6, 7},
         {10, 6}, DT_F32},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        char *ad = tu_strdupf("%s/ad-%zu", s->dir, i), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
        char *a_name = tu_strdupf(PEFT_KEY_PREFIX "model.layers.0.mlp.experts%s", BAD[i].a_key);
        char *b_name = tu_strdupf(PEFT_KEY_PREFIX "model.layers.0.mlp.experts%s", BAD[i].b_key);
        assert_int_equal(mkdir(ad, 0755), 0);
        struct syn_tensor f[2] = {{a_name, BAD[i].dtype, {BAD[i].a_shape[0], BAD[i].a_shape[1]}, NULL},
                                  {b_name, DT_F32, {BAD[i].b_shape[0], BAD[i].b_shape[1]}, NULL}};
        syn_fill(&f[0], 1.0f);
        syn_fill(&f[1], 1.0f);
        syn_write(w, f, 2);
        write_config(ad, BAD[i].config);
        char *in = tu_strdupf("%s/%s", s->dir, BAD[i].base), *out = tu_strdupf("%s/out", s->dir);
        struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", ad, NULL);
        if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, BAD[i].want))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        struct stat st;
        assert_int_not_equal(stat(out, &st), 0);
        tu_run_free(&r);
        free(f[0].v);
        free(f[1].v);
        free(in);
        free(out);
        free(a_name);
        free(b_name);
        free(ad);
        free(w);
    }
    for (int i = 0; i < 3 * SYN_EXPERTS; i++)
        free(base[i].v);
    free(mixtral);
    free(llama);
}

/* target_parameters that no pair of the adapter is for: PEFT matched none
 * of them when it trained (it saves a pair for each one it wraps), warns, and
 * merges the rest; so does nf4deq, with one warning. What PEFT's
 * ParamWrapper refuses (use_dora here) is then no reason to refuse: PEFT
 * wrapped no parameter, and trained v_proj as DoRA. */
static void test_experts_lora_none_saved_warns(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const CONFIGS[] = {
        "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"v_proj\"], "
        "\"target_parameters\": [\"mlp.experts.gate_up_proj\"]}",
        "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"v_proj\"], "
        "\"use_dora\": true, \"target_parameters\": [\"mlp.experts.gate_up_proj\"]}",
    };
    for (size_t i = 0; i < sizeof CONFIGS / sizeof CONFIGS[0]; i++) {
        char *ad = tu_strdupf("%s/ad-%zu", s->dir, i), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad),
             *out = tu_strdupf("%s/out-%zu", s->dir, i);
        assert_int_equal(mkdir(ad, 0755), 0);
        struct syn_tensor f[3] = {
            {PEFT_KEY_PREFIX "model.layers.0.self_attn.v_proj.lora_A.weight", DT_F32, {4, 128}, NULL},
            {PEFT_KEY_PREFIX "model.layers.0.self_attn.v_proj.lora_B.weight", DT_F32, {64, 4}, NULL},
            {PEFT_KEY_PREFIX "model.layers.0.self_attn.v_proj.lora_magnitude_vector", DT_F32, {64, 0}, NULL},
        };
        const size_t n = i == 1 ? 3 : 2; /* DoRA's magnitude with use_dora */
        for (size_t k = 0; k < n; k++)
            syn_fill(&f[k], 1.0f);
        syn_write(w, f, n);
        write_config(ad, CONFIGS[i]);
        assert_lora_warns_once(LORA_FIXTURES "/base-qwen3moe-bf16-bnb4", out, ad,
                               "target_parameters select no parameter the adapter holds a LoRA for",
                               "1 with LoRA merged");
        for (size_t k = 0; k < n; k++)
            free(f[k].v);
        free(ad);
        free(w);
        free(out);
    }
}

static void copy_tensors(const char *from, const char *to, int (*keep)(const char *, const void *), const void *arg,
                         const char *name_prefix, char *(*rename)(const char *name));

static int in_mlp(const char *name, const void *arg)
{
    (void)arg;
    return strstr(name, ".mlp.") != NULL;
}

/* "model.layers.L.mlp.X" -> "model.layers.0.mlp.experts.L.X": layer L's MLP as expert L. */
static char *layer_as_expert(const char *name)
{
    unsigned layer;
    int at = 0;
    assert_int_equal(sscanf(name, "model.layers.%u.mlp.%n", &layer, &at), 1);
    assert_true(at > 0);
    return tu_strdupf("model.layers.0.mlp.experts.%u.%s", layer, name + at);
}

/* 4-bit experts, as a checkpoint quantized before transformers 5 holds them
 * (base-llama-bf16-bnb4's two MLPs, written by bitsandbytes, as experts 0 and
 * 1): a LoRA on the fused gate_up_proj merges exactly as the same deltas
 * given as plain pairs on each expert's gate_proj and up_proj, byte for byte. */
static void test_experts_lora_on_4bit_experts(void **state)
{
    struct tu_scratch *s = *state;
    enum { E = 2, R = 3, H = 128, I = 352 };
    char *base = tu_strdupf("%s/base", s->dir), *weights = tu_strdupf("%s/model.safetensors", base),
         *config = tu_strdupf("%s/config.json", base);
    assert_int_equal(mkdir(base, 0755), 0);
    copy_tensors(LORA_FIXTURES "/base-llama-bf16-bnb4/model.safetensors", weights, in_mlp, NULL, NULL,
                 layer_as_expert);
    static const char CONFIG[] = "{\"model_type\": \"qwen3_moe\"}";
    tu_write_file(config, CONFIG, strlen(CONFIG));
    /* The fused pair, and the same deltas as plain pairs. */
    struct syn_tensor fused[2] = {
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_A.weight", DT_F32, {R * E, H}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.mlp.experts.lora_B.weight", DT_F32, {2 * I, R * E}, NULL},
    };
    syn_fill(&fused[0], 1.0f);
    syn_fill(&fused[1], 0.1f);
    static char names[2 * E * 2][96];
    struct syn_tensor plain[2 * E * 2];
    for (int e = 0; e < E; e++)
        for (int part = 0; part < 2; part++) {
            struct syn_tensor *a = &plain[(e * 2 + part) * 2], *b = a + 1;
            const char *proj = part ? "up_proj" : "gate_proj";
            snprintf(names[(e * 2 + part) * 2], sizeof names[0],
                     PEFT_KEY_PREFIX "model.layers.0.mlp.experts.%d.%s.lora_A.weight", e, proj);
            snprintf(names[(e * 2 + part) * 2 + 1], sizeof names[0],
                     PEFT_KEY_PREFIX "model.layers.0.mlp.experts.%d.%s.lora_B.weight", e, proj);
            *a = (struct syn_tensor){names[(e * 2 + part) * 2], DT_F32, {R, H}, malloc(R * H * sizeof(float))};
            *b = (struct syn_tensor){names[(e * 2 + part) * 2 + 1], DT_F32, {I, R}, malloc(I * R * sizeof(float))};
            memcpy(a->v, fused[0].v + (size_t)e * R * H, R * H * sizeof(float)); /* A's rows e*r.. */
            for (int row = 0; row < I; row++) /* B's columns e, e + E, ... of its gate or up rows */
                for (int k = 0; k < R; k++)
                    b->v[row * R + k] = fused[1].v[(size_t)(part * I + row) * R * E + k * E + e];
        }
    char *ad_fused = tu_strdupf("%s/fused", s->dir), *ad_plain = tu_strdupf("%s/plain", s->dir);
    char *w_fused = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad_fused),
         *w_plain = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad_plain);
    assert_int_equal(mkdir(ad_fused, 0755), 0);
    assert_int_equal(mkdir(ad_plain, 0755), 0);
    syn_write(w_fused, fused, 2);
    syn_write(w_plain, plain, 2 * E * 2);
    write_config(ad_fused, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5, \"target_modules\": [], "
                           "\"target_parameters\": [\"mlp.experts.gate_up_proj\"]}");
    write_config(ad_plain, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 5, "
                           "\"target_modules\": [\"gate_proj\", \"up_proj\"]}");
    char *out_fused = tu_strdupf("%s/out-fused", s->dir), *out_plain = tu_strdupf("%s/out-plain", s->dir);
    const char *d1[1] = {ad_fused}, *d2[1] = {ad_plain};
    assert_int_equal(merge_on_cpu(base, out_fused, d1, 1, 1, 3, DT_INVALID), 2 * E);
    assert_int_equal(merge_on_cpu(base, out_plain, d2, 1, 0, 2, DT_INVALID), 2 * E);
    char *f1 = tu_strdupf("%s/model.safetensors", out_fused), *f2 = tu_strdupf("%s/model.safetensors", out_plain);
    tu_assert_same_tensors(f1, f2);
    free(fused[0].v);
    free(fused[1].v);
    for (int i = 0; i < 2 * E * 2; i++)
        free(plain[i].v);
    free(base);
    free(weights);
    free(config);
    free(ad_fused);
    free(ad_plain);
    free(w_fused);
    free(w_plain);
    free(out_fused);
    free(out_plain);
    free(f1);
    free(f2);
}

/* A 2-D parameter in target_parameters ("self_attn.q_proj.weight") is a
 * ParamWrapper with one expert: the same pair and delta as the LoRA layer
 * target_modules would give, with rank_pattern and alpha_pattern matched
 * against "M.weight", not "M", and no target_modules needed. */
static void test_parameter_targets_as_layers(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *name, *config;
    } CONFIGS[] = {
        {"module-pattern", "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\"], "
                           "\"alpha_pattern\": {\"layers\\\\.1\\\\.self_attn\\\\.q_proj\": 32}}"},
        {"param-pattern", "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [], "
                          "\"target_parameters\": [\"self_attn.q_proj.weight\"], "
                          "\"alpha_pattern\": {\"layers\\\\.1\\\\.self_attn\\\\.q_proj\\\\.weight\": 32}}"},
        {"module", "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\"]}"},
        {"param-module-pattern", "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [], "
                                 "\"target_parameters\": [\"q_proj.weight\"], "
                                 "\"alpha_pattern\": {\"layers\\\\.1\\\\.self_attn\\\\.q_proj\": 32}}"},
    };
    struct syn_tensor f[4] = {
        {PEFT_KEY_PREFIX "model.layers.0.self_attn.q_proj.lora_A.weight", DT_F32, {8, 128}, NULL},
        {PEFT_KEY_PREFIX "model.layers.0.self_attn.q_proj.lora_B.weight", DT_F32, {128, 8}, NULL},
        {PEFT_KEY_PREFIX "model.layers.1.self_attn.q_proj.lora_A.weight", DT_F32, {8, 128}, NULL},
        {PEFT_KEY_PREFIX "model.layers.1.self_attn.q_proj.lora_B.weight", DT_F32, {128, 8}, NULL},
    };
    for (int i = 0; i < 4; i++)
        syn_fill(&f[i], 1.0f);
    char *outs[4];
    for (size_t i = 0; i < 4; i++) {
        char *ad = tu_strdupf("%s/ad-%s", s->dir, CONFIGS[i].name), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
        assert_int_equal(mkdir(ad, 0755), 0);
        syn_write(w, f, 4);
        write_config(ad, CONFIGS[i].config);
        outs[i] = tu_strdupf("%s/out-%s", s->dir, CONFIGS[i].name);
        const char *dirs[1] = {ad};
        assert_int_equal(merge_on_cpu(LORA_FIXTURES "/base-llama-bf16-bnb4", outs[i], dirs, 1, 0, 2, DT_INVALID), 2);
        free(ad);
        free(w);
    }
    char *a = tu_strdupf("%s/model.safetensors", outs[0]), *b = tu_strdupf("%s/model.safetensors", outs[1]),
         *c = tu_strdupf("%s/model.safetensors", outs[2]), *d = tu_strdupf("%s/model.safetensors", outs[3]);
    tu_assert_same_tensors(b, a); /* the parameter's pattern is the module's */
    tu_assert_same_tensors(d, c); /* a module's pattern does not match the parameter */
    struct st_file *fa, *fc; /* and the pattern does change the merge */
    assert_int_equal(st_open(a, &fa), NF4_OK);
    assert_int_equal(st_open(c, &fc), NF4_OK);
    const struct st_tensor *ta = st_find(fa, "model.layers.1.self_attn.q_proj.weight"),
                           *tc = st_find(fc, "model.layers.1.self_attn.q_proj.weight");
    uint64_t n = st_tensor_bytes(ta);
    unsigned char *x = malloc(n), *y = malloc(n);
    assert_int_equal(st_read(fa, ta, 0, x, n), NF4_OK);
    assert_int_equal(st_read(fc, tc, 0, y, n), NF4_OK);
    assert_true(memcmp(x, y, n) != 0);
    free(x);
    free(y);
    st_close(fa);
    st_close(fc);
    /* What PEFT's ParamWrapper refuses is refused where it wraps a parameter. */
    char *ad = tu_strdupf("%s/ad-dora", s->dir), *w = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad),
         *out = tu_strdupf("%s/out-dora", s->dir);
    assert_int_equal(mkdir(ad, 0755), 0);
    syn_write(w, f, 4);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [], "
                     "\"use_dora\": true, \"target_parameters\": [\"q_proj.weight\"]}");
    const char *dirs[1] = {ad};
    struct convert_stats st;
    assert_int_equal(convert_on_cpu(LORA_FIXTURES "/base-llama-bf16-bnb4", out, dirs, 1, 0, 0, DT_INVALID, &st),
                     NF4_EDATA);
    if (!strstr(nf4_last_error(), "model.layers.0.self_attn.q_proj.lora_A.weight: is a LoRA on a parameter "
                                  "(target_parameters), and the config sets use_dora"))
        fail_msg("%s", nf4_last_error());
    assert_int_equal(access(out, F_OK), -1); /* refused: nothing written */
    free(ad);
    free(w);
    free(out);
    for (int i = 0; i < 4; i++) {
        free(f[i].v);
        free(outs[i]);
    }
    free(a);
    free(b);
    free(c);
    free(d);
}

/* --device auto weighs a merge (merge_wants_gpu, src/convert.c): the GPU
 * when most merged elements are 4-bit and their mean rank is at least 48 per
 * 16 CPU threads. Wanted, it is used, or missing here said so; not wanted,
 * the CPU converts without a word about CUDA. */
static void test_auto_device_weighs_the_merge(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *base, *adapter, *threads;
        int wants_gpu;
    } CASES_[] = {
        {"base-llama-bf16-bnb4", "adapter-r8-all-linear", "2", 1},  /* r = 8 on 2 threads: 64 */
        {"base-llama-bf16-bnb4", "adapter-r8-all-linear", "3", 0},  /* 42.7 */
        {"base-qwen3moe-bf16-bnb4", "adapter-experts", "1", 0},    /* 63% of merged elements are 16-bit */
    };
    for (size_t i = 0; i < sizeof CASES_ / sizeof CASES_[0]; i++) {
        char *base = tu_strdupf(LORA_FIXTURES "/%s", CASES_[i].base),
             *ad = tu_strdupf(LORA_FIXTURES "/%s", CASES_[i].adapter), *out = tu_strdupf("%s/out-%zu", s->dir, i);
        struct tu_run r = tu_run("convert", "--threads", CASES_[i].threads, base, out, "--lora", ad, NULL);
        const int missing = strstr(r.err, "no CUDA device found") != NULL, on_cpu = strstr(r.err, ", on CPU") != NULL;
        if (r.status != 0 || (CASES_[i].wants_gpu ? !missing && on_cpu : missing || !on_cpu))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        tu_run_free(&r);
        free(base);
        free(ad);
        free(out);
    }
}

/* What PEFT 0.21 saves beside the LoRA pairs, each merged as it loads it:
 * - "M.base_layer.P": the base layer of a wrapped module (its bias with
 *   "bias": "all"; lm_head with save_embedding_layers), put back into M.P, and
 *   the same adapter's LoRA pair on M goes on top of it;
 * - modules_to_save entries matched by str.endswith, no '.' boundary ("norm"
 *   takes input_layernorm), on any module above the tensor ("layers.1.mlp");
 * - fan_in_fan_out: the layer decides, a 16-bit base's shape tells (square:
 *   the config). */
static void test_peft_saved_layouts(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor base[6] = {
        {"m.head.weight", DT_BF16, {37, 53}, NULL},      /* LoRA on a saved base layer */
        {"m.q.bias", DT_BF16, {37, 0}, NULL},            /* replaced from q.base_layer.bias */
        {"m.input_layernorm.weight", DT_F32, {37, 0}, NULL}, /* modules_to_save "norm" */
        {"m.layers.1.mlp.down.weight", DT_F16, {5, 7}, NULL}, /* modules_to_save "layers.1.mlp" */
        {"m.conv.weight", DT_F32, {13, 11}, NULL},       /* [in, out]: a Conv1D, fan_in_fan_out false */
        {"m.layers.2.mlp.down.weight", DT_F16, {5, 7}, NULL}, /* untouched */
    };
    struct syn_tensor saved[7] = {
        {PEFT_KEY_PREFIX "m.head.base_layer.weight", DT_BF16, {37, 53}, NULL},
        {PEFT_KEY_PREFIX "m.head.lora_A.weight", DT_F32, {3, 53}, NULL},
        {PEFT_KEY_PREFIX "m.head.lora_B.weight", DT_F32, {37, 3}, NULL},
        {PEFT_KEY_PREFIX "m.q.base_layer.bias", DT_BF16, {37, 0}, NULL},
        {PEFT_KEY_PREFIX "m.input_layernorm.weight", DT_F32, {37, 0}, NULL},
        {PEFT_KEY_PREFIX "m.layers.1.mlp.down.weight", DT_F16, {5, 7}, NULL},
        {PEFT_KEY_PREFIX "m.conv.lora_A.weight", DT_F32, {2, 13}, NULL},
    };
    struct syn_tensor conv_b = {PEFT_KEY_PREFIX "m.conv.lora_B.weight", DT_F32, {11, 2}, NULL};
    for (int i = 0; i < 6; i++) {
        if (!base[i].shape[1])
            base[i].shape[1] = 1; /* filled as 37 x 1, written 1-D below */
        syn_fill(&base[i], 2.0f);
    }
    for (int i = 0; i < 7; i++) {
        if (!saved[i].shape[1])
            saved[i].shape[1] = 1;
        syn_fill(&saved[i], 2.0f);
    }
    syn_fill(&conv_b, 1.0f);
    base[1].shape[1] = base[2].shape[1] = saved[3].shape[1] = saved[4].shape[1] = 0;
    char *base_path = tu_strdupf("%s/base.safetensors", s->dir), *ad = tu_strdupf("%s/ad", s->dir);
    syn_write(base_path, base, 6);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor all[8];
    memcpy(all, saved, sizeof saved);
    all[7] = conv_b;
    char *wpath = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(wpath, all, 8);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 6, \"rank_pattern\": {\"conv\": 2}, "
                     "\"target_modules\": [\"head\", \"conv\"], \"modules_to_save\": [\"norm\", \"layers.1.mlp\"], "
                     "\"bias\": \"all\", \"fan_in_fan_out\": false}");
    const char *dirs[1] = {ad};
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    assert_int_equal(merge_on_cpu(base_path, out, dirs, 1, 0, 0, DT_INVALID), 2);
    struct syn_term head = {&saved[1], &saved[2], 3, 2.0f, 0}, conv = {&saved[6], &conv_b, 2, 3.0f, 1};
    /* What each output tensor holds: its source's values, with the terms on top. */
    const struct {
        const struct syn_tensor *src;
        const struct syn_term *term;
    } WANT[6] = {{&saved[0], &head}, {&saved[3], NULL}, {&saved[4], NULL},
                 {&saved[5], NULL},  {&base[4], &conv}, {&base[5], NULL}};
    struct st_file *f;
    assert_int_equal(st_open(out, &f), NF4_OK);
    for (int i = 0; i < 6; i++) {
        const struct st_tensor *t = st_find(f, base[i].name);
        assert_non_null(t);
        assert_int_equal(t->dtype, base[i].dtype);
        unsigned size = dtype_bits(t->dtype) / 8;
        unsigned char *buf = malloc(t->nelem * size + 4);
        assert_int_equal(st_read(f, t, 0, buf, t->nelem * size), NF4_OK);
        uint64_t cols = base[i].shape[1] ? base[i].shape[1] : 1;
        for (uint64_t e = 0; e < t->nelem; e++) {
            float v = WANT[i].src->v[e];
            float want = WANT[i].term ? reference_merge(v, WANT[i].term, 1, e / cols, e % cols) : v;
            uint32_t want_bits = encode(t->dtype, want), got_bits = 0;
            memcpy(&got_bits, buf + e * size, size);
            if (got_bits != want_bits)
                fail_msg("%s[%llu]: 0x%x, expected 0x%x", base[i].name, (unsigned long long)e, got_bits, want_bits);
        }
        free(buf);
    }
    st_close(f);
    for (int i = 0; i < 6; i++)
        free(base[i].v);
    for (int i = 0; i < 7; i++)
        free(saved[i].v);
    free(conv_b.v);
    free(base_path);
    free(wpath);
    free(ad);
    free(out);
}

/* PEFT's bitsandbytes layers set fan_in_fan_out false whatever the config
 * says: on 4-bit weights it changes nothing. */
static void test_fan_in_fan_out_ignored_on_4bit_weights(void **state)
{
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s/adapter", s->dir), *a = tu_strdupf("%s/a", s->dir), *b = tu_strdupf("%s/b", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && python3 -c 'import json, sys; p = sys.argv[1]; c = json.load(open(p)); "
                           "c[\"fan_in_fan_out\"] = True; json.dump(c, open(p, \"w\"))' %s/adapter_config.json",
                           LORA_FIXTURES "/adapter-r8-all-linear", ad, ad);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", a, "--lora",
                             ad, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", b, "--lora",
               LORA_FIXTURES "/adapter-r8-all-linear", NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    assert_int_equal(tu_sh_status("cmp -s %s/model.safetensors %s/model.safetensors", a, b), 0);
    free(cmd);
    free(ad);
    free(a);
    free(b);
}

/* convert --device cpu BASE OUT --lora AD1 [--lora AD2] exits 65 with one
 * line holding `want`, and leaves nothing in the scratch directory. */
static void assert_merge_refused(const struct tu_scratch *s, const char *base, const char *ad1, const char *ad2,
                                 const char *want)
{
    char *out = tu_strdupf("%s/out", s->dir);
    struct tu_run r = ad2 ? tu_run("convert", "--device", "cpu", base, out, "--lora", ad1, "--lora", ad2, NULL)
                          : tu_run("convert", "--device", "cpu", base, out, "--lora", ad1, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, want))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(out);
}

/* convert --device cpu IN OUT --lora LORA succeeds, saying one warning that
 * holds `warning` and a summary that holds `merged` ("N with LoRA merged"). */
static void assert_lora_warns_once(const char *in, const char *out, const char *lora, const char *warning,
                                   const char *merged)
{
    struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != 2 || !strstr(r.err, warning) || !strstr(r.err, merged))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
}

/* Two adapters that both replace lm_head (modules_to_save): the order PEFT
 * would apply them in is not knowable here, so it is refused, and says why. */
static void test_two_replacements_refused(void **state)
{
    assert_merge_refused(*state, LORA_FIXTURES "/base-llama-bf16-bnb4", LORA_FIXTURES "/adapter-r16-qv-lmhead",
                         LORA_FIXTURES "/adapter-r16-qv-lmhead", "lm_head.weight: is replaced by two adapters");
}

/* PEFT rescales a DoRA merge by the norm of the base plus that adapter's delta
 * alone, so a tensor a DoRA adapter and another adapter both change is refused,
 * in either order. inspect marks DoRA terms, and the planner cuts a DoRA tensor
 * into whole rows even when asked for one-block chunks (down_proj's rows of
 * 352 are not a multiple of its 16384-element blocks). */
static void test_dora_alone_per_tensor(void **state)
{
    const char *base = LORA_FIXTURES "/base-llama-bf16-bnb4";
    assert_merge_refused(*state, base, LORA_FIXTURES "/adapter-dora", LORA_FIXTURES "/adapter-r8-all-linear",
                         "is changed by a DoRA adapter and by another adapter: merge them in separate runs");
    assert_merge_refused(*state, base, LORA_FIXTURES "/adapter-r8-all-linear", LORA_FIXTURES "/adapter-dora",
                         "is changed by a DoRA adapter and by another adapter");
    struct tu_run r = tu_run("inspect", base, "--lora", LORA_FIXTURES "/adapter-dora", NULL);
    assert_int_equal(r.status, 0);
    size_t dora_lines = 0;
    for (const char *at = r.out; (at = strstr(at, " 8              16            2  " LORA_FIXTURES "/adapter-dora (DoRA)\n"));
         at++)
        dora_lines++;
    assert_int_equal(dora_lines, 7);
    assert_non_null(strstr(r.out, "adapter-dora (base layer: replaced, BF16)\n"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", base, "--lora", LORA_FIXTURES "/adapter-dora", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"embedding\": false,\n      \"dora\": true,"));
    tu_run_free(&r);
}

/* Copies the tensors of safetensors file `from` for which keep(name, arg) is
 * true to `to`, each name after `name_prefix` (NULL: none). */
static void copy_tensors(const char *from, const char *to, int (*keep)(const char *, const void *), const void *arg,
                         const char *name_prefix, char *(*rename)(const char *name))
{
    struct st_file *f;
    assert_int_equal(st_open(from, &f), NF4_OK);
    struct st_out_tensor *outs = calloc(f->count, sizeof *outs);
    const struct st_tensor **src = calloc(f->count, sizeof *src);
    char **names = calloc(f->count, sizeof *names);
    size_t n = 0;
    for (size_t i = 0; i < f->count; i++) {
        const struct st_tensor *t = &f->tensors[i];
        if (!keep(t->name, arg))
            continue;
        src[n] = t;
        names[n] = rename ? rename(t->name) : tu_strdupf("%s%s", name_prefix ? name_prefix : "", t->name);
        outs[n] = (struct st_out_tensor){names[n], t->dtype, t->ndim, t->shape};
        n++;
    }
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, to, outs, n, NULL, 0), NF4_OK);
    for (size_t k = 0; k < n; k++) {
        const struct st_tensor *t = src[st_writer_order(w, k)];
        uint64_t len = st_tensor_bytes(t);
        void *buf = malloc(len ? len : 1);
        assert_int_equal(st_read(f, t, 0, buf, len), NF4_OK);
        assert_int_equal(st_writer_write(w, buf, len), NF4_OK);
        free(buf);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    free(outs);
    free(src);
    st_close(f);
}

static int all_but(const char *name, const void *drop)
{
    return strcmp(name, drop) != 0;
}

static int starts_with(const char *name, const void *prefix)
{
    return strncmp(name, prefix, strlen(prefix)) == 0;
}

static int not_starts_with(const char *name, const void *prefix)
{
    return !starts_with(name, prefix);
}

static const struct lora_case *tied_case(const char *adapter)
{
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        if (strcmp(CASES[i].adapter, adapter) == 0)
            return &CASES[i];
    fail_msg("no case %s", adapter);
    return NULL;
}

/* A tied base (no lm_head.weight; tie_word_embeddings true, or left out) and
 * an adapter that changes the head or the embedding without
 * ensure_weight_tying: the output has lm_head.weight beside the embedding,
 * in the embedding's shard and the index, and config.json says
 * tie_word_embeddings: false, as PEFT's merge_and_unload leaves the model
 * (the values: test_fixtures_within_tolerance). Kept tied, it stays true. A
 * base that is one weights file has no config.json to say so: refused, nothing
 * written. */
static void test_tied_embeddings_parted_by_an_adapter(void **state)
{
    struct tu_scratch *s = *state;
    const char *tied = LORA_FIXTURES "/" TIED_BASE;
    char *out = tu_strdupf("%s/out", s->dir);
    static const struct {
        const char *adapter, *tie;
    } WANT[] = {
        {"adapter-tied-embed", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-head", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-embed-head", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-head-lora", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-ensure", "\"tie_word_embeddings\": true,"},
        {"adapter-tied-embed-lora", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-embed-lora-ensure", "\"tie_word_embeddings\": false,"},
        {"adapter-tied-embed-lora-mirror", "\"tie_word_embeddings\": true,"},
    };
    for (size_t i = 0; i < sizeof WANT / sizeof WANT[0]; i++) {
        char *ad = tu_strdupf(LORA_FIXTURES "/%s", WANT[i].adapter), *config = tu_strdupf("%s/config.json", out);
        struct tu_run r = tu_run("convert", "--device", "cpu", tied, out, "--lora", ad, NULL);
        int parts = strstr(WANT[i].tie, "false") != NULL;
        if (r.status != 0 || (parts != (strstr(r.err, "the adapters part lm_head.weight from "
                                                        "model.embed_tokens.weight") != NULL)))
            fail_msg("%s: exit %d, stderr: %s", WANT[i].adapter, r.status, r.err);
        size_t len;
        char *text = tu_read_file(config, &len);
        if (!strstr(text, WANT[i].tie))
            fail_msg("%s: config.json does not say %s:\n%s", WANT[i].adapter, WANT[i].tie, text);
        free(text);
        tu_run_free(&r);
        tu_rmtree(out);
        free(config);
        free(ad);
    }

    /* Heads tied to other embeddings (the values: CASES): GPT-2's config.json
     * says false as Llama's does; BART's keeps its flag, which ties the
     * encoder's and decoder's embed_tokens to model.shared too (false would
     * leave them out when transformers loads it), and transformers 5 loads the
     * two apart. */
    static const struct {
        const char *base, *adapter, *embedding, *tie;
    } OTHER[] = {
        {GPT2_TIED_BASE, "adapter-gpt2-tied-wte", "transformer.wte.weight", "\"tie_word_embeddings\": false,"},
        {GPT2_TIED_BASE, "adapter-gpt2-tied-head-lora", "transformer.wte.weight", "\"tie_word_embeddings\": false,"},
        {BART_TIED_BASE, "adapter-bart-tied-head", "model.shared.weight", "\"tie_word_embeddings\": true,"},
    };
    for (size_t i = 0; i < sizeof OTHER / sizeof OTHER[0]; i++) {
        char *base = tu_strdupf(LORA_FIXTURES "/%s", OTHER[i].base);
        char *ad = tu_strdupf(LORA_FIXTURES "/%s", OTHER[i].adapter);
        char *config = tu_strdupf("%s/config.json", out), *says = tu_strdupf("lm_head.weight from %s", OTHER[i].embedding);
        struct tu_run r = tu_run("convert", "--device", "cpu", base, out, "--lora", ad, NULL);
        if (r.status != 0 || !strstr(r.err, says))
            fail_msg("%s: exit %d, stderr: %s", OTHER[i].adapter, r.status, r.err);
        tu_run_free(&r);
        char *text = tu_read_file(config, NULL);
        if (!strstr(text, OTHER[i].tie))
            fail_msg("%s: config.json does not say %s:\n%s", OTHER[i].adapter, OTHER[i].tie, text);
        free(text);
        tu_rmtree(out);
        free(says);
        free(config);
        free(ad);
        free(base);
    }
    /* Gemma 3's copy kept tied, under the embedding's runtime name (and the
     * head's) in the adapter and its saved name in the base: stays tied. */
    struct tu_run ensured = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/base-gemma3-bf16-bnb4", out, "--lora",
                                LORA_FIXTURES "/adapter-gemma3-ensure", NULL);
    if (ensured.status != 0)
        fail_msg("Gemma 3, ensure_weight_tying: exit %d, stderr: %s", ensured.status, ensured.err);
    tu_run_free(&ensured);
    char *kept_config = tu_strdupf("%s/config.json", out), *kept_weights = tu_strdupf("%s/model.safetensors", out);
    char *kept_text = tu_read_file(kept_config, NULL);
    assert_non_null(strstr(kept_text, "\"tie_word_embeddings\": true"));
    assert_null(strstr(kept_text, "\"tie_word_embeddings\": false"));
    struct st_file *kf;
    assert_int_equal(st_open(kept_weights, &kf), NF4_OK);
    assert_null(st_find(kf, "lm_head.weight"));
    st_close(kf);
    tu_rmtree(out);
    free(kept_text);
    free(kept_config);
    free(kept_weights);
    /* Qwen2-VL's saved form (model.* for model.language_model.*) is looked
     * for in a multimodal base only: in a plain Llama, PEFT would leave such
     * an adapter's keys out, and nf4deq refuses them. */
    struct tu_run vl = tu_run("convert", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", out, "--lora",
                              LORA_FIXTURES "/adapter-qwen2vl-qv", NULL);
    if (vl.status != 65 || !strstr(vl.err, "matches no floating-point tensor model.language_model.layers.0."))
        fail_msg("a Qwen2-VL adapter on a plain Llama: exit %d, stderr: %s", vl.status, vl.err);
    tu_run_free(&vl);
    assert_false(tu_exists(out));
    /* BART's weights file alone: no config.json has to change, so the head is
     * written apart; GPT-2's needs its config.json, as Llama's does. */
    char *single = tu_strdupf("%s/single.safetensors", s->dir);
    struct tu_run alone = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/" BART_TIED_BASE "/model.safetensors",
                               single, "--lora", LORA_FIXTURES "/adapter-bart-tied-head", NULL);
    if (alone.status != 0)
        fail_msg("BART's weights file: exit %d, stderr: %s", alone.status, alone.err);
    tu_run_free(&alone);
    struct st_file *sf;
    assert_int_equal(st_open(single, &sf), NF4_OK);
    assert_non_null(st_find(sf, "lm_head.weight"));
    st_close(sf);
    unlink(single);
    alone = tu_run("convert", "--device", "cpu", LORA_FIXTURES "/" GPT2_TIED_BASE "/model.safetensors", single, "--lora",
                 LORA_FIXTURES "/adapter-gpt2-tied-wte", NULL);
    if (alone.status != 65 || !strstr(alone.err, "config.json must say tie_word_embeddings: false"))
        fail_msg("GPT-2's weights file: exit %d, stderr: %s", alone.status, alone.err);
    tu_run_free(&alone);
    assert_false(tu_exists(single));
    free(single);

    /* Sharded, the embedding in the second shard: the head goes beside it. */
    char *sharded = tu_strdupf("%s/sharded", s->dir), *weights = tu_strdupf("%s/model.safetensors", tied);
    char *one = tu_strdupf("%s/model-00001-of-00002.safetensors", sharded),
         *two = tu_strdupf("%s/model-00002-of-00002.safetensors", sharded);
    tu_sh("mkdir %s && cp %s/config.json %s/", sharded, tied, sharded);
    copy_tensors(weights, one, not_starts_with, "model.embed_tokens.", NULL, NULL);
    copy_tensors(weights, two, starts_with, "model.embed_tokens.", NULL, NULL);
    struct st_file *f;
    assert_int_equal(st_open(one, &f), NF4_OK);
    struct strbuf idx = {0};
    strbuf_puts(&idx, "{\"metadata\": {}, \"weight_map\": {\"model.embed_tokens.weight\": "
                      "\"model-00002-of-00002.safetensors\"");
    for (size_t i = 0; i < f->count; i++) {
        strbuf_puts(&idx, ", \"");
        strbuf_puts(&idx, f->tensors[i].name);
        strbuf_puts(&idx, "\": \"model-00001-of-00002.safetensors\"");
    }
    strbuf_puts(&idx, "}}");
    st_close(f);
    char *index = tu_strdupf("%s/model.safetensors.index.json", sharded);
    tu_write_file(index, idx.p, idx.len);
    free(idx.p);
    /* tie_word_embeddings left out: transformers ties a head it does not find. */
    tu_sh("sed -i '/\"tie_word_embeddings\"/d' %s/config.json", sharded);
    char *ad = tu_strdupf(LORA_FIXTURES "/adapter-tied-head");
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", sharded, out, "--lora", ad, NULL);
    if (r.status != 0)
        fail_msg("sharded: exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    check_case(tied_case("adapter-tied-head"), out);
    size_t len;
    char *text = tu_strdupf("%s/model.safetensors.index.json", out), *json = tu_read_file(text, &len);
    if (!strstr(json, "\"lm_head.weight\": \"model-00002-of-00002.safetensors\",\n"
                      "    \"model.embed_tokens.weight\": \"model-00002-of-00002.safetensors\""))
        fail_msg("the index does not put lm_head.weight beside the embedding:\n%s", json);
    free(json);
    free(text);
    text = tu_strdupf("%s/config.json", out);
    json = tu_read_file(text, &len);
    if (!strstr(json, "\"tie_word_embeddings\": false\n}"))
        fail_msg("config.json does not add tie_word_embeddings: false:\n%s", json);
    free(json);
    free(text);
    tu_rmtree(out);

    /* One weights file: refused, with what to do instead. */
    char *out_file = tu_strdupf("%s/out.safetensors", s->dir);
    r = tu_run("convert", "--device", "cpu", weights, out_file, "--lora", LORA_FIXTURES "/adapter-tied-embed", NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "base_model.model.model.embed_tokens.weight: changes model.embed_tokens.weight, which the "
                       "base ties to lm_head.weight (tie_word_embeddings)") ||
        !strstr(r.err, "convert the model's directory"))
        fail_msg("a single tied file: exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    r = tu_run("inspect", weights, "--lora", LORA_FIXTURES "/adapter-tied-head-lora", NULL);
    if (r.status != NF4_EDATA || !strstr(r.err, "lm_head.lora_A.weight: changes lm_head.weight, which the base ties"))
        fail_msg("inspect of a single tied file: exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(sharded);
    assert_int_equal(tu_count_entries(s->dir), 0);

    /* ensure_weight_tying with the head's copy alone (PEFT saves the
     * embedding's too): it stands for the embedding's. */
    free(ad);
    ad = tu_strdupf(LORA_FIXTURES "/adapter-tied-ensure");
    char *kept = tu_strdupf("%s/kept", s->dir), *from = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad),
         *to = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, kept);
    tu_sh("mkdir %s && cp %s/" ADAPTER_CONFIG_NAME " %s/", kept, ad, kept);
    copy_tensors(from, to, all_but, PEFT_KEY_PREFIX "model.embed_tokens.weight", NULL, NULL);
    r = tu_run("convert", "-q", "--device", "cpu", tied, out, "--lora", kept, NULL);
    if (r.status != 0)
        fail_msg("the head's copy alone: exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    check_case(tied_case("adapter-tied-ensure"), out);
    tu_rmtree(out);
    tu_rmtree(kept);

    /* One adapter keeps its embedding copy tied to the head, another changes
     * the head apart: which the head ends as depends on how PEFT would load
     * and merge them. Refused, in either order. */
    assert_merge_refused(s, tied, LORA_FIXTURES "/adapter-tied-ensure", LORA_FIXTURES "/adapter-tied-head-lora",
                         "changes lm_head.weight apart from model.embed_tokens.weight, but ");
    assert_merge_refused(s, tied, LORA_FIXTURES "/adapter-tied-head", LORA_FIXTURES "/adapter-tied-ensure",
                         "is a copy of the embedding kept tied to the head (ensure_weight_tying)");

    /* Untied (tie_word_embeddings: false) and headless, a head is only missing. */
    char *bases = tu_mkdtemp(), *untied = tu_strdupf("%s/untied", bases); /* not in the scratch directory */
    tu_sh("cp -r %s %s && sed -i 's/\"tie_word_embeddings\": true/\"tie_word_embeddings\": false/' %s/config.json",
          tied, untied, untied);
    assert_merge_refused(s, untied, LORA_FIXTURES "/adapter-tied-head", NULL,
                         "matches no floating-point tensor lm_head.weight");
    tu_rmtree(bases);
    free(bases);
    free(untied);
    free(kept);
    free(from);
    free(to);
    free(ad);
    free(index);
    free(one);
    free(two);
    free(weights);
    free(sharded);
    free(out_file);
    free(out);
}

/* --resume keeps a dead run's shards only for the same decision to write the
 * head apart, which config.json makes and the recorded inputs do not cover. */
static void test_resume_record_holds_the_untied_head(void **state)
{
    (void)state;
    struct model *m;
    assert_int_equal(model_open_dir(LORA_FIXTURES "/" TIED_BASE, &m), NF4_OK);
    struct convert_opts o;
    convert_opts_init(&o);
    struct resume_manifest tied, untied;
    assert_int_equal(resume_fingerprint(m, &o, NULL, &tied), NF4_OK);
    assert_int_equal(resume_fingerprint(m, &o, "model.embed_tokens.weight", &untied), NF4_OK);
    assert_false(resume_same_source(&tied, &untied));
    assert_true(resume_same_source(&untied, &untied));
    resume_manifest_free(&tied);
    resume_manifest_free(&untied);
    model_close(m);
}

/* inspect --lora says where the head is parted from its embedding, and counts
 * it in the totals after conversion. */
static void test_inspect_says_the_head_is_untied(void **state)
{
    (void)state;
    const char *tied = LORA_FIXTURES "/" TIED_BASE;
    struct tu_run plain = tu_run("inspect", "--json", tied, NULL);
    struct tu_run r = tu_run("inspect", tied, "--lora", LORA_FIXTURES "/adapter-tied-head-lora", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\nlm_head.weight is written apart from model.embed_tokens.weight, which the base "
                                  "ties it to; config.json: tie_word_embeddings: false\n"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", tied, "--lora", LORA_FIXTURES "/adapter-tied-head-lora", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"untied\": {\n    \"head\": \"lm_head.weight\",\n    \"embedding\": "
                                  "\"model.embed_tokens.weight\",\n    \"config_unties\": true\n  }"));
    /* 512 x 128 more parameters, in bf16. */
    const char *p0 = strstr(plain.out, "\"parameters\": "), *p1 = strstr(r.out, "\"parameters\": ");
    const char *b0 = strstr(plain.out, "\"bytes_after_conversion\": "), *b1 = strstr(r.out, "\"bytes_after_conversion\": ");
    assert_true(p0 && p1 && b0 && b1);
    assert_int_equal(strtoull(p1 + 14, NULL, 10) - strtoull(p0 + 14, NULL, 10), 512 * 128);
    assert_int_equal(strtoull(b1 + 26, NULL, 10) - strtoull(b0 + 26, NULL, 10), 512 * 128 * 2);
    tu_run_free(&r);
    tu_run_free(&plain);
    r = tu_run("inspect", "--json", tied, "--lora", LORA_FIXTURES "/adapter-tied-ensure", NULL);
    assert_int_equal(r.status, 0);
    assert_null(strstr(r.out, "\"untied\""));
    tu_run_free(&r);
    /* BART's config.json keeps its flag (test_tied_embeddings_parted_by_an_adapter). */
    const char *bart = LORA_FIXTURES "/" BART_TIED_BASE, *bart_head = LORA_FIXTURES "/adapter-bart-tied-head";
    r = tu_run("inspect", bart, "--lora", bart_head, NULL);
    if (r.status != 0 || !strstr(r.out, "\nlm_head.weight is written apart from model.shared.weight, which the base "
                                        "ties it to; config.json keeps tie_word_embeddings, which ties the encoder's "
                                        "and decoder's embeddings too (transformers 5 loads the head apart)\n"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    r = tu_run("inspect", "--json", bart, "--lora", bart_head, NULL);
    if (r.status != 0 || !strstr(r.out, "\"embedding\": \"model.shared.weight\",\n    \"config_unties\": false\n"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
}

/* The tied head's LoRA merges once, into the embedding, only when it is the
 * embedding's LoRA transposed, element for element: one bit changed in it
 * (here the last element of lm_head.lora_B, which mirrors the last of
 * lora_embedding_A) and the two were trained apart, so the head is written
 * apart. inspect names the embedding's LoRA as such. */
static void test_embedding_lora_mirror_is_exact(void **state)
{
    struct tu_scratch *s = *state;
    const char *tied = LORA_FIXTURES "/" TIED_BASE;
    char *ad = tu_strdupf("%s/mirror", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *weights = tu_strdupf("%s/adapter_model.safetensors", ad), *config = tu_strdupf("%s/config.json", out);
    tu_sh("cp -r %s/adapter-tied-embed-lora-mirror %s", LORA_FIXTURES, ad);
    struct st_file *f;
    assert_int_equal(st_open(weights, &f), NF4_OK);
    const struct st_tensor *hb = st_find(f, PEFT_KEY_PREFIX "lm_head.lora_B.weight");
    assert_non_null(hb);
    uint64_t last = f->data_start + hb->end - 1; /* the high byte of a bf16 */
    st_close(f);
    tu_sh("printf '\\001' | dd of=%s bs=1 seek=%llu conv=notrunc status=none", weights, (unsigned long long)last);

    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", tied, out, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    size_t len;
    char *text = tu_read_file(config, &len);
    if (!strstr(text, "\"tie_word_embeddings\": false,"))
        fail_msg("a head LoRA one bit off the embedding's kept the tie:\n%s", text);
    free(text);
    tu_run_free(&r);
    tu_rmtree(out);

    r = tu_run("inspect", tied, "--lora", LORA_FIXTURES "/adapter-tied-embed-lora-mirror", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "adapter-tied-embed-lora-mirror (embedding)\n"));
    assert_null(strstr(r.out, "\nlm_head.weight "));
    assert_null(strstr(r.out, "written apart"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora", LORA_FIXTURES "/adapter-embed-lora",
               NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"fan_in_fan_out\": false,\n      \"embedding\": true,"));
    tu_run_free(&r);
    tu_rmtree(ad);
    free(ad);
    free(out);
    free(weights);
    free(config);
}

/* ---- refusals: exit 65, one line naming the file, nothing written ---- */

static void test_refusals_write_nothing(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *adapter_config, *want;
        const char *weights_of; /* the adapter whose weights the case uses; NULL: adapter-r8-all-linear */
    } BAD[] = {
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"use_dora\": true}",
         "lora_magnitude_vector, which DoRA (use_dora) needs", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_dora\": true, "
         "\"target_modules\": [\"embed_tokens\", \"v_proj\"]}",
         "lora_embedding_A: DoRA (use_dora) on an embedding is not supported", "adapter-embed-lora"},
        {"{\"peft_type\": \"IA3\", \"r\": 8, \"lora_alpha\": 16}", "only LoRA and LoKr adapters can be merged", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 16}", "but the config says r = 4", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"rank_pattern\": {\"q_proj\": 2}}",
         "but the config says r = 2 (rank_pattern)", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 0, \"lora_alpha\": 16}", "\"r\" must be a whole number", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": NaN}", "NaN or Infinity", NULL},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16", "is not valid JSON", NULL},
        /* Trainable tokens: adapter-tokens holds 4 rows of the embedding (512 x 128). */
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8}",
         "trainable_tokens_delta: has no rows in adapter_config.json's \"trainable_token_indices\"", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": [0, 5, 17, 512]}",
         "replaces row 512, past the 512 rows of model.embed_tokens.weight", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": [0, 5, 17]}",
         "must be 3x128: a row of model.embed_tokens.weight for each", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": [0, 5, 17, 5]}",
         "row 5 of the input embedding is listed twice", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": [0, 5, 17, 9.0]}",
         "\"trainable_token_indices\" rows must be whole numbers from 0", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": [0, -5, 17, 9]}",
         "the rows of the input embedding must be whole numbers from 0", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": "
         "{\"embed_tokens\": [0, 5, 17, 9], \"model.embed_tokens\": [0, 5, 17, 9]}}",
         "is the module of two entries of adapter_config.json's", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": {\"embed_tokens\": 3}}",
         "the rows of embed_tokens must be a list of row numbers", "adapter-tokens"},
        {"{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"trainable_token_indices\": \"embed_tokens\"}",
         "\"trainable_token_indices\" must be a list of row numbers, or an object", "adapter-tokens"},
        /* LoRA biases, on a base whose layers have none: PEFT cannot merge them either. */
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 32, \"lora_bias\": true}",
         "adds to model.layers.0.self_attn.k_proj.bias, which the base model does not have", "adapter-lora-bias"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 32}",
         "k_proj.lora_B.bias: is a LoRA bias, but adapter_config.json does not set lora_bias", "adapter-lora-bias"},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        char *weights_src = tu_strdupf(LORA_FIXTURES "/%s/" ADAPTER_WEIGHTS_NAME,
                                       BAD[i].weights_of ? BAD[i].weights_of : "adapter-r8-all-linear");
        size_t wlen = 0;
        char *weights = tu_read_file(weights_src, &wlen);
        assert_non_null(weights);
        char *ad = tu_strdupf("%s/bad-%zu", s->dir, i), *out = tu_strdupf("%s/out-%zu", s->dir, i);
        assert_int_equal(mkdir(ad, 0755), 0);
        char *wp = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
        tu_write_file(wp, weights, wlen);
        write_config(ad, BAD[i].adapter_config);
        for (int inspect = 0; inspect < 2; inspect++) {
            struct tu_run r = inspect ? tu_run("inspect", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora", ad, NULL)
                                      : tu_run("convert", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", out,
                                               "--lora", ad, NULL);
            if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, BAD[i].want) || !strstr(r.err, ad))
                fail_msg("case %zu (%s): exit %d, stderr: %s", i, inspect ? "inspect" : "convert", r.status, r.err);
            if (inspect)
                assert_string_equal(r.out, "");
            tu_run_free(&r);
        }
        assert_false(tu_exists(out));
        free(ad);
        free(out);
        free(wp);
        free(weights);
        free(weights_src);
    }
    /* Everything the runs could have left (temp files, OUT) would be here. */
    assert_int_equal(tu_count_entries(s->dir), (int)(sizeof BAD / sizeof BAD[0]));
}

/* Trained token rows are an adapter's only change to their tensor: with a
 * LoRA on it from another adapter, or other rows, which one PEFT would end
 * with is its order of merging; and on a tied base, the head parted from the
 * embedding by another change would have shared the rows in training. */
static void test_token_rows_alone_per_tensor(void **state)
{
    const char *base = LORA_FIXTURES "/base-llama-bf16-bnb4", *tied = LORA_FIXTURES "/" TIED_BASE;
    assert_merge_refused(*state, base, LORA_FIXTURES "/adapter-tokens", LORA_FIXTURES "/adapter-embed-lora",
                         "model.embed_tokens.weight: has trained token rows (trainable_token_indices) and is changed "
                         "otherwise too");
    assert_merge_refused(*state, base, LORA_FIXTURES "/adapter-embed-lora", LORA_FIXTURES "/adapter-tokens",
                         "has trained token rows (trainable_token_indices) and is changed otherwise too");
    assert_merge_refused(*state, base, LORA_FIXTURES "/adapter-tokens", LORA_FIXTURES "/adapter-tokens-dict",
                         "model.embed_tokens.weight: has rows replaced by the trained tokens of two adapters");
    assert_merge_refused(*state, tied, LORA_FIXTURES "/adapter-tied-tokens", LORA_FIXTURES "/adapter-tied-head",
                         "changes lm_head.weight apart from model.embed_tokens.weight, but");
    assert_merge_refused(*state, tied, LORA_FIXTURES "/adapter-tied-head", LORA_FIXTURES "/adapter-tied-tokens",
                         "replaces rows of the embedding, which the head shares");
    /* The head's own rows part it from the embedding only beside the same
     * adapter's rows of the embedding: another adapter's were the head's too. */
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s-head-rows", s->dir), *wpath = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor rows = {PEFT_KEY_PREFIX "lm_head" TOKEN_DELTA_SUFFIX, DT_F32, {2, 128}, NULL};
    syn_fill(&rows, 1.0f);
    syn_write(wpath, &rows, 1);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], "
                     "\"trainable_token_indices\": {\"lm_head\": [5, 6]}}");
    assert_merge_refused(s, tied, LORA_FIXTURES "/adapter-tied-tokens", ad, "replaces rows of the embedding, which the "
                                                                           "head shares");
    assert_merge_refused(s, tied, ad, LORA_FIXTURES "/adapter-tied-tokens", "replaces rows of the embedding, which the "
                                                                           "head shares");
    char *out = tu_strdupf("%s/out", s->dir), *config = tu_strdupf("%s/out/config.json", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", tied, out, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    size_t len;
    char *text = tu_read_file(config, &len);
    if (!strstr(text, "\"tie_word_embeddings\": false"))
        fail_msg("the head's own rows alone keep the tie: %s", text);
    free(text);
    tu_rmtree(out);
    tu_rmtree(ad);
    free(rows.v);
    free(config);
    free(out);
    free(wpath);
    free(ad);
}

/* An adapter file of every tensor of `from`, plus extra tensors. */
static void write_adapter_plus(const char *from_dir, const char *to_dir, const struct syn_tensor *extra, size_t nextra)
{
    char *from = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, from_dir), *to = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, to_dir);
    struct st_file *f;
    assert_int_equal(st_open(from, &f), NF4_OK);
    assert_true(f->count + nextra <= 16);
    struct syn_tensor ts[16];
    for (size_t i = 0; i < f->count; i++) {
        const struct st_tensor *t = &f->tensors[i];
        assert_true(t->dtype == DT_F32 || t->dtype == DT_BF16); /* factors, and a 16-bit copy */
        ts[i] = (struct syn_tensor){t->name, t->dtype, {t->shape[0], t->ndim > 1 ? t->shape[1] : 0}, malloc(t->nelem * 4)};
        unsigned size = dtype_bits(t->dtype) / 8;
        unsigned char *raw = malloc(t->nelem * size + 1);
        assert_int_equal(st_read(f, t, 0, raw, t->nelem * size), NF4_OK);
        for (uint64_t e = 0; e < t->nelem; e++)
            ts[i].v[e] = (float)value_of(t->dtype, raw, e);
        free(raw);
    }
    for (size_t i = 0; i < nextra; i++)
        ts[f->count + i] = extra[i];
    syn_write(to, ts, f->count + nextra);
    for (size_t i = 0; i < f->count; i++)
        free(ts[i].v);
    st_close(f);
    free(from);
    free(to);
}

/* PEFT saves a wrapped module's frozen layer as "M.original_module.P"
 * under the name the model runs it by; a multimodal base that transformers
 * saves in its older layout holds it under another (saved_names.h): found
 * there, checked for shape and left, and the merge is the one without it. */
static void test_original_module_on_a_multimodal_base(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = LORA_FIXTURES "/base-gemma3-bf16-bnb4", *plain = LORA_FIXTURES "/adapter-gemma3-qv-head";
    char *ad = tu_strdupf("%s/ad", s->dir), *ref = tu_strdupf("%s/ref", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(mkdir(ad, 0755), 0);
    tu_sh("cp %s/" ADAPTER_CONFIG_NAME " %s/", plain, ad);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", base, ref, "--lora", plain, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    static const uint64_t ROWS[2] = {300, 299}; /* the base's, and one off */
    for (int i = 0; i < 2; i++) {
        struct syn_tensor frozen = {PEFT_KEY_PREFIX "model.language_model.embed_tokens.original_module.weight",
                                    DT_BF16, {ROWS[i], 64}, calloc(ROWS[i] * 64, 4)};
        write_adapter_plus(plain, ad, &frozen, 1);
        free(frozen.v);
        r = tu_run("convert", "--device", "cpu", base, out, "--lora", ad, NULL);
        if (i == 0) {
            if (r.status != 0)
                fail_msg("exit %d: %s", r.status, r.err);
            tu_sh("cmp %s/model.safetensors %s/model.safetensors", out, ref);
            tu_rmtree(out);
        } else if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
                   !strstr(r.err, "language_model.model.embed_tokens.weight")) {
            fail_msg("exit %d: %s", r.status, r.err);
        }
        tu_run_free(&r);
    }
    assert_false(tu_exists(out));
    free(ad);
    free(ref);
    free(out);
}

/* When PEFT saves the tied layers whole (a grown vocabulary), it saves the
 * head's token rows too, which are the embedding's: those keep the tie, and
 * the merge is the one of the embedding's rows alone. One value off, and they
 * were trained apart: the head is written apart. A 4-bit weight's rows are
 * refused: bitsandbytes quantizes linear layers, PEFT's token rows are an
 * embedding's or a 16-bit head's. */
static void test_tied_token_rows_saved_twice(void **state)
{
    struct tu_scratch *s = *state;
    const char *tied = LORA_FIXTURES "/" TIED_BASE;
    char *ad = tu_strdupf("%s/twice", s->dir), *out = tu_strdupf("%s/out", s->dir), *ref = tu_strdupf("%s/ref", s->dir);
    char *embed_key = PEFT_KEY_PREFIX "model.embed_tokens" TOKEN_DELTA_SUFFIX;
    tu_sh("cp -r %s/adapter-tied-tokens %s", LORA_FIXTURES, ad);
    struct st_file *f;
    char *weights = tu_strdupf("%s/adapter-tied-tokens/" ADAPTER_WEIGHTS_NAME, LORA_FIXTURES);
    assert_int_equal(st_open(weights, &f), NF4_OK);
    const struct st_tensor *et = st_find(f, embed_key);
    assert_non_null(et);
    struct syn_tensor head = {PEFT_KEY_PREFIX "lm_head" TOKEN_DELTA_SUFFIX, DT_F32, {et->shape[0], et->shape[1]},
                              malloc(et->nelem * 4)};
    assert_int_equal(st_read(f, et, 0, head.v, et->nelem * 4), NF4_OK);
    const uint64_t last = et->nelem - 1;
    st_close(f);

    for (int off = 0; off < 2; off++) {
        if (off)
            head.v[last] = nextafterf(head.v[last], INFINITY);
        write_adapter_plus(LORA_FIXTURES "/adapter-tied-tokens", ad, &head, 1);
        struct tu_run r = tu_run("convert", "-q", "--device", "cpu", tied, out, "--lora", ad, NULL);
        assert_int_equal(r.status, 0);
        tu_run_free(&r);
        char *config = tu_strdupf("%s/config.json", out);
        size_t len;
        char *text = tu_read_file(config, &len);
        if (!strstr(text, off ? "\"tie_word_embeddings\": false," : "\"tie_word_embeddings\": true,"))
            fail_msg("the head's rows %s the embedding's:\n%s", off ? "one value off" : "equal to", text);
        free(text);
        free(config);
        if (!off) {
            struct tu_run c = tu_run("convert", "-q", "--device", "cpu", tied, ref, "--lora",
                                     LORA_FIXTURES "/adapter-tied-tokens", NULL);
            assert_int_equal(c.status, 0);
            tu_run_free(&c);
            tu_sh("cmp %s/model.safetensors %s/model.safetensors", out, ref);
        }
        tu_rmtree(out);
    }
    free(head.v);

    /* Rows of a 4-bit weight: refused. */
    struct syn_tensor q = {PEFT_KEY_PREFIX "model.layers.0.self_attn.q_proj" TOKEN_DELTA_SUFFIX, DT_F32, {1, 128},
                           calloc(128, 4)};
    write_adapter_plus(LORA_FIXTURES "/adapter-tied-tokens", ad, &q, 1);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], "
                     "\"trainable_token_indices\": {\"embed_tokens\": [2, 500, 1], \"q_proj\": [7]}}");
    struct tu_run r = tu_run("convert", "--device", "cpu", tied, out, "--lora", ad, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "q_proj.token_adapter.trainable_tokens_delta: replaces rows of "
                       "model.layers.0.self_attn.q_proj.weight, which is 4-bit"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    free(q.v);
    tu_rmtree(ad);
    tu_rmtree(ref);
    free(weights);
    free(ad);
    free(out);
    free(ref);
}

/* PEFT saves the embedding layers whole when they are targeted or the
 * vocabulary was resized (save_embedding_layers), frozen: here the tied
 * layout, each layer's token_adapter.base_layer.weight (the base's values)
 * and the head's rows (the embedding's). The merge is the one without them,
 * byte for byte, still tied. With a row more, the vocabulary is resized: 513
 * rows, still tied; with the two layers of different rows, refused. */
static void test_embedding_layers_saved_whole(void **state)
{
    struct tu_scratch *s = *state;
    const char *tied = LORA_FIXTURES "/" TIED_BASE;
    char *ad = tu_strdupf("%s/whole", s->dir), *out = tu_strdupf("%s/out", s->dir), *ref = tu_strdupf("%s/ref", s->dir);
    tu_sh("cp -r %s/adapter-tied-tokens %s", LORA_FIXTURES, ad);
    struct st_file *f;
    assert_int_equal(st_open(LORA_FIXTURES "/" TIED_BASE "/model.safetensors", &f), NF4_OK);
    const struct st_tensor *et = st_find(f, "model.embed_tokens.weight");
    assert_non_null(et);
    assert_int_equal(et->dtype, DT_BF16);
    const uint64_t rows = et->shape[0], cols = et->shape[1];
    uint16_t *raw = malloc(rows * cols * 2);
    float *embed = malloc((rows + 2) * cols * 4); /* up to two rows more, below */
    assert_int_equal(st_read(f, et, 0, raw, rows * cols * 2), NF4_OK);
    for (uint64_t i = 0; i < (rows + 2) * cols; i++)
        embed[i] = i < rows * cols ? bf16_to_f32(raw[i]) : 0.25f;
    st_close(f);
    assert_int_equal(st_open(LORA_FIXTURES "/adapter-tied-tokens/" ADAPTER_WEIGHTS_NAME, &f), NF4_OK);
    const struct st_tensor *dt = st_find(f, PEFT_KEY_PREFIX "model.embed_tokens" TOKEN_DELTA_SUFFIX);
    assert_non_null(dt);
    struct syn_tensor extra[3] = {
        {PEFT_KEY_PREFIX "model.embed_tokens.token_adapter.base_layer.weight", DT_BF16, {rows, cols}, embed},
        {PEFT_KEY_PREFIX "lm_head.token_adapter.base_layer.weight", DT_BF16, {rows, cols}, embed},
        {PEFT_KEY_PREFIX "lm_head" TOKEN_DELTA_SUFFIX, DT_F32, {dt->shape[0], dt->shape[1]}, malloc(dt->nelem * 4)},
    };
    assert_int_equal(st_read(f, dt, 0, extra[2].v, dt->nelem * 4), NF4_OK);
    st_close(f);

    write_adapter_plus(LORA_FIXTURES "/adapter-tied-tokens", ad, extra, 3);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", tied, out, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("convert", "-q", "--device", "cpu", tied, ref, "--lora", LORA_FIXTURES "/adapter-tied-tokens", NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    tu_sh("cmp %s/model.safetensors %s/model.safetensors && cmp %s/config.json %s/config.json", out, ref, out, ref);
    tu_rmtree(out);

    extra[0].shape[0] = extra[1].shape[0] = rows + 1;
    write_adapter_plus(LORA_FIXTURES "/adapter-tied-tokens", ad, extra, 3);
    r = tu_run("convert", "--device", "cpu", tied, out, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    char *config = tu_strdupf("%s/config.json", out), *weights = tu_strdupf("%s/model.safetensors", out);
    size_t len;
    char *text = tu_read_file(config, &len);
    if (!strstr(text, "\"vocab_size\": 513") || !strstr(text, "\"tie_word_embeddings\": true"))
        fail_msg("%s", text);
    free(text);
    assert_int_equal(st_open(weights, &f), NF4_OK);
    assert_int_equal(st_find(f, "model.embed_tokens.weight")->shape[0], rows + 1);
    assert_null(st_find(f, "lm_head.weight"));
    st_close(f);
    tu_rmtree(out);
    extra[1].shape[0] = rows + 2;
    write_adapter_plus(LORA_FIXTURES "/adapter-tied-tokens", ad, extra, 3);
    r = tu_run("convert", "--device", "cpu", tied, out, "--lora", ad, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "the adapters resize the vocabulary two ways"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    free(config);
    free(weights);
    tu_rmtree(ad);
    tu_rmtree(ref);
    free(extra[2].v);
    free(embed);
    free(raw);
    free(ad);
    free(out);
    free(ref);
}

/* A resized vocabulary: config.json says the new vocab_size, tied or not
 * (and parted from a tied embedding, the head is the frozen layer with the
 * new rows that PEFT saves), and inspect says so. Refused: a resize that leaves an embedding layer at
 * the base's rows (the merged model would not load), a single weights file
 * (no config.json to say it), and a modules_to_save copy whose twin PEFT
 * saves beside it differs. */
static void test_resized_vocabulary(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = LORA_FIXTURES "/base-llama-bf16-bnb4";
    static const struct {
        const char *base, *adapter, *tie;
    } CONFIGS[] = {
        {"base-llama-bf16-bnb4", "adapter-resized-tokens", "\"tie_word_embeddings\": false"},
        {"base-llama-bf16-bnb4", "adapter-resized-copies", "\"tie_word_embeddings\": false"},
        {TIED_BASE, "adapter-tied-resized-tokens", "\"tie_word_embeddings\": true"},
        {TIED_BASE, "adapter-tied-resized-copy", "\"tie_word_embeddings\": false"},
        {"base-llama-bf16-bnb4", "adapter-resized-lora", "\"tie_word_embeddings\": false"},
    };
    char *out = tu_strdupf("%s/out", s->dir), *config = tu_strdupf("%s/out/config.json", s->dir);
    for (size_t i = 0; i < sizeof CONFIGS / sizeof CONFIGS[0]; i++) {
        char *in = tu_strdupf(LORA_FIXTURES "/%s", CONFIGS[i].base), *ad = tu_strdupf(LORA_FIXTURES "/%s", CONFIGS[i].adapter);
        struct tu_run r = tu_run("convert", "--device", "cpu", in, out, "--lora", ad, NULL);
        if (r.status != 0 || !strstr(r.err, "trained on a vocabulary resized from 512 to 516 rows") ||
            !strstr(r.err, "(--tokenizer DIR)"))
            fail_msg("%s: exit %d, stderr: %s", ad, r.status, r.err);
        tu_run_free(&r);
        size_t len;
        char *text = tu_read_file(config, &len);
        if (!strstr(text, "\"vocab_size\": 516,") || !strstr(text, CONFIGS[i].tie))
            fail_msg("%s: %s", ad, text);
        free(text);
        tu_rmtree(out);
        r = tu_run("inspect", "--json", in, "--lora", ad, NULL);
        assert_int_equal(r.status, 0);
        if (!strstr(r.out, "\"vocab_size\": {\n    \"base\": 512,\n    \"merged\": 516\n  }"))
            fail_msg("%s", r.out);
        tu_run_free(&r);
        free(in);
        free(ad);
    }

    /* The embedding resized, the untied head not. */
    char *ad = tu_strdupf("%s-adapter", s->dir); /* beside: assert_merge_refused counts what is in s->dir */
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor embed = {PEFT_KEY_PREFIX "model.embed_tokens.weight", DT_BF16, {513, 128}, calloc(513 * 128, 4)};
    char *wpath = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(wpath, &embed, 1);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], "
                     "\"modules_to_save\": [\"embed_tokens\"]}");
    assert_merge_refused(s, base, ad, NULL, "model.embed_tokens.weight: resizes the vocabulary from 512 to 513 rows, "
                                            "but the adapters hold no lm_head.weight with the new rows");
    tu_rmtree(ad);
    free(embed.v);

    /* One weights file. */
    assert_merge_refused(s, LORA_FIXTURES "/base-llama-bf16-bnb4/model.safetensors", LORA_FIXTURES "/adapter-resized-tokens",
                         NULL, "convert the model's directory, not its weights file");

    /* The adapter's folder with the tokenizer it was trained with: the output
     * takes it (test_tokenizer.c), and nothing is left to warn of. */
    tu_sh("cp -r %s/adapter-resized-copies %s && echo '{}' > %s/tokenizer_config.json", LORA_FIXTURES, ad, ad);
    struct tu_run r = tu_run("convert", "--device", "cpu", base, out, "--lora", ad, NULL);
    char *want = tu_strdupf("the tokenizer is the one %s was trained with (tokenizer_config.json) instead of %s's, "
                            "for the 516 rows of the resized vocabulary", ad, base);
    if (r.status != 0 || !strstr(r.err, want) || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(want);
    tu_sh("cmp %s/tokenizer_config.json %s/tokenizer_config.json", ad, out);
    tu_rmtree(out);
    /* Kept IN's all the same: the warning says how to give the right one. */
    r = tu_run("convert", "--device", "cpu", base, out, "--lora", ad, "--tokenizer", "base", NULL);
    if (r.status != 0 || !strstr(r.err, "but the tokenizer files are " LORA_FIXTURES "/base-llama-bf16-bnb4's; give "
                                        "it the tokenizer the adapter was trained with (--tokenizer DIR)"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    tu_rmtree(ad);

    /* A copy's twin one byte off. */
    tu_sh("cp -r %s/adapter-resized-copies %s", LORA_FIXTURES, ad);
    struct st_file *f;
    assert_int_equal(st_open(wpath, &f), NF4_OK);
    const struct st_tensor *twin = st_find(f, PEFT_KEY_PREFIX "lm_head.modules_to_save.weight");
    assert_non_null(twin);
    uint64_t last = f->data_start + twin->end - 1;
    st_close(f);
    tu_sh("printf '\\001' | dd of=%s bs=1 seek=%llu conv=notrunc status=none", wpath, (unsigned long long)last);
    assert_merge_refused(s, base, ad, NULL, "lm_head.modules_to_save.weight: differs from "
                                            "base_model.model.lm_head.weight, the modules_to_save copy");
    tu_rmtree(ad);
    free(wpath);
    free(ad);
    free(out);
    free(config);
}

/* Trained token rows on a base of odd shape, given unsorted and with the
 * first and last rows, in chunks that start and end inside rows: each row
 * is its fp32 values rounded to the weight's bf16, then to the output dtype
 * (twice rounded where fp16 is asked for), the rest a plain cast. An fp16
 * output counts the values that overflow: a base row's, and a token row's,
 * but not those of the base row the token row replaces. */
static void test_token_rows_synthetic(void **state)
{
    struct tu_scratch *s = *state;
    enum { ROWS = 23, COLS = 9 };
    static const uint64_t TOKEN_ROWS[] = {10, 4, 0, 22};
    struct syn_tensor base = {"emb.weight", DT_BF16, {ROWS, COLS}, NULL};
    syn_fill(&base, 4.0f);
    base.v[4 * COLS + 3] = 131072.0f; /* replaced: its overflow to fp16 is not the output's */
    base.v[6 * COLS + 8] = -131072.0f; /* kept: it overflows */
    char *base_path = tu_strdupf("%s/base.safetensors", s->dir), *ad = tu_strdupf("%s/ad", s->dir);
    syn_write(base_path, &base, 1);
    assert_int_equal(mkdir(ad, 0755), 0);
    struct syn_tensor rows = {PEFT_KEY_PREFIX "emb" TOKEN_DELTA_SUFFIX, DT_F32, {4, COLS}, NULL};
    syn_fill(&rows, 4.0f);
    rows.v[0 * COLS + 5] = 1.0e6f; /* row 10: bf16 holds it, fp16 does not */
    char *wpath = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    syn_write(wpath, &rows, 1);
    write_config(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"target_modules\": [\"q\"], "
                     "\"trainable_token_indices\": {\"emb\": [10, 4, 0, 22]}}");
    static const uint64_t CHUNKS[] = {0, 1, 7, 64};
    static const enum st_dtype DTYPES[] = {DT_INVALID, DT_F16, DT_F32};
    const char *dirs[1] = {ad};
    for (size_t ci = 0; ci < sizeof CHUNKS / sizeof CHUNKS[0]; ci++)
        for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
            char *out = tu_strdupf("%s/out-%zu-%zu.safetensors", s->dir, ci, di);
            struct convert_opts o;
            convert_opts_init(&o);
            o.device = DEVICE_CPU;
            o.chunk_elements = CHUNKS[ci];
            o.threads = 3;
            o.dtype = DTYPES[di];
            o.lora_dirs = dirs;
            o.nlora = 1;
            o.progress = PROGRESS_NONE;
            struct convert_stats st;
            nf4_set_quiet(1);
            if (convert_run(base_path, out, &o, &st) != NF4_OK)
                fail_msg("convert: %s", nf4_last_error());
            assert_int_equal(st.merged, 1);
            assert_int_equal(st.overflowed, DTYPES[di] == DT_F16 ? 2 : 0);
            enum st_dtype dt = DTYPES[di] != DT_INVALID ? DTYPES[di] : DT_BF16;
            struct st_file *f;
            assert_int_equal(st_open(out, &f), NF4_OK);
            const struct st_tensor *t = st_find(f, "emb.weight");
            assert_non_null(t);
            assert_int_equal(t->dtype, dt);
            unsigned size = dtype_bits(dt) / 8;
            unsigned char *got = malloc(ROWS * COLS * size);
            assert_int_equal(st_read(f, t, 0, got, ROWS * COLS * size), NF4_OK);
            for (uint64_t row = 0; row < ROWS; row++) {
                int k = -1;
                for (int i = 0; i < 4; i++)
                    if (TOKEN_ROWS[i] == row)
                        k = i;
                for (uint64_t c = 0; c < COLS; c++) {
                    float v = k >= 0 ? decoded(DT_BF16, encode(DT_BF16, rows.v[k * COLS + c])) : base.v[row * COLS + c];
                    uint32_t want = encode(dt, v), bits = 0;
                    memcpy(&bits, got + (row * COLS + c) * size, size);
                    if (bits != want)
                        fail_msg("chunk %llu, %s: [%llu, %llu] = 0x%x, expected 0x%x", (unsigned long long)CHUNKS[ci],
                                 dtype_name(dt), (unsigned long long)row, (unsigned long long)c, bits, want);
                }
            }
            free(got);
            st_close(f);
            free(out);
        }
    free(base.v);
    free(rows.v);
    free(base_path);
    free(wpath);
    free(ad);
}

/* inspect counts each tensor's trained token rows, and lists them in JSON
 * in ascending order, whatever the config's. */
static void test_inspect_token_rows(void **state)
{
    (void)state;
    struct tu_run r = tu_run("inspect", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora",
                             LORA_FIXTURES "/adapter-tokens-dict", NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "\nlm_head.weight                                   -               -            -  "
                       LORA_FIXTURES "/adapter-tokens-dict (trainable tokens: 3 rows, BF16)\n") ||
        !strstr(r.out, "\nmodel.embed_tokens.weight                        -               -            -  "
                       LORA_FIXTURES "/adapter-tokens-dict (trainable tokens: 2 rows, BF16)\n"))
        fail_msg("%s", r.out);
    tu_run_free(&r);
    r = tu_run("inspect", "--json", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora", LORA_FIXTURES "/adapter-tokens-dict",
               NULL);
    assert_int_equal(r.status, 0);
    if (!strstr(r.out, "\"tensor\": \"lm_head.weight\",\n      \"adapter\": \"" LORA_FIXTURES "/adapter-tokens-dict\",\n"
                       "      \"change\": \"rows\",\n      \"rows\": [\n        4,\n        300,\n        510\n      ],\n"
                       "      \"dtype\": \"BF16\"\n"))
        fail_msg("%s", r.out);
    tu_run_free(&r);
}

/* An adapter for another model: its keys name modules this base lacks. */
static void test_adapter_for_another_base(void **state)
{
    assert_merge_refused(*state, LORA_FIXTURES "/base-llama-fp16-fp4-bnb4", LORA_FIXTURES "/adapter-r8-all-linear",
                         NULL, "adapter-r8-all-linear");
}

/* An adapter whose config no longer targets one of its modules (o_proj here):
 * PEFT does not load those weights, so the merge leaves them out, says so,
 * and merges the rest. */
static void test_untargeted_module_left_out_with_a_warning(void **state)
{
    struct tu_scratch *s = *state;
    char *ad = tu_strdupf("%s/adapter", s->dir), *out = tu_strdupf("%s/out.safetensors", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && python3 -c 'import json, sys; p = sys.argv[1]; c = json.load(open(p)); "
                           "c[\"target_modules\"] = [\"down_proj\"]; json.dump(c, open(p, \"w\"))' "
                           "%s/adapter_config.json",
                           LORA_FIXTURES "/adapter-fp16-r4", ad, ad);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("convert", "--device", "cpu", LORA_FIXTURES "/base-llama-fp16-fp4-bnb4", out, "--lora",
                             ad, NULL);
    if (r.status != 0 || !strstr(r.err, "o_proj.lora_A.weight: its module is not one adapter_config.json targets") ||
        !strstr(r.err, "2 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    r = tu_run("inspect", LORA_FIXTURES "/base-llama-fp16-fp4-bnb4", "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    const char *changed = strstr(r.out, "CHANGED BY LORA");
    assert_non_null(changed);
    assert_non_null(strstr(changed, "down_proj.weight"));
    assert_null(strstr(changed, "o_proj.weight"));
    tu_run_free(&r);
    free(cmd);
    free(ad);
    free(out);
}

/* inspect --lora lists each changed tensor with r, alpha and scaling. */
/* Each LoRA bias of every adapter is added in adapter order, rounded once:
 * the same adapter twice gives bias + b * s + b * s, element by element. A
 * bias one adapter replaces ("bias": "all") and another changes is refused,
 * as every tensor is. inspect marks the terms. */
static void test_lora_bias_terms(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = LORA_FIXTURES "/" BIAS_BASE, *ad = LORA_FIXTURES "/adapter-lora-bias";
    char *out = tu_strdupf("%s/twice", s->dir);
    const char *dirs[2] = {ad, ad};
    assert_int_equal(merge_on_cpu(base, out, dirs, 2, 0, 0, DT_INVALID), 16);
    struct model *got, *bm, *am;
    assert_int_equal(model_open_dir(out, &got), NF4_OK);
    assert_int_equal(model_open_dir(base, &bm), NF4_OK);
    char *weights = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ad);
    assert_int_equal(model_open_file(weights, &am), NF4_OK);
    size_t checked = 0;
    for (size_t i = 0; i < am->count; i++) {
        const char *key = am->tensors[i].t->name;
        if (!str_ends_with(key, ".lora_B.bias"))
            continue;
        char *name = tu_strdupf("%.*s.bias", (int)(strlen(key) - strlen(".lora_B.bias") - strlen(PEFT_KEY_PREFIX)),
                                key + strlen(PEFT_KEY_PREFIX));
        const struct model_tensor *g = model_find(got, name), *w = model_find(bm, name), *b = &am->tensors[i];
        assert_non_null(g);
        assert_non_null(w);
        assert_int_equal(g->t->dtype, DT_BF16);
        assert_int_equal(b->t->dtype, DT_F32);
        uint64_t n = w->t->nelem;
        assert_int_equal(b->t->nelem, n);
        uint16_t *gv = malloc(n * 2), *wv = malloc(n * 2);
        float *bv = malloc(n * 4);
        assert_int_equal(st_read(g->file, g->t, 0, gv, n * 2), NF4_OK);
        assert_int_equal(st_read(w->file, w->t, 0, wv, n * 2), NF4_OK);
        assert_int_equal(st_read(b->file, b->t, 0, bv, n * 4), NF4_OK);
        for (uint64_t k = 0; k < n; k++) {
            volatile float m = bf16_to_f32(wv[k]), d = bv[k] * 4.0f; /* alpha / r = 32 / 8 */
            m = m + d;
            m = m + d;
            if (gv[k] != f32_to_bf16(m))
                fail_msg("%s[%llu]: 0x%04x, expected 0x%04x", name, (unsigned long long)k, gv[k], f32_to_bf16(m));
        }
        checked++;
        free(gv);
        free(wv);
        free(bv);
        free(name);
    }
    assert_int_equal(checked, 8);
    model_close(am);
    model_close(bm);
    model_close(got);
    free(weights);
    tu_rmtree(out);
    free(out); /* assert_merge_refused counts what is left in s->dir */
    assert_merge_refused(s, base, ad, LORA_FIXTURES "/adapter-lora-bias-all",
                         "model.layers.0.self_attn.k_proj.bias: is replaced by one adapter (a modules_to_save copy, "
                         "a trained bias or a saved base layer) and changed by another");
    struct tu_run r = tu_run("inspect", base, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "model.layers.1.self_attn.v_proj.bias             8              32            4  "
                                  LORA_FIXTURES "/adapter-lora-bias (lora_bias)\n"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", base, "--lora", ad, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"lora_bias\": true"));
    tu_run_free(&r);
    /* A layer of no rows: refused, not a division by zero. */
    struct syn_tensor empty_base[2] = {{"model.d.weight", DT_F32, {0, 8}, NULL}, {"model.d.bias", DT_F32, {0, 0}, NULL}};
    struct syn_tensor empty_ad[3] = {{PEFT_KEY_PREFIX "model.d.lora_A.weight", DT_F32, {4, 8}, NULL},
                                     {PEFT_KEY_PREFIX "model.d.lora_B.weight", DT_F32, {0, 4}, NULL},
                                     {PEFT_KEY_PREFIX "model.d.lora_B.bias", DT_F32, {0, 0}, NULL}};
    for (size_t i = 0; i < 3; i++)
        syn_fill(&empty_ad[i], 1.0f);
    for (size_t i = 0; i < 2; i++)
        syn_fill(&empty_base[i], 1.0f);
    char *ebase = tu_strdupf("%s-empty.safetensors", s->dir), *ead = tu_strdupf("%s-empty-adapter", s->dir);
    char *eweights = tu_strdupf("%s/" ADAPTER_WEIGHTS_NAME, ead);
    syn_write(ebase, empty_base, 2);
    assert_int_equal(mkdir(ead, 0755), 0);
    syn_write(eweights, empty_ad, 3);
    write_config(ead, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"lora_bias\": true}");
    assert_merge_refused(s, ebase, ead, NULL, "changes model.d.weight, which has no elements");
    tu_rmtree(ead);
    for (size_t i = 0; i < 3; i++)
        free(empty_ad[i].v);
    for (size_t i = 0; i < 2; i++)
        free(empty_base[i].v);
    unlink(ebase);
    free(ebase);
    free(ead);
    free(eweights);
    /* "bias": "all": every bias trained, under a LoRA layer (M.base_layer.bias) or not (M.bias). */
    r = tu_run("inspect", base, "--lora", LORA_FIXTURES "/adapter-lora-bias-all", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "model.layers.0.self_attn.q_proj.bias             -               -            -  "
                                  LORA_FIXTURES "/adapter-lora-bias-all (trained bias: replaced, BF16)\n"));
    assert_non_null(strstr(r.out, "model.layers.0.self_attn.k_proj.bias             -               -            -  "
                                  LORA_FIXTURES "/adapter-lora-bias-all (trained bias: replaced, BF16)\n"));
    tu_run_free(&r);
}

/* ---- diffusers LoRAs (pytorch_lora_weights.safetensors) ---- */

#define DIFFUSERS_FIXTURES FIXTURES "/diffusers"

/* A LoRA diffusers' save_lora_weights wrote for the tiny Flux transformer,
 * with its config in the metadata (scalings 2 and 1) and without (scaling
 * 1): merged into the transformer/ component within the tolerance; given as
 * the file itself, on the single-file transformer, the same bytes. */
static void test_diffusers_loras(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    static const char *const NAMES[] = {"lora-flux", "lora-flux-nometa"};
    for (size_t i = 0; i < 2; i++) {
        char *out = tu_strdupf("%s/flux-%zu", s->dir, i), *ad = tu_strdupf(DIFFUSERS_FIXTURES "/%s", NAMES[i]);
        char *e32 = tu_strdupf(DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.%s.expected.safetensors", NAMES[i]);
        char *e64 = tu_strdupf(DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.%s.expected.fp64.safetensors", NAMES[i]);
        const char *dirs[1] = {ad};
        assert_int_equal(merge_on_cpu(base, out, dirs, 1, i ? 1 : 0, 3, DT_INVALID), 18);
        check_merge(out, base, ad, e32, e64, NULL);
        free(out);
        free(ad);
        free(e32);
        free(e64);
    }
    char *file_out = tu_strdupf("%s/flux.safetensors", s->dir), *dir_out = tu_strdupf("%s/flux-0/%s", s->dir,
                                                                                       "diffusion_pytorch_model.safetensors");
    const char *file[1] = {DIFFUSERS_FIXTURES "/lora-flux/pytorch_lora_weights.safetensors"};
    assert_int_equal(merge_on_cpu(DIFFUSERS_FIXTURES "/tiny-flux-transformer.bnb4.safetensors", file_out, file, 1, 0, 0,
                                  DT_INVALID), 18);
    tu_assert_same_tensors(file_out, dir_out);
    /* The same tensors pickled (pytorch_lora_weights.bin, no metadata): the
     * nometa merge, byte for byte. */
    char *pickled = tu_strdupf("%s/pickled", s->dir), *nometa = tu_strdupf("%s/flux-1", s->dir);
    const char *pdirs[1] = {DIFFUSERS_FIXTURES "/lora-flux-pickled"};
    assert_int_equal(merge_on_cpu(base, pickled, pdirs, 1, 0, 0, DT_INVALID), 18);
    char *pf = tu_strdupf("%s/diffusion_pytorch_model.safetensors", pickled),
         *nf = tu_strdupf("%s/diffusion_pytorch_model.safetensors", nometa);
    tu_assert_same_tensors(pf, nf);
    /* Another component's folder takes its own keys only: text_encoder_2/ is
     * not given the transformer's. */
    char *out = tu_strdupf("%s/te2", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4/text_encoder_2", out,
                             "--lora", DIFFUSERS_FIXTURES "/lora-flux", NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "is a diffusers LoRA with no tensors for text_encoder_2 (its keys are for: transformer)"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    free(out);
    free(pf);
    free(nf);
    free(pickled);
    free(nometa);
    free(file_out);
    free(dir_out);
}

/* config.json of `dir` holds `text` (a member as nf4deq writes it). */
static void assert_config_holds(const char *dir, const char *text)
{
    char *path = tu_strdupf("%s/config.json", dir), *json = tu_read_file(path, NULL);
    assert_non_null(json);
    if (!strstr(json, text))
        fail_msg("%s has no %s: %s", path, text, json);
    free(json);
    free(path);
}

/* A Flux.1 control LoRA in diffusers' form (make_flux_control_fixtures.py)
 * on the tiny transformer: x_embedder widened from 16 to 32 inputs (the base
 * in the first 16 columns, zeros after, then the LoRA merged: within the
 * tolerance of diffusers' own merge, in_channels 32 and out_channels 16 in
 * config.json), context_embedder's narrower lora_A padded, the norms
 * replaced (F32 rounded to BF16), a norm the model lacks ignored with a
 * warning; the same through the pipeline. */
static void test_flux_control_lora(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    const char *lora = DIFFUSERS_FIXTURES "/lora-flux-control-tiny.safetensors";
    const char *e32 = DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.lora-flux-control-tiny.expected.safetensors";
    const char *e64 = DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.lora-flux-control-tiny.expected.fp64.safetensors";
    char *out = tu_strdupf("%s/folder", s->dir), *pipe = tu_strdupf("%s/pipe", s->dir),
         *pipe_out = tu_strdupf("%s/pipe/transformer", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0); /* where no temp file may stay */
    struct tu_run r = tu_run("convert", "--device", "cpu", base, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != 2 ||
        !strstr(r.err, "transformer.transformer_blocks.1.attn.norm_q.weight: a norm weight the model does not have; "
                       "diffusers ignores it") || !strstr(r.err, "(29 dequantized, 4 with LoRA merged)"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    check_merge(out, base, lora, e32, e64, NULL);
    assert_config_holds(out, "\"in_channels\": 32,");
    assert_config_holds(out, "\"out_channels\": 16,");
    r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4", pipe, "--lora", lora, NULL);
    if (r.status != 0)
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    char *a = tu_strdupf("%s/diffusion_pytorch_model.safetensors", out),
         *b = tu_strdupf("%s/diffusion_pytorch_model.safetensors", pipe_out);
    tu_assert_same_tensors(a, b);
    assert_config_holds(pipe_out, "\"in_channels\": 32,");
    /* the index made a FluxControlPipeline's, the rest of it kept */
    char *index = tu_strdupf("%s/model_index.json", pipe), *want = tu_strdupf("%s/want.json", s->dir);
    tu_sh("sed 's/\"FluxPipeline\"/\"FluxControlPipeline\"/' %s/tiny-flux-bnb4/model_index.json > %s",
          DIFFUSERS_FIXTURES, want);
    tu_sh("cmp %s %s && rm %s", want, index, want);
    r = tu_run("inspect", DIFFUSERS_FIXTURES "/tiny-flux-bnb4", "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.out, "\nmodel_index.json: _class_name FluxPipeline becomes FluxControlPipeline, "
                                        "the pipeline that gives the widened transformer its control image\n"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    r = tu_run("inspect", DIFFUSERS_FIXTURES "/tiny-flux-bnb4", "--lora", lora, "--json", NULL);
    if (r.status != 0 ||
        !strstr(r.out, "\"index_class\": {\n    \"from\": \"FluxPipeline\",\n    \"to\": \"FluxControlPipeline\"\n  }"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    r = tu_run("inspect", base, "--lora", lora, "--json", NULL);
    if (r.status != 0 || !strstr(r.out, "\"change\": \"widened\"") || !strstr(r.out, "\"merged\": 32") ||
        !strstr(r.out, "\"lora_A_padded_from\": 40"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    r = tu_run("inspect", base, "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.out, "(lora_A padded from 40 to 64 inputs)") ||
        !strstr(r.out, "(base layer widened with zeros, BF16)") ||
        !strstr(r.out, "x_embedder is widened from 16 to 32 inputs"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 2); /* the two outputs, no temp file */
    free(a);
    free(b);
    free(out);
    free(pipe);
    free(pipe_out);
    free(index);
    free(want);
}

/* A pipeline class with no control form (FluxKontextPipeline): its index is
 * copied byte for byte, with a warning that names the class, in convert and
 * inspect alike; an index that is no JSON object: exit 65 in both, nothing
 * written. */
static void test_flux_control_lora_on_a_class_without_control_form(void **state)
{
    struct tu_scratch *s = *state;
    const char *lora = DIFFUSERS_FIXTURES "/lora-flux-control-tiny.safetensors";
    char *pipe = tu_strdupf("%s/kontext", s->dir), *out = tu_strdupf("%s/out", s->dir);
    tu_sh("cp -r %s/tiny-flux-bnb4 %s && sed -i 's/\"FluxPipeline\"/\"FluxKontextPipeline\"/' %s/model_index.json",
          DIFFUSERS_FIXTURES, pipe, pipe);
    struct tu_run r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != 3 ||
        !strstr(r.err, "nf4deq: warning: ") ||
        !strstr(r.err, "kontext/model_index.json: _class_name FluxKontextPipeline kept: the widened transformer takes "
                       "a control image, which only diffusers' FluxControl pipelines give it\n"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_sh("cmp %s/model_index.json %s/model_index.json", pipe, out);
    r = tu_run("inspect", pipe, "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.out, "\nmodel_index.json: kept as it is (_class_name FluxKontextPipeline): only "
                                        "diffusers' FluxControl pipelines give the widened transformer its control "
                                        "image\n"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    /* A class name holding escaped control characters prints inert: '?'. */
    tu_sh("sed -i 's/\"FluxKontextPipeline\"/\"Flux\\\\u001b[2J\\\\nX\"/' %s/model_index.json", pipe);
    r = tu_run("inspect", pipe, "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.out, "\nmodel_index.json: kept as it is (_class_name Flux?[2J?X): only "))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    /* an index that is no JSON object cannot be made a control pipeline's */
    tu_sh("rm -r %s && echo '[\"FluxPipeline\"]' > %s/model_index.json", out, pipe);
    for (int inspect = 0; inspect < 2; inspect++) {
        r = inspect ? tu_run("inspect", pipe, "--lora", lora, NULL)
                    : tu_run("convert", "--device", "cpu", pipe, out, "--lora", lora, NULL);
        if (r.status != 65 || tu_lines(r.err) != 2 || !strstr(r.err, "kontext/model_index.json: not a JSON object\n"))
            fail_msg("exit %d, stderr: %s", r.status, r.err);
        tu_run_free(&r);
    }
    assert_int_equal(tu_count_entries(s->dir), 1); /* the input alone */
    free(pipe);
    free(out);
}

/* A refusal (or a warning) about a LoRA that diffusers converts names the
 * file's own key, and the one it was converted to: a kohya Flux.1 pair whose
 * up factor has one row too many (the up factor named), the same pair in
 * XLabs' form, and one whose down factor has a column too many (the down
 * factor named). */
static void test_refusals_name_the_files_keys(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    char *lora = tu_strdupf("%s-lora.safetensors", s->dir);
    static const struct {
        struct synth_tensor t[2];
        const char *want;
    } NAMED[] = {
        {{{"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", DT_BF16, 4, 64, 0.5f},
          {"lora_unet_double_blocks_0_img_attn_proj.lora_up.weight", DT_BF16, 65, 4, 0.25f}},
         "-lora.safetensors: lora_unet_double_blocks_0_img_attn_proj.lora_up.weight (converted to "
         "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight): B @ A is 65x64 but the base tensor "
         "transformer_blocks.0.attn.to_out.0.weight is 64x64"},
        {{{"double_blocks.0.processor.proj_lora1.down.weight", DT_BF16, 4, 64, 0.5f},
          {"double_blocks.0.processor.proj_lora1.up.weight", DT_BF16, 65, 4, 0.25f}},
         "-lora.safetensors: double_blocks.0.processor.proj_lora1.up.weight (converted to "
         "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight): B @ A is 65x64"},
        /* a down factor too wide is its own fault (Flux.1's loader pads a narrower one) */
        {{{"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", DT_BF16, 4, 65, 0.5f},
          {"lora_unet_double_blocks_0_img_attn_proj.lora_up.weight", DT_BF16, 64, 4, 0.25f}},
         "-lora.safetensors: lora_unet_double_blocks_0_img_attn_proj.lora_down.weight (converted to "
         "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight): has 65 inputs, more than"},
    };
    for (size_t i = 0; i < sizeof NAMED / sizeof NAMED[0]; i++) {
        write_synth_file(lora, NAMED[i].t, 2);
        assert_merge_refused(s, base, lora, NULL, NAMED[i].want);
    }
    unlink(lora);
    free(lora);
    /* Warnings name them so too (nf4_tensor_shown), while the converted
     * model is open, and not after it closes. */
    const char *kohya = DIFFUSERS_FIXTURES "/lora-flux-kohya.safetensors";
    const char *converted = "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight";
    struct model *m;
    char shown[NF4_TENSOR_SHOWN_MAX];
    assert_int_equal(diffusers_lora_open(kohya, LORA_FAMILY_FLUX, 0, &m), NF4_OK);
    assert_non_null(model_find(m, converted));
    assert_string_equal(nf4_tensor_shown(kohya, converted, shown, sizeof shown),
                        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight (converted to "
                        "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight)");
    assert_string_equal(nf4_tensor_shown("other.safetensors", converted, shown, sizeof shown), converted);
    model_close(m);
    assert_string_equal(nf4_tensor_shown(kohya, converted, shown, sizeof shown), converted);
}

/* What the Flux.1 loader's widening cannot give a model that loads, or
 * diffusers raises on: refused in one line naming the key, nothing written. */
static void test_flux_control_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    char *lora = tu_strdupf("%s-lora.safetensors", s->dir), *other = tu_strdupf("%s-other.safetensors", s->dir);
#define XA "transformer.x_embedder.lora_A.weight"
#define XB "transformer.x_embedder.lora_B.weight"
    const struct synth_tensor widen[] = {{XA, DT_BF16, 4, 32, 0.5f}, {XB, DT_BF16, 64, 4, 0.25f}};
    /* a single file has no config.json to say in_channels */
    write_synth_file(lora, widen, 2);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-transformer.bnb4.safetensors", lora, NULL,
                         XA ": widens x_embedder.weight from 16 to 32 inputs, which config.json's in_channels must then "
                         "say; convert the transformer's folder");
    /* two adapters widening it */
    write_synth_file(other, widen, 2);
    assert_merge_refused(s, base, lora, other, XA ": widens x_embedder.weight again");
    /* a layer other than x_embedder */
    const struct synth_tensor wide_q[] = {{"transformer.transformer_blocks.0.attn.to_q.lora_A.weight", DT_BF16, 4, 80,
                                           0.5f},
                                          {"transformer.transformer_blocks.0.attn.to_q.lora_B.weight", DT_BF16, 64, 4,
                                           0.25f}};
    write_synth_file(lora, wide_q, 2);
    assert_merge_refused(s, base, lora, NULL, "to_q.lora_A.weight: has 80 inputs, more than "
                         "transformer_blocks.0.attn.to_q.weight (64): diffusers widens the layer in memory, but only "
                         "x_embedder's width is in the model's config");
    /* a norm of another size (load_state_dict raises) */
    const struct synth_tensor norm[] = {{"transformer.transformer_blocks.0.attn.norm_q.weight", DT_F32, 31, 0, 1}};
    write_synth_file(lora, norm, 1);
    assert_merge_refused(s, base, lora, NULL, "norm_q.weight: does not have the dtype class or shape of "
                         "transformer_blocks.0.attn.norm_q.weight in the base model");
    /* a LoRA's output rows are not widened (diffusers keeps the bias, whose load then raises) */
    const struct synth_tensor rows[] = {{XA, DT_BF16, 4, 16, 0.5f}, {XB, DT_BF16, 65, 4, 0.25f}};
    write_synth_file(lora, rows, 2);
    assert_merge_refused(s, base, lora, NULL, XB ": B @ A is 65x16 but the base tensor x_embedder.weight is 64x16");
#undef XA
#undef XB
    unlink(lora);
    unlink(other);
    free(lora);
    free(other);
}

/* A Flux.1 LoRA in diffusers' form with network alphas (TheLastBen's form,
 * make_flux_alpha_fixtures.py): merged within the tolerance with the
 * scalings PEFT gives it (a BF16 alpha over r is a BF16 number: 7 / 3 is
 * 2.328125), proj_out's alpha on the single block's proj_out too, where
 * diffusers' alpha_pattern matches it first; refused where diffusers raises,
 * or nf4deq does not take the alphas. */
static void test_flux_network_alphas(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", *lora = DIFFUSERS_FIXTURES "/lora-flux-alphas";
    char *out = tu_strdupf("%s/out", s->dir), *file = tu_strdupf("%s-alphas.safetensors", s->dir);
    const char *dirs[1] = {lora};
    assert_int_equal(merge_on_cpu(base, out, dirs, 1, 0, 0, DT_INVALID), 19);
    check_merge(out, base, lora, DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.lora-flux-alphas.expected.safetensors",
                DIFFUSERS_FIXTURES "/tiny-flux-bnb4.transformer.lora-flux-alphas.expected.fp64.safetensors", NULL);
    tu_rmtree(out);
#define PA "transformer.proj_out.lora_A.weight"
#define PB "transformer.proj_out.lora_B.weight"
    static const struct {
        struct synth_tensor ts[6];
        size_t n;
        const char *metadata, *want;
    } ALPHA_CASES[] = {
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_I32, 1, 0, 1}}, 3,
         NULL, "transformer.proj_out.alpha: is an alpha of dtype I32, which diffusers refuses"},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_F32, 2, 0, 1}}, 3,
         NULL, "transformer.proj_out.alpha: holds 2 values; an alpha is one number"},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_BF16, 1, 0, 4},
          {"transformer.context_embedder.lora_A.weight", DT_BF16, 4, 64, 0.5f},
          {"transformer.context_embedder.lora_B.weight", DT_BF16, 64, 4, 0.5f}}, 5, NULL, NULL},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_F32, 1, 0, 4}}, 3,
         "{\"transformer.r\": 4, \"transformer.lora_alpha\": 4, \"transformer.target_modules\": [\"proj_out\"]}",
         "transformer.proj_out.alpha: is an alpha key (a network alpha) beside a LoRA config in the metadata, which "
         "diffusers refuses together"},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_BF16, 1, 0, 4},
          {"transformer.context_embedder.lora_A.weight", DT_BF16, 4, 64, 0.5f},
          {"transformer.context_embedder.lora_B.weight", DT_BF16, 64, 4, 0.5f},
          {"transformer.context_embedder.alpha", DT_F32, 1, 0, 2}}, 6, NULL,
         "transformer.proj_out.alpha: is a BF16 alpha, and transformer.context_embedder.alpha, lora_alpha, a F32 one"},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"transformer.proj_out.alpha", DT_F32, 1, 0, INFINITY}},
         3, NULL, "transformer.proj_out.alpha: is inf: the weights it scales would not be finite"},
        {{{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f}, {"text_encoder.x.alpha", DT_I32, 1, 0, 1}}, 3, NULL,
         "text_encoder.x.alpha: is an alpha of dtype I32, which diffusers refuses"},
    };
    for (size_t i = 0; i < sizeof ALPHA_CASES / sizeof ALPHA_CASES[0]; i++) {
        write_synth_file_with_config(file, ALPHA_CASES[i].ts, ALPHA_CASES[i].n, ALPHA_CASES[i].metadata);
        if (ALPHA_CASES[i].want) {
            assert_merge_refused(s, base, file, NULL, ALPHA_CASES[i].want);
            continue;
        }
        /* one alpha, for proj_out alone: lora_alpha 4 for every module, context_embedder's too */
        struct tu_run r = tu_run("inspect", base, "--lora", file, "--json", NULL);
        if (r.status != 0 || !strstr(r.out, "\"alpha\": 4,") || strstr(r.out, "\"scaling\": 2,") ||
            !strstr(r.out, "\"scaling\": 1,"))
            fail_msg("exit %d, stdout: %s", r.status, r.out);
        tu_run_free(&r);
    }
    /* On the pipeline, another component's alphas belong to no component
     * (Flux.1's loader pops them all): one diffusers uses nowhere is left out
     * without a word, one of no floating dtype refused before any warning. */
    const struct synth_tensor other[] = {{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f},
                                         {"text_encoder_2.x.alpha", DT_F32, 2, 0, 1}};
    write_synth_file(file, other, 3);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4", out, "--lora", file,
                             NULL);
    if (r.status != 0 || tu_lines(r.err) != 1 || !strstr(r.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    const struct synth_tensor other_int[] = {{PA, DT_BF16, 4, 64, 0.5f}, {PB, DT_BF16, 16, 4, 0.25f},
                                             {"text_encoder_2.x.alpha", DT_I32, 1, 0, 1}};
    write_synth_file(file, other_int, 3);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4", file, NULL,
                         "text_encoder_2.x.alpha: is an alpha of dtype I32, which diffusers refuses");
#undef PA
#undef PB
    unlink(file);
    free(file);
    free(out);
}

/* The safetensors file `src` written to `dst` with lora_adapter_metadata
 * `value` (its tensors as they are). */
static void copy_with_lora_metadata(const char *src, const char *dst, const char *value)
{
    struct model *m;
    assert_int_equal(model_open_file(src, &m), NF4_OK);
    const struct st_meta meta = {"lora_adapter_metadata", (char *)value};
    write_model(m, dst, &meta, 1);
    model_close(m);
}

/* lora_adapter_metadata that diffusers reads as none (json.loads(raw) if raw
 * else None: "" and JSON's null) merges as a file without it, byte for byte;
 * whitespace alone, on which json.loads raises, is refused, as is a config
 * without target_modules. */
static void test_diffusers_lora_null_metadata(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    char *want = tu_strdupf("%s/want", s->dir), *got = tu_strdupf("%s/got", s->dir),
         *lora = tu_strdupf("%s/lora.safetensors", s->dir),
         *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *got_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", got);
    const char *nometa[1] = {DIFFUSERS_FIXTURES "/lora-flux-nometa"}, *dirs[1] = {lora};
    assert_int_equal(merge_on_cpu(base, want, nometa, 1, 0, 0, DT_INVALID), 18);
    static const char *const NONE[] = {"", "null", " null\n"};
    for (size_t i = 0; i < sizeof NONE / sizeof NONE[0]; i++) {
        copy_with_lora_metadata(DIFFUSERS_FIXTURES "/lora-flux-nometa/pytorch_lora_weights.safetensors", lora, NONE[i]);
        assert_int_equal(merge_on_cpu(base, got, dirs, 1, 0, 0, DT_INVALID), 18);
        tu_assert_same_tensors(got_file, want_file);
        tu_rmtree(got);
    }
    copy_with_lora_metadata(DIFFUSERS_FIXTURES "/lora-flux-nometa/pytorch_lora_weights.safetensors", lora, "  ");
    struct tu_run r = tu_run("convert", "--device", "cpu", base, got, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, "lora_adapter_metadata"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(got));
    /* A config without target_modules (or null): PEFT looks the model's type
     * up, and a diffusers model has none (diffusers 0.42: KeyError 'model_type'). */
    static const char *const NO_TARGETS[] = {"{\"transformer.r\": 4, \"transformer.lora_alpha\": 8}",
                                             "{\"transformer.r\": 4, \"transformer.target_modules\": null}"};
    for (size_t i = 0; i < 2; i++) {
        copy_with_lora_metadata(DIFFUSERS_FIXTURES "/lora-flux-nometa/pytorch_lora_weights.safetensors", lora,
                                NO_TARGETS[i]);
        r = tu_run("convert", "--device", "cpu", base, got, "--lora", lora, NULL);
        if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
            !strstr(r.err, "(metadata \"lora_adapter_metadata\"): has no target_modules: PEFT builds no LoRA layers "
                           "into a diffusers model from such a config (it raises)"))
            fail_msg("exit %d, stderr: %s", r.status, r.err);
        tu_run_free(&r);
        assert_false(tu_exists(got));
    }
    unlink(lora);
    free(want);
    free(got);
    free(lora);
    free(want_file);
    free(got_file);
}

/* A diffusers LoRA with tensors for the transformer and for another
 * component: the transformer's are merged, the others left out with one
 * warning; with none for the transformer, refused. inspect lists the change. */
static void test_diffusers_lora_components(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    struct syn_tensor ts[4] = {
        {"transformer.proj_out.lora_A.weight", DT_BF16, {4, 64}, NULL},
        {"transformer.proj_out.lora_B.weight", DT_BF16, {16, 4}, NULL},
        {"text_encoder.encoder.layers.0.self_attn.q_proj.lora_A.weight", DT_F32, {4, 8}, NULL},
        {"text_encoder.encoder.layers.0.self_attn.q_proj.lora_B.weight", DT_F32, {8, 4}, NULL},
    };
    for (size_t i = 0; i < 4; i++)
        syn_fill(&ts[i], 0.5f);
    char *ad = tu_strdupf("%s-lora", s->dir), *path = tu_strdupf("%s/" DIFFUSERS_LORA_NAME, ad);
    assert_int_equal(mkdir(ad, 0755), 0);
    syn_write(path, ts, 4);
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(base, out, ad,
                           "2 of its tensors are for other pipeline components (text_encoder) than transformer",
                           "1 with LoRA merged");
    struct tu_run r = tu_run("inspect", base, "--lora", path, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "proj_out.weight"));
    assert_non_null(strstr(r.out, "1 tensor changed by 1 adapter"));
    tu_run_free(&r);
    tu_rmtree(out);
    /* Only the text encoder's: nothing for this base. */
    syn_write(path, ts + 2, 2);
    assert_merge_refused(s, base, ad, NULL, "is a diffusers LoRA with no tensors for transformer (its keys are for: "
                                            "text_encoder)");
    tu_rmtree(ad);
    for (size_t i = 0; i < 4; i++)
        free(ts[i].v);
    free(ad);
    free(path);
    free(out);
}

/* A text encoder's LoRA keys with and without CLIP's "text_model." (as
 * transformers 4 and 5 name the module), on a text encoder whose tensors on
 * disk have it or not: diffusers 0.42 with transformers 5 loads all four
 * alike, so each merges into the same tensor; a LoRA with both forms of one
 * key is refused. */
static void test_diffusers_lora_text_model(void **state)
{
    struct tu_scratch *s = *state;
    char *flat = tu_strdupf("%s-flat", s->dir), *nested = tu_strdupf("%s-nested", s->dir),
         *with = tu_strdupf("%s-with.safetensors", s->dir), *without = tu_strdupf("%s-without.safetensors", s->dir),
         *ref = tu_strdupf("%s-ref.safetensors", s->dir);
    assert_int_equal(tu_sh_status("cp -r %s %s && mv %s/vae %s/text_encoder && cp -r %s %s", DIFFUSERS_FIXTURES
                                  "/tiny-flux-bnb4", flat, flat, flat, flat, nested), 0);
    char *te = tu_strdupf("%s/text_encoder/diffusion_pytorch_model.safetensors", flat),
         *nested_te = tu_strdupf("%s/text_encoder/diffusion_pytorch_model.safetensors", nested);
    copy_tensors(te, nested_te, all_but, "", "text_model.", NULL); /* as transformers 4 saved CLIP */
    struct syn_tensor ts[4] = {
        {"text_encoder.text_model.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"text_encoder.text_model.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
    };
    syn_fill(&ts[0], 0.5f);
    syn_fill(&ts[1], 0.5f);
    ts[2].v = ts[0].v;
    ts[3].v = ts[1].v;
    syn_write(with, ts, 2);
    syn_write(without, ts + 2, 2);
    const char *pipes[2] = {flat, nested}, *loras[2] = {with, without};
    char *outs[2][2];
    for (size_t p = 0; p < 2; p++)
        for (size_t l = 0; l < 2; l++) {
            outs[p][l] = tu_strdupf("%s/out-%zu-%zu", s->dir, p, l);
            struct tu_run r = tu_run("convert", "--device", "cpu", pipes[p], outs[p][l], "--lora", loras[l], NULL);
            if (r.status != 0 || !strstr(r.err, "1 with LoRA merged"))
                fail_msg("%s --lora %s: exit %d, stderr: %s", pipes[p], loras[l], r.status, r.err);
            tu_run_free(&r);
        }
    char *got[2][2];
    for (size_t p = 0; p < 2; p++)
        for (size_t l = 0; l < 2; l++)
            got[p][l] = tu_strdupf("%s/text_encoder/diffusion_pytorch_model.safetensors", outs[p][l]);
    tu_assert_same_tensors(got[0][1], got[0][0]);
    tu_assert_same_tensors(got[1][1], got[1][0]);
    copy_tensors(got[0][0], ref, all_but, "", "text_model.", NULL);
    tu_assert_same_tensors(got[1][0], ref);
    /* and it is a merge: the flat output's to_q differs from the base's */
    struct model *m;
    assert_int_equal(model_open_file(got[0][0], &m), NF4_OK);
    const struct model_tensor *q = model_find(m, "decoder.mid_block.attentions.0.to_q.weight");
    struct model *b;
    assert_int_equal(model_open_file(te, &b), NF4_OK);
    const struct model_tensor *bq = model_find(b, "decoder.mid_block.attentions.0.to_q.weight");
    float gv[32], bv[32];
    assert_int_equal(st_read(q->file, q->t, 0, gv, sizeof gv), NF4_OK);
    assert_int_equal(st_read(bq->file, bq->t, 0, bv, sizeof bv), NF4_OK);
    assert_true(memcmp(gv, bv, sizeof gv) != 0);
    model_close(m);
    model_close(b);
    /* Both forms of one key. */
    syn_write(with, ts, 4);
    char *out = tu_strdupf("%s/both", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", flat, out, "--lora", with, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "text_encoder.decoder.mid_block.attentions.0.to_q.lora_A.weight and "
                       "text_encoder.text_model.decoder.mid_block.attentions.0.to_q.lora_A.weight both become "
                       "text_encoder.decoder.mid_block.attentions.0.to_q.lora_A.weight once renamed\n"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    for (size_t p = 0; p < 2; p++)
        for (size_t l = 0; l < 2; l++) {
            tu_rmtree(outs[p][l]);
            free(outs[p][l]);
            free(got[p][l]);
        }
    tu_rmtree(flat);
    tu_rmtree(nested);
    unlink(with);
    unlink(without);
    unlink(ref);
    free(ts[0].v);
    free(ts[1].v);
    free(flat);
    free(nested);
    free(with);
    free(without);
    free(ref);
    free(te);
    free(nested_te);
    free(out);
}

/* The kohya tests point TMPDIR (where a LoRA's conversion goes) into their
 * scratch folder; their teardown puts it back even when one fails. */
static char *saved_tmpdir;
static int saved_tmpdir_set;

static int kohya_setup(void **state)
{
    const char *was = getenv("TMPDIR");
    saved_tmpdir = was ? strdup(was) : NULL;
    saved_tmpdir_set = 1;
    return tu_scratch_setup(state);
}

static int kohya_teardown(void **state)
{
    if (saved_tmpdir_set) {
        if (saved_tmpdir)
            setenv("TMPDIR", saved_tmpdir, 1);
        else
            unsetenv("TMPDIR");
        free(saved_tmpdir);
        saved_tmpdir = NULL;
        saved_tmpdir_set = 0;
    }
    return tu_scratch_teardown(state);
}

/* Kohya and ComfyUI Flux.1 LoRAs read as diffusers 0.42 loads them: each
 * file's conversion holds, byte for byte, the tensors of the .diffusers file
 * make_kohya_fixtures.py wrote with diffusers' own conversion (alpha folded
 * into the factors in their dtypes, qkv and linear1 split, dense and
 * block-diagonal, the text encoder's keys, what it leaves out), and merges as
 * that file does, alone and in a pipeline. */
static void test_kohya_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const KOHYA_CASES[][2] = {
        {DIFFUSERS_FIXTURES "/lora-flux-kohya.safetensors", DIFFUSERS_FIXTURES "/lora-flux-kohya.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-flux-comfy.safetensors", DIFFUSERS_FIXTURES "/lora-flux-kohya.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-flux-kohya-linear1.safetensors",
         DIFFUSERS_FIXTURES "/lora-flux-kohya-linear1.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-flux-kohya-te.safetensors", DIFFUSERS_FIXTURES "/lora-flux-kohya-te.diffusers.safetensors"},
    };
    for (size_t i = 0; i < sizeof KOHYA_CASES / sizeof KOHYA_CASES[0]; i++) {
        struct model *m;
        assert_int_equal(diffusers_lora_open(KOHYA_CASES[i][0], LORA_FAMILY_FLUX, 0, &m), NF4_OK);
        assert_int_equal(m->nfiles, 1);
        assert_string_equal(m->files[0]->path, KOHYA_CASES[i][0]); /* messages name the kohya file */
        tu_assert_same_st(m->files[0], KOHYA_CASES[i][0], KOHYA_CASES[i][1]);
        model_close(m);
    }
    char *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir);
    const char *kohya[1] = {KOHYA_CASES[0][0]}, *converted[1] = {KOHYA_CASES[0][1]};
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0); /* where no temp file may stay */
    const char *transformer = DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer";
    assert_int_equal(merge_on_cpu(transformer, got, kohya, 1, 0, 0, DT_INVALID), 16);
    assert_int_equal(merge_on_cpu(transformer, want, converted, 1, 0, 0, DT_INVALID), 16);
    char *got_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", got),
         *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *pipe_file = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", pipe);
    tu_assert_same_tensors(got_file, want_file);
    /* What is not merged, said once, also in a pipeline (which has no CLIP text encoder here). */
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4", pipe, "--lora",
                             KOHYA_CASES[1][0], NULL);
    if (r.status != 0 || tu_lines(r.err) != 3 ||
        !strstr(r.err, "lora-flux-comfy.safetensors: 11 of its tensors (text_encoders.clip_l.transformer.text_projection, "
                       "diffusion_model.final_layer.adaLN_modulation.1, diffusion_model.final_layer.linear, ...) are "
                       "for modules diffusers does not load from a kohya LoRA: they are not merged\n") ||
        !strstr(r.err, "6 of its tensors are for text_encoder, which this pipeline does not have"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_assert_same_tensors(pipe_file, want_file);
    r = tu_run("inspect", DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", "--lora", KOHYA_CASES[0][0], NULL);
    if (r.status != 0 || !strstr(r.out, "\n16 tensors changed by 1 adapter\n") ||
        !strstr(r.err, "13 of its tensors (lora_te1_text_projection, lora_te2_encoder_block_0_layer_0_SelfAttention_q, "
                       "lora_unet_final_layer_adaLN_modulation_1, ...) are for modules diffusers does not load"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(got);
    tu_rmtree(want);
    tu_rmtree(pipe);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(got_file);
    free(want_file);
    free(pipe_file);
    free(got);
    free(want);
    free(pipe);
}

/* A LoRA file of names[0] [down] and names[1] [up] (either NULL: left out),
 * in `dtype`, 0.5-scaled values, and names[2] (NULL: none) an F32 [1, 1] of
 * `third` (an alpha, or a key of another kind). */
static void write_pair_lora(const char *path, const char *const names[3], const uint64_t down[2], const uint64_t up[2],
                            enum st_dtype dtype, float third)
{
    struct syn_tensor ts[3];
    size_t n = 0;
    const uint64_t *shapes[2] = {down, up};
    for (size_t k = 0; k < 2; k++)
        if (names[k])
            ts[n++] = (struct syn_tensor){names[k], dtype, {shapes[k][0], shapes[k][1]}, NULL};
    if (names[2])
        ts[n++] = (struct syn_tensor){names[2], DT_F32, {1, 1}, NULL};
    for (size_t k = 0; k < n; k++)
        syn_fill(&ts[k], 0.5f);
    if (names[2])
        ts[n - 1].v[0] = third;
    syn_write(path, ts, n);
    for (size_t k = 0; k < n; k++)
        free(ts[k].v);
}

/* Kohya LoRAs diffusers would not load, or not as nf4deq would merge them:
 * refused with one line naming the file and the key, nothing written. */
static void test_kohya_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *names[3]; /* down, up, alpha (NULL: none) */
        uint64_t down[2], up[2];
        enum st_dtype dtype;
        float alpha;
        const char *want;
    } KOHYA_CASES[] = {
        {{"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", NULL, NULL}, {4, 64}, {256, 4}, DT_BF16, 0,
         "lora_unet_double_blocks_0_img_mlp_0.lora_down.weight: has no matching lora_up.weight"},
        {{NULL, "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight", NULL}, {4, 64}, {256, 4}, DT_BF16, 0,
         "is a kohya or ComfyUI-format LoRA without lora_down/lora_up pairs"},
        {{"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight",
          "lora_unet_double_blocks_0_img_mlp_0.alpha"}, {4, 64}, {256, 4}, DT_BF16, -1.0f,
         "lora_unet_double_blocks_0_img_mlp_0.alpha: is -1; an alpha is a number from 0 up"},
        {{"lora_unet_single_blocks_0_linear1.lora_down.weight", "lora_unet_single_blocks_0_linear1.lora_up.weight",
          NULL}, {4, 64}, {448, 4}, DT_BF16, 0,
         "lora_unet_single_blocks_0_linear1.lora_up.weight: has 448 rows; diffusers splits it into Flux.1's 3072 + "
         "3072 + 3072 + 12288"},
        {{"lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight",
          "lora_unet_double_blocks_0_txt_attn_qkv.lora_up.weight", NULL}, {3, 64}, {190, 3}, DT_F16, 0,
         "has 190 rows; diffusers splits it into three equal parts"},
        {{"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
          "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", NULL}, {4, 64}, {64, 4}, DT_BF16, 0,
         "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight: is not of a Flux.1 module diffusers "
         "converts from kohya's names"},
        {{"lora_unet_double_blocks_19_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_19_img_mlp_0.lora_up.weight",
          NULL}, {4, 64}, {256, 4}, DT_BF16, 0, "a LoRA for another model?"},
        {{"lora_unet_double_blocks_00_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_00_img_mlp_0.lora_up.weight",
          NULL}, {4, 64}, {256, 4}, DT_BF16, 0, "a LoRA for another model?"},
        {{"lora_transformer_single_transformer_blocks_0_proj_out.lora_down.weight",
          "lora_transformer_single_transformer_blocks_0_proj_out.lora_up.weight", NULL}, {4, 64}, {64, 4}, DT_BF16, 0,
         "is of the kohya \"mixture\" layout"},
        {{"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight",
          NULL}, {4, 64}, {256, 3}, DT_BF16, 0, "is a matrix; with lora_unet_double_blocks_0_img_mlp_0.lora_up.weight "
                                                "it is not a LoRA pair [r, in], [out, r]"},
        {{"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight",
          NULL}, {4, 64}, {256, 4}, DT_I8, 0, "is I8; LoRA weights must be F32, BF16 or F16"},
        {{"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight",
          NULL}, {4, 64}, {0, 4}, DT_BF16, 0, "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight: is empty"},
        {{"lora_unet_img_in.lora_down.weight", NULL, NULL}, {4, 16}, {64, 4}, DT_BF16, 0,
         "lora_unet_img_in.lora_down.weight: has no matching lora_up.weight"},
        {{"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
          "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight", NULL}, {4, 32}, {32, 4}, DT_BF16, 0,
         "is a text encoder key, and none of them is of an out_proj or mlp module: diffusers cannot tell their form"},
        {{"lora_unet_double_blocks_0_img_mlp_0_________________________________________________________________________"
          "________________________________________________________________________________________________________"
          "________________________________________________________________________________________________________"
          "________________________________________________________________________________________________________"
          "________________________________________________________________________________________________________"
          ".lora_down.weight", NULL, NULL}, {4, 64}, {256, 4}, DT_BF16, 0, "is too long a name for a LoRA key"},
        {{"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
          "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", NULL}, {4, 64}, {256, 4}, DT_BF16, 0,
         "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight: has no matching lora_up.weight"},
    };
    char *lora = tu_strdupf("%s-kohya.safetensors", s->dir);
    /* The converted LoRA's temp file goes where the scratch folder is checked empty. */
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof KOHYA_CASES / sizeof KOHYA_CASES[0]; i++) {
        write_pair_lora(lora, KOHYA_CASES[i].names, KOHYA_CASES[i].down, KOHYA_CASES[i].up, KOHYA_CASES[i].dtype,
                        KOHYA_CASES[i].alpha);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", lora, NULL, KOHYA_CASES[i].want);
    }
    /* lora_te_ and lora_te1_ of one layer: both would load as the same module. */
    struct syn_tensor te[4] = {
        {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", DT_BF16, {4, 32}, NULL},
        {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", DT_BF16, {37, 4}, NULL},
        {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", DT_BF16, {4, 32}, NULL},
        {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", DT_BF16, {37, 4}, NULL},
    };
    for (size_t k = 0; k < 4; k++)
        syn_fill(&te[k], 0.5f);
    syn_write(lora, te, 4);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", lora, NULL,
                         "becomes text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_A.weight, as "
                         "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight does");
    /* The text encoder's text_projection alone: diffusers drops it before it
     * looks at the rest, so the LoRA loads. */
    struct syn_tensor tp[4] = {
        {"lora_te1_text_projection.lora_down.weight", DT_BF16, {2, 32}, NULL},
        {"lora_te1_text_projection.lora_up.weight", DT_BF16, {32, 2}, NULL},
        {"lora_unet_double_blocks_0_img_mlp_0.lora_down.weight", DT_BF16, {4, 64}, NULL},
        {"lora_unet_double_blocks_0_img_mlp_0.lora_up.weight", DT_BF16, {256, 4}, NULL},
    };
    for (size_t k = 0; k < 4; k++)
        syn_fill(&tp[k], 0.5f);
    syn_write(lora, tp, 4);
    char *tp_out = tu_strdupf("%s/tp", s->dir);
    struct tu_run tr = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", tp_out,
                              "--lora", lora, NULL);
    if (tr.status != 0 || !strstr(tr.err, "2 of its tensors (lora_te1_text_projection) are for modules diffusers does "
                                          "not load") || !strstr(tr.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", tr.status, tr.err);
    tu_run_free(&tr);
    tu_rmtree(tp_out);
    free(tp_out);
    for (size_t k = 0; k < 4; k++)
        free(tp[k].v);
    /* A good LoRA whose conversion cannot be written. */
    syn_write(lora, te, 2);
    assert_int_equal(setenv("TMPDIR", "/nonexistent-nf4deq-tmp", 1), 0);
    char *out = tu_strdupf("%s/out", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", out,
                             "--lora", lora, NULL);
    if (r.status != NF4_ECANTCREAT || tu_lines(r.err) != 1 ||
        !strstr(r.err, "cannot create a temp file for the converted LoRA (set TMPDIR)"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(out);
    for (size_t k = 0; k < 4; k++)
        free(te[k].v);
    unlink(lora);
    free(lora);
}

/* Each of n LoRAs (cases[i][0]), opened as a LoRA of `family`, holds byte for
 * byte the tensors of its diffusers form (cases[i][1]), and merges into
 * `transformer` as that form does, changing merged[i] tensors. Leaves the
 * scratch folder empty (TMPDIR points there: no temp file may stay). */
static void assert_converts_as_diffusers(const struct tu_scratch *s, const char *const (*cases)[2], size_t n,
                                         enum lora_family family, const char *transformer, const uint64_t *merged)
{
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    char *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir);
    char *got_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", got),
         *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want);
    for (size_t i = 0; i < n; i++) {
        struct model *m;
        assert_int_equal(diffusers_lora_open(cases[i][0], family, 0, &m), NF4_OK);
        assert_int_equal(m->nfiles, 1);
        assert_string_equal(m->files[0]->path, cases[i][0]);
        tu_assert_same_st(m->files[0], cases[i][0], cases[i][1]);
        model_close(m);
        const char *lora[1] = {cases[i][0]}, *converted[1] = {cases[i][1]};
        assert_int_equal(merge_on_cpu(transformer, got, lora, 1, 0, 0, DT_INVALID), merged[i]);
        assert_int_equal(merge_on_cpu(transformer, want, converted, 1, 0, 0, DT_INVALID), merged[i]);
        tu_assert_same_tensors(got_file, want_file);
        tu_rmtree(got);
        tu_rmtree(want);
    }
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(got_file);
    free(want_file);
    free(got);
    free(want);
}

/* Qwen-Image LoRAs in the forms they are shared in (lightx2v's Lightning
 * LoRAs, kohya's and ComfyUI's names, PEFT's adapter name left in) read as
 * diffusers 0.42 loads them into a Qwen-Image pipeline: each conversion holds,
 * byte for byte, the tensors of the .diffusers file make_qwen_fixtures.py
 * wrote with diffusers' own (alphas of every dtype folded into the factors),
 * and merges as that file does, alone and in a pipeline. The form is the
 * pipeline's: the same file on Flux.1's transformer is read as Flux.1's
 * loader reads it, which finds nothing in it to load: refused. */
static void test_qwen_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const QWEN_CASES[][2] = {
        {DIFFUSERS_FIXTURES "/lora-qwen-lightning.safetensors",
         DIFFUSERS_FIXTURES "/lora-qwen-lightning.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-qwen-kohya.safetensors", DIFFUSERS_FIXTURES "/lora-qwen-kohya.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-qwen-comfy.safetensors", DIFFUSERS_FIXTURES "/lora-qwen-comfy.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-qwen-default.safetensors",
         DIFFUSERS_FIXTURES "/lora-qwen-default.diffusers.safetensors"},
        /* The config in the metadata (scaling 4), applied after the alphas are folded in. */
        {DIFFUSERS_FIXTURES "/lora-qwen-meta.safetensors", DIFFUSERS_FIXTURES "/lora-qwen-meta.diffusers.safetensors"},
    };
    const char *pipeline = DIFFUSERS_FIXTURES "/tiny-qwen-image";
    const char *transformer = DIFFUSERS_FIXTURES "/tiny-qwen-image/transformer";
    static const uint64_t MERGED[] = {28, 27, 14, 8, 8};
    assert_converts_as_diffusers(s, QWEN_CASES, sizeof QWEN_CASES / sizeof QWEN_CASES[0], LORA_FAMILY_QWEN_IMAGE,
                                 transformer, MERGED);
    char *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir), *pipe = tu_strdupf("%s/pipe", s->dir);
    char *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *pipe_file = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", pipe);
    /* In the pipeline: the DoRA scales diffusers drops, said once. */
    assert_lora_warns_once(pipeline, pipe, QWEN_CASES[2][0],
                           "lora-qwen-comfy.safetensors: 3 of its tensors (diffusion_model.transformer_blocks.1.attn.to_k."
                       "dora_scale, diffusion_model.transformer_blocks.1.attn.to_out.0.dora_scale, "
                       "diffusion_model.transformer_blocks.1.txt_mlp.net.0.proj.dora_scale) are DoRA scales or alphas "
                       "without factors, which diffusers drops from a Qwen-Image LoRA: they are not merged\n",
                           "14 with LoRA merged");
    const char *comfy_converted[1] = {QWEN_CASES[2][1]};
    assert_int_equal(merge_on_cpu(transformer, want, comfy_converted, 1, 0, 0, DT_INVALID), 14);
    tu_assert_same_tensors(pipe_file, want_file);
    struct tu_run r = tu_run("inspect", pipeline, "--lora", QWEN_CASES[1][0], "--json", NULL);
    if (r.status != 0 || !strstr(r.out, "\"merge\""))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    /* The component alone: its changes, and no tokenizer (a diffusers LoRA brings none). */
    r = tu_run("inspect", transformer, "--lora", QWEN_CASES[0][0], NULL);
    if (r.status != 0 || !strstr(r.out, "\n28 tensors changed by 1 adapter\n") || strstr(r.out, "Tokenizer"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    tu_rmtree(want);
    tu_rmtree(pipe);
    /* Flux.1's loader reads these keys as kohya's, and knows none of them. */
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", QWEN_CASES[0][0], NULL,
                         "lora-qwen-lightning.safetensors: has none of the keys diffusers loads from a kohya Flux.1 LoRA");
    free(want_file);
    free(pipe_file);
    free(got);
    free(want);
    free(pipe);
}

/* Qwen-Image LoRAs diffusers' conversion raises on (or loops forever on, or
 * silently keeps half of): refused with one line naming the file and the key,
 * nothing written. */
static void test_qwen_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key */
        enum st_dtype dtype;
        float extra; /* the third key's value */
        const char *want;
    } QWEN_CASES[] = {
        {{"transformer_blocks.0.attn.to_q.lora_down.weight", NULL, "transformer_blocks.0.attn.to_q.alpha"}, DT_BF16, 4,
         "transformer_blocks.0.attn.to_q.lora_down.weight: has no matching lora_up.weight"},
        {{"diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight", NULL, NULL}, DT_BF16, 0,
         "diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight: has no matching lora_B.weight"},
        {{NULL, "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight", NULL}, DT_BF16, 0,
         "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight: has no matching lora_A.weight"},
        {{"transformer_blocks.0.attn.to_q.lora_down.weight", "transformer_blocks.0.attn.to_q.lora_up.weight",
          "transformer_blocks.0.attn.to_q.alpha"}, DT_BF16, -2, "transformer_blocks.0.attn.to_q.alpha: is -2; an alpha "
                                                                "is a number from 0 up"},
        {{"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight",
          "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight", "lora_unet_transformer_blocks_0_attn_to_q.lora_A.weight"},
         DT_BF16, 1, "lora_unet_transformer_blocks_0_attn_to_q.lora_A.weight: is not a LoRA factor diffusers reads from a "
                     "Qwen-Image LoRA in this file (lora_down/lora_up pairs)"},
        {{"diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight",
          "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight", "transformer_blocks.0.attn.to_q.lora_A.weight"},
         DT_BF16, 1, "becomes transformer_blocks.0.attn.to_q.lora_A.weight, as"},
        {{"transformer_blocks.0.attn.to_q.lora_down.weight", "transformer_blocks.0.attn.to_q.lora_up.weight",
          "transformer_blocks.0.attn.to_q.alpha"}, DT_I8, 4, "is I8; LoRA weights must be F32, BF16 or F16"},
        {{NULL, NULL, "transformer_blocks.0.attn.to_q.alpha"}, DT_BF16, 4,
         "holds no LoRA factor pair (lora_down/lora_up or lora_A/lora_B)"},
        {{"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight",
          "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight", "lora_unet_transformer_blocks_0_attn_to_q.hada_w1_a"},
         DT_BF16, 1, "lora_unet_transformer_blocks_0_attn_to_q.hada_w1_a: is not a LoRA factor diffusers reads"},
    };
    char *lora = tu_strdupf("%s-qwen.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    static const uint64_t DOWN[2] = {4, 32}, UP[2] = {32, 4};
    for (size_t i = 0; i < sizeof QWEN_CASES / sizeof QWEN_CASES[0]; i++) {
        write_pair_lora(lora, QWEN_CASES[i].names, DOWN, UP, QWEN_CASES[i].dtype, QWEN_CASES[i].extra);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-qwen-image/transformer", lora, NULL, QWEN_CASES[i].want);
    }
    /* Not refused: diffusers cuts 19 characters off a kohya name, not bytes, so a
     * name with "é" in that stretch still lands on transformer_blocks.0.attn.to_q. */
    static const char *const ACCENTED[3] = {"lora_unet_transform\xc3\xa9r_blocks_0_attn_to_q.lora_down.weight",
                                            "lora_unet_transform\xc3\xa9r_blocks_0_attn_to_q.lora_up.weight", NULL};
    write_pair_lora(lora, ACCENTED, DOWN, UP, DT_BF16, 0);
    char *out = tu_strdupf("%s/accented", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-qwen-image/transformer", out,
                             "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    free(out);
    unlink(lora);
    free(lora);
}

/* Wan LoRAs in the forms they are shared in (Wan's own names under
 * diffusion_model., as ComfyUI, CausVid and lightx2v share them, with
 * lora_down / lora_up or lora_A / lora_B, alphas, diff_b biases, norm and weight
 * diffs, head.head.diff; musubi-tuner's lora_unet_ names) read as diffusers
 * 0.42 loads them into a Wan pipeline: each conversion holds, byte for byte,
 * the tensors of the .diffusers file make_wan_fixtures.py wrote with
 * diffusers' own, and merges as that file does, alone and in a pipeline. */
static void test_wan_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const WAN_CASES[][2] = {
        {DIFFUSERS_FIXTURES "/lora-wan-comfy.safetensors", DIFFUSERS_FIXTURES "/lora-wan-comfy.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-wan-distill.safetensors",
         DIFFUSERS_FIXTURES "/lora-wan-distill.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-wan-lora-a.safetensors", DIFFUSERS_FIXTURES "/lora-wan-lora-a.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-wan-musubi.safetensors", DIFFUSERS_FIXTURES "/lora-wan-musubi.diffusers.safetensors"},
        /* The config in the metadata (scaling 2), applied after the alphas are folded in. */
        {DIFFUSERS_FIXTURES "/lora-wan-meta.safetensors", DIFFUSERS_FIXTURES "/lora-wan-meta.diffusers.safetensors"},
    };
    const char *pipeline = DIFFUSERS_FIXTURES "/tiny-wan";
    const char *transformer = DIFFUSERS_FIXTURES "/tiny-wan/transformer";
    static const uint64_t MERGED[] = {48, 50, 10, 24, 4}; /* weights, and biases where the LoRA has diff_b */
    assert_converts_as_diffusers(s, WAN_CASES, sizeof WAN_CASES / sizeof WAN_CASES[0], LORA_FAMILY_WAN, transformer,
                                 MERGED);
    char *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir), *pipe = tu_strdupf("%s/pipe", s->dir);
    char *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *pipe_file = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", pipe);
    /* In the pipeline: what diffusers does not load, said once. */
    assert_lora_warns_once(pipeline, pipe, WAN_CASES[0][0],
                           "lora-wan-comfy.safetensors: 5 of its tensors (diffusion_model.blocks.0.norm3.diff, "
                       "diffusion_model.blocks.0.norm3.diff_b, diffusion_model.blocks.1.self_attn.norm_q.diff, ...) "
                       "are ones diffusers does not load from a Wan LoRA: they are not merged\n",
                           "48 with LoRA merged");
    const char *comfy_converted[1] = {WAN_CASES[0][1]};
    assert_int_equal(merge_on_cpu(transformer, want, comfy_converted, 1, 0, 0, DT_INVALID), 48);
    tu_assert_same_tensors(pipe_file, want_file);
    /* The component alone: the head's diff as a LoRA with an identity up, and its bias. */
    struct tu_run r = tu_run("inspect", transformer, "--lora", WAN_CASES[1][0], NULL);
    if (r.status != 0 || !strstr(r.out, "\n50 tensors changed by 1 adapter\n") || !strstr(r.out, "proj_out.bias") ||
        strstr(r.out, "Tokenizer"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    tu_rmtree(want);
    tu_rmtree(pipe);
    /* Qwen-Image's loader reads musubi's lora_unet_ names as kohya's
     * Qwen-Image names, which its 19-character cut garbles into one. */
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-qwen-image/transformer", WAN_CASES[3][0], NULL,
                         "lora-wan-musubi.safetensors: lora_unet_blocks_0_ffn_2.alpha: becomes transformer_blocks..alpha");
    free(want_file);
    free(pipe_file);
    free(got);
    free(want);
    free(pipe);
}

/* Wan 2.2's two experts: a LoRA given as transformer_2=FILE merges into
 * transformer_2 alone, as diffusers' load_into_transformer_2 loads it, beside
 * one for the transformer; so does a LoRA on transformer_2's folder alone.
 * Where diffusers cannot load into the component named: exit 2. */
static void test_wan_lora_into_transformer_2(void **state)
{
    struct tu_scratch *s = *state;
    const char *comfy = DIFFUSERS_FIXTURES "/lora-wan-comfy.safetensors",
               *musubi = DIFFUSERS_FIXTURES "/lora-wan-musubi.safetensors";
    char *pipe = tu_strdupf("%s/wan22", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *want = tu_strdupf("%s/want", s->dir), *index = tu_strdupf("%s/model_index.json", pipe);
    assert_int_equal(tu_sh_status("cp -R %s/tiny-wan %s && cp -R %s/transformer %s/transformer_2", DIFFUSERS_FIXTURES,
                                  pipe, pipe, pipe), 0);
    static const char WAN22[] = "{\"_class_name\": \"WanPipeline\", \"transformer\": [\"diffusers\", "
                                "\"WanTransformer3DModel\"], \"transformer_2\": [\"diffusers\", \"WanTransformer3DModel\"]}\n";
    tu_write_file(index, WAN22, strlen(WAN22));
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    char *into = tu_strdupf("transformer_2=%s", musubi);
    struct tu_run r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", comfy, "--lora", into, NULL);
    if (r.status != 0 || !strstr(r.err, "72 with LoRA merged")) /* 48 + 24 */
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    const char *transformer = DIFFUSERS_FIXTURES "/tiny-wan/transformer";
    const char *const files[2][2] = {{comfy, "transformer"}, {musubi, "transformer_2"}};
    for (size_t i = 0; i < 2; i++) {
        const char *lora[1] = {files[i][0]};
        assert_int_equal(merge_on_cpu(transformer, want, lora, 1, 0, 0, DT_INVALID), i ? 24 : 48);
        char *got_file = tu_strdupf("%s/%s/diffusion_pytorch_model.safetensors", out, files[i][1]),
             *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want);
        tu_assert_same_tensors(got_file, want_file);
        tu_rmtree(want);
        free(got_file);
        free(want_file);
    }
    tu_rmtree(out);
    /* transformer_2's folder alone takes the LoRA's transformer keys too. */
    char *second = tu_strdupf("%s/transformer_2", pipe);
    r = tu_run("convert", "--device", "cpu", second, out, "--lora", musubi, NULL);
    if (r.status != 0 || !strstr(r.err, "24 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    r = tu_run("inspect", pipe, "--lora", into, "--json", NULL);
    if (r.status != 0 || !strstr(r.out, "\"name\": \"transformer_2\"") || !strstr(r.out, "\"merge\""))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    /* No such component; one diffusers cannot load into; IN not a pipeline. */
    char *third = tu_strdupf("transformer_3=%s", musubi), *encoder = tu_strdupf("text_encoder=%s", musubi);
    static const char FLUX2[] = "{\"_class_name\": \"FluxPipeline\", \"transformer\": [\"diffusers\", \"X\"], "
                                "\"transformer_2\": [\"diffusers\", \"X\"]}\n";
    struct {
        const char *in, *lora, *want;
        int flux;
    } cases[] = {
        {pipe, third, "has no component transformer_3 (--lora transformer_3=", 0},
        {pipe, encoder, "has no component text_encoder", 0},
        {pipe, into, "is a FluxPipeline, and diffusers loads a LoRA into transformer only (Wan's loader also into "
                     "transformer_2, MiniMax-H3's into transformer_ref), not into transformer_2", 1},
        {transformer, into, "is not a diffusers pipeline, so --lora transformer_2=", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].flux)
            tu_write_file(index, FLUX2, strlen(FLUX2));
        for (int inspect = 0; inspect < 2; inspect++) {
            r = inspect ? tu_run("inspect", cases[i].in, "--lora", cases[i].lora, NULL)
                        : tu_run("convert", "--device", "cpu", cases[i].in, out, "--lora", cases[i].lora, NULL);
            if (r.status != NF4_EUSAGE || tu_lines(r.err) != 1 || !strstr(r.err, cases[i].want) || r.out[0])
                fail_msg("%s: exit %d, stderr: %s", cases[i].lora, r.status, r.err);
            tu_run_free(&r);
            assert_false(tu_exists(out));
        }
        if (cases[i].flux)
            tu_write_file(index, WAN22, strlen(WAN22));
    }
    /* Other pipelines of Wan's loader: ChronoEdit's loads into transformer_2 too;
     * Helios's converts Wan's forms but loads into the transformer only. */
    static const char CHRONO[] = "{\"_class_name\": \"ChronoEditPipeline\", \"transformer\": [\"diffusers\", \"X\"], "
                                 "\"transformer_2\": [\"diffusers\", \"X\"]}\n";
    static const char HELIOS[] = "{\"_class_name\": \"HeliosPipeline\", \"transformer\": [\"diffusers\", \"X\"], "
                                 "\"transformer_2\": [\"diffusers\", \"X\"]}\n";
    tu_write_file(index, CHRONO, strlen(CHRONO));
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", comfy, "--lora", into, NULL);
    if (r.status != 0 || !strstr(r.err, "72 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    tu_write_file(index, HELIOS, strlen(HELIOS));
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", comfy, NULL);
    if (r.status != 0 || !strstr(r.err, "48 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", into, NULL);
    if (r.status != NF4_EUSAGE || !strstr(r.err, "is a HeliosPipeline, and diffusers loads a LoRA into transformer only"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    /* NAME=VALUE that is no path at all, on a model: a missing LoRA (66), not a component. */
    r = tu_run("convert", "--device", "cpu", transformer, out, "--lora", "lr=1e-4", NULL);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1)
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(pipe);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(third);
    free(encoder);
    free(second);
    free(into);
    free(index);
    free(pipe);
    free(out);
    free(want);
}

/* Wan LoRAs diffusers' conversion raises on (or would load half of):
 * refused with one line naming the file and the key, nothing written. */
static void test_wan_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define WAN_Q "diffusion_model.blocks.0.self_attn.q"
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key, [1, 1] */
        enum st_dtype dtype;
        float extra; /* the third key's value */
        const char *want;
    } WAN_CASES[] = {
        {{WAN_Q ".lora_down.weight", NULL, WAN_Q ".alpha"}, DT_BF16, 4,
         WAN_Q ".alpha: has no matching lora_up.weight"},
        {{"diffusion_model.blocks.0.cross_attn.k.lora_down.weight", NULL, NULL}, DT_BF16, 0,
         "diffusion_model.blocks.0.cross_attn.k.lora_down.weight: has no matching lora_up.weight"},
        {{NULL, "diffusion_model.blocks.1.ffn.0.lora_B.weight", NULL}, DT_BF16, 0,
         "diffusion_model.blocks.1.ffn.0.lora_B.weight: has no matching lora_down.weight"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", WAN_Q ".alpha"}, DT_BF16, -2,
         WAN_Q ".alpha: is -2; an alpha is a number from 0 up"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", WAN_Q ".dora_scale"}, DT_BF16, 1,
         WAN_Q ".dora_scale: is not a key diffusers reads from a Wan LoRA in Wan's names (diffusion_model.)"},
        {{"diffusion_model.head.head.lora_down.weight", "diffusion_model.head.head.lora_up.weight", NULL}, DT_BF16, 0,
         "has no key of a block (blocks.N.), which diffusers' Wan conversion needs"},
        {{"diffusion_model.blocks.x.self_attn.q.lora_down.weight", NULL, NULL}, DT_BF16, 0,
         "diffusion_model.blocks.x.self_attn.q.lora_down.weight: has no block number after \"blocks.\""},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", "diffusion_model.text_embedding.0.alpha"}, DT_BF16, 1,
         "has keys of text_embedding.0 but not its lora_down.weight and lora_up.weight, which diffusers needs"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", WAN_Q ".lora_down.diff"}, DT_BF16, 1,
         WAN_Q ".lora_down.diff: is a diff of a LoRA key, which diffusers refuses"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", WAN_Q ".diff_b"}, DT_BF16, 1,
         WAN_Q ".diff_b: is not a bias (a vector of F32, BF16 or F16)"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", "diffusion_model.head.head.diff"}, DT_BF16, 1,
         "diffusion_model.head.head.diff: has no head.head.diff_b, which diffusers needs beside it"},
        /* diffusers cuts 16 characters off every key, whatever it starts with */
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", "0123456789abcdefblocks.0.self_attn.q.lora_up.weight"},
         DT_BF16, 1, "becomes blocks.0.self_attn.q.lora_up.weight, as"},
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", NULL}, DT_I8, 0,
         "is I8; LoRA weights must be F32, BF16 or F16"},
        {{"lora_unet_blocks_0_self_attn_q.lora_down.weight", "lora_unet_blocks_0_self_attn_q.lora_up.weight",
          "lora_unet_blocks_0_self_attn_q.alpha"}, DT_BF16, 1,
         "has no lora_unet_blocks_0_self_attn_k.lora_down.weight, which diffusers needs: a musubi-tuner Wan LoRA has "
         "every module of each of its 1 blocks"},
        {{"lora_unet_head_head.lora_down.weight", "lora_unet_head_head.lora_up.weight", NULL}, DT_BF16, 0,
         "lora_unet_head_head.lora_down.weight: is not a key of a block (lora_unet_blocks_N_...)"},
        /* diffusers would merge the bias alone, beside zero factors */
        {{WAN_Q ".lora_down.weight", WAN_Q ".lora_up.weight", "diffusion_model.blocks.0.self_attn.k.diff_b"}, DT_BF16, 1,
         "diffusion_model.blocks.0.self_attn.k.diff_b: is a bias change of blocks.0.self_attn.k, which has no factors "
         "here: nf4deq merges a diff_b only beside its module's lora_down and lora_up"},
        /* diffusers would walk 1.8e19 blocks */
        {{"diffusion_model.blocks.-9000000000000000000.ffn.0.diff", "diffusion_model.blocks.9000000000000000000.ffn.0.diff",
          NULL}, DT_BF16, 0, "has keys of blocks -9000000000000000000 to 9000000000000000000, more than a Wan model has"},
    };
#undef WAN_Q
    char *lora = tu_strdupf("%s-wan.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    static const uint64_t DOWN[2] = {4, 32}, UP[2] = {32, 4};
    for (size_t i = 0; i < sizeof WAN_CASES / sizeof WAN_CASES[0]; i++) {
        write_pair_lora(lora, WAN_CASES[i].names, DOWN, UP, WAN_CASES[i].dtype, WAN_CASES[i].extra);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-wan/transformer", lora, NULL, WAN_CASES[i].want);
    }
    /* A whole musubi-tuner block (it converts), then with a diff beside it:
     * musubi's converter, unlike the other, lets nothing be left. */
    static const char *const MODULES[] = {"self_attn_q", "self_attn_k", "self_attn_v", "self_attn_o", "cross_attn_q",
                                          "cross_attn_k", "cross_attn_v", "cross_attn_o", "ffn_0", "ffn_2"};
    struct syn_tensor block[31];
    char *names[31];
    size_t n = 0;
    for (size_t m = 0; m < 10; m++) {
        const uint64_t in = m == 9 ? 64 : 32, out = m == 8 ? 64 : 32;
        names[n] = tu_strdupf("lora_unet_blocks_0_%s.lora_down.weight", MODULES[m]);
        block[n] = (struct syn_tensor){names[n], DT_BF16, {4, in}, NULL}, n++;
        names[n] = tu_strdupf("lora_unet_blocks_0_%s.lora_up.weight", MODULES[m]);
        block[n] = (struct syn_tensor){names[n], DT_BF16, {out, 4}, NULL}, n++;
        names[n] = tu_strdupf("lora_unet_blocks_0_%s.alpha", MODULES[m]);
        block[n] = (struct syn_tensor){names[n], DT_F32, {1, 0}, NULL}, n++;
    }
    names[n] = tu_strdupf("lora_unet_blocks_0_modulation.diff");
    block[n] = (struct syn_tensor){names[n], DT_BF16, {32, 0}, NULL}, n++;
    for (size_t k = 0; k < n; k++)
        syn_fill(&block[k], 0.5f);
    for (size_t k = 2; k < n; k += 3)
        block[k].v[0] = 8.0f; /* the alphas */
    syn_write(lora, block, n - 1);
    char *out = tu_strdupf("%s/musubi", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-wan/transformer", out, "--lora",
                             lora, NULL);
    if (r.status != 0 || !strstr(r.err, "10 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    syn_write(lora, block, n);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-wan/transformer", lora, NULL,
                         "lora_unet_blocks_0_modulation.diff: is not a key diffusers reads from a Wan LoRA in "
                         "musubi-tuner's names (lora_unet_blocks_N_...)");
    for (size_t k = 0; k < n; k++) {
        free(block[k].v);
        free(names[k]);
    }
    /* A head diff of 5000 outputs: its identity up would be 5000 x 5000. */
    struct syn_tensor head[4] = {
        {"diffusion_model.blocks.0.self_attn.q.lora_down.weight", DT_BF16, {4, 32}, NULL},
        {"diffusion_model.blocks.0.self_attn.q.lora_up.weight", DT_BF16, {32, 4}, NULL},
        {"diffusion_model.head.head.diff", DT_BF16, {5000, 1}, NULL},
        {"diffusion_model.head.head.diff_b", DT_BF16, {5000, 0}, NULL},
    };
    for (size_t k = 0; k < 4; k++)
        syn_fill(&head[k], 0.5f);
    syn_write(lora, head, 4);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-wan/transformer", lora, NULL,
                         "diffusion_model.head.head.diff: has 5000 rows, and its diff_b 5000: more outputs than a Wan "
                         "head has (at most 4096 here)");
    for (size_t k = 0; k < 4; k++)
        free(head[k].v);
    free(out);
    unlink(lora);
    free(lora);
}

/* LTX-Video and HiDream LoRAs in ComfyUI's form (diffusion_model. for
 * transformer.), read as their loaders cut the prefix: byte-identical to
 * diffusers' conversion (a DoRA scale dropped with a warning), merged as the
 * diffusers form is; a key without the prefix refused, as diffusers refuses
 * the file. */
static void test_prefixed_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const LTX[][2] = {
        {DIFFUSERS_FIXTURES "/lora-ltx-comfy.safetensors", DIFFUSERS_FIXTURES "/lora-ltx-comfy.diffusers.safetensors"},
    };
    static const uint64_t MERGED[] = {18}; /* 17 weights and proj_out's bias */
    assert_converts_as_diffusers(s, LTX, 1, LORA_FAMILY_LTX_VIDEO, DIFFUSERS_FIXTURES "/tiny-ltx/transformer", MERGED);
    struct model *m;
    assert_int_equal(diffusers_lora_open(DIFFUSERS_FIXTURES "/lora-hidream-comfy.safetensors", LORA_FAMILY_HIDREAM, 0,
                                         &m), NF4_OK);
    tu_assert_same_st(m->files[0], DIFFUSERS_FIXTURES "/lora-hidream-comfy.safetensors",
                      DIFFUSERS_FIXTURES "/lora-hidream-comfy.diffusers.safetensors");
    model_close(m);
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-ltx", out, LTX[0][0],
                           "lora-ltx-comfy.safetensors: 1 of its tensors (diffusion_model.proj_in.dora_scale) are DoRA "
                       "scales, which diffusers drops: they are not merged\n",
                           "18 with LoRA merged");
    tu_rmtree(out);
    free(out);
    static const char *const NAMES[3] = {"diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight",
                                         "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight",
                                         "transformer_blocks.0.attn1.to_k.lora_A.weight"};
    static const uint64_t DOWN[2] = {4, 16}, UP[2] = {16, 4};
    char *lora = tu_strdupf("%s-ltx.safetensors", s->dir);
    write_pair_lora(lora, NAMES, DOWN, UP, DT_BF16, 1);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-ltx/transformer", lora, NULL,
                         "transformer_blocks.0.attn1.to_k.lora_A.weight: does not start with \"diffusion_model.\", as "
                         "every key of an LTX-Video LoRA in ComfyUI's form must (diffusers raises)");
    unlink(lora);
    free(lora);
}

/* Flux.2 LoRAs in BFL's names (ai-toolkit's, ComfyUI's, PEFT's prefix) and
 * in kohya's, read as diffusers 0.42 loads them into a Flux.2 pipeline: each
 * conversion holds, byte for byte, the tensors of the .diffusers file
 * make_flux2_fixtures.py wrote with diffusers' own (fused qkv split, alphas
 * folded in), and merges as that file does; in the pipeline, what is left
 * out is said once. Flux.2's classes choose Flux.2's loader, Flux.1's keep
 * theirs. */
static void test_flux2_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const FLUX2_CASES[][2] = {
        {DIFFUSERS_FIXTURES "/lora-flux2-bfl.safetensors", DIFFUSERS_FIXTURES "/lora-flux2-bfl.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-flux2-peft.safetensors", DIFFUSERS_FIXTURES "/lora-flux2-peft.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-flux2-kohya.safetensors",
         DIFFUSERS_FIXTURES "/lora-flux2-kohya.diffusers.safetensors"},
        /* The config in the metadata (scaling 2). */
        {DIFFUSERS_FIXTURES "/lora-flux2-meta.safetensors", DIFFUSERS_FIXTURES "/lora-flux2-meta.diffusers.safetensors"},
    };
    static const uint64_t MERGED[] = {39, 12, 33, 4};
    static const struct {
        const char *cls;
        enum lora_family family;
    } FAMILIES[] = {{"Flux2Pipeline", LORA_FAMILY_FLUX2}, {"Flux2KleinPipeline", LORA_FAMILY_FLUX2},
                    {"Flux2Transformer2DModel", LORA_FAMILY_FLUX2}, {"FluxPipeline", LORA_FAMILY_FLUX},
                    {"FluxTransformer2DModel", LORA_FAMILY_FLUX}, {"Flux3Pipeline", LORA_FAMILY_FLUX3},
                    {"Flux4Pipeline", LORA_FAMILY_OTHER}};
    for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++)
        assert_int_equal(diffusers_lora_family(FAMILIES[i].cls), FAMILIES[i].family);
    assert_converts_as_diffusers(s, FLUX2_CASES, sizeof FLUX2_CASES / sizeof FLUX2_CASES[0], LORA_FAMILY_FLUX2,
                                 DIFFUSERS_FIXTURES "/tiny-flux2/transformer", MERGED);
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-flux2", out, FLUX2_CASES[2][0],
                           "lora-flux2-kohya.safetensors: 7 of its tensors (lora_unet_single_blocks_0_linear2.dora_scale, "
                       "lora_te1_text_model_encoder_layers_0_mlp_fc1, lora_unet_double_blocks_0_img_mod_lin, ...) are "
                       "DoRA scales or keys diffusers does not convert from a kohya Flux.2 LoRA: they are not merged\n",
                           "33 with LoRA merged");
    tu_rmtree(out);
    free(out);
}

/* A Flux.2 qkv's lora_B is cut into to_q's, to_k's and to_v's rows as
 * torch.chunk cuts it, and its lora_A copied to each: bytes as they are,
 * NaN payloads, a signalling NaN and -0 included. */
static void test_flux2_lora_copies_bytes(void **state)
{
    struct tu_scratch *s = *state;
    static const char HEADER[] =
        "{\"diffusion_model.double_blocks.0.txt_attn.qkv.lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[1,2],"
        "\"data_offsets\":[0,4]},"
        "\"diffusion_model.double_blocks.0.txt_attn.qkv.lora_B.weight\":{\"dtype\":\"BF16\",\"shape\":[3,1],"
        "\"data_offsets\":[4,10]}}";
    static const unsigned char DATA[10] = {0xa1, 0x7f, 0x00, 0x80,              /* lora_A: a NaN, -0 */
                                           0x81, 0x7f, 0x01, 0xff, 0x00, 0x80}; /* lora_B: sNaN, a NaN, -0 */
    char *lora = tu_strdupf("%s-qkv.safetensors", s->dir);
    tu_write_safetensors_raw(lora, HEADER, strlen(HEADER), DATA, sizeof DATA);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    struct model *m;
    assert_int_equal(diffusers_lora_open(lora, LORA_FAMILY_FLUX2, 0, &m), NF4_OK);
    static const struct {
        const char *name;
        size_t at, len;
    } WANT[] = {{"transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight", 0, 4},
                {"transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight", 0, 4},
                {"transformer.transformer_blocks.0.attn.add_v_proj.lora_A.weight", 0, 4},
                {"transformer.transformer_blocks.0.attn.add_q_proj.lora_B.weight", 4, 2},
                {"transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight", 6, 2},
                {"transformer.transformer_blocks.0.attn.add_v_proj.lora_B.weight", 8, 2}};
    assert_int_equal(m->count, 6);
    for (size_t i = 0; i < sizeof WANT / sizeof WANT[0]; i++) {
        const struct model_tensor *t = model_find(m, WANT[i].name);
        assert_non_null(t);
        assert_int_equal(t->t->ndim, 2);
        assert_int_equal(t->t->shape[0], 1);
        assert_int_equal(t->t->shape[1], WANT[i].len / 2);
        unsigned char got[4];
        assert_int_equal(st_read(t->file, t->t, 0, got, WANT[i].len), NF4_OK);
        assert_memory_equal(got, DATA + WANT[i].at, WANT[i].len);
    }
    model_close(m);
    assert_int_equal(tu_count_entries(s->dir), 0);
    unlink(lora);
    free(lora);
}

/* Flux.2 LoRAs diffusers' conversion raises on, or loads nothing of:
 * refused with one line naming the file and the key, nothing written. */
static void test_flux2_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define F2_PROJ "diffusion_model.double_blocks.0.img_attn.proj"
#define F2_QKV "diffusion_model.double_blocks.0.img_attn.qkv"
#define F2_KOHYA "lora_unet_double_blocks_0_img_attn_proj"
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key, [1, 1] */
        uint64_t down[2], up[2];
        float extra; /* the third key's value */
        const char *want;
    } FLUX2_REFUSALS[] = {
        {{F2_PROJ ".lora_A.weight", F2_PROJ ".lora_B.weight", F2_PROJ ".alpha"}, {4, 32}, {32, 4}, 4,
         F2_PROJ ".alpha: is not a key diffusers reads from a Flux.2 LoRA in BFL's names"},
        {{"diffusion_model.double_blocks.x.img_attn.proj.lora_A.weight", NULL, NULL}, {4, 32}, {32, 4}, 0,
         "diffusion_model.double_blocks.x.img_attn.proj.lora_A.weight: has no block number where diffusers reads one "
         "(double_blocks.)"},
        {{"diffusion_model.double_blocks.01.img_attn.proj.lora_A.weight", NULL, NULL}, {4, 32}, {32, 4}, 0,
         "double_blocks.01.img_attn.proj.lora_A.weight: is not a key diffusers reads"},
        {{"diffusion_model.single_blocks.0.linear1.lora_A.weight", NULL, "diffusion_model.single_blocks.0.norm.scale"},
         {4, 32}, {32, 4}, 1, "diffusion_model.single_blocks.0.norm.scale: is not a key diffusers reads"},
        {{F2_QKV ".lora_A.weight", F2_QKV ".lora_B.weight", NULL}, {4, 32}, {32, 4}, 0,
         F2_QKV ".lora_B.weight: is not a fused qkv's lora_B [3 * out, r]"},
        /* a LoKr key makes the file a LoKr, whose conversion has no rule for a LoRA factor */
        {{F2_PROJ ".lora_A.weight", F2_PROJ ".lora_B.weight", "diffusion_model.double_blocks.0.img_attn.proj.lokr_w1"},
         {4, 32}, {32, 4}, 1, "proj.lora_A.weight: is left over where diffusers converts a Flux.2 LoKr in BFL's names"},
        /* diffusers cuts 16 characters off every key, whatever it starts with */
        {{F2_PROJ ".lora_A.weight", F2_PROJ ".lora_B.weight", "0123456789abcdefdouble_blocks.0.img_attn.proj.lora_B.weight"},
         {4, 32}, {32, 4}, 1, "becomes double_blocks.0.img_attn.proj.lora_B.weight, as"},
        /* a qkv's part and the same module already in diffusers' names */
        {{F2_QKV ".lora_A.weight", F2_QKV ".lora_B.weight", "diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight"},
         {1, 32}, {96, 1}, 1, "becomes transformer.transformer_blocks.0.attn.to_q.lora_A.weight, as"},
        {{F2_PROJ ".lora_A.weight", F2_PROJ ".lora_B.weight", "diffusion_model.transformer_blocks.0.attn.to_q.alpha"},
         {4, 32}, {32, 4}, 1, "transformer_blocks.0.attn.to_q.alpha: is no LoRA factor (no \"lora\" in its name)"},
        {{F2_KOHYA ".lora_down.weight", NULL, NULL}, {4, 32}, {32, 4}, 0,
         F2_KOHYA ".lora_down.weight: has no matching lora_up.weight"},
        {{F2_KOHYA ".lora_down.weight", F2_KOHYA ".lora_up.weight", "lora_unet_double_blocks_x.alpha"}, {4, 32}, {32, 4}, 1,
         "lora_unet_double_blocks_x.alpha: has no block number where diffusers reads one (lora_unet_double_blocks_)"},
        {{F2_KOHYA ".lora_down.weight", F2_KOHYA ".lora_up.weight", F2_KOHYA ".alpha"}, {4, 32}, {32, 4}, -2,
         F2_KOHYA ".alpha: is -2; an alpha is a number from 0 up"},
        {{"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
          NULL}, {4, 32}, {32, 4}, 0, "has 32 rows; diffusers splits it into three equal parts"},
        {{"lora_unet_double_blocks_0_img_mod_lin.lora_down.weight", "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight",
          NULL}, {4, 32}, {192, 4}, 0, "has none of the modules diffusers converts from a kohya Flux.2 LoRA "
                                        "(lora_unet_double_blocks_N_..., lora_unet_single_blocks_N_...): diffusers "
                                        "would load nothing of it"},
        /* ComfyUI's names with kohya's factors: diffusers' Flux.2 loader reads them as kohya's */
        {{F2_PROJ ".lora_down.weight", F2_PROJ ".lora_up.weight", NULL}, {4, 32}, {32, 4}, 0,
         "; its diffusion_model. keys with lora_down and lora_up are read as kohya's, and none of them converts"},
        {{"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight",
          NULL}, {4, 32}, {32, 3}, 0, "it is not a LoRA pair [r, in], [out, r]"},
        /* Python's int() reads Unicode digits; nf4deq refuses them, and says so */
        {{"lora_unet_double_blocks_\xd9\xa3_img_attn_proj.lora_down.weight", F2_KOHYA ".lora_up.weight", NULL},
         {4, 32}, {32, 4}, 0, "has a block number that is not ASCII digits after lora_unet_double_blocks_, which "
                              "nf4deq does not read"},
        /* diffusers' check passes "lokr" as well as "lora": a LoKr key, not one diffusers refuses */
        {{F2_PROJ ".lora_A.weight", F2_PROJ ".lora_B.weight", "diffusion_model.transformer_blocks.0.attn.to_q.xlokr"},
         {4, 32}, {32, 4}, 1, "transformer_blocks.0.attn.to_q.xlokr: is neither a LoRA factor nor a LoKr one"},
    };
#undef F2_PROJ
#undef F2_QKV
#undef F2_KOHYA
    char *lora = tu_strdupf("%s-flux2.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof FLUX2_REFUSALS / sizeof FLUX2_REFUSALS[0]; i++) {
        write_pair_lora(lora, FLUX2_REFUSALS[i].names, FLUX2_REFUSALS[i].down, FLUX2_REFUSALS[i].up, DT_BF16,
                        FLUX2_REFUSALS[i].extra);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux2/transformer", lora, NULL, FLUX2_REFUSALS[i].want);
    }
    /* A qkv's lora_A of no dimension: diffusers' torch.cat raises. */
    static const char SCALAR_A[] =
        "{\"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[],"
        "\"data_offsets\":[0,2]},\"diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight\":{\"dtype\":\"BF16\","
        "\"shape\":[3,1],\"data_offsets\":[2,8]}}";
    static const unsigned char EIGHT[8] = {0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f};
    tu_write_safetensors_raw(lora, SCALAR_A, strlen(SCALAR_A), EIGHT, sizeof EIGHT);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux2/transformer", lora, NULL,
                         "img_attn.qkv.lora_A.weight: is a single number, not a fused qkv's lora_A");
    /* A qkv's lora_B of 4-bit values: its rows are copied as whole bytes, so it is refused first. */
    static const char F4_B[] =
        "{\"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],"
        "\"data_offsets\":[0,2]},\"diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight\":{\"dtype\":\"F4\","
        "\"shape\":[3,2],\"data_offsets\":[2,5]}}";
    tu_write_safetensors_raw(lora, F4_B, strlen(F4_B), EIGHT, 5);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux2/transformer", lora, NULL,
                         "img_attn.qkv.lora_B.weight: is F4; LoRA weights must be F32, BF16 or F16");
    /* Flux.1's loader (and an unknown class's) has no all-keys "lora" check:
     * a key without it is judged as a PEFT key, not refused as diffusers'
     * (but for alphas, which it reads as network alphas: test_flux_network_alphas). */
    static const char *const FLUX1[3] = {"transformer.proj_out.lora_A.weight", "transformer.proj_out.lora_B.weight",
                                         "transformer.proj_out.scale"};
    static const uint64_t FLUX1_DOWN[2] = {4, 64}, FLUX1_UP[2] = {16, 4};
    write_pair_lora(lora, FLUX1, FLUX1_DOWN, FLUX1_UP, DT_BF16, 8);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", lora, NULL,
                         "transformer.proj_out.scale: is neither a LoRA weight nor in modules_to_save");
    /* A kohya block number in Unicode's blanks: Python's int() reads it, and
     * diffusers then leaves the key out (it is not the block's own name). */
    static const char *const SPACED[3] = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight",
                                          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight",
                                          "lora_unet_double_blocks_\xc2\xa0" "2_img_attn_proj.alpha"};
    static const uint64_t DOWN[2] = {4, 32}, UP[2] = {32, 4};
    write_pair_lora(lora, SPACED, DOWN, UP, DT_BF16, 2);
    char *out = tu_strdupf("%s/out", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux2/transformer", out, "--lora",
                             lora, NULL);
    if (r.status != 0 || !strstr(r.err, "1 of its tensors (lora_unet_double_blocks_\xc2\xa0" "2_img_attn_proj) are") ||
        !strstr(r.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    free(out);
    unlink(lora);
    free(lora);
}

/* Z-Image LoRAs in kohya's names (their lora_down made lora.down by
 * diffusers' renaming, a fused qkv split, a bare out made to_out.0, both
 * dropped beside separate ones), ComfyUI's and ai-toolkit's (lora_A or
 * lora_down), Anime-Z's dots and PEFT's default., read as diffusers 0.42
 * loads them into a Z-Image pipeline: each conversion holds, byte for byte,
 * the tensors of the .diffusers file make_zimage_fixtures.py wrote with
 * diffusers' own, and merges as that file does; in the pipeline, what is
 * dropped is said once. */
static void test_zimage_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
#define ZCASE(stem) {DIFFUSERS_FIXTURES "/" stem ".safetensors", DIFFUSERS_FIXTURES "/" stem ".diffusers.safetensors"}
    static const char *const ZIMAGE_CASES[][2] = {
        ZCASE("lora-zimage-kohya"), ZCASE("lora-zimage-fused"),   ZCASE("lora-zimage-comfy"),
        ZCASE("lora-zimage-down"),  ZCASE("lora-zimage-dots"),    ZCASE("lora-zimage-default"),
        ZCASE("lora-zimage-meta"), /* the config in the metadata: scaling 2 */
    };
    static const char *const EMBEDDER[2] = ZCASE("lora-zimage-embedder"), *const ORDER[2] = ZCASE("lora-zimage-order");
#undef ZCASE
    static const uint64_t MERGED[] = {35, 10, 11, 15, 8, 4, 4};
    assert_int_equal(diffusers_lora_family("ZImagePipeline"), LORA_FAMILY_Z_IMAGE);
    assert_int_equal(diffusers_lora_family("ZImageTransformer2DModel"), LORA_FAMILY_Z_IMAGE);
    assert_converts_as_diffusers(s, ZIMAGE_CASES, sizeof ZIMAGE_CASES / sizeof ZIMAGE_CASES[0], LORA_FAMILY_Z_IMAGE,
                                 DIFFUSERS_FIXTURES "/tiny-zimage/transformer", MERGED);
    /* t_embedder's names, whose module the tiny base leaves out, and an alpha two pairs name, which goes to the
     * pair whose data comes first in the file (not the first by name): the conversion alone. */
    const char *const *alone[] = {EMBEDDER, ORDER};
    for (size_t i = 0; i < 2; i++) {
        struct model *m;
        assert_int_equal(diffusers_lora_open(alone[i][0], LORA_FAMILY_Z_IMAGE, 0, &m), NF4_OK);
        tu_assert_same_st(m->files[0], alone[i][0], alone[i][1]);
        model_close(m);
    }
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-zimage", out, ZIMAGE_CASES[1][0],
                           "lora-zimage-fused.safetensors: 5 of its tensors (lora_unet_layers_1_attention_out.lora_down."
                       "weight, lora_unet_layers_1_attention_qkv.lora_down.weight, lora_unet_layers_1_attention_qkv."
                       "alpha) are DoRA scales, or fused layers beside their parts or without their lora.up, which "
                       "diffusers drops from a Z-Image LoRA: they are not merged\n",
                           "10 with LoRA merged");
    tu_rmtree(out);
    free(out);
}

/* Z-Image LoRAs diffusers' conversion raises on, or loads nothing of:
 * refused with one line naming the file and the key, nothing written. */
static void test_zimage_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define Z_Q "diffusion_model.layers.0.attention.to_q"
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key, [1, 1] */
        uint64_t down[2], up[2];
        float extra; /* the third key's value */
        const char *want;
    } ZIMAGE_REFUSALS[] = {
        {{"lora_unet_layers_0_attention_to_q.lora_down.weight", NULL, NULL}, {4, 32}, {32, 4}, 0,
         "lora_unet_layers_0_attention_to_q.lora_down.weight: has no matching lora.up.weight"},
        {{Z_Q ".lora_A.weight", NULL, NULL}, {4, 32}, {32, 4}, 0, Z_Q ".lora_A.weight: has no matching lora_B.weight"},
        {{NULL, Z_Q ".lora_B.weight", NULL}, {4, 32}, {32, 4}, 0,
         Z_Q ".lora_B.weight: is left over where diffusers converts a Z-Image LoRA"},
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", "diffusion_model.layers.0.attention.to_k.alpha"}, {4, 32}, {32, 4},
         2, "to_k.alpha: is left over where diffusers converts a Z-Image LoRA (as layers.0.attention.to_k.alpha)"},
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", Z_Q ".alpha"}, {4, 32}, {32, 4}, -2,
         Z_Q ".alpha: is -2; an alpha is a number from 0 up"},
        /* a LoKr key makes the file a LoKr, which holds nothing else */
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", Z_Q ".lokr_w1"}, {4, 32}, {32, 4}, 1,
         Z_Q ".lora_A.weight: is not a LoKr key (no \".lokr_\"), which diffusers refuses in a LoKr file"},
        /* diffusers removes the prefix where there is one: two keys become one */
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", "layers.0.attention.to_q.lora_A.weight"}, {4, 32}, {32, 4}, 1,
         "becomes layers.0.attention.to_q.lora_A.weight, as"},
        {{"lora_unet_layers_0_attention_qkv.lora_down.weight", "lora_unet_layers_0_attention_qkv.lora_up.weight", NULL},
         {4, 32}, {32, 4}, 0, "has 32 rows, which diffusers cuts into parts for to_q, to_k and to_v that cannot load"},
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", "diffusion_model.layers.0.x.lora.down.weight.y"}, {4, 32},
         {32, 4}, 1, "holds .lora.down.weight but does not end with it"},
        /* a qkv down without its up, which diffusers drops: nothing is left to load */
        {{"diffusion_model.layers.0.attention.qkv.lora.down.weight", NULL, NULL}, {4, 32}, {96, 4}, 0,
         "holds no LoRA factor pair (lora_down/lora_up, lora_A/lora_B or lora.down/lora.up): diffusers would load "
         "nothing of it"},
        {{Z_Q ".lora_A.weight", Z_Q ".lora_B.weight", NULL}, {4, 32}, {32, 3}, 0, "it is not a LoRA pair [r, in], [out, r]"},
        /* in diffusers' own form, which no conversion touches: every loader refuses a key without "lora" */
        {{"transformer.layers.0.attention.to_q.lora_A.weight", "transformer.layers.0.attention.to_q.lora_B.weight", "foo"},
         {4, 32}, {32, 4}, 1, "foo: has no \"lora\" in its name, and diffusers refuses a LoRA file with such a key"},
        {{Z_Q "_" "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          ".lora_A.weight", NULL, NULL}, {4, 32}, {32, 4}, 0, "is too long a name for a LoRA key (over 512 bytes)"},
    };
#undef Z_Q
    char *lora = tu_strdupf("%s-zimage.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof ZIMAGE_REFUSALS / sizeof ZIMAGE_REFUSALS[0]; i++) {
        write_pair_lora(lora, ZIMAGE_REFUSALS[i].names, ZIMAGE_REFUSALS[i].down, ZIMAGE_REFUSALS[i].up, DT_BF16,
                        ZIMAGE_REFUSALS[i].extra);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-zimage/transformer", lora, NULL, ZIMAGE_REFUSALS[i].want);
    }
    unlink(lora);
    free(lora);
}

/* LTX-2 LoRAs in ComfyUI's form (LTX-2's original names under
 * diffusion_model.) and with the text connectors' keys
 * (text_embedding_projection.), read as diffusers 0.42's LTX-2 loader reads
 * them: byte for byte the tensors of the .diffusers files
 * make_ltx2_fixtures.py wrote with diffusers' own conversion; on the
 * pipeline, the transformer and the connectors both merged as from that
 * form; the connectors' folder alone takes the connectors' keys. Keys
 * without "lora", and two keys that become one, refused. */
static void test_ltx2_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const LTX2[][2] = {
        {DIFFUSERS_FIXTURES "/lora-ltx2-comfy.safetensors", DIFFUSERS_FIXTURES "/lora-ltx2-comfy.diffusers.safetensors"},
        {DIFFUSERS_FIXTURES "/lora-ltx2-connectors.safetensors",
         DIFFUSERS_FIXTURES "/lora-ltx2-connectors.diffusers.safetensors"},
    };
    const char *pipeline = DIFFUSERS_FIXTURES "/tiny-ltx2";
    assert_int_equal(diffusers_lora_family("LTX2Pipeline"), LORA_FAMILY_LTX2);
    assert_int_equal(diffusers_lora_family("LTX2VideoTransformer3DModel"), LORA_FAMILY_LTX2);
    assert_int_equal(diffusers_lora_family("LTXPipeline"), LORA_FAMILY_LTX_VIDEO);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < 2; i++) {
        struct model *m;
        assert_int_equal(diffusers_lora_open(LTX2[i][0], LORA_FAMILY_LTX2, 0, &m), NF4_OK);
        tu_assert_same_st(m->files[0], LTX2[i][0], LTX2[i][1]);
        model_close(m);
    }
    char *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir);
    assert_lora_warns_once(pipeline, got, LTX2[0][0],
                           "lora-ltx2-comfy.safetensors: 2 of its tensors (diffusion_model.proj_out.dora_scale, "
                       "vae.decoder.conv.lora_A.weight) are DoRA scales or keys without \"diffusion_model.\", which "
                       "diffusers drops from an LTX-2 LoRA: they are not merged\n",
                           "25 with LoRA merged");
    struct tu_run r = tu_run("convert", "--device", "cpu", pipeline, want, "--lora", LTX2[0][1], NULL);
    if (r.status != 0 || !strstr(r.err, "25 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    static const char *const COMPONENTS[] = {"transformer", "connectors"};
    for (size_t c = 0; c < 2; c++) {
        char *g = tu_strdupf("%s/%s/diffusion_pytorch_model.safetensors", got, COMPONENTS[c]),
             *w = tu_strdupf("%s/%s/diffusion_pytorch_model.safetensors", want, COMPONENTS[c]);
        tu_assert_same_tensors(g, w);
        free(g);
        free(w);
    }
    tu_rmtree(got);
    tu_rmtree(want);
    /* The connectors' folder alone: its keys only, the others said once. */
    r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-ltx2/connectors", got, "--lora", LTX2[0][0], NULL);
    if (r.status != 0 || !strstr(r.err, "3 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(got);
    /* diffusers' own transformer keys as they are, the connectors' converted
     * beside them; their originals go to no component. */
    r = tu_run("convert", "--device", "cpu", pipeline, got, "--lora", LTX2[1][0], NULL);
    if (r.status != 0 || !strstr(r.err, "4 of its tensors are for text_embedding_projection") ||
        !strstr(r.err, "6 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(got);
    static const struct {
        const char *names[3];
        const char *want;
    } REFUSALS[] = {
        {{"diffusion_model.proj_out.lora_A.weight", "diffusion_model.proj_out.lora_B.weight",
          "diffusion_model.proj_out.alpha"},
         "diffusion_model.proj_out.alpha: becomes transformer.proj_out.alpha, with no \"lora\" in its name, which "
         "diffusers refuses"},
        {{"diffusion_model.proj_in.lora_A.weight", "diffusion_model.proj_in.lora_B.weight",
          "diffusion_model.patchify_proj.lora_A.weight"},
         "becomes transformer.proj_in.lora_A.weight, as"},
        /* diffusers' own form: LTX-2's loader, unlike Flux.2's and Z-Image's, passes no "lokr" key */
        {{"transformer.proj_in.lora_A.weight", "transformer.proj_in.lora_B.weight", "text_encoder.x.lokr_w1"},
         "text_encoder.x.lokr_w1: has no \"lora\" in its name, and diffusers refuses a LoRA file with such a key"},
    };
    static const uint64_t DOWN[2] = {4, 8}, UP[2] = {16, 4};
    char *lora = tu_strdupf("%s-ltx2.safetensors", s->dir);
    for (size_t i = 0; i < sizeof REFUSALS / sizeof REFUSALS[0]; i++) {
        write_pair_lora(lora, REFUSALS[i].names, DOWN, UP, DT_BF16, 1);
        assert_merge_refused(s, pipeline, lora, NULL, REFUSALS[i].want);
    }
    unlink(lora);
    free(lora);
    free(got);
    free(want);
}

/* An XLabs Flux.1 LoRA (double_blocks.0.processor.qkv_lora1.down.weight...)
 * read as diffusers 0.42's Flux.1 loader reads it: byte for byte the tensors
 * of the .diffusers file make_xlabs_fixtures.py wrote with diffusers' own
 * conversion (fused qkvs split, projections renamed), merged as that form
 * merges, alone and in the pipeline, where the DoRA scale diffusers drops is
 * said once. */
static void test_xlabs_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const XLABS[][2] = {
        {DIFFUSERS_FIXTURES "/lora-flux-xlabs.safetensors", DIFFUSERS_FIXTURES "/lora-flux-xlabs.diffusers.safetensors"},
    };
    static const uint64_t MERGED[] = {12};
    assert_converts_as_diffusers(s, XLABS, 1, LORA_FAMILY_FLUX, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", MERGED);
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-flux-bnb4", out, XLABS[0][0],
                           "lora-flux-xlabs.safetensors: 1 of its tensors (double_blocks.0.processor.proj_lora1."
                       "dora_scale) are DoRA scales, or a block's keys of no factor (neither down nor up in the "
                       "name), which diffusers does not load: they are not merged\n",
                           "12 with LoRA merged");
    tu_rmtree(out);
    free(out);
}

/* XLabs LoRAs diffusers' conversion raises on, or keeps one of two keys of:
 * refused with one line naming the file and the key, nothing written. */
static void test_xlabs_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define XL_QKV "double_blocks.0.processor.qkv_lora1"
#define XL_PROJ "double_blocks.0.processor.proj_lora1"
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key, [1, 1] */
        uint64_t down[2], up[2];
        const char *want;
    } XLABS_REFUSALS[] = {
        {{XL_QKV ".down.weight", NULL, NULL}, {4, 64}, {192, 4}, XL_QKV ".down.weight: has no matching up"},
        {{XL_QKV ".down.weight", XL_QKV ".up.weight", NULL}, {4, 64}, {64, 4},
         XL_QKV ".up.weight: has 64 rows, which diffusers cannot cut into three equal parts"},
        {{"double_blocks.x.processor.proj_lora1.down.weight", NULL, NULL}, {4, 64}, {64, 4},
         "double_blocks.x.processor.proj_lora1.down.weight: has no block number after double_blocks."},
        {{XL_PROJ ".down.weight", XL_PROJ ".up.weight", "double_blocks.0.processor.qkv_lora3.down.weight"}, {4, 64},
         {64, 4}, "qkv_lora3.down.weight: is left over where diffusers converts an XLabs LoRA"},
        {{XL_PROJ ".down.weight", XL_PROJ ".up.weight", "diffusion_model." XL_PROJ ".down.weight"}, {4, 64}, {64, 4},
         "becomes transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight, as"},
        {{"double_blocks.\xd9\xa3.processor.proj_lora1.down.weight", NULL, NULL}, {4, 64}, {64, 4},
         "has a block number that may not be ASCII digits after double_blocks."},
        /* "qkv_lora1" and no "up": a down, whatever its suffix; its up is itself */
        {{XL_PROJ ".down.weight", XL_PROJ ".up.weight", XL_QKV ".alpha"}, {4, 64}, {64, 4},
         XL_QKV ".alpha: has no matching up"},
    };
#undef XL_QKV
#undef XL_PROJ
    char *lora = tu_strdupf("%s-xlabs.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof XLABS_REFUSALS / sizeof XLABS_REFUSALS[0]; i++) {
        write_pair_lora(lora, XLABS_REFUSALS[i].names, XLABS_REFUSALS[i].down, XLABS_REFUSALS[i].up, DT_BF16, 1);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", lora, NULL, XLABS_REFUSALS[i].want);
    }
    /* An alpha: diffusers keeps it under the module's bare name, which its load skips. */
    static const char *const ALPHA[3] = {"double_blocks.0.processor.proj_lora1.down.weight",
                                         "double_blocks.0.processor.proj_lora1.up.weight",
                                         "double_blocks.0.processor.proj_lora1.alpha"};
    static const uint64_t DOWN[2] = {4, 64}, UP[2] = {64, 4};
    write_pair_lora(lora, ALPHA, DOWN, UP, DT_BF16, 4);
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", out, lora,
                           "1 of its tensors (double_blocks.0.processor.proj_lora1.alpha) are DoRA scales, or a "
                           "block's keys of no factor", "1 with LoRA merged");
    tu_rmtree(out);
    /* A DoRA scale named like a kohya down: diffusers drops it before it looks for kohya's form. */
    static const char *const DORA[3] = {"double_blocks.0.processor.proj_lora1.down.weight",
                                        "double_blocks.0.processor.proj_lora1.up.weight",
                                        "lora_unet_x.lora_down.weight.dora_scale"};
    write_pair_lora(lora, DORA, DOWN, UP, DT_BF16, 1);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", out, lora,
                           "1 of its tensors (lora_unet_x.lora_down.weight.dora_scale) are DoRA scales",
                           "1 with LoRA merged");
    tu_rmtree(out);
    free(out);
    /* A qkv up of no dimension, of three, of no rows, or not F32, BF16 or F16 (its rows are copied as bytes). */
    static const struct {
        const char *up; /* the up's dtype, shape and data_offsets */
        size_t bytes;
        const char *want;
    } UPS[] = {
        {"\"BF16\",\"shape\":[],\"data_offsets\":[2,4]", 4, "has 0 dimensions, but diffusers cuts it by rows"},
        {"\"BF16\",\"shape\":[3,1,1],\"data_offsets\":[2,8]", 8, "has 3 dimensions, but diffusers cuts it by rows"},
        {"\"BF16\",\"shape\":[0,1],\"data_offsets\":[2,2]", 2, "has 0 rows, which diffusers cannot cut into three"},
        {"\"F64\",\"shape\":[3,1],\"data_offsets\":[2,26]", 26, "is F64; LoRA weights must be F32, BF16 or F16"},
    };
    static const unsigned char ZEROS[26] = {0};
    for (size_t i = 0; i < sizeof UPS / sizeof UPS[0]; i++) {
        char header[512];
        snprintf(header, sizeof header,
                 "{\"double_blocks.0.processor.qkv_lora1.down.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],"
                 "\"data_offsets\":[0,2]},\"double_blocks.0.processor.qkv_lora1.up.weight\":{\"dtype\":%s}}",
                 UPS[i].up);
        tu_write_safetensors_raw(lora, header, strlen(header), ZEROS, UPS[i].bytes);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", lora, NULL, UPS[i].want);
    }
    unlink(lora);
    free(lora);
}

/* HunyuanVideo LoRAs in diffusion-pipe's and ComfyUI's form (HunyuanVideo's
 * own module names under diffusion_model., or transformer.), read as
 * diffusers 0.42's HunyuanVideo loader reads them: byte for byte the tensors
 * of the .diffusers files make_hunyuan_fixtures.py wrote with diffusers' own
 * conversion (fused qkvs cut, the token refiner renamed, the final
 * modulation's halves swapped), and merged as that form merges, alone and in
 * the pipeline. A single block's linear1, which diffusers cuts at
 * HunyuanVideo's own hidden size, is converted as diffusers converts it, and
 * refused on a base whose blocks are narrower. */
static void test_hunyuan_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static const char *const HUNYUAN[][2] = {
        {DIFFUSERS_FIXTURES "/lora-hunyuan-comfy.safetensors",
         DIFFUSERS_FIXTURES "/lora-hunyuan-comfy.diffusers.safetensors"},
    };
    static const char *const SINGLE[2] = {DIFFUSERS_FIXTURES "/lora-hunyuan-single.safetensors",
                                          DIFFUSERS_FIXTURES "/lora-hunyuan-single.diffusers.safetensors"};
    static const uint64_t MERGED[] = {29};
    static const struct {
        const char *cls;
        enum lora_family family;
    } FAMILIES[] = {{"HunyuanVideoPipeline", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanVideoImageToVideoPipeline", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanVideoFramepackPipeline", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanSkyreelsImageToVideoPipeline", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanVideoTransformer3DModel", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanVideoFramepackTransformer3DModel", LORA_FAMILY_HUNYUAN_VIDEO},
                    {"HunyuanVideo15Pipeline", LORA_FAMILY_OTHER},
                    {"HunyuanDiTPipeline", LORA_FAMILY_OTHER},
                    {"HunyuanImagePipeline", LORA_FAMILY_OTHER}};
    for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++)
        assert_int_equal(diffusers_lora_family(FAMILIES[i].cls), FAMILIES[i].family);
    assert_converts_as_diffusers(s, HUNYUAN, 1, LORA_FAMILY_HUNYUAN_VIDEO, DIFFUSERS_FIXTURES "/tiny-hunyuan/transformer",
                                 MERGED);
    struct model *m;
    assert_int_equal(diffusers_lora_open(SINGLE[0], LORA_FAMILY_HUNYUAN_VIDEO, 0, &m), NF4_OK);
    tu_assert_same_st(m->files[0], SINGLE[0], SINGLE[1]);
    model_close(m);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-hunyuan", SINGLE[0], NULL,
                         "lora-hunyuan-single.safetensors: transformer.single_blocks.0.linear1.lora_B.weight "
                         "(converted to transformer.single_transformer_blocks.0.attn.to_k.lora_B.weight): B @ A is "
                         "3072x16 but the base tensor");
    char *out = tu_strdupf("%s/out", s->dir);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-hunyuan", out, HUNYUAN[0][0],
                           "lora-hunyuan-comfy.safetensors: 1 of its tensors (diffusion_model.double_blocks.0."
                       "img_attn_proj.dora_scale) are DoRA scales, which diffusers drops: they are not merged\n",
                           "29 with LoRA merged");
    tu_rmtree(out);
    free(out);
}

/* What diffusers cuts out of a HunyuanVideo LoRA is copied byte for byte,
 * NaN payloads, a signalling NaN and -0 included: a fused qkv's lora_B bias
 * (a vector) in three, a single block's linear1 lora_B bias at 3 x 3072
 * values and the rest, and the final modulation's rows of an odd count with
 * its halves swapped (torch.chunk(2) gives the first half the middle row). */
static void test_hunyuan_lora_copies_bytes(void **state)
{
    struct tu_scratch *s = *state;
    enum { LINEAR1_ROWS = 3 * 3072 + 2 };
    char header[1024];
    snprintf(header, sizeof header,
             "{\"diffusion_model.double_blocks.0.img_attn_qkv.lora_B.bias\":{\"dtype\":\"BF16\",\"shape\":[3],"
             "\"data_offsets\":[0,6]},"
             "\"diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[3,1],"
             "\"data_offsets\":[6,12]},"
             "\"diffusion_model.single_blocks.0.linear1.lora_B.bias\":{\"dtype\":\"BF16\",\"shape\":[%d],"
             "\"data_offsets\":[12,%d]}}", LINEAR1_ROWS, 12 + 2 * LINEAR1_ROWS);
    static unsigned char data[12 + 2 * LINEAR1_ROWS];
    static const unsigned char ODD[12] = {0x81, 0x7f, 0x01, 0xff, 0x00, 0x80,  /* qkv bias: sNaN, a NaN, -0 */
                                          0xa1, 0x7f, 0x00, 0x80, 0x80, 0x3f}; /* modulation: a NaN, -0, 1 */
    memcpy(data, ODD, sizeof ODD);
    for (size_t i = 12; i < sizeof data; i++)
        data[i] = (unsigned char)(i * 7 + i / 512);
    char *lora = tu_strdupf("%s-hunyuan.safetensors", s->dir);
    tu_write_safetensors_raw(lora, header, strlen(header), data, sizeof data);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    struct model *m;
    assert_int_equal(diffusers_lora_open(lora, LORA_FAMILY_HUNYUAN_VIDEO, 0, &m), NF4_OK);
#define HV_SINGLE "transformer.single_transformer_blocks.0."
    static const struct {
        const char *name;
        size_t ndim, rows, at, len, wrap; /* bytes at..at+len, then from `wrap` on */
    } WANT[] = {{"transformer.transformer_blocks.0.attn.to_q.lora_B.bias", 1, 1, 0, 2, 0},
                {"transformer.transformer_blocks.0.attn.to_k.lora_B.bias", 1, 1, 2, 2, 0},
                {"transformer.transformer_blocks.0.attn.to_v.lora_B.bias", 1, 1, 4, 2, 0},
                {"transformer.norm_out.linear.lora_A.weight", 2, 3, 10, 2, 6}, /* row 2, then rows 0 and 1 */
                {HV_SINGLE "attn.to_q.lora_B.bias", 1, 3072, 12, 6144, 0},
                {HV_SINGLE "attn.to_k.lora_B.bias", 1, 3072, 12 + 6144, 6144, 0},
                {HV_SINGLE "attn.to_v.lora_B.bias", 1, 3072, 12 + 2 * 6144, 6144, 0},
                {HV_SINGLE "proj_mlp.lora_B.bias", 1, 2, 12 + 3 * 6144, 4, 0}};
#undef HV_SINGLE
    assert_int_equal(m->count, sizeof WANT / sizeof WANT[0]);
    static unsigned char got[6144], want[6144];
    for (size_t i = 0; i < sizeof WANT / sizeof WANT[0]; i++) {
        const struct model_tensor *t = model_find(m, WANT[i].name);
        if (!t)
            fail_msg("no %s", WANT[i].name);
        assert_int_equal(t->t->ndim, WANT[i].ndim);
        assert_int_equal(t->t->shape[0], WANT[i].rows);
        const size_t bytes = WANT[i].rows * 2;
        memcpy(want, data + WANT[i].at, WANT[i].len);
        memcpy(want + WANT[i].len, data + WANT[i].wrap, bytes - WANT[i].len);
        assert_int_equal(st_read(t->file, t->t, 0, got, bytes), NF4_OK);
        assert_memory_equal(got, want, bytes);
    }
    model_close(m);
    assert_int_equal(tu_count_entries(s->dir), 0);
    unlink(lora);
    free(lora);
}

/* HunyuanVideo LoRAs diffusers' conversion raises on, or cuts into parts
 * that cannot load: refused with one line naming the file and the key,
 * nothing written. */
static void test_hunyuan_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
#define HV_QKV "diffusion_model.double_blocks.0.img_attn_qkv"
#define HV_L1 "diffusion_model.single_blocks.0.linear1"
#define HV_MOD "diffusion_model.final_layer.adaLN_modulation.1"
#define HV_REFINER "diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn_qkv"
    static const struct {
        const char *names[3]; /* a factor pair (either may be NULL) and another key, [1, 1] */
        uint64_t down[2], up[2];
        const char *want;
    } HUNYUAN_REFUSALS[] = {
        {{HV_QKV ".lora_A.weight", HV_QKV ".lora_B.weight", NULL}, {2, 16}, {32, 2},
         HV_QKV ".lora_B.weight: has 32 rows, which diffusers cuts into parts for attn.to_q, attn.to_k and attn.to_v "
         "that cannot load"},
        {{HV_REFINER ".lora_A.weight", HV_REFINER ".lora_B.weight", HV_QKV ".lora_A.weight"}, {3, 16}, {48, 3},
         HV_REFINER ".lora_A.weight: is of the token refiner's fused qkv (self_attn_qkv), which diffusers cuts in "
         "three by rows, lora_A too"},
        {{HV_L1 ".lora_A.weight", HV_L1 ".lora_B.weight", HV_QKV ".lora_A.weight"}, {1, 16}, {112, 1},
         HV_L1 ".lora_B.weight: has 112 rows, but diffusers cuts 9216 of them off for to_q, to_k and to_v: "
         "HunyuanVideo's hidden size (3072), whatever the model's"},
        {{HV_MOD ".lora_A.weight", HV_MOD ".lora_B.weight", HV_QKV ".lora_A.weight"}, {1, 16}, {32, 1},
         HV_MOD ".lora_A.weight: has fewer than two rows (1), but diffusers cuts it into two halves"},
        {{"diffusion_model.single_blocks.0.img_attn_qkv.lora_A.weight", NULL, NULL}, {1, 16}, {1, 1},
         "single_blocks.0.img_attn_qkv.lora_A.weight: holds both img_attn_qkv and single_blocks (as single_blocks.0."
         "img_attn_qkv.lora_A.weight), which diffusers' conversion cannot take"},
        /* "transformer." and "diffusion_model." both removed: two keys become one */
        {{HV_QKV ".lora_A.weight", HV_QKV ".lora_B.weight", "transformer.double_blocks.0.img_attn_qkv.lora_A.weight"},
         {1, 16}, {48, 1}, "becomes transformer_blocks.0.img_attn_qkv.lora_A.weight, as"},
        /* a qkv's part and the same module in diffusers' names */
        {{HV_QKV ".lora_A.weight", HV_QKV ".lora_B.weight", "transformer_blocks.0.attn.to_k.lora_A.weight"}, {1, 16},
         {48, 1}, HV_QKV ".lora_A.weight: becomes transformer_blocks.0.attn.to_k.lora_A.weight, the name "
                  "transformer_blocks.0.attn.to_k.lora_A.weight has at that step"},
        /* a key moved onto the name another has before the move: which one diffusers keeps depends on
         * their order (five steps: each prefix cut, the renames, a rule's parts, transformer. put back) */
        {{"transformer.transformer.x.lora_A.weight", "transformer.x.lora_A.weight", HV_QKV ".lora_A.weight"}, {1, 16},
         {1, 16}, "transformer.transformer.x.lora_A.weight: becomes transformer.x.lora_A.weight, the name "
                  "transformer.x.lora_A.weight has at that step"},
        {{"transformer.diffusion_model.x.lora_A.weight", "diffusion_model.x.lora_A.weight", HV_QKV ".lora_A.weight"},
         {1, 16}, {1, 16}, "becomes diffusion_model.x.lora_A.weight, the name diffusion_model.x.lora_A.weight has"},
        {{"img_txt_norm1.lora_A.weight", "img_norm1.norm.lora_A.weight", HV_QKV ".lora_A.weight"}, {1, 16}, {1, 16},
         "img_txt_norm1.lora_A.weight: becomes img_norm1.norm.lora_A.weight, the name img_norm1.norm.lora_A.weight"},
        {{"txt_ifinal_layer.adaLN_modulation.1.lora_B.weight", "txt_inorm_out.linear.lora_B.weight",
          HV_QKV ".lora_A.weight"}, {4, 2}, {4, 2}, "txt_ifinal_layer.adaLN_modulation.1.lora_B.weight: becomes "
                                                    "txt_inorm_out.linear.lora_B.weight, the name"},
        {{"transformer.transformer.foo.lora_A.weight", "foo.lora_A.weight", HV_QKV ".lora_A.weight"}, {1, 16},
         {1, 16}, "foo.lora_A.weight: becomes transformer.foo.lora_A.weight, as transformer.transformer.foo.lora_A."
                  "weight does once diffusers puts transformer. before every key"},
        /* img_norm1 and txt_norm1 are both norm1.norm */
        {{HV_QKV ".lora_A.weight", "double_blocks.0.img_norm1.lora_A.weight", "double_blocks.0.txt_norm1.lora_A.weight"},
         {1, 16}, {1, 16}, "becomes transformer_blocks.0.norm1.norm.lora_A.weight, as"},
        {{HV_QKV ".lora_A.weight", HV_QKV ".lora_B.weight", "diffusion_model.double_blocks.0.img_attn_proj.alpha"},
         {1, 16}, {48, 1}, "diffusion_model.double_blocks.0.img_attn_proj.alpha: becomes transformer.transformer_blocks."
                           "0.attn.to_out.0.alpha, with no \"lora\" in its name, and diffusers refuses a LoRA file "
                           "with such a key"},
        {{"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "lora_unet_double_blocks_0_img_attn_qkv.lora_up."
          "weight", NULL}, {3, 16}, {48, 3}, "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight: is in kohya's "
                                             "form (lora_unet_, as musubi-tuner saves a HunyuanVideo LoRA)"},
    };
#undef HV_L1
#undef HV_MOD
#undef HV_REFINER
    char *lora = tu_strdupf("%s-hunyuan.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof HUNYUAN_REFUSALS / sizeof HUNYUAN_REFUSALS[0]; i++) {
        write_pair_lora(lora, HUNYUAN_REFUSALS[i].names, HUNYUAN_REFUSALS[i].down, HUNYUAN_REFUSALS[i].up, DT_BF16, 1);
        assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-hunyuan/transformer", lora, NULL, HUNYUAN_REFUSALS[i].want);
    }
    /* A qkv's lora_B of no dimension (torch.chunk raises), and of 4-bit
     * values (its rows are copied as whole bytes). */
    static const char SCALAR_B[] =
        "{\"" HV_QKV ".lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],\"data_offsets\":[0,2]},"
        "\"" HV_QKV ".lora_B.weight\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[2,4]}}";
    static const char F4_B[] =
        "{\"" HV_QKV ".lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],\"data_offsets\":[0,2]},"
        "\"" HV_QKV ".lora_B.weight\":{\"dtype\":\"F4\",\"shape\":[3,2],\"data_offsets\":[2,5]}}";
    static const unsigned char EIGHT[8] = {0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f};
    tu_write_safetensors_raw(lora, SCALAR_B, strlen(SCALAR_B), EIGHT, 4);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-hunyuan/transformer", lora, NULL,
                         HV_QKV ".lora_B.weight: has 0 dimensions, but diffusers cuts it by rows into three equal "
                         "parts");
    tu_write_safetensors_raw(lora, F4_B, strlen(F4_B), EIGHT, 5);
    assert_merge_refused(s, DIFFUSERS_FIXTURES "/tiny-hunyuan/transformer", lora, NULL,
                         HV_QKV ".lora_B.weight: is F4; LoRA weights must be F32, BF16 or F16");
#undef HV_QKV
    unlink(lora);
    free(lora);
}

/* A LoRA in diffusers' own form with DoRA scales: every diffusers loader
 * drops them with a warning and loads the rest, and so does nf4deq: the
 * merge is that of the file without them. */
static void test_diffusers_lora_drops_dora_scales(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor ts[3] = {
        {"transformer.blocks.0.attn1.to_q.lora_A.weight", DT_BF16, {4, 32}, NULL},
        {"transformer.blocks.0.attn1.to_q.lora_B.weight", DT_BF16, {32, 4}, NULL},
        {"transformer.blocks.0.attn1.to_q.dora_scale", DT_BF16, {1, 32}, NULL},
    };
    for (size_t k = 0; k < 3; k++)
        syn_fill(&ts[k], 0.5f);
    char *with = tu_strdupf("%s-with.safetensors", s->dir), *without = tu_strdupf("%s-without.safetensors", s->dir),
         *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir),
         *got_file = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", got),
         *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want);
    syn_write(with, ts, 3);
    syn_write(without, ts, 2);
    assert_lora_warns_once(DIFFUSERS_FIXTURES "/tiny-wan", got, with,
                           "-with.safetensors: 1 of its tensors are DoRA scales (dora_scale), which diffusers drops: they "
                       "are not merged\n",
                           "1 with LoRA merged");
    const char *lora[1] = {without};
    assert_int_equal(merge_on_cpu(DIFFUSERS_FIXTURES "/tiny-wan/transformer", want, lora, 1, 0, 0, DT_INVALID), 1);
    tu_assert_same_tensors(got_file, want_file);
    tu_rmtree(got);
    tu_rmtree(want);
    unlink(with);
    unlink(without);
    for (size_t k = 0; k < 3; k++)
        free(ts[k].v);
    free(with);
    free(without);
    free(got);
    free(want);
    free(got_file);
    free(want_file);
}

/* Where diffusers copies a tensor (factors without an alpha, a diff_b, the
 * head's diff), the conversion holds its bytes as they are: NaN payloads,
 * signalling NaNs and -0 included, which a multiply would change. */
static void test_wan_lora_copies_bytes(void **state)
{
    struct tu_scratch *s = *state;
    static const char HEADER[] =
        "{\"diffusion_model.blocks.0.ffn.0.lora_down.weight\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
        "\"diffusion_model.blocks.0.ffn.0.lora_up.weight\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]},"
        "\"diffusion_model.blocks.0.ffn.0.diff_b\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[16,20]}}";
    static const unsigned char DATA[20] = {0xa1, 0x7f, 0x01, 0xff, 0x00, 0x80, 0x81, 0x7f,  /* NaNs, -0 */
                                           0x40, 0x7f, 0xc0, 0xff, 0x80, 0x3f, 0x01, 0x00,  /* sNaN, 1, subnormal */
                                           0x01, 0x7c, 0x00, 0x80};                         /* F16 sNaN, -0 */
    char *lora = tu_strdupf("%s-copy.safetensors", s->dir);
    tu_write_safetensors_raw(lora, HEADER, strlen(HEADER), DATA, sizeof DATA);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    struct model *m;
    assert_int_equal(diffusers_lora_open(lora, LORA_FAMILY_WAN, 0, &m), NF4_OK);
    static const char *const WANT[][2] = {{"transformer.blocks.0.ffn.net.0.proj.lora_A.weight", "0"},
                                          {"transformer.blocks.0.ffn.net.0.proj.lora_B.weight", "8"},
                                          {"transformer.blocks.0.ffn.net.0.proj.lora_B.bias", "16"}};
    assert_int_equal(m->count, 3);
    for (size_t i = 0; i < 3; i++) {
        const struct model_tensor *t = NULL;
        for (size_t k = 0; k < m->count && !t; k++)
            t = strcmp(m->tensors[k].t->name, WANT[i][0]) == 0 ? &m->tensors[k] : NULL;
        assert_non_null(t);
        unsigned char got[8];
        const size_t at = (size_t)atoi(WANT[i][1]), len = i == 2 ? 4 : 8;
        assert_int_equal(st_read(t->file, t->t, 0, got, len), NF4_OK);
        assert_memory_equal(got, DATA + at, len);
    }
    model_close(m);
    /* Alphas of every integer dtype and a bool, as .item() reads them: r = 1,
     * so lora_A is the down times the alpha (1.0 -> 2.0; True -> 1.0). */
    static const struct {
        const char *dtype;
        unsigned char bytes[8];
        size_t len;
        uint16_t want;
    } ALPHAS[] = {{"U16", {2, 0}, 2, 0x4000}, {"U32", {2, 0, 0, 0}, 4, 0x4000}, {"U64", {2}, 8, 0x4000},
                  {"BOOL", {1}, 1, 0x3f80}};
    for (size_t i = 0; i < sizeof ALPHAS / sizeof ALPHAS[0]; i++) {
        char *header = tu_strdupf(
            "{\"diffusion_model.blocks.0.ffn.0.lora_down.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],\"data_offsets\":[0,2]},"
            "\"diffusion_model.blocks.0.ffn.0.lora_up.weight\":{\"dtype\":\"BF16\",\"shape\":[1,1],\"data_offsets\":[2,4]},"
            "\"diffusion_model.blocks.0.ffn.0.alpha\":{\"dtype\":\"%s\",\"shape\":[],\"data_offsets\":[4,%zu]}}",
            ALPHAS[i].dtype, 4 + ALPHAS[i].len);
        unsigned char data[12] = {0x80, 0x3f, 0x80, 0x3f};
        memcpy(data + 4, ALPHAS[i].bytes, ALPHAS[i].len);
        tu_write_safetensors_raw(lora, header, strlen(header), data, 4 + ALPHAS[i].len);
        assert_int_equal(diffusers_lora_open(lora, LORA_FAMILY_WAN, 0, &m), NF4_OK);
        const struct model_tensor *a = NULL;
        for (size_t k = 0; k < m->count && !a; k++)
            a = str_ends_with(m->tensors[k].t->name, ".lora_A.weight") ? &m->tensors[k] : NULL;
        uint16_t got = 0;
        assert_non_null(a);
        assert_int_equal(st_read(a->file, a->t, 0, &got, 2), NF4_OK);
        assert_int_equal(got, ALPHAS[i].want);
        model_close(m);
        free(header);
    }
    unlink(lora);
    free(lora);
}

/* The tensor bytes of a safetensors file, headers apart: what inspect's
 * bytes_after_conversion counts. */
static uint64_t tensor_bytes_of(const char *path)
{
    struct model *m;
    assert_int_equal(model_open_file(path, &m), NF4_OK);
    uint64_t n = 0;
    for (size_t i = 0; i < m->count; i++)
        n += st_tensor_bytes(m->tensors[i].t);
    model_close(m);
    return n;
}

/* A component of inspect --json's "components" by name. */
static const cJSON *json_component(const cJSON *root, const char *name)
{
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(root, "components"))
        if (strcmp(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(c, "name")), name) == 0)
            return c;
    fail_msg("no component %s", name);
    return NULL;
}

/* inspect PIPELINE --lora: each component with the LoRAs convert merges into
 * it (the same warning for keys of others), one with no 4-bit weight shown
 * as converted to merge them with its dtypes kept, and its totals those of
 * what convert writes. A LoRA refused for any component, even one found bad
 * after others' tables are made, prints no report. */
static void test_diffusers_lora_pipeline_inspect(void **state)
{
    struct tu_scratch *s = *state;
    const char *pipe = DIFFUSERS_FIXTURES "/tiny-flux-bnb4";
    struct tu_run r = tu_run("inspect", pipe, "--lora", DIFFUSERS_FIXTURES "/lora-flux", NULL);
    if (r.status != 0 || r.err[0] || !strstr(r.out, "== component transformer: converted ==\n") ||
        !strstr(r.out, "\n18 tensors changed by 1 adapter\n\n== component vae: no 4-bit weights, copied as it is") ||
        !strstr(r.out, "\npipeline: 3 components (2 converted, 1 copied)"))
        fail_msg("exit %d, stderr: %s, stdout: %s", r.status, r.err, r.out);
    size_t changes = 0; /* only the transformer's */
    for (const char *at = r.out; (at = strstr(at, "CHANGED BY LORA")); at++)
        changes++;
    assert_int_equal(changes, 1);
    tu_run_free(&r);
    /* The VAE as a Flux pipeline's text_encoder, which diffusers loads LoRAs into. */
    char *pipe2 = tu_strdupf("%s-pipe", s->dir), *lora = tu_strdupf("%s-te.safetensors", s->dir),
         *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(tu_sh_status("cp -r %s %s && mv %s/vae %s/text_encoder", pipe, pipe2, pipe2, pipe2), 0);
    struct syn_tensor ts[4] = {
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
        {"vae.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"vae.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
    };
    for (size_t i = 0; i < 4; i++)
        syn_fill(&ts[i], 0.5f);
    syn_write(lora, ts, 4);
    r = tu_run("inspect", "--dtype", "bf16", pipe2, "--lora", lora, NULL);
    if (r.status != 0 || tu_lines(r.err) != 1 || !strstr(r.err, "2 of its tensors are for vae") ||
        !strstr(r.out, "== component text_encoder: no 4-bit weights, converted to merge a LoRA, its dtypes kept ==\n") ||
        !strstr(r.out, "decoder.mid_block.attentions.0.to_q.weight       F32   [32, 32]                 4096  -> F32 "
                       "(4096 bytes)\n") ||
        !strstr(r.out, "\n1 tensor changed by 1 adapter\n") ||
        !strstr(r.out, "\npipeline: 3 components (2 converted, 1 more to merge a LoRA, 0 copied)"))
        fail_msg("exit %d, stderr: %s, stdout: %s", r.status, r.err, r.out);
    tu_run_free(&r);
    r = tu_run("inspect", "--json", "--dtype", "bf16", pipe2, "--lora", lora, NULL);
    assert_int_equal(r.status, 0);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    const cJSON *te = json_component(root, "text_encoder"), *tr = json_component(root, "transformer"),
                *totals = cJSON_GetObjectItemCaseSensitive(root, "totals");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(te, "action")), "merge");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(tr, "action")), "convert");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(te, "lora")), 1);
    assert_null(cJSON_GetObjectItemCaseSensitive(tr, "lora"));
    assert_int_equal(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(totals, "merged_components")), 1);
    assert_int_equal(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(totals, "converted_components")), 2);
    /* Its totals are what convert writes, F32 kept under --dtype bf16. */
    r = (tu_run_free(&r), tu_run("convert", "-q", "--device", "cpu", "--dtype", "bf16", pipe2, out, "--lora", lora,
                                 NULL));
    assert_int_equal(r.status, 0);
    char *te_out = tu_strdupf("%s/text_encoder/diffusion_pytorch_model.safetensors", out),
         *tr_out = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", out);
    assert_int_equal(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(
                         cJSON_GetObjectItemCaseSensitive(te, "totals"), "bytes_after_conversion")),
                     tensor_bytes_of(te_out));
    assert_int_equal(cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(
                         cJSON_GetObjectItemCaseSensitive(tr, "totals"), "bytes_after_conversion")),
                     tensor_bytes_of(tr_out));
    cJSON_Delete(root);
    tu_run_free(&r);
    tu_rmtree(out);
    /* Refused as convert refuses it, with nothing on standard output: a PEFT
     * adapter, a LoRA with nothing for the pipeline, and one whose
     * transformer keys fail to bind after the text encoders' tables. */
    r = tu_run("inspect", pipe, "--lora", LORA_FIXTURES "/adapter-r8-all-linear", NULL);
    if (r.status != NF4_EUSAGE || r.out[0] || !strstr(r.err, "is a PEFT adapter, which merges into one model"))
        fail_msg("exit %d, stderr: %s, stdout: %s", r.status, r.err, r.out);
    tu_run_free(&r);
    syn_write(lora, ts + 2, 2);
    r = tu_run("inspect", pipe, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || r.out[0] || tu_lines(r.err) != 1 || !strstr(r.err, "(its keys are for: vae)"))
        fail_msg("exit %d, stderr: %s, stdout: %s", r.status, r.err, r.out);
    tu_run_free(&r);
    /* (wider than proj_out: a narrower lora_A diffusers' Flux.1 loader pads) */
    struct syn_tensor bad[2] = {{"transformer.proj_out.lora_A.weight", DT_BF16, {4, 65}, NULL},
                                {"transformer.proj_out.lora_B.weight", DT_BF16, {16, 4}, NULL}};
    for (size_t i = 0; i < 2; i++)
        syn_fill(&bad[i], 0.5f);
    syn_write(lora, bad, 2);
    r = tu_run("inspect", pipe, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || r.out[0] || tu_lines(r.err) != 1 || !strstr(r.err, "transformer.proj_out.lora_A"))
        fail_msg("exit %d, stderr: %s, stdout: %s", r.status, r.err, r.out);
    tu_run_free(&r);
    for (size_t i = 0; i < 2; i++)
        free(bad[i].v);
    for (size_t i = 0; i < 4; i++)
        free(ts[i].v);
    unlink(lora);
    tu_rmtree(pipe2);
    free(te_out);
    free(tr_out);
    free(pipe2);
    free(lora);
    free(out);
}

/* A whole pipeline with diffusers LoRAs: each component diffusers' loader
 * loads LoRAs into takes the keys under its name, merged as in the
 * component's own conversion; one with no 4-bit weight is converted where a
 * LoRA changes it, copied byte for byte otherwise; keys of other components
 * are left out with a warning, a LoRA with none for the pipeline is refused,
 * and so is a PEFT adapter (one model's). */
static void test_diffusers_lora_pipeline(void **state)
{
    struct tu_scratch *s = *state;
    const char *pipe = DIFFUSERS_FIXTURES "/tiny-flux-bnb4";
    char *out = tu_strdupf("%s/pipe", s->dir), *one = tu_strdupf("%s/one", s->dir);
    const char *dirs[1] = {DIFFUSERS_FIXTURES "/lora-flux"};
    assert_int_equal(merge_on_cpu(pipe, out, dirs, 1, 0, 0, DT_INVALID), 18);
    assert_int_equal(merge_on_cpu(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/transformer", one, dirs, 1, 0, 0, DT_INVALID), 18);
    char *got = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", out),
         *want = tu_strdupf("%s/diffusion_pytorch_model.safetensors", one),
         *t5 = tu_strdupf("%s/text_encoder_2/model.safetensors", out),
         *vae = tu_strdupf("%s/vae/diffusion_pytorch_model.safetensors", out);
    tu_assert_same_tensors(got, want);
    tu_assert_same_tensors(t5, DIFFUSERS_FIXTURES "/tiny-flux-bnb4.text_encoder_2.expected.safetensors");
    size_t na = 0, nb = 0;
    char *a = tu_read_file(vae, &na), *b = tu_read_file(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/vae/"
                                                        "diffusion_pytorch_model.safetensors", &nb);
    /* (the plain copy of a component no LoRA changes) */
    assert_true(a && b && na == nb && memcmp(a, b, na) == 0);
    free(a);
    free(b);
    tu_rmtree(out);
    /* Keys for the transformer, the VAE (diffusers loads no LoRA into a VAE)
     * and a text encoder the pipeline does not have: the transformer's merged,
     * the others left out with one warning, the VAE copied byte for byte. */
    struct syn_tensor ts[6] = {
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"text_encoder.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
        {"transformer.proj_out.lora_A.weight", DT_BF16, {4, 64}, NULL},
        {"transformer.proj_out.lora_B.weight", DT_BF16, {16, 4}, NULL},
        {"vae.decoder.mid_block.attentions.0.to_q.lora_A.weight", DT_F32, {2, 32}, NULL},
        {"vae.decoder.mid_block.attentions.0.to_q.lora_B.weight", DT_F32, {32, 2}, NULL},
    };
    for (size_t i = 0; i < 6; i++)
        syn_fill(&ts[i], 0.5f);
    char *lora = tu_strdupf("%s-vae.safetensors", s->dir);
    syn_write(lora, ts, 6);
    assert_lora_warns_once(pipe, out, lora,
                           "4 of its tensors are for text_encoder, vae, which this pipeline does not have or diffusers "
                       "does not load LoRAs into",
                           "1 with LoRA merged");
    a = tu_read_file(vae, &na);
    b = tu_read_file(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/vae/diffusion_pytorch_model.safetensors", &nb);
    assert_true(a && b && na == nb && memcmp(a, b, na) == 0);
    free(a);
    free(b);
    tu_rmtree(out);
    /* A Flux pipeline's CLIP text encoder (the VAE's weights under that
     * name, here): no 4-bit weight, but diffusers loads LoRAs into it, so it
     * is converted, the LoRA merged, every dtype kept whatever --dtype says. */
    char *pipe2 = tu_strdupf("%s-pipe", s->dir);
    assert_int_equal(tu_sh_status("cp -r %s %s && mv %s/vae %s/text_encoder", pipe, pipe2, pipe2, pipe2), 0);
    syn_write(lora, ts, 2);
    struct tu_run r = tu_run("convert", "--device", "cpu", "--dtype", "bf16", pipe2, out, "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    char *te = tu_strdupf("%s/text_encoder/diffusion_pytorch_model.safetensors", out);
    struct model *vm, *bm;
    assert_int_equal(model_open_file(te, &vm), NF4_OK);
    assert_int_equal(model_open_file(DIFFUSERS_FIXTURES "/tiny-flux-bnb4/vae/diffusion_pytorch_model.safetensors", &bm),
                     NF4_OK);
    assert_int_equal(vm->count, bm->count);
    for (size_t i = 0; i < vm->count; i++)
        assert_int_equal(vm->tensors[i].t->dtype, bm->tensors[i].t->dtype); /* F32 kept */
    const struct model_tensor *q = model_find(vm, "decoder.mid_block.attentions.0.to_q.weight"),
                              *bq = model_find(bm, "decoder.mid_block.attentions.0.to_q.weight");
    float got_q, base_q;
    assert_int_equal(st_read(q->file, q->t, 0, &got_q, 4), NF4_OK);
    assert_int_equal(st_read(bq->file, bq->t, 0, &base_q, 4), NF4_OK);
    volatile float acc = 0.0f;
    for (int k = 0; k < 2; k++) {
        volatile float prod = ts[1].v[k] * ts[0].v[k * 32];
        acc = acc + prod;
    }
    volatile float d = acc * 1.0f, m = base_q + d; /* no metadata: scaling 1 */
    assert_true(memcmp(&got_q, (const void *)&m, 4) == 0);
    model_close(vm);
    model_close(bm);
    tu_rmtree(out);
    tu_rmtree(pipe2);
    free(pipe2);
    free(te);
    /* Only components the pipeline does not have, or diffusers loads nothing into. */
    syn_write(lora, ts + 4, 2);
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "has no tensors for a component of this pipeline that diffusers loads LoRAs into (its keys are "
                       "for: vae)"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", LORA_FIXTURES "/adapter-r8-all-linear", NULL);
    if (r.status != NF4_EUSAGE || !strstr(r.err, "is a PEFT adapter, which merges into one model"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    struct syn_tensor kohya[2] = {{"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", DT_F32, {4, 8}, NULL},
                                  {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", DT_F32, {8, 4}, NULL}};
    for (size_t i = 0; i < 2; i++)
        syn_fill(&kohya[i], 0.5f);
    syn_write(lora, kohya, 2);
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", lora, NULL);
    if (r.status != NF4_EDATA || !strstr(r.err, "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight: has 8 rows; "
                                             "diffusers splits it into three equal parts"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    for (size_t i = 0; i < 2; i++)
        free(kohya[i].v);
    r = tu_run("convert", "--device", "cpu", pipe, out, "--lora", LORA_FIXTURES, NULL); /* many *.safetensors */
    if (r.status != NF4_ENOINPUT || !strstr(r.err, "is neither a PEFT adapter (adapter_config.json) nor a diffusers "
                                                   "LoRA"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    unlink(lora);
    for (size_t i = 0; i < 6; i++)
        free(ts[i].v);
    free(lora);
    free(got);
    free(want);
    free(t5);
    free(vae);
    free(out);
    free(one);
}

/* The component is the real name of IN's folder ("text_encoder_2/." is
 * text_encoder_2), so a LoRA for two components goes on the right one; and a
 * PEFT adapter's file given for its folder is a usage error. */
static void test_diffusers_lora_component_by_folder(void **state)
{
    struct tu_scratch *s = *state;
    struct syn_tensor ts[4] = {
        {"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight", DT_F32, {2, 64}, NULL},
        {"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight", DT_F32, {64, 2}, NULL},
        {"transformer.proj_out.lora_A.weight", DT_BF16, {4, 64}, NULL},
        {"transformer.proj_out.lora_B.weight", DT_BF16, {16, 4}, NULL},
    };
    for (size_t i = 0; i < 4; i++)
        syn_fill(&ts[i], 0.5f);
    char *lora = tu_strdupf("%s-two.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    syn_write(lora, ts, 4);
    struct tu_run r = tu_run("convert", "--device", "cpu", DIFFUSERS_FIXTURES "/tiny-flux-bnb4/text_encoder_2/.", out,
                             "--lora", lora, NULL);
    if (r.status != 0 || !strstr(r.err, "2 of its tensors are for other pipeline components (transformer) than "
                                        "text_encoder_2") || !strstr(r.err, "1 with LoRA merged"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    r = tu_run("convert", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", out, "--lora",
               LORA_FIXTURES "/adapter-r8-all-linear/" ADAPTER_WEIGHTS_NAME, NULL);
    if (r.status != NF4_EUSAGE || !strstr(r.err, "is a file of a PEFT adapter: give --lora the adapter's folder"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    unlink(lora);
    for (size_t i = 0; i < 4; i++)
        free(ts[i].v);
    free(lora);
    free(out);
}

static void test_inspect_lists_changes(void **state)
{
    (void)state;
    struct tu_run r = tu_run("inspect", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora",
                             LORA_FIXTURES "/adapter-r16-qv-lmhead", NULL);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.err, "");
    assert_non_null(strstr(r.out, "model.layers.1.self_attn.v_proj.weight           16              8          0.5"));
    assert_non_null(strstr(r.out, "lm_head.weight"));
    assert_non_null(strstr(r.out, "modules_to_save: replaced"));
    assert_non_null(strstr(r.out, "5 tensors changed by 1 adapter"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora",
               LORA_FIXTURES "/adapter-r8-all-linear", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"scaling\": 2"));
    assert_non_null(strstr(r.out, "\"change\": \"merged\""));
    tu_run_free(&r);
}

static void test_pattern_matching_as_peft(void **state)
{
    (void)state;
    assert_int_equal(lora_pattern_matches("q_proj", "model.layers.0.self_attn.q_proj"), 1);
    assert_int_equal(lora_pattern_matches("q_proj", "q_proj"), 1);
    assert_int_equal(lora_pattern_matches("q_proj", "model.layers.0.self_attn.xq_proj"), 0);
    assert_int_equal(lora_pattern_matches("layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"), 1);
    assert_int_equal(lora_pattern_matches("layers\\.[0-9]+\\.mlp\\..*", "model.layers.12.mlp.up_proj"), 1);
    assert_int_equal(lora_pattern_matches("proj", "model.layers.0.self_attn.q_proj"), 0);
    assert_int_equal(lora_pattern_matches("(", "x"), -1);
    assert_true(lora_scaling(16, 8, 0) == 2.0f);
    assert_true(lora_scaling(16, 64, 1) == 2.0f);
}

/* lora_target_matches against PEFT 0.21's check_target_module_exists: every
 * row's expectation but the last three is what that function returns for the
 * same config and key (run in Python when the table was written); those three
 * are nf4deq's fallback for patterns it cannot run. */
/* lora_target_parse of a config holding `keys` ("\"target_modules\": [...]"):
 * *code, and the document, which the rules point into: free it after them. */
static cJSON *parse_target_rules(const char *keys, struct lora_target_rules *r, int *code)
{
    char *json = tu_strdupf("{%s}", keys);
    cJSON *root = cJSON_Parse(json);
    free(json);
    assert_non_null(root);
    *code = lora_target_parse("cfg", root, r);
    return root;
}

static void test_targeting_as_peft(void **state)
{
    (void)state;
    static const struct {
        const char *config; /* the keys of an adapter_config.json */
        const char *module;
        int targeted;
    } TARGET_CASES[] = {
        {"\"target_modules\": [\"q_proj\"]", "model.layers.0.self_attn.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"]", "model.layers.0.self_attn.k_proj", 0},
        {"\"target_modules\": [\"q_proj\"]", "q_proj", 1},
        {"\"target_modules\": [\"q_proj\"]", "model.layers.0.xq_proj", 0},
        {"\"target_modules\": \"model\\\\..*\\\\.(q|v)_proj\"", "model.layers.0.self_attn.q_proj", 1},
        {"\"target_modules\": \"model\\\\..*\\\\.(q|v)_proj\"", "model.layers.0.self_attn.k_proj", 0},
        {"\"target_modules\": \"model\\\\..*\\\\.(q|v)_proj\"", "model.layers.0.self_attn.q_proj.extra", 0},
        {"\"target_modules\": \"all-linear\"", "model.layers.0.self_attn.k_proj", 1},
        {"\"target_modules\": null", "model.layers.0.self_attn.k_proj", 1},
        {"\"target_modules\": [\"q_proj\", \"o_proj\"], \"exclude_modules\": [\"o_proj\"]",
         "model.layers.0.self_attn.o_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"exclude_modules\": \".*\\\\.1\\\\..*\"", "model.layers.1.self_attn.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0, 2]", "model.layers.0.self_attn.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0, 2]", "model.layers.1.self_attn.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0, 2]", "model.layers.2.self_attn.q_proj", 1},
        /* named in full: the layer index is not checked */
        {"\"target_modules\": [\"model.layers.1.self_attn.q_proj\"], \"layers_to_transform\": [0, 2]",
         "model.layers.1.self_attn.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"layers\"",
         "model.layers.1.self_attn.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"h\"",
         "model.layers.1.self_attn.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1", "layers.1.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1", "a.layers.1.q_proj", 1},
        /* PEFT 0.21 takes the first index ("...layers.1.experts.0..." is layer 1) */
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 3", "model.layers.1.blocks.3.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1", "model.layers.1.blocks.3.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 3, \"layers_pattern\": [\"blocks\"]",
         "model.layers.1.blocks.3.q_proj", 1},
        {"\"target_modules\": [\"down_proj\"], \"layers_to_transform\": 1", "model.layers.1.mlp.experts.0.down_proj",
         1},
        {"\"target_modules\": [\"down_proj\"], \"layers_to_transform\": 0", "model.layers.1.mlp.experts.0.down_proj",
         0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 2", "model.0.layers.2.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 0", "model.0.layers.2.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 0", "m.a.0.b.2.q_proj", 1},
        /* with layers_pattern, the pattern may start the name */
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"layers\"",
         "layers.1.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"layers\"",
         "model.xlayers.1.q_proj", 0},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"h\"",
         "transformer.h.1.attn.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"model.layers\"",
         "model.layers.1.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": [\"layers\"]",
         "model.layers.1.blocks.3.q_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": []", "model.layers.1.blocks.3.q_proj", 1},
        /* Patterns src/pattern.c cannot run (look-ahead), or that are not patterns
         * on their own (an unbalanced ')'): nothing is selected out, as before
         * nf4deq read these keys; a warning says so. */
        {"\"target_modules\": \"^(?!.*vision).*\\\\.q_proj\"", "model.vision.layers.0.k_proj", 1},
        {"\"target_modules\": \"model)|(?:zzz\"", "model.layers.0.k_proj", 1},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": 1, \"layers_pattern\": \"(?=x)\"",
         "model.layers.0.k_proj", 1},
    };
    for (size_t i = 0; i < sizeof TARGET_CASES / sizeof *TARGET_CASES; i++) {
        struct lora_target_rules r;
        int code;
        cJSON *root = parse_target_rules(TARGET_CASES[i].config, &r, &code);
        assert_int_equal(code, NF4_OK);
        if (lora_target_matches(&r, TARGET_CASES[i].module) != TARGET_CASES[i].targeted)
            fail_msg("case %zu: {%s} and %s: expected %d", i, TARGET_CASES[i].config, TARGET_CASES[i].module,
                     TARGET_CASES[i].targeted);
        lora_target_free(&r);
        cJSON_Delete(root);
    }
    static const char *const BAD[] = {
        "\"target_modules\": 5", "\"target_modules\": [\"q_proj\", 1]", "\"exclude_modules\": {}",
        "\"layers_to_transform\": \"0\"", "\"layers_to_transform\": [0, \"1\"]", "\"layers_pattern\": 3",
    };
    for (size_t i = 0; i < sizeof BAD / sizeof *BAD; i++) {
        struct lora_target_rules r;
        int code;
        cJSON *root = parse_target_rules(BAD[i], &r, &code);
        if (code != NF4_EDATA)
            fail_msg("{%s} was accepted", BAD[i]);
        lora_target_free(&r);
        cJSON_Delete(root);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fixtures_within_tolerance, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_factors_larger_than_a_slot, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_original_module_on_a_multimodal_base, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_fixtures_smallest_chunks, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_fp32_output_is_the_unrounded_merge, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_synthetic_adapters_match_reference, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_matches_reference, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_beside_the_router, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_wide_rows_of_b, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_forms, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_refusals, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_fused_matches_reference, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_fused_refusals, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_lora_on_renamed_router, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_none_saved_warns, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_experts_lora_on_4bit_experts, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_parameter_targets_as_layers, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_auto_device_weighs_the_merge, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_peft_saved_layouts, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_tied_embeddings_parted_by_an_adapter, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_two_replacements_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_dora_alone_per_tensor, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_token_rows_alone_per_tensor, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_tied_token_rows_saved_twice, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_token_rows_synthetic, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_embedding_layers_saved_whole, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_resized_vocabulary, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_fan_in_fan_out_ignored_on_4bit_weights, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_refusals_write_nothing, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_adapter_for_another_base, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_untargeted_module_left_out_with_a_warning, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_lora_bias_terms, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_loras, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_flux_control_lora, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_flux_control_lora_on_a_class_without_control_form, tu_scratch_setup,
                                        lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_flux_control_lora_refusals, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_refusals_name_the_files_keys, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_flux_network_alphas, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_null_metadata, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_components, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_component_by_folder, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_pipeline, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_pipeline_inspect, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_text_model, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_kohya_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_kohya_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_qwen_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_qwen_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_wan_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_wan_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_wan_lora_into_transformer_2, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_wan_lora_copies_bytes, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_diffusers_lora_drops_dora_scales, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_prefixed_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_flux2_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_flux2_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_flux2_lora_copies_bytes, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_zimage_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_zimage_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_ltx2_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_hunyuan_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_hunyuan_lora_copies_bytes, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_hunyuan_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_xlabs_lora_as_diffusers_loads_it, kohya_setup, kohya_teardown),
        cmocka_unit_test_setup_teardown(test_xlabs_lora_refusals, kohya_setup, kohya_teardown),
        cmocka_unit_test(test_inspect_lists_changes),
        cmocka_unit_test(test_inspect_says_the_head_is_untied),
        cmocka_unit_test(test_inspect_token_rows),
        cmocka_unit_test_setup_teardown(test_embedding_lora_mirror_is_exact, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test(test_resume_record_holds_the_untied_head),
        cmocka_unit_test(test_pattern_matching_as_peft),
        cmocka_unit_test(test_targeting_as_peft),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
