/* How the pipeline routes chunks between the GPU's lanes and the CPU's cores,
 * checked on a machine without a GPU. The gpu.h calls the pipeline and
 * gpu_start.c make are bound to a stand-in device with the linker's --wrap
 * (tests/gpu_lanes.mk): it opens at once, and each lane computes its chunk
 * with the CPU kernel (the same bytes) while holding the lane for
 * FAKE_LANE_MICROS, as a real round trip through the device does. Eight
 * workers on four lanes then find every lane busy, and:
 *   - by default such a worker dequantizes its chunk on its own core
 *     (pipeline.c take_lane); there the stand-in's cores take twice as long
 *     as its lanes, so that the engine clocks (engine_clock.h, tested in
 *     test_engine_clock.c) keep sending chunks to the lanes all along;
 *   - under NF4DEQ_GPU_ONLY=1 it waits, and the device computes every chunk;
 *   - with the scalar CPU kernel (NF4DEQ_CPU=scalar) it waits too.
 * Either way the output is the bytes bitsandbytes wrote, and no lane ever
 * carries two chunks at once. Into a mapped output the slots are page-locked
 * only where the GPU carries the chunks (the last two cases). Once the process expects to hand its device
 * files to a child at exit (main() calls handoff_expect), the pinned slots and
 * the device stay as they are for the driver to free there, and the slots are
 * kept out of the child's fork. A stand-in in an exclusive compute mode must
 * keep the CUDA teardown in the process (exit_handoff.h). The real device's side of this is
 * tests/scripts/check-gpu-fixtures.sh and tests/perf/tmpfs-bench.sh. */
#include "test_util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "convert.h"
#include "dequant.h"
#include "exit_handoff.h"
#include "gpu.h"

#define FAKE_LANES 4
#define FAKE_LANE_MICROS 20000
#define WORKERS 8

static struct {
    atomic_int lanes_in_use;  /* lanes set by gpu_use_lanes */
    atomic_int busy[FAKE_LANES]; /* chunks on each lane now: never above 1 */
    atomic_int busy_lanes;    /* lanes with a chunk on them now */
    atomic_long lane_chunks;  /* chunks the stand-in device computed */
    atomic_long cpu_chunks;   /* chunks dequantized on a core */
    atomic_long cpu_while_busy; /* ... that began while every lane was busy, after a
                                 * lane's first round trip: a worker that took its
                                 * chunk before the lanes opened, slowed down (a
                                 * loaded machine, sanitizers), could otherwise
                                 * begin it just as all four fill up */
    atomic_int overlap;       /* a lane carried two chunks at once */
    atomic_int registered;    /* slots page-locked and not yet released */
    atomic_int closes;        /* gpu_close calls */
    void *pinned[64];         /* the slots page-locked, in order */
    atomic_int npinned;
} fake;

/* How long a chunk on a stand-in core takes, besides its compute: set by a test. */
static long fake_cpu_micros;

/* The stand-in's compute mode: set by a test before it converts. */
static int fake_exclusive;

/* Any non-NULL pointer stands for the opened device: the pipeline only hands it back. */
static int fake_device;

void __real_dequant_cpu_path(const struct dequant_job *job, int threads, enum cpu_path path);

int __wrap_gpu_device_count(void)
{
    return 1;
}

int __wrap_gpu_open(struct gpu_ctx **out, int device, uint64_t mem_budget)
{
    (void)device;
    (void)mem_budget;
    *out = (struct gpu_ctx *)&fake_device;
    return NF4_OK;
}

void __wrap_gpu_close(struct gpu_ctx *ctx)
{
    if (ctx)
        atomic_fetch_add(&fake.closes, 1);
}

int __wrap_gpu_exclusive(const struct gpu_ctx *ctx)
{
    assert_ptr_equal(ctx, &fake_device);
    return fake_exclusive;
}

const char *__wrap_gpu_name(const struct gpu_ctx *ctx)
{
    (void)ctx;
    return "stand-in GPU";
}

int __wrap_gpu_use_lanes(struct gpu_ctx *ctx, int lanes)
{
    (void)ctx;
    if (lanes > FAKE_LANES)
        lanes = FAKE_LANES;
    atomic_store(&fake.lanes_in_use, lanes);
    return lanes;
}

int __wrap_gpu_host_register(struct gpu_ctx *ctx, void *p, size_t bytes)
{
    (void)ctx;
    (void)bytes;
    atomic_fetch_add(&fake.registered, 1);
    int i = atomic_fetch_add(&fake.npinned, 1);
    assert_true(i < (int)(sizeof fake.pinned / sizeof fake.pinned[0]));
    fake.pinned[i] = p;
    return 0;
}

void __wrap_gpu_host_unregister(struct gpu_ctx *ctx, void *p)
{
    (void)ctx;
    (void)p;
    atomic_fetch_sub(&fake.registered, 1);
}

