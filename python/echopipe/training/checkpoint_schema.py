"""What a train checkpoint must hold, checked field by field before any of it is used.

A checkpoint's SHA-256 only says the file is the one that was written, and anyone can write a
file that passes it. So every entry the trainer, ``export`` and ``--evaluate`` read is checked
here for type and range, the weights (and momentum buffers) for the names, shapes and dtypes of
the model the checkpoint names, the RNG states by loading them into scratch generators, and the
DALI input state by :mod:`echopipe.dali.state_check` (DALI's reader state included). A failed
check is a :class:`SchemaError` naming the entry; the reader adds the file's name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Any

import numpy as np
import torch

from ..models import MODEL_NAMES, build_model
from .config import TrainConfig
from .schedule import decay_groups
from .state import RunState

__all__ = ["SchemaError", "check_train_state", "expected_weights", "flat_weights"]

_BIG = 1 << 62
_MAX_CLASSES = 1 << 20
_TOP = {
    "kind", "config", "model", "pipeline", "input", "input_builds", "input_counters",
    "input_factor", "controller", "amp_scaler", "rng", "run",
}  # fmt: skip
_PIPELINE = {
    "format", "balance", "stages", "optimizers", "schedulers", "updates_per_stage",
    "scheduler_steps", "steps_fed", "samples_seen", "pipelined", "recompute",
}  # fmt: skip


class SchemaError(ValueError):
    """A checkpoint entry of the wrong type, range, shape or dtype; the message names it."""


def _show(value: Any) -> str:
    if isinstance(value, bool | int | float | type(None)) and len(repr(value)) < 40:
        return repr(value)
    if isinstance(value, str) and len(value) < 40:
        return repr(value)
    return f"a {type(value).__name__}"


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise SchemaError(f"{where} {what}")


def _int(value: Any, where: str, low: int = 0, high: int = _BIG) -> int:
    _need(type(value) is int and low <= value <= high, where,
          f"is {_show(value)}, not an integer in [{low}, {high}]")  # fmt: skip
    return value


def _num(value: Any, where: str, low: float = -math.inf, high: float = math.inf) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and low <= value <= high
    _need(ok, where, f"is {_show(value)}, not a finite number in [{low:g}, {high:g}]")
    return float(value)


def _dict(value: Any, where: str, required: set[str], optional: set[str] | None = None) -> dict:
    _need(isinstance(value, dict), where, f"is {_show(value)}, not a dict")
    missing = sorted(required - set(value))
    _need(not missing, where, f"lacks the entry {missing[0]!r}" if missing else "")
    if optional is not None:
        unknown = sorted(set(value) - required - optional, key=str)
        _need(
            not unknown, where, f"has an unknown entry {str(unknown[0])[:40]!r}" if unknown else ""
        )
    return value


def _list(value: Any, where: str, length: int | None = None) -> list:
    _need(isinstance(value, list), where, f"is {_show(value)}, not a list")
    _need(length is None or len(value) == length, where, f"has {len(value)} entries, not {length}")
    return value


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
            ok = child.isdigit() and int(child) < count
            _need(ok, "pipeline weights", f"have the name {str(key)[:60]!r}")
            out[f"{offset + int(child)}.{rest}"] = value
        offset += count
    return out


def check_weights(weights: dict[str, Any], name: str, num_classes: int, where: str) -> None:
    """``weights`` have exactly the names, shapes and dtypes of the named model."""
    expected = expected_weights(name, num_classes)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    _need(not missing, where, f"lack {missing[0]!r} of {name}" if missing else "")
    _need(not extra, where, f"have {extra[0][:60]!r}, which {name} has not" if extra else "")
    for key, (shape, dtype) in expected.items():
        t = weights[key]
        _need(isinstance(t, torch.Tensor), f"{where} {key!r}", f"is {_show(t)}, not a tensor")
        _need(
            tuple(t.shape) == shape and t.dtype == dtype,
            f"{where} {key!r}",
            f"has shape {tuple(t.shape)} {t.dtype}; {name} with {num_classes} classes has "
            f"{shape} {dtype}",
        )


def _check_pipeline(pipe: Any, model: dict[str, Any]) -> None:
    name, classes = model["name"], model["num_classes"]
    _dict(pipe, "pipeline", _PIPELINE)
    _int(pipe["format"], "pipeline 'format'", 1, 1)
    children = _small(name, 2)[1]
    balance = _list(pipe["balance"], "pipeline 'balance'")
    for b in balance:
        _int(b, "pipeline balance entry", 1, children)
    covered = sum(balance) == children
    _need(covered, "pipeline 'balance'", f"{balance} does not cover {children} blocks")
    n = len(balance)
    for key in ("stages", "optimizers", "schedulers", "updates_per_stage", "scheduler_steps"):
        _list(pipe[key], f"pipeline {key!r}", n)
    for stage in pipe["stages"]:
        _need(isinstance(stage, dict), "pipeline stage", "is not a dict of weights")
    check_weights(flat_weights(pipe), name, classes, "pipeline weights")
    for key in ("updates_per_stage", "scheduler_steps"):
        for v in pipe[key]:
            _int(v, f"pipeline {key!r} entry")
    for key in ("steps_fed", "samples_seen"):
        _int(pipe[key], f"pipeline {key!r}")
    for key in ("pipelined", "recompute"):
        _need(isinstance(pipe[key], bool), f"pipeline {key!r}", "is not true/false")
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
    _dict(state, where, {"state", "param_groups"}, set())
    groups = _list(state["param_groups"], f"{where} 'param_groups'")
    seen: list[int] = []
    for g in groups:
        _dict(g, f"{where} param group", {"params", "lr", "momentum"})
        for key, value in g.items():
            if key == "params":
                seen += [
                    _int(i, f"{where} param index", 0, len(order) - 1) for i in _list(value, where)
                ]
            elif key in ("lr", "momentum", "dampening", "weight_decay", "initial_lr"):
                _num(value, f"{where} {key!r}", 0.0)
            else:
                _need(isinstance(value, bool | type(None) | int | float | str), f"{where} {key!r}",
                      f"is {_show(value)}")  # fmt: skip
    _need(
        sorted(seen) == list(range(len(order))),
        where,
        f"does not cover the {len(order)} parameters",
    )
    entries = _dict(state["state"], f"{where} 'state'", set())
    for index, entry in entries.items():
        _int(index, f"{where} state index", 0, len(order) - 1)
        _dict(entry, f"{where} state {index}", set(), {"momentum_buffer", "step"})
        buf = entry.get("momentum_buffer")
        if buf is None:
            continue
        shape, dtype = shapes[order[index]]
        ok = isinstance(buf, torch.Tensor) and tuple(buf.shape) == shape and buf.dtype == dtype
        _need(ok, f"{where} momentum of {order[index]!r}", f"is not a {shape} {dtype} tensor")


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
    _dict(state, where, {"base_lrs", "last_epoch", "lr_lambdas"}, _SCHEDULER_KEYS)
    for key in ("base_lrs", "_last_lr"):
        for v in _list(state.get(key, []), f"{where} {key!r}"):
            _num(v, f"{where} {key!r} entry", 0.0)
    _int(state["last_epoch"], f"{where} 'last_epoch'", -1)
    _int(state.get("_step_count", 0), f"{where} '_step_count'")
    for v in _list(state["lr_lambdas"], f"{where} 'lr_lambdas'"):
        _need(v is None, f"{where} 'lr_lambdas'", "holds a lambda's state; the trainer's has none")
    for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
        _need(isinstance(state.get(key, False), bool), f"{where} {key!r}", "is not true/false")


def _check_rng(state: Any) -> None:
    """Each RNG state is loaded into a scratch generator: what they accept, the trainer's do."""
    _dict(state, "rng", {"torch", "numpy", "python"}, set())
    try:
        _need(isinstance(state["torch"], torch.Tensor), "rng 'torch'", "is not a tensor")
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
    _dict(run, "run", set(kinds), set())
    for key, value in run.items():
        where = f"run {key!r}"
        if kinds[key] is int:
            _int(value, where)
        elif kinds[key] is float:
            _num(value, where, -1.0)
        elif kinds[key] is str:
            _need(isinstance(value, str) and len(value) <= 64, where, f"is {_show(value)}")
        else:
            _list(value, where)
    st = RunState(**run)
    _need(
        st.steps_per_epoch >= 1 and st.world_size >= 1, "run", "has no steps per epoch or replicas"
    )
    _need(st.step_in_epoch <= st.steps_per_epoch, "run 'step_in_epoch'",
          f"is {st.step_in_epoch}, past the epoch's {st.steps_per_epoch} steps")  # fmt: skip
    for seg in st.epoch_clock:
        _need(isinstance(seg, list | tuple) and len(seg) == 3, "run 'epoch_clock'", "is damaged")
        _int(seg[0], "run 'epoch_clock' step")
        _num(seg[1], "run 'epoch_clock' epoch", 0.0)
        _num(seg[2], "run 'epoch_clock' rate", 0.0)
    for seg in st.schedule_warp:
        _need(isinstance(seg, list | tuple) and len(seg) == 3, "run 'schedule_warp'", "is damaged")
        for v in seg:
            _num(v, "run 'schedule_warp' entry", 0.0)
    for factor in st.factors_used:
        _num(factor, "run 'factors_used' entry", 1.0, 65535.0)
    for row in st.rows:
        _dict(row, "run metrics row", set())
        for key, value in row.items():
            ok = isinstance(key, str) and isinstance(value, bool | int | float | str | type(None))
            _need(ok, "run metrics row", f"entry {str(key)[:40]!r} is {_show(value)}")
    return st


