"""Bad input: fuzzed configuration values and command lines of every training entry point end in
a working config or one clear error naming the field (argparse's exit status 2, no traceback);
missing, empty or corrupt data gives a message naming the file and the fix; a model with no
supported layers warns and trains as the plain optimizer."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from core.config import ConfigError
from data import fashion_mnist as fashion_mnist_module
from data.errors import CorruptDataError, DataUnavailableError
from data.paths import DATA_DIR_ENV
from data.text_corpus import bert_tokenizer, wordpiece_vocab
from reproductions import demo
from reproductions.common.results import ResultsError, load_results
from reproductions.dpkfac import train as dpkfac_train
from reproductions.dpkfac.train import TrainConfig
from reproductions.mkor import bert as mkor_bert
from reproductions.mkor.config import field_help
from reproductions.osawa2018 import train as osawa_train
from reproductions.osawa2018.config import OsawaConfig
from reproductions.osawa2018.erasing import RandomErasing
from reproductions.osawa2018.mixup import RunningMixup
from reproductions.osawa2018.schedule import IntervalSchedule, PolynomialDecay
from tests.reliability.helpers import SETTINGS, assert_bit_identical, final_state, train_args

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=4), inner, max_size=2)),
    max_leaves=6)
"""Any value a JSON config file or a ``--set KEY=VALUE`` can hold (NaN and infinities too)."""

CLI_VALUES = st.one_of(JSON_VALUES.map(json.dumps), st.text(max_size=10))
"""What a user may type after ``KEY=``: JSON or any other text (read as a string)."""


class Parsed(Exception):
    """Raised in place of training: the command line was accepted."""


def invoke(main: Callable[[list[str]], Any], argv: list[str], *patches: Any) -> tuple[str, str]:
    """Run ``main(argv)`` with ``patches`` applied; the outcome is ``"parsed"`` or
    ``"exit <status>"``, with what was written to stderr."""
    stderr = io.StringIO()
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(redirect_stderr(stderr))
        stack.enter_context(redirect_stdout(io.StringIO()))
        try:
            main(argv)
        except Parsed:
            return "parsed", stderr.getvalue()
        except SystemExit as exc:
            return f"exit {exc.code}", stderr.getvalue()
    raise AssertionError(f"main({argv}) returned without training")


def assert_clear_error(outcome: str, stderr: str, names: set[str]) -> None:
    """A rejected command line: status 2, no traceback, and a last line that is argparse's
    ``<prog>: error: ...`` naming a field of ``names`` (or a nested field of one, or an option)
    and what is allowed."""
    assert outcome == "exit 2", (outcome, stderr)
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert ": error: " in last, last
    message = last.split(": error: ", 1)[1]
    if message.startswith("argument "):  # argparse's own checks of typed options
        return
    assert message.startswith("invalid ") and ": expected " in message, message
    named = message.removeprefix("invalid ").split("=", 1)[0].strip("'")  # quoted if unprintable
    top = named.split(".", 1)[0]  # a nested field is named with its parent: warm_start.steps
    assert top in names or named.startswith("--") or named == "config", message


# ------------------------------------------------------------------------------------------------
# Osawa et al.: OsawaConfig and `python -m reproductions.osawa2018.train --set KEY=VALUE`

OSAWA_FIELDS = {f.name for f in fields(OsawaConfig)}


def build_recipe(config: OsawaConfig) -> None:
    """Everything the trainer derives from the config alone (no model): must not fail."""
    PolynomialDecay(config.lr, config.lr_decay_start_epoch, config.lr_end_epoch, config.lr_power)
    IntervalSchedule.from_epochs(config.factor_update_intervals, 60_000 / config.batch_size)
    RandomErasing(config.erasing_rate, tuple(config.erasing_area), config.erasing_min_aspect)
    if config.mixup_alpha > 0:
        RunningMixup(config.mixup_alpha, 10, config.running_mixup)
    assert config.total_steps(60_000) >= 1
    assert config.accumulation_steps(1) >= 1


@FUZZ
@given(name=st.sampled_from(sorted(OSAWA_FIELDS)), value=JSON_VALUES)
def test_osawa_config_builds_a_usable_recipe_or_names_the_field(name: str, value: Any) -> None:
    try:
        config = OsawaConfig(**{name: value})
    except ConfigError as err:
        assert err.field_name in OSAWA_FIELDS and "expected" in str(err), err
        return
    build_recipe(config)


def test_osawa_epochs_give_at_least_one_update_and_an_overflowing_count_is_refused() -> None:
    """Found by the fuzz test above: ``epochs=7e-73`` made a run of 0 updates, and
    ``epochs=3e303`` an OverflowError traceback from ``total_steps``."""
    assert OsawaConfig(epochs=7e-73).total_steps(60_000) == 1
    assert OsawaConfig(epochs=2.0, batch_size=256).total_steps(60_000) == 469  # ceil(468.75)
    with pytest.raises(ConfigError, match="epochs") as err:
        OsawaConfig(epochs=3e303)
    assert err.value.field_name == "epochs"



@pytest.mark.parametrize(("field", "value"), [("precondition_dtype", "float8"),
                                              ("precondition_dtype_tolerance", -0.1)])
def test_osawa_precision_options_are_checked_with_the_config(field: str, value: object) -> None:
    """They were checked only when K-FAC was built, after the data had loaded (and never
    with ``optimizer="sgd"``)."""
    with pytest.raises(ConfigError) as err:
        OsawaConfig(optimizer="sgd", **{field: value})  # type: ignore[arg-type]
    assert err.value.field_name == field


def osawa_main(argv: list[str]) -> None:
    """The entry point with training replaced by :func:`build_recipe` of the parsed config."""
    def parsed(config: OsawaConfig, **_: Any) -> None:
        build_recipe(config)
        raise Parsed

    with mock.patch.object(osawa_train, "run", parsed):
        osawa_train.main(argv)


@FUZZ
@given(assignments=st.lists(st.tuples(st.sampled_from([*sorted(OSAWA_FIELDS), "lrr", ""]),
                                      CLI_VALUES), min_size=1, max_size=3),
       steps=st.sampled_from([None, "3", "0", "-2", "x", "1e3"]))
def test_osawa_command_line_parses_or_exits_with_one_line_naming_the_field(
        assignments: list[tuple[str, str]], steps: str | None) -> None:
    argv = ["--set", *(f"{key}={value}" for key, value in assignments)]
    if steps is not None:
        argv += ["--max-steps", steps]
    outcome, stderr = invoke(osawa_main, argv)
    if outcome != "parsed":
        assert_clear_error(outcome, stderr, OSAWA_FIELDS | {"lrr", ""})


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "lr=fast"], "invalid lr='fast': expected a number in [0.0, inf)"),
    (["--set", "momentum=1.5"], "invalid momentum=1.5: expected a number in [0.0, 1.0)"),
    (["--set", "optimizer=adam"], "invalid optimizer='adam': expected one of 'kfac', 'sgd'"),
    (["--set", "bn_fisher=kron"], "invalid bn_fisher='kron'"),
    (["--set", "lrdecay=1"], "invalid lrdecay=1: expected an OsawaConfig field: "),
    (["--set", "lr"], "invalid --set='lr': expected KEY=VALUE"),
    (["--set", "epochs=Infinity"], "invalid epochs=inf"),
    (["--set", "factor_update_intervals=[[1,2]]"], "invalid factor_update_intervals"),
    (["--config", "no-such-config"], "invalid config='no-such-config': expected a readable "
                                     "JSON file or one of fmnist_default"),
    (["--set", "data=image-folder"], "invalid --image-folder=None"),
])
def test_osawa_typos_name_the_field_and_the_allowed_values(argv: list[str],
                                                           message: str) -> None:
    outcome, stderr = invoke(osawa_train.main, [*argv, "--wandb", "disabled"])
    assert_clear_error(outcome, stderr, OSAWA_FIELDS | {"lrdecay"})
    assert message in stderr and "callable" not in stderr


# ------------------------------------------------------------------------------------------------
# MKOR: `python -m reproductions.mkor.bert --set FIELD=VALUE` (dotted for nested fields)

MKOR_FIELDS = {name for name, _, _ in field_help()}
MKOR_KEYS = [*sorted(MKOR_FIELDS), "warm_start", "preconditioner.kfac.damping",
             "preconditioner.adam.lr", "lr.x", "stepz", ""]


@FUZZ
@given(assignments=st.lists(st.tuples(st.sampled_from(MKOR_KEYS), CLI_VALUES), min_size=1,
                            max_size=3),
       flag=st.sampled_from([[], ["--steps", "0"], ["--threads", "0"], ["--stop-after", "-1"],
                             ["--optimizers", "lamb,sgdd"], ["--model", "huge"],
                             ["--config", "no-such-experiment"], ["--lr", "nan"]]))
def test_mkor_command_line_parses_or_exits_with_one_line_naming_the_field(
        assignments: list[tuple[str, str]], flag: list[str]) -> None:
    argv = ["--config", "tiny", *flag]
    for key, value in assignments:
        argv += ["--set", f"{key}={value}"]
    stop = mock.patch.object(mkor_bert, "init_distributed", side_effect=Parsed)
    outcome, stderr = invoke(mkor_bert.main, argv, stop)
    if outcome != "parsed":
        assert_clear_error(outcome, stderr, MKOR_FIELDS | set(MKOR_KEYS))


def test_a_field_name_with_a_line_break_is_quoted_in_a_one_line_error() -> None:
    """Found by the fuzz test above: a JSON key holding a newline split the message."""
    stop = mock.patch.object(mkor_bert, "init_distributed", side_effect=Parsed)
    outcome, stderr = invoke(mkor_bert.main, ["--config", "tiny", "--set",
                                              'warm_start={"\\n": null}'], stop)
    assert_clear_error(outcome, stderr, MKOR_FIELDS)
    assert "invalid 'warm_start.\\n'=None" in stderr


# ------------------------------------------------------------------------------------------------
# DP-KFAC: `python -m reproductions.dpkfac.train --config FILE --epochs N ...`

DPKFAC_FIELDS = {f.name for f in fields(TrainConfig)}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the fuzzed DP-KFAC config files are written."""
    return tmp_path_factory.mktemp("dpkfac-configs")


