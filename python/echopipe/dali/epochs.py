"""How the reader's epochs become the echo stream's epochs.

An epoch-aligned echo pipeline (``epochs=N``, by default N = 1) stores exactly one reader epoch
of its shard per epoch (the reader's padding is not stored), emits a fixed number of copies of
it, and ends the stream; the next pass starts after ``reset()``. DALI's reader decides which
files an epoch of a shard holds: with ``pad_last_batch=True`` every shard's epoch takes the same
number of reader batches (the larger shards' size, padded with the last sample), and unless
``stick_to_shard=True`` the reader moves to the next shard every epoch, so a shard's epoch can
hold one file more or less than the first one (20 files over 3 shards: 6, 7, 7 files). Every
shard's pass is padded to the batches of the largest shard's (:class:`PassSpan`), as the reader
pads its epochs, so that the ranks of a job take equal steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..echo import copies_per_epoch


class EpochSizeChangedError(ValueError):
    """An epoch-aligned pass under DALI's iterators holds another number of copies than the
    iterator was told when it read ``reader_meta`` (``set_echo_factor`` since then): it would
    end the epoch inside the pass, or ask for batches after its end. ``told`` and ``copies``
    say both numbers."""

    def __init__(self, message: str, told: int, copies: int) -> None:
        super().__init__(message)
        self.told, self.copies = told, copies


@dataclass(frozen=True)
class ReaderEpochs:
    """The upstream reader's epoch geometry for one shard (from ``Pipeline.reader_meta``)."""

    name: str
    size: int  #: samples of the whole data set (all shards), padding excluded
    shards: int
    shard_id: int
    stick_to_shard: bool
    padded: bool  #: pad_last_batch
    padded_shard: int  #: samples a shard's epoch takes from the reader, padding included

    @classmethod
    def from_meta(cls, name: str, meta: dict[str, Any]) -> ReaderEpochs:
        shards = int(meta["number_of_shards"])
        return cls(
            name=name,
            size=int(meta["epoch_size"]),
            shards=shards,
            shard_id=int(meta["shard_id"]),
            stick_to_shard=bool(meta.get("stick_to_shard", False)),
            padded=bool(meta.get("pad_last_batch", False)),
            padded_shard=int(meta.get("epoch_size_padded", meta["epoch_size"])) // shards,
        )

    def shard_files(self, shard: int) -> int:
        """DALI's size of shard ``shard`` (the same split as its reader and iterators)."""
        return self.size * (shard + 1) // self.shards - self.size * shard // self.shards

    def fresh(self, reader_epoch: int = 0) -> int:
        """Files this shard reads in reader epoch ``reader_epoch`` (0 = the first)."""
        shard = self.shard_id if self.stick_to_shard else self.shard_id + reader_epoch
        return self.shard_files(shard % self.shards)

    def iterations(self, upstream_batch_size: int) -> int:
        """Upstream batches per reader epoch: with padding, every shard takes as many batches
        as the largest one; without, the epoch simply ends inside a batch."""
        per_epoch = self.padded_shard if self.padded else self.fresh(0)
        return max(1, math.ceil(per_epoch / upstream_batch_size))

    @property
    def fixed_size(self) -> bool:
        """True when every epoch of this shard holds as many files as the first: one shard,
        ``stick_to_shard=True``, or shards of equal size."""
        return self.shards == 1 or self.stick_to_shard or self.size % self.shards == 0

    def copies(self, echo_factor: float, unit: int = 1) -> int:
        """Copies per reader epoch of this shard when its size is fixed: e times DALI's shard
        size, exact (the cache's ``epoch_size`` blocks). ``unit`` > 1 (batch mode: the cache
        echoes upstream batches, the last one short) is exact for a whole e only."""
        fresh = self.fresh(0)
        if unit == 1 or echo_factor == math.floor(echo_factor):
            return copies_per_epoch(echo_factor, fresh)
        return round(echo_factor * fresh)


@dataclass(frozen=True)
class EpochGeometry:
    """The built reader's epochs as the pipeline runs them (from :func:`epoch_geometry`).

    Attributes:
        epochs: reader epochs per pass, ``"auto"`` resolved (``None``: free-running).
        reader: the reader's geometry (``None`` without a reader).
        unaligned_reader: the reader's name when ``epochs="auto"`` fell back to free-running
            (no ``pad_last_batch``).
        shard_size: fresh samples per epoch of this shard (0 without a reader).
        iterations: upstream iterations per reader epoch.
    """

    epochs: int | None
    reader: ReaderEpochs | None
    unaligned_reader: str | None
    shard_size: int
    iterations: int

    def units(self, mode: str, upstream_batch_size: int) -> int:
        """The cache's ``epoch_size``: units of the first reader epoch of an epoch-aligned
        stream (samples, or upstream batches in batch mode), 0 for a free-running one."""
        if self.epochs is None or self.reader is None:
            return 0
        fresh = self.reader.fresh(0)
        if mode == "batch":
            return max(1, math.ceil(fresh / upstream_batch_size))
        return fresh


