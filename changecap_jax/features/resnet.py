"""ResNet-101 in plain PyTorch, truncated after layer3 or layer4, for grid features.

The official features come from torchvision's ImageNet ``resnet101`` in eval mode, cut as
conv1 -> bn1 -> relu -> maxpool -> layer1 -> layer2 -> layer3 (-> layer4): (1024, 14, 14) or
(2048, 7, 7) per 224 x 224 image. torchvision is not always installable, so this module
defines the same network with torchvision's exact module and parameter names (Bottleneck
blocks [3, 4, 23, 3], stride on the 3x3 conv as torchvision does, ``layerN.M.downsample.0/1``,
``fc``), so a torchvision ``resnet101`` state dict saved with ``torch.save`` loads into it
unchanged. When torchvision is importable its own ``resnet101`` is used instead.

Nothing is downloaded: the weights come from a local file (e.g. torchvision's
``resnet101-63fe2227.pth`` or ``resnet101-5d3b4d8f.pth``, copied by hand).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from changecap_jax.errors import UserError

try:  # torchvision can be absent or broken (e.g. built for another torch): guard broadly.
    from torchvision.models import resnet101 as _tv_resnet101
except Exception:  # pragma: no cover - depends on the install
    _tv_resnet101 = None

LAYERS = (3, 4, 23, 3)
OUTPUT_SHAPES = {3: (1024, 14, 14), 4: (2048, 7, 7)}  # for 224 x 224 inputs


class WeightsError(UserError, ValueError):
    """A weights file that is missing, unreadable or does not fit ResNet-101; names the file."""


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (expansion 4, stride on the 3x3 conv), same attribute names."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet with Bottleneck blocks; ``ResNet()`` is ResNet-101."""

    def __init__(self, layers: tuple[int, ...] = LAYERS, num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():  # torchvision's initialisation (irrelevant once loaded)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, kernel_size=1,
                          stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_resnet101(use_torchvision: bool | None = None) -> nn.Module:
    """An untrained ResNet-101: torchvision's when importable (``None``), else this module's."""
    if use_torchvision is None:
        use_torchvision = _tv_resnet101 is not None
    if use_torchvision:
        if _tv_resnet101 is None:
            raise ImportError("use_torchvision=True but torchvision is not importable")
        try:
            return _tv_resnet101(weights=None)
        except TypeError:  # torchvision < 0.13
            return _tv_resnet101(pretrained=False)
    return ResNet()


def _describe(obj: Any) -> str:
    return type(obj).__name__


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Loads a torchvision-format ResNet state dict from a local file, with clear errors.

    Accepts a plain state dict, or one wrapped as ``{"state_dict": ...}`` / ``{"model": ...}``,
    with or without a DataParallel ``module.`` prefix.
    """
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"ResNet-101 weights file {path} does not exist")
    if not path.is_file():
        raise WeightsError(f"ResNet-101 weights path {path} is not a file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # RuntimeError, UnpicklingError, EOFError, BadZipFile, ...
        raise WeightsError(
            f"{path} is not a readable PyTorch state-dict checkpoint (expected a file written by "
            f"torch.save(model.state_dict()); it may be another format, a pickled model, or "
            f"truncated or corrupt): {type(e).__name__}: {e}") from e
    if isinstance(obj, Mapping):
        for wrapper in ("state_dict", "model"):
            if isinstance(obj.get(wrapper), Mapping):
                obj = obj[wrapper]
                break
    if not isinstance(obj, Mapping) or not obj:
        raise WeightsError(f"{path} holds a {_describe(obj)}, not a ResNet-101 state dict")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise WeightsError(f"{path} is not a state dict of tensors (entry {bad[0]!r} is a "
                           f"{_describe(obj[bad[0]])})")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def check_state_dict(state: Mapping[str, torch.Tensor], model: nn.Module,
                     source: str | os.PathLike) -> None:
    """Raises ``WeightsError`` naming ``source`` for missing, unexpected or mis-shaped keys.

    BatchNorm ``num_batches_tracked`` counters may be absent (older torchvision checkpoints
    lack them; they play no part in eval mode).
    """
    expected = model.state_dict()
    missing = [k for k in expected
               if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise WeightsError(
            f"{source}: {len(missing)} ResNet-101 key(s) missing from the weights file, e.g. "
            f"{', '.join(repr(k) for k in missing[:5])}")
    if unexpected:
        raise WeightsError(
            f"{source}: {len(unexpected)} unexpected key(s) in the weights file (not "
            f"torchvision's resnet101 names), e.g. {', '.join(repr(k) for k in unexpected[:5])}")
    for key, value in state.items():
        want = tuple(expected[key].shape)
        got = tuple(value.shape)
        if got != want:
            raise WeightsError(
                f"{source}: key {key!r} has shape {got} in the weights file but ResNet-101 "
                f"expects {want}")


class TruncatedResNet(nn.Sequential):
    """conv1 -> bn1 -> relu -> maxpool -> layer1 .. layer{3,4}; child names as torchvision's."""

    def __init__(self, full: nn.Module, layer: int) -> None:
        if layer not in OUTPUT_SHAPES:
            raise ValueError(f"layer must be 3 or 4, got {layer}")
        names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
        names = names[: 4 + layer]
        super().__init__(OrderedDict((n, getattr(full, n)) for n in names))
        self.layer = layer

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """Per-image output shape for a 224 x 224 input."""
        return OUTPUT_SHAPES[self.layer]


def load_resnet101(
    weights: str | os.PathLike,
    layer: int = 3,
    device: str | torch.device | None = None,
    use_torchvision: bool | None = None,
) -> TruncatedResNet:
    """ResNet-101 with ``weights`` (a local torchvision-format state dict), cut after
    ``layer`` (3 -> (1024, 14, 14), 4 -> (2048, 7, 7) per 224 x 224 image), in eval mode."""
    if layer not in OUTPUT_SHAPES:
        raise ValueError(f"layer must be 3 or 4, got {layer}")
    state = read_state_dict(weights)
    full = build_resnet101(use_torchvision)
    check_state_dict(state, full, weights)
    full.load_state_dict(state, strict=False)  # strict checks done above, with clearer errors
    model = TruncatedResNet(full, layer)
    if device is not None:
        model = model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
