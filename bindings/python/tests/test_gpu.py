"""nf4deq's GPU ABI and Python package against bitsandbytes, on a CUDA device.

    python bindings/python/tests/test_gpu.py [-v] [--device cpu]

Every output is compared with bitsandbytes.functional.dequantize_4bit bit for
bit (integer views). Covers: random weights of many shapes (odd sizes, one-row,
tiny), nf4 and fp4, single and double quant, fp16/bf16/fp32 quant dtypes, every
blocksize bitsandbytes accepts, non-uint8 storage, Linear4bit/Params4bit,
out=, use_global_buffer, the old list quant state, a non-default stream,
quant states that change under the cache, the raw C ABI, and the custom op
under torch.compile(fullgraph=True) (also with CUDA graphs).
--device cpu runs the parts that make sense on the CPU (bitsandbytes' CPU
kernels as the reference), to check the script where there is no GPU.
Prints `N passed, M failed` last; exits 1 on any failure.
"""
import argparse
import copy
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bindings/python

import torch  # noqa: E402

import bitsandbytes.functional as F  # noqa: E402
from bitsandbytes.nn import Linear4bit, Params4bit  # noqa: E402

import nf4deq  # noqa: E402

passed = failed = skipped = 0
VERBOSE = False
DEV = "cuda"


def check(label, fn):
    """fn returns True/None for a pass, False for a failure, or raises."""
    global passed, failed
    try:
        ok = fn()
        ok = True if ok is None else bool(ok)
        err = ""
    except Exception as e:  # noqa: BLE001
        ok, err = False, f"{type(e).__name__}: {e}"
    if ok:
        passed += 1
        if VERBOSE:
            print(f"PASS {label}")
    else:
        failed += 1
        print(f"FAIL {label}" + (f"  [{err.splitlines()[0] if err else ''}]" if err else ""))
    return ok


def skip(label, why):
    global skipped
    skipped += 1
    if VERBOSE:
        print(f"SKIP {label}: {why}")


def same(x, y):
    """Same dtype, shape, strides and bits."""
    if x.dtype != y.dtype or x.shape != y.shape or x.stride() != y.stride():
        raise AssertionError(f"{x.dtype} {tuple(x.shape)} {x.stride()} vs {y.dtype} {tuple(y.shape)} {y.stride()}")
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    if not torch.equal(x.view(view).cpu(), y.view(view).cpu()):
        bad = (x.view(view) != y.view(view)).sum().item()
        raise AssertionError(f"{bad} of {x.numel()} elements differ")
    return True


