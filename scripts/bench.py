"""Per-step cost of K-FAC, DP-KFAC, MKOR and Eva, against the first-order step and the machine.

One run measures, for each workload (model, batch, first-order base optimizer):

* the training step (forward, backward, preconditioner, optimizer) of the first-order base and of
  every second-order method, as a ratio to the base step measured in the same run, amortized over
  update intervals 1, 10 and 100 (factors and inverses are both updated every interval steps);
* the per-stage breakdown (capture, factors, inversion, precondition, communication, scale) from
  the preconditioner's own stage timer;
* the second-order work against its lower bound: its FLOP count (or, for memory-bound stages, its
  bytes) at this machine's throughput for the same kernel kind (fp32 or bf16 GEMM, eigh,
  Cholesky inverse, triangular solve, memory copy), which the run measures before and after
  each workload (the faster kept);
* the factor-GEMM and inversion throughput as a fraction of the measured matmul throughput;
* peak memory over the first-order run, against the factor and inverse bytes.

How a step is amortized: each method runs a fixed pattern of update steps (factors captured and
inverses recomputed) and plain steps (precondition only), with a warm-up update and plain step
first (peak memory is measured on those two). Every step of a method follows a step of the base
optimizer on its own copy of the model, and ratios are medians of these adjacent pairs. Each
method runs in a fresh process with its own base (``--in-process`` runs them one after another
in this one), so what one method leaves in the allocator cannot move the next one's figures. For an
interval ``N`` the amortized step is ``(T_update + (N - 1) T_plain) / N`` with the median ``T``
of each kind (ratios and per-stage times are amortized the same way).

Clocks: on the CPU, process CPU time (``time.process_time``, also handed to the preconditioner's
stage timer): with one thread and no I/O it equals wall time on an idle machine, and it does not
count the time slices other processes take on a shared one. On a GPU, CUDA events (wall time),
with the forward and backward under bf16 autocast (factors and inversions stay fp32, as ``core``
always keeps them).

Peer numbers (KAISA, the DP-KFAC code, the MKOR code) are inputs (``--peer-*``); this script
never runs their code. Run with one thread per process (ENVIRONMENT.md §1.6); the run records the
thread settings and the load average, because other processes share the machine.

    python scripts/bench.py --quick                      # tiny models, 1-3 minutes (the test)
    python scripts/bench.py --json scripts/results/bench_cpu.json   # the full run (~20 minutes)
    python scripts/bench.py --device cuda --json scripts/results/bench_cuda.json
    python scripts/bench.py --reamortize scripts/results/bench_cpu.json --intervals 1 50
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools
# PyTorch backs large CPU tensors with transparent huge pages when this is set before its
# first allocation. Factors, inverses and products are allocated afresh every update, and
# faulting a 4608-square factor in 4 KiB pages costs a third of its syrk (docs/benchmarks.md,
# "Huge pages"). It applies to the first-order base as much. A value the caller set wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout's core, not an installed one
    sys.path.insert(0, str(ROOT))

import core.inverse  # noqa: E402
from core import host_kernels  # noqa: E402
from core.config import ConfigError  # noqa: E402
from core.host_memory import keep_freed_memory  # noqa: E402
from core.inverse import inverse_in_place  # noqa: E402
from core.layers import helper_for  # noqa: E402
from core.optim import build_optimizer  # noqa: E402
from core.preconditioner import discover_layers  # noqa: E402
from core.rank1 import BERT_DECODER_PATTERN  # noqa: E402
from reproductions.common.cli import (  # noqa: E402
    device_name,
    exit_on_user_error,
    positive_int,
    read_json_file,
    resolve_device,
)

MB = 2**20
INTERVALS = (1, 10, 100)
#: Stage columns of the tables; ``comm`` sums the three communication stages of core.timing.
COLUMNS = ("capture", "factors", "inversion", "precondition", "comm", "scale")
COMM_STAGES = ("factor_comm", "inverse_comm", "grad_comm")
#: Second-order work compared with its lower bound (communication is reported, not bounded).
WORK = ("capture", "factors", "inversion", "precondition", "scale")
#: Nominal FLOPs per n³ of each measured kernel kind other than the GEMM: LAPACK's Cholesky
#: factorisation plus inverse (n³/3 + 2n³/3), the factorisation alone (``potrf``, n³/3; what
#: ``cholesky_solve`` keeps), a triangular solve against n right-hand sides (``trsm``, n³), and
#: eigh with vectors (tridiagonalisation 4n³/3, divide and conquer and back-transformation).
NOMINAL_FLOPS = {"cholesky": 1.0, "potrf": 1.0 / 3.0, "trsm": 1.0, "eigh": 4.0}
#: Row labels of the rates table.
KERNEL_LABELS = {"cholesky": "Cholesky + inverse", "potrf": "Cholesky factorisation",
                 "trsm": "triangular solve", "eigh": "eigh"}

Batch = dict[str, Tensor]
#: Builds a workload's batch on a device; ``seed`` draws another one (default: the fixed one).
BatchMaker = Callable[..., Batch]


# Measurement primitives ----------------------------------------------------------------------
class Clock:
    """Seconds of a block: process CPU time on the CPU, CUDA events on a GPU.

    Attributes:
        now: The CPU clock (``time.process_time``), or wall time on a GPU (where stage
            timers use CUDA events instead).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.now: Callable[[], float] = time.perf_counter if self.cuda else time.process_time

    def time(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn()`` takes, its device work included."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = self.now()
        fn()
        return self.now() - begin

    def best(self, fn: Callable[[], object], repeats: int) -> float:
        """Fewest seconds of ``repeats`` calls after one warm-up call: what the machine can do,
        which is what a lower bound needs."""
        fn()
        return min(self.time(fn) for _ in range(repeats))


class MemoryProbe:
    """Peak memory of a run above what was live when it started.

    On a GPU: ``torch.cuda`` peak statistics. On the CPU: the process's resident-set high-water
    mark (``VmHWM``), reset through ``/proc/self/clear_refs`` after returning freed heap memory
    to the system (``malloc_trim``), so a peak counts what the run allocated, not earlier
    garbage. :meth:`mark` restarts the high-water mark but keeps the baseline, so work between
    the measured steps (the interleaved base steps) is left out.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._baseline = 0
        try:
            self._trim: Callable[[int], int] | None = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")

    def mark(self) -> None:
        """Forget earlier peaks."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        if self._trim is not None:
            self._trim(0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")

    def start(self) -> None:
        """Start a run: what is live now is its baseline."""
        gc.collect()
        self.mark()
        self._baseline = (torch.cuda.memory_allocated() if self.cuda
                          else self._status("VmRSS"))

    def peak(self) -> int:
        """Bytes above the baseline at the peak since the last :meth:`mark`."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._baseline
        return self._status("VmHWM") - self._baseline


# Kernel throughput of this machine ------------------------------------------------------------
@dataclass
class Rates:
    """Measured throughput per kernel kind and size.

    Attributes:
        gemm: FLOP/s of an ``n³`` fp32 matmul, by ``n``.
        eigh: ``n³``/s of ``torch.linalg.eigh`` of an SPD matrix, by ``n``.
        cholesky: ``n³``/s of a Cholesky factorisation plus inverse, by ``n``: the faster of
            torch's and, on the CPU, LAPACK's in place (:func:`cholesky_calls`).
        potrf: ``n³``/s of a Cholesky factorisation alone, by ``n``, likewise
            (:func:`factorisation_calls`).
        trsm: ``n³``/s of a triangular solve of ``n`` right-hand sides, by ``n``.
        bandwidth: bytes/s of a large copy (read plus write): main memory's.
        gemm_bf16: FLOP/s of an ``n³`` bf16 matmul (fp32 accumulation), by ``n``: the rate of
            the products with a state kept in bf16 (``precondition_dtype``).
        copy: bytes/s of a copy of ``n`` bytes (read plus write) repeated on the same buffers,
            by ``n``: from the caches where they fit, what a pass over data of that size can
            do at best (empty in runs saved before it was measured: ``bandwidth`` then).
    """

    gemm: dict[int, float]
    eigh: dict[int, float]
    cholesky: dict[int, float]
    potrf: dict[int, float]
    trsm: dict[int, float]
    bandwidth: float
    gemm_bf16: dict[int, float] = field(default_factory=dict)
    copy: dict[int, float] = field(default_factory=dict)

    def at(self, kind: str, n: int) -> float:
        """The ``kind`` rate measured at the size nearest ``n`` (log scale)."""
        table: dict[int, float] = getattr(self, kind)
        size = min(table, key=lambda s: abs(math.log(max(n, 1) / s)))
        return table[size]

    def copy_rate(self, nbytes: float) -> float:
        """Bytes/s of streaming ``nbytes``: the copy rate measured at the nearest size (the
        large copy's in runs saved before sizes were measured)."""
        return self.at("copy", int(nbytes)) if self.copy else self.bandwidth

    def passes(self, nbytes: float, count: float = 1.0, stream: float | None = None) -> float:
        """Seconds of ``count`` passes over ``nbytes`` of one layer's data (each read once, or
        read and written as a copy's halves). The first comes at the rate of ``stream``, the
        bytes the whole stage streams over all layers (where the data waits since it was
        made: the caches, or memory when they cannot hold it all), the others at the rate of
        ``nbytes`` (the layer's data, in cache since the first)."""
        first = nbytes / self.copy_rate(nbytes if stream is None else stream)
        return first + (count - 1) * nbytes / self.copy_rate(nbytes)

    def seconds(self, kind: str, n: int, flops: float) -> float:
        """Seconds of ``flops`` FLOPs of kernel ``kind`` (not the GEMM) at size ``n``."""
        return flops / (NOMINAL_FLOPS[kind] * self.at(kind, n))

    def fastest(self, other: Rates) -> Rates:
        """Per kernel kind and size, the higher of two measurements of the same sizes."""
        def best(mine: Any, theirs: Any) -> Any:
            if isinstance(mine, dict):
                return {n: max(rate, theirs.get(n, rate)) for n, rate in mine.items()}
            return max(mine, theirs)

        return Rates(**{f.name: best(getattr(self, f.name), getattr(other, f.name))
                        for f in fields(self)})

    @property
    def peak_gemm(self) -> float:
        return max(self.gemm.values())


def gemm_rate(a: Tensor, b: Tensor, clock: Clock, repeats: int) -> float:
    """FLOP/s of ``a @ b`` (square), the best of ``repeats`` calls."""
    return 2 * a.shape[0] ** 3 / clock.best(lambda: a @ b, repeats)


def well_conditioned_spd(n: int, device: torch.device) -> Tensor:
    """A well-conditioned SPD matrix, symmetric to the bit (``x @ x.T`` need not be: some BLAS
    builds sum its two triangles in different orders)."""
    x = torch.randn(n, 2 * n, device=device)
    gram = x @ x.T / (2 * n)
    return (gram + gram.T) / 2 + 1e-3 * torch.eye(n, device=device)


@dataclass(frozen=True)
class TimedCall:
    """A kernel as the library calls it, for a rate: ``run`` does the kernel on a fresh copy of
    its input, written into memory allocated once, and ``setup`` that copy alone, whose time is
    not the kernel's (None: ``run`` copies nothing)."""

    run: Callable[[], object]
    setup: Callable[[], object] | None = None


def fastest_seconds(clock: Clock, calls: Sequence[TimedCall], repeats: int) -> float:
    """Seconds of the fastest of ``calls`` (each the best of ``repeats``, less its setup's):
    a bound takes the fastest way the machine has to do the job."""
    def seconds(call: TimedCall) -> float:
        spent = clock.best(call.run, repeats)
        if call.setup is not None:
            spent -= clock.best(call.setup, repeats)
        return max(spent, 1e-9)

    return min(seconds(call) for call in calls)


def _in_place(src: Tensor, kernel: Callable[[Tensor], object]) -> TimedCall:
    """``kernel`` on a copy of ``src`` in a buffer allocated once, and that copy as setup."""
    buffer = torch.empty_like(src)

    def run() -> object:
        buffer.copy_(src)
        return kernel(buffer)

    return TimedCall(run, lambda: buffer.copy_(src))


def factorisation_calls(spd: Tensor) -> list[TimedCall]:
    """Ways to Cholesky-factor ``spd``: torch's, and on the CPU LAPACK's ``potrf`` alone in a
    copy's memory (:mod:`core.host_kernels`; torch's call adds a strided pass zeroing a
    triangle). A bound takes the fastest."""
    calls = [TimedCall(lambda: torch.linalg.cholesky(spd))]
    if spd.device.type == "cpu":
        calls.append(_in_place(spd, lambda m: host_kernels.cholesky_in_place(
            m, lower_in_matrix=False)))
    return calls


def cholesky_calls(spd: Tensor) -> list[TimedCall]:
    """Ways to form ``spd``'s inverse from its Cholesky factor, as :func:`factorisation_calls`:
    torch's, and on the CPU ``potrf`` and then ``potri`` in one copy's memory, as
    :func:`core.inverse.inverse_in_place` does."""
    calls = [TimedCall(lambda: torch.cholesky_inverse(torch.linalg.cholesky(spd)))]
    if spd.device.type == "cpu":
        calls.append(_in_place(spd, inverse_in_place))
    return calls


def triangular_solve_calls(lower: Tensor, rhs: Tensor) -> list[TimedCall]:
    """The triangular solves :func:`core.inverse.precondition` runs for ``cholesky_solve``, each
    into its row-major right-hand side in place (``out=``, no copy or transpose): with ``L``
    and with ``Lᵀ``, from the left and from the right (on an AMD CPU ``A``'s side of a
    gradient with many rows runs as the left solves on a transposed copy,
    :data:`core.inverse.TRANSPOSED_SOLVE_MIN_ROWS`)."""
    solve = torch.linalg.solve_triangular
    return [
        _in_place(rhs, lambda b: solve(lower, b, upper=False, out=b)),
        _in_place(rhs, lambda b: solve(lower.mT, b, upper=True, out=b)),
        _in_place(rhs, lambda b: solve(lower.mT, b, upper=True, left=False, out=b)),
        _in_place(rhs, lambda b: solve(lower, b, upper=False, left=False, out=b)),
    ]


def measure_rates(sizes: Sequence[int], device: torch.device, clock: Clock,
                  copy_elements: int) -> Rates:
    """GEMM (fp32 and bf16), eigh, Cholesky (with and without the inverse) and triangular-solve
    throughput at ``sizes``, and copy bandwidth: the best of five calls up to 1024, of three up
    to 2048, one above (an eigh there takes seconds)."""
    gemm, eigh, cholesky, potrf, trsm, gemm_bf16 = {}, {}, {}, {}, {}, {}
    for n in sizes:
        repeats_n = 5 if n <= 1024 else 3 if n <= 2048 else 1
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        gemm[n] = gemm_rate(a, b, clock, repeats_n)
        low_a, low_b = a.bfloat16(), b.bfloat16()
        gemm_bf16[n] = 2 * n**3 / clock.best(lambda a=low_a, b=low_b: a @ b, repeats_n)
        spd = well_conditioned_spd(n, device)
        eigh[n] = n**3 / clock.best(lambda s=spd: torch.linalg.eigh(s), repeats_n)
        cholesky[n] = n**3 / fastest_seconds(clock, cholesky_calls(spd), repeats_n)
        potrf[n] = n**3 / fastest_seconds(clock, factorisation_calls(spd), repeats_n)
        trsm[n] = n**3 / fastest_seconds(
            clock, triangular_solve_calls(torch.linalg.cholesky(spd), b), repeats_n)
    src = torch.randn(copy_elements, device=device)
    dst = torch.empty_like(src)
    seconds = clock.best(lambda: dst.copy_(src), 5)
    return Rates(gemm, eigh, cholesky, potrf, trsm,
                 bandwidth=2 * src.numel() * src.element_size() / seconds, gemm_bf16=gemm_bf16,
                 copy={n: copy_rate(n, device, clock) for n in COPY_BYTES
                       if n < src.numel() * src.element_size()})


#: Sizes (bytes) at which :func:`measure_rates` times a copy: from one core's L2 to main memory.
COPY_BYTES = (2**18, 2**20, 2**22, 2**24, 2**26)


def copy_rate(nbytes: int, device: torch.device, clock: Clock) -> float:
    """Bytes/s (read plus write) of copying ``nbytes`` between two buffers, again and again (so
    they stay in the caches when they fit), several copies per timing to amortise the clock."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    per_call = max(1, 2**24 // nbytes)

    def copies() -> None:
        for _ in range(per_call):
            dst.copy_(src)

    return 2 * nbytes * per_call / clock.best(copies, 5)


# Workloads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model, a fixed synthetic batch and the first-order optimizer the methods feed.

    Attributes:
        name: Row label.
        description: What it is, for the table header.
        build: Builds the model (seeded by the caller).
        batch: Builds the batch on a device.
        loss: The training loss of the model on the batch.
        base: The first-order optimizer (``sgd`` or ``lamb``) every method feeds.
        lr: Its learning rate.
        skip_layers: Module-name regexes left first-order by every second-order method.
        rounds: Timed rounds of one update and two plain steps per method.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: BatchMaker
    loss: Callable[[nn.Module, Batch], Tensor]
    base: str
    lr: float
    skip_layers: tuple[str, ...] = ()
    rounds: int = 2


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 conv1, no max-pool)."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def imagenet_resnet18() -> nn.Module:
    """torchvision's ResNet-18 (ImageNet stem, 1000 classes)."""
    import torchvision

    return torchvision.models.resnet18()


def tiny_cnn() -> nn.Module:
    """Three convolutions (3x3, strided 3x3, 1x1) and a Linear head, for ``--quick``."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


def images(batch: int, size: int, classes: int) -> BatchMaker:
    """A fixed batch of random images and labels (another one per ``seed``)."""

    def make(device: torch.device, seed: int = 0) -> Batch:
        generator = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(batch, 3, size, size, generator=generator).to(device),
                "y": torch.randint(0, classes, (batch,), generator=generator).to(device)}

    return make


def classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def bert(layers: int, hidden: int, heads: int, vocab: int) -> Callable[[], nn.Module]:
    """A ``BertForPreTraining`` builder (MLM and next-sentence heads, as the MKOR paper)."""

    def build() -> nn.Module:
        from transformers import BertConfig, BertForPreTraining

        config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=4 * hidden)
        return BertForPreTraining(config)

    return build


def masked_tokens(batch: int, seq: int, vocab: int) -> BatchMaker:
    """Random token pairs with 15% of positions as MLM targets and random NSP labels (another
    draw per ``seed``)."""

    def make(device: torch.device, seed: int = 0) -> Batch:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels = torch.where(torch.rand(batch, seq, generator=generator) < 0.15, ids, -100)
        types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq)
        out = {"input_ids": ids, "token_type_ids": types, "labels": labels,
               "attention_mask": torch.ones(batch, seq, dtype=torch.long),
               "next_sentence_label": torch.randint(0, 2, (batch,), generator=generator)}
        return {k: v.to(device) for k, v in out.items()}

    return make


def pretraining_loss(model: nn.Module, batch: Batch) -> Tensor:
    return model(**batch).loss


BERT_SKIP = (BERT_DECODER_PATTERN,)
WORKLOADS: dict[str, Workload] = {
    "resnet18-32": Workload(
        "resnet18-32", "ResNet-18 (CIFAR stem), 32x32 inputs, batch 32, SGD",
        cifar_resnet18, images(32, 32, 10), classification_loss, "sgd", 0.01),
    "bert-small": Workload(
        "bert-small", "BERT pre-training, 4 layers, hidden 256, sequence 128, batch 8, LAMB",
        bert(4, 256, 4, 30522), masked_tokens(8, 128, 30522), pretraining_loss, "lamb", 1e-3,
        BERT_SKIP, rounds=3),
    "resnet18-224": Workload(
        "resnet18-224", "ResNet-18 (ImageNet), 224x224 inputs, batch 16, SGD",
        imagenet_resnet18, images(16, 224, 1000), classification_loss, "sgd", 0.01, rounds=1),
    "tiny-cnn": Workload(
        "tiny-cnn", "three convolutions and a Linear, 8x8 inputs, batch 4, SGD",
        tiny_cnn, images(4, 8, 10), classification_loss, "sgd", 0.01, rounds=1),
    "tiny-bert": Workload(
        "tiny-bert", "BERT pre-training, 1 layer, hidden 32, sequence 16, batch 2, LAMB",
        bert(1, 32, 2, 64), masked_tokens(2, 16, 64), pretraining_loss, "lamb", 1e-3,
        BERT_SKIP, rounds=1),
}
FULL = ("resnet18-32", "bert-small", "resnet18-224")
QUICK = ("tiny-cnn", "tiny-bert")


def largest_factor(workload: Workload) -> int:
    """The largest Kronecker-factor dimension of the workload's preconditioned layers."""
    model = workload.build()
    helpers = [helper_for(module) for _, module in discover_layers(model, workload.skip_layers)]
    return max(max(h.a_dim, h.g_dim) for h in helpers if h is not None)


# Methods -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A second-order method as ``core.optim.build_optimizer`` builds it.

    Attributes:
        name: Row label.
        optimizer: ``build_optimizer`` name.
        options: Preconditioner options.
        schedule: Config fields that take the update schedule.
        kind: Cost-model family: ``kfac`` (dense factors), ``mkor`` or ``eva``.
    """

    name: str
    optimizer: str
    options: dict[str, Any]
    schedule: tuple[str, ...]
    kind: str

    @property
    def state_word(self) -> int:
        """Bytes per entry of the second-order state (``precondition_dtype``)."""
        return 2 if self.options.get("precondition_dtype") == "bfloat16" else 4

    @property
    def decomposition(self) -> str:
        """Kernel kind of the inversion stage: ``eigh``, ``cholesky`` (factorisation and
        inverse) or ``potrf`` (``cholesky_solve`` keeps the factorisation); rank-1: unused."""
        return {"eigen": "eigh", "cholesky_solve": "potrf"}.get(
            self.options.get("inverse_method", ""), "cholesky")


KFAC_SCHEDULE = ("factor_update_steps", "inv_update_steps")
DP_KFAC = {"inverse_method": "inverse", "strategy": "dp-kfac", "factor_scaling": "dpkfac",
           "damping_split": "pi"}
#: Inverses kept and applied in bf16 (KAISA's ``inv_dtype``), decomposed in fp32 (K-FAC; MKOR
#: also needs ``inverse_dtype`` to keep them in bf16, and updates them in fp32).
BF16_STATE = {"precondition_dtype": "bfloat16"}
METHODS = (
    Method("kfac-eigen", "kfac", {"inverse_method": "eigen"}, KFAC_SCHEDULE, "kfac"),
    Method("kfac-inverse", "kfac", {"inverse_method": "inverse"}, KFAC_SCHEDULE, "kfac"),
    Method("kfac-solve", "kfac", {"inverse_method": "cholesky_solve"}, KFAC_SCHEDULE, "kfac"),
    Method("dp-kfac", "kfac", DP_KFAC, KFAC_SCHEDULE, "kfac"),
    Method("kfac-inverse-bf16", "kfac", {"inverse_method": "inverse", **BF16_STATE},
           KFAC_SCHEDULE, "kfac"),
    Method("dp-kfac-bf16", "kfac", DP_KFAC | BF16_STATE, KFAC_SCHEDULE, "kfac"),
    Method("mkor", "mkor", {}, ("inv_update_steps",), "mkor"),
    Method("mkor-bf16", "mkor", {"inverse_dtype": "bfloat16", **BF16_STATE},
           ("inv_update_steps",), "mkor"),
    Method("eva", "eva", {}, ("factor_update_steps",), "eva"),
)


def update_schedule(updates: frozenset[int]) -> Callable[[int], int]:
    """An interval schedule whose updates fall exactly on the steps in ``updates`` (and 0).

    ``core`` updates at ``step`` when ``step % interval(step) == 0``: interval 1 there,
    ``step + 1`` elsewhere.
    """
    return lambda step: 1 if step in updates else step + 1


# One method on one workload ------------------------------------------------------------------
@dataclass(frozen=True)
class LayerShape:
    """What the cost model needs of one preconditioned layer.

    Attributes:
        a_dim: ``A``'s dimension. g_dim: ``G``'s dimension.
        rows: Rows of the factor GEMMs (examples times positions, or examples when the
            convention averages over positions first).
        captured: Elements of the layer's input and output gradient, which building its
            factors (or statistics) must read at least once.
        a_word: Bytes per entry of ``A``'s second-order state at the end of the run (2 for
            bf16; ``precondition_dtype_tolerance`` may keep a factor in fp32). g_word: ``G``'s.
        a_shifted: For a stride-1 convolution whose ``A`` is formed from shifted views of its
            input (:mod:`core.conv_gram`), that product's FLOPs and its GEMMs' output size
            (the input channels); None when ``A`` is the product of its rows.
    """

    a_dim: int
    g_dim: int
    rows: int
    captured: int
    a_word: int = 4
    g_word: int = 4
    a_shifted: tuple[float, int] | None = None

    @property
    def a_product(self) -> tuple[float, int]:
        """FLOPs of forming ``A`` the way the layer forms it, and the GEMM size whose rate
        they run at: ``rows·a²`` at ``a``'s, or the shifted product's."""
        return self.a_shifted or (float(self.rows * self.a_dim**2), self.a_dim)


@dataclass
class MethodRun:
    """Raw measurements of one method (or the base alone) on one workload.

    Attributes:
        kinds: ``"update"`` or ``"plain"`` per timed step.
        seconds: Step time per timed step.
        base_seconds: Time of the base step run just before each timed step (the ratio of the
            two is insensitive to load that drifts slower than a step).
        stages: The preconditioner's stage times per timed step (empty for the base).
        peak_bytes: Peak memory above the state before the first step, plus the state the
            method allocated when it was built.
        state_bytes: Factor and inverse bytes the method holds (its ``memory_usage``).
        layers: Shapes of the preconditioned layers.
        failures: Decomposition or update failures counted by the method.
        gemm_checks: FLOP/s of an fp32 GEMM of size ``gemm_check_size`` measured in this
            run's process before each timed step: what the machine gave while the method ran,
            to compare with the rates its bounds use (measured apart from it).
        gemm_check_size: That GEMM's size (0: not measured).
    """

    kinds: list[str]
    seconds: list[float]
    base_seconds: list[float]
    stages: list[dict[str, float]]
    peak_bytes: int
    state_bytes: int
    layers: list[LayerShape]
    failures: int
    gemm_checks: list[float] = field(default_factory=list)
    gemm_check_size: int = 0

    def _of(self, kind: str, values: Sequence[float]) -> float:
        return statistics.median(v for k, v in zip(self.kinds, values, strict=True) if k == kind)

    def median(self, kind: str) -> float:
        """Median step seconds of ``kind`` steps."""
        return self._of(kind, self.seconds)

    def ratio(self, kind: str) -> float:
        """Median over ``kind`` steps of the step time over the adjacent base step time."""
        return self._of(kind, [s / b for s, b in zip(self.seconds, self.base_seconds,
                                                      strict=True)])

    def stage_median(self, kind: str, column: str) -> float:
        """Median seconds of a :data:`COLUMNS` stage over ``kind`` steps."""
        return self._of(kind, [sum(s.get(x, 0.0) for x in COMM_STAGES) if column == "comm"
                               else s.get(column, 0.0) for s in self.stages])


class ParameterSnapshot:
    """A model's parameters as they are now, to start later steps from.

    The runners restore every trainer's initial parameters before each step, outside the
    clock, so the base and every method run the same forward and backward pass on the same
    values: a kernel whose cost depends on the values costs the same in both, and a method
    that fits the fixed batch faster is not charged for it. Optimizer and curvature state
    carry on.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values = [p.detach().clone() for p in model.parameters()]

    def restore(self) -> None:
        """Put the snapshot's values back into the model's parameters."""
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), self.values, strict=True):
                param.copy_(value)


