"""Every code block of README.md and of the docs pages (docs/**/*.md) is checked, so the documented
usage cannot rot.

- ```python blocks run, each in a fresh namespace.
- A block that needs a GPU has `<!-- test: cuda -->` on the line above its fence: its test
  carries the `cuda` marker (skipped with the reason where there is no GPU, run by
  `pytest -m cuda`).
- A block written for torchrun has `<!-- test: torchrun -->` above it: it runs as rank 0 of a
  one-process gloo group (the environment torchrun would give it), and must start and end its
  process group itself.
- ```sh (or ```bash, ```console) blocks are commands: each `make` target they name must exist
  in the Makefile.
- ```text blocks are output or listings, and ```cpp blocks are sketches of C++ for contributors
  (with elisions, so not compiled). A fence with any other language, or none, fails: a block is
  never skipped silently.
"""

import pathlib
import re

import pytest
from ranks import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))

FENCE = re.compile(
    r"(?:^<!-- test: (?P<marker>[a-z]+) -->\n)?^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
SHELLS = ("sh", "bash", "console")
LANGUAGES = {"python", "text", "cpp", *SHELLS}
MARKERS = {"cuda", "torchrun"}

# Optional dependencies (the `integrations` extra): a block importing one needs it installed.
FRAMEWORKS = ("lightning", "accelerate", "transformers")


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start("lang")) + 1
            yield page.relative_to(ROOT).as_posix(), line, match


BLOCKS = list(_blocks())


def _params(*langs):
    params = []
    for page, line, match in BLOCKS:
        if match["lang"] not in langs:
            continue
        marks = [pytest.mark.cuda] if match["marker"] == "cuda" else []
        params.append(pytest.param(match, id=f"{page}:{line}", marks=marks))
    return params


def test_every_page_is_found_and_the_readme_has_examples():
    assert (ROOT / "docs" / "index.md") in PAGES
    assert sum(1 for page, _, m in BLOCKS if page == "README.md" and m["lang"] == "python") >= 3


def test_every_fence_is_a_known_kind():
    unknown = [f"{page}:{line} ```{m['lang']}" for page, line, m in BLOCKS
               if m["lang"] not in LANGUAGES]
    assert not unknown, f"fences with no language or an unknown one (use {sorted(LANGUAGES)}): " \
                        f"{unknown}"
    bad = [f"{page}:{line} {m['marker']}" for page, line, m in BLOCKS
           if m["marker"] and (m["marker"] not in MARKERS or m["lang"] != "python")]
    assert not bad, f"test markers must be one of {sorted(MARKERS)}, on a python block: {bad}"


def test_no_fence_is_left_unmatched():
    # An opening fence the pattern missed (say, indented) would be a block nobody runs.
    for page in PAGES:
        fences = re.findall(r"^\s*```", page.read_text(), re.MULTILINE)
        found = sum(1 for p, _, _ in BLOCKS if p == page.relative_to(ROOT).as_posix())
        assert len(fences) == 2 * found, f"{page}: a fence the test does not see"


@pytest.fixture(autouse=True)
def _no_apex_alias_left_behind():
    """The migration examples install the apex alias in this process; later tests must not
    find `import apex` resolving to ampfuse."""
    yield
    from ampfuse import apex_compat

    if apex_compat.apex_alias_installed():
        apex_compat.uninstall_apex_alias()


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs(block, monkeypatch):
    code = block["body"]
    for name in FRAMEWORKS:
        if re.search(rf"^\s*(from|import) {name}\b", code, re.MULTILINE):
            pytest.importorskip(name)
    if block["marker"] == "torchrun":
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())}.items():
            monkeypatch.setenv(key, value)
    namespace = {"__name__": "docs_example"}
    try:
        # Running the documented example is the test.
        exec(compile(code, "docs example", "exec"), namespace)  # noqa: S102
    finally:
        # A class the block defines holds the namespace through its methods' globals, and the
        # namespace holds the block's tensors, whose autograd graph can hold it back through
        # C++ (hooks), where the garbage collector cannot see: clearing it frees the block's
        # models, so no later test finds one (an O1 model's op policy, say) still alive.
        namespace.clear()
        if block["marker"] == "torchrun":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


MAKE_TARGETS = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


@pytest.mark.parametrize("block", _params(*SHELLS))
def test_shell_block_names_real_make_targets(block):
    for target in re.findall(r"^\s*(?:\$\s*)?make\s+([\w-]+)", block["body"], re.MULTILINE):
        assert target in MAKE_TARGETS, f"`make {target}` is not a target of the Makefile"
