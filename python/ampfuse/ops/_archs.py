"""Which GPUs the op library has code for, read from the library file itself.

nvcc embeds the device code of each .cu file as a fat binary: a header (magic 0xBA55ED50) and
entries, each either machine code (an ELF "cubin") for one architecture or PTX for one virtual
architecture. Reading the entry headers gives the same list as ``cuobjdump --list-elf
--list-ptx`` without the CUDA toolkit, so ``cuda_status()`` and ``python -m ampfuse doctor`` can
say, before any launch, whether a device is covered. The op library itself checks again at the
first CUDA call with the CUDA runtime's own answer (csrc/ops/device_image.cpp); this module
only predicts and explains.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

_FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
_ENTRY_PTX = 1
_ENTRY_ELF = 2


@dataclasses.dataclass(frozen=True)
class CudaCode:
    """The device code in a library: machine code per architecture (80 for sm_80) and PTX per
    virtual architecture (120 for compute_120), and the nvcc release that compiled it."""

    sass: tuple[int, ...] = ()
    ptx: tuple[int, ...] = ()
    nvcc: str | None = None

    def __bool__(self) -> bool:
        return bool(self.sass or self.ptx)

    def describe(self) -> str:
        """ "sm_75, sm_80 + PTX compute_80", as the build prints it."""
        text = ", ".join(f"sm_{a}" for a in self.sass) or "no machine code"
        if self.ptx:
            text += " + PTX " + ", ".join(f"compute_{a}" for a in self.ptx)
        return text


def _fatbin_entries(data: bytes) -> Iterator[tuple[int, int]]:
    """(kind, architecture) of every entry of every fat binary in `data`."""
    start = data.find(_FATBIN_MAGIC)
    while start != -1:
        try:
            version, header_size, size = struct.unpack_from("<HHQ", data, start + 4)
        except struct.error:
            return
        end = start + header_size + size
        if version != 1 or header_size != 16 or end > len(data):
            start = data.find(_FATBIN_MAGIC, start + 4)  # these four bytes were not a header
            continue
        entry = start + header_size
        while entry + 32 <= end:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            if entry_header < 32:
                break
            yield kind, arch
            entry += entry_header + entry_size
        start = data.find(_FATBIN_MAGIC, end)


def read_cuda_code(library_path: str | os.PathLike[str]) -> CudaCode:
    """The device code in the library at `library_path`; an empty CudaCode for a CPU-only build
    or a file that cannot be read."""
    try:
        data = Path(library_path).read_bytes()
    except (OSError, TypeError):
        return CudaCode()
    sass, ptx = set(), set()
    for kind, arch in _fatbin_entries(data):
        if kind == _ENTRY_ELF:
            sass.add(arch)
        elif kind == _ENTRY_PTX:
            ptx.add(arch)
    release = re.search(rb"Cuda compilation tools, release ([0-9.]+), V([0-9.]+)", data)
    return CudaCode(tuple(sorted(sass)), tuple(sorted(ptx)),
                    release.group(2).decode() if release else None)


def arch_runs_on(arch: int, capability: tuple[int, int]) -> bool:
    """Machine code for `arch` (80 = sm_80) runs on its own major version at the same or a
    higher minor version: sm_80 on 8.0, 8.6 and 8.9, never on 9.0."""
    return arch // 10 == capability[0] and arch % 10 <= capability[1]


def ptx_runs_on(arch: int, capability: tuple[int, int]) -> bool:
    """PTX for compute_`arch` is compiled by the driver for any device of that capability or
    newer."""
    return arch <= capability[0] * 10 + capability[1]


def runs_on(code: CudaCode, capability: tuple[int, int]) -> bool:
    """Whether a device of `capability` (major, minor) can run this code."""
    return (any(arch_runs_on(a, capability) for a in code.sass)
            or any(ptx_runs_on(a, capability) for a in code.ptx))


def rebuild_hint(capability: tuple[int, int]) -> str:
    """The command that builds ampfuse for a device of `capability`."""
    major, minor = capability
    return (f'TORCH_CUDA_ARCH_LIST="{major}.{minor}" pip install --no-build-isolation . '
            "(in the ampfuse source folder, with the CUDA toolkit matching torch)")


def no_code_message(device: str, name: str, capability: tuple[int, int], code: CudaCode) -> str:
    """What a device without code gets told: the same facts as the op library's error."""
    major, minor = capability
    return (f"ampfuse has no GPU code for {device} ({name}, compute capability {major}.{minor}, "
            f"sm_{major}{minor}): this build holds code for {code.describe()}, none of which runs "
            f"on it. Rebuild ampfuse for this GPU: {rebuild_hint(capability)}.")
