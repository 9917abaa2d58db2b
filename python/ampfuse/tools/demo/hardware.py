"""What the demo runs on, and whether the low precision it trains in is native there.

Mixed precision is faster only where the hardware computes in the low dtype. On a CPU, torch
runs bf16 convolutions and matmuls through oneDNN at bf16 speed where the CPU has bf16
dot-product instructions (AVX512-BF16 or AMX-BF16; BF16 on Arm). Without them the same ops are
emulated: oneDNN converts to fp32 and back, or, where it has no bf16 kernels for the CPU (an
AVX2-only one), torch falls back to generic code, many times slower than fp32. fp16 is native
only with AVX512-FP16 or AMX-FP16 (F16C converts, it does not compute). On CUDA, fp16 runs on
tensor cores from compute capability 7.0 and bf16 from 8.0.

Both torch queries that decide it are read, not just the CPU's flags: oneDNN's bf16/fp16
checks follow what oneDNN will actually use (ONEDNN_MAX_CPU_ISA lowers it, as on a CPU without
AVX-512), and torch's kernel level (ATEN_CPU_CAPABILITY) is reported beside it. A dtype is
native when oneDNN supports it and the CPU has instructions that compute in it: oneDNN also
"supports" bf16 on AVX-512 CPUs without AVX512-BF16, by converting, which is not faster.
"""

from __future__ import annotations

import dataclasses

import torch

_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# CPU flags (torch.cpu.get_capabilities() keys) of instructions that compute in each dtype:
# x86 first, then Arm.
_CPU_ARITHMETIC = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fp16_arith"),
}
# Compute capability from which each dtype runs on tensor cores.
_CUDA_NATIVE_FROM = {torch.float16: (7, 0), torch.bfloat16: (8, 0)}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What detect() found: the device type ("cpu" or "cuda"), the CPU's or GPU's name, the
    facts queried (for the report) and the low dtypes whose arithmetic is native."""

    device_type: str
    name: str
    facts: tuple[str, ...]
    native: frozenset

    def is_native(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or dtype in self.native

    def describe(self) -> str:
        """One line: the device, what was queried and the verdict per low dtype."""
        verdicts = ", ".join(f"{name} {'native' if self.is_native(dtype) else 'emulated'}"
                             for dtype, name in _NAMES.items())
        return f"{self.name} ({'; '.join(self.facts)}): {verdicts}"

    def emulation_note(self, low: torch.dtype, others=()) -> str:
        """What the demo prints above its table where `low` (the dtype of its O1/O2 runs) or
        one of `others` (the dtypes of its other runs) is emulated here, "" where all are
        native: emulated arithmetic makes those runs slower than fp32, which the table must not
        leave unexplained."""
        emulated = [d for d in _NAMES if d in {low, *others} and not self.is_native(d)]
        if not emulated:
            return ""
        which = " and ".join(_NAMES[d] for d in emulated)
        verb = "are" if len(emulated) > 1 else "is"
        if self.device_type == "cuda":
            return (f"Note: {which} {verb} emulated on this GPU (no tensor cores for it: fp16 "
                    "needs compute capability 7.0, bf16 8.0), so its runs are slower than fp32 "
                    "here.")
        why = f"Note: {which} {verb} emulated on this CPU ({_missing_instructions(emulated)})"
        if low not in emulated:
            return f"{why}: the O2 fp16 run shows the dynamic loss scale, not speed."
        pays = {torch.bfloat16: "AVX512-BF16 or AMX", torch.float16: "AVX512-FP16 or AMX-FP16"}
        other = next((d for d in _NAMES if d != low and self.is_native(d)), None)
        return (f"{why}: torch runs {which} convolutions and matmuls in slower code, so the "
                f"{_NAMES[low]} runs are slower than fp32 here and this table shows accuracy, "
                "overflow handling and memory, not speed. Mixed precision pays in speed on a "
                f"GPU, or on a CPU with {pays[low]}"
                + (f" (here {_NAMES[other]} is native: --dtype {_NAMES[other]})." if other
                   else "."))


def _missing_instructions(emulated) -> str:
    parts = []
    if torch.bfloat16 in emulated:
        parts.append("no AVX512-BF16 or AMX-BF16 that oneDNN can use")
    if torch.float16 in emulated:
        parts.append("no AVX512-FP16 or AMX-FP16; F16C only converts")
    return "; ".join(parts)


def _onednn_supports(query: str) -> bool:
    """torch.ops.mkldnn._is_mkldnn_bf16_supported / _fp16_: False where torch was built
    without oneDNN, whose ops then raise instead of answering."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, query)())
    except (AttributeError, RuntimeError):
        return False


def _detect_cpu() -> Hardware:
    flags = torch.cpu.get_capabilities()
    kernels = torch.backends.cpu.get_cpu_capability()
    onednn = {torch.bfloat16: _onednn_supports("_is_mkldnn_bf16_supported"),
              torch.float16: _onednn_supports("_is_mkldnn_fp16_supported")}
    native = frozenset(dtype for dtype, names in _CPU_ARITHMETIC.items()
                       if onednn[dtype] and any(flags.get(name) is True for name in names))
    instructions = [label for label, key in (("AVX512-BF16", "avx512_bf16"),
                                             ("AMX-BF16", "amx_bf16"),
                                             ("AVX512-FP16", "avx512_fp16"),
                                             ("AMX-FP16", "amx_fp16"), ("F16C", "f16c"))
                    if flags.get(key) is True]
    facts = (f"torch kernels {kernels}",
             (f"oneDNN bf16 {'yes' if onednn[torch.bfloat16] else 'no'}, "
              f"fp16 {'yes' if onednn[torch.float16] else 'no'}"),
             f"instructions: {', '.join(instructions) or 'none for bf16 or fp16'}")
    name = str(flags.get("cpu_name") or flags.get("architecture") or "CPU")
    return Hardware("cpu", name, facts, native)


def _detect_cuda(device: torch.device) -> Hardware:
    capability = torch.cuda.get_device_capability(device)
    native = frozenset(dtype for dtype, first in _CUDA_NATIVE_FROM.items()
                       if tuple(capability) >= first)
    return Hardware("cuda", torch.cuda.get_device_name(device),
                    (f"compute capability {capability[0]}.{capability[1]}",), native)


def detect(device) -> Hardware:
    """The hardware report for `device` ("cpu", "cuda" or "cuda:N")."""
    device = torch.device(device)
    if device.type == "cuda":
        return _detect_cuda(device)
    return _detect_cpu()
