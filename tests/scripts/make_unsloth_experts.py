"""Writes a gpt-oss checkpoint in Unsloth's per-expert layout, and a LoRA on its experts, for check-gpu-fixtures.sh:
nf4deq writes the experts fused, each transposed, and the GPU's output must equal the CPU's byte for byte
(test_experts_fused checks the CPU's against what bitsandbytes wrote). Python's standard library only, so the
device machine runs it without packages.

    python3 make_unsloth_experts.py FIXTURES DIR

Layer L's three experts are all weight L of FIXTURES/tensors.bnb4.safetensors (a to h: blocksizes 64 to 256, rows
that do not end on a block, single quant, FP4, bf16 storage, an odd count), as gate_up_projs.N and down_projs.N,
with bf16 biases on gate_up_projs.N; the router is a linear layer. Writes DIR/base (model.safetensors,
config.json) and DIR/adapter (a LoRA on layer 2's gate_up_projs.0 and .2).
"""
import json
import os
import random
import struct
import sys

from make_fused_experts import bf16, f32, write_safetensors

EXPERTS, R = 3, 3
WEIGHTS = "abcdefgh"


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)}"""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def start(fixtures, out):
    """The fixture's 4-bit tensors and its source tensors (for their shapes), read; out/base and out/adapter made."""
    os.makedirs(out + "/base", exist_ok=True)
    os.makedirs(out + "/adapter", exist_ok=True)
    return (read_safetensors(fixtures + "/tensors.bnb4.safetensors"),
            read_safetensors(fixtures + "/tensors.source.safetensors"))


def main():
    fixtures, out = sys.argv[1], sys.argv[2]
    src, shapes = start(fixtures, out)
    base = []
    for layer, x in enumerate(WEIGHTS):
        prefix = "model.%s.weight" % x
        parts = sorted(k for k in src if k.startswith(prefix))
        rows = shapes[prefix][1][0]
        module = "model.layers.%d.mlp" % layer
        for e in range(EXPERTS):
            for proj in ("gate_up_projs", "down_projs"):
                for k in parts:
                    dtype, shape, raw = src[k]
                    base.append(("%s.experts.%s.%d.weight%s" % (module, proj, e, k[len(prefix):]), dtype, shape, raw))
            base.append(("%s.experts.gate_up_projs.%d.bias" % (module, e), "BF16", [rows],
                         bf16([float(e * 1000 + r) for r in range(rows)])))
        dtype, shape, raw = src["model.norm.weight"]
        base.append((module + ".router.linear.weight", dtype, shape, raw))
    write_safetensors(out + "/base/model.safetensors", base)
    with open(out + "/base/config.json", "w") as f:
        json.dump({"model_type": "gpt_oss"}, f)
    rng = random.Random(20261128)
    rows, cols = shapes["model.c.weight"][1]
    adapter = []
    for e in (0, 2):
        adapter += lora_pair("model.layers.2.mlp.experts.gate_up_projs.%d" % e, rows, cols, rng)
    write_adapter(out + "/adapter", adapter)


def lora_pair(module, rows, cols, rng):
    """PEFT's two factors of a rank-R LoRA on `module` ([rows, cols]), fp32 values spread over [-0.5, 0.5)."""
    key = "base_model.model." + module
    return [(key + ".lora_A.weight", "F32", [R, cols], f32([rng.uniform(-0.5, 0.5) for _ in range(R * cols)])),
            (key + ".lora_B.weight", "F32", [rows, R], f32([rng.uniform(-0.5, 0.5) for _ in range(rows * R)]))]


def write_adapter(path, tensors):
    """A PEFT adapter of rank R, alpha 5, in directory `path`."""
    write_safetensors(path + "/adapter_model.safetensors", tensors)
    with open(path + "/adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 5}, f)


if __name__ == "__main__":
    main()
