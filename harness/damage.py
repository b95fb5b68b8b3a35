"""Damage accounting: what each adversarial identity put into training, from a run's events.

An identity is one key. A contributor that comes back under a fresh key after
a ban (whitewashing) has several; each key's first ``Reputation`` event is its
registration. For every identity of an adversarial contributor (any strategy
but ``honest``):

- ``samples_trained``: rows of optimizer batches it signed (``TrainStep.samples_by``);
- ``weight_share``: its share of all the aggregation weight the run spent, the
  mean over the run's steps of its coefficient share in each step
  (``TrainStep.weight_share``; 0 in steps it was absent from), and likewise
  ``update_share`` (coefficient times gradient norm);
- ``groups`` and ``accepted``: its verdicts, and those that accepted the group;
- ``groups_before_ban``: its verdicts up to the ban (the one that banned it
  included), and ``time_to_ban_s``: simulated seconds from its registration
  to the ban; both None while it is not banned.

Per run, ``cheater_fraction`` is the fraction of trained samples signed by
adversarial identities: an upper bound on the forged samples trained, since an
adaptive adversary's samples are mostly honest work.

Pure: functions of ``harness.analysis.RunData``. Events written before keys
were recorded give no identities, and the figures say "n/a".
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.analysis import RunData
from harness.events import HONEST, TrainStep


@dataclass(frozen=True)
class IdentityDamage:
    """One adversarial key's account (see the module docstring)."""

    contributor: str
    strategy: str
    key: str
    registered_t: float
    samples_trained: int
    weight_share: float
    update_share: float
    groups: int
    accepted: int
    groups_before_ban: int | None
    time_to_ban_s: float | None


@dataclass(frozen=True)
class Damage:
    """A run's damage account: every adversarial identity, and the run's totals."""

    run: str
    identities: list[IdentityDamage]
    samples_trained: int
    """Every trained sample of the run, honest ones included."""
    steps: int

    @property
    def cheater_samples(self) -> int:
        return sum(i.samples_trained for i in self.identities)

    @property
    def cheater_fraction(self) -> float | None:
        """Trained samples from adversarial identities over all trained samples (None when
        nothing was trained)."""
        return self.cheater_samples / self.samples_trained if self.samples_trained else None

    @property
    def cheater_weight_share(self) -> float:
        return sum(i.weight_share for i in self.identities)

    @property
    def cheater_update_share(self) -> float:
        return sum(i.update_share for i in self.identities)

    def of(self, strategy: str) -> list[IdentityDamage]:
        """The identities of contributors running ``strategy``."""
        return [i for i in self.identities if i.strategy == strategy]


def damage(run: RunData) -> Damage:
    """The damage account of ``run`` (see the module docstring)."""
    who = run.strategies()
    first: dict[str, tuple[str, float]] = {}  # key -> (contributor, registration time)
    ban_t: dict[str, float] = {}
    for r in run.reputation:
        if not r.key:
            continue
        first.setdefault(r.key, (r.contributor, r.t))
        if r.banned and r.key not in ban_t:
            ban_t[r.key] = r.t
    for v in run.verdicts:  # a key seen only in verdicts (no registration event)
        if v.key:
            first.setdefault(v.key, (v.contributor, v.t))
    steps = [s for s in run.steps if s.samples_by or s.weight_share]
    n_steps = len(steps)
    identities = []
    for key, (contributor, t0) in first.items():
        strategy = who.get(contributor, HONEST)
        if strategy == HONEST:
            continue
        mine = [v for v in run.verdicts if v.key == key]
        banned = ban_t.get(key)
        identities.append(
            IdentityDamage(
                contributor=contributor,
                strategy=strategy,
                key=key,
                registered_t=t0,
                samples_trained=sum(s.samples_by.get(key, 0) for s in steps),
                weight_share=_mean_share(steps, key, "weight_share", n_steps),
                update_share=_mean_share(steps, key, "update_share", n_steps),
                groups=len(mine),
                accepted=sum(v.accepted for v in mine),
                groups_before_ban=None if banned is None else sum(v.t <= banned for v in mine),
                time_to_ban_s=None if banned is None else banned - t0,
            )
        )
    identities.sort(key=lambda i: (i.contributor, i.registered_t))
    total = sum(s.samples for s in run.steps) if n_steps else 0
    return Damage(run.name, identities, total, n_steps)


def _mean_share(steps: list[TrainStep], key: str, field: str, n: int) -> float:
    return sum(getattr(s, field).get(key, 0.0) for s in steps) / n if n else 0.0


def _opt(x: float | int | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def damage_lines(run: RunData) -> list[str]:
    """The report's damage section for ``run``: a table of adversarial identities and the
    fraction of trained samples they signed."""
    d = damage(run)
    head = [f"## Damage by adversarial identity (`{run.name}` run)", ""]
    if not d.identities:
        return [*head, "n/a: no adversarial identity in this run's events.", ""]
    rows = [
        "| contributor | strategy | key | samples trained | weight share | update share "
        "| groups (accepted) | groups before ban | time to ban (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i in d.identities:
        rows.append(
            f"| {i.contributor} | {i.strategy} | `{i.key}` | {i.samples_trained} "
            f"| {i.weight_share:.3f} | {i.update_share:.3f} | {i.groups} ({i.accepted}) "
            f"| {_opt(i.groups_before_ban, 'd')} | {_opt(i.time_to_ban_s, '.1f')} |"
        )
    frac = d.cheater_fraction
    return [
        *head,
        "weight share: the identity's share of all the aggregation weight over the run's "
        f"{d.steps} steps (its coefficient over their sum, averaged over steps); update share: "
        "coefficient times gradient norm, likewise.",
        "",
        *rows,
        "",
        f"trained samples from adversarial identities: {d.cheater_samples} of "
        f"{d.samples_trained} ({_opt(None if frac is None else 100 * frac, '.1f')}%); their "
        f"weight share {d.cheater_weight_share:.3f}, update share {d.cheater_update_share:.3f}.",
        "",
    ]
