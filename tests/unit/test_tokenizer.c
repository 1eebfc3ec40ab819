/* Whose tokenizer a converted model directory gets (tokenizer_files.h): IN's,
 * the last adapter folder's that holds one, or --tokenizer's; always one
 * folder's whole set, byte for byte, and nothing of another's beside it. */
#include "test_util.h"

#include "tokenizer_files.h"

#define LORA_FIXTURES FIXTURES "/lora"

/* The base, an adapter with the tokenizer it was trained with (and a file of
 * its own that is not one), a second adapter without, and a folder holding
 * only a GPT-2 style tokenizer. */
struct tok_case {
    char *dir, *base, *ad, *ad2, *tok, *out;
};

static int tok_setup(void **state)
{
    if (tu_scratch_setup(state) != 0)
        return -1;
    struct tu_scratch *s = *state;
    struct tok_case *t = calloc(1, sizeof *t);
    t->dir = s->dir;
    t->base = tu_strdupf("%s/base", s->dir);
    t->ad = tu_strdupf("%s/ad", s->dir);
    t->ad2 = tu_strdupf("%s/ad2", s->dir);
    t->tok = tu_strdupf("%s/tok", s->dir);
    t->out = tu_strdupf("%s/out", s->dir);
    tu_sh("cp -r %s/base-llama-bf16-bnb4 %s && printf 'base spm' > %s/tokenizer.model && "
          "printf '{\"base\": 1}' > %s/tokenizer_config.json && printf '{}' > %s/special_tokens_map.json",
          LORA_FIXTURES, t->base, t->base, t->base, t->base);
    tu_sh("cp -r %s/adapter-r8-all-linear %s && printf '{\"ad\": 1}' > %s/tokenizer_config.json && "
          "printf '{\"model\": {}}' > %s/tokenizer.json && printf '{{ messages }}' > %s/chat_template.jinja && "
          "printf 'not the tokenizer' > %s/README.md && mkdir %s/additional_chat_templates && "
          "printf '{{ tools }}' > %s/additional_chat_templates/tool_use.jinja",
          LORA_FIXTURES, t->ad, t->ad, t->ad, t->ad, t->ad, t->ad, t->ad);
    tu_sh("cp -r %s/adapter-r16-qv-lmhead %s", LORA_FIXTURES, t->ad2);
    tu_sh("mkdir %s && printf '{\"a\": 0}' > %s/vocab.json && printf '#v\\n' > %s/merges.txt && "
          "printf '{\"gpt2\": 1}' > %s/tokenizer_config.json && printf x > %s/notes.txt",
          t->tok, t->tok, t->tok, t->tok, t->tok);
    s->dir = (char *)t; /* the teardown frees through the case */
    return 0;
}

static int tok_teardown(void **state)
{
    struct tu_scratch *s = *state;
    struct tok_case *t = (struct tok_case *)s->dir;
    s->dir = t->dir;
    free(t->base);
    free(t->ad);
    free(t->ad2);
    free(t->tok);
    free(t->out);
    free(t);
    return tu_scratch_teardown(state);
}

static struct tok_case *tok_case_of(void **state)
{
    return (struct tok_case *)((struct tu_scratch *)*state)->dir;
}

/* OUT holds exactly `names` besides the model's own files (config.json,
 * generation_config.json, model.safetensors), each tokenizer file equal to
 * the one in `from`. */
static void assert_output_tokenizer(const char *out, const char *from, const char *const *names, size_t n)
{
    static const char *const MODEL_FILES[] = {"config.json", "generation_config.json", "model.safetensors"};
    int want = (int)(n + sizeof MODEL_FILES / sizeof *MODEL_FILES);
    if (tu_count_entries(out) != want)
        tu_sh("ls -la %s >&2; false", out);
    for (size_t i = 0; i < sizeof MODEL_FILES / sizeof *MODEL_FILES; i++) {
        char *p = tu_strdupf("%s/%s", out, MODEL_FILES[i]);
        assert_true(tu_exists(p));
        free(p);
    }
    for (size_t i = 0; i < n; i++)
        tu_sh("diff -r %s/%s %s/%s", from, names[i], out, names[i]);
}

