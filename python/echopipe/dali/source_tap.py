"""The upstream tap of the ImageNet builders: simulated read delay and recent source paths.

``read_delay_ms`` mimics a network file system: every upstream batch waits
``batch_size * read_delay_ms`` milliseconds (on an event, so it costs wall time but no CPU)
between the reader and the decoder, in a ``fn.python_function`` placed in the upstream pipeline
only. :meth:`UpstreamTap.stop` (the pipeline's close) ends a wait at once and lets later
batches through undelayed: a closing pipeline joins its upstream thread, which would otherwise
sit out up to a whole batch's delay (seconds) before a stop could end the process. The same
tap records the source paths of the last few batches, so a file that passes the header check
but that DALI's decoder rejects can be found and named afterwards
(:meth:`UpstreamTap.find_undecodable`, :func:`explain_decode_failure`). The public names are
re-exported by :mod:`echopipe.dali.builders` and :mod:`echopipe.dali`.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from ..data import CorruptImageError, check_image_file

__all__ = ["UpstreamTap", "explain_decode_failure", "optional_tap"]


class UpstreamTap:
    """Callable for ``fn.python_function`` between the reader and the decoder.

    Each call receives one batch of encoded files and their ``source_info`` paths, waits
    ``len(batch) * read_delay_ms`` milliseconds when a delay is set (less once :meth:`stop` is
    called), remembers the paths of the last ``history_batches`` batches, and passes the
    encoded files through unchanged.

    Counters (read them any time; they are updated under a lock): ``samples``, ``batches``,
    ``delay_s`` (total seconds of delay asked for), ``waiting`` (calls inside their delay now)
    and ``cut_short`` (delays that :meth:`stop` ended before their time). ``check`` and
    ``on_corrupt`` are the scan's settings, so that the message of a decoder failure suggests
    only what was not already in use.
    """

    def __init__(
        self,
        read_delay_ms: float = 0.0,
        *,
        history_batches: int = 8,
        check: str = "header",
        on_corrupt: str = "error",
    ) -> None:
        delay = float(read_delay_ms)
        if not np.isfinite(delay) or delay < 0:
            raise ValueError(f"read_delay_ms must be a finite number >= 0, got {read_delay_ms!r}")
        if int(history_batches) < 1:
            raise ValueError(f"history_batches must be >= 1, got {history_batches!r}")
        self.read_delay_ms = delay
        self.check, self.on_corrupt = check, on_corrupt
        self._lock = threading.Lock()
        self._recent: collections.deque[list[str]] = collections.deque(maxlen=int(history_batches))
        self.samples = 0
        self.batches = 0
        self.delay_s = 0.0
        self.waiting = 0
        self.cut_short = 0
        self._stopped = threading.Event()

    def stop(self) -> None:
        """End every delay now and skip those to come (the pipeline is closing)."""
        self._stopped.set()

    def __call__(self, encoded: list[np.ndarray], sources: list[np.ndarray]) -> list[np.ndarray]:
        paths = [arr.tobytes().decode("utf-8", "replace") for arr in sources]
        pause = len(encoded) * self.read_delay_ms / 1000.0
        if pause > 0 and not self._stopped.is_set():
            # The wait releases the GIL: the delay costs upstream wall time, not CPU.
            with self._lock:
                self.waiting += 1
            woken = self._stopped.wait(pause)
            with self._lock:
                self.waiting -= 1
                self.cut_short += int(woken)
        with self._lock:
            self._recent.append(paths)
            self.samples += len(encoded)
            self.batches += 1
            self.delay_s += pause
        return encoded

    def recent_files(self) -> list[str]:
        """Paths of the most recent batches that went through the reader, oldest first."""
        with self._lock:
            return [p for batch in self._recent for p in batch]

    def find_undecodable(self) -> list[tuple[str, str]]:
        """Fully decode (Pillow) the recent files; ``(path, reason)`` for each that fails.

        Used after DALI's decoder failed, to name the file: the failing batch is among the
        recent ones, since the decoder runs right after this tap.
        """
        bad = []
        for path in dict.fromkeys(self.recent_files()):
            try:
                check_image_file(path, "decode")
            except CorruptImageError as exc:
                bad.append((exc.path, exc.reason))
        return bad

    def stats(self) -> dict[str, float]:
        """``{"samples", "batches", "delay_s", "waiting", "cut_short"}`` so far."""
        with self._lock:
            return {
                "samples": self.samples,
                "batches": self.batches,
                "delay_s": self.delay_s,
                "waiting": self.waiting,
                "cut_short": self.cut_short,
            }


def optional_tap(
    read_delay_ms: float, track_sources: bool, check: str, on_corrupt: str
) -> UpstreamTap | None:
    """A builder's tap: only when it delays reads or tracks the files, else None (no Python in
    the reader's path)."""
    if not (track_sources or read_delay_ms > 0):
        return None
    return UpstreamTap(read_delay_ms, check=check, on_corrupt=on_corrupt)


def explain_decode_failure(tap: UpstreamTap, error: BaseException) -> BaseException:
    """An exception naming the file behind a DALI decoder failure, or ``error`` if none is found.

    DALI's own message (``nvImageCodec failure``) does not say which file failed. Errors that
    do not come from a decoder are returned unchanged.
    """
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    if not any(key in text for text in chain for key in ("decoders.image", "nvImageCodec")):
        return error
    bad = tap.find_undecodable()
    if not bad:
        return error
    path, reason = bad[0]
    more = f" (and {len(bad) - 1} more: {[p for p, _ in bad[1:4]]})" if len(bad) > 1 else ""
    # on_corrupt='skip' alone leaves out only what the scan's check sees, which was not this.
    if tap.check == "decode":
        hint = "it decoded when the folder was scanned (it changed since?): remove or replace it"
    else:
        skip = tap.on_corrupt == "skip"
        also, flags = ("", "") if skip else (" and on_corrupt='skip'", " --on-corrupt skip")
        hint = (
            f"the scan's check ({tap.check!r}) does not decode: remove or replace it, or scan "
            f"with check='decode'{also} (echopipe train: --check decode{flags}) to leave such "
            "files out"
        )
    exc = CorruptImageError(path, f"DALI's decoder failed on it ({reason}){more}; {hint}")
    exc.__cause__ = error
    return exc
