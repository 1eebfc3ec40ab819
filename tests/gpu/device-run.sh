#!/bin/bash
# One device-machine call: GPU checks (both builds) and the benchmark, logs under $OUT.
# Build and pack its binaries here first (make device-pack: .carry/bins.tar.xz and
# .carry/lib), then run it there carrying those two:
#   bash tests/gpu/device-run.sh [check|bench|all]
set -o pipefail
what=${1:-all}
# Binaries may travel packed (.carry/bins.tar.xz) to stay under the carry limit.
[ -f .carry/bins.tar.xz ] && tar -xJf .carry/bins.tar.xz
OUT=${OUT:-/tmp/nf4deq-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# bitsandbytes needs libcublas.so.13 / libcudart.so.13: take torch's if the toolkit lacks them.
for d in $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]; print(" ".join(os.path.join(p, s, "lib") for s in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
BNB=.carry/libbitsandbytes_cuda130.so
BENCH=build/gpu/nf4bench
[ -x build/nf4deq ] && build/nf4deq bench --help >/dev/null 2>&1 && BENCH="build/nf4deq bench"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,compute_mode,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
    bin=build/nf4deq; [ -x $bin ] || bin=build/gpu/nf4bench
    echo "cuobjdump --list-elf $bin"; cuobjdump --list-elf $bin
    cuobjdump --list-ptx $bin 2>/dev/null
} 2>&1 | tee "$OUT/device.txt"
cuobjdump --dump-sass -arch sm_90 build/gpu/nf4bench 2>&1 | gzip > "$OUT/sass-sm90.txt.gz"

rc=0
if [ "$what" = all ] || [ "$what" = check ]; then
    sh tests/gpu/run-checks.sh build build/ptx75 1 build/noasm 2>&1 | tee "$OUT/check.txt" || rc=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    $BENCH --bnb-lib $BNB --sweep --iters 200 2>&1 | tee "$OUT/bench.txt" || rc=1
    $BENCH --bnb-lib $BNB --iters 200 --json > "$OUT/bench.json" 2> "$OUT/bench-json.err" || rc=1
fi
echo "device-run: rc=$rc"
exit $rc
