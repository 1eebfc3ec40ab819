/* Every checkpoint layout a user brings, and nf4deq in a shell pipeline:
 * diffusers components and pipelines, any index prefix, ambiguous
 * directories, the Hugging Face cache, standard input and output, and the
 * --json reports. */
#include "test_util.h"

#include <cJSON.h>
#include <limits.h>

#include "hf_cache.h"

#define DIFFUSERS FIXTURES "/diffusers"
#define FLUX DIFFUSERS "/tiny-flux-bnb4"
#define FLUX_TRANSFORMER_EXPECTED DIFFUSERS "/tiny-flux-bnb4.transformer.expected.safetensors"
#define FLUX_T5_EXPECTED DIFFUSERS "/tiny-flux-bnb4.text_encoder_2.expected.safetensors"
#define BNB4 FIXTURES "/tensors.bnb4.safetensors"
#define LORA_FIXTURES FIXTURES "/lora"
#define COMMIT "0123456789abcdef0123456789abcdef01234567"
#define COMMIT2 "89abcdef0123456789abcdef0123456789abcdef"

static void assert_same_file(const char *got, const char *want)
{
    size_t a_len = 0, b_len = 0;
    char *a = tu_read_file(got, &a_len), *b = tu_read_file(want, &b_len);
    if (a_len != b_len || memcmp(a, b, a_len) != 0)
        fail_msg("%s differs from %s", got, want);
    free(a);
    free(b);
}