def _check_small_parts(state: dict[str, Any], config: dict[str, Any]) -> None:
    _int(state["input_builds"], "input_builds")
    counters = _dict(state["input_counters"], "input_counters",
                     {"fresh", "echoed", "samples", "up_s", "up_iters"}, set())  # fmt: skip
    for key, value in counters.items():
        _num(value, f"input_counters {key!r}", 0.0) if key == "up_s" else _int(value, key)
    _num(state["input_factor"], "input_factor", 1.0, 65535.0)
    auto = config.get("echo") == "auto" and not config.get("deterministic")
    c = state["controller"]
    _need((c is not None) == auto, "controller", "does not match the run's --echo")
    if c is not None:
        _dict(c, "controller", {"factor", "observations", "t_up", "t_down", "history"},
              {"below", "below_target", "above", "above_target", "t_aug"})  # fmt: skip
        _num(c["factor"], "controller 'factor'", 1.0, 65535.0)
        _int(c["observations"], "controller 'observations'")
        _int(c.get("below", 0), "controller 'below'")
        _int(c.get("above", 0), "controller 'above'")
        for key in ("below_target", "above_target"):
            _num(c.get(key, 0.0), f"controller {key!r}", 0.0)
        for key in ("t_up", "t_down", "t_aug"):
            _need(c.get(key) is None or _num(c[key], f"controller {key!r}", 0.0) >= 0, key, "")
        for h in _list(c["history"], "controller 'history'"):
            _dict(h, "controller history entry", {"step", "factor", "ratio"}, set())
            _int(h["step"], "controller history 'step'")
            _num(h["factor"], "controller history 'factor'", 1.0, 65535.0)
            ratio = h["ratio"]
            if not (isinstance(ratio, float) and math.isnan(ratio)):  # nan: not measured yet
                _num(ratio, "controller history 'ratio'", 0.0)
    s = state["amp_scaler"]
    _need((s is not None) == (config.get("amp") == "fp16"), "amp_scaler", "does not match --amp")
    if s is not None:
        _dict(s, "amp_scaler", {"scale", "good_updates", "skipped"}, set())
        _num(s["scale"], "amp_scaler 'scale'", 2.0**-126, 2.0**126)
        _int(s["good_updates"], "amp_scaler 'good_updates'")
        _int(s["skipped"], "amp_scaler 'skipped'")


