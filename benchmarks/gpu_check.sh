#!/usr/bin/env bash
# The GPU check, in stages, the most important first; each stage writes its results into $OUT
# (default benchmarks/out) as it goes, so a call cut off at the device tool's 600 s limit still
# returns what was done.
#
# How to call it (from the repository root, on the GPU machine):
#   bash benchmarks/gpu_check.sh [STAGE ...]        (or GPU_CHECK_STAGES="STAGE ..." bash ...)
# with the device tool: run(command="OUT=$OUT bash benchmarks/gpu_check.sh fp8 2>&1 | tee
#   $OUT/check.log", carry=["dist", ".gpu"], timeout_s=600). One call holds at most one of the two
#   big stages (fp8 about 330 s, tests about 270 s, each after a ~30 s install, and a call ends
#   at 600 s), so a session with 15 minutes of device time runs them as two calls, the FP8
#   figures first (the principal gap, never measured), then `tests`; later sessions go on with
#   fp8_torchao, fp8_loss and state. Carried (both git-ignored, made here first):
#   dist/ampfuse-*.whl   `make wheel`: the tests and benchmarks then run against that install
#                        (a venv with --system-site-packages over the machine's torch, plain pip,
#                        no build); without it, or when it was built from other sources than
#                        this checkout's (its source_digest), ampfuse is built in place for sm_90.
#   .gpu/                `make gpu-deps`: Debian's catch2 (ctest stage) and the wheels of
#                        expecttest, pytest-xdist and execnet (.gpu/*.whl); and .gpu/wheels/
#                        torchao-*.whl (torchao 0.17.0, built for torch 2.11, a cp310-abi3 wheel:
#                        `python -m pip download torchao==0.17.0 --no-deps -d .gpu/wheels`) for
#                        the torchao float8 rows. Never commit either folder.
#
# Stages, in the default order (estimated seconds on an H100 in brackets: not yet measured for
# the FP8 stages; the others are from earlier sessions):
#   fp8          FP8 figures: cast-kernel bandwidth, one decoder layer, the Llama stack (short
#                run, every ampfuse recipe beside bf16 O2 and torch AMP), GPT-2 small with
#                fp8=True, the GEMM threshold sweep (bounded to 60 s) [330]
#   tests        pytest -m cuda against the carried wheel (or the in-place build); 265 s with
#                4 workers before the FP8 CUDA tests were added, now 6 workers [270]
#   fp8_torchao  torchao float8 tensorwise/rowwise (torch.compile) on the layer and the Llama
#                stack, with bf16 O2 again as the baseline [240]
#   fp8_loss     the Llama stack at 2 layers for 300 steps: bf16 O2, current, rowwise [180]
#   state        memory of the optimizer state: bench_state_dtype.py (FusedAdamW, FusedLAMB),
#                profile_split.py [120]
#   bench        run.py (optimizers, ops, training, overhead) [175]
#   fp8_gemm     bench_fp8.py: the FP8 GEMM against bf16 and torch._scaled_mm [15]
#   train        bench_train.py, GPT-2 in bf16, O2 with and without fp8=True [50]
#   profile      profile_gpu.py: host/device split, launches and allocations (FP8 row too) [60]
#   ctest        the C++ CUDA kernel tests (Catch2 from .gpu/) [110]  (asked for by name)
#   apex_optimizers, master_modes (asked for by name) [60, 90]
# A stage whose estimate no longer fits before GPU_CHECK_DEADLINE_S (default 540) is left out
# and named at the end with the command that runs it; each benchmark also runs under its own
# `timeout`. Results in $OUT (the device tool returns at most 8 files; one is left for the
# caller's log): tests.log, ctest_cuda.log, fp8.txt, fp8.json, state.txt, bench.json,
# bench_table.txt. The tables are printed last. Exit status: non-zero if a test or benchmark
# failed or a stage was left out, so that a cut-short check never reads as a full one.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ALL="tests fp8 fp8_torchao fp8_loss state bench fp8_gemm train profile ctest apex_optimizers master_modes"
DEFAULT="fp8 tests fp8_torchao fp8_loss state bench fp8_gemm train profile"
stages=" ${*:-${GPU_CHECK_STAGES:-$DEFAULT}} "
for stage in $stages; do
  if [[ " $ALL " != *" $stage "* ]]; then
    echo "gpu_check: unknown stage '$stage'; the stages are: $ALL"
    exit 2
  fi
