/* What really happens to long conversions: a run SIGKILLed at several points
 * (then rerun plainly, or with --resume), two runs to one OUT, inputs
 * truncated or grown while they are read, and `nf4deq clean`.
 *
 * The runs stop themselves at a fixed point (NF4DEQ_TEST_STOP, see
 * safetensors_writer.c: just before an output file begins, or halfway
 * through its data), so each case kills or races them there, not after a
 * guessed delay. The model is generated: 5 shards (gen_bnb4 --preset tiny). */
#include "test_util.h"

#include <cJSON.h>
#include <signal.h>

#define GEN_BNB4 "build/tools/gen_bnb4"
#define SHARDS 5

struct scene {
    char *dir; /* scratch */
    char *in, *ref, *out;
};

static int scene_setup(void **state)
{
    struct scene *s = calloc(1, sizeof *s);
    s->dir = tu_mkdtemp();
    s->in = tu_strdupf("%s/in", s->dir);
    s->ref = tu_strdupf("%s/ref", s->dir);
    s->out = tu_strdupf("%s/out", s->dir);
    tu_sh(GEN_BNB4 " --preset tiny --shard-size 4M %s > /dev/null", s->in);
    struct tu_run r = tu_run("convert", "-q", "--device", "cpu", s->in, s->ref, NULL);
    assert_int_equal(r.status, 0);
    tu_run_free(&r);
    *state = s;
    return 0;
}

static int scene_teardown(void **state)
{
    struct scene *s = *state;
    tu_rmtree(s->dir);
    free(s->dir);
    free(s->in);
    free(s->ref);
    free(s->out);
    free(s);
    return 0;
}

/* Starts nf4deq with NF4DEQ_TEST_STOP=stop, and the signals in `ignored`
 * (ending with 0; may be NULL) ignored as nohup(1) would, and waits until it
 * has stopped itself there; its stderr goes to DIR/.stderr-PID. */
static pid_t start_stopped_ignoring(const struct scene *s, const char *stop, char *const *args, const int *ignored)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        for (size_t i = 0; ignored && ignored[i]; i++)
            signal(ignored[i], SIG_IGN); /* kept across exec */
        char *err = tu_strdupf("%s/.stderr-%d", s->dir, (int)getpid());
        int fd = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        setenv("NF4DEQ_TEST_STOP", stop, 1);
        tu_exec_nf4deq(args);
    }
    int st;
    while (waitpid(pid, &st, WUNTRACED) < 0 && errno == EINTR)
        ;
    if (!WIFSTOPPED(st))
        fail_msg("the run did not stop at NF4DEQ_TEST_STOP=%s (status 0x%x)", stop, st);
    return pid;
}

static pid_t start_stopped(const struct scene *s, const char *stop, char *const *args)
{
    return start_stopped_ignoring(s, stop, args, NULL);
}

static int reap(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void kill_stopped(pid_t pid)
{
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(reap(pid), 128 + SIGKILL);
}

static int continue_stopped(pid_t pid)
{
    assert_int_equal(kill(pid, SIGCONT), 0);
    return reap(pid);
}

static char *stderr_of(const struct scene *s, pid_t pid)
{
    char *p = tu_strdupf("%s/.stderr-%d", s->dir, (int)pid);
    char *text = tu_read_file(p, NULL);
    unlink(p);
    free(p);
    return text;
}

/* Entries of the scratch dir other than the runs' stderr files. */
static int entries(const struct scene *s)
{
    DIR *d = opendir(s->dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strncmp(e->d_name, ".stderr-", 8))
            n++;
    closedir(d);
    return n;
}

/* The temp directory a killed run left for OUT ("" if none). */
static char *temp_dir_of_out(const struct scene *s)
{
    DIR *d = opendir(s->dir);
    char *found = NULL;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, ".out.nf4deq-", 12) == 0 && strlen(e->d_name) == 12 + 6)
            found = tu_strdupf("%s/%s", s->dir, e->d_name);
    closedir(d);
    return found;
}