/* Header length, header JSON without __metadata__, and the data section. */
static cJSON *split_safetensors(const char *path, char **file, size_t *len, uint64_t *data_at)
{
    *file = tu_read_file(path, len);
    assert_true(*len >= 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | (unsigned char)(*file)[i];
    assert_true(n <= *len - 8);
    cJSON *h = cJSON_ParseWithLength(*file + 8, (size_t)n);
    assert_non_null(h);
    cJSON_DeleteItemFromObjectCaseSensitive(h, "__metadata__");
    *data_at = 8 + n;
    return h;
}

/* Byte for byte where it can be: the same tensor entries (dtype, shape,
 * offsets) and the same data section. Only __metadata__ may differ: the
 * output keeps the input's, the expected files were written without. */
static void assert_same_but_metadata(const char *got, const char *want)
{
    char *a, *b;
    size_t a_len, b_len;
    uint64_t a_at, b_at;
    cJSON *ha = split_safetensors(got, &a, &a_len, &a_at), *hb = split_safetensors(want, &b, &b_len, &b_at);
    if (!cJSON_Compare(ha, hb, 1))
        fail_msg("%s: the tensor entries of its header differ from %s's", got, want);
    if (a_len - a_at != b_len - b_at || memcmp(a + a_at, b + b_at, a_len - a_at) != 0)
        fail_msg("%s: its data section differs from %s's", got, want);
    cJSON_Delete(ha);
    cJSON_Delete(hb);
    free(a);
    free(b);
}

/* A config.json as the input had it, with quantization_config and nothing else removed. */
static void assert_config_is_input_without_quantization(const char *got, const char *input)
{
    char *g = tu_read_file(got, NULL), *i = tu_read_file(input, NULL);
    cJSON *jg = cJSON_Parse(g), *ji = cJSON_Parse(i);
    assert_non_null(jg);
    assert_non_null(ji);
    assert_null(cJSON_GetObjectItemCaseSensitive(jg, "quantization_config"));
    cJSON_DeleteItemFromObjectCaseSensitive(ji, "quantization_config");
    if (!cJSON_Compare(jg, ji, 1))
        fail_msg("%s is not %s without quantization_config", got, input);
    cJSON_Delete(jg);
    cJSON_Delete(ji);
    free(g);
    free(i);
}

static void assert_no_quantization_config_below(const char *dir)
{
    char *cmd = tu_strdupf("grep -rl quantization_config %s --include=config.json", dir);
    FILE *p = popen(cmd, "r");
    char line[PATH_MAX];
    if (p && fgets(line, sizeof line, p))
        fail_msg("%s still has a quantization_config", line);
    pclose(p);
    free(cmd);
}

static void assert_converted_ok(struct tu_run *r)
{
    if (r->status != 0)
        fail_msg("exited %d: %s", r->status, r->err);
    tu_run_free(r);
}

/* ---- diffusers pipelines ---- */

/* A copy of the fixture pipeline with what real repositories also hold:
 * tokenizer and scheduler folders, a README, nested folders, and the
 * .cache/huggingface folder of `hf download --local-dir`. */
static char *pipeline_with_extras(const char *scratch)
{
    char *p = tu_strdupf("%s/flux-in", scratch);
    tu_sh("cp -r %s %s && chmod -R u+w %s", FLUX, p, p);
    tu_sh("mkdir -p %s/tokenizer_2/extra %s/scheduler %s/.cache/huggingface", p, p, p);
    tu_sh("printf '{\"model_max_length\": 512}\\n' > %s/tokenizer_2/tokenizer_config.json", p);
    tu_sh("printf 'spiece model bytes' > %s/tokenizer_2/spiece.model", p);
    tu_sh("printf 'nested' > %s/tokenizer_2/extra/notes.txt", p);
    tu_sh("printf '{\"_class_name\": \"FlowMatchEulerDiscreteScheduler\"}\\n' > %s/scheduler/scheduler_config.json", p);
    tu_sh("printf '# tiny flux\\n' > %s/README.md && printf 'x' > %s/.cache/huggingface/download.lock", p, p);
    return p;
}

static void test_pipeline_converts_components_and_copies_the_rest(void **state)
{
    struct tu_scratch *s = *state;
    char *in = pipeline_with_extras(s->dir), *out = tu_strdupf("%s/flux-out", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_converted_ok(&r);
    char *got = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", out);
    assert_same_but_metadata(got, FLUX_TRANSFORMER_EXPECTED);
    tu_assert_same_tensors(got, FLUX_TRANSFORMER_EXPECTED);
    free(got);
    got = tu_strdupf("%s/text_encoder_2/model.safetensors", out);
    assert_same_but_metadata(got, FLUX_T5_EXPECTED);
    free(got);
    /* The unquantized VAE, and every other file, byte for byte. */
    static const char *const COPIED[] = {
        "vae/diffusion_pytorch_model.safetensors", "vae/config.json", "model_index.json", "README.md",
        "tokenizer_2/tokenizer_config.json", "tokenizer_2/spiece.model", "tokenizer_2/extra/notes.txt",
        "scheduler/scheduler_config.json",
    };
    for (size_t i = 0; i < sizeof COPIED / sizeof COPIED[0]; i++) {
        char *a = tu_strdupf("%s/%s", out, COPIED[i]), *b = tu_strdupf("%s/%s", in, COPIED[i]);
        assert_same_file(a, b);
        free(a);
        free(b);
    }
    char *cache = tu_strdupf("%s/.cache", out);
    assert_false(tu_exists(cache));
    free(cache);
    /* diffusers' config keeps its keys exactly; no dtype keys are added to it. */
    char *a = tu_strdupf("%s/transformer/config.json", out), *b = tu_strdupf("%s/transformer/config.json", in);
    assert_config_is_input_without_quantization(a, b);
    free(a);
    free(b);
    assert_no_quantization_config_below(out);
    /* Only the input and the output are left in the scratch directory. */
    assert_int_equal(tu_count_entries(s->dir), 2);
    free(in);
    free(out);
}

static void test_pipeline_output_is_all_or_nothing(void **state)
{
    struct tu_scratch *s = *state;
    char *in = pipeline_with_extras(s->dir), *out = tu_strdupf("%s/flux-out", s->dir);
    /* A corrupt shard in the last component converted: nothing may be left. */
    tu_sh("printf 'garbage' > %s/transformer/diffusion_pytorch_model.safetensors", in);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_int_equal(r.status, NF4_EDATA);
    assert_non_null(strstr(r.err, "transformer/diffusion_pytorch_model.safetensors"));
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 1);
    free(in);
    free(out);
}

/* A modular pipeline (ModularPipeline.save_pretrained's
 * modular_model_index.json and no model_index.json) is a pipeline: its
 * components convert as a DiffusionPipeline's, its index is copied byte for
 * byte (diffusers loads the components a folder holds from the folder), and
 * inspect lists it as one, warning of a component the index takes from a
 * repository. A folder named like the index is no index. */
static void test_modular_pipeline_converts_as_a_pipeline(void **state)
{
    struct tu_scratch *s = *state;
    char *in = pipeline_with_extras(s->dir), *out = tu_strdupf("%s/flux-out", s->dir);
    static const char MODULAR_INDEX[] =
        "{\n  \"_blocks_class_name\": \"FluxAutoBlocks\",\n  \"_class_name\": \"FluxModularPipeline\",\n"
        "  \"scheduler\": [null, null, {\"pretrained_model_name_or_path\": null, \"subfolder\": \"\"}],\n"
        "  \"text_encoder\": [\"transformers\", \"CLIPTextModel\", {\"pretrained_model_name_or_path\": "
        "\"someone/flux-bnb-4bit\", \"subfolder\": \"text_encoder\"}],\n"
        "  \"transformer\": [\"diffusers\", \"FluxTransformer2DModel\", {\"pretrained_model_name_or_path\": "
        "\"someone/flux-bnb-4bit\", \"subfolder\": \"transformer\"}],\n"
        "  \"vae\": [\"diffusers\", \"AutoencoderKL\", {\"pretrained_model_name_or_path\": "
        "\"someone/flux-bnb-4bit\", \"subfolder\": \"vae\"}]\n}\n";
    char *index = tu_strdupf("%s/modular_model_index.json", in);
    tu_sh("rm %s/model_index.json", in);
    tu_write_file(index, MODULAR_INDEX, strlen(MODULAR_INDEX));
    free(index);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_converted_ok(&r);
    char *got = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", out);
    assert_same_but_metadata(got, FLUX_TRANSFORMER_EXPECTED);
    free(got);
    got = tu_strdupf("%s/text_encoder_2/model.safetensors", out);
    assert_same_but_metadata(got, FLUX_T5_EXPECTED);
    free(got);
    char *a = tu_strdupf("%s/modular_model_index.json", out), *b = tu_strdupf("%s/modular_model_index.json", in);
    assert_same_file(a, b);
    free(a);
    free(b);
    assert_no_quantization_config_below(out);
    r = tu_run("inspect", in, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "pipeline: 3 components (2 converted, 1 copied)"));
    /* The index takes text_encoder from a repository, which the folder does
     * not hold: a converted pipeline would load it from there, and the
     * warning says so (naming no component the folder holds). */
    if (!strstr(r.err, "modular_model_index.json: takes text_encoder from the repositories it names "
                       "(someone/flux-bnb-4bit...)") || tu_lines(r.err) != 1)
        fail_msg("%s", r.err);
    tu_run_free(&r);
    tu_rmtree(out);
    /* An index that links outside the pipeline, which nf4deq copies no file
     * from: refused, as OUT would be no pipeline without it. */
    tu_sh("mv %s/modular_model_index.json %s/index-outside.json && ln -s %s/index-outside.json "
          "%s/modular_model_index.json", in, s->dir, s->dir, in);
    r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    if (r.status != NF4_EDATA || tu_lines(r.err) != 1 || !strstr(r.err, "modular_model_index.json: is the pipeline's index"))
        fail_msg("exit %d: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    tu_sh("rm %s/modular_model_index.json %s/index-outside.json && mkdir %s/modular_model_index.json", in, s->dir, in);
    r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_int_equal(r.status, NF4_ENOINPUT);
    assert_non_null(strstr(r.err, "is not a model directory"));
    tu_run_free(&r);
    assert_false(tu_exists(out));
    free(in);
    free(out);
}

/* "out/" is the directory out; an OUT inside IN is refused before anything is written. */
static void test_trailing_slash_and_out_inside_in(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/flux/", s->dir), *in = tu_strdupf("%s/in", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", FLUX, out, NULL);
    assert_converted_ok(&r);
    char *vae = tu_strdupf("%s/flux/vae/config.json", s->dir);
    assert_true(tu_exists(vae));
    free(vae);
    assert_int_equal(tu_count_entries(s->dir), 1); /* no lock or temp named after "" */
    tu_sh("cp -r %s %s && chmod -R u+w %s", FLUX, in, in);
    char *inside = tu_strdupf("%s/converted", in);
    r = tu_run("convert", "-q", in, inside, NULL);
    assert_int_equal(r.status, NF4_EUSAGE);
    assert_non_null(strstr(r.err, "inside the input directory"));
    tu_run_free(&r);
    assert_false(tu_exists(inside));
    free(inside);
    free(in);
    free(out);
}

