"""Dev check: PyTorch's own optimizer tests, run against ampfuse's drop-in optimizers.

PyTorch tests its optimizers in ``test/test_optim.py``, class ``TestOptimRenewed``: every test
runs over ``optim_db``, one ``OptimizerInfo`` per optimizer (its class, the configurations to try,
the errors to expect). This script reads that file from a PyTorch source checkout that you
provide (nothing of PyTorch's is kept in this repository), keeps the ``optim_db`` entries of
Adam, AdamW, SGD and Adagrad, and runs the tests' CPU instances twice: once as written
(torch's classes: the baseline) and once with each entry's ``optim_cls`` replaced by ampfuse's
drop-in (FusedAdam with torch.optim.Adam's L2 decay, FusedAdamW, FusedSGD, FusedAdagrad,
subclassed under torch's class names, which the tests read). Everything else in the entries
(configurations, error inputs, decorators) is torch's.

The fused optimizers refuse ``differentiable=True``, so that implementation is left out of the
entries on both sides; the tests then run every other configuration (hooks, state_dict, zero
grads, tensor lr...) instead of stopping at the first differentiable one.

Some tests differ on purpose (docs/optimizers.md): float64 params are
refused, argument errors are worded our own way and checked after
torch's own base class has looked at ``params`` (torch's error inputs pass ``params=None``),
and params on the meta device step as with torch's default path where torch's fused kernel
refuses them. Those are listed in EXPECTED below. The script prints one line per test and
exits non-zero when a test passes with torch's class but not with ampfuse's, outside that list.

Get the file (use the tag of the installed torch)::

    git clone --depth 1 --branch v2.11.0 --filter=blob:none --sparse \\
        https://github.com/pytorch/pytorch /tmp/pytorch-src
    git -C /tmp/pytorch-src sparse-checkout set test

Run (about a minute on two cores; needs ``expecttest``)::

    python tests/dev/torch_optim_suite.py /tmp/pytorch-src
    python tests/dev/torch_optim_suite.py /tmp/pytorch-src -k state_dict   # a subset

Not run in CI: it needs the PyTorch sources and takes longer than the unit tests.
"""

from __future__ import annotations

import ast
import copy
import re
import sys
import unittest
from pathlib import Path

from _torch_tests import parse_suite_args, report, run_suite

NAMES = ("Adam", "AdamW", "SGD", "Adagrad")

# Test-name patterns that differ on purpose (see the module docstring).
EXPECTED = {
    r"^test_(foreach|fused)_matches_forloop_.*_float64$": "float64 params are refused",
    r"^test_errors_": "params=None reaches torch's base class first; messages are our own",
    r"^test_fused_error_on_params_on_meta_": "meta params step, as torch's default path",
}


def drop_ins():
    """ampfuse's drop-ins under torch's class names (the tests name and branch on them)."""
    from ampfuse.optimizers import FusedAdagrad, FusedAdam, FusedAdamW, FusedSGD

    class Adam(FusedAdam):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                     amsgrad=False, *, decoupled_weight_decay=False, **kwargs):
            super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                             decoupled_weight_decay=decoupled_weight_decay, **kwargs)

    return {"Adam": Adam, "AdamW": type("AdamW", (FusedAdamW,), {}),
            "SGD": type("SGD", (FusedSGD,), {}), "Adagrad": type("Adagrad", (FusedAdagrad,), {})}


def split_source(test_optim: Path) -> tuple[str, str]:
    """(the file's imports, the source of class TestOptimRenewed). The imports of
    test/optim/*.py only re-export other test classes and are dropped."""
    source = test_optim.read_text()
    lines = source.splitlines()
    cls = next((node for node in ast.parse(source).body
                if isinstance(node, ast.ClassDef) and node.name == "TestOptimRenewed"), None)
    if cls is None:
        raise SystemExit(f"{test_optim}: no class TestOptimRenewed; is it PyTorch's "
                         "test/test_optim.py?")
    start = min([d.lineno for d in cls.decorator_list] + [cls.lineno]) - 1
    imports = [line for line in lines[:start] if not line.startswith("from optim.")]
    return "\n".join(imports), "\n".join(lines[start:cls.end_lineno])


def optim_db_for(use_ampfuse: bool) -> list:
    from torch.testing._internal.common_optimizers import optim_db

    ours = drop_ins() if use_ampfuse else {}
    entries = []
    for info in optim_db:
        name = info.optim_cls.__name__
        if name not in NAMES:
            continue
        info = copy.copy(info)
        info.optim_cls = ours.get(name, info.optim_cls)
        info.supported_impls = tuple(i for i in info.supported_impls if i != "differentiable")
        entries.append(info)
    return entries


def run(test_optim: Path, use_ampfuse: bool, name_filter: str | None,
        verbose: bool) -> dict[str, tuple[str, str]]:
    """Runs the CPU tests; returns test name -> (outcome, last line of its error)."""
    imports, class_source = split_source(test_optim)
    namespace: dict = {"__name__": f"optim_suite_{'ampfuse' if use_ampfuse else 'torch'}"}
    exec(compile(imports, "<test_optim.py imports>", "exec"), namespace)
    namespace["optim_db"] = optim_db_for(use_ampfuse)
    exec(compile(class_source, "<test_optim.py TestOptimRenewed>", "exec"), namespace)
    namespace["instantiate_device_type_tests"](namespace["TestOptimRenewed"], namespace,
                                               only_for="cpu")
    loaded = unittest.defaultTestLoader.loadTestsFromTestCase(namespace["TestOptimRenewedCPU"])
    return run_suite(unittest.TestSuite(
        t for t in loaded if not name_filter or name_filter in t._testMethodName), verbose)


def expected_reason(name: str) -> str | None:
    for pattern, reason in EXPECTED.items():
        if re.search(pattern, name):
            return reason
    return None


def main() -> int:
    args, test_optim = parse_suite_args(__doc__.split("\n\n")[0], "test_optim.py")
    baseline = run(test_optim, False, args.name_filter, verbose=False)
    ours = run(test_optim, True, args.name_filter, verbose=args.verbose)
    expected = {}
    for name in ours:
        reason = expected_reason(name)
        if reason:
            expected[name] = reason
    return report(baseline, ours, expected)


if __name__ == "__main__":
    sys.exit(main())
