/* Splitting a range of work units over short-lived threads: the CPU kernels'
 * (dequantization, LoRA merge) one way of using --threads. */
#ifndef NF4DEQ_PARALLEL_H
#define NF4DEQ_PARALLEL_H

#include <stdint.h>

/* Runs fn(ctx, first, count) over [0, units) in up to `threads` contiguous
 * shares of whole units, one thread each, and returns when all are done. A
 * share is never smaller than min_units. A thread that cannot be started has
 * its share done on the calling thread: this cannot fail. */
void parallel_for(uint64_t units, int threads, uint64_t min_units, void (*fn)(void *ctx, uint64_t first, uint64_t count),
                  void *ctx);

#endif
