"""The C ABI through the Python package's loader, on the CPU, without torch.

Needs numpy, safetensors and ml_dtypes only. Dequantizes every quantized weight
of tests/fixtures/tensors.bnb4.safetensors with nf4deq_dequantize_cpu and
compares the bytes with what bitsandbytes itself returned (the expected-*
fixtures), then checks the error paths.

    python bindings/python/tests/test_cpu_abi.py [REPO]

Prints `N passed, M failed` last; exits 1 on any failure.
"""
import os

# This test never wants a GPU, and the CUDA entry point must find none (the
# runtime reads this on its first call, which has not happened yet).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import ctypes  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import ml_dtypes  # noqa: E402,F401  (registers bfloat16 with numpy)
import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE.parents[2]
sys.path.insert(0, str(HERE.parent))  # bindings/python

import nf4deq  # noqa: E402

passed = failed = 0


def check(cond, label, detail=""):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {label}" + (f": {detail}" if detail else ""))


def ptr(a):
    return None if a is None else a.ctypes.data


def aligned_empty(nbytes, align=64):
    """A zeroed byte buffer whose start is `align`-aligned (the CUDA entry
    point checks 16-byte alignment before anything else)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


OUT = {"f16": (nf4deq.FLOAT16, np.float16), "bf16": (nf4deq.BFLOAT16, ml_dtypes.bfloat16),
       "f32": (nf4deq.FLOAT32, np.float32)}
NATURAL = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def weights(bnb):
    """name -> (quant state dict, packed bytes, absmax, nested_absmax, nested_code)."""
    for key in sorted(bnb):
        for qt in ("nf4", "fp4"):
            suffix = f".quant_state.bitsandbytes__{qt}"
            if key.endswith(suffix):
                name = key[: -len(suffix)]
                qs = json.loads(bytes(bnb[key]).decode())
                yield name, qs, (bnb[name].view(np.uint8).reshape(-1), bnb[name + ".absmax"],
                                 bnb.get(name + ".nested_absmax"), bnb.get(name + ".nested_quant_map"))


def run_cpu(lib, qs, arrays, out_dtype, threads=0, first_block=0, blocks=None):
    """Dequantizes blocks [first_block, first_block+blocks) of one weight; returns
    (status, output bytes)."""
    packed, absmax, nabs, ncode = arrays
    n = int(np.prod(qs["shape"]))
    bs = qs["blocksize"]
    nested = nabs is not None
    nbs = qs.get("nested_blocksize", 256) if nested else 1
    if blocks is None:
        blocks = -(-n // bs) - first_block
    start = first_block * bs
    count = min(n - start, blocks * bs)
    code, np_dt = OUT[out_dtype]
    out = np.zeros(count, dtype=np_dt)
    if nested:
        assert first_block % nbs == 0, "a run of a double-quant tensor starts on a nested block"
        nabs_run = nabs[first_block // nbs:]
    rc = lib.nf4deq_dequantize_cpu(
        ptr(packed[start // 2:]), ptr(absmax[first_block:]), ptr(nabs_run) if nested else None,
        ptr(ncode) if nested else None, float(qs.get("nested_offset", 0.0)), count, bs, nbs,
        nf4deq.NF4 if qs["quant_type"] == "nf4" else nf4deq.FP4, code, ptr(out), threads)
    return rc, out


class FakeTensor:
    """Stands in for torch.Tensor in the extension's cached call: it only needs
    a data pointer, a type, weak references, t() and what _torch.py's _layout
    reads (shape, stride(), dtype, get_device()), which it logs in `reads`."""
    reads = []

    def __init__(self, ptr, shape=(8, 1), stride=(1, 1), dtype="uint8", device=0):
        self.ptr, self._shape, self._stride, self.dtype, self._device = ptr, shape, stride, dtype, device

    @property
    def shape(self):
        FakeTensor.reads.append("shape")
        return self._shape

    def stride(self):
        FakeTensor.reads.append("stride")
        return self._stride

    def get_device(self):
        FakeTensor.reads.append("get_device")
        return self._device

    def layout(self):
        return self._shape, self._stride, self.dtype, self._device

    def t(self):
        return ("transposed", self)


class FakeParameter(FakeTensor):
    pass


class FakeSubclass(FakeTensor):  # as bitsandbytes' Params4bit: read with torch functions off
    pass


class FakeQuantState:
    def __init__(self, nested):
        self.absmax, self.shape, self.dtype, self.blocksize, self.quant_type = FakeTensor(4096), (3, 5), "bf16", 4096, "nf4"
        self.state2 = self.offset = None
        if nested:
            self.state2 = FakeQuantState(False)
            self.state2.absmax = FakeTensor(8192)
            self.state2.code, self.state2.blocksize = FakeTensor(12288), 256
            self.offset = FakeTensor(16384)


def check_eager_cached(ext, lib):
    """_launch.c's eager_cached() without torch: bound to stand-ins, it must
    take a call only when everything the Python path would check still holds,
    launch through the library (n=0 returns OK without a GPU; n>0 finds none),
    raise the library's error through check(), and never crash when the cache
    changes under it."""
    import gc
    import weakref

    cache, global_cache, calls = {}, {}, []

    class Guard:  # torch._C.DisableTorchFunctionSubclass
        def __enter__(self):
            calls.append("enter")

        def __exit__(self, *exc):
            calls.append("exit")

    def bind(current_device):
        ext.bind_eager(cache, global_cache, FakeTensor, FakeParameter, lambda t: t.ptr, current_device,
                       lambda dev: 0, Guard, nf4deq._lib.check)

    class Slotted:  # a quant state without an instance dictionary
        __slots__ = ("__weakref__",)

    device = [0]
    bind(lambda: device[0])
    out_buf = aligned_empty(256)

    def new_empty(shape, **kwargs):
        calls.append(("new_empty", shape, kwargs))
        return FakeTensor(out_buf.ctypes.data)

    absmax_buf = np.ones(4, dtype=np.float32)

    def entry(qs, w, n=0, transposed=False, dev=0, kwargs=None, layout="bound", into=None, alloc=None):
        state = nf4deq._lib.State(absmax_buf.ctypes.data, None, None, None, n, 0.0, 64, 1, nf4deq.NF4,
                                  nf4deq.BFLOAT16)
        st2 = qs.state2
        src = (qs.absmax, qs.shape, qs.dtype, qs.blocksize, qs.quant_type, st2,
               qs.offset if st2 else None, st2.absmax if st2 else None, st2.code if st2 else None,
               st2.blocksize if st2 else None)
        ptrs = (qs.absmax.ptr, qs.offset.ptr if st2 else None, st2.absmax.ptr if st2 else None,
                st2.code.ptr if st2 else None)
        (cache if into is None else into)[id(qs)] = (
            weakref.ref(qs), *src, ptrs, weakref.ref(w), w.ptr, w.layout() if layout == "bound" else layout,
            alloc or new_empty, (qs.shape,) if alloc is None else (), kwargs, ctypes.addressof(state), dev,
            transposed, state)

    w_buf = aligned_empty(64)
    for nested in (False, True):
        qs, w = FakeQuantState(nested), FakeTensor(w_buf.ctypes.data)
        tag = f"ext cached (nested={nested})"
        check(ext.eager_cached(w, qs) is None, f"{tag}: not in the cache -> None")
        entry(qs, w)
        check(len(cache[id(qs)]) == ext.FAST_FIELDS, f"{tag}: the test's entries have the extension's FAST_FIELDS items")
        calls.clear()
        got = ext.eager_cached(w, qs)
        check(isinstance(got, FakeTensor) and got.ptr == out_buf.ctypes.data and calls == [("new_empty", (3, 5), {})],
              f"{tag}: a hit allocates once and returns the output", f"{got!r} {calls}")
        entry(qs, w, kwargs={"memory_format": "contiguous"})
        calls.clear()
        got = ext.eager_cached(w, qs)
        check(isinstance(got, FakeTensor) and calls == [("new_empty", (3, 5), {"memory_format": "contiguous"})],
              f"{tag}: the allocation's keyword arguments are passed", f"{calls}")
        entry(qs, w)
        qs.blocksize = int("4096")  # equal, another object
        check(isinstance(ext.eager_cached(w, qs), FakeTensor), f"{tag}: an equal blocksize still hits")

        def miss(label, change, undo):
            change()
            calls.clear()
            got = ext.eager_cached(w2[0], qs)
            check(got is None and not any(isinstance(c, tuple) for c in calls), f"{tag}: {label} -> None",
                  f"{got!r} {calls}")
            undo()

        w2 = [w]
        # What _Entry.sources_match compares (the offset only with a state2).
        for attr in ("absmax", "shape", "dtype", "blocksize", "quant_type", "state2") + (("offset",) if nested else ()):
            old = getattr(qs, attr)
            miss(f"{attr} replaced", lambda a=attr: setattr(qs, a, object()), lambda a=attr, o=old: setattr(qs, a, o))
        # The same tensor objects given new storage (.data =, set_(), resize_()).
        holders = [(qs, "absmax")] + ([(qs, "offset"), (qs.state2, "absmax"), (qs.state2, "code")] if nested else [])
        for obj, attr in holders:
            t = getattr(obj, attr)
            miss(f"{attr} given new storage", lambda t=t: setattr(t, "ptr", t.ptr + 64),
                 lambda t=t: setattr(t, "ptr", t.ptr - 64))
        if nested:
            for attr in ("absmax", "code", "blocksize"):
                old = getattr(qs.state2, attr)
                miss(f"state2.{attr} replaced", lambda a=attr: setattr(qs.state2, a, object()),
                     lambda a=attr, o=old: setattr(qs.state2, a, o))
            old2 = qs.state2
            miss("state2 removed", lambda: setattr(qs, "state2", None), lambda: setattr(qs, "state2", old2))
        # Another object over the same bytes (a W.t() view made on each call)
        # stands for the bound weight only with the bound layout.
        for label, other in (("another shape", FakeTensor(w.ptr, shape=(1, 8))),
                             ("other strides", FakeTensor(w.ptr, stride=(2, 1))),
                             ("another dtype", FakeTensor(w.ptr, dtype="int8")),
                             ("another device", FakeTensor(w.ptr, device=1)),
                             ("another address", FakeTensor(w.ptr + 16)),
                             ("a Parameter at another address", FakeParameter(w.ptr + 16))):
            miss(f"another weight object, {label}", lambda o=other: w2.__setitem__(0, o), lambda: w2.__setitem__(0, w))
        calls.clear()
        got = ext.eager_cached(FakeTensor(w.ptr), qs)
        check(isinstance(got, FakeTensor) and calls == [("new_empty", (3, 5), {})],
              f"{tag}: another weight object with the bound address and layout hits", f"{got!r} {calls}")
        got = ext.eager_cached(FakeParameter(w.ptr), qs)
        check(isinstance(got, FakeTensor), f"{tag}: a Parameter with the bound address and layout hits", f"{got!r}")
        entry(qs, w, layout=None)
        check(ext.eager_cached(FakeTensor(w.ptr), qs) is None, f"{tag}: an entry with no layout takes no other object")
        for bad in ((1, 2, 3), [w.shape, w.stride(), w.dtype, 0]):
            entry(qs, w, layout=bad)
            check(ext.eager_cached(FakeTensor(w.ptr), qs) is None,
                  f"{tag}: a malformed layout {type(bad).__name__} of {len(bad)} -> None")
        entry(qs, w)
        FakeTensor.reads.clear()
        check(isinstance(ext.eager_cached(w, qs), FakeTensor) and not FakeTensor.reads,
              f"{tag}: the bound object itself: its layout is not read", f"{FakeTensor.reads}")
        miss("the weight's storage moved", lambda: setattr(w, "ptr", w.ptr + 16),
             lambda: setattr(w, "ptr", w.ptr - 16))
        miss("not a tensor", lambda: w2.__setitem__(0, object()), lambda: w2.__setitem__(0, w))
        miss("another current device", lambda: device.__setitem__(0, 1), lambda: device.__setitem__(0, 0))
        check(ext.eager_cached(w, [1, 2]) is None, f"{tag}: a list quant state -> None")
        slotted = Slotted()
        cache[id(slotted)] = (weakref.ref(slotted),) + cache[id(qs)][1:]
        check(ext.eager_cached(w, slotted) is None, f"{tag}: a quant state without a __dict__ -> None")
        del cache[id(slotted)]

        # A subclass weight is read inside the guard, which is left again.
        sub = FakeSubclass(w_buf.ctypes.data)
        entry(qs, sub, transposed=True)
        calls.clear()
        got = ext.eager_cached(sub, qs)
        check(isinstance(got, tuple) and got[0] == "transposed" and calls[:2] == ["enter", "exit"],
              f"{tag}: a subclass weight, read with torch functions off, returned transposed", f"{got!r} {calls}")
        # Another subclass object at its address (Params4bit.t() is a Params4bit):
        # its layout is read inside the guard too.
        other_sub = FakeSubclass(sub.ptr)
        calls.clear()
        FakeTensor.reads.clear()
        guarded = []
        real_stride = FakeSubclass.stride
        FakeSubclass.stride = lambda self: (guarded.append(calls[-1:] == ["enter"]), real_stride(self))[1]
        try:
            got = ext.eager_cached(other_sub, qs)
        finally:
            FakeSubclass.stride = real_stride
        check(isinstance(got, tuple) and calls[:2] == ["enter", "exit"] and guarded == [True]
              and FakeTensor.reads == ["shape", "stride", "get_device"],
              f"{tag}: another subclass object, its layout read with torch functions off",
              f"{got!r} {calls} {guarded} {FakeTensor.reads}")
        calls.clear()
        got = ext.eager_cached(FakeSubclass(sub.ptr, shape=(2, 4)), qs)
        check(got is None and calls == ["enter", "exit"], f"{tag}: another subclass object, another shape -> None, "
              "the guard left", f"{got!r} {calls}")

        # The global buffer's cache: the output is what its entry returns (the
        # view's detach() in _torch.py), and each cache serves its own calls.
        cache.clear()
        view = FakeTensor(out_buf.ctypes.data)
        entry(qs, w, into=global_cache, alloc=lambda: (calls.append("detach"), view)[1])
        calls.clear()
        check(ext.eager_cached(w, qs) is None and ext.eager_cached(w, qs, False) is None and not calls,
              f"{tag}: a global-buffer entry does not serve a call for a new tensor")
        for flag in (True, 1):
            calls.clear()
            got = ext.eager_cached(FakeTensor(w.ptr), qs, flag)
            check(got is view and calls == ["detach"], f"{tag}: a global-buffer call ({flag!r}) hits its entry",
                  f"{got!r} {calls}")
        entry(qs, w)
        global_cache.clear()
        check(ext.eager_cached(w, qs, True) is None, f"{tag}: a new-tensor entry does not serve a global-buffer call")

        class Untruthful:
            def __bool__(self):
                raise ZeroDivisionError("no truth")
        try:
            ext.eager_cached(w, qs, Untruthful())
            check(False, f"{tag}: use_global_buffer whose truth raises, raises it")
        except ZeroDivisionError:
            check(True, f"{tag}: use_global_buffer whose truth raises, raises it")

        # A real job with no GPU: the library's status, raised by check().
        entry(qs, w, n=128)
        try:
            ext.eager_cached(w, qs)
            check(False, f"{tag}: no GPU raises Nf4deqError")
        except nf4deq.Nf4deqError as e:
            check(e.status in (nf4deq.ENODEV, nf4deq.ECUDA), f"{tag}: no GPU raises Nf4deqError", str(e))

        # The entry dropped from the cache while the call checks it.
        entry(qs, w)
        bind(lambda: (cache.clear(), 0)[1])
        got = ext.eager_cached(w, qs)
        gc.collect()
        check(isinstance(got, FakeTensor) and not cache, f"{tag}: the cache emptied during the call", f"{got!r}")
        bind(lambda: device[0])

        # A quant state that died: its id may come back on another object.
        entry(qs, w)
        key = id(qs)
        del qs
        gc.collect()
        ghost = FakeQuantState(nested)
        if id(ghost) == key:
            check(ext.eager_cached(w, ghost) is None, f"{tag}: a reused id -> None")
        cache.clear()

    qs, w = FakeQuantState(False), FakeTensor(w_buf.ctypes.data)
    entry(qs, w)
    i = ext.FAST_ALLOC_ARGS
    cache[id(qs)] = cache[id(qs)][:i] + ([(3, 5)],) + cache[id(qs)][i + 1:]
    try:
        ext.eager_cached(w, qs)
        check(False, "ext cached: allocation arguments not in a tuple raise TypeError")
    except TypeError:
        check(True, "ext cached: allocation arguments not in a tuple raise TypeError")
    cache.clear()
    bad = FakeQuantState(False)
    cache[id(bad)] = (1, 2, 3)
    for args, exc, label in (((w, bad), TypeError, "a malformed cache entry"), ((w,), TypeError, "one argument"),
                             ((w, bad, None, None), TypeError, "four arguments")):
        try:
            ext.eager_cached(*args)
            check(False, f"ext cached: {label} raises {exc.__name__}")
        except exc:
            check(True, f"ext cached: {label} raises {exc.__name__}")
    for args, label in (((cache,), "one argument"), ((list(), {}, *[len] * 7), "a list for the cache"),
                        ((cache, None, *[len] * 7), "None for the global cache"),
                        ((cache, {}, *[len] * 6, 3), "a number for check"),
                        ((cache, *[len] * 7), "eight arguments (API 2's)")):
        try:
            ext.bind_eager(*args)
            check(False, f"bind_eager: {label} raises TypeError")
        except TypeError:
            check(True, f"bind_eager: {label} raises TypeError")


def main():
    try:
        lib = nf4deq.load_library()
    except OSError as e:
        print(f"FAIL load: {e}")
        print("0 passed, 1 failed")
        return 1
    print(f"library: {nf4deq.library_path()} (version {nf4deq.version()})")
    check(lib.nf4deq_abi_version() == nf4deq.ABI_VERSION == 1, "abi version")
    want_version = (REPO / "VERSION").read_text().strip() if (REPO / "VERSION").exists() else None
    check(want_version is None or nf4deq.version() == want_version, "version string",
          f"{nf4deq.version()!r} != VERSION {want_version!r}")
    for st in (nf4deq.OK, nf4deq.EINVAL, nf4deq.ECUDA, nf4deq.ENODEV, nf4deq.ENOMEM):
        check(nf4deq.strerror(st) not in ("", "unknown status"), f"strerror({st})")
    check(nf4deq.strerror(99) == "unknown status", "strerror(99)")

    fx = REPO / "tests" / "fixtures"
    bnb = load_file(str(fx / "tensors.bnb4.safetensors"))
    expected = {dt: load_file(str(fx / f"tensors.expected-{dt}.safetensors")) for dt in OUT}
    count = 0
    for name, qs, arrays in weights(bnb):
        count += 1
        natural = NATURAL[qs["dtype"]]
        for dt in list(OUT) + ["natural"]:
            out_dt = natural if dt == "natural" else dt
            for threads in ((0, 1, 3) if dt == "natural" else (0,)):
                rc, out = run_cpu(lib, qs, arrays, out_dt, threads)
                want = expected[out_dt][name]
                ok = rc == nf4deq.OK and out.tobytes() == want.reshape(-1).tobytes()
                label = f"{name} {dt}({out_dt}) threads={threads}"
                check(ok, label, f"status {rc} {nf4deq.last_error()}" if rc else "bytes differ")
        # The same weight in two runs, split on a (nested) block boundary: the
        # ABI promises any run that starts on one works on its own.
        bs, n = qs["blocksize"], int(np.prod(qs["shape"]))
        step = qs.get("nested_blocksize", 256) if arrays[2] is not None else 7
        total_blocks = -(-n // bs)
        if total_blocks > step:
            split = (total_blocks // 2) // step * step
            rc1, a = run_cpu(lib, qs, arrays, natural, 0, 0, split)
            rc2, b = run_cpu(lib, qs, arrays, natural, 0, split)
            whole = expected[natural][name].reshape(-1).tobytes()
            check(rc1 == rc2 == nf4deq.OK and a.tobytes() + b.tobytes() == whole, f"{name} in two runs at block {split}")
    check(count == 8, "fixture weight count", f"found {count}, the fixtures README lists 8")

    # Error paths: a status and a one-line reason, never a crash.
    packed = aligned_empty(64)
    absmax = np.ones(4, dtype=np.float32)
    out = aligned_empty(256)
    code = np.zeros(256, dtype=np.float32)
    p, a, o = packed.ctypes.data, absmax.ctypes.data, out.ctypes.data

    def expect(rc, want, label, words=()):
        msg = nf4deq.last_error()
        ok = rc in (want if isinstance(want, tuple) else (want,)) and msg != "" and all(w in msg for w in words)
        check(ok, label, f"status {rc} ({nf4deq.strerror(rc)}), message {msg!r}")

    expect(lib.nf4deq_dequantize_cpu(p, a, None, None, 0.0, 128, 48, 1, nf4deq.NF4, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "blocksize 48 -> EINVAL", ("blocksize",))
    expect(lib.nf4deq_dequantize_cpu(p, a, None, None, 0.0, 128, 8192, 1, nf4deq.NF4, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "blocksize 8192 -> EINVAL", ("blocksize",))
    expect(lib.nf4deq_dequantize_cpu(p, a, None, None, 0.0, 128, 64, 1, 2, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "quant_type 2 -> EINVAL", ("quant_type",))
    expect(lib.nf4deq_dequantize_cpu(p, a, None, None, 0.0, 128, 64, 1, nf4deq.NF4, 3, o, 0),
           nf4deq.EINVAL, "out_dtype 3 -> EINVAL", ("out_dtype",))
    expect(lib.nf4deq_dequantize_cpu(None, a, None, None, 0.0, 128, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "NULL packed -> EINVAL")
    expect(lib.nf4deq_dequantize_cpu(p, a, a, None, 0.0, 128, 64, 256, nf4deq.NF4, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "nested_absmax without nested_code -> EINVAL")
    expect(lib.nf4deq_dequantize_cpu(p, a, a, code.ctypes.data, 0.0, 128, 64, 100, nf4deq.NF4, nf4deq.FLOAT16, o, 0),
           nf4deq.EINVAL, "nested_blocksize 100 -> EINVAL", ("nested_blocksize",))
    rc = lib.nf4deq_dequantize_cpu(None, None, None, None, 0.0, 0, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, None, 0)
    check(rc == nf4deq.OK and nf4deq.last_error() == "", "n=0 with NULL pointers -> OK, last_error cleared",
          f"status {rc}, {nf4deq.last_error()!r}")
    try:
        nf4deq.check(nf4deq.EINVAL, "probe")
        check(False, "check() raises")
    except nf4deq.Nf4deqError as e:
        check(e.status == nf4deq.EINVAL and "invalid argument" in str(e), "check() raises Nf4deqError", str(e))

    # The CUDA entry point with no GPU: a clean ENODEV (or ECUDA), not a crash.
    cuda = lib.nf4deq_dequantize_cuda
    expect(cuda(p, a, None, None, 0.0, None, 128, 48, 1, nf4deq.NF4, nf4deq.FLOAT16, o, None),
           nf4deq.EINVAL, "cuda: blocksize 48 -> EINVAL (checked before the device)", ("blocksize",))
    expect(cuda(p + 1, a, None, None, 0.0, None, 128, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, o, None),
           nf4deq.EINVAL, "cuda: misaligned packed -> EINVAL", ("aligned",))
    expect(cuda(p, a, None, None, 0.0, None, 128, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, o, None),
           (nf4deq.ENODEV, nf4deq.ECUDA), "cuda without a GPU -> ENODEV/ECUDA")
    expect(cuda(p, a, None, None, 0.0, None, 128, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, o, None),
           (nf4deq.ENODEV, nf4deq.ECUDA), "cuda without a GPU, twice -> same, clean")
    rc = cuda(None, None, None, None, 0.0, None, 0, 64, 1, nf4deq.NF4, nf4deq.FLOAT16, None, None)
    check(rc == nf4deq.OK, "cuda: n=0 -> OK without touching the device", f"status {rc}")

    # The eager-call extension, where make built it: the same statuses and
    # messages as the ctypes route, and Python errors for wrong arguments.
    ext_file = Path(nf4deq.library_path()).resolve().parent / "_nf4deq_launch.abi3.so"
    if ext_file.is_file():
        check(nf4deq.launch_route() == f"extension {ext_file}", "the extension beside the library is used",
              nf4deq.launch_route())
        ext = nf4deq._lib.load_launch_extension()
        state = nf4deq._lib.State(a, None, None, None, 128, 0.0, 64, 1, nf4deq.NF4, nf4deq.FLOAT16)
        expect(ext.dequantize_cuda_state(0, p, o, None), nf4deq.EINVAL, "ext: NULL state -> EINVAL", ("state",))
        expect(ext.empty_cuda(None), (nf4deq.ENODEV, nf4deq.ECUDA), "ext: empty launch without a GPU -> ENODEV")
        check("state" not in nf4deq.last_error(), "each entry point reports its own failure", nf4deq.last_error())
        rc = ext.dequantize_cuda_state(ctypes.addressof(state), p, o, 0)
        expect(rc, (nf4deq.ENODEV, nf4deq.ECUDA), "ext: a real state without a GPU -> ENODEV/ECUDA")
        rc2 = lib.nf4deq_dequantize_cuda_state(ctypes.addressof(state), p, o, None)
        check(rc2 == rc, "ext and ctypes return the same status", f"{rc} vs {rc2}")
        for bad, label in (((0, 0, 0), "three arguments"), (("x", 0, 0, 0), "a str"), ((1.5, 0, 0, 0), "a float")):
            try:
                ext.dequantize_cuda_state(*bad)
                check(False, f"ext: {label} raises TypeError")
            except TypeError:
                check(True, f"ext: {label} raises TypeError")
        try:
            ext.dequantize_cuda_state(-1 << 70, 0, 0, 0)
            check(False, "ext: an address out of range raises OverflowError")
        except OverflowError:
            check(True, "ext: an address out of range raises OverflowError")
        check_eager_cached(ext, lib)
        import subprocess
        env = dict(os.environ, NF4DEQ_CTYPES="1", PYTHONPATH=str(HERE.parent))
        route = subprocess.run([sys.executable, "-c", "import nf4deq; print(nf4deq.launch_route())"], env=env,
                               capture_output=True, text=True).stdout.strip()
        check(route == "ctypes", "NF4DEQ_CTYPES=1 -> ctypes", route)
    else:
        check(nf4deq.launch_route() == "ctypes", "no extension built -> ctypes", nf4deq.launch_route())

    # The package must not have pulled torch in.
    check("torch" not in sys.modules, "import nf4deq does not import torch")

    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
