#!/usr/bin/env bash
# The install check on a GPU machine (issue 32), as users install: the wheels built on the build
# machine, brought along in dist/ (git-ignored: name it in the run's carried paths), go into the
# GPU machine's own Python with plain pip, and the CUDA tests run against that install.
#   1. dist/ampfuse-*.whl (`make wheel`: every architecture): a venv with
#      --system-site-packages (it keeps the machine's torch), `pip install --no-deps` (no
#      network there), then `pytest -m cuda` from the checkout, whose python/ is not on sys.path.
#   2. a wheel with machine code for sm_80 only, which an H100/H200 cannot run (dist-sm80/,
#      built here with the machine's 16 cores when not brought along). The first CUDA op must
#      raise ampfuse's error naming the device and the rebuild command, not a CUDA fault.
# Logs go to $OUT (default benchmarks/out). Exit status: non-zero if either check failed.
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
status=0

install_into() {  # install_into VENV WHEEL_DIR: a venv over the system torch, the wheel in it
  python3 -m venv --system-site-packages "$1" &&
    "$1/bin/python" -m pip install --quiet --no-deps --disable-pip-version-check "$2"/ampfuse-*.whl
}

echo "== 1. the full wheel, pytest -m cuda (at ${SECONDS} s)"
if install_into /tmp/ampfuse-wheel dist >"$out/wheel_install.log" 2>&1; then
  (cd tests && /tmp/ampfuse-wheel/bin/python -c \
    "import ampfuse; print(ampfuse.__version__, ampfuse.__file__); print(ampfuse.cuda_status())") \
    | tee -a "$out/wheel_install.log"
  /tmp/ampfuse-wheel/bin/python -m pytest -m cuda -q -p no:cacheprovider tests/python \
    >"$out/wheel_pytest_cuda.log" 2>&1 || status=1
  tail -n 3 "$out/wheel_pytest_cuda.log"
else
  tail -n 20 "$out/wheel_install.log"
  status=1
fi

echo "== 2. an sm_80-only wheel on this GPU: the clear error (at ${SECONDS} s)"
if ! ls dist-sm80/ampfuse-*.whl >/dev/null 2>&1; then
  TORCH_CUDA_ARCH_LIST=8.0 MAX_JOBS=16 python3 -m pip wheel --quiet --no-build-isolation \
    --no-deps --wheel-dir dist-sm80 . >"$out/sm80_build.log" 2>&1 || tail -n 20 "$out/sm80_build.log"
fi
if install_into /tmp/ampfuse-sm80 dist-sm80 >"$out/sm80_install.log" 2>&1; then
  (cd tests && /tmp/ampfuse-sm80/bin/python - <<'EOF') 2>&1 | tee "$out/sm80_error.log"
import sys
import torch
import ampfuse

print(ampfuse.cuda_status())
grads = [torch.ones(4, device="cuda")]
found_inf = torch.zeros(1, device="cuda")
try:
    ampfuse.multi_tensor_unscale_(grads, found_inf, torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
except RuntimeError as error:
    message = str(error)
    print("raised:", message.splitlines()[0])
    sys.exit(0 if "has no GPU code for CUDA device" in message and "TORCH_CUDA_ARCH_LIST" in message
             else 1)
print("no error: an sm_80-only build ran on this GPU")
sys.exit(1)
EOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  tail -n 20 "$out/sm80_install.log"
  status=1
fi
echo "gpu_wheel_check: $([ $status -eq 0 ] && echo ok || echo FAILED) (at ${SECONDS} s)"
exit $status
