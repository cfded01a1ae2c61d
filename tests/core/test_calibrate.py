"""Measuring a backend's iteration cost: the fit recovers a known model, the measurement gives a
usable one, bad arguments raise."""

import jax
import numpy as np
import pytest

import dyndepth
from dyndepth import _calibrate, _cost


@pytest.mark.parametrize("seed", range(5))
def test_lines_of_a_known_cost_give_it_back(seed):
    """Seconds per iteration made by the model itself (fixed + S x row, for the elementwise
    step at the floor and the matrix product at the rate) come back as the model's constants."""
    rng = np.random.default_rng(seed)
    want = _cost.IterationCost(
        fixed_seconds=float(rng.uniform(1e-6, 5e-5)),
        flops_per_second=float(rng.uniform(1e10, 1e15)),
        row_floor_seconds=float(rng.uniform(1e-9, 1e-7)),
        bytes_per_second=float(rng.uniform(1e9, 1e13)),
        moved_row_seconds=float(rng.choice([0.0, rng.uniform(1e-9, 5e-8)])),
    )
    batch = int(rng.choice([128, 512, 4096]))
    slots = _calibrate.slot_counts(batch)
    row_flops, weight_bytes = float(rng.uniform(1e3, 1e9)), float(rng.uniform(1e4, 1e8))
    moved = want.moved_row_seconds
    floor = [want.fixed_seconds + s * (want.row_floor_seconds + moved) for s in slots]
    fixed_mm = want.fixed_seconds + weight_bytes / want.bytes_per_second
    row = row_flops / want.flops_per_second
    matmul = [fixed_mm + s * (row + moved) for s in slots]
    # (every row at one shared step, no moves; a lockstep iteration's fixed part its own)
    lockstep = [(r, 0.6 * fixed_mm + r * row) for r in (batch // 2, batch)]
    got = _calibrate.cost_of_lines(slots, floor, matmul, lockstep, row_flops, weight_bytes)
    for field in ("fixed_seconds", "flops_per_second", "row_floor_seconds", "bytes_per_second"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-6), field
    assert got.moved_row_seconds == pytest.approx(moved, rel=1e-6, abs=1e-15)


def test_weights_that_cost_nothing_read_at_an_infinite_rate():
    slots = _calibrate.slot_counts(512)
    line = [1e-6 + s * 1e-8 for s in slots]
    lockstep = [(256, 1e-6 + 256 * 1e-8), (512, 1e-6 + 512 * 1e-8)]
    got = _calibrate.cost_of_lines(slots, line, line, lockstep, 1e3, 1e6)
    assert got.bytes_per_second == np.inf and got.moved_row_seconds == pytest.approx(0.0, abs=1e-15)


def test_a_lockstep_row_slower_than_a_scheduled_one_moves_nothing():
    """Noise can make the lockstep run's row cost more than the scheduled line's slope: no
    negative moves, no negative floor."""
    slots = _calibrate.slot_counts(512)
    line = [1e-6 + s * 1e-8 for s in slots]
    got = _calibrate.cost_of_lines(slots, line, line, [(256, 1e-6), (512, 1e-6 + 256 * 2e-8)],
                                   1e3, 1e6)  # fmt: skip
    assert got.moved_row_seconds == 0.0 and got.row_floor_seconds == pytest.approx(1e-8)
    # A lockstep line that noise tilts flat or down: the moves are not measured.
    for noisy in ([(256, 2e-6), (512, 2e-6)], [(256, 3e-6), (512, 2e-6)]):
        got = _calibrate.cost_of_lines(slots, line, line, noisy, 1e3, 1e6)
        assert got.moved_row_seconds == 0.0 and got.flops_per_second == pytest.approx(1e3 / 1e-8)


def test_fit_line_clamps_what_noise_tilts_below_zero():
    assert _calibrate.fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == (pytest.approx(4.0), 1e-15)
    a, b = _calibrate.fit_line([1, 2, 3], [0.5, 1.5, 2.5])
    assert (a, b) == (0.0, pytest.approx(1.0))


def test_measured_cost_is_usable_by_the_slot_rule():
    """A small measurement on this machine: positive constants, accepted by
    set_iteration_cost, after which a loop's fixed cost in rows follows them."""
    cost = dyndepth.measure_iteration_cost(batch=128, width=16, depth=2, repeats=1)
    assert isinstance(cost, dyndepth.IterationCost)
    assert cost.fixed_seconds >= 0 and cost.flops_per_second > 0 and cost.row_floor_seconds >= 0
    assert cost.bytes_per_second > 0 and cost.moved_row_seconds >= 0
    platform = jax.default_backend()
    suite_cost = _cost.backend_cost(platform)  # (tests/conftest.py's, which the suite runs on)
    try:
        dyndepth.set_iteration_cost(platform, cost)
        assert _cost.backend_cost().fixed_rows(1e6) == pytest.approx(cost.fixed_rows(1e6))
    finally:
        dyndepth.set_iteration_cost(platform, suite_cost)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(batch=64), ValueError, r"`batch` must be >= 128, got 64"),
        (dict(width=0), ValueError, r"`width` must be >= 1, got 0"),
        (dict(depth=0), ValueError, r"`depth` must be >= 1, got 0"),
        (dict(repeats=1.5), TypeError, r"`repeats` must be a static Python int"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        dyndepth.measure_iteration_cost(**kwargs)
