"""FusedAdam / FusedAdamW with state_dtype="int8" / "fp8": block-coded moments in the step.

The reference of a coded step is the unfused one: decode the moments (_state_codes), take the
fp32-state step (FusedAdamW with state_dtype="fp32", itself checked against torch.optim in
test_adam.py), code the new moments again. Each test runs both side by side from the same
params and grads, hands the reference the decoded moments before every step, and requires
codes, scales, params and every master-mode extra to be equal bit for bit. Then: which params
keep fp32 moments, skipped steps, checkpoints (resume, fp32 <-> coded in both directions, to
torch.optim), a memory-layout change, bad options. The op itself (fused_adam_coded_, CPU and
CUDA) is tested in test_adam_coded.py.
"""

import copy
import io

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)
import pytest
import torch
from ampfuse.optimizers import FusedAdam, FusedAdamW, decode_moments
from ampfuse.optimizers._state_codes import (
    BLOCK,
    MOMENT_KEYS,
    codes_kind,
    convert_moments,
)
from test_adam import clone_params, make_params, set_grads, step_grads

KINDS = ("int8", "fp8")
# A weight with a short last block, one of exactly two blocks, a bias under one block (fp32
# moments) and a 4-d one.
SHAPES = [(33, 20), (2, BLOCK), (7,), (4, 8, 3, 3)]
MODES = {  # id: (param dtype, master_weights)
    "fp32": (torch.float32, False),
    "bf16-masters": (torch.bfloat16, True),
    "bf16-none": (torch.bfloat16, False),
    "bf16-stochastic": (torch.bfloat16, "stochastic"),
    "bf16-kahan": (torch.bfloat16, "kahan"),
    "bf16-split": (torch.bfloat16, "split"),
    "fp16-masters": (torch.float16, True),
}


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _assert_same(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    assert actual.stride() == expected.stride() or actual.numel() <= 1, f"{what}: strides"
    assert torch.equal(_bits(actual), _bits(expected)), f"{what} differs"


def _hand_decoded_moments(coded_state, ref_state):
    """Writes the fp32 moments coded_state's codes stand for into ref_state, in place."""
    decoded = convert_moments(coded_state, "fp32")
    for key in MOMENT_KEYS:
        if key in ref_state:
            ref_state[key].copy_(decoded[key])


def _assert_state_is_coded_reference(opt, ref, params, ref_params, kind, where):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        _assert_same(p.detach(), r.detach(), f"{where}: param {i}")
        state, expected = opt.state[p], ref.state[r]
        if p.numel() >= BLOCK:
            expected = convert_moments(expected, kind)
        assert set(state) == set(expected), f"{where}: param {i} keys"
        for key, value in expected.items():
            _assert_same(state[key], value, f"{where}: param {i} {key}")


def _run_against_reference(kind, dtype, master_weights, steps=4, shapes=SHAPES, grad_scale=None,
                           memory_format=None, optimizer_class=FusedAdamW, device="cpu",
                           **options):
    """`steps` steps of optimizer_class(state_dtype=kind) beside its fp32-moment twin handed the
    decoded moments before each step (test_lamb_state_dtype.py runs FusedLAMB through it)."""
    params = make_params(shapes, dtype, device)
    if memory_format is not None:
        params = [p.detach().to(memory_format=memory_format).requires_grad_() if p.dim() == 4
                  else p for p in params]
    ref_params = clone_params(params)
    if memory_format is not None:
        ref_params = [r.detach().to(memory_format=memory_format).requires_grad_() if r.dim() == 4
                      else r for r in ref_params]
    options = dict({"lr": 3e-2, "weight_decay": 0.1}, **options)
    opt = optimizer_class(params, state_dtype=kind, master_weights=master_weights, **options)
    ref = optimizer_class(ref_params, master_weights=master_weights, **options)
    for step in range(steps):
        grads = step_grads(params, step)
        if step == 2:
            grads[0] = None  # a param without a grad skips this step, as in torch
        set_grads(params, grads)
        set_grads(ref_params, grads)
        for p, r in zip(params, ref_params):
            if p in opt.state and p.numel() >= BLOCK:
                _hand_decoded_moments(opt.state[p], ref.state[r])
        if grad_scale is None:
            opt.step()
            ref.step()
        else:
            for group in (params, ref_params):
                for p in group:
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
            scale = torch.tensor(grad_scale)
            opt.step(grad_scale=scale)
            ref.step(grad_scale=scale)
        _assert_state_is_coded_reference(opt, ref, params, ref_params, kind, f"step {step}")
    return opt, params


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_is_decode_fp32_step_encode(kind, mode):
    dtype, master_weights = MODES[mode]
    _run_against_reference(kind, dtype, master_weights)


@pytest.mark.parametrize("options", [
    {"amsgrad": True}, {"maximize": True},
    {"betas": (0.8, 0.95), "eps": 1e-6, "bias_correction": False},
], ids=["amsgrad", "maximize", "betas-eps-no-correction"])
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_options(kind, options):
    _run_against_reference(kind, torch.bfloat16, True, **options)


@pytest.mark.parametrize("kind", KINDS)
def test_coded_adam_l2(kind):
    # FusedAdam(adam_w_mode=False): L2 decay added to the grad, with coded moments.
    _run_against_reference(kind, torch.float32, False, steps=3, optimizer_class=FusedAdam,
                           lr=1e-2, weight_decay=0.05, adam_w_mode=False)


@pytest.mark.parametrize("kind", KINDS)
def test_scaled_grads_and_channels_last(kind):
    _run_against_reference(kind, torch.bfloat16, "split", grad_scale=1024.0,
                           memory_format=torch.channels_last)


@pytest.mark.parametrize("kind", KINDS)
def test_which_params_code_their_moments(kind):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(BLOCK,), (BLOCK - 1,), (3, 100)]]
    params.append(torch.nn.Parameter(torch.randn(300, dtype=torch.complex64)))
    opt = FusedAdamW(params, state_dtype=kind, amsgrad=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    held = [codes_kind(opt.state[p]) for p in params]
    # Coded from one whole block up; a smaller tensor and a complex one keep fp32 moments.
    assert held == [kind, "fp32", kind, "fp32"]
    assert opt.state[params[2]]["exp_avg_scales"].shape == (2,)  # 300 elements: 2 blocks
    first, second = (torch.int8, torch.uint8) if kind == "int8" else (torch.float8_e4m3fn,) * 2
    assert opt.state[params[0]]["exp_avg_codes"].dtype == first
    assert opt.state[params[0]]["exp_avg_sq_codes"].dtype == second
    assert opt.state[params[0]]["max_exp_avg_sq_codes"].dtype == second


def test_bytes_per_param_of_a_bf16_model():
    # params + grads + optimizer state per param, measured from the tensors, for a model of
    # 1024-wide layers (biases and norms are a small share, as in real models).
    def bytes_per_param(master_weights, state_dtype):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024),
                                    torch.nn.Linear(1024, 1024)).to(torch.bfloat16)
        opt = FusedAdamW(model.parameters(), master_weights=master_weights,
                         state_dtype=state_dtype)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        total = sum(p.numel() * p.element_size() * 2 for p in model.parameters())
        for state in opt.state.values():
            total += sum(v.numel() * v.element_size() for k, v in state.items()
                         if isinstance(v, torch.Tensor) and k != "step")
        return total / sum(p.numel() for p in model.parameters())

    assert bytes_per_param("stochastic", "fp32") == pytest.approx(12.0, abs=0.01)
    stochastic_int8 = bytes_per_param("stochastic", "int8")
    split_int8 = bytes_per_param("split", "int8")
    # 2 (param) + 2 (grad) + 2 (two 1-byte codes) + 8/256 (two fp32 block scales), plus the
    # fp32 moments of the 3 * 1024 bias and norm elements.
    assert 6.03 < stochastic_int8 < 6.05
    assert 8.03 < split_int8 < 8.05
    assert bytes_per_param("split", "fp8") == pytest.approx(split_int8)


