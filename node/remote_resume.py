"""Where a trainer against a validator starts: fresh, from its checkpoint, or from the chain.

The validator's policy version P (``/v1/info``) is where the run stands; a
trainer always continues from P, never beside it. In order:

1. a checkpoint in ``checkpoint_dir`` (``latest``): load it, re-run the
   journaled steps up to P (``TrainerLoop.resume``), and check that its
   publications are the validator's (the manifest digest at its version); a
   checkpoint past P, or of other manifests, is another run's and is refused
   with what to do;
2. no checkpoint and P = 0: a fresh start (a step journal left there is
   another run's and is refused);
3. no checkpoint, P > 0 and a step journal from version 1 to P: re-run those
   steps from the base model, as after a crash before the first checkpoint;
4. otherwise rebuild version P from the validator's chain of signed updates
   (``trainer.chain_resume``), train on from it with fresh optimizer moments,
   and read accepted samples from just after P's ``policy_published`` entry
   (``/v1/info`` ``policy_index``): every sample trained for a version up to
   P precedes that entry, so none is trained twice; those the stopped trainer
   had fetched and not trained are skipped. A checkpoint is written at P
   straight away.

Whenever the publisher's copy is behind P after 1 or 3 (the re-run steps are
not published again), it is rebuilt from the chain as well, so it equals what
contributors hold.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from node.client import ValidatorClient
from trainer.chain_resume import ChainError, rebuild_published
from trainer.config import TrainerConfig
from trainer.journal import journal_path, read_journal
from trainer.loop import TrainerLoop, checkpoint_version
from trainer.publish import PublishHook, StagePublisher, publishable_state
from trainer.stages import Stage
from verify.errors import ConfigError
from verify.keys import PublicKey
from verify.manifest import manifest_digest
from verify.types import SignedManifest

DEFAULT_CHECKPOINT_DIR = Path("runs/trainer/checkpoints")
"""``checkpoint_dir`` of a trainer against a validator when the config sets none."""

Start = Literal["fresh", "checkpoint", "journal", "chain"]


@dataclass(frozen=True)
class Plan:
    start: Start
    published: int
    directory: Path | None


def plan_start(directory: Path | None, published: int, *, asked: bool) -> Plan:
    """Which start (see the module docstring) for validator version ``published``;
    ``asked``: ``--resume`` was given. ConfigError when ``directory`` is another run's."""
    if directory is not None and (Path(directory) / "latest").is_file():
        at = checkpoint_version(directory)
        if at > published:
            raise ConfigError(
                f"the checkpoint in {directory} is at policy version {at} but the validator is "
                f"at {published}: it is another run's (a new ledger?); move {directory} away or "
                "pass another --checkpoint-dir"
            )
        return Plan("checkpoint", published, directory)
    journal = read_journal(journal_path(directory, 0)) if directory is not None else []
    where = f"in {directory}" if directory is not None else "(no checkpoint_dir)"
    if published == 0:
        if journal:
            raise ConfigError(
                f"{directory} holds a step journal up to policy version {journal[-1].version} "
                "but the validator is at 0: it is another run's; move it away or pass another "
                "--checkpoint-dir"
            )
        if asked:
            raise ConfigError(
                f"--resume: there is no checkpoint {where} (no 'latest' file) and the validator "
                "is at policy version 0: nothing to resume; start without --resume"
            )
        return Plan("fresh", 0, directory)
    if journal and journal[0].version == 1 and journal[-1].version >= published:
        return Plan("journal", published, directory)
    if journal:
        assert directory is not None
        raise ConfigError(
            f"{directory} holds a step journal of versions {journal[0].version}.."
            f"{journal[-1].version} but no checkpoint, and the validator is at {published}; "
            f"move {journal_path(directory, 0).parent} away to rebuild version {published} from "
            "the validator's chain"
        )
    if asked:
        log(f"--resume: there is no checkpoint {where} (no 'latest' file)")
    return Plan("chain", published, directory)


def log(line: str) -> None:
    print(f"trainer: {line}", file=sys.stderr, flush=True)


