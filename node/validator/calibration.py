"""Tolerance calibration: measure honest numerical noise, then set thresholds above it.

Honest contributors generate with the claimed policy, but on other hardware,
in another precision, with another batch size: their committed logprobs
differ from the validator's recomputation by rounding alone. ``calibrate``
measures that difference for every (generation dtype, recomputation dtype,
recomputation batch size, forward layout) setting on prompts from the task,
and chooses

    token_abs      = max(margin * (largest honest |diff| at any token), built-in bound)
    chunk_mean_abs = max(margin * (largest honest mean |diff| over a chunk), built-in bound)
    replay_slack   = max(margin * (largest honest replay gap), built-in slack)

for each generation precision on its own (``by_precision``): a contributor is
held to the bound of the precision its headers declare, so a float32
contributor cannot hide a substituted model in bfloat16's noise. The per-token
bounds only refuse what honest noise cannot produce, so a calibration never
tightens them below the built-in table (``verify.spotcheck``): a short run
that saw no chunk or no boundary shift cannot leave a degenerate bound.

The tight part is the divergence test (``verify.divergence``): for each
precision, with m the largest mean honest |diff| and g the largest mean honest
replay gap over the settings (generation backends, recomputation batch sizes,
layouts)::

    logprob_scale = LOGPROB_SCALE_MEANS * m        logprob_null = null_margin * m / logprob_scale
    replay_scale  = replay_slack                    replay_null  = null_margin * g / replay_scale

(each mean taken as an upper confidence bound, ``mean + UPPER_SDS sd / sqrt(n)``, and
floored per precision; the unclipped mean bounds the clipped score's). Replay gaps are
scored against the slack itself: an honest gap is a small fraction of it, a steered token
anywhere in it. Each precision needs
at least ``MIN_TOKENS`` measured tokens per setting, or ``calibrate`` refuses
and says what to run. The file records every observation, so a node refuses a
tolerance that would flag its own honest calibration runs, or that lacks the
statistics the test needs (:func:`load_tolerance_file`). The stated
false-positive rate is the divergence test's bound (``false_alarm`` over
``horizon_tokens`` audited tokens), a probability.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from rollout.backends import GenerateBackend, GenerationRequest, TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.progress import Progress, progress
from verify.commitment import DEFAULT_CHUNK_SIZE, n_chunks
from verify.divergence import DivergenceTest
from verify.errors import ConfigError
from verify.icdf import icdf_gaps, icdf_uniforms
from verify.logprobs import process_logits
from verify.sampling import SAMPLER_KEY_SIZE
from verify.spotcheck import (
    DEFAULT_TOLERANCES,
    MIN_MEAN_TOKENS,
    OracleRequest,
    Tolerance,
    Tolerances,
)

MIN_TOKENS = 2_000
"""Fewest honest tokens each setting of a precision must measure (its means set the test's
nulls)."""
LOGPROB_SCALE_MEANS = 10.0
"""The logprob score saturates at this many times the honest mean |diff|."""
NULL_FLOOR = 1e-3
MEAN_FLOOR = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-4}
"""Least mean honest |diff| a precision's null allows: other hardware's kernels round
differently than the machine that calibrated (float32 most of all, relative to its noise)."""
GAP_MEAN_FLOOR = {"float32": 1e-7, "bfloat16": 1e-5, "float16": 1e-6}
"""Least mean honest replay gap a precision's null allows, likewise."""
UPPER_SDS = 4.0
"""A setting's mean enters the nulls as ``mean + UPPER_SDS x sd / sqrt(tokens)``: honest replay
gaps are rare events (most tokens reproduce exactly), so a measured mean is itself noisy."""


def _upper(mean: float, sd: float, n: int) -> float:
    """An upper confidence bound on a setting's mean (``-1`` where it was not measured)."""
    return mean if mean < 0 else mean + UPPER_SDS * sd / max(n, 1) ** 0.5


