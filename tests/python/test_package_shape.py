"""The Python package's shape: layers that import only downward, no import circle, few modules
at the root, and `import ampfuse` free of the command-line tools (issue 30). The layers are
written once, in pyproject.toml's [tool.importlinter]; this runs import-linter on them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ampfuse
import ampfuse.ops

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ampfuse"


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.fail("import-linter is not installed: `pip install -r requirements-dev.txt`")
    result = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")],
                            cwd=ROOT / "python", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_package_root_has_at_most_eight_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


def test_import_ampfuse_loads_no_tool_code():
    code = ("import sys, ampfuse; "
            "print(sorted(m for m in sys.modules if m.startswith('ampfuse.tools')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_ops_facade_lists_every_registered_op():
    assert ampfuse.ops.OP_NAMES, "no op registered"
    for name in ampfuse.ops.OP_NAMES:
        assert name in ampfuse.ops.__all__, name
        assert callable(getattr(ampfuse.ops, name)), name


def test_op_names_are_the_tensor_ops_of_the_native_library():
    # Each name has a CPU kernel and a fake kernel; the O1 policy helpers, host-side functions in
    # the same namespace, are not among them.
    import torch
    from torch._library.simple_registry import singleton

    for name in ampfuse.ops.OP_NAMES:
        qualified = f"ampfuse::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), name
        assert singleton.find(qualified).fake_impl.kernel is not None, name
    assert not [name for name in ampfuse.ops.OP_NAMES if name.startswith("o1_")]
    assert "fused_adam_" in ampfuse.ops.OP_NAMES and "fp8_gemm" in ampfuse.ops.OP_NAMES
