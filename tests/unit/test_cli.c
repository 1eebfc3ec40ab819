/* The command line as a user and a shell script see it: help, version, exit
 * codes, one-line errors on stderr, and never a touched input or a partial output. */
#include "cpu_path.h"
#include "test_util.h"

#include <cJSON.h>

#include "gpu.h"
#include "safetensors_writer.h"

#define BNB4 FIXTURES "/tensors.bnb4.safetensors"

static void assert_one_line_error(const struct tu_run *r, const char *must_contain)
{
    assert_int_equal(tu_lines(r->err), 1);
    assert_true(strncmp(r->err, "nf4deq: ", 8) == 0);
    if (must_contain && !strstr(r->err, must_contain))
        fail_msg("stderr \"%s\" does not mention \"%s\"", r->err, must_contain);
}

static void test_help_and_version_go_to_stdout(void **state)
{
    (void)state;
    static const char *const CMDS[][2] = {{"--help", NULL}, {"-h", NULL}, {"convert", "--help"},
                                          {"inspect", "--help"}, {"bench", "--help"}, {"help", NULL}};
    for (size_t i = 0; i < sizeof CMDS / sizeof CMDS[0]; i++) {
        struct tu_run r = tu_run(CMDS[i][0], CMDS[i][1], NULL);
        assert_int_equal(r.status, 0);
        assert_non_null(strstr(r.out, "Usage"));
        assert_string_equal(r.err, "");
        tu_run_free(&r);
    }
    /* "help CMD" is CMD's own help, byte for byte. */
    static const char *const COMMANDS[] = {"convert", "inspect", "bench", "clean"};
    for (size_t i = 0; i < sizeof COMMANDS / sizeof *COMMANDS; i++) {
        struct tu_run own = tu_run(COMMANDS[i], "--help", NULL), r = tu_run("help", COMMANDS[i], NULL);
        if (r.status != 0 || strcmp(r.out, own.out) != 0 || strncmp(r.out, "Usage: nf4deq ", 14) != 0)
            fail_msg("help %s: exit %d, stdout: %.80s", COMMANDS[i], r.status, r.out);
        tu_run_free(&own);
        tu_run_free(&r);
    }
    struct tu_run r = tu_run("--help", NULL);
    assert_non_null(strstr(r.out, "Exit status"));
    tu_run_free(&r);
    r = tu_run("--version", NULL);
    assert_int_equal(r.status, 0);
    assert_true(strncmp(r.out, "nf4deq ", 7) == 0);
    tu_run_free(&r);
}

static void test_usage_errors_exit_2(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    char *out_slash = tu_strdupf("%s/", out); /* a directory, for a file input */
    const char *const CASES[][8] = {
        {NULL},
        {"frobnicate", NULL},
        {"convert", NULL},
        {"convert", BNB4, NULL},
        {"convert", BNB4, out, "extra", NULL},
        {"convert", "--dtype", "fp8", BNB4, out, NULL},
        {"convert", "--device", "tpu", BNB4, out, NULL},
        {"convert", "--threads", "0", BNB4, out, NULL},
        {"convert", "--threads", "many", BNB4, out, NULL},
        {"convert", "--gpu-mem", "lots", BNB4, out, NULL},
        {"convert", "--no-such-option", BNB4, out, NULL},
        {"convert", "--mem", "99999999999999999999", BNB4, out, NULL}, /* past 2^64 */
        {"convert", "--mem", " -1", BNB4, out, NULL},                   /* strtoull: 2^64 - 1 */
        {"convert", "--gpu-mem", "+1G", BNB4, out, NULL},
        {"convert", BNB4, "", NULL},
        {"convert", "", out, NULL},
        {"convert", BNB4, out_slash, NULL},
        {"bench", "--no-such-option", NULL},
        {"inspect", NULL},
        {"inspect", "--dtype", "int4", BNB4, NULL},
        {"inspect", "", NULL},
        {"help", "frobnicate", NULL},
        {"help", "convert", "inspect", NULL},
        {"clean", "", NULL},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        struct tu_run r = tu_run_argv((char *const *)CASES[i]);
        if (r.status != 2)
            fail_msg("case %zu (%s %s) exited %d", i, CASES[i][0] ? CASES[i][0] : "", CASES[i][0] && CASES[i][1] ? CASES[i][1] : "", r.status);
        assert_true(strncmp(r.err, "nf4deq: ", 8) == 0);
        assert_string_equal(r.out, "");
        tu_run_free(&r);
    }
    assert_false(tu_exists(out));
    free(out);
    free(out_slash);
}

/* getopt_long leaves optind on a cluster such as -zq until its last letter, and
 * names a long option given "=VALUE" by its short value: the message must
 * still name what the user typed. */
