"""Loads every file nf4deq wrote with the official safetensors package and checks
its arrays against the bitsandbytes fixtures, bit for bit."""
import json
import os
import sys

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from safetensors.numpy import load_file

out_dir, fixtures = sys.argv[1], sys.argv[2]
passed = failed = 0


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


def check(label, got, want):
    global passed, failed
    bad = sorted(k for k in set(got) | set(want) if k not in got or k not in want or not same_bits(got[k], want[k]))
    if bad:
        failed += 1
        print(f"FAIL {label}: {len(bad)} tensors differ, first {bad[0]}")
    else:
        passed += 1


def load_dir(path):
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        assert set(weight_map) == set(tensors), f"{index} does not list exactly the tensors written"
    return tensors


expected = {dt: load_file(f"{fixtures}/tensors.expected-{dt}.safetensors") for dt in ("bf16", "f16", "f32")}
for dt, fx in (("bf16", "bf16"), ("fp16", "f16"), ("fp32", "f32")):
    check(f"tensors --dtype {dt}", load_file(f"{out_dir}/tensors-{dt}.safetensors"), expected[fx])

natural = load_file(f"{out_dir}/tensors-natural.safetensors")
want = {}
for name, arr in natural.items():
    fx = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[str(arr.dtype)]
    want[name] = expected[fx][name]
check("tensors, natural dtypes", natural, want)

for m in ("bf16", "fp16"):
    for layout in ("", "-sharded"):
        for dt, fx in (("bf16", "bf16"), ("fp16", "f16")):
            got = load_dir(f"{out_dir}/tiny-{m}{layout}-{dt}")
            check(f"tiny-llama-{m}{layout} --dtype {dt}", got,
                  load_file(f"{fixtures}/tiny-llama-{m}-bnb4.expected-{fx}.safetensors"))

print(f"python safetensors: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
