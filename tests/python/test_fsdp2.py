"""The fused optimizers, GradScaler and multi_tensor_l2norm under FSDP2 (fully_shard): two CPU
processes (gloo), a bf16 model whose params, grads and optimizer state are DTensors sharded on
dim 0 (the 7-row layer is sharded unevenly, 4 + 3 rows).

Every rank trains on the same batches, so FSDP2's averaged gradients are the single-process
gradients and a sharded run must equal an unsharded single-process run of the same optimizer to
fp32 rounding: the ops run on each rank's local shards with no gather.
"""

import ampfuse
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import raises_naming
from ranks import run_on_ranks
from torch import nn

WORLD_SIZE = 2
STEPS = 4
TIMEOUT_S = 60


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 7)).to(torch.bfloat16)


def _batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(8, 16, generator=generator).to(torch.bfloat16)
    return inputs, torch.randn(8, 7, generator=generator)


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _full(t):
    """The whole tensor of a DTensor (an all-gather; test only), or t itself. int16 (split's
    low halves) is gathered as int32: neither gloo nor NCCL all-gathers int16."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.dtype == torch.int16:
        return t.to(torch.int32).full_tensor().to(torch.int16)
    if t.dtype == torch.float8_e4m3fn:  # gloo gathers bytes, not float8: gather their bits
        from torch.distributed.tensor import DTensor

        bits = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
        return bits.full_tensor().view(torch.float8_e4m3fn)
    return t.full_tensor()


OPTIMIZERS = {
    "FusedAdamW": lambda params: ampfuse.optimizers.FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, master_weights=True
    ),
    "FusedSGD": lambda params: ampfuse.optimizers.FusedSGD(
        params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, master_weights=True
    ),
    # bf16 without masters: the update is rounded to bf16 directly.
    "FusedAdam (no masters)": lambda params: ampfuse.optimizers.FusedAdam(
        params, lr=1e-2, amsgrad=True, master_weights=False
    ),
    # The master-free bf16 modes keep their state (int16 low halves, bf16 compensations) as
    # DTensors sharded like the params; the ops run on the local shards.
    "FusedAdamW (no masters, split)": lambda params: ampfuse.optimizers.FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, master_weights="split"
    ),
    "FusedSGD (no masters, kahan)": lambda params: ampfuse.optimizers.FusedSGD(
        params, lr=1e-2, momentum=0.9, weight_decay=0.1, master_weights="kahan"
    ),
    # Not element-wise: each trust ratio takes norms summed over the shards (ampfuse.ops.dtensor),
    # and the global grad norm clips (max_grad_norm=0.5 is below it here).
    "FusedLAMB": lambda params: ampfuse.optimizers.FusedLAMB(
        params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, master_weights=True
    ),
    # Both of its passes read the master that each shard's params and low halves make up.
    "FusedLAMB (no masters, split)": lambda params: ampfuse.optimizers.FusedLAMB(
        params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, master_weights="split"
    ),
    "FusedAdagrad": lambda params: ampfuse.optimizers.FusedAdagrad(
        params, lr=1e-2, lr_decay=0.01, weight_decay=0.1, master_weights=True
    ),
    # Not element-wise either: each param's grad norm (L2: sums of squares added over the
    # shards; max norm: maxima over the shards) blends into its running norm.
    "FusedNovoGrad": lambda params: ampfuse.optimizers.FusedNovoGrad(
        params, lr=1e-2, weight_decay=0.1, master_weights=True
    ),
    "FusedNovoGrad (max norm)": lambda params: ampfuse.optimizers.FusedNovoGrad(
        params, lr=1e-2, weight_decay=0.1, norm_type=0, reg_inside_moment=True,
        master_weights=True
    ),
    # Its second pass reads the master that each shard's params and low halves make up.
    "FusedNovoGrad (no masters, split)": lambda params: ampfuse.optimizers.FusedNovoGrad(
        params, lr=1e-2, weight_decay=0.1, master_weights="split"
    ),
    # 8-bit moments: each rank codes its shards in blocks of its own. The 32 x 16 weight's two
    # shards are one block each, the blocks of the unsharded weight, so the runs are equal; the
    # 7 x 32 weight and the biases are under one block and keep fp32 moments.
    "FusedAdamW (int8 moments)": lambda params: ampfuse.optimizers.FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, master_weights=True, state_dtype="int8"
    ),
    "FusedAdamW (no masters, split, fp8 moments)": lambda params: ampfuse.optimizers.FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, master_weights="split", state_dtype="fp8",
        amsgrad=True
    ),
    # LAMB's coded step runs the op's two halves on each rank's shards, with the sums added over
    # the shards between them (FusedLAMB._launch_coded).
    "FusedLAMB (int8 moments)": lambda params: ampfuse.optimizers.FusedLAMB(
        params, lr=1e-2, weight_decay=0.1, master_weights=True, state_dtype="int8"
    ),
    "FusedLAMB (no masters, split, fp8 moments)": lambda params: ampfuse.optimizers.FusedLAMB(
        params, lr=1e-2, weight_decay=0.1, master_weights="split", state_dtype="fp8"
    ),
}


def _train(optimizer_name, sharded):
    """STEPS steps; returns the whole params, state and first-step grad norms."""
    model = _model()
    if sharded:
        _shard(model)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    norms = None
    for step in range(STEPS):
        inputs, targets = _batch(step)
        F.mse_loss(model(inputs).float(), targets).backward()
        if norms is None:
            total, per_tensor = ampfuse.multi_tensor_l2norm(
                [p.grad for p in model.parameters()], per_tensor=True
            )
            norms = (_full(total), _full(per_tensor))
        optimizer.step()
        optimizer.zero_grad()
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    if sharded:
        for p, state in zip(params, states):
            for key, value in state.items():
                # The step count and NovoGrad's running norm are one value per param, the same
                # on every rank: plain tensors, as torch.optim keeps 'step' under FSDP2.
                if key in ("step", "norm_avg"):
                    assert type(value) is torch.Tensor and value.numel() == 1, key
                else:
                    assert type(value) is type(p) and value.placements == p.placements, key
    return {
        "params": [_full(p.detach()) for p in params],
        "state": [{k: _full(v) for k, v in state.items()} for state in states],
        "norms": norms,
    }


def _mixed_precision_policy_run(optimizer_factory):
    """An fp32 model under FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 sharded params and
    reduced grads); returns the whole params and first moments after STEPS steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 7))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=policy)
    optimizer = optimizer_factory(model.parameters())
    for step in range(STEPS):
        inputs, targets = _batch(step)
        F.mse_loss(model(inputs.float()).float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = list(model.parameters())
    return [_full(p.detach()) for p in params] + [
        _full(optimizer.state[p]["exp_avg"]) for p in params
    ]


def _scaler_skips(all_reduce_found_inf):
    """At step 1 only rank 1's shard of one grad overflows (what sharded grads look like to
    the scaler: the reduce-scatter gives the inf to one rank only). Returns, per step, whether
    this rank's params and state were left unchanged, and the scales."""
    rank = dist.get_rank()
    model = _shard(_model())
    optimizer = OPTIMIZERS["FusedAdamW"](model.parameters())
    scaler = ampfuse.GradScaler(
        "cpu", init_scale=2.0**10, all_reduce_found_inf=all_reduce_found_inf
    )
    unchanged, scales = [], []
    for step in range(3):
        inputs, targets = _batch(step)
        scaler.scale(F.mse_loss(model(inputs).float(), targets)).backward()
        if step == 1 and rank == 1:
            next(iter(model.parameters())).grad.to_local()[0, 0] = float("inf")
        before = [_local(p).clone() for p in model.parameters()] + [
            _local(v).clone() for p in model.parameters() for v in optimizer.state[p].values()
        ]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after = [_local(p) for p in model.parameters()] + [
            _local(v) for p in model.parameters() for v in optimizer.state[p].values()
        ]
        unchanged.append(
            len(before) == len(after) and all(torch.equal(b, a) for b, a in zip(before, after))
        )
        scales.append(scaler.get_scale())
    return {"unchanged": unchanged, "scales": scales}


def _attribution():
    """One step in which rank 1's shard of 0.weight's grad holds an inf and rank 0's shard of
    2.bias's grad a nan: each rank's kernels see only their own, and the DTensor rule OR-reduces
    the per-tensor flags, so both ranks must name both tensors."""
    model = _shard(_model())
    optimizer = OPTIMIZERS["FusedAdamW"](model.parameters())
    scaler = ampfuse.GradScaler("cpu", attribute_overflow=True)
    scaler.name_parameters(model)
    inputs, targets = _batch(0)
    scaler.scale(F.mse_loss(model(inputs).float(), targets)).backward()
    if dist.get_rank() == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    else:
        model[2].bias.grad.to_local()[0] = float("nan")
    scaler.step(optimizer)
    scaler.update()
    report = scaler.last_overflow()
    return report.param_names, report.kinds


def _assert_fp32_close(actual, expected, what, rtol=4e-7):
    # fp32 rounding: a few ulps of the values (more where the order of operations differs).
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=rtol, atol=1e-7, msg=lambda m: f"{what}: {m}"
    )


