"""Step journal: torn tails, re-run checks, and resume past the checkpoint without re-publishing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.node.conftest import build_tiny_model
from tests.trainer.test_loop import ListSource, groups_of, make_loop
from trainer.config import TrainerConfig
from trainer.journal import JournalMismatch, StepJournal, StepRecord, journal_path, read_journal
from trainer.loop import checkpoint_version
from trainer.network_rules import NetworkRules
from verify.errors import ProofTrainError

torch.set_num_threads(1)


def rec(version: int, trained=(1, 2), digest: str = "aa") -> StepRecord:
    return StepRecord(version, 10 * version, tuple(trained), (), None, digest)


def test_journal_appends_checks_re_runs_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = StepJournal(path)
    j.record(rec(1))
    j.record(rec(2, (3, 4)))
    j.record(rec(2, (3, 4)))  # a re-run that matches: not appended
    j.record(StepRecord(2, 99, (3, 4), (), None, "aa"))  # the cursor may differ on a re-run
    assert [r.version for r in read_journal(path)] == [1, 2] and j.head == 2
    with pytest.raises(JournalMismatch, match="trained"):
        j.record(rec(2, (3, 5)))
    with pytest.raises(JournalMismatch, match="digest"):
        j.record(rec(1, digest="bb"))
    with pytest.raises(ProofTrainError, match="cannot add 4"):
        j.record(rec(4))
    with open(path, "ab") as f:
        f.write(b'{"version":3,"cur')  # killed mid-write
    again = StepJournal(path)
    assert again.head == 2 and path.read_bytes().endswith(b"\n")
    again.record(rec(3))
    assert [r.version for r in read_journal(path)] == [1, 2, 3]
    path.write_bytes(path.read_bytes().replace(b'"version":2', b'"version":7'))
    with pytest.raises(ProofTrainError, match="jumps"):
        StepJournal(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("journal-tiny"), seed=4)


def _kill_after_checkpoint_3(ckpt: Path) -> None:
    """What a kill before the checkpoint at 5 leaves: ``latest`` still names 3."""
    shutil.rmtree(ckpt / "v00000005")
    (ckpt / "latest").write_text("v00000003")


def _cfg(tiny: Path, ckpt: Path, steps: int) -> TrainerConfig:
    return TrainerConfig(
        model_dir=tiny,
        steps=steps,
        batch_groups=2,
        rules=NetworkRules(max_staleness=100),
        eval_every=0,
        checkpoint_dir=ckpt,
        checkpoint_every=3,
        starve_timeout_s=1,
    )


def test_resume_re_runs_published_steps_without_publishing_them(tiny: Path, tmp_path: Path) -> None:
    """Published 1..5, checkpointed at 3: the validator is ahead of the checkpoint."""
    ckpt = tmp_path / "ckpt"
    source = ListSource(groups_of(20))
    published: list[int] = []
    first = make_loop(tiny, source, _cfg(tiny, ckpt, 7), published)
    first.run(steps=5)
    at_5 = {k: v.clone() for k, v in first.stage.state_dict().items()}
    _kill_after_checkpoint_3(ckpt)
    assert checkpoint_version(ckpt) == 3 and published == [1, 2, 3, 4, 5]

    resumed = make_loop(tiny, source, _cfg(tiny, ckpt, 7), published)
    assert resumed.resume(ckpt, published=5) and resumed.version == 5
    assert published == [1, 2, 3, 4, 5]  # re-run, checked, not announced again
    for k, v in resumed.stage.state_dict().items():
        assert torch.equal(v, at_5[k]), k
    resumed.run()
    assert published == [1, 2, 3, 4, 5, 6, 7]
    lines = read_journal(journal_path(ckpt, 0))
    trained = [i for r in lines for i in r.trained]
    assert [r.version for r in lines] == list(range(1, 8))
    assert sorted(trained) == list(range(len(trained))) and len(trained) == 7 * 2 * 4


def test_resume_refuses_a_re_run_that_differs(tiny: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    source = ListSource(groups_of(12))
    make_loop(tiny, source, _cfg(tiny, ckpt, 5), []).run(steps=5)
    _kill_after_checkpoint_3(ckpt)
    path = journal_path(ckpt, 0)
    lines = path.read_text().splitlines()
    line = json.loads(lines[4])
    line["digest"] = "00" * 32  # version 5 was announced with other weights
    path.write_text("\n".join([*lines[:4], json.dumps(line)]) + "\n")
    with pytest.raises(JournalMismatch, match="step 5 .* digest"):
        make_loop(tiny, source, _cfg(tiny, ckpt, 5), []).resume(ckpt, published=5)
    path.write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(ProofTrainError, match="version 4 was published but the step journal"):
        make_loop(tiny, source, _cfg(tiny, ckpt, 5), []).resume(ckpt, published=5)
