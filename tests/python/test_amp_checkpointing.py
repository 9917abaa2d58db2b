"""Activation checkpointing (torch.utils.checkpoint) inside an amp model trains exactly as the
same model without it.

At O1 the checkpointed part runs again during the backward. torch's checkpoint restores
torch's autocast state for that, but not the O1 model's lists (they are active only during
the model's forward), so the recomputation cast differently: the non-reentrant checkpoint
refused the recomputed tensors ("different metadata"), the reentrant one silently computed
other values. A listed op run under autocast inside a backward now takes the lists of the
live O1 models, and when those disagree about it, stops with an error that says so."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ampfuse import amp
from ampfuse.optimizers import FusedAdam


class Block(torch.nn.Module):
    """LayerNorm, Linear, GELU, softmax (on apex's fp32 list) and a residual Linear."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = torch.softmax(F.gelu(self.fc(self.norm(x))), -1) * 3.0
        return x + self.out(h)


class Net(torch.nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant  # None: no checkpointing
        self.inp = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _train(level, use_reentrant, dtype, **lists):
    torch.manual_seed(0)
    model = Net(use_reentrant)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, dtype=dtype,
                                      verbosity=0, **lists)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        # The reentrant checkpoint recomputes only for inputs that require grad.
        inputs = torch.randn(8, 16, generator=gen).requires_grad_(bool(use_reentrant))
        targets = torch.randint(0, 4, (8,), generator=gen)
        loss = F.cross_entropy(model(inputs).float(), targets)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().float().clone() for p in model.parameters()]


SETUPS = {
    "O1": ("O1", {}),
    "O1-custom-list": ("O1", {"custom_black_list": ["gelu"]}),
    "O2": ("O2", {}),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
def test_checkpointed_model_trains_as_the_plain_one(setup, use_reentrant, dtype):
    level, lists = setup
    plain = _train(level, None, dtype, **lists)
    checkpointed = _train(level, use_reentrant, dtype, **lists)
    assert checkpointed[0] == plain[0], "losses"
    for i, (c, p) in enumerate(zip(checkpointed[1], plain[1])):
        assert torch.equal(c, p), f"param {i}"


def test_o1_models_that_disagree_on_a_recomputed_op_are_named():
    """A second O1 model that casts gelu differently: whose lists a recomputation in the
    backward takes cannot be told, so it stops with the op and the fix."""
    other = torch.nn.Linear(4, 4)
    other_opt = FusedAdam(other.parameters())
    other, other_opt = amp.initialize(other, other_opt, opt_level="O1", verbosity=0,
                                      custom_black_list=["gelu"])
    torch.manual_seed(0)
    model = Net(use_reentrant=False)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    loss = model(torch.randn(8, 16)).float().square().mean()
    with pytest.raises(RuntimeError, match=r"aten::gelu.*2 O1 models alive cast it differently"
                                           r".*same custom lists"):
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
    del other, other_opt


def test_copies_of_one_o1_model_agree():
    """An EMA-style deep copy registers lists of its own, the same ones: no ambiguity."""
    import copy

    torch.manual_seed(0)
    model = Net(use_reentrant=False)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0,
                                      custom_black_list=["gelu"])
    ema = copy.deepcopy(model)
    loss = model(torch.randn(8, 16)).float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert ema is not model