static void test_option_errors_name_the_option(void **state)
{
    (void)state;
    static const struct {
        const char *args[6];
        const char *said;
    } CASES[] = {
        {{"convert", "-zq", "a", "b"}, "unrecognized option '-z'"},
        {{"convert", "-qz", "a", "b"}, "unrecognized option '-z'"},
        {{"convert", "a", "b", "--force", "-zq"}, "unrecognized option '-z'"},
        {{"convert", "--bogus", "a", "b"}, "unrecognized option '--bogus'"},
        {{"convert", "--force=1", "a", "b"}, "option '--force=1' takes no argument"},
        {{"convert", "--dtype=bf16", "-Dq", "a", "b"}, "unrecognized option '-D'"},
        {{"convert", "--lora", "--json=1", "-Jq", "a", "b"}, "unrecognized option '-J'"}, /* --json=1: --lora's */
        {{"convert", "a", "b", "--dtype"}, "option '--dtype' needs an argument"},
        {{"convert", "a", "b", "-qd"}, "option '-d' needs an argument"},
        {{"inspect", "--json=yes", "a"}, "option '--json=yes' takes no argument"},
        {{"clean", "-x"}, "unrecognized option '-x'"},
        {{"bench", "-z"}, "unrecognized option '-z'"},
        /* An abbreviation of two options is named as GNU getopt names it. */
        {{"convert", "--d", "bf16", "a", "b"}, "option '--d' is ambiguous; possibilities: '--dtype' '--device'"},
        {{"convert", "--re=main", "a", "b"}, "option '--re=main' is ambiguous; possibilities: '--revision' '--resume'"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        struct tu_run r = tu_run_argv((char *const *)CASES[i].args);
        assert_int_equal(r.status, 2);
        if (!strstr(r.err, CASES[i].said) || !strstr(r.err, "Try 'nf4deq "))
            fail_msg("case %zu: stderr \"%s\" lacks \"%s\"", i, r.err, CASES[i].said);
        tu_run_free(&r);
    }
    struct tu_run r = tu_run("bench", "--device", "", NULL); /* strtol reads "" as 0 */
    assert_int_equal(r.status, 2);
    assert_string_equal(r.err, "nf4deq: bench: bad --device ''\nTry 'nf4deq bench --help' for more information.\n");
    tu_run_free(&r);
    /* bench's own checks of its arguments end with the same line; the
     * environment's are not the command line's. */
    r = tu_run("bench", "--cpu", "--iters", "0", NULL);
    assert_int_equal(r.status, 2);
    assert_string_equal(r.err, "nf4deq: bench: bad --iters '0'\nTry 'nf4deq bench --help' for more information.\n");
    tu_run_free(&r);
    assert_int_equal(setenv("NF4DEQ_CPU", "avx3", 1), 0);
    r = tu_run("bench", "--cpu", NULL);
    unsetenv("NF4DEQ_CPU");
    assert_int_equal(r.status, 2);
    assert_string_equal(r.err, "nf4deq: NF4DEQ_CPU=avx3 is not a CPU path (scalar, sse, avx2, avx512 or neon)\n");
    tu_run_free(&r);
}

/* "convert IN - >> IN" and "1<> IN": the shell opened the input as standard
 * output, without truncating it. */
static void test_stdout_that_is_the_input_is_refused(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in.safetensors", s->dir);
    size_t len;
    char *orig = tu_read_file(BNB4, &len);
    tu_write_file(in, orig, len);
    static const int MODES[] = {O_WRONLY | O_APPEND, O_RDWR};
    static const char *const INPUTS[] = {NULL, "-"}; /* the path, or the same file as standard input too */
    for (int m = 0; m < 2; m++)
        for (int k = 0; k < 2; k++) {
            pid_t pid = fork();
            assert_true(pid >= 0);
            if (pid == 0) {
                int fd = open(in, MODES[m]), in_fd = open(in, O_RDONLY), null = open("/dev/null", O_WRONLY);
                if (fd < 0 || in_fd < 0 || null < 0)
                    _exit(99);
                dup2(in_fd, 0);
                dup2(fd, 1);
                dup2(null, 2);
                char *args[] = {"convert", "--device", "cpu", (char *)(INPUTS[k] ? INPUTS[k] : in), "-", NULL};
                tu_exec_nf4deq(args);
            }
            int st;
            waitpid(pid, &st, 0);
            assert_true(WIFEXITED(st));
            assert_int_equal(WEXITSTATUS(st), 2);
        }
    size_t now_len;
    char *now = tu_read_file(in, &now_len);
    assert_int_equal(now_len, len);
    assert_memory_equal(now, orig, len);
    free(now);
    free(orig);
    free(in);
}

/* The temps beside OUT are 15 bytes longer than its name: a name too long for
 * them is refused up front, in one line, and nothing is left. */
static void test_output_name_too_long_for_its_temps(void **state)
{
    struct tu_scratch *s = *state;
    char name[242];
    memset(name, 'n', 241);
    name[241] = '\0';
    char *out = tu_strdupf("%s/%s", s->dir, name);
    struct tu_run r = tu_run("convert", "--device", "cpu", BNB4, out, NULL);
    assert_int_equal(r.status, 73);
    assert_one_line_error(&r, "shorter");
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
    out[strlen(out) - 1] = '\0'; /* 240 bytes: fits */
    r = tu_run("convert", "-q", "--device", "cpu", "--dtype", "bf16", BNB4, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    tu_assert_same_tensors(out, FIXTURES "/tensors.expected-bf16.safetensors");
    free(out);
}

static void test_missing_input_exits_66(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/nope.safetensors", s->dir), *out = tu_strdupf("%s/out.safetensors", s->dir);
    struct tu_run r = tu_run("convert", in, out, NULL);
    assert_int_equal(r.status, 66);
    assert_one_line_error(&r, in);
    tu_run_free(&r);
    r = tu_run("inspect", in, NULL);
    assert_int_equal(r.status, 66);
    tu_run_free(&r);
    /* A directory that is not a model. */
    r = tu_run("convert", s->dir, out, NULL);
    assert_int_equal(r.status, 66);
    assert_one_line_error(&r, s->dir);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
    free(in);
    free(out);
}

static void test_existing_output_needs_force(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    tu_write_file(out, "keep me", 7);
    struct tu_run r = tu_run("convert", "-q", BNB4, out, NULL);
    assert_int_equal(r.status, 73);
    assert_one_line_error(&r, "--force");
    tu_run_free(&r);
    size_t len;
    char *kept = tu_read_file(out, &len);
    assert_int_equal(len, 7);
    free(kept);
    r = tu_run("convert", "-q", "--force", "--device", "cpu", "--dtype", "bf16", BNB4, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    tu_assert_same_tensors(out, FIXTURES "/tensors.expected-bf16.safetensors") ;
    assert_int_equal(tu_count_entries(s->dir), 1);
    free(out);
}

static void test_output_directory_replaced_only_with_force(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/model", s->dir);
    const char *in = FIXTURES "/tiny-llama-bf16-bnb4-sharded";
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    assert_int_equal(r.status, 73);
    tu_run_free(&r);
    char *stale = tu_strdupf("%s/stale.txt", out);
    tu_write_file(stale, "x", 1);
    r = tu_run("convert", "-q", "--force", "--device", "cpu", "--dtype", "fp16", in, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    /* The old tree is gone, not merged with the new one. */
    assert_false(tu_exists(stale));
    assert_int_equal(tu_count_entries(s->dir), 1);
    free(stale);
    free(out);
}

/* What stands at OUT is replaced by a rename, never written through, so only a
 * regular file or a directory may be there: a link (even to nothing), a FIFO
 * or ".." is refused at once, with or without --force, and left as it was. */
static void test_outputs_that_cannot_be_replaced(void **state)
{
    struct tu_scratch *s = *state;
    static const struct {
        const char *what, *make, *out; /* make: shell run in the scratch dir */
        int dir_input, force, status;
        const char *said;
    } CASES[] = {
        {"link to a file, --force", "echo old > t && ln -s t o", "o", 0, 1, 73, "is a symbolic link"},
        {"link to a file", "echo old > t && ln -s t o", "o", 0, 0, 73, "is a symbolic link"},
        {"link to nothing", "ln -s nowhere o", "o", 0, 0, 73, "is a symbolic link"},
        {"link to nothing, directory input", "ln -s nowhere o", "o", 1, 0, 73, "is a symbolic link"},
        {"link to a directory, --force", "mkdir d && ln -s d o", "o", 1, 1, 73, "is a symbolic link"},
        {"FIFO, --force", "mkfifo o", "o", 0, 1, 73, "is not a regular file or a directory"},
        {"..", "mkdir -p d/e", "d/e/..", 1, 1, 2, "cannot be replaced"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        tu_sh("rm -rf %s/* && cd %s && %s", s->dir, s->dir, CASES[i].make);
        char *out = tu_strdupf("%s/%s", s->dir, CASES[i].out);
        const char *in = CASES[i].dir_input ? FIXTURES "/tiny-llama-bf16-bnb4" : BNB4;
        struct tu_run r = CASES[i].force ? tu_run("convert", "-q", "--force", "--device", "cpu", in, out, NULL)
                                         : tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
        if (r.status != CASES[i].status || !strstr(r.err, CASES[i].said))
            fail_msg("%s: exit %d, stderr %s", CASES[i].what, r.status, r.err);
        assert_one_line_error(&r, CASES[i].out);
        tu_run_free(&r);
        /* Nothing replaced or added: the link is still a link, the FIFO a FIFO. */
        struct stat st;
        assert_int_equal(lstat(out, &st), 0);
        if (strcmp(CASES[i].out, "o") == 0)
            assert_true(strncmp(CASES[i].make, "mkfifo", 6) == 0 ? S_ISFIFO(st.st_mode) : S_ISLNK(st.st_mode));
        assert_int_equal(tu_sh_status("cd %s && [ -z \"$(ls -A | grep -v -x -e o -e t -e d)\" ]", s->dir), 0);
        free(out);
    }
}

/* An input with no 4-bit weight (the 16-bit original, say) converts to a
 * copy; a warning says so, since it is seldom the input meant. */
static void test_input_without_4bit_weights_warns(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cpu", FIXTURES "/tensors.expected-bf16.safetensors", out, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "tensors.expected-bf16.safetensors: no bitsandbytes 4-bit weights, so nothing to "
                                  "dequantize: tensors are copied as they are\n"));
    tu_run_free(&r);
    tu_assert_same_tensors(out, FIXTURES "/tensors.expected-bf16.safetensors");
    r = tu_run("convert", "--device", "cpu", BNB4, "-", NULL);
    assert_int_equal(r.status, 0);
    assert_null(strstr(r.err, "warning"));
    tu_run_free(&r);
    free(out);
}

static void test_refuses_to_overwrite_input(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in.safetensors", s->dir);
    size_t len;
    char *orig = tu_read_file(BNB4, &len);
    tu_write_file(in, orig, len);
    char *link = tu_strdupf("%s/link.safetensors", s->dir);
    assert_int_equal(symlink(in, link), 0);
    const char *outs[] = {in, link};
    for (int i = 0; i < 2; i++) {
        struct tu_run r = tu_run("convert", "--force", in, outs[i], NULL);
        assert_int_equal(r.status, 2);
        assert_one_line_error(&r, "input");
        tu_run_free(&r);
    }
    size_t now_len;
    char *now = tu_read_file(in, &now_len);
    assert_int_equal(now_len, len);
    assert_memory_equal(now, orig, len);
    /* A model directory cannot be converted onto itself either. */
    struct tu_run r = tu_run("convert", "--force", FIXTURES "/tiny-llama-bf16-bnb4", FIXTURES "/tiny-llama-bf16-bnb4", NULL);
    assert_int_equal(r.status, 2);
    tu_run_free(&r);
    free(now);
    free(orig);
    free(in);
    free(link);
}

/* The exit status of nf4deq `args` with its standard output opened on
 * `path` for reading and writing (1<>), its stderr silenced. */
static int exit_with_stdout_on(const char *path, char *const *args)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(path, O_RDWR), null = open("/dev/null", O_WRONLY);
        if (fd < 0 || null < 0)
            _exit(99);
        dup2(fd, 1);
        dup2(null, 2);
        tu_exec_nf4deq(args);
    }
    int st;
    waitpid(pid, &st, 0);
    assert_true(WIFEXITED(st));
    return WEXITSTATUS(st);
}

/* An adapter or --tokenizer folder is an input too: --force must not replace
 * an OUT that is one, or holds one, and its files stay as they were. */
static void test_force_spares_the_adapter_and_the_tokenizer(void **state)
{
    struct tu_scratch *s = *state;
    const char *base = FIXTURES "/lora/base-llama-bf16-bnb4", *adapter = FIXTURES "/lora/adapter-r8-all-linear";
    const char *flux = FIXTURES "/diffusers/tiny-flux-transformer.bnb4.safetensors";
    const char *flux_lora = FIXTURES "/diffusers/lora-flux/pytorch_lora_weights.safetensors";
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    tu_sh("cd %s && cp -r %s/%s ad && mkdir out && cp -r ad out/ad && mkdir tok && echo '{}' > tok/tokenizer.json && "
          "cp %s/%s l.safetensors", s->dir, cwd, adapter, cwd, flux_lora);
    static const struct {
        const char *in, *out, *opt, *arg; /* out and arg: under the scratch directory */
        const char *says;
    } CASES[] = {
        {"base", "ad", "--lora", "ad", "ad: is the adapter"},
        {"base", "out", "--lora", "out/ad", "out: contains the adapter"},
        {"base", "tok", "--tokenizer", "tok", "tok: is the --tokenizer folder"},
        {"flux", "l.safetensors", "--lora", "l.safetensors", "l.safetensors: is the adapter"},
        /* a file of the adapter's folder */
        {"file", "ad/adapter_model.safetensors", "--lora", "ad", "adapter_model.safetensors: is inside the adapter"},
    };
    char *base_file = tu_strdupf("%s/model.safetensors", base);
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        char *out = tu_strdupf("%s/%s", s->dir, CASES[i].out), *arg = tu_strdupf("%s/%s", s->dir, CASES[i].arg);
        const char *in = strcmp(CASES[i].in, "base") == 0 ? base : strcmp(CASES[i].in, "file") == 0 ? base_file : flux;
        struct tu_run r = tu_run("convert", "-q", "--force", "--device", "cpu", in, out, CASES[i].opt, arg, NULL);
        if (r.status != 2 || !strstr(r.err, CASES[i].says))
            fail_msg("%s %s: exit %d: %s", CASES[i].opt, CASES[i].arg, r.status, r.err);
        assert_one_line_error(&r, "refusing to replace it");
        tu_run_free(&r);
        free(out);
        free(arg);
    }
    tu_sh("cd %s && for d in ad out/ad; do cmp ad/adapter_model.safetensors %s/%s/adapter_model.safetensors && "
          "cmp ad/adapter_config.json %s/%s/adapter_config.json; done && test -f tok/tokenizer.json && "
          "cmp l.safetensors %s/%s", s->dir, cwd, adapter, cwd, adapter, cwd, flux_lora);
    /* Standard output opened on the adapter (1<> or >>) is refused as on IN. */
    char *lora = tu_strdupf("%s/l.safetensors", s->dir);
    char *on_lora[] = {"convert", "--device", "cpu", (char *)flux, "-", "--lora", lora, NULL};
    assert_int_equal(exit_with_stdout_on(lora, on_lora), 2);
    tu_sh("cmp %s %s", lora, flux_lora);
    /* ... and on a file of an adapter's folder. */
    char *ad = tu_strdupf("%s/ad", s->dir), *ad_weights = tu_strdupf("%s/ad/adapter_model.safetensors", s->dir);
    char *on_ad[] = {"convert", "--device", "cpu", base_file, "-", "--lora", ad, NULL};
    assert_int_equal(exit_with_stdout_on(ad_weights, on_ad), 2);
    tu_sh("cmp %s %s/%s/adapter_model.safetensors", ad_weights, cwd, adapter);
    free(ad);
    free(ad_weights);
    free(base_file);
    free(lora);
}

