"""The demo's evaluation: accuracy curves and where they hold, the adaptive stop rule against a
plain-Python loop, the adaptive-vs-fixed comparison on a tiny model, and the message when
matplotlib is missing."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dyndepth_app import demo, evaluate, model, plots
from dyndepth_app.config import QUICK, Config, replace

TINY = replace(Config(), **QUICK)


def test_held_from():
    assert evaluate.held_from([0.1, 0.995, 0.98, 0.99, 1.0], 0.99) == 4
    assert evaluate.held_from([1.0, 1.0], 0.99) == 1
    assert evaluate.held_from([1.0, 0.5], 0.99) is None
    assert evaluate.held_from([], 0.99) is None


def test_accuracy_curve_matches_a_loop_and_stops_once_held(monkeypatch):
    params = model.init_params(jax.random.PRNGKey(0), 8)
    cfg = replace(TINY, eval_chunk=3, eval_min_iters=4, eval_max_iters=12)
    curve = evaluate.accuracy_curve(params, cfg, 6, 16, max_iters=7)
    assert len(curve) == 7  # chunks of 3: 3 + 3 + 1
    x, t = model.make_batch(jax.random.fold_in(jax.random.PRNGKey(12345), 6), 16, 6)
    h = model.project(params, x)
    for i in range(7):
        h = model.core(params, h, x)
        solved = jnp.all(jnp.argmax(model.head(params, h), -1) == t, -1)
        assert curve[i] == pytest.approx(float(jnp.mean(solved)))
    # Stopping: with a target of 0 the accuracy holds from iteration 1, so the loop stops after
    # the first chunk that reaches max(hold * 1, eval_min_iters) = 4 iterations: 6.
    cfg0 = replace(cfg, eval_target=0.0)
    assert len(evaluate.accuracy_curve(params, cfg0, 6, 16, hold=4)) == 6


def _reference_stop(params, x, m, patience, cap, dilations):
    """The stop rule as a plain Python loop on one string: (prediction, steps)."""
    h = model.project(params, x, m)
    pred, streak, steps = None, 0, 0
    while streak < patience and steps < cap:
        h = model.core(params, h, x, dilations, m)
        new = np.asarray(jnp.argmax(model.head(params, h, m), -1))
        valid = np.asarray(m) > 0
        streak = streak + 1 if pred is not None and np.all(new[valid] == pred[valid]) else 0
        pred, steps = new, steps + 1
    return pred, steps


@pytest.mark.parametrize("patience", [1, 3])
def test_stop_rule_matches_a_python_loop(patience):
    """Each string stops after its predicted bits stayed unchanged for `patience` iterations
    (padding ignored) or when its budget (here 0.6 iterations per bit) is used up, both with
    dyndepth.while_loop under vmap and with vmap(lax.while_loop)."""
    params = model.init_params(jax.random.PRNGKey(1), 8)
    x, _, m, lengths = model.make_mixed_batch(jax.random.PRNGKey(2), 10, 3, 12)
    cap = evaluate.budgets(m, 0.6)
    np.testing.assert_array_equal(np.asarray(cap), np.ceil(0.6 * np.asarray(lengths)))
    dil, max_steps = (1, 2, 1, 1), int(cap.max())
    p_dd, s_dd, executed = evaluate.adaptive_dyndepth(params, dil, patience, max_steps, x, m, cap)
    assert int(s_dd.sum()) <= int(executed) <= x.shape[0] * max_steps
    p_lax, s_lax = evaluate.adaptive_lax(params, dil, patience, max_steps, x, m, cap)
    capped = 0
    for b in range(10):
        pred, steps = _reference_stop(params, x[b], m[b], patience, int(cap[b]), dil)
        capped += steps == int(cap[b])
        valid = np.asarray(m[b]) > 0
        assert int(s_dd[b]) == int(s_lax[b]) == steps, b
        np.testing.assert_array_equal(np.asarray(p_dd[b])[valid], pred[valid])
        np.testing.assert_array_equal(np.asarray(p_lax[b])[valid], pred[valid])
    assert len(set(np.asarray(s_dd).tolist())) > 1  # the strings stop at different iterations
    if patience == 3:
        assert 0 < capped < 10  # both ways of stopping occur


def test_adaptive_eval_on_a_tiny_model():
    params = model.init_params(jax.random.PRNGKey(3), 8)
    cfg = replace(TINY, adaptive_min_length=3, patience=2, eval_chunk=4, stop_budget=0.8)
    res = evaluate.adaptive_eval(params, cfg, max_length=12, batch=24)
    steps, lengths = np.asarray(res["steps"]), np.asarray(res["lengths"])
    assert len(steps) == len(lengths) == 24 and lengths.min() >= 3 and lengths.max() <= 12
    assert res["same_as_lax"] and res["same_as_counted_run"]
    fixed, longest_first, drawn, lax_row = res["contenders"]
    assert np.all(steps <= np.ceil(0.8 * lengths))
    assert 1 <= res["fixed_iterations"] <= steps.max()
    assert fixed["executed"] == fixed["useful"] == 24 * res["fixed_iterations"]
    for row in (longest_first, drawn):
        assert row["useful"] == steps.sum() <= row["executed"]  # counted in the loop body
        assert row["accuracy"] == pytest.approx(np.mean(res["solved"]))
        assert row["mean_iterations"] == pytest.approx(steps.mean())
    assert lax_row["useful"] == steps.sum() and lax_row["executed"] == 24 * steps.max()
    assert lax_row["accuracy"] == pytest.approx(np.mean(res["solved"]))
    # the fixed count is the first count reaching the adaptive accuracy (or the curve's best)
    curve = np.asarray(res["fixed_curve"])
    goal = min(drawn["accuracy"], curve.max())
    assert fixed["accuracy"] == pytest.approx(curve[res["fixed_iterations"] - 1])
    assert curve[res["fixed_iterations"] - 1] >= goal
    assert np.all(curve[: res["fixed_iterations"] - 1] < goal)
    # solved_from: the iteration from which each string stays solved through the curve's end
    solved_from = np.asarray(res["solved_from"])
    assert np.all((solved_from >= 0) & (solved_from <= len(curve)))
    text = evaluate.adaptive_table(res)
    assert "| adaptive, dyndepth.while_loop under vmap, longest first |" in text
    assert "| adaptive, vmap(lax.while_loop) |" in text and text.count("\n") == 5


def test_adaptive_table_speedups():
    def row(name, seconds):
        return dict(
            contender=name, accuracy=1.0, mean_iterations=2.0, executed=8, useful=4,
            seconds=seconds, compile_seconds=0.0,
        )  # fmt: skip

    res = {"contenders": [row("fixed", 4.0), row("adaptive", 1.0), row("lax", 2.0)]}
    lines = evaluate.adaptive_table(res).splitlines()
    assert lines[3].endswith("| 1.00 s | 4.00x | 2.00x |")  # the adaptive row
    assert lines[4].endswith("| 2.00 s | 2.00x | 1.00x |")  # the lax row


def test_missing_matplotlib_says_how_to_get_the_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert not plots.have_matplotlib()
    said = []
    res = {
        "lengths": [4, 8],
        "steps": [2, 3],
        "solved": [True, False],
        "solved_from": [1, 0],
        "fixed_iterations": 3,
        "strings": 2,
        "min_length": 4,
        "max_length": 8,
    }
    out = demo.write_plots({"alpha=1": {8: [0.5, 1.0]}}, res, str(tmp_path), TINY, said.append)
    assert out == []
    assert said == [plots.MISSING] and "pip install matplotlib" in plots.MISSING
    assert not list(tmp_path.iterdir())
