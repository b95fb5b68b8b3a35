"""The model card (``README.md``) of a release directory.

The card's figures come from signed statements only: the eval table (base vs
release, built when the release was made) and the improvement curve (every
eval the trainer recorded in the ledger). Both tables are rendered by
``ledger.release_view``, which the verifier re-renders and looks for verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ledger.release_view import (
    CurvePoint,
    TablePair,
    curve_table_markdown,
    eval_table_markdown,
    ordered,
    sparkline,
)

PASS1 = "pass@1 (greedy)"
CURVE_PNG = "curve.png"


@dataclass(frozen=True)
class CardFacts:
    """Everything the card states besides the eval statements."""

    name: str
    version: int
    base_digest: str
    weights_digest: str
    trainer_fingerprint: str
    origin: str
    checkpoint_size: int
    checkpoint_root: str
    verdicts: int
    manifests: Sequence[tuple[int, str, int]]  # (version, manifest digest hex, ledger index)
    k: int
    eval_seed: int


def _curve_lines(curve: Sequence[CurvePoint]) -> list[str]:
    by_task: dict[str, list[tuple[int, float]]] = {}
    for _, s in ordered(curve):
        for m in s.metrics:
            if m.name == PASS1:
                by_task.setdefault(f"{s.task_id}/{s.split}", []).append((s.version, m.value))
    lines = []
    for task, points in by_task.items():
        values = [v for _, v in points]
        lines.append(
            f"- `{task}` pass@1 over versions {points[0][0]}..{points[-1][0]}: "
            f"`{sparkline(values)}` ({values[0]:.3f} → {values[-1]:.3f})"
        )
    return lines


def plot_curve(curve: Sequence[CurvePoint], path: Path) -> bool:
    """Write the pass@1 curve (with its intervals) as a PNG; False when there is nothing to plot."""
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    for _, s in ordered(curve):
        for m in s.metrics:
            if m.name == PASS1:
                series.setdefault(f"{s.task_id}/{s.split}", []).append(
                    (s.version, m.value, m.lo, m.hi)
                )
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, points in series.items():
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", label=label)
        ax.fill_between(xs, [p[2] for p in points], [p[3] for p in points], alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("policy version")
    ax.set_ylabel("pass@1 (greedy), 95% CI")
    ax.set_ylim(0, 1)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return True


def render_card(
    facts: CardFacts, table: Sequence[TablePair], curve: Sequence[CurvePoint], *, plot: bool = False
) -> str:
    """Markdown of the model card (``plot``: a ``curve.png`` sits next to it)."""
    f = facts
    reproduce = [
        f"prooftrain eval . --task {base.task_id} --split {base.split} "
        f"-n {base.problems} -k {f.k} --seed {base.seed}"
        for base, _ in table
    ]
    provenance = ["| version | manifest digest | ledger entry |", "|---|---|---|"]
    provenance += [f"| {v} | `{d}` | #{i} |" for v, d, i in f.manifests]
    parts = [
        "---",
        "library_name: transformers",
        "tags: [prooftrain, decentralized-rl, verifiable]",
        "---",
        "",
        f"# {f.name}: policy version {f.version}",
        "",
        f"Post-trained by decentralized RL from a base model (weights digest `{f.base_digest}`) "
        f"through {f.version} signed policy versions published by trainer `{f.trainer_fingerprint}`, "
        f"on samples accepted by the validator of ledger `{f.origin}` "
        f"({f.verdicts} accepted verdicts before version {f.version} was published).",
        "",
        f"Released weights digest: `{f.weights_digest}`. Ledger checkpoint: size "
        f"{f.checkpoint_size}, root `{f.checkpoint_root}`.",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
        "```",
        "",
        "## Verify",
        "",
        "Offline, from the trainer's and the validator's public keys alone: signatures, the "
        "ledger checkpoint, every inclusion proof, the manifest chain from the base model, a "
        "replay of the weight-delta chain to these exact weights, and every figure below.",
        "",
        "```",
        "prooftrain release verify . --trainer-key TRAINER.pub --validator-key VALIDATOR.pub",
        "```",
        "",
        "## Evaluation: base vs release",
        "",
        "95% intervals: Wilson for greedy pass@1, normal over problems for the rest. "
        "Reproduce with:",
        "",
        "```",
        *reproduce,
        "```",
        "",
        eval_table_markdown(f.version, table),
        "## Improvement curve (evals recorded in the ledger)",
        "",
        *([f"![pass@1 over policy versions]({CURVE_PNG})", ""] if plot else []),
        *_curve_lines(curve),
        "",
        curve_table_markdown(curve),
        "## Provenance: policy versions",
        "",
        *provenance,
        "",
        "Each version's update blobs, signed manifest and `policy_published` ledger proof are "
        "in `chain/` and `ledger/proofs/`; `release.manifest` (signed by the trainer) binds "
        "every file of this directory.",
        "",
        f"Training data: the {f.verdicts} accepted verdicts are each proven in the validator's "
        "log (`ledger/records.bin` against the leaf hashes in `ledger/leaves.bin`, which fold "
        "to the signed checkpoint); a sample drawn from the checkpoint root also carries "
        "standalone proofs (`prooftrain audit check-proof ledger/proofs/<entry>.proof --key "
        "VALIDATOR.pub`). Every eval in the curve is a trainer-signed statement in `evals/ledger/` "
        "whose digest the ledger recorded.",
        "",
    ]
    return "\n".join(parts)
