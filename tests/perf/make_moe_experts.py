"""A mixture-of-experts base and a LoRA on its experts at Qwen3-30B-A3B's sizes (128 experts, hidden 2048,
expert intermediate 768), for timing nf4deq's merge of PEFT's target_parameters (docs/PERFORMANCE.md, "LoRA on
MoE experts"): LAYERS layers of bf16 experts as transformers 5 saves a bnb-4bit Qwen3-MoE (one tensor per expert
and projection; bitsandbytes does not quantize the fused experts), nothing else, and a rank-R LoRA with fp32
factors on every layer's mlp.experts.gate_up_proj and down_proj, as PEFT 0.21 saves it. With gpt_oss, the
same at gpt-oss-20b's sizes (32 experts, hidden and expert intermediate 2880), its experts fused as it saves
them: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (is_transposed), with their biases.

usage: python make_moe_experts.py LAYERS R DIR [gpt_oss]   (writes DIR/base and DIR/adapter; needs torch and
safetensors)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

layers, r, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fused = sys.argv[4:] == ["gpt_oss"]
E, H, I = (32, 2880, 2880) if fused else (128, 2048, 768)
g = torch.Generator().manual_seed(1)
os.makedirs(os.path.join(out, "base"), exist_ok=True)
os.makedirs(os.path.join(out, "adapter"), exist_ok=True)
with open(os.path.join(out, "base", "config.json"), "w") as f:
    json.dump({"model_type": "gpt_oss", "num_local_experts": E, "hidden_size": H, "intermediate_size": I,
               "num_hidden_layers": layers} if fused else
              {"model_type": "qwen3_moe", "num_experts": E, "hidden_size": H, "moe_intermediate_size": I,
               "num_hidden_layers": layers}, f)
base, lora = {}, {}
for n in range(layers):
    m = f"model.layers.{n}.mlp.experts"
    if fused:
        for proj, shape in (("gate_up_proj", (E, H, 2 * I)), ("down_proj", (E, I, H))):
            base[f"{m}.{proj}"] = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
            base[f"{m}.{proj}_bias"] = (torch.randn(E, shape[2], generator=g) * 0.02).to(torch.bfloat16)
    for e in range(0 if fused else E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            base[f"{m}.{e}.{proj}.weight"] = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    p = "base_model.model." + m
    lora[p + ".base_layer.lora_A.weight"] = torch.randn(r * E, H, generator=g) * 0.01  # gate_up_proj
    lora[p + ".base_layer.lora_B.weight"] = torch.randn(2 * I, r * E, generator=g) * 0.01
    lora[p + ".lora_A.weight"] = torch.randn(r * E, I, generator=g) * 0.01  # down_proj
    lora[p + ".lora_B.weight"] = torch.randn(H, r * E, generator=g) * 0.01
save_file(base, os.path.join(out, "base", "model.safetensors"), metadata={"format": "pt"})
save_file(lora, os.path.join(out, "adapter", "adapter_model.safetensors"), metadata={"format": "pt"})
with open(os.path.join(out, "adapter", "adapter_config.json"), "w") as f:
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": None,
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}, f)
