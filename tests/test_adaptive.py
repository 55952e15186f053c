"""The adaptive echo-factor controller on deterministic timings."""

from __future__ import annotations

import math

import pytest

from echopipe.echo.controller import EchoChange, EchoController


def feed(controller: EchoController, t_up: float, t_down: float, steps: range) -> list[float]:
    changes = []
    for step in steps:
        new = controller.observe(t_up, t_down, step)
        if new is not None:
            changes.append(new)
    return changes


def test_tracks_ratio_and_settles() -> None:
    c = EchoController(e_max=8, smoothing=0.5, warmup=2, quantum=0.5)
    changes = feed(c, 0.3, 0.1, range(40))
    assert c.factor == 3.0
    assert math.isclose(c.ratio, 3.0)
    # Smoothing starts after the warm-up, so the first change already aims at R=3.
    assert changes == [3.0]
    assert c.history[0] == EchoChange(0, 1.0, c.history[0].ratio)
    assert c.history[1].step == 2 and c.history[1].factor == 3.0


def test_clamps_to_bounds() -> None:
    c = EchoController(initial=2.0, e_max=4, smoothing=1.0, warmup=0, patience=1)
    assert c.observe(1.0, 0.1, 0) == 4.0  # R = 10 -> e_max
    assert c.observe(0.01, 0.1, 1) == 1.0  # R = 0.1 -> never below 1
    assert c.observe(0.0, 0.1, 2) is None  # zero upstream time is legal: stays at 1


def test_hysteresis_ignores_noise_but_follows_real_shift() -> None:
    c = EchoController(e_max=8, smoothing=1.0, hysteresis=0.2, warmup=0, quantum=0.25)
    assert c.observe(0.2, 0.1, 0) == 2.0
    # Ratio jitters between 1.8 and 2.2: inside the ±20 % band, no change.
    for step, up in enumerate([0.18, 0.22, 0.19, 0.21, 0.2], start=1):
        assert c.observe(up, 0.1, step) is None
    assert c.factor == 2.0
    # A real shift to R = 4 moves it.
    assert c.observe(0.4, 0.1, 10) == 4.0
    assert [h.factor for h in c.history] == [1.0, 2.0, 4.0]
    assert [h.step for h in c.history] == [0, 0, 10]


def test_smoothing_delays_reaction_to_a_spike() -> None:
    c = EchoController(e_max=8, smoothing=0.05, hysteresis=0.25, warmup=0, quantum=0.25)
    feed(c, 0.1, 0.1, range(20))
    assert c.factor == 1.0
    # One slow upstream batch (R = 5 once) moves the EMA only to R = 1.2: inside the band.
    assert c.observe(0.5, 0.1, 20) is None
    assert c.factor == 1.0 and math.isclose(c.ratio, 1.2)
    # A lasting change gets through once the average has moved.
    changes = feed(c, 0.5, 0.1, range(21, 80))
    assert changes == sorted(changes) and len(changes) >= 2
    # It settles within the hysteresis band of R = 5, not necessarily on it.
    assert abs(c.factor - 5.0) <= 0.25 * c.factor and c.factor >= 4.0


def test_a_short_dip_does_not_lower_e_but_a_lasting_one_does() -> None:
    c = EchoController(e_max=8, smoothing=1.0, hysteresis=0.15, warmup=0, patience=5)
    assert c.observe(0.6, 0.1, 0) == 6.0  # raises are immediate
    # Four steps of a slower downstream (R = 3): fewer than `patience`, e stays 6.
    assert feed(c, 0.6, 0.2, range(1, 5)) == []
    assert c.observe(0.6, 0.1, 5) is None and c.below == 0  # back inside the band: reset
    # A lasting drop: lowered on the 5th observation in a row, and only then.
    assert feed(c, 0.6, 0.2, range(6, 10)) == []
    assert c.observe(0.6, 0.2, 10) == 3.0
    assert [(h.step, h.factor) for h in c.history] == [(0, 1.0), (0, 6.0), (10, 3.0)]


def test_warmup_holds_initial_factor() -> None:
    c = EchoController(initial=1.5, e_max=8, smoothing=1.0, warmup=3)
    assert feed(c, 0.5, 0.1, range(3)) == []
    assert c.factor == 1.5
    assert c.observe(0.5, 0.1, 3) == 5.0


def test_warmup_observations_are_not_averaged() -> None:
    # Start-up: the first two batches look 10x slower upstream. They must not pull R up.
    c = EchoController(e_max=8, smoothing=0.2, warmup=2, quantum=0.5)
    assert feed(c, 1.0, 0.1, range(2)) == []
    assert c.observe(0.3, 0.1, 2) == 3.0
    assert math.isclose(c.ratio, 3.0)


def test_state_roundtrip_continues_identically() -> None:
    a = EchoController(e_max=6, smoothing=0.3, warmup=1)
    feed(a, 0.25, 0.1, range(10))
    b = EchoController(e_max=6, smoothing=0.3, warmup=1)
    b.load_state_dict(a.state_dict())
    assert b.factor == a.factor and b.history == a.history
    seq = [(0.5, 0.1), (0.55, 0.1), (0.1, 0.1), (0.6, 0.12)]
    out_a = [a.observe(u, d, 10 + i) for i, (u, d) in enumerate(seq)]
    out_b = [b.observe(u, d, 10 + i) for i, (u, d) in enumerate(seq)]
    assert out_a == out_b
    assert a.factor == b.factor


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"e_max": 0.5}, "e_max"),
        ({"initial": 9.0, "e_max": 8.0}, "initial"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"smoothing": 1.5}, "smoothing"),
        ({"hysteresis": -0.1}, "hysteresis"),
        ({"warmup": -1}, "warmup"),
        ({"patience": 0}, "patience"),
        ({"quantum": 0.0}, "quantum"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EchoController(**kwargs)


def test_bad_observations_are_named() -> None:
    c = EchoController()
    with pytest.raises(ValueError, match="t_down"):
        c.observe(0.1, 0.0, 0)
    with pytest.raises(ValueError, match="t_up"):
        c.observe(float("nan"), 0.1, 0)
    with pytest.raises(TypeError, match="t_up"):
        c.observe("0.1", 0.1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        c.load_state_dict({**c.state_dict(), "factor": 100.0})
