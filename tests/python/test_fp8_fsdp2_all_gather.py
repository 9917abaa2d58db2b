"""CurrentScaling(fsdp_fp8_all_gather=True) under FSDP2's fully_shard on CPU processes (gloo):
each rank casts its shard to FP8 with the whole weight's scale, FSDP2 all-gathers the 1-byte
codes, and the layer trains bit for bit like FSDP2's all-gather of the bf16 weight, and like
the unsharded FP8 layer: on an even split (2 ranks), an uneven one (5 ranks: 16 rows split
4/4/4/4/0, 32 rows 7/7/7/7/4, so FSDP2 pads, and one rank holds no row), an fp32 model under
MixedPrecisionPolicy(param_dtype=
bf16), gradients accumulated unsharded over the micro-batches (no gradient sync but the
last), a model made on the meta device, sharded, to_empty and loaded from a full state dict,
and one fully_shard unit holding both Linears. DDP with the option trains like without it."""

import itertools
from typing import NamedTuple

import ampfuse
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ampfuse import fp8
from ampfuse.fp8.fsdp_all_gather import FP8AllGatherWeight
from ranks import run_on_ranks
from torch import nn

STEPS = 2
MICRO_BATCHES = 2
TIMEOUT_S = 90
FEATURES = (32, 16, 32)  # Linear(32, 16), ReLU, Linear(16, 32)


class Case(NamedTuple):
    world_size: int = 2
    dtype: torch.dtype = torch.bfloat16
    param_dtype: torch.dtype | None = None  # FSDP2's MixedPrecisionPolicy
    sync_each_micro_batch: bool = True
    on_meta: bool = False  # made on the meta device, then to_empty and a full state dict
    each_layer: bool = True  # fully_shard on each Linear, else on the model only
    device: str = "cpu"  # "cuda": NCCL, one rank per GPU


CASES = {
    "even": Case(),
    "uneven": Case(world_size=5),  # 16 rows in chunks of 4: the 5th rank holds none
    "mixed_precision": Case(dtype=torch.float32, param_dtype=torch.bfloat16),
    "no_sync": Case(sync_each_micro_batch=False),
    "meta_init": Case(on_meta=True),
    "root_only": Case(each_layer=False),  # both Linears in one all-gather
    "one_gpu": Case(world_size=1, device="cuda"),  # NCCL and CUDA streams
    "one_rank": Case(world_size=1),  # FSDP2 calls the hooks but skips the collective
}


def _model(all_gather_fp8, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES[0], FEATURES[1]), nn.ReLU(),
                          nn.Linear(FEATURES[1], FEATURES[2])).to(dtype)
    fp8.convert(model, fp8.CurrentScaling(fsdp_fp8_all_gather=all_gather_fp8), min_features=0)
    return model


def _batch(step, micro):
    generator = torch.Generator().manual_seed(100 + 10 * step + micro)
    return (torch.randn(16, FEATURES[0], generator=generator).to(torch.bfloat16),
            torch.randn(16, FEATURES[2], generator=generator))


def _train(model, sync_each_micro_batch=True, device="cpu"):
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                              master_weights=True)
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            inputs, targets = (t.to(device) for t in _batch(step, micro))
            if not sync_each_micro_batch:
                model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
            loss = F.mse_loss(model(inputs).float(), targets)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses)


