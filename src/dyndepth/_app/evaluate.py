"""Evaluating the demo's network: accuracy after every iteration count, and adaptive stopping.

**Accuracy curves** (:func:`accuracy_curve`): one loop over the test strings that records, after
every iteration, which strings are solved (every bit right); the mean over strings after
iteration ``i`` is the accuracy of a net run for ``i`` iterations. The loop runs in chunks, so it
can stop once the accuracy has held ``>= target`` from some iteration ``T`` through ``hold * T``
(and a Ctrl-C stops it between chunks).

**Adaptive stopping** (:func:`adaptive_eval`): strings of mixed lengths, padded to the longest
and masked (a padded string computes exactly what it computes alone), each iterating until its
own stop rule fires: *its predicted bits have not changed for ``patience`` consecutive
iterations*, or its budget of ``stop_budget`` iterations per bit is used up (a string whose
predictions never settle, which happens for strings the net gets wrong, would otherwise run to
the loop's bound). The loop is ``dyndepth.while_loop`` under ``vmap``: the
library's per-sample scheduler refills a slot as soon as its string stops, so the batch costs
about the sum of the iterations the strings take. Compared on the same strings with

- a fixed iteration count for the whole batch (the smallest count at which the batch's accuracy
  reaches the adaptive accuracy, or the best it reaches within the adaptive run's longest stop:
  chosen with the labels, in hindsight, the best case for a fixed count), run as a batched
  ``lax.fori_loop``;
- ``jax.vmap`` of ``lax.while_loop`` with the same rule (every string runs until the batch's
  slowest stops; finished strings are masked).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dyndepth

from .args import check_interrupt
from .model import conv_eval, core, head, make_batch, make_mixed_batch, project

# ----------------------------------------------------------------------------- accuracy curves


def held_from(acc, target):
    """The smallest iteration ``T`` (1-based) such that ``acc[T - 1:]`` is all ``>= target``;
    ``None`` when the last entry is below ``target``."""
    acc = np.asarray(acc)
    if not acc.size or acc[-1] < target:
        return None
    below = np.flatnonzero(acc < target)
    return int(below[-1]) + 2 if below.size else 1


def _solved(params, h, t, m):
    pred = jnp.argmax(head(params, h, m, conv_eval), axis=-1)
    ok = pred == t if m is None else (pred == t) | (m == 0)
    return jnp.all(ok, axis=-1)


def _advance(params, h, x, t, m, dilations, iters):
    """``iters`` more iterations from state ``h``: ``(h, solved (iters, B))``."""

    def step(h, _):
        h = core(params, h, x, dilations, m, conv_eval)
        return h, _solved(params, h, t, m)

    return lax.scan(step, h, None, length=iters)


_advance_jit = jax.jit(_advance, static_argnums=(5, 6))
_project_jit = jax.jit(lambda params, x, m: project(params, x, m, conv_eval))


def solved_matrix(params, x, t, m, cfg, *, max_iters, stop=None):
    """``solved[i, b]`` (bool, numpy): string ``b`` solved after ``i + 1`` iterations, for
    ``i < max_iters`` or until ``stop(accuracies so far)`` returns True after a chunk of
    ``cfg.eval_chunk`` iterations. Checks for Ctrl-C between chunks."""
    h = _project_jit(params, x, m)
    rows, done = [], 0
    while done < max_iters:
        check_interrupt("interrupted during evaluation")
        n = min(cfg.eval_chunk, max_iters - done)
        h, solved = _advance_jit(params, h, x, t, m, tuple(cfg.dilations), n)
        rows.append(np.asarray(solved))
        done += n
        if stop is not None and stop(np.concatenate(rows).mean(axis=1)):
            break
    return np.concatenate(rows)


def accuracy_curve(params, cfg, length, batch, *, key=None, max_iters=None, hold=None):
    """Whole-string accuracy after each iteration count ``1, 2, ...`` on ``batch`` random
    strings of ``length`` bits: a list of floats. With ``hold``, the loop stops once the
    accuracy has stayed ``>= cfg.eval_target`` from some iteration ``T`` through
    ``max(hold * T, cfg.eval_min_iters)``; it never runs past ``max_iters`` (default
    ``cfg.eval_max_iters``)."""
    key = jax.random.PRNGKey(12345) if key is None else key
    max_iters = cfg.eval_max_iters if max_iters is None else max_iters
    x, t = make_batch(jax.random.fold_in(key, length), batch, length)

    def stop(acc):
        if hold is None:
            return False
        first = held_from(acc, cfg.eval_target)
        return first is not None and len(acc) >= max(hold * first, cfg.eval_min_iters)

    solved = solved_matrix(params, x, t, None, cfg, max_iters=max_iters, stop=stop)
    return solved.mean(axis=1).tolist()


def summarize(curves, cfg, strings):
    """Per length: strings evaluated, iterations evaluated, the best accuracy and where, the
    first iteration reaching ``cfg.eval_target``, the iteration ``T`` from which it held through
    the last iteration evaluated (``None`` if it did not), the accuracy at ``M`` (``None`` when
    not evaluated) and at the last iteration."""
    M, target = cfg.max_iters, cfg.eval_target
    rows = []
    for length, acc in curves.items():
        acc = np.asarray(acc)
        reach = np.flatnonzero(acc >= target)
        rows.append(
            {
                "length": int(length),
                "strings": strings[length] if isinstance(strings, dict) else strings,
                "iters": len(acc),
                "best": float(acc.max()),
                "best_at": int(acc.argmax()) + 1,
                "first_at_target": int(reach[0]) + 1 if reach.size else None,
                "held_from": held_from(acc, target),
                "at_M": float(acc[M - 1]) if len(acc) >= M else None,
                "at_last": float(acc[-1]),
            }
        )
    return rows


def _pct(v):
    return "n/a" if v is None else f"{100 * v:.1f}%"


def table(summary_by_label, cfg):
    """The summary as a Markdown table; "n/a" marks iterations that were not evaluated."""
    M, target = cfg.max_iters, cfg.eval_target
    lines = [
        f"| run | bits | strings | best | at iteration | first >= {100 * target:g}% | "
        f">= {100 * target:g}% held over iterations | at M = {M} | at the last iteration |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in summary_by_label.items():
        for r in rows:
            if r["held_from"] is None:
                held = "no"
            else:
                held = f"{r['held_from']}..{r['iters']} ({r['iters'] / r['held_from']:.1f}x)"
            first = "-" if r["first_at_target"] is None else str(r["first_at_target"])
            lines.append(
                f"| {label} | {r['length']} | {r['strings']} | {_pct(r['best'])} | "
                f"{r['best_at']} | {first} | {held} | {_pct(r['at_M'])} | "
                f"{_pct(r['at_last'])} ({r['iters']}) |"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- adaptive


def stop_init(params, x, m, cap):
    """The adaptive loop's carry for one string ``x`` (L,) with mask ``m`` (L,) and iteration
    budget ``cap``: ``(h, x, m, pred, streak, i, cap)``; ``pred`` starts at -1 (no prediction
    yet), ``streak`` counts the consecutive iterations after which ``pred`` did not change, ``i``
    the iterations run."""
    h = project(params, x, m, conv_eval)
    pred = jnp.full(x.shape, -1, jnp.int32)
    return h, x, m, pred, jnp.int32(0), jnp.int32(0), jnp.asarray(cap, jnp.int32)


def stop_body(params, dilations):
    """One iteration and the stop rule's bookkeeping: a string's streak grows when none of its
    predicted bits changed, and restarts at 0 otherwise (padding ignored)."""

    def body(carry):
        h, x, m, pred, streak, i, cap = carry
        h = core(params, h, x, dilations, m, conv_eval)
        new = jnp.argmax(head(params, h, m, conv_eval), axis=-1).astype(jnp.int32)
        same = jnp.all((new == pred) | (m == 0))
        return h, x, m, new, jnp.where(same, streak + 1, 0), i + 1, cap

    return body


def stop_cond(patience):
    """Keep iterating while the predictions have not stayed unchanged for ``patience``
    consecutive iterations and the string's budget is not used up."""
    return lambda carry: (carry[4] < patience) & (carry[5] < carry[6])


