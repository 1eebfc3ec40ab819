#include "parallel.h"

#include <pthread.h>
#include <stdlib.h>

struct share {
    void (*fn)(void *ctx, uint64_t first, uint64_t count);
    void *ctx;
    uint64_t first, count;
};

static void *share_main(void *arg)
{
    const struct share *s = arg;
    s->fn(s->ctx, s->first, s->count);
    return NULL;
}

void parallel_for(uint64_t units, int threads, uint64_t min_units, void (*fn)(void *ctx, uint64_t first, uint64_t count),
                  void *ctx)
{
    uint64_t max_threads = min_units ? units / min_units : units;
    if (threads < 1)
        threads = 1;
    if ((uint64_t)threads > max_threads)
        threads = max_threads > 1 ? (int)max_threads : 1;
    pthread_t *tids = threads > 1 ? calloc((size_t)threads, sizeof *tids) : NULL;
    struct share *shares = threads > 1 ? calloc((size_t)threads, sizeof *shares) : NULL;
    if (!tids || !shares) {
        free(tids);
        free(shares);
        if (units)
            fn(ctx, 0, units);
        return;
    }
    uint64_t per = (units + (uint64_t)threads - 1) / (uint64_t)threads;
    int started = 0;
    for (int i = 0; i < threads; i++) {
        uint64_t first = (uint64_t)i * per;
        if (first >= units)
            break;
        shares[i] = (struct share){fn, ctx, first, units - first < per ? units - first : per};
        if (pthread_create(&tids[i], NULL, share_main, &shares[i]) != 0) {
            /* Out of threads: do this share here rather than fail. */
            fn(ctx, shares[i].first, shares[i].count);
            shares[i].count = 0;
        }
        started = i + 1;
    }
    for (int i = 0; i < started; i++)
        if (shares[i].count)
            pthread_join(tids[i], NULL);
    free(tids);
    free(shares);
}
