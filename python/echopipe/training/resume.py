"""Resuming a run: one run, one story.

A resumed run is the run it continues. Its options are the checkpoint's: the ones the run
depends on (``fixed``) may not change; the ``free`` ones (``--epochs``, ``--workers``, ...) may
be given anew, and each change is named and recorded in ``config.json``; a resume that lengthens
or shortens the run stretches the rest of the learning-rate schedule from where it stopped.
Under torchrun the ranks agree on one step before any of them trains.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from .checkpoints import CheckpointError, RunCheckpoints
from .config import TrainConfig, UsageError, flag, free_on_resume
from .distributed import DistContext
from .options import check_value
from .state import RunState, is_partial

__all__ = [
    "agree_on_checkpoint",
    "agree_on_file",
    "given_by_value",
    "merge_options",
    "restart_entry",
]

_MISSING = object()


def given_by_value(cfg: TrainConfig) -> set[str]:
    """The fields of ``cfg`` that differ from their defaults: what a Python caller gave."""
    default = TrainConfig()
    return {
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)
    }


def merge_options(
    cfg: TrainConfig, saved: dict[str, Any], given: set[str], ckpt: Path
) -> tuple[TrainConfig, dict[str, list[Any]]]:
    """The resumed run's config and the free options given anew (``{flag: [was, now]}``).

    Options not in ``given`` are the checkpoint's; a fixed option given with another value is
    refused, naming it, its two values and the options that may change.
    """
    fixed = saved.get("config") or {}
    options = saved.get("options") or {}
    now = cfg.as_json()
    values: dict[str, Any] = {}
    changed: dict[str, list[Any]] = {}
    refused: list[str] = []
    for f in dataclasses.fields(cfg):
        name, kind = f.name, f.metadata["on_resume"]
        was = _MISSING if kind == "each" else (fixed if kind == "fixed" else options)
        was = was if was is _MISSING else was.get(name, _MISSING)  # type: ignore[union-attr]
        if was is _MISSING or (name in given and _same_value(name, now[name], was)):
            values[name] = getattr(cfg, name)
        elif name in given:
            if kind == "fixed":
                moved = _moved_data(was) if name == "data" else ""
                refused.append(f"{flag(name)} was {was!r}, now {now[name]!r}{moved}")
            changed[flag(name)] = [was, now[name]]
            values[name] = getattr(cfg, name)
        else:
            values[name] = _inherited(f, was, ckpt)
    if refused:
        raise UsageError(
            f"--resume {str(ckpt)!r}: {'; '.join(refused)}. Resume with the checkpoint's options; "
            f"only these may change: {', '.join(free_on_resume())}"
        )
    merged = TrainConfig(**values)
    merged.validate()
    return merged, changed


def _same_value(name: str, now: Any, was: Any) -> bool:
    """Whether an option given anew keeps the checkpoint's value: for ``--data`` the same
    folder, however it is spelled (relative, absolute, through a link)."""
    if name == "data" and isinstance(now, str) and isinstance(was, str):
        return os.path.realpath(now) == os.path.realpath(was)
    return bool(now == was)


def _inherited(f: dataclasses.Field, was: Any, ckpt: Path) -> Any:
    """The checkpoint's value of option ``f``, through the option's own check: a file that
    passes its hash may still hold any value, and one the run cannot use is named here."""
    value = Path(was) if f.name == "data" and isinstance(was, str) else was
    try:
        check_value(f, value)
    except UsageError as exc:
        moved = _moved_data(was) if f.name == "data" else ""
        raise UsageError(f"--resume {str(ckpt)!r}: the checkpoint's {exc}{moved}") from None
    return value


def _moved_data(was: Any) -> str:
    """The way on for a run whose data folder is gone (moved to another disk): the folder is
    compared through links, so a link at the old place to the new one continues the run."""
    if not isinstance(was, str) or os.path.lexists(was):
        return ""
    return f" (moved? a link at {was!r} to its new place lets the run continue)"


def agree_on_checkpoint(
    ckpts: RunCheckpoints,
    ctx: DistContext,
    read: Callable[[Path], dict[str, Any]],
    say: Callable[[str], None],
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint this rank resumes from, the same step on every rank; None when no rank
    has one.

    A step is also told by whether its epoch is validated: a stop during an epoch's validation
    checkpoints the epoch as trained, not validated, and a rank the stop reached after the
    last collective of that validation holds the validated epoch end of the same step.
    Resumed as they are, one would validate while the other trained on (their collectives
    crossed). Both kinds hold the same trained state (the validation changes no weights, and
    the BatchNorm averaging comes before either is written), so when every rank holds the step
    but not in one kind, every rank resumes from it as trained, not validated
    (:func:`_as_trained`), and all validate it first.

    When the ranks' ``last.pt`` differ otherwise (a rank killed between two writes), every rank
    falls back to the newest step all of them hold (``last.pt`` or the ``prev.pt`` kept beside
    it); the newer ``last.pt`` of a rank that falls back is of steps the others never took, and
    goes. With no step in common the run stops with one line naming the steps. Nothing is
    moved here: a rank that falls back gets ``prev.pt``, and the caller moves it over
    ``last.pt`` once nothing refuses the start.
    """
    last = _read_step(ckpts.last, read, ctx)
    steps = ctx.all_gather_object(_view(last))
    _raise_first_error(steps, last, ctx)
    if all(s is None for s in steps):
        return None
    if len(set(steps)) == 1:
        return ckpts.last, last[1]  # type: ignore[return-value]
    prev = _read_step(ckpts.prev, read, ctx) if ckpts.prev.is_file() else (None, None)
    views = ctx.all_gather_object([_view(last), _view(prev)])
    _raise_first_error([v[1] for v in views], prev, ctx)
    held = [{s for s in v if isinstance(s, tuple)} for v in views]
    common = set.intersection(*held)
    where = ", ".join(f"rank {r}: {_told(v[0])}" for r, v in enumerate(views))
    straddled = _straddled(held, common, [(ckpts.last, last), (ckpts.prev, prev)], ctx)
    if straddled is not None:
        step = straddled[1]["run"]["global_step"]
        say(f"resume: the ranks' checkpoints differ ({where}): a stop came between the ranks' "
            f"ends of the validation at step {step}, and the trained states are the same: all "
            f"resume from step {step} (not validated), and validate it first")  # fmt: skip
        return straddled
    if not common:
        raise UsageError(
            f"--resume: the ranks' checkpoints are of different steps ({where}) and no step is "
            "held by every rank; resuming would train the replicas out of step"
        )
    step = max(common)  # (of one step, its validated epoch end is the newer)
    say(f"resume: the ranks' checkpoints differ ({where}): all resume from {_told(step)}, the "
        "newest step every rank holds")  # fmt: skip
    if last[0] == step:
        return ckpts.last, last[1]  # type: ignore[return-value]
    return ckpts.prev, prev[1]  # type: ignore[return-value]


