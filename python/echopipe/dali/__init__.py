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

Ready-made ImageNet-layout pipelines: :func:`imagenet_train_pipeline` (echoing),
:func:`imagenet_plain_train_pipeline` and :func:`imagenet_val_pipeline` (plain DALI), and the pure
Python echo peer :func:`python_echo_train_pipeline` used as a baseline.

echopipe's DALI plugin (``libechopipe_dali.so``, which adds ``fn.echopipe_echo_sink`` and
``fn.echopipe_echo_source``) is loaded at the first use of the echo operators (creating an
:class:`EchoPipeline` or calling :func:`echo`), not at import, so the plain and validation
pipelines work without it. Before loading, the plugin's recorded DALI version is checked against
the installed DALI; a mismatch raises :class:`DaliVersionMismatchError` naming both versions.
"""

from __future__ import annotations

from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from . import plugin
from .builders import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImagenetEchoPipeline,
    UpstreamTap,
    explain_decode_failure,
    imagenet_decode_pipeline,
    imagenet_plain_train_pipeline,
    imagenet_train_pipeline,
    imagenet_val_pipeline,
    index_imagenet_split,
    resolve_split_dir,
)
from .checkpointing import CheckpointShardError, DaliCheckpointNeededError
from .config import EchoPipelineConfig
from .dali_api import CountedSizeWarning, UntrimmedPaddingWarning
from .definition import echo_pipeline_def
from .epochs import EpochSizeChangedError
from .iterator import EchoIterator
from .iterator_stats import EchoIteratorStats
from .iterator_warnings import EchoedEvaluationWarning, EpochContinuedWarning
from .peer import PythonEchoPipeline, python_echo_train_pipeline
from .peer_buffer import PythonEchoBuffer
from .pipeline import EchoPipeline, PipelineNotSerializableError
from .plugin import (
    DaliPluginMissingError,
    DaliVersionMismatchError,
    check_dali_version,
    gpu_backend_compiled,
    plugin_path,
)
from .specs import AugmentSpec, EchoSpec, ReaderSpec
from .torch_copy import to_torch
from .tracing import current_stage, echo
from .upstream_flight import EmptyUpstreamEpochError


def load_plugin() -> None:
    """Checks the plugin's DALI version and loads it now (idempotent).

    Creating an :class:`EchoPipeline` does this already; call it to fail early.

    Raises:
        DaliVersionMismatchError: the plugin was built for another DALI (names both versions).
        DaliPluginMissingError: the plugin was not built or cannot be found.
    """
    plugin.load()


def built_dali_version() -> str:
    """The DALI version the loaded plugin was compiled against."""
    return plugin.load().echopipe_dali_built_version().decode()


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AugmentSpec",
    "CheckpointShardError",
    "CountedSizeWarning",
    "DaliCheckpointNeededError",
    "DaliPluginMissingError",
    "DaliVersionMismatchError",
    "EchoIterator",
    "EchoIteratorStats",
    "EchoPipeline",
    "EchoPipelineConfig",
    "EchoSpec",
    "EchoedEvaluationWarning",
    "EmptyUpstreamEpochError",
    "EpochContinuedWarning",
    "EpochSizeChangedError",
    "ImagenetEchoPipeline",
    "LastBatchPolicy",
    "PipelineNotSerializableError",
    "PythonEchoBuffer",
    "PythonEchoPipeline",
    "ReaderSpec",
    "UntrimmedPaddingWarning",
    "UpstreamTap",
    "built_dali_version",
    "check_dali_version",
    "current_stage",
    "echo",
    "echo_pipeline_def",
    "explain_decode_failure",
    "gpu_backend_compiled",
    "imagenet_decode_pipeline",
    "imagenet_plain_train_pipeline",
    "imagenet_train_pipeline",
    "imagenet_val_pipeline",
    "index_imagenet_split",
    "load_plugin",
    "plugin_path",
    "python_echo_train_pipeline",
    "resolve_split_dir",
    "to_torch",
]
