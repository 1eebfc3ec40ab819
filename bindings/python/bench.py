#!/usr/bin/env python3
"""Side-by-side timing of NF4 dequantization from PyTorch, in one process, on
the same rotated inputs: nf4deq, the Triton peer and torch.compile of the plain
formula (both from ../shared/peers/nf4_peers.py, when present), bitsandbytes'
dequantize_4bit, and the fast_dequantize sequence (Unsloth's three
bitsandbytes calls, examples/unsloth_puzzle_harness.py).

Two timings per candidate and shape:
  graph  device time: CUDA-graph replays of one call per rotated input set,
         the rotation repeated to at least 48 calls per graph (fewer where
         their outputs would pass 2 GiB), queued back to back behind an
         untimed replay, each between its own pair of events, per call (median
         over replays). Queued, the device never waits for the host to launch
         the next replay; each replay's own fixed cost on the device is
         spread over its calls, as the 24 launches of a replay in `nf4deq
         bench` spread it, so the time is nearly the kernels' alone;
  eager  what a Python loop pays: 200 calls back to back, no sync in between,
         host clock from the first call to the end of the last, per call
         (median over repeats). Where the host is slower than the device, this
         is the host cost.
The floor of the eager path is measured in the same run: an empty kernel
launched through the same route as nf4deq's (the _nf4deq_launch extension, or
ctypes where it was not built; the ctypes floor is printed beside it).

Every output is compared byte for byte with dequantize_4bit's.

Run from the repository root, after `make`:
    python3 bindings/python/bench.py [--json FILE]   (torch, and bitsandbytes for its rows, installed)
Options: --shapes puzzle|issue|all (default all), --replays N (50), --calls N
(200), --repeats N (5), --peers DIR (default ../shared/peers).
"""
import argparse
import ctypes
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import bitsandbytes.functional as bnbF  # noqa: E402

import nf4deq  # noqa: E402
from nf4deq import _torch as nf4t  # noqa: E402

# The puzzle's nine matrices (three MLPs: gate, up, down), then the issue's
# two small bf16 shapes stand among them.
PUZZLE = [((8192, 2048), torch.float16), ((8192, 2048), torch.float16), ((2048, 8192), torch.float16),
          ((4096, 1024), torch.bfloat16), ((4096, 1024), torch.bfloat16), ((1024, 4096), torch.bfloat16),
          ((14336, 4096), torch.bfloat16), ((14336, 4096), torch.bfloat16), ((4096, 14336), torch.bfloat16)]
ISSUE = [((8192, 2048), torch.float16), ((4096, 1024), torch.bfloat16), ((1024, 4096), torch.bfloat16),
         ((14336, 4096), torch.bfloat16)]
NF4_LUT = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]


