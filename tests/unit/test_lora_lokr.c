/* LoKr adapters (lora_lokr.h, lora_lokr_forms.h) as diffusers 0.42 loads
 * them into Flux.2's and Z-Image's transformers: each fixture
 * make_lokr_fixtures.py wrote (ai-toolkit's, LyCORIS', PEFT's and
 * diffusers' own forms, with and without a LoKrConfig in the metadata)
 * converts to diffusers' own conversion byte for byte, and merges within
 * the tolerance of tests/fixtures/lora/README.md of PEFT's own merge, a
 * fused qkv's delta cut into its parts; the same bytes whatever the chunks
 * and threads; PEFT's factorization() as PEFT computes it; inspect says
 * LoKr; and what diffusers raises on, or would load other factors for, is
 * refused with one line naming the file and key, nothing written, no temp
 * file left. */
#include "test_util.h"

#include "convert.h"
#include "lora_diffusers.h"
#include "lora_lokr.h"
#include "lora_synth.h"
#include "merge_tolerance.h"
#include "model.h"
#include "safetensors_writer.h"

#define DIFF FIXTURES "/diffusers"
#define FLUX2_PIPE DIFF "/tiny-flux2"
#define ZIMAGE_PIPE DIFF "/tiny-zimage"
#define WEIGHTS "/transformer/diffusion_pytorch_model.safetensors"

static const struct lokr_case {
    const char *stem;
    enum lora_family family;
    const char *pipeline;
    uint64_t merged; /* tensors it changes: its .expected file's */
} CASES[] = {
    {"lora-flux2-lokr-bfl", LORA_FAMILY_FLUX2, FLUX2_PIPE, 10},
    {"lora-flux2-lokr-lycoris", LORA_FAMILY_FLUX2, FLUX2_PIPE, 4},
    {"lora-flux2-lokr-peft", LORA_FAMILY_FLUX2, FLUX2_PIPE, 4},
    {"lora-flux2-lokr-meta", LORA_FAMILY_FLUX2, FLUX2_PIPE, 4},
    {"lora-zimage-lokr-aitk", LORA_FAMILY_Z_IMAGE, ZIMAGE_PIPE, 5},
    {"lora-zimage-lokr-own", LORA_FAMILY_Z_IMAGE, ZIMAGE_PIPE, 5},
};

static void test_factorization_as_peft(void **state)
{
    (void)state;
    /* peft.tuners.lokr.layer.factorization(dim, factor), PEFT 0.21 */
    static const struct {
        uint64_t dim;
        int64_t factor;
        uint64_t m, n;
    } WANT[] = {
        {32, -1, 4, 8},   {96, -1, 8, 12},  {85, -1, 5, 17},       {128, -1, 8, 16},    {1, -1, 1, 1},
        {7, -1, 1, 7},    {3072, -1, 48, 64}, {12288, -1, 96, 128}, {32, 4, 4, 8},      {32, 8, 8, 4},
        {32, 3, 2, 16},   {85, 5, 5, 17},   {85, 4, 1, 85},        {96, 16, 16, 6},     {100, 7, 5, 20},
        {36, -5, 1, 36},  {36, 0, 1, 36},   {4096, 16, 16, 256},   {4096, -1, 64, 64},  {17, 17, 17, 1},
        {64, 100, 8, 8},
    };
    for (size_t i = 0; i < sizeof WANT / sizeof WANT[0]; i++) {
        uint64_t m, n;
        lokr_factorization(WANT[i].dim, WANT[i].factor, &m, &n);
        if (m != WANT[i].m || n != WANT[i].n)
            fail_msg("factorization(%llu, %lld) = (%llu, %llu), PEFT's (%llu, %llu)", (unsigned long long)WANT[i].dim,
                     (long long)WANT[i].factor, (unsigned long long)m, (unsigned long long)n,
                     (unsigned long long)WANT[i].m, (unsigned long long)WANT[i].n);
    }
}

/* Each fixture holds, once opened as its pipeline's loader opens it, the
 * tensors of diffusers' conversion byte for byte (and its metadata). */
