/* Kohya Stable Diffusion 1.x and XL LoRAs (lora_sd.h) read as diffusers 0.42
 * loads them. Each test builds the LoRAs lora-sd-xl.digest and
 * lora-sd-1.digest list (make_sd_fixtures.py: the SGM UNet's names with both
 * text encoders and mixed alphas; diffusers' block names without alphas):
 * each converts to what the digests of diffusers' own conversion say, byte
 * for byte, and merges each module with the scaling PEFT gave it once
 * diffusers had loaded the file; a LoCon pair on a 3x3 convolution merges
 * as PEFT's Conv2d computes it; what diffusers raises on, or what nf4deq does
 * not merge, is refused with one line naming the key, nothing written, no
 * temp file left. lora-sd-old.digest's LoRA, in diffusers' names before
 * PEFT (lora_old_forms.h), is renamed as diffusers renames it, byte for
 * byte, and merges as the renamed one does. */
#include "test_util.h"

#include "lora_diffusers.h"
#include "lora_old_forms.h"
#include "lora_recipe.h"
#include "lora_synth.h"
#include "strutil.h"

#define SD_XL_DIGEST FIXTURES "/diffusers/lora-sd-xl.digest"
#define SD_1_DIGEST FIXTURES "/diffusers/lora-sd-1.digest"
#define SD_OLD_DIGEST FIXTURES "/diffusers/lora-sd-old.digest"
#define SD_UNET_CONFIG "{\"_class_name\": \"UNet2DConditionModel\", \"layers_per_block\": 2}"

/* The classes of Stable Diffusion 1.x, 2.x and XL's pipelines and UNet pick
 * the conversion; Stable Diffusion 3's have a loader of their own, which
 * converts no other form. */
static void test_sd_family(void **state)
{
    (void)state;
    static const char *const SD[] = {"StableDiffusionPipeline", "StableDiffusionXLPipeline",
                                     "StableDiffusionXLImg2ImgPipeline", "StableDiffusionControlNetPipeline",
                                     "AnimateDiffSDXLPipeline", "KolorsPipeline", "LatentConsistencyModelPipeline",
                                     "PIAPipeline", "StableUnCLIPPipeline", "UNet2DConditionModel"};
    for (size_t i = 0; i < sizeof SD / sizeof SD[0]; i++)
        assert_int_equal(diffusers_lora_family(SD[i]), LORA_FAMILY_STABLE_DIFFUSION);
    assert_int_equal(diffusers_lora_family("StableDiffusion3Pipeline"), LORA_FAMILY_OWN_FORM);
    assert_int_equal(diffusers_lora_family("SD3Transformer2DModel"), LORA_FAMILY_OWN_FORM);
}

/* `r` written to `path`, converted with the UNet config `config` (NULL:
 * none): it matches digest file `digest`, names `path`, leaves `dir` empty;
 * the conversion is written to `converted` (NULL: not) with its metadata. */
static void assert_sd_converts(struct recipe *r, const char *path, const char *config, const char *digest,
                               const char *dir, const char *converted)
{
    const uint64_t in = recipe_write(r, path, r->values, NULL, 0);
    assert_int_equal(setenv("TMPDIR", dir, 1), 0);
    struct model *m;
    if (diffusers_lora_open_for(path, LORA_FAMILY_STABLE_DIFFUSION, config, 0, &m) != NF4_OK)
        fail_msg("%s", nf4_last_error());
    assert_string_equal(m->files[0]->path, path);
    assert_matches_digest(m, digest, r->n, in);
    if (converted)
        write_model(m, converted, m->files[0]->meta, m->files[0]->nmeta);
    model_close(m);
    assert_int_equal(tu_count_entries(dir), 0);
}

/* Both LoRAs convert to what the digests say, byte for byte. The SGM names
 * need the UNet's config, as diffusers' do. */
static void test_sd_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe xl, sd1;
    recipe_read(&xl, SD_XL_DIGEST);
    recipe_read(&sd1, SD_1_DIGEST);
    char *path = tu_strdupf("%s-sd.safetensors", s->dir), *config = tu_strdupf("%s-unet.json", s->dir);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    assert_sd_converts(&xl, path, config, SD_XL_DIGEST, s->dir, NULL);
    assert_sd_converts(&sd1, path, config, SD_1_DIGEST, s->dir, NULL);
    assert_sd_converts(&sd1, path, NULL, SD_1_DIGEST, s->dir, NULL); /* no SGM names: no config needed */
    /* A key given twice is its last copy, as diffusers reads it. */
    static const char TWICE[] = "{\"layers_per_block\": 3, \"_class_name\": \"UNet2DConditionModel\", "
                                "\"layers_per_block\": 2}";
    tu_write_file(config, TWICE, strlen(TWICE));
    assert_sd_converts(&xl, path, config, SD_XL_DIGEST, s->dir, NULL);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    struct model *m = NULL;
    assert_int_equal(diffusers_lora_open_for(path, LORA_FAMILY_STABLE_DIFFUSION, config, 0, &m), NF4_OK);
    model_close(m);
    recipe_write(&xl, path, xl.values, NULL, 0);
    m = NULL;
    assert_int_equal(diffusers_lora_open_for(path, LORA_FAMILY_STABLE_DIFFUSION, NULL, 0, &m), NF4_EDATA);
    assert_non_null(strstr(nf4_last_error(), "layers_per_block"));
    assert_null(m);
    unlink(path);
    unlink(config);
    free(path);
    free(config);
}

