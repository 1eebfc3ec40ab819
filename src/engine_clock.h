/* Which engine a dequantization chunk goes to while the GPU is open.
 *
 * The pipeline times every dequantization chunk it converts while the GPU is
 * open, on either engine, from its compute to its output placed, per output
 * byte. A chunk is worth sending to the GPU only where the GPU does it as fast
 * as a core or faster. Into tmpfs, where both engines wait on the page cache,
 * the cores then did 475-512 of the 1.1B preset's 528 chunks, against 174-203
 * without the clocks (docs/PERFORMANCE.md, "What the GPU path pays for CUDA
 * into tmpfs"). Merges, NF4DEQ_GPU_ONLY and the scalar CPU kernel do not ask:
 * pipeline.c sends those to the GPU whatever the clocks say. */
#ifndef NF4DEQ_ENGINE_CLOCK_H
#define NF4DEQ_ENGINE_CLOCK_H

#include <stddef.h>
#include <stdint.h>

/* Chunks each engine must have been timed on before the two are compared. */
#define ENGINE_CLOCK_MIN_CHUNKS 4
/* Each new chunk's time moves an engine's average by 1/ENGINE_CLOCK_WEIGHT of
 * the difference: the last few dozen chunks count. */
#define ENGINE_CLOCK_WEIGHT 8
/* While the GPU is the slower engine, one chunk in this many still goes to it,
 * so that its clock follows a change (a faster stretch, a busier CPU). */
#define ENGINE_RETRY_EVERY 16

struct engine_clock {
    double ns_per_byte; /* moving average */
    uint64_t chunks;    /* timed so far */
};

struct engine_clocks {
    struct engine_clock gpu, cpu;
    uint64_t passed_over; /* chunks kept off the GPU as the slower engine */
};

/* Adds a chunk of `bytes` output bytes that took `ns` on the GPU or a core. */
void engine_clock_add(struct engine_clocks *c, int on_gpu, double ns, size_t bytes);

/* Whether the next chunk may go to the GPU: yes until the GPU has been timed
 * on ENGINE_CLOCK_MIN_CHUNKS chunks, then no until a core has been, then yes
 * where the GPU is as fast as a core or faster, and on one chunk in
 * ENGINE_RETRY_EVERY where it is not. Counts the chunks it keeps off the GPU
 * as the slower engine. */
int engine_gpu_worth_a_chunk(struct engine_clocks *c);

#endif
