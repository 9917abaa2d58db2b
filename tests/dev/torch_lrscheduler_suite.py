"""Dev check: PyTorch's own LR-scheduler tests, run against ampfuse's drop-in optimizers.

PyTorch tests its schedulers in ``test/optim/test_lrscheduler.py`` (class ``TestLRScheduler``),
on optimizers it builds by name: ``SGD``, ``Adam``, ``AdamW`` (imported, or reached as
``torch.optim.AdamW``). This script reads that file from a PyTorch source checkout that you
provide (nothing of PyTorch's is kept in this repository) and runs its tests twice: once as
written (torch's optimizers: the baseline) and once with SGD, Adam, AdamW and Adagrad replaced
by ampfuse's drop-ins (torch_optim_suite.drop_ins), both in the test's namespace and in
``torch.optim`` for the duration of the run. The tests exercise what schedulers read and
write in param groups (``initial_lr``, tensor lrs, momentum and betas cycling, SWALR, state
dicts); most step without grads, so they check that handling, not the update's arithmetic.

One test differs on purpose (docs/optimizers.md):
``test_cycle_lr_with_adam`` cycles Adam's beta1 up to 22, which the fused optimizers refuse at
the step (they check a group's hyperparameters at every step; torch checks only in its
constructor). The script prints one line per test and exits non-zero when a test passes with
torch's classes but not with ampfuse's, outside that one.

Get the file as for torch_optim_suite.py (a sparse checkout of ``test`` at the installed torch's
tag), then run (a few seconds; needs ``expecttest``)::

    python tests/dev/torch_lrscheduler_suite.py /tmp/pytorch-src
"""

from __future__ import annotations

import contextlib
import sys
import unittest

from _torch_tests import parse_suite_args, report, run_suite
from torch_optim_suite import drop_ins

EXPECTED = {"test_cycle_lr_with_adam": "beta1 of 22 refused at the step"}


@contextlib.contextmanager
def torch_optim_names(classes):
    """torch.optim.<name> is `classes[name]` inside the block."""
    import torch.optim

    saved = {name: getattr(torch.optim, name) for name in classes}
    try:
        for name, cls in classes.items():
            setattr(torch.optim, name, cls)
        yield
    finally:
        for name, cls in saved.items():
            setattr(torch.optim, name, cls)


def run(test_file, use_ampfuse, name_filter, verbose):
    ours = drop_ins() if use_ampfuse else {}
    namespace = {"__name__": f"lrscheduler_suite_{'ampfuse' if use_ampfuse else 'torch'}"}
    exec(compile(test_file.read_text(), str(test_file), "exec"), namespace)
    namespace.update(ours)  # the names the test file imported from torch.optim
    loaded = unittest.defaultTestLoader.loadTestsFromTestCase(namespace["TestLRScheduler"])
    suite = unittest.TestSuite(t for t in loaded
                               if not name_filter or name_filter in t._testMethodName)
    with torch_optim_names(ours):
        return run_suite(suite, verbose)


def main() -> int:
    args, test_file = parse_suite_args(__doc__.split("\n\n")[0], "optim/test_lrscheduler.py")
    baseline = run(test_file, False, args.name_filter, verbose=False)
    ours = run(test_file, True, args.name_filter, verbose=args.verbose)
    return report(baseline, ours, EXPECTED, width=70)


if __name__ == "__main__":
    sys.exit(main())