class Trainer:
    """A model, its optimizer (built by ``core.optim.build_optimizer``) and a fixed batch,
    with its initial parameters (``start``, a :class:`ParameterSnapshot`).

    Args:
        workload: What to train.
        method: The second-order method, or None for the base optimizer alone.
        updates: Steps on which the method updates its factors and inverses.
        device: Where to train.
        autocast: Context for the forward and the loss.
    """

    def __init__(self, workload: Workload, method: Method | None, updates: frozenset[int],
                 device: torch.device, autocast: Callable[[], AbstractContextManager[Any]]
                 ) -> None:
        torch.manual_seed(0)
        self.workload, self.autocast = workload, autocast
        self.model = workload.build().to(device)
        self.batch = workload.batch(device)
        options: dict[str, Any] = {}
        if method is not None:
            options = {"base": workload.base, "skip_layers": workload.skip_layers,
                       **method.options}
            options.update({key: update_schedule(updates) for key in method.schedule})
        self.optimizer = build_optimizer(method.optimizer if method else workload.base,
                                         self.model, lr=workload.lr, **options)
        self.average_positions = options.get("factor_scaling") == "dpkfac"
        self.start = ParameterSnapshot(self.model)

    def step(self) -> None:
        """One training step."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.workload.loss(self.model, self.batch)
        loss.backward()
        self.optimizer.step()


def step_kinds(rounds: int) -> list[str]:
    """Warm-up update and plain step (untimed; peak memory is measured on them, the update
    step being the one with the largest transients), then ``rounds`` of one update and two
    plain steps."""
    return ["update", "plain"] + ["update", "plain", "plain"] * rounds


WARM_STEPS = 2


def run_base(workload: Workload, device: torch.device, memory: MemoryProbe,
             autocast: Callable[[], AbstractContextManager[Any]]) -> tuple[Trainer, int]:
    """A base trainer after its first steps, and its peak memory over them.

    A throw-away trainer runs first, so imports and kernel caches are not counted.
    """
    warm = Trainer(workload, None, frozenset(), device, autocast)
    for _ in range(WARM_STEPS):
        warm.step()
    del warm
    trainer = Trainer(workload, None, frozenset(), device, autocast)
    memory.start()
    for _ in range(WARM_STEPS):
        trainer.step()
    return trainer, memory.peak()


def state_bytes(precond: Any) -> int:
    """Bytes of the method's curvature state: factors, inverses or eigenbases, vectors."""
    usage = precond.memory_usage()
    return sum(v for k, v in usage.items() if k in ("factors", "inverses", "vectors"))


