#!/bin/bash
# Issue-9 speed table: converting a synthetic Llama-3-8B checkpoint plain and with
# an r = 64 LoRA adapter on all seven projections merged (gen_bnb4 --lora-rank 64),
# on the GPU and on the CPU with all cores, side by side in one run. Repetitions
# interleave the configurations so drift hits them alike; the page cache is
# dropped before every run (when root). Prints median seconds, the merged/plain
# ratio per device and nf4deq's own peak-RSS line. With NF4DEQ_BASELINE naming an
# earlier build, its CPU merge (base-cpu:lora) runs beside them. Every merged output
# of the first repetition is compared byte for byte with the first of its adapter (the GPU's
# where it runs): "identical" or DIFFERS.
#
#   [NF4DEQ_BASELINE=old/nf4deq] tests/perf/lora-bench.sh LOGDIR [REPEATS] [WORKDIR]
# WORKDIR holds the input and the output: /dev/shm for tmpfs, a disk path for disk.
# LORA_BENCH_DEVICES="cpu" leaves the GPU out (a machine without one);
# LORA_BENCH_LAYERS=N generates N layers instead of 32 (a machine with less memory);
# LORA_BENCH_DORA=1 makes the adapter a DoRA one (gen_bnb4 --dora), in WORKDIR/llama3-8b-dora.
# LORA_BENCH_RANK=R gives the generated adapter rank R instead of 64 (in WORKDIR/llama3-8b-rR).
# LORA_BENCH_MOE=DIR times DIR/base with DIR/adapter instead, as tests/perf/make_moe_experts.py writes them
# (a LoRA on MoE experts, target_parameters); cp -r of the plain output runs beside them.
# LORA_BENCH_LOKR=R also times a PEFT LoKr adapter of rank R on the same projections (make_lokr_adapter.py,
# in WORKDIR/NAME-lokr-rR): configurations DEV:lokr, beside DEV:lora.
set -u
log=${1:?LOGDIR}; reps=${2:-3}; work=${3:-/dev/shm/nf4lora}
bin=build/nf4deq; gen=build/tools/gen_bnb4; base=${NF4DEQ_BASELINE:-}
devices=${LORA_BENCH_DEVICES:-cuda cpu}; layers=()
[ -n "${LORA_BENCH_LAYERS:-}" ] && layers=(--layers "$LORA_BENCH_LAYERS")
kind_flag=(); name=llama3-8b; rank=${LORA_BENCH_RANK:-64}
[ -n "${LORA_BENCH_DORA:-}" ] && { kind_flag=(--dora); name=llama3-8b-dora; }
[ "$rank" != 64 ] && name=$name-r$rank
mkdir -p "$log" "$work"
table="$log/lora-table.txt"
model=$work/$name; adapter=$work/$name-lora
moe=${LORA_BENCH_MOE:-}
[ -n "$moe" ] && { model=$moe/base; adapter=$moe/adapter; }
if [ -z "$moe" ] && { [ ! -d "$model" ] || [ ! -d "$adapter" ]; }; then
    rm -rf "$model" "$adapter"
    "$gen" --preset llama3-8b "${layers[@]}" --lora-rank "$rank" "${kind_flag[@]}" "$model" | tee -a "$log/gen.txt" || exit 1
fi
lokr=${LORA_BENCH_LOKR:-}; lokr_adapter=$work/$name-lokr-r$lokr
if [ -n "$lokr" ] && [ ! -d "$lokr_adapter" ]; then
    python3 tests/perf/make_lokr_adapter.py "$model" "$lokr_adapter" "$lokr" | tee -a "$log/gen.txt" || exit 1
fi
drop() { sync; [ "$(id -u)" = 0 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; true; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
declare -A times rss same
configs=; for d in $devices; do configs="$configs $d:plain $d:lora${lokr:+ $d:lokr}"; done
[ -n "$base" ] && configs="$configs base-cpu:lora"
[ -n "$moe" ] && configs="$configs cp:plain"
rm -rf "$work"/merged-*
for r in $(seq "$reps"); do
    for c in $configs; do
        if [ "$c" = cp:plain ]; then # the plain output copied, where it is: what writing it costs
            "$bin" convert -q --device cpu "$model" "$work/plain-for-cp" || exit 1
            rm -rf "$work/out"; drop
            t0=$(date +%s.%N); cp -r "$work/plain-for-cp" "$work/out"; t1=$(date +%s.%N)
            rm -rf "$work/plain-for-cp"
            times[$c]="${times[$c]:-} $(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }")"
            rss[$c]=-
            continue
        fi
        dev=${c%%:*}; kind=${c##*:}; exe=$bin
        [ "$dev" = base-cpu ] && { dev=cpu; exe=$base; }
        extra=(); [ "$kind" = lora ] && extra=(--lora "$adapter")
        [ "$kind" = lokr ] && extra=(--lora "$lokr_adapter")
        rm -rf "$work/out"; drop
        t0=$(date +%s.%N)
        "$exe" convert --device "$dev" --progress none "$model" "$work/out" "${extra[@]}" 2> "$log/last.err"
        rc=$?; t1=$(date +%s.%N)
        cat "$log/last.err" >> "$log/runs.log"
        [ $rc -eq 0 ] || { echo "FAILED ($rc): $c"; cat "$log/last.err"; exit 1; }
        times[$c]="${times[$c]:-} $(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }")"
        rss[$c]=$(sed -n 's/.*peak RSS \([0-9]*\) MB.*/\1/p' "$log/last.err")
        if [ "$kind" != plain ] && [ "$r" = 1 ]; then
            if [ ! -d "$work/merged-$kind" ]; then
                mv "$work/out" "$work/merged-$kind"; same[$c]="the reference"
            elif diff -r -q "$work/merged-$kind" "$work/out" > /dev/null; then
                same[$c]=identical
            else
                same[$c]=DIFFERS
            fi
        fi
    done
done
rm -rf "$work"/merged-*
rm -rf "$work/out"
{
    echo "# $(date -u +%F\ %H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores, workdir $work ($(df -T "$work" | awk 'NR==2 {print $2}'))"
    printf '%-14s %10s %10s %10s  %s\n' config median_s ratio rss_MB 'runs (merged output)'
    for c in $configs; do
        med=$(echo ${times[$c]} | tr ' ' '\n' | median)
        dev=${c%%:*}; [ "$dev" = base-cpu ] && dev=cpu # the baseline's merge against this build's plain CPU run
        [ "$dev" = cp ] && dev=cpu # the copy against the CPU's plain conversion
        plain=$(echo ${times[$dev:plain]} | tr ' ' '\n' | median)
        printf '%-14s %10.2f %10.3f %10s  %s  (%s)\n' "$c" "$med" "$(awk "BEGIN { print $med / $plain }")" "${rss[$c]}" \
            "${times[$c]}" "${same[$c]:-not a merge}"
    done
} | tee -a "$table"
