"""The harness generates co-scheduled contributors' groups in one batch and charges each its share."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from harness.adversaries import make_strategy
from harness.adversaries.base import Context, plain_generation
from harness.scenario import ContributorSpec
from harness.simulation import Member, Simulation
from rollout.backends import GeneratedCompletion, GenerationRequest
from verify.keys import SigningKey

KEY = SigningKey.from_seed(b"\x11" * 32)


def _request(prompt: tuple[int, ...] = (3, 4, 5), temperature: float = 1.0) -> GenerationRequest:
    return GenerationRequest(
        prompt, 2, temperature, 0, 1.0, 4, KEY.public.raw, b"\x01" * 32, 7, (1,)
    )


def _completions(tag: int) -> list[GeneratedCompletion]:
    lp = np.zeros(1, np.float32)
    return [GeneratedCompletion(g, (tag,), lp, "length") for g in range(2)]


class _Backend:
    name = "fake"

    def __init__(self) -> None:
        self.alone: list[GenerationRequest] = []
        self.batches: list[list[GenerationRequest]] = []

    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        self.alone.append(request)
        return _completions(0)

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[GeneratedCompletion]]:
        self.batches.append(list(requests))
        return [_completions(i + 1) for i in range(len(requests))]


def _context(backend: _Backend) -> Context:
    return Context(KEY, backend, SimpleNamespace(eos_token_id=1), KEY.public)  # type: ignore[arg-type]


def test_a_prefetched_group_serves_exactly_its_request_once() -> None:
    backend = _Backend()
    ctx = _context(backend)
    plain, greedy = _request(), _request(temperature=0.0)
    ctx.request = lambda a, **changes: dataclasses.replace(plain, **changes)  # type: ignore[method-assign]
    ctx.prefetched[plain] = (_completions(9), 0.25)
    assert ctx.generate(None, temperature=0.0)[0].token_ids == (0,)  # type: ignore[arg-type]
    assert backend.alone == [greedy] and ctx.prefetch_s == 0.0
    assert ctx.generate(None)[0].token_ids == (9,)  # type: ignore[arg-type]
    assert ctx.prefetch_s == 0.25 and not ctx.prefetched
    assert ctx.generate(None)[0].token_ids == (0,)  # type: ignore[arg-type]
    assert backend.alone == [greedy, plain]


def test_strategies_declare_plain_generation() -> None:
    assert plain_generation(make_strategy("honest"))
    assert plain_generation(make_strategy("tampered-logprobs"))
    assert not plain_generation(make_strategy("greedy"))
    assert not plain_generation(make_strategy("wrong-model"))
    assert not plain_generation(make_strategy("replay"))


def _member(i: int, strategy: str, version: int, prompt: tuple[int, ...]) -> Member:
    spec = ContributorSpec(
        id=f"c{i}", strategy=strategy, params={}, network="default", churn=False, uploads=1, seed=i
    )
    ctx = SimpleNamespace(
        prefetched={},
        assignment=lambda sealed: SimpleNamespace(policy_version=version),
        request=lambda a: _request(prompt),
    )
    return Member(spec, KEY, make_strategy(strategy), ctx)  # type: ignore[arg-type]


def test_prefetch_batches_plain_requests_per_version_and_splits_the_time() -> None:
    sim = Simulation.__new__(Simulation)
    backends = {0: _Backend(), 1: _Backend()}
    sim._backend = backends.__getitem__  # type: ignore[method-assign]
    members = [
        _member(0, "honest", 0, (3,)),
        _member(1, "greedy", 0, (4,)),
        _member(2, "honest", 0, (5, 6)),
        _member(3, "honest", 1, (7,)),
        _member(4, "tampered-logprobs", 0, (8,)),
    ]
    sim._prefetch([(m, None, 0.0) for m in members])  # type: ignore[misc]
    # one batch of the three plain requests under version 0; version 1 has one: nothing to share
    assert backends[0].batches == [[_request((3,)), _request((5, 6)), _request((8,))]]
    assert backends[1].batches == [] and backends[0].alone == backends[1].alone == []
    shares = {
        m.spec.id: m.ctx.prefetched[_request(p)][1]
        for m, p in ((members[0], (3,)), (members[2], (5, 6)), (members[4], (8,)))
    }
    assert shares["c0"] == shares["c2"] == shares["c4"] > 0  # equal rows, equal shares
    assert members[0].ctx.prefetched[_request((3,))][0][0].token_ids == (1,)
    assert members[4].ctx.prefetched[_request((8,))][0][0].token_ids == (3,)
    assert members[1].ctx.prefetched == {} and members[3].ctx.prefetched == {}
