"""Where an echoing pipeline's cache arena lives: ``memory="auto"`` decided from the input.

The echo cache stores what reaches the echo point. Samples decoded on the GPU (``"mixed"``) are
best echoed from GPU memory: the sink then copies device to device, and the GPU echo source fills
each batch with one device-to-device gather. That needs the whole arena on the device, so
``"auto"`` takes the device only while the arena is at most :data:`DEVICE_SHARE` of the free
device memory (the rest is left to the model and DALI). Otherwise the arena is pinned, GPU-mapped
host memory when a GPU exists (the GPU source's gather reads it over the bus, and a CPU source
reads it as ordinary memory), and pageable host memory without one.

:func:`choose_memory` is the decision as a pure function; :func:`resolve_memory` feeds it the
machine's facts.
"""

from __future__ import annotations

from typing import Literal

#: Values ``memory=`` accepts.
MEMORY_KINDS = ("auto", "pageable", "pinned", "device")
#: ``"auto"`` puts the arena on the device only if it takes at most this share of the free
#: device memory when the cache is made.
DEVICE_SHARE = 0.5

Memory = Literal["pageable", "pinned", "device"]


def check_memory(memory: object) -> str:
    """``memory`` if it is one of :data:`MEMORY_KINDS`; ValueError naming it otherwise."""
    if memory not in MEMORY_KINDS:
        kinds = ", ".join(map(repr, MEMORY_KINDS))
        raise ValueError(f"memory must be one of {kinds}, got {memory!r}")
    return str(memory)


def choose_memory(
    memory: str,
    *,
    input_device: str,
    gpu_count: int,
    arena_bytes: int,
    device_free_bytes: int | None,
) -> Memory:
    """The arena for an echo point whose input lives on ``input_device`` (``"cpu"``/``"gpu"``).

    Args:
        memory: ``"auto"``, or an explicit kind (returned as is once checked).
        input_device: where the sink's input is: ``"gpu"`` after a ``"mixed"`` decoder.
        gpu_count: CUDA devices visible to echopipe's core (0 without CUDA).
        arena_bytes: the cache's ``cache_bytes``.
        device_free_bytes: free memory of the pipeline's device, ``None`` when unknown.

    Raises:
        ValueError: an unknown ``memory``; ``"device"`` or ``"pinned"`` without a GPU;
            ``"device"`` for an input on the CPU (the CPU sink cannot write GPU memory).
    """
    check_memory(memory)
    if input_device not in ("cpu", "gpu"):
        raise ValueError(f"input_device must be 'cpu' or 'gpu', got {input_device!r}")
    if memory in ("device", "pinned") and gpu_count < 1:
        raise ValueError(f"memory={memory!r} needs a CUDA device, but echopipe sees none")
    if memory == "device" and input_device != "gpu":
        raise ValueError(
            "memory='device' keeps the echo cache in GPU memory, but the echo input is on the "
            "CPU; decode with device='mixed' or use memory='pinned'"
        )
    if memory != "auto":
        return memory  # type: ignore[return-value]
    if gpu_count < 1:
        return "pageable"
    if (
        input_device == "gpu"
        and device_free_bytes is not None
        and arena_bytes <= DEVICE_SHARE * device_free_bytes
    ):
        return "device"
    return "pinned"


def gpu_count() -> int:
    """CUDA devices echopipe's core sees (0 when it was built without CUDA)."""
    from ..native import core

    return int(core.cuda_device_count()) if bool(core.built_with_cuda()) else 0


def device_free_bytes(device_id: int | None) -> int | None:
    """Free memory of CUDA device ``device_id`` (torch's query), ``None`` when unknown."""
    if device_id is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device_id)
        return int(free)
    except (ImportError, RuntimeError):
        return None


def resolve_memory(
    memory: str, *, input_device: str, arena_bytes: int, device_id: int | None
) -> Memory:
    """:func:`choose_memory` with this machine's GPU count and free device memory."""
    if check_memory(memory) == "pageable":
        return "pageable"  # without asking CUDA anything
    count = gpu_count()
    free = device_free_bytes(device_id) if memory == "auto" and input_device == "gpu" else None
    return choose_memory(
        memory,
        input_device=input_device,
        gpu_count=count,
        arena_bytes=arena_bytes,
        device_free_bytes=free,
    )
