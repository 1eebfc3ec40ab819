#!/bin/bash
# Issue-10 "memory speed" table: converting the 1.1B preset into tmpfs, where
# nf4deq itself, not the disk, is the limit. Times, interleaved within each
# repetition so that the machine's drift hits all alike:
#   nf4deq on the CPU (default workers, one thread, four threads), on the GPU
#   (when there is one), each default again with the output written by one
#   write(2) stream instead of through a mapping (NF4DEQ_OUTPUT_MAP=0: the rows
#   *-stream, the pipeline before the mapped output), the GPU again paying the
#   CUDA driver's teardown before it exits (NF4DEQ_GPU_HANDOFF=0: the row
#   cuda-exit, src/exit_handoff.h), and `cp` of the converted file, tmpfs to
#   tmpfs. Every output is compared byte for byte with a reference written by
#   one write(2) stream on the CPU.
#
#   tests/perf/tmpfs-bench.sh LOGDIR [REPEATS] [TMPFS-DIR]
#   NF4DEQ_BASELINE=old/nf4deq tests/perf/tmpfs-bench.sh ...   also time an
#       earlier build (rows base-cpu, base-cuda), for before/after in one run
#   TMPFS_BENCH_CONFIGS="cpu8 cuda12 ..." tests/perf/tmpfs-bench.sh ...   time
#       these instead (cpuN, cudaN: --threads N; cp is always timed)
#
# Every timed run writes into a file or directory removed just before, so each
# one allocates its tmpfs pages afresh, as `cp` does.
set -u
log=${1:?LOGDIR}; reps=${2:-5}; work=${3:-/dev/shm/nf4tmpfs}
bin=${NF4DEQ:-build/nf4deq}; gen=build/tools/gen_bnb4
mkdir -p "$log"; rm -rf "$work"; mkdir -p "$work"
table="$log/tmpfs-table.txt"; : > "$table"
now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.4f\", $1 }"; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

has_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
cpu_name=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "host: ${cpu_name:-?}, $(nproc) cores; GPU: ${gpu_name:-none}; $(date -u '+%F %H:%M') UTC; $(df -h "$work" | awk 'NR==2 {print $1, $2}')" | tee -a "$table"
"$gen" --preset tinyllama "$work/in" | tee -a "$table"
NF4DEQ_OUTPUT_MAP=0 "$bin" convert --progress none --device cpu "$work/in" "$work/ref" 2>> "$log/runs.log" || exit 1
ref=$work/ref/model.safetensors
echo "output: $(stat -c %s "$ref") bytes" | tee -a "$table"

base=${NF4DEQ_BASELINE:-}
configs="cpu cpu1 cpu4 cpu-stream"
[ "$has_gpu" = 1 ] && configs="$configs cuda cuda-stream cuda-exit"
[ -n "$base" ] && configs="$configs base-cpu"
[ -n "$base" ] && [ "$has_gpu" = 1 ] && configs="$configs base-cuda"
[ -n "${TMPFS_BENCH_CONFIGS:-}" ] && configs=$TMPFS_BENCH_CONFIGS
configs="$configs cp"
declare -A times
run_one() { # run_one CONFIG; appends the seconds to times[CONFIG]
    local t0 t1 rc=0
    rm -rf "$work/out" "$work/copy"
    case $1 in
    cp) t0=$(now); cp "$ref" "$work/copy" || rc=$?; t1=$(now) ;;
    base-*) t0=$(now); "$base" convert --progress none --device "${1#base-}" "$work/in" "$work/out" 2>> "$log/runs.log" || rc=$?; t1=$(now) ;;
    cpu[0-9]*|cuda[0-9]*) local dev=${1%%[0-9]*}
        t0=$(now); "$bin" convert --progress none --device "$dev" --threads "${1#"$dev"}" "$work/in" "$work/out" 2>> "$log/runs.log" || rc=$?; t1=$(now) ;;
    cuda-exit) t0=$(now); NF4DEQ_GPU_HANDOFF=0 "$bin" convert --progress none --device cuda "$work/in" "$work/out" 2>> "$log/runs.log" || rc=$?; t1=$(now) ;;
    *-stream) t0=$(now); NF4DEQ_OUTPUT_MAP=0 "$bin" convert --progress none --device "${1%-stream}" "$work/in" "$work/out" 2>> "$log/runs.log" || rc=$?; t1=$(now) ;;
    *) t0=$(now); "$bin" convert --progress none --device "$1" "$work/in" "$work/out" 2>> "$log/runs.log" || rc=$?; t1=$(now) ;;
    esac
    [ $rc -eq 0 ] || { echo "FAILED ($rc): $1"; tail -3 "$log/runs.log"; exit 1; }
    if [ "$1" != cp ]; then cmp -s "$ref" "$work/out/model.safetensors" || { echo "OUTPUT DIFFERS: $1"; exit 1; }; fi
    times[$1]="${times[$1]:-} $(calc "$t1 - $t0")"
}
for c in $configs; do run_one "$c"; done # warm-up, not counted
for c in $configs; do times[$c]=""; done
for r in $(seq "$reps"); do for c in $configs; do run_one "$c"; done; done
declare -A med
for c in $configs; do med[$c]=$(printf '%s\n' ${times[$c]} | median); done
for c in $configs; do
    printf '%-9s median %6.3f s  vs cp %5.3f  runs:%s\n' "$c" "${med[$c]}" "$(calc "${med[$c]} / ${med[cp]}")" "${times[$c]}" | tee -a "$table"
done
# ratio A B: A's median over B's, for the pairs this run timed
ratio() { [ -n "${med[$1]:-}" ] && [ -n "${med[$2]:-}" ] && printf '%s/%s %.3f\n' "$1" "$2" "$(calc "${med[$1]} / ${med[$2]}")" | tee -a "$table"; }
ratio cpu cpu-stream
ratio cuda cpu
ratio cuda cuda-stream
ratio cuda cuda-exit
ratio cuda base-cuda
ratio cpu base-cpu
grep -h "engine\|converted" "$log/runs.log" | tail -4 >> "$table"
rm -rf "$work"