/* --dtype in any case (BF16, as inspect prints it), and an OUT whose
 * directory is missing names that directory. */
static void test_dtype_case_and_missing_out_directory(void **state)
{
    struct tu_scratch *s = *state;
    char *out = tu_strdupf("%s/upper.safetensors", s->dir), *lower = tu_strdupf("%s/lower.safetensors", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", "--dtype", "BF16", BNB4, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("convert", "-q", "--device", "cpu", "--dtype", "bf16", BNB4, lower, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    tu_sh("cmp %s %s", out, lower);
    char *nested = tu_strdupf("%s/nodir/out.safetensors", s->dir);
    char *says = tu_strdupf("cannot be created in %s/nodir:", s->dir);
    r = tu_run("convert", "--device", "cpu", BNB4, nested, NULL);
    if (r.status != 73 || !strstr(r.err, says))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    assert_one_line_error(&r, "No such file or directory");
    tu_run_free(&r);
    free(says);
    free(nested);
    free(out);
    free(lower);
}

static void test_file_and_directory_do_not_mix(void **state)
{
    struct tu_scratch *s = *state;
    struct tu_run r = tu_run("convert", "--force", BNB4, s->dir, NULL);
    assert_int_equal(r.status, 2);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
}

static void test_device_choice_without_gpu(void **state)
{
    struct tu_scratch *s = *state;
    if (gpu_device_count() > 0)
        skip();
    char *out = tu_strdupf("%s/out.safetensors", s->dir);
    struct tu_run r = tu_run("convert", "--device", "cuda", BNB4, out, NULL);
    assert_int_equal(r.status, 69);
    assert_one_line_error(&r, NULL);
    tu_run_free(&r);
    assert_int_equal(tu_count_entries(s->dir), 0);
    /* auto keeps a plain conversion on a vector CPU kernel without asking for
     * a GPU at all; with only the scalar kernel it looks for one, says it is
     * falling back, then succeeds; --quiet silences both lines. */
    r = tu_run("convert", BNB4, out, NULL);
    assert_int_equal(r.status, 0);
    if (cpu_path_best() != CPU_PATH_SCALAR)
        assert_null(strstr(r.err, "CUDA"));
    assert_non_null(strstr(r.err, "converted 9 tensors (8 dequantized)"));
    tu_run_free(&r);
    assert_int_equal(setenv("NF4DEQ_CPU", "scalar", 1), 0);
    r = tu_run("convert", "-f", BNB4, out, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "no CUDA device"));
    assert_non_null(strstr(r.err, "on CPU (") && strstr(r.err, "scalar)"));
    tu_run_free(&r);
    r = tu_run("convert", "-q", "-f", BNB4, out, NULL);
    unsetenv("NF4DEQ_CPU");
    assert_int_equal(r.status, 0);
    assert_string_equal(r.err, "");
    tu_run_free(&r);
    free(out);
}

