"""Checks against bitsandbytes, transformers and PEFT that nf4deq writes a 4-bit GPT-2 as GPT-2 loads it.

transformers quantizes a GPT-2's Conv1D weights ([in, out]) transposed, [out, in], as bitsandbytes' linear layer
holds them. A tiny GPT2LMHeadModel (random weights) is quantized by the real bitsandbytes (on the GPU where there
is one, else its CPU backend) in two configurations (NF4 with double quant from bf16; FP4, single quant, from fp16)
and saved. nf4deq's conversion of each must:
  - hold every tensor of the model's own checkpoint, in its shape, each Conv1D weight equal byte for byte to
    bitsandbytes' dequantize_4bit of it, transposed, and every other tensor to the quantized checkpoint's;
  - load into GPT2LMHeadModel with no key missing, unexpected or of another shape;
  - be the same bytes when the checkpoint's model.safetensors is converted alone, its config.json beside it;
  - with a QLoRA that PEFT trained on the quantized model (c_attn, c_proj, c_fc; random B) merged, be within
    tests/fixtures/lora/README.md's tolerance of the fp32 and fp64 merges into bitsandbytes' output
    (check_lora_tolerance.py), and give logits near PEFT's own model's: nearer by far than the model without the
    LoRA (a delta merged the wrong way round in the square c_proj would not be).

On the GPU the model has 200 features, so that most rows do not end on a block. bitsandbytes 0.50's CPU backend
dequantizes some such weights ([200, 800], blocksize 64) otherwise than its CUDA kernels and its own generic torch
implementation (bitsandbytes.backends.default), which agree with nf4deq byte for byte (but for FP4's -0, which the
generic table holds as +0); so on the CPU the model has 192 features, and the reference is the generic
implementation, with the CUDA kernels' -0.

    python check_gpt2_layout.py NF4DEQ WORKDIR   (needs torch, safetensors, transformers, peft, bitsandbytes, numpy)
"""
import os
import shutil
import subprocess
import sys

import bitsandbytes as bnb
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [("nf4-double-bf16", torch.bfloat16, "nf4", True), ("fp4-single-fp16", torch.float16, "fp4", False)]
R, ALPHA = 4, 8


def convert(nf4deq, src, out, *extra):
    subprocess.run([nf4deq, "convert", "-q", "--device", os.environ.get("NF4DEQ_DEVICE", "cpu"), src, out, *extra],
                   check=True)


def dequantized(quantized):
    """{module name: bitsandbytes' output for its 4-bit weight, [out, in], on the CPU} (the module docstring says
    which implementation)."""
    out = {}
    for name, module in quantized.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        st = module.weight.quant_state
        if module.weight.device.type == "cuda":
            out[name] = bnb.functional.dequantize_4bit(module.weight.data, st).cpu()
            continue
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        from bitsandbytes.backends.utils import _get_4bit_code
        absmax = bnb.functional.dequantize_blockwise(st.absmax, st.state2) + st.offset if st.nested else st.absmax
        code = _get_4bit_code(st.quant_type, "cpu").clone()
        if st.quant_type == "fp4":
            code[8] = -0.0  # FP4's code 0b1000: the CUDA kernels' -0 (as tensors.expected-*), the generic table's +0
        out[name] = _dequantize_4bit_compute(module.weight.data.view(torch.uint8).reshape(-1), absmax, code,
                                             st.blocksize, st.shape, st.dtype)
    return out


def check_plain(quantized, deq, own_keys, got):
    """Names in the plain conversion `got` (name -> tensor) that are wrong: a 4-bit weight that is not bitsandbytes'
    output transposed, another tensor not the quantized checkpoint's, a name missing or not the model's own."""
    bad = []
    for name, w in deq.items():
        want, g = w.T.contiguous(), got.get(name + ".weight")
        if g is None or g.shape != want.shape or g.dtype != want.dtype or not torch.equal(
                g.view(torch.uint8), want.view(torch.uint8)):
            bad.append(name + ".weight")
    for name, t in quantized.state_dict().items():
        if name in got and name[:-len(".weight")] not in deq and not torch.equal(got[name], t.cpu()):
            bad.append(name)
    return bad + sorted(set(got) ^ own_keys)


