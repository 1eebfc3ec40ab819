"""Writes a base that holds its MoE experts fused, and a LoRA on them, for check-gpu-fixtures.sh: the GPU's merge
must equal the CPU's byte for byte (test_lora checks the CPU's against the formula). Python's standard library
only, so the device machine runs it without packages; seeded, so both engines merge the same bytes.

    python3 make_fused_experts.py DIR MODEL_TYPE

MODEL_TYPE gpt_oss: gate_up_proj [E, H, 2I], down_proj [E, I, H] (its experts module is_transposed); any other
fused type (llama4_text, gemma4_text, ...): [E, 2I, H] and [E, H, I]. The sizes are odd, and an expert's rows are
more than a chunk at --mem 8M, so chunks end at the experts' edges and inside them. Writes DIR/base
(model.safetensors, config.json) and DIR/adapter (PEFT's keys, r * E rows of lora_A, with down_proj wrapping
gate_up_proj).
"""
import json
import os
import random
import struct
import sys

E, H, I, R = 5, 611, 347, 7
MODULE = "model.layers.0.mlp.experts"


def bf16(values):
    """values rounded to bf16 (nearest even; no NaN here), little-endian."""
    out = bytearray()
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        bits += 0x7FFF + ((bits >> 16) & 1)
        out += struct.pack("<H", (bits >> 16) & 0xFFFF)
    return bytes(out)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def write_safetensors(path, tensors):
    """tensors: (name, dtype, shape, raw bytes), written in this order."""
    header, offset = {}, 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, _, raw in tensors:
            f.write(raw)


def values(rng, n, scale):
    return [rng.uniform(-scale, scale) for _ in range(n)]


def main():
    out, model_type = sys.argv[1], sys.argv[2]
    transposed = model_type == "gpt_oss"
    rng = random.Random(20261128)
    os.makedirs(out + "/base", exist_ok=True)
    os.makedirs(out + "/adapter", exist_ok=True)
    # (param, out features, in features) of each expert's delta
    params = [("gate_up_proj", 2 * I, H), ("down_proj", H, I)]
    base = []
    for param, o, i in params:
        shape = [E, i, o] if transposed else [E, o, i]
        base.append((MODULE + "." + param, "BF16", shape, bf16(values(rng, E * o * i, 0.05))))
    base.append(("model.norm.weight", "BF16", [H], bf16([1.0] * H)))
    write_safetensors(out + "/base/model.safetensors", base)
    with open(out + "/base/config.json", "w") as f:
        json.dump({"model_type": model_type}, f)
    adapter = []
    for param, o, i in params:
        key = "base_model.model." + MODULE + (".base_layer" if param == "gate_up_proj" else "")
        adapter.append((key + ".lora_A.weight", "F32", [R * E, i], f32(values(rng, R * E * i, 0.1))))
        adapter.append((key + ".lora_B.weight", "F32", [o, R * E], f32(values(rng, o * R * E, 0.1))))
    write_safetensors(out + "/adapter/adapter_model.safetensors", adapter)
    with open(out + "/adapter/adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": None,
                   "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}, f)


if __name__ == "__main__":
    main()
