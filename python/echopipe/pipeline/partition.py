"""Splitting an ``nn.Sequential`` into pipeline stages and placing them on devices.

A stage is a contiguous run of the sequential's children. ``balance`` follows the torchgpipe
convention: ``balance[k]`` is the number of children in stage ``k``. :func:`partition_balance`
chooses a balance automatically by timing each child's forward and backward on a sample input
and minimising the slowest stage (the pipeline's throughput is set by its slowest stage), with
optional per-stage memory caps.
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

__all__ = [
    "LayerProfile",
    "check_stale_share",
    "parse_devices",
    "partition_balance",
    "profile_layers",
    "split_sequential",
    "stale_share",
    "stale_share_fits",
    "validate_balance",
]

DeviceLike = str | int | torch.device
StaleShareBy = Literal["params", "layers"]


def parse_devices(devices: Sequence[DeviceLike] | None, num_stages: int) -> list[torch.device]:
    """Turn user device specs into ``torch.device`` objects, one per stage.

    ``None`` places every stage on the CPU. A device that does not exist on this machine (an
    unknown type, or a CUDA index beyond ``torch.cuda.device_count()``) raises ``ValueError``
    naming it.
    """
    if devices is None:
        return [torch.device("cpu")] * num_stages
    if isinstance(devices, str | torch.device | int):
        raise TypeError(f"devices must be a list with one device per stage, got {devices!r}")
    parsed: list[torch.device] = []
    for spec in devices:
        try:
            device = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"unknown device {spec!r}: {exc}") from exc
        if device.type == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if device.index is None else device.index
            if index >= available:
                raise ValueError(
                    f"unknown device {spec!r}: this machine has {available} CUDA device(s)"
                )
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(
                f"unsupported device {spec!r}: pipeline stages run on 'cpu' or 'cuda[:i]'"
            )
        parsed.append(device)
    if len(parsed) != num_stages:
        raise ValueError(
            f"got {len(parsed)} device(s) {[str(d) for d in parsed]} for {num_stages} stage(s); "
            "give exactly one device per stage"
        )
    return parsed


def validate_balance(module: nn.Module, balance: Sequence[int]) -> list[int]:
    """Check that ``balance`` splits ``module`` (an ``nn.Sequential``) into non-empty stages."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"the pipeline needs an nn.Sequential (one child per block), got "
            f"{type(module).__name__}; wrap your layers in nn.Sequential"
        )
    if isinstance(balance, str | bytes) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a sequence of ints, got {balance!r}")
    values: list[int] = []
    for entry in balance:
        if isinstance(entry, bool) or not isinstance(entry, int):
            raise TypeError(f"balance entries must be ints, got {entry!r} in {list(balance)!r}")
        if entry < 1:
            raise ValueError(f"every stage needs at least one layer, got balance={list(balance)!r}")
        values.append(entry)
    if not values:
        raise ValueError("balance is empty: give at least one stage")
    if sum(values) != len(module):
        raise ValueError(
            f"balance {values!r} sums to {sum(values)} but the model has {len(module)} layers"
        )
    return values