static void test_lokr_converts_as_diffusers(void **state)
{
    struct tu_scratch *s = *state;
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        char *file = tu_strdupf(DIFF "/%s.safetensors", CASES[i].stem),
             *want = tu_strdupf(DIFF "/%s.diffusers.safetensors", CASES[i].stem);
        struct model *m;
        assert_int_equal(diffusers_lora_open(file, CASES[i].family, 0, &m), NF4_OK);
        assert_string_equal(m->files[0]->path, file);
        tu_assert_same_st(m->files[0], file, want);
        model_close(m);
        free(file);
        free(want);
    }
    assert_int_equal(tu_count_entries(s->dir), 0);
}

/* convert --device cpu PIPE OUT --lora LORA in this process, chunks of
 * `chunk` elements (0: the default) on `threads`: the tensors merged. */
static uint64_t merge(const char *pipe, const char *out, const char *lora, uint64_t chunk, int threads)
{
    struct convert_opts o;
    convert_opts_init(&o);
    const char *dirs[1] = {lora};
    o.device = DEVICE_CPU;
    o.chunk_elements = chunk;
    o.threads = threads;
    o.lora_dirs = dirs;
    o.nlora = 1;
    o.progress = PROGRESS_NONE;
    nf4_set_quiet(1);
    nf4_clear_error();
    struct convert_stats st;
    if (convert_run(pipe, out, &o, &st) != NF4_OK)
        fail_msg("convert %s --lora %s: %s", pipe, lora, nf4_last_error());
    return st.merged;
}

/* The merged transformer `got` against the case's expected files (with the
 * tolerance), and every other tensor against the base's, byte for byte. */
static void check_merged(const struct lokr_case *c, const char *got_dir)
{
    char *e32_path = tu_strdupf(DIFF "/%s.expected.safetensors", c->stem),
         *e64_path = tu_strdupf(DIFF "/%s.expected.fp64.safetensors", c->stem),
         *base_path = tu_strdupf("%s" WEIGHTS, c->pipeline);
    struct model *got;
    struct st_file *e32, *e64, *base;
    assert_int_equal(model_open_dir(got_dir, &got), NF4_OK);
    assert_int_equal(st_open(e32_path, &e32), NF4_OK);
    assert_int_equal(st_open(e64_path, &e64), NF4_OK);
    assert_int_equal(st_open(base_path, &base), NF4_OK);
    assert_int_equal(e32->count, c->merged);
    assert_int_equal(got->count, base->count);
    struct tally tally = {0};
    for (size_t i = 0; i < e32->count; i++)
        check_tensor(got, e32, e64, e32->tensors[i].name, 1, &tally);
    for (size_t i = 0; i < base->count; i++) {
        const struct st_tensor *b = &base->tensors[i];
        if (st_find(e32, b->name))
            continue;
        const struct model_tensor *g = model_find(got, b->name);
        assert_non_null(g);
        const uint64_t n = st_tensor_bytes(b);
        unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
        assert_int_equal(st_read(g->file, g->t, 0, x, n), NF4_OK);
        assert_int_equal(st_read(base, b, 0, y, n), NF4_OK);
        if (g->t->dtype != b->dtype || memcmp(x, y, n) != 0)
            fail_msg("%s: %s changed, but no LoKr module is on it", c->stem, b->name);
        free(x);
        free(y);
    }
    /* The README's bar: at least 99.9% of merged elements equal the fp32 merge. */
    if (tally.exact * 1000 < tally.merged * 999)
        fail_msg("%s: only %llu of %llu merged elements equal the fp32 merge", c->stem,
                 (unsigned long long)tally.exact, (unsigned long long)tally.merged);
    model_close(got);
    st_close(e32);
    st_close(e64);
    st_close(base);
    free(e32_path);
    free(e64_path);
    free(base_path);
}

/* Each fixture merged into its pipeline within the tolerance of PEFT's
 * merge; the same bytes in chunks of 7 elements on 3 threads, and from
 * diffusers' conversion of it. */
