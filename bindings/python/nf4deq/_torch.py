"""PyTorch front end: dequantize(), fast_dequantize() and the torch.ops.nf4deq
custom ops, all calling libnf4deq through ctypes.

Two paths, one kernel:
- eager (the common QLoRA case): a direct call into the library. QLoRA
  dequantizes every weight on every forward and backward pass, so the host cost
  per call matters as much as the kernel: the pointers and sizes of each quant
  state are worked out once and cached, the offset is read on the GPU (never
  .item(), which would synchronize), and nothing goes through the dispatcher.
  Where the _nf4deq_launch extension was built, a cached call (same quant
  state, the same weight or a view of it with the same layout, output
  allocated or in the global buffer) is made by the extension in C; the
  Python path below makes every other call, and fills the extension's caches.
- torch.compile: torch.ops.nf4deq.dequantize_4bit, a custom op with a fake
  implementation, so Dynamo traces it without a graph break. Its real
  implementation calls the same ctypes function.
"""
import ctypes
import math
import weakref
from typing import List, Optional

import torch

from . import _lib

_L = _lib.load_library()
_cpu_fn = _L.nf4deq_dequantize_cpu
# The eager CUDA call: through the _nf4deq_launch extension where it was built
# (0.4-0.8 us a call less than ctypes' argument conversion, H200 host), else ctypes. Both
# take the same four integers and return the library's status.
_ext = _lib.load_launch_extension()
_cuda_state_fn = _ext.dequantize_cuda_state if _ext is not None else _L.nf4deq_dequantize_cuda_state

_OUT_DTYPE = {torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16, torch.float32: _lib.FLOAT32}
_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts

# Cheap C entry points where they exist; the public spellings otherwise.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda dev: torch.cuda.current_stream(dev).cuda_stream
)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
# bitsandbytes' Params4bit overrides __torch_function__, which turns even
# W.data_ptr() into a Python call; this switches that off for one read.
_no_torch_function = torch._C.DisableTorchFunctionSubclass

_vp, _f32, _u32, _u64, _int = ctypes.c_void_p, ctypes.c_float, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
# Bound once: the eager path reads these on every call, and a module global is
# one lookup where torch.nn.Parameter is three.
_Tensor, _Parameter, _Module = torch.Tensor, torch.nn.Parameter, torch.nn.Module
_data_ptr = torch.Tensor.data_ptr


def _unpack(qs):
    """A bitsandbytes QuantState, or the list form of bitsandbytes < 0.41, as
    (absmax, shape, dtype, blocksize, quant_type, offset, nested_absmax,
    nested_code, nested_blocksize). Nested parts are None for single quant."""
    if isinstance(qs, (list, tuple)):
        # [absmax, shape, dtype, blocksize, [offset, state2] or None, quant_type(, code)]
        # with state2 = [absmax2, code2, blocksize2, ...] (old quantize_blockwise) or a QuantState.
        if len(qs) < 5:
            raise TypeError(f"nf4deq: a list quant state needs at least 5 items, got {len(qs)}")
        absmax, shape, dtype, blocksize, compressed = qs[:5]
        quant_type = qs[5] if len(qs) > 5 and isinstance(qs[5], str) else "nf4"
        if compressed is None:
            offset = state2 = None
        elif isinstance(compressed, (list, tuple)) and len(compressed) == 2:
            offset, state2 = compressed
        else:
            raise TypeError("nf4deq: a list quant state's fifth item must be None or [offset, state2]")
        if state2 is None:
            nabs = ncode = nbs = None
        elif isinstance(state2, (list, tuple)):
            if len(state2) < 3:
                raise TypeError(f"nf4deq: a list state2 needs [absmax, code, blocksize, ...], got {len(state2)} items")
            nabs, ncode, nbs = state2[0], state2[1], state2[2]
        else:
            nabs, ncode, nbs = state2.absmax, state2.code, state2.blocksize
        return absmax, shape, dtype, blocksize, quant_type, offset, nabs, ncode, nbs
    if isinstance(qs, dict):
        raise TypeError("nf4deq: the quant state is a dict (QuantState.as_dict); pass "
                        "bitsandbytes' QuantState.from_dict(...) of it")
    if getattr(qs, "packing_format_for_cpu", False):
        # Linear4bit's CPU inference layout (bitsandbytes repacks on a CPU forward).
        raise ValueError("nf4deq: this weight is in bitsandbytes' CPU-packed layout; "
                         "move the Linear4bit to CUDA (or save it) to get the standard layout back")
    state2 = getattr(qs, "state2", None)
    if state2 is None:
        return qs.absmax, qs.shape, qs.dtype, qs.blocksize, qs.quant_type, None, None, None, None
    return (qs.absmax, qs.shape, qs.dtype, qs.blocksize, qs.quant_type, qs.offset,
            state2.absmax, state2.code, state2.blocksize)


