"""Block-wise 8-bit codes for Adam's moments (the format behind a future ``state_dtype``).

This module is the format's definition and its plain-torch reference: the fused kernels that
will dequantize, update and requantize inside the optimizer step must produce these bits, and
checkpoint conversion (fp32 state <-> codes) goes through these functions. It is not yet wired
into any optimizer (issue 33).

Layout. A param's moment, flattened, is cut into blocks of ``BLOCK`` (256) elements; a block
never spans two params (each param is quantized on its own, its last block may be short). Each
block has one fp32 scale, its absmax (of the value that is coded, see below). A tensor with
fewer than ``BLOCK`` elements (biases, norm weights) keeps fp32 moments: one rule, by element
count alone (``keeps_fp32_moments``), so the rule needs nothing but the shape.

Codes, rounding to nearest everywhere (ties to even), so a CPU and a CUDA kernel that do the
same fp32 operations get the same bits:

- ``"int8"``, first moment ``m`` (signed): linear, ``code = round(m / absmax * 127)``, decoded
  as ``code / 127 * absmax`` (fp32 operations in that order). An error in ``m``
  enters the update linearly and an ``m`` rounded to zero makes no update, so a linear code is
  safe for it.
- ``"int8"``, second moment ``v`` (non-negative): the code stores ``sqrt(v)`` (the quantity the
  update divides by) relative to its block absmax, in an unsigned 8-bit float: 4 exponent bits
  (bias 15) and 4 mantissa bits, with subnormals, no inf/nan. Code ``e * 16 + f`` is
  ``(16 + f) * 2**(e - 19)`` for ``e >= 1`` and ``f * 2**-18`` for ``e == 0``; 1.0 is code 0xF0.
  A linear code would round every ``sqrt(v)`` under ``absmax / 510`` to zero, and the update
  ``m / (sqrt(v) + eps)`` of such an element would explode; the peers avoid that with a
  nonlinear code map (bitsandbytes' and torchao's dynamic tree map, arXiv 2110.02861). This
  map keeps ``sqrt(v)`` to 1/32 relative down to ``2**-14`` of its block's absmax and to
  ``2**-19`` absolute below (``v`` down to about ``2**-36`` of the block's largest ``v``), and
  it decodes with exact fp32 arithmetic, no table.
- ``"fp8"``: both moments as ``torch.float8_e4m3fn`` codes of ``x / absmax * 448`` (448 is
  e4m3's largest finite value), decoded as ``code / 448 * absmax``; ``m`` signed, and the second
  moment again stored as ``sqrt(v)``, which halves the octaves e4m3's 18 must cover.

Every code is normalised by the absmax and decoded as ``(code value) * absmax`` last, so the
block's largest element decodes to the absmax exactly and coding decoded codes again gives the
same codes and scales. A block holding a nan or inf (a nonfinite grad stepped without
skip_nonfinite) gets a nan or inf scale and codes 0, so it decodes to nan as a whole. A block
of zeros has absmax 0; its scale is stored as 0 and its codes are 0 (decoded 0).
"""

from __future__ import annotations

import torch

from ampfuse.optimizers import _state_codes_sharded as sharded

BLOCK = 256
STATE_DTYPES = ("fp32", "int8", "fp8")
_E4M3_MAX = 448.0
# Unsigned e4m4 of sqrt(v)/absmax: smallest normal 2**-14, subnormal step 2**-18.
_U8_MIN_NORMAL = 2.0 ** -14
_U8_SUBNORMAL_STEP = 2.0 ** -18


def check_state_dtype(owner: str, value: object) -> str:
    """``value`` if it is one of STATE_DTYPES, else a ValueError naming them."""
    if not isinstance(value, str) or value not in STATE_DTYPES:
        raise ValueError(
            f"{owner}: state_dtype={value!r} is not supported; use 'fp32' (the default), "
            "'int8' (block-wise 8-bit codes) or 'fp8' (block-wise e4m3 codes).")
    return value


def keeps_fp32_moments(numel: int) -> bool:
    """A tensor smaller than one block keeps fp32 moments whatever the state_dtype."""
    return numel < BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened to fp32 and padded with zeros to whole blocks, as (blocks, BLOCK)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _check_kind(kind: str) -> None:
    if kind not in ("int8", "fp8"):
        raise ValueError(f"ampfuse: moment codes are 'int8' or 'fp8', got {kind!r}.")