def _straddled(
    held: list[set[tuple[int, bool]]],
    common: set[tuple[int, bool]],
    reads: list[tuple[Path, tuple[Any, Any]]],
    ctx: DistContext,
) -> tuple[Path, dict[str, Any]] | None:
    """This rank's checkpoint of the newest step every rank holds, but not in one kind (some
    only trained, some only validated), as trained, not validated; None when there is no such
    step newer than the ``common`` ones, or a validated one is not the trained one's epoch end
    (then the steps count as different). Every rank decides from the same gathered views."""
    steps = set.intersection(*({s for s, _ in h} for h in held))
    step = max(steps, default=None)
    if step is None or any(s >= step for s, _ in common):
        return None
    # (a rank that holds both kinds takes the trained one, which needs nothing undone)
    path, saved = next(
        (p, r[1]) for want in (False, True) for p, r in reads if r[0] == (step, want)
    )
    mine = _shape(saved)
    shapes = ctx.all_gather_object(mine)
    trained = next(s for s in shapes if not s["validated"])
    if not all(_ends(s, trained, step) for s in shapes if s["validated"]):
        return None
    if not mine["validated"]:
        return path, saved
    return path, {**saved, "run": _as_trained(saved["run"], trained),
                  "input_factor": trained["factor"]}  # fmt: skip


def _shape(saved: dict[str, Any]) -> dict[str, Any]:
    """What ranks compare of their checkpoints of one step (and what :func:`_as_trained`
    takes from a trained one)."""
    st = RunState.from_state_dict(saved["run"])
    return {
        "validated": not st.validation_due,
        "epoch": st.epoch,
        "step_in_epoch": st.step_in_epoch,
        "steps_per_epoch": st.steps_per_epoch,
        "epoch_fresh": st.epoch_fresh,
        "best_top1": st.best_top1,
        "factors_used": list(st.factors_used),
        "rows": [row.get("step") for row in st.rows if not is_partial(row)],
        "factor": float(saved["input_factor"]),
        "retunes": saved.get("controller") is not None,  # --echo auto: epoch ends retune
    }


def _ends(validated: dict[str, Any], trained: dict[str, Any], step: int) -> bool:
    """Whether ``validated`` is the validated end of the epoch ``trained`` holds as trained,
    not validated: one epoch and one row more, and no echo retune since but, with --echo auto,
    the epoch end's own (the next epoch's length, and a factor added to those used), which the
    resumed validation takes again from the same controller state."""
    same = ("steps_per_epoch", "factors_used", "factor")
    if validated["retunes"]:
        same = ()
        used = validated["factors_used"]
        retuned = used == trained["factors_used"] or used == [*trained["factors_used"], used[-1]]
        if not (retuned and validated["factor"] == used[-1]):
            return False
    return (
        validated["epoch"] == trained["epoch"] + 1
        and validated["step_in_epoch"] == 0
        and validated["rows"] == [*trained["rows"], step]
        and all(validated[k] == trained[k] for k in same)
    )


