"""A HunyuanVideo LoRA as diffusion-pipe and ComfyUI share them (HunyuanVideo's own module names under
"diffusion_model.", lora_A / lora_B, no alphas), at HunyuanVideo's real sizes (20 double blocks and 40 single
blocks, hidden 3072, mlp 12288: every linear layer of each block), random bf16, for timing nf4deq's conversion of
it (docs/PERFORMANCE.md, "HunyuanVideo LoRAs").

usage: python make_hunyuan_lora.py RANK   (writes hunyuan-r<RANK>.safetensors here; needs torch and safetensors)
"""
import sys

import torch
from safetensors.torch import save_file

r = int(sys.argv[1])
g = torch.Generator().manual_seed(1)
D, F = 3072, 12288
DOUBLE = {  # HunyuanVideo's module name: (out, in)
    "img_attn_qkv": (3 * D, D), "txt_attn_qkv": (3 * D, D), "img_attn_proj": (D, D), "txt_attn_proj": (D, D),
    "img_mlp.fc1": (F, D), "img_mlp.fc2": (D, F), "txt_mlp.fc1": (F, D), "txt_mlp.fc2": (D, F),
    "img_mod.linear": (6 * D, D), "txt_mod.linear": (6 * D, D),
}
SINGLE = {"linear1": (3 * D + F, D), "linear2": (D, D + F), "modulation.linear": (3 * D, D)}
sd = {}
for kind, n, modules in (("double_blocks", 20, DOUBLE), ("single_blocks", 40, SINGLE)):
    for b in range(n):
        for m, (o, i) in modules.items():
            name = f"diffusion_model.{kind}.{b}.{m}"
            sd[name + ".lora_A.weight"] = (torch.randn(r, i, generator=g) * 0.01).to(torch.bfloat16)
            sd[name + ".lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.01).to(torch.bfloat16)
save_file(sd, f"hunyuan-r{r}.safetensors")
