#!/usr/bin/env python3
"""Unsloth puzzle A (`test_dequantize`), with nf4deq as the candidate.

Builds the puzzle's three bitsandbytes Linear4bit MLPs (NF4, double quant,
blocksize 64) and, for each:
  1. runs the puzzle's checks (torch.testing.assert_close of the MLP forward
     against bitsandbytes' own Linear4bit forward, and of every dequantized
     matrix against the fast_dequantize sequence), plus an exact byte check
     against bitsandbytes.functional.dequantize_4bit;
  2. times the puzzle's loop: 1000 iterations of dequantizing up, gate and
     down, each followed by torch.cuda.synchronize(), with time.perf_counter,
     for nf4deq, for the fast_dequantize-equivalent sequence and for plain
     dequantize_4bit, in the same process;
  3. runs the MLP forward with nf4deq's op under torch.compile(fullgraph=True),
     compares it with eager, and counts graph breaks with torch._dynamo.explain.

Run from the repository root, after `make` and `pip install torch bitsandbytes`
(the script puts bindings/python on sys.path itself):
    python examples/unsloth_puzzle_harness.py
Options: --iters N (1000), --repeats R (3: each method timed R times, the
median reported), --no-compile, --cpu-smoke (tiny shapes on the CPU, no timing
claims: checks that the script itself runs where there is no GPU).

Exit status: 0 when every weight is byte-identical to bitsandbytes, every
puzzle check passes and no graph breaks; 1 otherwise. The speedup is reported
against the puzzle's bar (1.15x) and this project's target (1.5x) but does not
change the exit status.
"""
import argparse
import ctypes
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbF  # noqa: E402
from bitsandbytes.nn import Linear4bit  # noqa: E402

import nf4deq  # noqa: E402

try:
    from transformers import set_seed
    from transformers.activations import ACT2FN

    ACT = ACT2FN["silu"]
except ImportError:  # the puzzle uses transformers; these are equivalent
    def set_seed(seed):
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)

    ACT = nn.SiLU()

OPTIONS = [  # (bsz, qlen, hd, m, seed, dtype): the puzzle's three MLPs
    (2, 3333, 2048, 8192, 3407, torch.float16),
    (5, 777, 1024, 4096, 3409, torch.bfloat16),
    (3, 2048, 4096, 14336, 3408, torch.bfloat16),
]
SMOKE_OPTIONS = [(2, 33, 128, 256, 3407, torch.float16), (1, 17, 64, 128, 3409, torch.bfloat16)]
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# The fast_dequantize-equivalent: Unsloth's fast_dequantize (unsloth/kernels/
# utils.py, CUDA branch) re-written from its description, the same sequence of
# bitsandbytes C calls: absmax codes -> fp32 (cdequantize_blockwise_fp32),
# `+= offset` (a PyTorch kernel), then cdequantize_blockwise_{fp16,bf16}_nf4.
# Like Unsloth it runs under torch.inference_mode, reads the streams once at
# start-up, and allocates the output and the fp32 absmax on every call unless
# use_global_buffer.


