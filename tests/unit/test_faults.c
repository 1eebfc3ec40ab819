/* Fault injection: every system call and allocation the conversion pipeline
 * makes can fail, return short, or be interrupted, and nf4deq must still give
 * the documented exit code, one line of error naming a path, no output and no
 * temp file, and an untouched input (and an untouched old OUT with --force).
 *
 * The calls are intercepted with the linker's --wrap (tests/faults.mk lists
 * them): every undefined reference to write() in this program's objects,
 * libnf4deq.a's included, is bound to __wrap_write, and __real_write is libc's.
 * test_wraps_intercept proves the wrappers see the library's calls. cJSON is a
 * shared library, so its allocations are routed through the wrapper with
 * cJSON_InitHooks. Faults fire only while `g.armed` is set, i.e. during
 * convert_run(), never inside CMocka.
 *
 * The last tests deliver SIGTERM/SIGINT: to the real binary in the middle of a
 * ~1 s conversion of a synthetic model, and (deterministically) from inside a
 * forked in-process conversion right after each fsync/rename/mkostemp. A stop
 * (SIGTERM, SIGHUP) of a directory conversion may leave only its lock file and
 * its finished shards with their resume manifest, each shard as the clean
 * conversion wrote it. */
#include "test_util.h"

#include <cJSON.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>

#include "convert.h"
#include "fileio.h"
#include "inspect.h"
#include "lora_diffusers.h"
#include "model.h"

/* Wrapping malloc works under ASan too: __real_malloc is the sanitizer's
 * interceptor, so SANITIZE=1 runs the allocation sweeps as well. */

/* 1: a failed allocation inside cJSON must give 70 too. It gives 65 today
 * (cJSON returns NULL for both; see alloc_sweep), so by default that one
 * exit is tolerated, and counted, for allocations made by cJSON only. */
#ifndef STRICT_CJSON_OOM
#define STRICT_CJSON_OOM 1
#endif

/* ---- the fault table ------------------------------------------------------ */

enum fn { FN_WRITE, FN_PREAD, FN_READ, FN_FSYNC, FN_CLOSE, FN_RENAME, FN_RENAMEAT2, FN_MKOSTEMP, FN_MKDTEMP,
          FN_ALLOC, FN_FALLOCATE, FN_MMAP, FN_OPEN, FN_COUNT };
static const char *const FN_NAMES[FN_COUNT] = {"write", "pread", "read", "fsync", "close", "rename", "renameat2",
                                               "mkostemp", "mkdtemp", "alloc", "fallocate", "mmap", "open"};

enum mode {
    M_COUNT,  /* only count the matching calls */
    M_ERR,    /* fail with errno = err */
    M_SHORT,  /* transfer fewer bytes than asked (every matching call from nth on) */
    M_EINTR,  /* -1/EINTR on every other matching call from nth on */
    M_ZERO,   /* pread/write return 0 (a file that shrank, a device that takes nothing) */
    M_SIGNAL, /* do the call, then raise(err) */
};

enum fd_kind { K_ANY, K_FILE, K_DIR };

struct fault {
    enum fn fn;
    enum mode mode;
    int err;          /* errno for M_ERR, signal for M_SIGNAL */
    long nth;         /* first matching call that fires (1-based); 0: half of a clean run's; -1: the last */
    int every;        /* M_ERR/M_ZERO/M_SIGNAL: fire on every matching call from nth on */
    const char *path; /* only calls whose file (or rename source) name contains this */
    enum fd_kind kind;
};

/* The pipeline reads and writes from its own threads: the counters are atomic. */
static struct {
    atomic_int armed;
    struct fault f;
    atomic_long seen[FN_COUNT]; /* every call while armed */
    atomic_long matched;        /* calls matching f */
    atomic_long fired;
} g;

ssize_t __real_write(int fd, const void *buf, size_t len);
ssize_t __real_pread(int fd, void *buf, size_t len, off_t off);
ssize_t __real_read(int fd, void *buf, size_t len);
int __real_fsync(int fd);
int __real_close(int fd);
int __real_rename(const char *from, const char *to);
int __real_renameat2(int dfd1, const char *from, int dfd2, const char *to, unsigned flags);
int __real_mkostemp(char *tmpl, int flags);
char *__real_mkdtemp(char *tmpl);
int __real_fallocate(int fd, int mode, off_t off, off_t len);
void *__real_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int __real_open(const char *path, int flags, ...);
void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);

static int fd_matches(int fd)
{
    if (g.f.kind != K_ANY) {
        struct stat st;
        if (fstat(fd, &st) != 0 || (g.f.kind == K_DIR) != !!S_ISDIR(st.st_mode))
            return 0;
    }
    if (!g.f.path)
        return 1;
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0)
        return 0;
    target[n] = '\0';
    return strstr(target, g.f.path) != NULL;
}

/* Counts the call and says whether the fault fires on it. */
static int hit(enum fn fn, int fd, const char *path)
{
    if (!g.armed)
        return 0;
    g.seen[fn]++;
    if (fn != g.f.fn)
        return 0;
    if (fd >= 0 && !fd_matches(fd))
        return 0;
    if (fd < 0 && g.f.path && !(path && strstr(path, g.f.path)))
        return 0;
    long k = ++g.matched;
    if (g.f.mode == M_COUNT || g.f.nth <= 0 || k < g.f.nth)
        return 0;
    int fire;
    switch (g.f.mode) {
    case M_SHORT: fire = 1; break;
    case M_EINTR: fire = (k - g.f.nth) % 2 == 0; break;
    default: fire = g.f.every || k == g.f.nth; break;
    }
    if (fire)
        g.fired++;
    return fire;
}

static int fail_with(int err)
{
    errno = err;
    return -1;
}

ssize_t __wrap_write(int fd, const void *buf, size_t len);
ssize_t __wrap_write(int fd, const void *buf, size_t len)
{
    if (hit(FN_WRITE, fd, NULL)) {
        switch (g.f.mode) {
        case M_ERR: return fail_with(g.f.err);
        case M_EINTR: return fail_with(EINTR);
        case M_ZERO: return 0;
        case M_SHORT:
            if (len > 1)
                len = len > 8191 ? 4093 : len / 2;
            break;
        case M_SIGNAL: {
            ssize_t r = __real_write(fd, buf, len);
            raise(g.f.err);
            return r;
        }
        default: break;
        }
    }
    return __real_write(fd, buf, len);
}

ssize_t __wrap_pread(int fd, void *buf, size_t len, off_t off);
ssize_t __wrap_pread(int fd, void *buf, size_t len, off_t off)
{
    if (hit(FN_PREAD, fd, NULL)) {
        switch (g.f.mode) {
        case M_ERR: return fail_with(g.f.err);
        case M_EINTR: return fail_with(EINTR);
        case M_ZERO: return 0;
        case M_SHORT:
            if (len > 1)
                len = len > 8191 ? 4093 : len / 2;
            break;
        default: break;
        }
    }
    return __real_pread(fd, buf, len, off);
}

ssize_t __wrap_read(int fd, void *buf, size_t len);
ssize_t __wrap_read(int fd, void *buf, size_t len)
{
    if (hit(FN_READ, fd, NULL)) {
        switch (g.f.mode) {
        case M_ERR: return fail_with(g.f.err);
        case M_EINTR: return fail_with(EINTR);
        case M_SHORT:
            if (len > 1)
                len = len / 2;
            break;
        default: break;
        }
    }
    return __real_read(fd, buf, len);
}

int __wrap_fsync(int fd);
int __wrap_fsync(int fd)
{
    if (hit(FN_FSYNC, fd, NULL)) {
        if (g.f.mode == M_ERR)
            return fail_with(g.f.err);
        if (g.f.mode == M_SIGNAL) {
            int r = __real_fsync(fd);
            raise(g.f.err);
            return r;
        }
    }
    return __real_fsync(fd);
}

int __wrap_close(int fd);
int __wrap_close(int fd)
{
    if (hit(FN_CLOSE, fd, NULL) && g.f.mode == M_ERR) {
        __real_close(fd); /* the descriptor is gone either way, as on Linux */
        return fail_with(g.f.err);
    }
    return __real_close(fd);
}

int __wrap_rename(const char *from, const char *to);
int __wrap_rename(const char *from, const char *to)
{
    if (hit(FN_RENAME, -1, from)) {
        if (g.f.mode == M_ERR)
            return fail_with(g.f.err);
        if (g.f.mode == M_SIGNAL) {
            int r = __real_rename(from, to);
            raise(g.f.err);
            return r;
        }
    }
    return __real_rename(from, to);
}

