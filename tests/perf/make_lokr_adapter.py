"""Writes a PEFT LoKr adapter (adapter_config.json with "peft_type": "LOKR", adapter_model.safetensors) for a
Llama model directory gen_bnb4 wrote, shaped as PEFT 0.21's LoKr layer builds it on all seven projections of every
layer: decompose_factor -1 (each dimension factored near its square root), rank R (W2 split where R is under half
its larger side, as PEFT decides), alpha 2R, fp32 factors of small random values. Standard library only.

usage: make_lokr_adapter.py MODEL_DIR OUT_DIR [R]
"""
import json
import os
import random
import struct
import sys


def factorization(dim, factor=-1):
    """PEFT's (LyCORIS') factorization."""
    if factor > 0 and dim % factor == 0:
        return factor, dim // factor
    if factor == -1:
        factor = dim
    m, n = 1, dim
    while m < n:
        new_m = m + 1
        while dim % new_m:
            new_m += 1
        if new_m > factor:
            break
        m, n = new_m, dim // new_m
    return (m, n) if m <= n else (n, m)


def main():
    model, out = sys.argv[1], sys.argv[2]
    r = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    rnd = random.Random(1)
    tensors = []
    for layer in range(layers):
        for proj, (rows, cols) in shapes.items():
            a, c = factorization(rows)
            b, d = factorization(cols)
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors.append((key + ".lokr_w1", (a, b)))
            if r < max(c, d) / 2:
                tensors += [(key + ".lokr_w2_a", (c, r)), (key + ".lokr_w2_b", (r, d))]
            else:
                tensors.append((key + ".lokr_w2", (c, d)))
    header, offset = {}, 0
    for name, shape in tensors:
        n = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, shape in tensors:
            f.write(struct.pack(f"<{shape[0] * shape[1]}f", *(rnd.uniform(-0.05, 0.05) for _ in range(shape[0] * shape[1]))))
    config = {"peft_type": "LOKR", "r": r, "alpha": 2 * r, "decompose_factor": -1, "decompose_both": False,
              "rank_pattern": {}, "alpha_pattern": {},
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{out}: {len(tensors)} factors for {layers} layers, rank {r}")


if __name__ == "__main__":
    main()