@FUZZ
@given(name=st.sampled_from([*sorted(DPKFAC_FIELDS), "epoch"]), value=JSON_VALUES,
       flag=st.sampled_from([[], ["--epochs", "0"], ["--max-steps", "-3"], ["--workers", "0"],
                             ["--epochs", "x"], ["--optimizer", "adam"]]))
def test_dpkfac_command_line_parses_or_exits_with_one_line_naming_the_field(
        config_dir: Path, name: str, value: Any, flag: list[str]) -> None:
    config = config_dir / "config.json"
    config.write_text(json.dumps({name: value}))
    stop = mock.patch.object(dpkfac_train, "fashion_mnist", side_effect=Parsed)
    outcome, stderr = invoke(dpkfac_train.main, ["--config", str(config), *flag], stop)
    if outcome != "parsed":
        assert_clear_error(outcome, stderr, DPKFAC_FIELDS | {"epoch"})


# ------------------------------------------------------------------------------------------------
# Missing, empty and corrupt data: one line naming the file and the fix (exit status 1)

def osawa_on_folder(folder: Path, out: Path) -> tuple[str, str]:
    """Two updates of the tiny image-folder run through the entry point."""
    return invoke(osawa_train.main, train_args(out, folder, "--max-steps", "2"))


def assert_data_error(outcome: str, stderr: str, *needles: str) -> None:
    """Exit status 1, no traceback, one ``error:`` line holding every needle and a fix."""
    assert outcome == "exit 1", (outcome, stderr)
    assert "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if ": error: " in ln]
    assert "Fix: " in line, line
    for needle in needles:
        assert needle in line, (needle, line)