def _checkpoint_round_trip(name="FusedAdamW"):
    """torch.distributed.checkpoint's optimizer state dict of a stepped optimizer `name`,
    loaded into a fresh one: returns the saved state's types and whether every local shard
    came back."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = _shard(_model())
    optimizer = OPTIMIZERS[name](model.parameters())
    inputs, targets = _batch(0)
    F.mse_loss(model(inputs).float(), targets).backward()
    optimizer.step()
    saved = get_optimizer_state_dict(model, optimizer)
    loaded = OPTIMIZERS[name](model.parameters())
    set_optimizer_state_dict(model, loaded, saved)
    same = all(
        torch.equal(_bytes(_local(value)), _bytes(_local(loaded.state[p][key])))
        for p in model.parameters()
        for key, value in optimizer.state[p].items()
    )
    types = {key: type(value).__name__ for key, value in saved["state"]["0.weight"].items()}
    return {"types": types, "same": same}


def _master_follows_loaded_weights():
    """model.load_state_dict on the sharded model after some steps, then a step with lr 0: the
    masters must follow the loaded params rather than write the old weights back."""
    model = _shard(_model())
    optimizer = OPTIMIZERS["FusedAdamW"](model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step in range(3):
        if step == 2:
            model.load_state_dict(initial)
            for group in optimizer.param_groups:
                group["lr"] = 0.0
        inputs, targets = _batch(step)
        F.mse_loss(model(inputs).float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model[0].weight
    return torch.equal(
        _local(optimizer.state[weight]["master_param"]), _local(initial["0.weight"]).float()
    ) and torch.equal(_local(weight), _local(initial["0.weight"]))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t):
    """One-byte codes compared as bytes (torch.equal has no float8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _split_full_state_dict():
    """master_weights="split" under FSDP2 through torch's full (unsharded) optimizer state dict:
    the int16 low halves must be gathered (as int32: no backend gathers int16), come back as the
    live values, load into a fresh optimizer's shards, and the next steps must equal the
    uninterrupted run's."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    make = OPTIMIZERS["FusedAdamW (no masters, split)"]

    def steps(model, optimizer, which):
        for step in which:
            inputs, targets = _batch(step)
            F.mse_loss(model(inputs).float(), targets).backward()
            optimizer.step()
            optimizer.zero_grad()

    model = _shard(_model())
    optimizer = make(model.parameters())
    steps(model, optimizer, range(2))
    saved = get_optimizer_state_dict(model, optimizer, options=full)
    low = saved["state"]["0.weight"]["master_low_bits"]
    live = _full(optimizer.state[model[0].weight]["master_low_bits"])
    resumed_model = _shard(_model())
    resumed_model.load_state_dict(model.state_dict())
    resumed = make(resumed_model.parameters())
    set_optimizer_state_dict(resumed_model, resumed, saved, options=full)
    loaded = resumed.state[resumed_model[0].weight]["master_low_bits"]
    result = {
        "saved": (type(low).__name__, low.dtype, tuple(low.shape)),
        "saved_values_live": torch.equal(low.to(torch.int16), live),
        "loaded": (type(loaded).__name__, loaded.dtype),
        "loaded_values": torch.equal(_local(loaded), _local(
            optimizer.state[model[0].weight]["master_low_bits"])),
    }
    steps(model, optimizer, range(2, 4))
    steps(resumed_model, resumed, range(2, 4))
    result["same_after"] = all(torch.equal(_local(p), _local(q)) for p, q in
                               zip(model.parameters(), resumed_model.parameters()))
    return result


def _split_old_layout_loads():
    """A sharded split checkpoint of the old layout (param truncated toward zero, no
    'master_low_bits_layout'; its low halves are the master's low 16 bits, as layout 2's) loads
    into a fresh optimizer and converts on each rank's shards at the next step: the masters
    exactly, the params rounded (split_halves)."""
    from ampfuse.optimizers._precision import SPLIT_LAYOUT_KEY, precise_value, split_halves

    make = OPTIMIZERS["FusedAdamW (no masters, split)"]
    model = _shard(_model())
    optimizer = make(model.parameters())
    for step in range(2):
        inputs, targets = _batch(step)
        F.mse_loss(model(inputs).float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = [_local(precise_value(p, optimizer.state[p])).clone() for p in model.parameters()]
    saved = optimizer.state_dict()
    with torch.no_grad():
        for p, master in zip(model.parameters(), masters):
            _local(p).view(torch.int16).copy_((master.view(torch.int32) >> 16).to(torch.int16))
    for entry in saved["state"].values():
        del entry[SPLIT_LAYOUT_KEY]
    resumed = make(model.parameters())
    resumed.load_state_dict(saved)
    for group in resumed.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    resumed.step()
    exact = all(torch.equal(_local(precise_value(p, resumed.state[p])).view(torch.int32),
                            master.view(torch.int32))
                for p, master in zip(model.parameters(), masters))
    rounded = all(torch.equal(_local(p).view(torch.int16), split_halves(master)[0])
                  for p, master in zip(model.parameters(), masters))
    return {"masters_exact": exact, "params_rounded": rounded}


def _all_scenarios():
    """Everything the tests check, in one pair of processes (a spawn costs seconds)."""
    return {
        "train": {name: _train(name, sharded=True) for name in OPTIMIZERS},
        # The reference in the same process (same threads, same kernels), with no FSDP2.
        "reference": {name: _train(name, sharded=False) for name in OPTIMIZERS},
        "scaler": {flag: _scaler_skips(flag) for flag in (True, False)},
        "checkpoint": _checkpoint_round_trip(),
        "checkpoint_coded": _checkpoint_round_trip("FusedAdamW (int8 moments)"),
        "split_full_state_dict": _split_full_state_dict(),
        "split_old_layout": _split_old_layout_loads(),
        "master_follows": _master_follows_loaded_weights(),
        "attribution": _attribution(),
        "mixed_precision": [
            _mixed_precision_policy_run(
                lambda params: ampfuse.optimizers.FusedAdamW(params, lr=1e-2, weight_decay=0.1)
            ),
            _mixed_precision_policy_run(
                lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
            ),
        ],
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(_all_scenarios, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S,
                        out_dir=tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_master_weights_step_equals_single_process(ranks, optimizer_name):
    for rank, ranks_results in enumerate(ranks):
        result = ranks_results["train"][optimizer_name]
        reference = ranks_results["reference"][optimizer_name]
        for i, (p, q) in enumerate(zip(result["params"], reference["params"])):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, q), f"rank {rank}: param {i} differs from the reference"
        for i, (state, expected) in enumerate(zip(result["state"], reference["state"])):
            assert sorted(state) == sorted(expected)
            assert ("master_param" in state) == ("no masters" not in optimizer_name)
            for key in state:
                _assert_fp32_close(state[key], expected[key], f"rank {rank} state {i} {key}")
        # Training moved the params.
        assert not torch.equal(reference["params"][0], _model()[0].weight.detach())


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_l2norm_of_sharded_grads_is_the_global_norm(ranks, optimizer_name):
    for rank, ranks_results in enumerate(ranks):
        total, per_tensor = ranks_results["train"][optimizer_name]["norms"]
        reference = ranks_results["reference"][optimizer_name]["norms"]
        assert per_tensor.shape == (4,)
        _assert_fp32_close(total, reference[0], f"rank {rank} global grad norm")
        _assert_fp32_close(per_tensor, reference[1], f"rank {rank} per-tensor norms")


@pytest.mark.parametrize("all_reduce_found_inf", [False, True])
def test_fsdp2_grad_scaler_overflow_on_one_rank_skips_on_both(ranks, all_reduce_found_inf):
    """The unscale of DTensor grads reduces the overflow flag over the mesh, as torch's
    GradScaler does for FSDP2, so no option is needed for the ranks to skip together (the
    option's own all-reduce is then redundant but harmless)."""
    for rank, ranks_results in enumerate(ranks):
        result = ranks_results["scaler"][all_reduce_found_inf]
        assert result["unchanged"] == [False, True, False], f"rank {rank}"
        assert result["scales"] == [2.0**10, 2.0**9, 2.0**9], f"rank {rank}"


def test_fsdp2_overflow_attribution_names_the_same_tensors_on_every_rank(ranks):
    for rank, ranks_results in enumerate(ranks):
        assert ranks_results["attribution"] == (["0.weight", "2.bias"], ["inf", "nan"]), rank


def test_fsdp2_optimizer_state_dict_round_trips_through_distributed_checkpoint(ranks):
    for rank, ranks_results in enumerate(ranks):
        result = ranks_results["checkpoint"]
        assert result["types"] == {
            "step": "Tensor",
            "exp_avg": "DTensor",
            "exp_avg_sq": "DTensor",
            "master_param": "DTensor",
        }, f"rank {rank}"
        assert result["same"], f"rank {rank}"


def test_fsdp2_coded_moments_round_trip_through_distributed_checkpoint(ranks):
    # 8-bit moments: codes sharded like the param, scales as an evenly sharded DTensor (each
    # rank's blocks), both saved and loaded shard for shard.
    for rank, ranks_results in enumerate(ranks):
        result = ranks_results["checkpoint_coded"]
        assert result["types"] == {
            "step": "Tensor",
            "exp_avg_codes": "DTensor",
            "exp_avg_scales": "DTensor",
            "exp_avg_sq_codes": "DTensor",
            "exp_avg_sq_scales": "DTensor",
            "master_param": "DTensor",
        }, f"rank {rank}"
        assert result["same"], f"rank {rank}"


def test_fsdp2_split_low_halves_go_through_a_full_optimizer_state_dict(ranks):
    """gloo and NCCL cannot all-gather int16; state_dict() gives sharded low halves as int32."""
    for rank, ranks_results in enumerate(ranks):
        result = ranks_results["split_full_state_dict"]
        assert result == {
            "saved": ("Tensor", torch.int32, (32, 16)),
            "saved_values_live": True,
            "loaded": ("DTensor", torch.int16),
            "loaded_values": True,
            "same_after": True,
        }, f"rank {rank}"


def test_fsdp2_old_split_checkpoints_convert_on_each_shard(ranks):
    for rank, ranks_results in enumerate(ranks):
        assert ranks_results["split_old_layout"] == {"masters_exact": True,
                                                     "params_rounded": True}, f"rank {rank}"


@pytest.fixture
def mesh(one_rank):
    """A one-rank CPU device mesh in this process."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_dtensors_whose_shards_do_not_line_up_are_refused(mesh):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    flag, one = torch.zeros(()), torch.ones(())
    src = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    dst = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)])
    with raises_naming(r"dst\[0\] is sharded as", "sharded alike"):
        ampfuse.multi_tensor_scale_([src], [dst], one, flag)
    with raises_naming(r"dst\[0\] is a plain tensor but src\[0\] is a DTensor"):
        ampfuse.multi_tensor_scale_([src], [torch.zeros(4, 4)], one, flag)
    pending = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with raises_naming(r"grads\[0\].*Partial", "redistribute"):
        ampfuse.multi_tensor_unscale_([pending], flag, one)
    with raises_naming(r"tensors\[1\] is a plain tensor among DTensors"):
        ampfuse.multi_tensor_l2norm([src, torch.ones(3)])
    assert torch.equal(dst.to_local(), torch.zeros(4, 4)) and flag.item() == 0


def test_fsdp2_masters_follow_model_load_state_dict(ranks):
    assert [r["master_follows"] for r in ranks] == [True, True]


def test_fsdp2_mixed_precision_policy_matches_torch_fused_adamw(ranks):
    """Against torch's own fused AdamW on the same FSDP2 model: fp32 rounding apart."""
    for rank, ranks_results in enumerate(ranks):
        ours, torchs = ranks_results["mixed_precision"]
        for i, (a, b) in enumerate(zip(ours, torchs)):
            _assert_fp32_close(a, b, f"rank {rank} tensor {i}", rtol=1e-6)
