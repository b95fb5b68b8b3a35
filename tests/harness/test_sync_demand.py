"""A synchronous trainer's demand (``harness.simulation.SyncDemand``) and the setup latency
(``network.setup_latency``) that both modes pay."""

from __future__ import annotations

from pathlib import Path

from harness.events import TrainStep, Verdict, read_run_dir
from harness.run import run_scenario
from harness.scenario import load_scenario
from harness.simulation import SyncDemand

SYNC = """
name = "sync-demand"
seed = 0
[task]
name = "arithmetic"
train_pool = 256
heldout = 32
[[population.groups]]
strategy = "honest"
count = 4
uploads = 2
[network]
setup_latency = true
[network.profiles.default]
latency = { model = "constant", params = { ms = 200 } }
[validator]
group_size = 4
max_tokens = 8
[trainer]
steps = 3
batch_groups = 2
eval_every = 3
eval_problems = 16
mode = "sync"
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def test_demand_counts_what_is_claimed_until_it_is_refused_or_given_up() -> None:
    d = SyncDemand(batch=3)
    assert d.open(0, 0.0) == 3
    d.claim(0)
    d.claim(0, lost_at=5.0)  # lost on the wire: counted until its sender gives it up
    assert d.open(0, 1.0) == 1 and d.next_give_up() == 5.0
    d.release(0)  # a refused group frees its place
    assert d.open(0, 1.0) == 2
    assert d.open(0, 5.0) == 3 and d.next_give_up() is None
    assert d.open(1, 5.0) == 3  # each version has its own demand


def test_sync_hands_out_no_group_that_goes_stale_and_pays_the_setup(tmp_path: Path) -> None:
    path = tmp_path / "sync.toml"
    path.write_text(SYNC)
    out = run_scenario(load_scenario(path), tmp_path / "out", progress=False)
    events = read_run_dir(out)
    verdicts = [e for e in events if isinstance(e, Verdict)]
    steps = [e for e in events if isinstance(e, TrainStep)]
    assert [e.step for e in steps] == [1, 2, 3]
    # Rewards are 0 or 1: a mean strictly between is a group with a learning signal. Every such
    # accepted group is trained on; none was generated for a version already left behind.
    usable = [v for v in verdicts if v.accepted and v.reward is not None and 0 < v.reward < 1]
    assert len(usable) == sum(e.samples for e in steps) // 4
    # its request and answer (200 ms each) precede generation, and its upload follows it; a
    # contributor starts with the base weights, so the first group downloads none
    assert min(v.t for v in verdicts) >= 0.6
