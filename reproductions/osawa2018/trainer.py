"""One update of the paper's recipe, and evaluation, for one process of a (possibly DDP) run.

An update: learning rate from the polynomial schedule at the current fractional epoch; for each of
the accumulation micro-batches, running mixup and random erasing, forward, soft-target
cross-entropy divided by the accumulation steps, backward (DDP synchronises only on the last
micro-batch); L2 term added to the Conv/Linear gradients; K-FAC (``kfc`` factors, ``pi``
damping split, Cholesky, ``λ = max(λ, wd)``, no KL clip, factors of the current batch only,
relaxed update intervals, the configured distribution strategy) on Conv/Linear layers and the
Fisher block of BatchNorm; heavy-ball momentum with momentum adjustment; weight rescaling.

An update whose gradients are not finite (a NaN or Inf activation, a diverged loss) is skipped:
the preconditioners discard what they captured, the optimizer does not step, and the BatchNorm
statistics and the mixup memory go back to what they were before it; the step is counted
(``skipped_steps``) and reported, and training continues with the next batch.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from core import KFACPreconditioner
from core.batchnorm import BatchNormPreconditioner
from core.distributed import DistributedStrategy, Ledger
from reproductions.osawa2018.config import OsawaConfig
from reproductions.osawa2018.erasing import RandomErasing
from reproductions.osawa2018.mixup import RunningMixup
from reproductions.osawa2018.models import build_model
from reproductions.osawa2018.momentum import HeavyBallSGD
from reproductions.osawa2018.rescaling import add_weight_decay, rescale_weights, rescaled_weights
from reproductions.osawa2018.schedule import IntervalSchedule, PolynomialDecay, epoch_at


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sum ``values`` over all ranks (returned unchanged in a single process)."""
    if not dist.is_available() or not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