static void assert_out_is_ref(const struct scene *s)
{
    assert_int_equal(tu_sh_status("diff -r %s %s > /dev/null", s->out, s->ref), 0);
}

static int manifest_shards(const char *temp)
{
    char *p = tu_strdupf("%s/.nf4deq-resume.json", temp);
    char *json = tu_read_file(p, NULL);
    free(p);
    if (!json)
        return 0; /* killed before the first shard was finished */
    cJSON *root = cJSON_Parse(json);
    assert_non_null(root);
    int n = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(root, "shards"));
    cJSON_Delete(root);
    free(json);
    return n;
}

/* Starts a run that stops itself at `stop`, and SIGKILLs it there. */
static pid_t kill_at(const struct scene *s, const char *stop, char *const *args)
{
    pid_t pid = start_stopped(s, stop, args);
    kill_stopped(pid);
    free(stderr_of(s, pid));
    return pid;
}

/* A --resume rerun must keep `kept` shards, name the run that left them (and
 * say `also`, unless NULL), and write the reference output, leaving nothing else. */
static void resume_keeping(struct scene *s, int kept, const char *also)
{
    struct tu_run r = tu_run("convert", "--resume", "--device", "cpu", "--progress", "none", s->in, s->out, NULL);
    assert_int_equal(r.status, 0);
    char *said = tu_strdupf("kept %d of %d shards finished by a run that did not finish (pid ", kept, SHARDS);
    if (!strstr(r.err, said))
        fail_msg("stderr lacks \"%s\": %s", said, r.err);
    free(said);
    if (also && !strstr(r.err, also))
        fail_msg("stderr lacks \"%s\": %s", also, r.err);
    tu_run_free(&r);
    assert_out_is_ref(s);
    assert_int_equal(entries(s), 3);
}

/* ---- a run killed at several points ---- */

static void test_sigkill_then_rerun_or_resume(void **state)
{
    struct scene *s = *state;
    /* Before the first shard; halfway through the second; between the third
     * and the fourth; halfway through the last. */
    static const char *const STOPS[] = {"0", "1.5", "3", "4.5"};
    static const int FINISHED[] = {0, 1, 3, 4};
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    for (size_t i = 0; i < sizeof STOPS / sizeof *STOPS; i++) {
        /* A plain rerun removes what the dead run left, and says whose it was. */
        pid_t pid = kill_at(s, STOPS[i], args);
        char *temp = temp_dir_of_out(s);
        assert_non_null(temp);
        free(temp);
        struct tu_run r = tu_run("convert", "--json", "--device", "cpu", "--progress", "none", s->in, s->out, NULL);
        assert_int_equal(r.status, 0);
        cJSON *whole = cJSON_Parse(r.out);
        assert_non_null(whole);
        const double whole_out = cJSON_GetObjectItemCaseSensitive(whole, "bytes_out")->valuedouble;
        cJSON_Delete(whole);
        char *said = tu_strdupf("removed stale partial output from a run that did not finish (pid %d", (int)pid);
        if (!strstr(r.err, said))
            fail_msg("stop %s: stderr lacks \"%s\": %s", STOPS[i], said, r.err);
        free(said);
        tu_run_free(&r);
        assert_out_is_ref(s);
        assert_int_equal(entries(s), 3); /* in, ref, out: no temp, no lock */
        tu_rmtree(s->out);

        /* --resume keeps what the dead run finished and redoes the rest. */
        kill_at(s, STOPS[i], args);
        temp = temp_dir_of_out(s);
        int finished = manifest_shards(temp);
        assert_int_equal(finished, FINISHED[i]);
        free(temp);
        r = tu_run("convert", "--resume", "--json", "--device", "cpu", "--progress", "none", s->in, s->out, NULL);
        assert_int_equal(r.status, 0);
        said = tu_strdupf("kept %d of %d shards", finished, SHARDS);
        if (!strstr(r.err, said))
            fail_msg("stop %s: stderr lacks \"%s\": %s", STOPS[i], said, r.err);
        free(said);
        cJSON *report = cJSON_Parse(r.out);
        assert_non_null(report);
        assert_int_equal(cJSON_GetObjectItemCaseSensitive(report, "resumed_shards")->valuedouble, finished);
        /* bytes_out counts what this run wrote, not the shards it kept. */
        const double out_now = cJSON_GetObjectItemCaseSensitive(report, "bytes_out")->valuedouble;
        if (finished == 0 ? out_now != whole_out : out_now >= whole_out)
            fail_msg("stop %s: bytes_out %.0f after keeping %d shards, %.0f for the whole run", STOPS[i], out_now,
                     finished, whole_out);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(report, "tensors");
        assert_true(cJSON_GetObjectItemCaseSensitive(t, "total")->valuedouble > 0 || finished == SHARDS);
        cJSON_Delete(report);
        tu_run_free(&r);
        assert_out_is_ref(s);
        assert_int_equal(entries(s), 3);
        tu_rmtree(s->out);
    }
}

