/* fal's FLUX.1 Kontext LoRAs (lora_fal.h) read as diffusers 0.42 loads them.
 * A LoRA at FLUX.1's sizes is too large to keep, so each test builds one by
 * make_fal_fixtures.py's recipe; lora-flux-fal.digest holds the digests of
 * diffusers' own conversion of it, group by group. The conversion must hold
 * the same names, dtypes, shapes and bytes; merged through the command line it
 * must give what its conversion gives; and what diffusers raises on is
 * refused with one line naming the key, nothing written, no temp file left. */
#include "test_util.h"

#include <inttypes.h>

#include "lora_diffusers.h"
#include "lora_recipe.h"
#include "lora_synth.h"
#include "safetensors_writer.h"

#define FAL_DIGEST FIXTURES "/diffusers/lora-flux-fal.digest"
#define FLUX_TRANSFORMER FIXTURES "/diffusers/tiny-flux-bnb4/transformer"
#define FAL "base_model.model."
#define INNER 3072
#define MLP 12288
#define MOD (6 * INNER)

struct fal_module {
    const char *name;
    uint64_t out, in;
};

/* make_fal_fixtures.py's DOUBLE, SINGLE and FINAL. */
static const struct fal_module DOUBLE[] = {
    {"img_mod.lin", MOD, INNER},       {"txt_mod.lin", MOD, INNER},       {"img_attn.qkv", 3 * INNER, INNER},
    {"txt_attn.qkv", 3 * INNER, INNER}, {"img_mlp.0", MLP, INNER},         {"img_mlp.2", INNER, MLP},
    {"txt_mlp.0", MLP, INNER},         {"txt_mlp.2", INNER, MLP},         {"img_attn.proj", INNER, INNER},
    {"txt_attn.proj", INNER, INNER},
};
static const struct fal_module SINGLE[] = {
    {"modulation.lin", 3 * INNER, INNER}, {"linear1", 3 * INNER + MLP, INNER}, {"linear2", INNER, INNER + MLP}};
static const struct fal_module FINAL = {"final_layer.linear", 64, INNER};
/* Its biases: lora_B.bias vectors. */
static const struct {
    const char *name;
    uint64_t size;
} BIASES[] = {
    {FAL "double_blocks.0.img_mlp.0.lora_B.bias", MLP},
    {FAL "double_blocks.1.txt_attn.proj.lora_B.bias", INNER},
    {FAL "single_blocks.0.linear1.lora_B.bias", 3 * INNER + MLP},
    {FAL "single_blocks.2.modulation.lin.lora_B.bias", 3 * INNER},
    {FAL "final_layer.linear.lora_B.bias", 64},
};

/* A module's two factors, rank 1, in its block's dtype; `in`: lora_A's
 * columns (0: the module's own). */
static void fal_add_module(struct recipe *l, const char *block, const struct fal_module *m, uint64_t in)
{
    enum st_dtype dt = strcmp(block, "double_blocks.3.") == 0 ? DT_F16 : strcmp(block, "single_blocks.5.") == 0 ? DT_F32
                                                                                                              : DT_BF16;
    char name[RECIPE_NAME_MAX];
    snprintf(name, sizeof name, FAL "%s%s.lora_A.weight", block, m->name);
    recipe_add(l, name, dt, 2, 1, in ? in : m->in);
    snprintf(name, sizeof name, FAL "%s%s.lora_B.weight", block, m->name);
    recipe_add(l, name, dt, 2, m->out, 1);
}

/* make_fal_fixtures.py's fal_lora(): every module of FLUX.1's blocks and
 * their biases (`biases`); `in` as for fal_add_module. */
