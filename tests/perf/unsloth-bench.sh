#!/bin/bash
# What writing Unsloth's gpt-oss experts fused costs (docs/PERFORMANCE.md, "Unsloth's gpt-oss experts, fused"):
# a gpt-oss-20b-sized checkpoint in Unsloth's layout (tests/perf/make_unsloth_gpt_oss.py, LAYERS layers) converted
# fused (model_type gpt_oss), and the same bytes with the layout kept (model_type llama), on each device, and cp -r
# of the fused output, side by side; repetitions interleave the configurations, the output is removed and the
# page cache dropped (when root) before each run. Prints the median seconds of each and the ratios.
#
#   tests/perf/unsloth-bench.sh LOGDIR [REPEATS] [WORKDIR] [LAYERS]   (UNSLOTH_BENCH_DEVICES="cpu" without a GPU)
#
# With BENCH_MODEL=gpt2 the same for a GPT-2's Conv1D weights written transposed back (docs/PERFORMANCE.md,
# "GPT-2's Conv1D weights, transposed"): LAYERS blocks at GPT-2 XL's sizes (tests/perf/make_gpt2.py), as gpt2 and
# as llama.
set -u
log=${1:?LOGDIR}; reps=${2:-5}; work=${3:-/dev/shm/nf4unsloth}; layers=${4:-2}
bin=build/nf4deq; devices=${UNSLOTH_BENCH_DEVICES:-cuda cpu}; py=${PYTHON:-python3}
model=${BENCH_MODEL:-gpt_oss}
case $model in
    gpt_oss) make=tests/perf/make_unsloth_gpt_oss.py
             what="gpt-oss-20b sizes, $layers layers (32 experts, [5760, 2880] and [2880, 2880] NF4 each)" ;;
    gpt2) make=tests/perf/make_gpt2.py
          what="GPT-2 XL sizes, $layers blocks ([4800, 1600], [1600, 1600], [6400, 1600], [1600, 6400] NF4 each)" ;;
    *) echo "unsloth-bench.sh: BENCH_MODEL must be gpt_oss or gpt2" >&2; exit 2 ;;
esac
mkdir -p "$log" "$work"
for t in $model llama; do
    [ -d "$work/$t/base" ] || "$py" $make "$layers" "$work/$t" "$t" || exit 1
done
drop() { sync; [ "$(id -u)" = 0 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; true; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
declare -A times
configs=; for d in $devices; do configs="$configs $d:$model $d:llama"; done
configs="$configs cp:$model"
"$bin" convert -q --device cpu "$work/$model/base" "$work/for-cp" || exit 1
for r in $(seq "$reps"); do
    for c in $configs; do
        dev=${c%%:*}; type=${c##*:}
        rm -rf "$work/out"; drop
        t0=$(date +%s.%N)
        if [ "$dev" = cp ]; then
            cp -r "$work/for-cp" "$work/out" || exit 1
        else
            "$bin" convert --device "$dev" --progress none "$work/$type/base" "$work/out" 2> "$log/last.err" ||
                { cat "$log/last.err"; exit 1; }
        fi
        t1=$(date +%s.%N)
        [ "$r" = 1 ] && [ "$dev" != cp ] && echo "$c: $(tail -1 "$log/last.err")" | tee -a "$log/unsloth-runs.txt"
        times[$c]="${times[$c]:-} $(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }")"
    done
done
rm -rf "$work/out" "$work/for-cp"
{
    echo "$what, $reps runs, in $work"
    for c in $configs; do
        echo "$c: median $(echo "${times[$c]}" | tr ' ' '\n' | grep . | median) s (runs:${times[$c]})"
    done
    cpm=$(echo "${times[cp:$model]}" | tr ' ' '\n' | grep . | median)
    for d in $devices; do
        f=$(echo "${times[$d:$model]}" | tr ' ' '\n' | grep . | median)
        k=$(echo "${times[$d:llama]}" | tr ' ' '\n' | grep . | median)
        echo "$d: $model / layout kept = $(awk "BEGIN { printf \"%.2f\", $f / $k }"), $model / cp = $(awk "BEGIN { printf \"%.2f\", $f / $cpm }")"
    done
} | tee "$log/unsloth-table.txt"