/* A pipeline of class `cls` at `dir` for the converted LoRA `converted`:
 * unet/ (UNet2DConditionModel, layers_per_block 2), text_encoder/
 * (transformers 5's CLIPTextModel, without text_model.) and, where `xl`,
 * text_encoder_2/ (CLIPTextModelWithProjection, with it). */
static void write_sd_pipeline(const char *dir, const char *converted, const char *cls, int xl)
{
    struct model *m;
    assert_int_equal(model_open_file(converted, &m), NF4_OK);
    assert_int_equal(mkdir(dir, 0755), 0);
    char *index = tu_strdupf("%s/model_index.json", dir), *unet = tu_strdupf("%s/unet", dir),
         *te = tu_strdupf("%s/text_encoder", dir), *te2 = tu_strdupf("%s/text_encoder_2", dir),
         *json = tu_strdupf("{\"_class_name\": \"%s\", \"unet\": [\"diffusers\", \"UNet2DConditionModel\"], "
                            "\"text_encoder\": [\"transformers\", \"CLIPTextModel\"]%s}",
                            cls, xl ? ", \"text_encoder_2\": [\"transformers\", \"CLIPTextModelWithProjection\"]" : "");
    tu_write_file(index, json, strlen(json));
    write_component_base(m, unet, "unet.", NULL, SD_UNET_CONFIG, "diffusion_pytorch_model.safetensors");
    write_component_base(m, te, "text_encoder.", "text_model.", "{\"architectures\": [\"CLIPTextModel\"]}",
                         "model.safetensors");
    if (xl)
        write_component_base(m, te2, "text_encoder_2.", NULL, "{\"architectures\": [\"CLIPTextModelWithProjection\"]}",
                             "model.safetensors");
    model_close(m);
    free(index);
    free(unet);
    free(te);
    free(te2);
    free(json);
}

/* `inspect PIPE --lora LORA` lists each module the digest's scaling lines
 * name, with that scaling, and no other. */
static void assert_sd_scalings(const char *pipe, const char *lora, const char *digest)
{
    struct tu_run r = tu_run("inspect", pipe, "--lora", lora, NULL);
    if (r.status != 0)
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    char *want = tu_read_file(digest, NULL);
    assert_non_null(want);
    size_t wanted = 0, found = 0;
    for (const char *p = strstr(want, "\nscaling "); p; p = strstr(p + 1, "\nscaling "))
        wanted++;
    char component[64] = "";
    for (char *line = strtok(r.out, "\n"); line; line = strtok(NULL, "\n")) {
        char name[256], scaling[64], adapter[1024];
        unsigned rank;
        double alpha;
        if (sscanf(line, "== component %63[^:]:", component) == 1)
            continue;
        if (sscanf(line, "%255s %u %lf %63s %1023s", name, &rank, &alpha, scaling, adapter) != 5 ||
            strcmp(adapter, lora) != 0)
            continue;
        char *expect = tu_strdupf("\nscaling %s %s %s\n", component, name, scaling);
        if (!strstr(want, expect))
            fail_msg("%s: %s %s merged with scaling %s, which diffusers does not give it", digest, component, name,
                     scaling);
        free(expect);
        found++;
    }
    assert_int_equal(found, wanted);
    free(want);
    tu_run_free(&r);
}

/* Each module merges with the scaling diffusers gives it: the common alpha
 * where diffusers' alpha names fit no module (the UNet's attention, the text
 * encoders' attention, and the first text encoder's mlp under transformers
 * 5), the module's own elsewhere, its rank where the file has none. The
 * pipelines then convert. */