GENERATION_BACKENDS = {
    "transformers": TransformersBackend,
    "transformers-generate": GenerateBackend,
}
"""Honest generation paths a calibration measures: the project's backend (one prompt pass, its
cache shared by the group) and plain ``model.generate`` (a row per completion), each its own
rounding."""
Layout = Literal["packed", "unpacked"]
LAYOUTS: tuple[Layout, ...] = ("packed", "unpacked")


@dataclass
class SettingStats:
    generation_dtype: str
    recompute_dtype: str
    batch_size: int
    tokens: int
    chunks: int
    token_max_abs: float
    token_p999_abs: float
    chunk_mean_max: float
    layout: str = "unpacked"
    replay_gap_max: float = 0.0
    """Largest probability mass by which an honest token's keyed uniform fell outside its
    recomputed inverse-CDF interval (``verify.icdf.icdf_gaps``)."""
    token_mean_abs: float = -1.0
    """Mean honest |diff| per token (-1: not measured, a file too old for the test)."""
    replay_gap_mean: float = -1.0
    """Mean honest replay gap per token (0 where the replay drew the token)."""
    token_sd_abs: float = 0.0
    """Standard deviation of the honest |diff| per token."""
    replay_gap_sd: float = 0.0
    """Standard deviation of the honest replay gap per token."""
    backend: str = "transformers"
    """The generation path (:data:`GENERATION_BACKENDS`)."""


@dataclass
class Calibration:
    token_abs: float
    chunk_mean_abs: float
    margin: float
    null_margin: float
    observed_token_max: float
    observed_chunk_mean_max: float
    tokens: int
    chunks: int
    settings: list[SettingStats] = field(default_factory=list)

    @property
    def tolerance(self) -> Tolerance:
        """The bound over every setting (the loosest precision's)."""
        return Tolerance(self.token_abs, self.chunk_mean_abs)

    @property
    def tolerances(self) -> Tolerances:
        """Each generation precision's own bound, from its settings alone."""
        return Tolerances({d: _tolerance(v) for d, v in self.by_precision().items()})

    def by_precision(self) -> dict[str, dict[str, float]]:
        return _by_precision(self.settings, self.margin, self.null_margin)

    def false_positive_bound(self) -> float:
        """The divergence test's bound on an honest contributor's probability of an alarm
        within ``horizon_tokens`` audited tokens (the same for every precision)."""
        tests = [t.divergence for t in self.tolerances.by_precision.values()]
        return max(t.false_alarm for t in tests if t is not None)

    def to_json(self) -> dict:
        out = asdict(self)
        out["false_positive_bound"] = self.false_positive_bound()
        out["by_precision"] = self.by_precision()
        return out


def _tolerance(v: dict[str, float]) -> Tolerance:
    """A precision's row of ``by_precision`` as a :class:`Tolerance`."""
    return Tolerance(
        v["token_abs"],
        v["chunk_mean_abs"],
        v["replay_slack"],
        DivergenceTest(v["logprob_scale"], v["logprob_null"], v["replay_scale"], v["replay_null"]),
    )


