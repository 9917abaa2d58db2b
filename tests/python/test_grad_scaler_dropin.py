"""ampfuse.GradScaler as a drop-in for torch.amp.GradScaler in the places real code touches.

- Every gradient torch's scaler takes: float64 grads (torch's own op, so bit-identical) and
  strided views that are not dense (unscaled as dense copies and written back), on the
  unscale path and on the check-only path of fused optimizers.
- torch's private hooks that subclasses override (_unscale_grads_, _maybe_opt_step) are the
  ones our scaler calls, with torch's signatures; the per-optimizer records hold torch's keys.
- The public count of skipped steps: counted on the device, read only when asked, carried by
  state_dict() and pickling in a form torch's scaler still loads.
"""

import math
import pickle

import pytest
import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.scaling.grad_scaler import GradScaler
from ampfuse.optimizers import FusedSGD
from tolerances import assert_close_report

SCALE = 2.0**10
LOW = (torch.float32, torch.bfloat16, torch.float16)


def assert_same_bits(actual, expected, msg=""):
    if actual.dtype == torch.float64:  # the shared tolerance table covers the training dtypes
        assert actual.dtype == expected.dtype, msg
        assert torch.equal(actual.view(torch.int64), expected.view(torch.int64)), msg
    else:
        assert_close_report(actual, expected, exact=True, msg=msg)


def grads_like_torch(make_grads, allow_fp16=False):
    """Unscales the same grads with torch's scaler and ours (through the hook both share) and
    returns (ours, theirs, flags ours, flags theirs)."""
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        grads = make_grads()
        params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1.0)
        flags = cls("cpu")._unscale_grads_(
            opt, torch.full((), 1 / SCALE), torch.zeros(()), allow_fp16
        )
        results.append((grads, sum(float(f) for f in flags.values())))
    (ours, our_flag), (theirs, their_flag) = results
    return ours, theirs, our_flag, their_flag


def strided(dtype, base_shape=(6, 10), inject=None):
    """A grad that is a strided slice of a bigger tensor (not dense), and that bigger tensor."""
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(base_shape, generator=gen) * SCALE).to(dtype)
    view = base[1:5, ::3]
    if inject is not None:
        view[2, 1] = inject
    return base, view


@pytest.mark.parametrize("dtype", LOW + (torch.float64,), ids=str)
def test_views_and_float64_unscale_like_torch(dtype):
    """Dense, transposed and strided-slice grads, float64 included: the same values as torch's
    unscale, bit for bit, and the parts of a view's base outside the view untouched."""
    bases = []

    def make():
        gen = torch.Generator().manual_seed(1)
        dense = (torch.randn(5, 7, generator=gen) * SCALE).to(dtype)
        base, view = strided(dtype)
        bases.append((base, base.clone()))
        return [dense, dense.t().clone().t(), view]

    assert not make()[2].is_contiguous()
    ours, theirs, flag, their_flag = grads_like_torch(make, allow_fp16=True)
    assert flag == their_flag == 0.0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.stride() == b.stride()
        assert_same_bits(a, b, msg=f"grad {i}")
    base, before = bases[0]
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[1:5, ::3] = False
    assert torch.equal(base[outside], before[outside])


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", LOW + (torch.float64,), ids=str)
def test_overflow_in_a_view_or_a_float64_grad_is_found(dtype, value):
    def make():
        return [torch.ones(3, dtype=dtype), strided(dtype, inject=value)[1]]

    _, _, flag, their_flag = grads_like_torch(make, allow_fp16=True)
    assert flag == their_flag == 1.0


