#!/bin/sh
# Installs the Debian packages a stage needs when they are missing: as root with
# apt-get, otherwise it prints the exact command and fails.
#   ensure-deps.sh build   cJSON, pkg-config, a C compiler
#   ensure-deps.sh test    CMocka, python3 with venv for the safetensors check, and
#                          python3-dev for the Python package's extension
#   ensure-deps.sh fuzz    clang with libFuzzer and the sanitizer runtimes (make fuzz)
#   ensure-deps.sh cross   an AArch64 cross compiler and qemu-user (make check-aarch64)
set -eu
stage=${1:-build}
missing=""
need() { # need PACKAGE TEST-COMMAND...
    pkg=$1; shift
    if ! "$@" >/dev/null 2>&1; then missing="$missing $pkg"; fi
}
need pkg-config command -v pkg-config
need make command -v make
need gcc sh -c 'command -v cc || command -v gcc'
need libcjson-dev pkg-config --exists libcjson
if [ "$stage" = test ]; then
    need libcmocka-dev pkg-config --exists cmocka
    need python3 command -v python3
    need python3-venv python3 -c 'import venv, ensurepip'
    # The headers the Python package's eager-call extension builds against.
    need python3-dev pkg-config --exists python3
fi
if [ "$stage" = fuzz ]; then
    # libFuzzer ships in libclang-rt-dev, only a Recommends of clang: link a
    # trivial fuzzer to know it is really there.
    fuzz_probe() {
        command -v "${FUZZ_CC:-clang}" >/dev/null 2>&1 || return 1
        probe=$(mktemp -d) || return 1
        printf '%s\n' '#include <stddef.h>' '#include <stdint.h>' \
            'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' >"$probe/p.c"
        "${FUZZ_CC:-clang}" -fsanitize=fuzzer,address,undefined "$probe/p.c" -o "$probe/p" >/dev/null 2>&1
        rc=$?
        rm -rf "$probe"
        return $rc
    }
    need "clang libclang-rt-dev" fuzz_probe
fi
if [ "$stage" = cross ]; then
    need gcc-aarch64-linux-gnu command -v aarch64-linux-gnu-gcc
    need libc6-dev-arm64-cross test -e /usr/aarch64-linux-gnu/include/stdio.h
    need qemu-user command -v qemu-aarch64
fi
[ -z "$missing" ] && exit 0
cmd="apt-get install -y --no-install-recommends$missing"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "nf4deq: installing missing packages:$missing" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $cmd >&2
else
    echo "nf4deq: missing packages:$missing" >&2
    echo "nf4deq: install them with: sudo $cmd" >&2
    exit 1
fi
