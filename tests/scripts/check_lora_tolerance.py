"""Checks a merged conversion against the fp32 and fp64 merges PEFT's fixtures
give, with the tolerance of tests/fixtures/lora/README.md: every element equals
the fp32 merge, or is no farther from the fp64 merge than the fp32 merge is,
plus one ulp of the output dtype; at least 99.9% equal the fp32 merge exactly.
Tensors the adapter does not merge into must equal the fp32 file byte for byte,
and so must the biases a LoRA bias (lora_bias) changes: one multiply and one
add, in PEFT's order.

With PLAIN_DIR, a plain conversion of the base, the expected files hold only the
tensors the adapter changes (tests/fixtures/lora/README.md, "Expected files of
the changed tensors"): those the fp64 file holds too are checked with the
tolerance, the others byte for byte, and every other tensor must equal
PLAIN_DIR's byte for byte.
Needs numpy (the device image and the test venv have it).

usage: check_lora_tolerance.py GOT_DIR EXPECTED_FP32 EXPECTED_FP64 ADAPTER_DIR [PLAIN_DIR]
(ADAPTER_DIR: a PEFT adapter, or a folder with a diffusers LoRA's pytorch_lora_weights.safetensors)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_safetensors import tensors  # noqa: E402  (the stdlib-only reader beside this file)

PREFIX = "base_model.model."


def load(path):
    """name -> (dtype, raw bytes)."""
    return {name: (dtype, raw) for name, (dtype, _, raw) in tensors(path).items()}


def values(dtype, raw):
    """fp64 values and the bytes per element."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64), 2
    if dtype == "F16":
        return np.frombuffer(raw, np.float16).astype(np.float64), 2
    return np.frombuffer(raw, np.float32).astype(np.float64), 4


def ulp(dtype, x):
    mant, min_exp = {"BF16": (7, -126), "F16": (10, -14), "F32": (23, -126)}[dtype]
    _, e = np.frexp(np.abs(x))
    e = np.maximum(e - 1, min_exp)
    return np.ldexp(1.0, e - mant)


def adapter_targets(adapter):
    """The base tensors an adapter's LoRA pairs merge into."""
    merged = set()
    weights, prefix = os.path.join(adapter, "adapter_model.safetensors"), PREFIX
    if os.path.isfile(adapter):  # a diffusers LoRA file: the transformer's keys
        weights, prefix = adapter, "transformer."
    elif not os.path.exists(weights):  # a diffusers LoRA's folder
        weights, prefix = os.path.join(adapter, "pytorch_lora_weights.safetensors"), "transformer."
    for key in load(weights):
        for a_suffix in (".lora_A.weight", ".lora_embedding_A"):  # a layer's LoRA, an embedding's
            if key.startswith(prefix) and key.endswith(a_suffix):
                merged.add(key[len(prefix):-len(a_suffix)] + ".weight")
    return merged


def main():
    got_dir, e32_path, e64_path, adapter = sys.argv[1:5]
    got, e32, e64 = load(got_dir), load(e32_path), load(e64_path)
    if len(sys.argv) > 5:  # only the changed tensors expected; the rest as a plain conversion writes them
        merged = set(e32) & set(e64)  # merged; the others (copies, rows replaced) are exact
        e32 = dict(load(sys.argv[5]), **e32)
    else:
        merged = adapter_targets(adapter)
    bad, total, exact = [], 0, 0
    if set(got) != set(e32):
        bad.append("tensor names differ: %s" % sorted(set(got) ^ set(e32)))
    for name in sorted(set(got) & set(e32)):
        gdt, graw = got[name]
        wdt, wraw = e32[name]
        if gdt != wdt or len(graw) != len(wraw):
            bad.append("%s: %s of %d bytes, expected %s of %d" % (name, gdt, len(graw), wdt, len(wraw)))
            continue
        if name not in merged:
            if graw != wraw:
                bad.append("%s: differs from the expected file, which it must equal byte for byte" % name)
            continue
        g, size = values(gdt, graw)
        v32, _ = values(wdt, wraw)
        v64, _ = values(wdt, e64[name][1])
        same = np.frombuffer(graw, np.uint8).reshape(-1, size) == np.frombuffer(wraw, np.uint8).reshape(-1, size)
        same = same.all(axis=1)
        ok = same | (np.abs(g - v64) <= np.abs(v32 - v64) + ulp(wdt, v64))
        total += g.size
        exact += int(same.sum())
        if not ok.all():
            i = int(np.argmin(ok))
            bad.append("%s[%d] = %r: fp32 merge %r, fp64 merge %r" % (name, i, g[i], v32[i], v64[i]))
    if total and exact * 1000 < total * 999:
        bad.append("only %d of %d merged elements equal the fp32 merge" % (exact, total))
    label = os.path.basename(e32_path).replace(".expected.safetensors", "")
    print("lora tolerance %s: %d merged elements, %d equal to the fp32 merge (%.4f%%)%s" % (
        label, total, exact, 100.0 * exact / max(total, 1), "" if not bad else ": FAIL"))
    for b in bad[:10]:
        print("  " + b)
    return 1 if bad or not total else 0


if __name__ == "__main__":
    sys.exit(main())