/* A machine or service stopping (SIGTERM) leaves the finished shards for
 * --resume, and says so; Ctrl-C (SIGINT) leaves nothing. */
static void test_sigterm_keeps_finished_shards_sigint_does_not(void **state)
{
    struct scene *s = *state;
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    pid_t pid = start_stopped(s, "3", args);
    assert_int_equal(kill(pid, SIGTERM), 0);
    assert_int_equal(continue_stopped(pid), 128 + SIGTERM);
    char *err = stderr_of(s, pid);
    assert_non_null(strstr(err, "stopped by a signal; the shards finished so far stay in"));
    free(err);
    char *temp = temp_dir_of_out(s);
    assert_non_null(temp);
    assert_int_equal(manifest_shards(temp), 3);
    assert_int_equal(tu_count_entries(temp), 4); /* the manifest and three shards, nothing partial */
    free(temp);
    resume_keeping(s, 3, NULL);
    tu_rmtree(s->out);
    pid = start_stopped(s, "3", args);
    assert_int_equal(kill(pid, SIGINT), 0);
    assert_int_equal(continue_stopped(pid), 128 + SIGINT);
    free(stderr_of(s, pid));
    assert_int_equal(entries(s), 2); /* in and ref */
}

/* A signal ignored when the run starts stays ignored (nohup ignores SIGHUP,
 * a shell's background job SIGINT): the run goes on and finishes. */
static void test_signals_ignored_at_start_stay_ignored(void **state)
{
    struct scene *s = *state;
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    static const int IGNORED[] = {SIGHUP, SIGINT, 0};
    pid_t pid = start_stopped_ignoring(s, "2.5", args, IGNORED);
    assert_int_equal(kill(pid, SIGHUP), 0);
    assert_int_equal(kill(pid, SIGINT), 0);
    assert_int_equal(continue_stopped(pid), 0);
    free(stderr_of(s, pid));
    assert_out_is_ref(s);
    assert_int_equal(entries(s), 3);
}

/* A resume whose inputs changed since the dead run keeps nothing. */
static void test_resume_redoes_shards_whose_record_differs(void **state)
{
    struct scene *s = *state;
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    kill_at(s, "3", args);
    /* The same bytes, a new mtime: the record no longer matches. */
    tu_sh("touch -d '2001-01-01' %s/model-00002-of-00005.safetensors", s->in);
    tu_sh("rm -rf %s && " NF4DEQ_BIN " convert -q --device cpu %s %s", s->ref, s->in, s->ref);
    resume_keeping(s, 0, "every shard is redone");
    /* --dtype is part of the record too. */
    tu_rmtree(s->out);
    char *fp16[] = {"convert", "-q", "--device", "cpu", "--dtype", "fp16", s->in, s->out, NULL};
    kill_at(s, "2", fp16);
    resume_keeping(s, 0, NULL);
    /* A resume with other options takes the dead temp over and dies at once:
     * the manifest must describe it now, so a third run with the first
     * run's options keeps nothing the second could have rewritten. */
    tu_rmtree(s->out);
    kill_at(s, "3", args);
    char *fp16_resume[] = {"convert", "-q", "--resume", "--device", "cpu", "--dtype", "fp16", s->in, s->out, NULL};
    kill_at(s, "0", fp16_resume);
    resume_keeping(s, 0, NULL);
}