static void test_lokr_merges_as_peft(void **state)
{
    struct tu_scratch *s = *state;
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    char *out = tu_strdupf("%s/out", s->dir), *again = tu_strdupf("%s/again", s->dir);
    char *out_dir = tu_strdupf("%s/transformer", out);
    char *out_file = tu_strdupf("%s" WEIGHTS, out), *again_file = tu_strdupf("%s" WEIGHTS, again);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        const struct lokr_case *c = &CASES[i];
        char *file = tu_strdupf(DIFF "/%s.safetensors", c->stem),
             *converted = tu_strdupf(DIFF "/%s.diffusers.safetensors", c->stem);
        assert_int_equal(merge(c->pipeline, out, file, 0, 0), c->merged);
        check_merged(c, out_dir);
        assert_int_equal(merge(c->pipeline, again, file, 7, 3), c->merged);
        tu_assert_same_tensors(again_file, out_file);
        tu_rmtree(again);
        assert_int_equal(merge(c->pipeline, again, converted, 0, 0), c->merged);
        tu_assert_same_tensors(again_file, out_file);
        tu_rmtree(again);
        tu_rmtree(out);
        free(file);
        free(converted);
    }
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(out);
    free(again);
    free(out_dir);
    free(out_file);
    free(again_file);
}

/* A PEFT adapter folder of a LoKr (peft_type LOKR: decompose_both,
 * decompose_factor 8, a rank_pattern and an alpha_pattern) on a bnb-4bit
 * Llama: merged into the dequantized 4-bit weights within the tolerance of
 * PEFT's merge, every other tensor as the plain conversion writes it. */
static void test_peft_lokr_merges_as_peft(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/out", s->dir), *plain = tu_strdupf("%s/plain", s->dir);
    const char *base = FIXTURES "/lora/base-llama-bf16-bnb4";
    assert_int_equal(merge(base, out, FIXTURES "/lora/adapter-lokr", 0, 0), 6);
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.progress = PROGRESS_NONE;
    struct convert_stats st;
    assert_int_equal(convert_run(base, plain, &o, &st), NF4_OK);
    struct model *got, *pm;
    struct st_file *e32, *e64;
    assert_int_equal(model_open_dir(out, &got), NF4_OK);
    assert_int_equal(model_open_dir(plain, &pm), NF4_OK);
    assert_int_equal(st_open(FIXTURES "/lora/merged-lokr.expected.safetensors", &e32), NF4_OK);
    assert_int_equal(st_open(FIXTURES "/lora/merged-lokr.expected.fp64.safetensors", &e64), NF4_OK);
    assert_int_equal(got->count, pm->count);
    struct tally tally = {0};
    for (size_t i = 0; i < e32->count; i++)
        check_tensor(got, e32, e64, e32->tensors[i].name, 1, &tally);
    for (size_t i = 0; i < pm->count; i++) {
        const char *name = pm->tensors[i].t->name;
        if (st_find(e32, name))
            continue;
        const struct model_tensor *g = model_find(got, name), *p = &pm->tensors[i];
        assert_non_null(g);
        const uint64_t n = st_tensor_bytes(p->t);
        unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
        assert_int_equal(st_read(g->file, g->t, 0, x, n), NF4_OK);
        assert_int_equal(st_read(p->file, p->t, 0, y, n), NF4_OK);
        if (memcmp(x, y, n) != 0)
            fail_msg("%s: changed, but the LoKr is not on it", name);
        free(x);
        free(y);
    }
    if (tally.exact * 1000 < tally.merged * 999)
        fail_msg("only %llu of %llu merged elements equal the fp32 merge", (unsigned long long)tally.exact,
                 (unsigned long long)tally.merged);
    model_close(got);
    model_close(pm);
    st_close(e32);
    st_close(e64);
    tu_rmtree(out);
    tu_rmtree(plain);
    free(out);
    free(plain);
}

/* A PEFT LoKr folder whose config PEFT refuses, or under which PEFT's layers
 * would not take its factors: exit 65, one line naming the config or the
 * key, nothing written; and one without "alpha" takes LoKrConfig's. The
 * weights are adapter-lokr's. */
