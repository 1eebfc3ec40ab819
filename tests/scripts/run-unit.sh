#!/bin/sh
# Runs each CMocka test program and prints one total line that CI reads:
# "N passed, N failed". Exits non-zero if any test failed or a program crashed.
set -u
build=$1; shift
passed=0; failed=0; crashed=""
for bin in "$@"; do
    log="$build/tests/$(basename "$bin").log"
    "$bin" >"$log" 2>&1
    rc=$?
    # A program may run several groups: add up every group's counts.
    p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test(s)\./\1/p' "$log" | awk '{s += $1} END {if (NR) print s}')
    f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test(s), listed below:/\1/p' "$log" | awk '{s += $1} END {if (NR) print s}')
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    if [ "$rc" -ne 0 ] || [ -n "$f" ]; then
        cat "$log"
        [ -z "$p$f" ] && crashed="$crashed $(basename "$bin")(rc=$rc)"
    else
        printf '%-28s %s passed\n' "$(basename "$bin")" "${p:-0}"
    fi
done
[ -n "$crashed" ] && { echo "crashed:$crashed"; failed=$((failed + 1)); }
echo "unit: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
