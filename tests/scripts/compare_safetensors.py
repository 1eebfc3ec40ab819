"""Compares the tensors of safetensors files or model directories byte for byte
(names, dtypes, shapes, data), with nothing but the standard library, so it
also runs on machines that have no project dependencies installed.

usage: compare_safetensors.py GOT WANT     (each a file or a directory)
"""
import json
import os
import struct
import sys


def tensors(path):
    files = [path]
    if os.path.isdir(path):
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out[name] = (info["dtype"], info["shape"], data[8 + n + begin:8 + n + end])
    return out


def main():
    got, want = tensors(sys.argv[1]), tensors(sys.argv[2])
    bad = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
    for k in bad[:5]:
        if k not in got or k not in want:
            print(f"  {k}: only in {'GOT' if k in got else 'WANT'}")
        else:
            g, w = got[k][2], want[k][2]
            first = next((i for i in range(min(len(g), len(w))) if g[i] != w[i]), min(len(g), len(w)))
            print(f"  {k}: {got[k][:2]} vs {want[k][:2]}, first differing byte {first}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
