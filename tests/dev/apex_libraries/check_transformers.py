"""Dev check: transformers 4.x Trainer with half_precision_backend="apex", unchanged, on ampfuse
(CPU).

transformers 4.57 (the last 4.x; 5.x removed its apex backend) decides whether apex exists at
import time: ``transformers/utils/import_utils.py`` sets ``_apex_available =
_is_package_available("apex")``, which needs ``importlib.util.find_spec("apex")`` AND
``importlib.metadata.version("apex")`` (a distribution named apex). install_apex_alias() alone
does not satisfy the second, so this is the library that needs the installed alias::

    python -m ampfuse.apex_compat install      # into the environment's site-packages

This script does the same into a temporary directory that it puts first on sys.path, then runs
the Trainer's apex paths: ``TrainingArguments`` validation (``from apex import amp``),
``optim="adamw_apex_fused"`` (``apex.optimizers.FusedAdam``), ``amp.initialize(model,
optimizer, opt_level=args.fp16_opt_level)`` in ``_wrap_model``, ``amp.scale_loss`` in
``training_step``, and clipping over ``amp.master_params(optimizer)``. A tiny BERT trains on a
synthetic task at O1 and O2; the loss must fall as it does in an fp32 run of the same Trainer.

Run it from the repository root with transformers 4.57 and its dependencies on the path (see
README.md beside this file)::

    PYTHONPATH=/path/to/tf4-libs python tests/dev/apex_libraries/check_transformers.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import tempfile

import torch
from _checks import Checks

from ampfuse.apex_compat import ALIAS_VERSION, metadata

SITE = tempfile.mkdtemp(prefix="apex-alias-site-")
metadata.install(SITE)
sys.path.insert(0, SITE)  # what site-packages is for an installed package
importlib.invalidate_caches()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ampfuse  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)
from transformers.utils import is_apex_available  # noqa: E402

STEPS = 60
VOCAB = 32
LENGTH = 12
check = Checks("transformers")


class Marked(torch.utils.data.Dataset):
    """Label 1 when token 7 occurs in the sequence."""

    def __init__(self, size=512):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(8, VOCAB, (size, LENGTH), generator=gen)
        self.labels = torch.randint(0, 2, (size,), generator=gen)
        where = torch.randint(0, LENGTH, (size,), generator=gen)
        self.ids[self.labels == 1, where[self.labels == 1]] = 7

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def tiny_bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=LENGTH, num_labels=2)
    return BertForSequenceClassification(config)


def train(out_dir, opt_level=None):
    apex = opt_level is not None
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=32,
        learning_rate=3e-3, warmup_steps=0, logging_steps=5, save_strategy="no",
        report_to=[], seed=0, dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True,
        optim="adamw_apex_fused" if apex else "adamw_torch",
        fp16=apex, half_precision_backend="apex" if apex else "auto",
        fp16_opt_level=opt_level or "O1")
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=Marked())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def main():
    logging.getLogger("transformers").setLevel(logging.WARNING)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"ampfuse {ampfuse.__version__}")
    check(importlib.metadata.version("apex") == ALIAS_VERSION,
          "importlib.metadata sees the installed alias as apex " + ALIAS_VERSION)
    check(bool(is_apex_available()), "transformers.utils.is_apex_available() is True")
    with tempfile.TemporaryDirectory() as out_dir:
        _, baseline = train(out_dir)
        print(f"      fp32: loss {baseline[0]:.3f} -> {baseline[-1]:.3f}")
        for opt_level in ("O1", "O2"):
            trainer, losses = train(out_dir, opt_level)
            optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            print(f"      apex {opt_level}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            check(trainer.use_apex, f"{opt_level}: the Trainer took its apex backend")
            check(type(optimizer).__module__ == "ampfuse.apex_compat.apex.optimizers",
                  f"{opt_level}: optim='adamw_apex_fused' built apex.optimizers.FusedAdam")
            check(hasattr(optimizer, "_amp_stash"), f"{opt_level}: amp.initialize ran")
            check(losses[-1] < 0.5 * losses[0],
                  f"{opt_level}: the loss falls under the Trainer's apex backend")
            check(abs(losses[-1] - baseline[-1]) < 0.1,
                  f"{opt_level}: the final loss is within 0.1 of the fp32 run's")
    metadata.uninstall(SITE)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