static void test_sd_lora_merges_as_diffusers_scales(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe xl, sd1;
    recipe_read(&xl, SD_XL_DIGEST);
    recipe_read(&sd1, SD_1_DIGEST);
    char *lora = tu_strdupf("%s/sd.safetensors", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *tmp = tu_strdupf("%s/tmp", s->dir), *config = tu_strdupf("%s/unet.json", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    for (int xl_pipe = 1; xl_pipe >= 0; xl_pipe--) {
        struct recipe *r = xl_pipe ? &xl : &sd1;
        const char *digest = xl_pipe ? SD_XL_DIGEST : SD_1_DIGEST;
        assert_sd_converts(r, lora, config, digest, tmp, converted);
        write_sd_pipeline(pipe, converted, xl_pipe ? "StableDiffusionXLPipeline" : "StableDiffusionPipeline", xl_pipe);
        assert_sd_scalings(pipe, lora, digest);
        /* the XL file's DoRA scale and its second text encoder's attention are left out, with a warning */
        assert_lora_converts(pipe, out, lora, xl_pipe ? 2 : 1);
        char *unet_out = tu_strdupf("%s/unet/diffusion_pytorch_model.safetensors", out),
             *unet_in = tu_strdupf("%s/unet/diffusion_pytorch_model.safetensors", pipe);
        assert_true(tensor_differs(unet_out, unet_in, "time_embedding.linear_1.weight"));
        free(unet_out);
        free(unet_in);
        tu_rmtree(pipe);
        tu_rmtree(out);
        unlink(converted);
    }
    unlink(lora);
    unlink(config);
    free(lora);
    free(converted);
    free(tmp);
    free(config);
    free(pipe);
    free(out);
}

/* One refusal: the pairs `pairs` (kohya module names, each [2, 8] and
 * [8, 2] BF16; "NAME:R" for rank R; "NAME@" for a down without its up),
 * the tensors `extra` as F32 [1] (alphas, strays), and `meta` (NULL: none). */
struct sd_case {
    const char *pairs[3];
    const char *extra;
    const char *meta;
    const char *want;
};

static void write_sd_case(const char *path, const struct sd_case *c)
{
    static struct recipe r;
    r.n = 0;
    r.values = FROM_1_TO_2;
    for (size_t i = 0; i < 3 && c->pairs[i]; i++) {
        char name[RECIPE_NAME_MAX], key[RECIPE_NAME_MAX + 32];
        unsigned rank = 2;
        snprintf(name, sizeof name, "%s", c->pairs[i]);
        char *colon = strchr(name, ':'), *lone = strchr(name, '@');
        if (colon) {
            rank = (unsigned)atoi(colon + 1);
            *colon = '\0';
        }
        if (lone)
            *lone = '\0';
        snprintf(key, sizeof key, "%s.lora_down.weight", name);
        recipe_add(&r, key, DT_BF16, 2, rank, 8);
        snprintf(key, sizeof key, "%s.lora_up.weight", name);
        if (!lone)
            recipe_add(&r, key, DT_BF16, 2, 8, rank);
    }
    if (c->extra)
        recipe_add(&r, c->extra, DT_F32, 1, 1, 0);
    const struct st_meta meta = {"lora_adapter_metadata", (char *)c->meta};
    recipe_write(&r, path, r.values, c->meta ? &meta : NULL, c->meta ? 1 : 0);
}

#define CONV_OUT 4
#define CONV_IN 3
#define CONV_K 3
#define CONV_RANK 2
#define CONV_MODULE "down_blocks.0.resnets.0.conv1"
#define CONV_KOHYA "lora_unet_down_blocks_0_resnets_0_conv1"

/* LoCon's factors of one 3x3 convolution, F32: down [r, in, 3, 3] holding
 * (k + 2i + 3h + 5w + 1) / 16, up [out, r, up_k, up_k] (1x1, or what
 * `up_k` says) holding (o + k + 1) / 8. Sums of their products are exact in
 * fp32, whatever the order. */
static void write_conv_lora(const char *path, uint64_t up_k)
{
    static const uint64_t DOWN[4] = {CONV_RANK, CONV_IN, CONV_K, CONV_K};
    const uint64_t up_shape[4] = {CONV_OUT, CONV_RANK, up_k, up_k};
    const struct st_out_tensor outs[2] = {
        {CONV_KOHYA ".lora_down.weight", DT_F32, 4, DOWN},
        {CONV_KOHYA ".lora_up.weight", DT_F32, 4, up_shape},
    };
    float down[CONV_RANK][CONV_IN][CONV_K][CONV_K], up[CONV_OUT * CONV_RANK * 9];
    for (int k = 0; k < CONV_RANK; k++)
        for (int i = 0; i < CONV_IN; i++)
            for (int h = 0; h < CONV_K; h++)
                for (int w = 0; w < CONV_K; w++)
                    down[k][i][h][w] = (float)(k + 2 * i + 3 * h + 5 * w + 1) / 16.0f;
    for (uint64_t e = 0; e < CONV_OUT * CONV_RANK * up_k * up_k; e++) {
        const uint64_t o = e / (CONV_RANK * up_k * up_k), k = e / (up_k * up_k) % CONV_RANK;
        up[e] = (float)(o + k + 1) / 8.0f;
    }
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, outs, 2, NULL, 0), NF4_OK);
    for (size_t k = 0; k < 2; k++) {
        const size_t i = st_writer_order(w, k);
        assert_int_equal(st_writer_write(w, i == 0 ? (const void *)down : (const void *)up,
                                         i == 0 ? sizeof down : CONV_OUT * CONV_RANK * up_k * up_k * sizeof(float)),
                         NF4_OK);
    }
    assert_int_equal(st_writer_finish(w), NF4_OK);
}

