"""Arrows point one way (DESIGN.md, Layout): every import of every module under the project's
packages is read from its source (``ast``, so a function-level import counts as much as a
top-level one) and checked against the table of which package may import which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, set[str]] = {
    "verify": set(),
    "ledger": {"verify"},
    # rewards' errors derive from the one exception root, verify.errors.ProofTrainError
    "rewards": {"verify"},
    "rollout": {"verify", "rewards"},
    "trainer": {"verify", "ledger", "rewards", "rollout"},
    "node": {"verify", "ledger", "rewards", "rollout", "trainer"},
    "harness": {"verify", "ledger", "rewards", "rollout", "trainer", "node"},
    "bench": {"verify", "ledger", "rewards", "rollout", "trainer", "node", "harness"},
}
PACKAGES = set(ALLOWED) | {"tests"}


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import, and of every ``import_module("...")`` call."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def wrong_way(package: str) -> list[str]:
    """``file:line imports module`` for every import ``package`` may not make."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in imported(tree):
            top = module.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layout(package: str) -> None:
    assert wrong_way(package) == []


def test_production_code_never_imports_the_harness() -> None:
    production = [p for p in ALLOWED if p not in ("harness", "bench")]
    assert all("harness" not in ALLOWED[p] for p in production)
    assert [hit for p in production for hit in wrong_way(p) if " imports harness" in hit] == []


def test_the_walk_sees_every_kind_of_import() -> None:
    tree = ast.parse(
        "import harness.run\nfrom node.cli import main\nfrom . import sibling\n"
        "def f():\n    from harness import local\n"
        "importlib.import_module('harness.demo')\n"
    )
    assert [m for _, m in sorted(imported(tree))] == [
        "harness.run",
        "node.cli",
        "harness",
        "harness.demo",
    ]