def reference(W, qs):
    """What bitsandbytes' CUDA kernels return: on the GPU, dequantize_4bit
    itself. bitsandbytes' CPU backend disagrees with its CUDA kernels in places
    (some blocksizes, fp4 signs), so on the CPU the formula is spelled out in
    PyTorch instead: every product and the offset sum rounded to fp32 apart."""
    if W.device.type == "cuda":
        return F.dequantize_4bit(W, qs)
    n = 1
    for d in qs.shape:
        n *= d
    packed = W.reshape(-1).view(torch.uint8)
    idx = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n].long()
    code = F.get_4bit_type(qs.quant_type, device="cpu").clone()
    if qs.quant_type == "fp4":
        code[8] = -0.0  # the CUDA kernel decodes 0b1000 as a signed zero; the table has +0
    blocks = torch.arange(n) // qs.blocksize
    if qs.nested:
        s2 = qs.state2
        absmax = s2.code[qs.absmax.long()] * s2.absmax[torch.arange(qs.absmax.numel()) // s2.blocksize]
        absmax = absmax + qs.offset
    else:
        absmax = qs.absmax.float()
    out = (code[idx] * absmax[blocks]).to(qs.dtype).reshape(qs.shape)
    return out.t() if W.shape[0] == 1 else out


def quantize(shape, dtype, blocksize, quant_type, nested, storage=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)
    return F.quantize_4bit(A, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type,
                           quant_storage=storage)


SHAPES = [(1, 1), (1, 3), (3, 5), (7, 33), (64, 64), (1, 4096), (300, 301), (257, 129), (1024, 1000), (4096, 1024)]
BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_sweep():
    """The package vs dequantize_4bit over shapes x blocksizes x types."""
    for shape, bs, qt, nested, dt in itertools.product(SHAPES, BLOCKSIZES, ("nf4", "fp4"), (True, False), DTYPES):
        label = f"sweep {shape} bs={bs} {qt} nested={nested} {dt}"
        try:
            W, qs = quantize(shape, dt, bs, qt, nested, seed=hash((shape, bs)) & 0xFFFF)
            ref = reference(W, qs)
        except Exception as e:  # noqa: BLE001  (bitsandbytes refuses some tiny cases itself)
            skip(label, f"bitsandbytes: {e}")
            continue
        check(label, lambda: same(nf4deq.dequantize(W, qs), ref))
    # The output dtype follows quant_state.dtype, changed after the fact as the
    # Unsloth puzzle does; this also exercises the per-quant-state cache.
    W, qs = quantize((512, 384), torch.float32, 64, "nf4", True)
    for dt in DTYPES + DTYPES[::-1]:
        qs.dtype = dt
        check(f"quant_state.dtype changed to {dt}", lambda: same(nf4deq.dequantize(W, qs), reference(W, qs)))


def test_storage():
    """Params4bit quant_storage other than uint8: the packed bytes are the same."""
    for storage, shape in ((torch.bfloat16, (128, 96)), (torch.float16, (40, 64)), (torch.float32, (256, 64)),
                           (torch.float32, (3, 5))):
        label = f"quant_storage={storage} {shape}"
        W, qs = quantize(shape, torch.bfloat16, 64, "nf4", True, storage=storage)
        n, have = shape[0] * shape[1], W.numel() * W.element_size()
        if have < (n + 1) // 2:
            # bitsandbytes packs this into too few bytes and reads past the end;
            # nf4deq refuses instead of reading out of bounds.
            def refuses():
                try:
                    nf4deq.dequantize(W, qs)
                except ValueError:
                    return True
                return False

            check(label + " (too few packed bytes) raises ValueError", refuses)
            continue
        check(label, lambda: same(nf4deq.dequantize(W, qs), reference(W, qs)))


def test_modules():
    """Linear4bit / Params4bit, as QLoRA code holds them."""
    for qt, nested, dt in itertools.product(("nf4", "fp4"), (True, False), (torch.float16, torch.bfloat16)):
        torch.manual_seed(1)
        lin = Linear4bit(96, 160, bias=None, compute_dtype=dt, compress_statistics=nested, quant_type=qt).to(DEV)
        W, qs = lin.weight, lin.weight.quant_state
        ref = reference(W, qs)
        label = f"Linear4bit {qt} nested={nested} {dt}"
        check(f"{label}: dequantize(W, qs)", lambda: same(nf4deq.dequantize(W, qs), ref))
        check(f"{label}: dequantize(W)", lambda: same(nf4deq.dequantize(W), ref))
        check(f"{label}: dequantize(module)", lambda: same(nf4deq.dequantize(lin), ref))
        check(f"{label}: dequantize(W.data, qs)", lambda: same(nf4deq.dequantize(W.data, qs), ref))
        check(f"{label}: fast_dequantize(W, qs)", lambda: same(nf4deq.fast_dequantize(W, qs), ref))
        check(f"{label}: fast_dequantize(W)", lambda: same(nf4deq.fast_dequantize(W), ref))
        # Twice more: the cached path must give the same.
        check(f"{label}: cached calls", lambda: same(nf4deq.fast_dequantize(W, qs), ref)
              and same(nf4deq.fast_dequantize(W, qs), ref))
    plain = torch.randn(4, 4, device=DEV)
    check("fast_dequantize(unquantized) returns it", lambda: nf4deq.fast_dequantize(plain) is plain)


def test_out():
    W, qs = quantize((384, 200), torch.bfloat16, 64, "nf4", True)
    ref = reference(W, qs)
    out = torch.empty(qs.shape, dtype=qs.dtype, device=DEV)

    def into():
        r = nf4deq.dequantize(W, qs, out=out)
        return r is out and same(out, ref)

    check("out= preallocated: returns out, same bytes", into)
    if DEV == "cuda":  # bitsandbytes has no CPU kernel for its out= variant
        check("out= same as dequantize_4bit(out=)",
              lambda: same(nf4deq.dequantize(W, qs, out=torch.empty_like(ref)),
                           F.dequantize_4bit(W, qs, out=torch.empty_like(ref))))

    def strided():
        o = torch.zeros(qs.shape[::-1], dtype=qs.dtype, device=DEV).t()  # not contiguous
        nf4deq.dequantize(W, qs, out=o)
        return torch.equal(o.contiguous().view(torch.int16), ref.view(torch.int16))

    check("out= non-contiguous", strided)

    def misaligned():
        n = ref.numel()
        o = torch.zeros(n + 8, dtype=qs.dtype, device=DEV)[1:n + 1].view(qs.shape)  # 2-byte offset
        r = nf4deq.dequantize(W, qs, out=o)
        return r is o and torch.equal(o.view(torch.int16), ref.view(torch.int16))

    check("out= misaligned (2-byte offset)", misaligned)

    def wrong_dtype():
        try:
            nf4deq.dequantize(W, qs, out=torch.empty(qs.shape, dtype=torch.float16, device=DEV))
        except ValueError:
            return True
        return False

    check("out= wrong dtype raises ValueError", wrong_dtype)

    def global_buffer():
        W2, qs2 = quantize((100, 64), torch.bfloat16, 64, "nf4", True, seed=5)
        a = nf4deq.fast_dequantize(W, qs, use_global_buffer=True)
        ok = same(a, ref)
        b = nf4deq.fast_dequantize(W2, qs2, use_global_buffer=True)
        return ok and same(b, reference(W2, qs2)) and a.data_ptr() == b.data_ptr()

    check("use_global_buffer: right bytes, one shared buffer", global_buffer)

    def global_buffer_after_inference_mode():
        from nf4deq import _torch as nf4t
        nf4t._global_buffers.clear()
        nf4t._global_views.clear()
        nf4t._fast_global_cache.clear()
        with torch.inference_mode():
            nf4deq.fast_dequantize(W, qs, use_global_buffer=True)
        got = nf4deq.fast_dequantize(W, qs, use_global_buffer=True)
        got = nf4deq.fast_dequantize(W, qs, use_global_buffer=True)  # the extension's cached call, where built
        return not got.is_inference() and same(got, ref)

    check("use_global_buffer: an ordinary tensor, even when the first call ran in inference mode",
          global_buffer_after_inference_mode)


def test_unsloth_patterns():
    """Unsloth's matmul_lora calls fast_dequantize(W.t(), qs, use_global_buffer=True)
    with a new W.t() view each time. Here those calls alternate with the same
    weights untransposed and into new tensors, so a layout taken over from the
    bound weight would show, over weights that grow the global buffer and one of
    another dtype that replaces it: every output must be bitsandbytes', and every
    global-buffer output a view of the buffer in use."""
    from nf4deq import _torch as nf4t
    cases = [quantize((300, 64), torch.bfloat16, 64, "nf4", True, seed=21),
             quantize((128, 64), torch.bfloat16, 64, "fp4", True, seed=22),
             quantize((640, 96), torch.bfloat16, 64, "nf4", False, seed=23),   # the largest: the buffer grows
             quantize((64, 33), torch.float16, 64, "nf4", True, seed=24)]      # another dtype: replaced
    W5, qs5 = quantize((200, 64), torch.bfloat16, 64, "nf4", True, seed=25)
    cases.append((Params4bit(W5, requires_grad=False, quant_state=qs5, bnb_quantized=True, quant_type="nf4"), qs5))
    refs = [(reference(W.t(), qs), reference(W, qs)) for W, qs in cases]
    order = [0, 1, 2, 0, 3, 4, 1, 2, 3, 4, 0]
    alloc = nf4t._ext.FAST_ALLOC if nf4t._ext is not None else None

    def run():
        for _ in range(3):
            for i in order:
                (W, qs), (t_ref, ref) = cases[i], refs[i]
                g = nf4deq.fast_dequantize(W.t(), qs, use_global_buffer=True)
                buf = nf4t._global_buffers[W.get_device()]
                if not (same(g, t_ref) and g.data_ptr() == buf.data_ptr()):
                    return False
                # What the extension would return next: views of this buffer only.
                if alloc is not None and any(f[alloc].__self__.untyped_storage().data_ptr() !=
                                             buf.untyped_storage().data_ptr()
                                             for f in nf4t._fast_global_cache.values()):
                    return False
                if not (same(nf4deq.fast_dequantize(W.t(), qs), t_ref) and same(nf4deq.fast_dequantize(W, qs), ref)
                        and same(nf4deq.dequantize(W.t(), qs), t_ref)):
                    return False
        return True

    check("Unsloth patterns: W.t() each call, global buffer grown and replaced, layouts alternating", run)

    def too_short_view():
        W, qs = cases[0]
        nf4deq.fast_dequantize(W.t(), qs)  # bound
        try:
            nf4deq.fast_dequantize(W[:10], qs)  # same data pointer, another layout
        except ValueError:
            return True
        return False

    check("a shorter view at the bound weight's address still raises ValueError", too_short_view)


def test_list_form():
    """The quant state as a list (bitsandbytes < 0.41), as Unsloth still accepts."""
    for nested in (True, False):
        W, qs = quantize((256, 320), torch.float16, 64, "nf4", nested)
        ref = reference(W, qs)
        if nested:
            s2 = qs.state2
            state2 = [s2.absmax, s2.code, s2.blocksize, False, torch.float32, None, None]
            lst = [qs.absmax, qs.shape, qs.dtype, qs.blocksize, [qs.offset, state2], qs.quant_type, qs.code]
        else:
            lst = [qs.absmax, qs.shape, qs.dtype, qs.blocksize, None, qs.quant_type, qs.code]
        check(f"list quant state nested={nested}", lambda: same(nf4deq.fast_dequantize(W, lst), ref))
        check(f"list quant state nested={nested}, 6 items",
              lambda: same(nf4deq.fast_dequantize(W, lst[:6]), ref))


def test_cache_invalidation():
    W, qs = quantize((512, 256), torch.float16, 64, "nf4", True)
    ref = reference(W, qs)

    def warm(w):
        """Cached, and the next call handed to the extension where it was built:
        each change below must then be seen by the extension's checks too."""
        nf4deq.dequantize(w, qs)
        nf4deq.dequantize(w, qs)

    def new_absmax():
        warm(W)
        old = qs.absmax
        qs.absmax = old.clone()
        old.zero_()  # the stale pointer would now read zeros
        return same(nf4deq.dequantize(W, qs), ref)

    check("cache: quant_state.absmax replaced", new_absmax)

    def new_offset():
        warm(W)
        old = qs.offset
        qs.offset = old.clone() + 1.0
        try:
            return same(nf4deq.dequantize(W, qs), reference(W, qs))
        finally:
            qs.offset = old

    check("cache: quant_state.offset replaced", new_offset)

    def new_data():
        P = Params4bit(W.clone(), requires_grad=False, quant_state=qs, bnb_quantized=True, quant_type="nf4")
        warm(P)
        old = P.data
        P.data = old.clone()  # same Python object, new storage
        old.zero_()
        return same(nf4deq.dequantize(P, qs), ref)

    check("cache: weight.data swapped", new_data)

    def two_weights_one_state():
        warm(W)
        W2 = W.clone()
        return same(nf4deq.dequantize(W, qs), ref) and same(nf4deq.dequantize(W2, qs), ref) \
            and same(nf4deq.dequantize(W, qs), ref)

    check("cache: two weights sharing one quant state", two_weights_one_state)

    def deepcopied():
        warm(W)
        qs2 = copy.deepcopy(qs)
        return same(nf4deq.dequantize(W, qs2), ref)

    check("cache: deepcopy of the quant state", deepcopied)

    # The same tensor objects given new storage: the old address must not be read.
    def new_storage(get):
        def run():
            warm(W)
            t = get()
            old = t.data
            t.data = old.clone()  # same Python object, new storage
            old.fill_(float("nan") if old.is_floating_point() else 0)
            try:
                return same(nf4deq.dequantize(W, qs), ref)
            finally:
                t.data = old.copy_(t.data)
        return run

    for label, get in (("absmax", lambda: qs.absmax), ("nested absmax", lambda: qs.state2.absmax),
                       ("nested code", lambda: qs.state2.code), ("offset", lambda: qs.offset)):
        check(f"cache: quant_state {label}.data given new storage", new_storage(get))

    def host_offset_in_place():
        qh = copy.deepcopy(qs)
        qh.offset = qs.offset.cpu()
        nf4deq.dequantize(W, qh)
        nf4deq.dequantize(W, qh)
        qh.offset += 0.5  # in place, in host memory
        return same(nf4deq.dequantize(W, qh), reference(W, qh))

    check("cache: an offset in host memory changed in place", host_offset_in_place)


def test_errors():
    W, qs = quantize((64, 64), torch.float16, 64, "nf4", True)

    def raises(exc, fn):
        try:
            fn()
        except exc:
            return True
        return False

    check("no quant state raises ValueError", lambda: raises(ValueError, lambda: nf4deq.dequantize(W)))
    bad = copy.copy(qs)
    bad.blocksize = 48
    check("blocksize 48 raises ValueError", lambda: raises(ValueError, lambda: nf4deq.dequantize(W, bad)))
    bad2 = copy.copy(qs)
    bad2.quant_type = "int4"
    check("quant_type int4 raises ValueError", lambda: raises(ValueError, lambda: nf4deq.dequantize(W, bad2)))
    check("a too-short weight raises ValueError", lambda: raises(ValueError, lambda: nf4deq.dequantize(W[:10], qs)))
    if DEV == "cuda":
        check("weight on CPU, quant state on GPU raises ValueError",
              lambda: raises(ValueError, lambda: nf4deq.dequantize(W.cpu(), qs)))


def test_cpu_path():
    """CPU tensors go through nf4deq_dequantize_cpu; same bytes as bitsandbytes on the GPU."""
    for qt, nested, dt in itertools.product(("nf4", "fp4"), (True, False), DTYPES):
        W, qs = quantize((300, 301), dt, 64, qt, nested)
        ref = reference(W, qs).cpu()
        qc = copy.deepcopy(qs)
        qc.to("cpu")
        check(f"CPU path {qt} nested={nested} {dt}", lambda: same(nf4deq.dequantize(W.cpu(), qc), ref))


def test_stream():
    """The kernel is queued on the current stream: on a side stream, behind a
    long sleep and a copy that fills the weight, it must see the copy."""
    W, qs = quantize((4096, 1024), torch.bfloat16, 64, "nf4", True)
    ref = reference(W, qs)
    target = torch.zeros_like(W)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()

    def ordered():
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on s
            target.copy_(W)
            out = nf4deq.dequantize(target, qs)
        pending = not s.query()  # the call returned before the work ran
        s.synchronize()
        return same(out, ref) and pending

    check("non-default stream: ordered after earlier work on it, asynchronous", ordered)

    def graphs():
        out = torch.empty(qs.shape, dtype=qs.dtype, device=DEV)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):  # warm-up outside capture
            nf4deq.dequantize(W, qs, out=out)
        s.synchronize()
        with torch.cuda.graph(g):
            nf4deq.dequantize(W, qs, out=out)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        return same(out, ref)

    check("captured in a CUDA graph and replayed", graphs)

    if torch.cuda.device_count() > 1:
        def other_device():
            with torch.cuda.device(1):
                A = torch.randn(256, 256, device="cuda:1", dtype=torch.float16)
                W1, qs1 = F.quantize_4bit(A, compress_statistics=True, quant_type="nf4")
                ref1 = F.dequantize_4bit(W1, qs1)
            torch.cuda.set_device(0)
            out = nf4deq.dequantize(W1, qs1)  # current device 0, tensors on 1
            return out.device.index == 1 and same(out, ref1)

        check("weights on cuda:1 while cuda:0 is current", other_device)


