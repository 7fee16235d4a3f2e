#!/usr/bin/env bash
# Takes the bundled Gemma-3-270M, transformers 5.23 (the GGUF loader quantkit needs; the GPU image has
# 5.17) and the bundled dataset's token blocks to the GPU machine, whose calls carry at most 64 MiB with the
# working tree (~29 MB of it).
#
#     benchmarks/bundled_carry.sh pack          # CPU: .carry/part00..part07 (~34 MB each) + bundled_carry.sha256
#     # GPU, eight calls in a row while the machine stays warm, carry [".carry/partNN"] each:
#     benchmarks/bundled_carry.sh stage NN      # copies the part to /tmp/qk/parts
#     # after the last, in the same or a later call:
#     source benchmarks/bundled_carry.sh env    # joins and checks the parts; sets PYTHONPATH, QUANTKIT_CACHE
#     python benchmarks/pretokenized.py run /tmp/qk/tokens.pt benchmarks/calibration_sweep.py --device cuda ...
#
# The joined tarball's sha256 is checked against the one written by `pack` (carried in the tree).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
pack)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --dest "$work/whl" transformers==5.23.0 gguf==0.19.0
    mkdir -p "$work/gguf"
    python -c "import quantkit; quantkit.load_model(quantkit.BUNDLED_MODEL)"  # assembles the GGUF once
    cp "${QUANTKIT_CACHE:-$HOME/.cache/quantkit}/gguf/gemma-3-270m-Q4_K_M.gguf" "$work/gguf/"
    python "$root/benchmarks/pretokenized.py" save "$work/tokens.pt"
    tar cf "$work/bundle.tar" -C "$work" gguf whl tokens.pt
    rm -rf "$root/.carry" && mkdir -p "$root/.carry"
    split -n 8 -d "$work/bundle.tar" "$root/.carry/part"
    (cd "$work" && sha256sum bundle.tar | cut -d' ' -f1) > "$root/benchmarks/bundled_carry.sha256"
    ls -la "$root/.carry"
    ;;
stage)
    mkdir -p /tmp/qk/parts
    cp "$root/.carry/part$2" /tmp/qk/parts/
    ls -la /tmp/qk/parts
    ;;
env)
    if [ ! -d /tmp/qk/py ]; then
        cat /tmp/qk/parts/part0[0-7] > /tmp/qk/bundle.tar
        echo "$(cat "$root/benchmarks/bundled_carry.sha256")  /tmp/qk/bundle.tar" | sha256sum -c -
        tar xf /tmp/qk/bundle.tar -C /tmp/qk
        mkdir -p /tmp/qk/cache/gguf
        mv /tmp/qk/gguf/gemma-3-270m-Q4_K_M.gguf /tmp/qk/cache/gguf/
        python -m pip install --quiet --no-deps --target /tmp/qk/py /tmp/qk/whl/*.whl
    fi
    export PYTHONPATH="/tmp/qk/py:$root" QUANTKIT_CACHE=/tmp/qk/cache
    ;;
*)
    echo "usage: $0 pack | stage NN | env" >&2
    exit 2
    ;;
esac
