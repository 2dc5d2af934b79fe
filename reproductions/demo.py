"""K-FAC against SGD on real Fashion-MNIST: a demonstration of about a minute on a CPU.

Trains the same small CNN from the same initial weights on the same batches with momentum SGD
and with K-FAC-preconditioned momentum SGD, then prints a comparison table (training loss, test
accuracy, seconds). Run with ``python -m reproductions.demo [--steps N] [--data-dir D]``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from core import KFACPreconditioner
from core.config import ConfigError
from data.fashion_mnist import fashion_mnist
from data.paths import add_data_dir_argument
from reproductions.common.cli import exit_on_user_error, float_in, positive_int


def small_cnn() -> nn.Module:
    """A LeNet-sized CNN: two conv layers and two linear layers (all preconditioned)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(inplace=True), nn.Linear(64, 10),
    )


@dataclass
class RunResult:
    """Outcome of one optimizer's run."""

    name: str
    losses: list[float]
    test_accuracy: float
    seconds: float

    def loss_at(self, fraction: float) -> float:
        """Mean training loss over the tenth of the steps that ends ``fraction`` of the way
        through the run (less noisy than one step's)."""
        end = max(1, round(fraction * len(self.losses)))
        window = self.losses[max(0, end - max(1, len(self.losses) // 10)):end]
        return sum(window) / len(window)

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last tenth of the steps."""
        return self.loss_at(1.0)


def train(name: str, train_set: TensorDataset, test_set: TensorDataset, *, steps: int,
          batch_size: int, lr: float, use_kfac: bool, seed: int = 0) -> RunResult:
    """Train :func:`small_cnn` for ``steps`` steps and evaluate it on ``test_set``.

    Raises:
        ConfigError: if one batch is larger than the training set (no full batch to take).
    """
    if batch_size > len(train_set):
        raise ConfigError("--batch-size", batch_size,
                          f"at most {len(train_set)}, the training set's size")
    torch.manual_seed(seed)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precond = (KFACPreconditioner(model, factor_scaling="kfc", damping=0.03, kl_clip=1e-3, lr=lr,
                                  factor_update_steps=10, inv_update_steps=10)
               if use_kfac else None)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    losses: list[float] = []
    start = time.perf_counter()
    while len(losses) < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if precond is not None:
                precond.step()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return RunResult(name, losses, accuracy, seconds)


def comparison_table(results: list[RunResult]) -> str:
    """A markdown table of the runs: training loss a quarter and half way through and at the
    end (a second-order method's lead per step shows early, before both runs level off),
    test accuracy and time."""
    lines = ["| optimizer | train loss at 1/4 | at 1/2 | final train loss | test accuracy "
             "| seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.loss_at(0.25):.4f} | {r.loss_at(0.5):.4f} | "
                     f"{r.final_loss:.4f} | {100 * r.test_accuracy:.2f}% | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300,
                        help="training steps per optimizer")
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="examples per step")
    parser.add_argument("--lr", type=float_in(0.0, low_inclusive=False), default=0.05,
                        help="SGD learning rate (both runs)")
    add_data_dir_argument(parser)
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        train_set = fashion_mnist(train=True, root=args.data_dir)
        test_set = fashion_mnist(train=False, root=args.data_dir)
        results = [
            train(name, train_set, test_set, steps=args.steps, batch_size=args.batch_size,
                  lr=args.lr, use_kfac=use_kfac)
            for name, use_kfac in (("SGD (momentum 0.9)", False), ("K-FAC + SGD", True))
        ]
    print(f"\nFashion-MNIST, small CNN, {args.steps} steps of batch {args.batch_size}, "
          "same seed and batches:\n")
    print(comparison_table(results))


if __name__ == "__main__":
    main()
