"""BERT pre-training with LAMB, K-FAC (KAISA-style), MKOR, MKOR-H and Eva on identical batches.

Reproduces the comparison of Mozaffari et al., "MKOR" (NeurIPS 2023), Tables 2-3: BERT masked
language model + next-sentence pre-training (phase 2), every optimizer from the same weights, on
the same batches with the same seed, each second-order method feeding LAMB as the paper does.

    python -m reproductions.mkor.bert                      # the built-in CPU default (~17 min)
    python -m reproductions.mkor.bert --config bert_large_phase2 --corpus /data/wiki/*.parquet
    torchrun --nproc_per_node=4 -m reproductions.mkor.bert --config bert_large_phase2 ...

Each run writes ``<out>/<experiment>/<optimizer>-s<seed>/results.json`` (schema:
reproductions/common/README.md), atomic checkpoints of each rank next to it under
``checkpoints/rank-<r>/`` (``--resume`` continues; so does a worker group that ``torchrun
--max-restarts`` restarted after a failure), and a W&B run (offline unless logged in). The
closing table gives each optimizer's steps and time to LAMB's final loss. Settings come from a
config file (``--config``) plus the flags below and ``--set key=value``; the config fields are
listed at the end of ``--help``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import get_linear_schedule_with_warmup

from core.distributed.communicator import Communicator
from core.hybrid import HybridSwitch
from core.optim import FIRST_ORDER, SecondOrderOptimizer, build_optimizer
from core.preconditioner import KFACPreconditioner
from core.rank1 import BERT_DECODER_PATTERN, Rank1Preconditioner
from data.atomic import atomic_directory
from data.paths import add_data_dir_argument
from reproductions.common.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_agreed_checkpoint,
    require_same_config,
    save_checkpoint,
)
from reproductions.common.cli import (
    device_name,
    exit_on_user_error,
    positive_int,
    writable_directory,
)
from reproductions.common.launch import (
    DistContext,
    cleanup,
    finished,
    init_distributed,
    main_process_first,
    seed_everything,
)
from reproductions.common.results import RunRecorder, earlier_results
from reproductions.common.rng import capture_rng_state, restore_rng_state
from reproductions.common.tracking import Tracker, add_wandb_argument
from reproductions.mkor import data
from reproductions.mkor.config import (
    PretrainConfig,
    apply_overrides,
    field_help,
    load_config,
    parse_assignment,
)
from reproductions.mkor.model import build_model, existing_checkpoint, pretraining_loss
from reproductions.mkor.report import comparison_table

PAPER = "mkor"


# ----------------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag overrides the config field of the same name."""
    fields = "\n".join(f"  {name:<26} {text} (default {default!r})"
                       for name, text, default in field_help())
    parser = argparse.ArgumentParser(
        prog="python -m reproductions.mkor.bert", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (set with --set FIELD=VALUE, JSON values):\n" + fields)
    parser.add_argument("--config", default="default",
                        help="experiment file, a path or a name in reproductions/mkor/configs/ "
                             "(default: default = the CPU-sized built-in run)")
    parser.add_argument("--optimizers", type=lambda s: s.split(","), metavar="A,B,...",
                        help="comma-separated optimizers to compare, e.g. lamb,mkor")
    parser.add_argument("--model", help="BERT shape: tiny, small, bert-base, bert-large")
    parser.add_argument("--corpus", nargs="+", metavar="SOURCE",
                        help="'builtin', local .txt/.parquet/.json(l) files, or a Hugging Face "
                             "dataset name[:config]")
    parser.add_argument("--tokenizer", help="'wordpiece', a directory with vocab.txt, or a Hub "
                                            "tokenizer name")
    parser.add_argument("--steps", type=int, help="optimizer steps per optimizer")
    parser.add_argument("--seq-len", type=int, dest="seq_len", help="tokens per example")
    parser.add_argument("--batch-size", type=int, dest="batch_size",
                        help="global examples per step")
    parser.add_argument("--micro-batch-size", type=int, dest="micro_batch_size",
                        help="examples per process per forward pass (gradient accumulation)")
    parser.add_argument("--lr", type=float, help="peak learning rate (all optimizers)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"),
                        help="autocast precision (auto: bf16/fp16 on GPU, fp32 on CPU)")
    parser.add_argument("--seed", type=int, help="seed of weights, data order, masks, dropout")
    parser.add_argument("--init-checkpoint", dest="init_checkpoint", metavar="PATH",
                        help="start every optimizer from these weights (save_pretrained dir "
                             "or .pt state dict), e.g. a LAMB phase-1 checkpoint")
    parser.add_argument("--no-warm-start", action="store_true",
                        help="skip the config's LAMB warm start; start from init_checkpoint "
                             "or random weights")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override any config field, dotted for nested ones: "
                             "--set preconditioner.kfac.damping=0.01 --set warm_start.steps=50")
    parser.add_argument("--out", type=Path, default=Path("runs/mkor"),
                        help="output directory (results, checkpoints, W&B files)")
    parser.add_argument("--resume", action="store_true",
                        help="continue each run from its newest checkpoint (implied after a "
                             "torchrun restart); finished runs are kept; without it, earlier "
                             "checkpoints and results of these runs are deleted")
    parser.add_argument("--stop-after", type=positive_int, metavar="N", dest="stop_after",
                        help="stop each run after N steps of this invocation, with a "
                             "checkpoint (for wall-time-limited jobs; continue with --resume)")
    parser.add_argument("--device", type=device_name, choices=("auto", "cpu", "cuda"),
                        default="auto",
                        help="compute device (auto: the local GPU under torchrun, else CPU)")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="CPU threads of this process (default: torch's, all cores; one "
                             "per process under torchrun). Use 1 on a shared machine: "
                             "oversubscribed threads slow K-FAC's eigendecompositions hundreds "
                             "of times")
    add_wandb_argument(parser)
    add_data_dir_argument(parser)
    return parser