static void test_peft_lokr_configs(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *config, *want;
    } REFUSALS[] = {
        {"{\"peft_type\": \"LOKR\", \"r\": 2, \"alpha\": 6, \"decompose_both\": true, \"decompose_factor\": 8, "
         "\"rank_pattern\": {\"down_proj\": 8}, \"target_modules\": [\"o_proj\"]}",
         "targets none of the 6 modules its weights are for"},
        {"{\"peft_type\": \"LOKR\", \"r\": 0, \"alpha\": 6}", "\"r\" must be a whole number from 1 to 65536"},
        {"{\"peft_type\": \"LOKR\", \"r\": 2, \"alpha\": \"6\"}", "\"alpha\" must be a finite number"},
        {"{\"peft_type\": \"LOKR\", \"r\": 2, \"alpha\": 6, \"decompose_factor\": 4.0}",
         "\"decompose_factor\" must be a whole number"},
        /* without decompose_both PEFT builds W1 whole, where the file splits it */
        {"{\"peft_type\": \"LOKR\", \"r\": 2, \"alpha\": 6, \"decompose_factor\": 8, "
         "\"rank_pattern\": {\"down_proj\": 8}, \"target_modules\": [\"q_proj\", \"v_proj\", \"down_proj\"]}",
         "does not hold the factors PEFT's LoKr layer builds for model.layers.0.self_attn.q_proj"},
        /* another factorization: decompose_factor -1 */
        {"{\"peft_type\": \"LOKR\", \"r\": 2, \"alpha\": 6, \"decompose_both\": true, "
         "\"rank_pattern\": {\"down_proj\": 8}, \"target_modules\": [\"q_proj\", \"v_proj\", \"down_proj\"]}",
         "(r 8, decompose_factor -1, decompose_both)"},
    };
    char *adapter = tu_strdupf("%s/adapter", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *config = tu_strdupf("%s/adapter_config.json", adapter), *weights = tu_strdupf("%s/adapter_model.safetensors", adapter);
    assert_int_equal(mkdir(adapter, 0755), 0);
    size_t len = 0;
    char *bytes = tu_read_file(FIXTURES "/lora/adapter-lokr/adapter_model.safetensors", &len);
    tu_write_file(weights, bytes, len);
    free(bytes);
    for (size_t i = 0; i < sizeof REFUSALS / sizeof REFUSALS[0]; i++) {
        tu_write_file(config, REFUSALS[i].config, strlen(REFUSALS[i].config));
        struct tu_run r = tu_run("convert", "--device", "cpu", FIXTURES "/lora/base-llama-bf16-bnb4", out, "--lora",
                                 adapter, NULL);
        if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, REFUSALS[i].want) ||
            !strstr(r.err, adapter))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        tu_run_free(&r);
        assert_false(tu_exists(out));
    }
    /* Without "alpha", LoKrConfig's default, 8: scaling 4 at rank 2 */
    static const char NO_ALPHA[] = "{\"peft_type\": \"LOKR\", \"r\": 2, \"decompose_both\": true, "
                                   "\"decompose_factor\": 8, \"rank_pattern\": {\"down_proj\": 8}}";
    tu_write_file(config, NO_ALPHA, strlen(NO_ALPHA));
    struct tu_run r = tu_run("inspect", FIXTURES "/lora/base-llama-bf16-bnb4", "--lora", adapter, "--json", NULL);
    if (r.status != 0 || !strstr(r.out, "\"alpha\": 8,\n") || !strstr(r.out, "\"scaling\": 4,\n"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    tu_rmtree(adapter);
    free(adapter);
    free(out);
    free(config);
    free(weights);
}

/* A PEFT LoKr on the tied head is merged into the head written apart from
 * the embedding, as a LoRA on it is (config.json: tie_word_embeddings
 * false); one on the embedding is refused, as PEFT's LoKr refuses an
 * embedding. The factors: lm_head [512, 128] factored (16, 32) x (8, 16),
 * each whole at r 16; W1 0.5, W2 0.25, scaling 1: every element + 0.125. */
static void test_peft_lokr_tied_head_and_embedding(void **state)
{
    struct tu_scratch *s = *state;
    char *adapter = tu_strdupf("%s/adapter", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *config = tu_strdupf("%s/adapter_config.json", adapter), *weights = tu_strdupf("%s/adapter_model.safetensors", adapter);
    assert_int_equal(mkdir(adapter, 0755), 0);
    static const char HEAD[] = "{\"peft_type\": \"LOKR\", \"r\": 16, \"alpha\": 16, \"target_modules\": [\"lm_head\"]}";
    const struct synth_tensor head[] = {{"base_model.model.lm_head.lokr_w1", DT_F32, 16, 8, 0.5f},
                                        {"base_model.model.lm_head.lokr_w2", DT_F32, 32, 16, 0.25f}};
    tu_write_file(config, HEAD, strlen(HEAD));
    write_synth_file(weights, head, 2);
    assert_int_equal(merge(FIXTURES "/lora/base-llama-bf16-bnb4-tied", out, adapter, 0, 0), 1);
    struct model *got;
    assert_int_equal(model_open_dir(out, &got), NF4_OK);
    const struct model_tensor *h = model_find(got, "lm_head.weight"), *e = model_find(got, "model.embed_tokens.weight");
    assert_non_null(h);
    assert_non_null(e);
    uint16_t hv[512 * 128], ev[512 * 128];
    assert_int_equal(st_read(h->file, h->t, 0, hv, sizeof hv), NF4_OK);
    assert_int_equal(st_read(e->file, e->t, 0, ev, sizeof ev), NF4_OK);
    for (size_t i = 0; i < 512 * 128; i++)
        if (hv[i] != f32_to_bf16(bf16_to_f32(ev[i]) + 0.125f))
            fail_msg("lm_head.weight[%zu] = 0x%04x, the embedding's 0x%04x + 0.125", i, hv[i], ev[i]);
    char *cfg = tu_strdupf("%s/config.json", out), *text = tu_read_file(cfg, NULL);
    assert_non_null(strstr(text, "\"tie_word_embeddings\": false"));
    free(text);
    free(cfg);
    model_close(got);
    tu_rmtree(out);
    /* on the embedding: PEFT raises */
    static const char EMBED[] = "{\"peft_type\": \"LOKR\", \"r\": 16, \"alpha\": 16, \"target_modules\": [\"embed_tokens\"]}";
    const struct synth_tensor embed[] = {{"base_model.model.model.embed_tokens.lokr_w1", DT_F32, 16, 8, 0.5f},
                                         {"base_model.model.model.embed_tokens.lokr_w2", DT_F32, 32, 16, 0.25f}};
    tu_write_file(config, EMBED, strlen(EMBED));
    write_synth_file(weights, embed, 2);
    struct tu_run r = tu_run("convert", "--device", "cpu", FIXTURES "/lora/base-llama-bf16-bnb4", out, "--lora", adapter,
                             NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 ||
        !strstr(r.err, "embed_tokens.lokr_w1: is a LoKr on the embedding model.embed_tokens.weight"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    tu_rmtree(adapter);
    free(adapter);
    free(out);
    free(config);
    free(weights);
}

/* inspect lists each changed tensor as a LoKr's, the fused qkv's parts too. */
static void test_lokr_inspect(void **state)
{
    (void)state;
    struct tu_run r = tu_run("inspect", FLUX2_PIPE, "--lora", DIFF "/lora-flux2-lokr-bfl.safetensors", NULL);
    if (r.status != 0 || !strstr(r.out, "\n10 tensors changed by 1 adapter\n") ||
        !strstr(r.out, "transformer_blocks.0.attn.add_v_proj.weight") || !strstr(r.out, "(LoKr)"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    r = tu_run("inspect", FLUX2_PIPE, "--lora", DIFF "/lora-flux2-lokr-meta.safetensors", "--json", NULL);
    /* proj_out: rank_pattern 1, alpha 5: scaling 5 */
    if (r.status != 0 || !strstr(r.out, "\"lokr\": true") || !strstr(r.out, "\"scaling\": 5,"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
}

#define OUT0 "transformer.transformer_blocks.0.attn.to_out.0"
#define Q0 "transformer.transformer_blocks.0.attn.to_q"
#define BFL_PROJ "diffusion_model.double_blocks.0.img_attn.proj"

/* What diffusers raises on, or would load other factors for than the
 * file's: refused in one line naming the file and the key, nothing written,
 * no temp file left. Factors of [32, 32] layers by factorization(32) =
 * (4, 8): W1 [4, 4], W2 [8, 8]. */
static void test_lokr_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        int zimage; /* into the Z-Image pipeline, else Flux.2's */
        struct synth_tensor t[6];
        const char *meta, *want;
    } REFUSALS[] = {
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}, {OUT0 ".lokr_t2", DT_BF16, 2, 2, 1}},
         NULL, OUT0 ".lokr_t2: is a LoKr on a convolution (lokr_t2, use_effective_conv2d)"},
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}}, NULL,
         "holds LoKr keys of transformer.transformer_blocks.0.attn.to_out.0 without lokr_w2, or lokr_w2_a and "
         "lokr_w2_b: diffusers builds no config for it"},
        {0, {{OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}}, NULL, "without lokr_w1, or lokr_w1_a and lokr_w1_b"},
        /* factors PEFT's layer does not have: W2 [8, 7] would be [8, 8] */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 7, 1}}, NULL,
         OUT0 ".lokr_w1: does not hold the factors PEFT's LoKr layer builds for transformer_blocks.0.attn.to_out.0 "
         "[32, 32] (r 8, decompose_factor 4): lokr_w1 [4, 4] with lokr_w2 [8, 8]"},
        /* W2 split where PEFT, at rank 4 of sides of 8, builds it whole */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2_a", DT_BF16, 8, 4, 1},
             {OUT0 ".lokr_w2_b", DT_BF16, 4, 8, 1}}, NULL,
         "(r 4, decompose_factor 4): lokr_w1 [4, 4] with lokr_w2 [8, 8]"},
        /* W1 whole and split: decompose_both, rank 1 from lokr_w1_a, and PEFT splits both */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w1_a", DT_BF16, 4, 1, 1},
             {OUT0 ".lokr_w1_b", DT_BF16, 1, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}}, NULL,
         "(r 1, decompose_factor 4, decompose_both): lokr_w1_a [4, 1] and lokr_w1_b [1, 4] with lokr_w2_a [8, 1] and "
         "lokr_w2_b [1, 8]"},
        /* two modules no one decompose_factor factors both ways */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}, {Q0 ".lokr_w1", DT_BF16, 8, 8, 1},
             {Q0 ".lokr_w2", DT_BF16, 4, 4, 1}}, NULL, "holds LoKr factors whose shapes no one decompose_factor gives"},
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}, {Q0 ".lora_A.weight", DT_BF16, 2, 32, 1}},
         NULL, Q0 ".lora_A.weight: is a LoRA tensor, in a LoKr adapter"},
        {0, {{"transformer.transformer_blocks.7.attn.to_q.lokr_w1", DT_BF16, 4, 4, 1},
             {"transformer.transformer_blocks.7.attn.to_q.lokr_w2", DT_BF16, 8, 8, 1}}, NULL,
         "transformer.transformer_blocks.7.attn.to_q.lokr_w1: matches no floating-point tensor "
         "transformer_blocks.7.attn.to_q.weight in the base model"},
        {0, {{OUT0 ".lokr_w1", DT_F64, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}}, NULL, OUT0 ".lokr_w1: "},
        /* LoKrConfig(**metadata) raises TypeError on a LoRA config's key */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}},
         "{\"transformer.r\": 8, \"transformer.lora_alpha\": 8}",
         "holds \"lora_alpha\", which is no field of PEFT's LoKrConfig"},
        /* LoKrConfig(**metadata) without target_modules: PEFT finds no table for a diffusers model */
        {0, {{OUT0 ".lokr_w1", DT_BF16, 4, 4, 1}, {OUT0 ".lokr_w2", DT_BF16, 8, 8, 1}},
         "{\"transformer.r\": 8, \"transformer.alpha\": 8}", "has no target_modules"},
        /* a fused qkv and its part */
        {0, {{"transformer.transformer_blocks.0.attn.to_qkv.lokr_w1", DT_BF16, 8, 4, 1},
             {"transformer.transformer_blocks.0.attn.to_qkv.lokr_w2", DT_BF16, 12, 8, 1}, {Q0 ".lokr_w1", DT_BF16, 4, 4, 1},
             {Q0 ".lokr_w2", DT_BF16, 8, 8, 1}}, NULL,
         "to_qkv.lokr_w1: is a LoKr on a fused projection, for which diffusers fuses every attention's projections, "
         "and "},
        /* across blocks: diffusers fuses block 1 too, and computes it without its to_q's LoKr */
        {0, {{"transformer.transformer_blocks.0.attn.to_qkv.lokr_w1", DT_BF16, 8, 4, 1},
             {"transformer.transformer_blocks.0.attn.to_qkv.lokr_w2", DT_BF16, 12, 8, 1},
             {"transformer.transformer_blocks.1.attn.to_q.lokr_w1", DT_BF16, 4, 4, 1},
             {"transformer.transformer_blocks.1.attn.to_q.lokr_w2", DT_BF16, 8, 8, 1}}, NULL,
         "transformer_blocks.1.attn.to_q.lokr_w1 changes one of those, which the fused model does not compute with"},
        {0, {{BFL_PROJ ".lokr_w1", DT_BF16, 4, 4, 1}, {BFL_PROJ ".lokr_w2", DT_BF16, 8, 8, 1},
             {"diffusion_model.double_blocks.0.img_attn.norm.lokr_w1", DT_BF16, 4, 4, 1}}, NULL,
         "diffusion_model.double_blocks.0.img_attn.norm.lokr_w1: is left over where diffusers converts a Flux.2 LoKr "
         "in BFL's names"},
        {0, {{"diffusion_model.double_blocks.x.img_attn.proj.lokr_w1", DT_BF16, 4, 4, 1}}, NULL,
         "double_blocks.x.img_attn.proj.lokr_w1: has a block number diffusers' int() does not read"},
        {0, {{"lycoris_transformer_blocks_0_attn_norm_q.lokr_w1", DT_BF16, 4, 4, 1}}, NULL,
         "lycoris_transformer_blocks_0_attn_norm_q.lokr_w1: is not a key of a LyCORIS Flux.2 LoKr"},
        {0, {{BFL_PROJ ".alpha", DT_F32, 1, 0, 2}, {BFL_PROJ ".lokr_w2_a", DT_BF16, 8, 1, 1},
             {BFL_PROJ ".lokr_w2_b", DT_BF16, 1, 8, 1}}, NULL,
         BFL_PROJ ".alpha: is the alpha of a LoKr without lokr_w1 or lokr_w1_a to bake it into"},
        {0, {{BFL_PROJ ".alpha", DT_F32, 1, 0, INFINITY}, {BFL_PROJ ".lokr_w1", DT_BF16, 4, 4, 1},
             {BFL_PROJ ".lokr_w2_a", DT_BF16, 8, 1, 1}, {BFL_PROJ ".lokr_w2_b", DT_BF16, 1, 8, 1}}, NULL,
         BFL_PROJ ".alpha: is inf; an alpha is a finite number"},
        {0, {{BFL_PROJ ".alpha", DT_F32, 2, 0, 2}, {BFL_PROJ ".lokr_w1", DT_BF16, 4, 4, 1},
             {BFL_PROJ ".lokr_w2_a", DT_BF16, 8, 1, 1}, {BFL_PROJ ".lokr_w2_b", DT_BF16, 1, 8, 1}}, NULL,
         BFL_PROJ ".alpha: is not one number"},
        /* Z-Image's transformer has no fuse_qkv_projections: no to_qkv to load into */
        {1, {{"transformer.layers.0.attention.to_qkv.lokr_w1", DT_BF16, 8, 4, 1},
             {"transformer.layers.0.attention.to_qkv.lokr_w2", DT_BF16, 12, 8, 1}}, NULL,
         "matches no floating-point tensor layers.0.attention.to_qkv.weight in the base model"},
        {1, {{"diffusion_model.layers.0.attention.to_q.lokr_w1", DT_BF16, 4, 4, 1},
             {"diffusion_model.layers.0.attention.to_q.lokr_w2", DT_BF16, 8, 8, 1},
             {"diffusion_model.layers.0.attention.to_q.weight", DT_BF16, 4, 4, 1}}, NULL,
         "diffusion_model.layers.0.attention.to_q.weight: is not a LoKr key"},
    };
    char *lora = tu_strdupf("%s-lokr.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < sizeof REFUSALS / sizeof REFUSALS[0]; i++) {
        size_t n = 0;
        while (n < 6 && REFUSALS[i].t[n].name)
            n++;
        write_synth_file_with_config(lora, REFUSALS[i].t, n, REFUSALS[i].meta);
        struct tu_run r = tu_run("convert", "--device", "cpu", REFUSALS[i].zimage ? ZIMAGE_PIPE : FLUX2_PIPE, out,
                                 "--lora", lora, NULL);
        if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, REFUSALS[i].want) || !strstr(r.err, lora))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        tu_run_free(&r);
        assert_false(tu_exists(out));
        assert_int_equal(tu_count_entries(s->dir), 0);
    }
    unlink(lora);
    free(lora);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_factorization_as_peft),
        cmocka_unit_test_setup_teardown(test_lokr_converts_as_diffusers, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_lokr_merges_as_peft, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_peft_lokr_merges_as_peft, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_peft_lokr_configs, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_peft_lokr_tied_head_and_embedding, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test(test_lokr_inspect),
        cmocka_unit_test_setup_teardown(test_lokr_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