def test_routes():
    """The eager call through the _nf4deq_launch extension and through ctypes:
    the same bytes into poisoned outputs, on the current stream, and the
    extension in use wherever make built it."""
    from nf4deq import _lib, _torch as nf4t
    ext_file = Path(nf4deq.library_path()).resolve().parent / _lib.EXTENSION_FILE
    check("the extension beside the library is the eager route",
          lambda: not ext_file.is_file() or nf4deq.launch_route() == f"extension {ext_file}")
    ctypes_fn = nf4deq.load_library().nf4deq_dequantize_cuda_state
    routes = {"default": nf4t._cuda_state_fn, "ctypes": ctypes_fn}
    for (shape, dt, nested) in (((4097, 33), torch.bfloat16, True), ((1, 4096), torch.float16, False),
                               ((129, 257), torch.float32, True)):
        W, qs = quantize(shape, dt, 64, "nf4", nested, seed=7)
        ref = reference(W, qs)
        for name, fn in routes.items():
            def run(fn=fn):
                saved = nf4t._cuda_state_fn
                nf4t._cuda_state_fn = fn
                try:
                    out = torch.full_like(ref, float("nan"))
                    nf4deq.dequantize(W, qs, out=out)
                    return same(out, ref)
                finally:
                    nf4t._cuda_state_fn = saved
            check(f"route {name}: {shape} {dt} nested={nested}", run)


