"""Train a small CNN with distributed K-FAC and print the communication ledger.

    torchrun --nproc_per_node=4 scripts/torchrun_example.py --strategy comm-opt
    torchrun --nproc_per_node=4 scripts/torchrun_example.py --strategy all --no-ddp
    python scripts/torchrun_example.py            # one process: nothing is communicated

Runs on gloo (CPU) or NCCL (one GPU per process) unchanged. Data: synthetic 28×28 images of
10 classes (default), or Fashion-MNIST from its IDX ``.gz`` files (``--data fashion-mnist``;
Debian's ``dataset-fashion-mnist`` installs them under /usr/share/datasets/fashion-mnist).
Each step every rank trains on its slice of one global batch; without DDP the gradients are
averaged by ``core.distributed.average_gradients`` (ledger stage ``grad_allreduce``).
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from core import KFACPreconditioner
from core.config import STRATEGIES
from core.distributed import average_gradients
from reproductions.common.cli import exit_on_user_error, float_in, positive_int
from reproductions.common.launch import cleanup, finished


def setup() -> torch.device:
    """Join the torchrun job if there is one; the device this rank computes on."""
    if "RANK" not in os.environ:
        return torch.device("cpu")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)  # eigh slows down hundreds of times when threads oversubscribe
    return torch.device("cpu")


def rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


IMAGES = "train-images-idx3-ubyte.gz"
"""Fashion-MNIST's training images in the Debian package's folder."""


def load_data(kind: str, data_dir: Path, n: int) -> tuple[Tensor, Tensor]:
    """``n`` images ``(n, 1, 28, 28)`` and labels, identical on every rank."""
    if kind == "fashion-mnist":
        images = _idx(data_dir / IMAGES)[:n]
        labels = _idx(data_dir / "train-labels-idx1-ubyte.gz")[:n]
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        return (x - 0.286) / 0.353, torch.from_numpy(labels.astype(np.int64))
    generator = torch.Generator().manual_seed(0)
    templates = torch.randn(10, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    return templates[labels] + 2.0 * torch.randn(n, 1, 28, 28, generator=generator), labels


def make_model() -> nn.Module:
    """Two convolutions and two linear layers: four K-FAC layers of varied sizes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def train(strategy: str, args: argparse.Namespace, data: tuple[Tensor, Tensor],
          device: torch.device) -> None:
    rank, world_size = rank_and_size()
    x, y = data
    model = make_model().to(device)
    net = DistributedDataParallel(model) if args.ddp and world_size > 1 else model
    options: dict[str, object] = {}
    if strategy == "hybrid-opt":
        options["grad_worker_fraction"] = args.grad_worker_fraction
    precond = KFACPreconditioner(net, strategy=strategy, damping=args.damping, lr=args.lr,
                                 inv_update_steps=args.inv_update_steps,
                                 symmetry_aware=args.symmetry_aware,
                                 comm_dtype=args.comm_dtype,
                                 factors_in_backward=args.factors_in_backward, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    local = args.batch_size // world_size
    if rank == 0:
        print(f"\n=== {strategy}: {world_size} process(es), global batch {args.batch_size}, "
              f"{'DDP' if net is not model else 'average_gradients'} ===")
        print(precond.strategy.describe())
    for step in range(args.steps):
        start = (step * args.batch_size) % (len(x) - args.batch_size) + rank * local
        xb, yb = x[start:start + local].to(device), y[start:start + local].to(device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(xb), yb)
        loss.backward()
        if net is model:
            average_gradients(model.parameters(), precond.strategy.communicator)
        precond.step()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            value = loss.detach().clone()
            if world_size > 1:
                dist.all_reduce(value)
            if rank == 0:
                print(f"step {step:4d}  loss {value.item() / world_size:.4f}")
    report(precond, args.all_ranks)


def report(precond: KFACPreconditioner, all_ranks: bool) -> None:
    """Ledger summary (last step and all steps) and memory, of rank 0 or of every rank."""
    rank, world_size = rank_and_size()
    if world_size == 1:
        print("single process: nothing was communicated")
        return
    ledger = precond.strategy.communicator.ledger
    text = (f"{ledger.format_summary(step=precond.steps - 1)}\n{ledger.format_summary()}\n"
            f"memory (bytes): {precond.memory_usage()}")
    texts = [text]
    if all_ranks:
        texts = [""] * world_size
        dist.all_gather_object(texts, text)
    if rank == 0:
        print("\n".join(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="comm-opt", choices=(*STRATEGIES, "all"))
    parser.add_argument("--grad-worker-fraction", type=float_in(0.0, 1.0, low_inclusive=False),
                        default=0.5,
                        help="f for hybrid-opt (world size × f must divide the world size)")
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="global batch (a multiple of the number of processes)")
    parser.add_argument("--lr", type=float_in(0.0, low_inclusive=False), default=0.05)
    parser.add_argument("--damping", type=float_in(0.0, low_inclusive=False), default=1e-2)
    parser.add_argument("--inv-update-steps", type=positive_int, default=5)
    parser.add_argument("--symmetry-aware", action="store_true")
    parser.add_argument("--comm-dtype", choices=("float16", "bfloat16"), default=None)
    parser.add_argument("--factors-in-backward", action="store_true",
                        help="build factors in the backward hooks and start their all-reduce "
                             "there (KFACConfig.factors_in_backward)")
    parser.add_argument("--ddp", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the model in DistributedDataParallel (default) or average "
                             "gradients with core.distributed.average_gradients")
    parser.add_argument("--data", choices=("synthetic", "fashion-mnist"), default="synthetic")
    parser.add_argument("--data-dir", type=Path,
                        default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--examples", type=positive_int, default=4096)
    parser.add_argument("--log-every", type=positive_int, default=10)
    parser.add_argument("--all-ranks", action="store_true", help="print every rank's ledger")
    args = parser.parse_args()
    if args.examples <= args.batch_size:
        parser.error(f"--examples ({args.examples}) must exceed --batch-size "
                     f"({args.batch_size}): each step takes a window of the examples")
    if args.data == "fashion-mnist" and not (args.data_dir / IMAGES).is_file():
        parser.error(f"--data-dir {args.data_dir} holds no {IMAGES}: install the Debian "
                     "package (apt-get install dataset-fashion-mnist) or pass its folder")
    device = setup()
    world_size = rank_and_size()[1]
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} is not a multiple of the {world_size} "
                     "processes (each takes an equal share)")
    data = load_data(args.data, args.data_dir, args.examples)
    with exit_on_user_error(parser):  # an invalid K-FAC option (e.g. f for this world size)
        for strategy in (STRATEGIES if args.strategy == "all" else (args.strategy,)):
            train(strategy, args, data, device)
    finished()  # every rank done with every group before they are torn down
    cleanup()


if __name__ == "__main__":
    main()
