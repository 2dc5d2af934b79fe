"""scripts/measure_peer_kaisa.py's measurement, with a fake peer preconditioner and a fake clock.

No kfac-pytorch is needed: a fake preconditioner stands in for KAISA, and a clock that returns
set seconds per kind of step (instead of measuring) makes the amortized ratios exact, so the
checks are on the arithmetic, the update schedule handed to the peer and the JSON written.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from scripts import bench
from scripts import measure_peer_kaisa as peer

BASE_S = 2.0
PEER_UPDATE_S, PEER_PLAIN_S = 10.0, 2.0
OURS_UPDATE_S, OURS_PLAIN_S = 6.0, 2.5


class FakePeer:
    """Steps like KAISA's preconditioner: updates when ``steps % schedule(steps) == 0``."""

    made: list[FakePeer] = []

    def __init__(self, model: torch.nn.Module, schedule: Callable[[int], int], lr: float):
        self.schedule, self.lr, self.steps = schedule, lr, 0
        self.updated = False
        self.updates: list[int] = []
        self.n_params = sum(p.numel() for p in model.parameters())
        FakePeer.made.append(self)

    def step(self) -> None:
        self.updated = self.steps % self.schedule(self.steps) == 0
        if self.updated:
            self.updates.append(self.steps)
        self.steps += 1


class FakeClock:
    """Runs each step and returns set seconds: the base step, the peer's update or plain step
    (as the fake peer decided), our update or plain step (by position in bench's pattern)."""

    def __init__(self, rounds: int) -> None:
        self.now = time.process_time  # our preconditioner's stage timer reads it
        self.kinds = bench.step_kinds(rounds)
        self.calls: dict[int, int] = {}
        # Steps are counted per trainer by id(); keeping every trainer alive stops a later
        # block's trainer from reusing a collected one's id (and inheriting its count).
        self.trainers: list[Any] = []

    def time(self, fn: Callable[[], object]) -> float:
        fn()
        owner: Any = fn.__self__  # type: ignore[attr-defined]
        if isinstance(owner, peer.PeerTrainer):
            return PEER_UPDATE_S if owner.preconditioner.updated else PEER_PLAIN_S
        if owner.optimizer.preconditioner is None:
            return BASE_S
        if id(owner) not in self.calls:
            self.trainers.append(owner)
        i = self.calls.get(id(owner), 0)
        self.calls[id(owner)] = i + 1
        return OURS_UPDATE_S if self.kinds[i] == "update" else OURS_PLAIN_S


def tiny(rounds: int) -> bench.Workload:
    return bench.Workload(**{**bench.WORKLOADS["tiny-cnn"].__dict__, "rounds": rounds})


def test_amortized_ratios_schedule_and_json(tmp_path: Path) -> None:
    rounds, blocks = 2, 2
    FakePeer.made.clear()
    workload = tiny(rounds)
    device = torch.device("cpu")
    result = peer.measure(workload, FakePeer, blocks=blocks, device=device,
                          clock=FakeClock(rounds))  # type: ignore[arg-type]

    # One fresh peer per block, on the benchmark's learning rate, updating exactly on bench's
    # update steps (the warm-up update, then the first step of every round).
    assert len(FakePeer.made) == blocks
    kinds = bench.step_kinds(rounds)
    for fake in FakePeer.made:
        assert fake.lr == workload.lr
        assert fake.updates == [i for i, k in enumerate(kinds) if k == "update"] == [0, 2, 5]
        assert fake.steps == len(kinds)

    # (T_update + 9 T_plain) / 10 on the ratios to the adjacent base step.
    kaisa, ours = result["peer"], result["ours"]
    assert kaisa["ratio"] == pytest.approx((PEER_UPDATE_S + 9 * PEER_PLAIN_S) / 10 / BASE_S)
    assert kaisa["ratio"] == pytest.approx(1.4)
    assert kaisa["step_s"] == pytest.approx(2.8)
    assert kaisa["ratio_update"] == pytest.approx(5.0)
    assert kaisa["ratio_plain"] == pytest.approx(1.0)
    assert ours["ratio"] == pytest.approx((OURS_UPDATE_S + 9 * OURS_PLAIN_S) / 10 / BASE_S)
    assert result["speedup"] == pytest.approx(1.4 / 1.425)

    # Every timed step is kept (warm-up steps are not), with its block.
    for side in (kaisa, ours):
        steps = side["steps"]
        assert len(steps) == blocks * rounds * 3
        assert [s["kind"] for s in steps] == kinds[bench.WARM_STEPS:] * blocks
        assert [s["block"] for s in steps] == [b for b in range(blocks) for _ in range(rounds * 3)]
        assert all(s["base_s"] == BASE_S for s in steps)
    assert [s["ratio"] for s in kaisa["steps"][:3]] == [5.0, 1.0, 1.0]

    info = {"package": "kfac-pytorch", "version": "9.9.9", "loaded_tree_sha256": "ab" * 32}
    env = bench.environment(device)
    out = json.loads(json.dumps(peer.report(result, info, workload, blocks, env, 1.5),
                                default=str))
    assert out["peer"]["version"] == "9.9.9"
    assert out["peer"]["loaded_tree_sha256"] == "ab" * 32
    assert out["peer"]["config"]["compute_method"] == "INVERSE"
    assert out["peer"]["config"]["inv_update_steps"] == out["interval"] == 10
    assert out["ours"]["method"] == "kfac-inverse"
    assert out["ours"]["options"] == {"inverse_method": "inverse"}
    assert out["kaisa"]["ratio"] == pytest.approx(1.4)
    assert out["speedup"] == pytest.approx(1.4 / 1.425)
    assert out["environment"]["torch_threads"] == torch.get_num_threads()
    assert "OMP_NUM_THREADS" in out["environment"]
    assert len(out["load"]["start"]) == len(out["load"]["end"]) == 3
    assert (out["rounds_per_block"], out["blocks"]) == (rounds, blocks)
    assert "| tiny-cnn | KAISA (kfac-pytorch 9.9.9), inverse, every 10 | 1.40x |" in out["markdown"]
    assert out["markdown"].rstrip().endswith(f"| 1.43x | {1.4 / 1.425:.2f}x |")


