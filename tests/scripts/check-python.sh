#!/bin/sh
# The real-client check: the official safetensors package (from PyPI, with
# numpy and ml_dtypes for bfloat16) loads every file nf4deq writes, and its
# arrays equal the fixtures' bit for bit. Runs in a venv under BUILD.
set -eu
build=$1; python=${2:-python3}
venv="$build/venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import safetensors, numpy, ml_dtypes' 2>/dev/null; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        'safetensors>=0.4' 'numpy>=1.24' 'ml_dtypes>=0.3'
fi
out=$(mktemp -d "${TMPDIR:-/tmp}/nf4deq-pycheck-XXXXXX")
trap 'rm -rf "$out"' EXIT
bin="$build/nf4deq"
fx=tests/fixtures
for dt in bf16 fp16 fp32; do
    "$bin" convert -q --device cpu --dtype $dt "$fx/tensors.bnb4.safetensors" "$out/tensors-$dt.safetensors"
done
"$bin" convert -q --device cpu "$fx/tensors.bnb4.safetensors" "$out/tensors-natural.safetensors"
for m in bf16 fp16; do
    for layout in "" -sharded; do
        for dt in bf16 fp16; do
            "$bin" convert -q --device cpu --dtype $dt "$fx/tiny-llama-$m-bnb4$layout" "$out/tiny-$m$layout-$dt"
        done
    done
done
"$venv/bin/python" tests/python/check_outputs.py "$out" "$fx"
# OUT = -: the safetensors file streams through a pipe, and the official
# parser reads it from bytes (deserialize: numpy's load() lacks bfloat16).
"$bin" convert -q --device cpu --dtype bf16 "$fx/tensors.bnb4.safetensors" - | "$venv/bin/python" -c '
import sys
import numpy as np, ml_dtypes  # noqa: F401
from safetensors import deserialize
from safetensors.numpy import load_file
got = {name: t for name, t in deserialize(sys.stdin.buffer.read())}
want = load_file(sys.argv[1])
assert set(got) == set(want), "tensor names differ"
for k, w in want.items():
    assert got[k]["dtype"] == "BF16" and tuple(got[k]["shape"]) == w.shape, k
    assert bytes(got[k]["data"]) == w.view(np.uint8).tobytes(), k
print(f"python safetensors: {len(got)} tensors streamed through stdout, identical")
' "$fx/tensors.expected-bf16.safetensors"
# Where the Python headers are, make built the eager-call extension, and the
# ABI test below must exercise it.
if pkg-config --exists python3 && [ ! -f "$build/_nf4deq_launch.abi3.so" ]; then
    echo "check-python: $build/_nf4deq_launch.abi3.so is missing (run make python-ext)" >&2
    exit 1
fi
# The C ABI's CPU path through ctypes, against the fixtures (no torch, no GPU).
# A sanitized libnf4deq.so needs the ASan runtime loaded before python itself.
preload=""
if ldd "$build/libnf4deq.so" 2>/dev/null | grep -q libasan; then
    preload="$(${CC:-cc} -print-file-name=libasan.so)"
fi
NF4DEQ_LIBRARY="$build/libnf4deq.so" LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
    "$venv/bin/python" bindings/python/tests/test_cpu_abi.py
# Pattern keys of adapter configs: nf4deq's matcher against Python's own re.
"$venv/bin/python" tests/python/check_patterns.py "$build"