/* What diffusers raises on, or would load as nf4deq would not: one line
 * naming the file and key, exit 65, nothing written, no temp file left. */
static void test_sd_lora_refusals(void **state)
{
    struct tu_scratch *s = *state;
    static const struct sd_case CASES[] = {
        {{"lora_unet_down_blocks_1_attentions_0_proj_in@", NULL}, NULL, NULL,
         "proj_in.lora_down.weight: has no matching lora_up.weight"},
        {{"lora_unet_down_blocks_1_attentions_0_proj_in", NULL}, "lora_unet_down_blocks_1_attentions_0_proj_out.alpha",
         NULL, "proj_out.alpha: is no lora_down.weight, nor the lora_up.weight or alpha of one"},
        {{"lora_unet_middle_block_3_transformer_blocks_0_attn1_to_q", NULL}, NULL, NULL,
         "is of a middle block other than 0, 1 and 2"},
        {{"lora_unet_input_blocks_1_1_proj_in", "lora_unet_input_blocks_10_1_proj_in"}, NULL, NULL, "KeyError"},
        {{"lora_unet_input_blocks_x_1_proj_in", NULL}, NULL, NULL, "input_blocks_x_1_proj_in.lora_down.weight: has no "
         "block number"},
        {{"lora_unet_input_blocks_4_7_proj_in", NULL}, NULL, NULL, "an inner block number past diffusers' three"},
        {{"lora_unet_input_blocks_04_1_proj_in", NULL}, NULL, NULL, "is in no block diffusers maps it by"},
        {{"lora_te_text_model_encoder_layers_0_self_attn_q_proj", NULL}, NULL, NULL,
         "none of them is of an out_proj or mlp module"},
        {{"lora_unet_add_embedding_linear_1", "lora_unet_add_embedding_linear_2"}, NULL, NULL,
         "becomes unet.add.embedding.linear.lora_A.weight"},
        {{"lora_te2_text_model_encoder_layers_0_mlp_fc1", "lora_te2_text_projection:4"}, NULL, NULL,
         "text_projection.lora_down.weight: has rank 4, and diffusers builds text_projection with the "
         "text_encoder_2's common rank 2"},
        {{"lora_unet_mid_block_resnets_0_down_x", NULL}, NULL, NULL, "which are no LoRA pair of one module"},
        {{"lora_unet_down_blocks_1_attentions_0_proj_in", NULL}, "lora_unet_down_blocks_1_attentions_0_proj_in.alpha",
         "{\"unet.r\": 2}", "holds both alphas and a LoRA config"},
        {{"lora_unet_down_blocks_1_attentions_0_proj_in", NULL}, "lora_unet_down_blocks_1_attentions_0_proj_in.bias",
         NULL, "proj_in.bias: is no lora_down.weight"},
        {{"lora_te_text_model_encoder_layers_0_mlp_fc1", "lora_te_x_down_self_attn_out_proj"}, NULL, NULL,
         "x_down_self_attn_out_proj.lora_down.weight: becomes x.down.self_attn.out_proj.lora_A.weight and "
         "x.up.self_attn.out_proj.lora_B.weight, which are no LoRA pair of one module"},
        {{"lora_te_text_model_encoder_layers_0_mlp_layer_norm", NULL}, NULL, NULL,
         "none of them is of a module diffusers takes a rank from"},
        {{"lora_unet_output_blocks_2_0_emb_layers_1", "lora_unet_a_b_7_0_middle_block_output_blocks_2"}, NULL, NULL,
         "a_b_7_0_middle_block_output_blocks_2.lora_down.weight: is of a middle block other than 0, 1 and 2"},
        {{"lora_unet_time_embedding_emb_\xd9\xa3", NULL}, NULL, NULL, "holds a character outside ASCII"},
    };
    char *lora = tu_strdupf("%s-sd.safetensors", s->dir), *config = tu_strdupf("%s-unet.json", s->dir);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i <= sizeof CASES / sizeof CASES[0]; i++) {
        const char *want = "is 4-D; with " CONV_KOHYA ".lora_up.weight it is not a convolution's LoRA pair";
        if (i < sizeof CASES / sizeof CASES[0]) {
            write_sd_case(lora, &CASES[i]);
            want = CASES[i].want;
        } else {
            write_conv_lora(lora, 3); /* up with a 3x3 kernel: no LoRA PEFT makes */
        }
        struct model *m = NULL;
        nf4_clear_error();
        if (diffusers_lora_open_for(lora, LORA_FAMILY_STABLE_DIFFUSION, config, 0, &m) != NF4_EDATA ||
            !strstr(nf4_last_error(), want) || !strstr(nf4_last_error(), lora) || strchr(nf4_last_error(), '\n'))
            fail_msg("case %zu: %s", i, nf4_last_error());
        assert_null(m);
        assert_int_equal(tu_count_entries(s->dir), 0);
    }
    /* Through the command line, on a Stable Diffusion XL pipeline. */
    static struct recipe xl;
    recipe_read(&xl, SD_XL_DIGEST);
    char *tmp = tu_strdupf("%s/tmp", s->dir), *converted = tu_strdupf("%s/converted.safetensors", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_sd_converts(&xl, lora, config, SD_XL_DIGEST, tmp, converted);
    write_sd_pipeline(pipe, converted, "StableDiffusionXLPipeline", 1);
    write_sd_case(lora, &CASES[0]);
    assert_lora_refused(pipe, out, lora, CASES[0].want, tmp);
    tu_rmtree(pipe);
    /* The SGM names on a Stable Diffusion 1.x pipeline, whose loader does not map them. */
    write_sd_pipeline(pipe, converted, "StableDiffusionPipeline", 0);
    recipe_write(&xl, lora, xl.values, NULL, 0);
    assert_lora_refused(pipe, out, lora, "which diffusers maps only in Stable Diffusion XL's loader", tmp);
    tu_rmtree(pipe);
    unlink(converted);
    unlink(lora);
    unlink(config);
    free(lora);
    free(config);
    free(tmp);
    free(converted);
    free(pipe);
    free(out);
}