def epoch_geometry(
    meta: dict[str, Any], epochs: int | str | None, upstream_batch_size: int
) -> EpochGeometry:
    """The epochs of the upstream whose ``reader_meta()`` is ``meta``; resolves
    ``epochs="auto"`` (1 with a padded reader, endless otherwise)."""
    if not meta:
        if epochs not in (None, "auto"):
            raise ValueError(
                f"epochs={epochs} needs a DALI reader (fn.readers.*) before echo() to know "
                "the epoch size; without one, leave epochs=None for an endless stream"
            )
        return EpochGeometry(None, None, None, 0, 1 << 62)
    if len(meta) > 1:
        raise ValueError(
            f"the upstream part has {len(meta)} readers ({sorted(meta)}); echopipe needs "
            "exactly one to count epochs"
        )
    ((name, m),) = meta.items()
    reader = ReaderEpochs.from_meta(name, m)
    unaligned = None
    if epochs == "auto" and not reader.padded:
        # Without padding a reader epoch ends inside a batch, so epochs cannot be aligned;
        # the stream runs free, and DALI's iterators, which would count epochs, are refused.
        epochs, unaligned = None, name
    if epochs is not None and not reader.padded:
        raise ValueError(
            f"epochs={epochs} needs the reader {name!r} to be created with "
            "pad_last_batch=True, so every epoch starts on a batch boundary and no sample of "
            "the next epoch is pulled into the last batch; or pass epochs=None for a "
            "free-running stream"
        )
    resolved = 1 if epochs == "auto" else epochs
    return EpochGeometry(
        resolved, reader, unaligned, reader.fresh(0), reader.iterations(upstream_batch_size)
    )


def _copies_between(echo_factor: float, units: int, block: int) -> tuple[int, int]:
    """Fewest and most copies of ``units`` units put after a ``reset_input`` into a cache whose
    ``epoch_size`` is ``block``: each whole block gives exactly ``round(frac(e) * block)`` units
    an extra ticket (:func:`~echopipe.echo.copies_per_epoch`), and a part of a block any share
    of them that fits (which ones is the cache's seeded choice)."""
    whole = math.floor(echo_factor)
    extra = math.floor((echo_factor - whole) * block + 0.5)  # as the native core computes it
    full, rest = divmod(units, block)
    base = whole * units + full * extra
    return base + max(0, rest - (block - extra)), base + min(rest, extra)


@dataclass(frozen=True)
class PassSpan:
    """Copies in one pass of an epoch-aligned stream, on this shard and on every other.

    DALI's reader pads every shard's epoch to as many batches as the largest shard's
    (``pad_last_batch``), so that the ranks of a job take equal steps; an echo pass is padded
    the same way, to :meth:`batches`. ``most`` and ``least`` are exact with a whole e or shards
    that keep their size; where a fractional e meets reader epochs of another size than the
    cache's blocks (shards that move), they are the bounds of what the blocks can give.

    Attributes:
        own: this shard's copies in its first pass (:func:`epoch_copies`).
        most: copies of the largest pass any shard runs.
        least: copies of the smallest pass any shard runs.
        most_batches: in batch mode, the batches of the pass of most batches: a batch holds
            ``batch_size / upstream_batch_size`` units, and one that drew a short last unit
            ends short, so the batches are counted in units, not samples.
        least_full: in batch mode, the fewest full batches any shard's pass can hold, whatever
            the draws (each copy of a short unit in a batch of its own): what ``DROP`` keeps.
    """

    own: int
    most: int
    least: int
    most_batches: int | None = None
    least_full: int | None = None

    def batches(self, batch_size: int) -> int:
        """Batches of every shard's pass: the largest pass's, padded to that on the others."""
        if self.most_batches is not None:
            return max(1, self.most_batches)
        return max(1, math.ceil(self.most / batch_size))


