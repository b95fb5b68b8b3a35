"""Fault test of the trainer: SIGKILL ``prooftrain trainer`` at random moments and resume it.

The trainer runs as its own process against its in-process network (a
validator core with its ledger under ``<checkpoint_dir>/network``), with a
tiny config: few steps, small batches, a checkpoint every few steps. A seeded
killer sends SIGKILL at a random moment (during start-up and catch-up, or a
random time into a random step), checks the ledger, and restarts the trainer
with ``--resume``; after the last kill the trainer runs to the end. Then
:func:`check_run` checks what the run left behind:

* **ledger**: ``verify_ledger`` passes (after every kill and at the end).
* **versions**: the ``PolicyPublished`` records are versions 1..N, each exactly
  once, in ledger order, each naming the previous one's manifest as parent,
  all signed by one trainer key, N = ``steps``; the signed manifest chain
  rebuilds (``rollout.sync.PolicySync``, every signature and digest). A
  resume never re-publishes: steps the validator already holds are re-run
  from the checkpoint and checked against the step journal, not announced.
* **samples**: the step journal (``trainer.journal``) has one line per version
  1..N per rank, all ranks agreeing on the samples. Every accepted sample the
  trainer's cursor has passed is, exactly once, trained by one version,
  dropped (stale or uniform group), or held in the final checkpoint's buffer;
  none of them is a rejected one, and none was trained before its policy
  version existed or past the staleness bound.
* **weights**: the final checkpoint's parameters are those the journal's last
  line names.

Prints one JSON object with the figures and the problems found (none on success).

    python -m harness.trainer_faults [--kills 20] [--steps 60] [--seed 0] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rollout.loading import model_dir_arg
from trainer.network_rules import NetworkRules

REPO = Path(__file__).resolve().parent.parent

TINY_RULES = NetworkRules(max_staleness=1)
"""The network rules of :func:`tiny_config`'s runs."""


def tiny_config(model: Path, checkpoint_dir: Path, steps: int, **extra: object) -> str:
    """A trainer TOML small enough that a life of the trainer lasts seconds."""
    local: dict[str, object] = {"contributors": 2, "group_size": 4, "groups_per_fetch": 3}
    local.update({k.removeprefix("local."): v for k, v in extra.items() if k.startswith("local.")})
    top = {
        "model_dir": str(model),
        "checkpoint_dir": str(checkpoint_dir),
        "steps": steps,
        "batch_groups": 2,
        "checkpoint_every": 3,
        "eval_every": 0,
        "starve_timeout_s": 120.0,
    }
    top.update({k: v for k, v in extra.items() if not k.startswith("local.")})
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    lines += ["[rules]", f"max_staleness = {TINY_RULES.max_staleness}"]
    lines += ["[local]"] + [f"{k} = {json.dumps(v)}" for k, v in local.items()]
    return "\n".join(lines) + "\n"


def published_versions(ledger_path: Path) -> list:
    """The ``PolicyPublished`` records of a ledger, in ledger order."""
    from ledger.records import PolicyPublished, decode_record
    from ledger.storage import open_store

    store = open_store(str(ledger_path), readonly=True)
    try:
        return [
            r
            for _, _, body in store.entries(0, None)
            if isinstance(r := decode_record(body), PolicyPublished)
        ]
    finally:
        store.close()


def audit_ok(ledger_path: Path) -> bool:
    from ledger.audit import verify_ledger
    from ledger.storage import open_store

    store = open_store(str(ledger_path), readonly=True)
    try:
        return verify_ledger(store).ok
    finally:
        store.close()


def check_versions(network: Path, model: Path, steps: int, problems: list[str]) -> int:
    """The version-history invariants (module docstring); returns the number published."""
    from node.validator.state import StateStore
    from rollout.sync import PolicySync
    from verify.keys import PublicKey
    from verify.signed import open_sealed
    from verify.types import PolicyManifest, SignedManifest, decode

    recs = published_versions(network / "ledger.sqlite")
    versions = [r.version for r in recs]
    if versions != list(range(1, steps + 1)):
        dup = sorted(v for v, n in Counter(versions).items() if n > 1)
        problems.append(
            f"published versions are not 1..{steps} once each: {len(versions)} "
            f"records, repeated {dup[:10]}, last {versions[-3:]}"
        )
    for prev, rec in zip(recs, recs[1:], strict=False):
        if rec.parent_digest != prev.manifest_digest:
            problems.append(f"version {rec.version} does not extend version {prev.version}")
    if recs and recs[0].parent_digest:
        problems.append("version 1 names a parent")
    if len({r.trainer_key for r in recs}) > 1:
        problems.append("versions signed by more than one trainer key")
    if recs:
        from ledger.blobs import FileBlobStore

        state = StateStore(network / "state.sqlite")
        blobs = FileBlobStore(str(network / "ledger.sqlite") + ".blobs")

        def manifest(v: int) -> SignedManifest:
            raw = state.manifest(v)
            if raw is None:
                raise LookupError(f"no manifest for version {v}")
            return decode(SignedManifest, raw, max_bytes=len(raw))

        key = PublicKey(recs[0].trainer_key)
        try:
            shards = len(open_sealed(PolicyManifest, manifest(1), key).shards)
            PolicySync(model, key, manifest, blobs.get, shards).state_at(recs[-1].version)
        except Exception as exc:  # noqa: BLE001 - reported as a finding, with its type
            problems.append(f"the manifest chain does not rebuild: {type(exc).__name__}: {exc}")
        finally:
            state.close()
    return len(recs)


