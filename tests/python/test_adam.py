"""ampfuse.optimizers.FusedAdam / FusedAdamW against torch.optim.Adam / AdamW.

Parity: the same grads drive both for 100 steps and params and moments agree to a max relative
difference of 1e-5 (relative to the tensor's largest magnitude, so values crossing zero do not
blow the ratio up). With master_weights the fp32 masters follow torch's fp32 optimizer fed the
upcast low-precision grads, and the low-precision params equal the masters rounded, bit for bit.
A skipped step (found_inf) leaves every tensor bit-identical. The helpers at the top are shared
with test_sgd.py, test_optimizer_state.py and others. Bad input is tested in
test_adam_bad_input.py; several devices, CUDA graphs and torch.compile in
test_adam_graphs_compile.py.
"""

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedAdam, FusedAdamW
from helpers import dtype_id, make_generator, torch_scaler_class
from tolerances import assert_close_report

PARITY_RTOL = 1e-5
STEPS = 100
LOW_DTYPES = (torch.bfloat16, torch.float16)
# Several sizes and ranks and one empty tensor (chunking is test_*_op territory; torch.optim.Adam
# on the CPU is slow enough that 100 steps over large tensors would dominate the suite).
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]

# ---- helpers shared by the optimizer tests --------------------------------------------------


def make_params(shapes, dtypes, device, seed=0):
    """Leaf params with N(0, 1) values (made on the CPU, so every device sees the same numbers);
    `dtypes` is one dtype or a sequence cycled over the shapes."""
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    gen = make_generator(seed)
    return [
        torch.randn(shape, generator=gen).to(dtypes[i % len(dtypes)]).to(device).requires_grad_()
        for i, shape in enumerate(shapes)
    ]


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def step_grads(params, step, seed=1, scale=1.0):
    """Deterministic N(0, scale^2) grads for step `step`, one per param, in the param's dtype."""
    gen = make_generator(seed * 100_003 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype).to(p.device) for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.detach().clone().to(p.dtype)


def assert_parity(actual, expected, msg, rtol=PARITY_RTOL):
    """Max |actual - expected| within rtol of the largest |expected| (and rtol elementwise)."""
    expected = expected.detach().float().cpu()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    actual = actual.detach().float().cpu()
    assert_close_report(actual, expected, rtol=rtol, atol=rtol * scale + 1e-30, msg=msg)


def assert_rounded(params, masters):
    """Each param is its master rounded to the param's dtype, bit for bit."""
    for i, (p, m) in enumerate(zip(params, masters)):
        assert m.dtype == torch.float32
        assert_close_report(p.detach(), m.to(p.dtype), exact=True,
                            msg=f"param {i} vs master rounded")


def state_tensors(opt):
    """Every tensor in the optimizer state, keyed (param index, key), for bit-exact snapshots."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[(gi, pi, key)] = value
    return out


def snapshot(opt, params):
    tensors = {("param", i): p.detach() for i, p in enumerate(params)}
    tensors.update(state_tensors(opt))
    return {k: v.clone() for k, v in tensors.items()}


def assert_unchanged(opt, params, before, what):
    """Everything in `before` is bit-identical now; state created by this step (a first step)
    holds its initial values: step 0, zero moments, masters equal to the params upcast."""
    now = {("param", i): p.detach() for i, p in enumerate(params)}
    now.update(state_tensors(opt))
    assert before.keys() <= now.keys(), f"{what}: state disappeared"
    for key, value in now.items():
        if key in before:
            assert_close_report(value, before[key], exact=True, msg=f"{what}: {key}")
        elif key[2] == "master_param":
            p = opt.param_groups[key[0]]["params"][key[1]]
            assert_close_report(value, p.detach().float(), exact=True, msg=f"{what}: new {key}")
        else:
            assert not value.any(), f"{what}: new {key} is not zero"


def run_both(fused, ref, fused_params, ref_params, steps, grads_for=None, after_step=None):
    """Feeds both optimizers the same grads for `steps` steps; ref gets them upcast to its
    params' dtype. grads_for(step, params) -> list of grads (None = no grad)."""
    grads_for = grads_for or (lambda step, params: step_grads(params, step))
    for step in range(steps):
        grads = grads_for(step, fused_params)
        set_grads(fused_params, grads)
        set_grads(ref_params, grads)
        fused.step()
        ref.step()
        if after_step is not None:
            after_step(step)