static const char *const AD_FILES[] = {"additional_chat_templates", "chat_template.jinja", "tokenizer.json",
                                       "tokenizer_config.json"};
static const char *const BASE_FILES[] = {"special_tokens_map.json", "tokenizer.model", "tokenizer_config.json"};
static const char *const TOK_FILES[] = {"merges.txt", "tokenizer_config.json", "vocab.json"};
#define COUNT(a) (sizeof(a) / sizeof *(a))

static void test_names(void **state)
{
    (void)state;
    assert_true(tokenizer_file_name("tokenizer.json"));
    assert_true(tokenizer_file_name("chat_template.jinja"));
    assert_true(tokenizer_file_name("spiece.model"));
    assert_false(tokenizer_file_name("config.json"));
    assert_false(tokenizer_file_name("generation_config.json"));
    assert_false(tokenizer_file_name("preprocessor_config.json"));
    assert_false(tokenizer_file_name("chat_template.json")); /* a processor's */
    assert_false(tokenizer_file_name("tokenizer.json.bak"));
    assert_true(tokenizer_dir_name("additional_chat_templates"));
    assert_false(tokenizer_dir_name("original"));
    assert_false(tokenizer_file_name("additional_chat_templates"));
}

/* With --lora, the adapter folder's tokenizer replaces IN's whole, and a note says so. */
static void test_adapter_tokenizer_by_default(void **state)
{
    struct tok_case *t = tok_case_of(state);
    struct tu_run r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, NULL);
    char *want = tu_strdupf("nf4deq: %s: the tokenizer is the one %s was trained with (additional_chat_templates, "
                            "chat_template.jinja, tokenizer.json, tokenizer_config.json) instead of %s's; "
                            "--tokenizer base keeps %s's\n",
                            t->out, t->ad, t->base, t->base);
    if (r.status != 0 || !strstr(r.err, want) || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(want);
    assert_output_tokenizer(t->out, t->ad, AD_FILES, COUNT(AD_FILES));
    tu_rmtree(t->out);

    /* The last adapter that holds one: a later one without leaves the earlier one's. */
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, "--lora", t->ad2, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    assert_output_tokenizer(t->out, t->ad, AD_FILES, COUNT(AD_FILES));
    tu_rmtree(t->out);
    tu_sh("printf '{\"ad2\": 1}' > %s/tokenizer_config.json", t->ad2);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, "--lora", t->ad2, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    static const char *const AD2_FILES[] = {"tokenizer_config.json"};
    assert_output_tokenizer(t->out, t->ad2, AD2_FILES, COUNT(AD2_FILES));
    tu_rmtree(t->out);

    /* Neither holds one: IN's (its chat templates' folder too), and no note. */
    tu_sh("mkdir %s/additional_chat_templates && printf '{{ rag }}' > %s/additional_chat_templates/rag.jinja", t->base,
          t->base);
    tu_sh("rm %s/tokenizer_config.json", t->ad2);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad2, NULL);
    if (r.status != 0 || strstr(r.err, "tokenizer") || strstr(r.err, "not copied"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    static const char *const BASE_AND_DIR[] = {"additional_chat_templates", "special_tokens_map.json",
                                               "tokenizer.model", "tokenizer_config.json"};
    assert_output_tokenizer(t->out, t->base, BASE_AND_DIR, COUNT(BASE_AND_DIR));
    tu_rmtree(t->out);
    /* The adapter's whole set, its folder included, and not the base's folder. */
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    assert_output_tokenizer(t->out, t->ad, AD_FILES, COUNT(AD_FILES));
    char *gone = tu_strdupf("%s/additional_chat_templates/rag.jinja", t->out);
    assert_false(tu_exists(gone));
    free(gone);
}

/* --tokenizer base keeps IN's with --lora; --tokenizer DIR takes DIR's, with or without. */
static void test_tokenizer_option(void **state)
{
    struct tok_case *t = tok_case_of(state);
    struct tu_run r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, "--tokenizer", "base",
                             NULL);
    if (r.status != 0 || strstr(r.err, "tokenizer"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_output_tokenizer(t->out, t->base, BASE_FILES, COUNT(BASE_FILES));
    tu_rmtree(t->out);

    /* IN itself, by its path, is the same. */
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, "--tokenizer", t->base, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    assert_output_tokenizer(t->out, t->base, BASE_FILES, COUNT(BASE_FILES));
    tu_rmtree(t->out);

    char *want = tu_strdupf("nf4deq: %s: the tokenizer is %s's (merges.txt, tokenizer_config.json, vocab.json) "
                            "instead of %s's\n", t->out, t->tok, t->base);
    for (int with_lora = 0; with_lora < 2; with_lora++) {
        r = with_lora ? tu_run("convert", "--device", "cpu", "--tokenizer", t->tok, t->base, t->out, "--lora", t->ad,
                               NULL)
                      : tu_run("convert", "--device", "cpu", "--tokenizer", t->tok, t->base, t->out, NULL);
        if (r.status != 0 || !strstr(r.err, want))
            fail_msg("exit %d, stderr: %s", r.status, r.err);
        tu_run_free(&r);
        assert_output_tokenizer(t->out, t->tok, TOK_FILES, COUNT(TOK_FILES));
        tu_rmtree(t->out);
    }
    free(want);

    /* A sharded model directory (an index, several shards) takes it the same way. */
    char *sharded = tu_strdupf("%s/sharded", t->dir);
    tu_sh("cp -r %s/tiny-llama-bf16-bnb4-sharded %s", FIXTURES, sharded);
    r = tu_run("convert", "--device", "cpu", "--tokenizer", t->tok, sharded, t->out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    for (size_t i = 0; i < COUNT(TOK_FILES); i++)
        tu_sh("cmp %s/%s %s/%s", t->tok, TOK_FILES[i], t->out, TOK_FILES[i]);
    assert_int_equal(tu_count_entries(t->out), tu_count_entries(sharded) + (int)COUNT(TOK_FILES));
    tu_rmtree(t->out);
    free(sharded);
}

/* A bad --tokenizer fails before anything is written, in one line, for convert and inspect. */
static void test_tokenizer_refused(void **state)
{
    struct tok_case *t = tok_case_of(state);
    char *missing = tu_strdupf("%s/missing", t->dir), *file = tu_strdupf("%s/README.md", t->ad);
    char *weights = tu_strdupf("%s/model.safetensors", t->base);
    char *pipe_out = tu_strdupf("%s/pipe", t->dir), *file_out = tu_strdupf("%s/one.safetensors", t->dir);
    static const char *const EMPTY = "";
    const struct {
        const char *in, *tokenizer, *out;
        int status;
        const char *says;
    } CASES[] = {
        {t->base, missing, t->out, NF4_ENOINPUT, "--tokenizer: cannot open: No such file or directory"},
        {t->base, file, t->out, NF4_ENOINPUT, "--tokenizer: not a directory"},
        {t->base, t->ad2, t->out, NF4_ENOINPUT, "--tokenizer: holds no tokenizer"},
        {t->base, EMPTY, t->out, NF4_EUSAGE, "--tokenizer needs a directory, or base for IN's own"},
        {weights, t->tok, file_out, NF4_EUSAGE, "is a single weights file; --tokenizer gives a model directory"},
        {FIXTURES "/diffusers/tiny-flux-bnb4", t->tok, pipe_out, NF4_EUSAGE,
         "is a diffusers pipeline; --tokenizer gives a model directory"},
    };
    int entries = tu_count_entries(t->dir);
    for (size_t i = 0; i < COUNT(CASES); i++) {
        struct tu_run r = tu_run("convert", "--device", "cpu", CASES[i].in, CASES[i].out, "--tokenizer",
                                 CASES[i].tokenizer, NULL);
        int lines = CASES[i].status == NF4_EUSAGE && !CASES[i].tokenizer[0] ? 2 : 1; /* and "Try ..." */
        if (r.status != CASES[i].status || tu_lines(r.err) != lines || !strstr(r.err, CASES[i].says))
            fail_msg("case %zu: exit %d, stderr: %s", i, r.status, r.err);
        tu_run_free(&r);
        assert_int_equal(tu_count_entries(t->dir), entries);
        if (CASES[i].status == NF4_EUSAGE && CASES[i].tokenizer[0])
            continue; /* inspect words the layout refusal its own way */
        r = tu_run("inspect", CASES[i].in, "--tokenizer", CASES[i].tokenizer, NULL);
        if (r.status != CASES[i].status || r.out[0] || !strstr(r.err, CASES[i].says))
            fail_msg("inspect, case %zu: exit %d, stdout: %s, stderr: %s", i, r.status, r.out, r.err);
        tu_run_free(&r);
    }
    /* A set that cannot be taken whole: nothing is written, for --tokenizer or an adapter's. */
    static const struct {
        const char *make, *says;
    } BROKEN[] = {
        {"mkfifo %s/tokenizer.json", "tokenizer.json: the tokenizer's file is not a regular file"},
        {"ln -s ../elsewhere.json %s/tokenizer.json", "tokenizer.json: the tokenizer's file links outside"},
        {"ln -s missing.json %s/tokenizer.json", "tokenizer.json: the tokenizer's file: cannot stat: No such file"},
        {"printf x > %s/additional_chat_templates", "additional_chat_templates: the tokenizer's folder is not a "
                                                   "directory"},
        {"mkdir %1$s/additional_chat_templates && mkfifo %1$s/additional_chat_templates/tool_use.jinja",
         "additional_chat_templates/tool_use.jinja: the tokenizer's file is not a regular file"},
        {"mkdir %1$s/additional_chat_templates && ln -s ../../elsewhere.json %1$s/additional_chat_templates/x.jinja",
         "additional_chat_templates/x.jinja: the tokenizer's file links outside"},
        {"mkdir -p %1$s/additional_chat_templates/.ipynb_checkpoints %1$s/additional_chat_templates/sub",
         "additional_chat_templates/sub: the tokenizer's file is not a regular file"},
        {"mkdir %1$s/templates && ln -s templates %1$s/additional_chat_templates",
         "additional_chat_templates: the tokenizer's folder is not a directory (a link to one is not copied)"},
    };
    tu_sh("printf '{}' > %s/elsewhere.json", t->dir);
    entries = tu_count_entries(t->dir);
    for (size_t i = 0; i < COUNT(BROKEN); i++) {
        for (int adapter = 0; adapter < 2; adapter++) {
            const char *dir = adapter ? t->ad : t->tok;
            char *victim = tu_strdupf("%s/%s", dir, strstr(BROKEN[i].make, "additional") ? "additional_chat_templates"
                                                                                        : "tokenizer.json");
            char *saved = tu_strdupf("%s.saved", victim);
            int had = tu_exists(victim);
            if (had)
                assert_int_equal(rename(victim, saved), 0);
            tu_sh(BROKEN[i].make, dir);
            struct tu_run r = adapter ? tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad, NULL)
                                      : tu_run("convert", "--device", "cpu", t->base, t->out, "--tokenizer", t->tok,
                                               NULL);
            if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 || !strstr(r.err, BROKEN[i].says))
                fail_msg("case %zu, %s: exit %d, stderr: %s", i, dir, r.status, r.err);
            tu_run_free(&r);
            assert_int_equal(tu_count_entries(t->dir), entries);
            tu_sh("rm -rf %s %s/templates", victim, dir);
            if (had)
                assert_int_equal(rename(saved, victim), 0);
            free(victim);
            free(saved);
        }
    }

    /* An adapter whose only marker is a link to nothing holds a broken tokenizer, not none. */
    tu_sh("ln -s gone.json %s/tokenizer.json", t->ad2);
    struct tu_run r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", t->ad2, NULL);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 ||
        !strstr(r.err, "ad2/tokenizer.json: the tokenizer's file: cannot stat: No such file or directory"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(t->dir), entries);
    tu_sh("rm %s/tokenizer.json", t->ad2);

    r = tu_run("inspect", weights, "--tokenizer", t->tok, NULL);
    if (r.status != NF4_EUSAGE || r.out[0] || !strstr(r.err, "is a single weights file; --tokenizer applies to a "
                                                              "model directory"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(missing);
    free(file);
    free(weights);
    free(pipe_out);
    free(file_out);
}

/* A tokenizer whose added tokens run past the output's embedding rows (the
 * fixture's 512) gets a warning, whoever's it is; one within them none. */
static void test_added_tokens_past_the_embedding(void **state)
{
    struct tok_case *t = tok_case_of(state);
    tu_sh("printf '{\"added_tokens_decoder\": {\"0\": {\"content\": \"<unk>\"}, \"512\": {\"content\": "
          "\"<|eot_id|>\"}, \"x\": {}, \"-3\": {}, \"99999999999999999999999\": {}}}' > %s/tokenizer_config.json",
          t->tok);
    char *want = tu_strdupf("nf4deq: warning: %s/tokenizer_config.json: adds token 512 (\"<|eot_id|>\"), but the "
                            "output's embedding has 512 rows (0 to 511): the merged model cannot embed it. Is this "
                            "the tokenizer of this model?\n", t->tok);
    struct tu_run r = tu_run("convert", "--device", "cpu", t->base, t->out, "--tokenizer", t->tok, NULL);
    if (r.status != 0 || !strstr(r.err, want))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(want);
    tu_rmtree(t->out);
    tu_sh("printf '{\"added_tokens_decoder\": {\"511\": {\"content\": \"<last>\"}}}' > %s/tokenizer_config.json",
          t->tok);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--tokenizer", t->tok, NULL);
    if (r.status != 0 || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(t->out);
    /* A long token is cut on a character boundary: the message stays UTF-8. */
    tu_sh("printf '{\"added_tokens_decoder\": {\"9000\": {\"content\": \"%s\"}}}' > %s/tokenizer_config.json",
          "\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9"
          "\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9",
          t->tok);
    r = tu_run("convert", "--device", "cpu", "--json", t->base, t->out, "--tokenizer", t->tok, NULL);
    /* 31 two-byte characters fill 62 of the 63 bytes; the 32nd would be cut in two. */
    if (r.status != 0 || !strstr(r.err, "adds token 9000 (\"\xc3\xa9") || !strstr(r.err, "\xc3\xa9\"), but"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    for (const unsigned char *c = (const unsigned char *)r.out; *c; c++) /* stdout's JSON: no lone byte */
        if (*c >= 0x80) {
            size_t len = (*c & 0xE0) == 0xC0 ? 2 : (*c & 0xF0) == 0xE0 ? 3 : (*c & 0xF8) == 0xF0 ? 4 : 0;
            assert_true(len > 0);
            for (size_t k = 1; k < len; k++)
                assert_int_equal(c[k] & 0xC0, 0x80);
            c += len - 1;
        }
    tu_run_free(&r);
    tu_rmtree(t->out);
    /* Before transformers 4.34 the added tokens were listed in
     * added_tokens.json ({text: id}), as older adapters' folders hold them;
     * the higher of the two files' ids is the one said. */
    tu_sh("printf '{\"added_tokens_decoder\": {\"511\": {\"content\": \"<last>\"}}}' > %s/tokenizer_config.json && "
          "printf '{\"<pad>\": 600, \"<x>\": 7, \"<neg>\": -1, \"<half>\": 900.5, \"<str>\": \"999\"}' > "
          "%s/added_tokens.json", t->tok, t->tok);
    want = tu_strdupf("nf4deq: warning: %s/added_tokens.json: adds token 600 (\"<pad>\"), but the output's embedding "
                      "has 512 rows (0 to 511)", t->tok);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--tokenizer", t->tok, NULL);
    if (r.status != 0 || !strstr(r.err, want))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(want);
    tu_rmtree(t->out);
    tu_sh("printf '{\"<pad>\": 500}' > %s/added_tokens.json", t->tok); /* within the rows, as is 511 */
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--tokenizer", t->tok, NULL);
    if (r.status != 0 || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(t->out);
    tu_sh("rm %s/added_tokens.json", t->tok);
    /* Resized by the adapter to 516 rows: 515 fits, 516 does not. */
    char *ad = tu_strdupf("%s/resized", t->dir);
    tu_sh("cp -r %s/adapter-resized-copies %s && printf '{\"added_tokens_decoder\": {\"515\": {\"content\": "
          "\"<t4>\"}}}' > %s/tokenizer_config.json", LORA_FIXTURES, ad, ad);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", ad, NULL);
    if (r.status != 0 || strstr(r.err, "warning"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    tu_rmtree(t->out);
    tu_sh("printf '{\"added_tokens_decoder\": {\"516\": {\"content\": \"<t5>\"}}}' > %s/tokenizer_config.json", ad);
    r = tu_run("convert", "--device", "cpu", t->base, t->out, "--lora", ad, NULL);
    if (r.status != 0 || !strstr(r.err, "adds token 516 (\"<t5>\"), but the output's embedding has 516 rows"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    free(ad);
}

/* inspect says whose tokenizer convert would give the output, with --lora or --tokenizer only. */
static void test_inspect_says_whose(void **state)
{
    struct tok_case *t = tok_case_of(state);
    struct tu_run r = tu_run("inspect", "--json", t->base, "--lora", t->ad, NULL);
    char *want = tu_strdupf("\"tokenizer\": {\n    \"from\": \"adapter\",\n    \"path\": \"%s\",\n    \"files\": "
                            "[\n      \"additional_chat_templates\",\n      \"chat_template.jinja\",\n      \"tokenizer.json\",\n      "
                            "\"tokenizer_config.json\"\n    ]\n  }\n}", t->ad);
    if (r.status != 0 || !strstr(r.out, want))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    free(want);
    r = tu_run("inspect", "--json", t->base, "--lora", t->ad, "--tokenizer", "base", NULL);
    want = tu_strdupf("\"from\": \"base\",\n    \"path\": \"%s\",\n    \"files\": [\n      "
                      "\"special_tokens_map.json\",\n      \"tokenizer.model\",\n      \"tokenizer_config.json\"\n    ]",
                      t->base);
    if (r.status != 0 || !strstr(r.out, want))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    free(want);
    r = tu_run("inspect", t->base, "--tokenizer", t->tok, NULL);
    want = tu_strdupf("\nTokenizer: %s (merges.txt, tokenizer_config.json, vocab.json)\n", t->tok);
    if (r.status != 0 || !strstr(r.out, want))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    free(want);
    r = tu_run("inspect", "--json", t->base, NULL);
    assert_int_equal(r.status, 0);
    assert_null(strstr(r.out, "\"tokenizer\""));
    tu_run_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test_setup_teardown(test_adapter_tokenizer_by_default, tok_setup, tok_teardown),
        cmocka_unit_test_setup_teardown(test_tokenizer_option, tok_setup, tok_teardown),
        cmocka_unit_test_setup_teardown(test_tokenizer_refused, tok_setup, tok_teardown),
        cmocka_unit_test_setup_teardown(test_added_tokens_past_the_embedding, tok_setup, tok_teardown),
        cmocka_unit_test_setup_teardown(test_inspect_says_whose, tok_setup, tok_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
