# libFuzzer targets (included by the main Makefile).
#
#   make fuzz [FUZZ_SECONDS=60] [FUZZ_TARGETS="fuzz_header ..."]
#       fuzzes each target for FUZZ_SECONDS, starting from a scratch copy of its
#       committed corpus (tests/corpus/TARGET), and prints one line per target:
#       execs/s, total execs, coverage (cov) and features (ft). New crashes are
#       saved under $(BUILD)/fuzz/artifacts/TARGET/.
#   make fuzz-regress
#       replays every committed corpus file and every file in
#       tests/corpus/crashes/ through each target, without fuzzing.
#
# The library sources are compiled here with clang and
# -fsanitize=fuzzer-no-link,address,undefined, apart from the normal build.
# The CUDA back end is left out: src/gpu_none.c stands in for it.

FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= fuzz_header fuzz_quant_state fuzz_index fuzz_config fuzz_file fuzz_hf_ref fuzz_adapter_config fuzz_resume_manifest fuzz_pattern fuzz_torch_pickle fuzz_torch_file fuzz_kohya fuzz_model_dir
FUZZ_DIR      = $(BUILD)/fuzz
FUZZ_CORPUS   = tests/corpus
FUZZ_SAN      = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS   = -std=c11 -D_GNU_SOURCE -ffp-contract=off -fno-fast-math -Iinclude -Isrc $(CJSON_CFLAGS) -pthread \
                -g -O1 -DNF4DEQ_VERSION='"$(VERSION)"' $(FUZZ_SAN) \
                -DPIPELINE_MIN_SLOT_BYTES='(UINT64_C(1) << 20)' -DPIPELINE_MIN_MERGE_SLOT_BYTES='(UINT64_C(1) << 20)'
FUZZ_LIB_SRCS = $(filter-out src/main.c,$(wildcard src/*.c))
FUZZ_LIB_OBJS = $(FUZZ_LIB_SRCS:src/%.c=$(FUZZ_DIR)/obj/%.o)
FUZZ_BINS     = $(FUZZ_TARGETS:%=$(FUZZ_DIR)/%)
# Inputs up to 64 KiB: headers and blobs are small, and fuzz_file converts what it opens.
FUZZ_MAX_LEN ?= 65536

.PHONY: fuzz fuzz-build fuzz-regress fuzz-deps

fuzz-deps:
	@sh tests/scripts/ensure-deps.sh build
	@FUZZ_CC=$(FUZZ_CC) sh tests/scripts/ensure-deps.sh fuzz

$(FUZZ_DIR)/obj/%.o: src/%.c $(wildcard include/*.h src/*.h) | fuzz-deps
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_DIR)/libnf4deq-fuzz.a: $(FUZZ_LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(FUZZ_DIR)/%: tests/fuzz/%.c tests/fuzz/fuzz_common.h tests/fuzz/fuzz_convert.h $(FUZZ_DIR)/libnf4deq-fuzz.a | fuzz-deps
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_DIR)/libnf4deq-fuzz.a $(CJSON_LIBS) -lm -pthread

fuzz-build: $(FUZZ_BINS)

fuzz: fuzz-build
	@FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_MAX_LEN=$(FUZZ_MAX_LEN) sh tests/fuzz/run-fuzz.sh fuzz $(FUZZ_DIR) $(FUZZ_CORPUS) $(FUZZ_TARGETS)

fuzz-regress: fuzz-build
	@sh tests/fuzz/run-fuzz.sh regress $(FUZZ_DIR) $(FUZZ_CORPUS) $(FUZZ_TARGETS)