/* Paths longer than any fixed buffer: the lock, the stale temps and the
 * resume manifest are all found beside an OUT deep in long names. */
static void test_long_paths(void **state)
{
    struct scene *s = *state;
    char name[201];
    memset(name, 'd', 200);
    name[200] = '\0';
    char *deep = tu_strdupf("%s/%s/%s", s->dir, name, name);
    tu_sh("mkdir -p %s", deep);
    char *out = tu_strdupf("%s/%s-out", deep, name);
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, out, NULL};
    kill_at(s, "2", args);
    struct tu_run r = tu_run("convert", "--resume", "--device", "cpu", "--progress", "none", s->in, out, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "kept 2 of 5 shards"));
    tu_run_free(&r);
    assert_int_equal(tu_sh_status("diff -r %s %s > /dev/null", out, s->ref), 0);
    assert_int_equal(tu_count_entries(deep), 1); /* OUT alone: no lock, no temp */
    free(out);
    free(deep);
}

/* ---- one writer per OUT ---- */

static void test_second_run_to_one_out_exits_73_at_once(void **state)
{
    struct scene *s = *state;
    char *args[] = {"convert", "-q", "--device", "cpu", "--force", s->in, s->out, NULL};
    pid_t pid = start_stopped(s, "1.5", args);
    char *said = tu_strdupf("%s: another nf4deq (pid %d", s->out, (int)pid);
    for (int force = 0; force < 2; force++) {
        struct tu_run r = force ? tu_run("convert", "--force", s->in, s->out, NULL) : tu_run("convert", s->in, s->out, NULL);
        assert_int_equal(r.status, NF4_ECANTCREAT);
        assert_int_equal(tu_lines(r.err), 1);
        if (!strstr(r.err, said) || !strstr(r.err, "is writing it"))
            fail_msg("stderr: %s", r.err);
        tu_run_free(&r);
    }
    free(said);
    assert_int_equal(continue_stopped(pid), 0);
    free(stderr_of(s, pid));
    assert_out_is_ref(s);
    assert_int_equal(entries(s), 3);
}

/* ---- inputs that change during the run ---- */

static void change_during_run(struct scene *s, const char *stop, char *const *args, const char *change,
                              const char *named, const char *how, int left)
{
    pid_t pid = start_stopped(s, stop, args);
    tu_sh("%s", change);
    assert_int_equal(continue_stopped(pid), NF4_EIO);
    char *err = stderr_of(s, pid);
    assert_int_equal(tu_lines(err), 1);
    if (!strstr(err, named) || !strstr(err, how))
        fail_msg("stderr does not name %s (%s): %s", named, how, err);
    free(err);
    assert_int_equal(entries(s), left); /* no output, no temp, no lock */
}

