#!/bin/bash
# The device half of the Python bindings: the package against bitsandbytes,
# then the Unsloth puzzle harness; with `bench` or `all`, also bindings/python/bench.py
# against the peers carried in .carry/peers. `harness-ab [ROUNDS [DIR]]` runs the
# harness with and without the extension's cached call (nf4deq/_launch.c
# eager_cached), alternating, so both ratios to fast_dequantize come from one host;
# with DIR, this tree's package against DIR's (as for patterns, below). Logs under
# $OUT. `patterns [DIR]` times the eager call patterns (tests/perf/eager_patterns.py),
# ROUNDS times (default 2), alternating with the package under DIR (a directory
# holding another version's nf4deq/, and its libnf4deq.so with the extension beside
# it, if that version's library differs) where one is given. PIN=CPU runs every
# such process on that CPU (taskset): processes placed by the scheduler differed
# by up to 2x in PyTorch's own pieces on one machine. Run after unpacking
# .carry/bins.tar.xz (tests/gpu/device-run.sh does that).
#   bash tests/gpu/device-python.sh [tests|bench|all|harness-ab [ROUNDS [DIR]]|patterns [DIR]]
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
# with_package DIR CMD...: CMD with DIR's nf4deq package first on the path, and
# DIR's libnf4deq.so (with the extension beside it) where DIR has one; on CPU $PIN if set.
with_package() {
    local pkg=$1 lib=$NF4DEQ_LIBRARY
    shift
    [ -f "$pkg/libnf4deq.so" ] && lib=$pkg/libnf4deq.so
    NF4DEQ_LIBRARY=$lib PYTHONPATH=$PWD/.carry/py:$pkg ${PIN:+taskset -c $PIN} "$@"
}
# round_order I A B...: A B... in round I, reversed in even rounds, so that no
# side of an A/B always runs first (on a machine just woken, or after the other).
round_order() {
    local i=$1
    shift
    if [ $((i % 2)) = 0 ]; then printf '%s\n' "$@" | tac; else printf '%s\n' "$@"; fi
}
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 bindings/python/tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu_py.txt" | tail -15 || rc=1
    python3 examples/unsloth_puzzle_harness.py 2>&1 | tee "$OUT/harness.txt" | tail -40 || rc=1
fi
if [ "$what" = harness-ab ]; then
    # The harness puts this tree's bindings first on sys.path; importing nf4deq
    # before it runs keeps the package PYTHONPATH names (with_package DIR).
    # argv[1]: cached (the default) or python (the extension's cached call off).
    harness_py='
import runpy, sys
import nf4deq._torch as t
print("package:", t.__file__)
if sys.argv[1] == "python":
    t._eager_cached = None
sys.argv = ["unsloth_puzzle_harness.py"]
runpy.run_path("examples/unsloth_puzzle_harness.py", run_name="__main__")
'
    : > "$OUT/harness-ab.txt"
    : > "$OUT/harness-ab-full.txt"
    modes="cached python"
    [ -n "$3" ] && modes="$PWD/bindings/python $(cd "$3" && pwd)"
    for i in $(seq "${2:-2}"); do
        for mode in $(round_order "$i" $modes); do
            echo "== round $i: $mode" | tee -a "$OUT/harness-ab.txt"
            if [ -n "$3" ]; then
                with_package "$mode" python3 -c "$harness_py" cached
            else
                python3 -c "$harness_py" "$mode"
            fi 2>&1 | tee -a "$OUT/harness-ab-full.txt" |
                grep -E "^(package|  FAIL|    nf4deq|    fast_dequantize-eq|speedup|TOTAL|RESULT)" |
                tee -a "$OUT/harness-ab.txt" || rc=1
        done
    done
fi
if [ "$what" = patterns ]; then
    : > "$OUT/eager-patterns.txt"
    pkgs="$PWD/bindings/python ${2:+$(cd "$2" && pwd)}"
    for i in $(seq "${ROUNDS:-2}"); do
        for pkg in $(round_order "$i" $pkgs); do
            with_package "$pkg" python3 tests/perf/eager_patterns.py 2>&1 |
                tee -a "$OUT/eager-patterns.txt" || rc=1
        done
    done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 bindings/python/bench.py --peers .carry/peers --json "$OUT/pytorch-bench.json" 2>&1 |
        tee "$OUT/pytorch-bench.txt" || rc=1
fi
echo "device-python: rc=$rc"
exit $rc
