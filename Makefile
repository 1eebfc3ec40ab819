# nf4deq build. `make` builds build/nf4deq; `make check` runs every CPU test;
# `make check-gpu` runs the GPU tests (needs a CUDA device); `make demo` converts
# the sample model. Missing Debian packages are installed first (see `deps`).

PREFIX  ?= /usr/local
DESTDIR ?=
SANITIZE ?= 0
# A sanitized build lives apart, so its objects never mix with a plain build's.
ifeq ($(SANITIZE),1)
BUILD   ?= build/sanitize
else
BUILD   ?= build
endif

CC      ?= cc
CFLAGS  ?= -O2 -g
# -ffp-contract=off: bitsandbytes rounds after every multiply and add; a fused
# multiply-add would change the low bits of the result.
NF4_CFLAGS = -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wstrict-prototypes \
             -ffp-contract=off -fno-fast-math -Iinclude -Isrc -pthread -fPIC
ifeq ($(SANITIZE),1)
NF4_CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
NF4_LDFLAGS += -fsanitize=address,undefined
endif

PKG_CONFIG ?= pkg-config
CJSON_CFLAGS  = $(shell $(PKG_CONFIG) --cflags libcjson 2>/dev/null)
CJSON_LIBS    = $(shell $(PKG_CONFIG) --libs libcjson 2>/dev/null)
CMOCKA_CFLAGS = $(shell $(PKG_CONFIG) --cflags cmocka 2>/dev/null)
CMOCKA_LIBS   = $(shell $(PKG_CONFIG) --libs cmocka 2>/dev/null)

VERSION := $(shell cat VERSION 2>/dev/null || echo 0.0.0)
NF4_CFLAGS += -DNF4DEQ_VERSION='"$(VERSION)"'

