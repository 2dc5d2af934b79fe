"""scripts/gpu_check.sh, the one command a session lent a GPU runs, works end to end.

Here it runs on the CPU with a quick benchmark (the device tests' ``cuda`` cases skip), which
checks what it writes, not the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check(out: Path, workloads: str, bench_args: str) -> subprocess.CompletedProcess[str]:
    """The script on the CPU, with one-shape factor tables and a quick benchmark."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DEVICE": "cpu",
           "GRAM_ARGS": "--shapes 64x32 --repeats 1",
           "CONV_ARGS": "--shapes 2x8x6 --repeats 1", "WORKLOADS": workloads,
           "BENCH_ARGS": bench_args}
    return subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_gpu_check_runs_the_device_tests_and_the_benchmark(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, "tiny-cnn", "--quick --in-process --methods kfac-eigen")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bench tiny-cnn: exit 0" in done.stdout
    assert "torch " in (tmp_path / "environment.txt").read_text()
    tests = (tmp_path / "tests.log").read_text()
    assert " passed" in tests and "failed" not in tests
    assert "| 64 x 32 |" in (tmp_path / "gram_blocks.md").read_text()
    assert "| 2 x 8 x 6 |" in (tmp_path / "conv_gram.md").read_text()
    bench = json.loads((tmp_path / "bench_cpu_tiny-cnn.json").read_text())
    assert {(r["workload"], r["method"]) for r in bench["rows"]} == {("tiny-cnn", "kfac-eigen")}


def test_gpu_check_fails_when_the_benchmark_does(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, "no-such-workload", "--quick --in-process")
    assert done.returncode == 1
    assert "bench no-such-workload: exit 2" in done.stdout
