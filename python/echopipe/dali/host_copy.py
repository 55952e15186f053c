"""Host copies of DALI TensorLists (CPU or GPU) as numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def host_dense(tensor_list: Any) -> np.ndarray:
    """Host copy of a dense DALI TensorList, CPU or GPU (a GPU one has no array interface)."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.array(tensor_list.as_tensor())


def to_numpy(tensor_list: Any) -> np.ndarray | list[np.ndarray]:
    """Host copy of a DALI TensorList: one array when dense, else a list of samples."""
    if tensor_list.is_dense_tensor():
        return host_dense(tensor_list)
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return [np.array(tensor_list.at(i)) for i in range(len(tensor_list))]
