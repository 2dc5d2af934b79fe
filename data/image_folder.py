"""ImageNet-style image folders, and a tiny generated one for tests.

The Osawa et al. reproduction trains ResNet-50 on ImageNet laid out the way torchvision's
``ImageFolder`` expects: ``<root>/train/<class>/*.JPEG`` and ``<root>/val/<class>/*.JPEG``. That
data cannot be shipped, so :func:`make_tiny_image_folder` writes a few generated PNGs in the same
layout, letting tests exercise the identical code path in seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image
from torchvision import datasets, transforms

from data.errors import CorruptDataError, DataUnavailableError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""Per-channel statistics of ImageNet RGB pixels in [0, 1], as used by torchvision's models."""

RESIZE_RATIO = 256 / 224
"""Evaluation resizes the short side to this multiple of the crop size (256 for 224 crops)."""

FOLDER_FIX = (
    "pass a folder laid out as train/<class>/<images> and val/<class>/<images> (the "
    "--image-folder option of reproductions.osawa2018.train; see data/README.md, 'Full-size data')"
)


def image_folder(root: Path, train: bool, image_size: int) -> datasets.ImageFolder:
    """Open the ``train`` or ``val`` split of an ImageNet-style folder with standard transforms.

    Training uses ``RandomResizedCrop`` and a horizontal flip; evaluation resizes the short side to
    ``image_size * 256 / 224`` and center-crops. Both normalise with the ImageNet statistics.

    Args:
        root: Folder containing ``train/`` and ``val/``, each with one sub-folder per class.
        train: True for the augmented training split, False for the validation split.
        image_size: Side of the square crops fed to the model (224 for ResNet-50).

    Returns:
        The dataset; its ``classes`` are the sorted class-folder names.

    Raises:
        DataUnavailableError: ``root`` or the split is missing, or the split has no class folders,
            or a class folder has no images.

    Reading an example raises :class:`~data.errors.CorruptDataError` naming the file when it is
    not a readable image (truncated, empty, not an image at all).
    """
    split = Path(root) / ("train" if train else "val")
    if not Path(root).is_dir():
        raise DataUnavailableError(f"image folder {root}", FOLDER_FIX)
    if not split.is_dir():
        raise DataUnavailableError(f"the '{split.name}' split {split}", FOLDER_FIX)
    if not any(child.is_dir() for child in split.iterdir()):
        raise DataUnavailableError(f"class folders inside {split}", FOLDER_FIX)
    other = Path(root) / ("val" if train else "train")
    if other.is_dir():  # labels are class-folder indices: both splits must list the same
        mine, theirs = _class_folders(split), _class_folders(other)
        if mine != theirs:
            raise DataUnavailableError(
                f"the same class folders in {split} and {other} (only in {split.name}: "
                f"{sorted(mine - theirs)[:5]}; only in {other.name}: {sorted(theirs - mine)[:5]})",
                "give both splits one folder per class, the same names in each: the labels "
                "are the class folders' positions in sorted order")
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if train:
        pipeline = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    else:
        resized = round(image_size * RESIZE_RATIO)
        pipeline = [transforms.Resize(resized), transforms.CenterCrop(image_size)]
    try:
        return datasets.ImageFolder(
            str(split),
            transform=transforms.Compose([*pipeline, transforms.ToTensor(), normalize]),
            loader=load_rgb,
        )
    except FileNotFoundError as exc:  # torchvision: a class folder without image files
        raise DataUnavailableError(f"images in every class folder of {split} ({exc})",
                                   FOLDER_FIX) from None


def _class_folders(split: Path) -> set[str]:
    """The class-folder names of a split, as torchvision's ``ImageFolder`` finds them."""
    return {entry.name for entry in os.scandir(split) if entry.is_dir()}


def load_rgb(path: str) -> Image.Image:
    """Read an image file as 8-bit RGB, as torchvision's default loader does.

    PIL's ``convert("RGB")`` clips 16-bit grayscale (modes ``I;16*``) at 255 instead of scaling,
    which turns most such images white; they are scaled here by ``1/257`` (65535 -> 255,
    ``257 * k`` -> ``k``). 32-bit integer (``I``) and float (``F``) images have no known range,
    so they are refused rather than silently clipped.

    Args:
        path: The image file.

    Returns:
        The image in mode ``RGB``.

    Raises:
        CorruptDataError: the file is not a readable image, or its mode (``I``, ``F``) has no
            known 8-bit scaling (named, with the fix).
    """
    try:
        with Image.open(path) as image:
            if image.mode.startswith("I;16"):
                pixels = np.asarray(image).astype(np.float64)
                eight_bit = np.rint(pixels / 257).astype(np.uint8)
                return Image.fromarray(eight_bit).convert("RGB")  # uint8 2-D: mode L
            if image.mode in ("I", "F"):
                raise CorruptDataError(
                    Path(path), f"has image mode {image.mode} (32-bit "
                    f"{'integer' if image.mode == 'I' else 'float'} pixels), whose range for "
                    "8-bit RGB is unknown", "convert it to an 8-bit (or 16-bit) RGB or "
                    "grayscale image, or delete it")
            return image.convert("RGB")
    except CorruptDataError:  # a ValueError, but already the finished message
        raise
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError: OSError
        raise CorruptDataError(Path(path), f"is not a readable image ({exc})",
                               "replace the file with a good copy or delete it") from None


def make_tiny_image_folder(
    dest: Path, classes: int = 3, per_class: int = 4, size: int = 32, seed: int = 0
) -> Path:
    """Write a small generated ImageNet-style folder of RGB PNGs.

    Each class has its own base colour plus pixel noise, so a model can tell the classes apart and
    a short training run shows the loss falling. Both ``train`` and ``val`` get ``per_class``
    images per class.

    Args:
        dest: Folder to create (it may exist; files are overwritten).
        classes: Number of class folders, named ``class_000``, ``class_001``, ...
        per_class: Images per class in each split.
        size: Side of each square image in pixels.
        seed: Seed of the noise, so the output is reproducible.

    Returns:
        ``dest``, ready for :func:`image_folder`.
    """
    rng = np.random.default_rng(seed)
    base_colours = rng.integers(0, 256, size=(classes, 3))
    for split in ("train", "val"):
        for label in range(classes):
            folder = Path(dest) / split / f"class_{label:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(per_class):
                noise = rng.integers(-40, 41, size=(size, size, 3))
                pixels = np.clip(base_colours[label] + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"img_{index:03d}.png")
    return Path(dest)