/* A LoCon LoRA on a 3x3 convolution of a UNet's folder merges as PEFT's
 * Conv2d computes its delta (B @ A, A seen as [r, in * 3 * 3]): each element
 * of the weight, 1, plus its exact delta, rounded once to BF16. */
static void test_sd_conv_lora_merged(void **state)
{
    struct tu_scratch *s = *state;
    char *unet = tu_strdupf("%s/unet", s->dir), *lora = tu_strdupf("%s/locon.safetensors", s->dir),
         *out = tu_strdupf("%s/out", s->dir), *config = tu_strdupf("%s/config.json", unet),
         *weights = tu_strdupf("%s/diffusion_pytorch_model.safetensors", unet),
         *merged = tu_strdupf("%s/diffusion_pytorch_model.safetensors", out);
    static const uint64_t SHAPE[4] = {CONV_OUT, CONV_IN, CONV_K, CONV_K};
    const struct st_out_tensor weight = {CONV_MODULE ".weight", DT_BF16, 4, SHAPE};
    uint16_t ones[CONV_OUT * CONV_IN * CONV_K * CONV_K];
    for (size_t e = 0; e < sizeof ones / sizeof ones[0]; e++)
        ones[e] = 0x3f80; /* 1.0 */
    assert_int_equal(mkdir(unet, 0755), 0);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, weights, &weight, 1, NULL, 0), NF4_OK);
    assert_int_equal(st_writer_write(w, ones, sizeof ones), NF4_OK);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    write_conv_lora(lora, 1);
    assert_lora_converts(unet, out, lora, 1);
    struct st_file *f;
    assert_int_equal(st_open(merged, &f), NF4_OK);
    const struct st_tensor *t = st_find(f, CONV_MODULE ".weight");
    assert_non_null(t);
    assert_int_equal(t->ndim, 4);
    uint16_t got[CONV_OUT * CONV_IN * CONV_K * CONV_K];
    assert_int_equal(st_read(f, t, 0, got, sizeof got), NF4_OK);
    for (int o = 0; o < CONV_OUT; o++)
        for (int i = 0; i < CONV_IN; i++)
            for (int h = 0; h < CONV_K; h++)
                for (int x = 0; x < CONV_K; x++) { /* no alpha: scaling 1 */
                    float delta = 0;
                    for (int k = 0; k < CONV_RANK; k++)
                        delta += (float)(o + k + 1) / 8.0f * (float)(k + 2 * i + 3 * h + 5 * x + 1) / 16.0f;
                    unsigned char want[2];
                    f32_to_element(DT_BF16, want, 0, 1.0f + delta);
                    const size_t e = (size_t)((o * CONV_IN + i) * CONV_K + h) * CONV_K + (size_t)x;
                    if (memcmp(&got[e], want, 2) != 0)
                        fail_msg("[%d, %d, %d, %d]: %04x, want %02x%02x", o, i, h, x, got[e], want[1], want[0]);
                }
    st_close(f);
    tu_rmtree(unet);
    tu_rmtree(out);
    unlink(lora);
    free(unet);
    free(lora);
    free(out);
    free(config);
    free(weights);
    free(merged);
}