static void test_pipeline_refuses_lora_and_stdout(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/flux-out", s->dir);
    struct tu_run r = tu_run("convert", "--lora", FIXTURES "/lora/adapter-r8-all-linear", FLUX, out, NULL);
    assert_int_equal(r.status, NF4_EUSAGE);
    assert_non_null(strstr(r.err, "transformer"));
    tu_run_free(&r);
    assert_int_equal(tu_sh_status("%s convert %s - > %s/x 2>/dev/null", NF4DEQ_BIN, FLUX, s->dir), NF4_EUSAGE);
    char *x = tu_strdupf("%s/x", s->dir);
    struct stat st;
    assert_int_equal(stat(x, &st), 0);
    assert_int_equal(st.st_size, 0);
    free(x);
    free(out);
}

static void test_inspect_shows_components_and_totals(void **state)
{
    (void)state;
    struct tu_run r = tu_run("inspect", "--json", FLUX, NULL);
    assert_int_equal(r.status, 0);
    /* jq's layout: two-space indentation, "key": value. */
    assert_true(strncmp(r.out, "{\n  \"pipeline\": ", 16) == 0);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    const cJSON *comps = cJSON_GetObjectItemCaseSensitive(root, "components");
    assert_int_equal(cJSON_GetArraySize(comps), 3);
    static const char *const NAMES[] = {"text_encoder_2", "transformer", "vae"};
    static const char *const ACTIONS[] = {"convert", "convert", "copy"};
    static const int QUANTIZED[] = {10, 30, 0};
    double tensors = 0;
    for (int i = 0; i < 3; i++) {
        const cJSON *c = cJSON_GetArrayItem(comps, i);
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(c, "name")->valuestring, NAMES[i]);
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(c, "action")->valuestring, ACTIONS[i]);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "totals");
        assert_int_equal(cJSON_GetObjectItemCaseSensitive(t, "quantized_weights")->valuedouble, QUANTIZED[i]);
        tensors += cJSON_GetObjectItemCaseSensitive(t, "tensors")->valuedouble;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "totals");
    assert_true(cJSON_GetObjectItemCaseSensitive(t, "tensors")->valuedouble == tensors);
    assert_int_equal(cJSON_GetObjectItemCaseSensitive(t, "converted_components")->valuedouble, 2);
    cJSON_Delete(root);
    tu_run_free(&r);
    r = tu_run("inspect", FLUX, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "== component vae: no 4-bit weights, copied as it is =="));
    assert_non_null(strstr(r.out, "pipeline: 3 components (2 converted, 1 copied)"));
    tu_run_free(&r);
}

/* ---- model directories of any prefix ---- */

static void test_diffusers_component_and_single_file_convert(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/transformer", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", FLUX "/transformer", out, NULL);
    assert_converted_ok(&r);
    char *got = tu_strdupf("%s/diffusion_pytorch_model.safetensors", out);
    assert_same_but_metadata(got, FLUX_TRANSFORMER_EXPECTED);
    free(got);
    char *file = tu_strdupf("%s/single.safetensors", s->dir);
    r = tu_run("convert", "-q", "--device", "cpu", DIFFUSERS "/tiny-flux-transformer.bnb4.safetensors", file, NULL);
    assert_converted_ok(&r);
    assert_same_but_metadata(file, FLUX_TRANSFORMER_EXPECTED);
    free(file);
    free(out);
}

static void test_index_of_any_prefix_keeps_its_names(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in", s->dir), *out = tu_strdupf("%s/out", s->dir);
    tu_sh("cp -r " FIXTURES "/tiny-llama-bf16-bnb4-sharded %s && chmod -R u+w %s", in, in);
    tu_sh("mv %s/model.safetensors.index.json %s/diffusion_pytorch_model.safetensors.index.json", in, in);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_converted_ok(&r);
    char *index = tu_strdupf("%s/diffusion_pytorch_model.safetensors.index.json", out);
    char *old = tu_strdupf("%s/model.safetensors.index.json", out);
    assert_true(tu_exists(index));
    assert_false(tu_exists(old));
    free(index);
    free(old);
    free(in);
    free(out);
}