done
deadline=${GPU_CHECK_DEADLINE_S:-540}
if ! [[ "$deadline" =~ ^[0-9]+$ ]]; then
  echo "gpu_check: GPU_CHECK_DEADLINE_S must be a whole number of seconds, not '$deadline'"
  exit 2
fi
declare -A STAGE_SECONDS=([tests]=270 [fp8]=330 [fp8_torchao]=240 [fp8_loss]=180 [state]=120
                          [bench]=175 [fp8_gemm]=15 [train]=50 [profile]=60 [ctest]=110
                          [apex_optimizers]=60 [master_modes]=90)
left_for_time=""
failed=""
# runs STAGE: asked for, and its estimate still fits before the deadline (else noted, left out).
runs() {
  [[ "$stages" == *" $1 "* ]] || return 1
  if ((SECONDS + STAGE_SECONDS[$1] > deadline)); then
    echo "== $1: left out at ${SECONDS} s: it takes about ${STAGE_SECONDS[$1]} s, deadline ${deadline} s"
    left_for_time="$left_for_time $1"
    return 1
  fi
  echo "== $1 (at ${SECONDS} s)"
}
fail() { failed="$failed $1"; }
# bounded SECONDS NAME CMD...: runs CMD under `timeout`, its output appended to the stage's
# file ($log) and shown; a non-zero status or a timeout marks NAME failed.
bounded() {
  local secs=$1 name=$2
  shift 2
  echo "-- $name (at ${SECONDS} s, at most ${secs} s)" | tee -a "$log"
  timeout -k 10 "$secs" "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  if [[ $status -ne 0 ]]; then
    echo "gpu_check: $name exited with $status$([[ $status -eq 124 ]] && echo ' (timed out)')" |
      tee -a "$log"
    fail "$name"
  fi
}
# merge_json NAME FILE: adds FILE's JSON to $out/fp8.json under NAME (one file for the FP8 stages).
merge_json() {
  [[ -f "$2" ]] || return 0
  "$PY" - "$out/fp8.json" "$1" "$2" <<'EOF'
import json, os, sys
path, name, part = sys.argv[1:]
data = json.load(open(path)) if os.path.exists(path) else {}
data[name] = json.load(open(part))
json.dump(data, open(path, "w"), indent=1)
EOF
}

python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true

# ---- ampfuse: the carried wheel (as users install), else built in place -----------------------
log="$out/tests.log"
: >"$log"
wheel=$(ls dist/ampfuse-*.whl 2>/dev/null | head -n 1)
# A carried wheel must hold these sources: one built before a later change would measure old code
# (build_info.json's source_digest, written by setup.py, against cmake/source_digest.py here).
if [[ -n "$wheel" ]]; then
  built_from=$(python3 cmake/source_digest.py --wheel "$wheel")
  checkout=$(python3 cmake/source_digest.py)
  if [[ "$built_from" != "$checkout" ]]; then
    echo "gpu_check: $wheel was built from other sources (digest $built_from, this checkout" \
      "$checkout): building in place instead; run 'make wheel' again before carrying dist/" |
      tee -a "$log"
    wheel=""
  fi
fi
# A dry run of the plumbing on a machine without a GPU: GPU_CHECK_DEVICE=cpu with
# GPU_CHECK_PYTHON naming a Python that already imports ampfuse (no install, no build).
device=${GPU_CHECK_DEVICE:-cuda}
if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
  PY=$GPU_CHECK_PYTHON
elif [[ -n "$wheel" ]]; then
  echo "== ampfuse from $wheel (venv over the system torch; no build; at ${SECONDS} s)" | tee -a "$log"
  if ! { python3 -m venv --system-site-packages /tmp/ampfuse-wheel &&
    /tmp/ampfuse-wheel/bin/python -m pip install --quiet --no-deps --disable-pip-version-check \
      "$wheel"; } >>"$log" 2>&1; then
    tail -n 20 "$log"
    echo "gpu_check: the wheel did not install"
    exit 1
  fi
  PY=/tmp/ampfuse-wheel/bin/python