def _round_mantissa_to_4_bits(n: torch.Tensor) -> torch.Tensor:
    """n (fp32, >= 2**-14) rounded to 4 mantissa bits, ties to even, on its bit pattern."""
    bits = n.view(torch.int32)
    keep_lsb = (bits >> 19) & 1
    rounded = (bits + (0x3FFFF + keep_lsb)) & ~0x7FFFF
    return rounded.view(torch.float32)


def _encode_u8(n: torch.Tensor) -> torch.Tensor:
    """Unsigned e4m4 codes of n in [0, 1] (see the module docstring)."""
    sub = torch.round(n * (1.0 / _U8_SUBNORMAL_STEP))  # 0..16; 16 is the first normal code
    r = _round_mantissa_to_4_bits(torch.where(n >= _U8_MIN_NORMAL, n, _U8_MIN_NORMAL))
    bits = r.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + 15
    mantissa = (bits >> 19) & 0xF
    normal = exponent * 16 + mantissa
    return torch.where(n >= _U8_MIN_NORMAL, normal, sub.to(torch.int32)).to(torch.uint8)


def _decode_u8(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    e = c >> 4
    f = (c & 0xF).to(torch.float32)
    # 2**(e - 19) built from its bit pattern (e - 19 is a normal exponent for e in 1..15):
    # torch.ldexp is a pow on CUDA, which is not promised exact.
    power = ((e.clamp(min=1) - 19 + 127) << 23).view(torch.float32)
    normal = (f + 16.0) * power
    return torch.where(e == 0, f * _U8_SUBNORMAL_STEP, normal)


def quantize_moment(x: torch.Tensor, kind: str, second: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one param's moment: codes flat with x.numel() elements (int8 for the
    int8 first moment, uint8 for the int8 second moment, float8_e4m3fn for fp8), scales fp32
    with one per block. ``second``: x is the second moment (non-negative), coded as sqrt."""
    _check_kind(kind)
    numel = x.numel()
    blocks = _blocks(x)
    if second:
        # A correctly rounded fp32 sqrt, as C++'s sqrtf and CUDA's sqrtf give: torch's
        # vectorized fp32 sqrt on the CPU can be one ulp off; the float64 sqrt rounded to fp32
        # is exact (53 >= 2 * 24 + 2 bits, so the double rounding is innocuous).
        blocks = torch.sqrt(blocks.double()).float()
    absmax = blocks.abs().amax(dim=1, keepdim=True)  # nan if the block holds a nan
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    # A nan (a nonfinite grad stepped without skipping) codes to 0 under a nan scale: the
    # block decodes to nan, as an fp32 state would show it.
    blocks = torch.nan_to_num(blocks / safe, nan=0.0, posinf=0.0, neginf=0.0)
    if kind == "int8" and not second:
        codes = torch.round(blocks * 127.0).clamp(-127, 127).to(torch.int8)
    elif kind == "int8":
        codes = _encode_u8(blocks.clamp(0.0, 1.0))
    else:
        codes = (blocks * _E4M3_MAX).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(-1)[:numel].clone(), absmax.reshape(-1).clone()


def _exact_divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d fp32 tensor on `like`'s device, to divide by. Dividing a CUDA tensor by
    a Python number multiplies by the rounded reciprocal, which is not the correctly rounded
    quotient the kernels compute (16 of the 255 int8 codes would decode one ulp off)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def dequantize_moment(codes: torch.Tensor, scales: torch.Tensor, kind: str,
                      second: bool) -> torch.Tensor:
    """The fp32 moment (flat) that (codes, scales) stand for."""
    _check_kind(kind)
    numel = codes.numel()
    pad = (-numel) % BLOCK
    flat = codes.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, BLOCK)
    absmax = scales.reshape(-1, 1).to(torch.float32)
    if kind == "int8" and not second:
        values = blocks.to(torch.float32) / _exact_divisor(127.0, codes) * absmax
    elif kind == "int8":
        values = _decode_u8(blocks) * absmax
    else:
        values = blocks.to(torch.float32) / _exact_divisor(_E4M3_MAX, codes) * absmax
    if second:
        values = values * values
    return values.reshape(-1)[:numel].clone()


def state_bytes(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """Bytes one coded moment holds, measured from its tensors."""
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()


# Adam's moment state keys, and whether each is a second moment (non-negative, coded as sqrt).
MOMENT_KEYS = {"exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True}
_KIND_OF_CODES = {torch.int8: "int8", torch.uint8: "int8", torch.float8_e4m3fn: "fp8"}


def codes_kind(state: dict) -> str:
    """The state_dtype a param's state is held in: "fp32" when its moments are fp32 tensors
    (or it has none), else the kind its codes' dtype names (the state needs no extra key)."""
    for key in MOMENT_KEYS:
        codes = state.get(f"{key}_codes")
        if isinstance(codes, torch.Tensor):
            return _KIND_OF_CODES[codes.dtype]
    return "fp32"


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one block of memory in some dimension order (contiguous,
    channels_last, a transpose): at::Tensor::is_non_overlapping_and_dense, which Python lacks.
    Walking the dimensions from the smallest stride up, each stride must be the product of the
    sizes before it."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order: the order the fused kernels
    walk a param and its state in, and so the order quantization blocks are cut in (a
    channels_last weight's blocks run along its channels)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def convert_moments(state: dict, state_dtype: str) -> dict:
    """A copy of one param's state with its moments held as ``state_dtype``: fp32 moments are
    coded ("<key>_codes" shaped and laid out like the param, "<key>_scales" one fp32 per block
    of its memory order) and codes are decoded to fp32 tensors laid out like the codes.
    Coded -> fp32 -> the same kind
    gives the same bits; a tensor under one block keeps fp32 moments; other entries are kept
    as they are."""
    check_state_dtype("ampfuse", state_dtype)
    held = codes_kind(state)
    out = dict(state)
    for key, second in MOMENT_KEYS.items():
        if held != "fp32" and f"{key}_codes" in out:
            codes, scales = out.pop(f"{key}_codes"), out.pop(f"{key}_scales")
            codes_here = sharded.local(codes)  # a DTensor's shard: its blocks are its own
            values = dequantize_moment(memory_flat(codes_here),
                                       sharded.local_scales(scales, codes), held, second)
            moment = torch.empty_like(codes_here, dtype=torch.float32)
            memory_flat(moment).copy_(values)
            out[key] = sharded.wrap_codes(moment, codes)
        value = out.get(key)
        if (state_dtype != "fp32" and isinstance(value, torch.Tensor)
                and not keeps_fp32_moments(value.numel())):
            del out[key]
            value_here = sharded.local(value)
            flat_codes, scales = quantize_moment(memory_flat(value_here), state_dtype, second)
            codes = torch.empty_like(value_here, dtype=flat_codes.dtype)
            memory_flat(codes).copy_(flat_codes)
            out[f"{key}_codes"] = sharded.wrap_codes(codes, value)
            out[f"{key}_scales"] = sharded.wrap_scales(scales, value)
    return out


_CODE_DTYPES = {("int8", False): torch.int8, ("int8", True): torch.uint8,
                ("fp8", False): torch.float8_e4m3fn, ("fp8", True): torch.float8_e4m3fn}
# The dtype of a kind's first-moment codes ("exp_avg_codes"): a coded state's kind at a glance.
FIRST_MOMENT_CODES = {kind: _CODE_DTYPES[kind, False] for kind in ("int8", "fp8")}


def zero_codes(p: torch.Tensor, state_dtype: str, second: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of an all-zero moment of param p: zero codes laid out like p, and
    zero scales (a zero block's scale is stored as 0)."""
    codes = torch.zeros_like(p, dtype=_CODE_DTYPES[state_dtype, second],
                             memory_format=torch.preserve_format)
    blocks = sharded.local_blocks(sharded.local(p).numel())
    return codes, sharded.wrap_scales(torch.zeros(blocks, dtype=torch.float32,
                                                  device=p.device), p)


def coded_keys(moment_keys: tuple[str, ...]) -> tuple[str, ...]:
    """The state keys of coded moments standing for fp32 ``moment_keys``."""
    return tuple(f"{key}_{part}" for key in moment_keys for part in ("codes", "scales"))


def prepare_moments(p: torch.Tensor, state: dict, state_dtype: str,
                    moment_keys: tuple[str, ...]) -> None:
    """Makes ``state`` hold p's moments ``moment_keys`` as ``state_dtype`` (which the caller
    has already reduced to "fp32" for a param under one block): moments held in another
    form (a checkpoint, a changed state_dtype) are converted, missing ones made zero."""
    if codes_kind(state) != state_dtype:
        converted = convert_moments(state, state_dtype)
        state.clear()  # the same dict: a step plan holds on to it
        state.update(converted)
    for key in moment_keys:
        if state_dtype == "fp32":
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=torch.float32,
                                              memory_format=torch.preserve_format)
        elif f"{key}_codes" not in state:
            state[f"{key}_codes"], state[f"{key}_scales"] = zero_codes(p, state_dtype,
                                                                       MOMENT_KEYS[key])




def loaded_codes(saved: dict, key: str, p: torch.Tensor, where: str, owner: str) -> dict:
    """The state entries of coded moment ``key`` of a loaded checkpoint's param state, checked
    against param ``p`` and placed on its device: the codes and scales as they are when laid
    out like p, else (a checkpoint of a model in another memory format) the fp32 moment they
    decode to, laid out like p, which p's next step codes in its own block order."""
    codes, scales = saved.get(f"{key}_codes"), saved.get(f"{key}_scales")
    second = MOMENT_KEYS[key]
    kind = _KIND_OF_CODES.get(codes.dtype) if isinstance(codes, torch.Tensor) else None
    if (kind is None or not isinstance(codes, torch.Tensor)
            or not isinstance(scales, torch.Tensor)
            or codes.dtype != _CODE_DTYPES[kind, second]):
        raise ValueError(
            f"{owner}.load_state_dict: state of {where} has {key}_codes of dtype "
            f"{getattr(codes, 'dtype', type(codes).__name__)} and {key}_scales "
            f"{type(scales).__name__}; coded moments are int8 (first) / uint8 (second) or "
            "float8_e4m3fn codes with an fp32 tensor of block scales. The state dict is damaged "
            "or was not written by ampfuse.")
    expected = sharded.scales_shape(p)
    if tuple(codes.shape) != tuple(p.shape) or tuple(scales.shape) != expected:
        raise ValueError(
            f"{owner}.load_state_dict: state of {where} has {key}_codes of shape "
            f"{tuple(codes.shape)} with {tuple(scales.shape)} scales but the param has shape "
            f"{tuple(p.shape)} and takes {expected} scales (blocks of {BLOCK}, per shard when "
            "sharded); the state dict belongs to another model, or to this one sharded "
            "another way (coded moments load into the sharding they were saved from).")
    codes = codes.to(p.device)
    scales = scales.to(device=p.device, dtype=torch.float32)
    if codes.numel() <= 1 or codes.stride() == p.stride():
        return {f"{key}_codes": codes, f"{key}_scales": scales}
    if not is_dense(codes):
        raise ValueError(
            f"{owner}.load_state_dict: state of {where} has {key}_codes with strides "
            f"{codes.stride()}, which leave gaps or overlap; its blocks follow the memory order "
            "it was saved in. Load the codes as state_dict() saved them.")
    values = dequantize_moment(memory_flat(codes), scales, kind, second)
    moment = torch.empty_like(codes, dtype=torch.float32)
    memory_flat(moment).copy_(values)
    relaid = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return {key: relaid.copy_(moment)}


def decode_moments(state_dict: dict) -> dict:
    """A copy of an optimizer state_dict whose block-coded moments (state_dtype "int8"/"fp8")
    are decoded to the fp32 tensors torch.optim.Adam/AdamW keep, so that torch's optimizers
    (or any tool expecting fp32 moments) load it. The argument is left as it is; ampfuse's own
    optimizers load either form and need no conversion."""
    out = dict(state_dict)
    out["state"] = {
        key: convert_moments(state, "fp32") if isinstance(state, dict) else state
        for key, state in state_dict["state"].items()
    }
    return out