def rebuild_from_chain(
    client: ValidatorClient,
    version: int,
    base_model: nn.Module,
    base_digest: bytes,
    trainer: PublicKey,
    url: str,
    directory: Path | None,
) -> tuple[dict[str, torch.Tensor], SignedManifest]:
    """Version ``version``'s published weights (and its sealed manifest) from ``client``;
    ``base_model``: the base model (float32). ConfigError saying why and what to do when it
    fails."""
    base = {n: t.detach().to(torch.float32) for n, t in publishable_state(base_model).items()}
    try:
        return rebuild_published(
            version,
            base,
            base_digest=base_digest,
            trainer=trainer,
            fetch_manifest=client.manifest,
            fetch_blob=client.blob,
        )
    except ChainError as exc:
        keep = (
            f"restore the trainer's checkpoint directory ({directory})"
            if directory
            else ("start from a checkpoint of this run (--checkpoint-dir)")
        )
        raise ConfigError(
            f"cannot rebuild policy version {version} from the chain the validator at {url} "
            f"serves: {exc}; {keep}, or check that --trainer-key and --model are the ones this "
            "run was trained with"
        ) from exc


def resync_publisher(
    hook: PublishHook,
    cfg: TrainerConfig,
    stage: Stage,
    state: dict[str, torch.Tensor],
    version: int,
    sealed: SignedManifest,
) -> None:
    """Point ``hook`` at version ``version``: its published copy ``state`` (rebuilt from the
    chain), its parent the validator's manifest ``sealed``."""
    p = cfg.publish
    publisher = StagePublisher(
        0,
        state,
        p.codec,
        p.codec_params,
        p.snapshot_every,
        mirrors=tuple(getattr(stage, "tied_copies", {})),
        train_on=hook.publisher.train_on,
    )
    publisher.version = version
    hook.publisher, hook.parent = publisher, sealed


def continue_run(
    plan: Plan,
    loop: TrainerLoop,
    hook: PublishHook,
    cfg: TrainerConfig,
    client: ValidatorClient,
    policy_index: int | None,
    rebuild: Callable[[int], tuple[dict[str, torch.Tensor], SignedManifest]],
) -> None:
    """Bring ``loop`` (built on the base model) to the validator's version ``plan.published``."""
    if plan.start in ("checkpoint", "journal"):
        _from_checkpoint(plan, loop, hook, cfg, client, rebuild)
    elif plan.start == "chain":
        _from_chain(plan, loop, hook, cfg, policy_index, rebuild)


def _from_checkpoint(
    plan: Plan,
    loop: TrainerLoop,
    hook: PublishHook,
    cfg: TrainerConfig,
    client: ValidatorClient,
    rebuild: Callable[[int], tuple[dict[str, torch.Tensor], SignedManifest]],
) -> None:
    head, directory = plan.published, plan.directory
    assert directory is not None
    loop.resume(directory)
    at = loop.version
    if at and (hook.parent is None or manifest_digest(hook.parent) != _digest(client, at)):
        raise ConfigError(
            f"the checkpoint in {directory} (policy version {at}) is not of the chain the "
            f"validator holds: it is another run's; move {directory} away or pass another "
            "--checkpoint-dir"
        )
    if head > at:
        loop.replay_published(head)
        log(f"re-ran versions {at + 1}..{head} from the step journal in {directory}")
    if hook.publisher.version != head:  # the re-run steps were not published again
        state, sealed = rebuild(head)
        resync_publisher(hook, cfg, loop.stage, state, head, sealed)
    source = "checkpoint" if plan.start == "checkpoint" else "step journal"
    log(f"resumed at policy version {head} from the {source} in {directory}")


def _from_chain(
    plan: Plan,
    loop: TrainerLoop,
    hook: PublishHook,
    cfg: TrainerConfig,
    policy_index: int | None,
    rebuild: Callable[[int], tuple[dict[str, torch.Tensor], SignedManifest]],
) -> None:
    head, directory = plan.published, plan.directory
    if policy_index is None:
        raise ConfigError(
            f"the validator does not say where version {head} was published in its ledger "
            "(/v1/info has no policy_index); upgrade it"
        )
    state, sealed = rebuild(head)
    params = dict(loop.stage.named_parameters())
    if set(params) != set(state):
        raise ConfigError("the rebuilt policy does not name the trainer stage's parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    resync_publisher(hook, cfg, loop.stage, state, head, sealed)
    loop.version = head
    loop.buffer.cursor = policy_index + 1  # every sample trained for versions <= head is before
    log(
        f"no checkpoint {f'in {directory}' if directory else '(no checkpoint_dir)'}: rebuilt "
        f"policy version {head} from the validator's chain of signed updates; fresh optimizer "
        "moments (optimizer state is not in the chain); samples from ledger index "
        f"{policy_index + 1} on"
    )
    if directory is not None:
        loop.save(directory)


def _digest(client: ValidatorClient, version: int) -> bytes:
    return manifest_digest(client.manifest(version))