# ---- parity with torch.optim -----------------------------------------------------------------

ADAM_CASES = {
    # id: (fused class, fused kwargs, torch class, torch kwargs)
    "adam": (FusedAdam, dict(adam_w_mode=False), torch.optim.Adam, {}),
    "adam_l2": (FusedAdam, dict(adam_w_mode=False, weight_decay=0.1), torch.optim.Adam,
                dict(weight_decay=0.1)),
    "adamw": (FusedAdam, dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    "adamw_class_default_wd": (FusedAdamW, {}, torch.optim.AdamW, {}),
    "amsgrad": (FusedAdam, dict(adam_w_mode=False, amsgrad=True), torch.optim.Adam,
                dict(amsgrad=True)),
    "adamw_amsgrad": (FusedAdamW, dict(amsgrad=True, weight_decay=0.05), torch.optim.AdamW,
                      dict(amsgrad=True, weight_decay=0.05)),
    "maximize": (FusedAdam, dict(adam_w_mode=False, maximize=True, weight_decay=0.1),
                 torch.optim.Adam, dict(maximize=True, weight_decay=0.1)),
    "adamw_maximize": (FusedAdamW, dict(maximize=True), torch.optim.AdamW, dict(maximize=True)),
    "betas_eps": (FusedAdam, dict(adam_w_mode=False, betas=(0.8, 0.99), eps=1e-6),
                  torch.optim.Adam, dict(betas=(0.8, 0.99), eps=1e-6)),
}


def make_pair(case, fused_params, ref_params, lr=1e-2):
    fused_cls, fused_kwargs, torch_cls, torch_kwargs = ADAM_CASES[case]
    fused = fused_cls(fused_params, lr=lr, **fused_kwargs)
    return fused, torch_cls(ref_params, lr=lr, **torch_kwargs)


def assert_adam_state_parity(fused, ref, fused_params, ref_params, amsgrad=False):
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    for i, (p, q) in enumerate(zip(fused_params, ref_params)):
        for key in keys:
            assert fused.state[p][key].dtype == torch.float32
            assert_parity(fused.state[p][key], ref.state[q][key], f"params[{i}] {key}")
        assert float(fused.state[p]["step"]) == float(ref.state[q]["step"])


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_fp32_parity_with_torch(device, case):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused, ref = make_pair(case, params, ref_params)
    run_both(fused, ref, params, ref_params, STEPS)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"{case}: params[{i}] after {STEPS} steps")
    amsgrad = ADAM_CASES[case][3].get("amsgrad", False)
    assert_adam_state_parity(fused, ref, params, ref_params, amsgrad=amsgrad)


def reference_adam_no_bias_correction(params, steps, lr, betas, eps, weight_decay):
    """Adam with bias_correction=False (apex's option; torch has none), in float64."""
    b1, b2 = betas
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for step in range(steps):
        for p, m, v, g in zip(ps, ms, vs, step_grads(params, step)):
            g = g.double()
            p.mul_(1 - lr * weight_decay)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.sub_(lr * m / (v.sqrt() + eps))
    return ps


