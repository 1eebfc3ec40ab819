"""A kohya-format Flux.1 LoRA at Flux.1's real sizes (19 double blocks, 38 single blocks, every module
kohya's sd-scripts trains), random bf16 factors, for timing nf4deq's conversion of it (docs/PERFORMANCE.md,
"Kohya LoRAs").

usage: python make_kohya_lora.py RANK   (writes flux-kohya-rRANK.safetensors here; needs torch and safetensors)
"""
import torch, sys
from safetensors.torch import save_file
r = int(sys.argv[1]); g = torch.Generator().manual_seed(1)
sd = {}
D = {"img_attn_qkv": (9216, 3072), "img_attn_proj": (3072, 3072), "img_mlp_0": (12288, 3072), "img_mlp_2": (3072, 12288),
     "img_mod_lin": (18432, 3072), "txt_attn_qkv": (9216, 3072), "txt_attn_proj": (3072, 3072), "txt_mlp_0": (12288, 3072),
     "txt_mlp_2": (3072, 12288), "txt_mod_lin": (18432, 3072)}
S = {"linear1": (21504, 3072), "linear2": (3072, 15360), "modulation_lin": (9216, 3072)}
def add(n, o, i):
    sd[n + ".lora_down.weight"] = (torch.randn(r, i, generator=g) * 0.01).to(torch.bfloat16)
    sd[n + ".lora_up.weight"] = (torch.randn(o, r, generator=g) * 0.01).to(torch.bfloat16)
    sd[n + ".alpha"] = torch.tensor(float(r), dtype=torch.bfloat16)
for b in range(19):
    for k, (o, i) in D.items(): add(f"lora_unet_double_blocks_{b}_{k}", o, i)
for b in range(38):
    for k, (o, i) in S.items(): add(f"lora_unet_single_blocks_{b}_{k}", o, i)
save_file(sd, f"flux-kohya-r{r}.safetensors")
