"""Sample buffer (cursor, grouping, staleness, sync mode), trainer loop, checkpoint and resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from tests.node.conftest import build_tiny_model
from tests.trainer.test_rl import group
from trainer.buffer import SampleBuffer, StarvedError
from trainer.config import TrainerConfig, load_trainer_config
from trainer.loop import TrainerLoop, ensure_process_group
from trainer.network_rules import NetworkRules
from trainer.pipeline import PipelineRunner
from trainer.stages import load_stage
from verify.errors import ConfigError
from verify.types import AcceptedSample, SampleBatch

torch.set_num_threads(1)


class ListSource:
    """Serves a fixed list of samples by ledger index (one per index)."""

    def __init__(self, samples: list[AcceptedSample]) -> None:
        self.samples = [msgspec.structs.replace(s, ledger_index=i) for i, s in enumerate(samples)]
        self.calls = 0

    def fetch(self, cursor: int, limit: int) -> SampleBatch:
        self.calls += 1
        out = self.samples[cursor : cursor + limit]
        return SampleBatch(cursor, cursor + len(out), out)


def groups_of(n: int, *, version: int = 0, start: int = 0, keys: int = 2) -> list[AcceptedSample]:
    out: list[AcceptedSample] = []
    for i in range(start, start + n):
        out += group(
            i.to_bytes(16, "big"),
            [1.0, 0.0, 0.0, 0.0],
            version=version,
            key=bytes([1 + i % keys]) * 32,
        )
    return out


def aids(groups) -> list[int]:
    return [int.from_bytes(g[0].assignment_id, "big") for g in groups]


def test_buffer_releases_only_complete_groups_across_pages() -> None:
    buf = SampleBuffer(ListSource(groups_of(3)), max_staleness=2, page=3)
    buf.poll()  # group 0 has 3 of 4 members
    assert buf.take(5, 0).groups == []
    buf.poll()
    taken = buf.take(5, 0)
    assert aids(taken.groups) == [0] and len(buf) == 2
    assert buf.fill(2, 0, wait=lambda: None, timeout_s=1).groups and len(buf) == 0


def test_buffer_drops_stale_and_skips_uniform_groups() -> None:
    samples = groups_of(2, version=0) + groups_of(2, version=3, start=2)
    samples += group(b"\xff" * 16, [0.0, 0.0, 0.0, 0.0], version=3)
    buf = SampleBuffer(ListSource(samples), max_staleness=2)
    buf.poll()
    taken = buf.take(10, 4)
    assert aids(taken.groups) == [2, 3]
    assert taken.stale_dropped == 8 and taken.uniform_dropped == 4
    assert dict(taken.staleness) == {1: 8} and len(buf) == 0


def test_sync_mode_takes_only_the_current_version() -> None:
    samples = groups_of(1, version=0) + groups_of(1, version=1, start=1)
    buf = SampleBuffer(ListSource(samples), max_staleness=8, sync=True)
    buf.poll()
    taken = buf.take(10, 1)
    assert aids(taken.groups) == [1] and taken.stale_dropped == 4
    with pytest.raises(StarvedError):
        buf.fill(1, 2, wait=lambda: None, timeout_s=0.05)


def test_buffer_state_round_trip_loses_and_repeats_nothing() -> None:
    source = ListSource(groups_of(6))
    buf = SampleBuffer(source, max_staleness=1, page=7)
    buf.poll()
    first = buf.take(1, 0).groups
    restored = SampleBuffer(source, max_staleness=1, page=7)
    restored.load_state(buf.state())
    rest = restored.fill(5, 0, wait=lambda: None, timeout_s=1).groups
    assert aids(first) + aids(rest) == list(range(6))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("loop-tiny"), seed=4)


def make_loop(model_dir: Path, source, cfg: TrainerConfig, published: list) -> TrainerLoop:
    ensure_process_group()
    runner = PipelineRunner(load_stage(model_dir, 0, 1), 0, 1)
    return TrainerLoop(
        cfg, runner, source, publish=lambda v, s: published.append(v), progress=False
    )


def small_config(model_dir: Path, **kw: object) -> TrainerConfig:
    """Two groups a step, any staleness, no evals, a short starvation timeout."""
    base: dict[str, object] = {
        "batch_groups": 2,
        "rules": NetworkRules(max_staleness=100),
        "eval_every": 0,
        "starve_timeout_s": 1,
    }
    return TrainerConfig(model_dir=model_dir, **{**base, **kw})  # type: ignore[arg-type]


def trained(loop: TrainerLoop) -> list[int]:
    """Record which groups each step trains on."""
    seen: list[int] = []
    fill = loop.buffer.fill

    def recording(*a, **kw):
        taken = fill(*a, **kw)
        seen.extend(aids(taken.groups))
        return taken

    loop.buffer.fill = recording  # type: ignore[method-assign]
    return seen


def test_checkpoint_resume_trains_every_group_exactly_once(tiny: Path, tmp_path: Path) -> None:
    source = ListSource(groups_of(12))
    cfg = TrainerConfig(
        model_dir=tiny,
        steps=4,
        batch_groups=2,
        rules=NetworkRules(max_staleness=100),
        eval_every=0,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1,
        starve_timeout_s=1,
    )
    published: list[int] = []
    loop = make_loop(tiny, source, cfg, published)
    seen = trained(loop)
    loop.run(steps=2)
    params_at_2 = {k: v.clone() for k, v in loop.stage.state_dict().items()}
    assert (tmp_path / "ckpt" / "latest").read_text() == "v00000002"

    resumed = make_loop(tiny, source, cfg, published)
    assert resumed.resume(tmp_path / "ckpt") and resumed.version == 2
    for k, v in resumed.stage.state_dict().items():
        assert torch.equal(v, params_at_2[k])
    seen_after = trained(resumed)
    history = resumed.run()
    assert resumed.version == 4 and published == [1, 2, 3, 4]
    assert seen + seen_after == list(range(8))
    m = history.metrics[-1]
    assert m["train/version"] == 4 and m["off_policy/staleness/3"] == 8  # trained at v3 on v0
    assert {"train/reward", "train/grad_norm", "aggregate/contributors"} <= set(m)
    assert not list((tmp_path / "ckpt").glob("*/.*tmp*"))


def test_training_progress_in_a_log_is_whole_lines(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr is not a terminal here: plain lines, no redrawn bar."""
    cfg = small_config(tiny, steps=2)
    loop = make_loop(tiny, ListSource(groups_of(4)), cfg, [])
    loop.progress = True
    loop.run()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("train: ")]
    assert lines[0].startswith("train: 0/2 step (0%)")
    assert lines[-1].startswith("train: 2/2 step (100%)") and "reward=" in lines[-1]


