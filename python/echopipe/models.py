"""Image classification models as flat ``nn.Sequential`` stacks.

Every model here is a single-level ``nn.Sequential`` whose children are whole blocks (stem,
each residual block, pooling, flatten, classifier). A pipeline engine can therefore split a
model into stages with a ``balance`` list of child counts, without knowing its architecture.
Residual connections live inside a block, so no tensor ever crosses a stage boundary other
than the block output. No torchvision dependency.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

__all__ = [
    "MODEL_NAMES",
    "BasicBlock",
    "Bottleneck",
    "build_model",
    "count_parameters",
    "lenet5",
    "resnet18",
    "resnet50",
    "resnet_cifar",
    "resnet_small",
]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    # A projection only where shape changes; identity keeps the block cheap otherwise.
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(_conv1x1(in_ch, out_ch, stride), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual shortcut (He et al. 2016).

    Args:
        in_channels: channels of the block input.
        channels: channels of the block output.
        stride: stride of the first convolution (2 halves the spatial size).
    """

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, channels, stride)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm closing the residual branch (zero-initialised by the builders)."""
        return self.bn2


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual shortcut; stride on the 3x3.

    Args:
        in_channels: channels of the block input.
        channels: bottleneck width; the output has ``4 * channels`` channels.
        stride: stride of the 3x3 convolution.
    """

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = _conv1x1(in_channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = _conv1x1(channels, out_channels)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Return the bottleneck branch plus the shortcut, after ReLU."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm closing the residual branch (zero-initialised by the builders)."""
        return self.bn3


def _init_weights(model: nn.Module, zero_init_residual: bool = True) -> None:
    # Kaiming for ReLU nets; zeroing the last BN of each residual branch makes every block start
    # as identity, which helps small-batch and stale-weight training start stably.
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, BasicBlock | Bottleneck):
                nn.init.zeros_(m.last_bn().weight)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def lenet5(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """Classic LeNet-5 for 32x32 inputs (ReLU and max-pool instead of tanh and subsampling).

    Children: conv1 block, conv2 block, flatten, fc1, fc2, fc3 (each one entry).

    Args:
        num_classes: number of output logits.
        in_channels: channels of the input image (1 for digits, 3 for colour).

    Returns:
        ``nn.Sequential`` mapping ``(N, in_channels, 32, 32)`` to ``(N, num_classes)``.
    """
    _check_positive("num_classes", num_classes)
    _check_positive("in_channels", in_channels)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(in_channels, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        nn.Flatten(),
        nn.Sequential(nn.Linear(16 * 5 * 5, 120), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Linear(120, 84), nn.ReLU(inplace=True)),
        nn.Linear(84, num_classes),
    )
    _init_weights(model)
    return model


def _head(in_features: int, num_classes: int) -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_features, num_classes)]


def resnet_cifar(
    depth: int = 20, num_classes: int = 10, width: int = 16, in_channels: int = 3
) -> nn.Sequential:
    """CIFAR-style ResNet of He et al. (2016): depth = 6n + 2 (20, 32, 44, 56, 110, ...).

    A 3x3 stem, then three stages of ``n`` BasicBlocks with ``width``, ``2*width`` and
    ``4*width`` channels (stride 2 at the start of stages 2 and 3), global average pooling and a
    linear classifier. Shortcuts that change shape are 1x1 projections (option B). Works for any
    input side >= 8 thanks to the global pool.

    Args:
        depth: total number of weighted layers; must satisfy ``(depth - 2) % 6 == 0``.
        num_classes: number of output logits.
        width: channels of the first stage.
        in_channels: channels of the input image.

    Returns:
        Flat ``nn.Sequential``: stem, ``3n`` blocks, pool, flatten, fc (``3n + 4`` children).

    Raises:
        ValueError: if ``depth`` is not of the form 6n + 2 with n >= 1.
    """
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"depth must be an int, got {depth!r}")
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(
            f"resnet_cifar depth must be 6n+2 with n >= 1 (8, 14, 20, 32, 44, 56, 110, ...), "
            f"got depth={depth}"
        )
    _check_positive("num_classes", num_classes)
    _check_positive("width", width)
    _check_positive("in_channels", in_channels)
    n = (depth - 2) // 6
    layers: list[nn.Module] = [
        nn.Sequential(_conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
    ]
    ch = width
    for stage, out_ch in enumerate((width, 2 * width, 4 * width)):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            layers.append(BasicBlock(ch, out_ch, stride))
            ch = out_ch
    layers += _head(ch, num_classes)
    model = nn.Sequential(*layers)
    _init_weights(model)
    return model


def _imagenet_resnet(
    block: type[BasicBlock] | type[Bottleneck],
    blocks_per_stage: tuple[int, int, int, int],
    num_classes: int,
    in_channels: int,
) -> nn.Sequential:
    _check_positive("num_classes", num_classes)
    _check_positive("in_channels", in_channels)
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
    ]
    ch = 64
    for stage, count in enumerate(blocks_per_stage):
        planes = 64 * 2**stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            layers.append(block(ch, planes, stride))
            ch = planes * block.expansion
    layers += _head(ch, num_classes)
    model = nn.Sequential(*layers)
    _init_weights(model)
    return model


