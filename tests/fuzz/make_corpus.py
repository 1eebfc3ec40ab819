#!/usr/bin/env python3
"""Regenerates the fuzzers' seed corpus, tests/corpus/<target>/, from the
bitsandbytes fixtures in tests/fixtures plus a few hand-made variants.

Run from the repository root: python3 tests/fuzz/make_corpus.py
Python 3 standard library only. tests/corpus/crashes/, and files a target's
folder holds that this script does not write, are left alone."""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(ROOT, "tests", "corpus")
TARGETS = ["fuzz_header", "fuzz_quant_state", "fuzz_index", "fuzz_config", "fuzz_file", "fuzz_model_dir"]


def read_st(path):
    """(header dict in file order, raw header bytes, data bytes)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = raw[8:8 + n]
    return json.loads(hdr), hdr, raw[8 + n:]


def tensor_bytes(path, names):
    header, _, data = read_st(path)
    return {k: (header[k]["dtype"], header[k]["shape"], data[header[k]["data_offsets"][0]:header[k]["data_offsets"][1]])
            for k in names}


def build_st(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes). Laid out in list order."""
    header, off, blob = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blob += data
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def header_seed(hdr, data_len):
    return struct.pack("<Q", data_len) + hdr


def weight_parts(prefix):
    return [prefix + s for s in ("", ".absmax", ".nested_absmax", ".nested_quant_map", ".quant_map")]


