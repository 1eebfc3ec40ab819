# Fault injection (tests/unit/test_faults.c), included by the Makefile.
# Every function the test intercepts is bound to its __wrap_ version at static
# link time, for the test's own objects and for libnf4deq.a's alike; the real
# function stays reachable as __real_NAME. (Calls made inside shared libraries,
# libc's own and cJSON's, are not affected: cJSON is hooked with cJSON_InitHooks.)
FAULT_WRAPPED = write pread read fsync close rename renameat2 mkostemp mkdtemp \
                malloc calloc realloc strdup strndup asprintf fallocate mmap open
TEST_WRAPS_test_faults = $(foreach f,$(FAULT_WRAPPED),-Wl,--wrap=$(f))

# The signal tests convert a synthetic model made by gen_bnb4 with the build's nf4deq.
$(BUILD)/tests/test_faults: $(BUILD)/tools/gen_bnb4
