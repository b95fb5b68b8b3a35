"""Weight publication: bytes per published update against a full bfloat16 copy of the model.

Runs ``--steps`` AdamW steps of supervised next-token loss on the demo base
model (training-like deltas) and publishes after each with every codec,
exactly as the trainer does (``trainer.publish.StagePublisher``, implicit error
feedback). Prints one JSON object on its last line:

  bf16_bytes               a full bfloat16 copy of the model (the baseline, same run)
  codecs.<name>.bytes_per_update   mean published blob size over the steps
  codecs.<name>.ratio_vs_bf16      bf16_bytes / bytes_per_update (target: topk >= 10)
  codecs.<name>.tracking_error     |current - published| / |current - base| after the
                                   last step (what contributors lag behind the trainer)
  codecs.<name>.seconds_per_update encode + apply, one core
  int8_apply               the publisher's int8-block update (encoded in place, the copy
                           advanced by the values it decoded) against the same update
                           encoded and then applied by decoding its own blob as a
                           contributor does (the baseline, same steps, order alternating):
                           seconds per update of each, the speedup, and whether both
                           made the same blobs (every version compared) and
                           bit-identical published copies
  pass_at_1                with ``--train-steps N``: greedy held-out pass@1 (95% interval)
                           after N RL steps of ``configs/trainer.toml`` publishing with
                           each codec (fp32 deltas are the uncompressed run)
  sft_proxy                with ``--eval N``: greedy pass@1 on N held-out problems of
                           the trained weights and of each codec's published copy,
                           with 95% Wilson intervals
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench._util import emit  # noqa: E402
from rollout.loading import model_dir_arg  # noqa: E402
from rollout.progress import tracked  # noqa: E402
from trainer.publish import StagePublisher, publishable_state  # noqa: E402

CODECS: dict[str, tuple[str, dict[str, object]]] = {
    "fp32": ("fp32", {}),
    "int8-block": ("int8-block", {"block_size": 64, "scale_dtype": "bfloat16"}),
    "topk-2%-int8": ("topk", {"fraction": 0.02, "int8": True, "block_size": 64}),
}
TARGET_RATIO = 10.0


def train_and_eval(codec: str, steps: int, eval_problems: int) -> dict:
    """Held-out greedy pass@1 after ``steps`` RL steps publishing every version with ``codec``.

    The full RL run of ``configs/trainer.toml`` (in-process validator, honest
    contributors sampling from the *published* copy, spot checks), only the
    publication codec differs; the published copy of the last version is evaluated.
    """
    from node.local import run_local
    from trainer.config import load_trainer_config

    name, params = CODECS[codec]
    cfg = load_trainer_config(
        REPO / "configs" / "trainer.toml",
        {
            "steps": steps,
            "eval_every": steps,
            "eval_problems": eval_problems,
            "publish.codec": name,
            "publish.codec_params": params,
        },
    )
    history, net = run_local(cfg, progress=True)
    try:
        metric = history.evals[steps].metric("pass@1 (greedy)")
    finally:
        net.close()
    return {"value": metric.value, "ci95": [round(metric.ci_low, 4), round(metric.ci_high, 4)]}


def _supervised_rows(tokenizer, task: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    from rewards.tasks import generate, get_task

    gen = get_task(task)
    rows = []
    for p in generate(task, "train", n, seed):
        prompt = tokenizer(p.prompt)["input_ids"]
        target = tokenizer(gen.reference_completion(p), add_special_tokens=False)["input_ids"]
        rows.append((prompt + target + [tokenizer.eos_token_id], len(prompt)))
    return rows


def _batch(rows, idx: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(rows[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(idx):
        seq, n_prompt = rows[i]
        ids[r, : len(seq)] = torch.tensor(seq)
        labels[r, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
        mask[r, : len(seq)] = 1
    return ids, labels, mask


def _norm(state: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return float(sum(float((state[n] - other[n]).double().pow(2).sum()) for n in state) ** 0.5)


def measure(model, tokenizer, args) -> tuple[dict, dict[str, StagePublisher]]:
    base = {n: t.clone() for n, t in publishable_state(model).items()}
    pubs = {key: StagePublisher(0, base, name, params) for key, (name, params) in CODECS.items()}
    sizes: dict[str, list[int]] = {key: [] for key in CODECS}
    seconds: dict[str, float] = dict.fromkeys(CODECS, 0.0)
    rows = _supervised_rows(tokenizer, args.task, 4_096, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    decoding = _DecodingPublisher(base, *CODECS["int8-block"])
    for step in tracked(range(args.steps), "train + publish", "steps"):
        model.train()
        idx = torch.randint(len(rows), (args.batch,), generator=gen).tolist()
        ids, labels, mask = _batch(rows, idx, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        current = publishable_state(model)
        if step % 2:
            decoding.update(current)
        for key, pub in pubs.items():
            start = time.perf_counter()
            update = pub.update(current)
            sizes[key].append(update.nbytes)
            seconds[key] += time.perf_counter() - start
            if key == "int8-block":
                decoding.check(update.blob)
        if not step % 2:
            decoding.update(current)
    current = publishable_state(model)
    moved = _norm(current, base)
    bf16 = 2 * sum(t.numel() for t in base.values())
    out = {}
    for key, pub in pubs.items():
        mean = sum(sizes[key]) / len(sizes[key])
        out[key] = {
            "bytes_per_update": round(mean),
            "ratio_vs_bf16": round(bf16 / mean, 2),
            "tracking_error": round(_norm(current, pub.published_state()) / moved, 4),
            "seconds_per_update": round(seconds[key] / args.steps, 4),
        }
    fast = seconds["int8-block"] / args.steps
    slow = decoding.seconds / args.steps
    same = all(
        torch.equal(a.view(torch.int32), decoding.copy[n].view(torch.int32))
        for n, a in pubs["int8-block"].published_state().items()
    )
    apply = {
        "seconds_per_update": round(fast, 4),
        "decode_to_apply_seconds_per_update": round(slow, 4),
        "speedup": round(slow / fast, 3),
        "same_blobs": decoding.same_blobs and decoding.compared == args.steps,
        "versions_compared": decoding.compared,
        "published_copies_bit_identical": same,
    }
    return {"bf16_bytes": bf16, "params": bf16 // 2, "codecs": out, "int8_apply": apply}, pubs


class _DecodingPublisher:
    """The baseline of ``int8_apply``: each update encoded (``encode_state_delta``), then
    applied to the published copy by decoding its own blob (``add_state_delta_``), as a
    contributor applies it. Only the encode and the apply are timed (no input checks)."""

    def __init__(self, base: dict[str, torch.Tensor], name: str, params: dict) -> None:
        from verify.weights_codec import get_codec

        self.codec = get_codec(name, **params)
        self.copy = {n: t.clone() for n, t in base.items()}
        self.seconds, self.same_blobs, self.compared = 0.0, True, 0
        self._waiting: bytes | None = None  # this version's first blob, until the other comes

    def update(self, current: dict[str, torch.Tensor]) -> None:
        from verify.weights_codec import add_state_delta_, encode_state_delta

        start = time.perf_counter()
        deltas = {n: current[n].detach() - w for n, w in self.copy.items()}
        blob = encode_state_delta(deltas, self.codec)
        del deltas
        add_state_delta_(self.copy, blob)
        self.seconds += time.perf_counter() - start
        self.check(blob)

    def check(self, blob: bytes) -> None:
        """Meet the two blobs of a version (the publisher's and this one's, whichever came
        first this step) and compare them."""
        if self._waiting is None:
            self._waiting = blob
            return
        self.same_blobs &= self._waiting == blob
        self.compared += 1
        self._waiting = None


def sft_proxy(model, tokenizer, pubs: dict[str, StagePublisher], args) -> dict:
    """pass@1 of the trained weights and of what contributors would hold, same problems."""
    import copy

    from trainer.evals import evaluate

    def pass1(m) -> dict:
        metric = evaluate(
            (m.eval(), tokenizer), args.task, "heldout", n=args.eval, k=1, seed=args.seed
        ).metric("pass@1 (greedy)")
        return {"value": metric.value, "ci95": [round(metric.ci_low, 4), round(metric.ci_high, 4)]}

    out = {"uncompressed": pass1(model)}
    low, high = out["uncompressed"]["ci95"]
    for key, pub in pubs.items():
        clone = copy.deepcopy(model)
        pub.load_into(clone)
        out[key] = pass1(clone)
        out[key]["within_ci_of_uncompressed"] = low <= out[key]["value"] <= high
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--steps", type=int, default=30, help="supervised steps to measure bytes on")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--model-dir",
        type=model_dir_arg,
        default=None,
        help="a local Hugging Face model to publish (default: the demo base model), e.g. "
        "the one `prooftrain models fetch smollm2-135m` caches",
    )
    ap.add_argument(
        "--eval",
        type=int,
        default=0,
        help="held-out problems for the supervised pass@1 proxy (0: skip)",
    )
    ap.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="RL steps per codec for the pass@1 comparison (0: skip)",
    )
    ap.add_argument(
        "--train-eval",
        type=int,
        default=1000,
        help="held-out problems for that comparison (default 1000)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.base_model import ensure_base_model

    model_dir = args.model_dir or ensure_base_model(args.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    result, pubs = measure(model, tokenizer, args)
    topk = result["codecs"]["topk-2%-int8"]["ratio_vs_bf16"]
    result.update(
        {
            "bench": "weights",
            "model": model_dir.name,
            "steps": args.steps,
            "target_ratio": TARGET_RATIO,
            "topk_meets_target": topk >= TARGET_RATIO,
        }
    )
    if args.eval:
        result["sft_proxy"] = sft_proxy(model, tokenizer, pubs, args)
    if args.train_steps <= 0:
        result["pass_at_1"] = None
        result["pass_at_1_note"] = "skipped: pass --train-steps N to run the RL comparison"
    else:
        runs = {key: train_and_eval(key, args.train_steps, args.train_eval) for key in CODECS}
        low, high = runs["fp32"]["ci95"]
        for run in runs.values():
            run["within_ci_of_uncompressed"] = low <= run["value"] <= high
        result["pass_at_1"] = runs
        result["pass_at_1_note"] = (
            f"{args.train_steps} RL steps per codec; fp32 deltas are "
            "lossless (the uncompressed run)"
        )
    emit(result)


if __name__ == "__main__":
    main()