static void test_inspect_text_and_json(void **state)
{
    (void)state;
    struct tu_run r = tu_run("inspect", BNB4, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "nf4 blocksize 64, double quant, storage U8, [256, 512] -> BF16"));
    assert_non_null(strstr(r.out, "fp4 blocksize 64"));
    assert_non_null(strstr(r.out, "single quant"));
    assert_non_null(strstr(r.out, "storage BF16"));
    assert_non_null(strstr(r.out, "quant state of model.a.weight"));
    tu_run_free(&r);

    r = tu_run("inspect", "--json", "--dtype", "fp32", BNB4, NULL);
    assert_int_equal(r.status, 0);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    const cJSON *totals = cJSON_GetObjectItemCaseSensitive(root, "totals");
    uint64_t params = 256 * 512 + 384 * 200 + 64 * 1000 + 128 * 256 + 96 * 320 + 512 * 128 + 4096 + 300 * 301 + 512;
    assert_int_equal((uint64_t)cJSON_GetObjectItemCaseSensitive(totals, "parameters")->valuedouble, params);
    assert_int_equal((uint64_t)cJSON_GetObjectItemCaseSensitive(totals, "bytes_after_conversion")->valuedouble,
                     params * 4);
    assert_int_equal((int)cJSON_GetObjectItemCaseSensitive(totals, "quantized_weights")->valuedouble, 8);
    const cJSON *t;
    int found = 0;
    cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(root, "tensors"))
    {
        if (strcmp(cJSON_GetObjectItemCaseSensitive(t, "name")->valuestring, "model.h.weight") != 0)
            continue;
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(t, "quantization");
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(q, "type")->valuestring, "nf4");
        assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(q, "double_quant")));
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(q, "output_dtype")->valuestring, "F32");
        found = 1;
    }
    assert_true(found);
    cJSON_Delete(root);
    tu_run_free(&r);

    r = tu_run("inspect", FIXTURES "/tiny-llama-fp16-bnb4-sharded", NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "in 5 files, 14 quantized weights"));
    tu_run_free(&r);
}

/* A number member of obj, which must be there. */
static double json_number(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v))
        fail_msg("no number \"%s\" in the JSON", key);
    return v->valuedouble;
}

/* bench --cpu compares every path with the scalar one: an odd shape whose
 * output is large enough to be streamed (non-temporal stores from a cache-line
 * start; x86 only) and ends mid-block. Its timings are not checked, only that
 * it ran every path, streamed, and found them identical. */