def resnet18(num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """ImageNet ResNet-18 (BasicBlock, [2, 2, 2, 2]); 11.69M parameters at 1000 classes.

    Children: stem (7x7/2 conv, BN, ReLU, 3x3/2 max-pool), 8 blocks, pool, flatten, fc.
    Shortcut projections sit at the same places as in torchvision, so parameter counts match.
    """
    return _imagenet_resnet(BasicBlock, (2, 2, 2, 2), num_classes, in_channels)


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """ImageNet ResNet-50 (Bottleneck, [3, 4, 6, 3], stride on the 3x3); 25.56M parameters.

    Children: stem, 16 blocks, pool, flatten, fc.
    """
    return _imagenet_resnet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels)


def resnet_small(num_classes: int = 10, in_channels: int = 3, width: int = 24) -> nn.Sequential:
    """Narrow ResNet for quick CPU training on ~40-64 px images (the ``echopipe train`` default).

    A 3x3/2 stem halves the input so 64 px images cost like 32 px ones, then four BasicBlocks
    (width, 2w/2, 4w/2, 4w) - ten weighted layers - global pooling and a linear classifier.
    Works for any input side >= 16.

    Args:
        num_classes: number of output logits.
        in_channels: channels of the input image.
        width: channels after the stem.

    Returns:
        Flat ``nn.Sequential`` with 8 children: stem, 4 blocks, pool, flatten, fc.
    """
    _check_positive("num_classes", num_classes)
    _check_positive("in_channels", in_channels)
    _check_positive("width", width)
    w = width
    layers: list[nn.Module] = [
        nn.Sequential(_conv3x3(in_channels, w, stride=2), nn.BatchNorm2d(w), nn.ReLU(inplace=True)),
        BasicBlock(w, w),
        BasicBlock(w, 2 * w, stride=2),
        BasicBlock(2 * w, 4 * w, stride=2),
        BasicBlock(4 * w, 4 * w),
    ]
    layers += _head(4 * w, num_classes)
    model = nn.Sequential(*layers)
    _init_weights(model)
    return model


def _resnet_cifar_by_depth(depth: int) -> Callable[..., nn.Sequential]:
    def build(num_classes: int, **kw: int) -> nn.Sequential:
        return resnet_cifar(depth=depth, num_classes=num_classes, **kw)

    return build


def _lenet5_colour(num_classes: int, in_channels: int = 3) -> nn.Sequential:
    # By name every model takes colour images unless told otherwise: echopipe train feeds RGB,
    # and export's weights must load into build_model(name, num_classes) as they are.
    return lenet5(num_classes=num_classes, in_channels=in_channels)


_BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "lenet5": _lenet5_colour,
    "resnet_small": resnet_small,
    "resnet_cifar": resnet_cifar,
    "resnet20": _resnet_cifar_by_depth(20),
    "resnet56": _resnet_cifar_by_depth(56),
    "resnet110": _resnet_cifar_by_depth(110),
    "resnet18": resnet18,
    "resnet50": resnet50,
}

MODEL_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))
"""Names accepted by :func:`build_model`."""


def build_model(name: str, num_classes: int, **kw: object) -> nn.Sequential:
    """Build a registered model by name.

    Args:
        name: one of :data:`MODEL_NAMES` (``resnet_cifar`` takes ``depth=``; ``resnet20``,
            ``resnet56``, ``resnet110`` are fixed depths).
        num_classes: number of output logits.
        **kw: extra keyword arguments of the builder (``in_channels``, ``width``, ...).
            ``in_channels`` is 3 unless given, also for ``lenet5`` (whose function defaults to
            1, for digits).

    Raises:
        ValueError: if ``name`` is unknown; the message lists the valid names.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    return builder(num_classes=num_classes, **kw)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