def budgets(m, per_bit):
    """Each string's iteration budget: ``ceil(per_bit * its length)``, at least 1."""
    return jnp.maximum(1, jnp.ceil(per_bit * jnp.sum(m, axis=-1))).astype(jnp.int32)


def adaptive_dyndepth(params, dilations, patience, max_steps, x, m, cap):
    """``dyndepth.while_loop`` under ``vmap``: ``(pred (B, L), steps (B,))``."""

    def one(x, m, cap):
        carry, steps = dyndepth.while_loop(
            stop_cond(patience),
            stop_body(params, dilations),
            stop_init(params, x, m, cap),
            max_steps=max_steps,
            return_steps=True,
        )
        return carry[3], steps

    return jax.vmap(one)(x, m, cap)


def adaptive_lax(params, dilations, patience, max_steps, x, m, cap):
    """``jax.vmap`` of ``lax.while_loop`` with the same rule: ``(pred (B, L), steps (B,))``."""
    body, cond = stop_body(params, dilations), stop_cond(patience)

    def one(x, m, cap):
        carry = lax.while_loop(
            lambda c: cond(c) & (c[5] < max_steps), body, stop_init(params, x, m, cap)
        )
        return carry[3], carry[5]

    return jax.vmap(one)(x, m, cap)


def fixed_count(params, dilations, iters, x, m):
    """The whole batch for ``iters`` iterations (a batched ``lax.fori_loop``): ``pred``."""
    h = lax.fori_loop(
        0,
        iters,
        lambda i, h: core(params, h, x, dilations, m, conv_eval),
        project(params, x, m, conv_eval),
    )
    return jnp.argmax(head(params, h, m, conv_eval), axis=-1).astype(jnp.int32)


