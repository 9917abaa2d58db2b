"""Step plans (ampfuse.optimizers._plan): a group's op calls are reused while nothing they depend
on changed, and every change between steps gives what the full sort gives (on CPU and CUDA
params: the scan reads metadata only, never device data).

Each scenario runs twice, once as users run it and once with plans switched off (every step a
full sort, the behaviour before plans existed), and the two must agree bit for bit; the planned
run must also have skipped the full sort on its steady steps, so a plan that never holds fails.
fp32 scenarios are also checked against torch.optim."""

import pytest
import torch

from ampfuse.optimizers import (
    FusedAdagrad,
    FusedAdamW,
    FusedLAMB,
    FusedNovoGrad,
    FusedOptimizer,
    FusedSGD,
)
from ampfuse.ops import step_scan
from ampfuse.optimizers import _plan

SHAPES = [(4, 8), (8,), (3, 5, 2), (16,)]
STEPS = 6
CHANGE_AT = 3  # the change happens between step CHANGE_AT - 1 and step CHANGE_AT


def make_params(dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
            for s in SHAPES]


def set_grads(params, step, skip=()):
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
        p.grad = None if i in skip else g


def count_full_sorts(monkeypatch):
    calls = {"n": 0}
    original = FusedOptimizer._sort_into_calls

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedOptimizer, "_sort_into_calls", counting)
    return calls


