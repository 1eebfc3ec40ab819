"""nf4deq: bitsandbytes 4-bit (NF4/FP4) dequantization, byte-identical to
bitsandbytes.functional.dequantize_4bit, through libnf4deq.so and ctypes.

Importing this package needs only the standard library. The PyTorch functions
(dequantize, fast_dequantize, the torch.ops.nf4deq custom ops) are loaded on
first use, so the ctypes layer also works where torch is not installed.
"""
from ._lib import (  # noqa: F401
    ABI_VERSION,
    BFLOAT16,
    ECUDA,
    EINVAL,
    ENODEV,
    ENOMEM,
    FLOAT16,
    FLOAT32,
    FP4,
    NF4,
    OK,
    Nf4deqError,
    check,
    last_error,
    launch_route,
    library_path,
    load_library,
    strerror,
    version,
)

_TORCH_NAMES = ("dequantize", "fast_dequantize")


def __getattr__(name):
    # PEP 562: import torch only when a torch-facing function is asked for.
    if name in _TORCH_NAMES:
        from . import _torch

        # Bind them as real module attributes: later lookups (one per weight per
        # step in a training loop) then skip this function.
        for n in _TORCH_NAMES:
            globals()[n] = getattr(_torch, n)
        return globals()[name]
    raise AttributeError(f"module 'nf4deq' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_TORCH_NAMES))
