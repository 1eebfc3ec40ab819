"""A Qwen-Image LoRA as lightx2v's Lightning LoRAs are shared (bare module names, lora_down / lora_up / alpha),
at Qwen-Image's real sizes (60 blocks, every linear layer of each), random bf16 factors, for timing nf4deq's
conversion of it (docs/PERFORMANCE.md, "Qwen-Image LoRAs").

usage: python make_qwen_lora.py RANK   (writes qwen-lightning-rRANK.safetensors here; needs torch and safetensors)
"""
import sys

import torch
from safetensors.torch import save_file

r = int(sys.argv[1])
g = torch.Generator().manual_seed(1)
D = 3072
BLOCK = {  # module: (out, in)
    "attn.to_q": (D, D), "attn.to_k": (D, D), "attn.to_v": (D, D), "attn.to_out.0": (D, D),
    "attn.add_q_proj": (D, D), "attn.add_k_proj": (D, D), "attn.add_v_proj": (D, D), "attn.to_add_out": (D, D),
    "img_mlp.net.0.proj": (4 * D, D), "img_mlp.net.2": (D, 4 * D), "txt_mlp.net.0.proj": (4 * D, D),
    "txt_mlp.net.2": (D, 4 * D), "img_mod.1": (6 * D, D), "txt_mod.1": (6 * D, D),
}
sd = {}
for b in range(60):
    for m, (o, i) in BLOCK.items():
        n = f"transformer_blocks.{b}.{m}"
        sd[n + ".lora_down.weight"] = (torch.randn(r, i, generator=g) * 0.01).to(torch.bfloat16)
        sd[n + ".lora_up.weight"] = (torch.randn(o, r, generator=g) * 0.01).to(torch.bfloat16)
        sd[n + ".alpha"] = torch.tensor(float(r))
save_file(sd, f"qwen-lightning-r{r}.safetensors")
