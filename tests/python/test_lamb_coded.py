"""fused_lamb_coded_ (LAMB with block-coded moments, FusedLAMB's state_dtype) against its
definition: decode the moments (_state_codes), run fused_lamb_ on them in fp32, code the new
moments again. Every comparison is bit for bit: params, grads, masters or a bf16 mode's extra
tensors, codes, scales and the step count. Then the halves, skipped steps, inf/nan, opcheck,
the fake, argument errors, and CUDA against the same reference and the CPU (marked cuda).
FusedLAMB(state_dtype=...) is tested in test_lamb_state_dtype.py."""

import ampfuse
import pytest
import torch
from ampfuse.optimizers._state_codes import dequantize_moment, quantize_moment
from helpers import POSITIONS, call_with_one_and_more_threads, position_index, raises_naming

KINDS = ("int8", "fp8")
# A short last block, a chunk and one element (a CPU span of one block), under one block, 3-d,
# exactly one block, empty.
SHAPES = [(64, 33), (65537,), (7,), (3, 5, 2), (256,), (0,)]
MODES = {  # id: (param dtype, master_mode, fp32 masters)
    "fp32": (torch.float32, "fp32", False),
    "bf16-masters": (torch.bfloat16, "fp32", True),
    "fp16-masters": (torch.float16, "fp32", True),
    "bf16-none": (torch.bfloat16, "fp32", False),
    "bf16-stochastic": (torch.bfloat16, "stochastic", False),
    "bf16-kahan": (torch.bfloat16, "kahan", False),
    "bf16-split": (torch.bfloat16, "split", False),
}
MOMENTS = (("exp_avg", False), ("exp_avg_sq", True))