static void test_several_unindexed_files_are_one_model(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in", s->dir), *out = tu_strdupf("%s/out", s->dir);
    tu_sh("mkdir %s && cp " BNB4 " %s/part-a.safetensors && cp " DIFFUSERS
       "/tiny-flux-transformer.bnb4.safetensors %s/part-b.safetensors", in, in, in);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", "--dtype", "bf16", in, out, NULL);
    assert_converted_ok(&r);
    char *a = tu_strdupf("%s/part-a.safetensors", out), *b = tu_strdupf("%s/part-b.safetensors", out);
    tu_assert_same_tensors(a, FIXTURES "/tensors.expected-bf16.safetensors");
    assert_same_but_metadata(b, FLUX_TRANSFORMER_EXPECTED);
    free(a);
    free(b);
    free(in);
    free(out);
}

static void test_ambiguous_directories_exit_65_naming_the_candidates(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in", s->dir), *out = tu_strdupf("%s/out", s->dir);
    /* Two indexes. */
    tu_sh("cp -r " FIXTURES "/tiny-llama-bf16-bnb4-sharded %s && chmod -R u+w %s", in, in);
    tu_sh("cp %s/model.safetensors.index.json %s/diffusion_pytorch_model.safetensors.index.json", in, in);
    struct tu_run r = tu_run("convert", "-q", in, out, NULL);
    assert_int_equal(r.status, NF4_EDATA);
    assert_int_equal(tu_lines(r.err), 1);
    assert_non_null(strstr(r.err, "diffusion_pytorch_model.safetensors.index.json"));
    assert_non_null(strstr(r.err, "model.safetensors.index.json and"));
    tu_run_free(&r);
    /* Two unindexed variants of one model (diffusers' fp16 variant files). */
    tu_sh("rm -rf %s && mkdir %s && cp " DIFFUSERS "/tiny-flux-transformer.bnb4.safetensors %s/diffusion_pytorch_model.safetensors"
       " && cp " DIFFUSERS "/tiny-flux-transformer.bnb4.safetensors %s/diffusion_pytorch_model.fp16.safetensors",
       in, in, in, in);
    r = tu_run("convert", "-q", in, out, NULL);
    assert_int_equal(r.status, NF4_EDATA);
    assert_non_null(strstr(r.err, "diffusion_pytorch_model.fp16.safetensors and diffusion_pytorch_model.safetensors"));
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 1);
    free(in);
    free(out);
}

/* ---- the Hugging Face cache ---- */

/* HUB/models--acme--tiny with refs/main and refs/v2, each snapshot's files
 * linked into blobs/ as the hub does. */
static char *fake_hub(const char *scratch)
{
    char *hub = tu_strdupf("%s/hub", scratch);
    char *repo = tu_strdupf("%s/models--acme--tiny", hub);
    tu_sh("mkdir -p %s/refs %s/blobs %s/snapshots/" COMMIT " %s/snapshots/" COMMIT2, repo, repo, repo, repo);
    tu_sh("cp " BNB4 " %s/blobs/1111 && ln -s ../../blobs/1111 %s/snapshots/" COMMIT "/model.safetensors", repo, repo);
    tu_sh("cp " DIFFUSERS "/tiny-flux-transformer.bnb4.safetensors %s/blobs/2222 && "
       "ln -s ../../blobs/2222 %s/snapshots/" COMMIT2 "/diffusion_pytorch_model.safetensors", repo, repo);
    tu_sh("printf '" COMMIT "' > %s/refs/main && printf '" COMMIT2 "\\n' > %s/refs/v2", repo, repo);
    /* A pipeline whose component files link into blobs/ too. */
    char *flux = tu_strdupf("%s/models--acme--flux", hub);
    tu_sh("mkdir -p %s/refs %s/blobs %s/snapshots/" COMMIT "/transformer %s/snapshots/" COMMIT "/vae", flux, flux, flux, flux);
    tu_sh("printf '" COMMIT "' > %s/refs/main", flux);
    static const char *const FILES[] = {"model_index.json", "transformer/config.json",
                                        "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
                                        "vae/diffusion_pytorch_model.safetensors"};
    for (int i = 0; i < 5; i++) {
        const char *up = strchr(FILES[i], '/') ? "../../../blobs" : "../../blobs";
        tu_sh("cp " FLUX "/%s %s/blobs/b%d && ln -s %s/b%d %s/snapshots/" COMMIT "/%s", FILES[i], flux, i, up, i, flux,
           FILES[i]);
    }
    free(flux);
    free(repo);
    return hub;
}

