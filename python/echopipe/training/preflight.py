"""The checks that can refuse a run before any heavy work: the checkpoint and the data folder."""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoints import CheckpointError, read_checkpoint
from .config import DataError, TrainConfig, TrainError, UsageError
from .distributed import DistContext
from .options import CollectiveError

if TYPE_CHECKING:
    from ..data import ImageFolderIndex, ScanShare

__all__ = [
    "cache_does_not_fit",
    "check_cache_fits",
    "check_data",
    "read_resume",
    "same_world_size",
    "say_left_out",
]


def read_resume(path: Path, world_size: int) -> dict[str, Any]:
    """The checkpoint to resume, read and checked (the options are merged by the caller)."""
    if not path.is_file():
        raise UsageError(
            f"--resume: no checkpoint {str(path)!r} in this run folder; start without "
            "--resume, or give --resume CKPT"
        )
    try:
        saved = read_checkpoint(path)
    except CheckpointError as exc:
        prev = path.with_name("prev.pt")
        if path.name != "last.pt" or not prev.is_file():
            raise
        # A damaged last.pt (a copy cut short, a bad disk) need not end the run: the file
        # before it is kept beside it.
        raise CheckpointError(
            f"{exc}; --resume {shlex.quote(str(prev))} continues from the checkpoint before it"
        ) from None
    if "run" not in saved or "pipeline" not in saved:
        raise UsageError(f"--resume {str(path)!r} holds no training run to continue")
    was = saved["run"]["world_size"]
    if was != world_size:
        raise UsageError(
            f"--resume {str(path)!r}: the checkpoint was written at world size {was}, this run "
            f"has world size {world_size}: {same_world_size(was)}"
        )
    return saved


def same_world_size(was: int) -> str:
    """What to do when a run is resumed with another number of processes (refused: each
    rank's checkpoint holds its own shard's DALI reader position and echo cache, and the
    steps per epoch and LR clock are counted for that number of replicas)."""
    return (
        f"each rank's checkpoint holds its own data shard (reader position, echo cache), so the "
        f"run continues only at world size {was} (an elastic job must come back with as many "
        "processes: torchrun with a fixed --nnodes and --nproc_per_node), or start a new run "
        "with another --output"
    )


def cache_does_not_fit(cfg: TrainConfig) -> TrainError:
    """The one line for an echo cache larger than this machine holds."""
    # --shuffle-buffer only when given: its default is no value to name
    given = "" if cfg.shuffle_buffer is None else f", --shuffle-buffer {cfg.shuffle_buffer}"
    return TrainError(
        f"the echo cache does not fit in memory (--cache-mb {cfg.cache_mb}{given}): "
        f"give {'smaller values' if given else 'a smaller --cache-mb'}"
    )


