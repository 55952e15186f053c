"""Repeatable inputs for ``balance="auto"``: a cost model, and a cache of chosen balances.

Timing layers on a loaded machine gives a different split from run to run. Two ways to make the
choice repeatable:

* ``cost="model"``: each layer's cost is estimated from the shapes alone, as FLOPs of its
  forward and backward (``torch.utils.flop_counter``) over a compute rate plus the bytes it
  reads and writes over a memory rate. The same model and sample batch always give the same
  split, on any machine and under any load.
* ``cache=path``: the first timed choice is stored in a JSON file under a key made of the
  layers' structure, the sample's shape and dtype, the device and the options; later runs of
  the same configuration read it back instead of timing again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .modes import restore_modes, set_modes

#: Rates of the cost model. Only their ratio matters for the split: it weighs a byte moved
#: against a FLOP (a CPU core or a GPU reaches roughly 10 FLOPs per byte of memory traffic).
FLOPS_PER_S = 1e11
BYTES_PER_S = 1e10


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count_traffic(total: list[int]) -> Any:
    """A forward hook adding a leaf module's input, output and parameter bytes to total[0]."""

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = [t for t in (*inputs, output) if isinstance(t, torch.Tensor)]
        tensors += list(module.parameters(recurse=False))
        total[0] += sum(_nbytes(t) for t in tensors)

    return hook


def estimate_layer_seconds(module: nn.Sequential, sample_input: torch.Tensor) -> list[float]:
    """Modelled forward + backward seconds of each child (deterministic, from shapes only).

    Runs each child once on ``sample_input`` under a FLOP counter (on the module's current
    device), restoring weights and normalisation statistics afterwards.
    """
    from torch.utils.flop_counter import FlopCounterMode

    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    modes = set_modes([module], training=True)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    seconds: list[float] = []
    try:
        x = sample_input.to(device)
        for layer in module:
            inp = x.detach().requires_grad_(x.is_floating_point())
            traffic = [0]
            hooks = [
                leaf.register_forward_hook(_count_traffic(traffic))
                for leaf in layer.modules()
                if next(leaf.children(), None) is None
            ]
            try:
                with FlopCounterMode(display=False) as counter:
                    out = layer(inp.clone() if inp.requires_grad else inp)
                    if out.requires_grad:
                        out.backward(torch.ones_like(out))
            finally:
                for hook in hooks:
                    hook.remove()
            layer.zero_grad(set_to_none=True)
            # Forward reads inputs and weights and writes outputs; backward reads them again and
            # writes gradients of each: about three times the traffic of the forward.
            seconds.append(counter.get_total_flops() / FLOPS_PER_S + 3 * traffic[0] / BYTES_PER_S)
            x = out.detach()
    finally:
        module.load_state_dict(saved)
        restore_modes(modes)
    return seconds


def balance_key(module: nn.Sequential, sample_input: torch.Tensor, **options: Any) -> str:
    """A key for the balance of this model structure, sample batch and option set."""
    layers = [repr(layer) for layer in module]
    shapes = [
        [list(p.shape), str(p.dtype)] for layer in module for p in layer.state_dict().values()
    ]
    blob = json.dumps(
        {
            "layers": layers,
            "shapes": shapes,
            "sample": [list(sample_input.shape), str(sample_input.dtype)],
            "options": {k: repr(v) for k, v in sorted(options.items())},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load_cached_balance(path: str | os.PathLike[str], key: str) -> list[int] | None:
    """The balance stored under ``key`` in the JSON cache at ``path``, or None."""
    file = Path(path)
    if not file.is_file():
        return None
    try:
        entries = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"balance cache {str(file)!r} is not a JSON object: {exc}") from exc
    value = entries.get(key) if isinstance(entries, dict) else None
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"balance cache {str(file)!r} holds {value!r} under {key}, not a balance")
    return [int(v) for v in value]


def store_cached_balance(path: str | os.PathLike[str], key: str, balance: list[int]) -> None:
    """Adds ``key -> balance`` to the JSON cache at ``path`` (written atomically)."""
    file = Path(path)
    entries: dict[str, Any] = {}
    if file.is_file():
        try:
            loaded = json.loads(file.read_text())
            entries = loaded if isinstance(loaded, dict) else {}
        except (OSError, json.JSONDecodeError):
            entries = {}
    entries[key] = [int(v) for v in balance]
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, file)
