"""ampfuse.optimizers.FusedLAMB against a float64 LAMB written from apex.optimizers.FusedLAMB's
kernels (csrc/multi_tensor_lamb.cu in apex): the global grad norm over every group, the clip
max(1, norm / max_grad_norm), Adam moments with grad_averaging, the L2 or decoupled decay, and the
per-tensor trust ratio ||p|| / ||update||, applied only with weight decay unless use_nvlamb.

Parity: 20 steps, params and moments within 1e-5 of the largest magnitude of the reference.
With master_weights the fp32 masters follow the reference fed the upcast low-precision grads,
and the params equal the masters rounded, bit for bit. The op itself (opcheck, errors, inf/nan
positions, threads) is tested in test_lamb_op.py.
"""

import itertools
import math
import pathlib
import sys

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
from ampfuse.optimizers import FusedLAMB
from helpers import dtype_id, raises_naming
from test_adam import assert_parity, clone_params, make_params, set_grads, step_grads

STEPS = 20
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2), (0,), (129, 2)]


def reference_lamb(params, groups, grads_per_step, lr, betas=(0.9, 0.999), eps=1e-6,
                   weight_decay=0.01, adam_w_mode=True, bias_correction=True,
                   grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False):
    """float64 LAMB in apex's order of operations. `groups` lists the param indices of each
    group (one step count per group, as apex keeps it); grads_per_step[s][i] is param i's grad
    at step s (None: no grad, the param does not step, as in apex). Returns params, m, v."""
    p64 = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in p64]
    v = [torch.zeros_like(p) for p in p64]
    steps = [0] * len(groups)
    beta1, beta2 = betas
    for grads in grads_per_step:
        g64 = [None if g is None else g.double() for g in grads]
        norm = math.sqrt(sum(float(g.square().sum()) for g in g64 if g is not None))
        clip = norm / max_grad_norm if max_grad_norm and norm > max_grad_norm else 1.0
        for gi, members in enumerate(groups):
            steps[gi] += 1
            t = steps[gi]
            bc1 = 1 - beta1 ** t if bias_correction else 1.0
            bc2 = 1 - beta2 ** t if bias_correction else 1.0
            beta3 = 1 - beta1 if grad_averaging else 1.0
            for i in members:
                if g64[i] is None:
                    continue
                g = g64[i] / clip
                if not adam_w_mode:
                    g = g + weight_decay * p64[i]
                m[i] = m[i] * beta1 + beta3 * g
                v[i] = v[i] * beta2 + (1 - beta2) * g * g
                update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
                if adam_w_mode:
                    update = update + weight_decay * p64[i]
                ratio = lr
                if use_nvlamb or weight_decay != 0:
                    pn, un = float(p64[i].norm()), float(update.norm())
                    if pn != 0 and un != 0:
                        ratio = lr * pn / un
                p64[i] = p64[i] - ratio * update
    return p64, m, v


def run_fused(params, groups, grads_per_step, **options):
    param_groups = [{"params": [params[i] for i in members]} for members in groups]
    opt = FusedLAMB(param_groups, **options)
    for grads in grads_per_step:
        set_grads(params, grads)
        opt.step()
    return opt


OPTION_SETS = {
    "apex_defaults": {},
    "l2_mode": {"adam_w_mode": False},
    "no_decay": {"weight_decay": 0.0},
    "nvlamb_no_decay": {"weight_decay": 0.0, "use_nvlamb": True},
    "no_averaging_no_bias": {"grad_averaging": False, "bias_correction": False},
    "no_clip": {"max_grad_norm": None},
    "tight_clip": {"max_grad_norm": 0.05},
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_fp32_matches_the_float64_reference(device, options):
    params = make_params(SHAPES, torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s, scale=3.0) for s in range(STEPS)]
    groups = [[0, 1, 2], [3, 4, 5]]
    opt = run_fused(params, groups, grads, lr=1e-2, **options)
    expected, m, v = reference_lamb(ref_params, groups, grads, lr=1e-2, **options)
    for i, p in enumerate(params):
        assert_parity(p, expected[i], f"param {i}")
        if p.numel():
            assert_parity(opt.state[p]["exp_avg"], m[i], f"exp_avg {i}")
            assert_parity(opt.state[p]["exp_avg_sq"], v[i], f"exp_avg_sq {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_fp32_masters_follow_the_reference_and_params_are_them_rounded(device, dtype):
    params = make_params(SHAPES, dtype, device)
    grads = [step_grads(params, s) for s in range(STEPS)]
    opt = run_fused(params, [list(range(len(params)))], grads, lr=1e-2, master_weights=True)
    expected, _, _ = reference_lamb(params_at_start(dtype, device), [list(range(len(params)))],
                                    grads, lr=1e-2)
    for i, p in enumerate(params):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert_parity(master, expected[i], f"master {i}")
        assert torch.equal(p.detach(), master.to(dtype)), f"param {i} is not its master rounded"


def params_at_start(dtype, device):
    return make_params(SHAPES, dtype, device)


def test_a_zero_param_moves_by_lr_not_by_a_zero_trust_ratio(device):
    """Zero-initialized params (biases) have ||p|| = 0: the trust ratio falls back to lr, as in
    apex, rather than 0, which would pin them at zero forever."""
    params = [torch.zeros(12, device=device, requires_grad=True),
              torch.ones(5, device=device, requires_grad=True)]
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(3)]
    run_fused(params, [[0, 1]], grads, lr=1e-2)
    expected, _, _ = reference_lamb(ref_params, [[0, 1]], grads, lr=1e-2)
    assert params[0].abs().min() > 0
    for p, e in zip(params, expected):
        assert_parity(p, e, "param")