static void test_bench_cpu_checks_every_path(void **state)
{
    (void)state;
    struct tu_run r = tu_run("bench", "--cpu", "--shape", "4099x8191", "--threads", "1,2", "--iters", "3", "--json", NULL);
    if (r.status != 0)
        fail_msg("bench --cpu exited %d: %s", r.status, r.err);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "identical")));
#if defined(__x86_64__) || defined(__i386__)
    const int streams = cpu_path_supported(CPU_PATH_SSE) != 0; /* any x86 vector path */
#else
    const int streams = 0; /* NEON writes through the cache */
#endif
    assert_int_equal(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "streamed")), streams);
    assert_int_equal((uint64_t)json_number(root, "out_bytes"), 4099ull * 8191 * 2);
    const cJSON *row;
    int rows = 0;
    cJSON_ArrayForEach(row, cJSON_GetObjectItemCaseSensitive(root, "results"))
    {
        rows++;
        assert_true(json_number(row, "memcpy_gbps") > 0);
        assert_true(json_number(row, "write_floor_gbps") > 0);
        for (int p = 0; p < CPU_PATH_COUNT; p++) {
            char key[32];
            snprintf(key, sizeof key, "%s_gbps", cpu_path_name((enum cpu_path)p));
            if (cpu_path_supported((enum cpu_path)p))
                assert_true(json_number(row, key) > 0);
            else
                assert_null(cJSON_GetObjectItemCaseSensitive(row, key));
        }
    }
    assert_int_equal(rows, 2);
    cJSON_Delete(root);
    tu_run_free(&r);
    /* Its types are named as convert's, in any case; one it does not time is
     * named where it came from. */
    r = tu_run("bench", "--cpu", "--shape", "64x64", "--dtype", "BF16", "--threads", "1", "--iters", "3", NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("bench", "--cpu", "--shape", "64x64:fp32", NULL);
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "nf4deq: bench: the type in --shape must be fp16 or bf16, not 'fp32'\n"));
    tu_run_free(&r);
}

/* bench --cpu --lora-rank times the merge: every path's bytes against the
 * scalar path's, on an odd shape whose rows end mid-strip; the output goes
 * through the cache, so the write floor is memset. Bad ranks and the option
 * without --cpu are usage errors. */
static void test_bench_cpu_merge(void **state)
{
    (void)state;
    struct tu_run r = tu_run("bench", "--cpu", "--lora-rank", "5", "--shape", "37x1001:fp16", "--threads", "1,2",
                             "--iters", "3", "--json", NULL);
    if (r.status != 0)
        fail_msg("bench --cpu --lora-rank exited %d: %s", r.status, r.err);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "identical")));
    assert_false(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "streamed")));
    assert_int_equal((uint64_t)json_number(root, "lora_rank"), 5);
    assert_int_equal((uint64_t)json_number(root, "out_bytes"), 37ull * 1001 * 2);
    assert_int_equal((uint64_t)json_number(root, "in_bytes"), 37ull * 1001 * 2 + (37 + 1001) * 5 * 4);
    cJSON_Delete(root);
    tu_run_free(&r);
    static const char *const BAD[][2] = {{"0", "bad --lora-rank '0' (1..4096)"},
                                          {"4097", "bad --lora-rank '4097' (1..4096)"},
                                          {"r16", "bad --lora-rank 'r16' (1..4096)"}};
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        r = tu_run("bench", "--cpu", "--lora-rank", BAD[i][0], NULL);
        assert_int_equal(r.status, 2);
        if (!strstr(r.err, BAD[i][1]))
            fail_msg("--lora-rank %s: stderr \"%s\"", BAD[i][0], r.err);
        tu_run_free(&r);
    }
    r = tu_run("bench", "--lora-rank", "8", NULL);
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "nf4deq: bench: --lora-rank goes with --cpu"));
    tu_run_free(&r);
}

/* A full stdout is an error, not a silent success. */
static void test_stdout_write_error_exits_74(void **state)
{
    (void)state;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int full = open("/dev/full", O_WRONLY);
        int null = open("/dev/null", O_WRONLY);
        if (full < 0)
            _exit(99);
        dup2(full, 1);
        dup2(null, 2);
        execl(NF4DEQ_BIN, NF4DEQ_BIN, "inspect", BNB4, (char *)NULL);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 99)
        skip();
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 74);
}

/* Builds `dir` as a Hugging Face hub cache snapshot: every file a symlink into
 * the repository's blobs/ directory. */
static char *make_hub_cache_snapshot(const char *root, const char *model)
{
    char *blobs = tu_strdupf("%s/models--x/blobs", root);
    char *snap = tu_strdupf("%s/models--x/snapshots/0123abcd", root);
    char *cmd = tu_strdupf("mkdir -p %s %s && cp %s/* %s/", blobs, snap, model, blobs);
    assert_int_equal(system(cmd), 0);
    DIR *d = opendir(blobs);
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') {
            char *target = tu_strdupf("../../blobs/%s", e->d_name), *link = tu_strdupf("%s/%s", snap, e->d_name);
            assert_int_equal(symlink(target, link), 0);
            free(target);
            free(link);
        }
    closedir(d);
    free(cmd);
    free(blobs);
    return snap;
}

static void test_symlinks_inside_the_hub_cache_are_followed(void **state)
{
    struct tu_scratch *s = *state;
    char *snap = make_hub_cache_snapshot(s->dir, FIXTURES "/tiny-llama-bf16-bnb4-sharded");
    char *out = tu_strdupf("%s/out", s->dir), *evil = tu_strdupf("%s/stolen.txt", snap);
    assert_int_equal(symlink("/etc/hostname", evil), 0);
    struct tu_run r = tu_run("convert", "--device", "cpu", snap, out, NULL);
    assert_int_equal(r.status, 0);
    /* A link leaving the model is not copied, and the user is told. */
    assert_non_null(strstr(r.err, "outside the model directory; not copied"));
    tu_run_free(&r);
    char *copied = tu_strdupf("%s/stolen.txt", out), *config = tu_strdupf("%s/generation_config.json", out);
    assert_false(tu_exists(copied));
    assert_true(tu_exists(config));
    free(copied);
    free(config);
    free(evil);
    free(out);
    free(snap);
}

