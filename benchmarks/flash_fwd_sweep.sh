#!/usr/bin/env bash
# One device call: GPU flash tests, then the forward sweep against cuDNN on the shapes.
# The sweep's kernels are compiled first in parallel (tiny shapes with the same specialisation,
# sharing Triton's cache) while the tests run, so the timed sweep itself compiles nothing.
# Usage (repo root, on the GPU machine): OUT=dir bash benchmarks/flash_fwd_sweep.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-flash-sweep-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
pids=""
for sh in "1,256,16,128,0" "1,256,16,128,1" "1,256,32,64,0" "1,256,32,64,1"; do
  timeout 170 python benchmarks/flash_bench.py --no-bench --sweep-kinds fwd --sweep "$sh" > "$OUT/precompile_$sh.txt" 2>&1 &
  pids="$pids $!"
done
DELTA_ATTN_AUTOTUNE=0 timeout 150 python -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_flash_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error |assert" "$OUT/gpu_tests.log" | grep -v DEBUG | tail -8
for p in $pids; do wait "$p"; done
echo "precompile done $(date -u +%T)"
timeout ${SWEEP_S:-110} python benchmarks/flash_bench.py --no-bench --sweep-kinds fwd \
  --sweep "8,4096,16,128,0;8,4096,16,128,1;2,16384,16,128,0;2,16384,16,128,1;2,16384,32,64,0;2,16384,32,64,1" \
  > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$? $(date -u +%T)"
cat "$OUT/smi.txt"
grep -E "^(env|sweep|  sweep|  cudnn)" "$OUT/sweep.txt" | sed -E 's/^  sweep fwd  //' | cut -c1-150