def main():
    nf4deq, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failed = 0
    for name, dtype, quant_type, double in CONFIGS:
        d = f"{work}/{name}"
        torch.manual_seed(0)
        cfg = GPT2Config(n_embd=200 if device == "cuda" else 192, n_layer=2, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0,
                         eos_token_id=0)
        GPT2LMHeadModel(cfg).to(dtype).save_pretrained(f"{d}/hf")
        own_keys = set(load_file(f"{d}/hf/model.safetensors"))
        q = GPT2LMHeadModel.from_pretrained(f"{d}/hf", device_map=device, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
            bnb_4bit_compute_dtype=dtype))
        q.save_pretrained(f"{d}/bnb4")
        convert(nf4deq, f"{d}/bnb4", f"{d}/out")
        deq = dequantized(q)
        bad = check_plain(q, deq, own_keys, load_file(f"{d}/out/model.safetensors"))
        conv1d = len(deq)
        _, info = GPT2LMHeadModel.from_pretrained(f"{d}/out", output_loading_info=True)
        loads = not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
        print(f"{name}: {len(own_keys)} tensors, {conv1d} Conv1D weights 4-bit; {len(bad)} differ from bitsandbytes'"
              f"{': ' + ', '.join(bad[:4]) if bad else ''}; GPT2LMHeadModel loads it: {'yes' if loads else info}")
        failed += bool(bad) or not loads
        # The checkpoint's file alone, config.json beside it: the same bytes as the directory's.
        convert(nf4deq, f"{d}/bnb4/model.safetensors", f"{d}/single.safetensors")
        with open(f"{d}/single.safetensors", "rb") as f, open(f"{d}/out/model.safetensors", "rb") as g:
            same = f.read() == g.read()
        print(f"{name}: the single file, config.json beside it: {'same bytes' if same else 'DIFFERENT'}")
        failed += not same

        # A QLoRA PEFT trained on the quantized model, B random so that the merge shows.
        peft_model = get_peft_model(q, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["c_attn", "c_proj", "c_fc"],
                                                  init_lora_weights=False, lora_dropout=0.0))
        peft_model.save_pretrained(f"{d}/adapter")
        convert(nf4deq, f"{d}/bnb4", f"{d}/merged", "--lora", f"{d}/adapter")
        adapter = load_file(f"{d}/adapter/adapter_model.safetensors")
        fp32, fp64 = {}, {}
        for mname, w in deq.items():
            key = f"base_model.model.{mname}"
            a, b = adapter[key + ".lora_A.weight"], adapter[key + ".lora_B.weight"]
            scaling = ALPHA / R
            fp32[mname + ".weight"] = (w.float() + scaling * (b.float() @ a.float())).to(dtype).T.contiguous()
            fp64[mname + ".weight"] = (w.double() + scaling * (b.double() @ a.double())).to(dtype).T.contiguous()
        save_file(fp32, f"{d}/expected.fp32.safetensors")
        save_file(fp64, f"{d}/expected.fp64.safetensors")
        tol = subprocess.run([sys.executable, f"{HERE}/check_lora_tolerance.py", f"{d}/merged",
                              f"{d}/expected.fp32.safetensors", f"{d}/expected.fp64.safetensors", f"{d}/adapter",
                              f"{d}/out"], capture_output=True, text=True)
        x = torch.randint(0, cfg.vocab_size, (1, 16))
        with torch.no_grad():
            want = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(
                f"{d}/bnb4", device_map=device), f"{d}/adapter").eval()(x.to(device)).logits.float().cpu()
            merged = GPT2LMHeadModel.from_pretrained(f"{d}/merged").eval()(x).logits.float()
            plain = GPT2LMHeadModel.from_pretrained(f"{d}/out").eval()(x).logits.float()
        err, err_plain = (merged - want).abs().max().item(), (plain - want).abs().max().item()
        near = err < 0.25 * err_plain
        print(f"{name} + LoRA: tolerance {'ok' if tol.returncode == 0 else 'FAILED'} "
              f"({tol.stdout.strip().splitlines()[-1] if tol.stdout.strip() else tol.stderr.strip()[-200:]}); "
              f"logits vs PEFT's model: max |diff| {err:.4g}, without the LoRA {err_plain:.4g}: "
              f"{'near' if near else 'NOT NEAR'}")
        failed += tol.returncode != 0 or not near
    print("gpt2 layout: " + ("ok" if not failed else f"{failed} FAILED"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
