"""The block-wise 8-bit moment codes (ampfuse.optimizers._state_codes) against float64."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ampfuse.optimizers import _state_codes as codes_mod
from ampfuse.optimizers._state_codes import (
    BLOCK,
    check_state_dtype,
    dequantize_moment,
    keeps_fp32_moments,
    quantize_moment,
    state_bytes,
)
from helpers import AMPFUSE_PATH

KINDS = ("int8", "fp8")


def _moments(numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A first moment of mixed sign and a second moment spanning many octaves per block."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 1, (numel,), generator=gen)
    v = torch.rand(numel, generator=gen) * 10.0 ** torch.randint(-14, 0, (numel,), generator=gen)
    return m, v


def _per_block(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.numel()) % BLOCK
    return torch.cat([x, x.new_zeros(pad)]).view(-1, BLOCK)


def _bound(kind: str, second: bool, coded: torch.Tensor) -> torch.Tensor:
    """The largest error a round to nearest may make on each coded value (float64), in the
    coded domain (sqrt(v) for the second moment), from the block absmax."""
    absmax = coded.abs().amax(dim=1, keepdim=True)
    if kind == "int8" and not second:
        return (absmax / 254.0).expand_as(coded)
    if kind == "int8":
        # 4 mantissa bits: half an ulp is 2**-5 of the value; below 2**-14 a step of 2**-18.
        return torch.maximum(coded.abs() * 2.0 ** -5, absmax * 2.0 ** -19)
    # e4m3: 3 mantissa bits (2**-4 of the value), subnormal step 2**-9 of absmax / 448.
    return torch.maximum(coded.abs() * 2.0 ** -4, absmax / 448.0 * 2.0 ** -10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", [BLOCK, BLOCK + 1, 3 * BLOCK - 1, 5000])
def test_round_trip_within_half_a_step_of_float64(kind: str, numel: int) -> None:
    m, v = _moments(numel, seed=numel)
    for second, x in ((False, m), (True, v)):
        c, scales = quantize_moment(x, kind, second)
        back = dequantize_moment(c, scales, kind, second).double()
        assert back.shape == (numel,) and scales.numel() == math.ceil(numel / BLOCK)
        ref = x.double()
        coded_ref = _per_block(ref.sqrt() if second else ref)
        coded_back = _per_block(back.sqrt() if second else back)
        # fp32 arithmetic in the codec adds a few fp32 ulps on top of the rounding itself.
        slack = coded_ref.abs() * 2.0 ** -21 + 1e-45
        err = (coded_back - coded_ref).abs()
        bound = _bound(kind, second, coded_ref) + slack
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{kind} second={second}: worst element {worst} err {err.view(-1)[worst]:.3e} "
            f"bound {bound.view(-1)[worst]:.3e}")


@pytest.mark.parametrize("kind", KINDS)
def test_small_second_moments_are_not_rounded_to_zero(kind: str) -> None:
    # One large v in the block and the rest 2**-30 of it: a linear code would zero them all.
    v = torch.full((BLOCK,), 2.0 ** -30)
    v[7] = 1.0
    c, scales = quantize_moment(v, kind, second=True)
    back = dequantize_moment(c, scales, kind, second=True)
    assert back[7] == 1.0
    others = torch.cat([back[:7], back[8:]])
    assert bool((others > 0).all())
    assert bool(((others.double() - 2.0 ** -30).abs() <= 2.0 ** -30 * 0.13).all())


def test_the_unsigned_code_map_is_monotonic_and_round_trips_every_code() -> None:
    all_codes = torch.arange(0, 241, dtype=torch.uint8)
    values = codes_mod._decode_u8(all_codes)
    assert values[0] == 0.0 and values[240] == 1.0
    assert bool((values[1:] > values[:-1]).all())
    assert torch.equal(codes_mod._encode_u8(values), all_codes)
    # Ties round to the even code.
    midpoint = (values[17] + values[18]) / 2
    assert int(codes_mod._encode_u8(midpoint.reshape(1))) == 18


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("second", [False, True])
def test_codes_of_decoded_codes_are_the_same_codes(kind: str, second: bool) -> None:
    # A moment that is decoded and coded again without change keeps its bits: a kernel that
    # requantizes an untouched block writes what was there.
    m, v = _moments(4 * BLOCK + 3, seed=5)
    c, scales = quantize_moment(v if second else m, kind, second)
    again, scales_again = quantize_moment(dequantize_moment(c, scales, kind, second), kind, second)
    assert torch.equal(again.view(torch.uint8), c.view(torch.uint8))
    assert torch.equal(scales_again, scales)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_follow_the_param_and_the_last_block_is_short(kind: str) -> None:
    x = torch.ones(BLOCK + 10)
    x[BLOCK:] = 0.5
    c, scales = quantize_moment(x, kind, second=False)
    assert scales.tolist() == [1.0, 0.5]
    assert c.numel() == BLOCK + 10
    assert torch.equal(dequantize_moment(c, scales, kind, second=False), x)


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_of_zeros_codes_to_zeros(kind: str) -> None:
    for second in (False, True):
        c, scales = quantize_moment(torch.zeros(2 * BLOCK), kind, second)
        assert scales.tolist() == [0.0, 0.0]
        assert torch.equal(dequantize_moment(c, scales, kind, second), torch.zeros(2 * BLOCK))


def test_code_dtypes_and_bytes() -> None:
    x = torch.rand(4 * BLOCK)
    assert quantize_moment(x, "int8", False)[0].dtype == torch.int8
    assert quantize_moment(x, "int8", True)[0].dtype == torch.uint8
    assert quantize_moment(x, "fp8", False)[0].dtype == torch.float8_e4m3fn
    # One byte per element plus one fp32 scale per block: 1 + 4/256 bytes.
    assert state_bytes(*quantize_moment(x, "int8", True)) == 4 * BLOCK + 4 * 4


def test_small_tensor_rule_and_bad_values() -> None:
    assert keeps_fp32_moments(BLOCK - 1) and not keeps_fp32_moments(BLOCK)
    assert check_state_dtype("FusedAdam", "int8") == "int8"
    for bad in ("int4", "float32", None, 8):
        with pytest.raises(ValueError, match="'fp32'.*'int8'.*'fp8'"):
            check_state_dtype("FusedAdam", bad)
    with pytest.raises(ValueError, match="'int8' or 'fp8'"):
        quantize_moment(torch.ones(BLOCK), "fp16", False)


def test_second_moment_scales_are_correctly_rounded_square_roots() -> None:
    # The kernels' sqrtf is correctly rounded; the reference must be too (torch's vectorized
    # fp32 sqrt on the CPU need not be).
    _, v = _moments(20 * BLOCK, seed=3)
    for kind in KINDS:
        _, scales = quantize_moment(v, kind, second=True)
        expected = torch.sqrt(_per_block(v).amax(dim=1).double()).float()
        assert torch.equal(scales, expected)


def _adam_state(shape: tuple[int, ...], seed: int) -> dict:
    numel = math.prod(shape)
    m, v = _moments(numel, seed)
    return {"step": torch.tensor(7.0), "exp_avg": m.view(shape), "exp_avg_sq": v.view(shape),
            "max_exp_avg_sq": (v * 2).view(shape)}


@pytest.mark.parametrize("kind", KINDS)
def test_state_converts_fp32_to_codes_and_back(kind: str) -> None:
    shape = (3, 200)
    state = _adam_state(shape, seed=9)
    coded = codes_mod.convert_moments(state, kind)
    assert codes_mod.codes_kind(coded) == kind and codes_mod.codes_kind(state) == "fp32"
    assert coded["step"] is state["step"]
    assert set(coded) == {"step"} | {f"{k}_{s}" for k in codes_mod.MOMENT_KEYS
                                     for s in ("codes", "scales")}
    for key in codes_mod.MOMENT_KEYS:
        assert coded[f"{key}_codes"].shape == shape  # laid out like the param
    back = codes_mod.convert_moments(coded, "fp32")
    assert set(back) == set(state)
    for key, second in codes_mod.MOMENT_KEYS.items():
        assert back[key].shape == shape and back[key].dtype == torch.float32
        c, s = quantize_moment(state[key], kind, second)
        assert torch.equal(back[key].reshape(-1), dequantize_moment(c, s, kind, second))
    # Coded -> fp32 -> coded keeps every bit; coded -> the other kind goes through fp32.
    again = codes_mod.convert_moments(back, kind)
    for key in codes_mod.MOMENT_KEYS:
        assert torch.equal(again[f"{key}_codes"].view(torch.uint8),
                           coded[f"{key}_codes"].view(torch.uint8))
        assert torch.equal(again[f"{key}_scales"], coded[f"{key}_scales"])
    other = "fp8" if kind == "int8" else "int8"
    assert codes_mod.codes_kind(codes_mod.convert_moments(coded, other)) == other


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_of_a_channels_last_moment_follow_memory_order(kind: str) -> None:
    # The kernels walk a param and its state in memory order, so blocks are cut in that order:
    # a channels_last moment codes as its memory-order flat view would.
    state = _adam_state((4, 16, 3, 3), seed=5)
    moments = {k: v.to(memory_format=torch.channels_last) for k, v in state.items() if k != "step"}
    coded = codes_mod.convert_moments(dict(state, **moments), kind)
    for key, second in codes_mod.MOMENT_KEYS.items():
        codes = coded[f"{key}_codes"]
        assert codes.stride() == moments[key].stride()
        flat = moments[key].permute(0, 2, 3, 1).reshape(-1)  # memory order of channels_last
        c, s = quantize_moment(flat, kind, second)
        assert torch.equal(codes.permute(0, 2, 3, 1).reshape(-1).view(torch.uint8),
                           c.view(torch.uint8))
        assert torch.equal(coded[f"{key}_scales"], s)
    back = codes_mod.convert_moments(coded, "fp32")
    assert back["exp_avg"].stride() == moments["exp_avg"].stride()


def test_prepare_moments_converts_and_makes_missing_ones() -> None:
    p = torch.zeros(3, 200)
    state = _adam_state((3, 200), seed=3)
    step = state["step"]
    held = dict(state)
    codes_mod.prepare_moments(p, held, "int8", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    assert codes_mod.codes_kind(held) == "int8" and "exp_avg" not in held
    assert held["step"] is step
    expected = codes_mod.convert_moments(state, "int8")
    assert all(torch.equal(held[k].view(torch.uint8) if held[k].dtype != torch.float32
                           else held[k], expected[k].view(torch.uint8)
                           if expected[k].dtype != torch.float32 else expected[k])
               for k in expected)
    codes_mod.prepare_moments(p, held, "fp32", ("exp_avg", "exp_avg_sq"))
    assert codes_mod.codes_kind(held) == "fp32" and "exp_avg_codes" not in held
    fresh: dict = {}
    codes_mod.prepare_moments(p, fresh, "fp8", ("exp_avg", "exp_avg_sq"))
    assert set(fresh) == {"exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
                          "exp_avg_sq_scales"}
    assert fresh["exp_avg_scales"].shape == (3,) and not fresh["exp_avg_scales"].any()
    assert torch.equal(codes_mod.dequantize_moment(codes_mod.memory_flat(fresh["exp_avg_codes"]),
                                                   fresh["exp_avg_scales"], "fp8", False),
                       torch.zeros(600))


def test_state_of_a_small_tensor_stays_fp32() -> None:
    state = _adam_state((BLOCK - 1,), seed=2)
    coded = codes_mod.convert_moments(state, "int8")
    assert codes_mod.codes_kind(coded) == "fp32"
    assert all(coded[k] is state[k] for k in state)
    with pytest.raises(ValueError, match="state_dtype='bf16'"):
        codes_mod.convert_moments(state, "bf16")


def test_quality_script_runs_and_its_fp32_reference_is_torchs_adamw() -> None:
    # benchmarks/state_codes_quality.py at a few steps: every row prints, and its unfused
    # reference optimizer with fp32 moments ends where torch.optim.AdamW does.
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=AMPFUSE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "state_codes_quality.py"),
         "--steps-digits", "3", "--steps-gpt", "3"],
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()
            if line.startswith(("digits ", "gpt "))]
    value = {(r[0], r[1]): r[-5] for r in rows}
    for workload in ("digits", "gpt"):
        assert {s for w, s in value if w == workload} == {
            "torch.optim.AdamW", *(f"{kind}-{state}" for kind in ("unfused", "FusedAdamW")
                                   for state in ("fp32", "int8", "fp8"))}
        assert value[(workload, "unfused-fp32")] == value[(workload, "torch.optim.AdamW")]
    assert result.stdout.count("bytes per param") == 6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", [0, BLOCK // 2, BLOCK - 1])
def test_a_nonfinite_moment_makes_its_block_nan_and_leaves_others(kind: str, where: int) -> None:
    for second, bad in ((False, float("nan")), (False, float("-inf")), (True, float("nan")),
                        (True, float("inf"))):
        x = torch.rand(2 * BLOCK) + 0.5
        x[BLOCK + where] = bad
        c, scales = quantize_moment(x, kind, second)
        back = dequantize_moment(c, scales, kind, second)
        assert bool(back[BLOCK:].isnan().all())
        assert bool(back[:BLOCK].isfinite().all())
        assert torch.equal(c[BLOCK:].view(torch.uint8), torch.zeros(BLOCK, dtype=torch.uint8))