static void fal_recipe(struct recipe *l, uint64_t in, int biases)
{
    l->n = 0;
    char block[32];
    for (int i = 0; i < 19; i++)
        for (size_t m = 0; m < sizeof DOUBLE / sizeof DOUBLE[0]; m++) {
            snprintf(block, sizeof block, "double_blocks.%d.", i);
            fal_add_module(l, block, &DOUBLE[m], in);
        }
    for (int i = 0; i < 38; i++)
        for (size_t m = 0; m < sizeof SINGLE / sizeof SINGLE[0]; m++) {
            snprintf(block, sizeof block, "single_blocks.%d.", i);
            fal_add_module(l, block, &SINGLE[m], in);
        }
    fal_add_module(l, "", &FINAL, in);
    for (size_t b = 0; biases && b < sizeof BIASES / sizeof BIASES[0]; b++)
        recipe_add(l, BIASES[b].name, DT_BF16, 1, BIASES[b].size, 0);
}

/* The recipe's LoRA converted holds, group by group, diffusers' own
 * conversion of it: FLUX.1's every module renamed, fused qkv and linear1
 * cut, lora_A copied to each part, biases carried over, in three dtypes. */
static void test_fal_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe l;
    fal_recipe(&l, 0, 1);
    char *path = tu_strdupf("%s-fal.safetensors", s->dir);
    const uint64_t in = recipe_write(&l, path, RECIPE, NULL, 0);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0); /* where no temp file may stay */
    struct model *m;
    assert_int_equal(diffusers_lora_open(path, LORA_FAMILY_FLUX, 0, &m), NF4_OK);
    assert_string_equal(m->files[0]->path, path); /* messages name the fal file */
    assert_int_equal(m->count, 998);
    assert_matches_digest(m, FAL_DIGEST, 615, in);
    model_close(m);
    /* Read the same way where the class is unknown (Flux.1's rules). */
    assert_int_equal(diffusers_lora_open(path, LORA_FAMILY_OTHER, 0, &m), NF4_OK);
    assert_matches_digest(m, FAL_DIGEST, 615, in);
    model_close(m);
    assert_int_equal(tu_count_entries(s->dir), 0);
    unlink(path);
    free(path);
}

/* Merged through the command line into a FLUX.1-shaped transformer (lora_A
 * one column wide, so that the base stays small), the fal LoRA gives the
 * bytes its conversion, written as a diffusers LoRA, gives; the LoRA config
 * of its metadata (alpha 2: scaling 2) applies to both. */
static void test_fal_lora_merges_as_converted(void **state)
{
    struct tu_scratch *s = *state;
    static struct recipe l;
    fal_recipe(&l, 1, 1);
    char *fal = tu_strdupf("%s-fal.safetensors", s->dir), *converted = tu_strdupf("%s-fal.diffusers.safetensors", s->dir),
         *base = tu_strdupf("%s/base", s->dir), *got = tu_strdupf("%s/got", s->dir), *want = tu_strdupf("%s/want", s->dir);
    struct st_meta meta = {"lora_adapter_metadata",
                           "{\"transformer.r\": 1, \"transformer.lora_alpha\": 2, \"transformer.lora_bias\": true, "
                           "\"transformer.target_modules\": "
                           "[\"to_q\"]}"};
    recipe_write(&l, fal, FROM_1_TO_2, &meta, 1);
    struct model *m;
    assert_int_equal(diffusers_lora_open(fal, LORA_FAMILY_FLUX, 0, &m), NF4_OK);
    write_model(m, converted, &meta, 1);
    write_lora_base(m, base, "FluxKontextTransformer2DModel");
    model_close(m);
    assert_lora_converts(base, got, fal, 1);
    assert_lora_converts(base, want, converted, 1);
    char *got_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", got),
         *want_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", want),
         *base_file = tu_strdupf("%s/diffusion_pytorch_model.safetensors", base);
    tu_assert_same_tensors(got_file, want_file);
    /* and the merge changed something: the base is not what came out */
    assert_true(tensor_differs(base_file, got_file, "single_transformer_blocks.37.proj_mlp.weight"));
    unlink(fal);
    unlink(converted);
    free(got_file);
    free(want_file);
    free(base_file);
    free(fal);
    free(converted);
    free(base);
    free(got);
    free(want);
}

