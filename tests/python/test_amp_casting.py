"""O2/O3 model casting: which layers stay fp32, and what model.state_dict() gives.

- Every normalization layer torch ships (found by name in torch.nn, so a new one fails this
  test until it is looked at) stays fp32 at O2: its params and buffers, and the ops it runs,
  seen at the dispatcher, even though its input arrives in the low dtype; it hands the low
  dtype on. Lazy ones materialize in fp32.
- A user's own norm type, registered with register_norm_type, stays fp32 with everything
  inside it, in the models initialized after the registration.
- The kept norms cast in a forward set on the instance, not in hooks (torch's fast call
  path); it follows the model into deep copies and pickles, and a module whose instance has a
  forward of its own keeps it and gets hooks.
- model.state_dict() at O2 and O3 gives the cast params and buffers back in fp32, as apex did,
  and that state dict loads into a fresh fp32 model and back into the amp model.
"""

import copy
import inspect
import io

import pytest
import torch
from torch import nn

from aten_probe import AtenDtypes
from amp_models import low_dtype, make_model
from ampfuse import amp
from ampfuse.amp import casting, kept_norms

# Each normalization class in torch.nn: how to build one with params and buffers, and an input.
NORM_LAYERS = {
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), (3, 4, 5)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(4), (2, 4, 3, 3, 3)),
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(4), (3, 4, 5)),  # no process group: local BN
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (3, 4, 5)),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), (3, 4, 5, 5)),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), (2, 4, 3, 3, 3)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
                       (3, 4, 5)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                       (3, 4, 5, 5)),
    "InstanceNorm3d": (lambda: nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
                       (2, 4, 3, 3, 3)),
    "LazyInstanceNorm1d": (lambda: nn.LazyInstanceNorm1d(affine=True), (3, 4, 5)),
    "LazyInstanceNorm2d": (lambda: nn.LazyInstanceNorm2d(affine=True), (3, 4, 5, 5)),
    "LazyInstanceNorm3d": (lambda: nn.LazyInstanceNorm3d(affine=True), (2, 4, 3, 3, 3)),
    "LayerNorm": (lambda: nn.LayerNorm(5), (3, 4, 5)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    "RMSNorm": (lambda: nn.RMSNorm(5), (3, 4, 5)),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(2), (3, 4, 5)),
    "CrossMapLRN2d": (lambda: nn.CrossMapLRN2d(3), (3, 4, 5, 5)),
}


# Norm layers whose kernels take a low-precision input with fp32 weights (O2 feeds them the
# model's dtype); SyncBatchNorm is left out on purpose (kept_norms._MIXED_DTYPE_NORM_FORWARDS).
MIXED_DTYPE_NORMS = {name for name in NORM_LAYERS
                     if name.replace("Lazy", "").startswith(("BatchNorm", "InstanceNorm"))}


def torch_norm_classes():
    return sorted(
        name for name, cls in vars(nn).items()
        if inspect.isclass(cls) and issubclass(cls, nn.Module) and ("Norm" in name or "LRN" in name)
    )


def floating_tensors(module):
    return {name: t for name, t in list(module.named_parameters()) + list(module.named_buffers())
            if t.is_floating_point()}


def o2_cast(model, low):
    """What amp.initialize does to a model at O2, without the optimizer side."""
    casting.cast_model(model, low, keep_norm_fp32=True)
    casting.cast_model_io(model, low, torch.float32)
    return model


def test_the_table_covers_every_norm_class_torch_ships():
    assert torch_norm_classes() == sorted(NORM_LAYERS), (
        "torch.nn's normalization classes changed: add the new ones to NORM_LAYERS (and to "
        "casting.NORM_TYPES if they are not subclasses of a type already there)"
    )