int __wrap_renameat2(int dfd1, const char *from, int dfd2, const char *to, unsigned flags);
int __wrap_renameat2(int dfd1, const char *from, int dfd2, const char *to, unsigned flags)
{
    if (hit(FN_RENAMEAT2, -1, from)) {
        if (g.f.mode == M_ERR)
            return fail_with(g.f.err);
        if (g.f.mode == M_SIGNAL) {
            int r = __real_renameat2(dfd1, from, dfd2, to, flags);
            raise(g.f.err);
            return r;
        }
    }
    return __real_renameat2(dfd1, from, dfd2, to, flags);
}

int __wrap_mkostemp(char *tmpl, int flags);
int __wrap_mkostemp(char *tmpl, int flags)
{
    if (hit(FN_MKOSTEMP, -1, tmpl)) {
        if (g.f.mode == M_ERR)
            return fail_with(g.f.err);
        if (g.f.mode == M_SIGNAL) {
            int r = __real_mkostemp(tmpl, flags);
            raise(g.f.err);
            return r;
        }
    }
    return __real_mkostemp(tmpl, flags);
}

char *__wrap_mkdtemp(char *tmpl);
char *__wrap_mkdtemp(char *tmpl)
{
    if (hit(FN_MKDTEMP, -1, tmpl)) {
        if (g.f.mode == M_ERR) {
            errno = g.f.err;
            return NULL;
        }
        if (g.f.mode == M_SIGNAL) {
            char *r = __real_mkdtemp(tmpl);
            raise(g.f.err);
            return r;
        }
    }
    return __real_mkdtemp(tmpl);
}

/* open fails only with M_ERR: a file system without O_TMPFILE says EOPNOTSUPP. */
int __wrap_open(const char *path, int flags, ...);
int __wrap_open(const char *path, int flags, ...)
{
    mode_t mode = 0;
    if ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    if (hit(FN_OPEN, -1, path) && g.f.mode == M_ERR)
        return fail_with(g.f.err);
    return __real_open(path, flags, mode);
}

/* The output through a mapping (src/mapped_writer.c): space reserved with
 * fallocate, then the mapping itself. */
int __wrap_fallocate(int fd, int mode, off_t off, off_t len);
int __wrap_fallocate(int fd, int mode, off_t off, off_t len)
{
    if (hit(FN_FALLOCATE, fd, NULL)) {
        switch (g.f.mode) {
        case M_ERR: return fail_with(g.f.err);
        case M_EINTR: return fail_with(EINTR);
        default: break;
        }
    }
    return __real_fallocate(fd, mode, off, len);
}

void *__wrap_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
void *__wrap_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    if (hit(FN_MMAP, fd, NULL) && g.f.mode == M_ERR) {
        errno = g.f.err;
        return MAP_FAILED;
    }
    return __real_mmap(addr, len, prot, flags, fd, off);
}

/* Allocations: malloc, calloc, realloc, strdup, strndup and asprintf called
 * from nf4deq's objects, and cJSON's through its hooks. */
static _Thread_local int in_cjson;
static atomic_int fired_in_cjson;

static int alloc_fails(void)
{
    if (hit(FN_ALLOC, -1, NULL) && g.f.mode == M_ERR) {
        if (in_cjson)
            fired_in_cjson = 1;
        errno = ENOMEM;
        return 1;
    }
    return 0;
}

void *__wrap_malloc(size_t n);
void *__wrap_malloc(size_t n)
{
    return alloc_fails() ? NULL : __real_malloc(n);
}

void *__wrap_calloc(size_t n, size_t size);
void *__wrap_calloc(size_t n, size_t size)
{
    return alloc_fails() ? NULL : __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n)
{
    return alloc_fails() ? NULL : __real_realloc(p, n);
}

char *__wrap_strdup(const char *s);
char *__wrap_strdup(const char *s)
{
    return alloc_fails() ? NULL : __real_strdup(s);
}

char *__wrap_strndup(const char *s, size_t n);
char *__wrap_strndup(const char *s, size_t n)
{
    return alloc_fails() ? NULL : __real_strndup(s, n);
}

int __wrap_asprintf(char **out, const char *fmt, ...);
int __wrap_asprintf(char **out, const char *fmt, ...)
{
    if (alloc_fails())
        return -1;
    va_list ap;
    va_start(ap, fmt);
    int r = vasprintf(out, fmt, ap);
    va_end(ap);
    return r;
}

static void *cjson_malloc(size_t n)
{
    in_cjson = 1;
    void *p = __wrap_malloc(n);
    in_cjson = 0;
    return p;
}

static void cjson_free(void *p)
{
    free(p);
}

/* ---- conversions and their invariants --------------------------------------- */

struct io {
    const char *in;
    const char *expected;
    int dir;
    int map; /* the output's data through a mapping (NF4DEQ_OUTPUT_MAP=1), whatever the file system */
};
static const struct io FILE_IO = {FIXTURES "/tensors.bnb4.safetensors", FIXTURES "/tensors.expected-bf16.safetensors",
                                  0, 0};
static const struct io DIR_IO = {FIXTURES "/tiny-llama-bf16-bnb4-sharded",
                                 FIXTURES "/tiny-llama-bf16-bnb4.expected-bf16.safetensors", 1, 0};
static const struct io MAPPED_FILE_IO = {FIXTURES "/tensors.bnb4.safetensors",
                                         FIXTURES "/tensors.expected-bf16.safetensors", 0, 1};
static const struct io MAPPED_DIR_IO = {FIXTURES "/tiny-llama-bf16-bnb4-sharded",
                                        FIXTURES "/tiny-llama-bf16-bnb4.expected-bf16.safetensors", 1, 1};
/* gpt-oss's experts in Unsloth's layout, written fused (expert_layout.h):
 * tests/scripts/make_unsloth_experts.py writes it from the fixture's weights
 * into a temp directory when the group starts. test_experts_fused checks its
 * clean conversion against bitsandbytes' bytes. */
static char unsloth_in[4096];
static const struct io UNSLOTH_IO = {unsloth_in, NULL, 1, 0};
/* A GPT-2 whose 4-bit Conv1D weight is written transposed (conv1d_layout.h);
 * test_conv1d_layout checks a clean conversion against bitsandbytes' bytes. */
static const struct io GPT2_IO = {"tests/hostile/cases/dir-gpt2-conv1d-weight", NULL, 1, 0};

/* Byte snapshot of a file, or of every file of a directory. */
#define SNAP_MAX 32
struct snap {
    int n;
    char *name[SNAP_MAX];
    char *data[SNAP_MAX];
    size_t len[SNAP_MAX];
};

static void snap_take(struct snap *s, const char *path)
{
    memset(s, 0, sizeof *s);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    if (!S_ISDIR(st.st_mode)) {
        s->name[0] = tu_strdupf("%s", path);
        s->data[0] = tu_read_file(path, &s->len[0]);
        assert_non_null(s->data[0]);
        s->n = 1;
        return;
    }
    DIR *d = opendir(path);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        assert_true(s->n < SNAP_MAX);
        s->name[s->n] = tu_strdupf("%s/%s", path, e->d_name);
        s->data[s->n] = tu_read_file(s->name[s->n], &s->len[s->n]);
        assert_non_null(s->data[s->n]);
        s->n++;
    }
    closedir(d);
}

static void snap_check(const struct snap *s, const char *path, const char *what)
{
    struct stat st;
    if (stat(path, &st) != 0)
        fail_msg("%s %s is gone", what, path);
    if (S_ISDIR(st.st_mode) && tu_count_entries(path) != s->n)
        fail_msg("%s %s holds %d entries, had %d", what, path, tu_count_entries(path), s->n);
    for (int i = 0; i < s->n; i++) {
        size_t len = 0;
        char *now = tu_read_file(s->name[i], &len);
        if (!now || len != s->len[i] || memcmp(now, s->data[i], len) != 0)
            fail_msg("%s %s changed", what, s->name[i]);
        free(now);
    }
}

static void snap_free(struct snap *s)
{
    for (int i = 0; i < s->n; i++) {
        free(s->name[i]);
        free(s->data[i]);
    }
    s->n = 0;
}

/* Arms fault f (M_COUNT: only count) for the calls that follow, from
 * zeroed counters and no recorded error; disarm with g.armed = 0. */