/* A LoRA made from a recipe with one tensor dropped, added or of other rows. */
struct refusal {
    enum { DROP, ADD, RESHAPE } edit;
    const char *name;
    uint64_t d0; /* ADD: a vector of d0 values; RESHAPE: the rows */
    const char *want;
};

/* Each case's LoRA, the recipe `make` fills with one edit, refused in one
 * line holding `want`, nothing written, no temp file left. */
static void assert_refusals(const struct tu_scratch *s, const struct refusal *cases, size_t n,
                            void (*make)(struct recipe *))
{
    static struct recipe l;
    char *lora = tu_strdupf("%s-refused.safetensors", s->dir), *out = tu_strdupf("%s/out", s->dir);
    assert_int_equal(setenv("TMPDIR", s->dir, 1), 0);
    for (size_t i = 0; i < n; i++) {
        make(&l);
        if (cases[i].edit == DROP)
            recipe_remove(&l, cases[i].name);
        else if (cases[i].edit == ADD)
            recipe_add(&l, cases[i].name, DT_BF16, 1, cases[i].d0, 0);
        else
            recipe_find(&l, cases[i].name)->shape[0] = cases[i].d0;
        recipe_write(&l, lora, RECIPE, NULL, 0);
        assert_lora_refused(FLUX_TRANSFORMER, out, lora, cases[i].want, s->dir);
    }
    unlink(lora);
    free(lora);
    free(out);
}

static void fal_recipe_with_biases(struct recipe *l)
{
    fal_recipe(l, 0, 1);
}

/* What diffusers raises on, or would load as nf4deq would not merge it:
 * refused with one line naming the key, nothing written, no temp file left. */
static void test_fal_lora_refusals(void **state)
{
    static const struct refusal CASES[] = {
        {DROP, FAL "single_blocks.37.linear2.lora_B.weight", 0,
         FAL "single_blocks.37.linear2.lora_B.weight: is missing: diffusers converts a LoRA with \"base_model\" in a "
             "key as fal's FLUX.1 Kontext form"},
        {DROP, FAL "final_layer.linear.lora_A.weight", 0, FAL "final_layer.linear.lora_A.weight: is missing"},
        {ADD, "double_blocks.0.img_mlp.0.lora_A.weight", 4,
         "double_blocks.0.img_mlp.0.lora_A.weight: is left over where diffusers converts"},
        {ADD, FAL "double_blocks.0.img_attn.qkv.lora_B.bias", 9216, "img_attn.qkv.lora_B.bias: is left over"},
        {ADD, FAL "double_blocks.2.img_mod.lin.lora_B.bias", MOD, "img_mod.lin.lora_B.bias: is left over"},
        {ADD, FAL "single_blocks.1.linear1.lora_A.bias", 1, "linear1.lora_A.bias: is left over"},
        {ADD, FAL "double_blocks.0.img_mlp.0.alpha", 1, "img_mlp.0.alpha: is left over"},
        {RESHAPE, FAL "double_blocks.4.txt_attn.qkv.lora_B.weight", 9215,
         "txt_attn.qkv.lora_B.weight: has 9215 rows, which diffusers cuts into parts for attn.add_q_proj, "
         "attn.add_k_proj and attn.add_v_proj that cannot load"},
        {RESHAPE, FAL "single_blocks.9.linear1.lora_B.weight", 21503,
         "linear1.lora_B.weight: has 21503 rows, but diffusers cuts it into FLUX.1's 3072, 3072, 3072 and 12288"},
        {RESHAPE, FAL "single_blocks.0.linear1.lora_B.bias", 21505, "linear1.lora_B.bias: has 21505 rows"},
        /* a key of BFL's control form makes the file one (diffusers looks for it first) */
        {ADD, "double_blocks.0.img_attn.norm.query_norm.scale", 128,
         "time_in.in_layer.lora_A.weight: is missing: diffusers converts a LoRA with \"query_norm.scale\" in a key "
         "as BFL's FLUX.1 control form (Canny, Depth)"},
    };
    assert_refusals(*state, CASES, sizeof CASES / sizeof CASES[0], fal_recipe_with_biases);
}

