"""Natural-gradient preconditioning of BatchNorm's scale ``γ`` and shift ``β`` (Osawa et al.).

K-FAC's Kronecker factors do not fit BatchNorm, so Osawa et al. precondition its ``2C``
parameters with an exact Fisher block instead, in one of three shapes (``mode=``):

* ``"unit"``: one ``2×2`` block per channel over ``(γ_c, β_c)`` (the unit-wise Fisher);
* ``"diagonal"``: the diagonal of the Fisher, ``2C`` scalars;
* ``"full"``: the whole ``2C×2C`` Fisher of the layer (what the chainerkfac code computes by
  default; its ``diagonalize`` switch gives ``"diagonal"``).

Per example ``n`` and channel ``c``, with ``x̂`` the input normalised by the batch statistics and
``δ = B·gy`` (the per-example output gradient; the loss is a batch mean),
``u_{n,c} = (Σ_t δ_{n,c,t} x̂_{n,c,t}, Σ_t δ_{n,c,t})`` is that example's gradient of ``(γ_c, β_c)``
(``t`` runs over spatial positions). The Fisher block is ``F = (1/B) Σ_n u_n u_nᵀ`` restricted to
the chosen shape; the preconditioned gradient is ``(F + λI)⁻¹ ∇``. Blocks are stored as one batch
of square matrices per layer, ``(K, m, m)``: ``(C, 2, 2)``, ``(2C, 1, 1)`` or ``(1, 2C, 2C)``.

Across processes the batch Fisher blocks of all layers are averaged with one all-reduce, and every
rank inverts and preconditions every BatchNorm layer (``2C`` parameters each: negligible next to
the convolutions' factors).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from core.capture import CaptureHooks, HookSet
from core.config import (
    check_choice,
    check_hyper,
    check_number,
    check_schedulable,
    check_skip_layers,
    hyper_at,
    resolve_interval,
    skipped,
)
from core.distributed.communicator import Communicator
from core.factors import RunningFactor
from core.hyper import Schedulable
from core.inverse import DecompositionError, _with_fp64_retry
from core.layer_base import StepLossScale, autocast_off, cloned, restored
from core.layers import (
    UnsupportedLayerError,
    refuse_flat_sharding,
    refuse_lazy,
    refuse_sharded,
)

BN_FISHER_MODES = ("unit", "diagonal", "full")


def arrange(gamma: Tensor, beta: Tensor, mode: str) -> Tensor:
    """Lay out ``(…, C)`` values of ``γ`` and ``β`` as the block vectors ``(…, K, m)`` of ``mode``.
    """
    if mode == "unit":
        return torch.stack([gamma, beta], dim=-1)
    flat = torch.cat([gamma, beta], dim=-1)
    return flat.unsqueeze(-1) if mode == "diagonal" else flat.unsqueeze(-2)


def split(blocks: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`arrange`: block vectors ``(K, m)`` back to ``(γ, β)`` values."""
    if mode == "unit":
        return blocks[..., 0], blocks[..., 1]
    flat = blocks.flatten(-2)
    return flat.chunk(2, dim=-1)  # type: ignore[return-value]


