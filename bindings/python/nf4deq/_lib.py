"""Loads libnf4deq.so with ctypes. Needs nothing but the standard library, so the
CPU ABI can be tested (and used with numpy) where torch is not installed."""
import ctypes
import ctypes.util
import os
from pathlib import Path

ABI_VERSION = 1  # the NF4DEQ_ABI_VERSION these bindings were written for

# enum nf4deq_quant_type / nf4deq_out_dtype / nf4deq_status (include/nf4deq.h)
NF4, FP4 = 0, 1
FLOAT16, BFLOAT16, FLOAT32 = 0, 1, 2
OK, EINVAL, ECUDA, ENODEV, ENOMEM = 0, 1, 2, 3, 4
QUANT_TYPES = {"nf4": NF4, "fp4": FP4}


class State(ctypes.Structure):
    """struct nf4deq_state (include/nf4deq.h): a weight's quantization state,
    filled once, passed by address to nf4deq_dequantize_cuda_state."""

    _fields_ = [
        ("absmax", ctypes.c_void_p),
        ("nested_absmax", ctypes.c_void_p),
        ("nested_code", ctypes.c_void_p),
        ("nested_offset_device", ctypes.c_void_p),
        ("n", ctypes.c_uint64),
        ("nested_offset", ctypes.c_float),
        ("blocksize", ctypes.c_uint32),
        ("nested_blocksize", ctypes.c_uint32),
        ("quant_type", ctypes.c_int32),
        ("out_dtype", ctypes.c_int32),
    ]


class Nf4deqError(RuntimeError):
    """A call into libnf4deq returned an error status; .status holds it."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def _candidates():
    """Where to look, in order; see README.md."""
    env = os.environ.get("NF4DEQ_LIBRARY")
    if env:  # an explicit choice: never silently fall back to another copy
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / "libnf4deq.so"  # copied next to the package (a wheel, an install)
    yield here.parents[2] / "build" / "libnf4deq.so"  # <repo>/bindings/python/nf4deq -> <repo>/build
    found = ctypes.util.find_library("nf4deq")  # installed system-wide (make install)
    if found:
        yield Path(found)


def _declare(lib):
    """Sets argtypes/restype once: ctypes then converts Python ints and floats
    itself, and a wrong argument count fails instead of corrupting the stack."""
    vp, f, fp = ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p  # float* as void*: we pass addresses
    u32, u64, i = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
    lib.nf4deq_dequantize_cuda.argtypes = [vp, vp, fp, fp, f, fp, u64, u32, u32, i, i, vp, vp]
    lib.nf4deq_dequantize_cuda.restype = i
    lib.nf4deq_dequantize_cpu.argtypes = [vp, vp, fp, fp, f, u64, u32, u32, i, i, vp, i]
    lib.nf4deq_dequantize_cpu.restype = i
    # Four pointer-sized integers: the cheapest call ctypes makes (see _torch.py).
    lib.nf4deq_dequantize_cuda_state.argtypes = [vp, vp, vp, vp]
    lib.nf4deq_dequantize_cuda_state.restype = i
    lib.nf4deq_empty_cuda.argtypes = [vp]
    lib.nf4deq_empty_cuda.restype = i
    for name in ("nf4deq_version", "nf4deq_last_error"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_char_p
    lib.nf4deq_abi_version.argtypes = []
    lib.nf4deq_abi_version.restype = i
    lib.nf4deq_strerror.argtypes = [i]
    lib.nf4deq_strerror.restype = ctypes.c_char_p


_lib = None
_path = None


def load_library():
    """The loaded ctypes.CDLL (loaded once). Raises OSError when no usable
    library is found, naming every place tried."""
    global _lib, _path
    if _lib is not None:
        return _lib
    tried = []
    for cand in _candidates():
        # find_library returns a bare soname ("libnf4deq.so.0") that dlopen resolves itself.
        if cand.is_absolute() and not cand.exists():
            tried.append(f"{cand} (missing)")
            continue
        try:
            lib = ctypes.CDLL(str(cand))
        except OSError as e:
            tried.append(f"{cand} ({e})")
            continue
        try:
            _declare(lib)
        except AttributeError as e:
            tried.append(f"{cand} (not libnf4deq: {e})")
            continue
        abi = lib.nf4deq_abi_version()
        if abi != ABI_VERSION:
            raise OSError(f"nf4deq: {cand} has ABI version {abi}, these bindings need {ABI_VERSION}")
        _lib, _path = lib, str(cand)
        return lib
    raise OSError(
        "nf4deq: libnf4deq.so not found. Build it with `make` in the nf4deq repository, "
        "or set NF4DEQ_LIBRARY=/path/to/libnf4deq.so. Tried: " + "; ".join(tried or ["nothing"])
    )


EXTENSION_FILE = "_nf4deq_launch.abi3.so"
EXTENSION_API = 4  # _launch.c's EXT_API_VERSION
_ext = False  # False: not looked for yet; None: not in use


def load_launch_extension():
    """The _nf4deq_launch module (bindings/python/nf4deq/_launch.c) bound to the
    loaded library, or None: when NF4DEQ_CTYPES=1, or when it was not built.
    It makes the eager CUDA call without ctypes' argument conversion; the
    results are the same either way. Looked for beside the loaded library, then
    beside this package. A file that is there but does not load raises."""
    global _ext
    if _ext is not False:
        return _ext
    lib = load_library()
    _ext = None
    if os.environ.get("NF4DEQ_CTYPES") == "1":
        return None
    places = []
    if "/" in _path:  # a path, not a bare soname that dlopen searched for
        places.append(Path(_path).resolve().parent / EXTENSION_FILE)
    places.append(Path(__file__).resolve().parent / EXTENSION_FILE)
    for path in places:
        if not path.is_file():
            continue
        import importlib.util

        spec = importlib.util.spec_from_file_location("nf4deq._nf4deq_launch", path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except ImportError as e:
            raise OSError(f"nf4deq: {path} does not load ({e}); rebuild it with `make`, "
                          f"or set NF4DEQ_CTYPES=1 to call through ctypes") from None
        if getattr(mod, "API_VERSION", None) != EXTENSION_API:
            raise OSError(f"nf4deq: {path} has API version {getattr(mod, 'API_VERSION', None)}, "
                          f"these bindings need {EXTENSION_API}; rebuild it with `make`")
        mod.bind(ctypes.cast(lib.nf4deq_dequantize_cuda_state, ctypes.c_void_p).value,
                 ctypes.cast(lib.nf4deq_empty_cuda, ctypes.c_void_p).value)
        _ext = mod
        break
    return _ext


def launch_route():
    """How the eager CUDA call reaches the library: "extension PATH" or "ctypes"."""
    ext = load_launch_extension()
    return f"extension {ext.__file__}" if ext is not None else "ctypes"


def library_path():
    load_library()
    return _path


def version():
    return load_library().nf4deq_version().decode()


def last_error():
    return load_library().nf4deq_last_error().decode(errors="replace")


def strerror(status):
    return load_library().nf4deq_strerror(status).decode()


def check(status, what="nf4deq"):
    """Raises Nf4deqError for a non-OK status, with the library's own message.
    Must run on the thread that made the call (the message is per thread)."""
    if status != OK:
        raise Nf4deqError(status, f"{what}: {strerror(status)}: {last_error()}")
