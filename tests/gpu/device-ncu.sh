#!/bin/bash
# One device-machine call: Nsight Compute profiles of the fused kernel and of its
# traffic floor (the same loads and stores, no arithmetic) on one shape, so the two
# can be compared counter by counter (issue pipes, stall reasons, DRAM throughput).
# Build here first and carry the binaries as tests/gpu/device-run.sh says, then:
#   bash tests/gpu/device-ncu.sh [SHAPE [CACHE]]   (default 4096x1024:bf16 all)
# CACHE is ncu's --cache-control: all flushes the caches before each profiled launch
# (cold), none leaves them as the bench's previous launches left them, as in graph replays.
# Writes under $OUT: ncu-details.txt (every section, both kernels), ncu-raw.csv (every
# metric), ncu-source.csv (per-SASS-instruction stall samples of both).
# The clocks are left alone (--clock-control none), as the bench leaves them.
set -o pipefail
shape=${1:-4096x1024:bf16}
cache=${2:-all}
[ -f .carry/bins.tar.xz ] && tar -xJf .carry/bins.tar.xz
OUT=${OUT:-/tmp/nf4deq-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
# The bench launches each kernel first in its warm-up: the first launches of the default
# fused kernel (16-bit out, values by shuffle), of the T4 traffic kernel and of the empty
# kernel (what a launch costs under the profiler) are enough to compare. The warp-state
# sampler runs at its shortest interval: a 10 MB launch lasts a few microseconds.
profile() { # name regex count
    "$NCU" --clock-control none --cache-control $cache --set full --import-source yes --warp-sampling-interval 0 -f -o /tmp/ncu-$1 \
        --kernel-name-base demangled --kernel-name "regex:$2" --launch-count $3 \
        build/nf4deq bench --shape "$shape" --iters 100 > "$OUT/ncu-bench-$1.txt" 2>&1
}
rc=0
# The default kernel's multiply (template argument ASM: 2 = asm, 0 = C) is what the
# launch table picks for this shape; `nf4deq bench --json` reports it (asm_mul), so the
# filter takes the default kernel and not the asm-mul or c-mul bench variants.
asm=$(build/nf4deq bench --shape "$shape" --iters 100 --json |
      python3 -c 'import json, sys; print(2 if json.load(sys.stdin)["shapes"][0]["asm_mul"] else 0)') || rc=1
# The last template argument (PDL) is 0 for the default kernel, 1 for the pdl variant.
profile fused "^void dequant4_kernel<(__nv_bfloat16|__half), \(int\)0, \(int\)32, \(bool\)1, \(bool\)1, \(bool\)1, \(int\)${asm:-0}, \(int\)0, \(int\)1, \(bool\)0>" 4 || rc=1
profile traffic '^void traffic_kernel<\(int\)4' 2 || rc=1
profile empty '^empty_kernel' 1 || rc=1
for r in fused traffic empty; do
    "$NCU" --import /tmp/ncu-$r.ncu-rep --page details; echo
done > "$OUT/ncu-details.txt" 2>&1 || rc=1
for r in fused traffic empty; do
    "$NCU" --import /tmp/ncu-$r.ncu-rep --page raw --csv
done > "$OUT/ncu-raw.csv" 2>&1 || rc=1
for r in fused traffic; do
    "$NCU" --import /tmp/ncu-$r.ncu-rep --page source --csv --print-source sass
done > "$OUT/ncu-source.csv" 2>&1 || rc=1
gzip -f "$OUT/ncu-raw.csv" "$OUT/ncu-source.csv"
echo "device-ncu: rc=$rc"
exit $rc
