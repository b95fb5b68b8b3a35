"""The in-process network: verified samples by cursor, policy versions, staleness emulation."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from node.local import LocalNetwork, LocalSettings
from tests.node.conftest import build_tiny_model
from trainer.buffer import SampleSource
from trainer.network_rules import NetworkRules
from trainer.stages import load_stage
from verify.errors import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("local-tiny"), seed=5)


def small(max_staleness: int = NetworkRules().max_staleness, **kw) -> LocalSettings:
    base = dict(
        contributors=2,
        group_size=4,
        max_tokens=6,
        groups_per_fetch=2,
        rules=NetworkRules(max_staleness=max_staleness, audit_rate=1.0),
    )
    return LocalSettings(**{**base, **kw})


def nudged_stage(model_dir: Path, seed: int):
    stage = load_stage(model_dir, 0, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return stage


def test_serves_verified_groups_by_cursor(tiny: Path) -> None:
    net = LocalNetwork(tiny, small())
    try:
        assert isinstance(net, SampleSource)
        first = net.fetch(0, 1000)  # empty stream: the contributors produce 2 groups
        assert len(first.samples) == 8 and net.stats.verdicts["accepted"] == 8
        assert net.stats.audited == 8  # audit rate 1: every rollout spot-checked
        assert {s.group_index for s in first.samples} == {0, 1, 2, 3}
        assert all(s.policy_version == 0 for s in first.samples)
        again = net.fetch(first.cursor, 3)
        assert again.samples == first.samples[:3]
        rest = net.fetch(again.next_cursor, 1000)
        assert rest.samples == first.samples[3:]
        assert len(net.contributors) == 2 and net.weight(first.samples[0].contributor_key) > 0
    finally:
        net.close()


def test_published_versions_are_assigned_and_spot_checked(tiny: Path) -> None:
    net = LocalNetwork(tiny, small())
    try:
        net.publish(1, nudged_stage(tiny, 1))
        assert net.validator.versions.current == 1 and 1 in net.registry
        batch = net.fetch(0, 1000)
        assert batch.samples and all(s.policy_version == 1 for s in batch.samples)
        assert set(net.stats.verdicts) == {"accepted"}  # spot checks pass under version 1
    finally:
        net.close()


def test_publish_delay_emulates_staleness(tiny: Path) -> None:
    net = LocalNetwork(tiny, small(publish_delay=2, max_staleness=2))
    try:
        for v in (1, 2, 3):
            net.publish(v, nudged_stage(tiny, v))
        assert net.validator.versions.current == 1  # trainer at 3, validator at 3 - 2
        batch = net.fetch(0, 1000)
        assert {s.policy_version for s in batch.samples} == {1}
    finally:
        net.close()


def test_registry_is_bounded(tiny: Path) -> None:
    net = LocalNetwork(tiny, small(max_staleness=1))
    try:
        stage = nudged_stage(tiny, 0)
        for v in range(1, 8):
            net.publish(v, stage)
        assert 0 in net.registry and 7 in net.registry and 2 not in net.registry
    finally:
        net.close()


def test_a_dropped_versions_model_takes_the_next_copy_unless_it_is_held(tiny: Path) -> None:
    net = LocalNetwork(tiny, small(max_staleness=0))  # the registry keeps 2 versions
    try:

        def published(v: int) -> bool:  # the registry's model holds the publisher's copy
            params = dict(net.registry[v].named_parameters(remove_duplicate=False))
            return all(
                torch.equal(params[n], t) for n, t in net.publisher.published_state().items()
            )

        for v in (1, 2):
            net.publish(v, nudged_stage(tiny, v))
        first = weakref.ref(net.registry[1])
        net.publish(3, nudged_stage(tiny, 3))  # drops version 1
        assert 1 not in net.registry and first() is not None
        net.publish(4, nudged_stage(tiny, 4))  # drops 2; 1's model takes version 4
        assert net.registry[4] is first() and published(4)

        held = net.registry[3]  # a caller still holds version 3's model when it is dropped
        before = [p.detach().clone() for p in held.parameters()]
        net.publish(5, nudged_stage(tiny, 5))  # drops 3; 2's model takes version 5
        net.publish(6, nudged_stage(tiny, 6))  # drops 4: 3's model is held, so a new copy
        assert net.registry[6] is not held and published(6)
        assert all(torch.equal(a, b) for a, b in zip(before, held.parameters(), strict=True))
    finally:
        net.close()


def test_adversaries_need_the_harness(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="honest contributors only"):
        LocalNetwork(tiny, small(adversaries=("tampered-logprobs",)))


def test_reopened_network_resumes_the_version_chain(tiny: Path, tmp_path: Path) -> None:
    net = LocalNetwork(tiny, small(), work_dir=tmp_path / "net")
    stage = nudged_stage(tiny, 2)
    try:
        net.publish(1, nudged_stage(tiny, 1))
        net.publish(2, stage)
        served = net.fetch(0, 1000)
    finally:
        net.close()
    net = LocalNetwork(tiny, small(), work_dir=tmp_path / "net")
    try:
        with pytest.raises(Exception, match="version 2 but the checkpoint is at 1"):
            net.adopt(1, stage)
        net.adopt(2, stage)
        net.publish(3, nudged_stage(tiny, 3))
        later = net.fetch(served.next_cursor, 1000)
        assert later.samples and {s.policy_version for s in later.samples} == {3}
    finally:
        net.close()


def test_a_reopened_network_answers_what_a_killed_one_left_open(tiny: Path, tmp_path: Path) -> None:
    """A process killed between issuing a round and admitting it leaves each contributor an
    open assignment. Reopened, the contributors answer them first, as restarted contributors
    send their pending groups; left open, a few such kills (``max_outstanding`` of them)
    would leave the contributors no work until the assignments expired."""
    settings = small()
    net = LocalNetwork(tiny, settings, work_dir=tmp_path / "net")
    limit = net.validator.cfg.assignment.max_outstanding
    try:
        net.publish(1, nudged_stage(tiny, 1))
        keys = [key.public.raw for key, _ in net.contributors]
        for _ in range(limit):  # as many kills, each after issuing a round: every place taken
            assert all(not isinstance(s, Exception) for s in net.validator.assign_many(keys))
        left = {k: net.validator.open_assignments(k) for k in keys}
        assert all(len(v) == limit for v in left.values())
    finally:
        net.close()
    net = LocalNetwork(tiny, settings, work_dir=tmp_path / "net")
    try:
        assert all(len(net.validator.open_assignments(k)) == limit for k in keys)
        got = net.fetch(0, 1000)
        assert all(net.validator.open_assignments(k) == [] for k in keys)
        groups = len(keys) * limit + settings.groups_per_fetch
        assert net.stats.verdicts == {"accepted": settings.group_size * groups}
        assert not net.stats.admission_errors  # no assignment_limit: the places came back
        answered = {s.assignment_id for s in got.samples}
        assert {
            net.validator.open_assignment(a).assignment_id for v in left.values() for a in v
        } <= answered
    finally:
        net.close()


@pytest.mark.parametrize("codec", ["int8-block", "topk"])
def test_published_chain_rebuilds_bit_exactly_from_the_ledger(tiny: Path, codec: str) -> None:
    from rollout.sync import PolicySync

    net = LocalNetwork(tiny, small(codec=codec, snapshot_every=3))
    try:
        stages = [nudged_stage(tiny, v) for v in (1, 2, 3, 4)]
        for v, stage in enumerate(stages, start=1):
            net.publish(v, stage)
        kinds = [net.manifest(v) for v in (1, 2, 3, 4)]
        assert len({m.manifest for m in kinds}) == 4
        assert net.ledger.blobs is not None
        sync = PolicySync(tiny, net.trainer_key.public, net.manifest, net.ledger.blobs.get, 1)
        rebuilt = sync.state_at(4)
        published = dict(net.model(4).named_parameters())
        assert set(rebuilt) == set(published)
        for name, value in rebuilt.items():
            assert torch.equal(value, published[name].detach()), name
        # the published copy is the codec's, not the trainer's weights
        trained = dict(stages[-1].named_parameters())
        assert (
            any(
                not torch.equal(trained[n].detach(), published[n].detach())
                for n in trained
                if n in published
            )
            or codec == "fp32"
        )
    finally:
        net.close()


def test_evals_are_recorded_once_their_version_is_announced(tiny: Path) -> None:
    from ledger.records import EvalRecorded
    from trainer.evals import EvalReport, Metric

    def report(v: float) -> EvalReport:
        return EvalReport(
            "m", "arithmetic", "heldout", 10, (Metric("pass@1 (greedy)", v, 0.0, 1.0, 10),)
        )

    net = LocalNetwork(tiny, small(publish_delay=1, max_staleness=2))
    try:
        net.record_eval(0, report(0.1), seed=0)
        net.publish(1, nudged_stage(tiny, 1))  # held back: not announced yet
        net.record_eval(1, report(0.2), seed=0)
        recorded = [r for _, r in net.ledger.entries() if isinstance(r, EvalRecorded)]
        assert [r.version for r in recorded] == [0]
        net.publish(2, nudged_stage(tiny, 2))  # announces 1
        recorded = [r for _, r in net.ledger.entries() if isinstance(r, EvalRecorded)]
        assert [r.version for r in recorded] == [0, 1]
    finally:
        net.close()