class KeptSubclass(torch.Tensor):
    """A Tensor subclass with torch's default __torch_function__: what its
    methods return (t() included) is of the subclass again."""


def test_cached_path():
    """A call repeated with the same quant state and weight is made by the
    extension in C (_launch.c eager_cached) where it was built. Each case runs
    twice through the Python path (the second call hands it to the extension),
    then again with the Python path made to fail, so the result can only come
    from the extension. The output is allocated where a tensor of the same size
    was just filled with NaN and freed (the caching allocator hands that block
    back), so a launch that did not happen, or wrote short, fails the
    comparison; and it must be contiguous, as bitsandbytes' is, for 2-, 3- and
    4-D quant shapes."""
    from nf4deq import _torch as nf4t
    if nf4t._eager_cached is None:
        skip("cached path", "the _nf4deq_launch extension was not built")
        return

    def refuse(*args):
        raise AssertionError("the Python path took a call the extension should have made")

    def by_extension(call, like):
        torch.full_like(like, float("nan"))  # allocated and freed: the next block of this size is poisoned
        saved = nf4t._eager
        nf4t._eager = refuse
        try:
            return call()
        finally:
            nf4t._eager = saved

    cases = [((4097, 33), torch.bfloat16, "nf4", True), ((129, 257), torch.float32, "fp4", True),
             ((3, 5), torch.float16, "fp4", False), ((300, 301), torch.float16, "nf4", False),
             ((4096, 1024), torch.bfloat16, "nf4", True), ((1024, 4096), torch.bfloat16, "nf4", True),
             ((5, 7, 33), torch.bfloat16, "nf4", True), ((2, 3, 4, 5), torch.float16, "fp4", False),
             ((3, 1, 7, 9), torch.float32, "nf4", True)]
    for shape, dt, qt, nested in cases:
        W, qs = quantize(shape, dt, 64, qt, nested, seed=11)
        views = [("weight", W)]
        if len(shape) == 2:  # bitsandbytes returns out.t(), which only a 2-D output has
            views.append(("weight.t() (returned transposed)", W.t()))
        for name, w in views:
            ref = reference(w, qs)

            def run(w=w, qs=qs, ref=ref):
                first, second = nf4deq.dequantize(w, qs), nf4deq.dequantize(w, qs)
                third = by_extension(lambda: nf4deq.dequantize(w, qs), ref)
                fourth = by_extension(lambda: nf4deq.fast_dequantize(w, qs), ref)
                return same(first, ref) and same(second, ref) and same(third, ref) and same(fourth, ref)
            check(f"cached path: {shape} {dt} {qt} nested={nested}, {name}", run)

    W, qs = quantize((257, 129), torch.bfloat16, 64, "nf4", True, seed=12)
    ref = reference(W, qs)

    def params4bit():
        P = Params4bit(W.clone(), requires_grad=False, quant_state=qs, bnb_quantized=True, quant_type="nf4")
        nf4deq.fast_dequantize(P, P.quant_state)
        nf4deq.fast_dequantize(P, P.quant_state)
        return same(by_extension(lambda: nf4deq.fast_dequantize(P, P.quant_state), ref), ref)

    check("cached path: a Params4bit (torch functions off for its data pointer)", params4bit)

    def unsloth_call(kind, global_buffer):
        """Unsloth's matmul_lora call, fast_dequantize(W.t(), qs, use_global_buffer=True),
        and the same into a new tensor: a new W.t() on every call, which the
        extension takes for the bound weight by its address and layout. W: a
        plain tensor; a Params4bit, as matmul_lora gets it (its t() is a plain
        tensor: Parameter switches torch functions off); a Tensor subclass whose
        t() stays one, read with torch functions off. The global buffer is filled
        with NaN before the extension's call, which must leave bitsandbytes'
        output in it."""
        W3, qs3 = quantize((513, 130), torch.bfloat16, 64, "nf4", True, seed=14)
        w = {"tensor": lambda: W3,
             "Params4bit": lambda: Params4bit(W3.clone(), requires_grad=False, quant_state=qs3,
                                              bnb_quantized=True, quant_type="nf4"),
             "subclass": lambda: W3.clone().as_subclass(KeptSubclass)}[kind]()
        ref3 = reference(W3.t(), qs3)

        def call():
            return nf4deq.fast_dequantize(w.t(), qs3, use_global_buffer=global_buffer)
        python_calls = [same(call(), ref3) for _ in range(2)]  # bound, then handed to the extension
        if global_buffer:
            buf = nf4t._global_buffers[torch.cuda.current_device()]
            buf.fill_(float("nan"))
            got = by_extension(call, ref3)
            ok = same(got, ref3) and got.data_ptr() == buf.data_ptr()
        else:
            ok = same(by_extension(call, ref3), ref3)
        return all(python_calls) and ok and (kind != "subclass" or type(w.t()) is KeptSubclass)

    for kind in ("tensor", "Params4bit", "subclass"):
        for global_buffer in (True, False):
            check(f"cached path: fast_dequantize({kind}.t(), qs, use_global_buffer={global_buffer}), "
                  "a new view each call", lambda k=kind, g=global_buffer: unsloth_call(k, g))

    def dtype_changed():
        nf4deq.dequantize(W, qs)
        qs.dtype = torch.float16  # as the Unsloth puzzle does: the cached call must not be taken
        try:
            got = nf4deq.dequantize(W, qs)
            want = reference(W, qs)
        finally:
            qs.dtype = torch.bfloat16
        back = nf4deq.dequantize(W, qs)  # rebuilt for bf16 by the Python path
        nf4deq.dequantize(W, qs)
        again = by_extension(lambda: nf4deq.dequantize(W, qs), ref)
        return same(got, want) and same(back, ref) and same(again, ref)

    check("cached path: quant_state.dtype changed and changed back", dtype_changed)

    def side_stream():
        W2, qs2 = quantize((4096, 1024), torch.bfloat16, 64, "nf4", True, seed=13)
        ref2 = reference(W2, qs2)
        target = torch.zeros_like(W2)
        nf4deq.dequantize(target, qs2)  # cached, on the default stream
        nf4deq.dequantize(target, qs2)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on s
            target.copy_(W2)
            out = by_extension(lambda: nf4deq.dequantize(target, qs2), ref2)
        pending = not s.query()
        s.synchronize()
        return same(out, ref2) and pending

    check("cached path: on a side stream, ordered after earlier work on it", side_stream)


