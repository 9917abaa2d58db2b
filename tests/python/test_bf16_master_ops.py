"""fused_adam_ and fused_sgd_ with master_mode "stochastic", "kahan" and "split" (bf16 params
without fp32 masters): opcheck, the rounding itself, its keying, the skip contract, argument
errors, and CPU/CUDA equality. The optimizers built on them: test_bf16_master_modes.py."""

import pytest
import torch

import ampfuse  # noqa: F401  (loads the ops)
from ampfuse.optimizers._precision import joined_master

from helpers import raises_naming
from tolerances import assert_close_report, assert_lists_exact

SHAPES = [(5,), (65537,), (3, 4), (0,)]
MODES = ["stochastic", "kahan", "split"]


def _args(device, mode, seed=0, shapes=SHAPES, offset=0):
    """The ops' arguments; with `offset`, every tensor is a view that many elements into a
    flat allocation of its own (unaligned for offset 1: the CUDA loops' one-element path)."""
    gen = torch.Generator().manual_seed(seed)
    if offset:
        inner = _args(device, mode, seed, shapes)
        for key in ("params", "grads", "state", "state2", "extra"):
            inner[key] = [_offset_view(t, offset) for t in inner[key]]
        return inner
    params = [torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16)
              for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device=device, dtype=d)
             for s, d in zip(shapes, [torch.float32, torch.bfloat16, torch.float16,
                                      torch.bfloat16])]
    if mode == "kahan":
        extra = [(torch.randn(s, generator=gen) * 2**-10).to(device=device, dtype=torch.bfloat16)
                 for s in shapes]
    elif mode == "split":
        extra = [torch.randint(-2**15, 2**15, s, generator=gen, dtype=torch.int16).to(device)
                 for s in shapes]
    else:
        extra = []
    return dict(
        params=params, grads=grads,
        state=[torch.rand(s, generator=gen).to(device) for s in shapes],
        state2=[torch.rand(s, generator=gen).to(device) for s in shapes],
        extra=extra, step=torch.full((1,), 3.0, device=device),
        lr=torch.full((1,), 1e-2, device=device),
        ids=[11, 12, 13, 14] if mode == "stochastic" else [],
    )


