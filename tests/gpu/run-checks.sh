#!/bin/sh
# The GPU checks behind `make check-gpu`, runnable on their own (the device run
# calls this with prebuilt binaries):
#   sh tests/gpu/run-checks.sh [BUILD] [PTX75_BUILD] [BIG] [NOASM_BUILD]
# BUILD/gpu/test_gpu: the normal build (cubins for sm_75..sm_90, PTX for the newest).
# PTX75_BUILD/gpu/test_gpu: only compute_75 PTX, JIT-compiled by the driver.
# NOASM_BUILD/gpu/test_gpu: built with NF4DEQ_ASM=0 (no inline asm), if present.
# BUILD/gpu/test_gpu_merge: the fused LoRA merge kernel against the CPU merge.
# Then tests/scripts/check-gpu-fixtures.sh BUILD, if it exists.
set -u
BUILD=${1:-build}
PTX=${2:-build/ptx75}
BIG=${3:-1}
NOASM=${4:-build/noasm}
status=0

big=
[ "$BIG" = 1 ] && big=--big

echo "== check-gpu: $BUILD/gpu/test_gpu $big"
"$BUILD/gpu/test_gpu" $big || status=1

if [ -x "$BUILD/gpu/test_gpu_faults" ]; then
    echo "== check-gpu: $BUILD/gpu/test_gpu_faults (cudaMalloc / cudaMemcpyAsync failures)"
    "$BUILD/gpu/test_gpu_faults" || status=1
fi

if [ -x "$BUILD/gpu/test_gpu_merge" ]; then
    echo "== check-gpu: $BUILD/gpu/test_gpu_merge (fused LoRA merge kernel against the CPU merge)"
    "$BUILD/gpu/test_gpu_merge" || status=1
fi

echo "== check-gpu: $PTX/gpu/test_gpu (compute_75 PTX only, JIT)"
if command -v cuobjdump >/dev/null 2>&1; then
    elfs=$(cuobjdump --list-elf "$PTX/gpu/test_gpu" 2>/dev/null | wc -l)
    ptxs=$(cuobjdump --list-ptx "$PTX/gpu/test_gpu" 2>/dev/null | tr '\n' ' ')
    echo "device code: $elfs cubins; PTX: $ptxs"
    if [ "$elfs" != 0 ]; then
        echo "FAIL: the PTX-only build carries cubins"
        status=1
    fi
fi
# A private JIT cache, so this run really compiles the PTX.
CUDA_CACHE_PATH=$(mktemp -d) "$PTX/gpu/test_gpu" || status=1

if [ -x "$NOASM/gpu/test_gpu" ]; then
    echo "== check-gpu: $NOASM/gpu/test_gpu (NF4DEQ_ASM=0: no inline asm)"
    "$NOASM/gpu/test_gpu" || status=1
fi

if [ -f tests/scripts/check-gpu-fixtures.sh ]; then
    echo "== check-gpu: tests/scripts/check-gpu-fixtures.sh"
    sh tests/scripts/check-gpu-fixtures.sh "$BUILD" || status=1
    # Again with every output's data placed through a mapping by the workers,
    # as on tmpfs, whatever file system TMPDIR is on.
    echo "== check-gpu: tests/scripts/check-gpu-fixtures.sh, output through a mapping (NF4DEQ_OUTPUT_MAP=1)"
    NF4DEQ_OUTPUT_MAP=1 sh tests/scripts/check-gpu-fixtures.sh "$BUILD" || status=1
fi

if [ $status = 0 ]; then echo "check-gpu: PASS"; else echo "check-gpu: FAIL"; fi
exit $status