static void test_model_ids_resolve_in_the_cache(void **state)
{
    struct tu_scratch *s = *state;
    char *hub = fake_hub(s->dir), *out = tu_strdupf("%s/out", s->dir);
    unsetenv("HUGGINGFACE_HUB_CACHE"); /* whatever the caller's environment says */
    unsetenv("HF_HOME");
    unsetenv("XDG_CACHE_HOME");
    setenv("HF_HUB_CACHE", hub, 1);
    /* A file named as the ORG where the command runs does not make ORG/NAME a path. */
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    assert_int_equal(tu_sh_status("cd %s && : > acme && %s/%s inspect acme/tiny > /dev/null", s->dir, cwd,
                                  NF4DEQ_BIN), 0);
    tu_sh("rm %s/acme", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", "--dtype", "bf16", "acme/tiny", out, NULL);
    assert_converted_ok(&r);
    char *got = tu_strdupf("%s/model.safetensors", out);
    tu_assert_same_tensors(got, FIXTURES "/tensors.expected-bf16.safetensors");
    free(got);
    /* --revision: a branch with its refs/ file, then a commit hash. */
    static const char *const REVS[] = {"v2", COMMIT2};
    for (int i = 0; i < 2; i++) {
        char *o = tu_strdupf("%s/out-%d", s->dir, i);
        r = tu_run("convert", "-q", "--device", "cpu", "--revision", REVS[i], "acme/tiny", o, NULL);
        assert_converted_ok(&r);
        got = tu_strdupf("%s/diffusion_pytorch_model.safetensors", o);
        assert_same_but_metadata(got, FLUX_TRANSFORMER_EXPECTED);
        free(got);
        free(o);
    }
    /* A whole pipeline from the cache, links into blobs/ from sub-directories. */
    char *o = tu_strdupf("%s/flux", s->dir);
    r = tu_run("convert", "-q", "--device", "cpu", "acme/flux", o, NULL);
    assert_converted_ok(&r);
    got = tu_strdupf("%s/transformer/diffusion_pytorch_model.safetensors", o);
    assert_same_but_metadata(got, FLUX_TRANSFORMER_EXPECTED);
    free(got);
    got = tu_strdupf("%s/vae/diffusion_pytorch_model.safetensors", o);
    assert_same_file(got, FLUX "/vae/diffusion_pytorch_model.safetensors");
    free(got);
    free(o);
    /* Every variable huggingface_hub reads, each alone, with ~ and $VAR
     * expanded as it expands them; the cache moved where each one points. */
    unsetenv("HF_HUB_CACHE");
    const char *real_home = getenv("HOME");
    char *saved_home = real_home ? strdup(real_home) : NULL;
    setenv("HOME", s->dir, 1); /* ~ and $HOME: the scratch directory */
    setenv("NF4DEQ_TEST_SUB", "hfhome", 1);
    static const struct {
        const char *var, *value; /* value: "@" stands for the scratch directory */
        const char *dir;         /* where the hub goes, under the scratch directory */
    } PLACES[] = {
        {"HUGGINGFACE_HUB_CACHE", "@/legacy/hub", "legacy/hub"},
        {"HF_HOME", "@/hfhome", "hfhome/hub"},
        {"HF_HOME", "~/hfhome", "hfhome/hub"},
        {"HF_HOME", "$HOME/${NF4DEQ_TEST_SUB}/", "hfhome/hub"},
        {"HF_HUB_CACHE", "~/hfhome/hub", "hfhome/hub"},
        {"XDG_CACHE_HOME", "@/xdg", "xdg/huggingface/hub"},
        {NULL, NULL, ".cache/huggingface/hub"}, /* HOME alone */
    };
    char *at = strdup(hub);
    for (size_t i = 0; i < sizeof PLACES / sizeof *PLACES; i++) {
        char *to = tu_strdupf("%s/%s", s->dir, PLACES[i].dir);
        if (strcmp(at, to) != 0)
            tu_sh("mkdir -p %s && rmdir %s && mv %s %s", to, to, at, to);
        free(at);
        at = to;
        const char *v = PLACES[i].value;
        char *value = v && v[0] == '@' ? tu_strdupf("%s%s", s->dir, v + 1) : v ? strdup(v) : NULL;
        if (PLACES[i].var)
            setenv(PLACES[i].var, value, 1);
        r = tu_run("inspect", "acme/tiny", NULL);
        if (r.status != 0)
            fail_msg("%s=%s: exit %d: %s", PLACES[i].var ? PLACES[i].var : "HOME", value ? value : s->dir, r.status,
                     r.err);
        tu_run_free(&r);
        if (PLACES[i].var)
            unsetenv(PLACES[i].var);
        free(value);
    }
    /* huggingface_hub reads only the first cache that is set, and so does
     * nf4deq: the copy left in ~/.cache is not looked at once HF_HOME moves
     * the cache (it may be an older revision). */
    char *moved = tu_strdupf("%s/moved", s->dir);
    setenv("HF_HOME", moved, 1);
    r = tu_run("inspect", "acme/tiny", NULL);
    char *looked = tu_strdupf("(looked in %s/hub)", moved);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 || !strstr(r.err, looked))
        fail_msg("HF_HOME=%s with the model in ~/.cache: exit %d: %s", moved, r.status, r.err);
    tu_run_free(&r);
    unsetenv("HF_HOME");
    free(looked);
    free(moved);
    free(at);
    unsetenv("NF4DEQ_TEST_SUB");
    if (saved_home)
        setenv("HOME", saved_home, 1);
    free(saved_home);
    free(hub);
    free(out);
}

/* --lora ORG/NAME: an adapter downloaded with `hf download`, its files links
 * into blobs/, merges as the same adapter by its path does, and its tokenizer
 * (links into blobs/ too) is the output's; inspect finds it the same way. */