static void test_inputs_that_shrink_or_grow_exit_74(void **state)
{
    struct scene *s = *state;
    char *args[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    char *shard3 = tu_strdupf("%s/model-00003-of-00005.safetensors", s->in);
    char *shard1 = tu_strdupf("%s/model-00001-of-00005.safetensors", s->in);
    char *keep = tu_strdupf("%s/keep.safetensors", s->dir);
    tu_sh("cp %s %s", shard3, keep);
    /* A shard not read yet is cut short. */
    char *cmd = tu_strdupf("truncate -s 1000000 %s", shard3);
    change_during_run(s, "1", args, cmd, "model-00003-of-00005.safetensors", "shrank from", 3); /* in, ref, keep */
    free(cmd);
    tu_sh("mv %s %s", keep, shard3);
    /* A shard already converted grows: its output would no longer match it. */
    tu_sh("cp %s %s", shard1, keep);
    cmd = tu_strdupf("printf 'more' >> %s", shard1);
    change_during_run(s, "1.5", args, cmd, "model-00001-of-00005.safetensors", "grew from", 3);
    free(cmd);
    tu_sh("mv %s %s", keep, shard1);
    /* One file, cut short halfway through its own conversion. */
    char *file = tu_strdupf("%s/one.safetensors", s->dir), *out = tu_strdupf("%s/one-out.safetensors", s->dir);
    tu_sh("cp %s %s", shard3, file);
    char *one[] = {"convert", "-q", "--device", "cpu", file, out, NULL};
    cmd = tu_strdupf("truncate -s 100000 %s", file);
    pid_t pid = start_stopped(s, "0.5", one);
    tu_sh("%s", cmd);
    assert_int_equal(continue_stopped(pid), NF4_EIO);
    char *err = stderr_of(s, pid);
    assert_non_null(strstr(err, "one.safetensors"));
    assert_non_null(strstr(err, "shrank from"));
    free(err);
    assert_false(tu_exists(out));
    assert_int_equal(entries(s), 3); /* in, ref and the truncated copy */
    free(cmd);
    free(file);
    free(out);
    free(shard1);
    free(shard3);
    free(keep);
}

/* ---- nf4deq clean ---- */

static void test_clean_removes_only_stale_nf4deq_temps(void **state)
{
    struct scene *s = *state;
    /* A dead run's temp directory and lock file, for OUT. */
    char *dead[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    kill_at(s, "2", dead);
    /* A live run's, for another OUT. */
    char *live_out = tu_strdupf("%s/live", s->dir);
    char *live[] = {"convert", "-q", "--device", "cpu", s->in, live_out, NULL};
    pid_t live_pid = start_stopped(s, "1.5", live);
    /* And names that are not nf4deq's own, or only look alike. */
    static const char *const DECOYS[] = {"notes.txt", ".out.nf4deq-abc", "out.nf4deq-ABCDEF", ".out.nf4deq-lockX",
                                         ".nf4deq-ABCDEF"};
    for (size_t i = 0; i < sizeof DECOYS / sizeof *DECOYS; i++) {
        char *p = tu_strdupf("%s/%s", s->dir, DECOYS[i]);
        tu_write_file(p, "mine", 4);
        free(p);
    }
    int before = entries(s);
    struct tu_run r = tu_run("clean", "-n", s->dir, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "would remove"));
    assert_non_null(strstr(r.out, "/.out.nf4deq-lock (stale lock file of pid"));
    assert_non_null(strstr(r.out, "would remove 2 stale items; kept 2 of live runs"));
    tu_run_free(&r);
    assert_int_equal(entries(s), before);
    r = tu_run("clean", s->dir, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "removed 2 stale items; kept 2 of live runs"));
    tu_run_free(&r);
    assert_int_equal(entries(s), before - 2);
    assert_null(temp_dir_of_out(s));
    for (size_t i = 0; i < sizeof DECOYS / sizeof *DECOYS; i++) {
        char *p = tu_strdupf("%s/%s", s->dir, DECOYS[i]);
        size_t len;
        char *kept = tu_read_file(p, &len);
        assert_int_equal(len, 4);
        free(kept);
        free(p);
    }
    /* The live run was not disturbed. */
    assert_int_equal(continue_stopped(live_pid), 0);
    free(stderr_of(s, live_pid));
    assert_int_equal(tu_sh_status("diff -r %s %s > /dev/null", live_out, s->ref), 0);
    r = tu_run("clean", s->dir, NULL);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "removed 0 stale items\n"));
    tu_run_free(&r);
    free(live_out);
}