def _memory_bytes() -> int | None:
    """This process's memory: the machine's, or its cgroup's limit where lower (a container)."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read(32).strip()
        if text.isdigit():
            limit = min(limit, int(text))
    except (OSError, UnicodeDecodeError):
        pass
    return limit


def check_cache_fits(cfg: TrainConfig) -> None:
    """Refuses a ``--cache-mb`` larger than this machine's memory before the data is scanned
    or the synthetic set is built (minutes on a first run); the allocation itself, later, is
    the final word on what fits."""
    echo = cfg.echo_config()
    memory = None if echo.memory == "device" else _memory_bytes()
    if memory is not None and echo.cache_bytes > memory:
        raise cache_does_not_fit(cfg)


def check_data(
    cfg: TrainConfig,
    say: Callable[[str], None],
    left_out: list[str] | None = None,
    ctx: DistContext | None = None,
    check_train: bool = True,
) -> tuple[Path, list[str], dict[str, ImageFolderIndex]]:
    """The data folder, its classes and the checked index of each split (``"train"``,
    ``"val"``, which the DALI builders take as they are); the synthetic set is made here when
    needed.

    Checks every image of train/ and val/ as ``--check`` says, on a pool of threads, and under
    torchrun (``ctx``) each rank a share of them (the ranks combine what they found:
    :mod:`echopipe.data.folder_check`); warns about empty class folders, which stay classes of
    the model. What the scan of val/ left out is said, and added to ``left_out`` when given
    (train/'s is said once the training input is built). ``check_train=False`` (``--evaluate``,
    which reads only val/) lists train/ for its classes without checking its images.
    """
    from ..data import CheckFailedError, ScanShare, default_workers, scan_image_folder

    data_dir = _synthetic_set(cfg, say) if cfg.data is None else Path(cfg.data)
    world = ctx.world_size if ctx is not None else 1
    share = ScanShare(ctx.rank, world, ctx.all_gather_object) if world > 1 else None
    _has_splits(data_dir, share)
    workers = default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    indexes: dict[str, ImageFolderIndex] = {}

    def classes_found(classes: list[str]) -> None:
        # Refused here, before the images are checked (an hour for ImageNet with decode).
        if "train" not in indexes:
            if share is not None:
                _same_classes_on_every_rank(share, data_dir, classes)
            if len(classes) < 2:
                raise DataError(
                    f"--data {str(data_dir)!r}: train/ has {len(classes)} class folder(s); a "
                    f"classifier needs at least 2{_class_links_left_out(data_dir / 'train')}"
                )
        elif classes != indexes["train"].classes:
            extra = sorted(set(classes) ^ set(indexes["train"].classes))
            found = ((n, why) for n in extra if (why := _left_out_link(data_dir, n)))
            name, why = next(found, (extra[0], ""))
            # A ValueError: this rank's own finding, which the scan tells the other ranks.
            raise ValueError(
                f"val/ and train/ of {str(data_dir)!r} have different class folders (e.g. "
                f"{name!r}){why}"
            )

    split = "train"
    try:
        for split in ("train", "val"):
            indexes[split] = scan_image_folder(
                data_dir / split,
                on_classes=classes_found,
                check="none" if split == "train" and not check_train else cfg.check,  # type: ignore
                on_corrupt=cfg.on_corrupt,  # type: ignore[arg-type]
                workers=workers,
                share=share,
                progress=_check_progress(split, cfg.check, workers, world, say)
                if cfg.progress
                else None,
            )
    except (ValueError, CheckFailedError) as exc:
        raise DataError(f"--data: {exc}") from None
    except OSError as exc:  # a folder that cannot be listed, alone: the error names it
        raise DataError(f"--data: {exc.strerror or exc}") from None
    except CollectiveError as exc:
        raise _silent(ctx, split, exc) from None
    train, val = indexes["train"], indexes["val"]
    (left_out if left_out is not None else []).extend(say_left_out(val, "val", say))
    for name, n in zip(train.classes, train.counts_per_class(), strict=True):
        if n == 0:
            say(
                f"warning: class folder train/{name} has no images; the class stays among the "
                "model's outputs but is never trained"
            )
    return data_dir, train.classes, indexes


def _class_links_left_out(split_dir: Path) -> str:
    """The note on ``split_dir``'s class folders that are symbolic links left out."""
    from ..data.folder_walk import class_folders, links_left_out

    skipped: list[tuple[str, str]] = []
    class_folders(split_dir, os.path.realpath(split_dir), skipped)
    return links_left_out(skipped)


def _left_out_link(data_dir: Path, name: str) -> str:
    """Why the class folder ``name`` is missing from one split when that split has it as a
    symbolic link the scan leaves out (it leaves the split, loops or dangles): without it the
    line named a class the user sees in both splits."""
    from ..data.folder_walk import link_problem

    for split in ("train", "val"):
        path = data_dir / split / name
        if path.is_symlink() and link_problem(str(path), os.path.realpath(path.parent), set()):
            where = "that loops or dangles"
            with contextlib.suppress(OSError, RuntimeError):
                where = f"to {os.path.realpath(path, strict=True)}, outside {split}/,"
            return f": {split}/{name} is a symbolic link {where} and such links are left out"
    return ""


def _synthetic_set(cfg: TrainConfig, say: Callable[[str], None]) -> Path:
    """The synthetic set of ``cfg``'s size, made once into the cache folder."""
    from ..data import default_dataset_dir, ensure_synthetic_imagenet

    say(
        f"data: the synthetic set ({cfg.synthetic_classes} classes x "
        f"{cfg.synthetic_per_class} training images), built once into the cache (a minute or "
        "so on 2 cores) and then reused..."
    )
    try:
        data_dir = ensure_synthetic_imagenet(
            classes=cfg.synthetic_classes, per_class=cfg.synthetic_per_class
        )
    except OSError as exc:  # a full or read-only cache folder: a write that names nothing
        raise DataError(
            f"data: cannot build the synthetic set in {str(default_dataset_dir())!r} "
            f"({exc.strerror or exc}); set ECHOPIPE_CACHE_DIR to a folder with room, or "
            "give --data"
        ) from None
    say(f"data: synthetic set {data_dir}")
    return data_dir


