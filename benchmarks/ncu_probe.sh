#!/bin/bash
# Where the FP8 Gluon kernel's cycles go next to cuBLAS's (session 13): Nsight Compute's full
# section set with per-SASS-instruction warp-state samples, for `torch._scaled_mm` rowwise and one
# Gluon config at one point, eager, one call each (the report keeps each kernel's first launch).
#
#   bash benchmarks/ncu_probe.sh $OUT M:N:K gluon_config
#
# Writes $OUT/ncu_details.csv (every section, both kernels), $OUT/ncu_source_<kernel>.csv.xz
# (per-instruction metrics: warp stall samples by reason, instructions executed) and the log.
set -u
out=$1; point=${2:-16384:6144:4096}; config=${3:-coop2_128x256_g16}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
"$ncu" --version | tail -1
"$ncu" --clock-control none --set full --import-source yes -k 'regex:nvjet|_scaled_mm_kernel' -c 2 -f -o /tmp/probe \
    python benchmarks/gemm_power.py --out /tmp/probe_unused --eager-calls 1 --points "$point" \
    --configs "$config" --ops "scaled_mm+bias,gluon_fp8_$config" > "$out/ncu_log.txt" 2>&1
tail -5 "$out/ncu_log.txt"
"$ncu" -i /tmp/probe.ncu-rep --page details --csv > "$out/ncu_details.csv" 2>&1
for k in nvjet _scaled_mm_kernel; do
    "$ncu" -i /tmp/probe.ncu-rep --page source --csv --print-source sass -k "regex:$k" 2>&1 | xz -c > "$out/ncu_source_${k#_}.csv.xz"
done
ls -la "$out"