def pass_span(config: Any, reader: ReaderEpochs | None) -> PassSpan | None:
    """The :class:`PassSpan` of an epoch-aligned stream with the resolved ``config`` (None for
    a free-running one). Each shard's size comes from the reader's meta (DALI's split), so
    every rank computes the same ``most`` and ``least``."""
    if config.epochs is None or reader is None:
        return None
    epochs, e = int(config.epochs), float(config.echo.factor)
    own = epoch_copies(config, reader)
    sizes = [reader.shard_files(k) for k in range(reader.shards)]
    if config.echo.mode == "batch" or reader.stick_to_shard or len(set(sizes)) == 1:
        # Each shard reads itself every epoch (or all are alike): its cache's blocks are its
        # own epochs, and its pass is what epoch_copies gives it.
        passes = [
            epoch_copies(config, replace(reader, shard_id=k, stick_to_shard=True))
            for k in range(reader.shards)
        ]
        if config.echo.mode != "batch":
            return PassSpan(own, max(passes), min(passes))
        up = config.upstream_batch_size
        per_batch = config.batch_size // up
        # The last unit of a shard's epoch is short; its copies are at most ceil(e) per epoch.
        units = [(math.ceil(n / up), n % up != 0) for n in sizes]
        totals = [(epochs * copies_per_epoch(e, n), epochs * math.ceil(e) * s) for n, s in units]
        return PassSpan(
            own, max(passes), min(passes),
            most_batches=max(math.ceil(t / per_batch) for t, _ in totals),
            least_full=min(max(0, t // per_batch - min(s, t)) for t, s in totals),
        )  # fmt: skip
    # Shards that move: a rank's cache blocks hold its first epoch's files, and a pass reads
    # `epochs` shards in turn, starting anywhere.
    windows = {sum(sizes[(s + i) % len(sizes)] for i in range(epochs)) for s in range(len(sizes))}
    bounds = [_copies_between(e, u, block) for u in windows for block in set(sizes)]
    return PassSpan(own, max(hi for _, hi in bounds), min(lo for lo, _ in bounds))


def epoch_copies(config: Any, reader: ReaderEpochs | None) -> int:
    """Copies of samples in one pass of an epoch-aligned stream with the resolved ``config``:
    ``epochs`` times e times this shard's size (see :meth:`ReaderEpochs.copies`); 0 for a
    free-running stream."""
    if config.epochs is None or reader is None:
        return 0
    unit = config.upstream_batch_size if config.echo.mode == "batch" else 1
    return int(config.epochs) * reader.copies(config.echo.factor, unit)


def await_pass_end(
    runner: Any,
    *,
    fill: Callable[[], None] | None,
    check_upstream: Callable[[], None],
    closed: Callable[[], bool],
    timeout_s: float = 600.0,
) -> None:
    """Lets the upstream ``runner`` finish the pass (its padding-only last batches included)
    before the next one starts; every copy of the pass is out, so nothing waits for the
    consumer. ``fill`` (deterministic mode) runs the upstream in this thread; otherwise this
    polls the runner's thread until ``timeout_s``. ``check_upstream`` raises the upstream's
    error; ``closed`` says whether the pipeline was closed meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not runner.ended:
        check_upstream()
        if closed():
            raise RuntimeError("this EchoPipeline was closed")
        if fill is not None:
            fill()
        elif time.monotonic() > deadline:
            raise TimeoutError(
                f"the upstream pipeline did not finish its epoch within {timeout_s} s"
            )
        else:
            time.sleep(0.005)


def drop_rest_of_pass(
    cache: Any,
    batch_size: int,
    *,
    fill: Callable[[], None] | None,
    check_upstream: Callable[[], None],
    closed: Callable[[], bool],
    timeout_s: float = 600.0,
) -> int:
    """Draws what is left of an epoch-aligned pass out of ``cache`` and drops it (a reset
    inside an epoch); returns the copies dropped. The upstream still reads the rest of its
    reader epoch, so the next pass starts at the reader's epoch boundary; the copies are drawn
    here rather than through the downstream pipeline, which would decode and augment them for
    nobody. No downstream iteration may be in flight. ``fill``, ``check_upstream`` and
    ``closed`` as for :func:`await_pass_end`."""
    deadline = time.monotonic() + timeout_s
    dropped = 0
    while True:
        check_upstream()
        if closed():
            raise RuntimeError("this EchoPipeline was closed")
        if fill is not None:
            fill()
        try:
            drawn = len(cache.take(batch_size, timeout=0.05))
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the upstream pipeline did not finish its epoch within {timeout_s} s"
                ) from None
            continue
        if drawn == 0:  # every copy of the pass was drawn
            return dropped
        dropped += drawn
