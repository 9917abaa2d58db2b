"""fused_adam_coded_ (Adam with 8-bit block-coded moments): the CPU op equals its reference,
dequantize_moment -> fused_adam_ -> quantize_moment, bit for bit across param dtypes, master
modes and options; the skip contract; inf/nan; opcheck; and CUDA == CPU (cuda marker).
Misuse errors: test_adam_coded_errors.py."""

import pytest
import torch
from adam_coded_cases import (
    assert_same_bits,
    clone_case,
    coded_step,
    make_case,
    op_args,
    reference_step,
)

KINDS = ["int8", "fp8"]
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check_steps(case, steps=1, **options):
    """`steps` steps of the op and of the reference from the same state; equal after each."""
    expected = clone_case(case)
    for _ in range(steps):
        coded_step(case, **options)
        reference_step(expected, **options)
        assert_same_bits(case, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("masters", [True, False], ids=["masters", "no_masters"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_matches_reference(kind, param_dtype, masters, amsgrad, adam_w_mode):
    case = make_case(kind, param_dtype, masters=masters, amsgrad=amsgrad)
    _check_steps(case, adam_w_mode=adam_w_mode)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["stochastic", "kahan", "split"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_bf16_master_modes_match_reference(kind, mode, amsgrad):
    case = make_case(kind, torch.bfloat16, master_mode=mode, amsgrad=amsgrad)
    _check_steps(case, steps=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("write", [True, False], ids=["write_grads", "keep_grads"])
def test_maximize_and_grad_scale(kind, write):
    case = make_case(kind, torch.bfloat16, grad_scale=1024.0, amsgrad=True)
    _check_steps(case, maximize=True, write_unscaled_grads=write)


@pytest.mark.parametrize("kind", KINDS)
def test_several_steps(kind):
    case = make_case(kind, torch.float32, amsgrad=True, seed=1)
    _check_steps(case, steps=4)


@pytest.mark.parametrize("kind", KINDS)
def test_channels_last(kind):
    case = make_case(kind, torch.bfloat16, shapes=[(2, 3, 8, 20), (4, 5, 7, 3)],
                     channels_last=True)
    assert not case["params"][0].is_contiguous()
    assert case["exp_avg_codes"][0].stride() == case["params"][0].stride()
    _check_steps(case, steps=2)


@pytest.mark.parametrize("kind", KINDS)
def test_params_across_cpu_chunks(kind):
    # 65536-element CPU spans run on several threads; the last block of each param is short.
    case = make_case(kind, torch.bfloat16, shapes=[(2 * 65536 + 700,), (65536 + 1,), (300,)],
                     amsgrad=True, seed=2)
    _check_steps(case)


@pytest.mark.parametrize("kind", KINDS)
def test_params_under_one_block_and_empty(kind):
    # The optimizer decides which params code their moments, by the whole param's size: an
    # FSDP2 rank's shard of a coded param may be under one block, or empty.
    case = make_case(kind, torch.bfloat16, shapes=[(1000,), (255,), (0,), (1,)], seed=3)
    _check_steps(case, steps=2)


def test_zero_moments_and_grads():
    # A block of zeros has scale 0 and codes 0, and stays so under a zero grad (AdamW: the
    # weight decay does not enter the moments).
    case = make_case("int8", torch.float32)
    for key in ("grads", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
                "exp_avg_sq_scales"):
        for t in case[key]:
            t.zero_()
    _check_steps(case, adam_w_mode=True)
    assert all(s.eq(0).all() for s in case["exp_avg_scales"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["fp32", "split"])
def test_skipped_step_writes_nothing(kind, mode):
    case = make_case(kind, torch.bfloat16, master_mode=mode, amsgrad=True, grad_scale=8.0)
    case["found_inf"] = torch.ones(1)
    before = clone_case(case)
    coded_step(case)
    assert_same_bits(case, before)
    assert case["step"].item() == 3.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_nonfinite_grad_not_skipped(kind, where, value):
    # Without found_inf the step runs: the block holding the element decodes to nan next
    # time, exactly as the reference codes it; the other blocks are untouched by it.
    case = make_case(kind, torch.float32, amsgrad=True)
    grad = case["grads"][0]
    index = {"first": 0, "middle": grad.numel() // 2, "last": grad.numel() - 1}[where]
    grad.view(-1)[index] = value
    _check_steps(case, steps=2)
    block = index // 256
    scales = case["exp_avg_sq_scales"][0]
    assert not torch.isfinite(scales[block])
    finite = torch.ones_like(scales, dtype=torch.bool)
    finite[block] = False
    assert torch.isfinite(scales[finite]).all()


def test_step_advances_once():
    case = make_case("fp8", torch.float32)
    coded_step(case)
    assert case["step"].item() == 4.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["fp32", "stochastic"])
def test_opcheck(kind, mode):
    case = make_case(kind, torch.bfloat16, master_mode=mode, amsgrad=True, grad_scale=4.0,
                     shapes=[(300,), (2, 256)])
    case["found_inf"] = torch.zeros(1)
    args, kwargs = op_args(case, seed=3)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if kind == "fp8":
        # test_schema compares values with a mul torch has no CPU kernel for on float8_e4m3fn;
        # the schema (what is mutated) is the same for both kinds, checked with int8's codes.
        utils = utils[1:]
    torch.library.opcheck(torch.ops.ampfuse.fused_adam_coded_.default, args, kwargs,
                          test_utils=utils)


def test_fake_kernel_traces():
    # The fake runs under FakeTensorMode with the real op's checks.
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case("int8", torch.float32, amsgrad=True)
    with FakeTensorMode() as mode:
        fake = {k: ([mode.from_tensor(t) for t in v] if isinstance(v, list) and v
                    and isinstance(v[0], torch.Tensor) else
                    mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                for k, v in case.items()}
        coded_step(fake)


def test_wrapper_matches_op():
    from ampfuse.ops import fused_adam_coded_

    case = make_case("int8", torch.bfloat16, amsgrad=False)
    expected = clone_case(case)
    fused_adam_coded_(case["params"], case["grads"], case["exp_avg_codes"],
                      case["exp_avg_scales"], case["exp_avg_sq_codes"],
                      case["exp_avg_sq_scales"], [], [], case["master_params"], case["step"],
                      1e-3, 0.9, 0.999, 1e-8, 0.01, seed=5)
    reference_step(expected)
    assert_same_bits(case, expected)


def test_dtensor_shards_step_locally(one_rank):
    # Params, grads and codes sharded alike; the scales are each rank's own plain tensors.
    from ampfuse.ops import fused_adam_coded_
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    case = make_case("fp8", torch.float32, amsgrad=True, shapes=[(4, 300)])
    expected = clone_case(case)
    reference_step(expected)

    def shard(ts):
        # from_local: gloo has no collective for float8 codes, and one rank needs none.
        return [DTensor.from_local(t, mesh, [Shard(0)]) for t in ts]
    sharded = {k: shard(case[k]) for k in ("params", "grads", "exp_avg_codes",
                                           "exp_avg_sq_codes", "max_exp_avg_sq_codes",
                                           "master_params")}
    fused_adam_coded_(sharded["params"], sharded["grads"], sharded["exp_avg_codes"],
                      case["exp_avg_scales"], sharded["exp_avg_sq_codes"],
                      case["exp_avg_sq_scales"], sharded["max_exp_avg_sq_codes"],
                      case["max_exp_avg_sq_scales"], sharded["master_params"], case["step"],
                      case["lr"], 0.9, 0.999, 1e-8, 0.01, amsgrad=True, state_dtype="fp8",
                      seed=5)
    assert isinstance(sharded["params"][0], DTensor)
    for key, tensors in sharded.items():
        case[key] = [t.to_local() for t in tensors]
    assert_same_bits(case, expected)


# ---- CUDA == CPU, bit for bit (run on a GPU machine with `pytest -m cuda`) ----

def _cuda_equals_cpu(case, **options):
    gpu = {k: ([t.cuda() for t in v] if isinstance(v, list) and v
               and isinstance(v[0], torch.Tensor) else
               v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    for _ in range(2):
        coded_step(case, **options)
        coded_step(gpu, **options)
        torch.cuda.synchronize()
        assert_same_bits(gpu, case)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("masters", [True, False], ids=["masters", "no_masters"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_cuda_matches_cpu(kind, param_dtype, masters, amsgrad, adam_w_mode):
    case = make_case(kind, param_dtype, masters=masters, amsgrad=amsgrad,
                     shapes=[(1000,), (3, 300), (256,), (65536 * 3 + 77,)])
    _cuda_equals_cpu(case, adam_w_mode=adam_w_mode)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["stochastic", "kahan", "split"])
def test_cuda_bf16_master_modes_match_cpu(kind, mode):
    case = make_case(kind, torch.bfloat16, master_mode=mode, amsgrad=True)
    _cuda_equals_cpu(case)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_options_match_cpu(kind):
    case = make_case(kind, torch.float16, grad_scale=512.0, channels_last=True,
                     shapes=[(2, 3, 8, 20)])
    _cuda_equals_cpu(case, maximize=True, write_unscaled_grads=True)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", [0, 517, 999])
def test_cuda_nonfinite_grad_matches_cpu(kind, where):
    case = make_case(kind, torch.float32, amsgrad=True)
    case["grads"][0].view(-1)[where] = float("nan")
    _cuda_equals_cpu(case)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["fp32", "stochastic"])
def test_cuda_small_empty_and_many_params_match_cpu(kind, mode):
    # Launcher paths the other CUDA cases miss: a param under one block (the CTA's second code
    # block owns nothing), an empty one (no chunk, no launch), and more params than one launch's
    # 9-list table holds (326), so one prologue is followed by several launches, each with its
    # own param ids (stochastic rounding is keyed by them).
    shapes = [(255,), (0,), (1,), (1000,)] + [(3 + i % 300,) for i in range(400)]
    case = make_case(kind, torch.bfloat16 if mode == "stochastic" else torch.float32,
                     master_mode=mode, amsgrad=True, shapes=shapes, seed=4)
    _cuda_equals_cpu(case)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_skipped_step_writes_nothing(kind):
    case = make_case(kind, torch.bfloat16, amsgrad=True, grad_scale=8.0, device="cuda")
    case["found_inf"] = torch.ones(1, device="cuda")
    before = clone_case(case)
    coded_step(case)
    assert_same_bits(case, before)