def _check_config(config: Any) -> dict[str, Any]:
    """The options the run was written with: every option a resume must keep is there."""
    fixed = {
        f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("on_resume") == "fixed"
    }
    _dict(config, "config", fixed)
    _check_option_values(config, "config")
    return config


def _check_option_values(options: dict[str, Any], where: str) -> None:
    """Each entry is an option's name with a plain value (or a list of plain values)."""
    for key, value in options.items():
        items = value if isinstance(value, list) else [value]
        ok = isinstance(key, str) and all(
            isinstance(v, bool | int | float | str | type(None)) for v in items
        )
        _need(ok, f"{where} {str(key)[:40]!r}", f"is {_show(value)}, not an option value")


def check_model(model: Any) -> tuple[str, int]:
    """``(name, num_classes)`` of the checkpoint's ``model`` entry."""
    _dict(model, "model", {"name", "num_classes"}, set())
    _need(model["name"] in MODEL_NAMES, "model 'name'", f"{_show(model['name'])} is not a model")
    return model["name"], _int(model["num_classes"], "model 'num_classes'", 1, _MAX_CLASSES)


def check_train_state(state: Any) -> None:
    """Check every entry of a decoded train checkpoint that a resume, ``export`` or
    ``--evaluate`` reads.

    Raises:
        SchemaError: names the first entry of the wrong type, range, shape or dtype.
    """
    _dict(state, "the checkpoint", _TOP)
    _need(
        state["kind"] == "echopipe-train", "the checkpoint", "is not an echopipe train checkpoint"
    )
    config = _check_config(state["config"])
    if "options" in state:  # every option (the run's own, merged on a resume)
        _check_option_values(_dict(state["options"], "options", set()), "options")
    name, _ = check_model(state["model"])
    _need(config.get("model", name) == name, "model 'name'", f"{name!r} is not config's model")
    _check_pipeline(state["pipeline"], state["model"])
    run = _check_run(state["run"])
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
    _need(step <= run.steps_per_epoch, "input iterator 'step_in_epoch'",
          f"is {step}, past the epoch's {run.steps_per_epoch} steps")  # fmt: skip