def _data_folder_above(data_dir: Path) -> str:
    """The way on when ``data_dir`` is a split or class folder of a data folder (``--data
    DIR/train``): that data folder, named."""
    for up in list(data_dir.parents)[:2]:
        if (up / "train").is_dir() and (up / "val").is_dir():
            return f"; it is inside the data folder {str(up)!r}: give --data {str(up)!r}"
    return ""


def _has_splits(data_dir: Path, share: ScanShare | None) -> None:
    """Refuses a data folder without train/ or val/ before anything is scanned."""
    from ..data.folder_check import listing_failed

    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            missing = (
                f"--data {str(data_dir)!r} has no {split}/ folder (ImageNet layout: "
                f"train/<class>/*.JPEG and val/<class>/*.JPEG){_data_folder_above(data_dir)}"
            )
            if share is None:
                raise DataError(missing)
            # The others wait in the comparison of train/'s classes: told there, every rank
            # ends naming this one, instead of with a collective's error.
            raise DataError(f"--data: {listing_failed(share, missing)}")


def _silent(ctx: DistContext | None, split: str, exc: CollectiveError) -> TrainError:
    """A collective of the data check that failed, told as the rank that went away (killed,
    ended, or hung for --dist-timeout-s) when the others find one silent."""
    silent = ctx.silent_ranks() if ctx is not None else []
    if ctx is None or not silent:
        return exc
    return DataError(
        f"--data: rank {', '.join(map(str, silent))} did not answer while the ranks checked "
        f"{split}/ (it ended, or hung for --dist-timeout-s {ctx.timeout_s:g}); every rank stops"
    )


def _same_classes_on_every_rank(share: ScanShare, data_dir: Path, classes: list[str]) -> None:
    """Ranks whose --data hold other classes would build models of other sizes, and the first
    gradient exchange would fail deep in the collective, naming nothing; compared before the
    images are checked (an hour for ImageNet with --check decode). A rank that could not list
    its classes tells the others here (:func:`~echopipe.data.folder_check.listing_failed`)."""
    from ..data.folder_check import exchange

    views = exchange(share, [str(data_dir), classes])
    odd = next((r for r, v in enumerate(views) if v[1] != views[0][1]), None)
    if odd is not None:
        raise DataError(
            f"--data: rank {odd} finds {len(views[odd][1])} classes in {views[odd][0]!r}, "
            f"rank 0 {len(views[0][1])} in {views[0][0]!r}: every process must read the "
            "same data folder"
        )


def _check_progress(
    split: str, check: str, workers: int, world: int, say: Callable[[str], None]
) -> Callable[[int, int], None]:
    """The progress lines of the check of ``split``/: one at its start, then one about every
    30 seconds (the scan's pace), never one per file."""
    began = time.monotonic()
    mine = f" (this rank's 1/{world} of them)" if world > 1 else ""

    def line(done: int, total: int) -> None:
        if done == 0:
            say(f"data: checking the images of {split}/ (--check {check}, {workers} "
                f"thread(s)): {total} files{mine}...")  # fmt: skip
            return
        rate = done / max(time.monotonic() - began, 1e-9)
        left = (total - done) / rate / 60
        say(f"data: {split}/: {done} of {total} images checked ({rate:.0f}/s, about "
            f"{left:.0f} min left)")  # fmt: skip

    return line


def say_left_out(index: Any, split: str, say: Callable[[str], None]) -> list[str]:
    """One line per kind of file a scan of ``split``/ left out (links, corrupt images), said
    and returned (without the example) for the summary."""
    counts = []
    for what, items in (
        ("symbolic link(s)", index.links_skipped),
        ("corrupt image(s)", index.skipped),
        ("image(s) of other formats", getattr(index, "other_formats", [])),
    ):
        if items:
            path, why = items[0]
            say(f"data: {len(items)} {what} left out of {split}/ (e.g. {path}: {why})")
            counts.append(f"{len(items)} {what} of {split}/")
    return counts
