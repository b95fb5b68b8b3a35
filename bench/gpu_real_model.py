"""SmolLM2-135M contributors generating on a GPU, checked by validators on the GPU and on a CPU.

Honest rollouts of exactly ``--tokens`` tokens (no stop token) are generated on CUDA with the
transformers backend and the verifiable sampler, in float32 and in bfloat16, and recomputed
by the validator's oracle in float32 twice: on the same GPU (batch sizes 1, 4 and 16 and
each forward layout, taken in turn) and on the CPU (the usual validator). A few requests are
also generated on the CPU in float32 to see whether the two devices draw the same tokens.

* ``noise``: per-token |committed - recomputed| median, p99 and max for each generation
  precision and each validator device; the largest 32-token chunk mean.
* ``honest_audits``: the full spot check (every chunk's logprobs, support, and sampler replay
  on every token) of every rollout against the built-in tolerances
  (``verify.spotcheck.DEFAULT_TOLERANCES``), per validator device; and of the second half
  against a tolerance calibrated (margin 2) on the first half of the CPU validator's
  differences.
* ``cost``: the GPU validator's recomputation seconds and its whole spot check (recompute
  and compare) over the GPU's generation seconds for the same float32 rollouts; the CPU
  validator's likewise.
* ``cross_device``: CPU float32 generations of the first requests against the GPU's:
  completions identical token for token, and where the first differing token falls.
* ``vllm``: whether vLLM is importable here (its comparison is ``bench/vllm_check.py``).

Without CUDA it prints ``{"bench": "gpu_real_model", "skipped": ...}`` and exits 0.
Prints progress on stderr and one JSON object on its last line.

    python bench/gpu_real_model.py [--model DIR] [--rollouts 256] [--tokens 128]
                                   [--prompts FILE] [--cpu-requests 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from bench.real_model import (  # noqa: E402
    BATCH_SIZES,
    CHUNK,
    GROUP,
    Rollout,
    _calibrate,
    _summary,
    audit,
    claimed,
    generate_rollouts,
    log,
    requests_for,
    true_logprobs,
)
from rollout.backends import TransformersBackend  # noqa: E402
from rollout.loading import model_dir_arg  # noqa: E402
from rollout.oracle import TransformersOracle  # noqa: E402
from verify.spotcheck import DEFAULT_TOLERANCES, Tolerances  # noqa: E402


def oracles(model_dir: Path, device: str) -> dict[str, TransformersOracle]:
    """The float32 validator's forward layouts on ``device`` over one loaded model."""
    packed = TransformersOracle({0: model_dir}, device=device, dtype="float32")
    unpacked = TransformersOracle(
        {0: packed.model(0)}, device=device, dtype="float32", max_packed_tokens=0
    )
    return {"packed": packed, "unpacked": unpacked} if packed.packs(0) else {"unpacked": unpacked}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Validator:
    """One validator device: recomputes, audits and keeps per-token differences."""

    def __init__(self, model_dir: Path, device: str, batch: int | None = None) -> None:
        self.device = device
        self.layouts = oracles(model_dir, device)
        self.settings = [(b, lay) for lay in self.layouts for b in BATCH_SIZES]
        if batch is not None:
            self.settings = [(batch, next(iter(self.layouts)))]
        self.fp32_recompute_s = 0.0
        self.fp32_check_s = 0.0
        self.diffs: dict[str, list[np.ndarray]] = {}
        self.audits: Counter[str] = Counter()
        self.calibrated: Counter[str] = Counter()

    def check(
        self, part: list[Rollout], turn: int, calibration: Tolerances | None = None
    ) -> list[np.ndarray]:
        """Recompute ``part`` (one precision) in the turn's setting; audit each rollout
        against the built-in tolerance and, when given, ``calibration``; their differences."""
        batch, layout = self.settings[turn % len(self.settings)]
        seqs = [(r.ids, len(r.prompt)) for r in part]
        logits: list[torch.Tensor] = []
        t0 = time.perf_counter()
        for start in range(0, len(seqs), batch):
            logits += self.layouts[layout].logits_batch(0, seqs[start : start + batch])
        _sync(self.device)
        spent = time.perf_counter() - t0
        out, checked = [], 0.0
        for r, lg in zip(part, logits, strict=True):
            d = np.abs(
                r.completion.logprobs.astype(np.float64)
                - true_logprobs(lg, r.completion.token_ids).astype(np.float64)
            )
            self.diffs.setdefault(r.precision, []).append(d)
            rollout = claimed(r, precision=r.precision)
            t1 = time.perf_counter()
            verdict = audit(rollout, lg, DEFAULT_TOLERANCES.of(r.precision))
            checked += time.perf_counter() - t1
            self.audits[f"{r.precision}:{verdict}"] += 1
            if calibration is not None:
                verdict = audit(rollout, lg, calibration.of(r.precision))
                self.calibrated[f"{r.precision}:{verdict}"] += 1
            out.append(d)
        if part[0].precision == "float32":
            self.fp32_recompute_s += spent
            self.fp32_check_s += checked
        return out

    def report(self) -> dict:
        return {
            p: {
                **_summary(np.concatenate(d)),
                "rollouts": len(d),
                "chunk_mean_max": float(
                    max(x[c : c + CHUNK].mean() for x in d for c in range(0, len(x), CHUNK))
                ),
            }
            for p, d in sorted(self.diffs.items())
        }


