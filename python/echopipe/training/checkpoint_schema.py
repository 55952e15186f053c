"""What a train checkpoint must hold, checked field by field before any of it is used.

A checkpoint's SHA-256 only says the file is the one that was written, and anyone can write a
file that passes it. So every entry the trainer, ``export`` and ``--evaluate`` read is checked
here for type and range, the weights (and momentum buffers) for the names, shapes and dtypes of
the model the checkpoint names, the RNG states by loading them into scratch generators, and the
DALI input state by :mod:`echopipe.dali.state_check` (DALI's reader state included). A failed
check is a :class:`~.schema_values.SchemaError` naming the entry (the checks it is made of are
:mod:`.schema_values`); the reader adds the file's name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Any

import numpy as np
import torch

from ..echo.config import MAX_ECHO_FACTOR
from ..echo.controller import PAUSE_WINDOW
from ..models import MODEL_NAMES, build_model
from .config import TrainConfig
from .file_list import check_file_list_entry
from .schedule import decay_groups
from .schema_values import (
    SchemaError,
    check_dict,
    check_int,
    check_list,
    check_num,
    need,
    show,
)
from .state import RunState

__all__ = ["check_train_state", "expected_weights", "flat_weights"]

_MAX_CLASSES = 1 << 20
_TOP = {
    "kind", "config", "model", "pipeline", "input", "input_builds", "input_counters",
    "input_factor", "controller", "amp_scaler", "rng", "run",
}  # fmt: skip
_PIPELINE = {
    "format", "balance", "stages", "optimizers", "schedulers", "updates_per_stage",
    "scheduler_steps", "steps_fed", "samples_seen", "pipelined", "recompute",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The model's weights
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _small(name: str, classes: int) -> tuple[dict[str, tuple[tuple[int, ...], Any]], int]:
    """``({key: (shape, dtype)}, number of blocks)`` of a small build of the model."""
    model = build_model(name, num_classes=classes)
    state = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    return state, len(model)


@functools.lru_cache(maxsize=32)
def _param_order(name: str, first: int, count: int) -> tuple[str, ...]:
    """Names of the parameters of blocks ``first .. first + count - 1``, by the index the
    trainer's optimizer gives them (its groups: :func:`~.schedule.decay_groups`)."""
    model = build_model(name, num_classes=2)
    named = [
        (n, p) for n, p in model.named_parameters() if first <= int(n.split(".")[0]) < first + count
    ]
    by_id = {id(p): n for n, p in named}
    return tuple(by_id[id(p)] for group in decay_groups([p for _, p in named]) for p in group)