/* A file whose lora_adapter_metadata is "" or "null", which diffusers reads
 * as no config: the alphas' config takes its place, once; whitespace alone
 * is kept, and refused as no config. */
static void test_sd_lora_empty_config_replaced(void **state)
{
    struct tu_scratch *s = *state;
    char *lora = tu_strdupf("%s-sd.safetensors", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    static const char *const EMPTY[] = {"", "null", " null\n"};
    for (size_t i = 0; i < sizeof EMPTY / sizeof EMPTY[0]; i++) {
        const struct sd_case c = {{"lora_unet_down_blocks_1_attentions_0_proj_in", NULL},
                                  "lora_unet_down_blocks_1_attentions_0_proj_in.alpha", EMPTY[i], NULL};
        write_sd_case(lora, &c);
        struct model *m = NULL;
        if (diffusers_lora_open_for(lora, LORA_FAMILY_STABLE_DIFFUSION, NULL, 0, &m) != NF4_OK)
            fail_msg("\"%s\": %s", EMPTY[i], nf4_last_error());
        size_t configs = 0;
        for (size_t k = 0; k < m->files[0]->nmeta; k++)
            if (strcmp(m->files[0]->meta[k].key, "lora_adapter_metadata") == 0) {
                configs++;
                assert_non_null(strstr(m->files[0]->meta[k].value, "\"unet.lora_alpha\""));
            }
        assert_int_equal(configs, 1);
        model_close(m);
        assert_int_equal(tu_count_entries(s->dir), 0);
    }
    /* Whitespace alone is no JSON, on which diffusers' json.loads raises: the
     * file's config, kept and refused where it is read (diffusers_lora_config). */
    const struct sd_case blank = {{"lora_unet_down_blocks_1_attentions_0_proj_in", NULL}, NULL, "  ", NULL};
    write_sd_case(lora, &blank);
    struct model *m = NULL;
    assert_int_equal(diffusers_lora_open_for(lora, LORA_FAMILY_STABLE_DIFFUSION, NULL, 0, &m), NF4_OK);
    assert_string_equal(diffusers_lora_metadata(m), "  ");
    struct lora_config c;
    assert_int_equal(diffusers_lora_config(m, "unet.", 0, &c), NF4_EDATA);
    lora_config_free(&c);
    model_close(m);
    unlink(lora);
    free(lora);
}

/* The LoRA lora-sd-old.digest lists, written to `lora`, opened as a
 * pipeline's component opens it and renamed for each component. */
static struct model *open_old_forms(struct recipe *r, const char *lora)
{
    recipe_read(r, SD_OLD_DIGEST);
    const uint64_t in = recipe_write(r, lora, r->values, NULL, 0);
    struct model *m;
    assert_int_equal(diffusers_lora_open_own_form(lora, &m), NF4_OK);
    static const char *const COMPONENTS[] = {"unet.", "text_encoder.", "text_encoder_2."};
    for (size_t i = 0; i < sizeof COMPONENTS / sizeof COMPONENTS[0]; i++)
        if (diffusers_lora_old_names(m, COMPONENTS[i]) != NF4_OK)
            fail_msg("%s", nf4_last_error());
    assert_matches_digest(m, SD_OLD_DIGEST, r->n, in);
    return m;
}

/* A Stable Diffusion XL LoRA in diffusers' names before PEFT (attention
 * processors' to_q_lora, LoRACompatibleLinear's and ...Conv's .lora, the
 * text encoders' to_out_lora and lora_linear_layer): renamed as diffusers
 * renames it, byte for byte, the second text encoder's to_k_lora left out
 * (no to_out_lora beside it), each module merged with scaling 1 (no
 * alphas), and the pipeline converted exactly as with the same LoRA in
 * PEFT's names. */
static void test_sd_old_forms_renamed_as_diffusers(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe old;
    char *lora = tu_strdupf("%s/old.safetensors", s->dir), *peft = tu_strdupf("%s/peft.safetensors", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *want = tu_strdupf("%s/want", s->dir);
    struct model *m = open_old_forms(&old, lora);
    write_model(m, peft, NULL, 0);
    model_close(m);
    write_sd_pipeline(pipe, peft, "StableDiffusionXLPipeline", 1);
    assert_sd_scalings(pipe, lora, SD_OLD_DIGEST);
    assert_lora_converts(pipe, out, lora, 2); /* the warning, and the summary */
    assert_lora_converts(pipe, want, peft, 1);
    static const char *const FILES[] = {"unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                                        "text_encoder_2/model.safetensors"};
    for (size_t i = 0; i < sizeof FILES / sizeof FILES[0]; i++) {
        char *got = tu_strdupf("%s/%s", out, FILES[i]), *expect = tu_strdupf("%s/%s", want, FILES[i]),
             *base = tu_strdupf("%s/%s", pipe, FILES[i]);
        tu_assert_same_tensors(got, expect);
        assert_true(tu_sh_status("cmp -s %s %s", got, base) != 0); /* each component changed */
        /* each component's folder converted alone reads the LoRA as its pipeline does */
        char *folder = tu_strdupf("%s/%.*s", pipe, (int)(strchr(FILES[i], '/') - FILES[i]), FILES[i]),
             *alone = tu_strdupf("%s/alone", s->dir),
             *alone_file = tu_strdupf("%s/%s", alone, strchr(FILES[i], '/') + 1);
        struct tu_run r = tu_run("convert", "--device", "cpu", folder, alone, "--lora", lora, NULL);
        if (r.status != 0)
            fail_msg("%s: exit %d, stderr: %s", folder, r.status, r.err);
        tu_run_free(&r);
        tu_assert_same_tensors(alone_file, got);
        tu_rmtree(alone);
        free(folder);
        free(alone);
        free(alone_file);
        free(got);
        free(expect);
        free(base);
    }
    tu_rmtree(pipe);
    tu_rmtree(out);
    tu_rmtree(want);
    unlink(lora);
    unlink(peft);
    free(lora);
    free(peft);
    free(pipe);
    free(out);
    free(want);
}

/* One older-form refusal: tensors `names` (each [2, 8] or [8, 2] BF16 as
 * its name says down or up), and the message. */
struct old_case {
    const char *names[4];
    const char *want;
};

/* What diffusers refuses in the older forms, or loads two ways: one line
 * naming the file and key, exit 65, nothing written. */
static void test_sd_old_forms_refused(void **state)
{
    struct tu_scratch *s = *state;
    static const struct old_case CASES[] = {
        {{"text_encoder.text_model.encoder.layers.0.mlp.fc1.lora.down.weight",
          "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora.up.weight"},
         "is a text_encoder key, and neither it nor any other of them is in a form diffusers tells"},
        {{"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.down.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.up.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q_lora.down.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q_lora.up.weight"},
         "attn1.processor.to_q_lora.down.weight and unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1."
         "to_q_lora.down.weight both become unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A."
         "weight once renamed"},
        {{"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.down.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.up.weight"},
         "to_k_lora.down.weight: is in diffusers' names before PEFT, but the first of the component's keys"},
        {{"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.down.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.up.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.alpha"},
         "to_q_lora.alpha: is an alpha among keys in diffusers' names before PEFT"},
        /* renamed, then refused: named as in the file */
        {{"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.down.weight",
          "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.up.weight"},
         "attn2.processor.to_k_lora.down.weight (converted to unet.down_blocks.1.attentions.0.transformer_blocks.0."
         "attn2.to_k.lora_A.weight): B @ A is 8x8 but the base tensor"},
    };
    static struct recipe old;
    char *lora = tu_strdupf("%s/old.safetensors", s->dir), *peft = tu_strdupf("%s/peft.safetensors", s->dir),
         *pipe = tu_strdupf("%s/pipe", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *tmp = tu_strdupf("%s/tmp", s->dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    assert_int_equal(setenv("TMPDIR", tmp, 1), 0);
    struct model *m = open_old_forms(&old, lora);
    write_model(m, peft, NULL, 0);
    model_close(m);
    write_sd_pipeline(pipe, peft, "StableDiffusionXLPipeline", 1);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        static struct recipe r;
        r.n = 0;
        r.values = FROM_1_TO_2;
        for (size_t k = 0; k < 4 && CASES[i].names[k]; k++) {
            const int up = strstr(CASES[i].names[k], ".up.") || strstr(CASES[i].names[k], "lora_B");
            if (str_ends_with(CASES[i].names[k], ".alpha"))
                recipe_add(&r, CASES[i].names[k], DT_F32, 1, 1, 0);
            else
                recipe_add(&r, CASES[i].names[k], DT_BF16, 2, up ? 8 : 2, up ? 2 : 8);
        }
        recipe_write(&r, lora, r.values, NULL, 0);
        assert_lora_refused(pipe, out, lora, CASES[i].want, tmp);
    }
    tu_rmtree(pipe);
    unlink(lora);
    unlink(peft);
    free(lora);
    free(peft);
    free(pipe);
    free(out);
    free(tmp);
}

#define MANY_BLOCKS 7
#define MANY_LAYERS 30

/* A LoRA of many ranks and alphas, as kohya's resized ("dynamic rank")
 * LoRAs are: 210 feed-forwards of ranks 1 to 3 and alphas 1 to 5, whose
 * config names most of them in rank_pattern and alpha_pattern. Each merges
 * with its own alpha over its own rank (diffusers' alpha names fit a
 * feed-forward), none refused for the patterns' size. */
static void test_sd_lora_of_many_ranks(void **state)
{
    struct tu_scratch *s = *state;
    char *unet = tu_strdupf("%s/unet", s->dir), *lora = tu_strdupf("%s/many.safetensors", s->dir),
         *config = tu_strdupf("%s/config.json", unet), *weights = tu_strdupf("%s/diffusion_pytorch_model.safetensors", unet);
    static struct recipe r;
    static char names[MANY_BLOCKS * MANY_LAYERS][RECIPE_NAME_MAX];
    static uint64_t shapes[MANY_BLOCKS * MANY_LAYERS][2];
    static struct st_out_tensor outs[MANY_BLOCKS * MANY_LAYERS];
    r.n = 0;
    r.values = FROM_1_TO_2;
    for (int i = 0; i < MANY_BLOCKS * MANY_LAYERS; i++) {
        const int b = i / MANY_LAYERS, t = i % MANY_LAYERS;
        char key[RECIPE_NAME_MAX];
        snprintf(key, sizeof key, "lora_unet_down_blocks_%d_attentions_0_transformer_blocks_%d_ff_net_2.lora_down.weight",
                 b, t);
        recipe_add(&r, key, DT_BF16, 2, (uint64_t)(1 + i % 3), 4);
        snprintf(key, sizeof key, "lora_unet_down_blocks_%d_attentions_0_transformer_blocks_%d_ff_net_2.lora_up.weight",
                 b, t);
        recipe_add(&r, key, DT_BF16, 2, 4, (uint64_t)(1 + i % 3));
        snprintf(key, sizeof key, "lora_unet_down_blocks_%d_attentions_0_transformer_blocks_%d_ff_net_2.alpha", b, t);
        struct recipe_tensor *alpha = recipe_add(&r, key, DT_F32, 0, 0, 0);
        alpha->fixed = 1;
        alpha->value = (float)(1 + i % 5);
        snprintf(names[i], sizeof names[i], "down_blocks.%d.attentions.0.transformer_blocks.%d.ff.net.2.weight", b, t);
        shapes[i][0] = shapes[i][1] = 4;
        outs[i] = (struct st_out_tensor){names[i], DT_BF16, 2, shapes[i]};
    }
    recipe_write(&r, lora, r.values, NULL, 0);
    assert_int_equal(mkdir(unet, 0755), 0);
    tu_write_file(config, SD_UNET_CONFIG, strlen(SD_UNET_CONFIG));
    struct st_writer *w;
    uint16_t ones[16];
    for (int e = 0; e < 16; e++)
        ones[e] = 0x3f80;
    assert_int_equal(st_writer_begin(&w, weights, outs, MANY_BLOCKS * MANY_LAYERS, NULL, 0), NF4_OK);
    for (int k = 0; k < MANY_BLOCKS * MANY_LAYERS; k++)
        assert_int_equal(st_writer_write(w, ones, sizeof ones), NF4_OK);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    struct tu_run run = tu_run("inspect", unet, "--lora", lora, NULL);
    if (run.status != 0)
        fail_msg("exit %d, stderr: %s", run.status, run.err);
    size_t checked = 0;
    for (char *line = strtok(run.out, "\n"); line; line = strtok(NULL, "\n")) {
        int b, t;
        unsigned rank;
        double alpha, scaling;
        if (sscanf(line, "down_blocks.%d.attentions.0.transformer_blocks.%d.ff.net.2.weight %u %lf %lf", &b, &t, &rank,
                   &alpha, &scaling) != 5)
            continue;
        const int i = b * MANY_LAYERS + t;
        if (rank != (unsigned)(1 + i % 3) || alpha != (double)(1 + i % 5) ||
            (float)scaling != (float)((double)(1 + i % 5) / (1 + i % 3)))
            fail_msg("%s: want rank %d, alpha %d", line, 1 + i % 3, 1 + i % 5);
        checked++;
    }
    assert_int_equal(checked, MANY_BLOCKS * MANY_LAYERS);
    tu_run_free(&run);
    tu_rmtree(unet);
    unlink(lora);
    free(unet);
    free(lora);
    free(config);
    free(weights);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sd_family),
        cmocka_unit_test_setup_teardown(test_sd_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_lora_merges_as_diffusers_scales, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_lora_refusals, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_conv_lora_merged, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_lora_of_many_ranks, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_lora_empty_config_replaced, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_old_forms_renamed_as_diffusers, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_sd_old_forms_refused, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
