"""The precision set-ups the FP8 benchmarks compare (bench_fp8_train.py, bench_fp8_layer.py).

Rows, all bf16, all with AdamW's math and fp32 master weights:
  torch amp bf16        fp32 model, torch.autocast(bfloat16), torch.optim.AdamW(fused=True)
                        (foreach where torch has no fused kernel for the device).
  ampfuse O2 bf16       amp.initialize(opt_level="O2", dtype=bfloat16) with FusedAdam (AdamW
                        mode): bf16 model, fp32 masters in the optimizer. The baseline.
  ampfuse fp8 current   the same with fp8=ampfuse.fp8.CurrentScaling()
  ampfuse fp8 rowwise   ... fp8=ampfuse.fp8.RowwiseScaling()
  ampfuse fp8 delayed   ... fp8=ampfuse.fp8.DelayedScaling()
  ampfuse fp8=True      ... fp8=True (the default recipe and the automatic Linear filter)
  torchao tensorwise    torch amp bf16 with torchao.float8.convert_to_float8_training
  torchao rowwise       (Float8LinearConfig.from_recipe_name) and torch.compile of the model,
                        as torchao's float8 README recommends; only where torchao imports.
The recipe rows put every eligible Linear in FP8 (fp8_min_features=0, where amp.initialize
has it), as torchao's conversion does, so that recipes compare on the same GEMMs; "fp8=True"
keeps ampfuse's automatic rule, which leaves small Linears in bf16. Each row says how many
Linears ran in FP8. A recipe this ampfuse does not have (the FP8 rework's names, before it is
merged) makes its row an error row that says so, not a failure of the run.
"""

import inspect

import torch
from ampfuse import amp
from ampfuse import fp8 as ampfuse_fp8
from ampfuse.optimizers import FusedAdam
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

LR = 3e-4
WEIGHT_DECAY = 0.01
BASELINE = "ampfuse O2 bf16"
FP8_RECIPES = {"ampfuse fp8 current": "CurrentScaling", "ampfuse fp8 rowwise": "RowwiseScaling",
               "ampfuse fp8 delayed": "DelayedScaling", "ampfuse fp8=True": None}
TORCHAO = {"torchao tensorwise": "tensorwise", "torchao rowwise": "rowwise"}
SETUPS = ("torch amp bf16", BASELINE, *FP8_RECIPES, *TORCHAO)


class NotAvailable(RuntimeError):
    """A row that this installation cannot run (a missing recipe or package)."""


def torchao_float8():
    """torchao.float8, or None where torchao does not import."""
    try:
        from torchao import float8
    except ImportError:
        return None
    return float8


def torchao_convert(module, setup):
    """torchao's float8 training conversion of `module` in place, with the recipe of `setup`."""
    float8 = torchao_float8()
    if float8 is None:
        raise NotAvailable("torchao does not import here")
    config = float8.Float8LinearConfig.from_recipe_name(TORCHAO[setup])
    float8.convert_to_float8_training(module, config=config)


def fp8_recipe(setup):
    """The fp8= argument of amp.initialize for an ampfuse FP8 row."""
    name = FP8_RECIPES[setup]
    if name is None:
        return True
    return getattr(ampfuse_fp8, name)()


def _torch_adamw(params, device):
    fused = device in _get_fused_kernels_supported_devices()
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **kind)


def fp8_linear_count(model):
    """'n/m': the model's Linears that compute in FP8 (ampfuse's or torchao's), of all."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fp8 = [m for m in linears if isinstance(m, ampfuse_fp8.Linear)
           or type(m).__name__ == "Float8Linear"]
    return f"{len(fp8)}/{len(linears)}"


def build(setup, make_model, device):
    """(model, optimizer, forward context factory, description, FP8 Linears 'n/m') for one
    row. make_model() returns a fresh fp32 model on `device` (seeded by the caller). The
    forward context is torch.autocast for torch's rows and a no-op for ampfuse's."""
    if setup == "torch amp bf16" or setup in TORCHAO:
        model = make_model()
        what = "fp32 model, autocast bf16, AdamW(fused)"
        if setup in TORCHAO:
            torchao_convert(model, setup)
            count = fp8_linear_count(model)
            model = torch.compile(model)
            what += f", torchao float8 {TORCHAO[setup]}, torch.compile"
        else:
            count = fp8_linear_count(model)
        opt = _torch_adamw(model.parameters(), device)

        def autocast():
            return torch.autocast(device, dtype=torch.bfloat16)

        return model, opt, autocast, what, count

    fp8 = False if setup == BASELINE else fp8_recipe(setup)
    model = make_model()
    opt = FusedAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    every = {}
    if fp8 is not False and fp8 is not True and _initialize_takes("fp8_min_features"):
        every = {"fp8_min_features": 0}  # every eligible Linear, as torchao converts them
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0,
                                fp8=fp8, **every)
    what = "O2 bf16, FusedAdam (fp32 masters)"
    if fp8 is not False:
        what += f", fp8={type(fp8).__name__ + '()' if fp8 is not True else 'True'}"
    return model, opt, _nothing, what, fp8_linear_count(model)


def _initialize_takes(name):
    return name in inspect.signature(amp.initialize).parameters


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _nothing():
    return _Nothing()


def weight_stepper(module):
    """A function doing what an optimizer step does to `module`'s FP8 weights between two
    training steps: it writes the weights, so the next forward quantizes them again (their amax,
    cast and transpose). A layer benchmark has no optimizer; calling the function before each
    timed call keeps ampfuse's weight cache from serving every call after the first the first
    call's FP8 weights, a saving no training step without gradient accumulation gets (torchao's
    float8 pays it on every call). The FP8 layers are found here, once, so that the timed calls
    pay only the invalidation; for torchao's layers and bf16 ones the function does nothing."""
    layers = ampfuse_fp8.fp8_modules(module)

    def step():
        for layer in layers:
            layer.invalidate()
    return step


def convert_layer(module, setup):
    """Turns the nn.Linear layers of a bf16 module into FP8 ones for a layer benchmark (no
    optimizer): ampfuse.fp8.convert, or torchao's conversion. Returns the module to call."""
    if setup in TORCHAO:
        torchao_convert(module, setup)
        return torch.compile(module)
    recipe = fp8_recipe(setup)
    recipe = None if recipe is True else recipe
    ampfuse_fp8.convert(module, recipe, min_features=0)  # every eligible Linear, whatever its size
    return module