def test_config_rejects_unknown_keys_and_bad_bounds(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text("[trainer]\nlr = 1e-4\nlearning_rate = 3\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_trainer_config(bad)
    with pytest.raises(ConfigError, match="max_staleness"):
        load_trainer_config(None, {"rules.max_staleness": -1})
    with pytest.raises(ConfigError, match="aggregator"):
        load_trainer_config(None, {"aggregator.name": "average"})
    repo = Path(__file__).resolve().parents[2]
    cfg = load_trainer_config(repo / "configs" / "trainer.toml")
    assert cfg.aggregator.name == "centered-clip" and cfg.mode == "async"


def test_cli_smoke(tiny: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "trainer",
        "--steps",
        "2",
        "--quiet",
        "--set",
        f"model_dir={tiny}",
        "--set",
        "local.contributors=2",
        "--set",
        "local.group_size=4",
        "--set",
        "local.groups_per_fetch=4",
        "--set",
        "batch_groups=2",
        "--set",
        "eval_problems=8",
        "--set",
        "eval_every=2",
        "--set",
        "skip_uniform_groups=false",
        "--metrics",
        str(tmp_path / "m.jsonl"),
    ]
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pass@1 (greedy)" in out.stdout and "\n2 " in out.stdout
    assert "train/reward" in (tmp_path / "m.jsonl").read_text()


@pytest.mark.slow
def test_cli_two_stage_pipeline_smoke(tiny: Path, tmp_path: Path) -> None:
    """S = 2 under torchrun: rank 0 hosts the network, both stages step and checkpoint."""
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "trainer",
        "--steps",
        "2",
        "--quiet",
        "--set",
        f"model_dir={tiny}",
        "--set",
        "stages=2",
        "--set",
        "local.contributors=2",
        "--set",
        "local.group_size=4",
        "--set",
        "local.groups_per_fetch=4",
        "--set",
        "batch_groups=2",
        "--set",
        "eval_problems=8",
        "--set",
        "eval_every=2",
        "--set",
        "skip_uniform_groups=false",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    ]
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pass@1 (greedy)" in out.stdout
    assert sorted(p.name for p in (tmp_path / "ck" / "v00000002").iterdir()) == [
        "stage0.pt",
        "stage1.pt",
    ]


def test_a_stop_while_waiting_for_samples_checkpoints_and_loses_no_group(
    tiny: Path, tmp_path: Path
) -> None:
    cfg = TrainerConfig(
        model_dir=tiny,
        steps=3,
        batch_groups=2,
        rules=NetworkRules(max_staleness=100),
        eval_every=0,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=100,
        starve_timeout_s=5,
    )
    published: list[int] = []
    loop = make_loop(tiny, ListSource(groups_of(3)), cfg, published)
    loop.stop = lambda: loop.version == 1  # asked to stop while step 2 waits for a group
    seen = trained(loop)
    history = loop.run()
    assert history.stopped_at == 1 and published == [1] and seen == [0, 1]
    assert (tmp_path / "ckpt" / "latest").read_text() == "v00000001"

    resumed = make_loop(tiny, ListSource(groups_of(6)), cfg, published)
    assert resumed.resume(tmp_path / "ckpt") and len(resumed.buffer) == 4  # group 2, held
    seen_after = trained(resumed)
    assert resumed.run().stopped_at is None
    assert published == [1, 2, 3] and seen + seen_after == list(range(6))
