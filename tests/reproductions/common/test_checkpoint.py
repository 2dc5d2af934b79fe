"""Atomic checkpoints: naming, rotation, weights_only loading, corrupt-file fallback, and the
newest step every rank of a distributed run can load."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from reproductions.common.checkpoint import (
    CheckpointError,
    checkpoint_path,
    checkpoint_step,
    list_checkpoints,
    load_agreed_checkpoint,
    load_latest_checkpoint,
    load_newest_checkpoint,
    require_same_config,
    save_checkpoint,
)
from reproductions.common.launch import run_local
from reproductions.common.scrub import REDACTED


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((3,), float(step)), "nested": {"lr": [0.1, 0.2]},
            "tuple": (1, "a"), "none": None}


def test_save_is_atomic_and_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        path = save_checkpoint(tmp_path, step, state(step), keep=2)
        assert path == checkpoint_path(tmp_path, step)
    assert list_checkpoints(tmp_path) == [checkpoint_path(tmp_path, s) for s in (2, 3)]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 3
    assert torch.equal(loaded["weights"], torch.full((3,), 3.0))
    assert loaded["nested"] == {"lr": [0.1, 0.2]} and loaded["tuple"] == (1, "a")


def test_a_save_below_newer_checkpoints_keeps_the_file_it_wrote(tmp_path: Path) -> None:
    """Pruning by step deleted the checkpoint just written (and returned its path) when
    another run had left newer ones; now only the older ones go."""
    for step in (1, 10):
        save_checkpoint(tmp_path, step, state(step), keep=1)
    path = save_checkpoint(tmp_path, 7, state(7), keep=1)
    assert path.exists() and path == checkpoint_path(tmp_path, 7)
    assert list_checkpoints(tmp_path) == [checkpoint_path(tmp_path, s) for s in (7, 10)]


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, 1, state(1))

    def broken_save(obj: object, handle: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_path(tmp_path, 1).name]


def test_a_save_deletes_the_temporary_files_of_killed_writes(tmp_path: Path) -> None:
    """A write SIGKILLed mid-way leaves its temporary file (named as ``tempfile.mkstemp`` names
    it); the next save removes it, and only files of that pattern."""
    save_checkpoint(tmp_path, 1, state(1))
    killed = tmp_path / f".{checkpoint_path(tmp_path, 2).name}.k3x9_q2a.tmp"
    killed.write_bytes(b"\0" * 4096)  # the half-written state
    others = [tmp_path / "notes.tmp", tmp_path / ".checkpoint-notes.tmp"]
    for other in others:
        other.write_text("not a checkpoint")
    save_checkpoint(tmp_path, 3, state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [checkpoint_path(tmp_path, 1).name, checkpoint_path(tmp_path, 3).name,
         *(other.name for other in others)])


def test_loads_with_weights_only(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['bad'\].*weights_only"):
        save_checkpoint(tmp_path, 1, {"bad": object()})
    with pytest.raises(TypeError, match="TorchVersion"):  # a str subclass the loader refuses
        save_checkpoint(tmp_path, 1, {"meta": {"torch": torch.__version__}})
    # A file holding an arbitrary object (not written by save_checkpoint) is refused on load.
    torch.save({"bad": Path("x")}, checkpoint_path(tmp_path, 5))
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="000000005.pt"):
        load_latest_checkpoint(tmp_path)


def test_corrupt_newest_falls_back_with_a_warning(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, state(1))
    newest = save_checkpoint(tmp_path, 2, state(2))
    newest.write_bytes(newest.read_bytes()[:40])  # truncated
    with pytest.warns(RuntimeWarning, match=newest.name):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 1


def test_all_corrupt_raises_naming_every_file(tmp_path: Path) -> None:
    paths = [save_checkpoint(tmp_path, step, state(step)) for step in (1, 2)]
    for path in paths:
        path.write_bytes(b"not a checkpoint")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError) as info:
        load_latest_checkpoint(tmp_path)
    for path in paths:
        assert str(path) in str(info.value)


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "absent") is None
    assert load_latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize(("step", "keep"), [(-1, 2), (1, 0)])
def test_bad_arguments(tmp_path: Path, step: int, keep: int) -> None:
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, step, {}, keep=keep)


def test_newest_at_most_a_step(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, state(step), keep=3)
    found = load_newest_checkpoint(tmp_path, at_most=2)
    assert found is not None and found[0] == 2 and found[1]["step"] == 2
    assert load_newest_checkpoint(tmp_path, at_most=0) is None
    assert checkpoint_step(checkpoint_path(tmp_path, 12)) == 12
    with pytest.raises(ValueError, match="checkpoint-<step>"):
        checkpoint_step(tmp_path / "model.pt")


def test_agreed_checkpoint_without_a_process_group_is_the_newest(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, state(1))
    newest = save_checkpoint(tmp_path, 2, state(2))
    newest.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match=newest.name):
        loaded = load_agreed_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 1
    assert load_agreed_checkpoint(tmp_path / "absent") is None


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path: Path) -> None:
    """A state that records the world size it was saved by loads only in a run of that size;
    a state that records none loads anywhere."""
    save_checkpoint(tmp_path / "one", 1, {**state(1), "world_size": 1})
    loaded = load_agreed_checkpoint(tmp_path / "one")
    assert loaded is not None and loaded["step"] == 1
    save_checkpoint(tmp_path / "none", 1, state(1))
    assert load_agreed_checkpoint(tmp_path / "none") is not None
    saved = save_checkpoint(tmp_path / "two", 4, {**state(4), "world_size": 2})
    with pytest.raises(CheckpointError, match=rf"^the checkpoint {saved} was saved by a run of "
                                              r"world size 2, not 1 like this one .*: resume "
                                              r"with world size 2, or start elsewhere$"):
        load_agreed_checkpoint(tmp_path / "two", fix="start elsewhere")


def _agreed_steps(roots: list[str]) -> list[int | None]:
    import torch.distributed as dist

    steps = []
    for root in roots:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            loaded = load_agreed_checkpoint(Path(root) / f"rank-{dist.get_rank()}")
        steps.append(None if loaded is None else loaded["step"])
    return steps


#: (rank 0's steps, rank 1's steps, rank 1's damaged steps, the step both ranks must load)
AGREEMENT_CASES = [
    ((2, 3, 4), (2, 3, 4), (4,), 3),  # rank 1's newest is damaged: both take step 3
    ((2, 4), (2, 3, 4), (4,), 2),     # rank 1 falls to 3, which rank 0 lacks: both take 2
    ((3, 4), (2, 3), (3,), None),     # no step both ranks can read: both start afresh
]


@pytest.mark.distributed
def test_ranks_agree_on_the_newest_step_all_can_read(tmp_path: Path) -> None:
    roots = []
    for case, (rank0, rank1, broken1, _) in enumerate(AGREEMENT_CASES):
        roots.append(str(tmp_path / str(case)))
        for rank, steps in enumerate((rank0, rank1)):
            for step in steps:
                path = save_checkpoint(tmp_path / str(case) / f"rank-{rank}", step, state(step),
                                       keep=5)
                if rank == 1 and step in broken1:
                    path.write_bytes(path.read_bytes()[:50])
    expected = [agreed for *_, agreed in AGREEMENT_CASES]
    assert run_local(_agreed_steps, 2, roots, timeout=120) == [expected, expected]


def test_require_same_config_names_what_differs_and_accepts_the_rest(tmp_path: Path) -> None:
    saved = {"lr": 0.1, "shape": [2, 3], "max_steps": 5, "token": REDACTED}
    same = {"lr": 0.1, "shape": (2, 3), "max_steps": 9, "token": "hf_secretsecretsecret"}
    require_same_config(saved, same, tmp_path, fix="f", ignore=("max_steps",))
    require_same_config(None, {"lr": 1.0}, tmp_path, fix="f")  # a checkpoint of no record
    require_same_config({"threshold": None}, {"threshold": -math.inf}, tmp_path, fix="f")
    with pytest.raises(CheckpointError, match=r"saved by a run with other settings \(lr: 0.1 "
                                              r"saved, 0.2 now; max_steps: 5 saved, 9 now\); f$"):
        require_same_config(saved, {**same, "lr": 0.2}, tmp_path, fix="f")
    with pytest.raises(CheckpointError, match=r"new: None saved, 1 now"):
        require_same_config(saved, {**same, "new": 1}, tmp_path, fix="f", ignore=("max_steps",))


def _agreement_errors(roots: list[str]) -> list[str]:
    """The CheckpointError each case raised on this rank (every case must raise)."""
    import torch.distributed as dist

    errors = []
    for root in roots:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(CheckpointError) as info:
                load_agreed_checkpoint(Path(root) / f"rank-{dist.get_rank()}")
        errors.append(str(info.value))
    return errors


@pytest.mark.distributed
def test_a_rank_that_cannot_resume_makes_every_rank_raise_its_error(tmp_path: Path) -> None:
    """Every rank takes part in the agreement and raises the same error, naming the failing
    rank's files: alone, the failing rank left the others in a collective that then broke with a
    lost gloo connection. Cases: rank 1's only checkpoint is damaged; rank 0's checkpoints come
    from a 1-process run, rank 1 has none (a 2-process run would have started afresh and
    overwritten them)."""
    damaged = save_checkpoint(tmp_path / "damaged" / "rank-1", 2, state(2))
    damaged.write_bytes(b"garbage")
    save_checkpoint(tmp_path / "damaged" / "rank-0", 2, state(2))
    single = save_checkpoint(tmp_path / "single" / "rank-0", 6, {**state(6), "world_size": 1})
    roots = [str(tmp_path / "damaged"), str(tmp_path / "single")]
    rank0, rank1 = run_local(_agreement_errors, 2, roots, timeout=60)
    assert rank0 == rank1
    assert rank0[0].startswith(f"no checkpoint in {damaged.parent} can be loaded: {damaged}")
    assert rank0[0].endswith("or move them away (or pass another run directory) to start afresh")
    assert rank0[1].startswith(f"the checkpoint {single} was saved by a run of world size 1, "
                               "not 2 like this one")
