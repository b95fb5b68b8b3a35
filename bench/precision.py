"""Honest noise against cheating at a declared precision: the divergence test's figures.

For each model (the demo policy; SmolLM2-135M unless ``--quick``), honest contributors
generate through the project's backend and plain ``model.generate``, in float32
and in bfloat16, and attacks generate while declaring bfloat16 (each forges what an audited
rollout would carry). Every rollout is spot-checked by the validator's float32 recomputation
(per-token bounds, the sampler replayed on every token) and its evidence folded into its
contributor's divergence detector (``verify.divergence``), under two tables: the built-in one
(``verify.spotcheck.DEFAULT_TOLERANCES``) and a calibration of the model
(``node.validator.calibration.calibrate``, as ``prooftrain calibrate`` runs it).

* honest: audited tokens, hard-bound rejections (slashes), detector alarms, and the largest
  detector log-wealth reached against the threshold.
* attacks: ``int8`` and ``int4`` (group-32) weight quantisation, ``skip-layers`` (2 of
  SmolLM2's 30 layers, 1 of the demo's 2), ``weight-noise-1e-2`` (relative Gaussian noise),
  ``round-logprobs-0.01`` (honest tokens, committed logprobs rounded), ``temperature-0.95``
  and ``-1.05`` and ``top-k-50`` (sampled so, logprobs committed under the claimed
  unfiltered temperature 1), and ``steer-slack`` (at every token, the most probable token
  within the declared precision's replay slack of the keyed uniform). Each trial feeds one
  shuffled order of the attack's rollouts to a fresh detector; the audited tokens until the
  first rejection (hard bound or alarm) give the median and 95th percentile over trials.

Prints progress on stderr and one JSON object on its last line.

    python bench/precision.py [--quick] [--models demo,smollm2] [--prompts N]
                              [--honest-prompts N] [--trials 20]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from node.validator.calibration import calibrate, layout_oracles, unassigned_fields  # noqa: E402
from node.validator.policy import HFTextCodec  # noqa: E402
from node.validator.spot import _check  # noqa: E402
from rewards.tasks import generate  # noqa: E402
from rollout.backends import (  # noqa: E402
    GenerateBackend,
    GeneratedCompletion,
    GenerationRequest,
    TransformersBackend,
)
from verify.commitment import n_chunks  # noqa: E402
from verify.divergence import Detector  # noqa: E402
from verify.envelope import build_envelope, verify_envelope  # noqa: E402
from verify.errors import SpotCheckError  # noqa: E402
from verify.icdf import _blocks, _within  # noqa: E402
from verify.keys import SigningKey  # noqa: E402
from verify.samplers import sampler_named  # noqa: E402
from verify.spotcheck import DEFAULT_TOLERANCES, Tolerances  # noqa: E402

GROUP = 4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- cheaper or different models ----------------------------------------------------------


@torch.no_grad()
def quantised(model: torch.nn.Module, bits: int, group: int = 0) -> torch.nn.Module:
    """Every linear layer's weights rounded to ``bits`` (symmetric; one scale per output row,
    or per ``group`` consecutive weights)."""
    m = copy.deepcopy(model).eval()
    q = 2 ** (bits - 1) - 1
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            g = w.reshape(-1, group) if group else w
            s = g.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / q
            w.copy_(((g / s).round().clamp(-q, q) * s).reshape(w.shape))
    return m


@torch.no_grad()
def noisy(model: torch.nn.Module, relative: float, seed: int = 1) -> torch.nn.Module:
    """Every weight times ``1 + relative * N(0, 1)``."""
    m = copy.deepcopy(model).eval()
    gen = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.mul_(1 + relative * torch.randn(p.shape, generator=gen))
    return m


def skipping(model: torch.nn.Module, count: int) -> torch.nn.Module:
    """``count`` decoder layers from the middle removed."""
    m: Any = copy.deepcopy(model).eval()
    layers = list(m.model.layers)
    mid = len(layers) // 2
    kept = layers[:mid] + layers[mid + count :]
    m.model.layers = torch.nn.ModuleList(kept)
    m.config.num_hidden_layers = len(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    return m


class ForgingBackend(TransformersBackend):
    """Draws each token from another distribution than the claimed one (``reshape`` of the
    claimed processed logprobs, or steering within ``steer_slack``) and commits the token's
    logprob under the claim, as a cheater that knows the spot check would."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: str,
        reshape: Callable[[torch.Tensor], torch.Tensor] | None = None,
        steer_slack: float = 0.0,
    ) -> None:
        super().__init__(model, dtype=dtype)
        self.reshape, self.steer_slack = reshape, steer_slack

    def _sample(self, lp, rows, t, done, temperature):  # type: ignore[no-untyped-def,override]
        if self.reshape is not None:
            return super()._sample(self.reshape(lp), rows, t, done, temperature)
        sampler = sampler_named(rows[0][0].sampler)
        u = sampler.randomness([(r.sampler_key, r.nonce, r.seed, g, [t]) for r, g in rows], 0)
        return steer(lp, u, self.steer_slack)


