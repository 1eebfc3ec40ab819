"""Host time per call of the eager patterns a PyTorch user writes, on one
weight (4096x1024 bf16 by default: NF4, double quant), no sync in between,
median over interleaved rounds:

  dequantize(W, qs)                      the common call (bench.py's eager column)
  fast_dequantize(W, qs)                 Unsloth's drop-in, the same call
  fast_dequantize(W.t(), qs, use_global_buffer=True)
                                         what Unsloth's matmul_lora does: a new
                                         W.t() view on every call, the output in
                                         the per-device buffer
  fast_dequantize(W.t(), qs)             the same into a new tensor
  dequantize(W, qs, out=...)             into the caller's tensor

each on the plain packed tensor W, and the W.t() patterns also on a
bitsandbytes Params4bit P over the same bytes, which is what matmul_lora gets
(base_layer.weight; P.t() goes through Params4bit's __torch_function__ and is
a plain tensor). As reference points, PyTorch's own pieces: an empty kernel
through nf4deq's route, the allocation nf4deq uses, the views a call makes,
and P.t() itself, which the caller pays.

It imports whichever nf4deq comes first on PYTHONPATH (and the library
NF4DEQ_LIBRARY names), so two versions of the package can be timed on one
machine, one process each (tests/gpu/device-python.sh patterns DIR):
    PYTHONPATH=.carry/py:bindings/python python3 tests/perf/eager_patterns.py [--shape 4096x1024] [--rounds 7]
Prints one line per pattern: median and min in us per call.
"""
import argparse
import statistics
import time

import torch
import bitsandbytes.functional as bnbF
from bitsandbytes.nn import Params4bit

import nf4deq
from nf4deq import _torch as nf4t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    W, qs = bnbF.quantize_4bit(torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16),
                               blocksize=64, compress_statistics=True, quant_type="nf4")
    P = Params4bit(W.clone(), requires_grad=False, quant_state=qs, bnb_quantized=True, quant_type="nf4")
    ref = bnbF.dequantize_4bit(W, qs)
    out = torch.empty_like(ref)
    # Every pattern must return what bitsandbytes does before it is timed.
    t_ref = bnbF.dequantize_4bit(W.t(), qs)
    for got, want in ((nf4deq.dequantize(W, qs), ref), (nf4deq.fast_dequantize(W.t(), qs), t_ref),
                      (nf4deq.fast_dequantize(W.t(), qs, use_global_buffer=True), t_ref),
                      (nf4deq.fast_dequantize(P.t(), qs), t_ref),
                      (nf4deq.fast_dequantize(P.t(), qs, use_global_buffer=True), t_ref)):
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(
            got.view(torch.int16), want.view(torch.int16)), "an output differs from bitsandbytes'"
    dev = torch.cuda.current_device()
    ext = nf4t._ext
    empty = ext.empty_cuda if ext is not None else nf4deq.load_library().nf4deq_empty_cuda
    expanded = torch.empty((), dtype=torch.bfloat16, device="cuda").expand(shape)
    view = torch.empty(shape[0] * shape[1], dtype=torch.bfloat16, device="cuda")[: shape[0] * shape[1]].view(shape)
    patterns = {
        "dequantize(W, qs)": lambda: nf4deq.dequantize(W, qs),
        "fast_dequantize(W, qs)": lambda: nf4deq.fast_dequantize(W, qs),
        "fast_dequantize(W.t(), qs, use_global_buffer=True)":
            lambda: nf4deq.fast_dequantize(W.t(), qs, use_global_buffer=True),
        "fast_dequantize(W.t(), qs)": lambda: nf4deq.fast_dequantize(W.t(), qs),
        "dequantize(W, qs, out=out)": lambda: nf4deq.dequantize(W, qs, out=out),
        "fast_dequantize(P.t(), qs, use_global_buffer=True), P a Params4bit":
            lambda: nf4deq.fast_dequantize(P.t(), qs, use_global_buffer=True),
        "fast_dequantize(P.t(), qs), P a Params4bit": lambda: nf4deq.fast_dequantize(P.t(), qs),
        "reference: empty kernel through the route": lambda: empty(nf4t._raw_stream(dev)),
        "reference: empty_like of the expanded template":
            lambda: torch.empty_like(expanded, memory_format=torch.contiguous_format),
        "reference: W.t()": lambda: W.t(),
        "reference: P.t(), P a Params4bit": lambda: P.t(),
        "reference: view[...]": lambda: view[...],
        "reference: view.view_as(view)": lambda: view.view_as(view),
        "reference: view.detach()": lambda: view.detach(),
        "reference: view.view(shape)": lambda: view.view(shape),
        "reference: buffer[:n].view(shape)": lambda: view.view(-1)[: shape[0] * shape[1]].view(shape),
    }
    times = {k: [] for k in patterns}
    for _ in range(a.rounds):
        for k, fn in patterns.items():
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) * 1e6 / a.calls)
    print(f"eager_patterns: {torch.cuda.get_device_name()}, torch {torch.__version__}, nf4deq from "
          f"{nf4deq.__file__} ({nf4deq.library_path()}), {nf4deq.launch_route()}, {a.shape} bf16, {a.rounds} rounds x {a.calls} calls")
    for k, v in times.items():
        print(f"  {k:70s} {statistics.median(v):7.2f} us  (min {min(v):.2f})")


if __name__ == "__main__":
    main()
