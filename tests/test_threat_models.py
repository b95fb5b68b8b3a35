"""Every test a threat model cites exists, is collected, and runs in the default ``make test``:
not skipped by a marker, a ``pytest.skip``/``importorskip`` in its body, its fixtures or its
module, and not deselected as ``slow`` or ``gpu``."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"`(tests/[\w/]+\.py::\w+)`")
ADVERSARY_CLASSES = {
    "dishonest_contributor",
    "colluding_sybils",
    "compromised_validator",
    "compromised_trainer",
    "network_attacker",
    "storage_attacker",
    "reward_hacker",
}
PLUGIN = '''
import ast, inspect, json, textwrap


def skips_in(func):
    """Whether ``func``'s body calls pytest.skip, pytest.importorskip or pytest.xfail."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("skip", "importorskip", "xfail")
               and getattr(n.func.value, "id", "") == "pytest" for n in ast.walk(tree))


def why_skipped(item):
    why = []
    for m in item.iter_markers():
        if m.name == "skip" or (m.name == "skipif" and m.args
                                and (isinstance(m.args[0], str) or bool(m.args[0]))):
            why.append(f"marked {m.name}")
        elif m.name in ("slow", "gpu", "xfail"):
            why.append(f"marked {m.name} (not in the default run)")
    if skips_in(getattr(item, "function", None)):
        why.append("skips in its body")
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        if any(skips_in(d.func) for d in defs):
            why.append(f"fixture {name} may skip")
    return why


def pytest_collection_finish(session):
    out = {}
    for item in session.items:
        out.setdefault(item.nodeid.split("[")[0], []).extend(why_skipped(item))
    print("COLLECTED" + json.dumps(out))
'''


def module_skips(path: Path) -> bool:
    """Whether a test file skips as a whole (a module-level pytest.skip or importorskip)."""
    tree = ast.parse(path.read_text())
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("skip", "importorskip")
        and getattr(n.func.value, "id", "") == "pytest"
        for stmt in tree.body
        if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
        for n in ast.walk(stmt)
    )


def cited_tests() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for md in sorted((ROOT / "threat_models").glob("*.md")):
        out[md.stem] = set(CITED.findall(md.read_text()))
    return out


def test_every_adversary_class_has_a_threat_model_with_tests() -> None:
    cited = cited_tests()
    assert ADVERSARY_CLASSES <= set(cited)
    for name in ADVERSARY_CLASSES:
        assert cited[name], f"{name}.md cites no test"
        text = (ROOT / "threat_models" / f"{name}.md").read_text()
        for section in ("**Capabilities.**", "Residual risk"):
            assert section in text, f"{name}.md lacks {section}"


def test_cited_tests_exist_and_are_not_skipped(tmp_path: Path) -> None:
    ids = sorted(set().union(*cited_tests().values()))
    (tmp_path / "collect_plugin.py").write_text(PLUGIN)
    files = sorted({i.split("::")[0] for i in ids})
    whole = [f for f in files if module_skips(ROOT / f)]
    assert not whole, f"threat models cite tests in files that skip as a whole: {whole}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "collect_plugin", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("COLLECTED")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-2000:]
    collected = json.loads(line.removeprefix("COLLECTED"))
    missing = [i for i in ids if i not in collected]
    assert not missing, f"threat models cite tests that do not exist: {missing}"
    skipped = {i: sorted(set(collected[i])) for i in ids if collected[i]}
    assert not skipped, f"threat models cite tests that may be skipped: {skipped}"


def test_readme_table_lists_every_threat_model() -> None:
    table = (ROOT / "threat_models" / "README.md").read_text()
    for name in ADVERSARY_CLASSES:
        assert f"{name}.md" in table


def test_every_harness_adversary_is_in_the_table() -> None:
    from harness.adversaries import available_strategies

    table = (ROOT / "threat_models" / "README.md").read_text()
    for name in available_strategies():
        assert f"| `{name}` |" in table, f"strategy {name} is missing from threat_models/README.md"
