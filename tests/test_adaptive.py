"""The adaptive echo-factor controller on deterministic timings."""

from __future__ import annotations

import math
import random
import sys

import pytest

from echopipe.echo.controller import EchoChange, EchoController, model_ratio


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
        ({"raise_patience": 0}, "raise_patience"),
        ({"raise_patience": 11, "patience": 10}, "raise_patience"),
        ({"headroom": -0.1}, "headroom"),
        ({"headroom": math.inf}, "headroom"),
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


def test_prime_is_the_step_0_decision_before_any_step() -> None:
    c = EchoController(e_max=8, warmup=1, quantum=0.25)
    assert c.prime(0.6, 0.1) == 6.0  # t_up from the pipeline's fill, t_down from the trial
    assert c.factor == 6.0 and c.history == [EchoChange(0, 6.0, c.history[0].ratio)]
    assert math.isclose(c.history[0].ratio, 6.0)
    # The first observations refine the primed averages instead of starting at e = 1.
    assert feed(c, 0.6, 0.1, range(1, 20)) == []
    with pytest.raises(RuntimeError, match="first decision"):
        c.prime(0.6, 0.1)


def test_headroom_aims_above_the_ratio_and_keeps_the_recorded_ratio() -> None:
    c = EchoController(e_max=8, warmup=0, quantum=0.25, headroom=0.1)
    assert c.prime(0.5, 0.1) == 5.5  # R = 5, aimed 10 % above
    assert math.isclose(c.history[0].ratio, 5.0)  # the history keeps the modelled R
    assert c.target(10.0) == 8.0  # still within e_max
    assert c.target(0.5) == 1.0  # and never below 1
    # The band is around the raised target: R drifting to 5.2 (target 5.75) changes nothing.
    assert feed(c, 0.52, 0.1, range(1, 30)) == []


def test_augmentation_after_the_echo_point_raises_the_factor() -> None:
    # Input workers: t_up / e on fresh data plus t_aug per delivered batch, for every copy.
    assert math.isclose(model_ratio(0.6, 0.1), 6.0)
    assert math.isclose(model_ratio(0.6, 0.1, 0.04), 10.0)
    assert model_ratio(0.6, 0.1, 0.1) == math.inf  # nothing keeps up: the most echo
    c = EchoController(e_max=16, warmup=0, smoothing=1.0)
    assert c.prime(0.6, 0.1, t_aug=0.04) == 10.0
    capped = EchoController(e_max=8)
    assert capped.prime(0.6, 0.1, t_aug=0.2) == 8.0 and capped.history[0].ratio == 1e9
    # Observed timings carry the augmentation cost too: at e = 10 it keeps up, at 6 it does not.
    c2 = EchoController(e_max=16, warmup=0, smoothing=1.0)
    assert c2.observe(0.6, 0.1, 0, t_aug=0.04) == 10.0
    assert 0.6 / c2.factor + 0.04 <= 0.1 + 1e-12 < 0.6 / 6.0 + 0.04


def test_reads_during_the_downstreams_pauses_lower_the_factor_at_once() -> None:
    """The wall-clock study's figures (2026-12-04): t_up 369 ms per fresh batch, t_down 52 ms,
    an epoch of 12.5 fresh batches and about 1 s of validation and checkpoint between two
    epochs' steps, through which the reader reads on: 1.08 s / 12.5 = 86 ms per fresh batch the
    steps do not wait for. A fixed e = 6 kept up (its epochs took 75 steps of 52 ms), though
    R = 7.1 said it could not."""
    assert math.isclose(model_ratio(0.369, 0.052, 0.0, 0.0864), (0.369 - 0.0864) / 0.052)
    assert model_ratio(0.369, 0.052, 0.0, 0.5) == 0.0  # a pause that reads the next epoch whole
    c = EchoController(e_max=8, smoothing=1.0, warmup=0, patience=10)
    assert c.set_pause(0.0864, 0) is None  # nothing measured yet: only kept
    assert c.t_pause == 0.0864 and c.factor == 1.0
    c.pauses = []
    assert c.prime(0.369, 0.052) == 7.0
    # 5.5 is within the band of 7 (+-15 %), which a lowering from step readings also needs 10
    # times in a row: the pause, measured whole, moves the factor at once.
    assert c.set_pause(0.0864, 75) == 5.5
    assert c.history[-1] == EchoChange(75, 5.5, c.ratio)
    assert math.isclose(c.ratio, 5.435, abs_tol=1e-3)
    assert feed(c, 0.369, 0.052, range(76, 120)) == []  # the steps' own readings agree
    # The model takes the least of the last PAUSE_WINDOW (3) pauses: a shorter one moves the
    # target no more than a grid step here, so nothing changes...
    assert c.set_pause(0.0720, 150) is None and c.t_pause == 0.0720 and c.target(c.ratio) == 5.75
    # ...and a longer one (a slow checkpoint write) does not lower it while a shorter is kept.
    assert c.set_pause(0.2, 225) is None and c.t_pause == 0.0720
    # Saved and restored with the rest.
    d = EchoController(e_max=8)
    d.load_state_dict(c.state_dict())
    assert d.pauses == [0.0864, 0.0720, 0.2] and d.ratio == c.ratio
    with pytest.raises(ValueError, match="t_pause"):
        c.set_pause(-1.0, 226)
    # Pauses that no longer read (a cache with no room) raise it at once: the least is 0.
    assert c.set_pause(0.0, 300) == 7.0 and c.pauses == [0.0720, 0.2, 0.0]