def _offset_view(t, offset):
    """A copy of t viewed `offset` elements into a flat buffer of its dtype and device."""
    flat = torch.zeros(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = flat[offset:].view(t.shape)
    view.copy_(t)
    return view


def _adam(a, mode, found_inf=None, seed=5, write_grads=True):
    torch.ops.ampfuse.fused_adam_(
        a["params"], a["grads"], a["state"], a["state2"], [], a["extra"], a["step"], a["lr"],
        0.9, 0.999, 1e-8, 0.01, True, True, False, False, torch.full_like(a["lr"], 4.0),
        found_inf, write_grads, mode, a["ids"], seed)


def _sgd(a, mode, found_inf=None, seed=5):
    torch.ops.ampfuse.fused_sgd_(
        a["params"], a["grads"], a["state"], a["extra"], a["step"], a["lr"], 0.9, 0.0, 0.01,
        False, False, None, found_inf, False, False, mode, a["ids"], seed)


@pytest.mark.parametrize("mode", MODES)
def test_opcheck(device, mode):
    a = _args(device, mode, shapes=[(5,), (257,), (3, 4), (0,)])  # opcheck runs many times
    scale, found_inf = torch.full((1,), 8.0, device=device), torch.zeros(1, device=device)
    torch.library.opcheck(
        torch.ops.ampfuse.fused_adam_.default,
        (a["params"], a["grads"], a["state"], a["state2"], a["state2"], a["extra"], a["step"],
         a["lr"], 0.9, 0.999, 1e-8, 0.01, True, True, True, False, scale, found_inf, True,
         mode, a["ids"], 3),
    )
    torch.library.opcheck(
        torch.ops.ampfuse.fused_sgd_.default,
        (a["params"], a["grads"], a["state"], a["extra"], a["step"], a["lr"], 0.9, 0.0, 0.01,
         True, False, scale, None, True, False, mode, a["ids"], 3),
    )


def _sgd_one(value, delta, n, mode="stochastic", param_id=0, seed=0, step=0.0, extra=None):
    """One plain SGD step (lr 1, grad -delta) of n bf16 elements equal to `value`."""
    p = torch.full((n,), value, dtype=torch.bfloat16)
    grad = torch.full((n,), -delta)
    ids = [param_id] if mode == "stochastic" else []
    torch.ops.ampfuse.fused_sgd_(
        [p], [grad], [], [] if extra is None else [extra], torch.full((1,), step),
        torch.ones(1), 0.0, 0.0, 0.0, False, False, None, None, False, False, mode, ids, seed)
    return p


def test_stochastic_rounding_is_unbiased_and_keyed():
    """1 + 2^-9 lies a quarter of the way from 1 to the next bf16 (1 + 2^-7): about a quarter
    of the elements round up, over span boundaries; the bits depend on seed, step and param id,
    and on nothing else."""
    n = 3 * 65536 + 7
    p = _sgd_one(1.0, 2.0**-9, n)
    up = (p == 1.0 + 2.0**-7).float().mean().item()
    assert ((p == 1.0) | (p == 1.0 + 2.0**-7)).all()
    assert abs(up - 0.25) < 0.01, up  # 8 standard deviations at this n
    assert torch.equal(p, _sgd_one(1.0, 2.0**-9, n))
    for changed in ({"seed": 1}, {"step": 1.0}, {"param_id": 1}):
        assert not torch.equal(p, _sgd_one(1.0, 2.0**-9, n, **changed)), changed
    # Exactly representable results are never moved; an update that overflows gives inf
    # (adding random bits to inf's pattern would make a NaN).
    assert torch.equal(_sgd_one(1.0, 2.0**-7, 100), torch.full((100,), 1 + 2.0**-7,
                                                               dtype=torch.bfloat16))
    assert torch.isposinf(_sgd_one(3e38, 3e38, 10)).all()


def test_kahan_carries_the_rounding_error():
    compensation = torch.zeros(4, dtype=torch.bfloat16)
    p = _sgd_one(1.0, 2.0**-9, 4, mode="kahan", extra=compensation)
    assert torch.equal(p, torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(compensation, torch.full((4,), 2.0**-9, dtype=torch.bfloat16))
    # An overflow to inf leaves no compensation behind (inf - inf would poison the next load).
    p = _sgd_one(3e38, 3e38, 4, mode="kahan", extra=compensation)
    assert torch.isposinf(p).all() and torch.equal(compensation, torch.zeros_like(compensation))


def test_split_keeps_the_fp32_value_in_two_halves():
    low = torch.zeros(4, dtype=torch.int16)
    p = _sgd_one(1.0, 2.0**-20, 4, mode="split", extra=low)
    assert torch.equal(joined_master(p, low), torch.full((4,), 1.0 + 2.0**-20))
    # Just below 1 + half a bf16 step the param rounds up to 1 + 2^-7 and the low bits hold
    # the (negative) remainder.
    p = _sgd_one(1.0, 2.0**-8 + 2.0**-20, 4, mode="split", extra=low.zero_())
    assert torch.equal(p, torch.full((4,), 1.0 + 2.0**-7, dtype=torch.bfloat16))
    assert torch.equal(joined_master(p, low), torch.full((4,), 1.0 + 2.0**-8 + 2.0**-20))
    assert (low < 0).all()


@pytest.mark.parametrize("op", ["adam", "sgd"])
@pytest.mark.parametrize("mode", MODES)
def test_overflow_writes_nothing(device, op, mode):
    a = _args(device, mode)
    before = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
              for k, v in a.items() if k != "ids"}
    (_adam if op == "adam" else _sgd)(a, mode, found_inf=torch.ones(1, device=device))
    for key, value in before.items():
        for i, (b, t) in enumerate(zip(value, a[key]) if isinstance(value, list)
                                   else [(value, a[key])]):
            assert_close_report(t, b, exact=True, msg=f"{key}[{i}]")


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("op", ["adam", "sgd"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_cpu_bit_for_bit(op, mode, offset):
    """Same update math, same bit-level rounding, same counter-based random bits; in the CUDA
    loops' 4-element packs (aligned) and one element at a time (unaligned)."""
    results = []
    for device in ("cpu", "cuda"):
        a = _args(device, mode, offset=offset)
        for _ in range(3):
            (_adam if op == "adam" else _sgd)(a, mode)
        results.append(a)
    assert_lists_exact(results[1], results[0], ("params", "grads", "state", "state2", "extra"),
                       " cuda vs cpu")


def check_argument_errors(first, second):
    """master_args.h's refusals, through two ops' calls (each as op(args, mode)), so that the
    checks of both are met."""
    a = _args("cpu", "kahan")
    with raises_naming("master_mode='kahn'", "'stochastic', 'kahan', 'split'"):
        first(a, "kahn")
    with raises_naming(r"master_params\[0\]", "torch.int16", "split"):
        first(a, "split")
    a["extra"] = a["extra"][:2]
    with raises_naming("one torch.bfloat16 compensation per param"):
        second(a, "kahan")
    a = _args("cpu", "stochastic")
    a["ids"] = [1, 2]
    with raises_naming("one param id per param"):
        first(a, "stochastic")
    a["ids"] = [1, 2, 3, -4]
    with raises_naming(r"param_ids\[3\]", r"\[0, 2\^31\)"):
        second(a, "stochastic")
    a["ids"] = [1, 2, 3, 4]
    with raises_naming("param_ids", "master_mode='stochastic' only"):
        first(a, "fp32")
    a["params"][0] = a["params"][0].half()
    with raises_naming(r"params\[0\]", "torch.float16", "master_mode='fp32'"):
        second(a, "stochastic")


def test_argument_errors():
    check_argument_errors(_adam, _sgd)
