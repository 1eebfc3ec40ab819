"""A gpt-oss-20b-sized checkpoint in Unsloth's bitsandbytes layout, for timing how nf4deq writes its experts fused
(docs/PERFORMANCE.md, "Unsloth's gpt-oss experts, fused"): LAYERS layers of 32 experts, each a 4-bit linear layer
(NF4, blocksize 64, double quant, as Unsloth's *-unsloth-bnb-4bit checkpoints are quantized) of gate_up_projs.N
[5760, 2880] and down_projs.N [2880, 2880] with bf16 biases, and the router as a linear layer. The 4-bit data is
random (every nibble and scale code valid), which the timing does not depend on. With R > 0, also a rank-R LoRA on
every expert's two layers, as PEFT saves one Unsloth trained.

usage: python make_unsloth_gpt_oss.py LAYERS DIR [MODEL_TYPE [R]]   (MODEL_TYPE: gpt_oss, the default, is written
fused; any other keeps the layout, the same bytes per expert; writes DIR/base and, with R, DIR/adapter; needs
torch and safetensors)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

E, H, I, BLOCK, NESTED = 32, 2880, 2880, 64, 256
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
g = torch.Generator().manual_seed(1)
nested_code = torch.linspace(-1, 1, 256)


def weight(sd, name, rows, cols):
    """A random 4-bit weight [rows, cols] (NF4, BLOCK, double quant) and its quant state, into sd."""
    n = rows * cols
    blocks = n // BLOCK
    sd[name] = torch.randint(0, 256, (n // 2, 1), generator=g, dtype=torch.uint8)
    sd[name + ".absmax"] = torch.randint(0, 256, (blocks,), generator=g, dtype=torch.uint8)
    sd[name + ".nested_absmax"] = torch.rand((blocks + NESTED - 1) // NESTED, generator=g) * 0.05
    sd[name + ".nested_quant_map"] = nested_code.clone()
    sd[name + ".quant_map"] = torch.tensor(NF4)
    state = {"quant_type": "nf4", "blocksize": BLOCK, "dtype": "bfloat16", "shape": [rows, cols],
             "nested_blocksize": NESTED, "nested_dtype": "float32", "nested_offset": 0.02}
    sd[name + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


def main():
    layers, out = int(sys.argv[1]), sys.argv[2]
    model_type = sys.argv[3] if len(sys.argv) > 3 else "gpt_oss"
    r = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    os.makedirs(os.path.join(out, "base"), exist_ok=True)
    with open(os.path.join(out, "base", "config.json"), "w") as f:
        json.dump({"model_type": model_type, "num_local_experts": E, "hidden_size": H, "intermediate_size": I,
                   "num_hidden_layers": layers}, f)
    base, lora = {}, {}
    for n in range(layers):
        m = f"model.layers.{n}.mlp"
        for e in range(E):
            for proj, rows, cols in (("gate_up_projs", 2 * I, H), ("down_projs", H, I)):
                weight(base, f"{m}.experts.{proj}.{e}.weight", rows, cols)
                base[f"{m}.experts.{proj}.{e}.bias"] = (torch.randn(rows, generator=g) * 0.02).to(torch.bfloat16)
                if r:
                    p = f"base_model.model.{m}.experts.{proj}.{e}"
                    lora[p + ".lora_A.weight"] = torch.randn(r, cols, generator=g) * 0.01
                    lora[p + ".lora_B.weight"] = torch.randn(rows, r, generator=g) * 0.01
        base[f"{m}.router.linear.weight"] = (torch.randn(E, H, generator=g) * 0.02).to(torch.bfloat16)
        base[f"{m}.router.linear.bias"] = torch.zeros(E, dtype=torch.bfloat16)
    save_file(base, os.path.join(out, "base", "model.safetensors"), metadata={"format": "pt"})
    if r:
        os.makedirs(os.path.join(out, "adapter"), exist_ok=True)
        save_file(lora, os.path.join(out, "adapter", "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "adapter", "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                       "target_modules": ["gate_up_projs.%d" % e for e in range(E)] +
                                         ["down_projs.%d" % e for e in range(E)]}, f)


if __name__ == "__main__":
    main()
