#!/bin/sh
# Runs the libFuzzer targets built by tests/fuzz/fuzz.mk.
#   run-fuzz.sh fuzz    FUZZ_DIR CORPUS TARGET...   fuzz each for $FUZZ_SECONDS
#   run-fuzz.sh regress FUZZ_DIR CORPUS TARGET...   replay the committed inputs
# Fuzzing starts from a copy of CORPUS/TARGET in FUZZ_DIR/work/TARGET, so the
# committed corpus never changes; crashes land in FUZZ_DIR/artifacts/TARGET/.
# CORPUS/TARGET.seeds, where there is one, names more seeds (one path a line,
# from the repository's root): fixtures used as they are, not copied.
set -u
mode=$1 dir=$2 corpus=$3
shift 3
seconds=${FUZZ_SECONDS:-60}
max_len=${FUZZ_MAX_LEN:-65536}
failed=0
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# The last value of "KEY: N" in libFuzzer's status lines.
last_field() { # last_field KEY LOG
    sed -n "s/.* $1: \\([0-9][0-9]*\\).*/\\1/p" "$2" | tail -n 1
}
final_stat() { # final_stat NAME LOG
    sed -n "s/^stat::$1: *\\([0-9][0-9]*\\).*/\\1/p" "$2" | tail -n 1
}

for t in "$@"; do
    bin="$dir/$t"
    case $mode in
    fuzz)
        work="$dir/work/$t" art="$dir/artifacts/$t" log="$dir/logs/$t.log"
        rm -rf "$work"
        mkdir -p "$work" "$art" "$dir/logs"
        [ -d "$corpus/$t" ] && cp -R "$corpus/$t/." "$work/"
        # shellcheck disable=SC2046  # seed paths are plain (see the .seeds file)
        [ -f "$corpus/$t.seeds" ] && cp $(grep -v '^#' "$corpus/$t.seeds") "$work/"
        "$bin" -max_total_time="$seconds" -print_final_stats=1 -max_len="$max_len" -timeout=20 \
            -rss_limit_mb=2048 -artifact_prefix="$art/" "$work" >"$log" 2>&1
        rc=$?
        execs=$(final_stat number_of_executed_units "$log")
        rate=$(final_stat average_exec_per_sec "$log")
        cov=$(last_field cov "$log")
        ft=$(last_field ft "$log")
        printf '%-18s %8s execs/s %10s execs  cov: %-5s ft: %-6s corpus: %s files\n' "$t" "${rate:-?}" \
            "${execs:-?}" "${cov:-?}" "${ft:-?}" "$(ls "$work" | wc -l)"
        if [ "$rc" -ne 0 ]; then
            failed=$((failed + 1))
            echo "$t: FAILED (rc=$rc); log: $log; reproducer(s):" $(ls "$art")
            grep -E 'ERROR: |runtime error|fuzz invariant|SUMMARY' "$log" | head -n 5
        fi
        ;;
    regress)
        files=$(find "$corpus/$t" "$corpus/crashes" -type f 2>/dev/null | sort)
        [ -f "$corpus/$t.seeds" ] && files="$files
$(grep -v '^#' "$corpus/$t.seeds")"
        n=$(printf '%s\n' "$files" | grep -c .)
        log="$dir/logs/$t.regress.log"
        mkdir -p "$dir/logs"
        # shellcheck disable=SC2086  # corpus file names are plain (see tests/corpus)
        if [ "$n" -gt 0 ] && ! "$bin" $files >"$log" 2>&1; then
            failed=$((failed + 1))
            echo "$t: FAILED replaying $n inputs; log: $log"
            grep -E 'Running: |ERROR: |runtime error|fuzz invariant|SUMMARY' "$log" | tail -n 6
        else
            printf '%-18s %4d inputs replayed, no failure\n' "$t" "$n"
        fi
        ;;
    *)
        echo "run-fuzz.sh: unknown mode $mode" >&2
        exit 2
        ;;
    esac
done
[ "$failed" -eq 0 ] || { echo "fuzz: $failed target(s) failed"; exit 1; }
