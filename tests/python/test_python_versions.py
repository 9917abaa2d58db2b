"""The package runs on every Python torch 2.11 supports, 3.10 and newer (pyproject's
requires-python; the wheel is tagged py3-none), while CI runs one Python. So each module of the
installed package is read here as Python 3.10 would read it: its syntax parsed as 3.10's, and
no name of the standard library that arrived after 3.10 used where the module runs (under
``if TYPE_CHECKING:`` is fine: only type checkers read that). `typing.Self` imported at a
module's top once made `import ampfuse.fp8` fail on 3.10.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ampfuse
import pytest

# Standard-library names added in Python 3.11 or later (the ones a library like this one might
# reach for), by module.
NEWER_THAN_310 = {
    "typing": {"Self", "LiteralString", "Never", "TypeVarTuple", "Unpack", "assert_never",
               "assert_type", "reveal_type", "dataclass_transform", "get_overloads",
               "clear_overloads", "Required", "NotRequired", "override", "TypeAliasType",
               "ReadOnly", "TypeIs", "NoDefault", "get_protocol_members", "is_protocol"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member",
             "nonmember", "global_enum", "show_flag_values", "EnumType"},
    "datetime": {"UTC"},
    "collections.abc": {"Buffer"},
    "contextlib": {"chdir"},
    "math": {"cbrt", "exp2", "sumprod"},
    "itertools": {"batched"},
    "operator": {"call"},
    "hashlib": {"file_digest"},
    "asyncio": {"timeout", "timeout_at", "TaskGroup", "Runner"},
    "functools": {"Placeholder"},
}
NEW_MODULES = {"tomllib", "wsgiref.types"}

PACKAGE = Path(ampfuse.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` outside ``if TYPE_CHECKING:`` bodies (their else branches count)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def newer_names(source: str) -> list[str]:
    """`module.name`s of NEWER_THAN_310 (and NEW_MODULES) that `source` uses at run time:
    imported by name, or read as an attribute of the module imported under its own name."""
    tree = ast.parse(source, feature_version=(3, 10))
    found = []
    module_aliases: dict[str, str] = {}  # local name -> module, for `import math as m`
    nodes = list(_runtime_nodes(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEW_MODULES:
                    found.append(alias.name)
                if alias.asname:
                    module_aliases[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    top = alias.name.split(".")[0]
                    module_aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in NEW_MODULES:
                found.append(node.module)
            newer = NEWER_THAN_310.get(node.module, set())
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in newer]
    for node in nodes:
        if isinstance(node, ast.Attribute):
            parts = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in module_aliases:
                module = ".".join([module_aliases[value.id], *reversed(parts[1:])])
                if node.attr in NEWER_THAN_310.get(module, set()):
                    found.append(f"{module}.{node.attr}")
    return found


def test_the_check_finds_what_it_looks_for():
    source = """
from typing import TYPE_CHECKING, Any, Self
import enum
import math as m
import collections.abc
if TYPE_CHECKING:
    from typing import Never
else:
    import tomllib
x = enum.StrEnum
y = m.cbrt(8.0)
z = collections.abc.Buffer
"""
    assert sorted(newer_names(source)) == sorted(
        ["typing.Self", "tomllib", "enum.StrEnum", "math.cbrt", "collections.abc.Buffer"])
    with pytest.raises(SyntaxError):
        newer_names("try:\n    pass\nexcept* ValueError:\n    pass\n")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_reads_as_python_310_reads_it(path):
    assert newer_names(path.read_text()) == [], (
        f"{path.relative_to(PACKAGE)} uses standard-library names that Python 3.10 lacks at run "
        f"time; the package supports 3.10 (pyproject's requires-python): import them under "
        f"`if TYPE_CHECKING:` (annotations are strings here) or find a 3.10 spelling")


def test_the_package_has_modules():
    assert len(MODULES) > 50
