"""KVSERVE_CPU_THREADS_BIND: torch's OpenMP threads pinned one per core of a process's share.

Each case runs in a child process: a pin would otherwise hold for the rest of the test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import cpu

_CHILD = """
import json, os, sys
import torch
from kvserve.kernels import cpu
torch.set_num_threads(int(sys.argv[1]))
chosen = cpu.bind_threads_to_share(int(sys.argv[2]), int(sys.argv[3]))
a = torch.randn(512, 512)
for _ in range(10):
    (a @ a).sum()  # torch's own parallel regions, on the team that was pinned
masks = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list"))
    masks.append(line.split(":")[1].strip())
print(json.dumps({"chosen": chosen, "masks": masks}))
"""


def _run(num_threads: int, share: int, num_shares: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(num_threads), str(share), str(num_shares)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _needs_library_and_cores():
    if not cpu.available(torch.float32):
        pytest.skip("no C compiler here: nothing to pin threads with")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process that may run on 2 cores")


def test_each_thread_of_the_team_is_pinned_to_its_own_core():
    cores = sorted(os.sched_getaffinity(0))
    result = _run(2, 0, 1)
    assert result["chosen"] == cores[:2]
    # The caller and torch's second OpenMP thread each hold one core; the rest keep the mask.
    assert str(cores[0]) in result["masks"] and str(cores[1]) in result["masks"]


def test_the_second_share_takes_the_next_cores():
    cores = sorted(os.sched_getaffinity(0))
    result = _run(1, 1, 2)
    assert result["chosen"] == [cores[1]]
    assert str(cores[1]) in result["masks"]


def test_more_threads_than_cores_pins_nothing():
    num_cores = len(os.sched_getaffinity(0))
    result = _run(num_cores, 0, 2)  # two shares of every core: they would overlap
    assert result["chosen"] is None
    assert all("-" in mask or "," in mask for mask in result["masks"])
