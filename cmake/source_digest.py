"""A digest of the sources a build of ampfuse is made from, so that a built wheel can say which
sources it holds and a checkout can tell whether a wheel is stale.

setup.py records it in build_info.json (as "source_digest"); benchmarks/gpu_check.sh computes it
over the copy of the checkout on the GPU machine, where no .git travels, and builds in place
instead of installing a carried wheel that was built from other sources. Only the standard
library: it runs under any Python that runs the check.

The digest covers what reaches the wheel or decides how it is built: csrc/ and cmake/ (every
file), CMakeLists.txt, setup.py, pyproject.toml, and the package's Python files and py.typed. Not
the build outputs that an in-place build writes beside the Python files (the op library, the step
scanner, build_info.json) nor caches.

    python cmake/source_digest.py [ROOT]     prints the digest of the checkout at ROOT (default:
                                             this file's checkout)
    python cmake/source_digest.py --wheel W  prints the digest wheel W was built from ("none"
                                             for a wheel older than the digest)
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_WHOLE_FOLDERS = ("csrc", "cmake")
_FILES = ("CMakeLists.txt", "setup.py", "pyproject.toml")
_PACKAGE = Path("python") / "ampfuse"
_PACKAGE_SUFFIXES = (".py", ".typed")


def source_files(root: Path) -> list[Path]:
    """The files the digest covers, relative to `root`, in a fixed order."""
    found = [Path(name) for name in _FILES if (root / name).is_file()]
    for folder in _WHOLE_FOLDERS:
        found += [p.relative_to(root) for p in (root / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
    found += [p.relative_to(root) for p in (root / _PACKAGE).rglob("*")
              if p.is_file() and p.suffix in _PACKAGE_SUFFIXES and "__pycache__" not in p.parts]
    return sorted(found, key=lambda p: p.as_posix())


def source_digest(root: Path = ROOT) -> str:
    """sha256 over each covered file's path and bytes, as 16 hex digits."""
    digest = hashlib.sha256()
    for relative in source_files(root):
        data = (root / relative).read_bytes()
        # Path and length first: moving bytes from one file to the next changes the digest.
        digest.update(f"{relative.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def wheel_digest(wheel: Path) -> str:
    """The digest a built wheel records in its build_info.json, or "none" if it records none."""
    with zipfile.ZipFile(wheel) as archive:
        info = json.loads(archive.read("ampfuse/ops/build_info.json"))
    return info.get("source_digest", "none")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wheel"]:
        print(wheel_digest(Path(sys.argv[2])))
    else:
        print(source_digest(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
