"""Plain DALI pipelines that name the file behind a decoder failure.

DALI reports an undecodable JPEG as ``nvImageCodec failure`` without a path. The plain training,
decode-only and validation builders record the source paths of the last few batches in an
:class:`~echopipe.dali.builders.UpstreamTap`; this ``Pipeline`` subclass turns a decoder failure
raised by ``run``, ``outputs``, ``share_outputs`` or ``schedule_run`` (the calls DALI's
framework iterators make) into a :class:`~echopipe.data.CorruptImageError` naming the file,
chained to DALI's error, the same way the echoing training pipeline does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nvidia.dali import Pipeline

from ..data import CorruptImageError


class FileNamingPipeline(Pipeline):
    """``nvidia.dali.Pipeline`` whose decoder failures name the file (see the module notes)."""

    upstream_tap: Any = None

    def _named(self, error: Exception) -> Exception:
        from .builders import explain_decode_failure

        if self.upstream_tap is None:
            return error
        return explain_decode_failure(self.upstream_tap, error)

    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (StopIteration, CorruptImageError):
            raise  # the end of data, or already named by an inner call (run -> schedule_run)
        except Exception as error:
            named = self._named(error)
            if named is error:
                raise
            raise named from error

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(super().run, *args, **kwargs)

    def outputs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(super().outputs, *args, **kwargs)

    def share_outputs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(super().share_outputs, *args, **kwargs)

    def schedule_run(self) -> None:
        self._call(super().schedule_run)


def naming_pipeline(
    graph: Callable[[], Any], tap: Any, **pipeline_kwargs: Any
) -> FileNamingPipeline:
    """A :class:`FileNamingPipeline` with ``graph()``'s outputs (not built)."""
    pipe = FileNamingPipeline(**pipeline_kwargs)
    pipe.upstream_tap = tap
    with pipe:
        outputs = graph()
        pipe.set_outputs(*(outputs if isinstance(outputs, tuple | list) else (outputs,)))
    return pipe
