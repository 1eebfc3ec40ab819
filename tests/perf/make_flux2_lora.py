"""A Flux.2 LoRA as ai-toolkit and ComfyUI share them for FLUX.2 [dev] (BFL's names under "diffusion_model.",
lora_A / lora_B, no alphas), at FLUX.2 [dev]'s real sizes (8 double blocks and 48 single blocks, inner 6144,
mlp 18432: every linear layer of each block), random bf16, for timing nf4deq's conversion of it
(docs/PERFORMANCE.md, "Flux.2 LoRAs").

usage: python make_flux2_lora.py RANK   (writes flux2-r<RANK>.safetensors here; needs torch and safetensors)
"""
import sys

import torch
from safetensors.torch import save_file

r = int(sys.argv[1])
g = torch.Generator().manual_seed(1)
D, F = 6144, 18432
DOUBLE = {  # BFL's module name: (out, in)
    "img_attn.qkv": (3 * D, D), "txt_attn.qkv": (3 * D, D), "img_attn.proj": (D, D), "txt_attn.proj": (D, D),
    "img_mlp.0": (2 * F, D), "img_mlp.2": (D, F), "txt_mlp.0": (2 * F, D), "txt_mlp.2": (D, F),
}
SINGLE = {"linear1": (3 * D + 2 * F, D), "linear2": (D, D + F)}
sd = {}
for kind, n, modules in (("double_blocks", 8, DOUBLE), ("single_blocks", 48, SINGLE)):
    for b in range(n):
        for m, (o, i) in modules.items():
            name = f"diffusion_model.{kind}.{b}.{m}"
            sd[name + ".lora_A.weight"] = (torch.randn(r, i, generator=g) * 0.01).to(torch.bfloat16)
            sd[name + ".lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.01).to(torch.bfloat16)
save_file(sd, f"flux2-r{r}.safetensors")
