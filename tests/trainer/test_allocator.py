"""Freed memory stays in a training process: the next step's buffers take no page faults."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
import json, resource, sys
import torch
if sys.argv[1] == "retain":
    from trainer.allocator import retain_freed_memory
    assert retain_freed_memory() and retain_freed_memory()
faults = []
for _ in range(5):  # a step: 120 MiB of activations in 4 MiB tensors and one 64 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # block, written, then freed
    step = [torch.empty(1 << 20).fill_(1.0) for _ in range(30)]
    step.append(torch.empty(16 << 20).fill_(1.0))
    del step
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_a_step_after_the_first_reuses_freed_pages() -> None:
    pages = (30 * (4 << 20) + (64 << 20)) // 4096  # one step's 184 MiB in 4 KiB pages
    default, retained = _faults("default"), _faults("retain")
    assert min(default[0], retained[0]) > pages * 0.9  # the first step faults its pages in
    # glibc's defaults give the freed top of the heap back and unmap the block above the mmap
    # threshold: the next step faults all of it in again (47103 of 47104 pages in the second
    # step with glibc 2.36), and every later step the 64 MiB block at least
    assert default[1] > pages * 0.9
    assert min(default[1:]) > (64 << 20) // 4096 * 0.9
    # kept: the next two steps reuse most of the pages, then all of them (8193 to 16384
    # faults in each of those two, then none)
    assert max(retained[1:3]) < pages / 2
    assert sum(retained[3:]) < pages / 20
