"""Checks against transformers that nf4deq writes Unsloth's gpt-oss experts as gpt-oss's own checkpoints hold them.

A tiny GptOssForCausalLM (random bf16 weights) is saved by transformers, then rewritten in Unsloth's layout as its
patched modules name and shape it (experts.gate_up_projs.N / down_projs.N linear layers, [out, in], each the
transpose of expert N's slice, with biases; router.linear), in bf16, so that nothing is quantized and every value
must come back exactly. nf4deq's conversion of that must be transformers' own checkpoint tensor for tensor, byte for
byte, and load into the same logits.

    python check_unsloth_layout.py NF4DEQ WORKDIR      (needs torch, safetensors and transformers with gpt_oss)
"""
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM


def unsloth_layout(sd):
    """transformers' gpt-oss tensors renamed and split as Unsloth's bitsandbytes checkpoints hold them."""
    out = {}
    for k, v in sd.items():
        module, _, param = k.rpartition(".")
        if module.endswith(".experts") and param in ("gate_up_proj", "down_proj"):
            for e in range(v.shape[0]):
                out[f"{module}.{param}s.{e}.weight"] = v[e].T.contiguous()
        elif module.endswith(".experts") and param in ("gate_up_proj_bias", "down_proj_bias"):
            for e in range(v.shape[0]):
                out[f"{module}.{param[:-len('_bias')]}s.{e}.bias"] = v[e].clone()
        elif module.endswith(".router"):
            out[f"{module}.linear.{param}"] = v
        else:
            out[k] = v
    return out


def main():
    nf4deq, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=128)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(f"{work}/hf")
    own = load_file(f"{work}/hf/model.safetensors")
    os.makedirs(f"{work}/unsloth")
    save_file(unsloth_layout(own), f"{work}/unsloth/model.safetensors", metadata={"format": "pt"})
    shutil.copy(f"{work}/hf/config.json", f"{work}/unsloth/config.json")
    subprocess.run([nf4deq, "convert", "-q", "--device", os.environ.get("NF4DEQ_DEVICE", "cpu"),
                    f"{work}/unsloth", f"{work}/out"], check=True)
    got = load_file(f"{work}/out/model.safetensors")
    bad = sorted(set(got) ^ set(own)) + [k for k in own if k in got and not torch.equal(got[k], own[k])]
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        a = GptOssForCausalLM.from_pretrained(f"{work}/hf").eval()(x).logits
        b = GptOssForCausalLM.from_pretrained(f"{work}/out").eval()(x).logits
    same_logits = torch.equal(a, b)
    print(f"{len(own)} tensors, {len(bad)} differ from transformers' own checkpoint{': ' + ', '.join(bad[:5]) if bad else ''}; "
          f"logits {'equal' if same_logits else 'DIFFER'}")
    sys.exit(0 if not bad and same_logits else 1)


if __name__ == "__main__":
    main()
