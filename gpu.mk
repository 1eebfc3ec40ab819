# GPU tests and benchmark binaries, included by the Makefile. Not part of CI:
# `make check-gpu` needs a CUDA device.
#
#   make check-gpu        build/gpu/test_gpu (cubins sm_75..sm_90 + PTX), the same
#                         test from a build whose only device code is compute_75
#                         PTX (JIT-compiled by the driver: the T4 path on newer
#                         GPUs), and tests/scripts/check-gpu-fixtures.sh if present
#                         and the same test from an NF4DEQ_ASM=0 build (pure CUDA C,
#                         identical output)
#   make gpu-tests        just build them
#   make perf-tools       build/perf/launch_cost: host cost of a kernel launch by route;
#                         build/perf/cuda_teardown: what a process pays at exit for CUDA;
#                         build/perf/tmpfs_write: how fast each way of filling one
#                         output file is (write(2), threads through a mapping, the GPU)
#   make device-pack      the binaries a device-machine call runs, built for its one
#                         architecture (DEVICE_ARCH, default 90) and packed into
#                         .carry/bins.tar.xz (tests/gpu/device-pack.sh says why)
#   GPU_BIG=0             skip the > 2^31-element tensor (needs ~13 GB host memory)

GPU_BINS     = $(BUILD)/gpu/test_gpu $(BUILD)/gpu/nf4bench $(BUILD)/gpu/test_gpu_faults $(BUILD)/gpu/test_gpu_merge
GPU_WRAPS_test_gpu_faults = -Wl,--wrap=cudaMalloc -Wl,--wrap=cudaMemcpyAsync
PTX75_BUILD ?= build/ptx75
NOASM_BUILD ?= build/noasm
GPU_BIG     ?= 1

.PHONY: gpu-tests gpu-tests-ptx75 gpu-tests-noasm check-gpu perf-tools device-pack
DEVICE_ARCH ?= 90

$(BUILD)/gpu/%: tests/gpu/%.c tests/gpu/check.h tests/gpu/gpu_tensor.h $(BUILD)/libnf4deq.a $(wildcard include/*.h src/*.h)
	@mkdir -p $(@D)
	$(CC) $(NF4_CFLAGS) $(CJSON_CFLAGS) -I$(CUDA_HOME)/include $(CFLAGS) -o $@ $< $(BUILD)/libnf4deq.a $(LIBS) \
	    $(NF4_LDFLAGS) $(GPU_WRAPS_$*)

gpu-tests: $(GPU_BINS)

$(BUILD)/perf/launch_cost: tests/perf/launch_cost.cu $(BUILD)/libnf4deq.a
	@mkdir -p $(@D)
	$(NVCC) $(NF4_NVCCFLAGS) $(NVCCFLAGS) -o $@ $< $(BUILD)/libnf4deq.a $(CJSON_LIBS) -lpthread

$(BUILD)/perf/cuda_teardown: tests/perf/cuda_teardown.cu
	@mkdir -p $(@D)
	$(NVCC) $(NF4_NVCCFLAGS) $(NVCCFLAGS) -o $@ $< -lpthread

$(BUILD)/perf/tmpfs_write: tests/perf/tmpfs_write.cu
	@mkdir -p $(@D)
	$(NVCC) $(NF4_NVCCFLAGS) $(NVCCFLAGS) -o $@ $< -lpthread

perf-tools: $(BUILD)/perf/launch_cost $(BUILD)/perf/cuda_teardown $(BUILD)/perf/tmpfs_write

# Same sources, device code = compute_75 PTX only.
gpu-tests-ptx75:
	$(MAKE) --no-print-directory CUDA_ARCHS= CUDA_PTX_ARCH=75 BUILD=$(PTX75_BUILD) gpu-tests

# Same sources, no inline asm at all.
gpu-tests-noasm:
	$(MAKE) --no-print-directory NF4DEQ_ASM=0 BUILD=$(NOASM_BUILD) $(NOASM_BUILD)/gpu/test_gpu

check-gpu: gpu-tests gpu-tests-ptx75 gpu-tests-noasm
	@sh tests/gpu/run-checks.sh $(BUILD) $(PTX75_BUILD) $(GPU_BIG) $(NOASM_BUILD)

device-pack:
	@MAKE='$(MAKE)' sh tests/gpu/device-pack.sh $(DEVICE_ARCH)