/* `clean OUT`: what runs writing OUT itself left beside it, whether OUT is a
 * directory not there yet, a file, or an old output; nothing of other OUTs. */
static void test_clean_names_an_out(void **state)
{
    struct scene *s = *state;
    char *dead[] = {"convert", "-q", "--device", "cpu", s->in, s->out, NULL};
    kill_at(s, "2", dead);
    char *other = tu_strdupf("%s/other", s->dir);
    char *dead_other[] = {"convert", "-q", "--device", "cpu", s->in, other, NULL};
    kill_at(s, "1", dead_other);
    int before = entries(s);
    assert_false(tu_exists(s->out));
    struct tu_run r = tu_run("clean", "-n", s->out, NULL);
    if (r.status != 0 || !strstr(r.out, "would remove 2 stale items\n"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    assert_int_equal(entries(s), before);
    char *slashed = tu_strdupf("%s/", s->out); /* as a directory OUT is often typed */
    r = tu_run("clean", slashed, NULL);
    if (r.status != 0 || !strstr(r.out, "removed 2 stale items\n"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    assert_int_equal(entries(s), before - 2);
    assert_null(temp_dir_of_out(s));
    free(slashed);

    /* A single file's OUT, killed halfway: the file itself is no directory to search. */
    char *file_out = tu_strdupf("%s/one.safetensors", s->dir);
    tu_sh("cp \"$(ls %s/*.safetensors | head -1)\" %s/one-in.safetensors", s->in, s->dir);
    char *one_in = tu_strdupf("%s/one-in.safetensors", s->dir);
    char *dead_file[] = {"convert", "-q", "--device", "cpu", one_in, file_out, NULL};
    kill_at(s, "0.5", dead_file);
    tu_sh("cp %s %s", one_in, file_out); /* an old output in its place */
    before = entries(s);
    r = tu_run("clean", file_out, NULL);
    if (r.status != 0 || !strstr(r.out, "removed 2 stale items\n") || !strstr(r.out, "/.one.safetensors.nf4deq-"))
        fail_msg("exit %d, stdout: %s, stderr: %s", r.status, r.out, r.err);
    tu_run_free(&r);
    assert_int_equal(entries(s), before - 2);
    assert_true(tu_exists(file_out)); /* OUT itself is never touched */
    r = tu_run("clean", file_out, NULL);
    if (r.status != 0 || strcmp(r.out, "removed 0 stale items\n") != 0)
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);

    /* The other OUT's are still there; a path with nothing of it is a typo. */
    char *typo = tu_strdupf("%s/oter", s->dir);
    r = tu_run("clean", typo, NULL);
    if (r.status != NF4_ENOINPUT || tu_lines(r.err) != 1 ||
        !strstr(r.err, "oter: cannot open (and no run left a partial output of it): No such file or directory"))
        fail_msg("exit %d, stderr: %s", r.status, r.err);
    tu_run_free(&r);
    r = tu_run("clean", other, NULL);
    if (r.status != 0 || !strstr(r.out, "removed 2 stale items\n"))
        fail_msg("exit %d, stdout: %s", r.status, r.out);
    tu_run_free(&r);
    free(typo);
    free(one_in);
    free(file_out);
    free(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_sigkill_then_rerun_or_resume, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_sigterm_keeps_finished_shards_sigint_does_not, scene_setup,
                                        scene_teardown),
        cmocka_unit_test_setup_teardown(test_signals_ignored_at_start_stay_ignored, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_resume_redoes_shards_whose_record_differs, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_long_paths, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_second_run_to_one_out_exits_73_at_once, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_inputs_that_shrink_or_grow_exit_74, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_clean_names_an_out, scene_setup, scene_teardown),
        cmocka_unit_test_setup_teardown(test_clean_removes_only_stale_nf4deq_temps, scene_setup, scene_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