def test_float64_model_trains_like_torch():
    """A float64 model with torch.optim: the same params and scales as torch's scaler, with an
    overflow skipped on the way."""
    runs = []
    for cls in (GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = cls("cpu", init_scale=SCALE, growth_interval=2)
        scales = []
        for step in range(6):
            opt.zero_grad()
            x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(2, 6) * (step + 1)
            scaler.scale(model(x).square().mean()).backward()
            if step == 3:
                model.weight.grad[0, 0] = math.inf
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((scales, [p.detach() for p in model.parameters()]))
    (ours, our_params), (theirs, their_params) = runs
    assert ours == theirs and ours[3] == ours[2] / 2
    for a, b in zip(our_params, their_params):
        assert_same_bits(a, b)


def test_fused_optimizer_checks_strided_fp16_grads():
    """The check-only path (a fused optimizer divides the scale itself) takes views too, and
    an inf in one skips the step."""
    params = [torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16)) for _ in range(2)]
    opt = FusedSGD(params, lr=0.5)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for overflow in (False, True):
        for p in params:
            p.grad = torch.full((4, 8), 4.0, dtype=torch.float16)[:, ::2]
        if overflow:
            params[1].grad[3, 3] = math.inf
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        for p, b in zip(params, before):
            expected = b if overflow else b - 0.5  # grad 4.0 / scale 4.0 = 1.0
            assert_close_report(p.detach(), expected, exact=True)
    assert scaler.get_skipped_steps() == 1


def test_dtypes_no_scaler_takes_are_refused_clearly():
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float8_e4m3fn))
    param.grad = torch.ones(2, dtype=torch.float8_e4m3fn)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*float8_e4m3fn"):
        scaler.unscale_(torch.optim.SGD([param], lr=1.0))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("poisoned", [False, True])
def test_complex_grads_are_unscaled_as_their_real_views(dtype, poisoned):
    # torch's scaler refuses complex grads (its op has no complex kernel); ours takes them as
    # their real views, so complex params can train with loss scaling.
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(3, 4, dtype=dtype, generator=gen)
    param = torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype))
    param.grad = values * 1024.0
    if poisoned:
        param.grad[1, 2] = complex(1.0, float("inf"))
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler.unscale_(optimizer)
    flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert sum(flag.item() for flag in flags.values()) == (1.0 if poisoned else 0.0)
    if not poisoned:
        assert torch.equal(param.grad, values)  # a power-of-two scale: exact


# ---- torch's private hooks and records --------------------------------------------------------


def flagging_subclass(base):
    """A subclass in the style of sharded scalers: it records every call of the hook and
    reports an overflow found elsewhere (another shard) by setting every flag."""

    class Flagging(base):
        calls = []

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            flags = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            self.calls.append((float(inv_scale), allow_fp16))
            for flag in flags.values():
                flag.fill_(1.0)
            return flags

    return Flagging


@pytest.mark.parametrize("fused", [False, True], ids=["torch_optim", "fused"])
def test_unscale_grads_override_is_honoured_like_torch(fused):
    outcomes = []
    for base in (GradScaler, torch.amp.GradScaler):
        cls = flagging_subclass(base)
        param = torch.nn.Parameter(torch.ones(3))
        opt = FusedSGD([param], lr=0.1) if fused else torch.optim.SGD([param], lr=0.1)
        scaler = cls("cpu", init_scale=SCALE)
        for explicit_unscale in (True, False):
            scaler.scale(param.sum()).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        outcomes.append((cls.calls, param.detach().clone(), scaler.get_scale()))
    ours, theirs = outcomes
    assert ours[0] == theirs[0]  # the same calls: (1/scale, False) to unscale, (1.0, True) to check
    assert torch.equal(ours[1], torch.ones(3)) and torch.equal(theirs[1], torch.ones(3))
    assert ours[2] == theirs[2] == SCALE / 4


def test_flags_of_one_element_from_an_override_are_summed():
    """torch sums whatever flags the hook returns; one-element (not 0-dim) flags, several of
    them, work here too (a subclass adding the flag of another shard, say)."""

    class Sharded(GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            flags = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            return {**{d: f.reshape(1) for d, f in flags.items()}, "shard 1": torch.ones(1)}

    param = torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([param], lr=0.5)
    scaler = Sharded("cpu", init_scale=2.0)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(2)) and scaler.get_skipped_steps() == 1


