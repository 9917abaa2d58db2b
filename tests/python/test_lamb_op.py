"""The fused_lamb_ op itself (FusedLAMB, built on it, is tested in test_lamb.py): opcheck, the
skip contract, inf/nan at the first, a middle and the last element, results independent of
the thread count, CUDA against the CPU, and argument errors."""

import pytest
import torch

import ampfuse
from helpers import POSITIONS, position_index, raises_naming

SHAPES = [(5,), (65537,), (3, 4), (0,), (9, 17)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]


def _lamb_args(device, dtypes=DTYPES, shapes=SHAPES, masters=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(shapes, dtypes)]
    return {
        "params": params,
        "grads": grads,
        "exp_avgs": [torch.rand(s, generator=gen).to(device) for s in shapes],
        "exp_avg_sqs": [torch.rand(s, generator=gen).to(device) for s in shapes],
        "master_params": [p.float() for p in params] if masters else [],
        "step": torch.full((), 3.0, device=device),
        "lr": torch.full((1,), 1e-2, device=device),
    }


def _call(a, *, weight_decay=0.01, adam_w_mode=True, max_grad_norm=1.0, grad_norm=None,
          grad_scale=None, found_inf=None, write_grads=False, use_nvlamb=False):
    if grad_norm is None and max_grad_norm > 0:
        grad_norm = ampfuse._ops.multi_tensor_l2norm(a["grads"], False)[0]
    ampfuse._ops.fused_lamb_(
        a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"], a["step"],
        a["lr"], 0.9, 0.999, 1e-6, weight_decay, adam_w_mode, True, True, use_nvlamb,
        max_grad_norm, grad_norm, grad_scale, found_inf, write_unscaled_grads=write_grads)


def _clone(a):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in a.items()}


def _assert_same(a, b, keys=("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")):
    for key in keys:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(x, y), f"{key}[{i}]"


@pytest.mark.parametrize("write_grads", [True, False], ids=["write_grads", "read_grads"])
@pytest.mark.parametrize("masters", [True, False])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "no_clip"])
def test_opcheck(device, masters, write_grads, clip):
    a = _lamb_args(device, masters=masters)
    scale = torch.full((1,), 8.0, device=device)
    norm = torch.full((), 40.0, device=device) if clip else None
    torch.library.opcheck(
        torch.ops.ampfuse.fused_lamb_.default,
        (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"], a["step"],
         a["lr"], 0.9, 0.999, 1e-6, 0.01, True, True, True, False, clip, norm, scale,
         torch.zeros(1, device=device), write_grads),
    )


def test_found_inf_writes_nothing(device):
    a = _lamb_args(device)
    before = _clone(a)
    _call(a, found_inf=torch.ones(1, device=device), grad_scale=torch.full((1,), 4.0,
                                                                         device=device),
          write_grads=True)
    _assert_same(a, before)
    assert float(a["step"]) == 3.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", POSITIONS)
def test_a_non_finite_grad_reaches_only_its_element_without_decay(device, bad, position):
    """apex propagates inf/nan (a scaler's found_inf or skip_nonfinite is what skips a step).
    Without weight decay or clipping there is no trust ratio or global norm to spread it: the
    element turns NaN and every other element moves as if its grad had been 0."""
    a = _lamb_args(device, masters=True)
    clean = _clone(a)
    i = position_index(position, a["grads"][1].numel())
    a["grads"][1][i] = bad
    clean["grads"][1][i] = 0.0
    for args in (a, clean):
        _call(args, weight_decay=0.0, max_grad_norm=0.0)
    assert torch.isnan(a["master_params"][1][i]), "the element with a bad grad turns NaN"
    keep = torch.ones(a["grads"][1].numel(), dtype=torch.bool, device=device)
    keep[i] = False
    assert torch.equal(a["master_params"][1][keep], clean["master_params"][1][keep])
    for t in (0, 2, 3, 4):
        assert torch.equal(a["master_params"][t], clean["master_params"][t])


@pytest.mark.parametrize("position", POSITIONS)
def test_a_non_finite_grad_spreads_through_the_trust_ratio(device, position):
    """With weight decay the tensor's update norm, and so its whole step, is NaN, as in apex."""
    a = _lamb_args(device, masters=True)
    i = position_index(position, a["grads"][1].numel())
    a["grads"][1][i] = float("inf")
    _call(a, max_grad_norm=0.0)
    assert torch.isnan(a["master_params"][1]).all()
    assert torch.isfinite(a["master_params"][0]).all()


def test_results_do_not_depend_on_the_thread_count():
    a = _lamb_args("cpu", shapes=[(300_000,), (70_000,), (3,)], dtypes=DTYPES[:3])
    b = _clone(a)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _call(a)
        torch.set_num_threads(max(2, threads))
        _call(b)
    finally:
        torch.set_num_threads(threads)
    _assert_same(a, b)


def test_scale_is_divided_out_of_grads_and_norm():
    a = _lamb_args("cpu", dtypes=[torch.float32] * len(SHAPES))
    scaled = _clone(a)
    scaled["grads"] = [g * 64 for g in scaled["grads"]]
    _call(a)
    _call(scaled, grad_scale=torch.full((1,), 64.0), write_grads=True)
    _assert_same(a, scaled)


@pytest.mark.cuda
@pytest.mark.parametrize("masters", [True, False])
def test_cuda_matches_the_cpu(masters):
    cpu = _lamb_args("cpu", masters=masters)
    cuda = {k: ([t.cuda() for t in v] if isinstance(v, list) else v.cuda())
            for k, v in _clone(cpu).items()}
    for args in (cpu, cuda):
        _call(args, grad_scale=torch.full((1,), 2.0, device=args["step"].device),
              write_grads=True)
    for key in ("exp_avgs", "exp_avg_sqs", "grads"):
        for x, y in zip(cpu[key], cuda[key]):
            assert torch.equal(x, y.cpu()), key
    # The trust ratio's norms add in another order on the GPU: the last bits may differ.
    for key in ("params", "master_params"):
        for x, y in zip(cpu[key], cuda[key]):
            torch.testing.assert_close(y.cpu().float(), x.float(), rtol=2e-6, atol=1e-7)
    assert float(cuda["step"]) == 4.0


ERRORS = {
    "clip_without_norm": ({"max_grad_norm": 1.0, "grad_norm": None}, ["grad_norm"]),
    "negative_clip": ({"max_grad_norm": -1.0}, ["max_grad_norm", ">= 0"]),
    "norm_wrong_dtype": ({"grad_norm": "int"}, ["grad_norm", "float32"]),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_argument_errors_name_the_argument(case):
    changes, patterns = case
    a = _lamb_args("cpu")
    before = _clone(a)
    clip = changes.get("max_grad_norm", 1.0)
    norm = changes.get("grad_norm", torch.ones(()))
    if norm == "int":
        norm = torch.ones((), dtype=torch.int32)
    with raises_naming(*patterns):
        ampfuse._ops.fused_lamb_(
            a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"],
            a["step"], a["lr"], 0.9, 0.999, 1e-6, 0.01, True, True, True, False, clip, norm)
    _assert_same(a, before)


def test_moments_must_be_fp32():
    a = _lamb_args("cpu")
    a["exp_avgs"][0] = a["exp_avgs"][0].half()
    with raises_naming("exp_avgs", "float32"):
        _call(a)