@pytest.mark.parametrize("kind", KINDS)
def test_skipped_step_writes_nothing(kind):
    check_skipped_step_writes_nothing(FusedAdamW, kind, "split")


def check_skipped_step_writes_nothing(optimizer_class, kind, master_weights):
    params = make_params(SHAPES, torch.bfloat16, "cpu")
    opt = optimizer_class(params, state_dtype=kind, master_weights=master_weights)
    set_grads(params, step_grads(params, 0))
    opt.step()
    before = copy.deepcopy(({i: p.detach().clone() for i, p in enumerate(params)},
                            {i: opt.state[p] for i, p in enumerate(params)}))
    set_grads(params, step_grads(params, 1))
    opt.step(found_inf=torch.tensor(1.0))
    assert bool(opt.last_step_skipped)
    for i, p in enumerate(params):
        _assert_same(p.detach(), before[0][i], f"param {i}")
        for key, value in before[1][i].items():
            _assert_same(opt.state[p][key], value, f"param {i} {key}")


@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_bit_exact(kind):
    check_resume_is_bit_exact(FusedAdamW, kind, "stochastic")


def check_resume_is_bit_exact(optimizer_class, kind, master_weights):
    def train(params, opt, steps):
        for step in steps:
            set_grads(params, step_grads(params, step))
            opt.step()

    params = make_params(SHAPES, torch.bfloat16, "cpu")
    straight = clone_params(params)
    opt = optimizer_class(straight, state_dtype=kind, master_weights=master_weights)
    train(straight, opt, range(6))

    first = clone_params(params)
    opt1 = optimizer_class(first, state_dtype=kind, master_weights=master_weights)
    train(first, opt1, range(3))
    buffer = io.BytesIO()
    torch.save(opt1.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert "exp_avg_codes" in saved["state"][0] and "exp_avg" not in saved["state"][0]
    resumed = clone_params(first)
    opt2 = optimizer_class(resumed, state_dtype=kind, master_weights=master_weights)
    opt2.load_state_dict(saved)
    train(resumed, opt2, range(3, 6))
    for i, (a, b) in enumerate(zip(resumed, straight)):
        _assert_same(a.detach(), b.detach(), f"param {i}")
        for key, value in opt.state[b].items():
            _assert_same(opt2.state[a][key], value, f"param {i} {key}")


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_convert_between_fp32_and_coded_moments(kind):
    params = make_params(SHAPES, torch.float32, "cpu")
    fp32_params = clone_params(params)
    fp32_opt = FusedAdamW(fp32_params)
    set_grads(fp32_params, step_grads(fp32_params, 0))
    fp32_opt.step()

    # fp32 checkpoint -> coded optimizer: coded at the next step, which then equals the coded
    # step from the coded moments.
    coded_params = clone_params(fp32_params)
    coded_opt = FusedAdamW(coded_params, state_dtype=kind)
    # (deep copies: a state_dict holds the live tensors, which a load takes as they are)
    coded_opt.load_state_dict(copy.deepcopy(fp32_opt.state_dict()))
    assert coded_opt.param_groups[0]["state_dtype"] == kind  # the run's choice, not the file's
    ref_params = clone_params(fp32_params)
    ref_opt = FusedAdamW(ref_params)
    ref_opt.load_state_dict(copy.deepcopy(fp32_opt.state_dict()))
    for p, r in zip(coded_params, ref_params):
        if p.numel() >= BLOCK:
            coded = convert_moments(ref_opt.state[r], kind)
            _hand_decoded_moments(coded, ref_opt.state[r])
    grads = step_grads(params, 1)
    set_grads(coded_params, grads)
    set_grads(ref_params, grads)
    coded_opt.step()
    ref_opt.step()
    _assert_state_is_coded_reference(coded_opt, ref_opt, coded_params, ref_params, kind,
                                     "after loading fp32 moments")

    # coded checkpoint -> fp32 optimizer (ours: decoded at the next step; torch's: through
    # decode_moments).
    saved = copy.deepcopy(coded_opt.state_dict())
    back_params = clone_params(coded_params)
    back = FusedAdamW(back_params)
    back.load_state_dict(copy.deepcopy(saved))
    set_grads(back_params, step_grads(params, 2))
    back.step()
    assert all(codes_kind(back.state[p]) == "fp32" for p in back_params)
    torch_params = clone_params(coded_params)
    torch_opt = torch.optim.AdamW(torch_params)
    decoded = decode_moments(saved)
    torch_opt.load_state_dict(decoded)
    for i, p in enumerate(coded_params):
        state = torch_opt.state[torch_params[i]]
        expected = convert_moments(coded_opt.state[p], "fp32")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_same(state[key], expected[key], f"param {i} {key} in torch.optim.AdamW")
    set_grads(torch_params, step_grads(params, 2))
    torch_opt.step()  # torch's own step runs on the decoded moments
    assert "exp_avg_codes" in saved["state"][0], "decode_moments changed its argument"


def test_state_dtype_can_change_between_steps():
    params = make_params(SHAPES, torch.float32, "cpu")
    opt = FusedAdamW(params, state_dtype="int8")
    set_grads(params, step_grads(params, 0))
    opt.step()
    expected = {p: convert_moments(convert_moments(opt.state[p], "fp32"), "fp8")
                for p in params}
    opt.param_groups[0]["state_dtype"] = "fp8"
    ref_params = clone_params(params)
    ref = FusedAdamW(ref_params)
    ref.load_state_dict(copy.deepcopy(decode_moments(opt.state_dict())))
    for p, r in zip(params, ref_params):
        if p.numel() >= BLOCK:
            _hand_decoded_moments(expected[p], ref.state[r])
    set_grads(params, step_grads(params, 1))
    set_grads(ref_params, step_grads(params, 1))
    opt.step()
    ref.step()
    _assert_state_is_coded_reference(opt, ref, params, ref_params, "fp8", "after the switch")


@pytest.mark.parametrize("kind", KINDS)
def test_layout_change_recodes_in_the_new_block_order(kind):
    # Blocks follow memory order: after model.to(channels_last) the moments are decoded in the
    # old order and coded in the new one, then stepped.
    params = make_params([(8, 40, 3, 3)], torch.float32, "cpu")
    opt = FusedAdamW(params, state_dtype=kind)
    set_grads(params, step_grads(params, 0))
    opt.step()
    decoded = convert_moments(opt.state[params[0]], "fp32")
    relaid = {k: v.to(memory_format=torch.channels_last) if k in MOMENT_KEYS else v
              for k, v in decoded.items()}
    recoded = convert_moments(relaid, kind)
    params[0].data = params[0].data.to(memory_format=torch.channels_last)
    ref_params = clone_params(params)
    ref_params[0].data = ref_params[0].data.to(memory_format=torch.channels_last)
    ref = FusedAdamW(ref_params)
    ref.load_state_dict(copy.deepcopy(decode_moments(opt.state_dict())))
    set_grads(ref_params, step_grads(params, 1))
    ref.step(found_inf=torch.tensor(1.0))  # lays the reference's state out, steps nothing
    _hand_decoded_moments(recoded, ref.state[ref_params[0]])
    grads = [g.to(memory_format=torch.channels_last) for g in step_grads(params, 1)]
    set_grads(params, grads)
    set_grads(ref_params, grads)
    opt.step()
    ref.step()
    assert opt.state[params[0]]["exp_avg_codes"].stride() == params[0].stride()
    _assert_state_is_coded_reference(opt, ref, params, ref_params, kind, "after the relayout")


def test_bad_state_dtype_is_refused():
    p = torch.nn.Parameter(torch.randn(300))
    with pytest.raises(ValueError, match="state_dtype='bf16'.*'fp32'.*'int8'.*'fp8'"):
        FusedAdamW([p], state_dtype="bf16")
    opt = FusedAdamW([p])
    opt.param_groups[0]["state_dtype"] = "int4"
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="param_groups\\[0\\].*state_dtype='int4'"):
        opt.step()


def test_damaged_coded_checkpoint_is_refused():
    p = torch.nn.Parameter(torch.randn(300))
    opt = FusedAdamW([p], state_dtype="int8")
    p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg_scales"] = torch.zeros(5)
    with pytest.raises(ValueError, match="belongs to another model"):
        FusedAdamW([torch.nn.Parameter(torch.randn(300))]).load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg_sq_codes"] = bad["state"][0]["exp_avg_sq_codes"].view(torch.int8)
    with pytest.raises(ValueError, match="exp_avg_sq_codes of dtype torch.int8"):
        FusedAdamW([torch.nn.Parameter(torch.randn(300))]).load_state_dict(bad)
