#!/bin/sh
# Converts the sample model and shows what came out.
set -eu
build=$1
in=samples/tiny-llama-bf16-bnb4
out="$build/demo/tiny-llama-bf16"
mkdir -p "$build/demo"
echo "\$ nf4deq inspect $in"
"$build/nf4deq" inspect "$in"
echo
echo "\$ nf4deq convert --force $in $out"
"$build/nf4deq" convert --force "$in" "$out"
echo
echo "\$ nf4deq inspect $out"
"$build/nf4deq" inspect "$out"
