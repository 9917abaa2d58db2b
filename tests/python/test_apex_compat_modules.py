"""What the apex alias provides: apex's constructors (argument order and defaults, read from
apex's last release with amp) mapped onto ampfuse and torch with apex's meaning, and clear
errors for what it does not provide. The modules are imported under their ampfuse names, so no
alias is installed here."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import required

import ampfuse
from ampfuse.apex_compat.apex import optimizers as apex_optimizers
from ampfuse.apex_compat.apex import parallel as apex_parallel
from ampfuse.apex_compat.apex.normalization import fused_layer_norm as apex_norm
from ampfuse.apex_compat.apex.parallel.LARC import LARC

# apex's signatures: (name, default) in apex's order; `required` marks a required argument.
NO = inspect.Parameter.empty
APEX_SIGNATURES = {
    apex_optimizers.FusedAdam: [
        ("params", NO), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
        ("eps", 1e-8), ("adam_w_mode", True), ("weight_decay", 0.0), ("amsgrad", False),
        ("set_grad_none", True), ("capturable", False), ("master_weights", False)],
    apex_optimizers.FusedSGD: [
        ("params", NO), ("lr", required), ("momentum", 0), ("dampening", 0),
        ("weight_decay", 0), ("nesterov", False), ("wd_after_momentum", False),
        ("materialize_master_grads", True), ("set_grad_none", False)],
    apex_optimizers.FusedAdagrad: [
        ("params", NO), ("lr", 1e-2), ("eps", 1e-10), ("weight_decay", 0.0),
        ("set_grad_none", True), ("adagrad_w_mode", False)],
    apex_optimizers.FusedNovoGrad: [
        ("params", NO), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
        ("eps", 1e-8), ("weight_decay", 0.0), ("amsgrad", False), ("reg_inside_moment", False),
        ("grad_averaging", True), ("norm_type", 2), ("init_zero", False),
        ("set_grad_none", True)],
    apex_optimizers.FusedMixedPrecisionLamb: [
        ("params", NO), ("lr", 1e-3), ("step", 0), ("bias_correction", True),
        ("betas", (0.9, 0.999)), ("eps", 1e-6), ("weight_decay", 0.01), ("amsgrad", False),
        ("adam_w_mode", True), ("grad_averaging", True), ("max_grad_norm", 1.0),
        ("use_nvlamb", False), ("reduced_precision_dtype", None)],
    apex_parallel.DistributedDataParallel: [
        ("module", NO), ("message_size", 10000000), ("delay_allreduce", False),
        ("shared_param", None), ("allreduce_trigger_params", None),
        ("retain_allreduce_buffers", False), ("allreduce_always_fp32", False),
        ("num_allreduce_streams", 1), ("allreduce_communicators", None),
        ("gradient_average", True), ("gradient_predivide_factor", 1.0),
        ("gradient_average_split_factor", None), ("prof", False)],
    apex_parallel.SyncBatchNorm: [
        ("num_features", NO), ("eps", 1e-5), ("momentum", 0.1), ("affine", True),
        ("track_running_stats", True), ("process_group", None), ("channel_last", False),
        ("fuse_relu", False)],
    apex_parallel.convert_syncbn_model: [
        ("module", NO), ("process_group", None), ("channel_last", False)],
    LARC: [("optimizer", NO), ("trust_coefficient", 0.02), ("clip", True), ("eps", 1e-8)],
    apex_norm.FusedLayerNorm: [
        ("normalized_shape", NO), ("eps", 1e-5), ("elementwise_affine", True),
        ("memory_efficient", False)],
    apex_norm.FusedRMSNorm: [
        ("normalized_shape", NO), ("eps", 1e-5), ("elementwise_affine", True),
        ("memory_efficient", False)],
    apex_norm.fused_layer_norm_affine: [
        ("input", NO), ("weight", NO), ("bias", NO), ("normalized_shape", NO), ("eps", 1e-6),
        ("memory_efficient", False)],
    apex_norm.fused_rms_norm_affine: [
        ("input", NO), ("weight", NO), ("normalized_shape", NO), ("eps", 1e-6),
        ("memory_efficient", False)],
}


# apex 0.1's FusedAdam options that BERT fine-tuning scripts of that era still pass by keyword.
APEX_LEGACY_KEYWORDS = {
    apex_optimizers.FusedAdam: [("eps_inside_sqrt", False), ("max_grad_norm", 0.0)],
}


@pytest.mark.parametrize("target", list(APEX_SIGNATURES), ids=lambda t: t.__name__)
def test_constructors_take_apex_arguments_in_apex_order(target):
    function = target.__init__ if inspect.isclass(target) else target
    parameters = list(inspect.signature(function).parameters.values())
    if inspect.isclass(target):
        parameters = parameters[1:]  # self
    # Keyword-only extras are options of older apex releases (APEX_LEGACY_KEYWORDS).
    legacy = [(p.name, p.default) for p in parameters if p.kind == p.KEYWORD_ONLY]
    parameters = [p for p in parameters if p.kind != p.KEYWORD_ONLY]
    got = [(p.name, p.default) for p in parameters]
    assert got == APEX_SIGNATURES[target]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters)
    assert legacy == APEX_LEGACY_KEYWORDS.get(target, [])


def _params(seed=0, shapes=((5, 3), (3,), (4, 5))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _run(optimizer, params, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_positional_arguments_keep_apex_meaning(adam_w_mode):
    params = _params()
    # apex order: lr, bias_correction, betas, eps, adam_w_mode, weight_decay
    optimizer = apex_optimizers.FusedAdam(params, 2e-2, True, (0.8, 0.95), 1e-6, adam_w_mode,
                                          0.1)
    reference = _params()
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    expected = _run(torch_class(reference, lr=2e-2, betas=(0.8, 0.95), eps=1e-6,
                                weight_decay=0.1), reference)
    torch.testing.assert_close(_run(optimizer, params), expected)
    assert optimizer.set_grad_none is True


def test_fused_adam_bias_correction_is_second():
    optimizer = apex_optimizers.FusedAdam(_params(), 1e-3, False)
    assert optimizer.param_groups[0]["bias_correction"] is False


def test_fused_sgd_takes_lr_from_groups_and_zeroes_grads_as_apex():
    params = _params()
    optimizer = apex_optimizers.FusedSGD([{"params": params[:2], "lr": 0.1},
                                          {"params": params[2:], "lr": 0.01}], momentum=0.9,
                                         nesterov=True, weight_decay=1e-3)
    reference = _params()
    torch_sgd = torch.optim.SGD([{"params": reference[:2], "lr": 0.1},
                                 {"params": reference[2:], "lr": 0.01}], momentum=0.9,
                                nesterov=True, weight_decay=1e-3)
    torch.testing.assert_close(_run(optimizer, params), _run(torch_sgd, reference))
    optimizer.zero_grad()  # apex's FusedSGD defaults to set_grad_none=False
    assert all(p.grad is not None and not p.grad.any() for p in params)
    with pytest.raises(ValueError, match="lr"):
        apex_optimizers.FusedSGD(_params())  # no lr anywhere


def test_fused_sgd_apex_only_flags():
    fused_sgd_init = inspect.signature(ampfuse.optimizers.FusedSGD.__init__).parameters
    if "wd_after_momentum" in fused_sgd_init:
        apex_optimizers.FusedSGD(_params(), 0.1, 0.9, wd_after_momentum=True)
    else:
        with pytest.raises(NotImplementedError, match="wd_after_momentum"):
            apex_optimizers.FusedSGD(_params(), 0.1, 0.9, wd_after_momentum=True)
    # materialize_master_grads only chooses where amp keeps O2 master grads: same result.
    a, b = _params(), _params()
    lean = apex_optimizers.FusedSGD(a, 0.1, 0.9, materialize_master_grads=False)
    torch.testing.assert_close(_run(lean, a), _run(apex_optimizers.FusedSGD(b, 0.1, 0.9), b))


def test_every_apex_optimizer_is_there_and_other_names_are_not():
    for name in ("FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad",
                 "FusedMixedPrecisionLamb"):
        assert isinstance(getattr(apex_optimizers, name), type)
    with pytest.raises(AttributeError, match="FusedNothing"):
        apex_optimizers.FusedNothing  # noqa: B018  (the attribute read is what raises)
    with pytest.raises(ImportError):
        exec("from ampfuse.apex_compat.apex.optimizers import FusedNothing", {})


def test_apex_fused_adam_takes_amp_fused_path():
    """The alias's FusedAdam is ampfuse's: amp O2 runs it exactly like ampfuse.optimizers."""
    def train(optimizer_class):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 2))
        optimizer = optimizer_class(model.parameters(), lr=1e-2)
        model, optimizer = ampfuse.amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            loss = F.cross_entropy(model(torch.randn(4, 8, generator=gen)).float(),
                                   torch.randint(0, 2, (4,), generator=gen))
            with ampfuse.amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach() for p in model.parameters()]

    for ours, theirs in zip(train(apex_optimizers.FusedAdam), train(ampfuse.optimizers.FusedAdam)):
        assert torch.equal(ours, theirs)


# ---- apex.normalization --------------------------------------------------------------------------


def test_fused_norm_modules_are_torch_norms_with_apex_defaults():
    layer = apex_norm.FusedLayerNorm(6)
    rms = apex_norm.FusedRMSNorm([2, 3], elementwise_affine=False)
    assert isinstance(layer, torch.nn.LayerNorm) and isinstance(rms, torch.nn.RMSNorm)
    assert layer.eps == 1e-5 and rms.eps == 1e-5 and rms.weight is None
    x = torch.randn(4, 2, 3)
    torch.testing.assert_close(rms(x), F.rms_norm(x, (2, 3), None, 1e-5))
    with pytest.raises(ValueError, match="always has a weight"):
        apex_norm.MixedFusedLayerNorm(6, elementwise_affine=False)


def test_fused_norm_functions_follow_apex_dtype_contract():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((3, 5, 8), (8,), (8,)))
    torch.testing.assert_close(apex_norm.fused_layer_norm_affine(x, w, b, [8], 1e-6),
                               F.layer_norm(x, (8,), w, b, 1e-6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = apex_norm.fused_layer_norm_affine(x, w, b, [8], 1e-6)
        rms = apex_norm.fused_rms_norm(x, [8])
    # Inputs cast to the autocast dtype, statistics in fp32, result in the autocast dtype.
    low = [t.to(torch.bfloat16).float() for t in (x, w, b)]
    assert out.dtype == torch.bfloat16 and rms.dtype == torch.bfloat16
    assert torch.equal(out, F.layer_norm(low[0], (8,), low[1], low[2], 1e-6).bfloat16())
    assert torch.equal(rms, F.rms_norm(low[0], (8,), None, 1e-6).bfloat16())
    mixed = apex_norm.mixed_dtype_fused_layer_norm_affine(x.bfloat16(), w, b, [8])
    assert mixed.dtype == torch.float32  # the weight's dtype


def test_amp_o2_keeps_fused_layer_norm_fp32():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), apex_norm.FusedLayerNorm(6))
    ampfuse.amp.initialize(model, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32


# ---- apex.parallel -------------------------------------------------------------------------------


def test_ddp_takes_apex_arguments_and_reduces_as_asked(one_rank, monkeypatch):
    reduced = []
    all_reduce = torch.distributed.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(apex_parallel.dist, "all_reduce", recording_all_reduce)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).bfloat16()
    reference = torch.nn.Linear(6, 3).bfloat16()
    reference.load_state_dict(model.state_dict())
    ddp = apex_parallel.DistributedDataParallel(model, message_size=1000, delay_allreduce=True,
                                                allreduce_always_fp32=True,
                                                gradient_predivide_factor=4.0)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    assert ddp.bucket_bytes_cap == 1000 * 2  # message_size counts elements (bf16: 2 bytes)
    x = torch.randn(5, 6).bfloat16()
    ddp(x).float().square().sum().backward()
    reference(x).float().square().sum().backward()
    assert reduced and set(reduced) == {torch.float32}
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)  # one rank: the average is the grad itself


@pytest.mark.parametrize("option", [
    {"retain_allreduce_buffers": True}, {"allreduce_trigger_params": []},
    {"shared_param": True}, {"allreduce_communicators": ([], [])}])
def test_ddp_refuses_apex_internals(option):
    name = next(iter(option))
    with pytest.raises(NotImplementedError, match=name):
        apex_parallel.DistributedDataParallel(torch.nn.Linear(2, 2), **option)
    with pytest.raises(ValueError, match="gradient_predivide_factor must be > 0"):
        apex_parallel.DistributedDataParallel(torch.nn.Linear(2, 2), gradient_predivide_factor=0)


def test_syncbn_conversion_keeps_weights_and_statistics():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                                torch.nn.InstanceNorm2d(4))
    model(torch.randn(2, 3, 5, 5))  # moves the running statistics
    bn = model[1]
    converted = apex_parallel.convert_syncbn_model(model)
    assert isinstance(converted[1], torch.nn.SyncBatchNorm)
    assert isinstance(converted[2], torch.nn.InstanceNorm2d)
    for key, value in bn.state_dict().items():
        assert torch.equal(converted[1].state_dict()[key], value)
    layer = apex_parallel.SyncBatchNorm(4, 1e-3, 0.2)
    assert isinstance(layer, torch.nn.SyncBatchNorm) and (layer.eps, layer.momentum) == (1e-3, 0.2)
    for option in ("channel_last", "fuse_relu"):
        with pytest.raises(NotImplementedError, match=option):
            apex_parallel.SyncBatchNorm(4, **{option: True})
    with pytest.raises(NotImplementedError, match="channel_last"):
        apex_parallel.convert_syncbn_model(model, channel_last=True)


def _larc_reference(params, lr, weight_decay, trust, clip, eps, steps, seed):
    """LARC as apex documents it, one param at a time, in front of a plain SGD."""
    sgd = torch.optim.SGD(params, lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.zeros_like(p) if i == 1 else torch.randn(p.shape, generator=gen)
        with torch.no_grad():
            for p in params:
                p_norm, g_norm = p.norm(), p.grad.norm()
                if p_norm != 0 and g_norm != 0:
                    local = trust * p_norm / (g_norm + p_norm * weight_decay + eps)
                    if clip:
                        local = min(local / lr, 1)
                    p.grad.add_(p, alpha=weight_decay).mul_(local)
        sgd.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("trust", [0.02, 1.0])
def test_larc_matches_apex_algorithm(clip, trust):
    params = _params()
    optimizer = LARC(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
                     trust_coefficient=trust, clip=clip)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.zeros_like(p) if i == 1 else torch.randn(p.shape, generator=gen)
        optimizer.step()
        assert optimizer.param_groups[0]["weight_decay"] == 0.01  # restored after the step
    expected = _larc_reference(_params(), 0.1, 0.01, trust, clip, 1e-8, steps=3, seed=7)
    torch.testing.assert_close([p.detach() for p in params], expected)
    assert torch.equal(params[1], _params()[1])  # a zero grad: no decay, no update
    with pytest.raises(ValueError, match="closure"):
        optimizer.step(lambda: 0.0)