static void arm(struct fault f)
{
    nf4_clear_error();
    g.f = f;
    g.matched = 0;
    g.fired = 0;
    for (int i = 0; i < FN_COUNT; i++)
        g.seen[i] = 0;
    g.armed = 1;
}

static int convert(const char *in, const char *out, int force)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.dtype = DT_BF16;
    o.device = DEVICE_CPU;
    o.threads = 1;
    o.force = force;
    o.chunk_elements = 4096; /* many chunks: many reads and writes per tensor */
    o.mem = 1;               /* the smallest ring the pipeline allows */
    struct convert_stats st;
    nf4_set_quiet(1);
    arm(g.f);
    int rc = convert_run(in, out, &o, &st);
    g.armed = 0;
    return rc;
}

/* Clean conversions of both inputs, made once: what successful faulted runs
 * must reproduce byte for byte. */
static char *ref_root, *ref_file, *ref_dir, *ref_unsloth, *ref_gpt2;
static struct snap ref_dir_snap, ref_file_snap, ref_unsloth_snap, ref_gpt2_snap;

/* Every tensor of `expected` is in `got` with the same dtype and bytes, and
 * `got` has no other. */
static void assert_model_tensors(const struct model *got, const char *label, const char *expected)
{
    struct st_file *want;
    assert_int_equal(st_open(expected, &want), NF4_OK);
    assert_int_equal(got->count, want->count);
    for (size_t i = 0; i < want->count; i++) {
        const struct st_tensor *w = &want->tensors[i];
        const struct model_tensor *t = model_find(got, w->name);
        if (!t)
            fail_msg("%s lacks %s", label, w->name);
        assert_int_equal(t->t->dtype, w->dtype);
        uint64_t n = st_tensor_bytes(w);
        assert_int_equal(st_tensor_bytes(t->t), n);
        char *a = malloc(n + 1), *b = malloc(n + 1);
        assert_int_equal(st_read(t->file, t->t, 0, a, n), NF4_OK);
        assert_int_equal(st_read(want, w, 0, b, n), NF4_OK);
        if (memcmp(a, b, n) != 0)
            fail_msg("%s: %s differs from %s", label, w->name, expected);
        free(a);
        free(b);
    }
    st_close(want);
}

static void assert_dir_tensors(const char *out, const char *expected)
{
    struct model *got;
    assert_int_equal(model_open_dir(out, &got), NF4_OK);
    assert_model_tensors(got, out, expected);
    model_close(got);
}

static int group_setup(void **state)
{
    (void)state;
    cJSON_Hooks hooks = {cjson_malloc, cjson_free};
    cJSON_InitHooks(&hooks);
    ref_root = tu_mkdtemp();
    ref_file = tu_strdupf("%s/ref.safetensors", ref_root);
    ref_dir = tu_strdupf("%s/refdir", ref_root);
    ref_unsloth = tu_strdupf("%s/refunsloth", ref_root);
    ref_gpt2 = tu_strdupf("%s/refgpt2", ref_root);
    snprintf(unsloth_in, sizeof unsloth_in, "%s/unsloth/base", ref_root);
    if (tu_sh_status("python3 tests/scripts/make_unsloth_experts.py " FIXTURES " %s/unsloth", ref_root) != 0) {
        fprintf(stderr, "tests/scripts/make_unsloth_experts.py failed\n");
        return -1;
    }
    g.f = (struct fault){.fn = FN_COUNT, .mode = M_COUNT};
    if (convert(FILE_IO.in, ref_file, 0) != 0 || convert(DIR_IO.in, ref_dir, 0) != 0 ||
        convert(UNSLOTH_IO.in, ref_unsloth, 0) != 0 || convert(GPT2_IO.in, ref_gpt2, 0) != 0) {
        fprintf(stderr, "reference conversion failed: %s\n", nf4_last_error());
        return -1;
    }
    tu_assert_same_tensors(ref_file, FILE_IO.expected);
    assert_dir_tensors(ref_dir, DIR_IO.expected);
    snap_take(&ref_file_snap, ref_file);
    snap_take(&ref_dir_snap, ref_dir);
    snap_take(&ref_unsloth_snap, ref_unsloth);
    snap_take(&ref_gpt2_snap, ref_gpt2);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    snap_free(&ref_file_snap);
    snap_free(&ref_dir_snap);
    snap_free(&ref_unsloth_snap);
    snap_free(&ref_gpt2_snap);
    tu_rmtree(ref_root);
    free(ref_root);
    free(ref_file);
    free(ref_dir);
    free(ref_unsloth);
    free(ref_gpt2);
    return 0;
}

/* Sweeps run hundreds of cases and report every failing one, not only the
 * first: in soft mode a failed check is printed and counted. */
static int soft_mode;
static long soft_failures;

#define case_fail(...)                                                                                                 \
    do {                                                                                                               \
        if (!soft_mode)                                                                                                \
            fail_msg(__VA_ARGS__);                                                                                     \
        print_error(__VA_ARGS__);                                                                                      \
        print_error("\n");                                                                                             \
        soft_failures++;                                                                                               \
    } while (0)

/* A successful run's output equals the clean reference byte for byte. */
static void assert_same_as_ref(const char *out, const struct io *io)
{
    const int dir = io->dir;
    const struct snap *ref = io == &UNSLOTH_IO ? &ref_unsloth_snap
                             : io == &GPT2_IO  ? &ref_gpt2_snap
                             : dir             ? &ref_dir_snap
                                               : &ref_file_snap;
    if (!dir) {
        size_t len = 0;
        char *got = tu_read_file(out, &len);
        assert_non_null(got);
        if (len != ref->len[0] || memcmp(got, ref->data[0], len) != 0)
            case_fail("%s differs from the clean conversion", out);
        free(got);
        tu_assert_same_tensors(out, FILE_IO.expected);
        return;
    }
    assert_int_equal(tu_count_entries(out), ref->n);
    for (int i = 0; i < ref->n; i++) {
        const char *base = strrchr(ref->name[i], '/') + 1;
        char *p = tu_strdupf("%s/%s", out, base);
        size_t len = 0;
        char *got = tu_read_file(p, &len);
        if (!got || len != ref->len[i] || memcmp(got, ref->data[i], len) != 0)
            case_fail("%s differs from the clean conversion", p);
        free(got);
        free(p);
    }
}

static void assert_error_line(const char *name, const char *in, const char *scratch)
{
    const char *msg = nf4_last_error();
    if (!*msg || strcmp(msg, "unknown error") == 0)
        case_fail("%s: no error was recorded", name);
    if (strchr(msg, '\n'))
        case_fail("%s: error is more than one line: %s", name, msg);
    if (!strstr(msg, in) && !strstr(msg, scratch))
        case_fail("%s: error names neither the input nor the output: %s", name, msg);
    /* A temp directory (".OUT.nf4deq-XXXXXX") is nf4deq's own business: the
     * user knows OUT. (The resume manifest, "/.nf4deq-resume.json", is not one.) */
    for (const char *p = strstr(msg, ".nf4deq-"); p; p = strstr(p + 1, ".nf4deq-"))
        if (p > msg && p[-1] != '/')
            case_fail("%s: error names a temp path, not the output: %s", name, msg);
}

struct fcase {
    const char *name;
    const struct io *io;
    struct fault f;
    int want;
    int force; /* OUT exists beforehand, --force given: it must survive a failure */
};

/* Runs one case in a fresh scratch directory and checks every invariant.
 * Returns the exit code so sweeps can accept several. */