/* ---- BFL's FLUX.1 control LoRAs ---- */

#define CONTROL_DIGEST FIXTURES "/diffusers/lora-flux-control.digest"

/* make_flux_control_fixtures.py's LoRA (its every tensor listed in the
 * digest) converted holds, group by group, diffusers' own conversion of it:
 * the embedders, guidance_in among them, the blocks' modules renamed and
 * cut, lora_B biases carried over (a qkv's and linear1's cut, the final
 * adaLN_modulation's swapped), lora_A of rank 3 swapped in halves of 2 and
 * 1 rows, and every block's norm scales as attention norm weights. */
static void test_control_lora_as_diffusers_loads_it(void **state)
{
    struct tu_scratch *s = *state;
    assert_digest_converts(CONTROL_DIGEST, LORA_FAMILY_FLUX, s->dir, "control");
    assert_digest_converts(CONTROL_DIGEST, LORA_FAMILY_OTHER, s->dir, "control-other"); /* Flux.1's rules */
}

/* What diffusers raises on in a control LoRA, or loads without a tensor
 * nf4deq would have to leave out: refused in one line naming the key,
 * nothing written, no temp file left. */
static void control_recipe(struct recipe *l)
{
    recipe_read(l, CONTROL_DIGEST);
}

static void test_control_lora_refusals(void **state)
{
    static const struct refusal CASES[] = {
        {DROP, "img_in.lora_A.weight", 0,
         "img_in.lora_A.weight: is missing: diffusers converts a LoRA with \"query_norm.scale\" in a key as BFL's "
         "FLUX.1 control form (Canny, Depth), which has each factor of every module of FLUX.1's embedders"},
        {DROP, "single_blocks.37.norm.key_norm.scale", 0, "single_blocks.37.norm.key_norm.scale: is missing"},
        {DROP, "guidance_in.out_layer.lora_B.weight", 0, "guidance_in.out_layer.lora_B.weight: is missing"},
        {DROP, "final_layer.adaLN_modulation.1.lora_B.weight", 0, "adaLN_modulation.1.lora_B.weight: is missing"},
        {ADD, "double_blocks.0.img_mlp.0.lora_A.bias", 4,
         "double_blocks.0.img_mlp.0.lora_A.bias: is a lora_A bias, which PEFT's LoRA layer does not have"},
        {ADD, "double_blocks.0.img_mlp.0.alpha", 1, "img_mlp.0.alpha: is left over where diffusers converts a LoRA "
         "with \"query_norm.scale\" in a key as BFL's FLUX.1 control form (Canny, Depth), and raises"},
        {RESHAPE, "final_layer.adaLN_modulation.1.lora_A.weight", 1,
         "adaLN_modulation.1.lora_A.weight: has fewer than two rows (1), but diffusers cuts it into two halves"},
        {RESHAPE, "double_blocks.2.txt_attn.qkv.lora_B.weight", 9214, "txt_attn.qkv.lora_B.weight: has 9214 rows"},
        {RESHAPE, "double_blocks.0.img_attn.qkv.lora_B.bias", 9217, "img_attn.qkv.lora_B.bias: has 9217 rows"},
    };
    assert_refusals(*state, CASES, sizeof CASES / sizeof CASES[0], control_recipe);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fal_lora_as_diffusers_loads_it, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_fal_lora_merges_as_converted, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_fal_lora_refusals, tu_scratch_setup, lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_control_lora_as_diffusers_loads_it, tu_scratch_setup,
                                        lora_synth_teardown),
        cmocka_unit_test_setup_teardown(test_control_lora_refusals, tu_scratch_setup, lora_synth_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
