"""The amp front end on FSDP2 (fully_shard) models, two CPU processes (gloo).

FSDP2 owns the model's parameters, so amp must not cast them: the recipe is FSDP2's own
MixedPrecisionPolicy for the casts and amp.initialize(..., opt_level="O2",
cast_model_type=False) for loss scaling with ampfuse's fused optimizer; O1 (autocast inside the
forward) works as it does unsharded. Levels that cast the model are refused.
"""

import ampfuse
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ampfuse import amp
from helpers import raises_naming
from ranks import run_on_ranks
from torch import nn

WORLD_SIZE = 2
STEPS = 4
OVERFLOW_STEP = 2
TIMEOUT_S = 60


def _model(policy_dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 7))
    if policy_dtype is False:
        return model  # unsharded
    policy = MixedPrecisionPolicy(param_dtype=policy_dtype, reduce_dtype=torch.float32)
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=policy)
    return model


def _loss(model, step):
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(8, 16, generator=generator)
    targets = torch.randn(8, 7, generator=generator)
    loss = F.mse_loss(model(inputs).float(), targets)
    if step == OVERFLOW_STEP and dist.get_rank() == 1:
        loss = loss * float("inf")  # rank 1's grads overflow; the reduce-scatter spreads it
    return loss


def _whole_params(model):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def _amp_run(model, opt_level, **options):
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                      **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        with amp.scale_loss(_loss(model, step), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    scale = amp.state_dict()["loss_scaler0"]["scale"]
    return {"params": _whole_params(model), "scale": scale,
            "skipped": amp.skipped_steps(optimizer)}


def _grad_scaler_run(model):
    """The same training written with ampfuse.GradScaler instead of amp."""
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = ampfuse.GradScaler("cpu")
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    return {"params": _whole_params(model), "scale": scaler.get_scale(),
            "skipped": scaler.get_skipped_steps()}


def _scenarios():
    return {
        # amp's dtype names the policy's: fp16, so the loss is scaled dynamically.
        "o2_policy": _amp_run(_model(torch.float16), "O2", cast_model_type=False,
                              dtype=torch.float16),
        "grad_scaler_policy": _grad_scaler_run(_model(torch.float16)),
        "o1_sharded": _amp_run(_model(None), "O1"),
        "o1_unsharded": _amp_run(_model(False), "O1"),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(_scenarios, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S,
                        out_dir=tmp_path_factory.mktemp("fsdp2_amp"))


def _assert_same_run(actual, expected, what):
    assert (actual["scale"], actual["skipped"]) == (expected["scale"], expected["skipped"]), what
    for i, (a, b) in enumerate(zip(actual["params"], expected["params"])):
        assert torch.equal(a, b), f"{what}: param {i} differs"


def test_o2_with_fsdp2_mixed_precision_equals_the_grad_scaler_recipe(ranks):
    for rank, result in enumerate(ranks):
        run = result["o2_policy"]
        assert run["params"][0].dtype == torch.float32  # FSDP2's sharded params stay fp32
        assert (run["skipped"], run["scale"]) == (1, 2.0**15), f"rank {rank}"
        _assert_same_run(run, result["grad_scaler_policy"], f"rank {rank}: amp O2 vs GradScaler")
        assert not torch.equal(run["params"][0], _model(False)[0].weight.detach())
    _assert_same_run(ranks[1]["o2_policy"], ranks[0]["o2_policy"], "rank 1 vs rank 0")


def test_o1_with_fsdp2_equals_o1_unsharded(ranks):
    """Every rank's sharded run equals rank 1's unsharded one (same batches; rank 1 is the
    one whose loss overflows at OVERFLOW_STEP, and under FSDP2 every rank skips that step)."""
    unsharded = ranks[1]["o1_unsharded"]
    assert (unsharded["skipped"], ranks[0]["o1_unsharded"]["skipped"]) == (1, 0)
    for rank, result in enumerate(ranks):
        sharded = result["o1_sharded"]
        # bf16: no loss scaling by default, but the overflowing step is still skipped.
        assert (sharded["skipped"], sharded["scale"]) == (1, 1.0), f"rank {rank}"
        for i, (a, b) in enumerate(zip(sharded["params"], unsharded["params"])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, i=i, rank=rank: f"rank {rank} param {i}: {m}")


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_levels_that_cast_an_fsdp2_model_are_refused(one_rank, opt_level):
    model = _model(None)
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters())
    with raises_naming("FSDP2", "MixedPrecisionPolicy", "cast_model_type=False"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