def normalised(x: Tensor, eps: float) -> Tensor:
    """``x̂ = (x − μ) / sqrt(σ² + ε)`` per channel, with the batch's mean and biased variance.

    This is BatchNorm's training-mode normalisation without its affine part, in fp32 (autocast
    off). One fused kernel does it, several times faster than a strided variance over the
    non-channel dimensions followed by separate subtract and multiply passes; a NaN or Inf in a
    channel's inputs still makes that channel's ``x̂`` non-finite. Throw-away running statistics
    (momentum 0, so never read) select the kernel's fast path: without them, PyTorch's CPU
    kernel falls back to the strided variance.
    """
    channels = x.shape[1]
    running_mean = torch.zeros(channels, device=x.device)
    running_var = torch.ones(channels, device=x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.batch_norm(x.float(), running_mean, running_var, training=True, momentum=0.0,
                            eps=eps)


def per_example_grads(x_hat: Tensor, gy: Tensor) -> tuple[Tensor, Tensor]:
    """Per-example gradients of ``γ`` and ``β``, ``(B, C)`` each, from ``x̂`` and ``δ``."""
    n, c = gy.shape[:2]
    gy, x_hat = gy.reshape(n, c, -1), x_hat.reshape(n, c, -1)
    return (gy * x_hat).sum(-1), gy.sum(-1)


def fisher_blocks(x_hat: Tensor, gy: Tensor, mode: str, grad_scale: float = 1.0) -> Tensor:
    """``(1/B) Σ_n u_n u_nᵀ`` in the block shape of ``mode``, from ``x̂`` and ``δ`` of one batch.

    ``δ = grad_scale · gy``; ``u`` is linear in ``δ``, so the scale enters the small result
    squared instead of rewriting the whole gradient tensor.
    """
    u = arrange(*per_example_grads(x_hat, gy), mode)  # (B, K, m)
    return torch.einsum("nki,nkj->kij", u, u) * (grad_scale**2 / u.shape[0])


def damped_block_inverse(blocks: Tensor, damping: float, dtype: torch.dtype, *,
                         fp64_retry: bool = True) -> Tensor:
    """``(F + λI)⁻¹`` of a batch of symmetric blocks by Cholesky (retried in fp64 on failure,
    unless ``fp64_retry`` is False: a batch of several layers' blocks is retried layer by
    layer instead, so that the others keep their fp32 results).

    Raises:
        DecompositionError: if a block is not positive definite (even in fp64, with the retry).
    """

    def invert(m: Tensor) -> tuple[Tensor]:
        eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
        chol, info = torch.linalg.cholesky_ex(m + damping * eye)
        if bool((info != 0).any()):
            raise RuntimeError("a block is not positive definite")
        inv = torch.cholesky_inverse(chol)
        return ((inv + inv.mT) / 2,)

    (inv,) = _with_fp64_retry("cholesky", invert, blocks, dtype, retry=fp64_retry)
    return inv


def refuse_synchronised(name: str, module: _BatchNorm) -> None:
    """Refuse a SyncBatchNorm that normalises with every rank's statistics: its Fisher blocks
    are built from this rank's batch normalised with this rank's own.

    Raises:
        UnsupportedLayerError: naming the layer and the fixes.
    """
    if not (isinstance(module, nn.SyncBatchNorm) and dist.is_available()
            and dist.is_initialized()):
        return
    group = module.process_group or dist.group.WORLD
    if dist.get_world_size(group) > 1:
        raise UnsupportedLayerError(
            f"{name}: SyncBatchNorm normalises with the statistics of every rank's batch, and "
            "BatchNormPreconditioner builds its Fisher blocks from this rank's alone; use "
            "BatchNorm (per-rank statistics, as Osawa et al.) or skip_layers it")


class BatchNormBlock:
    """Fisher blocks and their damped inverse for one BatchNorm module.

    Args:
        name: The module's qualified name.
        module: An affine BatchNorm module, its parameters materialised (not lazy).
        mode: One of :data:`BN_FISHER_MODES`.
        grad_multiplier: Returns what the captured output gradient is multiplied by besides
            the batch size (the accumulation steps, since the loss is divided by them, over the
            AMP loss scale), read at capture time.
    """

    def __init__(self, name: str, module: _BatchNorm, mode: str,
                 grad_multiplier: Callable[[], float]) -> None:
        refuse_lazy(name, module)  # its blocks' shapes are unknown until a forward pass
        refuse_sharded(name, module)  # its Fisher blocks need every channel's γ and β
        refuse_synchronised(name, module)
        self.name = name
        self.module = module
        self.mode = mode
        self.grad_multiplier = grad_multiplier
        self.fisher = RunningFactor()
        self.inverse: Tensor | None = None
        self.batch: Tensor | None = None
        self.failures = 0
        self.nonfinite_skips = 0

    def capture(self, x: Tensor, gy: Tensor) -> None:
        """Accumulate the Fisher blocks of one forward call from its input and its output's
        gradient (handed over together by the hook on that call's output, so each gradient
        meets its own call's input whatever other calls did).

        The input is a reference autograd keeps for BatchNorm's backward anyway; ``x̂`` is
        computed from it here, as a short-lived temporary: held from forward to backward it
        would add a copy of every BatchNorm input to the memory peak.
        """
        x_hat = normalised(x, self.module.eps)
        self.fisher.accumulate(fisher_blocks(x_hat, gy.float(), self.mode,
                                             gy.shape[0] * self.grad_multiplier()))

    def batch_shape(self) -> tuple[int, ...]:
        """The shape of this layer's Fisher blocks, ``(K, m, m)``."""
        gamma, beta = self.module.weight, self.module.bias
        k, m = arrange(gamma.detach().float(), beta.detach().float(), self.mode).shape
        return (k, m, m)

    def grad_blocks(self) -> Tensor | None:
        """The current gradient of ``(γ, β)`` as block vectors ``(K, m)``, or None."""
        gamma, beta = self.module.weight, self.module.bias
        if gamma.grad is None or beta.grad is None:
            return None
        return arrange(gamma.grad.float(), beta.grad.float(), self.mode)

    def set_grad(self, blocks: Tensor) -> None:
        """Write block vectors back into ``.grad`` of ``γ`` and ``β``."""
        gamma, beta = split(blocks, self.mode)
        for param, value in ((self.module.weight, gamma), (self.module.bias, beta)):
            param.grad = value.reshape(param.shape).to(param.dtype).contiguous()

    def skip_nonfinite(self) -> None:
        """Count and report a non-finite batch (a NaN or Inf activation or gradient), which
        is skipped: the running blocks and the last good inverse stay as they were."""
        self.nonfinite_skips += 1
        warnings.warn(f"{self.name}: non-finite Fisher batch skipped "
                      f"({self.nonfinite_skips} so far)", stacklevel=3)

    def update_inverse(self, damping: float) -> None:
        """Recompute ``(F + λI)⁻¹``; on failure keep the last good inverse and count it."""
        if self.fisher.value is None:
            return
        try:
            self.inverse = damped_block_inverse(self.fisher.value, damping, torch.float32)
        except DecompositionError as err:
            self.failures += 1
            warnings.warn(f"{self.name}: {err}; keeping the last good inverse "
                          f"({self.failures} failures so far)", stacklevel=3)

    def preconditioned(self) -> Tensor | None:
        """``(F + λI)⁻¹ ∇`` as block vectors, or None without a gradient or an inverse (its
        finiteness is the caller's to check, for all layers in one host transfer)."""
        grad = self.grad_blocks()
        if grad is None or self.inverse is None:
            return None
        return torch.einsum("kij,kj->ki", self.inverse, grad)


class BatchNormPreconditioner:
    """Preconditions every affine BatchNorm layer's gradient with its Fisher block.

    Usage: ``loss.backward(); bn.step(); optimizer.step()`` (independent of, and composable with,
    :class:`core.KFACPreconditioner`, which leaves BatchNorm first-order).

    Args:
        model: The model (or its DDP wrapper).
        mode: Fisher block shape, one of :data:`BN_FISHER_MODES`.
        damping: ``λ`` added to the blocks' diagonal (number or callable of the step), > 0.
        factor_decay: Weight of the old running average in [0, 1); 0 uses each batch's blocks.
        update_steps: Update the blocks (and their inverses) every this many steps (int or
            callable of the step, e.g. a relaxed schedule).
        accumulation_steps: Micro-batches per step; the loss is assumed divided by it.
        skip_layers: Module-name regexes and module classes of BatchNorm layers to leave
            first-order.
        grad_scaler: An AMP ``GradScaler`` whose scale is divided out of captured gradients
            (unscale the gradients, ``scaler.unscale_(optimizer)``, before ``step()``).
        communicator: Averages the blocks across ranks and records it in its ledger (stage
            ``bn_factor_comm``); pass K-FAC's (``kfac.strategy.communicator``) to count both in
            one ledger. By default one over the initialised process group (collective: every
            rank builds the preconditioner), or none in one process.

    Raises:
        ConfigError: on an invalid option, naming it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "unit",
        damping: Schedulable[float] = 1e-3,
        factor_decay: Schedulable[float] = 0.0,
        update_steps: Schedulable[int] = 1,
        accumulation_steps: int = 1,
        skip_layers: Sequence[str | type[nn.Module]] = (),
        grad_scaler: Any = None,
        communicator: Communicator | None = None,
    ) -> None:
        check_choice("mode", mode, BN_FISHER_MODES)
        check_skip_layers(skip_layers)
        check_hyper("damping", damping)
        check_hyper("factor_decay", factor_decay)
        check_schedulable("update_steps", update_steps, low=1, integer=True)
        check_number("accumulation_steps", accumulation_steps, low=1, integer=True)
        self.mode = mode
        self.damping = damping
        self.factor_decay = factor_decay
        self.update_steps = update_steps
        self.accumulation_steps = accumulation_steps
        self.loss_scale = StepLossScale(grad_scaler)
        self.steps = 0
        self.last_preconditioned = 0
        refuse_flat_sharding(model)
        self.blocks = []
        half_frozen = []
        for name, module in model.named_modules():
            if (not isinstance(module, _BatchNorm) or not module.affine
                    or skipped(name, module, skip_layers)):
                continue
            trained = (module.weight.requires_grad, module.bias.requires_grad)
            if all(trained):
                self.blocks.append(BatchNormBlock(name, module, mode, self._grad_multiplier))
            elif any(trained):
                half_frozen.append(name)
        if half_frozen:
            warnings.warn(f"BatchNorm layers {', '.join(half_frozen)}: one of γ and β is frozen; "
                          "their Fisher blocks couple the two, so these layers are left "
                          "first-order (skip_layers them to silence this)", stacklevel=2)
        self.communicator = communicator or Communicator.from_torch()
        self._capturing = self._update_due(0)
        self._hooks = HookSet(lambda: [
            CaptureHooks(block.module, on_pair=block.capture, enabled=lambda: self._capturing,
                         name=block.name)
            for block in self.blocks
        ])

    def _update_due(self, step: int) -> bool:
        return step % resolve_interval("update_steps", self.update_steps, step) == 0

    def _grad_multiplier(self) -> float:
        """``accumulation_steps / loss_scale``: undo the loss division and the AMP scale."""
        return self.accumulation_steps / self.loss_scale.get()

    @torch.no_grad()
    def step(self) -> None:
        """Update the Fisher blocks when due, then precondition every layer's gradient."""
        with autocast_off():
            if self._capturing:
                batches = self._average_across_ranks(
                    [block.fisher.take_batch() for block in self.blocks])
                self._update(batches, hyper_at("factor_decay", self.factor_decay, self.steps),
                             hyper_at("damping", self.damping, self.steps))
            self._precondition()
            self._end_step()

    def _update(self, batches: list[Tensor | None], decay: float, damping: float) -> None:
        """Blend each finite batch into its layer's running blocks (a layer no rank ran this
        step keeps its blocks) and invert the updated layers' blocks, all of one size
        together: one host transfer checks every batch, and one inversion (its success
        checked once) serves them all, where three per layer stalled a GPU's kernel
        launches at every BatchNorm layer. Should a batch of them fail, each layer is
        inverted alone, so that only the failing ones keep their last inverse."""
        present = [(block, batch) for block, batch in zip(self.blocks, batches, strict=True)
                   if batch is not None]
        finite = (torch.stack([batch.isfinite().all() for _, batch in present]).tolist()
                  if present else [])
        by_size: dict[int, list[BatchNormBlock]] = {}
        for (block, batch), ok in zip(present, finite, strict=True):
            if not ok:
                block.skip_nonfinite()
                continue
            block.fisher.update(batch, decay)
            by_size.setdefault(batch.shape[-1], []).append(block)
        for group in by_size.values():
            blocks = [cast(Tensor, block.fisher.value) for block in group]  # just updated
            try:
                inverses = damped_block_inverse(torch.cat(blocks), damping, torch.float32,
                                                fp64_retry=False)
            except DecompositionError:
                for block in group:
                    block.update_inverse(damping)
                continue
            for block, inverse in zip(group, inverses.split([len(b) for b in blocks]),
                                      strict=True):
                block.inverse = inverse

    def _precondition(self) -> None:
        """Replace every layer's gradient by its preconditioned one where that is finite in the
        parameters' dtype (the others keep theirs), read for all layers in one host transfer:
        one per layer stalled a GPU's kernel launches at every BatchNorm layer, every step."""
        results = [(block, result) for block in self.blocks
                   if (result := block.preconditioned()) is not None]
        finite = (torch.stack([result.to(block.module.weight.dtype).isfinite().all()
                               for block, result in results]).tolist()  # as written: in fp16
                  if results else [])
        for (block, result), ok in zip(results, finite, strict=True):
            if ok:
                block.set_grad(result)
        self.last_preconditioned = sum(finite)

    def skip_step(self) -> None:
        """Account for a step whose optimizer update was skipped without :meth:`step` running
        (a ``GradScaler`` that found an overflow): the blocks its hooks captured are dropped
        and the step is counted, so schedules stay aligned with K-FAC's."""
        self.discard_pending()
        self._end_step()

    def discard_pending(self) -> None:
        """Forget the blocks the hooks captured since the last step and the loss scale read
        for them (a step that will not be taken)."""
        for block in self.blocks:
            block.fisher.discard_pending()
        self.loss_scale.reset()

    def _end_step(self) -> None:
        self.loss_scale.reset()
        self.steps += 1
        self._capturing = self._update_due(self.steps)

    def _average_across_ranks(self, batches: list[Tensor | None]) -> list[Tensor | None]:
        """Every layer's batch blocks averaged over the ranks that captured it (one all-reduce
        of all of them and of who captured what); None for a layer no rank captured (one in
        ``eval()`` mode, or on a branch not taken). In one process, the batches as they are.
        """
        if not self.blocks or self.communicator.world_size == 1:
            return batches
        shapes = [block.batch_shape() for block in self.blocks]
        device = self.blocks[0].module.weight.device
        flat = torch.cat([torch.zeros(shape, device=device).flatten() if b is None
                          else b.flatten() for b, shape in zip(batches, shapes, strict=True)]
                         + [torch.tensor([float(b is not None) for b in batches],
                                         device=device)])
        with self.communicator.ledger.at_step(self.steps):
            self.communicator.all_reduce(flat, stage="bn_factor_comm")
        counts = flat[-len(batches):].tolist()
        out: list[Tensor | None] = []
        offset = 0
        for shape, count in zip(shapes, counts, strict=True):
            size = math.prod(shape)
            part = flat[offset:offset + size].view(shape)
            out.append(part / count if count else None)
            offset += size
        return out

    def metrics(self) -> dict[str, float]:
        """Layers preconditioned at the last step; decomposition failures and skipped non-finite
        batches so far."""
        return {"bn/preconditioned_layers": float(self.last_preconditioned),
                "bn/decomposition_failures": float(sum(b.failures for b in self.blocks)),
                "bn/nonfinite_skips": float(sum(b.nonfinite_skips for b in self.blocks))}

    def state_dict(self) -> dict[str, Any]:
        """Step count, mode and every layer's running Fisher blocks and inverse (copies)."""
        return {
            "steps": self.steps,
            "mode": self.mode,
            "layers": {b.name: {"fisher": cloned(b.fisher.value),
                                "inverse": cloned(b.inverse), "failures": b.failures,
                                "nonfinite_skips": b.nonfinite_skips}
                       for b in self.blocks},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the mode and layers must match. Blocks captured
        since the last step are dropped (they belong to a step the saved state has not
        seen)."""
        names = sorted(b.name for b in self.blocks)
        if state["mode"] != self.mode or sorted(state["layers"]) != names:
            raise ValueError(f"BatchNorm preconditioner state was saved with mode "
                             f"{state['mode']!r} and layers {sorted(state['layers'])}; this "
                             f"one has {self.mode!r} and {names}")
        for block in self.blocks:
            saved = state["layers"][block.name]
            device = block.module.weight.device
            block.fisher.value = restored(saved["fisher"], device)
            block.inverse = restored(saved["inverse"], device)
            block.failures = int(saved["failures"])
            block.nonfinite_skips = int(saved["nonfinite_skips"])
        self.discard_pending()
        self.steps = int(state["steps"])
        self._capturing = self._update_due(self.steps)

    def remove_hooks(self) -> None:
        """Detach from the model: later forward passes are not captured (the gradients of
        those already run still are, when they arrive; :meth:`discard_pending` drops them)."""
        self._hooks.remove()

    def no_capture(self) -> AbstractContextManager[None]:
        """A context in which forward passes add nothing to the statistics, whenever their
        gradients are taken: an adversarial example's, an input-gradient penalty's or any
        gradient the optimizer will not apply, on a forward pass of its own."""
        return self._hooks.paused()

    def add_hooks(self) -> None:
        """Attach to the model again after :meth:`remove_hooks` (nothing if attached)."""
        self._hooks.add()
