"""Splitting an ``nn.Sequential`` into pipeline stages: devices, balances and their limits.

A stage is a contiguous run of the sequential's children. ``balance`` follows the torchgpipe
convention: ``balance[k]`` is the number of children in stage ``k``. This module checks and
applies a balance, finds the contiguous split of given per-layer costs that minimises the
slowest stage (:func:`min_max_partition`), and bounds how much of the model may run stale.
Where the costs come from (timing, a cost model) is in ``balance.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "DeviceLike",
    "StageFits",
    "check_no_shared_parameters",
    "check_share_bound",
    "check_stale_share",
    "min_max_partition",
    "parse_devices",
    "split_sequential",
    "stale_share",
    "stale_share_fits",
    "tied_fits",
    "validate_balance",
]

DeviceLike = str | int | torch.device
StaleShareBy = Literal["params", "layers"]
StageFits = Callable[[int, int, int], bool]
"""``stage_fits(stage, start, stop)``: whether layers ``start:stop`` may form stage ``stage``."""


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
    # By position: children() yields a module placed twice only once, len(module) counts both.
    children = list(module)
    check_no_shared_parameters(children, values)
    stages: list[nn.Sequential] = []
    start = 0
    for count in values:
        stages.append(nn.Sequential(*children[start : start + count]))
        start += count
    return stages


def check_no_shared_parameters(children: Sequence[nn.Module], balance: Sequence[int]) -> None:
    """Raise ``ValueError`` naming a trainable parameter that two stages of ``balance`` share.

    Each stage updates its own parameters with its own optimizer, at its own staleness, in
    its own thread (or rank): a weight tied across stages (an embedding and the output layer,
    a block placed twice) would be stepped by two optimizers on partial gradients, or would
    become two separate copies on two ranks. Within one stage a tied weight is fine.
    """
    owner: dict[int, tuple[int, str]] = {}
    stage_of = [k for k, count in enumerate(balance) for _ in range(count)]
    for i, child in enumerate(children):
        k = stage_of[i]
        for name, p in child.named_parameters(prefix=str(i), remove_duplicate=False):
            first = owner.setdefault(id(p), (k, name))
            if first[0] != k and p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} (stage {k}) is the same tensor as {first[1]!r} "
                    f"(stage {first[0]}): each stage updates its own parameters, so a weight "
                    "tied across stages is not supported; put the layers that share it in "
                    f"one stage (balance={list(balance)!r})"
                )


def tied_fits(module: nn.Sequential, num_stages: int) -> StageFits | None:
    """A ``stage_fits(stage, start, stop)`` rule keeping the children that share a trainable
    parameter in one stage (``None`` when none do), for the automatic balances: a split across
    a tie is refused by :func:`split_sequential`. ``ValueError`` when the ties leave fewer
    places to cut than ``num_stages`` needs."""
    first: dict[int, int] = {}
    spans: list[tuple[int, int]] = []  # children i..j share a weight
    for i, child in enumerate(module):
        for p in child.parameters():
            if p.requires_grad and first.setdefault(id(p), i) != i:
                spans.append((first[id(p)], i))
    if not spans:
        return None
    # A cut after child c (between c and c+1) is allowed unless a tie spans it.
    blocked = {c for i, j in spans for c in range(i, j)}
    if len(module) - 1 - len(blocked) < num_stages - 1:
        i, j = max(spans, key=lambda span: span[1] - span[0])
        raise ValueError(
            f"children {i} and {j} share a parameter and must stay in one stage, which leaves "
            f"too few places to cut {len(module)} children into {num_stages} stages"
        )

    def fits(stage: int, start: int, stop: int) -> bool:
        return (start == 0 or start - 1 not in blocked) and (
            stop == len(module) or stop - 1 not in blocked
        )

    return fits


def min_max_partition(
    costs: Sequence[float],
    num_stages: int,
    stage_fits: StageFits | None = None,
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
) -> StageFits:
    """A ``stage_fits(stage, start, stop)`` rule keeping the stale share <= ``max_stale_share``.

    The stale share depends only on where the last stage starts, so the rule limits that
    start. Raises ``ValueError`` when no split into ``num_stages`` stages can meet the bound
    (the stale stages need at least one child each), naming the smallest share reachable.
    """
    check_share_bound(max_stale_share)
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


def check_share_bound(max_stale_share: Any) -> None:
    """``max_stale_share`` is a number in [0, 1] (TypeError, ValueError naming it)."""
    if isinstance(max_stale_share, bool) or not isinstance(max_stale_share, int | float):
        raise TypeError(f"max_stale_share must be a number in [0, 1], got {max_stale_share!r}")
    if not 0.0 <= max_stale_share <= 1.0:
        raise ValueError(f"max_stale_share must be in [0, 1], got {max_stale_share!r}")


def check_stale_share(
    module: nn.Sequential,
    balance: Sequence[int],
    max_stale_share: float,
    by: StaleShareBy = "params",
) -> None:
    """Raise ``ValueError`` if ``balance`` runs more than ``max_stale_share`` of the model stale."""
    check_share_bound(max_stale_share)
    share = stale_share(module, balance, by)
    if share > max_stale_share * (1 + 1e-12):
        raise ValueError(
            f"balance {list(balance)!r} runs {share:.3f} of the model's {by} stale, above "
            f"max_stale_share={max_stale_share}"
        )
