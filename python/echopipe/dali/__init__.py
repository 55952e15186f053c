"""Data echoing inside NVIDIA DALI pipelines.

Write the pipeline once, in DALI's ``@pipeline_def`` style, and mark where samples are echoed::

    from nvidia.dali import fn
    import echopipe.dali as edali

    @edali.echo_pipeline_def(batch_size=64, num_threads=2, device_id=None, echo_factor=2.0)
    def train_pipe(data_dir):
        jpegs, labels = fn.readers.file(file_root=data_dir, random_shuffle=True, name="Reader")
        images = fn.decoders.image(jpegs, device="cpu")
        images, labels = edali.echo(images, labels)  # echo after decode
        images = fn.random_resized_crop(images, size=64)
        return images, labels

    with edali.EchoIterator(train_pipe("/data/train"), ["data", "label"]) as it:
        for batch in it:
            ...  # batch[0]["data"], batch[0]["label"]: torch tensors

Importing this module loads echopipe's DALI plugin (``libechopipe_dali.so``) after checking that
it was compiled for the installed DALI; a mismatch raises :class:`DaliVersionMismatchError` naming
both versions. The plugin adds ``fn.echopipe_echo_sink`` and ``fn.echopipe_echo_source``.
"""

from __future__ import annotations

from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from . import _plugin
from ._plugin import (
    DaliPluginMissingError,
    DaliVersionMismatchError,
    check_dali_version,
    gpu_backend_compiled,
    plugin_path,
)
from .iterator import EchoIterator
from .pipeline import EchoConfig, EchoPipeline, echo, echo_pipeline_def

_plugin.load()


def built_dali_version() -> str:
    """The DALI version the loaded plugin was compiled against."""
    return _plugin.load().echopipe_dali_built_version().decode()


__all__ = [
    "DaliPluginMissingError",
    "DaliVersionMismatchError",
    "EchoConfig",
    "EchoIterator",
    "EchoPipeline",
    "LastBatchPolicy",
    "built_dali_version",
    "check_dali_version",
    "echo",
    "echo_pipeline_def",
    "gpu_backend_compiled",
    "plugin_path",
]
