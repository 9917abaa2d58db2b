"""FusedOptimizer's public contract (its class docstring): the class is public, and callers such
as amp make, read and set fp32 masters through its methods, never through `optimizer.state`'s
entries. Each method is checked for what it returns, that a param never gets a second master,
and the errors for what it cannot take."""

import re
from pathlib import Path

import pytest
import torch
from ampfuse import amp
from ampfuse.optimizers import FusedAdam, FusedOptimizer, FusedSGD
from helpers import raises_naming

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ampfuse"


def mixed_params(device="cpu"):
    """A bf16, an fp16 and an fp32 param, with values that bf16/fp16 round."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen),
              torch.randn(2, 2, generator=gen)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    return [torch.nn.Parameter(v.to(device=device, dtype=d)) for v, d in zip(values, dtypes)]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)


# ---- the class is public ---------------------------------------------------------------------

def test_fused_optimizer_is_public_and_the_base_of_every_fused_optimizer():
    from ampfuse import optimizers
    from ampfuse.optimizers import _base

    assert "FusedOptimizer" in optimizers.__all__
    assert optimizers.FusedOptimizer is _base.FusedOptimizer
    functions = {"decode_moments"}  # the one checkpoint tool beside the optimizer classes
    for name in optimizers.__all__:
        cls = getattr(optimizers, name)
        if name in functions:
            assert callable(cls) and not isinstance(cls, type), name
            continue
        assert issubclass(cls, FusedOptimizer) and issubclass(cls, torch.optim.Optimizer), name
    for method in ("master_params", "masters_for", "masters", "set_masters",
                   "set_master_weights", "mark_masters", "follow_masters"):
        assert f"`{method}(" in FusedOptimizer.__doc__, f"the contract does not state {method}"


def _python_sources(*roots):
    for root in roots:
        yield from sorted(root.rglob("*.py"))


def test_nothing_outside_optimizers_imports_the_private_base():
    private = re.compile(r"ampfuse\.optimizers\._base\b|from ampfuse\.optimizers import _base")
    offenders = []
    for path in _python_sources(PACKAGE, ROOT / "tests", ROOT / "benchmarks"):
        if PACKAGE / "optimizers" in path.parents or path == Path(__file__).resolve():
            continue
        if private.search(path.read_text()):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_amp_does_not_touch_the_optimizers_state_layout():
    # DESIGN: amp talks to optimizers through FusedOptimizer's public methods, never their
    # state dicts. These are the entries it used to read and write itself. (Moving a
    # torch.optim optimizer's state from a param to the master amp swaps in stays: that is
    # torch.optim's own public mapping, keyed by param, not a fused optimizer's layout.)
    layout = re.compile(
        r"""["']master_param["']|\[["']master_weights["']\]|\.defaults\[|["']step["'] (not )?in """
    )
    offenders = []
    for path in _python_sources(PACKAGE / "amp"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if layout.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


# ---- masters_for ------------------------------------------------------------------------------

def test_masters_for_makes_each_master_once_from_its_param(device):
    params = mixed_params(device)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    low = params[:2]
    masters = opt.masters_for(low)
    for p, m in zip(low, masters):
        assert m.dtype == torch.float32 and m.device == p.device and m.shape == p.shape
        assert torch.equal(m, p.detach().float())
        assert m is not p
    # Asked again, in another order, and through master_params(): the same tensors.
    again = opt.masters_for(reversed(low))
    assert again[0] is masters[1] and again[1] is masters[0]
    assert opt.master_params() == [masters[0], masters[1], params[2]]
    # The step updates those masters (no second one is made) and rounds them into the params.
    set_grads(params, seed=1)
    opt.step()
    after = opt.masters_for(low)
    assert after[0] is masters[0] and after[1] is masters[1]
    for p, m in zip(low, masters):
        assert torch.equal(p.detach(), m.to(p.dtype))


def test_masters_for_equals_what_the_first_step_would_make():
    params = mixed_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    asked = FusedAdam(params, lr=1e-2, master_weights=True)
    unasked = FusedAdam(twin, lr=1e-2, master_weights=True)
    asked.masters_for(params[:2])
    for step in range(3):
        set_grads(params, seed=step)
        set_grads(twin, seed=step)
        asked.step()
        unasked.step()
    for a, b in zip(asked.master_params(), unasked.master_params()):
        assert torch.equal(a, b)


def test_masters_for_refuses_a_tensor_the_optimizer_does_not_hold():
    params = mixed_params()
    opt = FusedAdam(params, master_weights=True)
    stranger = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with raises_naming(r"FusedAdam\.masters_for", r"params\[1\]", "not a param of this optimizer",
                       "add_param_group"):
        opt.masters_for([params[0], stranger])
    assert opt.masters() == {}  # checked before any master is made


def test_masters_for_refuses_params_that_keep_no_master():
    params = mixed_params()
    opt = FusedAdam([{"params": params[:1], "master_weights": False},
                     {"params": params[1:]}], master_weights=True)
    with raises_naming(r"param_groups\[1\]\['params'\]\[1\]", "torch.float32",
                       "updates directly"):
        opt.masters_for([params[1], params[2]])
    with raises_naming(r"param_groups\[0\]\['params'\]\[0\]", "keeps no fp32 master",
                       "master_weights=False", r"set_master_weights\(True\)"):
        opt.masters_for([params[0]])
    assert opt.masters() == {}


# ---- masters ----------------------------------------------------------------------------------

def test_masters_reads_without_making_and_tells_the_unstepped_ones_apart():
    params = mixed_params()
    opt = FusedAdam(params[:2], lr=1e-2, master_weights=True)
    assert opt.masters() == {} and len(opt.state) == 0  # makes nothing, not even empty state
    set_grads(params[:1], seed=0)
    params[1].grad = None
    opt.step()  # only the bf16 param steps
    stepped = opt.masters()
    assert list(stepped) == [params[0]] and opt.masters(unstepped_only=True) == {}
    (made,) = opt.masters_for([params[1]])  # a master, but no step yet
    everything = opt.masters()
    assert list(everything) == [params[0], params[1]]  # param-group order
    assert everything[params[0]] is stepped[params[0]] and everything[params[1]] is made
    unstepped = opt.masters(unstepped_only=True)
    assert list(unstepped) == [params[1]] and unstepped[params[1]] is made
    # Those are the masters state_dict() leaves out, as its contract says.
    assert set(opt.state_dict()["state"]) == {0}


# ---- set_masters ------------------------------------------------------------------------------

def test_set_masters_takes_the_tensor_and_the_step_starts_from_it():
    exact = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    low = torch.nn.Parameter(exact.bfloat16())
    full = torch.nn.Parameter(exact.clone())  # the same weights, never rounded
    opt = FusedAdam([low], lr=1e-2, master_weights=True)
    reference = FusedAdam([full], lr=1e-2)
    master = exact.clone()
    opt.set_masters({low: master})
    assert opt.masters() == {low: master} and opt.masters_for([low])[0] is master
    grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(4)).bfloat16()
    low.grad, full.grad = grad, grad.float()
    opt.step()
    reference.step()
    assert opt.masters()[low] is master  # updated in place
    assert torch.equal(master, full.detach())  # from the exact weights, not their rounding
    assert torch.equal(low.detach(), full.detach().bfloat16())


def test_set_masters_replaces_a_master_unless_told_to_keep_stepped_ones():
    params = mixed_params()
    opt = FusedAdam(params[:2], lr=1e-2, master_weights=True)
    set_grads(params[:1], seed=0)
    params[1].grad = None
    opt.step()
    stepped = opt.masters()[params[0]]
    new = {p: torch.full(p.shape, 0.5) for p in params[:2]}
    opt.set_masters(new, keep_stepped=True)
    assert opt.masters()[params[0]] is stepped  # stepped: its own state stays
    assert opt.masters()[params[1]] is new[params[1]]  # no step yet: takes the given one
    opt.set_masters(new)
    assert opt.masters()[params[0]] is new[params[0]]


@pytest.mark.parametrize("bad, pattern", [
    (lambda p: torch.zeros(p.shape, dtype=torch.float64), "torch.float64"),
    (lambda p: torch.zeros(3), r"shape \(3,\)"),
    (lambda p: torch.zeros(p.shape, device="meta"), "on meta"),
    (lambda p: 0.5, "of type float"),
])
def test_set_masters_refuses_what_cannot_be_a_master(bad, pattern):
    params = mixed_params()
    opt = FusedSGD(params, lr=0.1, master_weights=True)
    good = torch.zeros(params[0].shape)
    with raises_naming(r"FusedSGD\.set_masters", r"param_groups\[0\]\['params'\]\[1\]", pattern,
                       r"torch\.float32 tensor of its param's shape \(5,\)"):
        opt.set_masters({params[0]: good, params[1]: bad(params[1])})
    assert opt.masters() == {}  # everything is checked before anything is set


def test_set_masters_refuses_a_tensor_the_optimizer_does_not_hold():
    params = mixed_params()
    opt = FusedAdam(params, master_weights=True)
    stranger = torch.zeros(7, dtype=torch.bfloat16)
    with raises_naming(r"FusedAdam\.set_masters", "a key of values", r"shape \(7,\)",
                       "not a param of this optimizer"):
        opt.set_masters({stranger: torch.zeros(7)})


# ---- set_master_weights -----------------------------------------------------------------------

def test_set_master_weights_reaches_every_group_and_later_ones():
    params = mixed_params()
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:2], "master_weights": False}],
                    lr=1e-2, master_weights=False)
    opt.set_master_weights(True)
    assert [g["master_weights"] for g in opt.param_groups] == [True, True]
    extra = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[-1]["master_weights"] is True
    set_grads(params[:2] + [extra], seed=0)
    opt.step()
    assert list(opt.masters()) == [params[0], params[1], extra]


def test_set_master_weights_refuses_a_bad_mode_and_changes_nothing():
    params = mixed_params()
    opt = FusedAdam(params, master_weights=True)
    with raises_naming(r"FusedAdam\.set_master_weights", "mode='fp32'", "'stochastic'"):
        opt.set_master_weights("fp32")
    # A bf16 mode takes no fp16 param (params[1]).
    with raises_naming(r"param_groups\[0\]\['params'\]\[1\]", "torch.float16"):
        opt.set_master_weights("kahan")
    assert opt.defaults["master_weights"] is True
    assert opt.param_groups[0]["master_weights"] is True


# ---- step_on_master_grads ---------------------------------------------------------------------

def test_step_on_master_grads_steps_on_the_masters_fp32_grads():
    exact = torch.randn(8, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 1e-3
    on_masters = torch.nn.Parameter(exact.bfloat16())
    on_params = torch.nn.Parameter(exact.bfloat16())
    a = FusedSGD([on_masters], lr=0.5, master_weights=True)
    b = FusedSGD([on_params], lr=0.5, master_weights=True)
    assert FusedOptimizer.step_on_master_grads is False and a.step_on_master_grads is False
    (master,) = a.masters_for([on_masters])
    on_masters.grad = torch.full((8,), 1e3, dtype=torch.bfloat16)  # would be used without it
    master.grad = grad.clone()
    a.step_on_master_grads = True
    a.step()
    on_params.grad = grad.bfloat16()  # what the param's own grad would carry: rounded
    b.step()
    assert torch.equal(master, exact.bfloat16().float() - 0.5 * grad)
    assert not torch.equal(b.masters()[on_params], master)


# ---- amp goes through the contract ------------------------------------------------------------

def test_amp_o2_gives_a_fused_optimizer_masters_from_the_fp32_weights():
    model = torch.nn.Linear(4, 3)
    exact = [p.detach().clone() for p in model.parameters()]
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                verbosity=0)
    assert opt.param_groups[0]["master_weights"] is True
    masters = opt.masters()
    assert list(masters) == list(model.parameters())
    for p, value in zip(model.parameters(), exact):
        assert p.dtype == torch.bfloat16
        assert torch.equal(masters[p], value)  # the fp32 weights, not their rounding
        assert not torch.equal(masters[p], p.detach().float())
    assert opt.masters_for(list(model.parameters())) == list(masters.values())
