"""CurrentScaling(fsdp_fp8_all_gather=True) in one process: the wrapped weight is invisible
outside FSDP2 (training, optimizers, amp O2, checkpoints, .to), and its FSDP2 hooks cast each
shard exactly as the whole weight is cast (FSDP2's collectives are faked here; the real ones
run in test_fp8_fsdp2_all_gather)."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from ampfuse import amp, fp8
from ampfuse.fp8 import fsdp_all_gather, tensorwise
from ampfuse.fp8.fsdp_all_gather import FP8AllGatherWeight, FP8GatheredWeight
from ampfuse.optimizers import FusedAdamW
from torch import nn

FLAG = fp8.CurrentScaling(fsdp_fp8_all_gather=True)
E4M3 = torch.float8_e4m3fn


def _model(recipe, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(dtype)
    fp8.convert(model, recipe, min_features=0)
    return model


def _batch(step, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(16, 32, generator=generator).to(dtype),
            torch.randn(16, 32, generator=generator))


def _bits(t):
    return t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_flag_must_be_a_bool(value):
    with pytest.raises(TypeError, match="fsdp_fp8_all_gather must be True or False"):
        fp8.CurrentScaling(fsdp_fp8_all_gather=value)


@pytest.mark.parametrize("recipe", [fp8.RowwiseScaling, fp8.DelayedScaling])
def test_only_current_scaling_offers_it(recipe):
    with pytest.raises(TypeError, match="fsdp_fp8_all_gather"):
        recipe(fsdp_fp8_all_gather=True)


def test_unaligned_layer_keeps_its_error():
    with pytest.raises(ValueError, match="in_features=30 must be a multiple of 16"):
        fp8.Linear(30, 16, recipe=FLAG)
    with pytest.raises(ValueError, match="cannot run in FP8"):
        fp8.convert(nn.Sequential(nn.Linear(30, 16)), FLAG, include=["0"])


def test_convert_wraps_the_same_parameter():
    model = nn.Sequential(nn.Linear(32, 64))
    weight = model[0].weight
    fp8.convert(model, FLAG, min_features=0)
    assert model[0].weight is weight
    assert isinstance(weight, FP8AllGatherWeight) and isinstance(weight, nn.Parameter)
    assert weight.requires_grad and not weight._inner.requires_grad
    assert type(model[0].bias) is nn.Parameter
    assert type(_model(fp8.CurrentScaling())[0].weight) is nn.Parameter
    # Ordinary ops give plain tensors; views and .data keep the wrapper.
    assert type(weight + 1) is torch.Tensor and type(weight.bfloat16()) is torch.Tensor
    assert type(torch.zeros_like(weight)) is torch.Tensor
    assert type(weight.data) is FP8AllGatherWeight and type(weight[:8]) is FP8AllGatherWeight


@pytest.mark.parametrize("master_weights", [True, "split", "stochastic"])
def test_trains_bit_for_bit_like_without_it(master_weights):
    runs = []
    for recipe in (FLAG, fp8.CurrentScaling()):
        model = _model(recipe)
        optimizer = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                               master_weights=master_weights)
        losses = []
        for step in range(3):
            for micro in range(2):  # gradient accumulation: the cached FP8 weight is reused
                x, y = _batch(10 * step + micro)
                loss = F.mse_loss(model(x).float(), y)
                loss.backward()
                losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
        state_types = {type(v) for s in optimizer.state.values() for v in s.values()}
        runs.append((torch.stack(losses), list(model.parameters()), state_types))
    (losses, params, state_types), (want_losses, want_params, _) = runs
    assert torch.equal(losses, want_losses)
    for got, want in zip(params, want_params):
        assert torch.equal(_bits(got), _bits(want))
    assert state_types == {torch.Tensor}, state_types
    assert isinstance(params[0], FP8AllGatherWeight)


def test_state_dict_is_plain_and_round_trips(tmp_path):
    model = _model(FLAG)
    state = model.state_dict()
    assert list(state) == list(_model(fp8.CurrentScaling()).state_dict())
    assert {type(v) for v in state.values()} == {torch.Tensor}
    assert model.state_dict(keep_vars=True)["0.weight"] is model[0].weight  # the live one
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    other = _model(FLAG)
    with torch.no_grad():
        other[0].weight.zero_()
    other.load_state_dict(loaded)
    assert isinstance(other[0].weight, FP8AllGatherWeight)
    assert torch.equal(_bits(other[0].weight), _bits(model[0].weight))
    x, _ = _batch(0)
    assert torch.equal(other(x), model(x))
    other.load_state_dict(loaded, assign=True)
    assert isinstance(other[0].weight, FP8AllGatherWeight)
    assert torch.equal(other(x), model(x))


def test_whole_module_pickles_and_copies():
    model = _model(FLAG)
    x, _ = _batch(0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert isinstance(other[0].weight, FP8AllGatherWeight)
        assert isinstance(other[0].weight, nn.Parameter) and other[0].weight.requires_grad
        assert torch.equal(other(x), model(x))


def test_module_to_dtype_keeps_the_wrapped_parameter():
    model = _model(FLAG, torch.float32)
    weight = model[0].weight
    model.to(torch.bfloat16)
    assert model[0].weight is weight and isinstance(weight, FP8AllGatherWeight)
    assert weight.dtype == weight._inner.dtype == torch.bfloat16
    reference = _model(fp8.CurrentScaling(), torch.float32).to(torch.bfloat16)
    x, _ = _batch(0)
    assert torch.equal(model(x), reference(x))


def test_writes_reach_the_forward():
    """The FP8 weight cache sees writes through the wrapper (version) and .data (storage)."""
    model, reference = _model(FLAG), _model(fp8.CurrentScaling())
    x, _ = _batch(0)
    for m in (model, reference):
        m(x)
        with torch.no_grad():
            m[0].weight.mul_(0.5)
    assert torch.equal(model(x), reference(x))
    for m in (model, reference):
        m[0].weight.data = torch.ones(64, 32, dtype=torch.bfloat16)
    assert isinstance(model[0].weight, FP8AllGatherWeight)
    assert torch.equal(model[0].weight._inner, reference[0].weight)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("convert_first", [True, False], ids=["convert_first", "amp_fp8"])
def test_amp_o2_trains_like_without_it(convert_first):
    runs = []
    for recipe in (FLAG, fp8.CurrentScaling()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        if convert_first:
            fp8.convert(model, recipe, min_features=0)
        optimizer = FusedAdamW(model.parameters(), lr=1e-2)
        options = {} if convert_first else {"fp8": recipe, "fp8_min_features": 0}
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                          dtype=torch.bfloat16, verbosity=0, **options)
        assert isinstance(model[0].weight, FP8AllGatherWeight) == (recipe is FLAG)
        losses = []
        for step in range(3):
            x, y = _batch(step, torch.float32)
            loss = F.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [p.detach() for p in model.parameters()]))
    (losses, params), (want_losses, want_params) = runs
    assert torch.equal(losses, want_losses)
    for got, want in zip(params, want_params):
        assert torch.equal(_bits(got), _bits(want))


# ---- the FSDP2 hooks, with FSDP2's mesh and all-reduce stood in for ----------------------


class _Mesh:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_group(self):
        return "shard group"


def _gather(weight, world_size, monkeypatch):
    """What FSDP2 would gather from `world_size` ranks (torch.chunk's split, padded to the
    first chunk), with the all-reduce MAX played by the test: it checks each rank's amax and
    answers the max over all ranks."""
    shards = list(weight.chunk(world_size))
    shards += [weight[:0]] * (world_size - len(shards))  # ranks past the last chunk: 0 rows
    local_amaxes = [s.float().abs().amax() if s.numel()
                    else weight.new_zeros((), dtype=torch.float32)
                    for s in shards]
    local_amaxes = [torch.where(a.isnan(), float("inf"), a) for a in local_amaxes]
    calls = []

    def all_reduce(tensor, op, group):
        assert op == torch.distributed.ReduceOp.MAX and group == "shard group"
        assert torch.equal(tensor, local_amaxes[len(calls)].reshape(1)), len(calls)
        calls.append(tensor.clone())
        tensor.copy_(torch.stack(local_amaxes).amax())

    monkeypatch.setattr(fsdp_all_gather.dist, "all_reduce", all_reduce)
    inputs, metadata = [], None
    for shard in shards:
        local = FP8AllGatherWeight(shard, E4M3)
        (codes,), metadata = local.fsdp_pre_all_gather(_Mesh(world_size), weight.shape,
                                                       weight.stride(), None, None)
        assert codes.dtype == torch.uint8 and codes.shape == shards[0].shape
        inputs.append(codes)
    assert len(calls) == world_size
    local = FP8AllGatherWeight(shards[0], E4M3)
    output = torch.cat(inputs)
    gathered, inner = local.fsdp_post_all_gather((output,), metadata, weight.dtype)
    # The codes view FSDP2's all-gather buffer, which it frees and refills between gathers.
    assert inner == (output,) and gathered._codes.data_ptr() == output.data_ptr()
    return gathered, inputs, shards


@pytest.mark.parametrize("rows,world_size", [(48, 2), (48, 5), (16, 5)],
                         ids=["even", "padded", "empty_shard"])
def test_gathered_codes_are_the_whole_weights(rows, world_size, device, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(rows, 32, generator=generator).bfloat16().to(device)
    gathered, inputs, shards = _gather(weight, world_size, monkeypatch)
    assert isinstance(gathered, FP8GatheredWeight)
    assert gathered.shape == weight.shape and gathered.dtype == weight.dtype
    got = gathered.tensorwise_weight()
    want = tensorwise.quantize_weight_current(weight, E4M3)
    assert torch.equal(got.scale_inv, want.scale_inv)
    assert torch.equal(got.w8.view(torch.uint8), want.w8.view(torch.uint8))
    assert torch.equal(got.w8t.view(torch.uint8), want.w8t.view(torch.uint8))
    for codes, shard in zip(inputs, shards):
        assert not codes[shard.shape[0]:].any()  # FSDP2's padding rows: zero codes


def test_a_nan_in_one_shard_makes_every_scale_nan(device, monkeypatch):
    weight = torch.randn(48, 32).bfloat16().to(device)
    weight[40, 3] = float("nan")
    gathered, _, _ = _gather(weight, 2, monkeypatch)
    assert gathered._scale_inv.isnan().all()
    assert tensorwise.quantize_weight_current(weight, E4M3).scale_inv.isnan().all()


def test_fp32_model_under_bf16_policy_casts_the_shard_first(monkeypatch):
    weight = torch.randn(32, 32)
    monkeypatch.setattr(fsdp_all_gather.dist, "all_reduce", lambda t, op, group: None)
    policy = type("Policy", (), {"param_dtype": torch.bfloat16})()
    (codes,), (scale_inv, _) = FP8AllGatherWeight(weight, E4M3).fsdp_pre_all_gather(
        _Mesh(1), weight.shape, weight.stride(), None, policy)
    want = tensorwise.quantize_weight_current(weight.bfloat16(), E4M3)
    assert torch.equal(codes, want.w8.view(torch.uint8))
    assert torch.equal(scale_inv, want.scale_inv)


def test_gathered_weight_reads_as_its_values_and_refuses_writes(device, monkeypatch):
    weight = torch.randn(48, 32).bfloat16().to(device)
    gathered, _, _ = _gather(weight, 2, monkeypatch)
    want = tensorwise.quantize_weight_current(weight, E4M3)
    values = (want.w8.float() * want.scale_inv).bfloat16()
    assert torch.equal(gathered.dequantize(), values)
    assert torch.equal(gathered + 1, values + 1)
    x = torch.randn(4, 32).bfloat16().to(device)
    assert torch.equal(F.linear(x, gathered), F.linear(x, values))
    # FSDP2 makes its unsharded Parameter with these: they keep the codes.
    param = nn.Parameter(torch.as_strided(gathered, weight.shape, weight.stride(), 0))
    assert isinstance(param, FP8GatheredWeight) and param._codes is gathered._codes
    with (pytest.raises(RuntimeError, match="writes into the all-gathered FP8 weight"),
          torch.no_grad()):
        gathered.add_(1)
    with pytest.raises(RuntimeError, match="only the whole weight can be viewed"):
        gathered.view(32, 48)
    # FSDP2's next all-gather refills the same codes and hands over the new scale.
    new_scale = torch.tensor([2.0], device=device)
    local = FP8AllGatherWeight(weight[:24], E4M3)
    assert local.fsdp_post_all_gather((torch.empty(0),), (new_scale, weight.shape),
                                      torch.bfloat16, out=param) is None
    assert param._scale_inv is new_scale
    with pytest.raises(TypeError, match="expected the FP8GatheredWeight"):
        local.fsdp_post_all_gather((torch.empty(0),), (new_scale, weight.shape),
                                   torch.bfloat16, out=torch.empty(48, 32, device=device))


def test_a_shard_by_columns_is_refused():
    weight = torch.randn(32, 32)
    with pytest.raises(NotImplementedError, match="shards the weight by rows"):
        FP8AllGatherWeight(weight[:, :16], E4M3).fsdp_pre_all_gather(
            _Mesh(2), weight.shape, weight.stride(), None, None)
