"""amp with DistributedDataParallel: two CPU processes (gloo), O2 bf16 with dynamic scaling.

The documented order is amp.initialize first, then wrap the model it returns:

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    model = DistributedDataParallel(model)

Each rank trains on its own data; DDP averages the gradients, so the params must stay identical
across ranks. An overflow injected on rank 1 only (its loss times inf, what an fp16 overflow in
its backward looks like) reaches rank 0 through the gradient all-reduce: both ranks skip the
step and back the scale off together.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from amp_models import TinyMLP, assert_same_snapshot, make_model, make_optimizer, snapshot
from ampfuse import amp
from helpers import raises_naming
from ranks import run_on_ranks
from torch.nn.parallel import DistributedDataParallel

WORLD_SIZE = 2
STEPS = 12
OVERFLOW_STEP = 6
OPTIMIZERS = ("FusedAdam", "AdamW")
TIMEOUT_S = 90


def _train_rank(rank, optimizer_name):
    model, batches = make_model("mlp", seed=0)  # the same initial weights on every rank
    optimizer = make_optimizer(optimizer_name, model.parameters())
    # bf16 trains unscaled by default; the dynamic scale is what must move together here.
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=1,
                                      loss_scale="dynamic")
    ddp_model = DistributedDataParallel(model)
    initial = snapshot(model, optimizer, amp)
    scales, skipped_unchanged = [], None
    for step in range(STEPS):
        inputs, targets = batches(step, seed=100 + rank)  # each rank its own data
        loss = F.cross_entropy(ddp_model(inputs), targets)
        if step == OVERFLOW_STEP and rank == 1:
            loss = loss * float("inf")
        before = snapshot(model, optimizer, amp) if step == OVERFLOW_STEP else None
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if before is not None:
            try:
                assert_same_snapshot(snapshot(model, optimizer, amp), before, f"rank {rank}")
                skipped_unchanged = True
            except AssertionError as error:
                skipped_unchanged = str(error)
        scales.append(amp.state_dict(optimizer)["loss_scaler0"]["scale"])
    return {
        "initial": initial,
        "final": snapshot(model, optimizer, amp),
        "scales": scales,
        "skipped": amp.skipped_steps(optimizer),
        "skipped_unchanged": skipped_unchanged,
        "param_dtypes": [p.dtype for p in model.parameters()],
    }


def _each_optimizer(train):
    rank = dist.get_rank()
    return {name: train(rank, name) for name in OPTIMIZERS}


def _run_ranks(train, tmp_path):
    """Runs train(rank, optimizer name) for every optimizer on WORLD_SIZE processes; returns
    each rank's results."""
    return run_on_ranks(_each_optimizer, train, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S,
                        out_dir=tmp_path)


def test_ddp_two_ranks_stay_identical_and_skip_together(tmp_path):
    ranks = _run_ranks(_train_rank, tmp_path)
    for name in OPTIMIZERS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["param_dtypes"] == [torch.bfloat16] * 4
        # Training moved the params, identically on both ranks.
        assert not torch.equal(r0["final"]["master[0]"], r0["initial"]["master[0]"])
        assert_same_snapshot(r1["final"], r0["final"], f"{name}: rank 1 vs rank 0")
        for r, result in enumerate((r0, r1)):
            assert result["skipped_unchanged"] is True, (
                f"{name}: the overflowing step changed rank {r}: {result['skipped_unchanged']}"
            )
            assert result["skipped"] == 1, f"{name}: rank {r}"
            expected = [2.0**16] * OVERFLOW_STEP + [2.0**15] * (STEPS - OVERFLOW_STEP)
            assert result["scales"] == expected, f"{name}: rank {r}"


def test_initialize_after_ddp_wrapping_is_an_error(one_rank):
    """amp.initialize on a model already wrapped in DistributedDataParallel names the fix."""
    model = TinyMLP()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    with raises_naming("DistributedDataParallel", "amp.initialize"):
        amp.initialize(DistributedDataParallel(model), optimizer, opt_level="O2")
    assert model.fc1.weight.dtype == torch.float32


def _local_grads_rank(rank, optimizer_name):
    """Each rank steps on its own gradients, never all-reduced (what sharded gradients or
    DDP's no_sync look like to amp); at step 2 only rank 1 overflows. Only an all-reduced
    overflow flag makes rank 0 skip that step too and keep the same loss scale."""
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      all_reduce_found_inf=True, loss_scale="dynamic")
    scales = []
    for step in range(4):
        inputs, targets = batches(step, seed=100 + rank)
        loss = F.cross_entropy(model(inputs), targets)
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        scales.append(amp.state_dict(optimizer)["loss_scaler0"]["scale"])
    return {"scales": scales, "skipped": amp.skipped_steps(optimizer)}


