"""Dev check: PyTorch's own GradScaler tests, run against ampfuse.GradScaler.

PyTorch tests its GradScaler in ``test/test_torch.py`` (class ``TestTorchDeviceType``: the
``test_grad_scaling_*`` tests, ``test_pickle_gradscaler``, ``test_grad_scaler_pass_itself``,
``test_grad_scale_will_not_overflow`` and ``test_params_invalidated_*``). This script reads that
file from a PyTorch source checkout that you provide (nothing of PyTorch's is kept in this
repository), takes those test methods out of the class, and runs their CPU instances twice:
once as written (torch's class: the baseline) and once with ``torch.GradScaler`` and
``torch.amp.GradScaler`` replaced by ``ampfuse.GradScaler`` for the duration of the run. It
prints one line per test and both outcomes, and exits non-zero when a test passes with torch's
class but not with ampfuse's.

Get the file (only test/test_torch.py is needed; use the tag of the installed torch)::

    git clone --depth 1 --branch v2.11.0 --filter=blob:none --sparse \
        https://github.com/pytorch/pytorch /tmp/pytorch-src
    git -C /tmp/pytorch-src sparse-checkout set test

Run (about a minute on two cores; needs ``expecttest``, which torch's test helpers import)::

    python tests/dev/torch_grad_scaler_suite.py /tmp/pytorch-src
    python tests/dev/torch_grad_scaler_suite.py /tmp/pytorch-src -k unscale   # a subset

Not run in CI: it needs the PyTorch sources and takes longer than the unit tests.
"""

from __future__ import annotations

import ast
import contextlib
import re
import sys
import textwrap
import unittest
from pathlib import Path

from _torch_tests import parse_suite_args, report, run_suite

# The tests that exercise GradScaler; torch's own deprecated aliases
# (torch.cpu.amp.GradScaler) are torch's business and left out.
SELECTED = re.compile(
    r"^(test_grad_scal|test_pickle_gradscaler|test_grad_scaler_pass_itself"
    r"|_run_scaling_case$|_?test_params_invalidated_with_grads_invalidated)"
)
EXCLUDED = {"test_grad_scaler_deprecated_warning"}

# The names those tests use from the top of test_torch.py.
PREAMBLE = """
import contextlib
import pickle
import unittest
from functools import partial
from itertools import chain

import torch
import torch._inductor.config
from torch.testing._internal.common_cuda import (
    TEST_MULTIGPU, _create_scaling_case, _create_scaling_models_optimizers)
from torch.testing._internal.common_device_type import (
    dtypes, dtypesIfCPU, dtypesIfCUDA, instantiate_device_type_tests, onlyCPU, onlyCUDA,
    onlyNativeDeviceTypes)
from torch.testing._internal.common_optimizers import (
    _get_optim_inputs_including_global_cliquey_kwargs, optim_db, optims)
from torch.testing._internal.common_utils import (
    TestCase, parametrize, skipIfRocm, skipIfTorchDynamo)
"""


def extract_methods(test_torch: Path, name_filter: str | None) -> tuple[str, list[str]]:
    """The selected methods of TestTorchDeviceType, as source of a class body."""
    source = test_torch.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(
        (node for node in tree.body
         if isinstance(node, ast.ClassDef) and node.name == "TestTorchDeviceType"),
        None,
    )
    if cls is None:
        raise SystemExit(
            f"{test_torch}: no class TestTorchDeviceType; is it PyTorch's test_torch.py?"
        )
    chunks, names = [], []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if not SELECTED.match(node.name) or node.name in EXCLUDED:
            continue
        if node.name.startswith("test_") and name_filter and name_filter not in node.name:
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        chunks.append(textwrap.dedent("\n".join(lines[start:node.end_lineno])))
        if node.name.startswith("test_"):
            names.append(node.name)
    if not names:
        raise SystemExit(f"{test_torch}: no GradScaler tests matched.")
    return "\n\n".join(chunks), names


def build_tests(body: str, use_ampfuse: bool) -> dict:
    """Compiles the tests into a namespace and instantiates their CPU variants."""
    namespace: dict = {"__name__": f"grad_scaler_suite_{'ampfuse' if use_ampfuse else 'torch'}"}
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    class_source = "class TestGradScaler(TestCase):\n" + textwrap.indent(body, "    ")
    exec(compile(class_source, "<test_torch.py excerpt>", "exec"), namespace)
    instantiate = namespace["instantiate_device_type_tests"]
    instantiate(namespace["TestGradScaler"], namespace, only_for="cpu")
    return namespace


@contextlib.contextmanager
def gradscaler_swapped(use_ampfuse: bool):
    import torch

    if not use_ampfuse:
        yield
        return
    import ampfuse

    saved = torch.GradScaler, torch.amp.GradScaler
    torch.GradScaler = torch.amp.GradScaler = ampfuse.GradScaler
    try:
        yield
    finally:
        torch.GradScaler, torch.amp.GradScaler = saved


def run(body: str, use_ampfuse: bool, verbose: bool) -> dict[str, tuple[str, str]]:
    """Runs every CPU test; returns test id -> (outcome, detail), as _torch_tests.run_suite."""
    namespace = build_tests(body, use_ampfuse)
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(namespace["TestGradScalerCPU"])
    with gradscaler_swapped(use_ampfuse):
        return run_suite(suite, verbose)


def main() -> int:
    args, test_torch = parse_suite_args(__doc__.split("\n\n")[0], "test_torch.py")
    body, _ = extract_methods(test_torch, args.name_filter)

    baseline = run(body, use_ampfuse=False, verbose=False)
    ours = run(body, use_ampfuse=True, verbose=args.verbose)
    return report(baseline, ours, width=90)


if __name__ == "__main__":
    sys.exit(main())
