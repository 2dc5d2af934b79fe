"""Running the Osawa et al. entry point as a user would, and injecting process faults into it.

The runs train a width-4 ResNet on a generated 3-class image folder (24 training images) for 12
updates of 12 images, with the whole recipe on (K-FAC, BatchNorm Fisher, running mixup, random
erasing, relaxed factor updates from epoch 2, polynomial decay), an evaluation every 2 epochs and a
checkpoint after every update, so a fault can land at any step and the stream crosses epochs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reproductions.common.checkpoint import checkpoint_step, list_checkpoints

REPO = Path(__file__).resolve().parents[2]

SETTINGS: dict[str, Any] = {
    "name": "reliability", "data": "image-folder", "image_size": 16, "width": 4,
    "batch_size": 12, "micro_batch_size": 6, "epochs": 6, "eval_every_epochs": 2,
    "eval_batch_size": 24, "lr_decay_start_epoch": 1, "lr_decay_end_epoch": 6,
    "factor_update_intervals": [[0, 1], [2, 2]],
}
"""``--set`` values of the tiny run (12 updates); the rest is the ``fmnist_default`` recipe."""

STEPS = 12
"""Updates in the tiny run."""

TIMEOUT_S = 180.0
"""Upper bound of every wait on a process in these tests."""


def set_args(settings: dict[str, Any] = SETTINGS) -> list[str]:
    """``--set KEY=VALUE ...`` for ``settings`` (strings bare, everything else as JSON)."""
    return ["--set", *(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                       for k, v in settings.items())]


def train_args(out: Path, folder: Path, *extra: str,
               settings: dict[str, Any] = SETTINGS) -> list[str]:
    """Arguments of ``reproductions.osawa2018.train`` for the tiny run into ``out``."""
    return ["--out", str(out), "--image-folder", str(folder), "--checkpoint-every", "1",
            "--wandb", "disabled", "--no-progress", *set_args(settings), *extra]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a spawned run: this checkout first on the path, one thread."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "disabled", **extra}


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python <args>`` in its own process group, stdout and stderr into ``log``."""
    with log.open("wb") as handle:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env or child_env(),
                                stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group of ``process`` (it and everything it started) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=TIMEOUT_S)


def wait_until(condition: Callable[[], bool], process: subprocess.Popen, what: str,
               timeout: float = TIMEOUT_S) -> None:
    """Poll ``condition`` every 5 ms until it holds.

    Raises:
        AssertionError: ``process`` ended first, or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.005)


def resumed_steps(log: str) -> list[int]:
    """The steps the entry point said it resumed from, in ``log``'s order."""
    return [int(step) for step in re.findall(r"resuming from the checkpoint of step (\d+)", log)]


def newest_step(directory: Path) -> int:
    """The newest checkpoint's step in ``directory`` (-1 without one)."""
    found = list_checkpoints(directory)
    return checkpoint_step(found[-1]) if found else -1


def final_state(out: Path, rank: int = 0, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Model parameters and buffers of ``rank``'s newest checkpoint under ``out``, which must
    be the one of ``step``."""
    newest = list_checkpoints(out / "checkpoints" / f"rank-{rank}")[-1]
    assert checkpoint_step(newest) == step, f"{newest} is not the checkpoint of step {step}"
    return torch.load(newest, weights_only=True)["trainer"]["model"]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same keys, and every tensor equal bit for bit."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), f"{key} differs"
