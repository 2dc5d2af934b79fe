"""Models: torchvision's ResNet-50 for the paper's scale, a small ResNet for Fashion-MNIST.

The paper trains ResNet-50 (the authors' repository later used ResNet-50-D); we use torchvision's
ResNet-50, whose 53 convolutions, 53 BatchNorms and one fully connected layer are the 107 Fisher
blocks of the paper's poster. The small ResNet is built from torchvision's ``BasicBlock``: a
stride-2 3×3 stem and three stages of one block each (widths ``w``, ``2w``, ``4w``), for 1-channel
28×28 images; with ``w = 16`` it has about 78k parameters.
"""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet50
from torchvision.models.resnet import BasicBlock

from core.config import check_choice

MODELS = ("resnet50", "small_resnet")


def _stage(in_channels: int, out_channels: int, stride: int) -> BasicBlock:
    downsample = None
    if stride != 1 or in_channels != out_channels:
        downsample = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
            nn.BatchNorm2d(out_channels),
        )
    return BasicBlock(in_channels, out_channels, stride=stride, downsample=downsample)


def small_resnet(num_classes: int = 10, in_channels: int = 1, width: int = 16) -> nn.Sequential:
    """A ResNet-8-like network for small grayscale images (every layer K-FAC-preconditioned).

    Args:
        num_classes: Outputs of the final Linear layer.
        in_channels: Input channels (1 for Fashion-MNIST).
        width: Channels of the first stage; the next two stages double it each time.
    """
    model = nn.Sequential(
        nn.Conv2d(in_channels, width, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        _stage(width, width, 1),
        _stage(width, 2 * width, 2),
        _stage(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


def build_model(name: str, num_classes: int, in_channels: int, width: int = 16) -> nn.Module:
    """``resnet50`` (3-channel input, ``width`` unused) or ``small_resnet``."""
    check_choice("model", name, MODELS)
    if name == "resnet50":
        if in_channels != 3:
            raise ValueError(f"resnet50 takes 3-channel images, the data has {in_channels}")
        return resnet50(weights=None, num_classes=num_classes)
    return small_resnet(num_classes, in_channels, width)
