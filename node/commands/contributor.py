"""``prooftrain contributor``: generate, commit and sign rollouts for a validator."""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from node.commands import model_dir_arg

if TYPE_CHECKING:
    from node.contributor import Contributor


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "contributor",
        help="answer a validator's assignments with signed rollouts",
        description="Register with a validator, then loop: take an assignment, load the assigned "
        "policy version (the base model, or a trainer-signed chain of compressed deltas, verified "
        "before use), generate the group with the verifiable sampler, commit and sign every "
        "rollout, submit. With --uploads N > 1 up to N groups upload in the background while the "
        "next one generates. Unacknowledged groups are kept in --state-dir and resubmitted after a "
        "restart, never regenerated.",
    )
    p.add_argument("--validator", required=True, help="validator URL, e.g. http://127.0.0.1:8470")
    p.add_argument(
        "--key", type=Path, required=True, help="contributor key file (prooftrain keys new)"
    )
    p.add_argument(
        "--model",
        type=model_dir_arg,
        required=True,
        help="local base model directory (policy version 0)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where progress is kept; one process per directory (default: "
        "runs/contributor/<key fingerprint>)",
    )
    p.add_argument("--name", default="", help="a name recorded with the registration")
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="stop after this many groups (default: run forever)",
    )
    p.add_argument(
        "--backend", default="transformers", help="generation backend (transformers, vllm)"
    )
    p.add_argument(
        "--device",
        default=None,
        help="torch device (transformers: default cpu; vllm: a CUDA device, default cuda)",
    )
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="generation precision"
    )
    p.add_argument(
        "--uploads",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="groups that may be uploading while the next one generates; 1 = one at a time "
        "(every generated group is kept in --state-dir before it is sent)",
    )
    p.set_defaults(func=run)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (1 = one group at a time), got {n}")
    return n


def _stop_on_signals(contributor: Contributor) -> None:
    """The first SIGTERM or SIGINT asks for a clean stop (the uploads in flight are answered,
    nothing generated is lost); a second one stops at once."""

    def handler(signum: int, _frame: object) -> None:
        contributor.log(
            f"{signal.Signals(signum).name}: stopping after the uploads in flight "
            "(send it again to stop at once)"
        )
        contributor.stop.set()
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def run(args: argparse.Namespace) -> int:
    from node.client import ValidatorClient
    from node.commands.keys import load_key_file
    from node.contributor import Contributor
    from node.contributor_state import default_state_dir, lock_state_dir

    key = load_key_file(args.key)
    state_dir = args.state_dir or default_state_dir(key.public)
    lock_state_dir(state_dir)  # before registering: a second process on it stops here
    client = ValidatorClient(args.validator, key)
    try:
        added = _first_contact(lambda: client.register(args.name))
        print(
            f"{'registered' if added else 'already registered'} as {key.public.fingerprint}; "
            f"state in {state_dir}"
        )
        contributor = Contributor(
            client,
            key,
            args.model,
            state_dir,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            uploads=args.uploads,
        )
        _stop_on_signals(contributor)
        stats = contributor.run(args.groups)
    finally:
        client.close()
    print(
        f"submitted {stats.submitted} groups: {stats.accepted} rollouts accepted, "
        f"{stats.rejected} rejected {stats.reasons or ''}"
    )
    return 0


def _first_contact(register: Callable[[], bool], idle_s: float = 1.0) -> bool:
    """Register, trying again while the validator cannot be reached (not started yet,
    restarting, the link down), with one line per try."""
    from node.client import ValidatorUnreachable

    while True:
        try:
            return register()
        except ValidatorUnreachable as exc:
            print(f"{exc}; trying again in {idle_s:g} s", flush=True)
            time.sleep(idle_s)
