"""Per-module-type helpers: captured tensors to factor rows, and the gradient matrix ∇W̄.

Each helper knows one ``nn.Module`` type. It turns the layer input into rows ``ā`` (bias entry
last), the output gradient into rows ``g``, and reads/writes the weight gradient as one matrix
``[∇W | ∇b]`` of shape ``(g_dim, a_dim)``. Factor scaling conventions live in ``core.factors``;
the helpers only report how many examples ``B`` and locations ``L`` (or positions ``T``) the rows
came from, which is all the conventions need.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from core import conv_gram

#: Factor rows that are a copy of the captured tensor (im2col patches, rows with a bias entry,
#: feature-major convolution gradients) are built and multiplied a slice of the batch at a
#: time, about this many bytes of rows per slice: each slice is still in cache when its GEMM
#: reads it, and the one small buffer is reused instead of a fresh allocation of the whole
#: batch's rows (page faults) every step.
ROW_PART_BYTES = 4 * 2**20
#: Fewest rows per slice, so that wide factors keep a deep GEMM (the output is read and
#: written once per slice).
MIN_PART_ROWS = 1024
#: Build a stride-1 convolution's ``A`` factor from shifted views of its padded input
#: (:mod:`core.conv_gram`) whenever that takes clearly fewer FLOPs than the product of its
#: patches (:data:`SHIFTED_FLOP_FRACTION`).
SHIFTED_CONV_GRAM = True
#: The shifted product is used only below this fraction of the patches' FLOPs: it also
#: assembles the ``d × d`` factor block by block and corrects the edges in small GEMMs, passes
#: the patches' one ``syrk`` does not make. On ResNet-18's 3x3 layers at 0.84 of the FLOPs
#: (512 channels at 4x4) it took 0.8-1.2x the patches' time on this project's CPUs, at 0.61
#: (512 at 7x7) 0.85-0.9x, at 0.57 and below 0.25-0.7x (``python -m scripts.conv_gram``).
SHIFTED_FLOP_FRACTION = 0.75


def batch_slices(tensor: Tensor, rows_per_example: int, dim: int, itemsize: int
                 ) -> tuple[Tensor, ...]:
    """``tensor`` split along the batch into slices of about :data:`ROW_PART_BYTES` of rows."""
    rows = max(ROW_PART_BYTES // (dim * itemsize), MIN_PART_ROWS)
    return tensor.split(max(1, rows // max(rows_per_example, 1)))


class UnsupportedLayerError(TypeError):
    """A module cannot be preconditioned; the message says why and how to skip it."""


@dataclass(frozen=True)
class Rows:
    """Factor rows of one captured tensor.

    Attributes:
        rows: ``(B, T, dim)`` rows; ``T`` is 1 for 2-D Linear, the sequence length for 3-D
            Linear inputs, and the number of output locations ``L`` for Conv2d.
        spatial: True when ``T`` counts conv output locations (the ``kfc``/``dpkfac``
            conventions treat locations and sequence positions differently).
    """

    rows: Tensor
    spatial: bool

    @property
    def batch(self) -> int:
        """Examples ``B`` in the captured batch."""
        return self.rows.shape[0]

    @property
    def positions(self) -> int:
        """Rows per example (``T`` or ``L``)."""
        return self.rows.shape[1]


class LayerHelper:
    """Base class: the weight/bias access shared by all supported layer types.

    Attributes:
        input_dims: The fewest and the most dimensions (None: any) of an input the rows are
            built from.
        sequence_positions: Whether an example's rows are positions of a sequence (Linear)
            rather than convolution output locations: DP-KFAC's factors average them per
            example (:meth:`example_mean_a_rows`).
        has_bias: Whether the module's bias is trained, decided when the helper is built: it
            becomes the last column of ``W̄`` (a bias frozen then is left out, so the weight's
            curvature has no column for it). The factors' shapes follow from it, so a bias
            frozen later keeps its column but is never written a gradient, and one unfrozen
            later is left first-order.
    """

    input_dims: tuple[int, int | None] = (2, None)
    sequence_positions: bool = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        bias = getattr(module, "bias", None)
        self.has_bias = bias is not None and bias.requires_grad

    def input_problem(self, x: Tensor) -> str | None:
        """What is wrong with a captured input's shape for this layer type, or None."""
        low, high = self.input_dims
        if low <= x.dim() and (high is None or x.dim() <= high):
            return None
        wanted = f"{low}" if high == low else f"at least {low}" if high is None else \
            f"{low} to {high}"
        return (f"{type(self.module).__name__} got a {x.dim()}-D input of shape "
                f"{tuple(x.shape)}; its curvature needs {wanted} dimensions, the first the "
                "batch (add one, or skip the layer with skip_layers)")

    # nn.Module annotates its attributes as ``Tensor | Module``; these two are parameters.
    @property
    def weight(self) -> Tensor:
        return self.module.weight  # type: ignore[return-value]

    @property
    def bias(self) -> Tensor:
        """The bias parameter (only of a helper :attr:`has_bias`)."""
        return self.module.bias  # type: ignore[return-value]

    @property
    def g_dim(self) -> int:
        """Dimension of ``G`` (output features / channels)."""
        return self.weight.shape[0]

    @property
    def a_dim(self) -> int:
        """Dimension of ``A`` (input features or patch size, plus one for the bias)."""
        return self.weight[0].numel() + int(self.has_bias)

    def a_rows(self, x: Tensor, dtype: torch.dtype | None = None) -> Rows:
        """Input rows ``ā`` (bias entry appended) of a captured layer input, in ``dtype``
        (default: the input's)."""
        raise NotImplementedError

    def g_rows(self, gy: Tensor) -> Rows:
        """Output-gradient rows of a captured output gradient."""
        raise NotImplementedError

    def example_mean_a_rows(self, x: Tensor, dtype: torch.dtype) -> Rows:
        """Each example's input rows averaged over its positions, ``(B, 1, a_dim)`` in
        ``dtype`` with the bias entry, for a layer with :attr:`sequence_positions`.

        Rows are affine in the input, so the input is averaged first and the bias entry
        appended to ``B`` rows: the rows themselves are never materialised.
        """
        raise NotImplementedError(f"{type(self).__name__} rows are not sequence positions")

    def mean_a_row(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """The mean input row ``ā`` over all rows of a captured input (bias entry appended)."""
        return self._append_bias(self.mean_input_row(x, dtype))

    def mean_input_row(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """:meth:`mean_a_row` without its bias entry (``a_dim − 1`` entries with a bias).

        Rows are affine in each example's input and every example has the same number of
        rows, so the batch mean is taken first: the rows of one averaged example, not of the
        whole batch, are materialised (the built-in helpers need none).
        """
        row = self.a_rows(x.mean(dim=0, keepdim=True, dtype=dtype)).rows.mean(dim=(0, 1))
        return row[:-1] if self.has_bias else row

    def input_slices(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """Batch slices of a captured input whose :meth:`a_rows` are built one at a time
        (the whole input when its rows are a view of it)."""
        return (x,)

    def shifted_plan(self, input_shape: torch.Size) -> conv_gram.Plan | None:
        """How to form ``A`` of an input of this shape without its rows, when that is
        cheaper than their product (None: build the rows)."""
        return None

    def grad_slices(self, gy: Tensor) -> tuple[Tensor, ...]:
        """Batch slices of a captured output gradient whose :meth:`g_rows` are multiplied one
        at a time (the whole gradient when its feature-major rows are a view of it)."""
        return (gy,)

    def grad_parts(self) -> tuple[Tensor, Tensor | None] | None:
        """``∇W`` as a ``(g_dim, a_dim − 1)`` matrix with a bias (``(g_dim, a_dim)`` without)
        and ``∇b`` (None without a bias; zeros if it has no gradient), or None if the weight
        has no gradient. Views of the ``.grad`` tensors where their layout allows (no copy)."""
        grad = self.weight.grad
        if grad is None:
            return None
        if sharded(grad):  # sharded after the preconditioner was built
            raise UnsupportedLayerError(
                f"a {type(self.module).__name__} layer's gradient is sharded (DTensor, from "
                f"FSDP's fully_shard or tensor parallelism); {SHARDED_FIX}")
        weight = self.weight_matrix(grad)
        if not self.has_bias:
            return weight, None
        bias = self.bias
        return weight, torch.zeros_like(bias) if bias.grad is None else bias.grad

    def weight_matrix(self, tensor: Tensor) -> Tensor:
        """A weight-shaped tensor (its gradient) as the ``(g_dim, a_dim − bias)`` matrix of
        ``∇W̄``'s layout, a view."""
        return tensor.reshape(self.g_dim, -1)

    def as_weight(self, matrix: Tensor) -> Tensor:
        """The inverse of :meth:`weight_matrix`: a ``(g_dim, a_dim − bias)`` matrix in the
        weight's shape (a view where the layout allows)."""
        return matrix.reshape(self.weight.shape)

    def grad_matrix(self) -> Tensor | None:
        """``∇W̄ = [∇W | ∇b]`` as a ``(g_dim, a_dim)`` matrix, or None if there is no gradient."""
        parts = self.grad_parts()
        if parts is None:
            return None
        weight, bias = parts
        return weight if bias is None else torch.cat([weight, bias.reshape(-1, 1)], dim=1)

    def grad_tensors(self) -> list[Tensor]:
        """The current ``.grad`` of the weight and (if any) the bias, those that exist."""
        params = (self.weight, self.bias) if self.has_bias else (self.weight,)
        return [p.grad for p in params if p.grad is not None]

    def set_grad(self, matrix: Tensor, scale: Tensor | float | None = None) -> None:
        """Write a ``(g_dim, a_dim)`` matrix (times ``scale``, if given) into ``.grad`` of
        weight and bias.

        Without a bias the weight's gradient becomes a view of ``matrix`` (a copy for a weight
        in another memory layout, such as channels-last), which ``scale`` then multiplies in
        place (so pass a matrix the caller owns). With a bias the columns are copied, scaled
        on the way, into the existing ``.grad`` tensors where they fit (no fresh buffers to
        allocate and fault in every step). Gradients keep their parameter's memory layout
        (:func:`_in_layout`).
        """
        weight = self.weight
        w_cols = self.a_dim - int(self.has_bias)
        if not self.has_bias:
            if scale is not None:
                matrix = matrix.mul_(scale)
            weight.grad = _in_layout(weight, self.as_weight(matrix))
            return
        _write_grad(weight, self.as_weight(matrix[:, :w_cols]), scale)
        _write_grad(self.bias, matrix[:, w_cols], scale)

    def add_outer_to_grad(self, parts: tuple[Tensor, Tensor | None], u: Tensor, v: Tensor, *,
                          beta: float, alpha: float) -> None:
        """Write ``β·[∇W | ∇b] + α·u vᵀ`` (``v`` of ``a_dim``) into ``.grad`` of weight and
        bias, with ``parts = (∇W, ∇b)`` as :meth:`grad_parts` gives them or copies of them (in
        another dtype, say): one pass in place where a part is the contiguous gradient itself,
        else a fresh result written into ``.grad``. A bias frozen since the helper was built
        is never written."""
        weight_part, bias_part = parts
        w_cols = weight_part.shape[1]
        _add_outer_into(self.weight, weight_part, u, v[:w_cols], beta, alpha, self.as_weight)
        if bias_part is not None:
            _add_outer_into(self.bias, bias_part.reshape(-1, 1), u,
                            v[w_cols:], beta, alpha, lambda column: column)

    def _append_bias(self, rows: Tensor) -> Tensor:
        if not self.has_bias:
            return rows
        ones = rows.new_ones(*rows.shape[:-1], 1)
        return torch.cat([rows, ones], dim=-1)


def _add_outer_into(param: Tensor, part: Tensor, u: Tensor, v: Tensor, beta: float,
                    alpha: float, as_param: Callable[[Tensor], Tensor]) -> None:
    """``param.grad = β·part + α·u vᵀ`` (``as_param`` gives it ``param``'s shape): in place
    when ``part`` views the whole contiguous ``.grad`` of a contiguous ``param``, else through
    :func:`_write_grad`; nothing for a frozen parameter."""
    if not param.requires_grad:
        return
    grad = param.grad
    if (grad is not None and part.dtype == grad.dtype and param.is_contiguous()
            and grad.is_contiguous()
            and part.data_ptr() == grad.data_ptr() and part.numel() == grad.numel()):
        part.addr_(u, v, beta=beta, alpha=alpha)
    else:
        _write_grad(param, as_param(torch.addr(part, u, v, beta=beta, alpha=alpha)), None)


def _write_grad(param: Tensor, value: Tensor, scale: Tensor | float | None) -> None:
    """``param.grad = value · scale`` (in ``param``'s memory layout), written into the current
    ``.grad`` when it has the right shape, dtype and layout and does not share memory with
    ``value``; nothing for a frozen parameter."""
    if not param.requires_grad:
        return
    value = value.reshape(param.shape)
    grad = param.grad
    if (grad is not None and grad.shape == param.shape and grad.dtype == param.dtype
            and _laid_out_like(param, grad)
            and grad.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()):
        if scale is None:
            grad.copy_(value)
        else:
            torch.mul(value, scale, out=grad)
        return
    if scale is not None:
        value = value * scale
    param.grad = _in_layout(param, value)


def _laid_out_like(param: Tensor, tensor: Tensor) -> bool:
    """Whether ``tensor`` (of ``param``'s shape) has ``param``'s memory layout: contiguous for
    a contiguous parameter, else the same strides (a channels-last convolution weight)."""
    return tensor.is_contiguous() if param.is_contiguous() else tensor.stride() == param.stride()


def _in_layout(param: Tensor, value: Tensor) -> Tensor:
    """``value`` (of ``param``'s shape) in ``param``'s dtype and memory layout: itself where it
    already is, else a copy.

    Autograd lays a gradient out like its parameter, and PyTorch's fused optimizers
    (``Adam(fused=True)``) read the two tensors' memory in step: a contiguous gradient of a
    channels-last weight gets its entries applied to the wrong weights, silently.
    """
    if value.dtype == param.dtype and _laid_out_like(param, value):
        return value
    return torch.empty_like(param).copy_(value)


class LinearHelper(LayerHelper):
    """``nn.Linear`` with 2-D ``(B, D)`` or N-D ``(B, ..., D)`` inputs (positions flattened)."""

    sequence_positions = True

    def a_rows(self, x: Tensor, dtype: torch.dtype | None = None) -> Rows:
        x = x.reshape(x.shape[0], -1, x.shape[-1]).to(dtype or x.dtype)
        return Rows(self._append_bias(x), spatial=False)

    def example_mean_a_rows(self, x: Tensor, dtype: torch.dtype) -> Rows:
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return Rows(self._append_bias(x.mean(dim=1, keepdim=True, dtype=dtype)), spatial=False)

    def g_rows(self, gy: Tensor) -> Rows:
        return Rows(gy.reshape(gy.shape[0], -1, gy.shape[-1]), spatial=False)

    def mean_input_row(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """One reduction over all rows of the input (its rows are a view of it): no
        batch-mean intermediate, no copy of the rows."""
        return x.reshape(-1, x.shape[-1]).mean(dim=0, dtype=dtype)

    def input_slices(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        if not self.has_bias:
            return (x,)
        return batch_slices(x, x[0].numel() // x.shape[-1], self.a_dim, dtype.itemsize)


class TransposedLinearHelper(LinearHelper):
    """A linear layer whose weight is stored ``(in, out)``, ``y = x W + b``: transformers'
    ``Conv1D`` (GPT-2's attention and MLP projections). Its rows are a Linear layer's; its
    ``∇W`` is the transposed gradient (a view: written in place where the step allows)."""

    @property
    def g_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def a_dim(self) -> int:
        return self.weight.shape[0] + int(self.has_bias)

    def weight_matrix(self, tensor: Tensor) -> Tensor:
        return tensor.t()

    def as_weight(self, matrix: Tensor) -> Tensor:
        return matrix.t()


class Conv2dHelper(LayerHelper):
    """``nn.Conv2d`` (stride, padding, dilation; ``groups=1``): im2col patch rows.

    Patches are in channel-major ``(c_in, k_h, k_w)`` order, matching ``weight.view(c_out, -1)``.
    """

    input_dims = (4, 4)

    def __init__(self, module: nn.Module) -> None:
        assert isinstance(module, nn.Conv2d)
        if module.groups != 1:
            raise UnsupportedLayerError(
                f"Conv2d with groups={module.groups} is not supported (its Fisher block is "
                "block-diagonal); it is left first-order"
            )
        if module.padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"Conv2d with padding_mode={module.padding_mode!r} is not supported; "
                "it is left first-order"
            )
        super().__init__(module)
        self.conv: nn.Conv2d = module
        self._padding()  # an unsupported padding is refused here, not at the first step

    def _padding(self) -> tuple[int, int]:
        padding = self.conv.padding
        if padding == "valid":
            return (0, 0)
        if padding == "same":
            k, d = self.conv.kernel_size, self.conv.dilation
            total = [d[i] * (k[i] - 1) for i in range(2)]
            if any(t % 2 for t in total):
                raise UnsupportedLayerError(
                    "Conv2d with padding='same' and an even effective kernel pads "
                    "asymmetrically; give explicit integer padding or skip the layer"
                )
            return (total[0] // 2, total[1] // 2)
        return padding  # type: ignore[return-value]

    def _output_size(self, h: int, w: int) -> tuple[int, int]:
        """Output height and width for an unpadded input of ``h × w``."""
        conv = self.conv
        (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
        ph, pw = self._padding()
        return ((h + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
                (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1)

    def shifted_plan(self, input_shape: torch.Size) -> conv_gram.Plan | None:
        """A plan for stride-1 convolutions of more than one tap whose shifted product takes
        under :data:`SHIFTED_FLOP_FRACTION` of the patches' FLOPs (on ResNet-18's 3x3 layers
        0.35-0.84 of them, so all but the 512-channel ones at 4x4)."""
        conv = self.conv
        if not SHIFTED_CONV_GRAM or conv.stride != (1, 1) or conv.kernel_size == (1, 1):
            return None
        batch, channels, height, width = input_shape
        (kh, kw), (dh, dw) = conv.kernel_size, conv.dilation
        plan = conv_gram.plan(conv_gram.Geometry((kh, kw), (dh, dw), self._padding()),
                              height, width)
        if plan.flops(batch, channels) >= SHIFTED_FLOP_FRACTION * plan.patch_flops(batch,
                                                                                   channels):
            return None
        return plan

    def input_slices(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        out_h, out_w = self._output_size(x.shape[2], x.shape[3])
        return batch_slices(x, out_h * out_w, self.a_dim, dtype.itemsize)

    def grad_slices(self, gy: Tensor) -> tuple[Tensor, ...]:
        return batch_slices(gy, gy[0].numel() // self.g_dim, self.g_dim, gy.element_size())

    def a_rows(self, x: Tensor, dtype: torch.dtype | None = None) -> Rows:
        """im2col rows, written once into a ``(c_in·k_h·k_w [+ 1], B, L)`` buffer.

        One strided copy from the (padded) input, with no ``unfold`` output to transpose and no
        concatenation for the bias entry: the rows are a permuted view of the buffer, which
        :func:`core.factors.add_a_rows` multiplies without another copy. For a 1x1 stride-1
        convolution the copy is the input itself, channel-major.
        """
        conv = self.conv
        (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
        ph, pw = self._padding()
        out_h, out_w = self._output_size(x.shape[2], x.shape[3])
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph))
        b, c = x.shape[:2]
        sb, sc, sy, sx = x.stride()
        patches = x.as_strided((c, kh, kw, b, out_h, out_w),
                               (sc, dh * sy, dw * sx, sb, sh * sy, sw * sx), x.storage_offset())
        dim = c * kh * kw
        rows = torch.empty(dim + int(self.has_bias), b, out_h, out_w,
                           dtype=dtype or x.dtype, device=x.device)
        rows[:dim].view(c, kh, kw, b, out_h, out_w).copy_(patches)
        if self.has_bias:
            rows[dim].fill_(1.0)
        return Rows(rows.view(-1, b, out_h * out_w).permute(1, 2, 0), spatial=True)

    def g_rows(self, gy: Tensor) -> Rows:
        return Rows(gy.flatten(2).transpose(1, 2), spatial=True)

    def mean_input_row(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Without patch rows: the entry of tap ``(c, i, j)`` is the mean of the
        batch-mean input over the output positions' window of that tap, summed over rows
        (one strided reduction for every ``i``), then over columns (for every ``j``)."""
        conv = self.conv
        (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
        ph, pw = self._padding()
        out_h, out_w = self._output_size(x.shape[2], x.shape[3])
        mean = x.mean(dim=0, dtype=dtype)  # (c_in, H, W) in dtype (CUDA fp16/bf16 -> fp32 uncopied)
        if ph or pw:
            mean = F.pad(mean, (pw, pw, ph, ph))
        channels, _, width = mean.shape
        sc, sy, sx = mean.stride()
        rows = mean.as_strided((channels, kh, out_h, width),
                               (sc, dh * sy, sh * sy, sx)).sum(dim=2)  # (c_in, k_h, W)
        rc, ry, rx = rows.stride()
        taps = rows.as_strided((channels, kh, kw, out_w), (rc, ry, dw * rx, sw * rx)).sum(dim=3)
        return taps.reshape(-1).div_(out_h * out_w)


_HELPERS: dict[type[nn.Module], type[LayerHelper]] = {
    nn.Linear: LinearHelper,
    nn.Conv2d: Conv2dHelper,
}


def refuse_lazy(name: str, module: nn.Module) -> None:
    """Raise :class:`~core.layers.UnsupportedLayerError` for a lazy module (``LazyLinear``,
    ``LazyConv2d``, ``LazyBatchNorm2d``) whose parameters are not materialised yet: its
    shapes, and so its factors, are unknown until its first forward pass."""
    if any(is_lazy(p) for p in module.parameters(recurse=False)):
        raise UnsupportedLayerError(
            f"{name or 'the model'} ({type(module).__name__}) has uninitialized parameters: "
            "run one forward pass (a batch of the training shape) before building the "
            "preconditioner, or skip it with skip_layers")


#: What an error about sharded parameters tells the user to do.
SHARDED_FIX = ("K-FAC, MKOR and Eva need each layer's whole weight gradient on the rank that "
               "builds its factors: wrap the model in DistributedDataParallel instead, or leave "
               "these layers first-order with skip_layers")


def sharded(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a ``DTensor``: a parameter or gradient sharded across ranks (FSDP2's
    ``fully_shard``, tensor parallelism), of which each rank holds a part."""
    # A DTensor exists only once its module is imported, which takes about a second: look it
    # up rather than import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def refuse_sharded(name: str, module: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` for a module whose parameters are sharded
    (:func:`sharded`): its factors and gradient would be one rank's part of the layer's."""
    if any(sharded(p) for p in module.parameters(recurse=False)):
        raise UnsupportedLayerError(
            f"{name or 'the model'} ({type(module).__name__}) has sharded parameters (DTensor, "
            f"from FSDP's fully_shard or tensor parallelism); {SHARDED_FIX}")


def refuse_flat_sharding(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` for a model wrapped in ``FullyShardedDataParallel``
    (FSDP1), whose flat parameters hold one rank's shard of every wrapped layer's weight."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded if the model uses it
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel)
                                for m in model.modules()):
        raise UnsupportedLayerError(
            "the model is wrapped in FullyShardedDataParallel, whose flat parameters shard "
            "every layer's weight; K-FAC, MKOR and Eva need each layer's whole weight gradient "
            "on the rank that builds its factors: wrap the model in DistributedDataParallel "
            "instead")


def computed_weight(module: nn.Module) -> bool:
    """Whether ``module.weight`` is computed from other parameters rather than being one
    itself: a ``torch.nn.utils.parametrize`` parametrization (``parametrizations.weight_norm``,
    ``spectral_norm``), or a tensor set by a forward pre-hook (the older
    ``torch.nn.utils.weight_norm``). Autograd then never writes the weight's ``.grad``."""
    if parametrize.is_parametrized(module, "weight"):
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.requires_grad and not weight.is_leaf


def _register_imported_types() -> None:
    """Support the layer types of libraries the model's code has imported, without importing
    them: transformers' ``Conv1D`` (GPT-2's linear layers, weight ``(in, out)``)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if isinstance(conv1d, type) and conv1d not in _HELPERS:
        _HELPERS[conv1d] = TransposedLinearHelper


def register_helper(module_type: type[nn.Module], helper: type[LayerHelper]) -> None:
    """Support another module type (e.g. a BatchNorm Fisher block in a reproduction)."""
    _HELPERS[module_type] = helper


def helper_for(module: nn.Module, name: str = "") -> LayerHelper | None:
    """The helper for ``module`` (called ``name`` in the model, for messages), or None when
    its type is not supported.

    Unsupported configurations of a supported type (e.g. grouped convolutions) warn and
    return None, so the layer is left first-order rather than preconditioned wrongly. So does
    a subclass of a supported type: its forward may differ from its base's (PyTorch's
    ``MultiheadAttention`` never calls its ``out_proj``), so it is supported only once
    registered. A lazy one (``LazyLinear``) is refused (:func:`refuse_lazy`), and so is one
    whose parameters are sharded (:func:`refuse_sharded`). One whose weight
    is computed from other parameters (:func:`computed_weight`) warns and stays first-order.
    """
    _register_imported_types()
    helper_type = _HELPERS.get(type(module))
    bases = [t for t in _HELPERS if isinstance(module, t)]
    if bases:
        refuse_sharded(name, module)
    if bases and computed_weight(module):
        warnings.warn(f"{name or type(module).__name__}: its weight is computed from other "
                      "parameters (weight_norm, spectral_norm or another parametrization), "
                      "which get the gradient the optimizer applies, not the weight, so it "
                      "stays first-order; remove the parametrization to precondition it, or "
                      "skip it with skip_layers", stacklevel=3)
        return None
    if helper_type is None:
        if bases:
            refuse_lazy(name, module)
        weight = getattr(module, "weight", None)
        if bases and isinstance(weight, Tensor) and weight.requires_grad:
            kind = type(module).__name__
            base = bases[0].__name__
            base = f"nn.{base}" if getattr(nn, base, None) is bases[0] else base
            warnings.warn(f"{kind} subclasses {base} but is "
                          "not a supported type, so it stays first-order; if its forward is "
                          f"its base's, register it: core.layers.register_helper({kind}, "
                          f"{_HELPERS[bases[0]].__name__})", stacklevel=3)
        return None
    try:
        return helper_type(module)
    except UnsupportedLayerError as err:
        warnings.warn(f"{name}: {err}" if name else str(err), stacklevel=3)
        return None
