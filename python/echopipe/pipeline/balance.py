"""Choosing a balance: functions that return a list of ints for ``StalePipeline(balance=...)``.

The engines only take a balance; where it comes from is decided here, as torchgpipe's
``balance_by_time`` does it:

* :func:`balance_by_time` times each child's forward and backward on a sample input,
  minimises the slowest stage, then times whole candidate stages to settle close calls.
* :func:`balance_by_cost` estimates each child from FLOPs and bytes
  (:mod:`echopipe.pipeline.cost_model`): no timing, so the same model and sample give the same
  split under any load.
* :func:`partition_balance` is what ``balance="auto"`` calls: either of the two under a
  memory cap and a stale-share bound, with an optional cache of the choice.

Timings come from ``clock`` (``time.perf_counter`` unless given), so a test can inject the
seconds each layer takes and check the decision without measuring a loaded machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .cost_model import (
    balance_key,
    estimate_layer_seconds,
    load_cached_balance,
    store_cached_balance,
)
from .modes import restore_modes, set_modes
from .partition import (
    DeviceLike,
    StageFits,
    StaleShareBy,
    min_max_partition,
    parse_devices,
    stale_share_fits,
    tied_fits,
    validate_balance,
)

__all__ = [
    "Clock",
    "LayerProfile",
    "balance_by_cost",
    "balance_by_time",
    "partition_balance",
    "profile_layers",
]

Clock = Callable[[], float]
"""Seconds from an arbitrary origin, as ``time.perf_counter`` returns them."""


@dataclass(frozen=True)
class LayerProfile:
    """Measured cost of one child of the sequential.

    Attributes:
        seconds: median forward + backward wall time.
        param_bytes: bytes of parameters and buffers.
        activation_bytes: bytes of the child's output for the sample batch (a stage keeps one
            such output per in-flight minibatch).
    """

    seconds: float
    param_bytes: int
    activation_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    device: DeviceLike = "cpu",
    repeats: int = 3,
    *,
    clock: Clock = time.perf_counter,
) -> list[LayerProfile]:
    """Time each child's forward and backward on ``sample_input`` (a representative batch).

    The module is moved to ``device`` for the measurement and moved back afterwards. Running
    statistics of normalisation layers are saved and restored so profiling leaves no trace.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"profile_layers needs an nn.Sequential, got {type(module).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    (target,) = parse_devices([device], 1)
    original_device = next((p.device for p in module.parameters()), torch.device("cpu"))
    saved_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    modes = set_modes([module], training=True)  # restored one by one: a frozen BN stays so
    module.to(target)
    profiles: list[LayerProfile] = []
    try:
        x = sample_input.to(target)
        for layer in module:
            times: list[float] = []
            out = None
            for _ in range(repeats):
                inp = x.detach().requires_grad_(x.is_floating_point())
                _sync(target)
                start = clock()
                out = layer(inp.clone() if inp.requires_grad else inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                _sync(target)
                times.append(clock() - start)
            layer.zero_grad(set_to_none=True)
            assert out is not None
            times.sort()
            param_bytes = sum(
                t.numel() * t.element_size()
                for t in list(layer.parameters()) + list(layer.buffers())
            )
            profiles.append(
                LayerProfile(
                    seconds=times[len(times) // 2],
                    param_bytes=param_bytes,
                    activation_bytes=out.numel() * out.element_size(),
                )
            )
            x = out.detach()
    finally:
        module.to(original_device)
        module.load_state_dict(saved_state)
        restore_modes(modes)
    return profiles


def _check_request(
    module: nn.Sequential, num_stages: int, memory_caps: Sequence[int] | None, name: str
) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"{name} needs an nn.Sequential, got {type(module).__name__}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > len(module):
        raise ValueError(f"cannot split {len(module)} layers into {num_stages} non-empty stages")
    if memory_caps is not None and len(memory_caps) != num_stages:
        raise ValueError(f"memory_caps needs {num_stages} entries, got {list(memory_caps)!r}")


def _both(first: StageFits | None, second: StageFits | None) -> StageFits | None:
    if first is None:
        return second
    if second is None:
        return first
    return lambda stage, start, stop: first(stage, start, stop) and second(stage, start, stop)


def _memory_fits(
    profiles: Sequence[LayerProfile], memory_caps: Sequence[int], num_stages: int
) -> StageFits:
    """A stage's parameters plus the outputs it keeps in flight (``2(K-1-k)+1`` of them under
    the stale-weight schedule) must fit its cap."""
    caps = list(memory_caps)
    params = [p.param_bytes for p in profiles]
    activations = [p.activation_bytes for p in profiles]

    def fits(stage: int, start: int, stop: int) -> bool:
        in_flight = 2 * (num_stages - 1 - stage) + 1
        need = sum(params[start:stop]) + in_flight * sum(activations[start:stop])
        return need <= caps[stage]

    return fits


def balance_by_time(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    num_stages: int,
    *,
    device: DeviceLike = "cpu",
    repeats: int = 3,
    memory_caps: Sequence[int] | None = None,
    stage_fits: StageFits | None = None,
    clock: Clock = time.perf_counter,
) -> list[int]:
    """A balance for ``num_stages`` stages from the time each child takes on ``device``.

    Each child is timed (forward + backward, median of ``repeats``) and the split minimising
    the slowest stage's time is found. That split and the ones moving a single stage boundary
    by one layer are then timed stage by stage (best of ``max(repeats, 5)``), and the one with
    the fastest slowest stage wins. ``memory_caps`` (bytes per stage) and ``stage_fits`` rule
    out stages that do not fit. ``clock`` reads the seconds.

    Returns:
        ``balance``, a list of ``num_stages`` positive ints summing to ``len(module)``.
    """
    _check_request(module, num_stages, memory_caps, "balance_by_time")
    stage_fits = _both(tied_fits(module, num_stages), stage_fits)
    profiles = profile_layers(module, sample_input, device, repeats=repeats, clock=clock)
    if memory_caps is not None:
        stage_fits = _both(_memory_fits(profiles, memory_caps, num_stages), stage_fits)
    balance = min_max_partition([p.seconds for p in profiles], num_stages, stage_fits)
    return _refine_by_stage_time(
        module, sample_input, device, balance, stage_fits, max(repeats, 5), clock
    )


def balance_by_cost(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    num_stages: int,
    *,
    device: DeviceLike = "cpu",
    memory_caps: Sequence[int] | None = None,
    stage_fits: StageFits | None = None,
) -> list[int]:
    """A balance from the cost model: each child's FLOPs and bytes, no timing.

    The estimate runs on the module's current device; ``device`` is where ``memory_caps``
    (bytes per stage) are measured, as for :func:`balance_by_time`.
    """
    _check_request(module, num_stages, memory_caps, "balance_by_cost")
    stage_fits = _both(tied_fits(module, num_stages), stage_fits)
    costs = estimate_layer_seconds(module, sample_input)
    if memory_caps is not None:  # only the bytes are used here, and those do not vary
        profiles = profile_layers(module, sample_input, device, repeats=1)
        stage_fits = _both(_memory_fits(profiles, memory_caps, num_stages), stage_fits)
    return min_max_partition(costs, num_stages, stage_fits)


def partition_balance(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    num_stages: int,
    devices: Sequence[DeviceLike] | None = None,
    *,
    memory_caps: Sequence[int] | None = None,
    repeats: int = 3,
    max_stale_share: float | None = None,
    stale_share_by: StaleShareBy = "params",
    cost: Literal["time", "model"] = "time",
    cache: str | os.PathLike[str] | None = None,
) -> list[int]:
    """Choose a balance for ``num_stages`` stages: what ``balance="auto"`` calls.

    ``cost="time"`` is :func:`balance_by_time` on the first device of ``devices`` (CPU when
    ``None``); ``cost="model"`` is :func:`balance_by_cost`. ``cache=path`` stores the chosen
    balance in a JSON file under a key of the model structure, sample and options, and reuses
    it in later runs instead of choosing again (see :mod:`echopipe.pipeline.cost_model`).
    When ``memory_caps`` (bytes per stage) is given, a stage's parameters plus the activations
    it keeps in flight must fit. When ``max_stale_share`` is given, only splits whose stale
    stages (all but the last) hold at most that share of the trainable parameters
    (``stale_share_by="params"``) or of the layers with parameters (``"layers"``) are
    considered: staleness costs accuracy mostly when it reaches deep layers
    (``bench/staleness_remedies.py``), at the price of a less even split.

    Returns:
        ``balance``, a list of ``num_stages`` positive ints summing to ``len(module)``.
    """
    _check_request(module, num_stages, memory_caps, "partition_balance")
    if cost not in ("time", "model"):
        raise ValueError(f"cost must be 'time' or 'model', got {cost!r}")
    device = parse_devices(devices, num_stages)[0] if devices is not None else "cpu"
    key = ""
    if cache is not None:
        key = balance_key(
            module, sample_input, num_stages=num_stages, device=str(device), cost=cost,
            memory_caps=memory_caps, max_stale_share=max_stale_share, by=stale_share_by,
        )  # fmt: skip
        cached = load_cached_balance(cache, key)
        if cached is not None:
            return validate_balance(module, cached)
    stale_fits = None
    if max_stale_share is not None:
        stale_fits = stale_share_fits(module, num_stages, max_stale_share, stale_share_by)
    if cost == "model":
        balance = balance_by_cost(
            module, sample_input, num_stages, device=device, memory_caps=memory_caps,
            stage_fits=stale_fits,
        )  # fmt: skip
    else:
        balance = balance_by_time(
            module, sample_input, num_stages, device=device, repeats=repeats,
            memory_caps=memory_caps, stage_fits=stale_fits,
        )  # fmt: skip
    if cache is not None:
        store_cached_balance(cache, key, balance)
    return balance


def _neighbour_balances(balance: list[int], stage_fits: StageFits | None) -> list[list[int]]:
    """``balance`` and every split that moves one stage boundary by one layer."""
    found = [balance]
    for cut in range(len(balance) - 1):
        for shift in (-1, 1):
            candidate = list(balance)
            candidate[cut] += shift
            candidate[cut + 1] -= shift
            if min(candidate) < 1 or candidate in found:
                continue
            bounds = [sum(candidate[:k]) for k in range(len(candidate) + 1)]
            if stage_fits is not None and not all(
                stage_fits(k, bounds[k], bounds[k + 1]) for k in range(len(candidate))
            ):
                continue
            found.append(candidate)
    return found


def _stage_seconds(
    layers: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    target: torch.device,
    start: int,
    stop: int,
    repeats: int,
    clock: Clock,
) -> float:
    """Best-of-``repeats`` seconds of layers ``start:stop`` as one stage (forward, backward to
    its input, as the engine runs it), after one warm-up run."""
    stage = nn.Sequential(*layers[start:stop])
    x = inputs[start]
    grad_in = start > 0 and x.is_floating_point()
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up kernels and caches
        inp = x.detach().requires_grad_(grad_in)
        _sync(target)
        begin = clock()
        out = stage(inp.clone() if grad_in else inp)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _sync(target)
        best = min(best, clock() - begin)
    stage.zero_grad(set_to_none=True)
    return best


def _refine_by_stage_time(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    device: DeviceLike,
    balance: list[int],
    stage_fits: StageFits | None,
    repeats: int,
    clock: Clock,
) -> list[int]:
    """Among ``balance`` and its one-layer neighbours, the split whose slowest stage is fastest.

    Per-layer times do not add up to a stage's time: a stage's first layer computes no input
    gradient on stage 0 only, small layers share caches, and allocator effects differ with the
    amount of memory a stage touches. Timing each candidate stage whole removes those errors
    where they decide between neighbouring splits.
    """
    candidates = _neighbour_balances(balance, stage_fits)
    if len(candidates) == 1:
        return balance
    (target,) = parse_devices([device], 1)
    original_device = next((p.device for p in module.parameters()), torch.device("cpu"))
    saved_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    modes = set_modes([module], training=True)
    module.to(target)
    layers = list(module)
    stage_seconds: dict[tuple[int, int], float] = {}
    try:
        inputs = [sample_input.to(target)]
        with torch.no_grad():
            for layer in layers[:-1]:
                inputs.append(layer(inputs[-1]))

        def slowest(candidate: list[int]) -> float:
            bounds = [sum(candidate[:k]) for k in range(len(candidate) + 1)]
            worst = 0.0
            for k in range(len(candidate)):
                key = (bounds[k], bounds[k + 1])
                if key not in stage_seconds:
                    stage_seconds[key] = _stage_seconds(
                        layers, inputs, target, *key, repeats, clock
                    )
                worst = max(worst, stage_seconds[key])
            return worst

        return min(candidates, key=slowest)  # ties keep the per-layer optimum (listed first)
    finally:
        module.to(original_device)
        module.load_state_dict(saved_state)
        restore_modes(modes)