class UnslothEquivalent:
    def __init__(self):
        lib = bnbF.lib
        self.dq_absmax = lib.cdequantize_blockwise_fp32
        self.dq_fp16 = lib.cdequantize_blockwise_fp16_nf4
        self.dq_bf16 = lib.cdequantize_blockwise_bf16_nf4
        n = torch.cuda.device_count()
        self.streams = tuple(ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(i)) for i in range(n))
        self.weight_buffers = [None] * n
        self.absmax_buffers = [None] * n
        self.device_ctx = torch.cuda.device if n > 1 else (lambda _d: nullcontext())

    @torch.inference_mode()
    def __call__(self, W, quant_state=None, out=None, use_global_buffer=False):
        if quant_state is None:
            return W
        if type(quant_state) is not list:
            absmax, shape, dtype = quant_state.absmax, quant_state.shape, quant_state.dtype
            blocksize, offset, state2 = quant_state.blocksize, quant_state.offset, quant_state.state2
            absmax2, code2, blocksize2 = state2.absmax, state2.code, state2.blocksize
        else:  # the bitsandbytes < 0.41 list form
            absmax, shape, dtype, blocksize, compressed_stats, _, _ = quant_state
            offset, state2 = compressed_stats
            absmax2, code2, blocksize2, _, _, _, _ = state2
        device = W.device
        stream = self.streams[device.index]
        n_absmax = absmax.numel()
        if use_global_buffer:
            size = shape[0] * shape[1]
            wbuf, abuf = self.weight_buffers[device.index], self.absmax_buffers[device.index]
            if wbuf is None or wbuf.dtype != dtype:
                wbuf = torch.empty(size, dtype=dtype, device=device, requires_grad=False)
                abuf = torch.empty(n_absmax, dtype=torch.float32, device=device, requires_grad=False)
                self.weight_buffers[device.index], self.absmax_buffers[device.index] = wbuf, abuf
            if size > wbuf.numel():
                wbuf.resize_(size)
            if n_absmax > abuf.numel():
                abuf.resize_(n_absmax)
            out = wbuf[:size].view(shape)
            out_absmax = abuf[:n_absmax]
        else:
            if out is None:
                out = torch.empty(shape, dtype=dtype, device=device, requires_grad=False)
            else:
                assert out.shape == shape and out.dtype == dtype
            out_absmax = torch.empty(n_absmax, dtype=torch.float32, device=device, requires_grad=False)
        get_ptr = bnbF.get_ptr
        ptr_out_absmax = get_ptr(out_absmax)
        with self.device_ctx(device):
            self.dq_absmax(get_ptr(code2), get_ptr(absmax), get_ptr(absmax2), ptr_out_absmax,
                           ctypes.c_int(blocksize2), ctypes.c_int(n_absmax), stream)
            out_absmax += offset
            fx = self.dq_fp16 if dtype == torch.float16 else self.dq_bf16
            fx(get_ptr(None), get_ptr(W), ptr_out_absmax, get_ptr(out), ctypes.c_int(blocksize),
               ctypes.c_int(out.numel()), stream)
        return out.t() if W.shape[0] == 1 else out


# ---------------------------------------------------------------------------
# The puzzle's own pieces.


def bnb_Linear4bit(hd, m, dtype=torch.float16):
    return Linear4bit(hd, m, bias=None, compute_dtype=dtype, compress_statistics=True, quant_type="nf4")


class MLP(nn.Module):
    def __init__(self, hd=4096, m=14336, dtype=torch.float16):
        super().__init__()
        self.gate_proj = bnb_Linear4bit(hd, m, dtype=dtype).to(DEVICE)  # .to() quantizes
        self.up_proj = bnb_Linear4bit(hd, m, dtype=dtype).to(DEVICE)
        self.down_proj = bnb_Linear4bit(m, hd, dtype=dtype).to(DEVICE)
        # As the puzzle does (18 Feb 2025): the weights were quantized from fp32.
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            p.weight.quant_state.dtype = dtype
        self.act_fn = ACT

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def mlp_forward(X, mlp, fx):
    up = X @ fx(mlp.up_proj).t()
    gate = X @ fx(mlp.gate_proj).t()
    h = mlp.act_fn(gate) * up
    return h @ fx(mlp.down_proj).t()


def mlp_dequantize(X, mlp, fx):
    a = fx(mlp.up_proj).t()
    sync()
    b = fx(mlp.gate_proj).t()
    sync()
    c = fx(mlp.down_proj).t()
    sync()
    return a, b, c


def assert_same(x, y, dtype):
    assert x.dtype == dtype, f"dtype {x.dtype} != {dtype}"
    torch.testing.assert_close(x, y, check_stride=True)


def assert_correct_bnb(weight, dtype):
    qs = weight.weight.quant_state
    assert weight.weight.dtype == torch.uint8
    assert qs.dtype == dtype
    assert qs.absmax.dtype == torch.uint8
    assert qs.code.dtype == torch.float32
    assert qs.offset.dtype == torch.float32
    assert qs.blocksize == 64
    assert qs.state2.absmax.dtype == torch.float32
    assert qs.state2.code.dtype == torch.float32
    assert qs.state2.blocksize == 256


# ---------------------------------------------------------------------------


class Report:
    def __init__(self):
        self.failures = []

    def check(self, label, fn):
        """Runs fn (which asserts or returns a bool); prints PASS/FAIL."""
        try:
            ok = fn()
            ok = True if ok is None else bool(ok)
            err = ""
        except Exception as e:  # noqa: BLE001  (a failed check is reported, not fatal)
            ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"  {'PASS' if ok else 'FAIL'} {label}" + (f"  [{err}]" if err else ""))
        if not ok:
            self.failures.append(label)
        return ok


def same_bytes(x, y):
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(view), y.view(view))


def time_loop(X, mlp, fx, iters):
    for _ in range(10):  # warm-up: allocator, caches, clocks
        mlp_dequantize(X, mlp, fx)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        mlp_dequantize(X, mlp, fx)
    return time.perf_counter() - start