def _codes_bytes(case):
    """Bytes of the codes each rank's pre-all-gather hook returns, per Linear."""
    return {-(-n // case.world_size) * k for k, n in itertools.pairwise(FEATURES)}


def _expected_all_gather_bytes(case, weight_bytes):
    """Bytes each rank puts into one all-gather: per Linear its padded weight shard at
    `weight_bytes` an element and its padded bias shard at 2 (bf16); one all-gather per Linear,
    or one of both."""
    sizes = []
    for k, n in itertools.pairwise(FEATURES):
        rows = -(-n // case.world_size)
        sizes.append(rows * k * weight_bytes + rows * 2)
    return set(sizes) if case.each_layer else {sum(sizes)}


def _train_sharded(all_gather_fp8, case):
    """Losses, full state and the bytes of each all-gather this rank sent."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    case = CASES[case]
    policy = MixedPrecisionPolicy(param_dtype=case.param_dtype)

    sent = []
    all_gather = dist.all_gather_into_tensor

    def recording_all_gather(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return all_gather(output, input, *args, **kwargs)

    with torch.device("meta" if case.on_meta else case.device):
        model = _model(all_gather_fp8, case.dtype)
    for module in (model[0], model[2], model) if case.each_layer else (model,):
        fully_shard(module, mp_policy=policy)
    if case.on_meta:
        model.to_empty(device=case.device)
        set_model_state_dict(model, _model(all_gather_fp8, case.dtype).state_dict(),
                             options=StateDictOptions(full_state_dict=True))
    local = model[0].weight.to_local()
    assert isinstance(local, FP8AllGatherWeight) == all_gather_fp8, type(local)
    dist.all_gather_into_tensor = recording_all_gather
    try:
        losses = _train(model, case.sync_each_micro_batch, case.device)
    finally:
        dist.all_gather_into_tensor = all_gather
    # torch.distributed.checkpoint's view of the model: plain local tensors; loading it back
    # keeps the weight's all-gather, and the model computes as before.
    state = get_model_state_dict(model)
    local_types = {type(v.to_local()) for v in state.values()}
    set_model_state_dict(model, state)
    assert isinstance(model[0].weight.to_local(), FP8AllGatherWeight) == all_gather_fp8
    model.load_state_dict(state, assign=True)  # new DTensors of plain local tensors
    assert isinstance(model[0].weight.to_local(), FP8AllGatherWeight) == all_gather_fp8
    inputs, targets = (t.to(case.device) for t in _batch(STEPS, 0))
    before = len(sent)
    dist.all_gather_into_tensor = recording_all_gather
    try:
        losses = torch.cat([losses, F.mse_loss(model(inputs).float(), targets).detach()[None]])
    finally:
        dist.all_gather_into_tensor = all_gather
    # The loaded model all-gathers (the sizes are checked with all).
    assert len(sent) > before or case.world_size == 1
    return {"losses": losses, "state": {k: v.full_tensor() for k, v in state.items()},
            "sent": sent, "local_types": local_types}


def _count_hook_calls():
    """Records the bytes each call of the pre-all-gather hook returns (with FSDP2's signature:
    FSDP2 checks it). FSDP2 calls the hook on one rank too, where it skips the collective."""
    calls = []
    hook = FP8AllGatherWeight.fsdp_pre_all_gather

    def counting_hook(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = hook(self, mesh, outer_size, outer_stride, module, mp_policy)
        calls.append(sum(t.numel() * t.element_size() for t in inputs))
        return inputs, metadata

    FP8AllGatherWeight.fsdp_pre_all_gather = counting_hook
    return calls


def _both_all_gathers(case):
    """_train_sharded without and with the option, and the bytes each hook call returned."""
    hook_calls = _count_hook_calls()
    results = {}
    for flag in (False, True):
        hook_calls.clear()
        results[flag] = {**_train_sharded(flag, case), "hooked": list(hook_calls)}
    return results


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.cuda)
                                  if case.device == "cuda" else name
                                  for name, case in CASES.items()])
def test_fp8_all_gather_trains_like_bf16_all_gather(tmp_path, case):
    world_size, dtype, device = CASES[case].world_size, CASES[case].dtype, CASES[case].device
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8.Linear's GEMMs need compute capability 8.9 or newer")
    ranks = run_on_ranks(_both_all_gathers, case, world_size=world_size, timeout_s=TIMEOUT_S,
                         out_dir=tmp_path, backend="nccl" if device == "cuda" else "gloo")
    reference = _model(False, dtype)
    expected_losses = _train(reference)
    expected_state = reference.state_dict()
    for result in ranks:
        fp8_gather, bf16_gather = result[True], result[False]
        # The gathered codes and scale are those the bf16 all-gather's forward makes: the two
        # sharded runs agree bit for bit.
        assert torch.equal(fp8_gather["losses"], bf16_gather["losses"])
        for name, value in fp8_gather["state"].items():
            assert torch.equal(value, bf16_gather["state"][name]), name
        # The hook made the FP8 codes, 1 byte an element; each all-gather moved them and the
        # bf16 bias (the weight at 2 bytes without the option). One rank gathers nothing.
        assert set(fp8_gather["hooked"]) == _codes_bytes(CASES[case])
        assert bf16_gather["hooked"] == []
        assert len(fp8_gather["sent"]) == len(bf16_gather["sent"])
        if world_size > 1:
            assert set(fp8_gather["sent"]) == _expected_all_gather_bytes(CASES[case], 1)
            assert set(bf16_gather["sent"]) == _expected_all_gather_bytes(CASES[case], 2)
        # A checkpoint of the sharded model holds plain local tensors.
        assert fp8_gather["local_types"] == {torch.Tensor}
        # And both train like the unsharded FP8 model (a bf16 one: the fp32 model under FSDP2's
        # bf16 policy computes from bf16 copies the unsharded one does not make): the same
        # losses; on 2 ranks params the same bits or one bf16 rounding apart (as
        # test_fp8_fsdp2). On 5 ranks FSDP2's averaged bf16 gradient (a sum of 5 divided by 5)
        # rounds apart from the single-process one, with or without the option, so there the
        # bit-exact match above is the check.
        # (On a GPU, cuBLASLt's GEMMs sum in another order than the CPU reference.)
        if dtype == torch.bfloat16 and device == "cpu":
            torch.testing.assert_close(fp8_gather["losses"][:-1], expected_losses, rtol=1e-6,
                                       atol=1e-7)
        if dtype == torch.bfloat16 and device == "cpu" and world_size == 2:
            for name, want in expected_state.items():
                torch.testing.assert_close(fp8_gather["state"][name], want, rtol=2**-8,
                                           atol=1e-6, msg=name)


def _ddp_runs():
    results = {}
    for flag in (False, True):
        model = _model(flag)
        with torch.no_grad():  # unlike inits: DDP's broadcast of rank 0's params must work
            model[0].weight.add_(dist.get_rank())
        ddp = nn.parallel.DistributedDataParallel(model)
        losses = _train(ddp)
        results[flag] = {"losses": losses, "params": [p.detach() for p in model.parameters()]}
    return results


def test_ddp_trains_like_without_it(tmp_path):
    """Outside FSDP2 the option changes nothing: DDP broadcasts and all-reduces the wrapped
    weight like a plain one."""
    for result in run_on_ranks(_ddp_runs, world_size=2, timeout_s=TIMEOUT_S, out_dir=tmp_path):
        assert torch.equal(result[True]["losses"], result[False]["losses"])
        for got, want in zip(result[True]["params"], result[False]["params"]):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
