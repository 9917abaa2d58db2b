"""The fused_lamb_ op itself (FusedLAMB, built on it, is tested in test_lamb.py): opcheck, the
skip contract, inf/nan at the first, a middle and the last element, results independent of
the thread count, CUDA against the CPU, and argument errors."""

import pytest
import torch

import ampfuse
from helpers import (
    POSITIONS,
    assert_lists_equal,
    call_with_one_and_more_threads,
    clone_args,
    position_index,
    raises_naming,
)

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
          grad_scale=None, found_inf=None, write_grads=False, use_nvlamb=False, sums=None,
          part="both"):
    if grad_norm is None and max_grad_norm > 0 and part != "apply":
        grad_norm = ampfuse.ops.multi_tensor_l2norm(a["grads"], False)[0]
    ampfuse.ops.fused_lamb_(
        a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"], a["step"],
        a["lr"], 0.9, 0.999, 1e-6, weight_decay, adam_w_mode, True, True, use_nvlamb,
        max_grad_norm, grad_norm, grad_scale, found_inf, write_unscaled_grads=write_grads,
        tensor_sums=sums, part=part)


def _sums(a):
    return torch.zeros((len(a["params"]), 2), dtype=torch.float64, device=a["step"].device)




def _assert_same(a, b, keys=("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")):
    assert_lists_equal(a, b, keys)


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
    before = clone_args(a)
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
    clean = clone_args(a)
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
    b = clone_args(a)
    call_with_one_and_more_threads(_call, a, b)
    _assert_same(a, b)


def test_scale_is_divided_out_of_grads_and_norm():
    a = _lamb_args("cpu", dtypes=[torch.float32] * len(SHAPES))
    scaled = clone_args(a)
    scaled["grads"] = [g * 64 for g in scaled["grads"]]
    _call(a)
    _call(scaled, grad_scale=torch.full((1,), 64.0), write_grads=True)
    _assert_same(a, scaled)


@pytest.mark.parametrize("masters", [True, False])
def test_the_two_halves_give_the_whole_step_bit_for_bit(device, masters):
    """part="moments" then part="apply" (what a sharded step runs, with the sums all-reduced in
    between) equals one part="both" call; "both" leaves the same sums when asked, and the
    first half alone moves no param and no step count."""
    whole = _lamb_args(device, masters=masters)
    halves = clone_args(whole)
    whole_sums, sums = _sums(whole), _sums(halves)
    scale = torch.full((1,), 8.0, device=device)
    _call(whole, grad_scale=scale, write_grads=True, sums=whole_sums)
    before = clone_args(halves)
    _call(halves, grad_scale=scale, write_grads=True, sums=sums, part="moments")
    _assert_same(halves, before, keys=("params", "master_params"))
    assert float(halves["step"]) == 3.0
    assert torch.equal(sums, whole_sums)
    assert bool((sums[[0, 1, 2, 4]] > 0).all()) and not sums[3].any()  # tensor 3 is empty
    assert not torch.equal(halves["exp_avgs"][0], before["exp_avgs"][0])
    _call(halves, grad_scale=scale, sums=sums, part="apply", grad_norm=None)
    _assert_same(halves, whole)
    assert float(halves["step"]) == 4.0


def test_the_second_half_forms_the_ratios_from_the_sums_it_is_given():
    """Sums from elsewhere (other shards) change the step: twice the update's sum of squares
    gives a trust ratio 1/sqrt(2) of the local one."""
    a = _lamb_args("cpu", masters=True)
    b = clone_args(a)
    sums_a, sums_b = _sums(a), _sums(b)
    for args, sums in ((a, sums_a), (b, sums_b)):
        _call(args, sums=sums, part="moments")
    sums_b[:, 1] *= 2
    start = [m.clone() for m in a["master_params"]]
    _call(a, sums=sums_a, part="apply")
    _call(b, sums=sums_b, part="apply")
    for i in (0, 1, 2, 4):  # tensor 3 is empty
        moved_a, moved_b = a["master_params"][i] - start[i], b["master_params"][i] - start[i]
        # The step is a difference of fp32 values: its rounding is relative to the param's size.
        atol = 1e-6 * float(start[i].abs().max())
        torch.testing.assert_close(moved_b, moved_a / 2 ** 0.5, rtol=1e-5, atol=atol)