def test_raw_abi():
    """The C ABI itself, with torch's device pointers."""
    lib = nf4deq.load_library()
    fn = lib.nf4deq_dequantize_cuda
    stream = torch.cuda.current_stream().cuda_stream
    for nested, dt in itertools.product((True, False), DTYPES):
        W, qs = quantize((1000, 333), dt, 64, "nf4", nested)
        ref = reference(W, qs)
        n = ref.numel()
        odt = {torch.float16: nf4deq.FLOAT16, torch.bfloat16: nf4deq.BFLOAT16, torch.float32: nf4deq.FLOAT32}[dt]
        nabs = qs.state2.absmax.data_ptr() if nested else None
        ncode = qs.state2.code.data_ptr() if nested else None
        nbs = qs.state2.blocksize if nested else 1
        for how in (("value", "device") if nested else ("none",)):
            out = torch.empty_like(ref)
            off_val = qs.offset.item() if how == "value" else 0.0
            off_ptr = qs.offset.data_ptr() if how == "device" else None

            def run():
                rc = fn(W.data_ptr(), qs.absmax.data_ptr(), nabs, ncode, off_val, off_ptr, n, 64, nbs,
                        nf4deq.NF4, odt, out.data_ptr(), stream)
                nf4deq.check(rc)
                torch.cuda.synchronize()
                return same(out, ref)

            check(f"C ABI nested={nested} {dt} offset={how}", run)
    # A run that starts on a block boundary, on its own (single quant).
    W, qs = quantize((1000, 333), torch.float16, 64, "nf4", False)
    ref = reference(W, qs).reshape(-1)
    out = torch.empty_like(ref)

    def chunks():
        n, split = ref.numel(), 64 * 1000  # elements; a multiple of 64 and of 32 bytes
        for start, count in ((0, split), (split, n - split)):
            rc = fn(W.data_ptr() + start // 2, qs.absmax.data_ptr() + start // 64 * 4, None, None, 0.0, None,
                    count, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, out.data_ptr() + start * 2, stream)
            nf4deq.check(rc)
        torch.cuda.synchronize()
        return same(out, ref)

    check("C ABI: two runs split on a block boundary", chunks)
    p, a, o = W.data_ptr(), qs.absmax.data_ptr(), out.data_ptr()
    rc = fn(p + 1, a, None, None, 0.0, None, 128, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, o, stream)
    check("C ABI: misaligned packed -> EINVAL", lambda: rc == nf4deq.EINVAL and "aligned" in nf4deq.last_error())
    rc2 = fn(p, a, None, None, 0.0, None, 128, 100, 1, nf4deq.NF4, nf4deq.FLOAT16, o, stream)
    check("C ABI: blocksize 100 -> EINVAL with a message",
          lambda: rc2 == nf4deq.EINVAL and "blocksize" in nf4deq.last_error())
    rc3 = fn(None, None, None, None, 0.0, None, 0, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, None, stream)
    check("C ABI: n=0 -> OK", lambda: rc3 == nf4deq.OK and nf4deq.last_error() == "")
    check("C ABI: device still healthy", lambda: torch.cuda.synchronize() is None)