int __wrap_gpu_dequant_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *job)
{
    assert_ptr_equal(ctx, &fake_device);
    int lanes = atomic_load(&fake.lanes_in_use);
    assert_true(lanes > 0);
    int l = lane % lanes;
    if (atomic_fetch_add(&fake.busy[l], 1) != 0)
        atomic_store(&fake.overlap, 1);
    atomic_fetch_add(&fake.busy_lanes, 1);
    __real_dequant_cpu_path(job, 1, CPU_PATH_SCALAR);
    struct timespec hold = {0, FAKE_LANE_MICROS * 1000L};
    nanosleep(&hold, NULL);
    atomic_fetch_sub(&fake.busy_lanes, 1);
    atomic_fetch_sub(&fake.busy[l], 1);
    atomic_fetch_add(&fake.lane_chunks, 1);
    return NF4_OK;
}

int __wrap_gpu_merge_lane(struct gpu_ctx *ctx, int lane, const struct dequant_job *dq, const struct merge_job *mj,
                          uint64_t *overflowed)
{
    (void)ctx;
    (void)lane;
    (void)dq;
    (void)mj;
    (void)overflowed;
    fail_msg("a plain conversion merged through the GPU");
    return NF4_ESOFTWARE;
}

void __wrap_dequant_cpu_path(const struct dequant_job *job, int threads, enum cpu_path path)
{
    int lanes = atomic_load(&fake.lanes_in_use);
    if (lanes > 0 && atomic_load(&fake.busy_lanes) == lanes && atomic_load(&fake.lane_chunks) > 0)
        atomic_fetch_add(&fake.cpu_while_busy, 1);
    atomic_fetch_add(&fake.cpu_chunks, 1);
    __real_dequant_cpu_path(job, threads, path);
    if (fake_cpu_micros > 0) {
        struct timespec hold = {fake_cpu_micros / 1000000, fake_cpu_micros % 1000000 * 1000L};
        nanosleep(&hold, NULL);
    }
}

static void fake_reset(void)
{
    memset(&fake, 0, sizeof fake);
}

/* Whether the mapping that holds `addr` has the VmFlags mnemonic `flag` in
 * /proc/self/smaps ("dc": not copied into a child on fork). */
static int vma_has_flag(const void *addr, const char *flag)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    assert_non_null(f);
    char line[512], want[8];
    snprintf(want, sizeof want, " %s", flag);
    int in_vma = 0, found = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in_vma = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
        } else if (in_vma && strncmp(line, "VmFlags:", 8) == 0) {
            line[strcspn(line, "\n")] = ' ';
            found = strstr(line, want) != NULL;
            break;
        }
    }
    fclose(f);
    return found;
}

/* Converts the tiny Llama fixture on the stand-in device in its smallest chunks
 * (one nested block, 16384 elements: about 30 chunks) with WORKERS workers,
 * and checks the bytes. Every pinned slot and the device are released unless
 * the process is to hand them to a child at exit. */
static void convert_on_fake_gpu(const char *dir, struct convert_stats *st)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = DEVICE_CUDA;
    o.dtype = DT_BF16;
    o.threads = WORKERS;
    o.chunk_elements = 1;
    o.progress = PROGRESS_NONE;
    static int runs; /* a new output each time: convert_run never replaces one without --force */
    char *out = tu_strdupf("%s/out%d", dir, runs++);
    nf4_set_quiet(1);
    fake_reset();
    assert_int_equal(convert_run(FIXTURES "/tiny-llama-fp16-bnb4", out, &o, st), NF4_OK);
    char *got = tu_strdupf("%s/model.safetensors", out);
    tu_assert_same_tensors(got, FIXTURES "/tiny-llama-fp16-bnb4.expected-bf16.safetensors");
    assert_int_equal(atomic_load(&fake.overlap), 0);
    assert_int_equal(atomic_load(&fake.lanes_in_use), FAKE_LANES);
    /* Into a mapped output, slots are page-locked only where the GPU carries
     * the chunks (pipeline.c pin_slots): under NF4DEQ_GPU_ONLY, with the scalar
     * kernel. main() sets NF4DEQ_OUTPUT_MAP, so that it is known here. */
    const char *only = getenv("NF4DEQ_GPU_ONLY"), *cpu = getenv("NF4DEQ_CPU"), *map = getenv("NF4DEQ_OUTPUT_MAP");
    int carries = (only && strcmp(only, "1") == 0) || (cpu && strcmp(cpu, "scalar") == 0);
    if (carries || strcmp(map, "1") != 0)
        assert_true(atomic_load(&fake.npinned) > 0);
    else
        assert_int_equal(atomic_load(&fake.npinned), 0);
    if (!handoff_at_exit()) {
        assert_int_equal(atomic_load(&fake.registered), 0); /* every pinned slot released */
        assert_int_equal(atomic_load(&fake.closes), 1);
    }
    free(got);
    free(out);
}