@pytest.mark.parametrize("name", sorted(NORM_LAYERS))
def test_o2_keeps_every_torch_norm_layer_fp32(device, name):
    low = low_dtype(device)
    build, shape = NORM_LAYERS[name]
    model = o2_cast(nn.Sequential(build()).to(device), low)
    handed_on = []
    model[0].register_forward_hook(lambda m, args, out: handed_on.append(out.dtype))
    x = torch.randn(shape, device=device, requires_grad=True)
    with AtenDtypes() as probe:
        out = model(x)
    ran = [(op, dtypes) for op, dtypes in probe.calls if op != "_to_copy" and dtypes]
    if name in MIXED_DTYPE_NORMS:
        # torch's batch and instance norms take the low dtype input with their fp32 weights,
        # as apex's O2 gave them: one kernel, statistics in fp32, no cast to fp32 and back.
        assert kept_norms.takes_low_precision_input(model[0])
        kernels = [dtypes for op, dtypes in ran if "batch_norm" in op]
        assert kernels and all(dtypes == {low, torch.float32} for dtypes in kernels), ran
    else:
        # The input was cast to the low dtype at the model's boundary, and back to fp32 for
        # the norm: every op the norm ran saw fp32 tensors only.
        assert ran and all(dtypes == {torch.float32} for _, dtypes in ran), ran
    assert handed_on == [low]
    assert out.dtype == torch.float32
    tensors = floating_tensors(model)
    assert all(t.dtype == torch.float32 for t in tensors.values()), tensors
    out.sum().backward()
    grads = {n: p.grad.dtype for n, p in model.named_parameters()}
    assert all(g == torch.float32 for g in grads.values()), grads
    assert x.grad.dtype == torch.float32


def test_o2_initialize_keeps_rmsnorm_fp32_and_trains(device):
    low = low_dtype(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.GELU(), nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert model[1].weight.dtype == torch.float32
    assert model[0].weight.dtype == low and model[3].weight.dtype == low
    x = torch.randn(32, 8, device=device)
    target = x[:, :4].clone()
    losses = []
    for _ in range(20):
        loss = (model(x) - target).pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    assert model[1].weight.dtype == torch.float32


class ScaleNorm(nn.Module):
    """A user's normalization layer, with a submodule of its own."""

    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.mix = nn.Linear(dim, dim)

    def forward(self, x):
        return self.gain * self.mix(x) / x.norm(dim=-1, keepdim=True).clamp_min(1e-5)


class SubScaleNorm(ScaleNorm):
    pass


def user_model(device):
    return nn.Sequential(nn.Linear(4, 4), ScaleNorm(4), SubScaleNorm(4), nn.Linear(4, 2)).to(device)


def test_registered_norm_types_stay_fp32_with_their_submodules(device):
    low = low_dtype(device)
    before = amp.initialize(user_model(device), opt_level="O2", verbosity=0)
    handle = casting.register_norm_type(ScaleNorm)
    try:
        model = amp.initialize(user_model(device), opt_level="O2", verbosity=0)
        # Subclasses count; everything inside the norm stays fp32; the rest is cast.
        for norm in (model[1], model[2]):
            assert {t.dtype for t in floating_tensors(norm).values()} == {torch.float32}
        assert model[0].weight.dtype == low and model[3].weight.dtype == low
        handed_on = []
        model[1].register_forward_hook(lambda m, a, out: handed_on.append(out.dtype))
        with AtenDtypes() as probe:
            assert model(torch.randn(3, 4, device=device)).dtype == torch.float32
        assert handed_on == [low]
        # The four linears, in order: the model's, the two inside the norms, the model's.
        linears = probe.dtypes_of("mm", "addmm")
        assert linears == [{low}, {torch.float32}, {torch.float32}, {low}], linears
    finally:
        handle.remove()
    # A registration applies to models initialized after it only, and remove() undoes it.
    assert before[1].gain.dtype == low
    after = amp.initialize(user_model(device), opt_level="O2", verbosity=0)
    assert after[1].gain.dtype == low and after[1].mix.weight.dtype == low


def test_register_norm_type_takes_module_classes_only():
    with pytest.raises(TypeError, match="the class itself"):
        casting.register_norm_type(nn.LayerNorm(4))
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        casting.register_norm_type(int)
    with pytest.raises(ValueError, match="every module"):
        casting.register_norm_type(nn.Module)


def test_lazy_modules_that_would_be_cast_are_refused_clearly():
    model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())
    with pytest.raises(ValueError, match=r"LazyLinear 0 .*forward pass.*before amp.initialize"):
        casting.cast_model(model, torch.bfloat16, keep_norm_fp32=True)


