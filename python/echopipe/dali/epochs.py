"""How the reader's epochs become the echo stream's epochs.

An epoch-aligned echo pipeline (``epochs=N``, by default N = 1) stores exactly one reader epoch
of its shard per epoch (the reader's padding is not stored), emits a fixed number of copies of
it, and ends the stream; the next pass starts after ``reset()``. DALI's reader decides which
files an epoch of a shard holds: with ``pad_last_batch=True`` every shard's epoch takes the same
number of reader batches (the larger shards' size, padded with the last sample), and unless
``stick_to_shard=True`` the reader moves to the next shard every epoch, so a shard's epoch can
hold one file more or less than the first one (20 files over 3 shards: 6, 7, 7 files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..echo import copies_per_epoch


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
