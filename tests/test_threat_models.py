"""Every test a threat model cites exists, is collected, and is not skipped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"`(tests/[\w/]+\.py::\w+)`")
ADVERSARY_CLASSES = {
    "dishonest_contributor", "colluding_sybils", "compromised_validator", "compromised_trainer",
    "network_attacker", "storage_attacker", "reward_hacker",
}
PLUGIN = '''
import json, pytest
def pytest_collection_finish(session):
    out = {}
    for item in session.items:
        base = item.nodeid.split("[")[0]
        skipped = any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
                      for m in item.iter_markers())
        out.setdefault(base, []).append(skipped)
    print("COLLECTED" + json.dumps(out))
'''


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
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "collect_plugin", *files],
        cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ,
                                                      "PYTHONPATH": str(tmp_path)},
    )
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("COLLECTED")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-2000:]
    collected = json.loads(line.removeprefix("COLLECTED"))
    missing = [i for i in ids if i not in collected]
    assert not missing, f"threat models cite tests that do not exist: {missing}"
    skipped = [i for i in ids if any(collected[i])]
    assert not skipped, f"threat models cite skipped tests: {skipped}"


def test_readme_table_lists_every_threat_model() -> None:
    table = (ROOT / "threat_models" / "README.md").read_text()
    for name in ADVERSARY_CLASSES:
        assert f"{name}.md" in table


def test_every_harness_adversary_is_in_the_table() -> None:
    from harness.adversaries import available_strategies

    table = (ROOT / "threat_models" / "README.md").read_text()
    for name in available_strategies():
        assert f"| `{name}` |" in table, f"strategy {name} is missing from threat_models/README.md"
