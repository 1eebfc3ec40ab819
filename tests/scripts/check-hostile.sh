#!/bin/sh
# Runs every case of the hostile corpus (tests/hostile/cases.tsv, made by
# tests/hostile/make_hostile.py) through BUILD/nf4deq and checks the contract:
#   - the exit code is the expected one, never a signal, never a hang;
#   - stderr is exactly one line, "nf4deq: ...", holding the expected text and
#     (on failure) the input path; a successful inspect prints nothing there;
#   - nothing is left in the scratch directory: no output, no temp file
#     (a successful convert leaves exactly its output, removed afterwards);
#   - the input is unchanged (checksums of every file before and after).
# Usage: check-hostile.sh BUILD [NAME-PATTERN]
# Prints one line per failure and "hostile: N passed, M failed".
set -u
build=${1:?usage: check-hostile.sh BUILD [NAME-PATTERN]}
pattern=${2:-}
bin=$build/nf4deq
here=$(cd "$(dirname "$0")/../hostile" && pwd)
manifest=$here/cases.tsv
cases=tests/hostile/cases
[ -d "$cases" ] || cases=$here/cases
[ -x "$bin" ] || { echo "check-hostile: $bin not built" >&2; exit 2; }
[ -f "$manifest" ] || { echo "check-hostile: $manifest missing" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/nf4deq-hostile-XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT INT TERM
passed=0 failed=0

fail() { # fail NAME WHAT
    failed=$((failed + 1))
    printf 'FAIL %s: %s\n' "$1" "$2"
}

# Checksums of every file under a path (file or directory), names included.
sums() {
    if [ -d "$1" ]; then
        (cd "$1" && find . -print | LC_ALL=C sort && find . -type f -print0 | LC_ALL=C sort -z |
            xargs -0r sha256sum)
    else
        sha256sum <"$1"
    fi
}

tab=$(printf '\t')
while IFS=$tab read -r name path kind code want; do
    case $name in '#'* | '') continue ;; esac
    if [ -n "$pattern" ]; then
        case $name in $pattern) ;; *) continue ;; esac
    fi
    scratch=$work/run
    rm -rf "$scratch"
    mkdir -p "$scratch"
    if [ "$path" = "-" ]; then
        in=$work/empty-dir
        rm -rf "$in"
        mkdir "$in"
    else
        in=$cases/$path
    fi
    if [ ! -e "$in" ]; then
        fail "$name" "input $in is missing (run tests/hostile/make_hostile.py)"
        continue
    fi
    if [ -d "$in" ]; then out=$scratch/out; else out=$scratch/out.safetensors; fi
    before=$(sums "$in")
    base=$cases/ok-baseline.safetensors # what lora cases are adapters for
    if [ "$kind" = lora ] || [ "$kind" = lora-inspect ]; then out=$scratch/out.safetensors; fi
    if [ "$kind" = inspect ]; then
        timeout 20 "$bin" inspect "$in" >"$work/stdout" 2>"$work/stderr"
    elif [ "$kind" = lora-inspect ]; then
        timeout 20 "$bin" inspect "$base" --lora "$in" >"$work/stdout" 2>"$work/stderr"
    elif [ "$kind" = lora ]; then
        timeout 20 "$bin" convert --device cpu "$base" "$out" --lora "$in" >"$work/stdout" 2>"$work/stderr"
    else
        timeout 20 "$bin" convert --device cpu "$in" "$out" >"$work/stdout" 2>"$work/stderr"
    fi
    rc=$?
    err=$(cat "$work/stderr")
    lines=$(wc -l <"$work/stderr")
    bad=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        bad="timed out after 20 s"
    elif [ "$rc" -ge 128 ]; then
        bad="killed by signal $((rc - 128))"
    elif [ "$rc" -ne "$code" ]; then
        bad="exit $rc, expected $code; stderr: $err"
    elif [ "$want" = "-" ]; then
        [ -s "$work/stderr" ] && bad="stderr should be empty: $err"
    elif [ "$lines" -ne 1 ] || [ "$(tail -c 1 "$work/stderr" | od -An -c | tr -d ' ')" != '\n' ]; then
        bad="stderr is not exactly one line: $err"
    else
        case $err in
        "nf4deq: "*) ;;
        *) bad="stderr does not start with 'nf4deq: ': $err" ;;
        esac
        case $err in
        *"$want"*) ;;
        *) bad="${bad:+$bad; }stderr lacks \"$want\": $err" ;;
        esac
        if [ "$code" -ne 0 ]; then
            case $err in
            *"$in"*) ;;
            *) bad="${bad:+$bad; }stderr does not name the input $in: $err" ;;
            esac
        fi
    fi
    # What the run left behind.
    if { [ "$kind" = convert ] || [ "$kind" = lora ]; } && [ "$code" -eq 0 ] && [ "$rc" -eq 0 ]; then
        [ -e "$out" ] || bad="${bad:+$bad; }no output written"
        rm -rf "$out"
    fi
    left=$(ls -A "$scratch")
    [ -n "$left" ] && bad="${bad:+$bad; }left behind: $(echo $left)"
    [ "$(sums "$in")" = "$before" ] || bad="${bad:+$bad; }the input changed"
    case $kind in *inspect) is_inspect=1 ;; *) is_inspect=0 ;; esac
    if [ "$is_inspect" = 1 ] && [ "$code" -ne 0 ] && [ -s "$work/stdout" ]; then
        bad="${bad:+$bad; }a failed inspect printed on stdout"
    fi
    if [ -n "$bad" ]; then
        fail "$name" "$bad"
    else
        passed=$((passed + 1))
    fi
done <"$manifest"

echo "hostile: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