def cross_device(model_dir: Path, gpu: list[Rollout], prompts, tokens: int, n: int) -> dict:  # type: ignore[no-untyped-def]
    """CPU float32 generations of the first ``n`` requests against the GPU float32 ones."""
    cpu = TransformersBackend(model_dir, dtype="float32")
    rolls, cpu_s = generate_rollouts(cpu, requests_for(prompts[:n], tokens, 1), "float32", "cpu")
    same, first_diff = 0, []
    for a, b in zip(rolls, gpu, strict=False):
        x, y = a.completion.token_ids, b.completion.token_ids
        where = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), None)
        if where is None:
            same += 1
        else:
            first_diff.append(where)
    return {
        "completions": len(rolls),
        "identical": same,
        "first_difference_positions": sorted(first_diff),
        "cpu_generation_s": cpu_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=model_dir_arg, help="SmolLM2-135M directory (default: fetched)")
    ap.add_argument("--rollouts", type=int, default=256, help="rollouts per precision (256)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rollout (128)")
    ap.add_argument(
        "--prompts", type=Path, help="JSON list of prompt token-id lists (default: gsm8k train)"
    )
    ap.add_argument(
        "--cpu-requests", type=int, default=4, help="requests also generated on the CPU (4)"
    )
    ap.add_argument(
        "--device", default="cuda", help="where contributors generate (cuda; cpu tests the bench)"
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("gpu_real_model skipped: no CUDA device")
        emit({"bench": "gpu_real_model", "skipped": "no CUDA device"})
        return 0
    from rollout.pretrained import ensure_model

    model_dir = args.model or ensure_model("smollm2-135m")
    prompts = _prompts(model_dir, args.prompts, max(1, args.rollouts // GROUP))
    torch.manual_seed(0)
    honest: list[Rollout] = []
    gen_s: dict[str, float] = {}
    for k, precision in enumerate(("float32", "bfloat16")):
        backend = TransformersBackend(model_dir, device=args.device, dtype=precision)
        generate_rollouts(backend, requests_for(prompts[:1], args.tokens, 99), precision, "warm-up")
        _sync(args.device)
        rolls, gen_s[precision] = generate_rollouts(
            backend,
            requests_for(prompts, args.tokens, 1 + k),
            precision,
            f"{args.device} {precision}",
        )
        honest += rolls
        del backend
    fp32 = [r for r in honest if r.precision == "float32"]
    bf16 = [r for r in honest if r.precision == "bfloat16"]
    # Batches of one precision, alternating, so both halves hold both precisions.
    batches = [b for i in range(0, len(fp32), 16) for b in (fp32[i : i + 16], bf16[i : i + 16])]
    on_device = Validator(model_dir, args.device)
    on_device.check(batches[0], 0)  # warm-up, not counted
    on_device = Validator(model_dir, args.device)
    on_cpu = Validator(model_dir, "cpu", batch=16)
    calibration: Tolerances | None = None
    first_half: list[tuple[str, np.ndarray]] = []
    for turn, part in enumerate(batches):
        on_device.check(part, turn)
        if turn >= len(batches) // 2:
            calibration = calibration or _calibrate(first_half)
        got = on_cpu.check(part, turn, calibration)
        if calibration is None:
            first_half += [(r.precision, d) for r, d in zip(part, got, strict=True)]
        log(f"  checked {turn + 1}/{len(batches)} batches")
    assert calibration is not None
    emit(
        {
            "bench": "gpu_real_model",
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "model": str(model_dir),
            "tokens_per_rollout": args.tokens,
            "rollouts": len(honest),
            "noise": {
                "validator_on_generation_device": on_device.report(),
                "validator_on_cpu": on_cpu.report(),
            },
            "honest_audits": {
                "built_in_validator_on_generation_device": dict(on_device.audits),
                "built_in_validator_on_cpu": dict(on_cpu.audits),
                "calibrated_validator_on_cpu_second_half": dict(on_cpu.calibrated),
            },
            "tolerance_calibrated": {
                p: dataclasses.asdict(calibration.of(p)) for p in ("float32", "bfloat16")
            },
            "cost": _costs(gen_s, fp32, {"generation_device": on_device, "cpu": on_cpu}),
            "cross_device": cross_device(model_dir, fp32, prompts, args.tokens, args.cpu_requests),
            "vllm": "installed" if importlib.util.find_spec("vllm") else "not installed",
        }
    )
    return 0


def _prompts(model_dir: Path, path: Path | None, n: int) -> list[list[int]]:
    if path is not None:
        return [list(p) for p in json.loads(path.read_text())[:n]]
    from node.validator.policy import HFTextCodec
    from rewards.tasks import generate

    codec = HFTextCodec(model_dir)
    return [codec.encode(p.prompt) for p in generate("gsm8k", "train", n, seed=5)]


def _costs(gen_s: dict[str, float], fp32: list[Rollout], validators: dict[str, Validator]) -> dict:
    out = {
        "generation_s_float32": gen_s["float32"],
        "generation_s_bfloat16": gen_s["bfloat16"],
        "generation_ms_per_row_token_float32": 1e3
        * gen_s["float32"]
        / sum(len(r.completion.token_ids) for r in fp32),
    }
    for name, v in validators.items():
        out[f"validator_on_{name}_recompute_s"] = v.fp32_recompute_s
        out[f"validator_on_{name}_compare_s"] = v.fp32_check_s
        out[f"validator_on_{name}_spotcheck_over_generation"] = (
            v.fp32_recompute_s + v.fp32_check_s
        ) / gen_s["float32"]
    return out


if __name__ == "__main__":
    sys.exit(main())
