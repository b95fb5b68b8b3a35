"""What the Gram sketch costs robust aggregation: centered clipping on a sketched Gram matrix
against the exact one, with contributors who lie.

``aggregator.gram_sketch = w`` lets the trainer estimate its contributors' Gram matrix
from a w x w sketch of each weight matrix's per-contributor gradient
(``trainer.groupgrad.GroupGradients.gram_sketch``) instead of forming every gradient.
Centered clipping then clips on estimated distances. This bench measures what that does
to the aggregate when some contributors send whatever they like.

One batch (``--contributors`` x ``--rows`` completions, ``--prompt`` + ``--completion``
tokens, as ``bench/contributor_grads.py``) gives every contributor's exact gradient
(``trainer.rl.RLStep``'s one pass). The last quarter of the contributors (``--liars``)
then replace theirs:

  sign_flip  the honest mean's direction reversed, at 10 x the largest honest norm
  spike      a rank-one matrix in the largest weight matrix, at 10 x the largest honest norm:
             the shape whose norm a matrix sketch estimates worst
  alie       the honest mean less one coordinate-wise standard deviation ("a little is
             enough"), every liar the same: close enough to pass a distance test
  none       nobody lies (what the sketch costs honest training)

For each, the default aggregator (centered clipping, the trainer's ``tau`` and ``iters``)
runs on the exact Gram matrix and on ``--draws`` fresh sketches of width
``--sketch-width``. A sketch here is ``A^T R_c B`` computed from the gradient rows, with
the Gaussian ``A`` and ``B`` of ``GroupGradients.gram_sketch`` (one ``B`` shared by the
projections that read one input: query, key and value; gate and up); in the trainer the
same product comes from activations and output gradients, never forming ``R_c``.

Prints progress on stderr and one JSON object on the last line of stdout. Per attack:

  mean_shift           no defence: ||mean of all - mean of the honest|| / ||mean of the
                       honest|| (the honest: those who do not lie; for none, everyone)
  exact_shift          centered clipping on the exact Gram matrix: ||clip of all - clip
                       of the honest|| / ||clip of the honest||, both exact
  sketch_shift         the same with the clip of all on a sketched Gram matrix, median
                       and max over the draws
  sketch_vs_exact      ||sketched clip of all - exact clip of all|| / ||exact clip of
                       all||, median and max
  liar_norm_ratio      a liar's gradient norm over the largest honest norm

Also ``honest_norms`` (each honest contributor's gradient norm), ``tau`` and ``iters``.

    python bench/sketch_robustness.py [--model-dir DIR | --width 384] [--draws 10]
                                      [--sketch-width 64] [--liars 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from rollout.loading import model_dir_arg  # noqa: E402
from trainer.groupgrad import _products  # noqa: E402 - the exact path's Gram products
from verify.aggregate import CenteredClip  # noqa: E402

ATTACKS = ("none", "sign_flip", "spike", "alie")
SHARED_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
}
"""Projections that read one input, so their sketches share one right-hand matrix ``B``."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Rows:
    """An aggregator that keeps the rows it is given and returns their mean."""

    name = "keep-rows"

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def __call__(self, grads: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        self.rows = grads  # the step's own buffer, kept from step to step
        return grads.mean(0)


def contributor_rows(model_dir: Path, batch) -> tuple[torch.Tensor, list[tuple[str, torch.Size]]]:  # type: ignore[no-untyped-def]
    """Every contributor's exact gradient (n, d) float32 from ``RLStep``'s one pass, and the
    (name, shape) of each parameter in the rows' layout."""
    from bench.contributor_grads import make_step

    step = make_step(model_dir, 0.0, "one_pass")
    step.via_gram = False  # hold the rows and hand them to the aggregator
    keeper = _Rows()
    step.aggregator = keeper
    step(batch)
    assert keeper.rows is not None
    stage = step.runner.stage
    layout = [(n, p.shape) for n, p in stage.named_parameters() if p.requires_grad]
    return keeper.rows, layout


def _input_key(name: str) -> str:
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{SHARED_INPUT[leaf]}" if leaf in SHARED_INPUT else name


def sketch_gram(
    rows: torch.Tensor, layout: list[tuple[str, torch.Size]], width: int, gen: torch.Generator
) -> torch.Tensor:
    """``GroupGradients.gram_sketch``'s estimate of ``rows @ rows.T`` (n, n) float64, from
    the rows: ``A^T R_c B`` per weight matrix (Gaussian, variance 1/width), vectors exact."""
    n = rows.shape[0]
    scale = width**-0.5
    parts: list[torch.Tensor] = []
    rights: dict[tuple[str, int], torch.Tensor] = {}
    start = 0
    for name, shape in layout:
        numel = shape.numel()
        block = rows[:, start : start + numel]
        start += numel
        if len(shape) < 2:
            parts.append(block)
            continue
        left = torch.randn((shape[0], width), generator=gen).mul_(scale)
        key = (_input_key(name), shape[1])
        right = rights.get(key)
        if right is None:
            right = rights[key] = torch.randn((shape[1], width), generator=gen).mul_(scale)
        sketched = left.t() @ (block.view(n, shape[0], shape[1]) @ right)  # (n, w, w)
        parts.append(sketched.reshape(n, -1))
    flat = torch.cat(parts, dim=1).double()
    return flat @ flat.T


@contextlib.contextmanager
def lying(
    rows: torch.Tensor, liars: int, attack: str, layout: list[tuple[str, torch.Size]], seed: int
) -> Iterator[None]:
    """The last ``liars`` rows of ``rows`` replaced by ``attack``'s, in place (a copy of
    SmolLM2-135M's rows would take 4.3 GB more), and put back afterwards."""
    if attack == "none":
        yield
        return
    kept = rows[len(rows) - liars :].clone()
    rows[len(rows) - liars :] = _lie(rows[: len(rows) - liars], attack, layout, seed)
    try:
        yield
    finally:
        rows[len(rows) - liars :] = kept


def _lie(
    honest: torch.Tensor, attack: str, layout: list[tuple[str, torch.Size]], seed: int
) -> torch.Tensor:
    """What every liar sends under ``attack``, given the honest rows."""
    mean = honest.mean(0)
    loud = 10.0 * float(honest.norm(dim=1).max())
    if attack == "sign_flip":
        return -mean * (loud / float(mean.norm()))
    if attack == "alie":
        return mean - honest.std(0)
    if attack != "spike":
        raise ValueError(f"unknown attack {attack!r}")
    lie = torch.zeros_like(mean)
    start, biggest = 0, (0, 0, torch.Size())
    for _, shape in layout:
        if len(shape) == 2 and shape.numel() > biggest[1]:
            biggest = (start, shape.numel(), shape)
        start += shape.numel()
    at, numel, shape = biggest
    gen = torch.Generator().manual_seed(seed)
    spike = torch.outer(torch.randn(shape[0], generator=gen), torch.randn(shape[1], generator=gen))
    lie[at : at + numel] = (spike * (loud / float(spike.norm()))).flatten()
    return lie


def _combined(alpha: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``alpha @ x`` (d,) float64, from float32 rows."""
    return (alpha.to(torch.float32) @ x).double()


def _shift(agg: torch.Tensor, target: torch.Tensor) -> float:
    return float((agg - target).norm() / target.norm())


def measure(
    rows: torch.Tensor,
    layout: list[tuple[str, torch.Size]],
    *,
    liars: int,
    width: int,
    draws: int,
    tau: float,
    iters: int,
    seed: int = 0,
) -> dict:
    """Per attack: the shifts and differences the module docstring lists."""
    clip = CenteredClip(tau=tau, iters=iters)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict] = {}
    honest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # h -> (mean, clip) of rows[:h]
    for attack in ATTACKS:
        h = len(rows) if attack == "none" else len(rows) - liars
        if h not in honest:  # the liars' attacks share one honest reference
            honest[h] = (
                rows[:h].mean(0).double(),
                _combined(clip.coefficients(_products(rows[:h])), rows[:h]),
            )
        honest_mean, honest_clip = honest[h]
        with lying(rows, liars, attack, layout, seed):
            exact = _combined(clip.coefficients(_products(rows)), rows)
            shifts, apart = [], []
            for _ in range(draws):  # one aggregate at a time: each is 1 GB at 135M
                sketched = _combined(clip.coefficients(sketch_gram(rows, layout, width, gen)), rows)
                shifts.append(_shift(sketched, honest_clip))
                apart.append(_shift(sketched, exact))
            out[attack] = {
                "mean_shift": round(_shift(rows.mean(0).double(), honest_mean), 4),
                "exact_shift": round(_shift(exact, honest_clip), 4),
                "sketch_shift": _spread(shifts),
                "sketch_vs_exact": _spread(apart),
                "liar_norm_ratio": None
                if attack == "none"
                else round(float(rows[-1].norm() / rows[:h].norm(dim=1).max()), 3),
            }
        say(f"{attack}: {json.dumps(out[attack])}")
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contributors", type=int, default=8)
    parser.add_argument("--liars", type=int, help="contributors who lie (default: a quarter)")
    parser.add_argument("--rows", type=int, default=8, help="completions per contributor")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=12, help="completion tokens")
    parser.add_argument("--sketch-width", type=int, default=64, help="the sketch's width w")
    parser.add_argument("--draws", type=int, default=10, help="fresh sketches per attack")
    parser.add_argument(
        "--model-dir", type=model_dir_arg, help="a local Hugging Face model directory"
    )
    parser.add_argument(
        "--width", type=int, default=384, help="else a random-init Llama of this hidden size"
    )
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of --width's model")
    args = parser.parse_args()
    liars = args.contributors // 4 if args.liars is None else args.liars
    if not 0 < liars < args.contributors / 2:
        parser.error("--liars must be at least 1 and fewer than half the contributors")
    if min(args.rows, args.prompt, args.completion, args.sketch_width, args.draws) < 1:
        parser.error("every count must be >= 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="sketch-robustness-") as tmp:
        emit(run(args, liars, Path(tmp)))


def run(args: argparse.Namespace, liars: int, tmp: Path) -> dict:
    from bench.contributor_grads import make_batch
    from bench.trust_overhead import build_wide_model
    from trainer.allocator import retain_freed_memory
    from verify.aggregate import get_aggregator

    retain_freed_memory()
    if args.model_dir:
        model_dir, model = Path(args.model_dir), str(args.model_dir)
    else:
        model_dir = build_wide_model(args.width, args.layers, tmp / "model")
        model = f"random-init Llama, hidden {args.width}, {args.layers} layers"
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    say(f"{model}: {args.contributors} contributors x {args.rows} rows, one pass")
    batch = make_batch(args.contributors, args.rows, args.prompt, args.completion, vocab)
    rows, layout = contributor_rows(model_dir, batch)
    default = get_aggregator("centered-clip")  # the trainer's default aggregator
    tau, iters = float(default.tau), int(default.iters)  # type: ignore[attr-defined]
    attacks = measure(
        rows, layout, liars=liars, width=args.sketch_width, draws=args.draws, tau=tau, iters=iters
    )
    honest = rows[: len(rows) - liars].norm(dim=1)
    return {
        "bench": "sketch_robustness",
        "model": model,
        "baseline": "centered clipping on the exact Gram matrix of the same rows",
        "contributors": args.contributors,
        "liars": liars,
        "sketch_width": args.sketch_width,
        "draws": args.draws,
        "tau": tau,
        "iters": iters,
        "honest_norms": [round(float(v), 4) for v in honest],
        "honest_mean_norm": round(float(rows[: len(rows) - liars].mean(0).norm()), 4),
        "attacks": attacks,
    }


if __name__ == "__main__":
    main()