def _as_trained(run: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """A validated epoch end's run state as it stood before the validation was recorded: the
    epoch's counters as the trained checkpoint holds them, without the epoch's row. The
    rank's own figures (its losses, samples and times) are kept, as the validation left them.
    The input needs no undoing: its reset for the next epoch only zeroes the iterator's
    position in an endless stream, and the resumed validation resets it again. With --echo
    auto the epoch end's retune is undone (the next epoch's length, the factor added; the
    caller takes the trained factor for the input), and the resumed validation takes it again
    from the controller, whose state the validation did not change."""
    st = RunState.from_state_dict(run)
    st.epoch, st.step_in_epoch = trained["epoch"], trained["step_in_epoch"]
    st.epoch_fresh, st.best_top1 = trained["epoch_fresh"], trained["best_top1"]
    st.steps_per_epoch, st.factors_used = trained["steps_per_epoch"], trained["factors_used"]
    st.epoch_wall_s = float(st.rows[-1].get("epoch_s") or 0.0)  # the epoch's time, gone on from
    st.rows = st.rows[:-1]
    return st.state_dict()


def agree_on_file(
    ckpt: Path, ctx: DistContext, read: Callable[[Path], dict[str, Any]]
) -> tuple[Path, dict[str, Any]]:
    """``--resume CKPT`` under torchrun: CKPT names one rank's file (``.../rank<r>/NAME``) and
    each rank resumes its own ``.../rank<rank>/NAME`` (its data shard's state), all of one
    step."""
    ckpt = Path(os.path.abspath(ckpt))  # (a name given inside rank<r>/ has that parent too)
    k = ckpt.parent.name[4:]
    if not (ckpt.parent.name.startswith("rank") and k.isascii() and k.isdigit()):
        if ckpt.is_file():  # one process's checkpoint: refused naming its world size
            read(ckpt)
        raise UsageError(
            f"--resume {str(ckpt)!r}: under torchrun each rank resumes its own checkpoint; give "
            f"one rank's file (.../checkpoints/rank<r>/{ckpt.name}), and every rank takes the "
            "file of that name in its own rank<r>/ folder"
        )
    mine = ckpt.parent.parent / f"rank{ctx.rank}" / ckpt.name
    got = _read_step(mine, read, ctx)
    if got[0] is None:
        got = (UsageError(f"--resume: rank {ctx.rank} has no checkpoint {str(mine)!r}"), None)
    steps = ctx.all_gather_object(_view(got))
    _raise_first_error(steps, got, ctx)
    if len(set(steps)) != 1:
        where = ", ".join(f"rank {r}: {_told(s)}" for r, s in enumerate(steps))
        raise UsageError(
            f"--resume {str(ckpt)!r}: the ranks' files are of different steps ({where}); "
            "resuming would train the replicas out of step"
        )
    return mine, got[1]  # type: ignore[return-value]


def _read_step(
    path: Path, read: Callable[[Path], dict[str, Any]], ctx: DistContext
) -> tuple[Any, Any]:
    """``((step, validated), saved)``, ``(None, None)`` without a file, or
    ``(exception, None)``; ``validated`` is False for an epoch trained but not validated."""
    if not path.is_file():
        return None, None
    try:
        saved = read(path)
        st = RunState.from_state_dict(saved["run"])  # (read() checked its fields)
        return (st.global_step, not st.validation_due), saved
    except (CheckpointError, OSError, UsageError) as exc:
        if not ctx.enabled:
            raise
        return exc, None


class _Refusal(NamedTuple):
    """A rank's refusal of its checkpoint as the other ranks receive it: its type and line
    (which names that rank's file), raised by each as it is."""

    kind: type[Exception]
    line: str


def _view(read: tuple[Any, Any]) -> tuple[int, bool] | _Refusal | None:
    step = read[0]
    return _Refusal(type(step), str(step)) if isinstance(step, BaseException) else step


def _told(view: tuple[int, bool] | None) -> str:
    """A rank's checkpoint as the lines name it: ``step 8``, ``step 8 (not validated)``."""
    if view is None:
        return "step none"
    step, validated = view
    return f"step {step}" + ("" if validated else " (not validated)")


def _raise_first_error(views: list[Any], mine: tuple[Any, Any], ctx: DistContext) -> None:
    if isinstance(mine[0], BaseException):
        raise mine[0]
    for v in views:
        if isinstance(v, _Refusal):
            raise v.kind(v.line)


def restart_entry(
    ckpt: Path, st: RunState, changed: dict[str, list[Any]], notes: list[str]
) -> dict[str, Any]:
    """One restart for ``config.json``'s history."""
    entry: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(sys.argv),
        "from": {"checkpoint": str(ckpt), "epoch": st.epoch, "step": st.global_step},
        "changed": changed,
        "notes": notes,
    }
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        entry["torchelastic_restart"] = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    return entry
