"""Fixtures of the reliability tests: the generated image folder and the uninterrupted run that
faulted runs must reproduce bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.image_folder import make_tiny_image_folder
from reproductions.osawa2018.train import main
from tests.reliability.helpers import train_args


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-class ImageNet-style folder of 8 generated 20×20 images per class and split."""
    return make_tiny_image_folder(tmp_path_factory.mktemp("images"), classes=3, per_class=8,
                                  size=20)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, image_folder: Path) -> Path:
    """The output directory of the tiny run trained start to end in one process."""
    out = tmp_path_factory.mktemp("uninterrupted")
    main(train_args(out, image_folder))
    return out