def load_peers(folder):
    path = Path(folder) / "nf4_peers.py"
    if not path.is_file():
        print(f"notice: {path} not found: the Triton and torch.compile peers are skipped", file=sys.stderr)
        return None
    spec = importlib.util.spec_from_file_location("nf4_peers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class InputSet:
    """One quantized weight: bitsandbytes' own quantize_4bit of random data."""

    def __init__(self, shape, dtype, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
        self.q, self.qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        self.shape, self.dtype = shape, dtype
        st2 = self.qs.state2
        self.code2, self.absmax2, self.absmax = st2.code, st2.absmax, self.qs.absmax
        self.offset = self.qs.offset.float().reshape(())  # a 0-dim fp32 tensor on the GPU, as the peers take
        self.lut = torch.tensor(NF4_LUT, device="cuda")
        self.ref = bnbF.dequantize_4bit(self.q, self.qs)


def candidates(peers, unsloth):
    c = {
        "nf4deq": lambda s: nf4deq.dequantize(s.q, s.qs),
        "bitsandbytes": lambda s: bnbF.dequantize_4bit(s.q, s.qs),
        "fast_dequantize seq": lambda s: unsloth(s.q, s.qs),
    }
    if peers is not None:
        c["triton peer"] = lambda s: peers.triton_dq(s.q, s.absmax, s.code2, s.absmax2, s.offset, s.lut,
                                                     s.shape, s.dtype)
        c["torch.compile"] = lambda s: peers.compiled(s.q, s.absmax, s.code2, s.absmax2, s.offset, s.lut,
                                                      s.shape, s.dtype)
    return c


GRAPH_CALLS = 48                 # calls per captured graph, at least
GRAPH_OUT_BYTES = 2 << 30        # ... unless their outputs (each kept) pass this


def graph_us(fn, sets, replays, stream, out_bytes):
    """Device time per call: a graph of the input sets' calls, the rotation
    repeated to GRAPH_CALLS calls, replayed. Every call keeps its own output, as
    eager calls would. Captured on `stream`, the one the candidates were made on
    (the fast_dequantize sequence reads its stream once, as Unsloth's does)."""
    passes = max(1, min(-(-GRAPH_CALLS // len(sets)), GRAPH_OUT_BYTES // (len(sets) * out_bytes)))
    calls = [s for _ in range(passes) for s in sets]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:  # warm-up outside the capture (compiles, caches)
            fn(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        outs = [fn(s) for s in calls]
    del outs
    g.replay()
    torch.cuda.synchronize()
    # Every replay is queued at once, behind an untimed one: a replay that is
    # launched only after the previous one finished would leave the device idle
    # between its start event and its first kernel for as long as the host takes
    # to launch it, and count that as device time.
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    g.replay()
    for start, end in events:
        start.record()
        g.replay()
        end.record()
    torch.cuda.synchronize()
    per_call = [start.elapsed_time(end) * 1000.0 / len(calls) for start, end in events]
    return statistics.median(per_call)


def eager_us(fn, sets, calls, repeats):
    """Host clock per call, `calls` calls back to back, no sync in between."""
    k = len(sets)
    for i in range(k):
        fn(sets[i])
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(sets[i % k])
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_call)


def empty_launch_fn(route=None):
    """nf4deq's empty-kernel entry through its eager route (the extension, or
    ctypes where it was not built); route="ctypes" forces ctypes."""
    ext = nf4t._ext if route != "ctypes" else None
    return ext.empty_cuda if ext is not None else nf4deq.load_library().nf4deq_empty_cuda


def floor_us(calls, repeats, route=None):
    """An empty kernel through nf4deq's route (see empty_launch_fn) on the
    current raw stream."""
    empty = empty_launch_fn(route)
    raw_stream, dev = nf4t._raw_stream, torch.cuda.current_device()
    per_call = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            if empty(raw_stream(dev)):
                raise RuntimeError(nf4deq.last_error())
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_call[1:])


def host_breakdown(s, calls):
    """Where nf4deq's eager call spends its host time: each piece alone, per
    call, timed as the eager loop is (a warm cache entry, no sync)."""
    dev = torch.cuda.current_device()
    out = torch.empty(s.shape, dtype=s.dtype, device="cuda")
    e = nf4t._cache.get(id(s.qs)) or nf4t._cached_entry(s.qs)
    wptr, optr = s.q.data_ptr(), out.data_ptr()

    def per_call(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6 / calls

    cuda_dev = torch.device("cuda", dev)
    template = torch.empty(0, dtype=s.dtype, device=cuda_dev)
    expanded = torch.empty((), dtype=s.dtype, device=cuda_dev).expand(s.shape)
    # A 64-element job: the device is never the limit, so this is the host
    # cost of the library call itself, by each route.
    tiny = nf4t._lib.State(e.state.absmax, e.state.nested_absmax, e.state.nested_code,
                           e.state.nested_offset_device, 64, e.state.nested_offset, e.state.blocksize,
                           e.state.nested_blocksize, e.state.quant_type, e.state.out_dtype)
    tiny_addr, ctypes_fn = ctypes.addressof(tiny), nf4deq.load_library().nf4deq_dequantize_cuda_state
    routes = {}
    if nf4t._ext is not None:
        routes["extension call, 64 elements"] = per_call(
            lambda: nf4t._ext.dequantize_cuda_state(tiny_addr, wptr, optr, nf4t._raw_stream(dev)))
    routes["ctypes call, 64 elements"] = per_call(
        lambda: ctypes_fn(tiny_addr, wptr, optr, nf4t._raw_stream(dev)))
    def python_path(fn):
        """fn timed with the extension's cached call switched off: every call
        through nf4deq/_torch.py's Python path, as before the extension made them."""
        saved = nf4t._eager_cached
        nf4t._eager_cached = None
        try:
            return fn()
        finally:
            nf4t._eager_cached = saved

    # The Python path and the allocation without the launch: min() stands in
    # for the library call (four integers in, 0 out: the default stream's handle).
    def wrapper_only():
        saved = nf4t._cuda_state_fn
        nf4t._cuda_state_fn = min
        try:
            return per_call(lambda: nf4deq.dequantize(s.q, s.qs)) if nf4t._raw_stream(dev) == 0 else float("nan")
        finally:
            nf4t._cuda_state_fn = saved
    routes["Python path without the launch"] = python_path(wrapper_only)
    routes["is_compiling"] = per_call(nf4t._is_compiling)
    empty = empty_launch_fn()
    routes["empty launch"] = per_call(lambda: empty(nf4t._raw_stream(dev)))
    return {**routes,
        "torch.empty(device=torch.device)": per_call(lambda: torch.empty(s.shape, dtype=s.dtype, device=cuda_dev)),
        "torch.empty(device=int)": per_call(lambda: torch.empty(s.shape, dtype=s.dtype, device=dev)),
        "new_empty": per_call(lambda: template.new_empty(s.shape)),
        "empty_like of the expanded template (what nf4deq allocates with)":
            per_call(lambda: torch.empty_like(expanded, memory_format=torch.contiguous_format)),
        "raw stream": per_call(lambda: nf4t._raw_stream(dev)),
        "library call, state": per_call(lambda: nf4t._cuda_state_fn(e.state_addr, wptr, optr,
                                                                    nf4t._raw_stream(dev))),
        "cache check": per_call(lambda: e.sources_match(s.qs)),
        "dequantize(out=)": per_call(lambda: nf4deq.dequantize(s.q, s.qs, out=out)),
        "dequantize(), Python path": python_path(lambda: per_call(lambda: nf4deq.dequantize(s.q, s.qs))),
        **cached_call_pieces(s, per_call),
        "dequantize()": per_call(lambda: nf4deq.dequantize(s.q, s.qs)),
    }


def cached_call_pieces(s, per_call):
    """The extension's cached call (nf4deq/_launch.c eager_cached) on its own,
    without dequantize() around it; and once more with its entry pointing at a
    copy of the state with n = 0, which the library returns from before any
    CUDA call: the checks and the allocation without the launch."""
    if nf4t._eager_cached is None:
        return {}
    nf4deq.dequantize(s.q, s.qs)
    nf4deq.dequantize(s.q, s.qs)  # the second call with this weight hands it to the extension
    key = id(s.qs)
    entry = nf4t._fast_cache.get(key)
    if entry is None:
        return {}
    i = nf4t._ext.FAST_STATE_ADDR
    real = nf4t._lib.State.from_address(entry[i])
    zero = nf4t._lib.State.from_buffer_copy(real)
    zero.n = 0
    pieces = {"cached call alone": per_call(lambda: nf4t._eager_cached(s.q, s.qs))}
    nf4t._fast_cache[key] = entry[:i] + (ctypes.addressof(zero),) + entry[i + 1:]
    try:
        pieces["cached call, n = 0 (no launch)"] = per_call(lambda: nf4t._eager_cached(s.q, s.qs))
    finally:
        nf4t._fast_cache[key] = entry
    return pieces


def same_bytes(x, y):
    return x.dtype == y.dtype and x.numel() == y.numel() and torch.equal(
        x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32).flatten(),
        y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32).flatten())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=("puzzle", "issue", "all"), default="all")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peers", default=str(ROOT.parent / "shared" / "peers"))
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.py: no CUDA device", file=sys.stderr)
        return 2
    peers = load_peers(a.peers)
    from unsloth_puzzle_harness import UnslothEquivalent
    cands = candidates(peers, UnslothEquivalent())
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):
        graph_cands = candidates(peers, UnslothEquivalent())
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    shapes = {"puzzle": PUZZLE, "issue": ISSUE, "all": None}[a.shapes]
    if shapes is None:
        shapes = PUZZLE + [s for s in ISSUE if s not in PUZZLE]
    floor = floor_us(a.calls, a.repeats)
    floor_ctypes = floor_us(a.calls, a.repeats, "ctypes")
    print(f"bench.py: {props.name}, torch {torch.__version__}, nf4deq {nf4deq.version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"nf4deq's eager route: {nf4deq.launch_route()}")
    print(f"empty kernel through nf4deq's route (raw stream): {floor:.2f} us per call; "
          f"through ctypes: {floor_ctypes:.2f}")
    rows, seen = [], set()
    for si, (shape, dtype) in enumerate(shapes):
        key = (shape, dtype)
        puzzle_only_repeat = key in seen
        seen.add(key)
        out_bytes = shape[0] * shape[1] * 2
        nsets = max(2, -(-2 * l2 // (out_bytes + out_bytes // 4)))  # rotate through twice L2
        sets = [InputSet(shape, dtype, 1000 * si + k) for k in range(nsets)]
        row = {"shape": f"{shape[0]}x{shape[1]}", "dtype": str(dtype).replace("torch.", ""), "sets": nsets,
               "puzzle": True if a.shapes != "issue" and si < len(PUZZLE) else False, "results": {}}
        for name, fn in cands.items():
            try:
                ident = all(same_bytes(fn(s), s.ref) for s in sets[:2])
                g = graph_us(graph_cands[name], sets, a.replays, capture, out_bytes)
                e = eager_us(fn, sets, a.calls, a.repeats)
            except Exception as ex:  # a peer that cannot run here is reported, not fatal
                row["results"][name] = {"error": f"{type(ex).__name__}: {ex}"}
                continue
            row["results"][name] = {"graph_us": g, "eager_us": e, "identical": ident}
        if not puzzle_only_repeat and "graph_us" in row["results"].get("nf4deq", {}):
            row["host"] = host_breakdown(sets[0], a.calls * 5)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    names = list(cands)
    print(f"\n{'shape':18s} " + " ".join(f"{n:>21s}" for n in names))
    print(f"{'':18s} " + " ".join(f"{'graph / eager us':>21s}" for _ in names))
    totals = {n: [0.0, 0.0] for n in names}
    for r in rows:
        cells = []
        for n in names:
            x = r["results"].get(n, {})
            if "error" in x:
                cells.append(f"{'error':>21s}")
                continue
            mark = "" if x["identical"] else "*"
            cells.append(f"{x['graph_us']:8.2f} / {x['eager_us']:7.2f}{mark:1s}  ")
            if r["puzzle"]:
                totals[n][0] += x["graph_us"]
                totals[n][1] += x["eager_us"]
        print(f"{r['shape'] + ' ' + r['dtype']:18s} " + " ".join(cells))
    if a.shapes != "issue":
        print(f"{'puzzle total (9)':18s} " + " ".join(f"{totals[n][0]:8.1f} / {totals[n][1]:7.1f}   " for n in names))
    print("\n* not byte-identical to bitsandbytes.functional.dequantize_4bit")
    print("nf4deq eager minus graph, per shape (the host cost above the device time), and the empty-launch floor:")
    for r in rows:
        x = r["results"].get("nf4deq", {})
        if "graph_us" in x:
            print(f"  {r['shape']} {r['dtype']}: +{x['eager_us'] - x['graph_us']:.2f} us")
    print("nf4deq's host time, piece by piece (us per call, no sync):")
    for r in rows:
        if "host" in r:
            print(f"  {r['shape']} {r['dtype']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host"].items()))
    if "triton peer" in names:
        print("nf4deq vs the Triton peer (graph): " + ", ".join(
            f"{r['shape']} {r['results']['triton peer']['graph_us'] / r['results']['nf4deq']['graph_us']:.3f}x"
            for r in rows if "graph_us" in r["results"].get("triton peer", {})
            and "graph_us" in r["results"].get("nf4deq", {})))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": props.name, "route": nf4deq.launch_route(), "floor_us": floor,
                       "floor_ctypes_us": floor_ctypes, "rows": rows}, f, indent=2)
    return 0 if all(x.get("identical", True) for r in rows for n, x in r["results"].items()
                    if n in ("nf4deq", "fast_dequantize seq")) else 1


if __name__ == "__main__":
    sys.exit(main())