def _by_precision(
    settings: Sequence[SettingStats], margin: float, null_margin: float
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for dtype in sorted({s.generation_dtype for s in settings}):
        mine = [s for s in settings if s.generation_dtype == dtype]
        built_in = DEFAULT_TOLERANCES.by_precision.get(dtype, DEFAULT_TOLERANCES.of("bfloat16"))
        tok = max(s.token_max_abs for s in mine)
        chunk = max(s.chunk_mean_max for s in mine)
        gap = max(s.replay_gap_max for s in mine)
        token_abs = max(margin * tok, built_in.token_abs)
        chunk_abs = min(max(margin * chunk, built_in.chunk_mean_abs), token_abs)
        slack = min(max(margin * gap, built_in.cdf_slack), 0.5)
        mean_abs = max(_upper(s.token_mean_abs, s.token_sd_abs, s.tokens) for s in mine)
        mean_gap = max(_upper(s.replay_gap_mean, s.replay_gap_sd, s.tokens) for s in mine)
        lp_mean = max(mean_abs, MEAN_FLOOR.get(dtype, 1e-3))
        lp_scale = LOGPROB_SCALE_MEANS * lp_mean
        gap_mean = max(mean_gap, GAP_MEAN_FLOOR.get(dtype, 1e-5))
        out[dtype] = {
            "token_abs": token_abs,
            "chunk_mean_abs": chunk_abs,
            "replay_slack": slack,
            "logprob_scale": lp_scale,
            "logprob_null": min(max(null_margin * lp_mean / lp_scale, NULL_FLOOR), 0.5),
            "replay_scale": slack,
            "replay_null": min(max(null_margin * gap_mean / slack, NULL_FLOOR), 0.5),
            "observed_token_max": tok,
            "observed_chunk_mean_max": chunk,
            "observed_replay_gap_max": gap,
            "observed_token_mean_abs": max(s.token_mean_abs for s in mine),
            "observed_replay_gap_mean": max(s.replay_gap_mean for s in mine),
            "min_setting_tokens": min(s.tokens for s in mine),
        }
    return out


def _diffs(
    claimed: np.ndarray, recomputed: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token |diff|, and the mean of each chunk the comparison judges a mean on."""
    d = np.abs(claimed.astype(np.float64) - recomputed.astype(np.float64))
    means = [
        d[i : i + chunk].mean()
        for i in range(0, len(d), chunk)
        if len(d[i : i + chunk]) >= MIN_MEAN_TOKENS
    ]
    return d, np.asarray(means, dtype=np.float64)


def calibrate(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    stop_token_ids: Sequence[int] = (),
    generation_dtypes: Sequence[str] = ("float32", "bfloat16"),
    recompute_dtype: str = "float32",
    batch_sizes: Sequence[int] = (1, 4, 16),
    group_size: int = 4,
    max_tokens: int = 16,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    margin: float = 2.0,
    null_margin: float = 1.25,
    seed: int = 0,
    layouts: Sequence[Layout] = LAYOUTS,
    backends: Sequence[str] = tuple(GENERATION_BACKENDS),
    min_tokens: int = MIN_TOKENS,
    progress: bool = False,
) -> Calibration:
    """Measure honest discrepancies for every setting and choose thresholds.

    Settings: generation precision x generation backend x recomputation batch size x
    forward layout. Raises ConfigError when a setting measured fewer than ``min_tokens``
    tokens (the message says how many prompts would do)."""
    if temperature <= 0.0:
        raise ConfigError("calibrate: the divergence test needs sampled tokens (temperature > 0)")
    oracles = layout_oracles(model_dir, recompute_dtype)
    used = [layout for layout in layouts if layout in oracles]
    if not used:  # thresholds from no observations would be the floors
        raise ConfigError(
            f"calibrate: {model_dir} runs none of the layouts {list(layouts)} "
            f"(it runs {sorted(oracles)})"
        )
    rng = np.random.default_rng(seed)
    settings: list[SettingStats] = []
    sampling = (temperature, top_k, top_p)
    generations = len(generation_dtypes) * len(backends)
    n_settings = generations * len(batch_sizes) * len(used)
    # One unit per rollout generated and per rollout recomputed in each setting, so the
    # bar moves (and its ETA means something) inside a setting, not only between them.
    rollouts = len(prompts) * group_size * generations * (1 + len(batch_sizes) * len(used))
    bar = _bar(rollouts, progress)
    for gen_dtype in generation_dtypes:
        for name in backends:
            bar.set_postfix_str(
                f"{len(settings)}/{n_settings} settings, generating {gen_dtype} {name}"
            )
            backend = GENERATION_BACKENDS[name](model_dir, dtype=gen_dtype)
            honest = _honest_rollouts(
                backend, prompts, rng, group_size, max_tokens, sampling, stop_token_ids, seed, bar
            )
            for b in batch_sizes:
                for layout in used:
                    bar.set_postfix_str(
                        f"{len(settings)}/{n_settings} settings, recomputing {gen_dtype} {name} "
                        f"batch {b} {layout}"
                    )
                    stats = _measure(honest, oracles[layout], b, sampling, chunk_size, bar)
                    settings.append(
                        SettingStats(
                            gen_dtype, recompute_dtype, b, **stats, layout=layout, backend=name
                        )
                    )
    bar.set_postfix_str(f"{len(settings)}/{n_settings} settings")
    bar.close()
    short = [s for s in settings if s.tokens < min_tokens]
    if short:
        worst = min(s.tokens for s in short)
        need = int(np.ceil(len(prompts) * min_tokens / max(worst, 1)))
        raise ConfigError(
            f"calibrate: {worst} honest tokens measured per setting, fewer than the {min_tokens} "
            f"the divergence test's nulls need; run it again with --prompts {need} (or more "
            "--max-tokens)"
        )
    tok_max = float(max((s.token_max_abs for s in settings), default=0.0))
    chunk_max = float(max((s.chunk_mean_max for s in settings), default=0.0))
    return Calibration(
        max(margin * tok_max, FLOAT32_FLOOR.token_abs),
        max(margin * chunk_max, FLOAT32_FLOOR.chunk_mean_abs),
        margin,
        null_margin,
        tok_max,
        chunk_max,
        int(sum(s.tokens for s in settings)),
        int(sum(s.chunks for s in settings)),
        settings,
    )


FLOAT32_FLOOR = DEFAULT_TOLERANCES.of("float32")


def _honest_rollouts(
    backend: TransformersBackend,
    prompts: Sequence[Sequence[int]],
    rng: np.random.Generator,
    group_size: int,
    max_tokens: int,
    sampling: tuple[float, int, float],
    stop_token_ids: Sequence[int],
    seed: int,
    bar: Progress,
) -> list[tuple[OracleRequest, np.ndarray, torch.Tensor]]:
    """Every prompt's group from ``backend``: (recomputation request, committed logprobs,
    keyed uniforms) per completion."""
    temperature, top_k, top_p = sampling
    out = []
    for i, prompt in enumerate(prompts):
        req = GenerationRequest(
            tuple(prompt),
            group_size,
            temperature,
            top_k,
            top_p,
            max_tokens,
            rng.bytes(SAMPLER_KEY_SIZE),
            rng.bytes(32),
            seed * 100_003 + i,
            tuple(stop_token_ids),
        )
        for c in backend.generate(req):
            spec = (req.sampler_key, req.nonce, req.seed, c.group_index, range(len(c.token_ids)))
            out.append(
                (
                    OracleRequest(tuple(prompt) + c.token_ids, len(prompt), *sampling),
                    np.asarray(c.logprobs),
                    icdf_uniforms([spec]),
                )
            )
        bar.update(group_size)
    return out


def _measure(
    honest: list[tuple[OracleRequest, np.ndarray, torch.Tensor]],
    oracle: TransformersOracle,
    batch: int,
    sampling: tuple[float, int, float],
    chunk_size: int,
    bar: Progress,
) -> dict:
    """Recompute ``honest`` in batches of ``batch``: SettingStats' measured fields."""
    tok, chk, gaps = [], [], []
    for start in range(0, len(honest), batch):
        part = honest[start : start + batch]
        logits = oracle.logits_batch(0, [(r.input_ids, r.prompt_len) for r, _, _ in part])
        for (r, claimed, uniforms), lg in zip(part, logits, strict=True):
            lp = process_logits(torch.as_tensor(lg), *sampling)  # (T, V)
            ids = torch.tensor(r.input_ids[r.prompt_len :], dtype=torch.long)
            rc = lp.gather(-1, ids[:, None])[:, 0].numpy().astype(np.float32)
            d, m = _diffs(claimed, rc, chunk_size)
            tok.append(d)
            chk.append(m)
            if len(ids):
                gaps.append(icdf_gaps(ids, lp, uniforms).numpy())
        bar.update(len(part))
    t, ch = np.concatenate(tok), np.concatenate(chk)
    g = np.concatenate(gaps) if gaps else np.zeros(0)
    return {
        "tokens": int(t.size),
        "chunks": int(ch.size),
        "token_max_abs": float(t.max(initial=0.0)),
        "token_p999_abs": float(np.quantile(t, 0.999)) if t.size else 0.0,
        "chunk_mean_max": float(ch.max(initial=0.0)),
        "replay_gap_max": float(g.max(initial=0.0)),
        "token_mean_abs": float(t.mean()) if t.size else 0.0,
        "replay_gap_mean": float(g.mean()) if g.size else 0.0,
        "token_sd_abs": float(t.std()) if t.size else 0.0,
        "replay_gap_sd": float(g.std()) if g.size else 0.0,
    }


def layout_oracles(model_dir: str | Path, dtype: str) -> dict[Layout, TransformersOracle]:
    """One oracle per forward layout a node may use, over one loaded model: ``packed``,
    the rows of short groups (when the model runs them), and ``unpacked``, as the node
    runs groups too wide to pack (a shared prefix when it pays, else left-padded rows;
    ``rollout/oracle.py``)."""
    packed = TransformersOracle({0: model_dir}, dtype=dtype, padding_side="left")
    unpacked = TransformersOracle(
        {0: packed.model(0)}, dtype=dtype, padding_side="left", max_packed_tokens=0
    )
    return {"packed": packed, "unpacked": unpacked} if packed.packs(0) else {"unpacked": unpacked}


def _bar(total: int, enabled: bool) -> Progress:
    return progress(total, "calibrating", "rollouts", enabled=enabled)


def write_tolerance_file(cal: Calibration, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    os.replace(tmp, target)
    return target


def load_tolerance_file(path: str | Path, *, min_tokens: int = MIN_TOKENS) -> Tolerances:
    """Read a tolerance file: each generation precision's bounds and divergence test; refuse
    thresholds that its own honest runs would exceed, and a file without the statistics the
    divergence test needs (written before it existed, or by hand)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        table = {str(d): {k: float(v[k]) for k in _FIELDS} for d, v in data["by_precision"].items()}
    except KeyError as exc:
        raise ConfigError(
            f"tolerance file {p} lacks {exc} that the divergence test needs; measure it again "
            f"with `prooftrain calibrate MODEL_DIR --out {p}`"
        ) from None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"tolerance file {p} is unreadable: {exc}") from None
    if not table:
        raise ConfigError(f"tolerance file {p} holds no calibrated precision")
    out: dict[str, Tolerance] = {}
    for dtype, v in table.items():
        if (
            v["token_abs"] < v["observed_token_max"]
            or v["chunk_mean_abs"] < v["observed_chunk_mean_max"]
            or 0 < v["replay_slack"] < v["observed_replay_gap_max"]
            or v["logprob_null"] * v["logprob_scale"] < v["observed_token_mean_abs"]
            or v["replay_null"] * v["replay_scale"] < v["observed_replay_gap_mean"]
        ):
            raise ConfigError(
                f"tolerance file {p} would flag its own honest calibration runs ({dtype}): a "
                "bound or a divergence null is below what its honest runs measured"
            )
        if v["observed_token_mean_abs"] < 0 or v["min_setting_tokens"] < min_tokens:
            raise ConfigError(
                f"tolerance file {p} ({dtype}) measured {int(v['min_setting_tokens'])} tokens per "
                f"setting, fewer than the {min_tokens} its divergence nulls need; measure it "
                f"again with `prooftrain calibrate MODEL_DIR --out {p}` and more --prompts"
            )
        try:
            out[dtype] = _tolerance(v)
        except ValueError as exc:
            raise ConfigError(f"tolerance file {p} ({dtype}): {exc}") from None
    try:
        return Tolerances(out)
    except ValueError as exc:
        raise ConfigError(f"tolerance file {p}: {exc}") from None


_FIELDS = (
    "token_abs",
    "chunk_mean_abs",
    "replay_slack",
    "logprob_scale",
    "logprob_null",
    "replay_scale",
    "replay_null",
    "observed_token_max",
    "observed_chunk_mean_max",
    "observed_replay_gap_max",
    "observed_token_mean_abs",
    "observed_replay_gap_mean",
    "min_setting_tokens",
)


def honest_audit(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    tolerance: Tolerance,
    *,
    stop_token_ids: Sequence[int] = (),
    generation_dtypes: Sequence[str] = ("float32", "bfloat16"),
    recompute_dtype: str = "float32",
    batch_sizes: Sequence[int] = (1, 4, 16),
    group_size: int = 4,
    max_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 1,
    shifts: Sequence[float] = (),
) -> dict:
    """Run the full spot check (logprobs, support, replay on every chunk) on fresh honest rollouts.

    Batches take the batch sizes in turn, and each round of them the next forward
    layout (:func:`layout_oracles`). Returns the number audited, the number
    rejected (false positives), and, for each ``shift``, the fraction of rollouts
    caught when 3 of their committed logprobs are moved by that many nats.
    """
    from node.validator.spot import _check
    from verify.envelope import build_envelope, verify_envelope
    from verify.errors import SpotCheckError
    from verify.keys import SigningKey

    oracles = list(layout_oracles(model_dir, recompute_dtype).values())
    rng = np.random.default_rng(seed)
    audited = rejected = 0
    caught = {s: 0 for s in shifts}
    key = SigningKey.from_seed(rng.bytes(32))
    for d, gen_dtype in enumerate(generation_dtypes):
        backend = TransformersBackend(model_dir, dtype=gen_dtype)
        items = []
        for i, prompt in enumerate(prompts):
            nonce, s_seed = rng.bytes(32), seed * 1_000_003 + d * 100_000 + i
            req = GenerationRequest(
                tuple(prompt),
                group_size,
                temperature,
                0,
                1.0,
                max_tokens,
                key.public.raw,
                nonce,
                s_seed,
                tuple(stop_token_ids),
            )
            for c in backend.generate(req):
                env = build_envelope(
                    key, unassigned_fields(req, c.group_index), c.token_ids, c.logprobs
                )
                items.append((verify_envelope(env), list(prompt), c))
        start, turn = 0, 0
        while start < len(items):
            b = batch_sizes[turn % len(batch_sizes)]
            oracle = oracles[turn // len(batch_sizes) % len(oracles)]
            batch, start, turn = items[start : start + b], start + b, turn + 1
            logits = oracle.logits_batch(0, [(p + list(c.token_ids), len(p)) for _, p, c in batch])
            for (rollout, _, _), lg in zip(batch, logits, strict=True):
                every_chunk = list(
                    range(n_chunks(rollout.header.token_count, rollout.header.chunk_size))
                )
                audited += 1
                try:
                    _check(rollout, lg.numpy(), every_chunk, tolerance)
                except SpotCheckError:
                    rejected += 1
                for shift in shifts:
                    lp = rollout.logprobs.copy()
                    k = min(3, len(lp))
                    lp[:k] = np.where(lp[:k] <= -shift, lp[:k] + shift, lp[:k] - shift)
                    try:
                        _check(
                            dataclasses.replace(rollout, logprobs=lp),
                            lg.numpy(),
                            every_chunk,
                            tolerance,
                        )
                    except SpotCheckError:
                        caught[shift] += 1
    return {
        "audited": audited,
        "rejected": rejected,
        "caught": {s: caught[s] / max(audited, 1) for s in shifts},
    }


def unassigned_fields(req: GenerationRequest, group_index: int, precision: str = "float32") -> dict:
    """Header fields of a rollout generated for ``req`` outside any assignment (calibration,
    benchmarks): its nonce, sampling and group, and placeholders for what a spot check does not
    read."""
    from verify.types import SamplingParams

    return dict(
        policy_version=0,
        manifest_digest=b"\0" * 32,
        task_id="t",
        prompt_id="p",
        prompt_digest=b"\0" * 32,
        assignment_id=b"\0" * 16,
        nonce=req.nonce,
        sampling=SamplingParams(req.temperature, req.top_p, req.top_k, req.max_tokens, req.seed),
        group_index=group_index,
        group_size=req.group_size,
        created_at_ms=0,
        precision=precision,
        backend="transformers",
    )
