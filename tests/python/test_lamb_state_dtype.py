"""FusedLAMB with state_dtype="int8" / "fp8": block-coded moments in the step (the op,
fused_lamb_coded_, is tested in test_lamb_coded.py).

The reference of a coded step is the unfused one, as for FusedAdam (test_state_dtype.py): the
fp32-moment FusedLAMB (itself checked against a float64 LAMB in test_lamb.py) run beside it
from the same params and grads, handed the decoded moments before every step; codes, scales,
params and every master-mode extra must be equal bit for bit. Then skipped steps, resume,
checkpoints both ways, options and bad values."""

import copy

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.optimizers import FusedLAMB
from ampfuse.optimizers._state_codes import BLOCK, codes_kind
from test_adam import clone_params, make_params, set_grads, step_grads
from test_state_dtype import (
    KINDS,
    MODES,
    SHAPES,
    _assert_state_is_coded_reference,
    _hand_decoded_moments,
    check_resume_is_bit_exact,
    check_skipped_step_writes_nothing,
)
from test_state_dtype import _run_against_reference as run_against_reference


def _run_against_reference(kind, dtype, master_weights, **options):
    return run_against_reference(kind, dtype, master_weights, optimizer_class=FusedLAMB,
                                 **options)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_is_decode_fp32_step_encode(kind, mode):
    dtype, master_weights = MODES[mode]
    _run_against_reference(kind, dtype, master_weights)


@pytest.mark.parametrize("options", [
    {"max_grad_norm": 0.05}, {"max_grad_norm": None}, {"adam_w_mode": False},
    {"grad_averaging": False, "use_nvlamb": True, "weight_decay": 0.0},
    {"betas": (0.8, 0.95), "eps": 1e-8, "bias_correction": False},
], ids=["clipped", "no-clip", "l2", "nvlamb-no-averaging", "betas-eps-no-correction"])
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_options(kind, options):
    _run_against_reference(kind, torch.bfloat16, True, **options)


@pytest.mark.parametrize("kind", KINDS)
def test_scaled_grads(kind):
    _run_against_reference(kind, torch.bfloat16, "split", grad_scale=1024.0)


@pytest.mark.parametrize("kind", KINDS)
def test_which_params_code_their_moments(kind):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(BLOCK,), (BLOCK - 1,), (3, 100)]]
    opt = FusedLAMB(params, state_dtype=kind)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert [codes_kind(opt.state[p]) for p in params] == [kind, "fp32", kind]
    assert opt.state[params[2]]["exp_avg_scales"].shape == (2,)  # 300 elements: 2 blocks
    first, second = (torch.int8, torch.uint8) if kind == "int8" else (torch.float8_e4m3fn,) * 2
    assert opt.state[params[0]]["exp_avg_codes"].dtype == first
    assert opt.state[params[0]]["exp_avg_sq_codes"].dtype == second


@pytest.mark.parametrize("kind", KINDS)
def test_skipped_step_writes_nothing(kind):
    check_skipped_step_writes_nothing(FusedLAMB, kind, "kahan")


@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_bit_exact(kind):
    check_resume_is_bit_exact(FusedLAMB, kind, "stochastic")


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_convert_both_ways(kind):
    params = make_params(SHAPES, torch.float32, "cpu")
    fp32_opt = FusedLAMB(params)
    set_grads(params, step_grads(params, 0))
    fp32_opt.step()
    # fp32 checkpoint -> coded optimizer: the run's state_dtype wins, coded at the next step.
    coded_params = clone_params(params)
    coded = FusedLAMB(coded_params, state_dtype=kind)
    coded.load_state_dict(copy.deepcopy(fp32_opt.state_dict()))
    assert coded.param_groups[0]["state_dtype"] == kind
    set_grads(coded_params, step_grads(params, 1))
    coded.step()
    held = [codes_kind(coded.state[p]) for p in coded_params]
    assert held == [kind if p.numel() >= BLOCK else "fp32" for p in coded_params]
    # coded checkpoint -> fp32 optimizer: decoded at the next step.
    back_params = clone_params(coded_params)
    back = FusedLAMB(back_params)
    back.load_state_dict(copy.deepcopy(coded.state_dict()))
    assert back.param_groups[0]["state_dtype"] == "fp32"
    set_grads(back_params, step_grads(params, 2))
    back.step()
    assert all(codes_kind(back.state[p]) == "fp32" for p in back_params)


def test_bad_state_dtype_is_refused():
    params = [torch.nn.Parameter(torch.randn(300))]
    with pytest.raises(ValueError, match="state_dtype='int4'.*'fp32'.*'int8'.*'fp8'"):
        FusedLAMB(params, state_dtype="int4")
    opt = FusedLAMB(params)
    opt.param_groups[0]["state_dtype"] = "bf16"
    params[0].grad = torch.randn(300)
    with pytest.raises(ValueError, match="param_groups\\[0\\].*state_dtype='bf16'"):
        opt.step()


@pytest.mark.parametrize("kind", KINDS)
def test_coded_lamb_takes_fewer_state_bytes(kind):
    p = torch.nn.Parameter(torch.randn(64, 1024))
    opt = FusedLAMB([p], state_dtype=kind)
    p.grad = torch.randn_like(p)
    opt.step()
    held = sum(v.numel() * v.element_size() for k, v in opt.state[p].items() if k != "step")
    assert held == 2 * p.numel() + 2 * 4 * (p.numel() // BLOCK)  # vs 8 bytes per param in fp32


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_steps_as_the_fp32_optimizer_on_decoded_moments(kind):
    _run_against_reference(kind, torch.bfloat16, True, steps=3, device="cuda")


@pytest.mark.parametrize("kind", KINDS)
def test_a_param_that_is_not_dense(kind):
    # A strided view is stepped through a contiguous copy; its codes are contiguous.
    base = torch.randn(40, 60, generator=torch.Generator().manual_seed(4))
    p = torch.nn.Parameter(base.clone()[:, ::2])
    r = torch.nn.Parameter(base.clone()[:, ::2])
    opt = FusedLAMB([p], state_dtype=kind, lr=1e-2)
    ref = FusedLAMB([r], lr=1e-2)
    for step in range(3):
        g = torch.randn(40, 30, generator=torch.Generator().manual_seed(step))
        p.grad, r.grad = g.clone(), g.clone()
        if p in opt.state:
            _hand_decoded_moments(opt.state[p], ref.state[r])
        opt.step()
        ref.step()
        _assert_state_is_coded_reference(opt, ref, [p], [r], kind, f"step {step}")
    assert opt.state[p]["exp_avg_codes"].is_contiguous()