def _count_executed(params, dilations, patience, max_steps, x, m, cap):
    """The adaptive run with a callback in the loop body that counts its evaluations per
    sample slot (under the scheduler a ``jax.debug.callback`` with a batched argument is
    called once per slot and iteration): ``(pred, steps, executed sample-iterations)``."""
    count = [0]
    body = stop_body(params, dilations)

    def counted(carry):
        jax.debug.callback(lambda s: count.__setitem__(0, count[0] + 1), carry[4])
        return body(carry)

    def one(x, m, cap):
        carry, steps = dyndepth.while_loop(
            stop_cond(patience),
            counted,
            stop_init(params, x, m, cap),
            max_steps=max_steps,
            return_steps=True,
        )
        return carry[3], steps

    pred, steps = jax.block_until_ready(jax.jit(jax.vmap(one))(x, m, cap))
    return np.asarray(pred), np.asarray(steps), count[0]


def _timed(fn, *args):
    """Compile ``fn`` ahead of time, then run it once: ``(output, run seconds, compile
    seconds)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    t1 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    return out, time.perf_counter() - t1, t1 - t0


def adaptive_eval(params, cfg, *, max_length=None, batch=None, key=None):
    """The adaptive-vs-fixed comparison on ``batch`` strings of lengths drawn uniformly from
    ``[cfg.adaptive_min_length, max_length]``: a dict with per-string ``lengths``, ``steps``
    and ``solved``, the fixed count's accuracy curve on the same strings, and per contender
    its accuracy, iterations, executed and useful sample-iterations, run and compile
    seconds. Each string's budget is ``cfg.stop_budget`` iterations per bit."""
    max_length = max(cfg.eval_lengths) if max_length is None else max_length
    batch = cfg.adaptive_batch if batch is None else batch
    key = jax.random.PRNGKey(777) if key is None else key
    x, t, m, lengths = make_mixed_batch(key, batch, cfg.adaptive_min_length, max_length)
    cap = budgets(m, cfg.stop_budget)
    max_steps = int(cap.max())
    dil, patience = tuple(cfg.dilations), cfg.patience
    tn = np.asarray(t)
    mn = np.asarray(m)

    def accuracy(pred):
        return float(np.mean(np.all((np.asarray(pred) == tn) | (mn == 0), axis=1)))

    # 1. The adaptive run, counting the sample-iterations the scheduler executes (untimed).
    check_interrupt("interrupted during the adaptive evaluation")
    pred, steps, executed = _count_executed(params, dil, patience, max_steps, x, m, cap)
    solved = np.all((pred == tn) | (mn == 0), axis=1)
    acc_adaptive = float(solved.mean())
    longest = int(steps.max())

    # 2. The fixed count on the same strings: the accuracy after every count, until it reaches
    # the adaptive accuracy (at most up to the longest adaptive run).
    curve_solved = solved_matrix(
        params, x, t, m, cfg, max_iters=longest, stop=lambda acc: acc[-1] >= acc_adaptive
    )
    curve = curve_solved.mean(axis=1)
    reached = np.flatnonzero(curve >= min(acc_adaptive, curve.max()))
    fixed = int(reached[0]) + 1
    # the iteration from which each string stays solved through the curve's end (0: never)
    ran = len(curve)
    stays = np.flip(np.cumprod(np.flip(curve_solved, 0), 0), 0).sum(0)
    solved_from = np.where(stays > 0, ran - stays + 1, 0)

    # 3. Wall time, each compiled ahead of time and run once.
    check_interrupt("interrupted during the adaptive evaluation")
    (p_dd, s_dd), run_dd, comp_dd = _timed(
        lambda p, x, m, c: adaptive_dyndepth(p, dil, patience, max_steps, x, m, c),
        params,
        x,
        m,
        cap,
    )
    check_interrupt("interrupted during the adaptive evaluation")
    (p_lax, s_lax), run_lax, comp_lax = _timed(
        lambda p, x, m, c: adaptive_lax(p, dil, patience, max_steps, x, m, c),
        params,
        x,
        m,
        cap,
    )
    check_interrupt("interrupted during the adaptive evaluation")
    p_fix, run_fix, comp_fix = _timed(
        lambda p, x, m: fixed_count(p, dil, fixed, x, m), params, x, m
    )
    useful = int(steps.sum())
    rows = [
        {
            "contender": f"fixed count ({fixed} iterations, whole batch)",
            "accuracy": accuracy(p_fix),
            "mean_iterations": float(fixed),
            "useful": batch * fixed,
            "executed": batch * fixed,
            "seconds": run_fix,
            "compile_seconds": comp_fix,
        },
        {
            "contender": "adaptive, dyndepth.while_loop under vmap",
            "accuracy": accuracy(p_dd),
            "mean_iterations": float(np.mean(s_dd)),
            "useful": useful,
            "executed": executed,
            "seconds": run_dd,
            "compile_seconds": comp_dd,
        },
        {
            "contender": "adaptive, vmap(lax.while_loop)",
            "accuracy": accuracy(p_lax),
            "mean_iterations": float(np.mean(s_lax)),
            "useful": useful,
            "executed": batch * int(np.max(s_lax)),
            "seconds": run_lax,
            "compile_seconds": comp_lax,
        },
    ]
    return {
        "rule": f"stop when the predicted bits are unchanged for {patience} consecutive "
        f"iterations, or after {cfg.stop_budget:g} iteration(s) per bit",
        "strings": batch,
        "min_length": cfg.adaptive_min_length,
        "max_length": max_length,
        "lengths": np.asarray(lengths).tolist(),
        "steps": steps.tolist(),
        "solved": solved.tolist(),
        "solved_from": solved_from.tolist(),
        "accuracy": acc_adaptive,
        "fixed_iterations": fixed,
        "fixed_curve": curve.tolist(),
        "same_as_lax": bool(np.array_equal(np.asarray(s_dd), np.asarray(s_lax)))
        and bool(np.array_equal(np.asarray(p_dd), np.asarray(p_lax))),
        "same_as_counted_run": bool(np.array_equal(np.asarray(s_dd), steps)),
        "contenders": rows,
    }


def adaptive_table(res):
    fixed = res["contenders"][0]
    lines = [
        "| evaluation | accuracy | iterations per string | executed sample-iterations | "
        "useful | executed / useful | wall time | vs fixed count |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["contenders"]:
        lines.append(
            f"| {r['contender']} | {100 * r['accuracy']:.1f}% | {r['mean_iterations']:.1f} "
            f"(mean) | {r['executed']} | {r['useful']} | {r['executed'] / r['useful']:.2f} | "
            f"{r['seconds']:.2f} s | {fixed['seconds'] / r['seconds']:.2f}x faster |"
        )
    return "\n".join(lines)