else
  source benchmarks/gpu_build.sh
  build_for_hopper "$out/build.tmp.log" gpu_check || { cat "$out/build.tmp.log" >>"$log"; exit 1; }
  tail -n 3 "$out/build.tmp.log" >>"$log"
  rm -f "$out/build.tmp.log"
  PY=python3
fi
(cd tests && "$PY" -c 'import ampfuse; print("ampfuse", ampfuse.__version__, ampfuse.__file__)') |
  tee -a "$log"
# The carried wheels (expecttest, pytest-xdist, execnet; torchao) into a folder of their own.
extra=$(ls .gpu/*.whl .gpu/wheels/*.whl 2>/dev/null)
if [[ -n "$extra" ]]; then
  # shellcheck disable=SC2086  # one argument per wheel
  "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
    --target /tmp/gpu-site $extra >>"$log" 2>&1 &&
    export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import torchao; print("torchao", torchao.__version__)' 2>/dev/null ||
  echo "gpu_check: torchao does not import: its rows will say so (carry .gpu/wheels/torchao-*.whl)"

# ---- (a) FP8 figures (issue 31) ----------------------------------------------------------------
tmp=$(mktemp -d)
if runs fp8; then
  log="$out/fp8.txt"
  bounded 60 fp8_kernels "$PY" benchmarks/bench_fp8_kernels.py --device "$device" --warmup 20 \
    --repeats 50 --json "$tmp/kernels.json"
  merge_json kernels "$tmp/kernels.json"
  bounded 90 fp8_layer "$PY" benchmarks/bench_fp8_layer.py --device "$device" --setups bf16 \
    "ampfuse fp8 current" "ampfuse fp8 rowwise" "ampfuse fp8 delayed" --json "$tmp/layer.json"
  merge_json layer "$tmp/layer.json"
  bounded 150 fp8_llama "$PY" benchmarks/bench_fp8_train.py --device "$device" --warmup 2 \
    --repeats 4 --setups "ampfuse O2 bf16" "torch amp bf16" "ampfuse fp8 current" \
    "ampfuse fp8 rowwise" "ampfuse fp8 delayed" --json "$tmp/llama.json"
  merge_json llama "$tmp/llama.json"
  bounded 60 fp8_gpt2 "$PY" benchmarks/bench_fp8_train.py --model gpt --device "$device" \
    --json "$tmp/gpt2.json"
  merge_json gpt2 "$tmp/gpt2.json"
  recipe=current  # the automatic rule's recipe; delayed where this ampfuse predates it
  "$PY" -c 'import ampfuse.fp8 as f; f.CurrentScaling' 2>/dev/null || recipe=delayed
  bounded 75 fp8_threshold "$PY" benchmarks/bench_fp8_threshold.py --device "$device" \
    --recipe "$recipe" --budget-s 60 --json "$tmp/threshold.json"
  merge_json threshold "$tmp/threshold.json"
fi
# ---- (b) the CUDA tests ----------------------------------------------------------------------
if runs tests; then
  log="$out/tests.log"  # (the install's lines are there already)
  parallel=()
  "$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 6)  # 16 CPUs, one GPU
  "$PY" -c 'import expecttest' 2>/dev/null ||
    echo "gpu_check: no expecttest: run 'make gpu-deps' and carry .gpu/ (two test files need it)"
  echo "-- $PY -m pytest -m cuda -q ${parallel[*]} tests/python" | tee -a "$log"
  "$PY" -m pytest -m cuda -q -rfE -p no:cacheprovider "${parallel[@]}" tests/python 2>&1 |
    tee -a "$log" | tail -n 40
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "pytest"
fi
if runs fp8_torchao; then
  log="$out/fp8.txt"
  bounded 100 torchao_layer "$PY" benchmarks/bench_fp8_layer.py --device "$device" --setups bf16 \
    "bf16 compiled" "torchao tensorwise" "torchao rowwise" --json "$tmp/layer_torchao.json"
  merge_json layer_torchao "$tmp/layer_torchao.json"
  bounded 150 torchao_llama "$PY" benchmarks/bench_fp8_train.py --device "$device" --warmup 2 \
    --repeats 4 --setups "ampfuse O2 bf16" "torchao tensorwise" "torchao rowwise" \
    --json "$tmp/llama_torchao.json"
  merge_json llama_torchao "$tmp/llama_torchao.json"
fi
if runs fp8_loss; then
  log="$out/fp8.txt"
  bounded 180 fp8_loss "$PY" benchmarks/bench_fp8_train.py --device "$device" --layers 2 \
    --steps 300 --setups "ampfuse O2 bf16" "ampfuse fp8 current" "ampfuse fp8 rowwise" \
    "ampfuse fp8 delayed" --json "$tmp/loss.json"
  merge_json loss "$tmp/loss.json"
fi

# ---- (c) optimizer-state memory (scripts of the state-dtype work) ------------------------------
if runs state; then
  log="$out/state.txt"
  # profile_split's default size is for the CPU; 3.5e8 is its 350M-parameter GPU check.
  # FusedLAMB's coded step (lamb_coded.cu) after FusedAdamW's.
  declare -A STATE_ARGS=([bench_state_dtype]="" [bench_state_dtype_lamb]="--optimizer lamb"
                         [profile_split]="--total-elements 3.5e8")
  [[ "$device" == cuda ]] || STATE_ARGS[profile_split]=""
  for run in bench_state_dtype bench_state_dtype_lamb profile_split; do
    script=${run%_lamb}
    # shellcheck disable=SC2086  # the extra arguments split into words on purpose
    bounded 45 "$run" "$PY" "benchmarks/$script.py" --device "$device" ${STATE_ARGS[$run]}
  done
fi

# ---- (d) the earlier benchmarks ----------------------------------------------------------------
log="$out/bench_table.txt"
if runs bench; then
  timeout -k 10 200 "$PY" benchmarks/run.py --device "$device" --out "$out" >/dev/null || fail bench
fi
if runs fp8_gemm; then
  bounded 30 fp8_gemm "$PY" benchmarks/bench_fp8.py --device "$device"
fi
if runs train; then
  bounded 80 train "$PY" benchmarks/bench_train.py --device "$device" --models gpt --amp-dtype bf16
fi
if runs profile; then
  bounded 90 profile "$PY" benchmarks/profile_gpu.py --device "$device"
fi
if runs apex_optimizers; then
  for bench in bench_lamb bench_novograd; do
    bounded 40 "$bench" "$PY" "benchmarks/$bench.py" --device "$device"
  done
fi
if runs master_modes; then
  for optimizer in adagrad lamb novograd; do
    bounded 40 "master_modes $optimizer" "$PY" benchmarks/bench_master_modes.py --device "$device" \
      --optimizer "$optimizer"
  done
fi
if runs ctest; then
  catch2_deb=$(ls .gpu/catch2_*.deb 2>/dev/null | head -n 1)
  if [[ -z "$catch2_deb" ]]; then
    echo "gpu_check: no .gpu/catch2_*.deb: run 'make gpu-deps' and carry .gpu/"
    fail ctest
  else
    rm -rf .gpu/catch2 && dpkg -x "$catch2_deb" .gpu/catch2
    if cmake -S . -B build/gpu-tests -DAMPFUSE_BUILD_OPS=OFF -DAMPFUSE_BUILD_STEP_SCAN=OFF \
        -DAMPFUSE_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCatch2_DIR="$PWD/.gpu/catch2/usr/lib/cmake/Catch2" >"$out/ctest_cuda.log" 2>&1 &&
        cmake --build build/gpu-tests -j 16 >>"$out/ctest_cuda.log" 2>&1; then
      ctest --test-dir build/gpu-tests --output-on-failure 2>&1 | tee -a "$out/ctest_cuda.log" |
        tail -n 20
      [[ ${PIPESTATUS[0]} -eq 0 ]] || fail ctest
    else
      tail -n 30 "$out/ctest_cuda.log"
      fail ctest
    fi
  fi
fi
rm -rf "$tmp"

# ---- the tables, last --------------------------------------------------------------------------
for table in bench_table.txt state.txt fp8.txt; do
  if [[ -f "$out/$table" ]]; then
    echo "======== $table"
    grep -v '^-- \|^#   ' "$out/$table"
  fi
done
echo "== done at ${SECONDS} s; failed:${failed:- none}"
if [[ -n "$left_for_time" ]]; then
  echo "gpu_check: not run for lack of time:$left_for_time; run them in another call:" \
    "bash benchmarks/gpu_check.sh${left_for_time}"
fi
[[ -z "$failed" && -z "$left_for_time" ]]
