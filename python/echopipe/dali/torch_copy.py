"""DALI outputs as PyTorch tensors, for :class:`~echopipe.dali.EchoIterator`.

Tensors: CPU outputs are copied once out of DALI's buffer into numpy memory that torch then
shares (``np.array`` + ``torch.from_numpy``). A zero-copy DLPack view would not be safe: DALI
reuses its output buffers for later iterations (the downstream pipeline is scheduled again as soon
as a batch is taken), so a view would change under the consumer. GPU outputs stay on their GPU:
they are copied into a new torch tensor on the current torch stream with DALI's
``feed_ndarray``, which orders the copy after the work that produced the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_torch(value: Any) -> torch.Tensor | list[torch.Tensor]:
    """A DALI TensorList (or numpy arrays restored from a checkpoint) as torch tensor(s).

    Dense CPU lists become one CPU tensor through a single host copy; dense GPU lists become
    a tensor on the same GPU (copied on torch's current stream there). Non-dense lists become
    one tensor per sample (GPU samples via the host). The result never aliases DALI's buffers.
    """
    from nvidia.dali.backend import TensorListGPU

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, list):
        return [torch.from_numpy(np.asarray(v)) for v in value]
    if isinstance(value, TensorListGPU):
        if value.is_dense_tensor():
            return _gpu_to_torch(value)
        value = value.as_cpu()
    if value.is_dense_tensor():
        return torch.from_numpy(np.array(value.as_tensor()))
    return [torch.from_numpy(np.array(value.at(i))) for i in range(len(value))]


def _gpu_to_torch(value: Any) -> torch.Tensor:
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    tensor = value.as_tensor()
    device = torch.device("cuda", value.device_id())
    out = torch.empty(tensor.shape(), dtype=to_torch_type[tensor.dtype], device=device)
    stream = torch.cuda.current_stream(device)
    # feed_ndarray makes the copy wait for DALI's producing work, and torch's later use of
    # ``out`` is ordered after it because both run on ``stream``.
    feed_ndarray(tensor, out, cuda_stream=stream)
    return out


def arrays_as_tensors(tree: Any) -> Any:
    """``tree`` (nested dicts, lists and tuples) with each numpy array as a CPU tensor sharing
    its memory, so that ``torch.load(weights_only=True)`` (Lightning's default on torch >= 2.6)
    reads a saved state; :func:`tensors_as_arrays` reverses it."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree))
    if isinstance(tree, dict):
        return {k: arrays_as_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(arrays_as_tensors(v) for v in tree)
    return tree


def tensors_as_arrays(tree: Any) -> Any:
    """The inverse of :func:`arrays_as_tensors` (a tree without tensors comes back equal)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, dict):
        return {k: tensors_as_arrays(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(tensors_as_arrays(v) for v in tree)
    return tree