def test_without_bias_correction_matches_float64_reference(device):
    params = make_params(SHAPES, torch.float32, device)
    start = clone_params(params)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, bias_correction=False)
    for step in range(STEPS):
        set_grads(params, step_grads(params, step))
        opt.step()
    expected = reference_adam_no_bias_correction(start, STEPS, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    for i, (p, e) in enumerate(zip(params, expected)):
        assert_parity(p, e, f"params[{i}]")


# ---- master weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["adam_l2", "adamw", "amsgrad", "maximize"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_master_weights_follow_fp32_torch(device, dtype, case):
    params = make_params(SHAPES, dtype, device)
    ref_params = clone_params(params, torch.float32)
    fused_cls, fused_kwargs, torch_cls, torch_kwargs = ADAM_CASES[case]
    fused = fused_cls(params, lr=1e-2, master_weights=True, **fused_kwargs)
    ref = torch_cls(ref_params, lr=1e-2, **torch_kwargs)

    def check(step):
        masters = [fused.state[p]["master_param"] for p in params]
        assert_rounded(params, masters)
        if step % 10 == 9:
            for i, (m, q) in enumerate(zip(masters, ref_params)):
                assert_parity(m, q, f"{dtype_id(dtype)} {case}: master {i} after {step + 1} steps")

    run_both(fused, ref, params, ref_params, STEPS, after_step=check)
    amsgrad = torch_kwargs.get("amsgrad", False)
    assert_adam_state_parity(fused, ref, params, ref_params, amsgrad=amsgrad)


def test_master_weights_are_created_once_and_kept(device):
    params = make_params([(5, 3), (4,)], torch.bfloat16, device)
    opt = FusedAdamW(params, lr=1e-2, master_weights=True)
    set_grads(params, step_grads(params, 0))
    opt.step()
    masters = [opt.state[p]["master_param"] for p in params]
    for step in range(1, 5):
        set_grads(params, step_grads(params, step))
        opt.step()
    for p, m in zip(params, masters):
        assert opt.state[p]["master_param"] is m
    assert opt.master_params() == masters


def test_master_weights_on_fp32_params_is_a_no_op(device):
    params = make_params(SHAPES, torch.float32, device)
    plain_params = clone_params(params)
    with_masters = FusedAdamW(params, lr=1e-2, master_weights=True)
    plain = FusedAdamW(plain_params, lr=1e-2)
    run_both(with_masters, plain, params, plain_params, 10)
    for p, q in zip(params, plain_params):
        assert "master_param" not in with_masters.state[p]
        assert_close_report(p.detach(), q.detach(), exact=True,
                            msg="fp32 param with master_weights")
    assert all(m is p for m, p in zip(with_masters.master_params(), params))


@pytest.mark.parametrize("master_weights", [True, False], ids=["masters", "no_masters"])
def test_mixed_dtypes_in_one_group(device, master_weights):
    """fp32, bf16 and fp16 params in one group. With masters each low-precision master follows
    fp32 torch; without, each low-precision param is updated in fp32 math and rounded every step,
    which the reference reproduces by rounding its fp32 copy the same way."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    params = make_params(SHAPES, dtypes, device)
    ref_params = clone_params(params, torch.float32)
    fused = FusedAdamW(params, lr=1e-2, master_weights=master_weights)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)

    def round_like_fused(step):
        if not master_weights:
            with torch.no_grad():
                for p, q in zip(params, ref_params):
                    q.copy_(q.to(p.dtype))

    run_both(fused, ref, params, ref_params, STEPS, after_step=round_like_fused)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        if master_weights and p.dtype != torch.float32:
            assert_parity(fused.state[p]["master_param"], q, f"master {i}")
            assert_rounded([p], [fused.state[p]["master_param"]])
        elif p.dtype == torch.float32:
            assert_parity(p, q, f"params[{i}] fp32")
        else:
            # A rare tie can round the other way and shift later steps by one unit of the dtype.
            assert_parity(p, q, f"params[{i}] {dtype_id(p.dtype)}",
                          rtol=2 * torch.finfo(p.dtype).eps)
        assert fused.state[p]["exp_avg"].dtype == torch.float32


# ---- groups, schedulers, missing grads, zero_grad -----------------------------------------


def test_param_groups_with_own_hyperparameters_and_add_param_group(device):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)

    def groups(ps):
        return [{"params": ps[:2], "lr": 1e-2, "weight_decay": 0.1},
                {"params": ps[2:4], "lr": 3e-3, "betas": (0.8, 0.95)}]

    fused = FusedAdam(groups(params), lr=1e-3, adam_w_mode=False)
    ref = torch.optim.Adam(groups(ref_params), lr=1e-3)

    def add_late_group(step):
        if step == 9:
            fused.add_param_group({"params": params[4:], "lr": 5e-3, "amsgrad": True})
            ref.add_param_group({"params": ref_params[4:], "lr": 5e-3, "amsgrad": True})

    run_both(fused, ref, params, ref_params, 40, after_step=add_late_group)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")
    assert len(fused.param_groups) == 3


def test_step_lr_scheduler_parity(device):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused, ref = make_pair("adamw", params, ref_params, lr=3e-2)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) for o in (fused, ref)]

    def advance(step):
        for s in schedulers:
            s.step()
        assert fused.param_groups[0]["lr"] == ref.param_groups[0]["lr"]

    run_both(fused, ref, params, ref_params, 50, after_step=advance)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")


def test_params_without_grad_are_skipped_like_torch(device):
    """A param with no grad neither moves nor counts the step, as in torch.optim: params[1]
    misses every third step and params[3] gets its first grad at step 10."""
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    fused, ref = make_pair("adam_l2", params, ref_params)
    before = params[3].detach().clone()

    def grads_for(step, ps):
        grads = step_grads(ps, step)
        if step % 3 == 0:
            grads[1] = None
        if step < 10:
            grads[3] = None
        return grads

    def check(step):
        if step < 10:
            assert_close_report(params[3].detach(), before, exact=True, msg="param without grad")
            assert params[3] not in fused.state

    run_both(fused, ref, params, ref_params, 40, grads_for=grads_for, after_step=check)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_parity(p, q, f"params[{i}]")
        assert float(fused.state[p]["step"]) == float(ref.state[q]["step"]), f"params[{i}] step"


def test_params_that_always_step_together_share_one_step_tensor(device):
    params = make_params(SHAPES, torch.float32, device)
    opt = FusedAdamW(params, lr=1e-2)
    for step in range(3):
        set_grads(params, step_grads(params, step))
        opt.step()
    steps = {id(opt.state[p]["step"]) for p in params}
    assert len(steps) == 1
    assert float(opt.state[params[0]]["step"]) == 3.0


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad(device, set_grad_none):
    params = make_params([(4, 3), (5,)], torch.float32, device)
    opt = FusedAdam(params, set_grad_none=set_grad_none)
    set_grads(params, step_grads(params, 0))
    opt.zero_grad()
    for p in params:
        if set_grad_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()
    set_grads(params, step_grads(params, 1))
    opt.zero_grad(set_to_none=not set_grad_none)
    for p in params:
        assert (p.grad is None) == (not set_grad_none)


# ---- skipped steps: found_inf and torch.amp.GradScaler --------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_DTYPES, ids=dtype_id)
def test_found_inf_kwarg_skips_everything(device, dtype):
    """Steps 0 (state just created), 7 and 19 are skipped: every tensor stays bit-identical and
    the run equals one in which those steps never happened."""
    skipped = {0, 7, 19}
    params = make_params(SHAPES, dtype, device)
    ref_params = clone_params(params, torch.float32)
    fused = FusedAdam(params, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, amsgrad=True)
    found_inf = torch.zeros((), device=device)
    for step in range(20):
        grads = step_grads(params, step)
        set_grads(params, grads)
        if step in skipped:
            before = snapshot(fused, params)
            fused.step(found_inf=found_inf.fill_(1.0))
            assert_unchanged(fused, params, before, f"skipped step {step}")
            continue
        fused.step(found_inf=found_inf.fill_(0.0))
        set_grads(ref_params, grads)
        ref.step()
    masters = fused.master_params()
    for i, (m, q) in enumerate(zip(masters, ref_params)):
        assert_parity(m, q, f"params[{i}]")
        assert float(fused.state[params[i]]["step"]) == 20 - len(skipped)


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_DTYPES, ids=dtype_id)
def test_grad_scale_kwarg_divides_the_grads(device, dtype):
    """Grads carrying a power-of-two loss scale give bit-identical results to unscaled grads."""
    params = make_params(SHAPES, dtype, device)
    plain_params = clone_params(params)
    scaled = FusedAdamW(params, lr=1e-2, master_weights=True)
    plain = FusedAdamW(plain_params, lr=1e-2, master_weights=True)
    scale = torch.full((), 1024.0, device=device)
    for step in range(10):
        grads = step_grads(params, step)
        set_grads(params, [g * 1024 for g in grads])
        set_grads(plain_params, grads)
        scaled.step(grad_scale=scale)
        plain.step()
    for p, q in zip(params, plain_params):
        assert_close_report(p.detach(), q.detach(), exact=True, msg="scaled vs unscaled grads")
        assert_close_report(scaled.state[p]["exp_avg"], plain.state[q]["exp_avg"], exact=True,
                            msg="exp_avg")


def scaler_training(opt, params, steps, poison, scaler, unscale_first=False):
    """Steps through torch.amp.GradScaler: the grads of step s are those of step_grads(s), made
    by backward through the scaled loss; poison maps a step to a value (inf/nan) written into one
    element of that step's grads. Yields (step, skipped) after each step."""
    for step in range(steps):
        targets = [g.float() for g in step_grads(params, step)]
        if step in poison:
            targets[0].view(-1)[5] = poison[step]
        opt.zero_grad()
        loss = sum((p.float() * t).sum() for p, t in zip(params, targets))
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
        before = snapshot(opt, params) if step in poison else None
        scaler.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        if before is not None:
            assert_unchanged(opt, params, before, f"step {step} with {poison[step]} in a grad")
        scaler.update()
        yield step, step in poison


# GradScaler.unscale_() refuses fp16 grads (torch's allow_fp16=False), so fp16 goes the fused
# way only.
SCALER_CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                (torch.bfloat16, True), (torch.float16, False)]


