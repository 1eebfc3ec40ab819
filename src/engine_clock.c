#include "engine_clock.h"

void engine_clock_add(struct engine_clocks *c, int on_gpu, double ns, size_t bytes)
{
    struct engine_clock *e = on_gpu ? &c->gpu : &c->cpu;
    if (bytes == 0 || !(ns >= 0))
        return;
    double sample = ns / (double)bytes;
    e->ns_per_byte = e->chunks == 0 ? sample : e->ns_per_byte + (sample - e->ns_per_byte) / ENGINE_CLOCK_WEIGHT;
    e->chunks++;
}

int engine_gpu_worth_a_chunk(struct engine_clocks *c)
{
    if (c->gpu.chunks < ENGINE_CLOCK_MIN_CHUNKS)
        return 1;
    /* A core gets its own chunks to time: with as many lanes as workers, none
     * would ever find every lane busy. */
    if (c->cpu.chunks < ENGINE_CLOCK_MIN_CHUNKS)
        return 0;
    if (c->gpu.ns_per_byte <= c->cpu.ns_per_byte)
        return 1;
    return ++c->passed_over % ENGINE_RETRY_EVERY == 0;
}
