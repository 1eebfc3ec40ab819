# The pipeline's GPU routing against a stand-in device (tests/unit/test_gpu_lanes.c),
# included by the Makefile: the gpu.h calls of libnf4deq.a's pipeline and GPU
# start, and the CPU kernel entry (to count where chunks went), are bound to the
# test's __wrap_ versions at static link time; __real_dequant_cpu_path stays the
# library's.
GPU_LANES_WRAPPED = gpu_device_count gpu_open gpu_close gpu_name gpu_exclusive gpu_use_lanes gpu_host_register \
                    gpu_host_unregister gpu_dequant_lane gpu_merge_lane dequant_cpu_path
TEST_WRAPS_test_gpu_lanes = $(foreach f,$(GPU_LANES_WRAPPED),-Wl,--wrap=$(f))