static int run_case(const struct fcase *c, int check_code)
{
    char *scratch = tu_mkdtemp();
    char *out = tu_strdupf("%s/%s", scratch, c->io->dir ? "outdir" : "out.safetensors");
    struct snap in_before, old_out;
    snap_take(&in_before, c->io->in);
    memset(&old_out, 0, sizeof old_out);
    if (c->force) {
        if (c->io->dir) {
            assert_int_equal(mkdir(out, 0777), 0);
            char *p = tu_strdupf("%s/old.txt", out);
            tu_write_file(p, "the old output\n", 15);
            free(p);
        } else {
            tu_write_file(out, "the old output\n", 15);
        }
        snap_take(&old_out, out);
    }
    int entries_before = tu_count_entries(scratch);
    if (c->io->map)
        setenv("NF4DEQ_OUTPUT_MAP", "1", 1);

    g.f = c->f;
    if (c->f.nth == 0 || c->f.nth == -1) {
        /* Find where "the middle" or "the last" matching call is on a clean run. */
        char *probe = tu_mkdtemp();
        char *pout = tu_strdupf("%s/%s", probe, c->io->dir ? "outdir" : "out.safetensors");
        g.f.mode = M_COUNT;
        assert_int_equal(convert(c->io->in, pout, 0), 0);
        long total = g.matched;
        if (total <= 0)
            case_fail("%s: a clean run makes no matching %s call", c->name, FN_NAMES[c->f.fn]);
        g.f = c->f;
        g.f.nth = c->f.nth == 0 ? (total + 1) / 2 : total;
        tu_rmtree(probe);
        free(probe);
        free(pout);
    }
    int rc = convert(c->io->in, out, c->force);
    if (g.fired == 0)
        case_fail("%s: the fault never fired (%ld matching %s calls)", c->name, g.matched, FN_NAMES[c->f.fn]);
    if (check_code && rc != c->want)
        case_fail("%s: exit %d, expected %d (%s)", c->name, rc, c->want, nf4_last_error());
    if (rc == 0) {
        long before = soft_failures;
        assert_same_as_ref(out, c->io);
        if (soft_failures != before)
            case_fail("%s: exit 0 but the output differs", c->name);
    } else {
        assert_error_line(c->name, c->io->in, scratch);
        if (c->force)
            snap_check(&old_out, out, "the old OUT");
        else if (tu_exists(out))
            case_fail("%s: exit %d but %s exists (%s)", c->name, rc, out, nf4_last_error());
        if (tu_count_entries(scratch) != entries_before)
            case_fail("%s: exit %d left %d entries in the scratch directory, expected %d (%s)", c->name, rc,
                     tu_count_entries(scratch), entries_before, nf4_last_error());
    }
    unsetenv("NF4DEQ_OUTPUT_MAP");
    snap_check(&in_before, c->io->in, "the input");
    snap_free(&in_before);
    snap_free(&old_out);
    tu_rmtree(scratch);
    free(scratch);
    free(out);
    return rc;
}

/* ---- the wrappers see the library's calls ---------------------------------- */

static void test_wraps_intercept(void **state)
{
    (void)state;
    char *scratch = tu_mkdtemp();
    char *out = tu_strdupf("%s/out.safetensors", scratch), *outdir = tu_strdupf("%s/outdir", scratch);
    g.f = (struct fault){.fn = FN_COUNT, .mode = M_COUNT};
    assert_int_equal(convert(FILE_IO.in, out, 0), 0);
    static const enum fn FILE_FNS[] = {FN_WRITE, FN_PREAD, FN_FSYNC, FN_CLOSE, FN_RENAME, FN_MKOSTEMP, FN_ALLOC};
    for (size_t i = 0; i < sizeof FILE_FNS / sizeof FILE_FNS[0]; i++)
        if (g.seen[FILE_FNS[i]] == 0)
            fail_msg("the %s wrapper saw no call from libnf4deq.a in file mode", FN_NAMES[FILE_FNS[i]]);
    assert_int_equal(convert(DIR_IO.in, outdir, 0), 0);
    static const enum fn DIR_FNS[] = {FN_WRITE, FN_PREAD, FN_READ, FN_FSYNC, FN_RENAME, FN_MKOSTEMP, FN_MKDTEMP,
                                      FN_ALLOC};
    for (size_t i = 0; i < sizeof DIR_FNS / sizeof DIR_FNS[0]; i++)
        if (g.seen[DIR_FNS[i]] == 0)
            fail_msg("the %s wrapper saw no call from libnf4deq.a in directory mode", FN_NAMES[DIR_FNS[i]]);
    /* --force over an existing directory goes through renameat2(RENAME_EXCHANGE). */
    assert_int_equal(convert(DIR_IO.in, outdir, 1), 0);
    assert_true(g.seen[FN_RENAMEAT2] > 0);
    assert_same_as_ref(outdir, &DIR_IO);
    tu_rmtree(scratch);
    free(scratch);
    free(out);
    free(outdir);
}

/* ---- the table ---------------------------------------------------------------- */

#define FK(fn_, mode_, err_, nth_, path_, kind_) \
    ((struct fault){.fn = (fn_), .mode = (mode_), .err = (err_), .nth = (nth_), .path = (path_), .kind = (kind_)})
