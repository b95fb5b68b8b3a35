"""The in-process network (``node.local``) with adversarial contributors.

:class:`AdversarialNetwork` plays each name in ``LocalSettings.adversaries`` with
that strategy of ``harness.adversaries``, one extra contributor each, beside
the honest ones; everything else is ``node.local.LocalNetwork``.
"""

from __future__ import annotations

from harness.adversaries.base import Context, make_strategy
from node.local import LocalNetwork, RegistryOracle
from rollout.backends import TransformersBackend
from verify.keys import SigningKey
from verify.types import SignedAssignment, WorkAssignment


class AdversarialNetwork(LocalNetwork):
    """An in-process network whose extra contributors play ``harness.adversaries`` strategies."""

    def check_strategy(self, name: str) -> None:
        make_strategy(name)  # ConfigError names the known strategies

    def answer_as(
        self, strategy: str, key: SigningKey, sealed: SignedAssignment, a: WorkAssignment
    ) -> bytes:
        ctx = Context(
            key,
            TransformersBackend(self.registry[a.policy_version]),
            self.codec,
            self.validator.key.public,
            oracle=RegistryOracle(self.registry),
        )
        raw = make_strategy(strategy).answer(ctx, sealed)
        # A group kept back (selective submission) is never sent: an empty body is refused
        # before anything is recorded, and the assignment expires as if nothing had arrived.
        return b"" if raw is None else raw