static void test_busy_lanes_leave_chunks_to_the_cpu(void **state)
{
    struct tu_scratch *s = *state;
    unsetenv("NF4DEQ_GPU_ONLY");
    unsetenv("NF4DEQ_GPU_HANDOFF");
    struct convert_stats st;
    setenv("NF4DEQ_OUTPUT_MAP", "1", 1); /* the slots stay pageable */
    convert_on_fake_gpu(s->dir, &st);
    setenv("NF4DEQ_OUTPUT_MAP", "0", 1); /* write(2): they are page-locked */
    fake_cpu_micros = 2 * FAKE_LANE_MICROS; /* the GPU is the faster engine */
    convert_on_fake_gpu(s->dir, &st);
    fake_cpu_micros = 0;
    assert_true(handoff_wanted()); /* a device in the default mode leaves it on */
    long on_lanes = atomic_load(&fake.lane_chunks), on_cpu = atomic_load(&fake.cpu_chunks);
    print_message("lanes %ld, cores %ld (%ld while every lane was busy)\n", on_lanes, on_cpu,
                  atomic_load(&fake.cpu_while_busy));
    assert_true(on_lanes > 0);
    /* A worker that waited for a lane would never dequantize on its core while all were busy. */
    assert_true(atomic_load(&fake.cpu_while_busy) > 0);
    char want[64];
    snprintf(want, sizeof want, "; the CPU (%d threads, ", WORKERS);
    if (!strstr(st.engine, "stand-in GPU") || !strstr(st.engine, want))
        fail_msg("engine line: %s", st.engine);
}

static void test_gpu_only_waits_for_a_lane(void **state)
{
    struct tu_scratch *s = *state;
    setenv("NF4DEQ_GPU_ONLY", "1", 1);
    struct convert_stats st;
    convert_on_fake_gpu(s->dir, &st);
    unsetenv("NF4DEQ_GPU_ONLY");
    assert_true(atomic_load(&fake.lane_chunks) > 0);
    assert_int_equal(atomic_load(&fake.cpu_chunks), 0);
    assert_string_equal(st.engine, "stand-in GPU");
}

static void test_scalar_kernel_waits_for_a_lane(void **state)
{
    struct tu_scratch *s = *state;
    unsetenv("NF4DEQ_GPU_ONLY");
    setenv("NF4DEQ_CPU", "scalar", 1);
    struct convert_stats st;
    convert_on_fake_gpu(s->dir, &st);
    unsetenv("NF4DEQ_CPU");
    assert_true(atomic_load(&fake.lane_chunks) > 0);
    assert_int_equal(atomic_load(&fake.cpu_while_busy), 0);
}

/* After handoff_expect, as in the command-line tool: the slots stay pinned and
 * the device open (the driver frees both in the hand-off's child), and a fork
 * would not copy the slots. Runs after the tests that expect every release. */
static void test_handoff_leaves_the_gpu_to_the_child(void **state)
{
    struct tu_scratch *s = *state;
    setenv("NF4DEQ_GPU_ONLY", "1", 1); /* so that the slots are page-locked */
    unsetenv("NF4DEQ_GPU_HANDOFF");
    assert_false(handoff_at_exit()); /* library callers free everything */
    handoff_expect();
    assert_true(handoff_at_exit());
    struct convert_stats st;
    convert_on_fake_gpu(s->dir, &st);
    int pinned = atomic_load(&fake.npinned);
    assert_int_equal(atomic_load(&fake.registered), pinned);
    assert_int_equal(atomic_load(&fake.closes), 0);
    for (int i = 0; i < pinned; i++)
        if (!vma_has_flag(fake.pinned[i], "dc"))
            fail_msg("pinned slot %d would be copied into the hand-off's child", i);
    /* NF4DEQ_GPU_HANDOFF=0: no hand-off, so everything is released again. */
    setenv("NF4DEQ_GPU_HANDOFF", "0", 1);
    assert_false(handoff_at_exit());
    convert_on_fake_gpu(s->dir, &st);
    unsetenv("NF4DEQ_GPU_HANDOFF");
    unsetenv("NF4DEQ_GPU_ONLY");
}

/* Runs last: the refusal lasts for the rest of the process. */
static void test_exclusive_device_keeps_the_teardown(void **state)
{
    struct tu_scratch *s = *state;
    unsetenv("NF4DEQ_GPU_HANDOFF");
    assert_true(handoff_wanted());
    fake_exclusive = 1;
    struct convert_stats st;
    convert_on_fake_gpu(s->dir, &st);
    fake_exclusive = 0;
    assert_false(handoff_wanted());
    assert_false(handoff_at_exit()); /* so the slots and the device were released */
}

int main(void)
{
    setenv("NF4DEQ_OUTPUT_MAP", "0", 1); /* whatever file system the scratch directory is on */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_busy_lanes_leave_chunks_to_the_cpu, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_gpu_only_waits_for_a_lane, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_scalar_kernel_waits_for_a_lane, tu_scratch_setup, tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_handoff_leaves_the_gpu_to_the_child, tu_scratch_setup,
                                        tu_scratch_teardown),
        cmocka_unit_test_setup_teardown(test_exclusive_device_keeps_the_teardown, tu_scratch_setup,
                                        tu_scratch_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