static void test_adapter_ids_resolve_in_the_cache(void **state)
{
    struct tu_scratch *s = *state;
    char *hub = tu_strdupf("%s/hub", s->dir), *repo = tu_strdupf("%s/hub/models--acme--adapter", s->dir);
    static const char *const FILES[] = {"adapter_config.json", "adapter_model.safetensors"};
    tu_sh("mkdir -p %s/refs %s/blobs %s/snapshots/" COMMIT, repo, repo, repo);
    for (int i = 0; i < 2; i++)
        tu_sh("cp " LORA_FIXTURES "/adapter-r16-qv-lmhead/%s %s/blobs/a%d && ln -s ../../blobs/a%d %s/snapshots/" COMMIT
              "/%s", FILES[i], repo, i, i, repo, FILES[i]);
    tu_sh("printf '{\"chat_template\": \"x\"}' > %s/blobs/t && ln -s ../../blobs/t %s/snapshots/" COMMIT
          "/tokenizer_config.json && printf '" COMMIT "' > %s/refs/main", repo, repo, repo);
    unsetenv("HUGGINGFACE_HUB_CACHE");
    unsetenv("HF_HOME");
    unsetenv("XDG_CACHE_HOME");
    setenv("HF_HUB_CACHE", hub, 1);
    char *by_id = tu_strdupf("%s/by-id", s->dir), *by_path = tu_strdupf("%s/by-path", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", by_id, "--lora",
                             "acme/adapter", NULL);
    assert_converted_ok(&r);
    r = tu_run("convert", "-q", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", by_path, "--lora",
               LORA_FIXTURES "/adapter-r16-qv-lmhead", NULL);
    assert_converted_ok(&r);
    tu_sh("cmp %s/model.safetensors %s/model.safetensors", by_id, by_path);
    tu_sh("cmp %s/blobs/t %s/tokenizer_config.json && test ! -L %s/tokenizer_config.json", repo, by_id, by_id);
    r = tu_run("inspect", LORA_FIXTURES "/base-llama-bf16-bnb4", "--lora", "acme/adapter", NULL);
    if (r.status != 0 || !strstr(r.out, "tensors changed by 1 adapter") || !strstr(r.out, "snapshots/" COMMIT))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    /* Not in the cache: the command that downloads it, nothing written. */
    char *absent = tu_strdupf("%s/absent", s->dir);
    r = tu_run("convert", "--device", "cpu", LORA_FIXTURES "/base-llama-bf16-bnb4", absent, "--lora", "acme/nope", NULL);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 || !strstr(r.err, "hf download acme/nope\n"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_false(tu_exists(absent));
    unsetenv("HF_HUB_CACHE");
    free(absent);
    free(by_id);
    free(by_path);
    free(repo);
    free(hub);
}

static void test_models_missing_from_the_cache_give_the_download_command(void **state)
{
    struct tu_scratch *s = *state;
    char *hub = fake_hub(s->dir), *out = tu_strdupf("%s/out", s->dir);
    setenv("HF_HUB_CACHE", hub, 1);
    struct tu_run r = tu_run("convert", "acme/absent", out, NULL);
    assert_int_equal(r.status, NF4_ENOINPUT);
    assert_int_equal(tu_lines(r.err), 1);
    assert_non_null(strstr(r.err, "hf download acme/absent\n"));
    tu_run_free(&r);
    r = tu_run("convert", "--revision", "v9", "acme/tiny", out, NULL);
    assert_int_equal(r.status, NF4_ENOINPUT);
    assert_non_null(strstr(r.err, "hf download acme/tiny --revision v9\n"));
    tu_run_free(&r);
    /* A download that did not finish: the weights' link points at no blob. */
    tu_sh("mv %s/models--acme--tiny/blobs/1111 %s/blob-aside", hub, s->dir);
    r = tu_run("convert", "acme/tiny", out, NULL);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 || !strstr(r.err, "snapshots/" COMMIT "/model.safetensors: ") ||
        !strstr(r.err, "the download did not finish; run it again: hf download acme/tiny\n"))
        fail_msg("exit %d: %s", r.status, r.err);
    tu_run_free(&r);
    tu_sh("mv %s/blob-aside %s/models--acme--tiny/blobs/1111", s->dir, hub);
    /* A refs/ file that is not a commit hash is bad data; --revision with a path is a usage error. */
    tu_sh("printf 'not a hash' > %s/models--acme--tiny/refs/main", hub);
    r = tu_run("convert", "acme/tiny", out, NULL);
    assert_int_equal(r.status, NF4_EDATA);
    assert_non_null(strstr(r.err, "refs/main"));
    tu_run_free(&r);
    r = tu_run("convert", "--revision", "main", BNB4, out, NULL);
    assert_int_equal(r.status, NF4_EUSAGE);
    tu_run_free(&r);
    r = tu_run("convert", "--revision", "../../x", "acme/tiny", out, NULL);
    assert_int_equal(r.status, NF4_EUSAGE);
    tu_run_free(&r);
    unsetenv("HF_HUB_CACHE");
    assert_false(tu_exists(out));
    free(hub);
    free(out);
}

static void test_hostile_ids_refs_and_revisions(void **state)
{
    (void)state;
    /* huggingface_hub's validate_repo_id: 96 characters for ORG and for NAME each, no ".git" suffix. */
    char org96[HF_REPO_PART_MAX + 1], long_ok[2 * HF_REPO_PART_MAX + 2], long_bad[2 * HF_REPO_PART_MAX + 3];
    memset(org96, 'o', HF_REPO_PART_MAX);
    org96[HF_REPO_PART_MAX] = '\0';
    snprintf(long_ok, sizeof long_ok, "%s/%s", org96, org96);
    snprintf(long_bad, sizeof long_bad, "%s/%sx", org96, org96);
    const char *const GOOD_IDS[] = {"acme/tiny", "unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "a/b", "A_1/x.y", long_ok,
                                    "a/b.gitx"};
    const char *const BAD_IDS[] = {"acme", "acme/", "/tiny", "a/b/c", "a--b/c", "a/b..c", ".a/b", "a/b-",
                                   "a /b", "a/b\n", "", long_bad, "a/b.git"};
    for (size_t i = 0; i < sizeof GOOD_IDS / sizeof *GOOD_IDS; i++)
        if (!hf_repo_id_is_valid(GOOD_IDS[i]))
            fail_msg("'%s' refused as a model id", GOOD_IDS[i]);
    for (size_t i = 0; i < sizeof BAD_IDS / sizeof *BAD_IDS; i++)
        if (hf_repo_id_is_valid(BAD_IDS[i]))
            fail_msg("'%s' passed as a model id", BAD_IDS[i]);
    static const char *const BAD_REVS[] = {"", "/abs", "..", "a/../b", "a//b", "a/.", "x\ty", "a\\b"};
    for (size_t i = 0; i < sizeof BAD_REVS / sizeof *BAD_REVS; i++)
        assert_false(hf_revision_is_valid(BAD_REVS[i]));
    assert_true(hf_revision_is_valid("refs/pr/1"));
    char commit[HF_COMMIT_HEX + 1];
    static const char *const BAD_REFS[] = {"", COMMIT "0", "0123456789ABCDEF0123456789abcdef01234567", "0123",
                                           COMMIT " x", "g123456789abcdef0123456789abcdef01234567"};
    for (size_t i = 0; i < sizeof BAD_REFS / sizeof *BAD_REFS; i++)
        assert_int_equal(hf_ref_parse("refs/main", BAD_REFS[i], strlen(BAD_REFS[i]), commit), NF4_EDATA);
    nf4_clear_error();
    assert_int_equal(hf_ref_parse("refs/main", COMMIT "\n", strlen(COMMIT) + 1, commit), NF4_OK);
    assert_string_equal(commit, COMMIT);
}

