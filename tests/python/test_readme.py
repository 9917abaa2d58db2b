"""Every ```python block of README.md runs, so the documented usage cannot rot."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.fixture(autouse=True)
def _no_apex_alias_left_behind():
    """The migration example installs the apex alias in this process; later tests must not
    find `import apex` resolving to ampfuse."""
    yield
    from ampfuse import apex_compat

    if apex_compat.apex_alias_installed():
        apex_compat.uninstall_apex_alias()


# Optional dependencies (the `integrations` extra): a block importing one needs it installed.
FRAMEWORKS = ("lightning", "accelerate", "transformers")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    for name in FRAMEWORKS:
        if re.search(rf"^\s*(from|import) {name}\b", BLOCKS[index], re.M):
            pytest.importorskip(name)
    exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {"__name__": "readme"})