def steer(lp: torch.Tensor, uniforms: torch.Tensor, slack: float) -> torch.Tensor:
    """For each row, the most probable token whose inverse-CDF interval lies within ``slack``
    (probability mass) of the keyed uniform: every choice the replay slack leaves."""
    p, sums = _blocks(lp)
    n, nb, width = p.shape
    c = torch.cat([_within(p, sums, torch.full((n,), b)) for b in range(nb)], dim=1)
    c = c[:, : lp.shape[-1]]  # (n, V) running sums C_j
    total = sums[:, -1:]
    target = uniforms.to(torch.float64)[:, None] * total
    lo = c - torch.exp(lp).to(torch.float64)
    window = (c > target - slack * total) & (lo < target + slack * total) & torch.isfinite(lp)
    return torch.where(window, lp, torch.full_like(lp, -torch.inf)).argmax(dim=-1)


def own(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval()


def tempered(temperature: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda lp: torch.log_softmax(lp / temperature, dim=-1)


def top_k(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def cut(lp: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(lp, min(k, lp.shape[-1]), dim=-1).values[:, -1:]
        return torch.log_softmax(lp.masked_fill(lp < kth, -torch.inf), dim=-1)

    return cut


# -- rollouts and audits ------------------------------------------------------------------


class Pool:
    """Honest or forged rollouts of one contributor, with the prompts they answer."""

    def __init__(self, name: str, precision: str) -> None:
        self.name, self.precision = name, precision
        self.items: list[tuple[object, list[int]]] = []  # (verified rollout, prompt ids)


def make_requests(
    prompts: Sequence[list[int]], max_tokens: int, stops: Sequence[int], seed: int
) -> tuple[SigningKey, list[GenerationRequest]]:
    rng = np.random.default_rng(seed)
    key = SigningKey.from_seed(rng.bytes(32))
    reqs = [
        GenerationRequest(
            tuple(p),
            GROUP,
            1.0,
            0,
            1.0,
            max_tokens,
            key.public.raw,
            rng.bytes(32),
            seed * 100_003 + i,
            tuple(stops),
        )
        for i, p in enumerate(prompts)
    ]
    return key, reqs


def rollouts(
    name: str,
    backend: TransformersBackend,
    precision: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    stops: Sequence[int],
    seed: int,
    forge_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Pool:
    key, reqs = make_requests(prompts, max_tokens, stops, seed)
    pool = Pool(name, precision)
    t0 = time.perf_counter()
    for req in reqs:
        for c in backend.generate(req):
            pool.items.append(
                (envelope(key, req, c, precision, forge_logprobs), list(req.prompt_ids))
            )
    tokens = sum(r.header.token_count for r, _ in pool.items)  # type: ignore[attr-defined]
    log(f"  {name}: {len(pool.items)} rollouts, {tokens} tokens, {time.perf_counter() - t0:.0f} s")
    return pool


def envelope(key, req, c: GeneratedCompletion, precision: str, forge=None):  # type: ignore[no-untyped-def]
    fields = unassigned_fields(req, c.group_index, precision)
    lps = np.asarray(c.logprobs) if forge is None else forge(np.asarray(c.logprobs))
    return verify_envelope(build_envelope(key, fields, c.token_ids, lps.astype(np.float32)))


def audit(pool: Pool, oracle, tables: dict[str, Tolerances]) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Per table, each rollout's ``(tokens, rejected_by_hard_bound, increments | None)``."""
    logits = []
    for start in range(0, len(pool.items), 16):
        part = pool.items[start : start + 16]
        logits += oracle.logits_batch(
            0,
            [(p + r.token_ids.tolist(), len(p)) for r, p in part],  # type: ignore[attr-defined]
        )
    out: dict[str, list] = {}
    for table, tolerances in tables.items():
        tol = tolerances.of(pool.precision)
        rows: list[tuple[int, bool, np.ndarray | None]] = []
        for (r, _), lg in zip(pool.items, logits, strict=True):
            every = list(range(n_chunks(r.header.token_count, r.header.chunk_size)))  # type: ignore[attr-defined]
            try:
                recomputed, _, gaps = _check(r, np.asarray(lg), every, tol)  # type: ignore[arg-type]
            except SpotCheckError:
                rows.append((r.header.token_count, True, None))  # type: ignore[attr-defined]
                continue
            ev = tol.divergence.evidence(r.logprobs, recomputed, gaps)  # type: ignore[union-attr,attr-defined]
            rows.append((ev.tokens, False, ev.increments))
        out[table] = rows
    return out


def run_stream(rows: list, threshold: float) -> tuple[int | None, float, int]:
    """Feed rows to a fresh detector: (audited tokens at the first rejection or None, peak
    log-wealth, hard-bound rejections)."""
    det, peak, hard = Detector(), 0.0, 0
    for tokens, rejected, inc in rows:
        if rejected:
            hard += 1
            return det.tokens + tokens, peak, hard
        alarm = det.update(inc, tokens, threshold)
        peak = max(peak, det.peak)
        if alarm is not None:
            return det.tokens, peak, hard
    return None, peak, hard


SIZES = {
    "demo": {"prompts": 600, "honest_prompts": 3000, "cal_prompts": 160, "max_tokens": 16},
    "demo-quick": {"prompts": 60, "honest_prompts": 150, "cal_prompts": 40, "max_tokens": 16},
    "smollm2": {"prompts": 30, "honest_prompts": 84, "cal_prompts": 40, "max_tokens": 32},
}
"""Prompts (G = 4 completions each) per attack, per honest stream and for the calibration."""


def model_figures(args: argparse.Namespace, label: str, model_dir: Path, size: dict) -> dict:
    codec = HFTextCodec(model_dir)
    stops = [codec.eos_token_id] if codec.eos_token_id is not None else []
    n_cal, n_attack, n_honest = size["cal_prompts"], size["prompts"], size["honest_prompts"]
    problems = generate("arithmetic", "train", n_cal + max(n_attack, n_honest), seed=args.seed)
    encoded = [codec.encode(p.prompt) for p in problems]
    cal_prompts, rest = encoded[:n_cal], encoded[n_cal:]
    prompts, honest_prompts = rest[:n_attack], rest[:n_honest]
    max_tokens = size["max_tokens"]
    log(f"{label}: calibrating on {len(cal_prompts)} prompts")
    cal = calibrate(
        model_dir,
        cal_prompts,
        stop_token_ids=stops,
        max_tokens=max_tokens,
        batch_sizes=(1, 8),
        min_tokens=100 if args.quick else 2_000,
        seed=args.seed + 7,
    )
    tables = {"built_in": DEFAULT_TOLERANCES, "calibrated": cal.tolerances}
    oracle = layout_oracles(model_dir, "float32")["unpacked"]
    base = TransformersBackend(model_dir, dtype="float32").model
    n_layers = len(base.model.layers)  # type: ignore[union-attr,arg-type]
    skip = 2 if n_layers >= 8 else 1
    bf16 = "bfloat16"
    slack = {t: tables[t].of(bf16).cdf_slack for t in tables}
    # A backend converts the module it is given in place: each gets its own copy.
    honest_specs = [
        (
            "float32/transformers",
            lambda: TransformersBackend(own(base), dtype="float32"),
            "float32",
        ),
        ("bfloat16/transformers", lambda: TransformersBackend(own(base), dtype=bf16), bf16),
        (
            "bfloat16/transformers-generate",
            lambda: GenerateBackend(own(base), dtype=bf16),
            bf16,
        ),
    ]
    attack_specs: list[tuple[str, Callable[[], TransformersBackend], object]] = [
        ("int8", lambda: TransformersBackend(quantised(base, 8), dtype=bf16), None),
        ("int4", lambda: TransformersBackend(quantised(base, 4, 32), dtype=bf16), None),
        (
            f"skip-{skip}-of-{n_layers}-layers",
            lambda: TransformersBackend(skipping(base, skip), dtype=bf16),
            None,
        ),
        ("weight-noise-1e-2", lambda: TransformersBackend(noisy(base, 1e-2), dtype=bf16), None),
        (
            "round-logprobs-0.01",
            lambda: TransformersBackend(own(base), dtype=bf16),
            lambda lp: np.round(lp, 2),
        ),
        (
            "temperature-0.95",
            lambda: ForgingBackend(own(base), dtype=bf16, reshape=tempered(0.95)),
            None,
        ),
        (
            "temperature-1.05",
            lambda: ForgingBackend(own(base), dtype=bf16, reshape=tempered(1.05)),
            None,
        ),
        ("top-k-50", lambda: ForgingBackend(own(base), dtype=bf16, reshape=top_k(50)), None),
    ]
    honest: dict = {"tokens": 0, "bfloat16_tokens": 0, "slashes": 0, "alarms": 0, "by_stream": {}}
    for i, (name, make_honest, precision) in enumerate(honest_specs):
        pool = rollouts(
            name, make_honest(), precision, honest_prompts, max_tokens, stops, args.seed + i
        )
        audited = audit(pool, oracle, tables)
        tokens = sum(r.header.token_count for r, _ in pool.items)  # type: ignore[attr-defined]
        honest["tokens"] += tokens  # each audited once, judged under both tables
        honest["bfloat16_tokens"] += tokens if precision == bf16 else 0
        for table, rows in audited.items():
            thr = tables[table].of(precision).divergence.threshold  # type: ignore[union-attr]
            at, peak, hard = run_stream(rows, thr)
            honest["by_stream"][f"{name}@{table}"] = {
                "tokens": tokens,
                "slashes": sum(1 for r in rows if r[1]),
                "alarm_at_tokens": at if not hard else None,
                "peak_log_wealth": round(peak, 2),
                "threshold": round(thr, 2),
            }
            honest["slashes"] += sum(1 for r in rows if r[1])
            honest["alarms"] += int(at is not None and not hard)
    attacks: dict = {}
    rng = np.random.default_rng(args.seed)
    for i, (name, make, forge) in enumerate(attack_specs):
        pool = rollouts(name, make(), bf16, prompts, max_tokens, stops, 1000 + i, forge)  # type: ignore[arg-type]
        attacks[name] = trials(audit(pool, oracle, tables), tables, bf16, args.trials, rng)
    attacks["steer-slack"] = {}
    for table in tables:  # each table's own slack
        backend = ForgingBackend(own(base), dtype=bf16, steer_slack=slack[table])
        name = f"steer-slack@{table}"
        pool = rollouts(name, backend, bf16, prompts, max_tokens, stops, 2000)
        audited = audit(pool, oracle, {table: tables[table]})
        attacks["steer-slack"].update(trials(audited, tables, bf16, args.trials, rng))
    return {
        "model": str(model_dir),
        "calibration": {
            d: {
                k: v[k]
                for k in (
                    "logprob_scale",
                    "logprob_null",
                    "replay_scale",
                    "replay_null",
                    "observed_token_mean_abs",
                    "min_setting_tokens",
                )
            }
            for d, v in cal.by_precision().items()
        },
        "honest": honest,
        "attacks": attacks,
    }


def trials(
    audited: dict[str, list], tables: dict[str, Tolerances], precision: str, n: int, rng
) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    for table, rows in audited.items():
        thr = tables[table].of(precision).divergence.threshold  # type: ignore[union-attr]
        found = []
        for _ in range(n):
            order = rng.permutation(len(rows))
            found.append(run_stream([rows[j] for j in order], thr)[0])
        hits = [f for f in found if f is not None]
        out[table] = {
            "tokens": sum(r[0] for r in rows),
            "hard_rejections": sum(1 for r in rows if r[1]),
            "detected_trials": len(hits),
            "trials": n,
            "tokens_to_detect_median": int(np.median(hits)) if hits else None,
            "tokens_to_detect_p95": int(np.quantile(hits, 0.95)) if len(hits) == n else None,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="demo model only, few prompts")
    ap.add_argument("--models", default="demo,smollm2", help="comma-separated: demo, smollm2")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per attack (G = 4)")
    ap.add_argument("--honest-prompts", type=int, default=0, help="prompts per honest stream")
    ap.add_argument("--trials", type=int, default=20, help="shuffled orders per attack")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    models = ["demo"] if args.quick else args.models.split(",")
    out: dict = {"bench": "precision", "quick": args.quick, "models": {}}
    t0 = time.perf_counter()
    for m in models:
        size = dict(SIZES["demo-quick" if args.quick else m])
        size["prompts"] = args.prompts or size["prompts"]
        size["honest_prompts"] = args.honest_prompts or size["honest_prompts"]
        if m == "demo":
            from trainer.base_model import ensure_base_model

            model_dir = ensure_base_model("arithmetic")
        else:
            from rollout.pretrained import ensure_model

            model_dir = ensure_model("smollm2-135m")
        out["models"][m] = model_figures(args, m, model_dir, size)
    summary = {
        "honest_tokens": sum(v["honest"]["tokens"] for v in out["models"].values()),
        "honest_bfloat16_tokens": sum(
            v["honest"]["bfloat16_tokens"] for v in out["models"].values()
        ),
        "honest_alarms": sum(v["honest"]["alarms"] for v in out["models"].values()),
        "honest_slashes": sum(v["honest"]["slashes"] for v in out["models"].values()),
        "false_alarm_bound": DEFAULT_TOLERANCES.of("bfloat16").divergence.false_alarm,  # type: ignore[union-attr]
        "false_alarm_horizon_tokens": DEFAULT_TOLERANCES.of("bfloat16").divergence.horizon_tokens,  # type: ignore[union-attr]
        "attacks": {},
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    for label, fig in out["models"].items():
        for name, per_table in fig["attacks"].items():
            for table, f in per_table.items():
                summary["attacks"][f"{label}/{name}@{table}"] = {
                    "detected": f["detected_trials"] == f["trials"],
                    "tokens_to_detect_p95": f["tokens_to_detect_p95"],
                    "tokens_to_detect_median": f["tokens_to_detect_median"],
                }
    out.update(summary)
    emit(out)
    return out


if __name__ == "__main__":
    main()
