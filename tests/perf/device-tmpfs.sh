#!/bin/bash
# One device-machine call for issue 10's tmpfs rows: what a process pays at
# exit for CUDA (cuda_teardown), how fast each way of filling one file on tmpfs
# is (tmpfs_write), and the 1.1B conversion into tmpfs (tmpfs-bench.sh), with
# an earlier build beside this one when .carry/base/nf4deq is there. Build
# here first (make all tools perf-tools), then pack what travels:
#   tar -cJf .carry/bins.tar.xz build/nf4deq build/tools/gen_bnb4 build/perf [.carry/base/nf4deq]
# and carry .carry with libcjson.so.1 under .carry/lib:
#   bash tests/perf/device-tmpfs.sh [REPEATS]       logs under $OUT
set -u -o pipefail
reps=${1:-7}
[ -f .carry/bins.tar.xz ] && tar -xJf .carry/bins.tar.xz
OUT=${OUT:-/tmp/nf4deq-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
    date -u
    # compute_mode: the teardown hand-off is off on an exclusive one (exit_handoff.h)
    nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader
    echo "$(nproc) cores: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
    uname -r
    df -h /dev/shm | tail -1
} 2>&1 | tee "$OUT/host.txt"
rc=0
build/perf/cuda_teardown 2>&1 | tee "$OUT/teardown.txt" || rc=1
mkdir -p /dev/shm/tw
build/perf/tmpfs_write /dev/shm/tw 2200 5 2>&1 | tee "$OUT/tmpfs-write.txt" || rc=1
rm -rf /dev/shm/tw
base=
[ -x .carry/base/nf4deq ] && base=.carry/base/nf4deq
NF4DEQ_BASELINE=$base bash tests/perf/tmpfs-bench.sh "$OUT/tmpfs" "$reps" /dev/shm/tb 2>&1 | tee "$OUT/tmpfs-bench.txt" || rc=1
echo "device-tmpfs: rc=$rc"
exit $rc