# ---- CUDA -------------------------------------------------------------------
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
NF4DEQ_CUDA ?= $(if $(NVCC),1,0)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# Cubins for Turing (T4) through Hopper, plus PTX of the newest for later GPUs.
CUDA_ARCHS ?= 75 80 86 89 90
CUDA_PTX_ARCH ?= 90
NVCC_GENCODE ?= $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                -gencode arch=compute_$(CUDA_PTX_ARCH),code=compute_$(CUDA_PTX_ARCH)
NF4DEQ_ASM ?= 1
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo
NF4_NVCCFLAGS = $(NVCC_GENCODE) -Iinclude -Isrc -DNF4DEQ_ASM=$(NF4DEQ_ASM) -Xcompiler -fPIC,-Wall
ifeq ($(NF4DEQ_CUDA),1)
CUDA_SRCS = $(wildcard cuda/*.cu)
CUDA_OBJS = $(CUDA_SRCS:cuda/%.cu=$(BUILD)/cuda/%.o)
CUDA_LIBS = -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
EXCLUDE_SRCS = src/gpu_none.c
SO_GPU_OBJS = $(BUILD)/cuda/dequant_launch.o $(BUILD)/cuda/api.o
else
CUDA_OBJS =
CUDA_LIBS =
EXCLUDE_SRCS =
SO_GPU_OBJS = $(BUILD)/obj/gpu_none.o
endif
# -----------------------------------------------------------------------------

LIB_SRCS = $(filter-out src/main.c $(EXCLUDE_SRCS),$(wildcard src/*.c))
LIB_OBJS = $(LIB_SRCS:src/%.c=$(BUILD)/obj/%.o)
LIBS     = $(CJSON_LIBS) $(CUDA_LIBS) -lm -pthread
# libnf4deq.so: the public ABI (include/nf4deq.h) and what it needs, no more;
# the CLI links the same objects from libnf4deq.a.
SO_OBJS  = $(BUILD)/obj/api.o $(BUILD)/obj/dequant_cpu.o $(BUILD)/obj/dequant_x86.o $(BUILD)/obj/dequant_neon.o $(BUILD)/obj/cpu_path.o $(BUILD)/obj/parallel.o $(BUILD)/obj/status.o $(BUILD)/obj/dtype.o $(SO_GPU_OBJS)
SO_NAME  = libnf4deq.so.0

TEST_SRCS = $(wildcard tests/unit/test_*.c)
TEST_BINS = $(TEST_SRCS:tests/unit/%.c=$(BUILD)/tests/%)
TOOL_SRCS = $(wildcard tests/tools/*.c)
TOOL_BINS = $(TOOL_SRCS:tests/tools/%.c=$(BUILD)/tools/%)

PYTHON ?= python3
VENV    = $(BUILD)/venv

.PHONY: all deps test-deps check check-unit check-cli check-python check-gpu demo install uninstall clean tools python-ext

# The Python package's eager-call extension (bindings/python/nf4deq/_launch.c),
# built beside libnf4deq.so when pkg-config finds the Python headers; without it
# the package calls through ctypes.
PY_EXT_CFLAGS := $(shell pkg-config --cflags python3 2>/dev/null)
PY_HAVE_HEADERS := $(shell pkg-config --exists python3 2>/dev/null && echo yes)
PY_EXT = $(BUILD)/_nf4deq_launch.abi3.so

all: $(BUILD)/nf4deq $(BUILD)/libnf4deq.so $(if $(PY_HAVE_HEADERS),$(PY_EXT))

$(PY_EXT): bindings/python/nf4deq/_launch.c
	@mkdir -p $(@D)
	$(CC) -shared -fPIC -O2 -Wall -Wextra $(PY_EXT_CFLAGS) $(CFLAGS) -o $@ $<

# After test-deps installed python3-dev on a fresh machine: a new make reads
# pkg-config again.
python-ext:
	@if pkg-config --exists python3; then $(MAKE) --no-print-directory $(PY_EXT); \
	 else echo "nf4deq: no Python headers (python3-dev): the Python package will use ctypes"; fi

# Installs what the build needs when it is missing: as root through apt-get,
# otherwise by printing the exact command and stopping.
deps:
	@sh tests/scripts/ensure-deps.sh build

# What the tests need (CMocka, python3 with venv), before any test compiles.
test-deps: deps
	@sh tests/scripts/ensure-deps.sh test

$(BUILD)/obj/%.o: src/%.c $(wildcard include/*.h src/*.h) | deps
	@mkdir -p $(@D)
	$(CC) $(NF4_CFLAGS) $(CJSON_CFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/cuda/%.o: cuda/%.cu $(wildcard include/*.h src/*.h cuda/*.cuh)
	@mkdir -p $(@D)
	$(NVCC) $(NF4_NVCCFLAGS) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/libnf4deq.a: $(LIB_OBJS) $(CUDA_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libnf4deq.so: $(SO_OBJS) src/libnf4deq.map
	$(CC) -shared -Wl,-soname,$(SO_NAME) -Wl,--version-script=src/libnf4deq.map -Wl,--no-undefined \
	    $(NF4_LDFLAGS) $(LDFLAGS) -o $@ $(SO_OBJS) $(CUDA_LIBS) -lm -pthread

$(BUILD)/nf4deq.pc: Makefile
	@mkdir -p $(@D)
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: nf4deq\nDescription: bitsandbytes 4-bit dequantization, bit-identical, CPU and CUDA\nVersion: %s\nLibs: -L$${libdir} -lnf4deq\nCflags: -I$${includedir}\n' \
	    '$(PREFIX)' '$(VERSION)' > $@

$(BUILD)/nf4deq: $(BUILD)/obj/main.o $(BUILD)/libnf4deq.a
	$(CC) $(NF4_LDFLAGS) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/tests/%: tests/unit/%.c tests/unit/test_util.h tests/unit/cpu_sweep.h tests/unit/fixture_checkpoint.h tests/unit/lora_synth.h tests/unit/lora_recipe.h tests/unit/merge_tolerance.h tests/unit/merge_sweep.h $(BUILD)/libnf4deq.a $(BUILD)/nf4deq | test-deps
	@mkdir -p $(@D)
	$(CC) $(NF4_CFLAGS) $(CJSON_CFLAGS) $(CMOCKA_CFLAGS) $(CFLAGS) -Itests/unit -DNF4DEQ_BIN='"$(BUILD)/nf4deq"' -o $@ $< \
	    $(BUILD)/libnf4deq.a $(CMOCKA_LIBS) $(LIBS) $(NF4_LDFLAGS) $(TEST_WRAPS_$*)

$(BUILD)/tools/%: tests/tools/%.c $(BUILD)/libnf4deq.a
	@mkdir -p $(@D)
	$(CC) $(NF4_CFLAGS) $(CJSON_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libnf4deq.a $(LIBS) $(NF4_LDFLAGS)

tools: $(TOOL_BINS)

check: test-deps all tools $(TEST_BINS)
	@$(MAKE) --no-print-directory python-ext
	@sh tests/scripts/run-unit.sh $(BUILD) $(TEST_BINS)
	@sh tests/scripts/check-hostile.sh $(BUILD)
	@sh tests/scripts/check-python.sh $(BUILD) $(PYTHON)

demo: deps all
	@sh tests/scripts/demo.sh $(BUILD)

install: all $(BUILD)/nf4deq.pc
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/doc/nf4deq \
	    $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 755 $(BUILD)/nf4deq $(DESTDIR)$(PREFIX)/bin/nf4deq
	install -m 644 include/nf4deq.h $(DESTDIR)$(PREFIX)/include/nf4deq.h
	install -m 755 $(BUILD)/libnf4deq.so $(DESTDIR)$(PREFIX)/lib/$(SO_NAME)
	ln -sf $(SO_NAME) $(DESTDIR)$(PREFIX)/lib/libnf4deq.so
	install -m 644 $(BUILD)/nf4deq.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/nf4deq.pc
	install -m 644 README.md $(DESTDIR)$(PREFIX)/share/doc/nf4deq/README.md
	install -m 644 docs/nf4deq.1 $(DESTDIR)$(PREFIX)/share/man/man1/nf4deq.1

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/nf4deq $(DESTDIR)$(PREFIX)/share/man/man1/nf4deq.1 \
	    $(DESTDIR)$(PREFIX)/include/nf4deq.h $(DESTDIR)$(PREFIX)/lib/$(SO_NAME) \
	    $(DESTDIR)$(PREFIX)/lib/libnf4deq.so $(DESTDIR)$(PREFIX)/lib/pkgconfig/nf4deq.pc
	rm -rf $(DESTDIR)$(PREFIX)/share/doc/nf4deq

clean:
	rm -rf $(BUILD)

-include gpu.mk
-include tests/fuzz/fuzz.mk
-include tests/faults.mk
-include tests/gpu_lanes.mk
# test_exit_handoff opens a file inside fork, as another thread may between the
# hand-off's listing of descriptors and its fork, and fails the child's own
# listing (open of /proc/self/fd) to drive its fallback.
TEST_WRAPS_test_exit_handoff = -Wl,--wrap=fork -Wl,--wrap=open

# ---- AArch64: the NEON kernel, cross-built and run under qemu-user ----------
CROSS_CC ?= aarch64-linux-gnu-gcc
CROSS_SYSROOT ?= /usr/aarch64-linux-gnu
CROSS_SRCS = src/dequant_cpu.c src/dequant_neon.c src/dequant_x86.c src/cpu_path.c src/parallel.c src/status.c src/dtype.c \
             src/merge_cpu.c src/merge_x86.c
.PHONY: check-aarch64
check-aarch64:
	@sh tests/scripts/ensure-deps.sh cross
	@mkdir -p $(BUILD)/aarch64
	$(CROSS_CC) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -ffp-contract=off -O2 -Isrc -Iinclude -pthread \
	    -o $(BUILD)/aarch64/neon_sweep tests/cross/neon_sweep.c $(CROSS_SRCS) -lm
	qemu-aarch64 -L $(CROSS_SYSROOT) $(BUILD)/aarch64/neon_sweep
