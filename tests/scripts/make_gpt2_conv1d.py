"""Writes a GPT-2 checkpoint whose Conv1D weights bitsandbytes quantized ([out, in]), and a LoRA on two of them, for
check-gpu-fixtures.sh: nf4deq writes those weights transposed back, [in, out], and the GPU's output must equal the
CPU's byte for byte (test_conv1d_layout checks the CPU's against what bitsandbytes wrote). Python's standard library
only, so the device machine runs it without packages.

    python3 make_gpt2_conv1d.py FIXTURES DIR

Weights a to h of FIXTURES/tensors.bnb4.safetensors (blocksizes 64 to 256, rows that do not end on a block, single
quant, FP4, bf16 storage, an odd count) become the Conv1D layers of two blocks, c the head (a linear layer, kept as
stored). Writes DIR/base (model.safetensors, config.json) and DIR/adapter (a LoRA on h.0.mlp.c_fc and h.1.mlp.c_proj).
"""
import json
import random
import sys

from make_fused_experts import write_safetensors
from make_unsloth_experts import lora_pair, start, write_adapter

CONV1D = {"a": "transformer.h.0.attn.c_attn", "b": "transformer.h.0.attn.c_proj", "c": "transformer.h.0.mlp.c_fc",
          "d": "transformer.h.0.mlp.c_proj", "e": "transformer.h.1.attn.c_attn", "f": "transformer.h.1.attn.q_attn",
          "g": "transformer.h.1.mlp.c_fc", "h": "transformer.h.1.mlp.c_proj"}
HEAD_FROM = "c"


def main():
    src, shapes = start(sys.argv[1], sys.argv[2])
    out = sys.argv[2]
    base = []
    for x, module in list(CONV1D.items()) + [(HEAD_FROM, "lm_head")]:
        prefix = "model.%s.weight" % x
        for k in sorted(k for k in src if k.startswith(prefix)):
            dtype, shape, raw = src[k]
            base.append(("%s.weight%s" % (module, k[len(prefix):]), dtype, shape, raw))
    dtype, shape, raw = src["model.norm.weight"]
    base.append(("transformer.ln_f.weight", dtype, shape, raw))
    write_safetensors(out + "/base/model.safetensors", base)
    with open(out + "/base/config.json", "w") as f:
        json.dump({"model_type": "gpt2"}, f)
    rng = random.Random(20261128)
    adapter = []
    for x in ("c", "h"):
        rows, cols = shapes["model.%s.weight" % x][1]
        adapter += lora_pair(CONV1D[x], rows, cols, rng)
    write_adapter(out + "/adapter", adapter)


if __name__ == "__main__":
    main()