def run_method(workload: Workload, method: Method, base: Trainer, device: torch.device,
               clock: Clock, memory: MemoryProbe,
               autocast: Callable[[], AbstractContextManager[Any]],
               check_size: int = 0, keep_memory: bool = False) -> MethodRun:
    """Train ``workload`` with ``method``, each step right after a step of ``base`` (and,
    with ``check_size``, a GEMM throughput check before each pair).

    With ``keep_memory`` the timed steps run with freed CPU memory kept in the process for
    reuse (:func:`~core.host_memory.keep_freed_memory`), returned to the system afterwards: the
    warm-up steps, on which memory is measured, return it as freed, so their resident peak
    counts what is live and not the holes a heap that only grows would add."""
    kinds = step_kinds(workload.rounds)
    updates = frozenset(i for i, kind in enumerate(kinds) if kind == "update")
    trainer = Trainer(workload, method, updates, device, autocast)
    precond = trainer.optimizer.preconditioner
    precond.timer.clock = clock.now
    rows, handles = record_shapes(trainer.model, [layer.name for layer in precond.layers],
                                  trainer.average_positions)
    built = state_bytes(precond)  # allocated with the method (MKOR's identity inverses)
    # The GEMM check's operands, and one product's scratch, exist before the memory baseline:
    # the base's peak has none of them, so allocated after it they counted as the method's.
    check = [torch.randn(check_size, check_size, device=device) for _ in range(2)]
    if check_size:
        gemm_rate(*check, clock, repeats=1)
    memory.start()
    seconds, base_seconds, stages, peak = [], [], [], 0
    checks = []
    try:
        for i in range(len(kinds)):
            if i == WARM_STEPS and keep_memory:
                keep_freed_memory()
            if check_size:
                checks.append(gemm_rate(*check, clock, repeats=2))
            base.start.restore()
            base_seconds.append(clock.time(base.step))
            trainer.start.restore()
            warm = i < WARM_STEPS  # memory is measured on the untimed warm-up steps only: its
            if warm:  # probe returns freed heap memory, which timed steps would pay to fault in
                memory.mark()
            seconds.append(clock.time(trainer.step))
            if warm:
                peak = max(peak, memory.peak())
            stages.append(dict(precond.timer.last))
            for handle in handles:  # the first step recorded the rows
                handle.remove()
    finally:
        if keep_memory:
            keep_freed_memory(False)
    metrics = precond.metrics()
    return MethodRun(
        kinds[WARM_STEPS:], seconds[WARM_STEPS:], base_seconds[WARM_STEPS:],
        stages[WARM_STEPS:], built + peak, state_bytes=state_bytes(precond),
        layers=[LayerShape(layer.a_dim, layer.g_dim, *rows[layer.name][:2],
                           *state_words(layer, method.state_word),
                           a_shifted=rows[layer.name][2])
                for layer in precond.layers],
        failures=int(metrics.get("decomposition_failures", 0)
                     + metrics.get("update_failures", 0)),
        gemm_checks=checks[WARM_STEPS:], gemm_check_size=check_size)


