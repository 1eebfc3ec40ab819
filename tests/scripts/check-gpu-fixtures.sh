#!/bin/sh
# On a CUDA machine: converts every fixture with --device cuda and checks the
# bytes against what bitsandbytes wrote and against the CPU path's output.
# Output buffers are poisoned by the GPU back end before each run (see cuda/).
#   check-gpu-fixtures.sh BUILD
set -u
build=${1:-build}
bin="$build/nf4deq"
# NF4DEQ_GPU_DEVICE=cpu runs the same script on the CPU, to test the script itself.
gpu=${NF4DEQ_GPU_DEVICE:-cuda}
# Every chunk through the GPU: no CPU chunks while it opens (see src/pipeline.h).
export NF4DEQ_GPU_ONLY=1
fx=tests/fixtures
out=$(mktemp -d "${TMPDIR:-/tmp}/nf4deq-gpufx-XXXXXX")
trap 'rm -rf "$out"' EXIT
passed=0; failed=0
check() { # check LABEL GOT WANT
    if python3 tests/scripts/compare_safetensors.py "$2" "$3"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); echo "FAIL: $1"
    fi
}
convert() { # convert DEVICE IN OUT [DTYPE]
    if [ -n "${4:-}" ]; then set -- "$1" "$2" "$3" --dtype "$4"; else set -- "$1" "$2" "$3"; fi
    "$bin" convert -q --device "$1" "$2" "$3" ${4:+"$4"} ${5:+"$5"} || { failed=$((failed + 1)); echo "FAIL: convert $*"; }
}
converted_lora() { # converted_lora NAME IN GOT_DIR REF_BASE LORA: --lora LORA.safetensors (a form diffusers
    # converts) into IN on the GPU gives, in GOT_DIR below its output, the CPU's merge of diffusers' own
    # conversion of it (LORA.diffusers.safetensors) into REF_BASE, byte for byte
    "$bin" convert -q --device cpu "$4" "$out/$1-ref" --lora "$5.diffusers.safetensors"
    if "$bin" convert -q --device "$gpu" "$2" "$out/$1-gpu" --lora "$5.safetensors"; then
        check "$1 --lora ${5##*/} (gpu vs the cpu merge of its diffusers form)" "$out/$1-gpu$3" "$out/$1-ref"
    else
        failed=$((failed + 1)); echo "FAIL: convert --lora ${5##*/}"
    fi
}
merge() { # merge LABEL BASE ADAPTER OUT EXPECTED [PLAIN]: --lora on the GPU, within the tolerance, equal to the
    # CPU's (PLAIN: a plain conversion of BASE, for expected files that hold only the merged tensors)
    "$bin" convert -q --device "$gpu" "$2" "$4-gpu" --lora "$3" ||
        { failed=$((failed + 1)); echo "FAIL: convert --lora $3"; return; }
    if python3 tests/scripts/check_lora_tolerance.py "$4-gpu" "$5.expected.safetensors" "$5.expected.fp64.safetensors" \
        "$3" ${6:+"$6"}; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); echo "FAIL: $1 tolerance"
    fi
    "$bin" convert -q --device cpu "$2" "$4-cpu" --lora "$3"
    check "$1 (gpu vs cpu)" "$4-gpu" "$4-cpu"
}
for dt in bf16:bf16 fp16:f16 fp32:f32; do
    arg=${dt%%:*}; file=${dt##*:}
    convert "$gpu" "$fx/tensors.bnb4.safetensors" "$out/t-$arg.safetensors" "$arg"
    check "tensors --dtype $arg (gpu vs bitsandbytes)" "$out/t-$arg.safetensors" "$fx/tensors.expected-$file.safetensors"
done
convert "$gpu" "$fx/tensors.bnb4.safetensors" "$out/t-natural-gpu.safetensors"
convert cpu "$fx/tensors.bnb4.safetensors" "$out/t-natural-cpu.safetensors"
check "tensors natural dtype (gpu vs cpu)" "$out/t-natural-gpu.safetensors" "$out/t-natural-cpu.safetensors"
# Weights of no elements, two under double quant with a NaN nested_offset, beside a full one.
convert "$gpu" "$fx/empty-weights.bnb4.safetensors" "$out/empty-weights.safetensors"
check "empty weights (gpu vs bitsandbytes)" "$out/empty-weights.safetensors" "$fx/empty-weights.expected.safetensors"
for m in bf16 fp16; do
    for layout in "" -sharded; do
        for dt in bf16:bf16 fp16:f16; do
            arg=${dt%%:*}; file=${dt##*:}
            convert "$gpu" "$fx/tiny-llama-$m-bnb4$layout" "$out/$m$layout-$arg" "$arg"
            check "tiny-llama-$m$layout --dtype $arg (gpu vs bitsandbytes)" "$out/$m$layout-$arg" \
                "$fx/tiny-llama-$m-bnb4.expected-$file.safetensors"
        done
        convert "$gpu" "$fx/tiny-llama-$m-bnb4$layout" "$out/$m$layout-fp32-gpu" fp32
        convert cpu "$fx/tiny-llama-$m-bnb4$layout" "$out/$m$layout-fp32-cpu" fp32
        check "tiny-llama-$m$layout --dtype fp32 (gpu vs cpu)" "$out/$m$layout-fp32-gpu" "$out/$m$layout-fp32-cpu"
    done
done
# QLoRA merges: the fused merge kernel within the tolerance of
# tests/fixtures/lora/README.md, and equal to the CPU path byte for byte.
lf=$fx/lora
for c in bf16-bnb4:r8-all-linear bf16-bnb4:r16-qv-lmhead fp16-fp4-bnb4:fp16-r4 bf16-bnb4-tied:tied-embed \
    bf16-bnb4-tied:tied-head bf16-bnb4-tied:tied-embed-head bf16-bnb4-tied:tied-head-lora bf16-bnb4-tied:tied-ensure \
    bf16-bnb4:embed-lora bf16-bnb4-tied:tied-embed-lora bf16-bnb4-tied:tied-embed-lora-ensure \
    bf16-bnb4-tied:tied-embed-lora-mirror bf16-bnb4:tokens bf16-bnb4:tokens-dict \
    bf16-bnb4-tied:tied-tokens bf16-bnb4-tied:tied-tokens-apart bf16-bnb4:resized-tokens bf16-bnb4:resized-copies \
    bf16-bnb4-tied:tied-resized-tokens bf16-bnb4-tied:tied-resized-copy bf16-bnb4:resized-lora \
    bf16-bnb4-bias:lora-bias bf16-bnb4-bias:lora-bias-all \
    bf16-bnb4-bias:lora-bias-fp32; do
    base=${c%%:*}; case_=${c##*:}
    # Expected files of the changed tensors only (tests/fixtures/lora/README.md), but one full file per base.
    plain=
    case $case_ in r8-all-linear|r16-qv-lmhead|fp16-r4|tied-embed|lora-bias) ;; *)
        plain=$out/plain-$base
        [ -d "$plain" ] || convert "$gpu" "$lf/base-llama-$base" "$plain" ;;
    esac
    merge "lora $case_" "$lf/base-llama-$base" "$lf/adapter-$case_" "$out/lora-$case_" "$lf/merged-$case_" $plain
done
# DoRA, and a LoRA on MoE experts (target_parameters): expected files of the merged tensors only.
convert "$gpu" "$lf/base-llama-bf16-bnb4" "$out/llama-plain"
merge "lora dora" "$lf/base-llama-bf16-bnb4" "$lf/adapter-dora" "$out/lora-dora" "$lf/merged-dora" "$out/llama-plain"
# A LoKr (PEFT's LOKR adapter): its Kronecker products on the CPU, the 4-bit bases dequantized on the GPU.
merge "lora lokr" "$lf/base-llama-bf16-bnb4" "$lf/adapter-lokr" "$out/lora-lokr" "$lf/merged-lokr" "$out/llama-plain"
convert "$gpu" "$lf/base-qwen3moe-bf16-bnb4" "$out/qwen3moe-plain"
merge "lora experts" "$lf/base-qwen3moe-bf16-bnb4" "$lf/adapter-experts" "$out/lora-experts" "$lf/merged-experts" \
    "$out/qwen3moe-plain"
# Heads tied to other embeddings: GPT-2's transformer.wte (Conv1D weights written [in, out]), BART's model.shared.
# Multimodal bases in transformers' saved layout: Gemma 3's (its head tied) and Qwen2-VL's.
for c in gpt2-bf16-bnb4-tied:gpt2-tied-wte gpt2-bf16-bnb4-tied:gpt2-tied-head-lora bart-fp16-fp4-bnb4-tied:bart-tied-head \
    gemma3-bf16-bnb4:gemma3-qv-head qwen2vl-bf16-bnb4:qwen2vl-qv gemma3-bf16-bnb4:gemma3-ensure; do
    base=${c%%:*}; case_=${c##*:}
    [ -d "$out/plain-$base" ] || convert "$gpu" "$lf/base-$base" "$out/plain-$base"
    merge "lora $case_" "$lf/base-$base" "$lf/adapter-$case_" "$out/lora-$case_" "$lf/merged-$case_" "$out/plain-$base"
done
# A LoRA on experts the base holds fused (gpt_oss's is_transposed, llama4's
# not), written here: the GPU's merge equals the CPU's byte for byte, with
# chunks cut at the experts' edges (--mem 8M: within them too).
for t in gpt_oss llama4_text; do
    python3 tests/scripts/make_fused_experts.py "$out/fused-$t" "$t"
    for mem in "" 8M; do
        for run in gpu:"$gpu" cpu:cpu; do
            "$bin" convert -q --device "${run#*:}" ${mem:+--mem "$mem"} "$out/fused-$t/base" \
                "$out/fused-$t-${run%%:*}$mem" --lora "$out/fused-$t/adapter" ||
                { failed=$((failed + 1)); echo "FAIL: convert fused $t on ${run#*:}"; }
        done
        check "lora on fused experts ($t${mem:+, --mem $mem}: gpu vs cpu)" "$out/fused-$t-gpu$mem" \
            "$out/fused-$t-cpu$mem"
    done
done
# A checkpoint whose 4-bit weights are written transposed (a tile of whole
# blocks per source row), plain and with a LoRA merged: the GPU's bytes equal
# the CPU's (the unit tests check those against bitsandbytes'), and with
# --mem 8M.
transposed_layout() { # transposed_layout NAME LABEL: NAME's base and adapter, made by make_NAME.py
    for lora in "" "$out/$1/adapter"; do
        for mem in "" 8M; do
            for run in gpu:"$gpu" cpu:cpu; do
                "$bin" convert -q --device "${run#*:}" --dtype bf16 ${mem:+--mem "$mem"} "$out/$1/base" \
                    "$out/$1-${run%%:*}$mem${lora:+-lora}" ${lora:+--lora "$lora"} ||
                    { failed=$((failed + 1)); echo "FAIL: convert $2 on ${run#*:}"; }
            done
            check "$2${lora:+, a lora merged}${mem:+, --mem $mem} (gpu vs cpu)" \
                "$out/$1-gpu$mem${lora:+-lora}" "$out/$1-cpu$mem${lora:+-lora}"
        done
    done
}
# gpt-oss's experts in Unsloth's per-expert layout, written fused, each weight
# transposed (test_experts_fused).
python3 tests/scripts/make_unsloth_experts.py "$fx" "$out/unsloth"
transposed_layout unsloth "unsloth gpt-oss experts, fused"
# GPT-2's 4-bit Conv1D weights, written transposed back, [in, out]
# (test_conv1d_layout).
python3 tests/scripts/make_gpt2_conv1d.py "$fx" "$out/gpt2"
transposed_layout gpt2 "gpt2 conv1d weights, transposed"
# The same model's file alone, by the config.json beside it, on the GPU.
"$bin" convert -q --device "$gpu" --dtype bf16 "$out/gpt2/base/model.safetensors" "$out/gpt2-file-gpu.safetensors" ||
    { failed=$((failed + 1)); echo "FAIL: convert the gpt2 file alone"; }
check "gpt2 conv1d weights, the file alone (gpu vs the folder on the cpu)" "$out/gpt2-file-gpu.safetensors" \
    "$out/gpt2-cpu/model.safetensors"
# Pickled adapters (adapter_model.bin): the same tensors as the adapters above,
# so the GPU's merge from each equals its merge from them, byte for byte.
for c in bf16-bnb4:r16-qv-lmhead fp16-fp4-bnb4:fp16-r4 bf16-bnb4:r8-all-linear; do
    base=${c%%:*}; case_=${c##*:}
    "$bin" convert -q --device "$gpu" "$lf/base-llama-$base" "$out/lora-$case_-pickled-gpu" \
        --lora "$lf/adapter-$case_-pickled" ||
        { failed=$((failed + 1)); echo "FAIL: convert --lora adapter-$case_-pickled"; continue; }
    check "lora $case_ from adapter_model.bin (gpu vs the safetensors adapter's)" "$out/lora-$case_-pickled-gpu" \
        "$out/lora-$case_-gpu"
done
# A diffusers pipeline: each quantized component through the GPU against what
# bitsandbytes returned, the unquantized VAE copied byte for byte; and a file
# streamed to standard output, equal to the CPU's file.
dx=$fx/diffusers
convert "$gpu" "$dx/tiny-flux-bnb4" "$out/flux"
check "flux pipeline transformer (gpu vs bitsandbytes)" "$out/flux/transformer" \
    "$dx/tiny-flux-bnb4.transformer.expected.safetensors"
check "flux pipeline text_encoder_2 (gpu vs bitsandbytes)" "$out/flux/text_encoder_2" \
    "$dx/tiny-flux-bnb4.text_encoder_2.expected.safetensors"
# diffusers LoRAs (save_lora_weights) merged into the transformer component:
# within the tolerance, and equal to the CPU's merge byte for byte.
for case_ in lora-flux lora-flux-nometa lora-flux-alphas; do
    merge "$case_" "$dx/tiny-flux-bnb4/transformer" "$dx/$case_" "$out/flux-$case_" \
        "$dx/tiny-flux-bnb4.transformer.$case_"
done
# ... and into the whole pipeline: its transformer as the component's own merge.
# A Flux.1 control LoRA: x_embedder widened (a 4-bit base dequantized on the host, a float source merged on the
# GPU), a narrower lora_A padded, the norms replaced.
merge "lora-flux-control-tiny" "$dx/tiny-flux-bnb4/transformer" "$dx/lora-flux-control-tiny.safetensors" \
    "$out/flux-control" "$dx/tiny-flux-bnb4.transformer.lora-flux-control-tiny"
if "$bin" convert -q --device "$gpu" "$dx/tiny-flux-bnb4" "$out/flux-pipe-lora" --lora "$dx/lora-flux"; then
    check "flux pipeline --lora lora-flux (gpu vs the component's cpu merge)" "$out/flux-pipe-lora/transformer" \
        "$out/flux-lora-flux-cpu"
else
    failed=$((failed + 1)); echo "FAIL: convert the pipeline --lora lora-flux"
fi
# A kohya Flux.1 LoRA and an XLabs one on the transformer, a Qwen-Image LoRA in lightx2v's
# form, a Wan LoRA in lightx2v's distillation form (diff_b biases, the
# head's diff), a Flux.2 LoRA in kohya's form (alphas folded, qkv split), a
# Z-Image LoRA in kohya's (a fused qkv split, a bare out), a Flux.2 LoKr in
# ai-toolkit's form (a fused qkv's delta cut by rows) and a Z-Image one, an LTX-2 LoRA in
# ComfyUI's (its transformer's part) and a HunyuanVideo LoRA in ComfyUI's
# (qkvs cut, the token refiner renamed, the final modulation's halves
# swapped) on whole pipelines, each as diffusers converts it.
converted_lora "flux transformer" "$dx/tiny-flux-bnb4/transformer" "" "$dx/tiny-flux-bnb4/transformer" \
    "$dx/lora-flux-kohya"
converted_lora "flux transformer xlabs" "$dx/tiny-flux-bnb4/transformer" "" "$dx/tiny-flux-bnb4/transformer" \
    "$dx/lora-flux-xlabs"
converted_lora "qwen-image pipeline" "$dx/tiny-qwen-image" /transformer "$dx/tiny-qwen-image/transformer" \
    "$dx/lora-qwen-lightning"
converted_lora "wan pipeline" "$dx/tiny-wan" /transformer "$dx/tiny-wan/transformer" "$dx/lora-wan-distill"
converted_lora "flux.2 pipeline" "$dx/tiny-flux2" /transformer "$dx/tiny-flux2/transformer" "$dx/lora-flux2-kohya"
converted_lora "z-image pipeline" "$dx/tiny-zimage" /transformer "$dx/tiny-zimage/transformer" "$dx/lora-zimage-fused"
converted_lora "flux.2 pipeline lokr" "$dx/tiny-flux2" /transformer "$dx/tiny-flux2/transformer" "$dx/lora-flux2-lokr-bfl"
converted_lora "z-image pipeline lokr" "$dx/tiny-zimage" /transformer "$dx/tiny-zimage/transformer" \
    "$dx/lora-zimage-lokr-aitk"
converted_lora "ltx-2 pipeline" "$dx/tiny-ltx2" /transformer "$dx/tiny-ltx2/transformer" "$dx/lora-ltx2-comfy"
converted_lora "hunyuanvideo pipeline" "$dx/tiny-hunyuan" /transformer "$dx/tiny-hunyuan/transformer" \
    "$dx/lora-hunyuan-comfy"
if cmp -s "$out/flux/vae/diffusion_pytorch_model.safetensors" "$dx/tiny-flux-bnb4/vae/diffusion_pytorch_model.safetensors"; then
    passed=$((passed + 1))
else
    failed=$((failed + 1)); echo "FAIL: flux pipeline vae not copied byte for byte"
fi
"$bin" convert -q --device "$gpu" "$fx/tensors.bnb4.safetensors" - > "$out/stdout.safetensors" ||
    { failed=$((failed + 1)); echo "FAIL: convert to standard output"; }
if cmp -s "$out/stdout.safetensors" "$out/t-natural-cpu.safetensors"; then
    passed=$((passed + 1))
else
    failed=$((failed + 1)); echo "FAIL: the stream on standard output differs from the CPU's file"
fi
# Under NF4DEQ_GPU_ONLY the GPU computed every chunk: the engine line names no
# share of the CPU. Without it, chunks before the GPU is open go to the CPU
# (src/pipeline.h), and the output is the same bytes.
if [ "$gpu" = cuda ]; then
    line=$("$bin" convert --device cuda --progress none "$fx/tensors.bnb4.safetensors" "$out/engine.safetensors" 2>&1)
    case $line in
    *"on NVIDIA"*"; the CPU"* | *"on CPU"*) failed=$((failed + 1)); echo "FAIL: not all on the GPU: $line" ;;
    *"on NVIDIA"*) passed=$((passed + 1)) ;;
    *) failed=$((failed + 1)); echo "FAIL: engine line: $line" ;;
    esac
    NF4DEQ_GPU_ONLY=0 "$bin" convert -q --device cuda --dtype bf16 "$fx/tensors.bnb4.safetensors" "$out/hybrid.safetensors" ||
        { failed=$((failed + 1)); echo "FAIL: convert without NF4DEQ_GPU_ONLY"; }
    check "tensors, GPU opened while the CPU starts (vs bitsandbytes)" "$out/hybrid.safetensors" \
        "$fx/tensors.expected-bf16.safetensors"
fi
echo "gpu fixtures: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
