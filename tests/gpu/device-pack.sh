#!/bin/sh
# Builds what a device-machine call runs (tests/gpu/device-run.sh) and packs it
# into .carry/bins.tar.xz, with libcjson.so.1 beside it in .carry/lib:
#   sh tests/gpu/device-pack.sh [ARCH]        (make device-pack [DEVICE_ARCH=90])
# then carry [".carry/bins.tar.xz", ".carry/lib"] and run
#   bash tests/gpu/device-run.sh check
#
# Why not the normal build: everything that travels to the device machine (the
# tracked tree and the carried files) must stay under 64 MiB, and the tests'
# fixtures alone are about 60 MB. Fat binaries with cubins for sm_75..sm_90 pack
# to 9 MB; built for the device's one architecture (ARCH, default 90: H100 and
# H200) they pack to about 4 MB and run the same code there. The compute_75 PTX
# build is the normal one, which is the point of it: the driver JIT-compiles it.
set -eu
ARCH=${1:-90}
MAKE=${MAKE:-make}
DEV=build/device-sm$ARCH
GENCODE="-gencode arch=compute_$ARCH,code=sm_$ARCH"

$MAKE --no-print-directory gpu-tests-ptx75
$MAKE --no-print-directory BUILD=$DEV "NVCC_GENCODE=$GENCODE" $DEV/nf4deq gpu-tests
$MAKE --no-print-directory BUILD=$DEV-noasm NF4DEQ_ASM=0 "NVCC_GENCODE=$GENCODE" $DEV-noasm/gpu/test_gpu

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/gpu" "$stage/build/ptx75/gpu" "$stage/build/noasm/gpu"
cp $DEV/nf4deq "$stage/build/"
cp $DEV/gpu/test_gpu $DEV/gpu/test_gpu_faults $DEV/gpu/test_gpu_merge $DEV/gpu/nf4bench "$stage/build/gpu/"
cp $DEV-noasm/gpu/test_gpu "$stage/build/noasm/gpu/"
cp build/ptx75/gpu/test_gpu "$stage/build/ptx75/gpu/"
# --strip-all: symbols are of no use there (no debugger or sanitizer runs), and
# leaving them out gives the tree about 200 KB more room under the limit.
strip --strip-all "$stage/build/nf4deq" "$stage"/build/gpu/* "$stage"/build/*/gpu/*

mkdir -p .carry/lib
tar -C "$stage" -cf - build | xz -T1 -9e > .carry/bins.tar.xz
cp -L "$(pkg-config --variable=libdir libcjson 2>/dev/null || echo /usr/lib/x86_64-linux-gnu)/libcjson.so.1" .carry/lib/

# What travels: tracked files, untracked ones git does not ignore, and the
# carry, counted as a tar archive holds them (a 512-byte header a file, each
# file in 512-byte blocks), which is how the device call measures them: on
# 2026-11-28 a tree and carry of 66.42 MB in plain bytes (67.41 MB so) were
# refused, and 66.00 MB (66.99 MB so) taken.
tar_bytes() { # tar_bytes: the files named on standard input (NUL-separated), as tar stores them
    xargs -0 stat -c %s 2>/dev/null | awk '{t += 512 + int(($1 + 511) / 512) * 512} END {print t + 0}'
}
tree=$(git ls-files -z --cached --others --exclude-standard | tar_bytes)
carry=$(find .carry/bins.tar.xz .carry/lib -type f -print0 | tar_bytes)
limit=$((64 * 1024 * 1024))
echo "device-pack: sm_$ARCH; tree $tree bytes + carry $carry bytes = $((tree + carry)) of $limit" \
    "($(( (limit - tree - carry) / 1024 )) KiB left for the call's script)"
if [ $((tree + carry)) -ge $limit ]; then
    echo "device-pack: over the device's carry limit" >&2
    exit 1
fi
