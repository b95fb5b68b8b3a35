"""The README guides and the pages under ``docs/`` hold the detail: the README stays short,
links every page, and no link or cited code path in either points nowhere.

Checked in ``README.md`` and ``docs/*.md`` (outside fenced code blocks):

* every relative Markdown link names an existing file, and its ``#anchor`` (GitHub's
  slug of a heading) a heading of that file;
* every repository path cited in backticks (``node/validator/core.py``, ``bench/``)
  exists;
* the README is under 300 lines, links every ``docs/*.md``, and carries no measurement
  prose (load averages, interleaved runs): that belongs in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 300
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [ROOT / "README.md", *PAGES]
CODE_ROOTS = (
    "verify|ledger|rewards|rollout|trainer|node|harness|bench|tests|configs|threat_models|docs"
)
CODE_PATH = re.compile(rf"^(?:{CODE_ROOTS})/[\w./-]*$")
MEASUREMENT_PROSE = ("load average", "interleaved")
"""Phrases of a measured note (how a figure was taken), which has no place in the README."""


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``# comment`` in a shell block is no heading)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped
    (word characters, hyphens and spaces kept), spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text, a repeated heading's as GitHub numbers it."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(text), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``'s prose."""
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def broken_links(doc: Path) -> list[str]:
    """Each relative link of ``doc`` whose file or anchor does not exist, with the reason."""
    problems = []
    for target in links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{doc.name}: {target}: no such file")
        elif anchor and (file.is_dir() or anchor not in anchors(file.read_text())):
            problems.append(f"{doc.name}: {target}: no heading #{anchor} in {file.name}")
    return problems


def cited_paths(text: str) -> list[str]:
    """Repository paths cited inside backticks in ``text``'s prose."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", prose(text)):
        found.extend(word for word in span.split() if CODE_PATH.match(word))
    return found


def test_readme_is_under_300_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_carries_no_measurement_prose() -> None:
    text = (ROOT / "README.md").read_text().lower()
    assert [p for p in MEASUREMENT_PROSE if p in text] == []


def test_there_are_pages_and_the_readme_links_every_one() -> None:
    assert len(PAGES) >= 5
    linked = {
        (ROOT / t.partition("#")[0]).resolve() for t in links((ROOT / "README.md").read_text())
    }
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_cited_code_path_exists(doc: Path) -> None:
    paths = cited_paths(doc.read_text())
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_checks_find_what_is_wrong(tmp_path: Path) -> None:
    """A missing file, a missing anchor and a missing code path are each reported; a heading
    inside a code block is no anchor."""
    (tmp_path / "other.md").write_text("# Title\n\n## The `sampler.py` note\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Top\n\n```sh\n# not-a-heading\n```\n\n"
        "[ok](other.md#the-samplerpy-note) [self](#top) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad](other.md#nowhere) [code](#not-a-heading)\n"
        "See `verify/commitment.py` and `verify/no_such_module.py`.\n"
    )
    assert broken_links(doc) == [
        "doc.md: missing.md: no such file",
        "doc.md: other.md#nowhere: no heading #nowhere in other.md",
        "doc.md: #not-a-heading: no heading #not-a-heading in doc.md",
    ]
    paths = cited_paths(doc.read_text())
    assert paths == ["verify/commitment.py", "verify/no_such_module.py"]
    assert [p for p in paths if not (ROOT / p).exists()] == ["verify/no_such_module.py"]
    assert anchors("## A b\n## A b\n") == {"a-b", "a-b-1"}
