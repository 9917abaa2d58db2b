"""The public API is typed (issue 30): mypy checks the public modules, with every function in
them fully hinted, as pyproject.toml's [tool.mypy] configures it; and the package ships
py.typed, so its users' type checkers read those hints."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_public_modules_pass_mypy(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: `pip install -r requirements-dev.txt`")
    # A fresh cache outside the tree: a cold run, as in CI (about 30 s of one core).
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy_cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout + result.stderr
    print(f"mypy took {time.monotonic() - start:.0f} s:\n{output}")
    assert result.returncode == 0, f"mypy found errors in the public modules:\n{output}"


def test_py_typed_is_shipped():
    assert (ROOT / "python" / "ampfuse" / "py.typed").is_file()
    # pyproject.toml's [tool.setuptools.package-data] puts it in the wheel and the sdist.
    assert 'ampfuse = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
