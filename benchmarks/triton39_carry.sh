#!/usr/bin/env bash
# Builds .carry/triton39.tar.xz: triton 3.9.0 (the CPU test pin, and what torch 2.13 installs) cut
# down to what the kernels need on an sm_90 GPU, about 53 MB, small enough to carry to the GPU
# machine, whose image has triton 3.6 (benchmarks/NOTES-gemm.md, session 12). Left out: the AMD
# backend, CUPTI, the profiler and test libraries, the disassemblers, libtriton's debug info, and
# the older ptxas (3.9 compiles sm_90 with ptxas-blackwell, which stays).
#
#     benchmarks/triton39_carry.sh
#     # on the GPU machine (the device tool: carry [".carry"]):
#     mkdir -p /tmp/t39 && tar xJf .carry/triton39.tar.xz -C /tmp/t39 && \
#         PYTHONPATH=/tmp/t39 TRITON_BACKENDS_IN_TREE=1 python benchmarks/gemm.py --out $OUT/std
#
# TRITON_BACKENDS_IN_TREE=1 makes triton load the backends found in its own tree instead of the
# entry points of the triton installed on the machine (which name the AMD backend left out here).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --dest "$work" triton==3.9.0
python3 -m zipfile -e "$work"/triton-3.9.0-*.whl "$work/tree"
t="$work/tree/triton"
strip --strip-unneeded "$t/_C/libtriton.so"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
    "$t/backends/nvidia/bin/ptxas" "$t/backends/nvidia/bin/cuobjdump" "$t/backends/nvidia/bin/nvdisasm" \
    "$t/FileCheck" "$t/_C/libproton.so" "$t/instrumentation/libGPUInstrumentationTestLib.so" \
    "$t/plugins/libTritonPluginsTestLib.so"
chmod +x "$t/backends/nvidia/bin/"*  # zipfile does not keep the executable bit
mkdir -p .carry
tar cJf .carry/triton39.tar.xz.partial -C "$work/tree" triton
mv .carry/triton39.tar.xz.partial .carry/triton39.tar.xz
ls -l .carry/triton39.tar.xz