#define F(fn_, mode_, err_, nth_, path_) FK(fn_, mode_, err_, nth_, path_, K_ANY)
static const struct fcase CASES[] = {
    /* ---- file mode ---- */
    {"file: ENOSPC on the first write", &FILE_IO, F(FN_WRITE, M_ERR, ENOSPC, 1, "out.safetensors"), 74, 0},
    {"file: ENOSPC in the middle of tensor data", &FILE_IO, F(FN_WRITE, M_ERR, ENOSPC, 0, "out.safetensors"), 74,
     0},
    {"file: ENOSPC on the last write", &FILE_IO, F(FN_WRITE, M_ERR, ENOSPC, -1, "out.safetensors"), 74, 0},
    {"file: EIO on write", &FILE_IO, F(FN_WRITE, M_ERR, EIO, 0, "out.safetensors"), 74, 0},
    {"file: write returns 0", &FILE_IO, F(FN_WRITE, M_ZERO, 0, 0, "out.safetensors"), 74, 0},
    {"file: short writes, retried", &FILE_IO, F(FN_WRITE, M_SHORT, 0, 1, "out.safetensors"), 0, 0},
    {"file: EINTR on every other write", &FILE_IO, F(FN_WRITE, M_EINTR, 0, 1, "out.safetensors"), 0, 0},
    {"file: short preads, retried", &FILE_IO, F(FN_PREAD, M_SHORT, 0, 1, "tensors.bnb4"), 0, 0},
    {"file: EINTR on every other pread", &FILE_IO, F(FN_PREAD, M_EINTR, 0, 1, "tensors.bnb4"), 0, 0},
    {"file: EIO on the header pread", &FILE_IO, F(FN_PREAD, M_ERR, EIO, 1, "tensors.bnb4"), 74, 0},
    {"file: EIO on a data pread", &FILE_IO, F(FN_PREAD, M_ERR, EIO, 0, "tensors.bnb4"), 74, 0},
    {"file: pread returns 0 early (file shrank)", &FILE_IO, F(FN_PREAD, M_ZERO, 0, 0, "tensors.bnb4"), 74, 0},
    {"file: EIO from fsync of the output", &FILE_IO, FK(FN_FSYNC, M_ERR, EIO, 1, NULL, K_FILE), 74, 0},
    {"file: EIO from fsync of its directory", &FILE_IO, FK(FN_FSYNC, M_ERR, EIO, 1, NULL, K_DIR), 74, 0},
    {"file: EIO from close of the output", &FILE_IO, F(FN_CLOSE, M_ERR, EIO, 1, "out.safetensors"), 74, 0},
    {"file: rename EXDEV", &FILE_IO, F(FN_RENAME, M_ERR, EXDEV, 1, "out.safetensors"), 73, 0},
    {"file: rename EACCES", &FILE_IO, F(FN_RENAME, M_ERR, EACCES, 1, "out.safetensors"), 73, 0},
    {"file: mkostemp EACCES", &FILE_IO, F(FN_MKOSTEMP, M_ERR, EACCES, 1, NULL), 73, 0},
    {"file: mkostemp EEXIST", &FILE_IO, F(FN_MKOSTEMP, M_ERR, EEXIST, 1, NULL), 73, 0},
    {"file --force: ENOSPC keeps the old OUT", &FILE_IO, F(FN_WRITE, M_ERR, ENOSPC, 0, "out.safetensors"), 74, 1},
    {"file --force: fsync EIO keeps the old OUT", &FILE_IO, FK(FN_FSYNC, M_ERR, EIO, 1, NULL, K_FILE), 74, 1},
    {"file --force: rename EACCES keeps the old OUT", &FILE_IO, F(FN_RENAME, M_ERR, EACCES, 1, NULL), 73, 1},
    {"file --force: EIO on pread keeps the old OUT", &FILE_IO, F(FN_PREAD, M_ERR, EIO, 0, "tensors.bnb4"), 74, 1},
    {"file --force: short writes replace the old OUT", &FILE_IO, F(FN_WRITE, M_SHORT, 0, 1, "out.safetensors"), 0,
     1},
    /* ---- directory mode ---- */
    {"dir: ENOSPC on the first write", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 1, "outdir"), 74, 0},
    {"dir: ENOSPC in the middle of shard data", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 0, "/.model-0000"), 74, 0},
    {"dir: ENOSPC on the last shard's data", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, -1, "/.model-00005"), 74, 0},
    {"dir: ENOSPC writing a copied file", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 1, "/generation_config.json"), 74,
     0},
    {"dir: ENOSPC writing the index", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 1, "/.model.safetensors.index.json."),
     74, 0},
    {"dir: ENOSPC writing config.json", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 1, "/.config.json."), 74, 0},
    {"dir: EIO on write", &DIR_IO, F(FN_WRITE, M_ERR, EIO, 0, "outdir"), 74, 0},
    {"dir: short writes, retried", &DIR_IO, F(FN_WRITE, M_SHORT, 0, 1, "outdir"), 0, 0},
    {"dir: EINTR on every other write", &DIR_IO, F(FN_WRITE, M_EINTR, 0, 1, "outdir"), 0, 0},
    {"dir: short preads, retried", &DIR_IO, F(FN_PREAD, M_SHORT, 0, 1, "bnb4-sharded"), 0, 0},
    {"dir: EINTR on every other pread", &DIR_IO, F(FN_PREAD, M_EINTR, 0, 1, "bnb4-sharded"), 0, 0},
    {"dir: short reads of a copied file", &DIR_IO, F(FN_READ, M_SHORT, 0, 1, "generation_config"), 0, 0},
    {"dir: EINTR reading a copied file", &DIR_IO, F(FN_READ, M_EINTR, 0, 1, "generation_config"), 0, 0},
    {"dir: EIO reading a copied file", &DIR_IO, F(FN_READ, M_ERR, EIO, 1, "generation_config"), 74, 0},
    {"dir: EIO on a shard pread", &DIR_IO, F(FN_PREAD, M_ERR, EIO, 0, "/model-0000"), 74, 0},
    {"dir: EIO reading config.json", &DIR_IO, F(FN_PREAD, M_ERR, EIO, 1, "sharded/config.json"), 74, 0},
    {"dir: pread returns 0 early (shard shrank)", &DIR_IO, F(FN_PREAD, M_ZERO, 0, 0, "/model-0000"), 74, 0},
    /* ---- gpt-oss's experts written fused: whole tensors read for the cache, bands without it ---- */
    {"unsloth: EIO on a data pread", &UNSLOTH_IO, F(FN_PREAD, M_ERR, EIO, 0, "base/model.safetensors"), 74, 0},
    {"unsloth: short preads, retried", &UNSLOTH_IO, F(FN_PREAD, M_SHORT, 0, 1, "base/model.safetensors"), 0, 0},
    {"unsloth: pread returns 0 early", &UNSLOTH_IO, F(FN_PREAD, M_ZERO, 0, 0, "base/model.safetensors"), 74, 0},
    {"dir: EIO from fsync of a shard", &DIR_IO, FK(FN_FSYNC, M_ERR, EIO, 0, NULL, K_FILE), 74, 0},
    {"dir: EIO from fsync of a copied file", &DIR_IO, FK(FN_FSYNC, M_ERR, EIO, 1, "/generation_config.json", K_FILE),
     74, 0},
    {"dir: EIO from fsync of the index", &DIR_IO, FK(FN_FSYNC, M_ERR, EIO, 1, "/.model.safetensors.index", K_FILE),
     74, 0},
    {"dir: EIO from the first directory fsync", &DIR_IO, FK(FN_FSYNC, M_ERR, EIO, 1, NULL, K_DIR), 74, 0},
    {"dir: EIO from the last directory fsync", &DIR_IO, FK(FN_FSYNC, M_ERR, EIO, -1, NULL, K_DIR), 74, 0},
    {"dir: rename EXDEV of a shard", &DIR_IO, F(FN_RENAME, M_ERR, EXDEV, 1, "/.model-0000"), 73, 0},
    {"dir: rename EACCES of the index", &DIR_IO, F(FN_RENAME, M_ERR, EACCES, 1, "/.model.safetensors.index"), 73,
     0},
    {"dir: rename EXDEV of the finished directory", &DIR_IO, F(FN_RENAME, M_ERR, EXDEV, -1, NULL), 73, 0},
    {"dir: mkdtemp EACCES", &DIR_IO, F(FN_MKDTEMP, M_ERR, EACCES, 1, NULL), 73, 0},
    {"dir: mkostemp EACCES for a shard", &DIR_IO, F(FN_MKOSTEMP, M_ERR, EACCES, 0, NULL), 73, 0},
    {"dir --force: ENOSPC keeps the old OUT", &DIR_IO, F(FN_WRITE, M_ERR, ENOSPC, 0, "outdir"), 74, 1},
    {"dir --force: ENOSPC on config.json keeps the old OUT", &DIR_IO,
     F(FN_WRITE, M_ERR, ENOSPC, 1, "/.config.json."), 74, 1},
    {"dir --force: renameat2 EXDEV keeps the old OUT", &DIR_IO, F(FN_RENAMEAT2, M_ERR, EXDEV, 1, NULL), 73, 1},
    {"dir --force: renameat2 EACCES keeps the old OUT", &DIR_IO, F(FN_RENAMEAT2, M_ERR, EACCES, 1, NULL), 73, 1},
    {"dir --force: short writes replace the old OUT", &DIR_IO, F(FN_WRITE, M_SHORT, 0, 1, "outdir"), 0, 1},
    /* ---- the output's data through a mapping, as on tmpfs ---- */
    {"file, mapped: ENOSPC reserving the data", &MAPPED_FILE_IO, F(FN_FALLOCATE, M_ERR, ENOSPC, 1, "out.safetensors"),
     74, 0},
    {"file, mapped: EIO reserving the data", &MAPPED_FILE_IO, F(FN_FALLOCATE, M_ERR, EIO, -1, "out.safetensors"), 74,
     0},
    {"file, mapped: EINTR on every other reservation (retried, identical output)", &MAPPED_FILE_IO,
     F(FN_FALLOCATE, M_EINTR, 0, 1, "out.safetensors"), 0, 0},
    {"file, mapped: no mapping, written with write(2)", &MAPPED_FILE_IO,
     F(FN_MMAP, M_ERR, ENOMEM, 1, "out.safetensors"), 0, 0},
    {"file, mapped: EIO from fsync of the output", &MAPPED_FILE_IO, FK(FN_FSYNC, M_ERR, EIO, 1, NULL, K_FILE), 74, 0},
    {"file, mapped: rename EXDEV", &MAPPED_FILE_IO, F(FN_RENAME, M_ERR, EXDEV, 1, "out.safetensors"), 73, 0},
    {"file --force, mapped: ENOSPC keeps the old OUT", &MAPPED_FILE_IO,
     F(FN_FALLOCATE, M_ERR, ENOSPC, 1, "out.safetensors"), 74, 1},
    {"dir, mapped: ENOSPC reserving a shard's data", &MAPPED_DIR_IO,
     F(FN_FALLOCATE, M_ERR, ENOSPC, 0, "/.model-0000"), 74, 0},
    {"dir, mapped: no mapping for a shard, written with write(2)", &MAPPED_DIR_IO,
     F(FN_MMAP, M_ERR, ENODEV, 0, "/.model-0000"), 0, 0},
    {"dir --force, mapped: ENOSPC keeps the old OUT", &MAPPED_DIR_IO, F(FN_FALLOCATE, M_ERR, ENOSPC, -1, "outdir"),
     74, 1},
};
#undef F
#undef FK

#define NCASES (sizeof CASES / sizeof CASES[0])

static void test_fault_case(void **state)
{
    run_case(*state, 1);
}

/* ---- allocation failure sweep ---------------------------------------------- */