@pytest.mark.parametrize("damage", ["missing", "empty class", "corrupt image", "empty image"])
def test_image_folder_faults_name_the_file_and_the_fix(tmp_path: Path, image_folder: Path,
                                                       damage: str) -> None:
    folder = tmp_path / "images"
    shutil.copytree(image_folder, folder)
    victim = folder / "train" / "class_001" / "img_002.png"
    if damage == "missing":
        shutil.rmtree(folder)
        needles = [f"image folder {folder}", "--image-folder"]
    elif damage == "empty class":
        for image in (folder / "train" / "class_002").iterdir():
            image.unlink()
        needles = ["class_002", "train/<class>/<images>"]
    else:
        victim.write_bytes(b"" if damage == "empty image" else victim.read_bytes()[:60])
        needles = [str(victim), "is not a readable image"]
    assert_data_error(*osawa_on_folder(folder, tmp_path / "out"), *needles)


@pytest.mark.parametrize("content", [b"PK\x03\x04 a cut-off download",
                                     b"junk"])  # torch.load raised struct.error on the latter
def test_corrupt_fashion_mnist_cache_names_the_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    content: bytes) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "fashion-mnist" / "train.pt"
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content)
    outcome, stderr = invoke(osawa_train.main, ["--out", str(tmp_path / "out"), "--wandb",
                                                "disabled", "--max-steps", "1"])
    assert_data_error(outcome, stderr, str(cache), f"delete {cache}")


