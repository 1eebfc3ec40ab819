/* Fault injection on the GPU path: cudaMalloc and cudaMemcpyAsync fail (through
 * -Wl,--wrap) during a conversion. Each case must give its documented exit
 * code and a one-line message, leave no output and no temp file, and leave the
 * input untouched; with --device auto, a GPU that cannot be opened means a
 * correct conversion on the CPU. Plain C (the device machine has no CMocka):
 * prints "N passed, N failed".
 *
 *   test_gpu_faults    run from the repository root, on a machine with a GPU */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>

#include "convert.h"
#include "file_copy.h"
#include "gpu.h"
#include "model_dir.h"
#include "status.h"

#define INPUT "tests/fixtures/tensors.bnb4.safetensors"
#define INPUT_DIR "tests/fixtures/tiny-llama-bf16-bnb4-sharded"

#include "check.h"

/* Which call fails: the Nth (1-based) call of `fail_fn` after arming; 0: none.
 * The GPU is opened on a thread of its own: the count is atomic. */
enum { FN_NONE, FN_MALLOC, FN_MEMCPY };
static int fail_fn, fail_at, calls;

cudaError_t __real_cudaMalloc(void **p, size_t n);
cudaError_t __real_cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k, cudaStream_t s);

cudaError_t __wrap_cudaMalloc(void **p, size_t n)
{
    if (fail_fn == FN_MALLOC && __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST) == fail_at)
        return cudaErrorMemoryAllocation;
    return __real_cudaMalloc(p, n);
}

cudaError_t __wrap_cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k, cudaStream_t s)
{
    if (fail_fn == FN_MEMCPY && __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST) == fail_at)
        return cudaErrorLaunchFailure;
    return __real_cudaMemcpyAsync(dst, src, n, k, s);
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d)
        closedir(d);
    return n;
}

static int run(const char *in, const char *out, enum device_choice device, int fn, int at)
{
    struct convert_opts o;
    convert_opts_init(&o);
    o.device = device;
    o.dtype = DT_BF16;
    o.progress = PROGRESS_NONE;
    /* One worker: chunks reach the device in order, so a clean run makes the
     * same calls every time (with several, which chunk first grows a lane's
     * buffers varies). check-gpu-fixtures.sh covers several lanes. */
    o.threads = 1;
    struct convert_stats st;
    nf4_clear_error();
    nf4_set_quiet(1);
    fail_fn = fn;
    fail_at = at;
    calls = 0;
    int rc = convert_run(in, out, &o, &st);
    fail_fn = FN_NONE;
    return rc;
}

int main(void)
{
    if (gpu_device_count() == 0) {
        printf("no CUDA device: nothing to test\n0 passed, 0 failed\n");
        return 0;
    }
    /* Every chunk through the GPU, none on the CPU while it opens: a clean run
     * then makes the same calls every time, and each one can be failed. */
    setenv("NF4DEQ_GPU_ONLY", "1", 1);
    /* Count the calls a clean conversion makes, then fail each one in turn. */
    static const struct {
        const char *in, *label;
    } INPUTS[] = {{INPUT, "file"}, {INPUT_DIR, "directory"}};
    for (size_t i = 0; i < 2; i++) {
        char dir[] = "/tmp/nf4deq-gpufault-XXXXXX";
        char out[256];
        if (!mkdtemp(dir))
            return 1;
        snprintf(out, sizeof out, "%s/out", dir);
        int total[3] = {0};
        for (int fn = FN_MALLOC; fn <= FN_MEMCPY; fn++) {
            remove_tree(dir);
            if (!mkdtemp(strcpy(dir, "/tmp/nf4deq-gpufault-XXXXXX")))
                return 1;
            snprintf(out, sizeof out, "%s/out", dir);
            int rc = run(INPUTS[i].in, out, DEVICE_CUDA, fn, -1);
            total[fn] = calls;
            CHECK(rc == 0, "%s: clean run failed: %s", INPUTS[i].label, nf4_last_error());
        }
        remove_tree(dir);
        printf("%s: %d cudaMalloc and %d cudaMemcpyAsync calls in a clean conversion\n", INPUTS[i].label,
               total[FN_MALLOC], total[FN_MEMCPY]);
        CHECK(total[FN_MALLOC] > 0 && total[FN_MEMCPY] > 0, "%s: the wraps saw no calls", INPUTS[i].label);
        for (int fn = FN_MALLOC; fn <= FN_MEMCPY; fn++)
            for (int at = 1; at <= total[fn]; at++) {
                char label[96];
                snprintf(label, sizeof label, "%s: %s #%d fails", INPUTS[i].label,
                         fn == FN_MALLOC ? "cudaMalloc" : "cudaMemcpyAsync", at);
                /* A device that cannot be set up is "GPU unavailable" (69) or a CUDA
                 * error (70); a failing copy mid-conversion is a CUDA error (70). */
                char dir2[] = "/tmp/nf4deq-gpufault-XXXXXX";
                if (!mkdtemp(dir2))
                    return 1;
                char out2[256];
                snprintf(out2, sizeof out2, "%s/out", dir2);
                int rc = run(INPUTS[i].in, out2, DEVICE_CUDA, fn, at);
                CHECK(rc == NF4_ESOFTWARE || rc == NF4_EUNAVAILABLE, "%s: exit %d (%s)", label, rc,
                      nf4_last_error());
                CHECK(strchr(nf4_last_error(), '\n') == NULL, "%s: message is more than one line", label);
                CHECK(count_entries(dir2) == 0, "%s: output or temp file left", label);
                remove_tree(dir2);
            }
    }
    /* With --device auto a GPU that cannot be opened is not an error: the CPU converts. */
    char dir[] = "/tmp/nf4deq-gpufault-XXXXXX";
    if (!mkdtemp(dir))
        return 1;
    char out[256];
    snprintf(out, sizeof out, "%s/out.safetensors", dir);
    /* (auto opens the GPU for a plain conversion only without a vector kernel.) */
    setenv("NF4DEQ_CPU", "scalar", 1);
    int rc = run(INPUT, out, DEVICE_AUTO, FN_MALLOC, 1);
    unsetenv("NF4DEQ_CPU");
    CHECK(rc == 0, "auto with a failing cudaMalloc: exit %d (%s)", rc, nf4_last_error());
    CHECK(count_entries(dir) == 1, "auto: expected exactly the output");
    remove_tree(dir);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
