"""KAISA's step time (kfac-pytorch, Pauloski et al.) over the SGD step, and ours, in one run.

Issue #10's benchmark takes the peers' step times as inputs (``scripts/bench.py --peer-kaisa``).
This script measures KAISA's once, with its public code, on the benchmark's ResNet-18 cell:
ResNet-18 with the CIFAR stem at 32x32, batch 32, SGD (momentum 0.9, lr 0.01), K-FAC with
explicit inverses (``compute_method=INVERSE``, not eigen), factors and inverses every 10 steps,
KAISA's default damping (0.001), factor decay (0.95) and kl_clip (0.001), one process
(``grad_worker_fraction`` = COMM_OPT, nothing to communicate), no symmetry-aware communication,
fp32, one thread.

The measurement is bench.py's, reused from it (workload, model, batch, loss, base trainer, step
pattern, update schedule, ratio and amortization): a warm-up update and plain step, then rounds
of one update and two plain steps; every timed step follows a step of the SGD base on its own
copy of the model, and each ratio is the median over adjacent (step, base step) pairs of one
kind. The step every 10 is ``(T_update + 9 T_plain) / 10`` applied to those median ratios. Our
``kfac-inverse`` cell runs through bench.py's own method runner in the same process, against the
same base trainer, so both ratios come from one run; the runs go in blocks whose order alternates
(KAISA first, then ours first, ...) so that slow drift of the machine's load falls on both.

KAISA's step is its documented loop: ``loss.backward(); preconditioner.step(); optimizer.step()``
with the same first-order optimizer as the base. Its code is never vendored: it is imported from
``--peer-path``, where ``pip install --target`` put it (or where its public repository's
``kfac/`` package was laid, see docs/peers.md); the run records the version and the sha256 of
every file of it that was loaded.

    OMP_NUM_THREADS=1 python scripts/measure_peer_kaisa.py \\
        --json scripts/results/peer_kaisa_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools
# PyTorch backs large CPU tensors with transparent huge pages when this is set before its
# first allocation. Factors, inverses and products are allocated afresh every update, and
# faulting a 4608-square factor in 4 KiB pages costs a third of its syrk (docs/benchmarks.md,
# "Huge pages"). It applies to the first-order base as much. A value the caller set wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.host_memory import keep_freed_memory  # noqa: E402
from core.optim import build_optimizer  # noqa: E402
from reproductions.common.cli import positive_int  # noqa: E402
from scripts import bench  # noqa: E402

#: Where the peer package is looked for by default: outside the package, ignored by git.
DEFAULT_PEER_PATH = ROOT / ".peers" / "kaisa"
PIP_COMMAND = "python -m pip install --no-deps --target {path} kfac-pytorch"
INTERVAL = 10
#: Our method against KAISA with its inverses in each ``inv_dtype``.
OURS = {"float32": "kfac-inverse", "bfloat16": "kfac-inverse-bf16"}


class Preconditioner(Protocol):
    def step(self) -> None: ...


#: Builds a peer preconditioner over a model: (model, update schedule, learning rate).
PeerFactory = Callable[[torch.nn.Module, Callable[[int], int], float], Preconditioner]


# The peer's code -----------------------------------------------------------------------------
def load_kaisa(path: Path) -> ModuleType:
    """Import ``kfac`` (kfac-pytorch) from ``path`` and nowhere else.

    Raises:
        SystemExit: when ``path`` holds no ``kfac`` package, naming the command that puts it
            there, or when another ``kfac`` was imported first.
    """
    path = path.resolve()
    if not (path / "kfac" / "preconditioner.py").is_file():
        raise SystemExit(
            f"KAISA (kfac-pytorch) not found at {path}: install it outside this project's venv "
            f"with\n    {PIP_COMMAND.format(path=path)}\nor lay its public repository's kfac/ "
            "package there (docs/peers.md), then pass --peer-path.")
    sys.path.insert(0, str(path))
    import kfac
    import kfac.enums
    import kfac.preconditioner

    loaded = Path(kfac.__file__).resolve().parent
    if loaded != path / "kfac":
        raise SystemExit(f"imported kfac from {loaded}, not from {path}")
    return kfac


def peer_provenance(kfac: ModuleType) -> dict[str, Any]:
    """Version, the files of the peer's package that this process loaded, with their sha256,
    and the package's own provenance record (``PROVENANCE.json`` beside it) when there is one."""
    package = Path(kfac.__file__).resolve().parent
    files = {}
    for name, module in sorted(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if (name == "kfac" or name.startswith("kfac.")) and origin:
            rel = Path(origin).resolve().relative_to(package.parent).as_posix()
            files[rel] = hashlib.sha256(Path(origin).read_bytes()).hexdigest()
    manifest = "".join(f"{sha}  {rel}\n" for rel, sha in sorted(files.items()))
    info: dict[str, Any] = {
        "package": "kfac-pytorch", "import": "kfac", "path": str(package.parent),
        "version": getattr(kfac, "__version__", None), "loaded_files_sha256": files,
        "loaded_tree_sha256": hashlib.sha256(manifest.encode()).hexdigest(),
    }
    record = package.parent / "PROVENANCE.json"
    if record.is_file():
        info["provenance"] = json.loads(record.read_text())
    return info


def kaisa_factory(kfac: ModuleType, skip_layers: Sequence[str], inv_dtype: str = "float32"
                  ) -> PeerFactory:
    """KAISA configured as the benchmark cell (every keyword spelled out, defaults included);
    ``inv_dtype`` is the dtype KAISA keeps and applies its inverses in."""
    enums = kfac.enums

    def make(model: torch.nn.Module, schedule: Callable[[int], int], lr: float
             ) -> Preconditioner:
        return kfac.preconditioner.KFACPreconditioner(
            model, factor_update_steps=schedule, inv_update_steps=schedule,
            damping=0.001, factor_decay=0.95, kl_clip=0.001, lr=lr,
            compute_method=enums.ComputeMethod.INVERSE,
            grad_worker_fraction=enums.DistributedStrategy.COMM_OPT,
            symmetry_aware=False, inv_dtype=getattr(torch, inv_dtype), factor_dtype=None,
            skip_layers=list(skip_layers))

    return make


KAISA_CONFIG = {
    "compute_method": "INVERSE", "factor_update_steps": INTERVAL, "inv_update_steps": INTERVAL,
    "damping": 0.001, "factor_decay": 0.95, "kl_clip": 0.001, "lr": "the SGD lr",
    "grad_worker_fraction": "COMM_OPT (1.0; one process)", "symmetry_aware": False,
    "inv_dtype": "float32 (--inv-dtype)", "factor_dtype": "None (fp32 training)",
    "allreduce_bucket_cap_mb": "25 (default; no communication in one process)",
}


# Measurement ---------------------------------------------------------------------------------
class PeerTrainer:
    """The benchmark's model, batch and first-order optimizer, preconditioned by a peer, with
    its initial parameters (``start``; every step starts from them, as in bench.py).

    Args:
        workload: What to train (bench.py's).
        make_preconditioner: Builds the peer's preconditioner over the model.
        updates: Steps on which the peer updates its factors and inverses.
        device: Where to train.
    """

    def __init__(self, workload: bench.Workload, make_preconditioner: PeerFactory,
                 updates: frozenset[int], device: torch.device) -> None:
        torch.manual_seed(0)
        self.workload = workload
        self.model = workload.build().to(device)
        self.batch = workload.batch(device)
        self.optimizer = build_optimizer(workload.base, self.model, lr=workload.lr)
        self.preconditioner = make_preconditioner(
            self.model, bench.update_schedule(updates), workload.lr)
        self.start = bench.ParameterSnapshot(self.model)

    def step(self) -> None:
        """One training step, the peer's documented loop."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.workload.loss(self.model, self.batch)
        loss.backward()
        self.preconditioner.step()
        self.optimizer.step()


def run_peer(workload: bench.Workload, make_preconditioner: PeerFactory, base: bench.Trainer,
             device: torch.device, clock: bench.Clock) -> bench.MethodRun:
    """bench.run_method's pattern for a peer: each step right after a step of ``base``."""
    kinds = bench.step_kinds(workload.rounds)
    updates = frozenset(i for i, kind in enumerate(kinds) if kind == "update")
    trainer = PeerTrainer(workload, make_preconditioner, updates, device)
    seconds, base_seconds = [], []
    for _ in kinds:
        base.start.restore()
        base_seconds.append(clock.time(base.step))
        trainer.start.restore()
        seconds.append(clock.time(trainer.step))
    warm = bench.WARM_STEPS
    timed = len(kinds) - warm
    usage = getattr(trainer.preconditioner, "memory_usage", None)
    state = usage().get("total", 0) if usage is not None else 0
    return bench.MethodRun(kinds[warm:], seconds[warm:], base_seconds[warm:], [{}] * timed,
                           peak_bytes=0, state_bytes=int(state), layers=[], failures=0)


def concatenate(runs: Sequence[bench.MethodRun]) -> bench.MethodRun:
    """The timed steps of several runs of one method as one run (medians over all of them)."""
    return bench.MethodRun(
        [k for r in runs for k in r.kinds], [s for r in runs for s in r.seconds],
        [b for r in runs for b in r.base_seconds], [s for r in runs for s in r.stages],
        max(r.peak_bytes for r in runs), max(r.state_bytes for r in runs), runs[0].layers,
        sum(r.failures for r in runs))


def summary(run: bench.MethodRun, blocks: Sequence[int], interval: int) -> dict[str, Any]:
    """bench.py's amortized step and ratio, and every timed step."""
    return {
        "ratio": bench.amortize(run.ratio("update"), run.ratio("plain"), interval),
        "step_s": bench.amortize(run.median("update"), run.median("plain"), interval),
        "ratio_update": run.ratio("update"), "ratio_plain": run.ratio("plain"),
        "median_update_s": run.median("update"), "median_plain_s": run.median("plain"),
        "base_step_s": statistics.median(run.base_seconds),
        "steps": [{"block": b, "kind": k, "step_s": s, "base_s": t, "ratio": s / t}
                  for b, k, s, t in zip(blocks, run.kinds, run.seconds, run.base_seconds,
                                        strict=True)],
        "state_bytes": run.state_bytes, "failures": run.failures,
    }


def measure(workload: bench.Workload, make_peer: PeerFactory, *, blocks: int,
            device: torch.device, clock: bench.Clock, include_ours: bool = True,
            interval: int = INTERVAL, ours: str = OURS["float32"]) -> dict[str, Any]:
    """KAISA's (and ours, method ``ours``, unless ``include_ours`` is False) amortized step
    over the SGD step.

    Runs ``blocks`` blocks of ``workload.rounds`` rounds per method, alternating which method
    goes first, every step after a step of one shared SGD base trainer.

    Returns:
        ``peer`` and (with ``include_ours``) ``ours``: :func:`summary` of each; ``speedup``:
        the peer's ratio over ours; ``load``: the load average at the start and the end.
    """
    memory = bench.MemoryProbe(device)
    load = {"start": os.getloadavg()}
    base, _ = bench.run_base(workload, device, memory, nullcontext)
    method = next(m for m in bench.METHODS if m.name == ours)
    runs: dict[str, list[bench.MethodRun]] = {"peer": [], "ours": []}
    block_of: dict[str, list[int]] = {"peer": [], "ours": []}
    for block in range(blocks):
        order = ["peer", "ours"] if block % 2 == 0 else ["ours", "peer"]
        for who in order:
            if who == "peer":
                run = run_peer(workload, make_peer, base, device, clock)
            elif include_ours:
                run = bench.run_method(workload, method, base, device, clock, memory,
                                       nullcontext)
            else:
                continue
            runs[who].append(run)
            block_of[who] += [block] * len(run.kinds)
            print(f"[block {block} {who}: update {run.ratio('update'):.2f}x, plain "
                  f"{run.ratio('plain'):.2f}x, load {os.getloadavg()[0]:.2f}]",
                  file=sys.stderr, flush=True)
    load["end"] = os.getloadavg()
    out: dict[str, Any] = {"load": load,
                           "peer": summary(concatenate(runs["peer"]), block_of["peer"],
                                           interval)}
    if include_ours:
        out["ours"] = summary(concatenate(runs["ours"]), block_of["ours"], interval)
        out["speedup"] = out["peer"]["ratio"] / out["ours"]["ratio"]
    return out


# Report --------------------------------------------------------------------------------------
def markdown(result: dict[str, Any], workload: str, version: str | None,
             interval: int = INTERVAL, inv_dtype: str = "float32") -> str:
    """One markdown table row: workload, KAISA's ratio, ours, the speed-up."""
    ours = result.get("ours")
    inverse = "inverse" if inv_dtype == "float32" else f"inverse in {inv_dtype}"
    return (f"| {workload} | KAISA (kfac-pytorch {version}), {inverse}, every {interval} | "
            f"{result['peer']['ratio']:.2f}x | ours {OURS[inv_dtype]}, every {interval} | "
            + (f"{ours['ratio']:.2f}x | {result['speedup']:.2f}x |" if ours else "- | - |"))


def report(result: dict[str, Any], peer: dict[str, Any], workload: bench.Workload,
           blocks: int, env: dict[str, Any], wall_s: float, inv_dtype: str = "float32"
           ) -> dict[str, Any]:
    """Everything the run measured and what it ran, as written to ``--json``: ``peer`` (the
    peer's version, file hashes and configuration), ``kaisa`` and ``ours`` (:func:`summary`),
    ``speedup`` (KAISA's ratio over ours), the thread settings and the load average."""
    header = ("| workload | peer | peer x SGD | ours | ours x SGD | speed-up |\n"
              "|---|---|---|---|---|---|")
    line = markdown(result, workload.name, peer.get("version"), inv_dtype=inv_dtype)
    ours = OURS[inv_dtype]
    return {
        "workload": {"name": workload.name, "description": workload.description,
                     "base": workload.base, "lr": workload.lr},
        "interval": INTERVAL, "rounds_per_block": workload.rounds, "blocks": blocks,
        "amortization": "(T_update + (N - 1) T_plain) / N on the median ratios to the adjacent "
                        "SGD step, N = interval (bench.amortize)",
        "peer": {**peer, "config": KAISA_CONFIG | {"inv_dtype": inv_dtype}},
        "environment": env, "load": result["load"], "wall_s": wall_s,
        "kaisa": result["peer"],
        "ours": None if "ours" not in result else {
            "method": ours, "options": next(m.options for m in bench.METHODS if m.name == ours),
            **result["ours"]},
        "speedup": result.get("speedup"), "markdown": f"{header}\n{line}",
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-path", type=Path, default=DEFAULT_PEER_PATH,
                        help="folder holding kfac-pytorch's kfac package (pip --target)")
    parser.add_argument("--workload", default="resnet18-32", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="rounds (one update and two plain steps) per block and method")
    parser.add_argument("--blocks", type=positive_int, default=2,
                        help="blocks per method, alternating which method runs first")
    parser.add_argument("--no-ours", action="store_true", help="measure KAISA only")
    parser.add_argument("--inv-dtype", choices=sorted(OURS), default="float32",
                        help="KAISA's inv_dtype; ours keeps its inverses in the same dtype")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--release-freed-memory", action="store_true",
                        help="let the C library return freed CPU memory to the system (as "
                             "scripts/bench.py's option of that name; by default it is kept "
                             "for reuse, as the benchmark does)")
    parser.add_argument("--json", type=Path, help="write every measurement to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # No memory is measured here: freed memory is kept over the whole run, peer and ours alike
    keep = not args.release_freed_memory and keep_freed_memory()
    freed_memory = ("kept in the process for reuse (glibc mallopt: no mmap, no trim)" if keep
                    else "returned to the system")
    device = torch.device("cpu")  # one process, fp32, process CPU time (bench.Clock)
    kfac = load_kaisa(args.peer_path)
    workload = bench.WORKLOADS[args.workload]
    workload = bench.Workload(**{**workload.__dict__, "rounds": args.rounds})
    started = time.perf_counter()
    result = measure(workload, kaisa_factory(kfac, workload.skip_layers, args.inv_dtype),
                     blocks=args.blocks, device=device, clock=bench.Clock(device),
                     include_ours=not args.no_ours, ours=OURS[args.inv_dtype])
    env = bench.environment(device) | {"freed CPU memory": freed_memory}
    out = report(result, peer_provenance(kfac), workload, args.blocks, env,
                 time.perf_counter() - started, args.inv_dtype)
    print(out["markdown"])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