@pytest.mark.parametrize("seed", range(4))
def test_factor_stays_steady_under_noisy_timings(seed: int) -> None:
    """R = 6 with 20 % log-normal noise on both sides (a loaded 2-core machine): the trainer's
    settings keep e within one quantum band of R instead of walking between 5 and 8."""
    rng = random.Random(seed)
    c = EchoController(e_max=8, warmup=1, smoothing=0.1, raise_patience=3, patience=10)
    c.prime(0.6, 0.1)
    for step in range(1, 300):
        c.observe(0.6 * rng.lognormvariate(0, 0.2), 0.1 * rng.lognormvariate(0, 0.2), step)
    factors = [h.factor for h in c.history]
    assert len(factors) <= 3, c.history
    assert all(6.0 <= f <= 7.5 for f in factors), c.history


def test_a_lowering_goes_only_as_far_as_the_whole_run_agrees() -> None:
    c = EchoController(e_max=8, smoothing=1.0, hysteresis=0.1, warmup=0, patience=3)
    c.prime(0.8, 0.1)
    # Three readings below the band (R = 6, 4, 5): lowered to 6, the highest of them.
    assert feed(c, 0.6, 0.1, range(1, 2)) + feed(c, 0.4, 0.1, range(2, 3)) == []
    assert c.observe(0.5, 0.1, 3) == 6.0


def test_a_raise_waits_for_raise_patience_and_takes_the_lowest_target() -> None:
    c = EchoController(e_max=8, smoothing=1.0, warmup=0, patience=5, raise_patience=2)
    c.prime(0.2, 0.1)
    assert c.observe(0.8, 0.1, 1) is None  # one spike: no raise
    assert c.observe(0.2, 0.1, 2) is None and c.above == 0
    assert c.observe(0.8, 0.1, 3) is None
    assert c.observe(0.5, 0.1, 4) == 5.0


def test_an_unprimed_controller_takes_its_first_decision_at_once() -> None:
    c = EchoController(e_max=8, smoothing=1.0, warmup=0, raise_patience=3)
    assert c.observe(0.4, 0.1, 0) == 4.0  # no estimate before step 1: no waiting either
    assert c.observe(0.8, 0.1, 1) is None and c.observe(0.8, 0.1, 2) is None
    assert c.observe(0.8, 0.1, 3) == 8.0


def test_times_at_the_ends_of_the_float_range_keep_a_factor() -> None:
    """A smoothed t_down that underflows to 0 leaves R undefined (nan): the factor stays; a
    quantum too small to count in gives the clamped ratio itself. No exception either way."""
    tiny = EchoController(warmup=0, smoothing=0.5)
    for step in range(3):
        tiny.observe(sys.float_info.max, 5e-324, step)
    assert math.isnan(tiny.ratio) and 1.0 <= tiny.factor <= tiny.e_max
    fine = EchoController(warmup=0, quantum=1e-310)
    fine.observe(3.0, 1.0, 0)
    assert fine.factor == pytest.approx(3.0)


class _FinishedUpstream:
    """An upstream that ran all it will (a small shard stopped at its epoch's end) before the
    first poll: its counters never move again."""

    batch_size = 16
    upstream_batch_size = 4

    def start(self) -> None:
        pass

    def upstream_time(self) -> tuple[int, float]:
        return 16, 0.032


def test_the_fill_timing_does_not_wait_out_its_timeout_for_an_upstream_already_done() -> None:
    """``echopipe train --data DIR`` on 3 classes x 20 images, -b 16: the upstream ran its 16
    batches before the first poll and stopped, and the run sat 30 s before step 1 with 'the
    upstream did not time 4 batches within 30 s'. It times those batches instead, at once."""
    import time

    from echopipe.training.echo_start import fill_seconds_per_batch

    t0 = time.monotonic()
    t_up = fill_seconds_per_batch(_FinishedUpstream(), timeout_s=20.0)
    assert time.monotonic() - t0 < 5.0
    assert t_up == pytest.approx(0.032 / 16 * 16 / 4)


def test_every_auto_controller_takes_the_same_warm_up() -> None:
    """``EchoLoader(echo_factor="auto")`` used the class default of 3 warm-up observations where
    ``echopipe train --echo auto`` used 1: its first decision came 4 batches later."""
    from echopipe.echo.controller import AUTO_WARMUP
    from echopipe.torch.arguments import check_echo

    factor, controller = check_echo("auto", 8.0)
    assert factor == 1.0 and controller is not None and controller.warmup == AUTO_WARMUP == 1