# ---- model.state_dict() at O2/O3 --------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_state_dict_is_fp32_and_loads_at_any_level(device, opt_level, model_name):
    low = low_dtype(device)
    model, _ = make_model(model_name, seed=0, device=device)
    model = amp.initialize(model, opt_level=opt_level, verbosity=0)
    live = {name: t.detach().clone() for name, t in model.state_dict(keep_vars=True).items()}
    assert low in {t.dtype for t in live.values()}

    state = {key: value.clone() for key, value in model.state_dict().items()}
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    assert {v.dtype for v in floats.values()} == {torch.float32}
    for key, value in floats.items():  # low -> fp32 is exact
        assert torch.equal(value, live[key].float()), key
    first_child = next(model.children())
    assert {v.dtype for v in first_child.state_dict().values() if v.is_floating_point()} == {
        torch.float32}
    # state_dict(keep_vars=True) still hands out the model's own tensors.
    name, param = next(iter(model.named_parameters()))
    assert model.state_dict(keep_vars=True)[name] is param

    fresh, _ = make_model(model_name, seed=1, device=device)
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(state)
    for key, value in model.state_dict(keep_vars=True).items():
        assert value.dtype == live[key].dtype and torch.equal(value.detach(), live[key]), key


def o2_norm_model(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16),
                          nn.BatchNorm1d(16), nn.Linear(16, 4)).to(device)
    return o2_cast(model, low_dtype(device))


def test_kept_norms_cast_without_hooks_and_follow_copies(device):
    model = o2_norm_model(device)
    x = torch.randn(5, 8, device=device)
    out = model(x)
    for norm in (model[1], model[4]):
        assert not norm._forward_pre_hooks and not norm._forward_hooks
        assert isinstance(norm.forward, kept_norms.KeptNormForward)
        assert norm.weight.dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert clone[1].forward.module is clone[1] and clone[4].forward.module is clone[4]
        assert torch.equal(clone(x), out)
        with torch.no_grad():
            clone[1].weight.mul_(3.0)
        assert not torch.equal(clone(x), out)  # the copy runs its own weights...
        assert torch.equal(model(x), out)  # ...and the original is untouched
    model[1].forward.remove()
    assert "forward" not in model[1].__dict__
    assert model[1].forward.__func__ is nn.LayerNorm.forward  # the class's forward again


class _PairNorm(nn.LayerNorm):
    """A norm whose forward takes an optional second tensor and returns a tuple."""

    def forward(self, x, shift=None):
        out = super().forward(x if shift is None else x + shift)
        return out, out.detach() * 2


@pytest.mark.parametrize("call", ["positional", "keyword", "two args", "fp32 input"])
def test_kept_norm_forward_casts_every_call_form(device, call):
    low = low_dtype(device)
    norm = _PairNorm(16).to(device)
    kept = kept_norms.KeptNormForward(norm, torch.float32, low)
    x = torch.randn(3, 16, device=device)
    seen = []
    norm.register_forward_pre_hook(lambda m, args: seen.append(args))  # not on the fast path
    expected = _PairNorm.forward(norm, x.to(low).float(), None)
    if call == "positional":
        out = kept(x.to(low))
    elif call == "keyword":
        out = kept(x=x.to(low))
    elif call == "two args":
        shift = torch.zeros(16, device=device, dtype=low)
        out = kept(x.to(low), shift)
    else:
        out = kept(x)
        expected = _PairNorm.forward(norm, x, None)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, expected):
        assert got.dtype == low
        assert torch.equal(got, want.to(low))
    assert not seen  # KeptNormForward calls the class's forward, not the module's hooks


def test_a_norm_with_its_own_instance_forward_keeps_it(device):
    low = low_dtype(device)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(device)
    norm = model[1]
    seen = []

    def patched(x):  # what another library's instance-level patch looks like
        seen.append(x.dtype)
        return type(norm).forward(norm, x)

    norm.forward = patched
    o2_cast(model, low)
    assert norm.forward is patched
    out = model(torch.randn(5, 8, device=device))
    assert seen == [torch.float32]  # hooks gave it fp32 in...
    assert out.dtype == torch.float32 and model[2].weight.dtype == low  # ...and low out

