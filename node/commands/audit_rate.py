"""``prooftrain audit-rate``: how often must rollouts be audited to catch a cheater?"""

from __future__ import annotations

import argparse
import json
import math


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit-rate",
        help="audit rate needed to catch a cheater with given confidence",
        description="A contributor cheats on a fraction f of its rollouts; each rollout is audited "
        "independently with probability p, and an audited cheat is caught. Over n rollouts it "
        "escapes with probability (1 - p f)^n. Prints the smallest p with detection probability "
        ">= c, and the rates the node's reputation policy gives a new key as it builds a record.",
    )
    p.add_argument("--cheat-fraction", type=float, required=True, help="f in (0, 1]")
    p.add_argument("--rollouts", type=int, required=True, help="n >= 1")
    p.add_argument("--confidence", type=float, default=0.99, help="c in (0, 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def required_rate(f: float, n: int, c: float) -> float:
    """Smallest p with 1 - (1 - p f)^n >= c (may exceed 1: then even p = 1 is not enough)."""
    return (1.0 - (1.0 - c) ** (1.0 / n)) / f


def run(args: argparse.Namespace) -> int:
    from ledger.reputation import ReputationParams, apply, audit_rate, initial
    from verify.errors import ConfigError

    f, n, c = args.cheat_fraction, args.rollouts, args.confidence
    if not (0 < f <= 1 and n >= 1 and 0 < c < 1):
        raise ConfigError("need 0 < cheat-fraction <= 1, rollouts >= 1, 0 < confidence < 1")
    p = required_rate(f, n, c)
    params = ReputationParams()
    state = initial(b"\x00" * 32, params)
    schedule = {}
    for audits in range(0, 257):
        if audits in (0, 1, 4, 16, 64, 256):
            schedule[audits] = audit_rate(state, params)
        state = apply(state, params, 1, 0, 0, 0, audits)
    detect_new = 1 - (1 - min(1.0, schedule[0]) * f) ** n
    result = {
        "cheat_fraction": f,
        "rollouts": n,
        "confidence": c,
        "required_audit_rate": min(p, math.inf),
        "achievable": p <= 1.0,
        "new_key_audit_rate": schedule[0],
        "audit_rate_after_honest_audits": schedule,
        "floor_audit_rate": params.min_audit_rate,
        "detection_at_floor_rate": 1 - (1 - params.min_audit_rate * f) ** n,
        "detection_at_new_key_rate": detect_new,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"to catch a contributor cheating on {f:.1%} of rollouts within {n} rollouts "
        f"with probability {c:.1%}:"
    )
    print(
        f"  audit rate needed     {p:.4f}"
        + ("" if p <= 1 else "  (not achievable: more rollouts needed)")
    )
    print(f"  a new key is audited  {schedule[0]:.4f}")
    for k, rate in schedule.items():
        print(f"  after {k:>3} passed audits: rate {rate:.4f}")
    print(
        f"  detection at the floor rate {params.min_audit_rate}: "
        f"{result['detection_at_floor_rate']:.4f}"
    )
    return 0