static void test_shard_linking_outside_the_model_is_refused(void **state)
{
    struct tu_scratch *s = *state;
    char *model = tu_strdupf("%s/model", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && mv %s/model-00002-of-00005.safetensors %s/ && "
                           "ln -s ../model-00002-of-00005.safetensors %s/model-00002-of-00005.safetensors",
                           FIXTURES "/tiny-llama-bf16-bnb4-sharded", model, model, s->dir, model);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("convert", "--device", "cpu", model, out, NULL);
    assert_int_equal(r.status, 65);
    assert_one_line_error(&r, "model-00002-of-00005.safetensors: is a link to a file outside the model directory");
    tu_run_free(&r);
    assert_false(tu_exists(out));
    assert_int_equal(tu_count_entries(s->dir), 2); /* the model and the moved shard, nothing else */
    free(cmd);
    free(model);
    free(out);
}

/* A model directory's config.json is its own: one that is a directory (or a
 * FIFO) is refused before any shard is written, by convert and inspect alike,
 * rather than leaving an output with no config.json or a half-done run. */
static void test_config_that_is_no_file_is_refused_first(void **state)
{
    struct tu_scratch *s = *state;
    char *model = tu_strdupf("%s/model", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && rm %s/config.json && mkdir %s/config.json",
                           FIXTURES "/tiny-llama-bf16-bnb4-sharded", model, model, model);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("convert", "--device", "cpu", model, out, NULL);
    assert_int_equal(r.status, 66);
    assert_one_line_error(&r, "model/config.json: not a regular file");
    tu_run_free(&r);
    assert_false(tu_exists(out));
    assert_int_equal(tu_count_entries(s->dir), 1); /* no temp, no lock */
    r = tu_run("inspect", model, NULL);
    assert_int_equal(r.status, 66);
    assert_one_line_error(&r, "model/config.json: not a regular file");
    tu_run_free(&r);
    free(cmd);
    free(model);
    free(out);
}

/* save_pretrained(variant="bf16") names a sharded checkpoint's index
 * model.safetensors.index.bf16.json (diffusers likewise): alone, it is the
 * index, rewritten under its own name as the plain one is, the shards byte
 * for byte the plain conversion's. Beside a plain index, which transformers
 * loads unless told a variant, it is another checkpoint's, left out with a
 * warning (copied, it would list tensors OUT does not have). Beside a weights
 * file it does not list, or another variant's index, nf4deq does not choose. */
static void test_variant_index_is_the_index(void **state)
{
    struct tu_scratch *s = *state;
    char *model = tu_strdupf("%s/model", s->dir), *out = tu_strdupf("%s/out", s->dir),
         *plain = tu_strdupf("%s/plain", s->dir), *both = tu_strdupf("%s/both", s->dir),
         *refused = tu_strdupf("%s/refused", s->dir);
    tu_sh("cp -r %s %s && mv %s/model.safetensors.index.json %s/model.safetensors.index.bf16.json",
          FIXTURES "/tiny-llama-bf16-bnb4-sharded", model, model, model);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", model, out, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    r = tu_run("convert", "-q", "--device", "cpu", FIXTURES "/tiny-llama-bf16-bnb4-sharded", plain, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    tu_sh("cd %s && test ! -e model.safetensors.index.json && for f in model-0000?-of-00005.safetensors; do "
          "cmp $f %s/$f || exit 1; done && cmp model.safetensors.index.bf16.json %s/model.safetensors.index.json",
          out, plain, plain);
    /* Beside the plain index. */
    tu_sh("cp %s/model.safetensors.index.bf16.json %s/model.safetensors.index.json", model, model);
    r = tu_run("convert", "--device", "cpu", model, both, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "model/model.safetensors.index.bf16.json: not part of the model (the index of "
                                  "another variant; the model's is model.safetensors.index.json); not copied\n"));
    tu_run_free(&r);
    tu_sh("cd %s && test ! -e model.safetensors.index.bf16.json && cmp model.safetensors.index.json "
          "%s/model.safetensors.index.json", both, plain);
    /* Beside another variant's index, and beside a weights file it does not list. */
    tu_sh("mv %s/model.safetensors.index.json %s/model.safetensors.index.fp16.json", model, model);
    r = tu_run("convert", "--device", "cpu", model, refused, NULL);
    assert_int_equal(r.status, 65);
    assert_one_line_error(&r, "is ambiguous: it holds 2 index files (model.safetensors.index.bf16.json and "
                              "model.safetensors.index.fp16.json)");
    tu_run_free(&r);
    tu_sh("rm %s/model.safetensors.index.fp16.json && cp %s/model.safetensors %s/", model,
          FIXTURES "/tiny-llama-bf16-bnb4", model);
    r = tu_run("convert", "--device", "cpu", model, refused, NULL);
    assert_int_equal(r.status, 65);
    assert_one_line_error(&r, "is ambiguous: it holds model.safetensors.index.bf16.json, the index of a variant, "
                              "and model.safetensors, which it does not list");
    tu_run_free(&r);
    assert_false(tu_exists(refused));
    free(model);
    free(out);
    free(plain);
    free(both);
    free(refused);
}

/* A 4-bit model.safetensors left beside the shards, or a hidden one, must not
 * reach the output: transformers could load it, still quantized, before the
 * index. inspect names the same files. */
static void test_stray_checkpoint_files_are_not_copied(void **state)
{
    struct tu_scratch *s = *state;
    char *model = tu_strdupf("%s/model", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && cp %s/model.safetensors %s/ && cp %s %s/.old.safetensors",
                           FIXTURES "/tiny-llama-bf16-bnb4-sharded", model, FIXTURES "/tiny-llama-bf16-bnb4", model,
                           BNB4, model);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("inspect", model, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\nNot part of the model, neither converted nor copied:\n"
                                  "  .old.safetensors (a hidden file)\n"
                                  "  model.safetensors (not listed in model.safetensors.index.json)\n"));
    tu_run_free(&r);
    r = tu_run("inspect", "--json", model, NULL);
    assert_int_equal(r.status, 0);
    cJSON *root = cJSON_Parse(r.out);
    char *not_copied = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "not_copied"));
    assert_string_equal(not_copied, "[\".old.safetensors\",\"model.safetensors\"]");
    free(not_copied);
    cJSON_Delete(root);
    tu_run_free(&r);
    r = tu_run("convert", "--device", "cpu", model, out, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "model/model.safetensors: not part of the model (not listed in "
                                  "model.safetensors.index.json); not copied\n"));
    assert_non_null(strstr(r.err, ".old.safetensors: not part of the model (a hidden file); not copied\n"));
    tu_run_free(&r);
    char *stray = tu_strdupf("%s/model.safetensors", out), *hidden = tu_strdupf("%s/.old.safetensors", out);
    assert_false(tu_exists(stray));
    assert_false(tu_exists(hidden));
    free(stray);
    free(hidden);
    free(cmd);
    free(model);
    free(out);
}

