"""The leanest Python path a user would write to undo bnb-4bit today: load the
checkpoint onto the GPU with safetensors, dequantize every 4-bit weight with
bitsandbytes.functional.dequantize_4bit, and save with safetensors.

usage: python_path.py IN_DIR_OR_FILE OUT_FILE
Prints one line: seconds, peak GPU memory (torch allocator), tensors.
"""
import os
import resource
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402
from bitsandbytes.functional import QuantState  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

SUFFIX = ".quant_state.bitsandbytes__nf4"
src, dst = sys.argv[1], sys.argv[2]
files = [src] if os.path.isfile(src) else sorted(
    os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors"))
t_imports = time.perf_counter()

state = {}
for f in files:
    state.update(load_file(f, device="cuda"))
out = {}
for name in list(state):
    if not name.endswith(SUFFIX):
        continue
    base = name[: -len(SUFFIX)]
    parts = {k: v for k, v in state.items() if k.startswith(base + ".")}
    qs = QuantState.from_dict(parts, device=torch.device("cuda"))
    out[base] = F.dequantize_4bit(state[base], qs)
for name, t in state.items():
    if name in out or name.startswith(tuple(b + "." for b in out)):
        continue
    out[name] = t
torch.cuda.synchronize()
save_file({k: v.contiguous().cpu() for k, v in out.items()}, dst)
t1 = time.perf_counter()
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"python path: {t1 - t0:.2f} s total ({t1 - t_imports:.2f} s after imports), "
      f"{len(out)} tensors, peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, peak RSS {rss_mb:.0f} MB")
