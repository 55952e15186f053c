"""The training input (DALI + the echo cache) and validation.

:class:`TrainInput` wraps :func:`echopipe.dali.imagenet_train_pipeline` (reader, decode, echo,
augmentation) and :class:`echopipe.dali.EchoIterator`; its :meth:`TrainInput.build` is the one
place the DALI training input is constructed. ``t_up`` is the upstream time per fresh batch that
the echo pipeline measures; ``t_down`` is the stages' busy time,
:meth:`echopipe.pipeline.StalePipeline.step_seconds`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .config import DataError, TrainConfig
from .distributed import DistContext
from .preflight import cache_does_not_fit
from .progress import to_stderr

if TYPE_CHECKING:
    from ..data import ImageFolderIndex

__all__ = ["TrainInput", "evaluate", "evaluate_checkpoint"]


class TrainInput:
    """The echoing DALI training input of one replica.

    A new echo factor takes effect through :meth:`set_factor` (at a decision step), which
    changes the running cache's ``e`` in place (no rebuild).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        data_dir: Path | ImageFolderIndex,
        ctx: DistContext,
        device_id: int | None,
    ):
        self.cfg = cfg
        # Built once: every pipeline of the run takes it as it is, with the factor of the moment.
        self.echo = cfg.echo_config()
        self.data_dir = data_dir
        self.ctx = ctx
        self.device_id = device_id
        self.iterator: Any = None
        self.pipe: Any = None
        self.factor = 0.0
        self.builds = 0
        # Counters of earlier pipelines (rebuilds and resumed runs), added to the live one's.
        self.base = {"fresh": 0, "echoed": 0, "samples": 0, "up_s": 0.0, "up_iters": 0}

    def build(self, factor: float, steps_per_epoch: int | None, state: Any = None) -> None:
        from ..dali import AugmentSpec, EchoIterator, ReaderSpec, imagenet_train_pipeline

        self.close()
        cfg = self.cfg
        reader = ReaderSpec(
            shard_id=self.ctx.rank,
            num_shards=self.ctx.world_size,
            # The same seed on resume: DALI's checkpoint restores the reader's position in the
            # file order that this seed permutes, so the resumed epoch goes on where it stopped.
            seed=cfg.seed + 104729 * self.ctx.rank,
            on_corrupt=cfg.on_corrupt,  # type: ignore[arg-type]
            check=cfg.check,  # type: ignore[arg-type]
            read_delay_ms=cfg.read_delay_ms,
            decode_device=cfg.decode,  # type: ignore[arg-type]
            device_id=self.device_id,
            num_threads=cfg.workers,
        )
        try:
            self.pipe = imagenet_train_pipeline(
                self.data_dir,
                batch_size=cfg.batch_size,
                reader=reader,
                augment=AugmentSpec(image_size=cfg.image_size),
                echo=replace(self.echo, factor=factor),  # a pipeline's factor is a number
                deterministic=cfg.deterministic,
                enable_checkpointing=True,
            )
        except MemoryError:
            # Within their bounds, --cache-mb and --shuffle-buffer can still ask for more than
            # this machine has left: the cache's arena and slots are allocated here.
            raise cache_does_not_fit(cfg) from None
        self.iterator = EchoIterator(self.pipe, ["data", "label"], steps_per_epoch=steps_per_epoch)
        if state is not None:
            from ..dali.state_check import check_cache_restores

            try:
                self.iterator.load_state_dict(state)
                # The cache itself is restored at the first batch; a blob it refuses is
                # named now, before any training.
                check_cache_restores(self.pipe.config, state["pipeline"]["cache"])
            except ValueError as exc:  # a state of another pipeline (its fields are checked)
                from .checkpoints import CheckpointError

                named = f" {str(cfg.resume)!r}" if isinstance(cfg.resume, Path) else ""
                raise CheckpointError(
                    f"--resume{named}: the checkpoint's input state does not fit this run: {exc}"
                ) from None
        self.factor = factor
        self.builds += 1

    def count_in(self, state: dict[str, Any]) -> None:
        """Add the counters of the pipeline that saved ``state`` to ``base``, where ``state``
        is not restored (an input that starts afresh over a changed train/)."""
        stats, runner = state["iterator"]["stats"], state["pipeline"]["runner"]
        for key in ("fresh", "echoed", "samples"):
            self.base[key] += int(stats[key])
        self.base["up_s"] += float(runner.get("seconds", 0.0))
        self.base["up_iters"] += int(runner["iterations"])

    def set_factor(self, factor: float) -> None:
        """Use echo factor ``factor`` for fresh samples cached from now on.

        The running cache changes ``e`` in place: samples already cached keep their tickets, so
        nothing is dropped or rebuilt. Called at a step where all replicas agree on the factor;
        the caller re-plans the epoch's length.
        """
        self.pipe.set_echo_factor(factor)
        self.factor = factor

    def natural_steps(self) -> int:
        """Steps of one epoch for this shard at the current factor (resets a fixed length)."""
        self.iterator.set_epoch_size()  # back to the reader's shard size
        return self.iterator.steps_per_epoch

    def steps_at(self, factor: float) -> int:
        """Steps of one epoch for this shard at echo factor ``factor`` (what
        :meth:`natural_steps` gives once the factor is set), changing nothing: the endless
        stream's epoch hands out ``round(shard * e)`` samples, the last batch filled."""
        samples = max(1, round(self.iterator.shard_size * factor))
        return math.ceil(samples / self.cfg.batch_size)

    def set_steps(self, steps: int) -> None:
        """Fix the epoch length (all replicas must run the same number of steps)."""
        self.iterator.steps_per_epoch = steps

    def counters(self) -> dict[str, float]:
        s = self.iterator.stats if self.iterator is not None else None
        batches, seconds = self.pipe.upstream_time() if self.pipe is not None else (0, 0.0)
        return {
            "fresh": self.base["fresh"] + (s.fresh if s else 0),
            "echoed": self.base["echoed"] + (s.echoed if s else 0),
            "samples": self.base["samples"] + (s.samples if s else 0),
            "up_s": self.base["up_s"] + seconds,
            "up_iters": self.base["up_iters"] + batches,
        }

    def pause_room(self) -> int:
        """Samples the cache can take in while the steps pause, above what it keeps for
        shuffling: its capacity (in slots, and in bytes at the mean size resident) less the
        shuffle buffer and one upstream batch, where the upstream stops for room."""
        s, c = self.pipe.cache.stats(), self.pipe.config
        fits = s.capacity_samples
        if s.resident and s.bytes_used:
            fits = min(fits, s.capacity_bytes * s.resident // s.bytes_used)
        return max(fits - int(c.echo.shuffle_buffer) - int(c.upstream_batch_size), 0)

    def pause_reads(self, before: tuple[int, float]) -> float | None:
        """The controller's ``t_pause`` for the pause between two epochs' steps that began at
        ``before`` (:meth:`echopipe.dali.EchoPipeline.upstream_supply` then): the samples the
        upstream read in it, and those it would have read while it waited for room in a full
        cache, at most the cache's room (:meth:`pause_room`), as a share of an epoch's fresh
        samples, times ``t_up``. ``None`` before ``t_up`` is measured."""
        t_up = self.upstream_step_seconds()
        if t_up is None:
            return None
        (fresh0, wait0), (fresh1, wait1) = before, self.pipe.upstream_supply()
        read = fresh1 - fresh0 + (wait1 - wait0) / t_up * self.cfg.batch_size
        return t_up * min(read, self.pause_room()) / max(self.iterator.shard_size, 1)

    def upstream_step_seconds(self) -> float | None:
        """``t_up`` of the live pipeline: upstream seconds per downstream batch of fresh
        samples (mean since it was built; restored with a checkpoint), or ``None`` before any."""
        t_up = self.pipe.upstream_step_seconds()
        return None if math.isnan(t_up) else t_up

    def explain(self, exc: RuntimeError) -> Exception:
        """The training input's failure ``exc`` (raised by the DALI pipeline) as one line: a
        cache too small for what it must hold names --cache-mb; anything else is ``exc``."""
        from ..echo import CacheTooSmallError

        small = exc.__cause__
        if isinstance(small, CacheTooSmallError):
            return DataError(
                f"--deterministic: the echo cache (--cache-mb {self.cfg.cache_mb}) holds only "
                f"{small.resident} decoded training images, but the first draw waits for "
                f"{small.wanted} (the shuffle buffer or the batch); raise --cache-mb to at least "
                f"{math.ceil(small.need_bytes / 2**20)} or lower --shuffle-buffer"
            )
        # DALI passes the sink's SampleTooLargeError on as text; the cache keeps the typed one.
        cache = getattr(self.pipe, "cache", None)
        too_large = cache.refused_sample if cache is not None else None
        if too_large is not None:
            need = too_large.sample_bytes / 2**20
            files = getattr(getattr(self.pipe, "folder_index", None), "files", [])
            found = _image_larger_than(files, self.echo.cache_bytes)
            which = f" ({found})" if found else ""
            return DataError(
                f"a decoded training image{which} needs {need:.1f} MiB, more than the echo "
                f"cache holds (--cache-mb {self.cfg.cache_mb}); raise --cache-mb to at least "
                f"{math.ceil(need) * 4}"
            )
        return exc

    def state_dict(self) -> dict[str, Any]:
        return self.iterator.state_dict()

    def close(self) -> None:
        """Close the live pipeline; its counters are kept in ``base``."""
        if self.iterator is not None:
            self.base = self.counters()  # type: ignore[assignment]
            with contextlib.suppress(Exception):
                self.iterator.close()
        self.iterator = self.pipe = None


def evaluate(
    pipeline: Any,
    cfg: TrainConfig,
    data_dir: Path | ImageFolderIndex,
    ctx: DistContext,
    device_id: int | None,
    val_iter: list[Any],
) -> tuple[float, float, int, float]:
    """``(top1, mean loss, images, top5)`` over this rank's validation shard, summed over
    ranks (top-5 is top-k with k = min(5, classes)). ``data_dir`` is the data folder, or the
    index of val/ that check_data checked (then it is not listed or checked again)."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from ..dali import imagenet_val_pipeline

    if not val_iter:
        pipe = imagenet_val_pipeline(
            data_dir,
            batch_size=min(cfg.batch_size * 4, 256),
            image_size=cfg.image_size,
            decode_device=cfg.decode,
            shard_id=ctx.rank,
            num_shards=ctx.world_size,
            num_threads=cfg.workers,
            device_id=device_id,
            on_corrupt=cfg.on_corrupt,
            # data_dir is val/'s index, checked by check_data (bad files left out with skip);
            # the check names what a decoder failure's message may suggest.
            check=cfg.check,
        )
        pipe.build()
        val_iter.append(
            DALIGenericIterator(
                [pipe],
                ["data", "label"],
                reader_name=pipe.reader_name,
                last_batch_policy=LastBatchPolicy.PARTIAL,
                auto_reset=True,
            )
        )
    correct = correct5 = 0.0
    loss_sum = 0.0
    count = 0
    for batch in val_iter[0]:
        x = batch[0]["data"]
        y = batch[0]["label"].reshape(-1).long()
        logits = pipeline.evaluate(x).float()
        correct += float((logits.argmax(1) == y.cpu()).sum())
        k = min(5, logits.shape[1])
        correct5 += float((logits.topk(k, dim=1).indices == y.cpu()[:, None]).any(1).sum())
        loss_sum += float(nn.functional.cross_entropy(logits, y.cpu(), reduction="sum"))
        count += int(y.numel())
    correct, loss_sum, total, correct5 = ctx.all_reduce_sum(
        [correct, loss_sum, float(count), correct5]
    )
    n = max(total, 1.0)
    return correct / n, loss_sum / n, int(total), correct5 / n


def evaluate_checkpoint(
    cfg: TrainConfig, checkpoint: Path, log: Callable[[str], None] | None = None
) -> tuple[float, float, int]:
    """``(top1, loss, images)`` of a checkpoint's weights on ``cfg``'s validation split, at
    the image size the checkpoint's run trained at (``cfg``'s may be the default, which a
    model such as lenet5 cannot take). Under torchrun every rank evaluates its shard of val/
    and all return the totals."""
    from .checkpoints import export_state_dict

    weights, saved = export_state_dict(checkpoint)
    # Under torchrun the ranks share val/'s check and its images, and a rank whose listing
    # fails (or that is killed) is named by every rank, as in training.
    ctx = DistContext.from_env(cfg.dist_timeout_s)
    try:
        return _evaluate_on(cfg, checkpoint, weights, saved, ctx, log)
    finally:
        ctx.close()


def _evaluate_on(
    cfg: TrainConfig,
    checkpoint: Path,
    weights: dict[str, Any],
    saved: dict[str, Any],
    ctx: DistContext,
    log: Callable[[str], None] | None,
) -> tuple[float, float, int]:
    """:func:`evaluate_checkpoint` among the ranks of ``ctx``."""
    from ..models import build_model
    from .preflight import check_data

    say = log or to_stderr
    if not ctx.is_main:
        say = lambda m: None  # noqa: E731  (rank 0 says what the check does)
    _, classes, indexes = check_data(cfg, say, ctx=ctx, check_train=False)  # reads only val/
    name, num_classes = saved["model"]["name"], saved["model"]["num_classes"]
    if len(classes) != num_classes:
        raise DataError(
            f"--evaluate {str(checkpoint)!r}: the model has {num_classes} classes, "
            f"--data has {len(classes)}"
        )
    model = build_model(name, num_classes=num_classes)
    model.load_state_dict(weights)
    model.eval()
    cfg = replace(cfg, model=name, image_size=int(saved["config"]["image_size"]))

    class _Plain:
        @staticmethod
        def evaluate(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model(x)

    return evaluate(_Plain(), cfg, indexes["val"], ctx, None, [])[:3]


def _image_larger_than(files: list[str], capacity: int, budget_s: float = 5.0) -> str | None:
    """``'PATH, WxH'`` of an image whose decoded RGB pixels exceed ``capacity`` bytes, or None.

    The cache's error does not name the sample, so the image headers are read (largest files
    first, no decoding) until one is found or ``budget_s`` has passed: a huge dataset is not
    read in full only to improve an error message.
    """
    from PIL import Image

    def size(path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            return 0

    deadline = time.perf_counter() + budget_s
    for path in sorted(files, key=size, reverse=True):
        if time.perf_counter() > deadline:
            return None
        try:
            with Image.open(path) as im:
                w, h = im.size
        except Exception:  # Pillow raises many types; the run's own error is what counts
            continue
        if 3 * w * h > capacity:
            return f"{path}, {w}x{h}"
    return None
