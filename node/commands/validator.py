"""``prooftrain validator``: run a validator node."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validator",
        help="run a validator node (HTTP service on loopback by default)",
        description="Run a validator node: assign work, admit signed rollout groups, compute "
        "rewards, spot-check a keyed random subset, record verdicts in the ledger and serve "
        "accepted samples to the trainer. Settings come from a TOML file "
        "(see configs/validator.toml); unknown keys are an error.",
    )
    p.add_argument("--config", type=Path, default=None, help="validator TOML (default: built-in defaults)")
    p.add_argument("--host", default=None, help="override node.host")
    p.add_argument("--port", type=int, default=None, help="override node.port")
    p.add_argument("--check", action="store_true", help="load everything, print a summary, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from node.config import ValidatorConfig, load
    from node.validator.build import build_validator, trainer_key
    from node.validator.server import server_config, settle_heap, share_the_interpreter
    from node.validator.service import create_app

    overrides = {k: v for k, v in (("node.host", args.host), ("node.port", args.port)) if v is not None}
    cfg = load(ValidatorConfig, args.config, overrides)
    validator = build_validator(cfg)
    print(f"validator key {validator.key.public.hex()}")
    print(f"ledger        {cfg.node.ledger} ({validator.ledger.size()} entries)")
    print(f"policy        {cfg.policy.model_dir} (version {validator.versions.current})")
    print(f"admission     {cfg.node.admission_threads} thread(s), "
          f"{cfg.node.admission_processes or 'no'} precheck process(es)")
    if args.check:
        return 0
    logging.basicConfig(level=logging.INFO)
    app = create_app(validator, trainer_key(cfg))
    settle_heap()  # the model and libraries stay loaded: keep full collections off them
    share_the_interpreter()
    print(f"listening on http://{cfg.node.host}:{cfg.node.port}")
    server = uvicorn.Server(server_config(app, cfg.node.host, cfg.node.port, log_level="warning"))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:  # the port was taken, or the app failed to start (uvicorn said why)
        print("the validator did not start")
        return 1
    return 0
