"""Credentials never reach configs, results or dashboards."""

from __future__ import annotations

import pytest

from reproductions.common.scrub import REDACTED, is_secret_name, scrub_argv, scrub_secrets


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "hf_token", "apiKey", "secret", "db-password",
                                  "key", "aws.secret.access", "s3Key", "oauth2Token"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["tokenizer", "max_tokens", "monkey", "keep", "vocab_size",
                                  "lr"])
def test_ordinary_names(name: str) -> None:
    assert not is_secret_name(name)


def test_scrubs_by_name_and_by_value() -> None:
    env = {"WANDB_API_KEY": "0123456789abcdef", "SHORT_TOKEN": "abc"}
    config = {"lr": 0.1, "hf_token": "hf_xyz", "nested": {"apiKey": "k"},
              "argv": ["--url", "https://u:0123456789abcdef@host"], "pair": ("tokenizer", 1)}
    clean = scrub_secrets(config, environ=env)
    assert clean == {"lr": 0.1, "hf_token": REDACTED, "nested": {"apiKey": REDACTED},
                     "argv": ["--url", f"https://u:{REDACTED}@host"], "pair": ("tokenizer", 1)}
    assert config["hf_token"] == "hf_xyz"  # the input is not modified


def test_by_value_only_keeps_layer_names() -> None:
    report = {"bert.encoder.layer.0.attention.self.key": 12}
    assert scrub_secrets(report, by_name=False, environ={}) == report


def test_command_lines_are_scrubbed_by_value_and_by_option_name() -> None:
    env = {"HF_TOKEN": "hf_0123456789"}
    argv = ["train.py", "--set", "lr=0.1", "api_key=abc", "source=see hf_0123456789",
            "--hf-token", "xyz", "--wandb-key=k", "--tokenizer", "wordpiece"]
    assert scrub_argv(argv, environ=env) == [
        "train.py", "--set", "lr=0.1", f"api_key={REDACTED}", f"source=see {REDACTED}",
        "--hf-token", REDACTED, f"--wandb-key={REDACTED}", "--tokenizer", "wordpiece"]


def test_an_eight_character_secret_and_one_inside_a_longer_one_are_redacted_whole() -> None:
    """The longer secret is replaced first, so no tail of it is left beside a shorter one."""
    env = {"MY_TOKEN": "abcdefgh", "HF_TOKEN": "abcdefgh-and-more", "PATH": "/bin"}
    assert scrub_secrets({"log": "using abcdefgh-and-more and abcdefgh"}, environ=env) == {
        "log": f"using {REDACTED} and {REDACTED}"}


def test_a_secret_looking_word_that_is_not_an_option_does_not_redact_the_next_one() -> None:
    assert scrub_argv(["train.py", "--set", "key", "--lr", "0.1"], environ={}) == [
        "train.py", "--set", "key", "--lr", "0.1"]
