#!/usr/bin/env bash
# Build an offline bundle of FlashAttention-4 (flash-attn-4, CuTe DSL) for a Python 3.12 x86-64 GPU
# machine that cannot reach a package registry, so it can be benchmarked beside flashtile.
#
# Run from the repository root on a machine with registry access. It writes two folders (.gitignore lists them):
#   .peer-whl/  the small wheels (~10 MB)
#   .peer-big/  cu13.tar.xz: the CUDA-13 MLIR libraries (a 92 MB wheel), repacked with xz (~61 MB),
#               so that each part stays under 64 MiB when copied to the GPU machine on its own.
# Install on the GPU machine, in this order (the wheels replace the folder the tarball fills):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/fa4 .peer-whl/*.whl
#   tar xJf .peer-big/cu13.tar.xz -C /tmp/fa4
#   export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
#   python3 -c "from flash_attn.cute import flash_attn_func"   # layout (batch, seqlen, nheads, headdim)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
mkdir -p .peer-whl .peer-big
tmp=$(mktemp -d)
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for p in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
         nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi torch-c-dlpack-ext quack-kernels; do
  python3 -m pip download -q "${P[@]}" -d .peer-whl "$p"
done
python3 -m pip download -q "${P[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir "$tmp/x" && (cd "$tmp/x" && unzip -q "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
echo "repacking the CUDA-13 libraries with xz -9e (about 3-4 minutes on 2 cores)..."
(cd "$tmp/x" && tar cf - . | xz -9e -T0 > "$root/.peer-big/cu13.tar.xz")
rm -rf "$tmp"
du -sh .peer-whl .peer-big
