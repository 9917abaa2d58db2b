"""Convergence parity on real data: the demo's CNN trained on the digits set at O1 and O2 ends
within one point of test accuracy of the fp32 run, with the same seed, batches and
hyperparameters (bf16 on CPU, fp16 on CUDA). One point is under 4 of the 360 test images."""

import pytest
import torch

from ampfuse.tools.demo import digits as demo
from ampfuse.tools.demo import training

STEPS = 300  # about 13 epochs: fp32 is at 98% and every run has converged
TOLERANCE = 1.0  # percentage points of test accuracy


def _check_parity(device, dtype):
    data = training.load_digits(device)
    accuracy = {}
    for level in ("O0", "O1", "O2"):
        result = training.train_run(level, level, data, steps=STEPS, seed=0, device=device,
                                    dtype=dtype, progress=False)
        assert demo.failures([result], inject_overflow=None) == []
        accuracy[level] = result["accuracy"]
    assert accuracy["O0"] >= 97.0, accuracy
    for level in ("O1", "O2"):
        assert abs(accuracy[level] - accuracy["O0"]) <= TOLERANCE, accuracy


def test_parity_cpu_bf16():
    _check_parity("cpu", torch.bfloat16)


@pytest.mark.cuda
def test_parity_cuda_fp16():
    _check_parity("cuda", torch.float16)
