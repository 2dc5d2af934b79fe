"""core.host_memory: freed memory kept for reuse, checked by the page faults of reallocation.

Each case runs in a fresh interpreter: the setting is process-wide and would otherwise carry
into every later test.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = 48 * 2**20 // 4096

#: For each phase named on the command line (``default``: glibc as it starts; ``keep`` and
#: ``release``: after ``keep_freed_memory(True / False)``), allocates, writes and frees a 48 MB
#: tensor (above glibc's largest mmap threshold, 32 MiB) six times, and prints the minor page
#: faults of each round.
PROGRAM = """
import json, resource, sys
import torch
from core.host_memory import keep_freed_memory
out = []
for phase in sys.argv[1].split(","):
    applied = None if phase == "default" else keep_freed_memory(phase == "keep")
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(12 * 2**20).fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    out.append({"applied": applied, "faults": faults})
print(json.dumps(out))
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _phases(phases: str) -> list[dict[str, object]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "0",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROGRAM, phases], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _every_round_faults_the_tensor_in(faults: list[int]) -> bool:
    return all(f > PAGES // 2 for f in faults)


@glibc_only
def test_kept_memory_is_reused_without_faulting_it_in_again() -> None:
    (default,) = _phases("default")
    # glibc's default: every round maps the tensor afresh and faults in each of its pages
    assert _every_round_faults_the_tensor_in(default["faults"])  # type: ignore[arg-type]
    (kept,) = _phases("keep")
    faults: list[int] = kept["faults"]  # type: ignore[assignment]
    assert kept["applied"] is True
    # the heap grows (more than once if smaller blocks took part of the freed space
    # meanwhile), then freed blocks are reused, already resident
    assert faults[0] > PAGES // 2 and all(f < 100 for f in faults[3:])


@glibc_only
def test_releasing_returns_what_was_kept() -> None:
    kept, released = _phases("keep,release")
    assert kept["applied"] is True and released["applied"] is True
    assert all(f < 100 for f in kept["faults"][3:])  # type: ignore[index]
    # the kept pages went back to the system: the next tensor faults its memory in again
    assert released["faults"][0] > PAGES // 2  # type: ignore[index]