def test_found_inf_skips_each_half():
    a = _lamb_args("cpu")
    before = clone_args(a)
    sums = _sums(a)
    for part in ("moments", "apply"):
        _call(a, found_inf=torch.ones(1), sums=sums, part=part)
    _assert_same(a, before)
    assert float(a["step"]) == 3.0 and not sums.any()


@pytest.mark.parametrize("part", ["moments", "apply"])
def test_opcheck_halves(device, part):
    a = _lamb_args(device, masters=True)
    norm = torch.full((), 40.0, device=device)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_lamb_.default,
        (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"], a["step"],
         a["lr"], 0.9, 0.999, 1e-6, 0.01, True, True, True, False, 1.0, norm, None, None, False,
         torch.rand((len(a["params"]), 2), dtype=torch.float64, device=device), part),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("masters", [True, False])
def test_cuda_matches_the_cpu(masters):
    """From one grad norm, the first half gives the same moments and grads, and each tensor's
    sums of squares of param and update to their last bits (the GPU adds them in another
    order); from the same sums the second half writes the same params and masters. Comparing
    params after each side's own sums cannot be tight: a trust ratio a few ulps apart moves a
    16-bit param that sits near a rounding boundary by a whole ulp, and an fp32 param whose
    update nearly cancels it by thousands of its own ulps (the C++ CUDA test met the latter on
    an H100). test_the_two_halves_give_the_whole_step_bit_for_bit holds the one-call step to
    the halves on each device."""
    cpu = _lamb_args("cpu", masters=masters)
    cuda = {k: ([t.cuda() for t in v] if isinstance(v, list) else v.cuda())
            for k, v in clone_args(cpu).items()}
    # The clip's global grad norm is a sum the GPU adds in another order too: one for both.
    norm = ampfuse.ops.multi_tensor_l2norm(cpu["grads"], False)[0]
    cpu_sums, cuda_sums = _sums(cpu), _sums(cuda)
    for args, sums in ((cpu, cpu_sums), (cuda, cuda_sums)):
        _call(args, grad_scale=torch.full((1,), 2.0, device=sums.device), write_grads=True,
              sums=sums, part="moments", grad_norm=norm.to(sums.device))
    _assert_same(cpu, cuda, keys=("exp_avgs", "exp_avg_sqs", "grads"))
    torch.testing.assert_close(cuda_sums.cpu(), cpu_sums, rtol=1e-6, atol=0)
    for args, sums in ((cpu, cuda_sums.cpu()), (cuda, cuda_sums)):
        _call(args, grad_scale=torch.full((1,), 2.0, device=sums.device), sums=sums,
              part="apply", grad_norm=None)
    _assert_same(cpu, cuda, keys=("params", "master_params"))
    assert float(cpu["step"]) == float(cuda["step"]) == 4.0


ERRORS = {
    "clip_without_norm": ({"max_grad_norm": 1.0, "grad_norm": None}, ["grad_norm"]),
    "negative_clip": ({"max_grad_norm": -1.0}, ["max_grad_norm", ">= 0"]),
    "norm_wrong_dtype": ({"grad_norm": "int"}, ["grad_norm", "float32"]),
    "unknown_part": ({"part": "first"}, ["part='first'", "'moments'"]),
    "half_without_sums": ({"part": "moments"}, ["tensor_sums", "float64"]),
    "sums_wrong_shape": ({"part": "apply", "tensor_sums": torch.zeros(2, 2, dtype=torch.float64)},
                         ["tensor_sums", r"shape \(5, 2\)"]),
    "sums_wrong_dtype": ({"tensor_sums": torch.zeros(5, 2)}, ["tensor_sums", "float64"]),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_argument_errors_name_the_argument(case):
    changes, patterns = case
    a = _lamb_args("cpu")
    before = clone_args(a)
    clip = changes.get("max_grad_norm", 1.0)
    norm = changes.get("grad_norm", torch.ones(()))
    if norm == "int":
        norm = torch.ones((), dtype=torch.int32)
    with raises_naming(*patterns):
        ampfuse.ops.fused_lamb_(
            a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["master_params"],
            a["step"], a["lr"], 0.9, 0.999, 1e-6, 0.01, True, True, True, False, clip, norm,
            tensor_sums=changes.get("tensor_sums"), part=changes.get("part", "both"))
    _assert_same(a, before)


def test_moments_must_be_fp32():
    a = _lamb_args("cpu")
    a["exp_avgs"][0] = a["exp_avgs"][0].half()
    with raises_naming("exp_avgs", "float32"):
        _call(a)
