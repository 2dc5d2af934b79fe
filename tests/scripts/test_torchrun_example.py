"""scripts/torchrun_example.py under torchrun with 2 gloo processes: every strategy trains, prints
its ledger, and the job ends cleanly (a rank aborting at exit failed 4 of 10 such runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_strategy_runs_on_two_processes_and_the_job_ends_cleanly() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        # --standalone: the rendezvous store binds a free port itself (a port chosen here
        # could be taken before the job binds it)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "scripts/torchrun_example.py", "--strategy", "all",
         "--steps", "2", "--examples", "256"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for strategy in ("d-kfac", "comm-opt", "hybrid-opt", "mem-opt", "osawa", "dp-kfac"):
        assert f"=== {strategy}: 2 process(es)" in done.stdout
    assert "factor_comm" in done.stdout and "terminate called" not in done.stderr


def test_too_few_examples_for_one_batch_is_refused() -> None:
    done = subprocess.run([sys.executable, "scripts/torchrun_example.py", "--examples", "128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--examples (128) must exceed --batch-size (128)" in done.stderr