/* ---- standard streams ---- */

static void test_stdout_streams_the_file(void **state)
{
    struct tu_scratch *s = *state;
    char *file = tu_strdupf("%s/file.safetensors", s->dir), *piped = tu_strdupf("%s/piped.safetensors", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", BNB4, file, NULL);
    assert_converted_ok(&r);
    /* Through a pipe, so nothing can seek. */
    assert_int_equal(tu_sh_status("%s convert -q --device cpu %s - | cat > %s", NF4DEQ_BIN, BNB4, piped), 0);
    assert_same_file(piped, file);
    /* Standard input, when it is a file. */
    char *from_stdin = tu_strdupf("%s/stdin.safetensors", s->dir);
    assert_int_equal(tu_sh_status("%s convert -q --device cpu - %s < %s", NF4DEQ_BIN, from_stdin, BNB4), 0);
    assert_same_file(from_stdin, file);
    free(from_stdin);
    assert_int_equal(tu_sh_status("cat %s | %s convert -q - %s/never 2>/dev/null", BNB4, NF4DEQ_BIN, s->dir), NF4_EUSAGE);
    /* A directory or a closed standard input: refused, and said as what it is. */
    char *err = tu_strdupf("%s/err", s->dir);
    static const char *const REDIRECTS[][2] = {{"< /", "is a directory"}, {"<&-", "is closed"}};
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(tu_sh_status("%s convert -q - %s/never %s 2> %s", NF4DEQ_BIN, s->dir, REDIRECTS[i][0], err),
                         NF4_EUSAGE);
        char *msg = tu_read_file(err, NULL);
        if (tu_lines(msg) != 1 || !strstr(msg, REDIRECTS[i][1]))
            fail_msg("%s: %s", REDIRECTS[i][0], msg);
        free(msg);
    }
    free(err);
    free(file);
    free(piped);
}

static void test_stdout_failures_exit_74_and_never_create_a_dash_file(void **state)
{
    struct tu_scratch *s = *state;
    char *err = tu_strdupf("%s/err", s->dir);
    assert_int_equal(tu_sh_status("cd %s && %s/%s convert %s/%s - > /dev/full 2> %s", s->dir, getenv("PWD"), NF4DEQ_BIN,
                               getenv("PWD"), BNB4, err), NF4_EIO);
    char *msg = tu_read_file(err, NULL);
    assert_int_equal(tu_lines(msg), 1);
    assert_non_null(strstr(msg, "standard output"));
    free(msg);
    assert_int_equal(tu_sh_status("cd %s && %s/%s convert %s/%s - >&- 2> %s", s->dir, getenv("PWD"), NF4DEQ_BIN,
                               getenv("PWD"), BNB4, err), NF4_EIO);
    msg = tu_read_file(err, NULL);
    assert_non_null(strstr(msg, "standard output is closed"));
    free(msg);
    /* A reader that leaves early. */
    assert_int_equal(tu_sh_status("cd %s && { %s/%s convert %s/%s - 2> %s; echo $? > rc; } | head -c 10 > /dev/null; "
                               "exit $(cat rc)", s->dir, getenv("PWD"), NF4DEQ_BIN, getenv("PWD"), BNB4, err), NF4_EIO);
    /* --json needs standard output for itself. */
    struct tu_run r = tu_run("convert", "--json", BNB4, "-", NULL);
    assert_int_equal(r.status, NF4_EUSAGE);
    tu_run_free(&r);
    char *dash = tu_strdupf("%s/-", s->dir);
    assert_false(tu_exists(dash));
    assert_false(tu_exists("-"));
    free(dash);
    free(err);
}

/* ---- convert --json ---- */

static const cJSON *get(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v)
        fail_msg("the report has no \"%s\"", key);
    return v;
}

