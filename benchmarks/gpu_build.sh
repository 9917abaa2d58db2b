# Sourced by gpu_check.sh and ncu_profile.sh: build_for_hopper LOG SCRIPT builds ampfuse in
# place for sm_90 (the lent GPUs are H100/H200) with the machine's 16 cores, the build's
# output in LOG. On failure it prints the log's tail, says which script failed, and returns 1.
build_for_hopper() {
  local log=$1 script=$2
  echo "== build (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16; at ${SECONDS} s)"
  if ! TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
      python3 -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "$script: build failed (full log: $log)"
    return 1
  fi
  tail -n 3 "$log"
}
