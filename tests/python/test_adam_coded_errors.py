"""fused_adam_coded_'s misuse errors: each names the argument and the fix, from the op and
from its fake kernel, and a refused call writes nothing."""

import pytest
import torch
from adam_coded_cases import assert_same_bits, clone_case, coded_step, make_case
from helpers import raises_naming
from torch._subclasses.fake_tensor import FakeTensorMode


def _case(kind="int8", **kw):
    return make_case(kind, torch.float32, shapes=[(1000,), (3, 300)], **kw)


def _fake(case):
    mode = FakeTensorMode()

    def fake(v):
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(v)
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return [mode.from_tensor(t) for t in v]
        return v
    return mode, {k: fake(v) for k, v in case.items()}


def _both_raise(case, *patterns, **options):
    """The eager op and the fake kernel refuse the call alike; the eager one wrote nothing."""
    before = clone_case(case)
    with raises_naming(*patterns):
        coded_step(case, **options)
    assert_same_bits(case, before)
    mode, fake = _fake(case)
    with mode, raises_naming(*patterns):
        coded_step(fake, **options)


def test_unknown_state_dtype():
    case = _case()
    case["kind"] = "int4"
    _both_raise(case, "state_dtype='int4'", "'int8', 'fp8'")


@pytest.mark.parametrize("kind,key,dtype", [
    ("int8", "exp_avg_codes", torch.uint8),
    ("int8", "exp_avg_sq_codes", torch.int8),
    ("fp8", "exp_avg_codes", torch.int8),
    ("fp8", "exp_avg_sq_codes", torch.uint8),
])
def test_wrong_code_dtype(kind, key, dtype):
    case = _case(kind)
    case[key][1] = case[key][1].view(dtype)
    _both_raise(case, rf"{key}\[1\] must be torch\.", "int8|uint8|float8_e4m3fn")


def test_codes_shaped_unlike_param():
    case = _case()
    case["exp_avg_codes"][1] = case["exp_avg_codes"][1].reshape(300, 3)
    _both_raise(case, r"exp_avg_codes\[1\] has shape", r"params\[1\]")


def test_codes_laid_out_unlike_param():
    case = make_case("int8", torch.float32, shapes=[(2, 3, 8, 20)], channels_last=True)
    case["exp_avg_sq_codes"][0] = case["exp_avg_sq_codes"][0].contiguous()
    before = clone_case(case)
    with raises_naming(r"exp_avg_sq_codes\[0\] has strides", "zeros_like"):
        coded_step(case)
    assert_same_bits(case, before)


@pytest.mark.parametrize("bad", ["numel", "dtype", "2d"])
def test_bad_scales(bad):
    case = _case()
    scales = case["exp_avg_scales"][1]
    case["exp_avg_scales"][1] = {"numel": scales[:-1], "dtype": scales.double(),
                                 "2d": scales.view(1, -1)}[bad]
    _both_raise(case, r"exp_avg_scales\[1\]", "float32")


def test_non_contiguous_scales():
    case = make_case("int8", torch.float32, shapes=[(1024,)])
    case["exp_avg_scales"][0] = torch.zeros(8)[::2]
    with raises_naming(r"exp_avg_scales\[0\] must be a contiguous 1-D tensor of 4", "zeros"):
        coded_step(case)


def test_max_moment_without_amsgrad():
    case = _case(amsgrad=True)
    case["amsgrad"] = False
    _both_raise(case, "max_exp_avg_sq_codes and max_exp_avg_sq_scales must be empty")


def test_max_moment_missing_with_amsgrad():
    case = _case()
    case["amsgrad"] = True
    case["max_exp_avg_sq_codes"] = case["exp_avg_sq_codes"]
    _both_raise(case, r"max_exp_avg_sq_scales has 0 tensors but params has 2")


def test_list_length_mismatch():
    case = _case()
    case["exp_avg_codes"] = case["exp_avg_codes"][:1]
    _both_raise(case, "exp_avg_codes has 1 tensors but params has 2", "one tensor per param")


def test_bad_master_mode():
    case = _case()
    case["master_mode"] = "bf16"
    _both_raise(case, "master_mode='bf16'", "'fp32', 'stochastic', 'kahan', 'split'")


def test_bf16_mode_with_fp32_params():
    case = _case(master_mode="kahan")
    _both_raise(case, "master_mode='kahan' updates torch.bfloat16 params")


def test_bad_beta():
    case = _case()
    with raises_naming("beta2 must be in"):
        args_case = clone_case(case)
        torch.ops.ampfuse.fused_adam_coded_(
            args_case["params"], args_case["grads"], args_case["exp_avg_codes"],
            args_case["exp_avg_scales"], args_case["exp_avg_sq_codes"],
            args_case["exp_avg_sq_scales"], [], [], args_case["master_params"],
            args_case["step"], args_case["lr"], 0.9, 1.0, 1e-8, 0.0, True, True, False, False,
            None, None)


def test_sparse_param_refused():
    case = _case()
    case["params"][0] = case["params"][0].to_sparse()
    with raises_naming("sparse"):
        coded_step(case)