/* inspect says what convert does with every entry of a pipeline: a checkpoint
 * beside the components and links to nothing are not copied, and a link to
 * nothing (a blob missing from a cache) is a warning, not a failure. */
static void test_pipeline_entries_inspect_agrees_with_convert(void **state)
{
    struct tu_scratch *s = *state;
    char *pl = tu_strdupf("%s/pl", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && cp %s %s/single.safetensors && ln -s nowhere %s/README.md && "
                           "ln -s nowhere %s/transformer/notes.txt",
                           FIXTURES "/diffusers/tiny-flux-bnb4", pl, BNB4, pl, pl, pl);
    assert_int_equal(system(cmd), 0);
    struct tu_run r = tu_run("inspect", "--json", pl, NULL);
    assert_int_equal(r.status, 0);
    cJSON *root = cJSON_Parse(r.out);
    assert_non_null(root);
    char *copied = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "copied"));
    char *not_copied = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "not_copied"));
    assert_string_equal(copied, "[\"model_index.json\"]");
    assert_string_equal(not_copied, "[\"README.md\",\"single.safetensors\"]");
    free(copied);
    free(not_copied);
    /* Bytes after conversion are tensor bytes for every component, copied
     * ones too (the vae), as for a model inspected alone, and add up. */
    uint64_t pipeline_after = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(root, "components"))
    {
        uint64_t sum = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(c, "tensors"))
        {
            const cJSON *q = cJSON_GetObjectItemCaseSensitive(t, "quantization");
            const cJSON *b = cJSON_GetObjectItemCaseSensitive(q ? q : t, "output_bytes");
            sum += b ? (uint64_t)b->valuedouble : 0;
        }
        const cJSON *totals = cJSON_GetObjectItemCaseSensitive(c, "totals");
        assert_int_equal((uint64_t)cJSON_GetObjectItemCaseSensitive(totals, "bytes_after_conversion")->valuedouble,
                         sum);
        pipeline_after += sum;
    }
    assert_int_equal((uint64_t)cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "totals"),
                                                                 "bytes_after_conversion")
                         ->valuedouble,
                     pipeline_after);
    cJSON_Delete(root);
    tu_run_free(&r);
    r = tu_run("convert", "--device", "cpu", pl, out, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "README.md: a link to nothing; not copied"));
    assert_non_null(strstr(r.err, "notes.txt: a link to nothing; not copied"));
    assert_non_null(strstr(r.err, "single.safetensors: a checkpoint outside every component"));
    tu_run_free(&r);
    static const char *const ABSENT[] = {"README.md", "single.safetensors", "transformer/notes.txt"};
    for (size_t i = 0; i < sizeof ABSENT / sizeof *ABSENT; i++) {
        char *p = tu_strdupf("%s/%s", out, ABSENT[i]);
        struct stat st;
        assert_int_not_equal(lstat(p, &st), 0);
        free(p);
    }
    free(cmd);
    free(pl);
    free(out);
}

/* Copied files keep their permissions, less the umask, as cp gives them: a
 * private file stays private. */
static void test_copied_files_keep_their_permissions(void **state)
{
    struct tu_scratch *s = *state;
    char *in = tu_strdupf("%s/in", s->dir), *out = tu_strdupf("%s/out", s->dir);
    char *cmd = tu_strdupf("cp -r %s %s && chmod 600 %s/generation_config.json && printf x > %s/tokenizer.model && "
                           "chmod 640 %s/tokenizer.model && printf y > %s/run.sh && chmod 4755 %s/run.sh",
                           FIXTURES "/tiny-llama-bf16-bnb4", in, in, in, in, in, in);
    assert_int_equal(system(cmd), 0);
    mode_t mask = umask(022);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    umask(mask);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    static const struct {
        const char *name;
        mode_t mode;
    } WANT[] = {{"generation_config.json", 0600}, {"tokenizer.model", 0640}, {"run.sh", 0755}};
    for (size_t i = 0; i < sizeof WANT / sizeof *WANT; i++) {
        char *p = tu_strdupf("%s/%s", out, WANT[i].name);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        if ((st.st_mode & 07777) != WANT[i].mode)
            fail_msg("%s: mode %o, expected %o", WANT[i].name, (unsigned)(st.st_mode & 07777), (unsigned)WANT[i].mode);
        free(p);
    }
    free(cmd);
    free(in);
    free(out);
}

/* A private input converts to a private output, as cp copies it: the
 * output's mode is a plain create's less what the input does not grant its
 * group and others (a file of 0600; a directory of 0700, and the files
 * nf4deq writes in it); an open one gets the umask's. */
static void test_outputs_are_no_more_open_than_the_input(void **state)
{
    struct tu_scratch *s = *state;
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    tu_sh("cd %s && cp %s/%s priv.safetensors && chmod 600 priv.safetensors && cp %s/%s pub.safetensors && "
          "chmod 644 pub.safetensors && cp -r %s/%s pdir && chmod 700 pdir && chmod 600 pdir/* && "
          "cp -r pdir odir && chmod 755 odir", s->dir, cwd, BNB4, cwd, BNB4, cwd, FIXTURES "/tiny-llama-bf16-bnb4");
    static const struct {
        const char *in, *out;
        mode_t want;
    } CASES[] = {
        {"priv.safetensors", "priv.out", 0600}, {"pub.safetensors", "pub.out", 0644}, {"pdir", "pdir.out", 0700},
        {"odir", "odir.out", 0755}};
    mode_t mask = umask(022);
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        char *in = tu_strdupf("%s/%s", s->dir, CASES[i].in), *out = tu_strdupf("%s/%s", s->dir, CASES[i].out);
        struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
        assert_int_equal(r.status, 0);
        tu_run_free(&r);
        struct stat st;
        assert_int_equal(stat(out, &st), 0);
        if ((st.st_mode & 07777) != CASES[i].want)
            fail_msg("%s: mode %o, expected %o", CASES[i].out, (unsigned)(st.st_mode & 07777), (unsigned)CASES[i].want);
        free(in);
        free(out);
    }
    umask(mask);
    /* While it is written, the temp directory is 0700: its files, not yet
     * given their modes, are nobody else's to open (stopped halfway through
     * the shard, NF4DEQ_TEST_STOP). */
    char *stopped_out = tu_strdupf("%s/stopped.out", s->dir), *odir = tu_strdupf("%s/odir", s->dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        setenv("NF4DEQ_TEST_STOP", "0.5", 1);
        umask(022);
        char *args[] = {"convert", "--device", "cpu", odir, stopped_out, NULL};
        tu_exec_nf4deq(args);
    }
    int wst;
    while (waitpid(pid, &wst, WUNTRACED) < 0 && errno == EINTR)
        ;
    assert_true(WIFSTOPPED(wst));
    char *cmd = tu_strdupf("stat -c %%a %s/.stopped.out.nf4deq-?????? 2>&1", s->dir), tmp_mode[32] = "";
    FILE *listing = popen(cmd, "r");
    assert_non_null(listing);
    if (!fgets(tmp_mode, sizeof tmp_mode, listing))
        tmp_mode[0] = '\0';
    pclose(listing);
    free(cmd);
    assert_int_equal(kill(pid, SIGCONT), 0);
    while (waitpid(pid, &wst, 0) < 0 && errno == EINTR)
        ;
    assert_true(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    if (strcmp(tmp_mode, "700\n") != 0)
        fail_msg("the temp directory while written: mode %s", tmp_mode);
    struct stat done;
    assert_int_equal(stat(stopped_out, &done), 0);
    assert_int_equal(done.st_mode & 07777, 0755);
    free(stopped_out);
    free(odir);
    /* Each written file no more open than its namesake in IN, in an open
     * directory too (odir: 0755, its files 0600). */
    static const char *const WRITTEN[] = {"pdir.out/model.safetensors", "pdir.out/config.json",
                                          "odir.out/model.safetensors", "odir.out/config.json"};
    for (size_t i = 0; i < sizeof WRITTEN / sizeof *WRITTEN; i++) {
        char *p = tu_strdupf("%s/%s", s->dir, WRITTEN[i]);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        if ((st.st_mode & 07777) != 0600)
            fail_msg("%s: mode %o, expected 600", WRITTEN[i], (unsigned)(st.st_mode & 07777));
        free(p);
    }
}