static void alloc_sweep(const struct io *io, long stride)
{
    char *probe = tu_mkdtemp();
    char *pout = tu_strdupf("%s/%s", probe, io->dir ? "outdir" : "out.safetensors");
    g.f = (struct fault){.fn = FN_ALLOC, .mode = M_COUNT};
    if (io->map)
        setenv("NF4DEQ_OUTPUT_MAP", "1", 1);
    assert_int_equal(convert(io->in, pout, 0), 0);
    unsetenv("NF4DEQ_OUTPUT_MAP");
    long total = g.matched;
    tu_rmtree(probe);
    free(probe);
    free(pout);
    assert_true(total > 10);
    long ok = 0, oom = 0, cjson65 = 0;
    soft_mode = 1;
    soft_failures = 0;
    for (long n = 1; n <= total; n += stride) {
        char name[64];
        snprintf(name, sizeof name, "allocation %ld of %ld", n, total);
        struct fcase c = {name, io, {.fn = FN_ALLOC, .mode = M_ERR, .nth = n}, 70, 0};
        fired_in_cjson = 0;
        int rc = run_case(&c, 0);
        if (soft_failures > 40) /* enough to see the pattern */
            break;
        if (rc == 65 && fired_in_cjson && !STRICT_CJSON_OOM) {
            /* cJSON returns NULL for "out of memory" and "invalid" alike, so
             * nf4deq reports a failed allocation inside cJSON as bad JSON (65). */
            cjson65++;
            continue;
        }
        if (rc != 0 && rc != 70)
            case_fail("%s: allocation %ld of %ld failing gave exit %d (%s)", io->in, n, total, rc, nf4_last_error());
        rc == 0 ? ok++ : oom++;
    }
    soft_mode = 0;
    if (soft_failures)
        fail_msg("%ld failed checks (above)", soft_failures);
    print_message("  %s: %ld allocations; %ld runs exit 70, %ld succeed anyway, %ld inside cJSON exit 65\n", io->in,
                  total, oom, ok, cjson65);
}

/* inspect --json on `in` (with adapter `lora`, or NULL) into a temp file,
 * with g.f armed: its status, and what it printed in *out (allocated). */
static int inspect_json(const char *in, const char *lora, char **out)
{
    FILE *f = tmpfile();
    assert_non_null(f);
    const char *loras[1] = {lora};
    nf4_set_quiet(1);
    nf4_clear_error();
    arm(g.f);
    int rc = inspect_run(in, 1, DT_INVALID, loras, lora ? 1 : 0, NULL, f);
    g.armed = 0;
    long len = ftell(f);
    assert_true(len >= 0);
    *out = calloc(1, (size_t)len + 1);
    rewind(f);
    assert_int_equal(fread(*out, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    return rc;
}

/* Every allocation of inspect --json failing in turn, on a pipeline and on a
 * merge: exit 70 with one line and nothing on standard output, or, where
 * nf4deq could do without it, the whole report as a clean run prints it.
 * Never 0 with a report that lacks a part (which it was before session 32's
 * mend: cJSON's failed additions went unnoticed), never the table's lines in
 * its place, and no use of a component's object that a failed addition freed
 * (both found by this sweep). */
static void inspect_alloc_sweep(const char *in, const char *lora)
{
    char *ref;
    g.f = (struct fault){.fn = FN_ALLOC, .mode = M_COUNT};
    assert_int_equal(inspect_json(in, lora, &ref), 0);
    const long total = g.matched;
    assert_true(total > 100);
    long oom = 0, ok = 0;
    for (long n = 1; n <= total; n++) {
        char *got;
        g.f = (struct fault){.fn = FN_ALLOC, .mode = M_ERR, .nth = n};
        int rc = inspect_json(in, lora, &got);
        if (rc == 0 && strcmp(got, ref) != 0)
            fail_msg("%s: allocation %ld of %ld failing: exit 0 with another report", in, n, total);
        if (rc != 0 && (rc != 70 || strchr(nf4_last_error(), '\n')))
            fail_msg("%s: allocation %ld of %ld failing: exit %d (%s)", in, n, total, rc, nf4_last_error());
        if (rc != 0 && got[0])
            fail_msg("%s: allocation %ld of %ld failing: exit %d, and printed %.200s", in, n, total, rc, got);
        rc == 0 ? ok++ : oom++;
        free(got);
    }
    free(ref);
    print_message("  inspect --json %s: %ld allocations; %ld runs exit 70, %ld print the whole report\n", in, total,
                  oom, ok);
}

static void test_alloc_sweep_inspect_json(void **state)
{
    (void)state;
    inspect_alloc_sweep(FIXTURES "/diffusers/tiny-flux-bnb4", NULL);
    inspect_alloc_sweep(FIXTURES "/lora/base-llama-bf16-bnb4", FIXTURES "/lora/adapter-r8-all-linear");
}

static void test_alloc_sweep_file(void **state)
{
    (void)state;
    alloc_sweep(&FILE_IO, 1);
}

static void test_alloc_sweep_dir(void **state)
{
    (void)state;
    alloc_sweep(&DIR_IO, 1);
}

static void test_alloc_sweep_unsloth(void **state)
{
    (void)state;
    alloc_sweep(&UNSLOTH_IO, 1);
}

static void test_alloc_sweep_gpt2(void **state)
{
    (void)state;
    alloc_sweep(&GPT2_IO, 1);
}

static void test_alloc_sweep_mapped_file(void **state)
{
    (void)state;
    alloc_sweep(&MAPPED_FILE_IO, 1);
}

/* ---- signals ------------------------------------------------------------- */

/* What SIGTERM and SIGHUP may leave of a directory conversion (fileio.h):
 * OUT's lock file, and its temp directory holding only the resume manifest
 * and finished shards, each byte-identical to the clean conversion's
 * (`ref` NULL: shards only checked to be there). */
static void assert_resumable_leftovers(const char *scratch, const struct snap *ref)
{
    DIR *d = opendir(scratch);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (strstr(e->d_name, ".nf4deq-lock"))
            continue;
        char *temp = tu_strdupf("%s/%s", scratch, e->d_name);
        DIR *t = opendir(temp);
        if (!t || !strstr(e->d_name, ".nf4deq-"))
            case_fail("%s: left, and not a resumable temp directory", temp);
        struct dirent *f;
        while (t && (f = readdir(t)) != NULL) {
            if (!strcmp(f->d_name, ".") || !strcmp(f->d_name, "..") || !strcmp(f->d_name, ".nf4deq-resume.json"))
                continue;
            char *p = tu_strdupf("%s/%s", temp, f->d_name);
            int same = !ref && strstr(f->d_name, ".safetensors") && f->d_name[0] != '.';
            for (int i = 0; ref && i < ref->n && !same; i++)
                if (!strcmp(strrchr(ref->name[i], '/') + 1, f->d_name)) {
                    size_t len = 0;
                    char *got = tu_read_file(p, &len);
                    same = got && len == ref->len[i] && memcmp(got, ref->data[i], len) == 0;
                    free(got);
                }
            if (!same)
                case_fail("%s: kept by a stop, but not a finished shard of the clean conversion", p);
            free(p);
        }
        if (t)
            closedir(t);
        free(temp);
    }
    closedir(d);
}

/* In a forked child, a conversion raises `sig` right after the nth call of fn
 * (after a temp file, a rename, an fsync...). The signal handler must leave no
 * temp file; OUT may exist only if it was already complete. */
static void signal_sweep(const struct io *io, enum fn fn, int sig)
{
    char *probe = tu_mkdtemp();
    char *pout = tu_strdupf("%s/%s", probe, io->dir ? "outdir" : "out.safetensors");
    g.f = (struct fault){.fn = fn, .mode = M_COUNT};
    assert_int_equal(convert(io->in, pout, 0), 0);
    long total = g.matched;
    tu_rmtree(probe);
    free(probe);
    free(pout);
    assert_true(total > 0);
    for (long n = 1; n <= total; n++) {
        char *scratch = tu_mkdtemp();
        char *out = tu_strdupf("%s/%s", scratch, io->dir ? "outdir" : "out.safetensors");
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            install_signal_cleanup();
            g.f = (struct fault){.fn = fn, .mode = M_SIGNAL, .err = sig, .nth = n};
            int rc = convert(io->in, out, 0);
            _exit(100 + rc);
        }
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        if (!WIFSIGNALED(st) || WTERMSIG(st) != sig)
            fail_msg("%s: signal after %s call %ld: child did not die from signal %d (status 0x%x)", io->in,
                     FN_NAMES[fn], n, sig, st);
        int left = tu_count_entries(scratch);
        if (left == 1 && tu_exists(out)) {
            /* Only a finished output may remain: the signal came after it was published. */
            assert_same_as_ref(out, io);
        } else if (left != 0 && io->dir && (sig == SIGTERM || sig == SIGHUP) && !tu_exists(out)) {
            /* A stop keeps a directory's finished shards for --resume. */
            assert_resumable_leftovers(scratch, &ref_dir_snap);
        } else if (left != 0) {
            DIR *d = opendir(scratch);
            struct dirent *e;
            char names[512] = "";
            while (d && (e = readdir(d)))
                if (strlen(names) + strlen(e->d_name) + 2 < sizeof names) {
                    strcat(names, " ");
                    strcat(names, e->d_name);
                }
            if (d)
                closedir(d);
            fail_msg("%s: signal %d after %s call %ld of %ld left:%s", io->in, sig, FN_NAMES[fn], n, total, names);
        }
        tu_rmtree(scratch);
        free(scratch);
        free(out);
    }
}