class OsawaTrainer:
    """Model, optimizer, preconditioners and augmentation of one run on one process.

    Args:
        config: The run configuration.
        num_classes: Classes of the data set.
        in_channels: Image channels of the data set.
        dataset_size: Training examples ``N`` (epochs are counted in them).
        device: Where this process computes.
        world_size: Processes in the run (DDP when > 1).

    Attributes:
        step: Updates done so far (skipped ones included).
        skipped_steps: Updates skipped for non-finite gradients.
        accumulation_steps: Micro-batches per update on this process.
    """

    def __init__(self, config: OsawaConfig, *, num_classes: int, in_channels: int,
                 dataset_size: int, device: torch.device, world_size: int = 1) -> None:
        self.config = config
        self.device = device
        self.dataset_size = dataset_size
        self.accumulation_steps = config.accumulation_steps(world_size)
        self.model = build_model(config.model, num_classes, in_channels, config.width).to(device)
        self.net: torch.nn.Module = self.model
        if world_size > 1:
            self.net = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.weights = rescaled_weights(self.model)
        self.optimizer = HeavyBallSGD(self.model.parameters(), lr=config.lr,
                                      momentum=config.momentum,
                                      adjust_momentum=config.adjust_momentum)
        self.lr_schedule = PolynomialDecay(config.lr, config.lr_decay_start_epoch,
                                           config.lr_end_epoch, config.lr_power)
        self.intervals = IntervalSchedule.from_epochs(config.factor_update_intervals,
                                                      dataset_size / config.batch_size)
        self.kfac: KFACPreconditioner | None = None
        self.bn: BatchNormPreconditioner | None = None
        if config.optimizer == "kfac":
            self.kfac = KFACPreconditioner(
                self.net, factor_scaling="kfc", damping_split="pi", inverse_method="cholesky",
                damping=config.effective_damping, factor_decay=config.factor_decay,
                factor_update_steps=self.intervals, inv_update_steps=self.intervals,
                kl_clip=None, accumulation_steps=self.accumulation_steps,
                strategy=config.strategy, assignment=config.assignment,
                precondition_dtype=config.precondition_dtype,
                precondition_dtype_tolerance=config.precondition_dtype_tolerance)
            if config.bn_fisher != "none":
                self.bn = BatchNormPreconditioner(
                    self.net, mode=config.bn_fisher,
                    damping=config.bn_damping_scale * config.damping,  # no L2 on BN: no max
                    factor_decay=config.factor_decay, update_steps=self.intervals,
                    accumulation_steps=self.accumulation_steps,
                    communicator=getattr(self.kfac.strategy, "communicator", None))
        self.mixup = (RunningMixup(config.mixup_alpha, num_classes, config.running_mixup)
                      if config.mixup_alpha > 0 else None)
        self.erasing = (RandomErasing(config.erasing_rate, tuple(config.erasing_area),
                                      config.erasing_min_aspect)
                        if config.erasing_rate > 0 else None)
        self.step = 0
        self.skipped_steps = 0

    @property
    def epoch(self) -> float:
        """Fractional epochs done."""
        return epoch_at(self.step, self.config.batch_size, self.dataset_size)

    def augment(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Running mixup (with erasing applied to the mixed batch) or erasing alone.

        Returns:
            The inputs and the targets (soft with mixup, the labels otherwise).
        """
        if self.mixup is not None:
            return self.mixup(x, labels, transform=self.erasing)
        return (x if self.erasing is None else self.erasing(x)), labels

    def train_step(self, micro_batches: list[tuple[Tensor, Tensor]]) -> dict[str, float]:
        """One update from this process's micro-batches (skipped if the gradients are not finite).

        Returns:
            ``loss`` and ``train_accuracy`` over the global batch, ``lr`` and the ``momentum``
            applied.
        """
        if len(micro_batches) != self.accumulation_steps:
            raise ValueError(f"expected {self.accumulation_steps} micro-batches, "
                             f"got {len(micro_batches)}")
        lr = self.lr_schedule(self.epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.net.train()
        buffers = [b.clone() for b in self.model.buffers()]
        remembered = None if self.mixup is None else self.mixup.previous
        loss_sum, correct, count = 0.0, 0.0, 0.0
        for index, (x, labels) in enumerate(micro_batches):
            x, labels = x.to(self.device), labels.to(self.device)
            inputs, targets = self.augment(x, labels)
            last = index == len(micro_batches) - 1
            sync = nullcontext() if last or self.net is self.model else self.net.no_sync()
            with sync:
                logits = self.net(inputs)
                loss = F.cross_entropy(logits, targets)
                (loss / self.accumulation_steps).backward()
            loss_sum += float(loss.detach()) * len(labels)
            correct += float((logits.argmax(1) == labels).sum())
            count += len(labels)
        finite = self.gradients_finite()
        add_weight_decay(self.weights, self.config.weight_decay)
        if self.kfac is not None:
            self.kfac.step()
        if self.bn is not None:
            self.bn.step()
        if finite:
            self.optimizer.step()
            if self.config.weight_rescaling:
                rescale_weights(self.weights)
        else:
            with torch.no_grad():
                for buffer, before in zip(self.model.buffers(), buffers, strict=True):
                    buffer.copy_(before)
            if self.mixup is not None:
                self.mixup.previous = remembered
            self.skipped_steps += 1
            warnings.warn(f"step {self.step + 1}: non-finite gradients, update skipped "
                          f"({self.skipped_steps} so far)", RuntimeWarning, stacklevel=2)
        self.step += 1
        loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], self.device)
        return {"loss": loss_sum / count, "train_accuracy": correct / count, "lr": lr,
                "momentum": float(self.optimizer.param_groups[0]["last_momentum"])}

    def gradients_finite(self) -> bool:
        """Whether every gradient is finite (the same answer on every rank once DDP reduced them).
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """Loss and accuracy on this process's shard of the test set, summed over ranks."""
        self.model.eval()
        loss_sum, correct, count = 0.0, 0.0, 0.0
        for x, labels in loader:
            x, labels = x.to(self.device), labels.to(self.device)
            logits = self.model(x)
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += float((logits.argmax(1) == labels).sum())
            count += len(labels)
        self.model.train()
        loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], self.device)
        return {"test_loss": loss_sum / count, "test_accuracy": correct / count}

    def metrics(self) -> dict[str, float]:
        """Skipped updates and the preconditioners' per-step metrics (stage times, damping,
        failures)."""
        out: dict[str, float] = {"skipped_steps": float(self.skipped_steps)}
        if self.kfac is not None:
            out.update({f"kfac/{k}": v for k, v in self.kfac.metrics().items()})
        if self.bn is not None:
            out.update(self.bn.metrics())
        return out

    def stage_times(self) -> dict[str, float]:
        """Seconds per K-FAC stage over the run, the part before a resume included (empty
        without K-FAC)."""
        return {} if self.kfac is None else dict(self.kfac.timer.totals)

    def _recording_ledger(self) -> Ledger | None:
        """The ledger K-FAC's collectives are recorded in (None unless K-FAC runs distributed)."""
        if self.kfac is None or not isinstance(self.kfac.strategy, DistributedStrategy):
            return None
        return self.kfac.strategy.communicator.ledger

    def ledger(self) -> dict[str, dict[str, int]] | None:
        """This rank's communication per stage over the run, the part before a resume included:
        ``{stage: {collectives, elements, bytes, traffic_bytes}}`` (None unless K-FAC runs
        distributed)."""
        live = self._recording_ledger()
        if live is None:
            return None
        return {stage: vars(counts) for stage, counts in live.summary().items()}

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, preconditioner and mixup states, the step, and the stage times and
        communication so far, which the results report for the whole run (this rank's view)."""
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "stage_time_s": self.stage_times(),
            "ledger": None if (live := self._recording_ledger()) is None else live.state_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "kfac": None if self.kfac is None else self.kfac.state_dict(),
            "bn": None if self.bn is None else self.bn.state_dict(),
            "mixup": None if self.mixup is None else self.mixup.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same configuration."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.kfac is not None:
            self.kfac.load_state_dict(state["kfac"])
        if self.bn is not None:
            self.bn.load_state_dict(state["bn"])
        if self.mixup is not None:
            self.mixup.load_state_dict(state["mixup"])
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.kfac is not None:  # (checkpoints of older revisions carry neither)
            self.kfac.timer.reset()
            self.kfac.timer.totals.update(state.get("stage_time_s") or {})
        live = self._recording_ledger()
        if live is not None and state.get("ledger"):  # saved totals stand for the entries
            live.load_state_dict(state["ledger"])
