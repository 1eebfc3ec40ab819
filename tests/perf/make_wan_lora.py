"""A Wan LoRA as lightx2v's and CausVid's Wan 2.1 14B LoRAs are shared (Wan's own names under
"diffusion_model.", lora_down / lora_up / alpha and a diff_b per module), at Wan 2.1 14B's real sizes (40
blocks, inner 5120, ffn 13824, every linear layer of each block), random bf16, for timing nf4deq's conversion
of it (docs/PERFORMANCE.md, "Wan LoRAs").

usage: python make_wan_lora.py RANK   (writes wan-r<RANK>.safetensors here; needs torch and safetensors)
"""
import sys

import torch
from safetensors.torch import save_file

r = int(sys.argv[1])
g = torch.Generator().manual_seed(1)
D, F = 5120, 13824
BLOCK = {  # Wan's module name: (out, in)
    "self_attn.q": (D, D), "self_attn.k": (D, D), "self_attn.v": (D, D), "self_attn.o": (D, D),
    "cross_attn.q": (D, D), "cross_attn.k": (D, D), "cross_attn.v": (D, D), "cross_attn.o": (D, D),
    "ffn.0": (F, D), "ffn.2": (D, F),
}
sd = {}
for b in range(40):
    for m, (o, i) in BLOCK.items():
        n = f"diffusion_model.blocks.{b}.{m}"
        sd[n + ".lora_down.weight"] = (torch.randn(r, i, generator=g) * 0.01).to(torch.bfloat16)
        sd[n + ".lora_up.weight"] = (torch.randn(o, r, generator=g) * 0.01).to(torch.bfloat16)
        sd[n + ".alpha"] = torch.tensor(float(r))
        sd[n + ".diff_b"] = (torch.randn(o, generator=g) * 0.01).to(torch.bfloat16)
save_file(sd, f"wan-r{r}.safetensors")
