#!/bin/bash
# Issue-10 disk row: the Llama-3-8B preset (gen_bnb4 --preset llama3-8b: 5.70 GB
# in, 16.06 GB out, 2 shards) converted onto a disk, the page cache dropped
# before every run, every run ending fsync'd. This build on the GPU and the
# CPU, and an earlier build beside it when NF4DEQ_BASELINE names one,
# interleaved; each row gives the wall time and the peak RSS nf4deq reports.
#
#   tests/perf/disk8b-bench.sh LOGDIR [REPEATS] [DISK-DIR]
#   NF4DEQ_BASELINE=old/nf4deq tests/perf/disk8b-bench.sh ...
set -u
log=${1:?LOGDIR}; reps=${2:-3}; work=${3:-/var/tmp/nf4disk}
bin=${NF4DEQ:-build/nf4deq}; gen=build/tools/gen_bnb4; base=${NF4DEQ_BASELINE:-}
mkdir -p "$log"; rm -rf "$work"; mkdir -p "$work"
table="$log/disk8b-table.txt"; : > "$table"
now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.4f\", $1 }"; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped: not root)"; }

echo "$(date -u '+%F %H:%M') UTC; $(nproc) cores; $(df -hT "$work" | awk 'NR==2 {print $1, $2, $3}')" | tee -a "$table"
"$gen" --preset llama3-8b "$work/in" | tee -a "$table"
configs="cuda cpu"
[ -n "$base" ] && configs="$configs base-cuda base-cpu"
declare -A times rss
for r in $(seq "$reps"); do
    for c in $configs; do
        b=$bin; [ "${c#base-}" != "$c" ] && b=$base
        rm -rf "$work/out"; drop
        t0=$(now)
        "$b" convert --progress none --device "${c#base-}" "$work/in" "$work/out" 2> "$log/last.err" || { cat "$log/last.err"; exit 1; }
        t1=$(now)
        line=$(grep "converted" "$log/last.err" | tail -1)
        echo "$c run $r: $(calc "$t1 - $t0") s; $line" | tee -a "$table"
        times[$c]="${times[$c]:-} $(calc "$t1 - $t0")"
        rss[$c]="${rss[$c]:-} $(echo "$line" | sed -n 's/.*peak RSS \([0-9]*\) MB.*/\1/p')"
    done
done
for c in $configs; do
    printf '%-10s median %7.3f s  runs:%s  peak RSS MB:%s\n' "$c" "$(printf '%s\n' ${times[$c]} | median)" "${times[$c]}" "${rss[$c]}" | tee -a "$table"
done
rm -rf "$work"