def main():
    seeds = {t: {} for t in TARGETS}
    bnb4 = os.path.join(FIX, "tensors.bnb4.safetensors")
    sharded = os.path.join(FIX, "tiny-llama-bf16-bnb4-sharded")
    single = os.path.join(FIX, "tiny-llama-fp16-bnb4", "model.safetensors")

    # fuzz_header: the real headers, with their real data length.
    for name, path in [("tensors-bnb4", bnb4), ("tiny-llama-single", single),
                       ("shard-00005", os.path.join(sharded, "model-00005-of-00005.safetensors"))]:
        _, hdr, data = read_st(path)
        seeds["fuzz_header"][name] = header_seed(hdr, len(data))
    small = {
        "empty-object": (b"{}", 0),
        "metadata-only": (b'{"__metadata__":{"format":"pt"}}', 0),
        "sub-byte-and-scalar": (b'{"q":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]},'
                                b'"s":{"dtype":"F64","shape":[],"data_offsets":[3,11]},'
                                b'"z":{"dtype":"BF16","shape":[0,4],"data_offsets":[11,11]}}   ', 11),
        "escaped-names": (b'{"a\\"b\\u00e9\\n":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1),
        "every-dtype": (("{" + ",".join(
            '"t%d":{"dtype":"%s","shape":[8],"data_offsets":[%d,%d]}' % (i, d, 8 * i, 8 * i + 8)
            for i, d in enumerate(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"])) + "}").encode(), 48),
    }
    for name, (hdr, n) in small.items():
        seeds["fuzz_header"][name] = header_seed(hdr, n)

    # fuzz_quant_state: every distinct blob in the fixtures, and variants.
    header, _, data = read_st(bnb4)
    for k, v in header.items():
        if ".quant_state." in k:
            b, e = v["data_offsets"]
            seeds["fuzz_quant_state"][k.split(".")[1] + "-" + k.rsplit("__", 1)[1]] = data[b:e]
    seeds["fuzz_quant_state"]["single-quant-min"] = b'{"quant_type":"nf4","blocksize":32,"dtype":"float32","shape":[]}'
    seeds["fuzz_quant_state"]["nested-extremes"] = (
        b'{"quant_type":"fp4","blocksize":4096,"dtype":"float16","shape":[1,2,3,4,5,6,7,8],'
        b'"nested_blocksize":1048576,"nested_dtype":"float32","nested_offset":-3.4028234663852886e38}')

    # fuzz_index: the real index and variants.
    with open(os.path.join(sharded, "model.safetensors.index.json"), "rb") as f:
        seeds["fuzz_index"]["tiny-llama-sharded"] = f.read()
    seeds["fuzz_index"]["no-metadata"] = b'{"weight_map":{"a":"s1.safetensors","b":"s2.safetensors","c":"s1.safetensors"}}'
    seeds["fuzz_index"]["metadata-nested"] = (b'{"metadata":{"total_size":12,"x":{"y":[1,2,{"z":null}]}},'
                                              b'"weight_map":{"a\\u0000b":"s.safetensors"}}')

    # fuzz_config: the real configs and variants.
    for d in ("tiny-llama-bf16-bnb4", "tiny-llama-fp16-bnb4"):
        with open(os.path.join(FIX, d, "config.json"), "rb") as f:
            seeds["fuzz_config"][d] = f.read()
    seeds["fuzz_config"]["empty-object"] = b"{}"
    seeds["fuzz_config"]["compact-dtype-last"] = b'{"a":[1,{"b":"}"}],"quantization_config":{"x":"{"},"dtype":"float16"}'
    seeds["fuzz_config"]["only-quantization-config"] = b'\n{ "quantization_config" : { "load_in_4bit" : true } }\n'
    seeds["fuzz_config"]["tabs-torch-dtype"] = b'{\t"torch_dtype":\t"float16",\t"s":"a\\"b\\\\"\t}'

    # fuzz_file: small real checkpoints cut out of the fixtures.
    def cut(names):
        t = tensor_bytes(bnb4, names)
        return build_st([(n,) + t[n] for n in names], {"format": "pt"})
    g = weight_parts("model.g.weight") + ["model.g.weight.quant_state.bitsandbytes__nf4", "model.norm.weight"]
    seeds["fuzz_file"]["nested-nf4-g-and-norm"] = cut(g)
    seeds["fuzz_file"]["single-quant-d"] = cut(["model.d.weight", "model.d.weight.absmax", "model.d.weight.quant_map",
                                                "model.d.weight.quant_state.bitsandbytes__nf4"])
    seeds["fuzz_file"]["fp4-e"] = cut(weight_parts("model.e.weight") + ["model.e.weight.quant_state.bitsandbytes__fp4"])
    seeds["fuzz_file"]["bf16-storage-f"] = cut(weight_parts("model.f.weight") +
                                               ["model.f.weight.quant_state.bitsandbytes__nf4"])
    with open(os.path.join(sharded, "model-00005-of-00005.safetensors"), "rb") as f:
        seeds["fuzz_file"]["tiny-llama-shard-00005"] = f.read()
    seeds["fuzz_file"]["plain-f64-f4"] = build_st([("x", "F64", [2], struct.pack("<2d", 1e300, -0.0)),
                                                   ("y", "F4", [4], b"\x12\x34")])

    # fuzz_model_dir: a byte for config.json's model_type (0 gpt_oss, 1 gpt2, 2 llama), then model.safetensors:
    # two of Unsloth's experts and a router; a GPT-2's Conv1D weights (NF4 single quant, FP4) and a linear head.
    def renamed(pairs, extra=()):
        out = []
        for x, name in pairs:
            prefix = "model.%s.weight" % x
            names = [n for n in tensor_bytes(bnb4, [k for k in read_st(bnb4)[0] if k.startswith(prefix)])]
            t = tensor_bytes(bnb4, names)
            out += [(name + n[len(prefix):],) + t[n] for n in sorted(names)]
        return build_st(out + list(extra), {"format": "pt"})
    norm = tensor_bytes(bnb4, ["model.norm.weight"])["model.norm.weight"]
    experts = [(x, "model.layers.0.mlp.experts.%s.%d.weight" % (p, e)) for e, x in enumerate("gg")
               for p in ("gate_up_projs", "down_projs")]
    seeds["fuzz_model_dir"]["gpt-oss-unsloth-experts"] = b"\x00" + renamed(
        experts, [("model.layers.0.mlp.router.linear.weight",) + norm])
    gpt2 = renamed([("d", "transformer.h.0.mlp.c_fc.weight"), ("e", "transformer.h.0.attn.c_proj.weight"),
                    ("d", "lm_head.weight")])
    seeds["fuzz_model_dir"]["gpt2-conv1d"] = b"\x01" + gpt2
    seeds["fuzz_model_dir"]["llama-keeps-conv1d-names"] = b"\x02" + gpt2

    # Seeds added by hand beside these (tests/corpus/fuzz_config/diffusers-*) are kept: a file is only written.
    for t in TARGETS:
        d = os.path.join(OUT, t)
        os.makedirs(d, exist_ok=True)
        for name, blob in sorted(seeds[t].items()):
            with open(os.path.join(d, name), "wb") as f:
                f.write(blob)
    os.makedirs(os.path.join(OUT, "crashes"), exist_ok=True)
    total = sum(len(b) for s in seeds.values() for b in s.values())
    print("corpus: %d files, %d bytes" % (sum(len(s) for s in seeds.values()), total))


if __name__ == "__main__":
    sys.exit(main())