def test_the_demo_refuses_a_batch_larger_than_the_data_and_names_missing_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--batch-size 70000`` left the loader empty and the demo looped for ever; missing
    data ended in a traceback."""
    data = TensorDataset(torch.zeros(100, 1, 28, 28), torch.zeros(100, dtype=torch.long))
    with mock.patch.object(demo, "fashion_mnist", return_value=data):
        outcome, stderr = invoke(demo.main, ["--batch-size", "101", "--steps", "1"])
    assert_clear_error(outcome, stderr, {"--batch-size"})
    assert "at most 100" in stderr
    for bad in (["--batch-size", "0"], ["--steps", "0"]):
        assert_clear_error(*invoke(demo.main, bad), {"--batch-size", "--steps"})
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(fashion_mnist_module.SOURCE_DIR_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(fashion_mnist_module, "_network_available", lambda timeout=3.0: False)
    assert_data_error(*invoke(demo.main, ["--steps", "1"]), str(tmp_path / "nowhere"),
                      f"unset ${fashion_mnist_module.SOURCE_DIR_ENV}")


@pytest.mark.parametrize("content", [None, b"", b" \n\n "])
def test_missing_or_empty_corpus_names_the_file(tmp_path: Path, content: bytes | None) -> None:
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_bytes(content)
    kind = DataUnavailableError if content is None else CorruptDataError
    with pytest.raises(kind, match=f"{corpus}.*Fix: "):
        wordpiece_vocab(corpus, 100, root=tmp_path / "cache")


@pytest.mark.parametrize("content", [b"", b"the\nand\n", b"[PAD]\n[UNK]\n[CLS]\nthe\n"])
def test_vocabulary_without_special_tokens_names_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "vocab.txt").write_bytes(content)
    with pytest.raises(CorruptDataError, match=r"vocab.txt: lacks the special tokens .*Fix: "):
        bert_tokenizer(tmp_path)


@pytest.mark.parametrize("content", [b"", b"   \n", b"\xff\xfe garbage"])
def test_mkor_corpus_faults_exit_with_one_line(tmp_path: Path, content: bytes) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    argv = ["--config", "tiny", "--corpus", str(corpus), "--no-warm-start", "--optimizers",
            "lamb", "--wandb", "disabled", "--out", str(tmp_path / "out"),
            "--data-dir", str(tmp_path / "cache")]
    assert_data_error(*invoke(mkor_bert.main, argv), str(corpus))


@pytest.mark.parametrize("content", [None, "", "{\"schema\": \"kfac-repro/results/v1\""])
def test_missing_empty_or_truncated_results_file_names_it_and_the_fix(
        tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsError, match=f"^{path}: .*Fix: restore the file from git"):
        load_results(path)


# ------------------------------------------------------------------------------------------------
# A model with no supported layers: a warning, and the plain optimizer's run

class NoSupportedLayers(nn.Module):
    """A linear classifier on the pooled image written with a bare parameter (no nn.Linear)."""

    def __init__(self, num_classes: int, in_channels: int, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_channels, num_classes) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3)) @ self.weight


def test_model_without_supported_layers_warns_and_trains_as_the_plain_optimizer(
        tmp_path: Path, image_folder: Path) -> None:
    finals = {}
    for optimizer in ("kfac", "sgd"):
        out = tmp_path / optimizer
        argv = train_args(out, image_folder, "--max-steps", "3",
                          settings={**SETTINGS, "optimizer": optimizer})
        with mock.patch("reproductions.osawa2018.trainer.build_model",
                        lambda name, classes, channels, width: NoSupportedLayers(classes,
                                                                                 channels)):
            if optimizer == "kfac":
                with pytest.warns(UserWarning, match="no supported layers"):
                    osawa_train.main(argv)
            else:
                osawa_train.main(argv)
        finals[optimizer] = final_state(out, step=3)
    assert_bit_identical(finals["kfac"], finals["sgd"])