def split_sequential(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``module`` into stages of ``balance[k]`` children each, sharing the child modules."""
    values = validate_balance(module, balance)
    children = list(module.children())
    if len(children) != len(module):  # pragma: no cover - nn.Sequential keeps them equal
        raise ValueError("the sequential's children and length disagree")
    stages: list[nn.Sequential] = []
    start = 0
    for count in values:
        stages.append(nn.Sequential(*children[start : start + count]))
        start += count
    return stages


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
    module: nn.Sequential, sample_input: torch.Tensor, device: DeviceLike = "cpu", repeats: int = 3
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
    was_training = module.training
    module.to(target).train()
    profiles: list[LayerProfile] = []
    try:
        x = sample_input.to(target)
        for layer in module:
            times: list[float] = []
            out = None
            for _ in range(repeats):
                inp = x.detach().requires_grad_(x.is_floating_point())
                _sync(target)
                start = time.perf_counter()
                out = layer(inp.clone() if inp.requires_grad else inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                _sync(target)
                times.append(time.perf_counter() - start)
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
        module.train(was_training)
    return profiles


def _min_max_partition(
    costs: Sequence[float],
    num_stages: int,
    stage_fits: Callable[[int, int, int], bool] | None = None,
) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the max sum.

    Dynamic programming over (layers used, stages used); ties keep the split found first, so
    the result is deterministic. ``stage_fits(stage, start, stop)``, when given, rules out
    stages whose layers ``start:stop`` do not fit the memory of the stage's device.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-stage cost of splitting the first i layers into s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                if stage_fits is not None and not stage_fits(s - 1, j, i):
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i] = value
                    cut[s][i] = j
    if best[num_stages][n] == inf:
        raise ValueError(f"no split of {n} layers into {num_stages} stages fits the memory caps")
    balance: list[int] = []
    i = n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


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
    """Choose a balance for ``num_stages`` stages by profiling each layer.

    Repeatable choices (see :mod:`echopipe.pipeline.cost_model`): ``cost="model"`` replaces
    the timings by a FLOPs-and-bytes estimate from the shapes (no timing at all, so the same
    model and sample give the same split under any load); ``cache=path`` stores the chosen
    balance in a JSON file under a key of the model structure, sample and options, and reuses
    it in later runs instead of timing again.

    Each child is timed (forward + backward, median of ``repeats``) on the first device of
    ``devices`` (CPU when ``None``); the split minimises the slowest stage's time. That split
    and the ones moving a single stage boundary by one layer are then timed stage by stage
    (best of ``repeats``), and the one with the fastest slowest stage wins. When
    ``memory_caps`` (bytes per stage) is given, a stage's parameters plus the activations it
    keeps in flight must fit: stage ``k`` of ``K`` holds up to ``2(K-1-k)+1`` outputs in flight
    under the stale-weight schedule. When ``max_stale_share`` is given, only splits whose
    stale stages (all but the last) hold at most that share of the trainable parameters
    (``stale_share_by="params"``) or of the layers with parameters (``"layers"``) are
    considered: staleness costs accuracy mostly when it reaches deep layers
    (``bench/staleness_remedies.py``), at the price of a less even split.

    Returns:
        ``balance``, a list of ``num_stages`` positive ints summing to ``len(module)``.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"partition_balance needs an nn.Sequential, got {type(module).__name__}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > len(module):
        raise ValueError(f"cannot split {len(module)} layers into {num_stages} non-empty stages")
    if memory_caps is not None and len(memory_caps) != num_stages:
        raise ValueError(f"memory_caps needs {num_stages} entries, got {list(memory_caps)!r}")
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
    if cost == "model":
        costs = estimate_layer_seconds(module, sample_input)
    else:
        profiles = profile_layers(module, sample_input, device, repeats=repeats)
        costs = [p.seconds for p in profiles]
    stage_fits: Callable[[int, int, int], bool] | None = None
    if memory_caps is not None:
        if cost == "model":  # only the bytes are used here, and those do not vary
            profiles = profile_layers(module, sample_input, device, repeats=1)
        caps = list(memory_caps)
        params = [p.param_bytes for p in profiles]
        activations = [p.activation_bytes for p in profiles]

        def fits(stage: int, start: int, stop: int) -> bool:
            in_flight = 2 * (num_stages - 1 - stage) + 1
            need = sum(params[start:stop]) + in_flight * sum(activations[start:stop])
            return need <= caps[stage]

        stage_fits = fits
    if max_stale_share is not None:
        stale_fits = stale_share_fits(module, num_stages, max_stale_share, stale_share_by)
        stage_fits = _both(stage_fits, stale_fits)
    balance = _min_max_partition(costs, num_stages, stage_fits)
    if cost == "time":
        balance = _refine_by_stage_time(
            module, sample_input, device, balance, stage_fits, max(repeats, 5)
        )
    if cache is not None:
        store_cached_balance(cache, key, balance)
    return balance


def _both(
    first: Callable[[int, int, int], bool] | None, second: Callable[[int, int, int], bool]
) -> Callable[[int, int, int], bool]:
    if first is None:
        return second
    return lambda stage, start, stop: first(stage, start, stop) and second(stage, start, stop)


def _neighbour_balances(
    balance: list[int], stage_fits: Callable[[int, int, int], bool] | None
) -> list[list[int]]:
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


def _refine_by_stage_time(
    module: nn.Sequential,
    sample_input: torch.Tensor,
    device: DeviceLike,
    balance: list[int],
    stage_fits: Callable[[int, int, int], bool] | None,
    repeats: int,
) -> list[int]:
    """Among ``balance`` and its one-layer neighbours, the split whose slowest stage is fastest.

    Per-layer times do not add up to a stage's time: a stage's first layer computes no input
    gradient on stage 0 only, small layers share caches, and allocator effects differ with the
    amount of memory a stage touches. Timing each candidate stage whole (forward, backward to
    its input, as the engine runs it; best of ``repeats`` after one warm-up) removes those
    errors where they decide between neighbouring splits.
    """
    candidates = _neighbour_balances(balance, stage_fits)
    if len(candidates) == 1:
        return balance
    (target,) = parse_devices([device], 1)
    original_device = next((p.device for p in module.parameters()), torch.device("cpu"))
    saved_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    was_training = module.training
    module.to(target).train()
    layers = list(module)
    stage_seconds: dict[tuple[int, int], float] = {}
    try:
        inputs = [sample_input.to(target)]
        with torch.no_grad():
            for layer in layers[:-1]:
                inputs.append(layer(inputs[-1]))

        def time_stage(start: int, stop: int) -> float:
            stage = nn.Sequential(*layers[start:stop])
            x = inputs[start]
            grad_in = start > 0 and x.is_floating_point()
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms up kernels and caches
                inp = x.detach().requires_grad_(grad_in)
                _sync(target)
                begin = time.perf_counter()
                out = stage(inp.clone() if grad_in else inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                _sync(target)
                best = min(best, time.perf_counter() - begin)
            stage.zero_grad(set_to_none=True)
            return best

        def slowest(candidate: list[int]) -> float:
            bounds = [sum(candidate[:k]) for k in range(len(candidate) + 1)]
            worst = 0.0
            for k in range(len(candidate)):
                key = (bounds[k], bounds[k + 1])
                if key not in stage_seconds:
                    stage_seconds[key] = time_stage(*key)
                worst = max(worst, stage_seconds[key])
            return worst

        return min(candidates, key=slowest)  # ties keep the per-layer optimum (listed first)
    finally:
        module.to(original_device)
        module.load_state_dict(saved_state)
        module.train(was_training)


# Accuracy-aware bound: how much of the model may run stale ------------------------------------


def _child_weights(module: nn.Sequential, by: StaleShareBy) -> list[int]:
    """Per child: its trainable parameter count (``"params"``) or 1 if it has any (``"layers"``)."""
    if by not in ("params", "layers"):
        raise ValueError(f"stale share is measured by 'params' or 'layers', got {by!r}")
    counts = [sum(p.numel() for p in c.parameters() if p.requires_grad) for c in module]
    return counts if by == "params" else [int(n > 0) for n in counts]


def stale_share(
    module: nn.Sequential, balance: Sequence[int], by: StaleShareBy = "params"
) -> float:
    """Share of ``module`` that trains with stale weights under ``balance``.

    Every stage but the last is stale when pipelined (``D_k = 2(K-1-k) > 0``), so this is the
    share of trainable parameters (``by="params"``) or of layers with trainable parameters
    (``by="layers"``) in the children before the last stage. 0 for one stage or a model
    without trainable parameters.
    """
    values = validate_balance(module, balance)
    weights = _child_weights(module, by)
    total = sum(weights)
    return sum(weights[: len(module) - values[-1]]) / total if total else 0.0


def stale_share_fits(
    module: nn.Sequential,
    num_stages: int,
    max_stale_share: float,
    by: StaleShareBy = "params",
) -> Callable[[int, int, int], bool]:
    """A ``stage_fits(stage, start, stop)`` rule keeping the stale share <= ``max_stale_share``.

    The stale share depends only on where the last stage starts, so the rule limits that
    start. Raises ``ValueError`` when no split into ``num_stages`` stages can meet the bound
    (the stale stages need at least one child each), naming the smallest share reachable.
    """
    if isinstance(max_stale_share, bool) or not isinstance(max_stale_share, int | float):
        raise TypeError(f"max_stale_share must be a number in [0, 1], got {max_stale_share!r}")
    if not 0.0 <= max_stale_share <= 1.0:
        raise ValueError(f"max_stale_share must be in [0, 1], got {max_stale_share!r}")
    weights = _child_weights(module, by)
    total = sum(weights)
    last_start = 0  # the largest index the last stage may start at
    running = 0
    for j in range(len(weights) + 1):
        if total == 0 or running <= max_stale_share * total * (1 + 1e-12):
            last_start = j
        if j < len(weights):
            running += weights[j]
    if last_start < num_stages - 1:
        smallest = sum(weights[: num_stages - 1]) / total if total else 0.0
        raise ValueError(
            f"max_stale_share={max_stale_share} cannot be met with {num_stages} stages: "
            f"the smallest stale share ({by}) is {smallest:.3f}, with one layer in each "
            "stale stage"
        )

    def fits(stage: int, start: int, stop: int) -> bool:
        return stage != num_stages - 1 or start <= last_start

    return fits


def check_stale_share(
    module: nn.Sequential,
    balance: Sequence[int],
    max_stale_share: float,
    by: StaleShareBy = "params",
) -> None:
    """Raise ``ValueError`` if ``balance`` runs more than ``max_stale_share`` of the model stale."""
    share = stale_share(module, balance, by)
    if share > max_stale_share * (1 + 1e-12):
        raise ValueError(
            f"balance {list(balance)!r} runs {share:.3f} of the model's {by} stale, above "
            f"max_stale_share={max_stale_share}"
        )