def _dev_index(t):
    """-1 for a CPU tensor, the CUDA device index otherwise."""
    if t.device.type == "cpu":
        return -1
    if t.device.type != "cuda":
        raise ValueError(f"nf4deq: tensors must be on the CPU or a CUDA device, not {t.device}")
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _f32_contig(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"nf4deq: {what} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        t = t.float()
    return t.contiguous()


class _Entry:
    """Everything one quant state needs for a launch, worked out once. The
    source objects are kept (strongly) and compared by identity on every call,
    so a quant state that is moved (QuantState.to reassigns its tensors) or
    retyped (the Unsloth puzzle sets quant_state.dtype) is worked out again."""

    __slots__ = ("qs_ref", "src", "src_ptrs", "off_host", "keep", "dev", "device", "n", "shape", "dtype",
                 "cpu_args", "state", "state_addr", "template", "w_ref", "wptr", "wsig", "transposed")

    def sources_match(self, qs):
        """qs holds the tensors this entry was built from, where it built it."""
        return self._same_objects(qs) and self._same_storage()

    def _same_objects(self, qs):
        # Straight from the instance dictionaries: QuantState defines
        # __getattr__, which makes every attribute read slower. Objects kept
        # elsewhere (slots, properties) take the attribute route.
        s = self.src
        try:
            d = qs.__dict__
            if (d["absmax"] is not s[0] or d["shape"] is not s[1] or d["dtype"] is not s[2]
                    or d["blocksize"] != s[3] or d["quant_type"] != s[4]):
                return False
            st2 = d["state2"]
            if st2 is None:
                return s[5] is None
            d2 = st2.__dict__
            return (s[5] is st2 and d["offset"] is s[6] and d2["absmax"] is s[7] and d2["code"] is s[8]
                    and d2["blocksize"] == s[9])
        except (AttributeError, KeyError):
            return self._same_objects_by_attrs(qs)

    def _same_storage(self):
        """The source tensors (the same objects: _same_objects) still keep
        their data where the entry points."""
        s, p = self.src, self.src_ptrs
        return (_data_ptr(s[0]) == p[0] and (s[5] is None or (
            (p[1] is None or _data_ptr(s[6]) == p[1]) and _data_ptr(s[7]) == p[2] and _data_ptr(s[8]) == p[3])))

    def _same_objects_by_attrs(self, qs):
        s = self.src
        if (s[0] is not qs.absmax or s[1] is not qs.shape or s[2] is not qs.dtype or s[3] != qs.blocksize
                or s[4] != qs.quant_type):
            return False
        st2 = getattr(qs, "state2", None)
        if st2 is None:
            return s[5] is None
        return (s[5] is st2 and s[6] is qs.offset and s[7] is st2.absmax and s[8] is st2.code
                and s[9] == st2.blocksize)


def _build(unpacked):
    """Validates a quant state and turns it into an _Entry (ctypes arguments
    ready, tensors it points into kept alive). Raises ValueError/TypeError."""
    absmax, shape, dtype, blocksize, quant_type, offset, nabs, ncode, nbs = unpacked
    if quant_type not in _lib.QUANT_TYPES:
        raise ValueError(f"nf4deq: quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if dtype not in _OUT_DTYPE:
        raise ValueError(f"nf4deq: quant_state.dtype must be float16, bfloat16 or float32, got {dtype}")
    if blocksize not in _BLOCKSIZES:
        raise ValueError(f"nf4deq: invalid blocksize {blocksize}")
    if shape is None:
        raise ValueError("nf4deq: the quant state has no shape")
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    if not isinstance(absmax, torch.Tensor):
        raise TypeError("nf4deq: quant_state.absmax must be a tensor")
    dev = _dev_index(absmax)
    keep = []
    off_host = None
    if nabs is None:  # single quant: absmax holds the fp32 scales
        absmax = _f32_contig(absmax, "absmax")
        nabs_ptr = ncode_ptr = None
        off_val, off_ptr, nbs = 0.0, None, 1
    else:  # double quant: absmax holds uint8 codes into ncode, scaled by nabs per nbs blocks
        if absmax.dtype != torch.uint8:
            raise ValueError(f"nf4deq: double-quant absmax must be uint8 codes, got {absmax.dtype}")
        absmax = absmax.contiguous()
        if not isinstance(nbs, int) and not (isinstance(nbs, torch.Tensor) and nbs.numel() == 1):
            raise TypeError(f"nf4deq: the nested blocksize must be an int, got {type(nbs).__name__}")
        nbs = int(nbs)
        if nbs <= 0 or nbs & (nbs - 1):
            raise ValueError(f"nf4deq: nested blocksize {nbs} is not a power of two")
        nabs, ncode = _f32_contig(nabs, "nested absmax"), _f32_contig(ncode, "nested code")
        if nabs.numel() < -(-blocks // nbs) or ncode.numel() < 256:
            raise ValueError(f"nf4deq: nested absmax has {nabs.numel()} values (needs {-(-blocks // nbs)}), "
                             f"nested code {ncode.numel()} (needs 256)")
        if _dev_index(nabs) != dev or _dev_index(ncode) != dev:
            raise ValueError("nf4deq: the quant state's tensors are on different devices")
        keep += [nabs, ncode]
        nabs_ptr, ncode_ptr = nabs.data_ptr(), ncode.data_ptr()
        if offset is None:
            raise ValueError("nf4deq: a double-quant state needs an offset")
        off_val, off_ptr = 0.0, None
        if isinstance(offset, torch.Tensor):
            if offset.numel() != 1:
                raise ValueError("nf4deq: the offset must hold one value")
            if dev >= 0 and _dev_index(offset) == dev:
                # Read on the GPU by the kernel: no .item(), no host sync. bitsandbytes
                # adds it to fp32 absmax, i.e. as fp32, hence the cast.
                offset = _f32_contig(offset, "offset")
                keep.append(offset)
                off_ptr = offset.data_ptr()
            elif offset.device.type == "cpu":
                off_val = float(offset.item())  # a host tensor: no sync
                off_host = offset  # read again on every call: it may change in place
            else:
                raise ValueError(f"nf4deq: offset on {offset.device}, quant state on {absmax.device}")
        else:
            off_val = float(offset)
    if absmax.numel() < blocks:
        raise ValueError(f"nf4deq: absmax has {absmax.numel()} values, {shape} in blocks of {blocksize} needs {blocks}")
    keep.append(absmax)
    e = _Entry()
    e.keep, e.dev, e.n, e.shape, e.dtype = keep, dev, n, shape, dtype
    e.device = absmax.device
    qt, odt = _lib.QUANT_TYPES[quant_type], _OUT_DTYPE[dtype]
    if dev >= 0:
        # struct nf4deq_state: each call then passes four integers, the
        # cheapest call ctypes makes (0.55 us less than the 13 arguments of
        # nf4deq_dequantize_cuda, H200 host: docs/PERFORMANCE.md).
        e.state = _lib.State(absmax.data_ptr(), nabs_ptr, ncode_ptr, off_ptr, n, off_val, blocksize, nbs, qt, odt)
        e.state_addr = ctypes.addressof(e.state)
    else:
        # Pre-built ctypes objects: with argtypes set, ctypes passes these through as they are.
        e.cpu_args = (_vp(absmax.data_ptr()), _vp(nabs_ptr), _vp(ncode_ptr), _f32(off_val), _u64(n),
                      _u32(blocksize), _u32(nbs), _int(qt), _int(odt))
    e.template = None
    e.w_ref, e.wptr, e.wsig, e.transposed = None, None, None, False
    e.off_host = off_host
    e.src_ptrs = _source_pointers(unpacked)
    return e


def _ptr(t):
    return _data_ptr(t) if isinstance(t, torch.Tensor) else None


def _source_pointers(unpacked):
    """Where the quant state's tensors keep their data. An entry is built for
    these: a tensor that keeps its identity but gets new storage (.data =,
    set_(), resize_()) must not be read at the old address."""
    absmax, _, _, _, _, offset, nabs, ncode, _ = unpacked
    return (_ptr(absmax), _ptr(offset), _ptr(nabs), _ptr(ncode))


def _reread_host_offset(e):
    """A double-quant offset held in host memory is read on every call (an
    in-place change must show), not once when the entry was built."""
    v = float(e.off_host.item())
    if e.dev >= 0:
        e.state.nested_offset = v
    else:
        a = e.cpu_args
        e.cpu_args = a[:3] + (_f32(v),) + a[4:]


def _layout(w):
    """Everything _bind_weight's outcome depends on besides the data pointer."""
    return w.shape, w.stride(), w.dtype, w.get_device()


def _layout_unwrapped(w):
    """_layout of a Tensor subclass, read with torch functions off as
    _bind_weight reads it (a subclass's t() may be of the subclass again)."""
    with _no_torch_function():
        return _layout(w)


def _bind_weight(e, w):
    """Checks the packed weight against the entry. Returns (tensor to read,
    transposed, cacheable, layout): a non-contiguous or (on the GPU) misaligned
    weight is copied, and then not cached."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"nf4deq: the weight must be a tensor, got {type(w).__name__}")
    with _no_torch_function():
        if _dev_index(w) != e.dev:
            raise ValueError(f"nf4deq: weight on {w.device}, quant state on {e.device}")
        nbytes = w.numel() * w.element_size()
        if nbytes < (e.n + 1) // 2:
            raise ValueError(f"nf4deq: the packed weight has {nbytes} bytes, {e.n} values need {(e.n + 1) // 2}")
        transposed = w.dim() > 0 and w.shape[0] == 1  # bitsandbytes then returns out.t()
        cacheable = w.is_contiguous() and (e.dev < 0 or w.data_ptr() % 16 == 0)
        layout = _layout(w)
        if not cacheable:
            w = w.contiguous() if not w.is_contiguous() else w.clone()  # fresh allocations are aligned
        return w, transposed, cacheable, layout


def _launch(e, wptr, optr):
    if e.dev >= 0:
        if _current_device() == e.dev:
            rc = _cuda_state_fn(e.state_addr, wptr, optr, _raw_stream(e.dev))
        else:  # the library launches on the current device
            with torch.cuda.device(e.dev):
                rc = _cuda_state_fn(e.state_addr, wptr, optr, _raw_stream(e.dev))
    else:
        rc = _cpu_fn(wptr, *e.cpu_args, optr, torch.get_num_threads())
    if rc:
        _lib.check(rc, "nf4deq_dequantize_cuda" if e.dev >= 0 else "nf4deq_dequantize_cpu")


def _out_ok(e, out):
    """Can the kernel write straight into out?"""
    if not isinstance(out, torch.Tensor):
        raise TypeError("nf4deq: out must be a tensor")
    if out.dtype is not e.dtype or out.numel() != e.n:
        raise ValueError(f"nf4deq: out must be {e.dtype} with {e.n} elements (shape {e.shape}), "
                         f"got {out.dtype} {tuple(out.shape)}")
    # get_device() is -1 for the CPU and for meta alike; only then is the
    # (slower) device type read.
    if out.get_device() != e.dev or (e.dev < 0 and out.device.type != "cpu"):
        raise ValueError(f"nf4deq: out on {out.device}, weight on {e.device}")
    return out.is_contiguous() and (e.dev < 0 or out.data_ptr() % 16 == 0)


# How a new output is allocated: torch.empty_like of the entry's template, a
# 0-dim tensor expanded (no memory of its own) to the output's shape. On an H200
# host that takes 1.85 us a call against 2.43 for new_empty(shape), which parses
# the shape each time (docs/PERFORMANCE.md). The memory format is given, so the
# output is contiguous whatever the (all-zero) strides of the template suggest.
_empty_like = torch.empty_like
_CONTIGUOUS = torch.contiguous_format
_ALLOC_KWARGS = {"memory_format": _CONTIGUOUS}
_scalars = {}  # (dtype, device) -> the 0-dim tensor the templates expand


def _out_template(e):
    key = (e.dtype, e.device)
    base = _scalars.get(key)
    if base is None:
        base = _scalars[key] = torch.empty((), dtype=e.dtype, device=e.device)
    return base.expand(e.shape)


# Per-device reusable output, like Unsloth's WEIGHT_BUFFERS (use_global_buffer=True).
_global_buffers = {}
# Per device, (dtype, shape, transposed) -> buffer[:n].view(shape), or its t(),
# of that device's current buffer, emptied whenever the buffer is replaced.
# Each call returns a new tensor over the cached view's memory (its detach()):
# 0.5 us against 1.9-5 us for slicing and viewing the buffer again, and 1 us
# more for the t() of a transposed result (H200 host, tests/perf/eager_patterns.py).
_global_views = {}


def _global_view(e, transposed):
    """The cached view of the current global buffer that e's output is,
    transposed as the call returns it."""
    key = e.dev
    views = _global_views.get(key)
    vkey = (e.dtype, e.shape, transposed)
    v = views.get(vkey) if views is not None else None
    if v is None:
        # Made outside inference mode: whether a call first ran under
        # torch.inference_mode() must not decide, for every later call,
        # whether the result can take part in autograd.
        with torch.inference_mode(False):
            buf = _global_buffers.get(key)
            if buf is None or buf.dtype is not e.dtype or buf.numel() < e.n:
                buf = torch.empty(max(e.n, buf.numel() if buf is not None and buf.dtype is e.dtype else 0),
                                  dtype=e.dtype, device=e.device)
                _global_buffers[key] = buf
                views = None
                # The extension's global-buffer entries hold views of the old
                # buffer: dropped, so that no call writes there and its memory is freed.
                _fast_global_cache.clear()
            if views is None:
                views = _global_views[key] = {}
            v = buf[: e.n].view(e.shape)
            v = views[vkey] = v.t() if transposed else v
    return v


# id(quant state) -> _Entry. Keyed by id because QuantState defines __eq__ and
# so is not hashable; the weakref in the entry guards against a reused id, and
# its callback drops the entry when the quant state goes away.
_cache = {}
# id(quant state) -> the extension's fast entry (_register_fast), for calls
# that return a new tensor; dropped with the _cache entry.
_fast_cache = {}
# The same for calls into the global buffer; emptied when a buffer is replaced.
_fast_global_cache = {}
_eager_cached = None
if _ext is not None:
    _ext.bind_eager(_fast_cache, _fast_global_cache, _Tensor, _Parameter, _Tensor.data_ptr, _current_device,
                    _raw_stream, _no_torch_function, _lib.check)
    _eager_cached = _ext.eager_cached


def _drop(key):
    _cache.pop(key, None)
    _fast_cache.pop(key, None)
    _fast_global_cache.pop(key, None)


def _cached_entry(qs):
    key = id(qs)
    e = _build(_unpack(qs))
    try:
        e.qs_ref = weakref.ref(qs, lambda _r, key=key: _drop(key))
    except TypeError:  # an object that takes no weak reference: not cached
        e.qs_ref = lambda: None
        return e
    st2 = getattr(qs, "state2", None)
    e.src = (qs.absmax, qs.shape, qs.dtype, qs.blocksize, qs.quant_type, st2,
             qs.offset if st2 is not None else None,
             st2.absmax if st2 is not None else None, st2.code if st2 is not None else None,
             st2.blocksize if st2 is not None else None)
    _cache[key] = e
    return e


def _register_fast(e, qs, global_view):
    """Hands the extension what it needs to make this call again by itself
    (the tuple's layout: FAST_* in _launch.c). Only for an entry in _cache
    whose weight binding is cached, on a CUDA device. global_view: the
    global buffer's view the call returned (detached), already transposed
    where the call transposes, else None."""
    s = e.src
    if global_view is None:
        _fast_cache[id(qs)] = (e.qs_ref, *s, e.src_ptrs, e.w_ref, e.wptr, e.wsig, _empty_like, (e.template,),
                               _ALLOC_KWARGS, e.state_addr, e.dev, e.transposed, e)
    else:
        _fast_global_cache[id(qs)] = (e.qs_ref, *s, e.src_ptrs, e.w_ref, e.wptr, e.wsig, global_view.detach, (),
                                      None, e.state_addr, e.dev, False, e)


def _eager(w, qs, out, use_global_buffer):
    e = _cache.get(id(qs))  # a list-form state is never cached: a miss
    if e is None or e.qs_ref() is not qs or not e.sources_match(qs):
        if type(qs) in (list, tuple):  # old list form: nothing stable to cache on
            e = _build(_unpack(qs))
        else:
            e = _cached_entry(qs)
    if e.off_host is not None:
        _reread_host_offset(e)
    # The weight: one pointer read per call; the checks run again only when
    # the weight object or its storage changed.
    tw = type(w)
    plain = tw is _Tensor or tw is _Parameter
    if plain:
        wptr = w.data_ptr()
    elif isinstance(w, _Tensor):
        with _no_torch_function():
            wptr = w.data_ptr()
    else:
        raise TypeError(f"nf4deq: the weight must be a tensor, got {tw.__name__}")
    # bound: the weight is the bound one, or another tensor over the same
    # bytes with the same layout, such as the W.t() view Unsloth's matmul_lora
    # makes on every call: _bind_weight would find what it found for the bound one.
    bound = wptr == e.wptr and e.w_ref is not None and (
        e.w_ref() is w or (_layout(w) if plain else _layout_unwrapped(w)) == e.wsig)
    if bound:
        transposed = e.transposed
    else:
        src, transposed, cacheable, layout = _bind_weight(e, w)
        if cacheable:
            e.w_ref, e.wptr, e.wsig, e.transposed = weakref.ref(w), wptr, layout, transposed
        else:
            # A copy: alive in this frame until the launch is queued, and freed
            # in stream order after it, so it is never cached.
            e.w_ref = e.wptr = e.wsig = None
            wptr = src.data_ptr()

    view = None  # the global buffer's view, transposed as returned
    if out is None:
        if use_global_buffer:
            view = _global_view(e, transposed)
            res = view.detach()
        else:
            t = e.template
            if t is None:
                t = e.template = _out_template(e)
            res = _empty_like(t, memory_format=_CONTIGUOUS)
        dev = e.dev
        if dev >= 0 and _current_device() == dev:
            # _launch's common case, inlined: a Python call less per weight.
            rc = _cuda_state_fn(e.state_addr, wptr, res.data_ptr(), _raw_stream(dev))
            if rc:
                _lib.check(rc, "nf4deq_dequantize_cuda")
            # A call the extension did not make, with a cached entry and the
            # weight it was bound to before: the extension makes the next one.
            # Not on a weight's first call, so that a weight seen once costs no
            # registration.
            if _eager_cached is not None and bound and e.off_host is None and _cache.get(id(qs)) is e:
                _register_fast(e, qs, view)
        else:
            _launch(e, wptr, res.data_ptr())
    elif _out_ok(e, out):
        _launch(e, wptr, out.data_ptr())
        res = out
    else:  # non-contiguous or misaligned out: dequantize aside, then copy in
        tmp = torch.empty(e.shape, dtype=e.dtype, device=e.device)
        _launch(e, wptr, tmp.data_ptr())
        out.copy_(tmp.view(out.shape))
        res = out
    return res.t() if transposed and view is None else res


# ---------------------------------------------------------------------------
# Custom ops, for torch.compile. The schema carries plain tensors and numbers;
# the QuantState is taken apart in dequantize() before the op is called.


def _op_run(packed, absmax, nested_absmax, nested_code, offset, offset_value, shape, blocksize,
            nested_blocksize, quant_type, dtype, out):
    qt = "nf4" if quant_type == _lib.NF4 else "fp4" if quant_type == _lib.FP4 else quant_type
    off = offset if offset is not None else offset_value
    e = _build((absmax, shape, dtype, blocksize, qt, off, nested_absmax, nested_code,
                nested_blocksize if nested_absmax is not None else None))
    src = _bind_weight(e, packed)[0]
    if out is None:
        out = torch.empty(e.shape, dtype=e.dtype, device=e.device)
    elif not _out_ok(e, out):
        tmp = torch.empty(e.shape, dtype=e.dtype, device=e.device)
        _launch(e, src.data_ptr(), tmp.data_ptr())
        out.copy_(tmp.view(out.shape))
        return out
    _launch(e, src.data_ptr(), out.data_ptr())
    return out


@torch.library.custom_op("nf4deq::dequantize_4bit", mutates_args=())
def _dequantize_op(packed: torch.Tensor, absmax: torch.Tensor, nested_absmax: Optional[torch.Tensor],
                   nested_code: Optional[torch.Tensor], offset: Optional[torch.Tensor], offset_value: float,
                   shape: List[int], blocksize: int, nested_blocksize: int, quant_type: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Returns a new [shape] tensor of dtype. packed is NOT transposed back here
    (the caller does, as bitsandbytes does)."""
    return _op_run(packed, absmax, nested_absmax, nested_code, offset, offset_value, shape, blocksize,
                   nested_blocksize, quant_type, dtype, None)


@_dequantize_op.register_fake
def _(packed, absmax, nested_absmax, nested_code, offset, offset_value, shape, blocksize, nested_blocksize,
      quant_type, dtype):
    return torch.empty(shape, dtype=dtype, device=packed.device)


@torch.library.custom_op("nf4deq::dequantize_4bit_out", mutates_args=("out",))
def _dequantize_out_op(packed: torch.Tensor, absmax: torch.Tensor, nested_absmax: Optional[torch.Tensor],
                       nested_code: Optional[torch.Tensor], offset: Optional[torch.Tensor], offset_value: float,
                       shape: List[int], blocksize: int, nested_blocksize: int, quant_type: int,
                       dtype: torch.dtype, out: torch.Tensor) -> None:
    _op_run(packed, absmax, nested_absmax, nested_code, offset, offset_value, shape, blocksize,
            nested_blocksize, quant_type, dtype, out)


@_dequantize_out_op.register_fake
def _(packed, absmax, nested_absmax, nested_code, offset, offset_value, shape, blocksize, nested_blocksize,
      quant_type, dtype, out):
    return None


def _traced(w, qs, out):
    """The torch.compile path: everything here is traceable Python; the work is
    one custom-op node."""
    absmax, shape, dtype, blocksize, quant_type, offset, nabs, ncode, nbs = _unpack(qs)
    offset_t = offset if isinstance(offset, torch.Tensor) else None
    offset_v = float(offset) if offset is not None and offset_t is None else 0.0
    args = (w, absmax, nabs, ncode, offset_t, offset_v, [int(s) for s in shape], int(blocksize),
            int(nbs) if nbs is not None else 0, _lib.QUANT_TYPES.get(quant_type, -1), dtype)
    if out is None:
        res = torch.ops.nf4deq.dequantize_4bit(*args)
    else:
        torch.ops.nf4deq.dequantize_4bit_out(*args, out)
        res = out
    return res.t() if w.shape[0] == 1 else res


# ---------------------------------------------------------------------------
# Public API


def dequantize(weight, quant_state=None, out=None):
    """Dequantizes a bitsandbytes 4-bit weight; the result is byte-identical to
    bitsandbytes.functional.dequantize_4bit(weight, quant_state, out=out).

    weight: the packed tensor (a Params4bit, or its .data), or a Linear4bit.
    quant_state: a bitsandbytes QuantState or the old list form; default
        weight.quant_state.
    out: optional tensor of quant_state.dtype with the weight's element count.
    CUDA tensors run on the current stream, CPU tensors on the CPU.
    """
    if isinstance(weight, _Module):
        weight = weight.weight
    if quant_state is None:
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            raise ValueError("nf4deq: no quant_state given and the weight has none")
    if _is_compiling():
        return _traced(weight, quant_state, out)
    if out is None and _eager_cached is not None:
        res = _eager_cached(weight, quant_state)
        if res is not None:
            return res
    return _eager(weight, quant_state, out, False)


def fast_dequantize(W, quant_state=None, out=None, use_global_buffer=False):
    """Drop-in for Unsloth's fast_dequantize(W, quant_state, out, use_global_buffer).

    Returns W unchanged when it carries no quant state (an unquantized weight).
    use_global_buffer=True writes into one reused buffer per device (the result
    is overwritten by the next such call), as Unsloth does; under
    torch.compile it is ignored. Unlike Unsloth's, fp32 quant states and FP4
    are handled too, and the output is exactly bitsandbytes'.
    """
    if quant_state is None:
        quant_state = getattr(W, "quant_state", None)
        if quant_state is None:
            return W
    if _is_compiling():
        return _traced(W, quant_state, out)
    if out is None and _eager_cached is not None:
        res = _eager_cached(W, quant_state, use_global_buffer)
        if res is not None:
            return res
    return _eager(W, quant_state, out, use_global_buffer)
