"""Registers the ops' DTensor rules (ampfuse.ops.dtensor) the first time a wrapper is called
after torch.distributed.tensor is loaded."""

from __future__ import annotations

import sys

import torch


def register_dtensor_rules() -> None:
    """Registers the ops' DTensor rules (ampfuse.ops.dtensor) once torch.distributed.tensor is
    loaded. No DTensor exists before that, and importing it eagerly would cost every ampfuse
    import over a second, so each wrapper checks: one dict lookup (skipped while torch.compile
    traces; eager calls register the rules). The dict lookups come first: torch.compile traces
    them, and they settle the usual case without a Python call."""
    if "torch.distributed.tensor" not in sys.modules or "ampfuse.ops.dtensor" in sys.modules:
        return
    if not torch.compiler.is_compiling():
        import ampfuse.ops.dtensor  # noqa: F401  (registers the rules)
