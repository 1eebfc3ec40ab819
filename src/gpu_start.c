#include "gpu_start.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "exit_handoff.h"
#include "fileio.h"
#include "gpu.h"
#include "status.h"

struct gpu_start {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t mem_budget;
    enum gpu_start_state state;
    int code;
    struct nf4_error error; /* the failure, from the opening thread's error buffer */
    struct gpu_ctx *ctx;
    int found_device;
};

static void *start_main(void *arg)
{
    struct gpu_start *s = arg;
    struct gpu_ctx *ctx = NULL;
    int found = gpu_device_count() > 0;
    /* With no device, gpu_open still says why: no driver, or a build without CUDA. */
    int code = gpu_open(&ctx, 0, s->mem_budget);
    if (code == NF4_OK && !found) {
        gpu_close(ctx);
        ctx = NULL;
        code = nf4_fail(NF4_EUNAVAILABLE, NULL, NULL, "no CUDA device found");
    }
    if (code == NF4_OK && gpu_exclusive(ctx))
        handoff_forbid();
    pthread_mutex_lock(&s->mu);
    s->found_device = found;
    s->ctx = code == NF4_OK ? ctx : NULL;
    s->code = code;
    if (code != NF4_OK)
        nf4_error_save(&s->error);
    s->state = code == NF4_OK ? GPU_START_READY : GPU_START_FAILED;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int gpu_start_begin(struct gpu_start **out, uint64_t mem_budget)
{
    *out = NULL;
    struct gpu_start *s = calloc(1, sizeof *s);
    if (!s)
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "out of memory");
    s->mem_budget = mem_budget;
    s->state = GPU_START_PENDING;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (thread_create_blocking_signals(&s->thread, start_main, s) != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return nf4_fail(NF4_ESOFTWARE, NULL, NULL, "cannot start a thread to open the GPU");
    }
    *out = s;
    return NF4_OK;
}

static enum gpu_start_state report(struct gpu_start *s, int *code)
{
    enum gpu_start_state state = s->state;
    *code = NF4_OK;
    if (state == GPU_START_FAILED)
        *code = nf4_error_restore(s->code, &s->error);
    return state;
}

enum gpu_start_state gpu_start_poll(struct gpu_start *s, int *code)
{
    pthread_mutex_lock(&s->mu);
    enum gpu_start_state state = report(s, code);
    pthread_mutex_unlock(&s->mu);
    return state;
}

enum gpu_start_state gpu_start_wait(struct gpu_start *s, int *code)
{
    pthread_mutex_lock(&s->mu);
    while (s->state == GPU_START_PENDING)
        pthread_cond_wait(&s->cv, &s->mu);
    enum gpu_start_state state = report(s, code);
    pthread_mutex_unlock(&s->mu);
    return state;
}

int gpu_start_found_device(const struct gpu_start *s)
{
    return s->found_device;
}

struct gpu_ctx *gpu_start_ctx(const struct gpu_start *s)
{
    return s->ctx;
}

void gpu_start_free(struct gpu_start *s)
{
    if (!s)
        return;
    pthread_join(s->thread, NULL);
    /* The driver frees the device's memory with the device files, in the
     * hand-off's child (exit_handoff.h), when this process is about to exit. */
    if (!handoff_at_exit())
        gpu_close(s->ctx);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
