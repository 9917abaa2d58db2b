"""The sources' digest (cmake/source_digest.py): what it covers, and that a built ampfuse records
the digest of the sources it was built from (benchmarks/gpu_check.sh refuses a carried wheel
whose digest is not the checkout's)."""

import json
import runpy
import shutil
import zipfile
from pathlib import Path

import pytest

import ampfuse

CHECKOUT = Path(__file__).resolve().parents[2]
DIGEST = runpy.run_path(str(CHECKOUT / "cmake" / "source_digest.py"))


def _tree(root: Path) -> Path:
    """A small checkout: a file of each covered kind, and build outputs and caches beside them."""
    files = {
        "CMakeLists.txt": "project(x)\n",
        "setup.py": "setup()\n",
        "pyproject.toml": "[project]\n",
        "csrc/kernels/adam.cu": "// kernel\n",
        "csrc/ops.h": "// ops\n",
        "cmake/build_info.json.in": "{}\n",
        "python/ampfuse/__init__.py": "x = 1\n",
        "python/ampfuse/py.typed": "",
        "python/ampfuse/ops/build_info.json": '{"version": "a"}\n',
        "python/ampfuse/ops/libampfuse_ops.so": "\x7fELF",
        "python/ampfuse/__pycache__/__init__.cpython-311.pyc": "cache",
        "tests/python/test_x.py": "def test(): pass\n",
        "README.md": "# x\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_covers_the_build_inputs_and_the_package_and_nothing_else(tmp_path):
    covered = [p.as_posix() for p in DIGEST["source_files"](_tree(tmp_path))]
    assert covered == sorted([
        "CMakeLists.txt", "cmake/build_info.json.in", "csrc/kernels/adam.cu", "csrc/ops.h",
        "pyproject.toml", "python/ampfuse/__init__.py", "python/ampfuse/py.typed", "setup.py",
    ])


@pytest.mark.parametrize("name", ["csrc/kernels/adam.cu", "python/ampfuse/__init__.py",
                                  "CMakeLists.txt", "setup.py", "cmake/build_info.json.in"])
def test_changes_when_a_covered_file_changes(tmp_path, name):
    root = _tree(tmp_path)
    before = DIGEST["source_digest"](root)
    (root / name).write_text((root / name).read_text() + " ")
    assert DIGEST["source_digest"](root) != before


@pytest.mark.parametrize("name", ["python/ampfuse/ops/build_info.json",
                                  "python/ampfuse/ops/libampfuse_ops.so",
                                  "python/ampfuse/__pycache__/__init__.cpython-311.pyc",
                                  "tests/python/test_x.py", "README.md"])
def test_stays_when_a_build_output_cache_or_test_changes(tmp_path, name):
    root = _tree(tmp_path)
    before = DIGEST["source_digest"](root)
    (root / name).write_text("changed")
    assert DIGEST["source_digest"](root) == before


def test_a_renamed_file_or_bytes_moved_between_files_change_it(tmp_path):
    root = _tree(tmp_path)
    before = DIGEST["source_digest"](root)
    shutil.move(root / "csrc/ops.h", root / "csrc/ops2.h")
    assert DIGEST["source_digest"](root) != before
    shutil.move(root / "csrc/ops2.h", root / "csrc/ops.h")
    assert DIGEST["source_digest"](root) == before
    # "// kernel\n" + "// ops\n" split differently between two files
    (root / "csrc/kernels/adam.cu").write_text("// kernel\n// o")
    (root / "csrc/ops.h").write_text("ps\n")
    assert DIGEST["source_digest"](root) != before


def test_reads_the_digest_a_wheel_records_and_none_from_an_older_wheel(tmp_path):
    for name, info in (("new.whl", {"version": "x", "source_digest": "0123456789abcdef"}),
                       ("old.whl", {"version": "x"})):
        with zipfile.ZipFile(tmp_path / name, "w") as wheel:
            wheel.writestr("ampfuse/ops/build_info.json", json.dumps(info))
    assert DIGEST["wheel_digest"](tmp_path / "new.whl") == "0123456789abcdef"
    assert DIGEST["wheel_digest"](tmp_path / "old.whl") == "none"


def test_the_installed_build_records_the_digest_of_this_checkout():
    """make test builds the wheel from this checkout and installs it: its build_info.json must
    carry this checkout's digest. An in-place build in the checkout is rebuilt only when its
    native sources change, so it is not checked (its Python files are the checkout's own)."""
    package = Path(ampfuse.__file__).resolve().parent
    if package == CHECKOUT / "python" / "ampfuse":
        pytest.skip("ampfuse is the checkout's in-place build, not an installed wheel")
    info = json.loads((package / "ops" / "build_info.json").read_text())
    assert info["source_digest"] == DIGEST["source_digest"](CHECKOUT)
