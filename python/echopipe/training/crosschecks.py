"""Checks of a whole :class:`~.config.TrainConfig` that no single option's check can make:
options against each other, against the model's blocks and input, and against the machine.
Like the per-option checks they touch no data and build nothing but meta-device models."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .options import MAX_IMAGE_SIZE, UsageError

__all__ = ["check_combination", "check_gpu_needs", "check_model_input", "check_model_split"]


def check_combination(cfg: Any) -> None:
    """Raise :class:`UsageError` naming the first options of ``cfg`` that do not go together."""
    if (
        isinstance(cfg.balance, list)
        and isinstance(cfg.stages, int)
        and len(cfg.balance) != cfg.stages
    ):
        raise UsageError(
            f"--balance {cfg.balance} has {len(cfg.balance)} stages but --stages is {cfg.stages}"
        )
    if (
        cfg.devices is not None
        and isinstance(cfg.stages, int)
        and len(cfg.devices) not in (1, cfg.stages)
    ):
        raise UsageError(
            f"--devices {','.join(cfg.devices)} gives {len(cfg.devices)} "
            f"devices for {cfg.stages} stages; give one, or one per stage"
        )
    if cfg.warmup_epochs > cfg.epochs:
        raise UsageError(
            f"--warmup-epochs {cfg.warmup_epochs:g} is longer than the run (--epochs "
            f"{cfg.epochs}): the rate would never reach --lr"
        )
    if isinstance(cfg.hybrid_switch, int) and cfg.hybrid_switch > cfg.epochs:
        raise UsageError(
            f"--hybrid-switch {cfg.hybrid_switch} is after the last epoch (--epochs "
            f"{cfg.epochs}): the run would never switch"
        )
    check_cache_slots(cfg.echo_config(), cfg.batch_size)
    check_model_split(cfg.model, cfg.balance, cfg.stages)
    check_model_input(cfg.model, cfg.image_size)
    check_gpu_needs(cfg.decode, cfg.devices)


def check_cache_slots(echo: Any, batch_size: int) -> None:
    """Refuse a ``--shuffle-buffer`` whose cache would need more sample slots than the cache
    has: each is within its own bound, the slots they need together may not be. The pipeline's
    own sizing (:meth:`~echopipe.dali.EchoPipelineConfig.resolved`) says how many it needs."""
    from ..dali.config import EchoPipelineConfig

    try:
        EchoPipelineConfig(batch_size=batch_size, echo=replace(echo, factor=1.0)).resolved()
    except ValueError as exc:
        raise UsageError(
            f"--shuffle-buffer {echo.shuffle_buffer} with --batch-size {batch_size} does not fit "
            f"the echo cache: {exc}"
        ) from None


def check_model_split(model: str, balance: Any, stages: Any) -> None:
    """Refuse a ``--balance`` or ``--stages`` that does not fit ``model``'s blocks."""
    # The model's block count, from a build on the meta device (no memory, no init cost).
    import torch

    from ..models import build_model

    with torch.device("meta"):
        blocks = len(build_model(model, num_classes=2))
    if isinstance(balance, list) and sum(balance) != blocks:
        raise UsageError(
            f"--balance {','.join(map(str, balance))} covers "
            f"{sum(balance)} blocks; {model} has {blocks}"
        )
    if isinstance(stages, int) and stages > blocks:
        raise UsageError(f"--stages {stages}: {model} has only {blocks} blocks")


def check_model_input(model: str, image_size: int) -> None:
    """Refuse an ``--image-size`` that ``model``'s layers cannot take (lenet5's classifier is
    sized for 32x32), found by a forward pass on the meta device."""
    import torch

    from ..models import build_model

    with torch.device("meta"):
        net = build_model(model, num_classes=2).eval()  # eval: batch norm takes one image

        def fits(size: int) -> bool:
            try:
                net(torch.empty(1, 3, size, size))
            except RuntimeError:
                return False
            return True

        if fits(image_size):
            return
        # The first run of sizes that fit: a model with a fixed input takes one small range.
        sizes: list[int] = []
        for size in range(16, MAX_IMAGE_SIZE + 1):
            if fits(size):
                sizes.append(size)
            elif sizes:
                break
    takes = f"{sizes[0]} to {sizes[-1]}" if sizes else f"none of 16 to {MAX_IMAGE_SIZE}"
    raise UsageError(f"--image-size {image_size} does not fit --model {model}, which takes {takes}")


def check_gpu_needs(decode: str, devices: list[str] | None) -> None:
    """Refuse ``--decode mixed`` without a GPU to decode on."""
    import torch

    has_cuda = torch.cuda.is_available()
    wants_gpu = devices is not None and any(d.startswith("cuda") for d in devices)
    if decode == "mixed" and devices is not None and not wants_gpu:
        raise UsageError(
            f"--decode mixed decodes on a GPU, but --devices {','.join(devices)} has none"
        )
    if decode == "mixed" and not has_cuda:
        raise UsageError("--decode mixed decodes on a GPU, but torch sees no CUDA device")
