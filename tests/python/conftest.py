"""pytest wiring shared by every ampfuse test module.

- The `cuda` marker tags every test that needs a GPU: `pytest -m cuda` runs exactly those (the
  GPU check), `pytest -m "not cuda"` the CPU ones. Without a usable CUDA device they are skipped
  with the reason, never reported as passing.
- The `device` fixture runs a test once on "cpu" and once on "cuda" (the latter carries the
  marker), so each parity test is written once for both devices.
"""

import os
import sys

import pytest
import torch

# The helper modules beside this file (tolerances.py, helpers.py) must import under any
# --import-mode, not only pytest's default "prepend".
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

_NO_CUDA_REASON = "torch.cuda.is_available() is False: no usable CUDA device on this machine"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device; skipped without one, selected by `pytest -m cuda`"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_NO_CUDA_REASON)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group in this process (FSDP2 and DCP on world size 1)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