def compile_check(rep, X, mlp, dt, label):
    """The MLP forward with nf4deq's op inside torch.compile(fullgraph=True)."""
    def forward(x):
        def w(p):
            return nf4deq.dequantize(p.weight, p.weight.quant_state).t()

        h = torch.nn.functional.silu(x @ w(mlp.gate_proj)) * (x @ w(mlp.up_proj))
        return h @ w(mlp.down_proj)

    def weights():
        return tuple(nf4deq.dequantize(p.weight, p.weight.quant_state)
                     for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    result = {"breaks": None}

    def explain():
        torch._dynamo.reset()
        ex = torch._dynamo.explain(forward)(X)
        result["breaks"] = ex.graph_break_count
        print(f"    explain: graph_count={ex.graph_count} graph_break_count={ex.graph_break_count} "
              f"ops={ex.op_count}" + (f" reasons={[str(r.reason) for r in ex.break_reasons]}" if ex.break_reasons else ""))
        return ex.graph_break_count == 0

    rep.check(f"{label}: torch._dynamo.explain finds no graph break", explain)

    def compiled_forward():
        torch._dynamo.reset()
        t0 = time.perf_counter()
        y = torch.compile(forward, fullgraph=True)(X)
        sync()
        y0 = forward(X)
        err = ((y.float() - y0.float()).abs().max() / y0.float().abs().max()).item()
        print(f"    compiled forward: {time.perf_counter() - t0:.1f} s to compile and run; "
              f"bitwise equal to eager: {torch.equal(y, y0)}; max|diff|/max|eager| = {err:.2e}")
        assert y.dtype == dt and y.shape == y0.shape
        return err < 1e-2  # inductor fuses silu*mul in fp32, so not always bit-equal to eager

    rep.check(f"{label}: torch.compile(fullgraph=True) forward matches eager", compiled_forward)

    def compiled_weights():
        torch._dynamo.reset()
        got = torch.compile(weights, fullgraph=True)()
        want = [bnbF.dequantize_4bit(p.weight, p.weight.quant_state) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        return all(same_bytes(g, w) for g, w in zip(got, want))

    rep.check(f"{label}: compiled nf4deq op output byte-identical to dequantize_4bit", compiled_weights)
    return result["breaks"]


def main():
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    options = OPTIONS
    if args.cpu_smoke:
        DEVICE, options, args.iters, args.repeats = "cpu", SMOKE_OPTIONS, min(args.iters, 20), 1
    elif not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --cpu-smoke to check the script alone)")
        return 1

    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__}, nf4deq {nf4deq.version()} "
          f"({nf4deq.library_path()})")
    if DEVICE == "cuda":
        print(f"device: {torch.cuda.get_device_name()}; iterations {args.iters}, repeats {args.repeats} (median)")
    unsloth = UnslothEquivalent() if DEVICE == "cuda" else None

    methods = {
        "nf4deq": lambda p: nf4deq.fast_dequantize(p.weight, p.weight.quant_state),
        "fast_dequantize-eq": (lambda p: unsloth(p.weight, p.weight.quant_state)) if unsloth else None,
        "dequantize_4bit": lambda p: bnbF.dequantize_4bit(p.weight, p.weight.quant_state),
    }
    # Informational variants (not in the verdict): preallocated/global buffers.
    extras = {
        "nf4deq use_global_buffer": lambda p: nf4deq.fast_dequantize(p.weight, p.weight.quant_state,
                                                                   use_global_buffer=True),
        "fast_dequantize-eq use_global_buffer": (lambda p: unsloth(p.weight, p.weight.quant_state,
                                                                   use_global_buffer=True)) if unsloth else None,
    }
    rep = Report()
    rows = []
    for i, (bsz, qlen, hd, m, seed, dt) in enumerate(options):
        label = f"MLP{i + 1} ({bsz},{qlen},{hd},{m}) {str(dt).replace('torch.', '')}"
        print(f"\n{label}")
        set_seed(seed)
        torch.set_default_dtype(torch.float32)
        mlp = MLP(hd=hd, m=m, dtype=dt)
        X = torch.randn((bsz, qlen, hd), device=DEVICE, dtype=dt)
        sync()
        projs = (mlp.up_proj, mlp.gate_proj, mlp.down_proj)
        nf, ref = methods["nf4deq"], methods["fast_dequantize-eq"] or methods["dequantize_4bit"]
        identical = True
        for _ in range(2):  # the puzzle's two warm-up rounds, with its checks
            reference_forward = mlp(X) if DEVICE == "cuda" else mlp_forward(X, mlp, methods["dequantize_4bit"])
            rep.check(f"{label}: assert_close(mlp_forward(nf4deq), Linear4bit forward)",
                      lambda: assert_same(mlp_forward(X, mlp, nf), reference_forward, dt))
            rep.check(f"{label}: assert_correct_bnb (up, gate, down)",
                      lambda: [assert_correct_bnb(p, dt) for p in projs] and None)
            got, want = mlp_dequantize(X, mlp, nf), mlp_dequantize(X, mlp, ref)
            for name, g, w in zip(("up", "gate", "down"), got, want):
                rep.check(f"{label}: assert_close({name}: nf4deq, fast_dequantize-eq)", lambda: assert_same(g, w, dt))
        for name, p in zip(("up", "gate", "down"), projs):
            ok = rep.check(f"{label}: {name} byte-identical to bitsandbytes.functional.dequantize_4bit",
                           lambda: same_bytes(nf(p), methods["dequantize_4bit"](p)))
            identical &= ok
            if unsloth:  # informational: the bnb sequence itself must agree with bnb
                print(f"    (fast_dequantize-eq byte-identical to dequantize_4bit for {name}: "
                      f"{same_bytes(ref(p), methods['dequantize_4bit'](p))})")

        times = {}
        order = [k for k, f in {**methods, **extras}.items() if f is not None]
        samples = {k: [] for k in order}
        for r in range(args.repeats):
            for k in order[r % len(order):] + order[: r % len(order)]:  # rotate to spread drift
                fx = methods.get(k) or extras[k]
                samples[k].append(time_loop(X, mlp, fx, args.iters))
        for k in order:
            times[k] = statistics.median(samples[k])
            print(f"    {k:40s} {times[k]:8.4f} s  (runs: {', '.join(f'{t:.4f}' for t in samples[k])})")
        breaks = None
        if not args.no_compile:
            breaks = compile_check(rep, X, mlp, dt, label)
        rows.append((label, times, identical, breaks))
        del mlp, X
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    # ---- summary
    print("\n==== summary ====")
    hdr = f"{'':40s} {'nf4deq s':>9s} {'fast_deq-eq s':>13s} {'deq_4bit s':>10s} {'x fast':>7s} {'x bnb':>6s} {'identical':>9s} {'breaks':>6s}"
    print(hdr)
    tot = {"nf4deq": 0.0, "fast_dequantize-eq": 0.0, "dequantize_4bit": 0.0}
    for label, times, identical, breaks in rows:
        for k in tot:
            tot[k] += times.get(k, float("nan"))
        fe = times.get("fast_dequantize-eq", float("nan"))
        print(f"{label:40s} {times['nf4deq']:9.4f} {fe:13.4f} {times['dequantize_4bit']:10.4f} "
              f"{fe / times['nf4deq']:6.2f}x {times['dequantize_4bit'] / times['nf4deq']:5.2f}x "
              f"{'yes' if identical else 'NO':>9s} {('-' if breaks is None else breaks)!s:>6s}")
    speed_fast = tot["fast_dequantize-eq"] / tot["nf4deq"]
    speed_bnb = tot["dequantize_4bit"] / tot["nf4deq"]
    all_identical = all(r[2] for r in rows)
    total_breaks = None if args.no_compile else sum(r[3] or 0 for r in rows) + sum(r[3] is None for r in rows)
    print(f"{'TOTAL':40s} {tot['nf4deq']:9.4f} {tot['fast_dequantize-eq']:13.4f} {tot['dequantize_4bit']:10.4f} "
          f"{speed_fast:6.2f}x {speed_bnb:5.2f}x {'yes' if all_identical else 'NO':>9s} "
          f"{('-' if total_breaks is None else total_breaks)!s:>6s}")
    print(f"\nspeedup vs fast_dequantize-eq: {speed_fast:.3f}x "
          f"(puzzle bar 1.15x: {'MET' if speed_fast >= 1.15 else 'MISSED'}; target 1.5x: "
          f"{'MET' if speed_fast >= 1.5 else 'MISSED'})")
    print(f"speedup vs dequantize_4bit:     {speed_bnb:.3f}x")
    print(f"byte-identical to dequantize_4bit: {'yes' if all_identical else 'NO'}")
    print(f"graph breaks under torch.compile(fullgraph=True): "
          f"{'not run' if total_breaks is None else total_breaks}")
    ok = all_identical and not rep.failures and (total_breaks in (None, 0))
    if rep.failures:
        print(f"failed checks ({len(rep.failures)}): " + "; ".join(rep.failures))
    print("RESULT: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