def test_maybe_opt_step_override_is_honoured():
    class Counting(GradScaler):
        seen = []

        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            self.seen.append(optimizer_state["stage"])
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    scaler = Counting("cpu", init_scale=2.0)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    assert Counting.seen == [OptState.UNSCALED]
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


@pytest.mark.parametrize("fused", [False, True], ids=["torch_optim", "fused"])
def test_per_optimizer_records_have_torch_keys(fused):
    expected = _refresh_per_optimizer_state()
    param = torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([param], lr=0.1) if fused else torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu")
    assert scaler._per_optimizer_states["unused"] == expected
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    assert scaler._per_optimizer_states[id(opt)].keys() == expected.keys()
    scaler.step(opt)
    assert scaler._per_optimizer_states[id(opt)].keys() == expected.keys()
    scaler.update()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy._per_optimizer_states["unused"] == expected


# ---- skipped steps ----------------------------------------------------------------------------


def run_with_overflows(scaler, opts_params, overflow_at, steps):
    """Each step: a backward through every param, an inf in the params listed for that step."""
    for step in range(steps):
        for opt, params in opts_params:
            opt.zero_grad()
            scaler.scale(sum(p.sum() for p in params)).backward()
            for p in overflow_at.get(step, []):
                p.grad[0] = math.inf
        for opt, _ in opts_params:
            scaler.step(opt)
        scaler.update()


def test_skipped_steps_counts_iterations_on_the_device(monkeypatch):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    opts = [FusedSGD([params[0]], lr=0.1), torch.optim.SGD([params[1]], lr=0.1)]
    scaler = GradScaler("cpu", init_scale=SCALE)
    assert scaler.get_skipped_steps() == 0
    # both optimizers overflow at step 1 (one iteration), one of them at step 3
    overflow_at = {1: params, 3: params[:1]}
    # The fused optimizer's steps and update() never read the count (or anything) back.
    reads = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or real_item(t))
    run_with_overflows(scaler, [(opts[0], params[:1])], {}, 1)
    assert reads == []
    run_with_overflows(scaler, list(zip(opts, [[p] for p in params])), overflow_at, 5)
    monkeypatch.undo()
    assert scaler.get_skipped_steps() == 2
    # update(new_scale) does not apply the rule, but a skipped step still counts
    params[1].grad = None
    scaler.scale(params[0].sum()).backward()
    params[0].grad[0] = math.nan
    scaler.step(opts[0])
    scaler.update(new_scale=8.0)
    assert scaler.get_skipped_steps() == 3 and scaler.get_scale() == 8.0
    assert GradScaler("cpu", enabled=False).get_skipped_steps() == 0


def test_skipped_steps_survive_checkpoints_and_torch_loads_them():
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu", init_scale=SCALE)
    run_with_overflows(scaler, [(opt, [param])], {0: [param], 2: [param]}, 4)
    saved = scaler.state_dict()
    assert saved["skipped_steps"] == 2

    for loaded_before_first_scale in (True, False):
        other = GradScaler("cpu")
        if not loaded_before_first_scale:
            other.scale(torch.ones(()))
        other.load_state_dict(saved)
        assert other.get_skipped_steps() == 2 and other.state_dict() == saved
    assert pickle.loads(pickle.dumps(scaler)).get_skipped_steps() == 2

    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)  # ignores the entries it does not know
    assert theirs.get_scale() == saved["scale"]
    scaler.load_state_dict(theirs.state_dict())  # torch's dict: the count goes on
    assert scaler.get_skipped_steps() == 2
    with pytest.raises(ValueError, match="skipped_steps"):
        scaler.load_state_dict({**saved, "skipped_steps": -1})
    assert scaler.get_skipped_steps() == 2