/* A pipeline's components, converted or copied, are no more open than
 * their sources, and so is each file in them, as cp -r makes them. */
static void test_pipeline_components_keep_their_modes(void **state)
{
    struct tu_scratch *s = *state;
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    tu_sh("cd %s && cp -r %s/%s pipe && chmod 700 pipe/transformer && chmod 600 pipe/transformer/* && "
          "chmod 750 pipe/vae && chmod 640 pipe/vae/config.json && chmod 711 pipe/text_encoder_2",
          s->dir, cwd, FIXTURES "/diffusers/tiny-flux-bnb4");
    mode_t mask = umask(022);
    char *in = tu_strdupf("%s/pipe", s->dir), *out = tu_strdupf("%s/pipe.out", s->dir);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", in, out, NULL);
    umask(mask);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    static const struct {
        const char *path;
        mode_t want;
    } MODES[] = {
        {"transformer", 0700},                                     /* converted */
        {"transformer/diffusion_pytorch_model.safetensors", 0600}, /* written */
        {"transformer/config.json", 0600},                         /* rewritten */
        {"vae", 0750},                                             /* copied */
        {"vae/config.json", 0640},
        {"text_encoder_2", 0711},                                  /* converted */
        {"model_index.json", 0644},
    };
    for (size_t i = 0; i < sizeof MODES / sizeof *MODES; i++) {
        char *p = tu_strdupf("%s/%s", out, MODES[i].path);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        if ((st.st_mode & 07777) != MODES[i].want)
            fail_msg("%s: mode %o, expected %o", MODES[i].path, (unsigned)(st.st_mode & 07777),
                     (unsigned)MODES[i].want);
        free(p);
    }
    free(in);
    free(out);
}

/* A tensor name with terminal escapes (valid JSON: \u001b, \u009b) prints
 * inert in inspect's table: control characters as '?'. */
static void test_inspect_prints_control_bytes_in_names_as_question_marks(void **state)
{
    struct tu_scratch *s = *state;
    char *path = tu_strdupf("%s/esc.safetensors", s->dir);
    static const uint64_t SHAPE[] = {1};
    const struct st_out_tensor t[] = {{"a\x1b]0;title\x07" "b\x0b" "\xc2\x9b" "c\x7f" "d\xc2\xa0", DT_BF16, 1, SHAPE}};
    struct st_writer *w;
    assert_int_equal(st_writer_begin(&w, path, t, 1, NULL, 0), NF4_OK);
    static const unsigned char ZEROS[2];
    assert_int_equal(st_writer_write(w, ZEROS, 2), NF4_OK);
    assert_int_equal(st_writer_finish(w), NF4_OK);
    struct tu_run r = tu_run("inspect", path, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "a?]0;title?b??c?d\xc2\xa0 ")); /* the C1 CSI, two bytes in UTF-8, as one '?' */
    for (const char *p = r.out; *p; p++)
        assert_true(*p == '\n' || ((unsigned char)*p >= 0x20 && (unsigned char)*p != 0x7f &&
                                    ((unsigned char)*p != 0xc2 || (unsigned char)p[1] > 0x9f)));
    tu_run_free(&r);
    /* --json escapes them all (as jq does, and the C1 controls too); U+00A0 is
     * no control and stays as it is. */
    r = tu_run("inspect", "--json", path, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"name\": \"a\\u001b]0;title\\u0007b\\u000b\\u009bc\\u007fd\xc2\xa0\""));
    tu_run_free(&r);
    free(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_help_and_version_go_to_stdout, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_usage_errors_exit_2, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_option_errors_name_the_option, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_stdout_that_is_the_input_is_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_output_name_too_long_for_its_temps, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_missing_input_exits_66, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_existing_output_needs_force, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_output_directory_replaced_only_with_force, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_outputs_that_cannot_be_replaced, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_input_without_4bit_weights_warns, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_refuses_to_overwrite_input, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_force_spares_the_adapter_and_the_tokenizer, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_dtype_case_and_missing_out_directory, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_outputs_are_no_more_open_than_the_input, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_file_and_directory_do_not_mix, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_device_choice_without_gpu, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_inspect_text_and_json, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_bench_cpu_checks_every_path, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test(test_bench_cpu_merge),
        cmocka_unit_test_setup_teardown(test_stdout_write_error_exits_74, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_symlinks_inside_the_hub_cache_are_followed, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_shard_linking_outside_the_model_is_refused, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_config_that_is_no_file_is_refused_first, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_variant_index_is_the_index, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_stray_checkpoint_files_are_not_copied, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_pipeline_entries_inspect_agrees_with_convert, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_inspect_prints_control_bytes_in_names_as_question_marks, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_copied_files_keep_their_permissions, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_pipeline_components_keep_their_modes, tu_scratch_setup,
                                        tu_scratch_teardown),
    };
    return cmocka_run_group_tests_name("cli", tests, NULL, NULL);
}