def test_overflow_on_one_rank_skips_on_every_rank_with_all_reduce_found_inf(tmp_path):
    ranks = _run_ranks(_local_grads_rank, tmp_path)
    for name in OPTIMIZERS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["skipped"] == r1["skipped"] == 1, name
        assert r0["scales"] == r1["scales"] == [2.0**16] * 2 + [2.0**15] * 2, name


ACCUMULATION_VARIANTS = {
    # apex's recipe: the no_sync micro-batch keeps its grads scaled (delay_unscale=True), so
    # the synced backward all-reduces them, an inf included.
    "FusedAdam, delay_unscale": ("FusedAdam", True, False),
    "AdamW, delay_unscale": ("AdamW", True, False),
    # A fused optimizer keeps the grads scaled until its step whatever delay_unscale says; the
    # inf the later checks see again is counted once.
    "FusedAdam": ("FusedAdam", False, False),
    # The all-reduced flag makes every rank see the overflow at once.
    "FusedAdam, all_reduce_found_inf": ("FusedAdam", False, True),
}


def _no_sync_rank(rank, variant):
    """Two micro-batches per step, the first under DDP's no_sync; at step 2 only rank 1's first
    micro-batch overflows. The overflow reaches rank 0 through the second micro-batch's
    all-reduce, so both ranks skip that step and stay identical."""
    optimizer_name, delay_unscale, all_reduce = ACCUMULATION_VARIANTS[variant]
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      loss_scale="dynamic", all_reduce_found_inf=all_reduce)
    ddp_model = DistributedDataParallel(model)
    scales = []
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):
            inputs, targets = batches(2 * step + micro, seed=100 + rank)
            synced = micro == 1
            with contextlib.nullcontext() if synced else ddp_model.no_sync():
                loss = F.cross_entropy(ddp_model(inputs), targets)
                if step == 2 and rank == 1 and not synced:
                    loss = loss * float("inf")
                with amp.scale_loss(loss, optimizer,
                                    delay_unscale=delay_unscale and not synced) as scaled_loss:
                    scaled_loss.backward()
        optimizer.step()
        scales.append(amp.state_dict(optimizer)["loss_scaler0"]["scale"])
    return {"final": snapshot(model, optimizer, amp), "scales": scales,
            "skipped": amp.skipped_steps(optimizer)}


def _no_sync_scenarios():
    rank = dist.get_rank()
    results = {variant: _no_sync_rank(rank, variant) for variant in ACCUMULATION_VARIANTS}
    results["refusal"] = {level: _unsynced_unscale_rank(rank, level) for level in ("O1", "O2")}
    return results


def test_no_sync_accumulation_with_an_overflow_on_one_rank_keeps_ranks_identical(tmp_path):
    r0, r1 = run_on_ranks(_no_sync_scenarios, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S,
                          out_dir=tmp_path)
    for variant in ACCUMULATION_VARIANTS:
        assert r0[variant]["skipped"] == r1[variant]["skipped"] == 1, variant
        assert r0[variant]["scales"] == r1[variant]["scales"] == [2.0**16] * 2 + [2.0**15] * 2
        assert_same_snapshot(r1[variant]["final"], r0[variant]["final"], f"{variant}: rank 1")
    # Where ranks would drift apart silently, amp refuses (_unsynced_unscale_rank).
    assert r0["refusal"] == r1["refusal"] == {level: {"refused": True} for level in ("O1", "O2")}


def _unsynced_unscale_rank(rank, opt_level):
    """A torch.optim optimizer unscales on scale_loss's exit, at O2 into its fp32 masters, at O1
    in place and then into amp's stash for the next backward: both out of reach of DDP's
    all-reduce. Under no_sync, without delay_unscale, amp refuses."""
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer("AdamW", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    ddp_model = DistributedDataParallel(model)
    inputs, targets = batches(0, seed=100 + rank)
    with ddp_model.no_sync():
        loss = F.cross_entropy(ddp_model(inputs), targets)
        with raises_naming("no_sync", "delay_unscale=True"):  # noqa: SIM117 (the order matters)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
    # The grads were left as they were (scaled, in .grad) and the synced forward is accepted.
    assert all(p.grad is not None for p in model.parameters())
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(inputs), targets)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    return {"refused": True}