def test_compile():
    import torch._dynamo

    torch.manual_seed(2)
    for qt, nested, dt in (("nf4", True, torch.bfloat16), ("nf4", True, torch.float16), ("fp4", False, torch.float16)):
        lin = Linear4bit(256, 512, bias=None, compute_dtype=dt, compress_statistics=nested, quant_type=qt).to(DEV)
        lin.weight.quant_state.dtype = dt
        W, qs = lin.weight, lin.weight.quant_state
        ref = reference(W, qs)
        x = torch.randn(8, 256, device=DEV, dtype=dt)
        label = f"compile {qt} nested={nested} {dt}"

        def fn(x):
            return x @ nf4deq.dequantize(lin.weight, lin.weight.quant_state).t()

        def no_breaks():
            torch._dynamo.reset()
            ex = torch._dynamo.explain(fn)(x)
            if ex.graph_break_count:
                print(f"    break reasons: {[str(r.reason) for r in ex.break_reasons]}")
            return ex.graph_break_count == 0 and ex.graph_count == 1

        check(f"{label}: explain -> 0 graph breaks", no_breaks)

        def matches_eager():
            torch._dynamo.reset()
            y = torch.compile(fn, fullgraph=True)(x)
            y0 = fn(x)
            torch.testing.assert_close(y, y0)
            return True

        check(f"{label}: fullgraph forward == eager", matches_eager)

        def op_bytes():
            torch._dynamo.reset()
            got = torch.compile(lambda w: nf4deq.dequantize(w, qs), fullgraph=True)(W)
            return same(got, ref)

        check(f"{label}: compiled dequantize byte-identical", op_bytes)

        def out_variant():
            torch._dynamo.reset()

            def g(buf):
                nf4deq.dequantize(W, qs, out=buf)
                return buf * 1  # use it after the mutation

            buf = torch.empty(qs.shape, dtype=qs.dtype, device=DEV)
            got = torch.compile(g, fullgraph=True)(buf)
            return same(got, ref) and same(buf, ref)

        check(f"{label}: compiled out= variant", out_variant)

        def fast_compiled():
            torch._dynamo.reset()
            got = torch.compile(lambda: nf4deq.fast_dequantize(lin.weight, lin.weight.quant_state), fullgraph=True)()
            return same(got, ref)

        check(f"{label}: compiled fast_dequantize", fast_compiled)

    check("torch.ops.nf4deq.dequantize_4bit is registered", lambda: hasattr(torch.ops.nf4deq, "dequantize_4bit"))

    def opcheck():
        W, qs = quantize((128, 64), torch.float16, 64, "nf4", True)
        args = (W, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, 0.0, list(qs.shape), 64, 256,
                nf4deq.NF4, torch.float16)
        torch.library.opcheck(torch.ops.nf4deq.dequantize_4bit.default, args)
        return True

    check("torch.library.opcheck(nf4deq::dequantize_4bit)", opcheck)

    if DEV == "cuda":
        def cuda_graphs():
            torch._dynamo.reset()
            W, qs = quantize((1024, 512), torch.bfloat16, 64, "nf4", True)
            x = torch.randn(16, 512, device=DEV, dtype=torch.bfloat16)
            f = torch.compile(lambda x: x @ nf4deq.dequantize(W, qs).t(), mode="reduce-overhead", fullgraph=True)
            want = x @ F.dequantize_4bit(W, qs).t()
            for _ in range(4):  # warm-up, record, replays
                y = f(x)
                torch.testing.assert_close(y, want)
            return True

        check("compile mode=reduce-overhead (CUDA graphs)", cuda_graphs)


def main():
    global VERBOSE, DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    VERBOSE, DEV = args.verbose, args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device (--device cpu checks the script alone)")
        print("0 passed, 1 failed")
        return 1
    print(f"torch {torch.__version__}; nf4deq {nf4deq.version()} ({nf4deq.library_path()}, "
          f"{nf4deq.launch_route()}); "
          f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}")
    tests = [test_sweep, test_storage, test_modules, test_out, test_unsloth_patterns, test_list_form,
             test_cache_invalidation, test_errors, test_compile]
    if DEV == "cuda":
        tests[1:1] = [test_cpu_path, test_stream, test_routes, test_cached_path, test_raw_abi]
    for t in tests:
        before = (passed, failed)
        try:
            t()
        except Exception as e:  # noqa: BLE001  (a crash in set-up counts as one failure)
            check(f"{t.__name__} set-up", lambda: (_ for _ in ()).throw(e))
        print(f"{t.__name__}: {passed - before[0]} passed, {failed - before[1]} failed")
    if skipped:
        print(f"({skipped} sweep cases skipped: bitsandbytes itself refused them; -v lists them)")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
