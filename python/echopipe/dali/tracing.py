"""Tracing a pipeline function: :func:`echo`, :func:`current_stage` and the trace state.

``@echo_pipeline_def`` traces the user's function up to three times: once with DALI's own
``pipeline_def`` to learn whether this call builds an echo point at all (``"probe"``: ``echo``
passes its fields through and counts), then once per part of the :class:`EchoPipeline`
(``"upstream"``: ``echo`` becomes the echo sink; ``"downstream"``: it becomes the echo source).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import plugin


@dataclass
class Trace:
    """What one trace of a pipeline function found (filled in by :func:`echo`)."""

    stage: str  # "upstream" | "downstream" | "probe" (a plain DALI trace that counts echo() calls)
    cache_name: str
    calls: int = 0
    num_fields: int = 0
    devices: list[str] = field(default_factory=list)
    sink: Any = None
    info: Any = None
    source_device: str | None = None


_state = threading.local()


def current_stage() -> str | None:
    """Which part of an echoing pipeline is being traced in this thread.

    ``"upstream"`` or ``"downstream"`` while :class:`EchoPipeline` traces a pipeline function
    (it traces it once for each part), ``None`` otherwise, including the first trace by DALI's
    own ``pipeline_def`` that looks for the echo point. A pipeline function can use it to put
    operators into one part only, e.g. a ``fn.python_function`` (DALI never prunes those) that
    should run on the reader side::

        if edali.current_stage() != "downstream":
            jpegs = fn.python_function(jpegs, function=tap)
    """
    state: Trace | None = getattr(_state, "trace", None)
    return None if state is None or state.stage == "probe" else state.stage


def trace_counting_echo(build: Callable[[], Any]) -> tuple[Any, int]:
    """Runs ``build()`` (which traces a pipeline function into a plain DALI pipeline) with
    :func:`echo` passing its fields through; returns what ``build`` returned and how many times
    the function called :func:`echo`. A pipeline function that echoes only under a condition
    (``if is_training:``) builds a plain pipeline when the condition is false."""
    state, result = trace(Trace(stage="probe", cache_name=""), build)
    return result, state.calls


def trace(state: Trace, build: Callable[[], Any]) -> tuple[Trace, Any]:
    """Runs ``build()`` with ``state`` as this thread's trace; returns it and what ``build``
    returned."""
    _state.trace = state
    try:
        result = build()
    finally:
        _state.trace = None
    return state, result


def echo(*fields: Any, device: str | None = None) -> tuple[Any, ...]:
    """Marks the echo point inside an ``@echo_pipeline_def`` function.

    Args:
        *fields: 1 to 4 DALI data nodes that make up one sample (e.g. images, labels, metadata).
            Each may be CPU or GPU; they travel together and come back in the same order, with
            dtype, shape and layout preserved.
        device: where the fields come out downstream: ``"cpu"`` or ``"gpu"``. Default: ``"gpu"``
            if any input is on the GPU (after a ``"mixed"`` decoder), else ``"cpu"``.

    Returns:
        A tuple with one node per input field (call it as ``images, labels = echo(images,
        labels)``). In the upstream trace these are the inputs themselves; in the downstream trace
        they are the echo source's outputs.
    """
    state: Trace | None = getattr(_state, "trace", None)
    if state is None:
        raise RuntimeError(
            "echopipe.dali.echo() can only be called inside a function decorated with "
            "@echopipe.dali.echo_pipeline_def (while echopipe traces it)"
        )
    if not 1 <= len(fields) <= 4:
        raise ValueError(f"echo() takes 1 to 4 fields per sample, got {len(fields)}")
    if device not in (None, "cpu", "gpu"):
        raise ValueError(f"echo(device=...) must be 'cpu', 'gpu' or None, got {device!r}")
    if state.stage == "probe":
        state.calls += 1
        return tuple(fields)
    plugin.load()  # the operators below exist only once the plugin is loaded
    state.calls += 1
    if state.calls > 1:
        raise RuntimeError("echo() was called more than once; a pipeline has one echo point")
    from nvidia.dali import fn

    devices = [getattr(node, "device", "cpu") for node in fields]
    state.num_fields = len(fields)
    state.devices = devices
    upstream_gpu = any(d == "gpu" for d in devices)
    if state.stage == "upstream":
        state.sink = fn.echopipe_echo_sink(
            *fields, cache_name=state.cache_name, device="gpu" if upstream_gpu else "cpu"
        )
        return tuple(fields)
    source_device = device or ("gpu" if upstream_gpu else "cpu")
    state.source_device = source_device
    outputs = fn.echopipe_echo_source(
        cache_name=state.cache_name, num_fields=len(fields), device=source_device
    )
    state.info = outputs[-1]
    return tuple(outputs[:-1])
