"""Resuming FSDP2 training from torch.distributed.checkpoint (DCP) with ampfuse's fused optimizer
and GradScaler: two CPU processes (gloo) save the sharded model, the sharded optimizer state
(fp32 masters included) and the scaler mid-run; a fresh model resumes from the checkpoint and
must end bit-for-bit where the uninterrupted run ended, and one process (a different world size,
so DCP reshards every tensor) must end at the same whole tensors.

Two set-ups: a bf16 model whose optimizer keeps fp32 masters, and an fp32 model under FSDP2's
MixedPrecisionPolicy (fp16 compute, fp32 reduction), the sharded fp32 params being the masters.
At steps 1 and 5 one grad element overflows in one rank's shard only; every rank must skip.
"""

import math
import os

import ampfuse
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

WORLD_SIZE = 2
STEPS = 6
SAVE_AFTER = 3  # steps 0-2 before the checkpoint (the scaler's growth tracker is then 1), 3-5 after
OVERFLOW_STEPS = (1, 5)
OVERFLOW_ROW = 20  # a row of the first weight (32 rows) that rank 1 holds on two ranks
TIMEOUT_S = 60
CONFIGS = ("bf16_masters", "fp16_policy")


def _build(config):
    """The model (sharded over every rank), its FusedAdamW and a GradScaler."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 7))
    if config == "bf16_masters":
        model, policy = model.to(torch.bfloat16), MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=policy)
    optimizer = ampfuse.optimizers.FusedAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True
    )
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, optimizer, scaler


def _plant_overflow(grad):
    """An inf at OVERFLOW_ROW of the whole grad, written by the rank whose shard holds it
    (FSDP2 shards dim 0 in torch.chunk's pieces)."""
    rows_per_rank = math.ceil(grad.shape[0] / dist.get_world_size())
    owner = OVERFLOW_ROW // rows_per_rank
    if dist.get_rank() == owner:
        grad.to_local()[OVERFLOW_ROW - owner * rows_per_rank, 0] = float("inf")


def _train(model, optimizer, scaler, steps):
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        inputs = torch.randn(8, 16, generator=generator)
        targets = torch.randn(8, 7, generator=generator)
        dtype = next(model.parameters()).dtype
        loss = F.mse_loss(model(inputs.to(dtype)).float(), targets)
        scaler.scale(loss).backward()
        if step in OVERFLOW_STEPS:
            _plant_overflow(model[0].weight.grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def _app_state(model, optimizer, scaler):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "scaler": scaler.state_dict(),
    }


def _resume(checkpoint, model, optimizer, scaler):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _app_state(model, optimizer, scaler)
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scaler.load_state_dict(state["scaler"])


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # the step count is a plain tensor


def _snapshot(model, optimizer, scaler, view):
    """Every param and optimizer state tensor (through `view`: local shard or whole tensor),
    the scale and the skipped-step count."""
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"param{i}"] = view(p.detach()).clone()
        for key, value in optimizer.state[p].items():
            out[f"param{i}.{key}"] = view(value).clone()
    out["scale"] = scaler.get_scale()
    out["skipped"] = scaler.get_skipped_steps()
    return out


def _save_and_resume(checkpoint_root):
    """Per config: the uninterrupted run and the resumed one, as local shards and whole."""
    import torch.distributed.checkpoint as dcp

    results = {}
    for config in CONFIGS:
        checkpoint = os.path.join(checkpoint_root, config)
        model, optimizer, scaler = _build(config)
        _train(model, optimizer, scaler, range(SAVE_AFTER))
        dcp.save(_app_state(model, optimizer, scaler), checkpoint_id=checkpoint)
        _train(model, optimizer, scaler, range(SAVE_AFTER, STEPS))
        straight = _snapshot(model, optimizer, scaler, _local)
        whole = _snapshot(model, optimizer, scaler, _whole)

        model, optimizer, scaler = _build(config)
        _resume(checkpoint, model, optimizer, scaler)
        state_keys = sorted(optimizer.state[model[0].weight])
        state_is_sharded = all(
            type(value) is type(p) and value.placements == p.placements
            for p in model.parameters()
            for key, value in optimizer.state[p].items()
            if key != "step"
        )
        _train(model, optimizer, scaler, range(SAVE_AFTER, STEPS))
        resumed = _snapshot(model, optimizer, scaler, _local)
        results[config] = {
            "straight": straight,
            "resumed": resumed,
            "whole": whole,
            "state_keys": state_keys,
            "state_is_sharded": state_is_sharded,
        }
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2_checkpoint")
    results = run_on_ranks(_save_and_resume, str(root / "dcp"), world_size=WORLD_SIZE,
                           timeout_s=TIMEOUT_S, out_dir=root)
    return root / "dcp", results


def _assert_same(actual, expected, what):
    assert sorted(actual) == sorted(expected), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, f"{what}: {key}"
            assert torch.equal(actual[key], value), f"{what}: {key} differs"
        else:
            assert actual[key] == value, f"{what}: {key} is {actual[key]}, expected {value}"


@pytest.mark.parametrize("config", CONFIGS)
def test_dcp_resume_on_the_same_world_size_is_bit_for_bit(two_ranks, config):
    _, results = two_ranks
    for rank, result in enumerate(results):
        run = result[config]
        masters = ["master_param"] if config == "bf16_masters" else []  # else the params are
        assert run["state_keys"] == sorted(["step", "exp_avg", "exp_avg_sq", *masters])
        assert run["state_is_sharded"], f"rank {rank}: the loaded state lost its sharding"
        _assert_same(run["resumed"], run["straight"], f"{config}, rank {rank}")
        # Both planted overflows were skipped on every rank; the scale backed off at step 1, grew
        # back at step 3 (growth_interval 2) and backed off at step 5.
        assert run["straight"]["skipped"] == len(OVERFLOW_STEPS), f"rank {rank}"
        assert run["straight"]["scale"] == 2.0**9, f"rank {rank}"
    # Each rank holds its own half.
    assert not torch.equal(results[0][config]["straight"]["param0"],
                           results[1][config]["straight"]["param0"])


@pytest.mark.parametrize("config", CONFIGS)
def test_dcp_checkpoint_of_two_ranks_resumes_on_one(two_ranks, one_rank, config):
    """DCP reshards the two-rank checkpoint onto one rank; the run continues to the same whole
    params, moments, masters and scale as the two ranks reached."""
    checkpoint_root, results = two_ranks
    torch.set_num_threads(1)
    model, optimizer, scaler = _build(config)
    _resume(str(checkpoint_root / config), model, optimizer, scaler)
    _train(model, optimizer, scaler, range(SAVE_AFTER, STEPS))
    _assert_same(_snapshot(model, optimizer, scaler, _whole), results[0][config]["whole"],
                 f"{config}, one rank vs two")
