#!/usr/bin/env bash
# The GPU check (docs: GPU.md): build ampfuse in place for Hopper, run the CUDA tests, run the
# GPU benchmarks, and print the benchmark table last. Results go to $OUT (default
# benchmarks/out): build.log, pytest_cuda.log, bench.json, bench_table.txt.
# Exit status: non-zero if the build or any CUDA test failed (the benchmarks still run after
# failing tests, so that a failure and the figures come back together).
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"

python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'

echo "== build (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16)"
if ! TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log"
  echo "gpu_check: build failed (full log: $out/build.log)"
  exit 1
fi
tail -n 3 "$out/build.log"

echo "== CUDA tests: python3 -m pytest -m cuda -q tests/python"
python3 -m pytest -m cuda -q tests/python 2>&1 | tee "$out/pytest_cuda.log" | tail -n 40
tests_status=${PIPESTATUS[0]}

echo "== benchmarks"
bench_status=0
python3 benchmarks/run.py --device cuda --out "$out" >/dev/null || bench_status=$?

echo "== CUDA tests exit status: $tests_status; benchmarks exit status: $bench_status"
if [[ -f "$out/bench_table.txt" ]]; then
  cat "$out/bench_table.txt"
fi
if [[ $tests_status -ne 0 || $bench_status -ne 0 ]]; then
  exit 1
fi
