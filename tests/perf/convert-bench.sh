#!/bin/bash
# Issue-5 "convert" table, run on a CUDA machine in one go. Times, side by side:
# nf4deq on the GPU and on the CPU, `cp` of an output-sized file (the I/O
# floor) and the leanest Python path, on synthetic 1.1B and 8B checkpoints,
# plus the largest shards of a 70B model under --gpu-mem 12G.
#
#   tests/perf/convert-bench.sh LOGDIR [REPEATS]
#   NF4_PERF_GPU=0 PRESETS=tinyllama tests/perf/convert-bench.sh ...   CPU-only machine
#
# Page caches are dropped before every timed run (when root), and every run
# ends with its data on disk: nf4deq fsyncs, the cp floor is `cp && sync`.
set -u
log=${1:?LOGDIR}; reps=${2:-3}
mkdir -p "$log"
bin=build/nf4deq; gen=build/tools/gen_bnb4
work=${NF4_PERF_DIR:-/tmp/nf4perf}
rm -rf "$work"; mkdir -p "$work"
table="$log/convert-table.txt"; : > "$table"

drop() { sync; [ "$(id -u)" = 0 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; true; }
gpu_mem_watch() { # samples used GPU memory every 100 ms into $1 until killed
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$1" 2>/dev/null &
    echo $!
}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.4f\", $1 }"; }

row() { printf '%-34s %-10s %8s s  %s\n' "$1" "$2" "$3" "$4" | tee -a "$table"; }

run_nf4deq() { # run_nf4deq LABEL MODEL DEVICE [extra args...]; prints median seconds
    local label=$1 model=$2 device=$3; shift 3
    local times=() peak_rss="" peak_gpu=""
    for r in $(seq "$reps"); do
        rm -rf "$work/out"; drop
        local base; base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
        local watch; watch=$(gpu_mem_watch "$log/gpumem.txt")
        local t0; t0=$(now)
        "$bin" convert --device "$device" --progress none "$@" "$model" "$work/out" 2> "$log/last.err"
        local rc=$?; local t1; t1=$(now)
        kill "$watch" 2>/dev/null; wait "$watch" 2>/dev/null
        [ $rc -eq 0 ] || { echo "FAILED ($rc): $label"; cat "$log/last.err"; return 1; }
        cat "$log/last.err" >> "$log/runs.log"
        times+=("$(calc "$t1 - $t0")")
        peak_rss=$(sed -n 's/.*peak RSS \([0-9]*\) MB.*/\1/p' "$log/last.err")
        local top; top=$(sort -n "$log/gpumem.txt" | tail -1)
        [ -n "$base" ] && [ -n "$top" ] && peak_gpu=$((top - base))
    done
    local med; med=$(printf '%s\n' "${times[@]}" | median)
    row "$label" "$device" "$(printf '%.2f' "$med")" "runs: ${times[*]}; peak RSS ${peak_rss} MB; peak GPU +${peak_gpu:-?} MiB"
    echo "$med" > "$log/last.median"
}

cp_floor() { # cp_floor LABEL FILE-OF-OUTPUT-SIZE
    local times=()
    for r in $(seq "$reps"); do
        rm -f "$work/copy"; drop
        local t0; t0=$(now); cp "$2" "$work/copy" && sync; local t1; t1=$(now)
        times+=("$(calc "$t1 - $t0")")
    done
    rm -f "$work/copy"
    local med; med=$(printf '%s\n' "${times[@]}" | median)
    row "$1" "cp+sync" "$(printf '%.2f' "$med")" "runs: ${times[*]}; $(stat -c %s "$2") bytes"
    echo "$med" > "$log/last.median"
}

use_gpu=${NF4_PERF_GPU:-1}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "device: ${gpu_name:-no GPU}, $(nproc) cores, $(date -u +%F), $(df -h "$work" | awk 'NR==2 {print $1}')" | tee -a "$table"
for preset in ${PRESETS:-tinyllama llama3-8b}; do
    "$gen" --preset "$preset" "$work/$preset" | tee -a "$table"
    if [ "$use_gpu" = 1 ]; then
        run_nf4deq "$preset nf4deq" "$work/$preset" cuda; gpu=$(cat "$log/last.median")
    else
        run_nf4deq "$preset nf4deq" "$work/$preset" cpu; gpu=$(cat "$log/last.median")
    fi
    # An output-sized file for the floor: the converted model itself.
    outsize_file=$(ls -S "$work/out"/*.safetensors | head -1)
    if [ "$(ls "$work/out"/*.safetensors | wc -l)" -gt 1 ]; then
        cat "$work/out"/*.safetensors > "$work/floor.bin"; outsize_file="$work/floor.bin"
    fi
    mv "$outsize_file" "$work/floor.src"; rm -rf "$work/out" "$work/floor.bin"
    cp_floor "$preset cp floor" "$work/floor.src"; floor=$(cat "$log/last.median")
    if [ "$use_gpu" = 1 ]; then
        run_nf4deq "$preset nf4deq" "$work/$preset" cpu; cpu=$(cat "$log/last.median")
    fi
    if [ "$use_gpu" = 1 ]; then
        printf '%-34s gpu/cp %.3f   cpu/cp %.3f\n' "$preset ratios" "$(calc "$gpu / $floor")" \
            "$(calc "$cpu / $floor")" | tee -a "$table"
    else
        printf '%-34s cpu/cp %.3f\n' "$preset ratio" "$(calc "$gpu / $floor")" | tee -a "$table"
    fi
    if [ "$use_gpu" = 1 ] && [ "$preset" = tinyllama ] && [ -d .carry/py/bitsandbytes ]; then
        times=()
        for r in $(seq "$reps"); do
            rm -f "$work/py.safetensors"; drop
            t0=$(now); PYTHONPATH=.carry/py python3 tests/perf/python_path.py "$work/$preset" "$work/py.safetensors" \
                > "$log/python.txt" 2>&1 && sync; t1=$(now)
            cat "$log/python.txt" >> "$log/runs.log"
            times+=("$(calc "$t1 - $t0")")
        done
        py=$(printf '%s\n' "${times[@]}" | median)
        row "$preset python path" "torch+bnb" "$(printf '%.2f' "$py")" "runs: ${times[*]}; $(tail -1 "$log/python.txt")"
        printf '%-34s python/nf4deq-gpu %.2fx\n' "$preset speedup" "$(calc "$py / $gpu")" | tee -a "$table"
        rm -f "$work/py.safetensors"
    fi
    rm -rf "$work/$preset" "$work/floor.src" "$work/out"
done
{ [ "$use_gpu" = 1 ] && [ "${SKIP_70B:-0}" != 1 ]; } || { rm -rf "$work"; echo "--- table ---"; cat "$table"; exit 0; }
# 70B: two layers hold every tensor shape the full model has (the 2.1 GB
# embedding and lm_head, the 28672x8192 MLP weights) in 5 GB shards.
"$gen" --preset llama3-70b --layers 2 --shard-size 5G "$work/l70" | tee -a "$table"
reps=1
run_nf4deq "llama3-70b (2 layers) --gpu-mem 12G" "$work/l70" cuda --gpu-mem 12G
run_nf4deq "llama3-70b (2 layers) default" "$work/l70" cuda
rm -rf "$work"
echo "--- table ---"; cat "$table"