static void test_json_report_of_a_success(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/flux", s->dir);
    struct tu_run r = tu_run("convert", "--json", "-q", "--device", "cpu", FLUX, out, NULL);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.err, "");
    assert_true(strncmp(r.out, "{\n  \"ok\": true,\n", 16) == 0);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    assert_true(cJSON_IsTrue(get(root, "ok")));
    assert_string_equal(get(root, "input")->valuestring, FLUX);
    assert_string_equal(get(root, "output")->valuestring, out);
    assert_string_equal(get(root, "layout")->valuestring, "pipeline");
    const cJSON *t = get(root, "tensors");
    assert_int_equal(get(t, "dequantized")->valuedouble, 40);
    assert_true(get(t, "total")->valuedouble == get(t, "dequantized")->valuedouble + get(t, "passed_through")->valuedouble);
    assert_true(get(root, "bytes_in")->valuedouble > 0 && get(root, "bytes_out")->valuedouble > 0);
    assert_true(get(root, "peak_rss_bytes")->valuedouble > 0);
    assert_true(cJSON_IsNumber(get(root, "seconds")) && cJSON_IsString(get(root, "engine")));
    /* Its own peak, not its parent's: started from a process holding 256 MiB
     * (as from Python with torch loaded), a small conversion still reads small. */
    size_t big = (size_t)256 << 20;
    char *ballast = malloc(big);
    assert_non_null(ballast);
    memset(ballast, 1, big);
    char *out2 = tu_strdupf("%s/flux2", s->dir);
    struct tu_run r2 = tu_run("convert", "--json", "-q", "--device", "cpu", FLUX, out2, NULL);
    free(ballast);
    assert_int_equal(r2.status, 0);
    cJSON *root2 = cJSON_Parse(r2.out);
    assert_non_null(root2);
    if (get(root2, "peak_rss_bytes")->valuedouble > (double)(128 << 20))
        fail_msg("peak_rss_bytes %.0f: the parent's 256 MiB counted", get(root2, "peak_rss_bytes")->valuedouble);
    cJSON_Delete(root2);
    tu_run_free(&r2);
    free(out2);
    assert_true(cJSON_IsArray(get(root, "warnings")));
    /* Every file under OUT, with its size. */
    const cJSON *files = get(root, "files");
    assert_int_equal(cJSON_GetArraySize(files), 7);
    const cJSON *f;
    cJSON_ArrayForEach(f, files) {
        struct stat st;
        assert_int_equal(stat(get(f, "path")->valuestring, &st), 0);
        assert_true(get(f, "bytes")->valuedouble == (double)st.st_size);
    }
    cJSON_Delete(root);
    tu_run_free(&r);
    free(out);
}

static void test_json_report_of_failures(void **state)
{
    struct tu_scratch *s = *state;
    char *bad = tu_strdupf("%s/bad.safetensors", s->dir), *out = tu_strdupf("%s/out.safetensors", s->dir);
    tu_write_file(bad, "x", 1);
    /* Bad data, a model id the cache lacks, and a usage error found once the
     * input is known (--lora on a pipeline). */
    const char *const CASES[][8] = {
        {"convert", "--json", "-q", bad, out, NULL},
        {"convert", "--json", "-q", "no/such-model", out, NULL},
        {"convert", "--json", "--lora", FIXTURES "/lora/adapter-r8-all-linear", FLUX, out, NULL},
    };
    static const int CODES[] = {NF4_EDATA, NF4_ENOINPUT, NF4_EUSAGE};
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        struct tu_run r = tu_run_argv((char *const *)CASES[i]);
        assert_int_equal(r.status, CODES[i]);
        cJSON *root = cJSON_Parse(r.out);
        if (!root)
            fail_msg("case %zu: stdout is not JSON: %s", i, r.out);
        assert_true(cJSON_IsFalse(get(root, "ok")));
        assert_int_equal(get(root, "exit_code")->valuedouble, CODES[i]);
        assert_non_null(strstr(r.err, get(root, "error")->valuestring));
        assert_true(cJSON_IsString(get(root, "file")));
        assert_true(cJSON_IsNull(get(root, "tensor")));
        cJSON_Delete(root);
        tu_run_free(&r);
    }
    /* A hostile tensor: its name comes back in "tensor". */
    char *hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,8]}}";
    tu_write_safetensors_raw(bad, hdr, strlen(hdr), "01234567", 8);
    struct tu_run r = tu_run("convert", "--json", "-q", bad, out, NULL);
    assert_int_equal(r.status, NF4_EDATA);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    assert_string_equal(get(root, "file")->valuestring, bad);
    assert_string_equal(get(root, "tensor")->valuestring, "w");
    cJSON_Delete(root);
    tu_run_free(&r);
    assert_false(tu_exists(out));
    free(bad);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
#define SCRATCH(t) cmocka_unit_test_setup_teardown(t, tu_scratch_setup, tu_scratch_teardown)
        SCRATCH(test_pipeline_converts_components_and_copies_the_rest),
        SCRATCH(test_pipeline_output_is_all_or_nothing),
        SCRATCH(test_pipeline_refuses_lora_and_stdout),
        SCRATCH(test_trailing_slash_and_out_inside_in),
        cmocka_unit_test(test_inspect_shows_components_and_totals),
        SCRATCH(test_modular_pipeline_converts_as_a_pipeline),
        SCRATCH(test_diffusers_component_and_single_file_convert),
        SCRATCH(test_index_of_any_prefix_keeps_its_names),
        SCRATCH(test_several_unindexed_files_are_one_model),
        SCRATCH(test_ambiguous_directories_exit_65_naming_the_candidates),
        SCRATCH(test_model_ids_resolve_in_the_cache),
        SCRATCH(test_models_missing_from_the_cache_give_the_download_command),
        cmocka_unit_test(test_hostile_ids_refs_and_revisions),
        SCRATCH(test_adapter_ids_resolve_in_the_cache),
        SCRATCH(test_stdout_streams_the_file),
        SCRATCH(test_stdout_failures_exit_74_and_never_create_a_dash_file),
        SCRATCH(test_json_report_of_a_success),
        SCRATCH(test_json_report_of_failures),
#undef SCRATCH
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