def make_args(device, mode, kind, seed=0, shapes=SHAPES):
    """The op's arguments, with random moments coded: a dict of tensors and tensor lists."""
    dtype, master_mode, masters = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grad_dtypes = [torch.float32, dtype, torch.bfloat16, torch.float16]
    grads = [(torch.randn(s, generator=gen) * 8).to(grad_dtypes[i % 4])
             for i, s in enumerate(shapes)]
    if masters:
        extra = [p.float() + torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
    elif master_mode == "kahan":
        extra = [(torch.randn(s, generator=gen) * 2**-10).to(torch.bfloat16) for s in shapes]
    elif master_mode == "split":
        extra = [torch.randint(-2**15, 2**15, s, generator=gen, dtype=torch.int16)
                 for s in shapes]
    else:
        extra = []
    a = {"params": params, "grads": grads, "extra": extra,
         "step": torch.full((), 3.0), "lr": torch.full((1,), 1e-2)}
    for key, second in MOMENTS:
        codes, scales = [], []
        for s in shapes:
            moment = torch.rand(s, generator=gen) * 1e-2
            moment = moment if second else moment - 5e-3
            c, sc = quantize_moment(moment, kind, second)
            codes.append(c.view(s))
            scales.append(sc)
        a[f"{key}_codes"], a[f"{key}_scales"] = codes, scales
    a = {k: [t.to(device) for t in v] if isinstance(v, list) else v.to(device)
         for k, v in a.items()}
    a["mode"], a["kind"] = mode, kind
    a["ids"] = [11 + i for i in range(len(shapes))] if master_mode == "stochastic" else []
    return a


def clone(a):
    return {k: [t.clone() for t in v] if isinstance(v, list) and v and isinstance(
        v[0], torch.Tensor) else (v.clone() if isinstance(v, torch.Tensor) else v)
        for k, v in a.items()}


def _common(a, grad_scale, found_inf, clip, norm, write_grads, weight_decay, adam_w_mode):
    if norm is None and clip > 0:
        norm = ampfuse.ops.multi_tensor_l2norm(a["grads"], False)[0]
    scale = None if grad_scale is None else torch.full_like(a["lr"], grad_scale)
    return ([a["extra"], a["step"], a["lr"], 0.9, 0.999, 1e-6, weight_decay, adam_w_mode, True,
             True, False, clip, norm, scale, found_inf, write_grads],
            {"master_mode": MODES[a["mode"]][1], "param_ids": a["ids"], "seed": 5})


def coded_step(a, *, grad_scale=4.0, found_inf=None, clip=1.0, norm=None, write_grads=True,
               weight_decay=0.01, adam_w_mode=True, sums=None, part="both"):
    rest, kw = _common(a, grad_scale, found_inf, clip, norm, write_grads, weight_decay,
                       adam_w_mode)
    torch.ops.ampfuse.fused_lamb_coded_(
        a["params"], a["grads"], a["exp_avg_codes"], a["exp_avg_scales"], a["exp_avg_sq_codes"],
        a["exp_avg_sq_scales"], *rest, sums, part, state_dtype=a["kind"], **kw)


def reference_step(a, **options):
    """The definition: decode, fused_lamb_ in fp32 (part="both"), code again (in place)."""
    moments = {}
    for key, second in MOMENTS:
        moments[key] = [dequantize_moment(c, s, a["kind"], second).view(c.shape)
                        for c, s in zip(a[f"{key}_codes"], a[f"{key}_scales"])]
    options.pop("part", None)
    options.pop("sums", None)
    rest, kw = _common(a, options.pop("grad_scale", 4.0), options.pop("found_inf", None),
                       options.pop("clip", 1.0), options.pop("norm", None),
                       options.pop("write_grads", True), options.pop("weight_decay", 0.01),
                       options.pop("adam_w_mode", True))
    assert not options, options
    torch.ops.ampfuse.fused_lamb_(a["params"], a["grads"], moments["exp_avg"],
                                  moments["exp_avg_sq"], *rest, None, "both", **kw)
    for key, second in MOMENTS:
        for i, m in enumerate(moments[key]):
            c, s = quantize_moment(m, a["kind"], second)
            a[f"{key}_codes"][i].copy_(c.view(m.shape))
            a[f"{key}_scales"][i].copy_(s)


def _bits(t):
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


TENSORS = ("params", "grads", "extra", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
           "exp_avg_sq_scales")


def _same_bits(x, y):
    """Equal bit for bit, except that a nan equals any nan: which nan a block's scale carries is
    not part of the contract (CUDA's block max and torch's amax may keep different ones, and the
    GPU forms nans with other bits than the CPU); where the nans are is."""
    if x.dtype.is_floating_point and x.element_size() > 1:
        x_nan, y_nan = torch.isnan(x), torch.isnan(y)
        return torch.equal(x_nan, y_nan) and torch.equal(_bits(x[~x_nan]), _bits(y[~y_nan]))
    return torch.equal(_bits(x), _bits(y))


def assert_same(actual, expected):
    for key in TENSORS:
        for i, (x, y) in enumerate(zip(actual[key], expected[key])):
            assert _same_bits(x, y.to(x.device)), f"{key}[{i}] differs"
    assert torch.equal(actual["step"], expected["step"].to(actual["step"].device)), "step"


# ---- CPU against the definition ---------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_is_decode_fp32_step_encode(kind, mode):
    a = make_args("cpu", mode, kind)
    expected = clone(a)
    for _ in range(3):  # several steps: each starts from the codes the last one wrote
        coded_step(a)
        reference_step(expected)
        assert_same(a, expected)
    assert float(a["step"]) == 6.0


@pytest.mark.parametrize("options", [
    {"clip": 0.0}, {"clip": 1e6}, {"grad_scale": None}, {"write_grads": False},
    {"adam_w_mode": False}, {"weight_decay": 0.0},
], ids=["no-clip", "clip-not-reached", "unscaled", "read-grads", "l2", "no-decay"])
@pytest.mark.parametrize("kind", KINDS)
def test_coded_step_options(device, kind, options):
    # "no-decay" has no trust ratio: the first pass, which only forms sums, is left out.
    a = make_args(device, "bf16-masters", kind, seed=1)
    expected = clone(a)
    coded_step(a, **options)
    reference_step(expected, **options)
    assert_same(a, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_the_halves_give_the_whole_step(kind):
    a = make_args("cpu", "bf16-split", kind, seed=2)
    expected = clone(a)
    before = clone(a)
    sums = torch.zeros((len(a["params"]), 2), dtype=torch.float64)
    coded_step(a, sums=sums, part="moments")
    assert_same(a, before)  # the first half writes nothing but the sums
    assert sums.abs().sum() > 0
    coded_step(a, sums=sums, part="apply")
    reference_step(expected)
    assert_same(a, expected)


def test_apply_forms_the_ratios_from_the_sums_it_is_given():
    a = make_args("cpu", "fp32", "int8", seed=3)
    b = clone(a)
    sums = torch.zeros((len(a["params"]), 2), dtype=torch.float64)
    coded_step(a, sums=sums, part="moments")
    coded_step(a, sums=sums, part="apply")
    coded_step(b, sums=sums * 4.0, part="apply")  # both norms doubled: the same ratios
    assert_same(a, b)
    c = make_args("cpu", "fp32", "int8", seed=3)
    coded_step(c, sums=sums * torch.tensor([4.0, 1.0], dtype=torch.float64), part="apply")
    assert not torch.equal(c["params"][0], a["params"][0])  # param norm doubled: ratio doubled


@pytest.mark.parametrize("part", ["both", "moments", "apply"])
def test_found_inf_writes_nothing(part):
    a = make_args("cpu", "bf16-kahan", "fp8", seed=4)
    before = clone(a)
    sums = None if part == "both" else torch.ones((len(a["params"]), 2), dtype=torch.float64)
    coded_step(a, found_inf=torch.ones(1), sums=sums, part=part)
    assert_same(a, before)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_grads_code_as_the_reference(kind, bad, position):
    # Not skipped: the nonfinite value reaches the moments, whose blocks then code to inf or
    # nan scales, and the param through its trust ratio, as the fp32 op and the codes' rule say.
    a = make_args("cpu", "fp32", kind, seed=6)
    g = a["grads"][0].view(-1)
    g[position_index(position, g.numel())] = bad
    expected = clone(a)
    coded_step(a, clip=0.0)
    reference_step(expected, clip=0.0)
    assert_same(a, expected)
    assert not torch.isfinite(a["exp_avg_sq_scales"][0]).all()


def test_results_do_not_depend_on_the_thread_count():
    one, more = make_args("cpu", "bf16-stochastic", "int8"), make_args("cpu", "bf16-stochastic",
                                                                      "int8")
    call_with_one_and_more_threads(coded_step, one, more)
    assert_same(one, more)


def test_param_under_one_block_and_empty_param_are_taken():
    # The op codes whatever it is given; which params keep fp32 moments is FusedLAMB's choice.
    a = make_args("cpu", "fp32", "int8", shapes=[(3,), (0,)])
    expected = clone(a)
    coded_step(a)
    reference_step(expected)
    assert_same(a, expected)


# ---- opcheck, the fake, errors -----------------------------------------------------------------


def _op_args(a, sums=None, part="both"):
    rest, kw = _common(a, 4.0, None, 1.0, None, True, 0.01, True)
    args = (a["params"], a["grads"], a["exp_avg_codes"], a["exp_avg_scales"],
            a["exp_avg_sq_codes"], a["exp_avg_sq_scales"], *rest, sums, part)
    return args, dict(kw, state_dtype=a["kind"])


@pytest.mark.parametrize("part", ["both", "moments", "apply"])
@pytest.mark.parametrize("mode", ["fp32", "bf16-masters", "bf16-split"])
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck(device, kind, mode, part):
    a = make_args(device, mode, kind, shapes=[(300,), (5, 7)])
    sums = None if part == "both" else torch.ones((2, 2), dtype=torch.float64, device=device)
    args, kwargs = _op_args(a, sums, part)
    # opcheck's schema test does arithmetic on the inputs, which torch has no fp8 kernel for on
    # the CPU; int8 runs it, with the same schema.
    utils = (("test_faketensor", "test_aot_dispatch_dynamic") if kind == "fp8"
             else ("test_schema", "test_autograd_registration", "test_faketensor",
                   "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.ampfuse.fused_lamb_coded_.default, args, kwargs,
                          test_utils=utils)


def test_fake_checks_like_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = make_args("cpu", "fp32", "int8", shapes=[(300,)])
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: [mode.from_tensor(t) for t in v] if isinstance(v, list) and v and isinstance(
            v[0], torch.Tensor) else (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
            for k, v in a.items()}
        args, kwargs = _op_args(fake)
        torch.ops.ampfuse.fused_lamb_coded_(*args, **kwargs)  # a good call traces
        fake["exp_avg_scales"] = [mode.from_tensor(torch.zeros(1))]
        args, kwargs = _op_args(fake)
        with raises_naming("exp_avg_scales\\[0\\]", "ceil\\(numel / 256\\) = 2"):
            torch.ops.ampfuse.fused_lamb_coded_(*args, **kwargs)


def _bad(change):
    a = make_args("cpu", "fp32", "int8", shapes=[(300,), (4, 70)])
    change(a)
    return a


BAD = {
    "state_dtype": (lambda a: a.update(kind="int4"), ["state_dtype='int4'", "'int8', 'fp8'"]),
    "code dtype": (lambda a: a["exp_avg_sq_codes"].__setitem__(
        0, a["exp_avg_sq_codes"][0].view(torch.int8)), ["exp_avg_sq_codes\\[0\\]", "uint8"]),
    "fp8 codes under int8": (lambda a: a["exp_avg_codes"].__setitem__(
        1, torch.zeros(4, 70, dtype=torch.float8_e4m3fn)), ["exp_avg_codes\\[1\\]", "int8"]),
    "code shape": (lambda a: a["exp_avg_codes"].__setitem__(
        1, torch.zeros(70, 4, dtype=torch.int8)), ["exp_avg_codes\\[1\\]", "laid out like"]),
    "code layout": (lambda a: a["exp_avg_codes"].__setitem__(
        1, torch.zeros(70, 4, dtype=torch.int8).t()), ["exp_avg_codes\\[1\\]", "strides"]),
    "scales count": (lambda a: a["exp_avg_sq_scales"].__setitem__(
        0, torch.zeros(1)), ["exp_avg_sq_scales\\[0\\]", "= 2 elements"]),
    "scales dtype": (lambda a: a["exp_avg_scales"].__setitem__(
        1, torch.zeros(2, dtype=torch.float64)), ["exp_avg_scales\\[1\\]", "float32"]),
    "missing codes": (lambda a: a["exp_avg_codes"].pop(), ["exp_avg_codes", "one tensor per"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_argument_errors_name_the_argument(case):
    change, patterns = BAD[case]
    a = _bad(change)
    with raises_naming(*patterns):
        coded_step(a)


def test_apply_needs_the_norm_when_clipping():
    a = make_args("cpu", "fp32", "int8", shapes=[(300,)])
    sums = torch.ones((1, 2), dtype=torch.float64)
    args, kwargs = _op_args(a, sums, "apply")
    args = list(args)
    args[18] = None  # grad_norm
    with raises_naming("max_grad_norm=1", "part='apply' needs it too"):
        torch.ops.ampfuse.fused_lamb_coded_(*args, **kwargs)


# ---- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_coded_step_is_decode_fp32_step_encode(kind, mode):
    # On the GPU the definition runs fused_lamb_'s CUDA kernels, so the bits are those.
    a = make_args("cuda", mode, kind)
    expected = clone(a)
    for _ in range(2):
        coded_step(a)
        reference_step(expected)
        assert_same(a, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fp32", "bf16-masters", "bf16-stochastic", "bf16-split"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_the_cpu_given_the_same_sums(kind, mode):
    # The fp32 sums of squares are added in another order on the GPU (test_lamb_op.py); given
    # the same sums, the second half is element-wise and agrees bit for bit. The global grad
    # norm is such a sum too (multi_tensor_l2norm adds in fp32 on the GPU, in double on the
    # CPU; with seed 8 the two round an ulp apart), and both halves clip by it, so both devices
    # get the CPU's norm. part="moments" writes no grads, so one norm serves all four calls.
    cpu = make_args("cpu", mode, kind, seed=8)
    cuda = make_args("cuda", mode, kind, seed=8)
    norm = ampfuse.ops.multi_tensor_l2norm(cpu["grads"], False)[0]
    sums = torch.zeros((len(cpu["params"]), 2), dtype=torch.float64)
    coded_step(cpu, sums=sums, part="moments", norm=norm)
    cuda_sums = torch.zeros_like(sums, device="cuda")
    coded_step(cuda, sums=cuda_sums, part="moments", norm=norm.cuda())
    torch.testing.assert_close(cuda_sums.cpu(), sums, rtol=1e-6, atol=0)
    coded_step(cpu, sums=sums, part="apply", norm=norm)
    coded_step(cuda, sums=sums.cuda(), part="apply", norm=norm.cuda())
    assert_same(cuda, cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("part", ["both", "apply"])
def test_cuda_found_inf_writes_nothing(part):
    a = make_args("cuda", "bf16-kahan", "fp8", seed=4)
    before = clone(a)
    sums = None if part == "both" else torch.ones((len(a["params"]), 2), dtype=torch.float64,
                                                  device="cuda")
    coded_step(a, found_inf=torch.ones(1, device="cuda"), sums=sums, part=part)
    assert_same(a, before)


@pytest.mark.cuda
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_nan_grad_codes_as_the_reference(kind, position):
    a = make_args("cuda", "fp32", kind, seed=6)
    g = a["grads"][1].view(-1)
    g[position_index(position, g.numel())] = float("nan")
    expected = clone(a)
    coded_step(a, clip=0.0)
    reference_step(expected, clip=0.0)
    assert_same(a, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_step_holds_no_fp32_moments(kind):
    # fp32 copies of both moments of 4M params would be 32 MiB at the step's peak; the coded
    # kernels' own scratch is a few floats per 64K-element chunk and per tensor.
    n = 1 << 22
    a = make_args("cuda", "bf16-masters", kind, shapes=[(n,)])
    norm = ampfuse.ops.multi_tensor_l2norm(a["grads"], False)[0]
    coded_step(a, norm=norm)  # the allocator's first blocks, the constants buffer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    coded_step(a, norm=norm)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < n // 8


def test_dtensors_are_refused_with_the_way_to_call_it(one_rank):
    # Sharded codes carry scales padded to the largest shard's blocks, which only FusedLAMB
    # cuts to each rank's own (test_fsdp2.py runs it there).
    import ampfuse.ops.dtensor  # noqa: F401  (the rules; the wrappers import it themselves)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    a = make_args("cpu", "fp32", "int8", shapes=[(300,)])
    for key in ("params", "grads", "exp_avg_codes", "exp_avg_sq_codes"):
        a[key] = [distribute_tensor(t, mesh, [Shard(0)]) for t in a[key]]
    with raises_naming("fused_lamb_coded_ takes no DTensors", "part='moments'",
                       "combine_over_shards"):
        coded_step(a, clip=0.0)
