"""Tolerance calibration: measure honest numerical noise, then set thresholds above it.

Honest contributors generate with the claimed policy, but on other hardware,
in another precision, with another batch size: their committed logprobs
differ from the validator's recomputation by rounding alone. ``calibrate``
measures that difference for every (generation dtype, recomputation dtype,
recomputation batch size, forward layout) setting on prompts from the task,
and chooses

    token_abs      = margin * (largest honest |diff| at any token)
    chunk_mean_abs = margin * (largest honest mean |diff| over a chunk)

(with small floors so a bit-exact setting still gets a usable threshold),
overall and for each generation precision on its own (``by_precision``): a
contributor is held to the bound of the precision its headers declare, so a
float32 contributor cannot hide a substituted model in bfloat16's noise.
The file records the observations, so a node can refuse a tolerance that
would flag its own honest calibration runs (:func:`load_tolerance_file`).
The implied false-positive rate is stated as the observed exceedance count
and its 95% upper bound (3/N when none exceed).
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

from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from verify.commitment import DEFAULT_CHUNK_SIZE, n_chunks
from verify.errors import ConfigError
from verify.icdf import icdf_gaps, icdf_uniforms
from verify.logprobs import process_logits
from verify.sampling import SAMPLER_KEY_SIZE
from verify.spotcheck import MIN_MEAN_TOKENS, OracleRequest, Tolerance, Tolerances

TOKEN_FLOOR = 1e-4
CHUNK_FLOOR = 1e-5
REPLAY_FLOOR = 1e-4
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


@dataclass
class Calibration:
    token_abs: float
    chunk_mean_abs: float
    margin: float
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
        return Tolerances(
            {
                d: Tolerance(v["token_abs"], v["chunk_mean_abs"], v["replay_slack"])
                for d, v in self.by_precision().items()
            }
        )

    def by_precision(self) -> dict[str, dict[str, float]]:
        return _by_precision(self.settings, self.margin)

    def false_positive_bound(self) -> float:
        """95% upper bound on the per-chunk false-positive rate (none of the chunks exceeded)."""
        return 3.0 / max(self.chunks, 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["false_positive_rate_95ub"] = self.false_positive_bound()
        out["by_precision"] = self.by_precision()
        return out


def _thresholds(tok_max: float, chunk_max: float, margin: float) -> tuple[float, float]:
    token_abs = max(margin * tok_max, TOKEN_FLOOR)
    return token_abs, min(max(margin * chunk_max, CHUNK_FLOOR), token_abs)


def _by_precision(settings: Sequence[SettingStats], margin: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for dtype in sorted({s.generation_dtype for s in settings}):
        mine = [s for s in settings if s.generation_dtype == dtype]
        tok = max(s.token_max_abs for s in mine)
        chunk = max(s.chunk_mean_max for s in mine)
        token_abs, chunk_abs = _thresholds(tok, chunk, margin)
        gap = max(s.replay_gap_max for s in mine)
        out[dtype] = {
            "token_abs": token_abs,
            "chunk_mean_abs": chunk_abs,
            # A calibration run sees few near-boundary draws, so its largest
            # shift understates the tail: never below the mean |diff| bound, which
            # bounds the L1 distance that moves every boundary.
            "replay_slack": min(max(margin * gap, chunk_abs, REPLAY_FLOOR), 0.5),
            "observed_token_max": tok,
            "observed_chunk_mean_max": chunk,
            "observed_replay_gap_max": gap,
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
    seed: int = 0,
    layouts: Sequence[Layout] = LAYOUTS,
    progress: bool = False,
) -> Calibration:
    """Measure honest discrepancies for every setting and choose thresholds."""
    oracles = layout_oracles(model_dir, recompute_dtype)
    used = [layout for layout in layouts if layout in oracles]
    if not used:  # thresholds from no observations would be the floors
        raise ConfigError(
            f"calibrate: {model_dir} runs none of the layouts {list(layouts)} "
            f"(it runs {sorted(oracles)})"
        )
    settings: list[SettingStats] = []
    all_tok: list[np.ndarray] = []
    all_chunk: list[np.ndarray] = []
    rng = np.random.default_rng(seed)
    bar = _bar(len(generation_dtypes) * len(batch_sizes) * len(used), progress)
    for gen_dtype in generation_dtypes:
        backend = TransformersBackend(model_dir, dtype=gen_dtype)
        requests: list[OracleRequest] = []
        claimed: list[np.ndarray] = []
        uniforms: list[torch.Tensor] = []
        from rollout.backends import GenerationRequest

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
                requests.append(
                    OracleRequest(
                        tuple(prompt) + c.token_ids, len(prompt), temperature, top_k, top_p
                    )
                )
                claimed.append(np.asarray(c.logprobs))
                uniforms.append(
                    icdf_uniforms(
                        [
                            (
                                req.sampler_key,
                                req.nonce,
                                req.seed,
                                c.group_index,
                                range(len(c.token_ids)),
                            )
                        ]
                    )
                )
        for b in batch_sizes:
            for layout in used:
                tok, chk, gaps = [], [], [0.0]
                for start in range(0, len(requests), b):
                    batch = requests[start : start + b]
                    logits = oracles[layout].logits_batch(
                        0, [(r.input_ids, r.prompt_len) for r in batch]
                    )
                    for j, (r, lg) in enumerate(zip(batch, logits, strict=True)):
                        lp = process_logits(
                            torch.as_tensor(lg), temperature, top_k, top_p
                        )  # (T, V)
                        ids = torch.tensor(r.input_ids[r.prompt_len :], dtype=torch.long)
                        rc = lp.gather(-1, ids[:, None])[:, 0].numpy().astype(np.float32)
                        d, m = _diffs(claimed[start + j], rc, chunk_size)
                        tok.append(d)
                        chk.append(m)
                        if temperature > 0 and len(ids):
                            gaps.append(float(icdf_gaps(ids, lp, uniforms[start + j]).max()))
                t, ch = np.concatenate(tok), np.concatenate(chk)
                settings.append(
                    SettingStats(
                        gen_dtype,
                        recompute_dtype,
                        b,
                        int(t.size),
                        int(ch.size),
                        float(t.max(initial=0.0)),
                        float(np.quantile(t, 0.999)) if t.size else 0.0,
                        float(ch.max(initial=0.0)),
                        layout,
                        max(gaps),
                    )
                )
                all_tok.append(t)
                all_chunk.append(ch)
                bar.update(1)
    bar.close()
    tok_max = float(max((s.token_max_abs for s in settings), default=0.0))
    chunk_max = float(max((s.chunk_mean_max for s in settings), default=0.0))
    token_abs, chunk_abs = _thresholds(tok_max, chunk_max, margin)
    return Calibration(
        token_abs,
        chunk_abs,
        margin,
        tok_max,
        chunk_max,
        int(sum(t.size for t in all_tok)),
        int(sum(c.size for c in all_chunk)),
        settings,
    )


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


def _bar(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc="calibrating", disable=not enabled, unit="setting")


def write_tolerance_file(cal: Calibration, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    os.replace(tmp, target)
    return target


def load_tolerance_file(path: str | Path) -> Tolerances:
    """Read a tolerance file: each generation precision's bound (``by_precision``, or rebuilt
    from the recorded settings of a file written before it had one); refuse thresholds that
    its own honest runs would exceed."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        if "by_precision" in data:
            table = {
                str(d): {k: float(v.get(k, 0.0)) for k in _FIELDS}
                for d, v in data["by_precision"].items()
            }
        else:
            settings = [SettingStats(**s) for s in data["settings"]]
            table = _by_precision(settings, float(data["margin"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"tolerance file {p} is unreadable: {exc}") from None
    if not table:
        raise ConfigError(f"tolerance file {p} holds no calibrated precision")
    out: dict[str, Tolerance] = {}
    for dtype, v in table.items():
        if (
            v["token_abs"] < v["observed_token_max"]
            or v["chunk_mean_abs"] < v["observed_chunk_mean_max"]
            or 0 < v["replay_slack"] < v["observed_replay_gap_max"]
        ):
            raise ConfigError(
                f"tolerance file {p} would flag its own honest calibration runs ({dtype}): token_abs "
                f"{v['token_abs']:g} < observed {v['observed_token_max']:g} or chunk_mean_abs "
                f"{v['chunk_mean_abs']:g} < observed {v['observed_chunk_mean_max']:g}"
            )
        try:
            out[dtype] = Tolerance(v["token_abs"], v["chunk_mean_abs"], v["replay_slack"])
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
    "observed_token_max",
    "observed_chunk_mean_max",
    "observed_replay_gap_max",
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
    from rollout.backends import GenerationRequest
    from verify.envelope import build_envelope, verify_envelope
    from verify.errors import SpotCheckError
    from verify.keys import SigningKey
    from verify.types import SamplingParams

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
                fields = dict(
                    policy_version=0,
                    manifest_digest=b"\0" * 32,
                    task_id="t",
                    prompt_id="p",
                    prompt_digest=b"\0" * 32,
                    assignment_id=b"\0" * 16,
                    nonce=nonce,
                    sampling=SamplingParams(temperature, 1.0, 0, max_tokens, s_seed),
                    group_index=c.group_index,
                    group_size=group_size,
                    created_at_ms=0,
                )
                env = build_envelope(key, fields, c.token_ids, c.logprobs)
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
