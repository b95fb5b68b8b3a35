"""Task generators, train/held-out splits and prompt references.

A split is a pure function of a problem's *content* (its split key), not of
the seed or the position it was drawn at: a problem is held-out iff
``sha256(SPLIT_DOMAIN || key)`` falls in the held-out bucket. So no train
problem can ever equal a held-out one, whatever seeds either side used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

from rewards.base import Problem
from rewards.errors import TaskError, UnknownTaskError

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
SPLIT_DOMAIN = b"prooftrain/split/v1\x00"
HELDOUT_PER_MILLE = 100  # 10% of the problem space is held out

_GENERATORS: dict[str, TaskGenerator] = {}


def split_of(key: str) -> Split:
    """The split a problem with this content key belongs to (deterministic, seed-free)."""
    h = int.from_bytes(hashlib.sha256(SPLIT_DOMAIN + key.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_PER_MILLE else "train"


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise TaskError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    return split  # type: ignore[return-value]


@runtime_checkable
class TaskGenerator(Protocol):
    """Seeded synthetic problems. ``generate`` is deterministic in its arguments."""

    name: str

    def generate(self, split: Split, n: int, seed: int = 0) -> list[Problem]:
        """``n`` distinct problems of ``split``; the same arguments give the same list."""
        ...

    def reference_completion(self, problem: Problem) -> str:
        """A completion that scores 1.0 (supervised data for the base policy)."""
        ...


def register_task(gen: TaskGenerator) -> TaskGenerator:
    if gen.name in _GENERATORS:
        raise TaskError(f"a task generator named {gen.name!r} is already registered")
    _GENERATORS[gen.name] = gen
    return gen


def get_task(name: str) -> TaskGenerator:
    import rewards.tasks.arithmetic  # noqa: F401, PLC0415 - registers built-ins
    import rewards.tasks.countdown  # noqa: F401, PLC0415
    import rewards.tasks.gsm8k  # noqa: F401, PLC0415
    import rewards.tasks.reverse_text  # noqa: F401, PLC0415

    try:
        return _GENERATORS[name]
    except KeyError:
        known = ", ".join(sorted(_GENERATORS))
        raise UnknownTaskError(f"no task generator {name!r} (known: {known})") from None


def generate(task: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems of ``task`` from ``split``; see :class:`TaskGenerator`."""
    if n < 0:
        raise TaskError("n must be >= 0")
    return get_task(task).generate(check_split(split), n, seed)


_T = TypeVar("_T")


def draw_distinct(
    sample_key: Iterable[tuple[str, _T]], split: Split, n: int, max_tries: int
) -> list[tuple[str, _T]]:
    """Take distinct items whose split key lands in ``split`` from an endless sampler."""
    out: list[tuple[str, _T]] = []
    seen: set[str] = set()
    for tries, (key, item) in enumerate(sample_key):
        if len(out) >= n:
            break
        if tries >= max_tries:
            raise TaskError(f"could not draw {n} distinct {split} problems in {max_tries} tries")
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        out.append((key, item))
    return out


@dataclass(frozen=True)
class PromptRef:
    """What a validator assigns and a contributor echoes: validator → contributor → validator."""

    id: str
    digest: str  # Problem.prompt_digest, hex


class PromptMismatchError(TaskError):
    """A prompt reference names an unknown problem or a different prompt."""


def ref(problem: Problem) -> PromptRef:
    return PromptRef(id=problem.id, digest=problem.prompt_digest)


class ProblemIndex:
    """Problems addressed by id; :meth:`resolve` checks the digest a contributor answered."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self._by_id: dict[str, Problem] = {}
        for p in problems:
            if p.id in self._by_id:
                raise TaskError(f"duplicate problem id {p.id!r}")
            self._by_id[p.id] = p

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, problem_id: object) -> bool:
        return problem_id in self._by_id

    def get(self, problem_id: str) -> Problem:
        try:
            return self._by_id[problem_id]
        except KeyError:
            raise PromptMismatchError(f"unknown problem id {problem_id!r}") from None

    def resolve(self, prompt_ref: PromptRef) -> Problem:
        """The problem ``prompt_ref`` names, if its digest matches the stored prompt."""
        problem = self.get(prompt_ref.id)
        if problem.prompt_digest != prompt_ref.digest:
            raise PromptMismatchError(
                f"prompt digest mismatch for {prompt_ref.id!r}: "
                f"expected {problem.prompt_digest[:16]}, got {prompt_ref.digest[:16]}"
            )
        return problem
