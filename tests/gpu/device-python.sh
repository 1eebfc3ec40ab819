#!/bin/bash
# The device half of the Python bindings: the package against bitsandbytes,
# then the Unsloth puzzle harness; with `bench` or `all`, also bindings/python/bench.py
# against the peers carried in .carry/peers. Logs under $OUT. Run after unpacking
# .carry/bins.tar.xz (tests/gpu/device-run.sh does that).
#   bash tests/gpu/device-python.sh [tests|bench|all]
set -o pipefail
what=${1:-tests}
OUT=${OUT:-/tmp/nf4deq-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.carry/py:$PWD/bindings/python PYTHONUNBUFFERED=1
export NF4DEQ_LIBRARY=$PWD/build/libnf4deq.so
export LD_LIBRARY_PATH=$PWD/.carry/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]; print(" ".join(os.path.join(p, s, "lib") for s in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 bindings/python/tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu_py.txt" | tail -15 || rc=1
    python3 examples/unsloth_puzzle_harness.py 2>&1 | tee "$OUT/harness.txt" | tail -40 || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 bindings/python/bench.py --peers .carry/peers --json "$OUT/pytorch-bench.json" 2>&1 |
        tee "$OUT/pytorch-bench.txt" || rc=1
fi
echo "device-python: rc=$rc"
exit $rc