struct sig_case {
    const char *name;
    const struct io *io;
    enum fn fn;
    int sig;
};

static const struct sig_case SIG_CASES[] = {
    {"file: signal after each mkostemp", &FILE_IO, FN_MKOSTEMP, SIGTERM},
    {"file: signal after each write", &FILE_IO, FN_WRITE, SIGTERM},
    {"file: signal after each fsync", &FILE_IO, FN_FSYNC, SIGTERM},
    {"file: signal after each rename", &FILE_IO, FN_RENAME, SIGINT},
    {"dir: signal after mkdtemp", &DIR_IO, FN_MKDTEMP, SIGTERM},
    {"dir: signal after each mkostemp", &DIR_IO, FN_MKOSTEMP, SIGTERM},
    {"dir: signal after each fsync", &DIR_IO, FN_FSYNC, SIGHUP},
    {"dir: signal after each rename", &DIR_IO, FN_RENAME, SIGINT},
};
#define NSIG_CASES (sizeof SIG_CASES / sizeof SIG_CASES[0])

static void test_signal_case(void **state)
{
    const struct sig_case *c = *state;
    signal_sweep(c->io, c->fn, c->sig);
}

/* The real binary, killed in the middle of a ~1 s conversion. */
static char *big_root, *big_dir, *big_file;

static int big_setup(void **state)
{
    (void)state;
    big_root = tu_mkdtemp();
    big_dir = tu_strdupf("%s/tinyllama-2l", big_root);
    big_file = tu_strdupf("%s/model.safetensors", big_dir);
    char *bin = tu_strdupf("%s", NF4DEQ_BIN);
    char *slash = strrchr(bin, '/');
    char *gen = slash ? tu_strdupf("%.*s/tools/gen_bnb4", (int)(slash - bin), bin) : tu_strdupf("tools/gen_bnb4");
    /* detect_leaks=0: under SANITIZE=1 the generator's own leaks must not fail the set-up. */
    char *cmd = tu_strdupf("ASAN_OPTIONS=detect_leaks=0 '%s' --preset tinyllama --layers 2 '%s' >/dev/null", gen, big_dir);
    int rc = system(cmd);
    free(bin);
    free(gen);
    free(cmd);
    return rc == 0 ? 0 : -1;
}

static int big_teardown(void **state)
{
    (void)state;
    tu_rmtree(big_root);
    free(big_root);
    free(big_dir);
    free(big_file);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void kill_binary(const char *in, int dir, int sig)
{
    char *scratch = tu_mkdtemp();
    char *out = tu_strdupf("%s/%s", scratch, dir ? "out" : "out.safetensors");
    fflush(NULL);
    double t0 = now_s();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execl(NF4DEQ_BIN, NF4DEQ_BIN, "convert", "-q", "--device", "cpu", "-j", "1", "--dtype", "fp32", in, out,
              (char *)NULL);
        _exit(127);
    }
    /* Wait until the output is being written (a temp entry appears), and at
     * least 0.3 s, then signal: the child must still be running. */
    int st = 0, seen_temp = 0;
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            fail_msg("%s finished (status 0x%x) before it could be signalled: the model is too small", NF4DEQ_BIN,
                     st);
        seen_temp = seen_temp || tu_count_entries(scratch) > 0;
        if (seen_temp && now_s() - t0 >= 0.3)
            break;
        if (now_s() - t0 > 20)
            fail_msg("no temp file appeared in %s", scratch);
        usleep(2000);
    }
    assert_int_equal(kill(pid, sig), 0);
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (!(WIFSIGNALED(st) && WTERMSIG(st) == sig) && !(WIFEXITED(st) && WEXITSTATUS(st) != 0))
        fail_msg("after signal %d the child ended with status 0x%x", sig, st);
    if (dir && sig == SIGTERM)
        assert_resumable_leftovers(scratch, NULL); /* a stop keeps finished shards for --resume */
    else if (tu_count_entries(scratch) != 0)
        fail_msg("signal %d after %.2f s left %d entries in %s", sig, now_s() - t0, tu_count_entries(scratch),
                 scratch);
    tu_rmtree(scratch);
    free(scratch);
    free(out);
}

static void test_sigterm_dir(void **state)
{
    (void)state;
    kill_binary(big_dir, 1, SIGTERM);
}

static void test_sigint_dir(void **state)
{
    (void)state;
    kill_binary(big_dir, 1, SIGINT);
}

static void test_sigterm_file(void **state)
{
    (void)state;
    kill_binary(big_file, 0, SIGTERM);
}

static void test_sigint_file(void **state)
{
    (void)state;
    kill_binary(big_file, 0, SIGINT);
}

/* Every signal whose default action ends the process cleans up as SIGINT
 * does (fileio.h's cleanup_signals): a timer's, a user's, a real-time one, a
 * power failure's. */
static void test_other_fatal_signals(void **state)
{
    (void)state;
    kill_binary(big_file, 0, SIGUSR1);
    kill_binary(big_dir, 1, SIGALRM);
    kill_binary(big_file, 0, SIGRTMIN);
    kill_binary(big_file, 0, SIGPWR);
}

/* A file size limit (ulimit -f) is a write error: SIGXFSZ is ignored, so the
 * write fails with EFBIG, exit 74, one line, nothing left. */
static void test_file_size_limit_is_a_write_error(void **state)
{
    (void)state;
    for (int dir = 0; dir < 2; dir++) {
        char *scratch = tu_mkdtemp();
        char *out = tu_strdupf("%s/%s", scratch, dir ? "out" : "out.safetensors");
        char *err = tu_strdupf("%s.err", scratch);
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            struct rlimit lim = {1 << 20, 1 << 20};
            int devnull = open("/dev/null", O_RDWR), errfd = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (devnull < 0 || errfd < 0 || setrlimit(RLIMIT_FSIZE, &lim) != 0)
                _exit(126);
            dup2(devnull, 1);
            dup2(errfd, 2);
            execl(NF4DEQ_BIN, NF4DEQ_BIN, "convert", "--progress", "none", "--device", "cpu", "--dtype", "fp32",
                  dir ? big_dir : big_file, out, (char *)NULL);
            _exit(127);
        }
        int st = 0;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        char *msg = tu_read_file(err, NULL);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 74 || tu_lines(msg) != 1 || !strstr(msg, "File too large"))
            fail_msg("%s under a 1 MiB file size limit: status 0x%x, stderr: %s", dir ? "directory" : "file", st,
                     msg);
        if (tu_count_entries(scratch) != 0)
            fail_msg("a file size limit left %d entries in %s", tu_count_entries(scratch), scratch);
        unlink(err);
        tu_rmtree(scratch);
        free(msg);
        free(err);
        free(scratch);
        free(out);
    }
}

/* ---- a kohya LoRA's temp file ------------------------------------------------ */

#define KOHYA_LORA FIXTURES "/diffusers/lora-flux-kohya.safetensors"
#define KOHYA_AS_DIFFUSERS FIXTURES "/diffusers/lora-flux-kohya.diffusers.safetensors"

/* Points TMPDIR at `tmp`; returns what it was (allocated, NULL: unset) for tmpdir_restore. */
static char *tmpdir_set(const char *tmp)
{
    char *old = getenv("TMPDIR") ? tu_strdupf("%s", getenv("TMPDIR")) : NULL;
    setenv("TMPDIR", tmp, 1);
    return old;
}

static void tmpdir_restore(char *old)
{
    old ? setenv("TMPDIR", old, 1) : unsetenv("TMPDIR");
    free(old);
}

/* diffusers_lora_open of KOHYA_LORA with TMPDIR=tmp and fault f armed. */
static int open_kohya(const char *tmp, struct fault f, struct model **m)
{
    char *old = tmpdir_set(tmp);
    arm(f);
    int rc = diffusers_lora_open(KOHYA_LORA, LORA_FAMILY_FLUX, 0, m);
    g.armed = 0;
    tmpdir_restore(old);
    return rc;
}