def accepted_samples(network: Path) -> tuple[dict[int, int], set[int]]:
    """Accepted ledger index -> policy version; and the indices of every other entry."""
    from ledger.records import VerdictRecorded, decode_record
    from ledger.storage import open_store
    from node.validator.state import StateStore
    from verify.types import AcceptedSample, decode

    store = open_store(str(network / "ledger.sqlite"), readonly=True)
    state = StateStore(network / "state.sqlite")
    accepted: dict[int, int] = {}
    other: set[int] = set()
    try:
        for index, _, body in store.entries(0, None):
            rec = decode_record(body)
            if isinstance(rec, VerdictRecorded) and rec.accepted:
                raw = state.sample(rec.envelope_digest, rec.assignment_id)
                accepted[index] = (
                    -1
                    if raw is None
                    else decode(AcceptedSample, raw, max_bytes=len(raw)).policy_version
                )
            else:
                other.add(index)
    finally:
        store.close()
        state.close()
    return accepted, other


def check_samples(
    checkpoint_dir: Path, model: Path, ranks: int, max_staleness: int, problems: list[str]
) -> dict[str, int]:
    """The sample-accounting and final-weights invariants (module docstring)."""
    import torch

    from trainer.journal import journal_path, params_digest, read_journal
    from trainer.loop import checkpoint_version
    from trainer.stages import load_stage
    from verify.types import AcceptedSample, decode

    journals = [read_journal(journal_path(checkpoint_dir, r)) for r in range(ranks)]
    main = journals[0]
    if [r.version for r in main] != list(range(1, len(main) + 1)):
        problems.append("the step journal is not versions 1..N once each")
    for r, other in enumerate(journals[1:], 1):
        if [(x.version, x.trained, x.dropped) for x in other] != [
            (x.version, x.trained, x.dropped) for x in main
        ]:
            problems.append(f"rank {r}'s journal disagrees with rank 0's about the samples")
    accepted, not_accepted = accepted_samples(checkpoint_dir / "network")
    final = checkpoint_version(checkpoint_dir)
    state = torch.load(checkpoint_dir / f"v{final:08d}" / "stage0.pt", weights_only=False)
    held = [
        decode(AcceptedSample, raw, max_bytes=len(raw)).ledger_index
        for raw in state["buffer"]["held"]
    ]
    cursor = int(state["buffer"]["cursor"])
    if main and final != main[-1].version:
        problems.append(
            f"final checkpoint v{final} is not the journal's last version {main[-1].version}"
        )
    uses = Counter(i for rec in main for i in (*rec.trained, *rec.dropped)) + Counter(held)
    twice = sorted(i for i, n in uses.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} samples consumed twice, e.g. ledger index {twice[:5]}")
    skipped = sorted(i for i in accepted if i < cursor and i not in uses)
    if skipped:
        problems.append(f"{len(skipped)} accepted samples skipped, e.g. ledger index {skipped[:5]}")
    bogus = sorted(i for i in uses if i not in accepted or i >= cursor)
    if bogus:
        problems.append(
            f"{len(bogus)} consumed ledger indices are not accepted samples before "
            f"the cursor, e.g. {bogus[:5]}"
        )
    for rec in main:
        bad = [
            i
            for i in rec.trained
            if not 0 <= rec.version - 1 - accepted.get(i, -(10**9)) <= max_staleness
        ]
        if bad:
            problems.append(
                f"version {rec.version} trained samples outside the staleness window: {bad[:5]}"
            )
    for r in range(ranks):
        ck = torch.load(checkpoint_dir / f"v{final:08d}" / f"stage{r}.pt", weights_only=False)
        stage = load_stage(model, r, ranks)
        stage.load_state_dict(ck["stage"])
        if journals[r] and params_digest(stage) != journals[r][-1].digest:
            problems.append(f"rank {r}'s final checkpoint is not the weights its journal names")
    trained = sum(len(rec.trained) for rec in main)
    dropped = sum(len(rec.dropped) for rec in main)
    return {
        "steps_journaled": len(main),
        "accepted_samples": len(accepted),
        "other_ledger_entries": len(not_accepted),
        "samples_trained": trained,
        "samples_dropped": dropped,
        "samples_held_at_end": len(held),
        "final_cursor": cursor,
    }


