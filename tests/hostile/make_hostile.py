#!/usr/bin/env python3
"""Generates the committed hostile corpus: tests/hostile/cases/ and the
manifest tests/hostile/cases.tsv that tests/scripts/check-hostile.sh reads.

Run from anywhere: python3 tests/hostile/make_hostile.py
Python 3 standard library only. The output is deterministic.

Every case starts from real bitsandbytes data cut out of
tests/fixtures/tensors.bnb4.safetensors (the fixture README says how it was
made) and breaks exactly one rule, so its expected message is the one that
rule gives. The base checkpoint holds:
  model.g.weight   nf4, double quant, blocksize 256, [1, 4096]   (as in the fixture)
  model.d.weight   nf4, single quant, blocksize 64, [8, 256]     (the fixture's first 8 rows
                   of [128, 256]: packed bytes and absmax are per block, so a
                   prefix of rows with the prefix of absmax is itself valid)
  model.norm.weight BF16[512], not quantized
Directory cases use two small shards of the same tensors (about 6 KB each),
not copies of the 500 KB tiny-llama model; their config.json is the real one
from tests/fixtures/tiny-llama-bf16-bnb4-sharded.

LoRA adapter cases (lora-*) are adapter directories for the base file
ok-baseline.safetensors: a valid one changes model.d.weight [8, 256] with r = 4;
each other case breaks one rule of the adapter format. Kinds lora and
lora-inspect run `convert BASE OUT --lora CASE` and `inspect BASE --lora CASE`.

Manifest columns (tab-separated, '#' lines are comments):
  name  path (relative to cases/)  kind (convert|inspect|lora|lora-inspect)  exit code  stderr substring
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tensors.bnb4.safetensors")
CONFIG = os.path.join(ROOT, "tests", "fixtures", "tiny-llama-bf16-bnb4-sharded", "config.json")
CASES = os.path.join(HERE, "cases")
MANIFEST = os.path.join(HERE, "cases.tsv")

G = "model.g.weight"
D = "model.d.weight"
NORM = "model.norm.weight"
NF4 = ".quant_state.bitsandbytes__nf4"


# ---- reading the fixture ----------------------------------------------------

def read_fixture():
    with open(FIXTURE, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[b:end])
    return out


class T:
    """One tensor: name, dtype, shape, bytes. Tests edit copies of these."""

    def __init__(self, name, dtype, shape, data):
        self.name, self.dtype, self.shape, self.data = name, dtype, list(shape), bytes(data)

    def copy(self, **kw):
        t = T(self.name, self.dtype, self.shape, self.data)
        for k, v in kw.items():
            setattr(t, k, v)
        return t


def base_tensors():
    fx = read_fixture()
    ts = []
    for suffix in ["", ".absmax", ".nested_absmax", ".nested_quant_map", ".quant_map", NF4]:
        dt, shape, data = fx[G + suffix]
        ts.append(T(G + suffix, dt, shape, data))
    # d: keep the first 8 of 128 rows (8 * 256 values = 32 blocks of 64).
    dt, shape, data = fx[D]
    ts.append(T(D, dt, [1024, 1], data[:1024]))
    dt, shape, data = fx[D + ".absmax"]
    ts.append(T(D + ".absmax", dt, [32], data[:32 * 4]))
    dt, shape, data = fx[D + ".quant_map"]
    ts.append(T(D + ".quant_map", dt, shape, data))
    blob = json.loads(fx[D + NF4][2])
    assert blob["shape"] == [128, 256]
    blob["shape"] = [8, 256]
    ts.append(blob_tensor(D + NF4, blob))
    dt, shape, data = fx[NORM]
    ts.append(T(NORM, dt, shape, data))
    return ts


def blob_tensor(name, obj_or_bytes, dtype="U8"):
    data = obj_or_bytes if isinstance(obj_or_bytes, bytes) else json.dumps(obj_or_bytes).encode()
    return T(name, dtype, [len(data)], data)


def blob_of(ts, name):
    return json.loads(find(ts, name).data)


def find(ts, name):
    for t in ts:
        if t.name == name:
            return t
    raise KeyError(name)


def replace(ts, name, new):
    return [new if t.name == name else t for t in ts]


def drop(ts, name):
    assert any(t.name == name for t in ts), name
    return [t for t in ts if t.name != name]


def with_blob(ts, name, edit):
    obj = blob_of(ts, name)
    edit(obj)
    return replace(ts, name, blob_tensor(name, obj))


# ---- writing safetensors ----------------------------------------------------

def header_text(ts, metadata={"format": "pt"}):
    """The header JSON as the reference writes it (compact), data laid out in list order."""
    parts, off = [], 0
    if metadata is not None:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    for t in ts:
        parts.append('%s:{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}' % (
            json.dumps(t.name), t.dtype, json.dumps(t.shape, separators=(",", ":")), off, off + len(t.data)))
        off += len(t.data)
    return "{" + ",".join(parts) + "}"


def st_bytes(ts, header=None, pad=True, metadata={"format": "pt"}):
    text = header if header is not None else header_text(ts, metadata)
    h = text.encode("utf-8") if isinstance(text, str) else text
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(t.data for t in ts)


# ---- the cases --------------------------------------------------------------

ROWS = []


def row(name, path, kind, code, msg):
    # A successful inspect prints nothing on stderr: "-" says so.
    if code == 0 and kind.endswith("inspect"):
        msg = "-"
    ROWS.append((name if not kind.endswith("inspect") else name + "--inspect", path, kind, code, msg))


def emit(name, blob, code, msg, kinds=("convert",)):
    """A single-file case."""
    path = name + ".safetensors"
    with open(os.path.join(CASES, path), "wb") as f:
        f.write(blob)
    for k in kinds:
        row(name, path, k, code, msg)


def emit_dir(name, files, code, msg, kinds=("convert",)):
    """A directory case: files maps names to bytes (missing dir if None)."""
    d = os.path.join(CASES, name)
    os.makedirs(d, exist_ok=True)
    for fname, blob in sorted(files.items()):
        with open(os.path.join(d, fname), "wb") as f:
            f.write(blob)
    for k in kinds:
        row(name, name, k, code, msg)


def header_edit(ts, old, new):
    """The base header with the first `old` replaced by `new` (str or raw bytes)."""
    text = header_text(ts).encode()
    old = old.encode() if isinstance(old, str) else old
    new = new.encode() if isinstance(new, str) else new
    assert old in text, old
    return st_bytes(ts, text.replace(old, new, 1))


def header_edit_ts(ts, name, new_name):
    """The tensors with one renamed (json.dumps escapes control bytes as \\u00XX)."""
    return replace(ts, name, find(ts, name).copy(name=new_name))


def file_cases(B):
    ok = st_bytes(B)
    emit("ok-baseline", ok, 0, "converted", kinds=("convert", "inspect"))

    # -- the safetensors reader: length prefix
    emit("st-empty-file", b"", 65, "too small for a safetensors header", kinds=("convert", "inspect"))
    emit("st-shorter-than-8-bytes", ok[:5], 65, "too small for a safetensors header")
    emit("st-header-length-over-limit", struct.pack("<Q", 100000001) + ok[8:], 65,
         "exceeds the 100000000-byte limit", kinds=("convert", "inspect"))
    emit("st-header-length-2p64-1", b"\xff" * 8 + ok[8:], 65, "exceeds the 100000000-byte limit")
    emit("st-header-length-past-eof", struct.pack("<Q", len(ok)) + ok[8:], 65, "runs past the end")
    emit("st-header-length-zero", struct.pack("<Q", 0) + ok[8:], 65, "header does not start with '{'")
    # Checkpoint formats taken for safetensors, said as what they are.
    with open(os.path.join(ROOT, "tests", "fixtures", "lora", "adapter-fp16-r4-pickled", "adapter_model.bin"), "rb") as f:
        emit("st-is-torch-zip", f.read(), 65, "is a ZIP archive, such as a PyTorch checkpoint (torch.save",
             kinds=("convert", "inspect"))
    emit("st-is-legacy-pickle", b"\x80\x02\x8a\x0alZ\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.", 65,
         "is a pickle, such as a PyTorch checkpoint from before torch 1.6")
    emit("st-is-gguf", b"GGUF\x03\x00\x00\x00" + bytes(16), 65, "is a GGUF file (llama.cpp), not safetensors")
    # -- header text
    emit("st-header-not-utf8", header_edit(B, '"model.norm.weight"', b'"model.norm.w\xffight"'), 65,
         "header is not valid UTF-8")
    emit("st-header-overlong-utf8", header_edit(B, '"model.norm.weight"', b'"model.norm.w\xc0\xafight"'), 65,
         "header is not valid UTF-8")
    # safetensors 0.8 lets writers pad the header at the front too (JSON white space).
    emit("ok-header-leading-whitespace", st_bytes(B, " \t\r\n" + header_text(B)), 0, "converted",
         kinds=("convert", "inspect"))
    emit("st-header-leading-bom", st_bytes(B, "\ufeff" + header_text(B)), 65, "header does not start with '{'")
    # serde_json, the reference's parser, stops at 128 levels; an unknown key may nest.
    emit("st-header-nested-128-levels", header_edit(B, '"dtype":"BF16"', '"dtype":"BF16","x":' + "[" * 126 + "]" * 126),
         65, "JSON nested more than 127 levels deep")
    emit("ok-header-nested-127-levels", header_edit(B, '"dtype":"BF16"', '"dtype":"BF16","x":' + "[" * 125 + "]" * 125),
         0, "converted")
    emit("st-header-not-json", st_bytes(B, header_text(B)[:-1]), 65, "header is not valid JSON")
    emit("st-header-json-array", st_bytes(B, "{" + header_text(B)[1:-1] + "]"), 65, "header is not valid JSON")
    emit("st-header-trailing-bytes", st_bytes(B, header_text(B) + "x"), 65, "trailing bytes after the header")
    emit("st-header-nul-byte", header_edit(B, '"model.norm.weight"', '"model.norm.weight\x00"'), 65,
         "header contains a NUL byte")
    emit("st-header-control-char", header_edit(B, '"model.norm.weight"', '"model.norm.weight\x01"'), 65,
         "a raw control character")
    emit("st-header-u0000-in-name", header_edit(B, '"model.norm.weight"', '"model.norm.weight\\u0000x"'), 65,
         "a raw control character")
    emit("st-header-malformed-u-escape", header_edit(B, '"model.norm.weight"', '"model.norm.weight\\uZZZZ"'), 65,
         "a raw control character")
    # -- dtype, shape, numbers
    emit("st-dtype-lowercase", header_edit(B, '"dtype":"BF16"', '"dtype":"bf16"'), 65,
         'model.norm.weight: unknown dtype "bf16"')
    # Escaped control bytes are valid JSON; in a message they must not reach the
    # terminal (an ESC sequence) or break the one line (VT): printed as '?'.
    emit("st-name-with-terminal-escapes",
         header_edit(header_edit_ts(B, NORM, "model.norm\x1b[2J\x0b.weight"), '"dtype":"BF16"', '"dtype":"bf16"'),
         65, 'model.norm?[2J?.weight: unknown dtype "bf16"', kinds=("convert", "inspect"))
    emit("ok-dtype-fp8-fnuz", st_bytes(B + [T("x.fnuz_e4m3", "F8_E4M3FNUZ", [4], b"\x11\x22\x33\x44"),
                                            T("x.fnuz_e5m2", "F8_E5M2FNUZ", [2], b"\x55\x66")]), 0, "converted",
         kinds=("convert", "inspect"))
    emit("st-dtype-not-string", header_edit(B, '"dtype":"BF16"', '"dtype":16'), 65,
         "model.norm.weight: dtype is not a string")
    emit("st-shape-negative", header_edit(B, '"shape":[512]', '"shape":[-512]'), 65,
         "numbers must be non-negative integers")
    emit("st-shape-float-literal", header_edit(B, '"shape":[512]', '"shape":[512.0]'), 65,
         "numbers must be non-negative integers")
    emit("st-shape-exponent", header_edit(B, '"shape":[512]', '"shape":[5.12e2]'), 65,
         "numbers must be non-negative integers")
    emit("st-number-leading-zero", header_edit(B, '"shape":[512]', '"shape":[0512]'), 65,
         "numbers must be non-negative integers")
    emit("st-number-17-digits", header_edit(B, '"shape":[512]', '"shape":[12345678901234567]'), 65,
         "numbers must be non-negative integers")
    emit("st-shape-not-array", header_edit(B, '"shape":[512]', '"shape":512'), 65,
         "model.norm.weight: shape is not an array")
    emit("st-shape-product-overflow", header_edit(B, '"shape":[512]', '"shape":[4294967296,4294967296,2]'), 65,
         "model.norm.weight: shape product overflows")
    emit("st-shape-size-mismatch", header_edit(B, '"shape":[512]', '"shape":[511]'), 65,
         "model.norm.weight: data_offsets span 1024 bytes but shape and dtype need 1022")
    emit("st-missing-shape", header_edit(B, '"shape":[512],', ''), 65, 'model.norm.weight: missing "shape"')
    emit("st-key-twice-in-entry", header_edit(B, '"dtype":"BF16"', '"dtype":"BF16","dtype":"BF16"'), 65,
         'model.norm.weight: "dtype" appears more than once')
    emit("st-tensor-entry-not-object", st_bytes(B, header_text(B)[:-1] + ',"x":[1]}'), 65,
         "x: tensor entry is not an object")
    f4 = B + [T("odd.f4", "F4", [3], b"\x00\x00")]
    emit("st-f4-odd-count", st_bytes(f4), 65, "odd.f4: 3 elements of F4 do not fill whole bytes")
    # -- offsets and the data buffer
    n = len(b"".join(t.data for t in B))
    last = "[%d,%d]" % (n - 1024, n)
    emit("st-offsets-not-pair", header_edit(B, last, "[%d]" % (n - 1024)), 65,
         "model.norm.weight: data_offsets is not a pair")
    emit("st-offsets-end-before-begin", header_edit(B, last, "[%d,%d]" % (n, n - 1024)), 65,
         "model.norm.weight: data_offsets end")
    emit("st-offsets-beyond-2p53", header_edit(B, last, "[%d,9007199254740993]" % (n - 1024)), 65,
         "model.norm.weight: data_offsets are not non-negative integers")
    gap = B + [T("z.after.gap", "U8", [4], b"abcd")]
    emit("st-offsets-gap", header_edit(gap, "[%d,%d]" % (n, n + 4), "[%d,%d]" % (n + 4, n + 8)) + b"wxyz", 65,
         "z.after.gap: data starts at")
    emit("st-offsets-overlap", header_edit(gap, "[%d,%d]" % (n, n + 4), "[%d,%d]" % (n - 4, n)), 65,
         "data starts at")
    emit("st-data-truncated", ok[:-1], 65, "tensors cover", kinds=("convert", "inspect"))
    emit("st-data-extra-byte", ok + b"\x00", 65, "tensors cover")
    dup = st_bytes(B + [B[-1]])
    emit("st-duplicate-tensor-name", dup, 65, "model.norm.weight: tensor name appears twice in the header")
    # -- __metadata__
    emit("st-metadata-value-not-string", header_edit(B, '{"format":"pt"}', '{"format":1}'), 65,
         '__metadata__ value of "format" is not a string')
    emit("st-metadata-twice", header_edit(B, '"__metadata__":{"format":"pt"}',
                                          '"__metadata__":{"format":"pt"},"__metadata__":{}'), 65,
         "header has __metadata__ twice")
    emit("st-metadata-not-object", header_edit(B, '{"format":"pt"}', '"pt"'), 65, "__metadata__ is not an object")
    emit("ok-metadata-null", header_edit(B, '{"format":"pt"}', 'null'), 0, "converted", kinds=("convert", "inspect"))
    emit("st-metadata-key-twice", header_edit(B, '{"format":"pt"}', '{"format":"pt","format":"pt"}'), 65,
         '__metadata__ has key "format" twice')

    # -- quant states: parts
    emit("qs-absmax-missing", st_bytes(drop(B, G + ".absmax")), 65,
         "missing quant-state tensor model.g.weight.absmax", kinds=("convert", "inspect"))
    a = find(B, D + ".absmax")
    emit("qs-absmax-short", st_bytes(replace(B, a.name, a.copy(shape=[31], data=a.data[:124]))), 65,
         "model.d.weight.absmax: holds 31 values, expected 32")
    a = find(B, G + ".absmax")
    emit("qs-absmax-wrong-dtype", st_bytes(replace(B, a.name, a.copy(dtype="I8"))), 65,
         "model.g.weight.absmax: dtype is I8, expected U8")
    a = find(B, D + ".absmax")
    emit("qs-absmax-f16-single-quant", st_bytes(replace(B, a.name, a.copy(dtype="F16", shape=[64]))), 65,
         "model.d.weight.absmax: dtype is F16, expected F32")
    emit("qs-nested-absmax-missing", st_bytes(drop(B, G + ".nested_absmax")), 65,
         "missing quant-state tensor model.g.weight.nested_absmax")
    a = find(B, G + ".nested_absmax")
    emit("qs-nested-absmax-short", st_bytes(replace(B, a.name, a.copy(shape=[0], data=b""))), 65,
         "model.g.weight.nested_absmax: holds 0 values, expected 1")
    a = find(B, G + ".nested_quant_map")
    emit("qs-nested-quant-map-255", st_bytes(replace(B, a.name, a.copy(shape=[255], data=a.data[:1020]))), 65,
         "model.g.weight.nested_quant_map: holds 255 values, expected 256")
    emit("qs-nested-quant-map-missing", st_bytes(drop(B, G + ".nested_quant_map")), 65,
         "missing quant-state tensor model.g.weight.nested_quant_map")
    emit("qs-quant-map-missing", st_bytes(drop(B, D + ".quant_map")), 65,
         "missing quant-state tensor model.d.weight.quant_map")
    a = find(B, D + ".quant_map")
    emit("qs-quant-map-15", st_bytes(replace(B, a.name, a.copy(shape=[15], data=a.data[:60]))), 65,
         "model.d.weight.quant_map: holds 15 values, expected 16")
    emit("qs-packed-weight-missing", st_bytes(drop(B, G)), 65,
         "model.g.weight: quant state present but the packed weight is missing")
    p = find(B, D)
    emit("qs-packed-too-short", st_bytes(replace(B, D, p.copy(shape=[1023, 1], data=p.data[:1023]))), 65,
         "model.d.weight: packed weight is 1023 bytes, but shape needs 1024")
    emit("qs-nested-parts-without-nested-state",
         st_bytes(B + [find(B, G + ".nested_absmax").copy(name=D + ".nested_absmax")]), 65,
         "nested tensors present but the quant state is not nested")
    emit("qs-orphan-part", st_bytes(B + [find(B, D + ".quant_map").copy(name="model.z.weight.quant_map")]), 65,
         "model.z.weight.quant_map: quant-state tensor belongs to no weight")
    # A weight named like a state part would be planned as one and dropped.
    emit("qs-weight-named-like-a-part",
         st_bytes(B + [find(B, D + NF4).copy(name=D + ".absmax" + NF4),
                       find(B, G + ".nested_absmax").copy(name=D + ".absmax.absmax"),
                       find(B, D + ".quant_map").copy(name=D + ".absmax.quant_map")]), 65,
         "names model.d.weight.absmax as its packed weight")
    emit("qs-blob-of-a-blob", st_bytes(B + [find(B, D + NF4).copy(name=D + NF4 + NF4)]), 65,
         "as its packed weight, a name only quant-state parts may have")
    emit("qs-int8-scb", st_bytes(B + [T("model.q.weight.SCB", "F32", [2], b"\x00" * 8)]), 65,
         "model.q.weight.SCB: bitsandbytes 8-bit (LLM.int8) weights are not supported")
    # -- quant states: the blob
    def qs(name, edit, msg, weight=G, kinds=("convert",)):
        emit(name, st_bytes(with_blob(B, weight + NF4, edit)), 65, msg, kinds)
    qs("qs-blocksize-48", lambda o: o.update(blocksize=48), "blocksize 48 is not a power of two from 32 to 4096",
       kinds=("convert", "inspect"))
    qs("qs-blocksize-8192", lambda o: o.update(blocksize=8192), "blocksize 8192 is not a power of two")
    qs("qs-blocksize-16", lambda o: o.update(blocksize=16), "blocksize 16 is not a power of two")
    qs("qs-blocksize-float", lambda o: o.update(blocksize=256.5), 'quant state "blocksize" is not written as an integer')
    # 256.0 and 2.56e2 are 256 to cJSON, but not integers to torch.Size or bitsandbytes' int arguments.
    qs("qs-blocksize-256.0", lambda o: o.update(blocksize=256.0), 'quant state "blocksize" is not written as an integer')
    qs_raw_early = find(B, G + NF4).data
    assert b'"blocksize": 256' in qs_raw_early
    emit("qs-blocksize-2.56e2", st_bytes(replace(B, G + NF4, blob_tensor(
        G + NF4, qs_raw_early.replace(b'"blocksize": 256', b'"blocksize": 2.56e2')))), 65,
        'quant state "blocksize" is not written as an integer')
    # An escaped key is the same key to cJSON and Python: "\u0062locksize" is blocksize.
    emit("qs-blocksize-float-escaped-key", st_bytes(replace(B, G + NF4, blob_tensor(
        G + NF4, qs_raw_early.replace(b'"blocksize": 256', b'"\\u0062locksize": 256.0')))), 65,
        'quant state "blocksize" is not written as an integer')
    qs("qs-shape-floats", lambda o: o.update(shape=[float(v) for v in o["shape"]]),
       'quant state "shape" is not written as an integer')
    qs("qs-nested-blocksize-float", lambda o: o.update(nested_blocksize=256.0),
       'quant state "nested_blocksize" is not written as an integer')
    qs("qs-blocksize-missing", lambda o: o.pop("blocksize"), 'no integer "blocksize"')
    qs("qs-quant-type-unknown", lambda o: o.update(quant_type="nf3"), 'unsupported quant_type "nf3"')
    qs("qs-quant-type-contradicts-name", lambda o: o.update(quant_type="fp4"),
       'quant_type "fp4" contradicts the tensor name')
    qs("qs-dtype-unknown", lambda o: o.update(dtype="float64"), 'quant state dtype "float64" is not float16')
    qs("qs-dtype-missing", lambda o: o.pop("dtype"), "quant state dtype (missing) is not float16")
    qs("qs-shape-not-array", lambda o: o.update(shape=4096), 'quant state has no "shape" array')
    qs("qs-shape-9-dims", lambda o: o.update(shape=[1] * 8 + [4096]), "quant state shape has 9 dimensions")
    qs("qs-shape-negative", lambda o: o.update(shape=[1, -4096]), "quant state shape[1] is not a non-negative")
    qs("qs-shape-overflow", lambda o: o.update(shape=[4294967296, 4294967296, 2]),
       "quant state shape product overflows")
    qs("qs-shape-more-than-packed", lambda o: o.update(shape=[2, 4096]),
       "packed weight is 2048 bytes, but shape needs 4096 for 8192 values")
    qs("qs-nested-partial", lambda o: o.pop("nested_offset"),
       "quant state has only some of nested_blocksize, nested_dtype, nested_offset")
    qs("qs-nested-blocksize-not-pow2", lambda o: o.update(nested_blocksize=255),
       "nested_blocksize is not a power of two")
    qs("qs-nested-blocksize-too-big", lambda o: o.update(nested_blocksize=1 << 21),
       "nested_blocksize is not a power of two")
    qs("qs-nested-dtype-f16", lambda o: o.update(nested_dtype="float16"), 'nested_dtype must be "float32"')
    qs("qs-nested-offset-string", lambda o: o.update(nested_offset="0.1"),
       "nested_offset is not a finite float32 number")
    # JSON has no inf, but 1e400 overflows to it.
    blob = find(B, G + NF4).data.replace(b'"nested_offset": 0.14574050903320312', b'"nested_offset": 1e400')
    assert b"1e400" in blob
    emit("qs-nested-offset-overflows", st_bytes(replace(B, G + NF4, blob_tensor(G + NF4, blob))), 65,
         "nested_offset is not a finite float32 number")
    # Under half an ulp above FLT_MAX, torch rounds the offset to FLT_MAX: valid.
    blob = find(B, G + NF4).data.replace(b'"nested_offset": 0.14574050903320312', b'"nested_offset": 3.4028235e38')
    emit("ok-nested-offset-rounds-to-flt-max", st_bytes(replace(B, G + NF4, blob_tensor(G + NF4, blob))), 0,
         "converted")
    raw = find(B, G + NF4).data
    def qs_raw(name, blob, msg, **kw):
        emit(name, st_bytes(replace(B, G + NF4, blob_tensor(G + NF4, blob, **kw))), 65, msg)
    qs_raw("qs-blob-not-json", raw[:-1], "quant state is not valid JSON")
    qs_raw("qs-blob-json-array", b"[" + raw + b"]", "quant state is not a JSON object")
    qs_raw("qs-blob-trailing-bytes", raw + b"{}", "quant state is not valid JSON")
    qs_raw("qs-blob-key-twice", raw[:-1] + b', "blocksize": 64}', "quant state has a key twice")
    qs_raw("qs-blob-control-char", raw.replace(b'"nf4"', b'"nf4\x01"'), "quant state is not valid JSON")
    qs_raw("qs-blob-not-u8", raw, "quant state blob is I8, expected U8", dtype="I8")
    qs_raw("qs-blob-empty", b"", "quant state is not valid JSON")
    # What transformers 5 saves for a layer it split on load: the parts' quant states concatenated.
    qs_raw("qs-blob-states-back-to-back", raw + b"\n" + raw + raw,
           "quant state is not valid JSON: it holds 3 quant states back to back, as transformers 5 saves")
    # A NUL between them is no writer's: cJSON would skip it, the diagnosis must not.
    qs_raw("qs-blob-states-nul-between", raw + b"\0" + raw, "quant state is not valid JSON")
    # Python's json writes a NaN offset as the bare word NaN: bitsandbytes does for a weight of no elements,
    # which is read (tests/fixtures/empty-weights.*); on this one of 4096 every element would be NaN.
    qs_raw("qs-blob-nan-offset", raw.replace(b'"nested_offset": 0.14574050903320312', b'"nested_offset": NaN'),
           "nested_offset is NaN or infinite (bitsandbytes quantized a weight holding an infinity or NaN)")


def shard_files(B, index_edit=None, shards=None):
    """The base model as a two-shard directory."""
    s1 = [t for t in B if t.name.startswith(G) or t.name == NORM]
    s2 = [t for t in B if t.name.startswith(D)]
    if shards:
        s1, s2 = shards(s1, s2)
    files = {"model-00001-of-00002.safetensors": st_bytes(s1), "model-00002-of-00002.safetensors": st_bytes(s2)}
    wm = {t.name: "model-00001-of-00002.safetensors" for t in s1}
    wm.update({t.name: "model-00002-of-00002.safetensors" for t in s2})
    total = sum(len(t.data) for t in s1 + s2)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}
    text = json.dumps(index, indent=2)
    if index_edit:
        text = index_edit(text)
    files["model.safetensors.index.json"] = text.encode() if isinstance(text, str) else text
    with open(CONFIG, "rb") as f:
        files["config.json"] = f.read()
    files["generation_config.json"] = b'{\n  "_from_model_config": true,\n  "bos_token_id": 1\n}\n'
    return files


def dir_cases(B):
    emit_dir("ok-dir-baseline", shard_files(B), 0, "converted", kinds=("convert", "inspect"))
    S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"

    def idx(name, edit, code, msg, kinds=("convert",)):
        emit_dir(name, shard_files(B, index_edit=edit), code, msg, kinds)
    idx("dir-index-not-json", lambda t: t[:-2], 65, "model.safetensors.index.json: not valid JSON",
        kinds=("convert", "inspect"))
    idx("dir-index-no-weight-map", lambda t: t.replace('"weight_map"', '"weightmap"'), 65,
        'has no "weight_map" object')
    idx("dir-index-weight-map-empty", lambda t: json.dumps({"metadata": {}, "weight_map": {}}), 65,
        "weight_map is empty")
    idx("dir-index-key-twice", lambda t: t[:-2] + ',\n  "metadata": {}\n}', 65, "has a top-level key twice")
    idx("dir-index-metadata-not-object", lambda t: t.replace('"metadata": {', '"metadata": [{', 1).replace(
        '},\n  "weight_map"', '}],\n  "weight_map"', 1), 65, '"metadata" is not an object')
    idx("dir-index-value-not-string", lambda t: t.replace('"%s"' % S2, "2", 1), 65,
        "weight_map value is not a file name")
    idx("dir-index-tensor-twice", lambda t: t.replace('"weight_map": {', '"weight_map": {\n    "%s": "%s",' % (NORM, S1)),
        65, "model.norm.weight: listed twice in weight_map")
    idx("dir-shard-missing", lambda t: t.replace(S2, "model-00003-of-00003.safetensors"), 66,
        "model-00003-of-00003.safetensors: cannot open", kinds=("convert", "inspect"))
    idx("dir-shard-dotdot", lambda t: t.replace(S2, "../" + S2, 1), 65,
        'shard "../%s" is not a plain file name inside the model directory' % S2)
    idx("dir-shard-absolute", lambda t: t.replace(S2, "/etc/passwd", 1), 65,
        'shard "/etc/passwd" is not a plain file name')
    idx("dir-shard-dot", lambda t: t.replace(S2, ".", 1), 65, 'shard "." is not a plain file name')
    idx("dir-tensor-in-wrong-shard", lambda t: t.replace('"%s": "%s"' % (NORM, S1), '"%s": "%s"' % (NORM, S2)), 65,
        "model.norm.weight: listed in %s but stored in %s" % (S2, S1))
    idx("dir-tensor-not-in-shard", lambda t: t.replace('"weight_map": {', '"weight_map": {\n    "model.ghost": "%s",' % S1),
        65, "model.ghost: listed in %s, which has no such tensor" % S1)
    emit_dir("dir-tensor-in-two-shards", shard_files(B, shards=lambda s1, s2: (s1, s2 + [find(B, NORM)])), 65,
             "model.norm.weight: tensor is also in")
    # GPT-2's Conv1D layers are quantized transposed ([out, in]) and written transposed back, [in, out]: a quant
    # state that is not 2-D has no [out, in] to turn.
    def gpt2(name, layer, code, msg, edit=None):
        ts = with_blob(B, D + NF4, edit) if edit else B
        ts = [t.copy(name=t.name.replace(D, layer)) if t.name.startswith(D) else t for t in ts]
        emit_dir(name, {"model.safetensors": st_bytes(ts), "config.json": b'{"model_type": "gpt2", "n_embd": 256}\n'},
                 code, msg, kinds=("convert", "inspect"))
    gpt2("dir-gpt2-conv1d-weight", "transformer.h.0.mlp.c_fc.weight", 0, "converted")
    gpt2("dir-gpt2-conv1d-weight-3d", "transformer.h.0.mlp.c_fc.weight", 65,
         "transformer.h.0.mlp.c_fc.weight: is a Conv1D layer's weight (config.json: a GPT-2 architecture), whose "
         "quant state must be 2-D", edit=lambda o: o.update(shape=[1] + o["shape"]))
    gpt2("dir-gpt2-linear-weight", "lm_head.weight", 0, "")
    # transformers reads a repeated key's last copy: a llama here to cJSON, a GPT-2 to Python.
    ts = [t.copy(name=t.name.replace(D, "transformer.h.0.mlp.c_fc.weight")) if t.name.startswith(D) else t for t in B]
    emit_dir("dir-config-key-twice", {"model.safetensors": st_bytes(ts),
                                      "config.json": b'{"model_type": "llama", "model_type": "gpt2"}\n'}, 65,
             'config.json: has "model_type" twice, which transformers reads as the last', kinds=("convert", "inspect"))
    emit_dir("dir-config-key-twice-in-part", {"model.safetensors": st_bytes(B), "config.json":
                                              b'{"text_config": {"model_type": "llama", "model_type": "gpt2"}}\n'},
             65, 'config.json: has "model_type" in text_config twice', kinds=("convert", "inspect"))
    files = shard_files(B)
    files["config.json"] = files["config.json"][:-3]
    emit_dir("dir-config-not-json", files, 65, "config.json: not a JSON object")
    files = shard_files(B)
    files["config.json"] = b"[" + files["config.json"] + b"]"
    emit_dir("dir-config-json-array", files, 65, "config.json: not a JSON object")
    files = shard_files(B)
    files["config.json"] = b"\xef\xbb\xbf" + files["config.json"]
    emit_dir("dir-config-utf8-bom", files, 65, "config.json: not a JSON object")
    # A bad shard is reported by its own path.
    emit_dir("dir-shard-bad-header", shard_files(B) | {S2: b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1} "}, 65,
             S2 + ": a: tensor entry is not an object")
    # No index: a single model.safetensors.
    emit_dir("dir-single-file-truncated", {"model.safetensors": st_bytes(B)[:-1]}, 65,
             "model.safetensors: tensors cover", kinds=("convert", "inspect"))
    # git keeps no empty directory: path "-" asks check-hostile.sh for a fresh one.
    for k in ("convert", "inspect"):
        ROWS.append(("dir-empty" + ("" if k == "convert" else "--inspect"), "-", k, 66,
                     "is not a model directory: it has no *.safetensors file"))
    emit_dir("dir-only-config", {"config.json": shard_files(B)["config.json"]}, 66, "is not a model directory")
    with open(os.path.join(ROOT, "tests", "fixtures", "lora", "adapter-fp16-r4-pickled", "adapter_model.bin"), "rb") as f:
        emit_dir("dir-pytorch-model-bin", {"config.json": shard_files(B)["config.json"], "pytorch_model.bin": f.read()},
                 66, "it holds pytorch_model.bin, a PyTorch checkpoint (torch.save), and no *.safetensors file",
                 kinds=("convert", "inspect"))


# ---- LoRA adapters for ok-baseline.safetensors -------------------------------

PEFT = "base_model.model."
LA = PEFT + "model.d.lora_A.weight"
LB = PEFT + "model.d.lora_B.weight"


def f32_bytes(values):
    return struct.pack("<%df" % len(values), *values)


def adapter_tensors(r=4, a_shape=None, b_shape=None):
    a_shape = a_shape or [r, 256]
    b_shape = b_shape or [8, r]
    na = a_shape[0] * (a_shape[1] if len(a_shape) > 1 else 1)
    nb = b_shape[0] * (b_shape[1] if len(b_shape) > 1 else 1)
    return [T(LA, "F32", a_shape, f32_bytes([((i * 37) % 101 - 50) / 1000.0 for i in range(na)])),
            T(LB, "F32", b_shape, f32_bytes([((i * 53) % 89 - 44) / 500.0 for i in range(nb)]))]


def adapter_config(**edits):
    c = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["d"], "fan_in_fan_out": False,
         "use_rslora": False, "use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
         "rank_pattern": {}, "alpha_pattern": {}}
    for k, v in edits.items():
        if v is None and k in c:
            del c[k]
        else:
            c[k] = v
    return json.dumps(c, indent=2).encode()


def emit_lora(name, code, msg, config=None, weights=None, kinds=("lora",)):
    files = {}
    if config is not False:
        files["adapter_config.json"] = config if config is not None else adapter_config()
    if weights is not False:
        files["adapter_model.safetensors"] = weights if weights is not None else st_bytes(adapter_tensors())
    emit_dir(name, files, code, msg, kinds=kinds)


STORAGE_TYPES = {"F32": "FloatStorage", "F16": "HalfStorage", "BF16": "BFloat16Storage"}


def pickle_str(text):
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def pickle_int(n):
    return b"J" + struct.pack("<i", n)


def state_dict_pickle(ts, call=b"ctorch._utils\n_rebuild_tensor_v2\n"):
    """The pickle torch.save writes for a dict of tensors (protocol 2), each
    tensor at the start of its own storage, storage keys "0", "1", ..."""
    out = [b"\x80\x02}("]
    for k, t in enumerate(ts):
        size = struct.calcsize({"F32": "f", "F16": "e", "BF16": "e"}[t.dtype])
        strides = [1] * len(t.shape)
        for d in range(len(t.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * t.shape[d + 1]
        out += [pickle_str(t.name), call, b"((", pickle_str("storage"),
                b"ctorch\n" + STORAGE_TYPES[t.dtype].encode() + b"\n", pickle_str(str(k)), pickle_str("cpu"),
                pickle_int(len(t.data) // size), b"tQ", pickle_int(0), b"(", *map(pickle_int, t.shape), b"t(",
                *map(pickle_int, strides), b"t\x89ccollections\nOrderedDict\n)RtR"]
    out.append(b"u.")
    return b"".join(out)


def torch_zip(ts, pickle=None, storages=None, compress=False, extra=()):
    """A torch.save archive: adapter_model/data.pkl, byteorder, data/K, version."""
    import io
    import warnings
    import zipfile
    warnings.filterwarnings("ignore", "Duplicate name", UserWarning)  # a case writes one on purpose
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", method) as z:
        def put(name, data):
            info = zipfile.ZipInfo("adapter_model/" + name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = method
            z.writestr(info, data)
        put("data.pkl", pickle if pickle is not None else state_dict_pickle(ts))
        put("byteorder", b"little")
        for k, t in enumerate(ts):
            put("data/%d" % k, storages[k] if storages else t.data)
        for name, data in extra:
            put(name, data)
        put("version", b"3\n")
    return buf.getvalue()


def zip64_central(blob, short=False):
    """The archive with every central directory record's sizes and local
    header offset moved into a ZIP64 extra field, as writers do past 4 GiB
    (short: the field holds only the first of the three)."""
    eocd = blob.rfind(b"PK\x05\x06")
    cd_size, cd_off = struct.unpack("<II", blob[eocd + 12:eocd + 20])
    cd, out, i = blob[cd_off:cd_off + cd_size], b"", 0
    while i < len(cd):
        hdr = bytearray(cd[i:i + 46])
        nl, el, cl = struct.unpack("<HHH", hdr[28:34])
        name, rest = cd[i + 46:i + 46 + nl], cd[i + 46 + nl:i + 46 + nl + el + cl]
        cs, us = struct.unpack("<II", hdr[20:28])
        (off,) = struct.unpack("<I", hdr[42:46])
        z64 = struct.pack("<HHQ", 1, 8, us) if short else struct.pack("<HHQQQ", 1, 24, us, cs, off)
        hdr[20:28] = struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF)
        hdr[42:46] = struct.pack("<I", 0xFFFFFFFF)
        hdr[30:32] = struct.pack("<H", el + len(z64))
        out += bytes(hdr) + name + rest[:el] + z64 + rest[el:]
        i += 46 + nl + el + cl
    end = bytearray(blob[eocd:])
    end[12:16] = struct.pack("<I", len(out))
    return blob[:cd_off] + out + bytes(end)


def emit_pickled(name, code, msg, blob, kinds=("lora",)):
    emit_dir(name, {"adapter_config.json": adapter_config(), "adapter_model.bin": blob}, code, msg, kinds=kinds)


def pickled_cases(both):
    ts = adapter_tensors()
    emit_pickled("lora-pickled-ok", 0, "1 with LoRA merged", torch_zip(ts), kinds=both)
    emit_pickled("lora-pickled-legacy", 65, "adapter_model.bin: is not a ZIP archive",
                 b"\x80\x02\x8a\x0alZ\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.", kinds=both)
    emit_pickled("lora-pickled-runs-code", 65, "the pickle calls os.system",
                 torch_zip(ts, pickle=b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R."), kinds=both)
    emit_pickled("lora-pickled-other-callable", 65, "the pickle calls torch._utils._rebuild_qtensor",
                 torch_zip(ts, pickle=state_dict_pickle(ts, b"ctorch._utils\n_rebuild_qtensor\n")))
    emit_pickled("lora-pickled-storage-short", 65, "lora_B.weight: its storage adapter_model/data/1 is 124 bytes, too few for 32 elements of F32",
                 torch_zip(ts, storages=[ts[0].data, ts[1].data[:-4]]), kinds=both)
    emit_pickled("lora-pickled-storage-missing", 65, "its storage adapter_model/data/1 is not in the archive",
                 torch_zip(ts).replace(b"adapter_model/data/1", b"adapter_model/data/x"))
    emit_pickled("lora-pickled-compressed", 65, "ZIP entry is compressed (method 8)", torch_zip(ts, compress=True))
    emit_pickled("lora-pickled-truncated", 65, "no end of central directory record", torch_zip(ts)[:-1], kinds=both)
    emit_pickled("lora-pickled-big-endian", 65, "says the tensors are not little-endian",
                 torch_zip(ts).replace(b"little", b"big\0\0\0"))
    dup = torch_zip(ts, extra=[("data/0", ts[0].data)])
    emit_pickled("lora-pickled-duplicate-entry", 65, "ZIP entry name appears twice", dup)
    emit_pickled("lora-pickled-zip64-fields", 0, "1 with LoRA merged", zip64_central(torch_zip(ts)), kinds=both)
    emit_pickled("lora-pickled-zip64-short", 65, "adapter_model/data.pkl: ZIP64 extra field is too short",
                 zip64_central(torch_zip(ts), short=True))
    emit_pickled("lora-pickled-not-a-state-dict", 65, "holds a list, not a dict of tensors",
                 torch_zip(ts, pickle=b"\x80\x02]."))


def lora_cases():
    both = ("lora", "lora-inspect")
    emit_lora("lora-ok", 0, "1 with LoRA merged", kinds=both)
    # The adapter's weights file.
    whole = st_bytes(adapter_tensors())
    emit_lora("lora-weights-truncated", 65, "adapter_model.safetensors: tensors cover", weights=whole[:-1], kinds=both)
    emit_lora("lora-weights-header-truncated", 65, "runs past the end", weights=whole[:40])
    emit_lora("lora-weights-missing", 66, "adapter_model.safetensors: cannot open", weights=False, kinds=both)
    emit_lora("lora-config-missing", 66, "adapter_config.json: cannot open", config=False, kinds=both)
    pickled_cases(both)
    # adapter_config.json.
    emit_lora("lora-config-not-json", 65, "adapter_config.json: is not valid JSON", config=adapter_config()[:-2],
              kinds=both)
    emit_lora("lora-config-array", 65, "is not a JSON object", config=b"[" + adapter_config() + b"]")
    emit_lora("lora-config-duplicate-key", 65, "has a duplicate key",
              config=adapter_config().replace(b'"r": 4,', b'"r": 4, "r": 8,'))
    emit_lora("lora-targets-nothing", 65, "targets none of the 1 modules its weights are for",
              config=adapter_config(layers_to_transform=[99]), kinds=both)
    emit_lora("lora-target-modules-number", 65, '"target_modules" must be a module name pattern',
              config=adapter_config(target_modules=5))
    emit_lora("lora-r-float", 65, '"r" must be a whole number', config=adapter_config(r=4.0))
    emit_lora("lora-r-float-escaped-key", 65, '"r" must be a whole number',
              config=adapter_config().replace(b'"r": 4,', b'"\\u0072": 4.0,'))
    emit_lora("lora-alpha-nan", 65, "NaN or Infinity", config=adapter_config().replace(b'"lora_alpha": 8', b'"lora_alpha": NaN'),
              kinds=both)
    emit_lora("lora-alpha-huge", 65, '"lora_alpha" must be a finite number',
              config=adapter_config().replace(b'"lora_alpha": 8', b'"lora_alpha": 1e999'))
    emit_lora("lora-alpha-string", 65, '"lora_alpha" must be a finite number', config=adapter_config(lora_alpha="8"))
    emit_lora("lora-alpha-missing", 65, '"lora_alpha" must be a finite number', config=adapter_config(lora_alpha=None))
    emit_lora("lora-scaling-not-finite", 65, "lora_alpha / r is not a finite fp32 number",
              config=adapter_config(lora_alpha=1e300))
    emit_lora("lora-r-zero", 65, '"r" must be a whole number from 1 to 65536', config=adapter_config(r=0), kinds=both)
    emit_lora("lora-r-huge", 65, '"r" must be a whole number from 1 to 65536', config=adapter_config(r=10 ** 12),
              kinds=both)
    emit_lora("lora-r-negative", 65, '"r" must be a whole number', config=adapter_config(r=-4))
    emit_lora("lora-r-fraction", 65, '"r" must be a whole number', config=adapter_config(r=4.5))
    emit_lora("lora-rank-mismatch", 65, "has rank 4, but the config says r = 8", config=adapter_config(r=8),
              kinds=both)
    emit_lora("lora-rank-pattern-mismatch", 65, "but the config says r = 2 (rank_pattern)",
              config=adapter_config(rank_pattern={"d": 2}))
    emit_lora("lora-rank-pattern-zero", 65, '"rank_pattern": "d" must be a whole number',
              config=adapter_config(rank_pattern={"d": 0}))
    emit_lora("lora-pattern-not-regex", 65, "is not a regular expression", config=adapter_config(alpha_pattern={"(": 2}))
    # regcomp(3) took minutes on the first and 200 MB on the second; now each
    # is refused at once, or matched in linear time.
    emit_lora("lora-pattern-expands", 65, "its repeats expand past 2048 states",
              config=adapter_config(rank_pattern={"((x{40}){40}){40}": 8}))
    # Each key fits 2048 states; nine of them pass the config's 16384.
    emit_lora("lora-pattern-states", 65, "the pattern keys compile to more than 16384 states in all",
              config=adapter_config(rank_pattern={f"k{i}.{{2000}}": 8 for i in range(9)}))
    emit_lora("lora-pattern-lookahead", 65, "look-ahead and look-behind are not supported",
              config=adapter_config(alpha_pattern={"^(?!.*vision).*q_proj": 8}))
    emit_lora("lora-peft-type", 65, "is a PREFIX_TUNING adapter; only LoRA and LoKr adapters can be merged",
              config=adapter_config(peft_type="PREFIX_TUNING"), kinds=both)
    emit_lora("lora-no-peft-type", 65, 'has no "peft_type"', config=adapter_config(peft_type=None))
    # DoRA: a magnitude [out] beside each pair, with use_dora; nothing else.
    emit_lora("lora-dora-ok", 0, "1 with LoRA merged", config=adapter_config(use_dora=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_magnitude_vector", "F32", [8],
                                                      f32_bytes([0.5 + i / 16 for i in range(8)]))]), kinds=both)
    emit_lora("lora-dora", 65, "lora_magnitude_vector, which DoRA (use_dora) needs", config=adapter_config(use_dora=True),
              kinds=both)
    emit_lora("lora-dora-key", 65, "is a DoRA magnitude, but adapter_config.json does not set use_dora",
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_magnitude_vector", "F32", [8],
                                                      f32_bytes([1.0] * 8))]))
    emit_lora("lora-dora-magnitude-shape", 65, "must be an F32, BF16 or F16 vector of 8, one per row",
              config=adapter_config(use_dora=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_magnitude_vector", "F32", [256],
                                                      f32_bytes([1.0] * 256))]), kinds=both)
    emit_lora("lora-dora-magnitude-dtype", 65, "must be an F32, BF16 or F16 vector",
              config=adapter_config(use_dora=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_magnitude_vector", "I32", [8],
                                                      bytes(32))]))
    emit_lora("lora-dora-magnitude-alone", 65, "lora_magnitude_vector: has no matching lora_A.weight",
              config=adapter_config(use_dora=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + name + ".lora_magnitude_vector", "F32", [8],
                                                      f32_bytes([1.0] * 8)) for name in ("model.d", "model.x")]))
    # LoRA biases (lora_bias): lora_B.bias [out] goes onto the base layer's bias, which ok-baseline lacks.
    lora_bias = [T(PEFT + "model.d.lora_B.bias", "F32", [8], f32_bytes([i / 8 for i in range(8)]))]
    emit_lora("lora-bias-no-base-bias", 65, "adds to model.d.bias, which the base model does not have",
              config=adapter_config(lora_bias=True), weights=st_bytes(adapter_tensors() + lora_bias), kinds=both)
    emit_lora("lora-bias-unset", 65, "is a LoRA bias, but adapter_config.json does not set lora_bias",
              weights=st_bytes(adapter_tensors() + lora_bias))
    emit_lora("lora-bias-shape", 65, "must be an F32, BF16 or F16 vector of 8, one per row",
              config=adapter_config(lora_bias=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_B.bias", "F32", [7], bytes(28))]))
    emit_lora("lora-bias-alone", 65, "model.x.lora_B.bias: has no matching lora_A.weight",
              config=adapter_config(lora_bias=True),
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.x.lora_B.bias", "F32", [8], bytes(32))]))
    emit_lora("lora-bias-dora", 65, "sets both lora_bias and use_dora, which PEFT refuses",
              config=adapter_config(lora_bias=True, use_dora=True))
    # diffusers LoRAs (save_lora_weights): pytorch_lora_weights.safetensors, keys under the component's
    # name, the config in the metadata; ok-baseline, a single file, is taken as the transformer.
    def diffusers_lora(prefix="transformer.", config=None, raw=None, extra=()):
        ts = [T(prefix + t.name[len(PEFT):], t.dtype, t.shape, t.data) for t in adapter_tensors()] + list(extra)
        meta = {"format": "pt"}
        if config is not None or raw is not None:
            meta["lora_adapter_metadata"] = raw if raw is not None else json.dumps(
                {"transformer." + k: v for k, v in config.items()})
        return {"pytorch_lora_weights.safetensors": st_bytes(ts, metadata=meta)}
    emit_dir("lora-diffusers-ok", diffusers_lora(config={"r": 4, "lora_alpha": 8, "target_modules": ["d"]}), 0,
             "1 with LoRA merged", kinds=both)
    emit_dir("lora-diffusers-no-metadata", diffusers_lora(), 0, "1 with LoRA merged", kinds=both)
    emit_dir("lora-diffusers-other-component", diffusers_lora(prefix="text_encoder."), 65,
             "is a diffusers LoRA with no tensors for transformer (its keys are for: text_encoder)", kinds=both)
    emit_dir("lora-diffusers-metadata-not-json", diffusers_lora(raw="{\"transformer.r\": 4"), 65,
             '(metadata "lora_adapter_metadata"): is not valid JSON', kinds=both)
    emit_dir("lora-diffusers-metadata-rank", diffusers_lora(config={"r": 8, "lora_alpha": 8, "target_modules": ["d"]}), 65,
             "has rank 4, but the config says r = 8", kinds=("lora",))
    emit_dir("lora-diffusers-metadata-dora", diffusers_lora(config={"r": 4, "lora_alpha": 8, "use_dora": True,
                                                                                 "target_modules": ["d"]}), 65,
             "lora_magnitude_vector, which DoRA (use_dora) needs", kinds=("lora",))
    emit_dir("lora-diffusers-rank-huge", diffusers_lora(extra=[
        T("transformer.model.g.lora_A.weight", "F32", [65537, 0], b""),
        T("transformer.model.g.lora_B.weight", "F32", [0, 65537], b"")]), 65,
        "has rank 65537; a rank is from 1 to 65536", kinds=("lora",))
    # diffusers injects the adapter by its keys: the metadata's target rules do not leave any out.
    emit_dir("lora-diffusers-targets-ignored", diffusers_lora(config={"r": 4, "lora_alpha": 8,
                                                                      "target_modules": ["elsewhere"]}), 0,
             "1 with LoRA merged", kinds=("lora",))
    emit_dir("lora-diffusers-metadata-other", {"pytorch_lora_weights.safetensors": st_bytes(
        [T("transformer." + t.name[len(PEFT):], t.dtype, t.shape, t.data) for t in adapter_tensors()],
        metadata={"format": "pt", "lora_adapter_metadata": json.dumps({"text_encoder.r": 4,
                                                                       "text_encoder.lora_alpha": 8})})}, 65,
             "holds the LoRA config of text_encoder, not of transformer", kinds=("lora",))
    emit_dir("lora-diffusers-metadata-empty", diffusers_lora(raw=""), 0, "1 with LoRA merged", kinds=("lora",))
    emit_dir("lora-diffusers-r-float", diffusers_lora(raw='{"transformer.r": 4.0, "transformer.lora_alpha": 8}'), 65,
             '"r" must be a whole number from 1 to 65536', kinds=("lora",))
    # ModelMixin.save_lora_adapter: one model's LoRA, no component before the keys or in the metadata.
    emit_dir("lora-diffusers-unprefixed", {"pytorch_lora_weights.safetensors": st_bytes(
        [T(t.name[len(PEFT):], t.dtype, t.shape, t.data) for t in adapter_tensors()],
        metadata={"format": "pt", "lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8,
                                                                       "target_modules": ["d"]})})}, 0,
             "1 with LoRA merged", kinds=both)
    # Without target_modules PEFT looks the model's type up; diffusers raises for every diffusers model.
    emit_dir("lora-diffusers-metadata-no-targets", diffusers_lora(config={"r": 4, "lora_alpha": 8}), 65,
             "has no target_modules: PEFT builds no LoRA layers into a diffusers model", kinds=both)
    # A LoRA repository's one *.safetensors file, as diffusers guesses it; a PEFT adapter's weights file is not one.
    emit_dir("lora-diffusers-named", {"my_lora.safetensors": diffusers_lora()["pytorch_lora_weights.safetensors"]}, 0,
             "1 with LoRA merged", kinds=("lora",))
    emit_dir("lora-diffusers-peft-keys", {"peft_lora.safetensors": st_bytes(adapter_tensors())}, 65,
             "holds a PEFT adapter's keys (base_model.model....): give --lora the adapter's folder", kinds=("lora",))
    emit_dir("lora-diffusers-kohya", {"pytorch_lora_weights.safetensors": st_bytes(
        [T("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "F32", [4, 256], bytes(4096)),
         T("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", "F32", [8, 4], bytes(128)),
         T("lora_unet_double_blocks_0_img_attn_qkv.alpha", "F32", [], bytes(4))])}, 65,
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight: has 8 rows; diffusers splits it into three equal parts",
        kinds=both)
    # a kohya LoHa: no lora_down/lora_up pairs to convert
    emit_dir("lora-diffusers-kohya-loha", {"pytorch_lora_weights.safetensors": st_bytes(
        [T("lora_unet_double_blocks_0_img_attn_qkv.hada_w1_a", "F32", [4, 4], bytes(64)),
         T("lora_unet_double_blocks_0_img_attn_qkv.hada_w1_b", "F32", [4, 4], bytes(64))])}, 65,
        "is a kohya or ComfyUI-format LoRA without lora_down/lora_up pairs (LoHa, LoKr...), which nf4deq does not read",
        kinds=both)
    emit_lora("lora-bias-mode-unknown", 65, '"bias" must be', config=adapter_config(bias="some"))
    # PEFT features whose weights are no plain delta of the base as it is.
    emit_lora("lora-init-pissa", 65, '"init_lora_weights": "pissa_niter_4" rewrote the base weights',
              config=adapter_config(init_lora_weights="pissa_niter_4"), kinds=both)
    emit_lora("lora-init-loftq", 65, '"init_lora_weights": "loftq" replaced the base weights with LoftQ',
              config=adapter_config(init_lora_weights="loftq"))
    emit_lora("lora-init-mica-capital", 0, "1 with LoRA merged", config=adapter_config(init_lora_weights="MiCA"))
    emit_lora("lora-init-empty", 0, "1 with LoRA merged", config=adapter_config(init_lora_weights=""))
    emit_lora("lora-init-olora-case", 65, '"init_lora_weights": "OLoRA" rewrote the base weights',
              config=adapter_config(init_lora_weights="OLoRA"))
    emit_lora("lora-init-lora-ga", 65, '"init_lora_weights": "lora_ga" rewrote the base weights',
              config=adapter_config(init_lora_weights="lora_ga"))
    emit_lora("lora-init-pissa-capital", 65, '"init_lora_weights": "PiSSA" is no initialisation PEFT or nf4deq knows',
              config=adapter_config(init_lora_weights="PiSSA"))
    emit_lora("lora-init-eva-capital", 65, '"init_lora_weights": "EVA" is no initialisation',
              config=adapter_config(init_lora_weights="EVA"))
    emit_lora("lora-init-number", 65, '"init_lora_weights" must be true, false or the name',
              config=adapter_config(init_lora_weights=1))
    emit_lora("lora-init-gaussian", 0, "1 with LoRA merged", config=adapter_config(init_lora_weights="Gaussian"))
    emit_lora("lora-init-false", 0, "1 with LoRA merged", config=adapter_config(init_lora_weights=False))
    # use_qalora acts on GPTQ layers only: on a bitsandbytes base PEFT trains and merges a plain LoRA.
    emit_lora("lora-qalora", 0, "1 with LoRA merged", config=adapter_config(use_qalora=True, qalora_group_size=16))
    emit_lora("lora-enable-lora", 65, "enable_lora: PEFT 0.2's MergedLinear",
              config=adapter_config(enable_lora=[True, False, True]), kinds=both)
    emit_lora("lora-enable-lora-null", 0, "1 with LoRA merged", config=adapter_config(enable_lora=None, merge_weights=False))
    emit_lora("lora-alora", 65, "is an activated LoRA (alora_invocation_tokens)",
              config=adapter_config(alora_invocation_tokens=[128000, 882]), kinds=both)
    emit_lora("lora-alora-empty", 65, "is an activated LoRA", config=adapter_config(alora_invocation_tokens=[]))
    emit_lora("lora-alora-false", 65, "is an activated LoRA", config=adapter_config(alora_invocation_tokens=False))
    emit_lora("lora-layer-replication", 65, "replicates layers (layer_replication)",
              config=adapter_config(layer_replication=[[0, 4], [2, 5]]))
    emit_lora("lora-target-parameters-dora", 65, "and the config sets use_dora, which PEFT's ParamWrapper refuses",
              config=adapter_config(target_modules=[], target_parameters=["d.weight"], use_dora=True))
    emit_lora("lora-target-parameters-string", 65, "\"target_parameters\" must be a list of parameter names",
              config=adapter_config(target_parameters="experts.gate_up_proj"))
    emit_lora("lora-target-parameters-empty", 0, "1 with LoRA merged", config=adapter_config(target_parameters=[]))
    emit_lora("lora-bdlora", 65, "has block-diagonal factors on 16-bit layers (use_bdlora)",
              config=adapter_config(use_bdlora={"target_modules_bd_a": ["d"], "nblocks": 2}))
    emit_lora("lora-kasa-empty", 65, "is KaSA (kasa_config)", config=adapter_config(kasa_config={}))
    emit_lora("lora-kasa-null", 0, "1 with LoRA merged", config=adapter_config(kasa_config=None, velora_config=None))
    emit_lora("lora-kasa-false", 0, "1 with LoRA merged", config=adapter_config(kasa_config=False, layer_replication=0))
    # Embedding LoRA: lora_embedding_A [r, vocab] and lora_embedding_B [dim, r] on a 16-bit [vocab, dim].
    emit_lora("lora-embedding-b-missing", 65, "has no matching base_model.model.model.d.lora_embedding_B",
              weights=st_bytes([T(PEFT + "model.d.lora_embedding_A", "F32", [4, 8], f32_bytes([0.0] * 32))]),
              kinds=both)
    emit_lora("lora-embedding-b-alone", 65, "lora_embedding_B: has no matching lora_embedding_A",
              weights=st_bytes([T(PEFT + "model.d.lora_embedding_B", "F32", [256, 4], f32_bytes([0.0] * 1024))]))
    emit_lora("lora-embedding-on-4bit", 65, "model.d.weight is 4-bit; bitsandbytes never quantizes an embedding",
              weights=st_bytes([T(PEFT + "model.d.lora_embedding_A", "F32", [4, 8], f32_bytes([0.0] * 32)),
                                T(PEFT + "model.d.lora_embedding_B", "F32", [256, 4], f32_bytes([0.0] * 1024))]),
              kinds=both)
    emit_lora("lora-embedding-not-matrix", 65, "transposed (an embedding) is 512x1 but the base tensor "
              "model.norm.weight is not a matrix",
              config=adapter_config(target_modules=["norm"]),
              weights=st_bytes([T(PEFT + "model.norm.lora_embedding_A", "F32", [4, 512], f32_bytes([0.0] * 2048)),
                                T(PEFT + "model.norm.lora_embedding_B", "F32", [1, 4], f32_bytes([0.0] * 4))]))
    # Keys against the base.
    emit_lora("lora-unknown-module", 65, "matches no floating-point tensor model.x.weight",
              weights=st_bytes([t.copy(name=t.name.replace("model.d.", "model.x.")) for t in adapter_tensors()]),
              kinds=both)
    emit_lora("lora-quant-state-target", 65, "matches no floating-point tensor",
              weights=st_bytes([t.copy(name=t.name.replace("model.d.", "model.d.weight.absmax.")) for t in adapter_tensors()]))
    emit_lora("lora-shape-mismatch", 65, "B @ A is 8x128 but the base tensor model.d.weight is 8x256",
              weights=st_bytes(adapter_tensors(a_shape=[4, 128])), kinds=both)
    # PEFT's bitsandbytes layers ignore fan_in_fan_out: a 4-bit weight's delta is never transposed.
    emit_lora("lora-fan-in-fan-out-on-4bit", 0, "1 with LoRA merged", config=adapter_config(fan_in_fan_out=True))
    emit_lora("lora-not-matrix", 65, "is not a matrix", weights=st_bytes(adapter_tensors(a_shape=[1024])))
    ints = adapter_tensors()
    ints[0] = ints[0].copy(dtype="I32")
    emit_lora("lora-int-weights", 65, "LoRA weights must be F32, BF16 or F16", weights=st_bytes(ints))
    emit_lora("lora-b-missing", 65, "has no matching " + LB, weights=st_bytes(adapter_tensors()[:1]), kinds=both)
    emit_lora("lora-a-missing", 65, "has no matching lora_A", weights=st_bytes(adapter_tensors()[1:]))
    emit_lora("lora-not-peft-key", 65, 'is not a PEFT key',
              weights=st_bytes([t.copy(name=t.name[len(PEFT):]) for t in adapter_tensors()]))
    emit_lora("lora-unlisted-tensor", 65, "is neither a LoRA weight nor in modules_to_save",
              weights=st_bytes(adapter_tensors() + [T(PEFT + NORM, "BF16", [512], b"\0" * 1024)]))
    emit_lora("lora-saved-module-shape", 65, "does not have the dtype class or shape of model.norm.weight",
              config=adapter_config(modules_to_save=["norm"]),
              weights=st_bytes(adapter_tensors() + [T(PEFT + NORM, "BF16", [256], b"\0" * 512)]))
    emit_lora("lora-unknown-lora-tensor", 65, "is a LoRA tensor nf4deq does not know how to merge",
              weights=st_bytes(adapter_tensors() + [T(PEFT + "model.d.lora_C.weight", "F32", [4], f32_bytes([0.0] * 4))]))


def main():
    shutil.rmtree(CASES, ignore_errors=True)
    os.makedirs(CASES)
    B = base_tensors()
    file_cases(B)
    dir_cases(B)
    lora_cases()
    names = [r[0] for r in ROWS]
    assert len(names) == len(set(names)), "duplicate case names"
    with open(MANIFEST, "w") as f:
        f.write("# Generated by tests/hostile/make_hostile.py; checked by tests/scripts/check-hostile.sh.\n")
        f.write("# name\tpath (under tests/hostile/cases)\tkind\texit\tstderr substring\n")
        for r in ROWS:
            assert "\t" not in "".join(map(str, r)) and "\n" not in "".join(map(str, r))
            f.write("%s\t%s\t%s\t%d\t%s\n" % r)
    size = 0
    for dp, _, fs in os.walk(CASES):
        size += sum(os.path.getsize(os.path.join(dp, x)) for x in fs)
    print("hostile: %d rows, %d bytes under %s" % (len(ROWS), size, os.path.relpath(CASES, ROOT)))


if __name__ == "__main__":
    main()