/* Its diffusers form goes to a file no name reaches (O_TMPFILE); where the
 * file system lacks O_TMPFILE, to a mkstemp'd name unlinked at once. Either
 * way TMPDIR holds nothing even while the LoRA is open, and what is read back
 * is diffusers' own conversion. */
static void test_kohya_temp_has_no_name(void **state)
{
    (void)state;
    char *tmp = tu_mkdtemp();
    static const struct {
        const char *name;
        enum mode mode;
        int err;
        long mkostemps;
    } WAYS[] = {
        {"O_TMPFILE", M_COUNT, 0, 0},
        {"no O_TMPFILE (EOPNOTSUPP)", M_ERR, EOPNOTSUPP, 1},
        {"no O_TMPFILE (EISDIR, kernels before 3.11)", M_ERR, EISDIR, 1},
    };
    for (size_t i = 0; i < sizeof WAYS / sizeof WAYS[0]; i++) {
        struct model *m = NULL;
        struct fault f = {.fn = FN_OPEN, .mode = WAYS[i].mode, .err = WAYS[i].err, .nth = 1, .path = tmp};
        if (open_kohya(tmp, f, &m) != NF4_OK)
            fail_msg("%s: %s", WAYS[i].name, nf4_last_error());
        if (g.matched != 1 || g.seen[FN_MKOSTEMP] != WAYS[i].mkostemps)
            fail_msg("%s: %ld O_TMPFILE opens and %ld mkostemps in TMPDIR, expected 1 and %ld", WAYS[i].name,
                     (long)g.matched, (long)g.seen[FN_MKOSTEMP], WAYS[i].mkostemps);
        if (tu_count_entries(tmp) != 0)
            fail_msg("%s: TMPDIR holds %d entries while the LoRA is open", WAYS[i].name, tu_count_entries(tmp));
        assert_string_equal(m->files[0]->path, KOHYA_LORA);
        assert_model_tensors(m, WAYS[i].name, KOHYA_AS_DIFFUSERS);
        model_close(m);
    }
    tu_rmtree(tmp);
    free(tmp);
}

/* A TMPDIR where no file can be made is exit 73, one line naming it. */
static void test_kohya_temp_cannot_be_made(void **state)
{
    (void)state;
    char *tmp = tu_mkdtemp();
    struct model *m = NULL;
    assert_int_equal(open_kohya(tmp, (struct fault){.fn = FN_OPEN, .mode = M_ERR, .err = EACCES, .nth = 1,
                                                    .path = tmp}, &m), NF4_ECANTCREAT);
    assert_null(m);
    assert_int_equal(g.fired, 1);
    const char *msg = nf4_last_error();
    if (!strstr(msg, tmp) || !strstr(msg, "TMPDIR") || strchr(msg, '\n'))
        fail_msg("not one line naming TMPDIR: %s", msg);
    assert_int_equal(tu_count_entries(tmp), 0);
    tu_rmtree(tmp);
    free(tmp);
}

/* convert --device cpu IN OUT --lora LORA in this process with fault `f`
 * armed (an M_COUNT one counts the calls it matches in g.matched). */
static int merge_with_fault(struct fault f, const char *in, const char *lora, const char *out,
                            struct convert_stats *st)
{
    const char *loras[1] = {lora};
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CPU;
    o.lora_dirs = loras;
    o.nlora = 1;
    arm(f);
    int rc = convert_run(in, out, &o, st);
    g.armed = 0;
    return rc;
}

/* A pipeline converts a kohya LoRA once: to see which components it is for,
 * and then, opened again from that temp file, for each of them. */
static void test_kohya_converted_once(void **state)
{
    (void)state;
    char *tmp = tu_mkdtemp(), *scratch = tu_mkdtemp(), *out = tu_strdupf("%s/out", scratch);
    char *old = tmpdir_set(tmp);
    struct convert_stats st;
    int rc = merge_with_fault((struct fault){.fn = FN_OPEN, .mode = M_COUNT, .path = tmp},
                              FIXTURES "/diffusers/tiny-flux-bnb4", KOHYA_LORA, out, &st);
    tmpdir_restore(old);
    if (rc != 0)
        fail_msg("convert: %s", nf4_last_error());
    assert_int_equal(st.merged, 16);
    if (g.matched != 1)
        fail_msg("the kohya LoRA was converted %ld times", (long)g.matched);
    assert_int_equal(tu_count_entries(tmp), 0);
    tu_rmtree(tmp);
    tu_rmtree(scratch);
    free(tmp);
    free(scratch);
    free(out);
}

/* config.json is read once in a run, however many things it decides (the
 * head tied to GPT-2's wte, the model's type for the adapter's names, the
 * Conv1D layout of each part, gpt-oss's experts) and the output's copy is
 * rewritten from those bytes: one reading, so the output cannot mix two
 * versions of a config.json edited while the run went on. */
static void test_config_read_once(void **state)
{
    (void)state;
    char *scratch = tu_mkdtemp(), *out = tu_strdupf("%s/out", scratch);
    struct convert_stats st;
    const struct fault opens = {.fn = FN_OPEN, .mode = M_COUNT, .path = "base-gpt2-bf16-bnb4-tied/config.json"};
    int rc = merge_with_fault(opens, FIXTURES "/lora/base-gpt2-bf16-bnb4-tied",
                              FIXTURES "/lora/adapter-gpt2-tied-head-lora", out, &st);
    if (rc != 0)
        fail_msg("convert: %s", nf4_last_error());
    assert_true(st.merged > 0);
    if (g.matched != 1)
        fail_msg("config.json was opened %ld times", (long)g.matched);
    char *config = tu_strdupf("%s/config.json", out);
    size_t len;
    char *text = tu_read_file(config, &len);
    assert_non_null(strstr(text, "\"tie_word_embeddings\": false"));
    assert_null(strstr(text, "quantization_config"));
    free(text);
    free(config);
    tu_rmtree(scratch);
    free(scratch);
    free(out);
}

/* SIGKILL in the middle of writing the temp file leaves nothing in TMPDIR:
 * no handler runs, so only a file without a name is safe. */
static void test_kohya_temp_survives_sigkill(void **state)
{
    (void)state;
    char *tmp = tu_mkdtemp();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct model *m = NULL;
        /* The second write into TMPDIR: the header is in, the data is not. */
        open_kohya(tmp, (struct fault){.fn = FN_WRITE, .mode = M_SIGNAL, .err = SIGKILL, .nth = 2, .path = tmp}, &m);
        _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL)
        fail_msg("the conversion was not killed in its temp file's writes (status %#x)", status);
    assert_int_equal(tu_count_entries(tmp), 0);
    tu_rmtree(tmp);
    free(tmp);
}

int main(void)
{
    static struct CMUnitTest faults[7 + NCASES + NSIG_CASES];
    size_t n = 0;
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_wraps_intercept);
    for (size_t i = 0; i < NCASES; i++)
        faults[n++] = (struct CMUnitTest){CASES[i].name, test_fault_case, NULL, NULL, (void *)&CASES[i]};
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_file);
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_dir);
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_mapped_file);
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_unsloth);
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_gpt2);
    faults[n++] = (struct CMUnitTest)cmocka_unit_test(test_alloc_sweep_inspect_json);
    for (size_t i = 0; i < NSIG_CASES; i++)
        faults[n++] = (struct CMUnitTest){SIG_CASES[i].name, test_signal_case, NULL, NULL, (void *)&SIG_CASES[i]};
    const struct CMUnitTest temps[] = {
        cmocka_unit_test(test_kohya_temp_has_no_name),
        cmocka_unit_test(test_kohya_temp_cannot_be_made),
        cmocka_unit_test(test_kohya_converted_once),
        cmocka_unit_test(test_config_read_once),
        cmocka_unit_test(test_kohya_temp_survives_sigkill),
    };
    const struct CMUnitTest signals[] = {
        cmocka_unit_test(test_sigterm_dir),
        cmocka_unit_test(test_sigint_dir),
        cmocka_unit_test(test_sigterm_file),
        cmocka_unit_test(test_sigint_file),
        cmocka_unit_test(test_other_fatal_signals),
        cmocka_unit_test(test_file_size_limit_is_a_write_error),
    };
    int failed = _cmocka_run_group_tests("faults", faults, n, group_setup, group_teardown);
    failed += cmocka_run_group_tests_name("kohya temp files", temps, NULL, NULL);
    failed += cmocka_run_group_tests_name("signals", signals, big_setup, big_teardown);
    return failed;
}
