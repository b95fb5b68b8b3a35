"""``/metrics`` has what a dashboard of the node needs, with label sets that cannot grow:
contributors, policy and checkpoint age, how long samples wait for the trainer, the process
and the build."""

from __future__ import annotations

import time
from importlib.metadata import version

import httpx
from prometheus_client.parser import text_string_to_metric_families

from node.client import ValidatorClient
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from rollout.worker import answer
from verify.errors import Reason
from verify.keys import SigningKey

TRAINER = SigningKey.from_seed(b"\x77" * 32)
ALICE, BOB, MALLORY = (SigningKey.from_seed(bytes([b]) * 32) for b in (0x61, 0x62, 0x6D))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape_when(url: str, ready, timeout_s: float = 10.0) -> dict:  # type: ignore[no-untyped-def]
    """Scrape until ``ready(samples)``: the node's gauges follow its ledger once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_metrics_a_dashboard_reads(make_validator, backend, codec) -> None:
    v = make_validator({"limits.requests_per_s": 1000.0, "limits.burst": 1000})
    started = time.time()
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        before = scrape(url)
        assert value(before, "prooftrain_contributors", state="registered") == 0
        assert value(before, "prooftrain_trainer_cursor") != value(
            before, "prooftrain_trainer_cursor"
        )  # NaN: no read yet
        alice, bob = ValidatorClient(url, ALICE), ValidatorClient(url, BOB)
        for client, name in ((alice, "alice"), (bob, "bob"), (ValidatorClient(url, MALLORY), "m")):
            client.register(name)
        for _ in range(2):
            alice.submit(answer(ALICE, alice.assign(), v.key.public, backend, codec))
        v.ledger.slash(MALLORY.public.raw, Reason.LOGPROB_MISMATCH, b"evidence")
        time.sleep(0.5)  # the samples wait at least this long for the trainer
        batch = ValidatorClient(url, TRAINER).samples(0, limit=5)
        ValidatorClient(url, TRAINER).samples(0, limit=5)  # read again: no second wait
        samples = scrape_when(
            url, lambda s: value(s, "prooftrain_contributors", state="banned") == 1
        )

    assert value(samples, "prooftrain_contributors", state="registered") == 3
    assert value(samples, "prooftrain_contributors", state="active") == 1  # only alice submitted
    assert value(samples, "prooftrain_contributors", state="banned") == 1
    # no publication yet: version 0 dates from the log's creation
    assert 0 <= value(samples, "prooftrain_policy_age_seconds") <= time.time() - started + 1
    assert value(samples, "prooftrain_policy_published_timestamp_seconds") >= started - 1
    size = v.ledger.size()
    covered = value(samples, "prooftrain_ledger_checkpoint_size")
    assert 0 < covered < size  # the slash came after the last checkpoint, half a second ago
    assert 0.5 <= value(samples, "prooftrain_ledger_checkpoint_age_seconds") < 60
    # five samples read once each, each after at least half a second
    assert value(samples, "prooftrain_trainer_sample_wait_seconds_count") == 5
    assert value(samples, "prooftrain_trainer_sample_wait_seconds_sum") >= 5 * 0.5
    assert value(samples, "prooftrain_trainer_cursor") == batch.next_cursor
    assert 0 < value(samples, "prooftrain_trainer_cursor_lag_entries") == size - batch.next_cursor
    assert value(samples, "process_resident_memory_bytes") > 0
    assert value(samples, "process_start_time_seconds") <= time.time()
    assert (
        value(samples, "prooftrain_build_info", version=version("prooftrain"), python=_python())
        == 1
    )
    assert "python_info" in {name for name, _ in samples}
    # bounded labels: contributors are counted, never named
    states = {
        dict(labels)["state"] for name, labels in samples if name == "prooftrain_contributors"
    }
    assert states == {"registered", "banned", "active"}
    assert not any(
        ALICE.public.raw.hex()[:8] in str(labels) or "contributor" in dict(labels)
        for _, labels in samples
    )


def _python() -> str:
    import platform

    return platform.python_version()


def test_the_gauges_follow_publications_the_active_window_and_checkpoints(tmp_path) -> None:
    from ledger.log import Ledger
    from ledger.records import ContributorRegistered, Note, PolicyPublished, VerdictRecorded
    from node.validator.activity import ActivityLog
    from node.validator.service import Metrics

    def verdict(c: bytes, at_ms: int) -> VerdictRecorded:
        return VerdictRecorded(c, b"\x00" * 16, 0, b"\x01" * 32, True, "", False, b"", at_ms)

    old, recent = ALICE.public.raw, BOB.public.raw
    ledger = Ledger.open(tmp_path / "l.sqlite", signing_key=TRAINER, origin="test/validator")
    ledger.append_many(
        [
            ContributorRegistered(old, "old", 1_000),
            ContributorRegistered(recent, "recent", 1_000),
            verdict(old, 2_000),
            PolicyPublished(1, b"", b"\x02" * 32, TRAINER.public.raw, 650_000),
            verdict(recent, 700_000),
        ],
        checkpoint=True,
    )
    now = [800_000]
    metrics = Metrics()
    log = ActivityLog(ledger, metrics, lambda: 0, clock_ms=lambda: now[0], active_window_s=600)

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert gauge("prooftrain_contributors", state="registered") == 2
    assert gauge("prooftrain_contributors", state="active") == 1  # 2 s is not in the window
    assert gauge("prooftrain_policy_published_timestamp_seconds") == 650
    assert gauge("prooftrain_policy_age_seconds") == 150
    assert gauge("prooftrain_ledger_checkpoint_age_seconds") == 0  # the checkpoint covers the log
    ledger.append(Note("after the checkpoint", 790_000))
    now[0] = 1_400_000
    log.poll()
    assert gauge("prooftrain_ledger_checkpoint_age_seconds") == 610
    assert gauge("prooftrain_contributors", state="active") == 0
    assert gauge("prooftrain_policy_age_seconds") == 750


def test_storage_gauges_say_what_is_free_and_how_fast_the_blob_store_grows(
    make_validator,
) -> None:
    """Free bytes per store the node writes, and the update blob bytes each version adds
    (nothing is deleted): what an operator alerts on before writes are refused with 503."""
    import shutil

    from verify.signed import seal
    from verify.types import PolicyManifest, ShardEntry

    v = make_validator()
    v.versions.trainer = TRAINER.public  # the key whose manifests it records
    blob = b"\x07" * 12_345
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        before = scrape(url)
        trainer = ValidatorClient(url, TRAINER)
        digest = trainer.put_blob(blob)
        shard = ShardEntry(0, digest, "int8-block", len(blob), "delta")
        trainer.publish(
            seal(
                TRAINER,
                PolicyManifest(1, 1, b"", v.versions.base_digest, [shard], TRAINER.public.raw, 0),
            )
        )
        after = scrape(url)
    assert value(before, "prooftrain_policy_version_blob_bytes") == 0  # the base model
    assert value(after, "prooftrain_policy_version_blob_bytes") == len(blob)
    free = shutil.disk_usage(".").free
    for store in ("ledger", "state_file", "blob_dir"):  # here all on the disk of the cwd
        assert abs(value(after, "prooftrain_storage_free_bytes", store=store) - free) < 1 << 30
