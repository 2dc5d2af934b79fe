"""ImageNet-style folders: the tiny generated one, transforms, and the missing-folder errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from data.errors import DataUnavailableError
from data.image_folder import image_folder, make_tiny_image_folder


def test_tiny_folder_loads_both_splits(tmp_path: Path) -> None:
    root = make_tiny_image_folder(tmp_path / "tiny", classes=3, per_class=2, size=20)
    train = image_folder(root, train=True, image_size=16)
    val = image_folder(root, train=False, image_size=16)
    assert train.classes == ["class_000", "class_001", "class_002"]
    assert len(train) == len(val) == 6
    image, label = val[5]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert label == 2
    assert train[0][0].shape == (3, 16, 16)


def test_tiny_folder_is_reproducible(tmp_path: Path) -> None:
    a = make_tiny_image_folder(tmp_path / "a", classes=1, per_class=1)
    b = make_tiny_image_folder(tmp_path / "b", classes=1, per_class=1)
    name = Path("train/class_000/img_000.png")
    assert (a / name).read_bytes() == (b / name).read_bytes()


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailableError, match="image folder .*absent.*train/<class>"):
        image_folder(tmp_path / "absent", train=True, image_size=8)


def test_missing_split_and_empty_split(tmp_path: Path) -> None:
    root = make_tiny_image_folder(tmp_path / "tiny", classes=1, per_class=1, size=8)
    shutil.rmtree(root / "val")
    with pytest.raises(DataUnavailableError, match="'val' split"):
        image_folder(root, train=False, image_size=8)
    (root / "val").mkdir()
    with pytest.raises(DataUnavailableError, match="class folders inside"):
        image_folder(root, train=False, image_size=8)


@pytest.mark.parametrize("train", [True, False])
def test_splits_with_other_class_folders_are_refused_naming_them(tmp_path: Path,
                                                                 train: bool) -> None:
    """Labels are the class folders' sorted positions: a class missing from one split (or a
    stray folder) would shift every later label of that split without an error."""
    root = make_tiny_image_folder(tmp_path / "tiny", classes=3, per_class=1, size=8)
    shutil.rmtree(root / "val" / "class_000")
    (root / "val" / "stray").mkdir()
    (root / "val" / "stray" / "x.png").write_bytes((root / "train" / "class_000" / "img_000.png"
                                                    ).read_bytes())
    with pytest.raises(DataUnavailableError,
                       match=r"only in (train: \['class_000'\]; only in val: \['stray'\]|"
                             r"val: \['stray'\]; only in train: \['class_000'\])"):
        image_folder(root, train=train, image_size=8)


def test_16_bit_image_is_scaled_not_saturated(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from data.image_folder import load_rgb

    path = tmp_path / "gray16.png"
    Image.fromarray(np.array([[0, 257 * 100, 30000, 65535]], dtype=np.uint16)).save(path)
    assert Image.open(path).mode == "I;16"
    pixels = np.asarray(load_rgb(str(path)))
    assert pixels.shape == (1, 4, 3) and pixels.dtype == np.uint8
    assert pixels[0, :, 0].tolist() == [0, 100, round(30000 / 257), 255]
    assert (pixels[..., 0] == pixels[..., 2]).all()


@pytest.mark.parametrize(("name", "array"), [
    ("float.tif", [[0.5, 0.25]]),
    ("int32.tif", [[70000, 3]]),
])
def test_float_and_32_bit_images_are_refused_naming_mode(tmp_path: Path, name: str,
                                                        array: list[list[float]]) -> None:
    import numpy as np
    from PIL import Image

    from data.errors import CorruptDataError
    from data.image_folder import load_rgb

    path = tmp_path / name
    dtype = np.float32 if name.startswith("float") else np.int32
    Image.fromarray(np.array(array, dtype=dtype)).save(path)
    mode = Image.open(path).mode
    with pytest.raises(CorruptDataError, match=rf"{name}: has image mode {mode} ") as caught:
        load_rgb(str(path))
    assert "not a readable image" not in str(caught.value)