def run(make, dtype, change, planned, monkeypatch, device="cpu"):
    """Steps an optimizer STEPS times, calling change(opt, params) before step CHANGE_AT.
    Returns params, state tensors and how many full sorts ran."""
    with monkeypatch.context() as m:
        if not planned:
            m.setattr(_plan.StepPlan, "build", classmethod(lambda cls, *a, **k: None))
        sorts = count_full_sorts(m)
        params = make_params(dtype, device=device)
        opt = make(params)
        for step in range(STEPS):
            if step == CHANGE_AT:
                change(opt, params)
            skip = getattr(change, "skip", lambda s: ())(step)
            set_grads(params, step, skip)
            opt.step()
        state = [
            {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for p in params
        ]
        return [p.detach().clone() for p in params], state, sorts["n"]


def replace_state_dict(opt, params):
    opt.state[params[1]] = {}


def replace_momentum(opt, params):
    """Replaces each param's first state tensor (momentum buffer, first moment, Adagrad sum)."""
    for p in params:
        key = next(k for k in ("momentum_buffer", "exp_avg", "sum") if k in opt.state[p])
        opt.state[p][key] = torch.full_like(opt.state[p][key], 0.25)


def write_param_in_place(opt, params):
    with torch.no_grad():
        params[2].mul_(0.5)


def replace_param_data(opt, params):
    params[0].data = params[0].data * 2


def change_layout(opt, params):
    params[2].data = params[2].data.transpose(0, 2).contiguous().transpose(0, 2)


def append_param(opt, params):
    extra = torch.nn.Parameter(torch.ones(5, dtype=params[0].dtype, device=params[0].device))
    extra.grad = torch.full_like(extra, 0.5)
    params.append(extra)
    opt.param_groups[0]["params"].append(extra)


def replace_step(opt, params):
    for p in params[:2]:
        opt.state[p]["step"] = opt.state[p]["step"].clone()


def drop_a_grad(opt, params):
    pass


drop_a_grad.skip = lambda step: (1,) if step >= CHANGE_AT else ()


def load_own_state_dict(opt, params):
    saved = opt.state_dict()
    with torch.no_grad():
        for p in params:
            p.add_(0.125)
    opt.load_state_dict(saved)


CHANGES = {
    "none": lambda opt, params: None,
    "replace_state_dict": replace_state_dict,
    "replace_momentum": replace_momentum,
    "write_param_in_place": write_param_in_place,
    "replace_param_data": replace_param_data,
    "change_layout": change_layout,
    "append_param": append_param,
    "replace_step": replace_step,
    "drop_a_grad": drop_a_grad,
    "load_own_state_dict": load_own_state_dict,
}

OPTIMIZERS = {
    "sgd": lambda master: (
        lambda params: FusedSGD(params, lr=0.1, momentum=0.9, master_weights=master)
    ),
    "adamw": lambda master: (
        lambda params: FusedAdamW(params, lr=0.01, weight_decay=0.1, master_weights=master)
    ),
    "lamb": lambda master: (
        lambda params: FusedLAMB(params, lr=0.01, weight_decay=0.1, max_grad_norm=0.5,
                                 master_weights=master)
    ),
    "adagrad": lambda master: (
        lambda params: FusedAdagrad(params, lr=0.1, weight_decay=0.1, master_weights=master)
    ),
    "novograd": lambda master: (
        lambda params: FusedNovoGrad(params, lr=0.01, weight_decay=0.1, master_weights=master)
    ),
}


# (param dtype, master_weights): fp32 steps without masters, fp16 and bf16 with fp32 masters,
# bf16 in the three master-free modes.
PRECISIONS = {
    "fp32": (torch.float32, False),
    "fp16": (torch.float16, True),
    "bf16": (torch.bfloat16, True),
    "bf16-stochastic": (torch.bfloat16, "stochastic"),
    "bf16-kahan": (torch.bfloat16, "kahan"),
    "bf16-split": (torch.bfloat16, "split"),
}


# Every optimizer with every precision: all of them take the master-free bf16 modes.
OPTIMIZER_PRECISIONS = [(name, precision) for name in OPTIMIZERS for precision in PRECISIONS]


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("name,precision", OPTIMIZER_PRECISIONS)
def test_planned_steps_match_full_sorts(monkeypatch, device, name, precision, change):
    dtype, master = PRECISIONS[precision]
    make = OPTIMIZERS[name](master)
    planned = run(make, dtype, CHANGES[change], True, monkeypatch, device)
    full = run(make, dtype, CHANGES[change], False, monkeypatch, device)
    for i, (a, b) in enumerate(zip(planned[0], full[0])):
        assert torch.equal(a, b), f"params[{i}] differ between planned and full-sort steps"
    for i, (a, b) in enumerate(zip(planned[1], full[1])):
        assert a.keys() == b.keys(), f"params[{i}] state keys differ"
        for key in a:
            assert torch.equal(a[key], b[key]), f"params[{i}] state {key!r} differs"
    assert full[2] == STEPS
    # Two sorts at most: the first step, and the step after the change. Without the C++
    # scanner (a wheel install) no plan is made and every step sorts.
    if step_scan.NATIVE:
        assert planned[2] <= 2, f"{planned[2]} full sorts in {STEPS} steps: plans were not reused"
    else:
        assert planned[2] == STEPS


@pytest.mark.parametrize("change", ["replace_state_dict", "replace_momentum", "drop_a_grad",
                                    "append_param", "change_layout", "replace_param_data"])
def test_planned_sgd_matches_torch(monkeypatch, change):
    """The same changes made to torch.optim.SGD give the same params (fp32)."""
    ours = run(OPTIMIZERS["sgd"](False), torch.float32, CHANGES[change], True, monkeypatch)

    params = make_params(torch.float32)
    ref = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    for step in range(STEPS):
        if step == CHANGE_AT:
            CHANGES[change](ref, params)
        skip = getattr(CHANGES[change], "skip", lambda s: ())(step)
        set_grads(params, step, skip)
        ref.step()
    for i, (a, b) in enumerate(zip(ours[0], params)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6,
                                   msg=f"params[{i}] after {change}")


def test_subclass_params_keep_the_full_sort(monkeypatch):
    """Params that are Tensor subclasses (DTensor is one) are never planned, in the optimizer
    and in scan_step, and step as plain params do."""

    class Sub(torch.Tensor):
        pass

    sorts = count_full_sorts(monkeypatch)
    plain = make_params(torch.float32)
    subs = [torch.Tensor._make_subclass(Sub, p.detach().clone(), True) for p in plain]
    results = []
    for params in (plain, subs):
        opt = FusedSGD(params, lr=0.1, momentum=0.9)
        for step in range(3):
            set_grads(params, step)
            opt.step()
        results.append([p.detach().clone().as_subclass(torch.Tensor) for p in params])
    # Plain params sort once (at every step without the C++ scanner), subclass params at every
    # step.
    assert sorts["n"] == (1 if step_scan.NATIVE else 3) + 3
    assert opt._step_plans[0] is None
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_python_stand_ins_always_decline(monkeypatch):
    """Without the C++ scanner (a wheel install) every step takes the Python path, with the
    same results: the stand-ins only ever say "not confirmed" and "marked none"."""
    from ampfuse.ops import step_scan

    plain = torch.zeros(2)
    assert step_scan._python_scan_step([plain], {}, ((plain,),)) is None
    assert step_scan._python_mark_params([plain], [object()]) is False


def test_scan_step_refuses_a_dispatching_subclass():
    class Wrapped(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise AssertionError("scan_step must not dispatch")

    _C = pytest.importorskip("ampfuse.ops._step_scan", reason="no C++ step scanner (a wheel)")

    wrapped = torch.Tensor._make_subclass(Wrapped, torch.zeros(2))
    assert _C.scan_step([wrapped], {}, ((wrapped,),)) is None
    plain = torch.zeros(2)
    assert _C.scan_step([plain], {}, ((plain,),)) == []
    # Containers other than torch.optim's own are left to the Python loop, not refused.
    assert _C.scan_step((plain,), {}, ((plain,),)) is None
    assert _C.scan_step([plain], object(), ((plain,),)) is None
    assert _C.scan_step([plain], {}, [(plain,)]) is None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_plan_does_not_keep_grads_alive(name):
    """zero_grad(set_to_none=True) frees the grads even though the plan keeps its calls: a
    plan holding them would add a whole set of grads to the next backward's peak memory."""
    import gc
    import weakref

    params = make_params(torch.float16)
    opt = OPTIMIZERS[name](True)(params)
    for step in range(3):  # the first full sort, then planned steps
        set_grads(params, step)
        refs = [weakref.ref(p.grad) for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert not alive, f"step {step}: grads of params {alive} outlived zero_grad"
    assert (opt._step_plans[0] is not None) == step_scan.NATIVE


def test_stochastic_param_ids_follow_an_earlier_group_growing(monkeypatch):
    """master_weights="stochastic" keys each param's random bits by its index in the optimizer:
    a param added to an earlier group shifts the ids of every later group, and a plan must not
    keep the old ones."""

    def make(params):
        return FusedAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=0.01,
                          master_weights="stochastic")

    def grow_first_group(opt, params):
        extra = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16))
        params.append(extra)  # set_grads gives it a grad; its place in the optimizer is group 0
        opt.param_groups[0]["params"].append(extra)

    planned = run(make, torch.bfloat16, grow_first_group, True, monkeypatch)
    full = run(make, torch.bfloat16, grow_first_group, False, monkeypatch)
    for i, (a, b) in enumerate(zip(planned[0], full[0])):
        assert torch.equal(a, b), f"params[{i}] differ between planned and full-sort steps"
    if step_scan.NATIVE:  # two groups: a sort each at the first step and after the change
        assert planned[2] <= 4