@pytest.mark.parametrize("dtype, unscale_first", SCALER_CASES,
                         ids=[f"{dtype_id(d)}-{'unscale_then_step' if u else 'fused_unscale'}"
                              for d, u in SCALER_CASES])
def test_grad_scaler_drives_the_optimizer(device, dtype, unscale_first):
    """torch.amp.GradScaler (ampfuse's for bf16 on CUDA: helpers.torch_scaler_class) with inf
    and nan injected at the first, a middle and the last step: those steps write nothing, the
    others match fp32 torch fed the unscaled grads."""
    poison = {0: float("inf"), 6: float("nan"), 11: float("-inf")}
    params = make_params(SHAPES[:4], dtype, device)
    ref_params = clone_params(params, torch.float32)
    fused = FusedAdamW(params, lr=1e-2, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    # Scaled grads must stay finite in fp16: |grad| * 1024 is far below 65504.
    scaler = torch_scaler_class(device, dtype)(device, init_scale=1024.0, growth_interval=1000)
    for step, skipped in scaler_training(fused, params, 12, poison, scaler, unscale_first):
        if not skipped:
            set_grads(ref_params, [g.float() for g in step_grads(params, step)])
            ref.step()
    assert scaler.get_scale() == 1024.0 / 2 ** len(poison)
    for i, (m, q) in enumerate(zip(fused.master_params(), ref_params)):
        assert_parity(m, q, f"params[{i}]")
    assert_adam_state_parity(fused, ref, params, ref_params)


def test_optimizer_declares_amp_scaling_support():
    assert FusedAdam._step_supports_amp_scaling is True
    assert FusedAdamW._step_supports_amp_scaling is True