def test_params_without_grads_keep_their_state_and_count(device):
    """apex's lists skip params without a grad; their moments and step count stay."""
    params = make_params([(10,), (20,)], torch.float32, device)
    ref_params = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    grads[1][1] = None
    grads[2][1] = None
    opt = run_fused(params, [[0, 1]], grads, lr=1e-2)
    assert float(opt.state[params[0]]["step"]) == 4.0
    assert float(opt.state[params[1]]["step"]) == 2.0
    # The reference counts one step per group, as apex does: only param 0, which always steps,
    # is comparable. The grad norm of steps 1 and 2 is param 0's alone in both.
    expected, _, _ = reference_lamb(ref_params, [[0, 1]], grads, lr=1e-2)
    assert_parity(params[0], expected[0], "param 0")


def test_the_grad_norm_spans_every_group(device):
    """One global norm for the whole step: splitting the params into groups changes nothing."""
    params = make_params(SHAPES, torch.float32, device)
    split = clone_params(params)
    grads = [step_grads(params, s, scale=5.0) for s in range(5)]
    run_fused(params, [list(range(len(params)))], grads, lr=1e-2)
    run_fused(split, [[0, 1], [2, 3], [4, 5]], grads, lr=1e-2)
    for a, b in zip(params, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_scaled_grads_give_the_unscaled_result_bit_for_bit(device, dtype):
    """A power-of-two loss scale divides out exactly: the norm and every grad."""
    params = make_params(SHAPES, dtype, device)
    scaled = clone_params(params)
    opt = FusedLAMB(params, lr=1e-2, master_weights=True)
    opt_scaled = FusedLAMB(scaled, lr=1e-2, master_weights=True)
    scale = torch.full((1,), 1024.0, device=device)
    for s in range(5):
        grads = step_grads(params, s)
        set_grads(params, grads)
        opt.step()
        set_grads(scaled, [g * 1024 for g in grads])
        opt_scaled.step(grad_scale=scale)
        for p, q in zip(params, scaled):
            assert torch.equal(q.grad, p.grad), "the unscaled grads are written back"
    for a, b in zip(params, scaled):
        assert torch.equal(a, b)


def test_a_torch_grad_scaler_drives_it(device):
    params = make_params(SHAPES, torch.float32, device)
    plain = clone_params(params)
    opt, opt_plain = FusedLAMB(params, lr=1e-2), FusedLAMB(plain, lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
    for s in range(3):
        grads = step_grads(params, s)
        # d/dp of sum(p * g) is g: backward of the scaled loss leaves g * scale in p.grad.
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        scaler.scale(loss).backward()
        scaler.step(opt)
        opt.zero_grad()
        scaler.update()
        set_grads(plain, grads)
        opt_plain.step()
    for a, b in zip(params, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_skip_nonfinite_leaves_everything_as_it_was(device, bad, position):
    params = make_params([(100,), (65537,), (9,)], torch.float16, device)
    opt = FusedLAMB(params, lr=1e-2, master_weights=True, skip_nonfinite=True)
    set_grads(params, step_grads(params, 0))
    opt.step()
    before = {k: [opt.state[p][k].clone() for p in params]
              for k in ("exp_avg", "exp_avg_sq", "master_param", "step")}
    values = [p.detach().clone() for p in params]
    grads = step_grads(params, 1)
    index = {"first": 0, "middle": grads[1].numel() // 2, "last": grads[1].numel() - 1}[position]
    grads[1][index] = bad
    set_grads(params, grads)
    opt.step()
    assert bool(opt.last_step_skipped)
    for p, value in zip(params, values):
        assert torch.equal(p.detach(), value)
    for key, tensors in before.items():
        for p, t in zip(params, tensors):
            assert torch.equal(opt.state[p][key], t), key


def compiled_steps_match_eager(device, backend):
    """A torch.compile(fullgraph=True) FusedLAMB step (grad norm included) gives the eager
    step's bits, masters and bf16 params alike."""
    params = make_params(SHAPES, torch.bfloat16, device)
    eager = clone_params(params)
    opts = [FusedLAMB(p, lr=1e-2, master_weights=True) for p in (params, eager)]

    @torch.compile(backend=backend, fullgraph=True)
    def compiled_step():
        opts[0].step()

    for s in range(4):
        grads = step_grads(params, s, scale=5.0)
        set_grads(params, grads)
        set_grads(eager, grads)
        compiled_step()
        opts[1].step()
    for a, b in zip(params, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_matches_eager_cpu(backend):
    compiled_steps_match_eager("cpu", backend)


@pytest.mark.cuda
def test_compiled_step_matches_eager_cuda():
    compiled_steps_match_eager("cuda", "inductor")


def test_state_dict_resume_is_bit_for_bit(device):
    params = make_params(SHAPES, torch.bfloat16, device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(6)]
    opt = run_fused(params, [[0, 1, 2], [3, 4, 5]], grads, lr=1e-2, master_weights=True)

    first = run_fused(resumed, [[0, 1, 2], [3, 4, 5]], grads[:3], lr=1e-2, master_weights=True)
    saved = first.state_dict()
    assert [g["step"] for g in saved["param_groups"]] == [3, 3], "apex's per-group step"
    again = FusedLAMB([{"params": resumed[:3]}, {"params": resumed[3:]}], lr=1e-2,
                      master_weights=True)
    again.load_state_dict(saved)
    for g in grads[3:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert torch.equal(opt.state[params[0]]["master_param"],
                       again.state[resumed[0]]["master_param"])


def test_loads_an_apex_fused_lamb_checkpoint(device):
    """apex keeps the step count as an int in each param group and moments in the param's
    dtype; loading it continues with fp32 moments and the right bias correction."""
    params = make_params([(30,), (4, 5)], torch.float32, device)
    resumed = clone_params(params)
    grads = [step_grads(params, s) for s in range(4)]
    run_fused(params, [[0, 1]], grads, lr=1e-2)
    first = run_fused(resumed, [[0, 1]], grads[:2], lr=1e-2)
    ours = first.state_dict()
    apex_style = {
        "state": {i: {"exp_avg": s["exp_avg"].half(), "exp_avg_sq": s["exp_avg_sq"].clone()}
                  for i, s in ours["state"].items()},
        "param_groups": [dict({k: v for k, v in g.items() if k != "step"}, step=2)
                         for g in ours["param_groups"]],
    }
    again = FusedLAMB(resumed, lr=1e-2)
    again.load_state_dict(apex_style)
    assert float(again.state[resumed[0]]["step"]) == 2.0
    assert "step" not in again.param_groups[0]
    assert again.state[resumed[0]]["exp_avg"].dtype == torch.float32
    for g in grads[2:]:
        set_grads(resumed, g)
        again.step()
    for a, b in zip(params, resumed):
        assert_parity(b, a, "resumed from an apex checkpoint", rtol=1e-3)


def _train_tiny_mlp(opt_level=None, steps=30):
    """Losses of a small regression trained by FusedLAMB, plain fp32 or under amp (bf16)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = FusedLAMB(model.parameters(), lr=5e-2)
    if opt_level is not None:
        model, opt = ampfuse.amp.initialize(model, opt, opt_level=opt_level,
                                            dtype=torch.bfloat16, verbosity=0)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if opt_level is None:
            loss.backward()
        else:
            with ampfuse.amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_like_fp32(opt_level):
    _, _, fp32 = _train_tiny_mlp()
    model, opt, losses = _train_tiny_mlp(opt_level)
    assert fp32[-1] < 0.8 * fp32[0], fp32
    assert abs(losses[-1] - fp32[-1]) < 0.05 * fp32[-1], (losses[-1], fp32[-1])
    if opt_level == "O2":
        p = model[0].weight
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


def test_apex_alias_gives_fused_lamb_with_apex_positional_order():
    from ampfuse.apex_compat.apex import optimizers as apex_optimizers

    params = make_params([(8,)], torch.float32, "cpu")
    opt = apex_optimizers.FusedLAMB(params, 1e-3, True, (0.8, 0.9), 1e-5, 0.1, False, False,
                                    True, False, 2.0, True)
    group = opt.param_groups[0]
    assert isinstance(opt, FusedLAMB)
    assert (group["bias_correction"], group["betas"], group["eps"], group["weight_decay"]) == (
        True, (0.8, 0.9), 1e-5, 0.1)
    assert (group["adam_w_mode"], group["grad_averaging"], group["max_grad_norm"],
            group["use_nvlamb"]) == (False, True, 2.0, True)
    assert opt.set_grad_none is False


BAD_OPTIONS = {
    "amsgrad": ({"amsgrad": True}, ["amsgrad"]),
    "negative_clip": ({"max_grad_norm": -1.0}, ["max_grad_norm", ">= 0"]),
    "bool_clip": ({"max_grad_norm": True}, ["max_grad_norm"]),
    "kahan": ({"master_weights": "kahan"}, ["master_weights", "FusedAdam"]),
    "beta": ({"betas": (0.9, 1.0)}, ["betas", r"\[0, 1\)"]),
    "flag": ({"use_nvlamb": 1}, ["use_nvlamb", "True or False"]),
    "foreign_key": ({"momentum": 0.9}, None),
}


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_by_name(case):
    options, patterns = case
    params = make_params([(4,)], torch.float32, "cpu")
    if patterns is None:  # a key of another optimizer in a param group
        with raises_naming("momentum", "does not have"):
            FusedLAMB([{"params": params, **options}])
        return
    with raises_naming(*patterns):
        FusedLAMB(params, **options)


def test_dtensor_params_step_like_plain_ones(one_rank):
    """On one rank a DTensor step runs both halves of the op with the sums all-reduced between
    them (a no-op here): the same bits as plain tensors. Two ranks: test_fsdp2.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    plain = make_params([(6, 3), (5,)], torch.float32, "cpu")
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
               for p in plain]
    opts = [FusedLAMB(ps, lr=1e-2) for ps in (plain, sharded)]
    for s in range(3):
        grads = step_grads(plain, s, scale=4.0)
        set_grads(plain, grads)
        for p, g in zip(sharded, grads):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        for opt in opts:
            opt.step()
    for p, q in zip(plain, sharded):
        assert torch.equal(p.detach(), q.detach().full_tensor())
    with raises_naming("part and tensor_sums", "part='both'"):
        ampfuse._ops.fused_lamb_([sharded[1].data], [sharded[1].grad], [sharded[1].data],
                                 [sharded[1].data], [], torch.zeros(()), 1e-3, 0.9, 0.999, 1e-6,
                                 0.0, tensor_sums=torch.zeros(1, 2, dtype=torch.float64),
                                 part="moments")


def test_option_sets_cover_each_switch_both_ways():
    switches = ("adam_w_mode", "grad_averaging", "bias_correction", "use_nvlamb")
    seen = {(k, v) for options in OPTION_SETS.values() for k, v in options.items()}
    defaults = {"adam_w_mode": True, "grad_averaging": True, "bias_correction": True,
                "use_nvlamb": False}
    for switch, value in itertools.product(switches, (True, False)):
        assert (switch, value) in seen or defaults[switch] == value, (switch, value)


def test_the_benchmarks_torch_lamb_computes_the_same_step():
    """bench_lamb.py times ForeachLamb, written with torch's _foreach ops, as torch's side of
    the comparison: it must be the same LAMB, or the ratio compares different work."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from bench_lamb import ForeachLamb
    finally:
        sys.path.pop(0)
    params = make_params(SHAPES, torch.float32, "cpu")
    ours = clone_params(params)
    torch_opt, fused = ForeachLamb(params), FusedLAMB(ours, lr=1e-3)
    for s in range(5):
        grads = step_grads(params, s, scale=4.0)
        set_grads(params, grads)
        set_grads(ours, grads)
        torch_opt.step()
        fused.step()
    for a, b in zip(ours, params):
        assert_parity(a, b, "FusedLAMB against bench_lamb.ForeachLamb")
