#!/usr/bin/env bash
# Nsight Compute profiles of the kernels issue 10 found below their bandwidth goals (see
# benchmarks/ncu_targets.py for the list and what each reached). Builds ampfuse for sm_90 as
# gpu_check.sh does, then runs ncu_targets.py under ncu with the sections that say why a
# memory-bound kernel falls short: speed of light, memory workload, occupancy, launch
# statistics and warp stall reasons. Results go to $OUT (default benchmarks/out):
# ncu_build.log, ncu_kernels.txt (the report, one block per kernel, in the order of the
# targets) and ncu_raw.csv (the same metrics as CSV). Run it as a second device call after
# gpu_check.sh: OUT=$OUT bash benchmarks/ncu_profile.sh > $OUT/ncu_stdout.txt 2>&1
# Exit status: non-zero when the build fails, when no ncu is found, or when ncu fails (a
# machine that does not grant access to the GPU's performance counters says so in the report).
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"

ncu_bin=$(command -v ncu || true)
if [[ -z "$ncu_bin" ]]; then
  for candidate in /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    if [[ -x "$candidate" ]]; then
      ncu_bin=$candidate
      break
    fi
  done
fi
if [[ -z "$ncu_bin" ]]; then
  echo "ncu_profile: no ncu on this machine (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"
  exit 1
fi
"$ncu_bin" --version | tail -n 1

source benchmarks/gpu_build.sh
build_for_hopper "$out/ncu_build.log" ncu_profile || exit 1

sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
          --section LaunchStats --section WarpStateStats --section SchedulerStats)
echo "== ncu over benchmarks/ncu_targets.py"
PYTHONPATH=python "$ncu_bin" --profile-from-start off --nvtx --target-processes all \
  "${sections[@]}" --print-units base -o "$out/ncu_report" -f \
  python3 benchmarks/ncu_targets.py --device cuda
status=$?
if [[ $status -eq 0 ]]; then
  # Kernels come in the order ncu_targets.py prints its targets ("ran l2norm fp32", ...).
  "$ncu_bin" -i "$out/ncu_report.ncu-rep" --page details > "$out/ncu_kernels.txt" 2>&1 ||
    status=$?
  "$ncu_bin" -i "$out/ncu_report.ncu-rep" --page raw --csv > "$out/ncu_raw.csv" 2>&1 || true
  rm -f "$out/ncu_report.ncu-rep"
  grep -E "^  [a-z_]|NVTX|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Block Limit" \
    "$out/ncu_kernels.txt" | head -n 200
fi
echo "ncu_profile: exit status $status"
exit $status
