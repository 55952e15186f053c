"""Tests for echopipe.models: shapes, parameter counts, flatness, init, training, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from echopipe.data import load_digits
from echopipe.models import (
    MODEL_NAMES,
    BasicBlock,
    Bottleneck,
    build_model,
    count_parameters,
    lenet5,
    resnet18,
    resnet50,
    resnet_cifar,
    resnet_small,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize(
    ("name", "kwargs", "shape", "num_children"),
    [
        ("lenet5", {"in_channels": 1}, (2, 1, 32, 32), 6),
        ("lenet5", {}, (2, 3, 32, 32), 6),  # by name, colour like every model
        ("resnet_cifar", {"depth": 8}, (2, 3, 8, 8), 7),
        ("resnet20", {}, (2, 3, 32, 32), 13),
        ("resnet20", {"width": 8, "in_channels": 1}, (2, 1, 45, 61), 13),
        ("resnet56", {}, (2, 3, 16, 16), 31),
        ("resnet_small", {}, (2, 3, 64, 64), 8),
        ("resnet_small", {}, (2, 3, 40, 52), 8),
        ("resnet18", {}, (2, 3, 64, 64), 12),
        ("resnet50", {}, (2, 3, 32, 32), 20),
    ],
)
def test_output_shape_and_flat_children(
    name: str, kwargs: dict[str, int], shape: tuple[int, ...], num_children: int
) -> None:
    model = build_model(name, num_classes=7, **kwargs).eval()
    assert isinstance(model, nn.Sequential)
    assert len(model) == num_children
    x = torch.randn(*shape)
    with torch.no_grad():
        out = model(x)
        # Running the children one by one is exactly what a pipeline engine does.
        y = x
        for child in model:
            y = child(y)
    assert out.shape == (shape[0], 7)
    assert torch.equal(out, y)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_residual_block_is_a_direct_child(name: str) -> None:
    model = build_model(name, num_classes=10)
    direct = {id(m) for m in model}
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock | Bottleneck)]
    assert all(id(b) in direct for b in blocks)
    # No child nests another residual stage: every child is a block, a small stem/head, or a
    # plain layer.
    for child in model:
        nested = [m for m in child.modules() if isinstance(m, BasicBlock | Bottleneck)]
        assert nested in ([], [child])


def test_split_by_balance_matches_whole_model() -> None:
    model = resnet_cifar(20, num_classes=10).eval()
    balance = [5, 4, 4]
    assert sum(balance) == len(model)
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(*list(model)[start : start + count]))
        start += count
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        y = x
        for stage in stages:
            y = stage(y)
        assert torch.allclose(y, model(x))


def test_parameter_counts_match_reference_architectures() -> None:
    # torchvision's resnet18 / resnet50 have exactly these counts at 1000 classes.
    assert count_parameters(resnet18()) == 11_689_512
    assert count_parameters(resnet50()) == 25_557_032
    # He et al. 2016, table 6: 0.27M, 0.85M, 1.7M (with 1x1 projection shortcuts here).
    assert count_parameters(resnet_cifar(20)) == pytest.approx(0.27e6, rel=0.02)
    assert count_parameters(resnet_cifar(56)) == pytest.approx(0.85e6, rel=0.02)
    assert count_parameters(resnet_cifar(110)) == pytest.approx(1.73e6, rel=0.02)
    assert count_parameters(lenet5()) == 61_706
    assert count_parameters(resnet_cifar(20, width=32)) > 3.9 * count_parameters(resnet_cifar(20))


def test_zero_init_makes_identity_blocks_start_as_relu() -> None:
    model = resnet_small().train()
    block = model[1]
    assert isinstance(block, BasicBlock)
    assert isinstance(block.shortcut, nn.Identity)
    assert torch.count_nonzero(block.bn2.weight) == 0
    x = torch.randn(4, block.conv1.in_channels, 16, 16)
    with torch.no_grad():
        assert torch.allclose(block(x), torch.relu(x))


def test_conv_weights_use_kaiming_scale() -> None:
    conv = resnet18()[0][0]
    assert isinstance(conv, nn.Conv2d)
    fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
    expected_std = (2.0 / fan_out) ** 0.5
    assert conv.weight.std().item() == pytest.approx(expected_std, rel=0.1)


def test_all_parameters_get_gradients() -> None:
    model = resnet_small(num_classes=5)
    x = torch.randn(4, 3, 32, 32)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_lenet5_sgd_on_digits_reduces_loss() -> None:
    x_train, y_train, x_test, y_test = load_digits(image_size=32)
    model = lenet5(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def test_loss() -> float:
        with torch.no_grad():
            return nn.functional.cross_entropy(model(x_test), y_test).item()

    before = test_loss()
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        batch = torch.randint(0, len(y_train), (64,), generator=generator)
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = test_loss()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert after < 0.5 * before
    assert accuracy > 0.6  # chance is 0.1


def test_unknown_model_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="resnet19") as info:
        build_model("resnet19", num_classes=10)
    for name in MODEL_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("depth", [21, 2, 0, 19])
def test_bad_cifar_depth_is_named(depth: int) -> None:
    with pytest.raises(ValueError, match=f"depth={depth}"):
        resnet_cifar(depth)


def test_bad_argument_types_and_values() -> None:
    with pytest.raises(TypeError, match="depth"):
        resnet_cifar("20")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_classes must be >= 1, got 0"):
        resnet18(num_classes=0)
    with pytest.raises(ValueError, match="width must be >= 1, got -4"):
        build_model("resnet_small", 10, width=-4)
    with pytest.raises(TypeError, match="in_channels"):
        lenet5(in_channels=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        build_model("resnet18", 10, depth=20)


def test_build_model_resnet_cifar_takes_depth() -> None:
    model = build_model("resnet_cifar", 10, depth=32)
    assert len(model) == 3 * 5 + 4
