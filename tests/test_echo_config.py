"""One echo configuration: each field's bound (the native core's), one typed error, and no other
module writing an echo-factor bound."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from echopipe.dali import EchoPipelineConfig, EchoSpec, echo, echo_pipeline_def
from echopipe.echo import EchoCache, EchoConfig, EchoConfigError
from echopipe.echo.config import (
    MAX_CAPACITY_BYTES,
    MAX_CAPACITY_SAMPLES,
    MAX_ECHO_FACTOR,
    MAX_EPOCH_SIZE,
    MAX_SEED,
    MIN_CAPACITY_BYTES,
    check_factor,
)
from echopipe.native import core

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "echopipe"

GOOD: dict[str, list[Any]] = {
    "factor": [1, 1.0, 2.5, MAX_ECHO_FACTOR, np.float32(3.0), "auto"],
    "factor_max": [1.0, 4, MAX_ECHO_FACTOR],
    "placement": ["after_decode", "after_augment"],
    "mode": ["example", "batch"],
    "shuffle_buffer": [None, 0, 64, MAX_CAPACITY_SAMPLES],
    "cache_bytes": [MIN_CAPACITY_BYTES, 256 << 20],
    "memory": ["auto", "pageable", "pinned", "device"],
}
BAD: dict[str, list[Any]] = {
    "factor": [0.5, 0, MAX_ECHO_FACTOR + 1, math.nan, math.inf, True, "2", None, "Auto"],
    "factor_max": [0.99, MAX_ECHO_FACTOR + 1, 1e9, "auto", math.inf, False],
    "placement": ["before_decode", None, 1],
    "mode": ["examples", "", None],
    "shuffle_buffer": [-1, MAX_CAPACITY_SAMPLES + 1, 1.5, True],
    "cache_bytes": [MIN_CAPACITY_BYTES - 1, 0, -1, 1.0e6, None],
    "memory": ["host", "cuda", None],
}


def test_the_bounds_are_the_native_cores() -> None:
    assert (MAX_ECHO_FACTOR, MIN_CAPACITY_BYTES) == (core.MAX_ECHO_FACTOR, core.MIN_CAPACITY_BYTES)
    assert (MAX_CAPACITY_SAMPLES, MAX_EPOCH_SIZE) == (
        core.MAX_CAPACITY_SAMPLES,
        core.MAX_EPOCH_SIZE,
    )
    assert MAX_ECHO_FACTOR == 65535  # the tickets' 16 bits
    # The core itself takes the largest factor and refuses the next one.
    kwargs = dict(capacity_bytes=1 << 12, capacity_samples=8, min_fill=0, seed=0, mode="example")
    kwargs.update(batch_size=1, memory="pageable", epoch_size=0)
    native = core.EchoCache(echo_factor=MAX_ECHO_FACTOR, name="cfg-bound", **kwargs)
    native.close()
    core.remove_cache("cfg-bound")
    with pytest.raises(ValueError):
        core.EchoCache(echo_factor=MAX_ECHO_FACTOR + 1, name="cfg-over", **kwargs)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_field_takes_the_values_in_its_bound(name: str) -> None:
    for value in GOOD[name]:
        config = EchoConfig(**{name: value})
        assert getattr(config, name) == value
        assert EchoConfig.check_field(name, value) == value


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_field_refuses_values_out_of_its_bound_naming_field_and_value(name: str) -> None:
    for value in BAD[name]:
        with pytest.raises(EchoConfigError) as caught:
            EchoConfig(**{name: value})
        assert caught.value.field == name and caught.value.value is value
        assert str(caught.value).startswith(f"{name} must be ")
        assert str(caught.value).endswith(f"got {value!r}")
        with pytest.raises(EchoConfigError):
            EchoConfig.check_field(name, value)


def test_the_error_is_a_value_error_and_a_label_names_the_callers_option() -> None:
    assert issubclass(EchoConfigError, ValueError)
    with pytest.raises(EchoConfigError) as caught:
        EchoConfig.check_field("factor_max", 1e9, "--echo-max")
    assert caught.value.field == "--echo-max"
    assert str(caught.value) == f"--echo-max must be a finite number in [1, 65535], got {1e9!r}"
    with pytest.raises(KeyError, match="no field 'echo'"):
        EchoConfig.check_field("echo", 2.0)


def test_a_factor_is_made_a_float_and_auto_only_where_allowed() -> None:
    assert EchoConfig(factor=3).factor == 3.0 and isinstance(EchoConfig(factor=3).factor, float)
    assert EchoConfig().adaptive and not EchoConfig(factor=2).adaptive
    assert check_factor("auto", allow_auto=True) == "auto"
    with pytest.raises(EchoConfigError, match="echo_factor must be a finite number"):
        check_factor("auto", "echo_factor")


def test_every_field_has_a_default_and_a_help_text() -> None:
    config = EchoConfig()
    for f in dataclasses.fields(EchoConfig):
        assert f.default is not dataclasses.MISSING, f.name
        assert getattr(config, f.name) == f.default
        assert EchoConfig.help(f.name) and len(EchoConfig.help(f.name)) > 10, f.name
    assert EchoConfig.help("factor") == dataclasses.fields(EchoConfig)[0].metadata["help"]


def test_a_factor_just_over_the_native_bound_is_refused_before_any_cache_is_made() -> None:
    over = MAX_ECHO_FACTOR + 0.5
    before = set(core.cache_names())
    with pytest.raises(EchoConfigError, match="echo_factor"):
        EchoCache(capacity_bytes=1 << 12, capacity_samples=8, echo_factor=over)
    with pytest.raises(EchoConfigError, match="echo_factor"):
        EchoSpec(echo_factor=over)

    @echo_pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def random_pairs() -> Any:
        from nvidia.dali import fn

        a, b = echo(fn.random.uniform(shape=[2]), fn.random.uniform(shape=[1]))
        return a, b

    with pytest.raises(EchoConfigError, match="echo_factor"):
        random_pairs(echo_factor=over)
    assert set(core.cache_names()) == before
    cache = EchoCache(capacity_bytes=1 << 12, capacity_samples=8, echo_factor=2.0)
    try:
        with pytest.raises(EchoConfigError, match="echo_factor"):
            cache.echo_factor = over
        assert cache.echo_factor == 2.0
    finally:
        cache.close()


def test_a_pipeline_config_takes_a_factor_but_not_auto() -> None:
    resolved = EchoPipelineConfig(batch_size=4, echo=EchoConfig(factor=3)).resolved()
    assert resolved.echo.factor == 3.0 and resolved.echo.shuffle_buffer == 16
    with pytest.raises(EchoConfigError, match="echo_factor must be a finite number"):
        EchoPipelineConfig(batch_size=4, echo=EchoConfig(factor="auto")).resolved()


def test_a_pipeline_functions_factor_error_does_not_offer_auto() -> None:
    @echo_pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def noise() -> Any:
        from nvidia.dali import fn

        return echo(fn.random.uniform(shape=[2]))

    for bad in (0.5, "auto"):
        with pytest.raises(EchoConfigError) as caught:
            noise(echo_factor=bad)
        want = f"echo_factor must be a finite number in [1, 65535], got {bad!r}"
        assert str(caught.value) == want


@pytest.mark.parametrize(
    ("name", "value", "bound"),
    [
        ("capacity_bytes", MAX_CAPACITY_BYTES + 1, f"[{MIN_CAPACITY_BYTES}, {MAX_CAPACITY_BYTES}]"),
        ("capacity_samples", MAX_CAPACITY_SAMPLES + 1, f"[1, {MAX_CAPACITY_SAMPLES}]"),
        ("min_fill", 1 << 64, f"[0, {MAX_CAPACITY_SAMPLES}]"),
        ("seed", MAX_SEED + 1, f"[0, {MAX_SEED}]"),
        ("seed", -1, f"[0, {MAX_SEED}]"),
        ("epoch_size", MAX_EPOCH_SIZE + 1, f"[0, {MAX_EPOCH_SIZE}]"),
        ("batch_size", "x", f"[1, {MAX_CAPACITY_SAMPLES}]"),
        ("batch_size", 0, f"[1, {MAX_CAPACITY_SAMPLES}]"),
    ],
)
def test_the_cache_refuses_an_integer_past_the_cores_by_its_argument(
    name: str, value: int, bound: str
) -> None:
    """Integers the core's C types cannot hold (a seed of 2**64) are refused by name and value,
    not by pybind's dump of the constructor's signature, and no cache is made."""
    before = set(core.cache_names())
    with pytest.raises(EchoConfigError) as caught:
        EchoCache(**{"capacity_bytes": 1 << 12, "capacity_samples": 8, name: value})
    assert str(caught.value) == f"{name} must be an integer in {bound}, got {value!r}"
    assert set(core.cache_names()) == before


def test_the_cache_names_a_memory_or_name_of_the_wrong_type_and_takes_the_largest_seed() -> None:
    small: dict[str, Any] = {"capacity_bytes": 1 << 12, "capacity_samples": 8}
    with pytest.raises(ValueError, match=r"^memory must be one of 'auto', .*, got None$"):
        EchoCache(**small, memory=None)
    with pytest.raises(TypeError, match=r"^name must be a str or None, got 5 \(int\)$"):
        EchoCache(**small, name=5)
    EchoCache(**small, seed=MAX_SEED).close()


def test_an_arena_larger_than_the_machine_is_a_memory_error_naming_capacity_bytes() -> None:
    """The core cannot map the arena (a RuntimeError of its own): that is the machine's memory,
    the MemoryError a caller (the train command) catches, naming the argument and the bytes."""
    before = set(core.cache_names())
    with pytest.raises(MemoryError) as caught:
        EchoCache(capacity_bytes=MAX_CAPACITY_BYTES, capacity_samples=8, memory="pageable")
    assert str(caught.value).startswith(f"capacity_bytes={MAX_CAPACITY_BYTES}: no memory for ")
    assert "\n" not in str(caught.value)
    assert set(core.cache_names()) == before


# The echo core's bounds as Python might spell them: the factor's 16 bits, the slot and epoch
# limits (2^31 - 1 and 2^40), or a constant of its own.
BOUND_LITERALS = re.compile(
    r"65535|0xffff\b|2147483647|MAX_ECHO\w*\s*(?::\s*\w+\s*)?=\s*[\d.]+"
    r"|1\s*<<\s*(?:31|40)\b|2\s*\*\*\s*(?:31|40)\b",
    re.IGNORECASE,
)
#: Lines that write one of those numbers for something that is not the echo core's, and what.
OTHER_BOUNDS = {
    ("dali/state_check.py", "_MINSTD_MODULUS = 2**31 - 1"): "the modulus of DALI's reader RNG",
    ("dali/state_check.py", 'f"{here} field {number}", 0, 1 << 40)'): "DALI reader counters",
    ("dali/state_check.py", "_DALI_SHARDS_MAX = 1 << 31"): "DALI's shard count type",
}


def test_no_other_module_writes_an_echo_core_bound() -> None:
    writers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if BOUND_LITERALS.search(line) and not any(
                name == where and text in line for where, text in OTHER_BOUNDS
            ):
                writers.append(f"{name}:{number}: {line.strip()}")
    assert writers == []
    # Each exception is still there (so it cannot outlive the line it excuses).
    for where, text in OTHER_BOUNDS:
        assert text in (PACKAGE / where).read_text(encoding="utf-8"), (where, text)
    # The pattern finds the spellings it is meant to find.
    for spelled in ("e <= 65535", "MAX_ECHO = 100.0", "0, 1 << 40)", "2**31 - 1", "0xFFFF"):
        assert BOUND_LITERALS.search(spelled), spelled


def test_the_train_options_are_the_echo_config_fields_and_convert_mib_once() -> None:
    from echopipe.training.config import TrainConfig

    cfg = TrainConfig()
    assert cfg.echo_config() == EchoConfig()  # every default is EchoConfig's
    cfg = TrainConfig(echo=2.5, echo_max=8.0, echo_insert="after_augment", echo_mode="batch",
                      shuffle_buffer=12, cache_mb=3)  # fmt: skip
    assert cfg.echo_config() == EchoConfig(
        factor=2.5, factor_max=8.0, placement="after_augment", mode="batch", shuffle_buffer=12,
        cache_bytes=3 << 20,
    )  # fmt: skip
    options = {f.name: f.metadata for f in dataclasses.fields(TrainConfig) if f.metadata["echo"]}
    assert {m["echo"][0] for m in options.values()} == {
        "factor", "factor_max", "placement", "mode", "shuffle_buffer", "cache_bytes"
    }  # fmt: skip
    for meta in options.values():
        assert meta["help"].startswith(EchoConfig.help(meta["echo"][0]))


def test_the_builder_takes_an_echo_config_as_it_is(tiny_imagenet: Path) -> None:
    from echopipe.dali import imagenet_train_pipeline

    config = EchoConfig(factor=3, placement="after_augment", shuffle_buffer=8, cache_bytes=1 << 22)
    with imagenet_train_pipeline(
        tiny_imagenet, batch_size=4, echo=config, image_size=32, num_threads=1, epochs=1
    ) as pipe:
        assert pipe.config.echo == dataclasses.replace(config, memory=pipe.config.echo.memory)
        assert pipe.config.epochs == 1 and pipe.cache.echo_factor == 3.0
    with pytest.raises(EchoConfigError, match="echo_factor must be a finite number"):
        imagenet_train_pipeline(tiny_imagenet, batch_size=4, echo=EchoConfig(factor="auto"))


def test_a_pipeline_functions_seed_is_bounded_before_dali_gets_it() -> None:
    """DALI's seeds are signed 64-bit and the pair's downstream pipeline takes seed + 1: a seed
    past MAX_PAIR_SEED is refused by name, not as DALI's overflow; a builder's largest seed
    plus a shard id is taken."""
    from echopipe.dali.builder_checks import MAX_PAIR_SEED, MAX_PIPELINE_SEED

    @echo_pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def noise() -> Any:
        from nvidia.dali import fn

        return echo(fn.random.uniform(shape=[2]))

    with pytest.raises(
        EchoConfigError, match=f"seed must be an integer in \\[0, {MAX_PAIR_SEED}\\]"
    ):
        noise(seed=MAX_PAIR_SEED + 1)
    with noise(seed=MAX_PIPELINE_SEED + 1) as pipe:  # (a builder's largest seed, on shard 1)
        assert pipe.config.seed == MAX_PIPELINE_SEED + 1
