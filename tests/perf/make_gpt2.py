"""A GPT-2-XL-sized bitsandbytes checkpoint, for timing how nf4deq writes a GPT-2's Conv1D weights transposed back
(docs/PERFORMANCE.md, "GPT-2's Conv1D weights, transposed"): LAYERS blocks of GPT-2 XL's four Conv1D layers, each
4-bit as transformers quantizes it, [out, in] (NF4, blocksize 64, double quant): attn.c_attn [4800, 1600],
attn.c_proj [1600, 1600], mlp.c_fc [6400, 1600], mlp.c_proj [1600, 6400], with bf16 biases and layer norms, and
the bf16 embeddings. The 4-bit data is random (every nibble and scale code valid), which the timing does not
depend on.

usage: python make_gpt2.py LAYERS DIR [MODEL_TYPE]   (MODEL_TYPE: gpt2, the default, is written transposed; any
other keeps the layout, the same bytes; writes DIR/base; needs torch and safetensors)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

from make_unsloth_gpt_oss import g, weight

D, VOCAB, POSITIONS = 1600, 50257, 1024
LAYERS = (("attn.c_attn", 3 * D, D), ("attn.c_proj", D, D), ("mlp.c_fc", 4 * D, D), ("mlp.c_proj", D, 4 * D))


def bf16(*shape):
    return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)


def main():
    layers, out = int(sys.argv[1]), sys.argv[2]
    model_type = sys.argv[3] if len(sys.argv) > 3 else "gpt2"
    os.makedirs(os.path.join(out, "base"), exist_ok=True)
    with open(os.path.join(out, "base", "config.json"), "w") as f:
        json.dump({"model_type": model_type, "n_embd": D, "n_layer": layers, "n_head": 25, "vocab_size": VOCAB,
                   "n_positions": POSITIONS}, f)
    sd = {"transformer.wte.weight": bf16(VOCAB, D), "transformer.wpe.weight": bf16(POSITIONS, D),
          "transformer.ln_f.weight": bf16(D), "transformer.ln_f.bias": bf16(D)}
    for n in range(layers):
        h = f"transformer.h.{n}"
        for layer, rows, cols in LAYERS:
            weight(sd, f"{h}.{layer}.weight", rows, cols)
            sd[f"{h}.{layer}.bias"] = bf16(rows)
        for ln in ("ln_1", "ln_2"):
            sd[f"{h}.{ln}.weight"], sd[f"{h}.{ln}.bias"] = bf16(D), bf16(D)
    save_file(sd, os.path.join(out, "base", "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