def expected_weights(name: str, num_classes: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{key: (shape, dtype)}`` of ``build_model(name, num_classes).state_dict()``, found
    without building that model: the dimensions that differ between a 2- and a 3-class build
    are the class count's. A file's class count cannot make the reader allocate."""
    two, three = _small(name, 2)[0], _small(name, 3)[0]
    out = {}
    for key, (shape, dtype) in two.items():
        other = three[key][0]
        dims = tuple(
            num_classes if (a, b) == (2, 3) else a for a, b in zip(shape, other, strict=True)
        )
        out[key] = (dims, dtype)
    return out


def flat_weights(pipeline: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The pipeline's per-stage weights under the flat model's names (``<block>.<name>``), the
    ``--amp`` wrapper's ``block.`` level removed."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for count, stage in zip(pipeline["balance"], pipeline["stages"], strict=True):
        for key, value in stage.items():
            child, _, rest = str(key).partition(".")
            if rest.startswith("block."):  # the autocast wrapper of --amp
                rest = rest[len("block.") :]
            ok = child.isascii() and child.isdigit() and int(child) < count
            need(ok, "pipeline weights", f"have the name {str(key)[:60]!r}")
            out[f"{offset + int(child)}.{rest}"] = value
        offset += count
    return out


def check_weights(weights: dict[str, Any], name: str, num_classes: int, where: str) -> None:
    """``weights`` have exactly the names, shapes and dtypes of the named model."""
    expected = expected_weights(name, num_classes)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    need(not missing, where, f"lack {missing[0]!r} of {name}" if missing else "")
    need(not extra, where, f"have {extra[0][:60]!r}, which {name} has not" if extra else "")
    for key, (shape, dtype) in expected.items():
        t = weights[key]
        need(isinstance(t, torch.Tensor), f"{where} {key!r}", f"is {show(t)}, not a tensor")
        need(
            tuple(t.shape) == shape and t.dtype == dtype,
            f"{where} {key!r}",
            f"has shape {tuple(t.shape)} {t.dtype}; {name} with {num_classes} classes has "
            f"{shape} {dtype}",
        )


def _check_pipeline(pipe: Any, model: dict[str, Any]) -> None:
    name, classes = model["name"], model["num_classes"]
    check_dict(pipe, "pipeline", _PIPELINE)
    check_int(pipe["format"], "pipeline 'format'", 1, 1)
    children = _small(name, 2)[1]
    balance = check_list(pipe["balance"], "pipeline 'balance'")
    for b in balance:
        check_int(b, "pipeline balance entry", 1, children)
    covered = sum(balance) == children
    need(covered, "pipeline 'balance'", f"{balance} does not cover {children} blocks")
    n = len(balance)
    for key in ("stages", "optimizers", "schedulers", "updates_per_stage", "scheduler_steps"):
        check_list(pipe[key], f"pipeline {key!r}", n)
    for stage in pipe["stages"]:
        need(isinstance(stage, dict), "pipeline stage", "is not a dict of weights")
    check_weights(flat_weights(pipe), name, classes, "pipeline weights")
    for key in ("updates_per_stage", "scheduler_steps"):
        for v in pipe[key]:
            check_int(v, f"pipeline {key!r} entry")
    for key in ("steps_fed", "samples_seen"):
        check_int(pipe[key], f"pipeline {key!r}")
    for key in ("pipelined", "recompute"):
        need(isinstance(pipe[key], bool), f"pipeline {key!r}", "is not true/false")
    shapes = expected_weights(name, classes)
    offset = 0
    for i, count in enumerate(balance):
        order = _param_order(name, offset, count)
        _check_optimizer(pipe["optimizers"][i], order, shapes, f"pipeline optimizer {i}")
        _check_scheduler(pipe["schedulers"][i], f"pipeline scheduler {i}")
        offset += count


def _check_optimizer(state: Any, order: tuple[str, ...], shapes: dict, where: str) -> None:
    """SGD's state: numeric hyper-parameters, every parameter once, momentum buffers of the
    parameters' shapes (a wrong one would fail only at the next step, mid-run)."""
    if state is None:
        return
    check_dict(state, where, {"state", "param_groups"}, set())
    groups = check_list(state["param_groups"], f"{where} 'param_groups'")
    seen: list[int] = []
    for g in groups:
        check_dict(g, f"{where} param group", {"params", "lr", "momentum"})
        for key, value in g.items():
            if key == "params":
                seen += [
                    check_int(i, f"{where} param index", 0, len(order) - 1)
                    for i in check_list(value, where)
                ]
            elif key in ("lr", "momentum", "dampening", "weight_decay", "initial_lr"):
                check_num(value, f"{where} {key!r}", 0.0)
            else:
                need(isinstance(value, bool | type(None) | int | float | str), f"{where} {key!r}",
                      f"is {show(value)}")  # fmt: skip
    need(
        sorted(seen) == list(range(len(order))),
        where,
        f"does not cover the {len(order)} parameters",
    )
    entries = check_dict(state["state"], f"{where} 'state'", set())
    for index, entry in entries.items():
        check_int(index, f"{where} state index", 0, len(order) - 1)
        check_dict(entry, f"{where} state {index}", set(), {"momentum_buffer", "step"})
        buf = entry.get("momentum_buffer")
        if buf is None:
            continue
        shape, dtype = shapes[order[index]]
        ok = isinstance(buf, torch.Tensor) and tuple(buf.shape) == shape and buf.dtype == dtype
        need(ok, f"{where} momentum of {order[index]!r}", f"is not a {shape} {dtype} tensor")


_SCHEDULER_KEYS = {
    "base_lrs", "last_epoch", "lr_lambdas", "_step_count", "_is_initial",
    "_get_lr_called_within_step", "_last_lr", "verbose",
}  # fmt: skip
"""What ``LambdaLR.state_dict`` holds (``verbose`` in older torch releases)."""


def _check_scheduler(state: Any, where: str) -> None:
    """LambdaLR's state: ``load_state_dict`` copies every entry onto the scheduler, so only its
    own entries are accepted, and no lambda state (it would be copied onto the trainer's)."""
    if state is None:
        return
    check_dict(state, where, {"base_lrs", "last_epoch", "lr_lambdas"}, _SCHEDULER_KEYS)
    for key in ("base_lrs", "_last_lr"):
        for v in check_list(state.get(key, []), f"{where} {key!r}"):
            check_num(v, f"{where} {key!r} entry", 0.0)
    check_int(state["last_epoch"], f"{where} 'last_epoch'", -1)
    check_int(state.get("_step_count", 0), f"{where} '_step_count'")
    for v in check_list(state["lr_lambdas"], f"{where} 'lr_lambdas'"):
        need(v is None, f"{where} 'lr_lambdas'", "holds a lambda's state; the trainer's has none")
    for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
        need(isinstance(state.get(key, False), bool), f"{where} {key!r}", "is not true/false")


def _check_rng(state: Any) -> None:
    """Each RNG state is loaded into a scratch generator: what they accept, the trainer's do."""
    check_dict(state, "rng", {"torch", "numpy", "python"}, set())
    try:
        need(isinstance(state["torch"], torch.Tensor), "rng 'torch'", "is not a tensor")
        torch.Generator().set_state(state["torch"])
        np.random.RandomState().set_state(state["numpy"])
        random.Random().setstate(state["python"])
    except (TypeError, ValueError, RuntimeError, IndexError, OverflowError, KeyError) as exc:
        raise SchemaError(f"rng holds an unusable random-number state ({exc})") from None


def _check_run(run: Any) -> RunState:
    """Each :class:`RunState` field has its default's type; counters are in range."""
    kinds = {}
    for f in dataclasses.fields(RunState):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kinds[f.name] = type(default)
    check_dict(run, "run", set(kinds) - RunState.LATER_FIELDS, set(RunState.LATER_FIELDS))
    for key, value in run.items():
        where = f"run {key!r}"
        if kinds[key] is int:
            check_int(value, where)
        elif kinds[key] is float:
            check_num(value, where, -1.0)
        elif kinds[key] is str:
            need(isinstance(value, str) and len(value) <= 64, where, f"is {show(value)}")
        else:
            check_list(value, where)
    st = RunState(**run)
    need(
        st.steps_per_epoch >= 1 and st.world_size >= 1, "run", "has no steps per epoch or replicas"
    )
    need(st.step_in_epoch <= st.steps_per_epoch, "run 'step_in_epoch'",
          f"is {st.step_in_epoch}, past the epoch's {st.steps_per_epoch} steps")  # fmt: skip
    for seg in st.epoch_clock:
        need(isinstance(seg, list | tuple) and len(seg) == 3, "run 'epoch_clock'", "is damaged")
        check_int(seg[0], "run 'epoch_clock' step")
        check_num(seg[1], "run 'epoch_clock' epoch", 0.0)
        check_num(seg[2], "run 'epoch_clock' rate", 0.0)
    for seg in st.schedule_warp:
        need(isinstance(seg, list | tuple) and len(seg) == 3, "run 'schedule_warp'", "is damaged")
        for v in seg:
            check_num(v, "run 'schedule_warp' entry", 0.0)
    for factor in st.factors_used:
        check_num(factor, "run 'factors_used' entry", 1.0, MAX_ECHO_FACTOR)
    for row in st.rows:
        check_dict(row, "run metrics row", set())
        for key, value in row.items():
            ok = isinstance(key, str) and isinstance(value, bool | int | float | str | type(None))
            need(ok, "run metrics row", f"entry {str(key)[:40]!r} is {show(value)}")
    return st


def _check_small_parts(state: dict[str, Any], config: dict[str, Any]) -> None:
    check_int(state["input_builds"], "input_builds")
    counters = check_dict(state["input_counters"], "input_counters",
                     {"fresh", "echoed", "samples", "up_s", "up_iters"}, set())  # fmt: skip
    for key, value in counters.items():
        check_num(value, f"input_counters {key!r}", 0.0) if key == "up_s" else check_int(value, key)
    check_num(state["input_factor"], "input_factor", 1.0, MAX_ECHO_FACTOR)
    auto = config.get("echo") == "auto" and not config.get("deterministic")
    c = state["controller"]
    need((c is not None) == auto, "controller", "does not match the run's --echo")
    if c is not None:
        optional = {"below", "below_target", "above", "above_target", "t_aug", "pauses"}
        check_dict(c, "controller", {"factor", "observations", "t_up", "t_down", "history"},
                   optional)  # fmt: skip
        check_num(c["factor"], "controller 'factor'", 1.0, MAX_ECHO_FACTOR)
        check_int(c["observations"], "controller 'observations'")
        check_int(c.get("below", 0), "controller 'below'")
        check_int(c.get("above", 0), "controller 'above'")
        for key in ("below_target", "above_target"):
            check_num(c.get(key, 0.0), f"controller {key!r}", 0.0)
        for key in ("t_up", "t_down", "t_aug"):
            need(c.get(key) is None or check_num(c[key], f"controller {key!r}", 0.0) >= 0, key, "")
        pauses = check_list(c.get("pauses", []), "controller 'pauses'")
        need(len(pauses) <= PAUSE_WINDOW, "controller 'pauses'", f"holds {len(pauses)} entries")
        for v in pauses:
            check_num(v, "controller 'pauses' entry", 0.0)
        for h in check_list(c["history"], "controller 'history'"):
            check_dict(h, "controller history entry", {"step", "factor", "ratio"}, set())
            check_int(h["step"], "controller history 'step'")
            check_num(h["factor"], "controller history 'factor'", 1.0, MAX_ECHO_FACTOR)
            ratio = h["ratio"]
            if not (isinstance(ratio, float) and math.isnan(ratio)):  # nan: not measured yet
                check_num(ratio, "controller history 'ratio'", 0.0)
    s = state["amp_scaler"]
    need((s is not None) == (config.get("amp") == "fp16"), "amp_scaler", "does not match --amp")
    if s is not None:
        check_dict(s, "amp_scaler", {"scale", "good_updates", "skipped"}, set())
        check_num(s["scale"], "amp_scaler 'scale'", 2.0**-126, 2.0**126)
        check_int(s["good_updates"], "amp_scaler 'good_updates'")
        check_int(s["skipped"], "amp_scaler 'skipped'")


def _check_config(config: Any) -> dict[str, Any]:
    """The options the run was written with: every option a resume must keep is there."""
    fixed = {
        f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("on_resume") == "fixed"
    }
    check_dict(config, "config", fixed)
    _check_option_values(config, "config")
    return config


def _check_option_values(options: dict[str, Any], where: str) -> None:
    """Each entry is an option's name with a plain value (or a list of plain values)."""
    for key, value in options.items():
        items = value if isinstance(value, list) else [value]
        ok = isinstance(key, str) and all(
            isinstance(v, bool | int | float | str | type(None)) for v in items
        )
        need(ok, f"{where} {str(key)[:40]!r}", f"is {show(value)}, not an option value")


def check_model(model: Any) -> tuple[str, int]:
    """``(name, num_classes)`` of the checkpoint's ``model`` entry."""
    check_dict(model, "model", {"name", "num_classes"}, set())
    need(model["name"] in MODEL_NAMES, "model 'name'", f"{show(model['name'])} is not a model")
    return model["name"], check_int(model["num_classes"], "model 'num_classes'", 1, _MAX_CLASSES)


def check_train_state(state: Any) -> None:
    """Check every entry of a decoded train checkpoint that a resume, ``export`` or
    ``--evaluate`` reads.

    Raises:
        SchemaError: names the first entry of the wrong type, range, shape or dtype.
    """
    check_dict(state, "the checkpoint", _TOP)
    need(state["kind"] == "echopipe-train", "the checkpoint", "is not an echopipe train checkpoint")
    config = _check_config(state["config"])
    if "options" in state:  # every option (the run's own, merged on a resume)
        _check_option_values(check_dict(state["options"], "options", set()), "options")
    name, _ = check_model(state["model"])
    need(config.get("model", name) == name, "model 'name'", f"{name!r} is not config's model")
    _check_pipeline(state["pipeline"], state["model"])
    run = _check_run(state["run"])
    if "train_files" in state:  # checkpoints written before the file list was recorded lack it
        check_file_list_entry(state["train_files"])
    _check_rng(state["rng"])
    _check_small_parts(state, config)
    try:
        from ..dali.state_check import DaliStateError, check_iterator_state
    except ModuleNotFoundError:
        # Without DALI (``export`` needs none) nothing can use the input state; a resume, which
        # restores it, runs with DALI and so checks it here.
        return
    try:
        check_iterator_state(state["input"], "input")
    except DaliStateError as exc:
        raise SchemaError(str(exc)) from None
    step = state["input"]["iterator"]["step_in_epoch"]
    need(step <= run.steps_per_epoch, "input iterator 'step_in_epoch'",
          f"is {step}, past the epoch's {run.steps_per_epoch} steps")  # fmt: skip