def test_peer_only_run_has_no_ours() -> None:
    FakePeer.made.clear()
    result = peer.measure(tiny(1), FakePeer, blocks=1, device=torch.device("cpu"),
                          clock=FakeClock(1), include_ours=False)  # type: ignore[arg-type]
    assert "ours" not in result and "speedup" not in result
    assert result["peer"]["ratio"] == pytest.approx(1.4)
    assert peer.markdown(result, "tiny-cnn", "1.0").endswith("| - | - |")


def test_missing_peer_names_the_pip_command(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as error:
        peer.load_kaisa(tmp_path)
    message = str(error.value)
    assert "pip install --no-deps --target" in message and "kfac-pytorch" in message
    assert str(tmp_path.resolve()) in message


def test_provenance_hashes_the_loaded_files(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "kfac"
    (package / "layers").mkdir(parents=True)
    sources = {"kfac/__init__.py": b"__version__ = '0.4.1'\n",
               "kfac/layers/inverse.py": b"x = 1\n"}
    for rel, data in sources.items():
        (tmp_path / rel).write_bytes(data)
    (tmp_path / "PROVENANCE.json").write_text(json.dumps({"newest_commit": "dae45024"}))
    modules = {}
    for name, rel in (("kfac", "kfac/__init__.py"), ("kfac.layers.inverse",
                                                     "kfac/layers/inverse.py")):
        module = ModuleType(name)
        module.__file__ = str(tmp_path / rel)
        modules[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    modules["kfac"].__version__ = "0.4.1"  # type: ignore[attr-defined]

    info = peer.peer_provenance(modules["kfac"])
    assert info["version"] == "0.4.1"
    assert info["loaded_files_sha256"] == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in sources.items()}
    manifest = "".join(f"{hashlib.sha256(data).hexdigest()}  {rel}\n"
                       for rel, data in sorted(sources.items()))
    assert info["loaded_tree_sha256"] == hashlib.sha256(manifest.encode()).hexdigest()
    assert info["provenance"] == {"newest_commit": "dae45024"}


def test_bf16_run_pairs_kaisa_inv_dtype_with_our_bf16_state() -> None:
    result = {"peer": {"ratio": 2.0}, "ours": {"ratio": 1.6}, "speedup": 1.25}
    line = peer.markdown(result, "resnet18-32", "0.7.0", inv_dtype="bfloat16")
    assert "inverse in bfloat16" in line and "ours kfac-inverse-bf16" in line
    assert peer.OURS["bfloat16"] in {m.name for m in bench.METHODS}
    options = next(m.options for m in bench.METHODS if m.name == peer.OURS["bfloat16"])
    assert options["precondition_dtype"] == "bfloat16"


def test_every_peer_and_base_step_starts_from_its_initial_parameters() -> None:
    """As bench.py's runner: the base and the peer start each step from their snapshots."""
    entries: list[bool] = []

    class CheckingClock(FakeClock):
        def time(self, fn: Callable[[], object]) -> float:
            owner: Any = fn.__self__  # type: ignore[attr-defined]
            entries.append(all(torch.equal(p, v) for p, v in
                               zip(owner.model.parameters(), owner.start.values, strict=True)))
            return super().time(fn)

    rounds = 1
    peer.measure(tiny(rounds), FakePeer, blocks=1, device=torch.device("cpu"),
                 clock=CheckingClock(rounds), include_ours=False)  # type: ignore[arg-type]
    assert len(entries) == 2 * len(bench.step_kinds(rounds)) and all(entries)