def check_run(
    checkpoint_dir: Path,
    model: Path,
    steps: int,
    *,
    ranks: int = 1,
    rules: NetworkRules = TINY_RULES,
) -> tuple[dict, list[str]]:
    """Every invariant of the module docstring on a finished run; (figures, problems)."""
    problems: list[str] = []
    network = checkpoint_dir / "network"
    figures: dict = {"final_audit_ok": audit_ok(network / "ledger.sqlite")}
    if not figures["final_audit_ok"]:
        problems.append("the ledger does not verify")
    figures["versions_published"] = check_versions(network, model, steps, problems)
    figures.update(check_samples(checkpoint_dir, model, ranks, rules.max_staleness, problems))
    return figures, problems


# -- the campaign


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _journal_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def _kill_at_random(proc: subprocess.Popen, journal: Path, rng: random.Random) -> str:
    """SIGKILL ``proc`` at a random moment; returns when (or 'exited' if it ended first)."""
    if rng.random() < 0.25:
        moment, deadline = "start-up", time.monotonic() + rng.uniform(0.5, 8.0)
        start = _journal_lines(journal)  # before this process journals its first step
        while (
            time.monotonic() < deadline and proc.poll() is None and _journal_lines(journal) == start
        ):
            time.sleep(0.05)
    else:
        moment, seen = "training", _journal_lines(journal)
        wait_for = seen + rng.randint(1, 3)
        deadline = time.monotonic() + 300
        changed: list[float] = []  # when the journal last grew: the step time, whatever the machine
        while seen < wait_for and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
            if (now := _journal_lines(journal)) != seen:
                seen, changed = now, [*changed[-1:], time.monotonic()]
        step_s = changed[1] - changed[0] if len(changed) == 2 else 0.5
        time.sleep(rng.uniform(0.0, step_s))  # a random point of the next step
    if proc.poll() is not None:
        return "exited"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return moment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the run")
    parser.add_argument(
        "--model", type=model_dir_arg, default=None, help="model dir (default: the demo base model)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="keep the run here")
    args = parser.parse_args(argv)

    from trainer.base_model import ensure_base_model
    from trainer.journal import journal_path
    from trainer.loop import checkpoint_version

    rng = random.Random(args.seed)
    model = (args.model or ensure_base_model("arithmetic", progress=False)).resolve()
    with tempfile.TemporaryDirectory(prefix="prooftrain-trainer-faults-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = work / "ckpt"
        (work / "trainer.toml").write_text(tiny_config(model, ckpt, args.steps))
        cmd = [
            sys.executable,
            "-m",
            "node.cli",
            "trainer",
            "--config",
            str(work / "trainer.toml"),
            "--resume",
            "--quiet",
        ]
        journal, ledger = journal_path(ckpt, 0), ckpt / "network" / "ledger.sqlite"
        moments: Counter[str] = Counter()
        audits, ahead, unpublished, reruns, problems = [], 0, 0, 0, []
        t0 = time.monotonic()
        while sum(moments.values()) < args.kills:
            proc = _start(cmd, work / "trainer.log")
            moment = _kill_at_random(proc, journal, rng)
            if moment == "exited":
                if proc.returncode != 0:
                    problems.append(
                        f"the trainer exited {proc.returncode} after "
                        f"{sum(moments.values())} kills (see trainer.log)"
                    )
                break
            moments[moment] += 1
            if ledger.is_file():
                audits.append(audit_ok(ledger))
                head = len(published_versions(ledger))
                ahead += head > checkpoint_version(ckpt)
                unpublished += _journal_lines(journal) > head
                reruns += max(0, _journal_lines(journal) - checkpoint_version(ckpt))
            print(
                f"kill {sum(moments.values())}/{args.kills} ({moment}): "
                f"{_journal_lines(journal)} steps journaled, audit "
                f"{'ok' if not audits or audits[-1] else 'FAILED'}",
                file=sys.stderr,
            )
        if not problems:
            proc = _start(cmd, work / "trainer.log")
            if proc.wait(timeout=1800) != 0:
                problems.append(f"the final trainer run exited {proc.returncode} (see trainer.log)")
        figures: dict = {}
        if not problems:
            figures, problems = check_run(ckpt, model, args.steps)
        if problems:
            print((work / "trainer.log").read_text()[-3000:], file=sys.stderr)
    result = {
        "kills": sum(moments.values()),
        "kills_during_start_up": moments["start-up"],
        "kills_during_training": moments["training"],
        "audits_after_kills_ok": sum(audits),
        "audits_after_kills": len(audits),
        "kills_with_publication_ahead_of_checkpoint": ahead,
        "kills_with_a_journaled_step_not_yet_published": unpublished,
        "journaled_steps_re_run": reruns,
        "steps": args.steps,
        **figures,
        "seconds": round(time.monotonic() - t0, 1),
        "problems": problems,
    }
    print(json.dumps(result))
    return 0 if not problems and all(audits) and result["kills"] == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
