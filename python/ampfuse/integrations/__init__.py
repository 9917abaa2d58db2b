"""Glue between ampfuse and the libraries most PyTorch users train with.

Each submodule imports its framework when it is itself imported, never before: `import ampfuse`
imports none of them. Install them with the `integrations` extra (`pip install
"ampfuse[integrations]"`) or on their own.

- ``ampfuse.integrations.lightning``: precision plugins for the Lightning Trainer
  (``AmpfusePrecision``) and for Fabric (``AmpfuseFabricPrecision``).
- ``ampfuse.integrations.accelerate``: ``track_skipped_steps(optimizer)``, which makes
  Accelerate's ``optimizer_step_was_skipped`` and its LR-scheduler wrapper see a step that a fused
  optimizer skipped on the device.
- ``ampfuse.integrations.transformers``: ``AmpfuseTrainerCallback`` for the HF Trainer, which does
  the same inside ``Trainer.train()``.
"""

import importlib
from types import ModuleType


def require(module: str, purpose: str) -> ModuleType:
    """Imports `module` (a framework) or raises an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.partition(".")[0]
        raise ImportError(
            f"{purpose} needs the `{top}` package, which is not installed (or failed to import: "
            f"{error}). Install it with `pip install \"ampfuse[integrations]\"` (or `pip install "
            f"{top}`)."
        ) from error