def state_words(layer: Any, default: int) -> tuple[int, int]:
    """Bytes per entry of a layer's ``A`` and ``G`` state as kept now (a K-FAC layer's
    state), or ``default`` for both."""
    state = getattr(layer, "state", None)
    if state is None:
        return default, default
    a, g = (state.side_tensors(side)[0].element_size() for side in ("a", "g"))
    return a, g


def record_shapes(model: nn.Module, names: Sequence[str], average_positions: bool
                  ) -> tuple[dict[str, tuple[int, int, tuple[float, int] | None]], list[Any]]:
    """Forward hooks that record, on the next call of the named modules, their factor-GEMM rows,
    the elements of their input and output (the output gradient has the output's shape), and
    for a convolution whose ``A`` comes from shifted views of its input, that product's FLOPs
    and GEMM size (:attr:`LayerShape.a_shifted`)."""
    rows: dict[str, tuple[int, int, tuple[float, int] | None]] = {}
    modules = dict(model.named_modules())

    def hook(name: str) -> Callable[..., None]:
        def run(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            shifted = None
            if isinstance(module, nn.Conv2d):
                count = output.shape[0] * output.shape[2] * output.shape[3]
                helper = helper_for(module)
                plan = helper.shifted_plan(inputs[0].shape) if helper is not None else None
                if plan is not None:
                    batch, channels = inputs[0].shape[:2]
                    shifted = (plan.flops(batch, channels), channels)
            elif average_positions:  # dpkfac: a 3-D Linear input is averaged over positions
                count = inputs[0].shape[0]
            else:
                count = inputs[0].numel() // inputs[0].shape[-1]
            rows[name] = (count, inputs[0].numel() + output.numel(), shifted)
        return run

    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    return rows, handles


@dataclass(frozen=True)
class RunSpec:
    """What one method's measurement needs, by name (picklable for a fresh process).

    Attributes:
        workload: Name in :data:`WORKLOADS`. rounds: Its rounds (None: the workload's).
        method: Name in :data:`METHODS`. device: Torch device string. threads: Torch threads.
        autocast: bf16 autocast for the forward and backward (GPU).
        check_size: Size of the GEMM throughput check before each timed step (0: none).
        keep_memory: Keep freed CPU memory in the process for reuse over the timed steps
            (:func:`run_method`).
    """

    workload: str
    rounds: int | None
    method: str
    device: str
    threads: int
    autocast: bool
    check_size: int = 0
    keep_memory: bool = True

    def resolve(self) -> tuple[Workload, Method]:
        workload = WORKLOADS[self.workload]
        if self.rounds is not None:
            workload = Workload(**{**workload.__dict__, "rounds": self.rounds})
        return workload, next(m for m in METHODS if m.name == self.method)


def current_device(name: str) -> torch.device:
    """The device ``name`` names, made the current one: the timing events, synchronisations
    and memory counters of this script and of ``core.timing`` act on the current GPU (with
    ``cuda:1`` they read an idle ``cuda:0``)."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is not None:  # "cuda" is the current one already
        torch.cuda.set_device(device)
    return device


def measure_method(spec: RunSpec) -> tuple[MethodRun, int]:
    """A method's run on a workload and the peak memory of the base optimizer's first steps,
    both in this process (which :func:`measure_isolated` makes a fresh one)."""
    torch.set_num_threads(spec.threads)
    device = current_device(spec.device)
    workload, method = spec.resolve()
    clock, memory = Clock(device), MemoryProbe(device)

    def autocast() -> AbstractContextManager[Any]:
        return bf16_autocast(device) if spec.autocast else nullcontext()

    base, base_peak = run_base(workload, device, memory, autocast)
    return (run_method(workload, method, base, device, clock, memory, autocast,
                       spec.check_size, spec.keep_memory), base_peak)


def measure_isolated(spec: RunSpec) -> tuple[MethodRun, int]:
    """:func:`measure_method` in a fresh process, so what earlier methods left behind (heap
    fragmentation, huge pages held, allocator caches, a warmed-up GPU allocator) cannot move
    this method's time or memory, and every method starts as a user's training run does."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_method, (spec,))


# Lower bounds --------------------------------------------------------------------------------
def stage_bounds(method: Method, layers: Sequence[LayerShape], rates: Rates
                 ) -> dict[str, dict[str, float]]:
    """Seconds each stage needs at least, on an update step and on a plain step.

    FLOP counts at the measured rate of the same kernel kind, at the nearest measured size:
    factors are symmetric rank-k updates (``rows·d²`` FLOPs per factor, GEMM rate), except a
    stride-1 convolution's ``A`` formed from shifted views of its input, which counts that
    product's FLOPs (:attr:`LayerShape.a_product`);
    decompositions are ``n³`` at the measured rate of their kind (eigh, Cholesky factorisation
    and inverse, or the factorisation alone for ``cholesky_solve``); preconditioning is GEMMs
    (``2·g·a·(g + a)`` FLOPs, twice that for the eigenbasis rotations) or, for
    ``cholesky_solve``, four triangular solves of the same FLOPs at the measured triangular-solve
    rate (two against each factor); each factor's product counts at the GEMM rate of the
    dtype its state is kept in (bf16 with ``precondition_dtype``, unless the tolerance kept it
    fp32), whose bytes it reads; the triangular solves' rate is that of the in-place solves
    the library runs. Memory-bound work counts the passes over its data at the copy rate of
    that data's size (:meth:`Rates.passes`): a stage's first pass over a layer's data at the
    rate of all the bytes the stage streams (in the caches only if they all fit), its further
    passes at the rate of the layer's own bytes (in cache since the first). The rank-1
    statistics read each layer's input and output gradient once (the row means need no
    patches), MKOR's rank-1 updates read and write the inverses as kept, Eva's closed form reads the
    gradient and writes ``.grad`` with the KL clip's scale folded in (so its scale stage needs
    nothing), and K-FAC's and MKOR's scale reads ``P`` and the gradient and writes ``.grad``.
    Capture (building factor rows) has no bound of its own: a lower bound need not materialise
    rows, so it counts as overhead of ``factors``. Every stage must also read its inputs once
    (the captured input and output gradient for ``factors``; factors, gradients and inverses
    for the others), so each layer's bound is the larger of that read and its compute, which
    can overlap.
    """
    word = 4  # fp32
    update = dict.fromkeys(WORK, 0.0)
    plain = dict.fromkeys(WORK, 0.0)

    def gemm_kind(state_word: int) -> str:
        return "gemm_bf16" if state_word == 2 else "gemm"

    def states(layer: LayerShape) -> int:  # bytes of the two states as kept
        return layer.a_dim**2 * layer.a_word + layer.g_dim**2 * layer.g_word

    def operands(layer: LayerShape) -> int:  # the gradient and the two states
        return layer.g_dim * layer.a_dim * word + states(layer)

    # What each stage streams over all layers: the rate of its first pass over each layer
    stream = {
        "factors": sum(x.captured for x in layers) * word,
        # K-FAC decomposes its fp32 factors, MKOR updates its inverses as kept
        "inversion": sum(states(x) if method.kind == "mkor" else (x.a_dim**2 + x.g_dim**2) * word
                         for x in layers),
        "precondition": sum(x.g_dim * x.a_dim * word if method.kind == "eva" else operands(x)
                            for x in layers),
        "scale": sum(x.g_dim * x.a_dim for x in layers) * word,
    }

    def at_least_read(seconds: float, elements: int, stage: str) -> float:
        return max(seconds, rates.passes(elements * word, stream=stream[stage]))

    for layer in layers:
        a, g, rows = layer.a_dim, layer.g_dim, layer.rows
        squares = a * a + g * g
        gemm = max(2 * g * a * g / rates.at(gemm_kind(layer.g_word), min(g, a))
                   + 2 * g * a * a / rates.at(gemm_kind(layer.a_word), min(g, a)),
                   rates.passes(operands(layer), stream=stream["precondition"]))
        # read P and the gradient (the KL clip's products), write .grad
        scale = rates.passes(g * a * word, 3, stream=stream["scale"])
        if method.kind == "kfac":
            a_flops, a_size = layer.a_product
            update["factors"] += at_least_read(
                a_flops / rates.at("gemm", a_size) + rows * g * g / rates.at("gemm", g),
                layer.captured, "factors")
            kind = method.decomposition
            update["inversion"] += at_least_read(
                sum(d**3 / rates.at(kind, d) for d in (a, g)), squares, "inversion")
            if kind == "potrf":
                solves = rates.seconds("trsm", a, 2 * g * a * a) + rates.seconds(
                    "trsm", g, 2 * a * g * g)
                precondition = at_least_read(solves, g * a + squares, "precondition")
            else:
                precondition = (2 if kind == "eigh" else 1) * gemm
            step_work = {"precondition": precondition, "scale": scale}
        else:  # row means: the layer's input and output gradient, each read once
            update["factors"] += at_least_read(0.0, layer.captured, "factors")
            if method.kind == "mkor":  # matvec, then the rank-1 update (read and write)
                update["inversion"] += rates.passes(states(layer), 3,
                                                    stream=stream["inversion"])
                # its per-layer rescale runs (and is timed) in its precondition stage
                step_work = {"precondition": gemm + scale, "scale": 0.0}
            else:  # eva: a bilinear form and the KL term in one read of the gradient, then
                # one rank-1 update of it into .grad, the clip's scale folded in (as K-FAC's)
                step_work = {"precondition": rates.passes(g * a * word, 3,
                                                          stream=stream["precondition"]),
                             "scale": 0.0}
        for stage, seconds in step_work.items():
            update[stage] += seconds
            plain[stage] += seconds
    return {"update": update, "plain": plain}


def amortize(update: float, plain: float, interval: int) -> float:
    """Mean per-step value when one step in ``interval`` is an update step."""
    return (update + (interval - 1) * plain) / interval


# Report --------------------------------------------------------------------------------------
@dataclass
class Row:
    """One (workload, method, interval) line of the results."""

    workload: str
    method: str
    interval: int
    step_s: float
    ratio: float
    stages_s: dict[str, float]
    bound_s: dict[str, float]
    work_ratio: float
    memory_over_base_mb: float
    state_mb: float
    memory_ratio: float
    factor_gemm_fraction: float | None
    inversion_fraction: float | None
    failures: int
    gemm_speed: float | None = None


def summarise(workload: str, base_peak: int, method: Method, run: MethodRun, rates: Rates,
              intervals: Sequence[int]) -> list[Row]:
    """Amortized rows of one method for every interval.

    Args:
        workload: Its name.
        base_peak: Peak bytes of the base run.
        method: The method.
        run: Its measurements.
        rates: This machine's kernel rates, for the bounds.
        intervals: Update intervals to amortize over.
    """
    bounds = stage_bounds(method, run.layers, rates)
    over = (run.peak_bytes - base_peak) / MB
    state = run.state_bytes / MB
    factor_flops = sum(x.a_product[0] + x.rows * x.g_dim**2 for x in run.layers)
    factor_s = run.stage_median("update", "factors")
    decomposition_flops = NOMINAL_FLOPS.get(method.decomposition, 0.0) * sum(
        x.a_dim**3 + x.g_dim**3 for x in run.layers)
    inversion_s = run.stage_median("update", "inversion")
    dense = method.kind == "kfac"
    # How fast GEMMs ran in the method's process against the rate the bounds use at that size
    speed = (statistics.median(run.gemm_checks) / rates.at("gemm", run.gemm_check_size)
             if run.gemm_checks else None)
    rows = []
    for n in intervals:
        stages = {c: amortize(run.stage_median("update", c), run.stage_median("plain", c), n)
                  for c in COLUMNS}
        bound = {s: amortize(bounds["update"][s], bounds["plain"][s], n) for s in WORK}
        work = sum(stages[s] for s in WORK)
        rows.append(Row(
            workload, method.name, n,
            amortize(run.median("update"), run.median("plain"), n),
            amortize(run.ratio("update"), run.ratio("plain"), n), stages, bound,
            work / max(sum(bound.values()), 1e-12), over, state,
            over / state if state else math.nan,
            factor_flops / factor_s / rates.peak_gemm if dense and factor_s > 0 else None,
            decomposition_flops / inversion_s / rates.peak_gemm
            if dense and inversion_s > 0 else None,
            run.failures, speed))
    return rows


def markdown_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def results_table(rows: Sequence[Row], base_steps: dict[str, float]) -> str:
    """The main table: amortized step, ratio, stages, bound ratio and memory."""
    header = ["workload", "method", "every", "step s", "x base", *[f"{c} ms" for c in COLUMNS],
              "work / bound", "mem over base MB", "factors+inv MB", "mem ratio"]
    lines = [[w, "base", "-", f"{s:.3f}", "1.00", *["-"] * len(COLUMNS), "-", "-", "-", "-"]
             for w, s in base_steps.items()]
    for r in rows:
        lines.append([r.workload, r.method, str(r.interval), f"{r.step_s:.3f}", f"{r.ratio:.2f}",
                      *[f"{1e3 * r.stages_s[c]:.1f}" for c in COLUMNS], f"{r.work_ratio:.2f}",
                      f"{r.memory_over_base_mb:.0f}", f"{r.state_mb:.0f}",
                      f"{r.memory_ratio:.2f}"])
    lines.sort(key=lambda line: list(base_steps).index(line[0]))
    return markdown_table(header, lines)


def bound_table(rows: Sequence[Row]) -> str:
    """Per-stage ratio of measured time to its lower bound (capture counted in factors)."""
    header = ["workload", "method", "every", "factors", "inversion", "precondition", "scale",
              "all work", "factor GEMM / matmul", "inversion / matmul", "GEMM in run / rate"]

    def ratio(r: Row, stage: str) -> str:
        spent = r.stages_s[stage] + (r.stages_s["capture"] if stage == "factors" else 0.0)
        bound = r.bound_s[stage]
        return f"{spent / bound:.2f}" if bound > 0 else "-"

    def fraction(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [[r.workload, r.method, str(r.interval),
              *[ratio(r, s) for s in ("factors", "inversion", "precondition", "scale")],
              f"{r.work_ratio:.2f}", fraction(r.factor_gemm_fraction),
              fraction(r.inversion_fraction), fraction(r.gemm_speed)] for r in rows]
    return markdown_table(header, lines)


def rates_table(rates: Rates) -> str:
    header = ["kernel", *[str(n) for n in rates.gemm]]
    lines = [["GEMM GFLOP/s", *[f"{v / 1e9:.1f}" for v in rates.gemm.values()]],
             ["bf16 GEMM GFLOP/s", *[f"{v / 1e9:.1f}" for v in rates.gemm_bf16.values()]]]
    for kind, label in KERNEL_LABELS.items():
        table: dict[int, float] = getattr(rates, kind)
        flops = NOMINAL_FLOPS[kind]
        lines.append([f"{label} GFLOP/s (nominal {flops:.3g}n³)",
                      *[f"{flops * v / 1e9:.1f}" for v in table.values()]])
    return (markdown_table(header, lines)
            + f"\n\nCopy bandwidth: {rates.bandwidth / 1e9:.1f} GB/s (read + write)"
            + ("; of the same buffers again and again, by size: " + ", ".join(
                f"{n / 2**20:g} MiB {rate / 1e9:.1f}" for n, rate in rates.copy.items())
               + " GB/s" if rates.copy else "") + ".")


@dataclass(frozen=True)
class Peers:
    """Peer step times as multiples of their first-order step (KAISA's measured here by
    ``scripts/measure_peer_kaisa.py``; the others as the issue author measured them).

    Attributes:
        resnet_inverse: ResNet-18 (32x32, batch 32), K-FAC inverse method every 10 steps:
            KAISA, the DP-KFAC code and the MKOR code.
        bert_dpkfac: Small BERT every 10 steps, DP-KFAC (inverse).
        bert_mkor: Small BERT every 10 steps, MKOR.
        resnet_inverse_bf16: As ``resnet_inverse``, with the inverses kept and applied in bf16
            (KAISA's ``inv_dtype=torch.bfloat16``): the peers of the ``-bf16`` methods.
    """

    resnet_inverse: dict[str, float]
    bert_dpkfac: float
    bert_mkor: float
    resnet_inverse_bf16: dict[str, float] = field(default_factory=dict)


def find(rows: Sequence[Row], workload: str, method: str, interval: int) -> Row | None:
    for r in rows:
        if (r.workload, r.method, r.interval) == (workload, method, interval):
            return r
    return None


#: On the CPU, the resident-set probe moves by some tens of MB with heap reuse: a memory target
#: is judged only for methods whose state is larger than this.
CPU_MEMORY_FLOOR_MB = 128.0


#: How much faster than the fastest peer a step must be (issue #10).
PEER_SPEEDUP = 1.5


def targets(rows: Sequence[Row], peers: Peers, memory_floor_mb: float) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured values and whether it is met.

    ``met`` is None when the measurement cannot decide; ``note`` then says why: the state is
    below ``memory_floor_mb``, or a peer is so close to the first-order step that being 1.5x
    faster would need a step faster than the first-order one (then the overhead over that step
    is compared instead, in a target of its own). The work targets are judged against the
    bounds as measured; ``aside`` gives them again at the GEMM throughput the method's own
    process saw (``Row.gemm_speed``), for reading a run on a machine that slowed down.
    """
    out: list[dict[str, Any]] = []

    def add(name: str, values: list[float], limit: float, at_least: bool,
            undecided: str | None = None, why_not: str | None = None,
            aside: str | None = None) -> None:
        met = all((v >= limit) if at_least else (v <= limit) for v in values)
        out.append({"target": name, "measured": values, "limit": limit, "at_least": at_least,
                    "met": None if undecided else met,
                    "note": undecided or (None if met else why_not), "aside": aside})

    pairs = dict.fromkeys((r.workload, r.method) for r in rows)
    for workload, method in pairs:
        mine = [r for r in rows if (r.workload, r.method) == (workload, method)]
        every = "/".join(str(r.interval) for r in mine)
        speeds = [r.gemm_speed for r in mine]
        add(f"{workload} {method}: second-order work / lower bound, every {every}",
            [r.work_ratio for r in mine], 1.3, False,
            aside=None if None in speeds else "at the in-run GEMM rate: " + " / ".join(
                f"{r.work_ratio * speed:.2f}" for r, speed in zip(mine, speeds, strict=True)))
        if not math.isnan(mine[0].memory_ratio):
            noisy = mine[0].state_mb < memory_floor_mb
            add(f"{workload} {method}: memory over base / (factors + inverses)",
                [mine[0].memory_ratio], 1.2, False,
                "n/a (state below the probe's noise)" if noisy else None)
    fastest = min(peers.resnet_inverse.values())
    comparisons = [("resnet18-32", "kfac-inverse", fastest),
                   ("resnet18-32", "kfac-solve", fastest),
                   ("resnet18-32", "dp-kfac", fastest),
                   ("bert-small", "dp-kfac", peers.bert_dpkfac),
                   ("bert-small", "mkor", peers.bert_mkor)]
    if peers.resnet_inverse_bf16:
        fastest_bf16 = min(peers.resnet_inverse_bf16.values())
        comparisons += [("resnet18-32", "kfac-inverse-bf16", fastest_bf16),
                        ("resnet18-32", "dp-kfac-bf16", fastest_bf16)]
    for workload, method, peer in comparisons:
        r = find(rows, workload, method, 10)
        if r is None:
            continue
        infeasible = peer < PEER_SPEEDUP
        # The step the work's lower bound (at this machine's kernel rates) allows, in base steps.
        floor = 1 + sum(r.bound_s.values()) * r.ratio / r.step_s
        add(f"{workload} {method} every 10: step speed-up over the fastest peer "
            f"({peer:g}x base)", [peer / r.ratio], PEER_SPEEDUP, True,
            f"infeasible as stated (needs a step below {peer / PEER_SPEEDUP:.2f}x the "
            "first-order step); see the overhead row" if infeasible else None,
            f"out of reach at this precision: the work's lower bound at the measured kernel "
            f"rates alone makes the step {floor:.2f}x the first-order one, the target needs "
            f"below {peer / PEER_SPEEDUP:.2f}x" if floor > peer / PEER_SPEEDUP else None)
        if infeasible:
            overhead = r.ratio - 1
            add(f"{workload} {method} every 10: overhead over base, peer's / ours "
                f"({peer - 1:.2f} / {overhead:.2f})",
                [(peer - 1) / overhead] if overhead > 0 else [], PEER_SPEEDUP, True,
                None if overhead > 0 else
                "n/a (our overhead is below this run's noise: measure with more --rounds)")
    r = find(rows, "bert-small", "mkor", 10)
    if r is not None:
        add("bert-small mkor every 10: step / LAMB step", [r.ratio], 1.1, False,
            None if r.ratio >= 1 else
            "n/a (below the LAMB step: this run's noise; measure with more --rounds)")
    return out


def targets_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [[t["target"], " / ".join(f"{v:.2f}" for v in t["measured"])
              + (f" ({t['aside']})" if t.get("aside") else ""),
              ("≥ " if t["at_least"] else "≤ ") + f"{t['limit']:g}",
              t["note"] if t["met"] is None else "met" if t["met"] else
              "**not met**" + (f": {t['note']}" if t["note"] else "")]
             for t in results]
    return markdown_table(["target", "measured", "limit", "status"], lines)


# Driver --------------------------------------------------------------------------------------
def memory_policy(keep: bool) -> str:
    """What the timed steps do with freed CPU memory (:func:`run_method`), for the run's
    environment."""
    if not keep:
        return "returned to the system (the C library's default)"
    if platform.libc_ver()[0] == "glibc":
        return ("kept in the process for reuse in the timed steps (glibc mallopt: no mmap, "
                "no trim), returned in the warm-up steps that measure memory")
    return "returned to the system (not glibc: it cannot be told to keep it)"


def environment(device: torch.device) -> dict[str, Any]:
    """Thread settings, versions and hardware, recorded with every result."""
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"), "device": str(device),
    }
    env["cpu_model"] = host_kernels.cpuinfo_field("model name")
    env["cpu_vendor"] = host_kernels.cpu_vendor()
    threshold = core.inverse.TRANSPOSED_SOLVE_MIN_ROWS
    env["cholesky_solve A side"] = (
        f"on a transposed copy from {threshold} gradient rows"
        if threshold is not None and core.inverse.transposes_a_side(threshold, device)
        else "in place, from the right")
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


@contextmanager
def bf16_autocast(device: torch.device) -> Iterator[None]:
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help``); counts and the device are checked when parsed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and kernel sizes: a smoke run of 1-3 minutes")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        help=f"default: {' '.join(FULL)} (--quick: {' '.join(QUICK)})")
    parser.add_argument("--methods", nargs="+", choices=[m.name for m in METHODS],
                        default=[m.name for m in METHODS])
    parser.add_argument("--intervals", nargs="+", type=positive_int, default=list(INTERVALS),
                        help="steps per second-order update the results are amortized over")
    parser.add_argument("--rounds", type=positive_int, help="timed rounds per method (default: "
                        "per workload; each is one update and two plain steps)")
    parser.add_argument("--device", type=device_name,
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, auto, cuda or cuda:N (default: cuda when there is one)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default 1)")
    parser.add_argument("--no-autocast", action="store_true",
                        help="on a GPU, run the forward and backward in fp32")
    parser.add_argument("--json", type=Path, help="write every measurement to this file")
    parser.add_argument("--reamortize", type=Path, metavar="JSON",
                        help="measure nothing: print a saved run's results, bounds and targets "
                             "amortized over --intervals, from its raw steps")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every method in this process, one after another, "
                             "instead of each in a fresh one (faster to start; what earlier "
                             "methods leave in the allocator then moves later ones)")
    parser.add_argument("--release-freed-memory", action="store_true",
                        help="let the C library return freed CPU memory to the system, its "
                             "default, so every step faults its large tensors in afresh (by "
                             "default the benchmark keeps freed memory for reuse: "
                             "core.host_memory, docs/benchmarks.md 'Freed memory')")
    peer_note = (" (default %s; with --reamortize, the saved run's unless given: peers "
                 "measured on the run's host afterwards)")
    parser.add_argument("--peer-kaisa", type=float,
                        help="KAISA's step every 10 over SGD's, measured with its public code "
                             "by scripts/measure_peer_kaisa.py on the host of the run "
                             "(docs/peers.md; the issue author gave 12.5)"
                             + peer_note % PEER_DEFAULTS["peer_kaisa"])
    parser.add_argument("--peer-kaisa-bf16", type=float,
                        help="the same with KAISA's inverses in bf16 (inv_dtype), measured by "
                             "scripts/measure_peer_kaisa.py --inv-dtype bfloat16"
                             + peer_note % PEER_DEFAULTS["peer_kaisa_bf16"])
    for name in ("peer_dpkfac", "peer_mkor", "peer_bert_dpkfac", "peer_bert_mkor"):
        parser.add_argument("--" + name.replace("_", "-"), type=float,
                            help=peer_note.strip() % PEER_DEFAULTS[name])
    return parser


# The peers' step times over their first-order step: KAISA's measured on the Intel Xeon host of
# docs/peers.md (its /proc/cpuinfo model name: PEER_KAISA_HOST), the others the issue author's.
PEER_DEFAULTS = {"peer_kaisa": 3.17, "peer_kaisa_bf16": 2.53, "peer_dpkfac": 10.9,
                 "peer_mkor": 6.6, "peer_bert_dpkfac": 1.26, "peer_bert_mkor": 1.19}
PEER_KAISA_HOST = "Intel(R) Xeon(R) Processor"


def _kaisa_given(args: argparse.Namespace) -> bool:
    return args.peer_kaisa is not None or args.peer_kaisa_bf16 is not None


def kaisa_defaults_elsewhere(args: argparse.Namespace, cpu_model: str | None) -> bool:
    """Whether the targets judge against KAISA's default figures on a host other than theirs
    (a peer's ratio to the first-order step belongs to the host it was measured on:
    docs/peers.md)."""
    return not _kaisa_given(args) and cpu_model != PEER_KAISA_HOST


def kaisa_provenance(args: argparse.Namespace, cpu_model: str | None) -> str:
    """Where the KAISA figures the targets judge against come from, and for the defaults on
    another host what to do."""
    if _kaisa_given(args):
        return "given on the command line"
    provenance = f"the defaults, measured on {PEER_KAISA_HOST}"
    if not kaisa_defaults_elsewhere(args, cpu_model):
        return provenance
    return (f"{provenance}, not this host ({cpu_model or 'unknown'}): measure KAISA here "
            "(scripts/measure_peer_kaisa.py) and judge this run against it with --reamortize "
            "RUN.json --peer-kaisa X --peer-kaisa-bf16 Y")


def peers_from_args(args: argparse.Namespace, saved: Peers | None = None) -> Peers:
    """The peer step times given on the command line, the rest from ``saved`` (a saved run's)
    or else the defaults."""
    fallback = dict(PEER_DEFAULTS)
    if saved is not None:
        fallback.update({"peer_kaisa": saved.resnet_inverse["KAISA"],
                         "peer_dpkfac": saved.resnet_inverse["DP-KFAC"],
                         "peer_mkor": saved.resnet_inverse["MKOR"],
                         "peer_bert_dpkfac": saved.bert_dpkfac, "peer_bert_mkor": saved.bert_mkor})
        fallback["peer_kaisa_bf16"] = saved.resnet_inverse_bf16.get("KAISA")
    value = {name: getattr(args, name) if getattr(args, name) is not None else default
             for name, default in fallback.items()}
    bf16 = value["peer_kaisa_bf16"]
    return Peers({"KAISA": value["peer_kaisa"], "DP-KFAC": value["peer_dpkfac"],
                  "MKOR": value["peer_mkor"]}, value["peer_bert_dpkfac"],
                 value["peer_bert_mkor"], {} if bf16 is None else {"KAISA": bf16})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its markdown tables, and return (and optionally write) them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reamortize is not None:
        with exit_on_user_error(parser):
            saved = read_json_file(args.reamortize, "--reamortize")
            try:
                peers = peers_from_args(args, Peers(**saved["peers"]))
                out = reamortize(saved, args.intervals, peers)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:  # another shape
                raise ConfigError("--reamortize", str(args.reamortize),
                                  "a results file of this script's current --json format "
                                  f"(it lacks or misshapes {exc})") from None
        print(tables_markdown({k: out["tables"][k] for k in ("results", "bounds", "targets")}))
        write_json(args.json, out)
        return out
    torch.set_num_threads(args.threads)
    freed_memory = memory_policy(not args.release_freed_memory)
    device = current_device(args.device)
    clock = Clock(device)
    use_autocast = device.type == "cuda" and not args.no_autocast
    names = args.workloads or (QUICK if args.quick else FULL)
    methods = [m for m in METHODS if m.name in args.methods]
    peers = peers_from_args(args)
    env = environment(device)
    env["freed CPU memory"] = freed_memory
    env["KAISA figures"] = kaisa_provenance(args, env.get("cpu_model"))
    if kaisa_defaults_elsewhere(args, env.get("cpu_model")) and "resnet18-32" in names:
        print(f"bench.py: KAISA figures are {env['KAISA figures']}", file=sys.stderr,
              flush=True)
    load = {"start": os.getloadavg()}
    started = time.perf_counter()
    sizes = (32, 64, 128) if args.quick else (256, 512, 1024, 2048)
    rows: list[Row] = []
    base_steps: dict[str, float] = {}
    drift: dict[str, str] = {}
    raw: dict[str, dict[str, Any]] = {}
    all_rates: dict[str, Rates] = {}
    for name in names:
        workload = WORKLOADS[name]

        def rates_now(workload: Workload = workload) -> Rates:
            return measure_rates(sorted({*sizes, largest_factor(workload)}), device, clock,
                                 copy_elements=2**20 if args.quick else 2**26)

        before = all_rates[name] = rates_now()
        raw[name] = {"load_before": os.getloadavg()}
        measured = {}
        for method in methods:
            spec = RunSpec(name, args.rounds, method.name, args.device, args.threads,
                           use_autocast, check_size=min(sizes, key=lambda n: abs(n - 1024)),
                           keep_memory=not args.release_freed_memory)
            measured[method.name] = (measure_method(spec) if args.in_process
                                     else measure_isolated(spec))
            run, base_peak = measured[method.name]
            raw[name][method.name] = asdict(run) | {"base_peak_bytes": base_peak}
            # What is measured so far, for --reamortize if the run is cut off (a time limit).
            write_json(args.json, partial_record(env, load, all_rates, names, peers, raw))
        runs = {m: run for m, (run, _) in measured.items()}
        # A shared machine slows down at times: the rates are the best of two measurements,
        # one before the runs and one after, so a slow spell cannot lower a bound.
        rates = all_rates[name] = before.fastest(rates_now())
        base_steps[name] = base_step(runs.values())
        drift[name] = base_drift(runs)
        for method in methods:
            run, base_peak = measured[method.name]
            rows += summarise(name, base_peak, method, run, rates, args.intervals)
        raw[name]["load_after"] = os.getloadavg()
        print(f"[{name} done at {time.perf_counter() - started:.0f} s, load "
              f"{os.getloadavg()[0]:.2f}]", file=sys.stderr, flush=True)
    load["end"] = os.getloadavg()
    goals = targets(rows, peers, memory_floor(device.type))
    env["methods measured"] = ("one after another in this process" if args.in_process
                               else "each in a fresh process")
    env["base step beside each method (s, in run order)"] = "; ".join(
        f"{name}: {text}" for name, text in drift.items())
    tables = {
        "environment": "\n".join(f"- {k}: {v}" for k, v in env.items())
        + f"\n- load average (1, 5, 15 min): start {load['start']}, end {load['end']}"
        + f"\n- wall time: {time.perf_counter() - started:.0f} s",
        "rates": "\n\n".join(f"{name}:\n\n{rates_table(r)}" for name, r in all_rates.items()),
        "results": results_table(rows, base_steps),
        "bounds": bound_table(rows),
        "targets": targets_table(goals),
    }
    print(tables_markdown(tables))
    out = {"environment": env, "load": load,
           "rates": {name: asdict(r) for name, r in all_rates.items()}, "workloads":
           {n: WORKLOADS[n].description for n in names}, "peers": asdict(peers),
           "rows": [asdict(r) for r in rows], "targets": goals, "raw": raw, "tables": tables}
    write_json(args.json, out)
    return out


def partial_record(env: dict[str, Any], load: dict[str, Any], rates: dict[str, Rates],
                   names: Sequence[str], peers: Peers, raw: dict[str, dict[str, Any]]
                   ) -> dict[str, Any]:
    """The record of a run still going: its raw measurements and the rates so far, without
    rows or tables (``--reamortize`` computes them, when the run was cut off)."""
    return {"partial": True, "environment": env, "load": load,
            "rates": {name: asdict(r) for name, r in rates.items()},
            "workloads": {n: WORKLOADS[n].description for n in names}, "peers": asdict(peers),
            "rows": [], "targets": [], "raw": raw, "tables": {}}


def write_json(path: Path | None, out: dict[str, Any]) -> None:
    """Write a run's record to ``path`` (``--json``), if given, atomically (a run killed while
    writing leaves the previous record whole)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(out, indent=1, default=str))
        os.replace(temporary, path)


def tables_markdown(tables: dict[str, str]) -> str:
    """The printed (and documented) form of a run's tables: one ``###`` section each."""
    return "\n".join(f"\n### {title}\n\n{table}" for title, table in tables.items())


def rerender_targets(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run with its targets judged again from its rows by :func:`targets` (after the
    targets' rules change; the measurements are untouched)."""
    rows = [Row(**r) for r in saved["rows"]]
    goals = targets(rows, Peers(**saved["peers"]), saved_memory_floor(saved))
    return {**saved, "targets": goals, "tables": {**saved["tables"],
                                                  "targets": targets_table(goals)}}


def base_step(runs: Iterable[MethodRun]) -> float:
    """A workload's first-order step: the median of the base steps run beside its methods."""
    return statistics.median(t for run in runs for t in run.base_seconds)


#: Spread of a workload's base step from one method's run to another's above which the run
#: says that the host's speed moved while it ran.
BASE_DRIFT_FLAG = 1.10


def base_drift(runs: dict[str, MethodRun]) -> str:
    """The base step's median beside each method, in the order they ran, and their spread.

    Each step's ratio pairs it with the base step run just before it, so it survives a host
    that slows down; a stage's ratio to its bound does not, since the bounds take the rates of
    the run's quieter moments (:meth:`Rates.fastest`). A spread above
    :data:`BASE_DRIFT_FLAG` says so.
    """
    medians = {name: statistics.median(run.base_seconds) for name, run in runs.items()}
    spread = max(medians.values()) / min(medians.values())
    text = (", ".join(f"{name} {seconds:.3f}" for name, seconds in medians.items())
            + f" (spread {spread:.2f}x)")
    if spread > BASE_DRIFT_FLAG:
        text += (": the host's speed moved during the run; its stage ratios to the bounds "
                 "read high where it was slow")
    return text


def memory_floor(device_type: str) -> float:
    """Memory below which a method's state is within the probe's noise (:func:`targets`)."""
    return 0.0 if device_type == "cuda" else CPU_MEMORY_FLOOR_MB


def saved_memory_floor(saved: dict[str, Any]) -> float:
    """:func:`memory_floor` of the device a saved run measured."""
    return memory_floor(saved["environment"]["device"].split(":")[0])


def saved_method_run(raw: dict[str, Any]) -> tuple[MethodRun, int]:
    """A method's measurements as :func:`main` saves them (``raw``), and the peak bytes of its
    process's base run."""
    fields = {k: v for k, v in raw.items() if k != "base_peak_bytes"}
    layers = [LayerShape(**{**x, "a_shifted": None if x["a_shifted"] is None
                            else tuple(x["a_shifted"])}) for x in fields["layers"]]
    return MethodRun(**{**fields, "layers": layers}), raw["base_peak_bytes"]


def reamortize(saved: dict[str, Any], intervals: Sequence[int],
               peers: Peers | None = None) -> dict[str, Any]:
    """A saved run's rows, targets and their tables amortized over ``intervals`` from its raw
    steps and rates: the update and plain steps it timed do not depend on the interval, so
    nothing is measured again (a run made with ``--intervals 10`` read every step, say).
    ``peers`` replaces the saved run's peer step times (measured on its host afterwards)."""
    peers = peers or Peers(**saved["peers"])
    rows: list[Row] = []
    base_steps: dict[str, float] = {}
    for name, raw in saved["raw"].items():
        rates = Rates(**{kind: {int(n): rate for n, rate in value.items()}
                         if isinstance(value, dict) else value
                         for kind, value in saved["rates"][name].items()})
        runs = {m.name: saved_method_run(raw[m.name]) for m in METHODS if m.name in raw}
        base_steps[name] = base_step(run for run, _ in runs.values())
        for method in METHODS:
            if method.name in runs:
                run, base_peak = runs[method.name]
                rows += summarise(name, base_peak, method, run, rates, intervals)
    goals = targets(rows, peers, saved_memory_floor(saved))
    tables = {**saved["tables"], "results": results_table(rows, base_steps),
              "bounds": bound_table(rows), "targets": targets_table(goals)}
    return {**saved, "peers": asdict(peers), "rows": [asdict(r) for r in rows], "targets": goals,
            "tables": tables}


if __name__ == "__main__":
    main()