def build_config(args: argparse.Namespace) -> PretrainConfig:
    """The config file with the flags and ``--set`` assignments applied."""
    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("optimizers", "model", "corpus", "tokenizer", "steps", "seq_len",
                     "batch_size", "micro_batch_size", "lr", "precision", "seed",
                     "init_checkpoint")
        if getattr(args, name) is not None}
    if args.no_warm_start:
        overrides["warm_start"] = None
    overrides.update(parse_assignment(text) for text in args.set)
    return apply_overrides(load_config(args.config), overrides)


# ----------------------------------------------------------------------------------------------
# Pieces of a run

def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None: full fp32)."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if precision == "bf16" else torch.float16


def make_optimizer(cfg: PretrainConfig, name: str, model: torch.nn.Module,
                   scaler: torch.amp.GradScaler, accumulation: int) -> SecondOrderOptimizer:
    """``name`` over ``model`` as the paper composes it: the preconditioner, then LAMB.

    The vocabulary decoder is left first-order by every second-order method (embeddings are
    never preconditioned: no method supports ``nn.Embedding``).
    """
    if name in FIRST_ORDER:
        return build_optimizer(name, model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    options = {"skip_layers": (BERT_DECODER_PATTERN,), "accumulation_steps": accumulation,
               **cfg.preconditioner.get(name, {})}
    if scaler.is_enabled():
        options["grad_scaler"] = scaler
    return build_optimizer(name, model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                           base=cfg.base, **options)


def make_scheduler(cfg: PretrainConfig, optimizer: SecondOrderOptimizer
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup * steps``, then polynomial or linear decay.

    ``poly`` is NVIDIA's BERT schedule (``PolyWarmUpScheduler``), which the MKOR code's phase-2
    recipe uses: with ``p = (k + 1) / steps`` at update ``k`` (counted from 0: NVIDIA's
    scheduler steps before the optimizer, so the first update is not at rate 0),
    ``p / warmup`` during the warm-up and ``(1 − p)^power`` after it, the decay measured from
    the start of training (so the rate steps down where the warm-up ends). transformers'
    polynomial schedule measures it from the end of the warm-up instead, 7% higher for the
    rest of BERT-Large's phase 2. ``linear`` is transformers' (rate 0 at update 0).
    """
    warmup = round(cfg.warmup * cfg.steps)
    if cfg.schedule == "poly":
        fraction, total, power = cfg.warmup, cfg.steps, cfg.poly_power

        def nvidia_poly(step: int) -> float:
            progress = (step + 1) / total
            if progress < fraction:
                return progress / fraction
            return max(1.0 - progress, 0.0) ** power

        return torch.optim.lr_scheduler.LambdaLR(optimizer.base, nvidia_poly)
    return get_linear_schedule_with_warmup(optimizer.base, warmup, cfg.steps)


def preconditioner_of(optimizer: SecondOrderOptimizer) -> Any:
    """The preconditioner that does the work (inside MKOR-H's switch), or None."""
    precond = optimizer.preconditioner
    return precond.preconditioner if isinstance(precond, HybridSwitch) else precond


def communicator_of(precond: Any) -> Communicator | None:
    """The communicator (and so the ledger) a preconditioner's collectives go through."""
    if isinstance(precond, KFACPreconditioner):
        return precond.strategy.communicator
    if isinstance(precond, Rank1Preconditioner):
        return precond.communicator
    return None


def memory_report(model: torch.nn.Module, optimizer: SecondOrderOptimizer,
                  device: torch.device) -> dict[str, Any]:
    """Bytes of parameters, gradients, first-order state and preconditioner state, the peak,
    and the preconditioner's parts (``preconditioner_parts``)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    first_order = sum(t.numel() * t.element_size() for state in optimizer.base.state.values()
                      for t in state.values() if isinstance(t, torch.Tensor))
    precond = preconditioner_of(optimizer)
    parts = precond.memory_usage() if precond is not None else {"total": 0}
    report: dict[str, Any] = {"parameters": params, "gradients": params,
                              "first_order_state": first_order,
                              "preconditioner_state": parts.pop("total"),
                              "preconditioner_parts": parts}
    if device.type == "cuda":
        report["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    else:
        import resource

        report["peak_rss_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
             device: torch.device, dtype: torch.dtype | None) -> dict[str, float]:
    """Mean held-out losses (``loss``, ``mlm_loss``, ``nsp_loss``) over fixed batches."""
    model.eval()
    sums = torch.zeros(3)
    for batch in batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            losses = pretraining_loss(model, data.to_device(batch, device))
        sums += torch.stack([x.detach().float().cpu() for x in losses])
    model.train()
    mean = (sums / len(batches)).tolist()
    return {"loss": mean[0], "mlm_loss": mean[1], "nsp_loss": mean[2]}


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU), so a clock reads it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_over_ranks(values: list[float], ctx: DistContext) -> list[float]:
    """Average scalars over ranks, so every rank logs and acts on the same (global) loss."""
    if ctx.world_size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(tensor)
    return (tensor / ctx.world_size).tolist()


def _base_step_timer(optimizer: SecondOrderOptimizer, device: torch.device) -> dict[str, float]:
    """Accumulate the first-order step's seconds under ``["base_step"]`` (via step hooks)."""
    totals = {"base_step": 0.0}
    started: list[float] = []

    def pre(*_: Any) -> None:
        sync_device(device)
        started.append(time.perf_counter())

    def post(*_: Any) -> None:
        sync_device(device)
        totals["base_step"] += time.perf_counter() - started.pop()

    optimizer.base.register_step_pre_hook(pre)
    optimizer.base.register_step_post_hook(post)
    return totals


def _count(totals: dict[str, dict[str, int]], stage: str, *, elements: int, nbytes: int,
           traffic: int) -> None:
    entry = totals.setdefault(stage, {"collectives": 0, "elements": 0, "bytes": 0,
                                      "traffic_bytes": 0})
    entry["collectives"] += 1
    entry["elements"] += elements
    entry["bytes"] += nbytes
    entry["traffic_bytes"] += traffic


def drain_ledger(optimizer: SecondOrderOptimizer, model: torch.nn.Module, ctx: DistContext,
                 totals: dict[str, dict[str, int]]) -> None:
    """Add this step's communication to ``totals`` (``core.distributed``'s per-stage fields).

    The preconditioner's collectives come from its communicator's ledger (then cleared, so it
    does not grow over a long run). DDP's gradient all-reduce is not in any ledger; it is
    counted as one all-reduce of every gradient, ``2(P-1)/P`` of it received per worker (ring).
    """
    communicator = communicator_of(preconditioner_of(optimizer))
    if communicator is not None:
        for entry in communicator.ledger.entries:
            _count(totals, entry.stage, elements=entry.elements, nbytes=entry.bytes,
                   traffic=entry.traffic_bytes)
        communicator.ledger.clear()
    if ctx.world_size > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        elements = sum(g.numel() for g in grads)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        _count(totals, "grad_allreduce", elements=elements, nbytes=nbytes,
               traffic=2 * (ctx.world_size - 1) * nbytes // ctx.world_size)


# ----------------------------------------------------------------------------------------------
# One optimizer's run

#: What ``--resume`` requires of a run's recorded settings: all the same except the run list,
#: the description, the launch hint, the checkpoint cadence and the paths of the corpus and the
#: initial weights (which move with the machine; a resumed run's weights come from its
#: checkpoint).
RESUME_CHECK: dict[str, Any] = {
    "fix": "resume with the same config and options, or run without --resume (which deletes "
           "this run's checkpoints) or with another --out",
    "ignore": ("optimizers", "description", "launch", "checkpoint_every", "corpus",
               "init_checkpoint")}


def adopt_single_process_checkpoints(checkpoints: Path, ctx: DistContext) -> None:
    """Move checkpoints of the layout before per-rank checkpoints (files straight in
    ``checkpoints/``, written by rank 0 alone) into ``checkpoints/rank-0``, so that a run
    started before that change resumes instead of starting over.

    Raises:
        CheckpointError: there are such files and several processes: rank 0's state alone
            cannot resume the other ranks' (K-FAC's strategies keep per-rank state).
    """
    old = list_checkpoints(checkpoints) if checkpoints.is_dir() else []
    if not old:
        return
    if ctx.world_size > 1:
        raise CheckpointError(
            f"{checkpoints} holds checkpoints saved by rank 0 alone (the layout before "
            "per-rank checkpoints), which cannot resume several processes: resume with one "
            "process, or start afresh without --resume")
    target = checkpoints / "rank-0"
    target.mkdir(exist_ok=True)
    for path in old:
        path.rename(target / path.name)
    tqdm.write(f"moved {len(old)} checkpoint(s) of the earlier layout into {target}",
               file=sys.stderr)


def run_dir(out: Path, cfg: PretrainConfig, name: str) -> Path:
    """Where one run's results and checkpoints go."""
    return out / cfg.experiment / f"{name}-s{cfg.seed}"


def clear_earlier_runs(directories: list[Path], ctx: DistContext) -> None:
    """Delete what earlier runs left in these run directories: checkpoints (of any rank and world
    size), which would outrank a fresh run's own, the model, and the results file, whose settings
    a ``--resume`` of the fresh run would otherwise be checked against.
    """
    if ctx.is_main:
        for here in directories:
            for stale in (here / "checkpoints", here / "model"):
                if stale.exists():
                    shutil.rmtree(stale)
            (here / "results.json").unlink(missing_ok=True)
    if ctx.world_size > 1:
        torch.distributed.barrier()  # no rank saves before they are gone


def train(cfg: PretrainConfig, name: str, ctx: DistContext, args: argparse.Namespace,
          examples: tuple[Any, Any], tokenizer: Any) -> dict[str, Any]:
    """Train with optimizer ``name`` for ``cfg.steps`` steps; returns the results data.

    Every rank checkpoints its own state (K-FAC's distributed strategies keep per-rank state)
    under ``checkpoints/rank-<r>``; a resumed run (``--resume``, or any run after ``torchrun``
    restarted the worker group) continues on every rank from the newest step all ranks saved.
    """
    here = run_dir(args.out, cfg, name)
    ckpt_dir = here / "checkpoints" / f"rank-{ctx.rank}"
    results_path = here / "results.json"
    run_config = {**cfg.to_dict(), "optimizer": name}
    resume = args.resume or ctx.restarts > 0
    if resume:
        adopt_single_process_checkpoints(here / "checkpoints", ctx)
    done = earlier_results(results_path) if resume else None
    if done is not None:
        require_same_config(done["config"], run_config, here, together=False, **RESUME_CHECK)
        if done["finished"] and done["steps"] and done["steps"][-1]["step"] == cfg.steps - 1:
            return done
    if not resume:
        clear_earlier_runs([here], ctx)

    # Same weights, batches, masks and dropout for every optimizer.
    seed_everything(cfg.seed)
    model = build_model(cfg.model, len(tokenizer), cfg.dropout, cfg.init_checkpoint)
    model.to(ctx.device)
    raw_model = model
    if ctx.world_size > 1:
        model = DistributedDataParallel(model, device_ids=[ctx.local_rank]
                                        if ctx.device.type == "cuda" else None)
    # Each rank its own dropout masks (NVIDIA's recipe seeds with seed + rank): with one seed
    # the ranks' masks were the same, their noise fully correlated.
    seed_everything(cfg.seed + ctx.rank)
    accumulation = cfg.accumulation_steps(ctx.world_size)
    dtype = autocast_dtype(cfg.precision, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    optimizer = make_optimizer(cfg, name, model, scaler, accumulation)
    scheduler = make_scheduler(cfg, optimizer)
    base_time = _base_step_timer(optimizer, ctx.device)
    batches = data.PretrainingBatches(
        examples[0], tokenizer, micro_batch=cfg.micro_batch(ctx.world_size),
        accumulation=accumulation, world_size=ctx.world_size, rank=ctx.rank, seed=cfg.seed,
        mlm_probability=cfg.mlm_probability)
    held_out = data.held_out_batches(examples[1], tokenizer, batch_size=cfg.micro_batch(1),
                                     count=cfg.eval_batches, seed=cfg.seed,
                                     mlm_probability=cfg.mlm_probability)
    recorder = RunRecorder(paper=PAPER, experiment=cfg.experiment, optimizer=name,
                           config=run_config, world_size=ctx.world_size, device=ctx.device)
    ledger: dict[str, dict[str, int]] = {}

    start, wandb_id = 0, None
    earlier_stages: dict[str, float] = {}  # the stage times of the steps before a resume
    state = load_agreed_checkpoint(ckpt_dir, map_location=ctx.device) if resume else None
    if state is not None:
        require_same_config(state["results"]["config"], run_config, ckpt_dir, **RESUME_CHECK)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        restore_rng_state(state["rng"])
        recorder = RunRecorder.from_data(state["results"], run_config)
        ledger = state["ledger"]
        earlier_stages = state["stage_time_s"]
        start, wandb_id = state["step"], state["wandb_id"]
        if ctx.is_main:
            restart = f"restart {ctx.restarts}: " if ctx.restarts else ""
            tqdm.write(f"{restart}{cfg.experiment} {name}: resuming from the checkpoint of step "
                       f"{start}", file=sys.stderr)
    tracker = Tracker(paper=PAPER, experiment=cfg.experiment, optimizer=name, seed=cfg.seed,
                      config=recorder.data["config"], directory=args.out / cfg.experiment,
                      mode=args.wandb, run_id=wandb_id, enabled=ctx.is_main)
    recorder.update(wandb=tracker.info())

    def checkpoint(step: int) -> None:
        """This rank's checkpoint after ``step`` steps, and the results file (rank 0's)."""
        if ctx.is_main:
            recorder.write(results_path)
        save_checkpoint(ckpt_dir, step, {
            "step": step, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "rng": capture_rng_state(), "results": recorder.data, "wandb_id": tracker.id,
            "ledger": ledger, "stage_time_s": stage_times(optimizer, base_time, earlier_stages),
            "world_size": ctx.world_size})

    end = cfg.steps if args.stop_after is None else min(cfg.steps, start + args.stop_after)
    progress = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not ctx.is_main,
                    desc=f"{cfg.experiment} {name}", dynamic_ncols=True, file=sys.stdout)
    model.train()
    for step in progress:
        sync_device(ctx.device)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        parts = torch.zeros(3)
        for micro in range(accumulation):
            batch = data.to_device(batches.batch(step, micro), ctx.device)
            sync = (model.no_sync() if ctx.world_size > 1 and micro < accumulation - 1
                    else nullcontext())
            with sync:
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                    losses = pretraining_loss(model, batch)
                scaler.scale(losses[0] / accumulation).backward()
            parts += torch.stack([x.detach().float().cpu() for x in losses]) / accumulation
        loss, mlm_loss, nsp_loss = _mean_over_ranks(parts.tolist(), ctx)
        lr = optimizer.param_groups[0]["lr"]  # this step's (the scheduler moves it on below)
        sync_device(ctx.device)
        t1 = time.perf_counter()
        scale = scaler.get_scale()
        scaler.step(optimizer, loss)  # = optimizer.step(loss) unless fp16 gradients overflowed
        scaler.update()
        if scaler.get_scale() < scale:  # skipped on an overflow: the captures are dropped
            optimizer.skip_step()
        scheduler.step()
        sync_device(ctx.device)
        t2 = time.perf_counter()

        metrics = optimizer.metrics()
        drain_ledger(optimizer, raw_model, ctx, ledger)
        del metrics["lr"]  # the next step's
        step_log = {"loss": loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
                    "time_s": t2 - t0, "optimizer_s": t2 - t1, "lr": lr}
        if "hybrid/second_order" in metrics:
            step_log["second_order"] = metrics["hybrid/second_order"]
        recorder.log_step(step, **step_log)
        tracker.log({f"train/{k}": v for k, v in step_log.items()}
                    | {f"optimizer/{k}": v for k, v in metrics.items()}, step=step)
        progress.set_postfix(loss=f"{loss:.3f}", lr=f"{step_log['lr']:.2e}")

        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            scores = evaluate(raw_model, held_out, ctx.device, dtype)
            recorder.log_eval(step, **scores)
            tracker.log({f"eval/{k}": v for k, v in scores.items()}, step=step)
        if done % cfg.checkpoint_every == 0 or done == end:
            if done == cfg.steps:
                _finalise(recorder, tracker, optimizer, raw_model, ctx, cfg,
                          stage_times(optimizer, base_time, earlier_stages), ledger)
                if ctx.is_main:
                    with atomic_directory(here / "model") as tmp:
                        raw_model.save_pretrained(tmp)
                        tokenizer.save_pretrained(tmp)
            checkpoint(done)
    if start == end and ctx.is_main:  # resumed at its last checkpoint, its results file lost
        recorder.write(results_path)
    progress.close()
    tracker.finish()
    return recorder.data


def stage_times(optimizer: SecondOrderOptimizer, base_time: dict[str, float],
                earlier: dict[str, float]) -> dict[str, float]:
    """Seconds per optimizer stage over the whole run, the first-order step's as ``base_step``.

    The preconditioner's timer and ``base_time`` count this process's steps only; ``earlier``
    (the totals a resumed run's checkpoint carried, else empty) adds those of the steps before,
    so a resumed run reports what an uninterrupted one would.
    """
    precond = preconditioner_of(optimizer)
    now = {**(precond.timer.totals if precond is not None else {}), **base_time}
    totals = dict(earlier)
    for stage, seconds in now.items():
        totals[stage] = totals.get(stage, 0.0) + seconds
    return totals


def _finalise(recorder: RunRecorder, tracker: Tracker, optimizer: SecondOrderOptimizer,
              model: torch.nn.Module, ctx: DistContext, cfg: PretrainConfig,
              stages: dict[str, float], ledger: dict[str, dict[str, int]]) -> None:
    """Stage times (``stages``, of the whole run), memory, ledger and summary of a completed
    run."""
    steps = recorder.data["steps"]
    tail = [s["loss"] for s in steps[-cfg.smooth_window:] if s["loss"] is not None]
    evals = recorder.data["evals"]
    summary = {
        "steps": len(steps), "final_loss": sum(tail) / len(tail) if tail else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "train_time_s": sum(s["time_s"] for s in steps),
        "optimizer_time_s": sum(s["optimizer_s"] for s in steps),
    }
    switch = optimizer.preconditioner
    if isinstance(switch, HybridSwitch):
        summary["switched_to_first_order_at_step"] = switch.event.step if switch.event else None
    recorder.update(optimizer_stage_time_s=stages, summary=summary,
                    memory=memory_report(model, optimizer, ctx.device),
                    ledger=ledger if ctx.world_size > 1 else None)
    recorder.finish()
    tracker.summary(summary)


# ----------------------------------------------------------------------------------------------
# The comparison

def prepare_examples(cfg: PretrainConfig, ctx: DistContext, args: argparse.Namespace
                     ) -> tuple[tuple[Any, Any], Any]:
    """Tokenizer and (train, held-out) examples of ``cfg`` (rank 0 builds the caches first)."""
    with main_process_first(ctx):
        corpus = data.load_corpus(cfg.corpus, text_column=cfg.text_column,
                                  data_dir=args.data_dir)
        tokenizer = data.load_tokenizer(cfg.tokenizer, corpus, vocab_size=cfg.vocab_size,
                                        max_length=cfg.seq_len, data_dir=args.data_dir)
        examples = data.pretraining_examples(corpus, tokenizer, seq_len=cfg.seq_len,
                                             seed=cfg.seed, eval_fraction=cfg.eval_fraction)
    return examples, tokenizer


def warm_start(cfg: PretrainConfig, ctx: DistContext, args: argparse.Namespace
               ) -> Path | None:
    """Run (or, resuming, reuse) the LAMB warm start.

    Returns:
        The directory of its final model (``save_pretrained`` format), or None when it was
        stopped early by ``--stop-after``.
    """
    ws = cfg.warm_start
    assert ws is not None
    warm = replace(cfg, experiment=f"{cfg.experiment}-warmstart", steps=ws.steps,
                   seq_len=ws.seq_len, lr=ws.lr, warmup=ws.warmup, optimizers=["lamb"],
                   warm_start=None)
    examples, tokenizer = prepare_examples(warm, ctx, args)
    results = train(warm, "lamb", ctx, args, examples, tokenizer)
    return run_dir(args.out, warm, "lamb") / "model" if results["finished"] else None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the comparison and print its table; returns every run's results data.

    A configuration or data error exits with one line naming the field or file (no traceback).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        writable_directory(args.out, "--out")
        return _compare(build_config(args), args)


def _compare(cfg: PretrainConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The body of :func:`main`: the warm start, then every optimizer from its weights."""
    ctx = init_distributed(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    runs: list[dict[str, Any]] = []
    try:
        # first: an unusable corpus, tokenizer or starting checkpoint ends the command before
        # anything is deleted
        if cfg.init_checkpoint is not None:
            existing_checkpoint(cfg.model, cfg.init_checkpoint)
        examples, tokenizer = prepare_examples(cfg, ctx, args)
        if not (args.resume or ctx.restarts > 0):
            # every run's up front, not each as it starts: a --resume of this invocation must
            # not meet an earlier invocation's state in the runs it had not reached
            clear_earlier_runs([run_dir(args.out, cfg, name) for name in cfg.optimizers], ctx)
        if cfg.warm_start is not None and cfg.init_checkpoint is None:
            start = warm_start(cfg, ctx, args)
            if start is None:
                print("warm start stopped early; continue with --resume")
                return runs
            cfg = replace(cfg, init_checkpoint=str(start))
        runs = [train(cfg, name, ctx, args, examples, tokenizer) for name in cfg.optimizers]
        finished()
    finally:
        cleanup()
    complete = [r for r in runs if r["finished"]]
    if ctx.is_main and complete:
        print(f"\n{cfg.experiment}: BERT {cfg.model}, {cfg.steps} steps of {cfg.batch_size} x "
              f"{cfg.seq_len} tokens, same weights, batches and seed for every optimizer\n")
        print(comparison_table(complete, cfg.smooth_window))
    return runs


if __name__ == "__main__":
    main()
