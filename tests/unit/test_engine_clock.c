/* The engine clocks (src/engine_clock.h): which engine a dequantization chunk
 * goes to while the GPU is open, from the times of the chunks before it. The
 * pipeline's side, with a stand-in device, is tests/unit/test_gpu_lanes.c. */
#include "engine_clock.h"
#include "test_util.h"

#define CHUNK_BYTES 4194304u

/* Adds `n` chunks of CHUNK_BYTES that took `ms` each on one engine. */
static void add(struct engine_clocks *c, int on_gpu, int n, double ms)
{
    for (int i = 0; i < n; i++)
        engine_clock_add(c, on_gpu, ms * 1e6, CHUNK_BYTES);
}

/* How many of the next `n` chunks it would send to the GPU. */
static int sent_of(struct engine_clocks *c, int n)
{
    int sent = 0;
    for (int i = 0; i < n; i++)
        sent += engine_gpu_worth_a_chunk(c);
    return sent;
}

static void test_untimed_engines_take_turns(void **state)
{
    (void)state;
    struct engine_clocks c = {0};
    /* The GPU first, until it has been timed... */
    assert_int_equal(sent_of(&c, 100), 100);
    add(&c, 1, ENGINE_CLOCK_MIN_CHUNKS - 1, 1.0);
    assert_int_equal(sent_of(&c, 10), 10);
    /* ...then a core, even where the GPU is the faster (with a lane for every
     * worker, no core would find every lane busy and be timed)... */
    add(&c, 1, 1, 1.0);
    assert_int_equal(sent_of(&c, 10), 0);
    add(&c, 0, ENGINE_CLOCK_MIN_CHUNKS - 1, 100.0);
    assert_int_equal(sent_of(&c, 10), 0);
    /* ...then the faster. */
    add(&c, 0, 1, 100.0);
    assert_int_equal(sent_of(&c, 100), 100);
    assert_int_equal(c.passed_over, 0);
}

static void test_a_faster_gpu_takes_every_chunk(void **state)
{
    (void)state;
    struct engine_clocks c = {0};
    add(&c, 1, 10, 2.0);
    add(&c, 0, 10, 3.0);
    assert_int_equal(sent_of(&c, 1000), 1000);
    /* As fast: the GPU too (the user asked for it). */
    struct engine_clocks tie = {0};
    add(&tie, 1, 10, 3.0);
    add(&tie, 0, 10, 3.0);
    assert_int_equal(sent_of(&tie, 100), 100);
}

static void test_a_slower_gpu_gets_one_chunk_in_retry_every(void **state)
{
    (void)state;
    struct engine_clocks c = {0};
    add(&c, 1, 10, 8.4);
    add(&c, 0, 10, 8.0);
    assert_int_equal(sent_of(&c, 64 * ENGINE_RETRY_EVERY), 64);
    assert_int_equal(c.passed_over, 64 * ENGINE_RETRY_EVERY);
}

static void test_the_clocks_follow_a_change(void **state)
{
    (void)state;
    struct engine_clocks c = {0};
    add(&c, 1, 10, 9.0);
    add(&c, 0, 10, 8.0);
    assert_int_equal(sent_of(&c, ENGINE_RETRY_EVERY), 1);
    /* The GPU's chunks get faster: a few retried chunks bring it back. */
    add(&c, 1, 6, 4.0);
    assert_int_equal(sent_of(&c, 100), 100);
    /* Then the CPU's do: the average of the last chunks, not of all of them. */
    add(&c, 0, 30, 1.0);
    assert_int_equal(sent_of(&c, ENGINE_RETRY_EVERY), 1);
}

static void test_empty_and_odd_samples_are_ignored(void **state)
{
    (void)state;
    struct engine_clocks c = {0};
    engine_clock_add(&c, 1, 5e6, 0);     /* no output bytes */
    engine_clock_add(&c, 0, -1.0, 4096); /* a clock that went backwards */
    engine_clock_add(&c, 0, 0.0 / 0.0, 4096);
    assert_int_equal(c.gpu.chunks, 0);
    assert_int_equal(c.cpu.chunks, 0);
    add(&c, 1, 4, 2.0);
    add(&c, 0, 4, 1.0);
    assert_true(c.gpu.ns_per_byte > c.cpu.ns_per_byte);
    assert_int_equal(sent_of(&c, ENGINE_RETRY_EVERY), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_untimed_engines_take_turns),
        cmocka_unit_test(test_a_faster_gpu_takes_every_chunk),
        cmocka_unit_test(test_a_slower_gpu_gets_one_chunk_in_retry_every),
        cmocka_unit_test(test_the_clocks_follow_a_change),
        cmocka_unit_test(test_empty_and_odd_samples_are_ignored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
