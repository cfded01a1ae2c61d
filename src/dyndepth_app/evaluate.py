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
library's per-sample scheduler runs a quarter of the batch at a time and refills a slot as soon
as its string stops, so the batch costs about the sum of the iterations the strings take. It
loads strings in batch order, so the batch goes in longest first (the lengths are known, the
stopping iterations are not): the long strings start early and the tail stays short; the same
loop on the strings in their drawn (random) order is reported too. Compared on the same strings
with

- a fixed iteration count for the whole batch (the smallest count at which the batch's accuracy
  reaches the adaptive accuracy, or the best it reaches within the adaptive run's longest stop:
  chosen with the labels, in hindsight, the best case for a fixed count), run as a batched
  ``lax.fori_loop``;
- ``jax.vmap`` of ``lax.while_loop`` with the same rule (every string runs until the batch's
  slowest stops; finished strings are masked).

Wall times: each contender compiled ahead of time, then all run in turn, ``adaptive_repeats``
rounds; the fastest run of each.
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
    """``dyndepth.while_loop`` under ``vmap``: ``(pred (B, L), steps (B,), executed)``,
    ``executed`` the sample-iterations its loop ran (``return_info``)."""

    def one(x, m, cap):
        carry, info = dyndepth.while_loop(
            stop_cond(patience),
            stop_body(params, dilations),
            stop_init(params, x, m, cap),
            max_steps=max_steps,
            return_info=True,
        )
        return carry[3], info["steps"], info["executed_sample_steps"]

    pred, steps, executed = jax.vmap(one)(x, m, cap)
    return pred, steps, executed[0]  # (one loop for the batch: every sample has its figure)


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


def _first_run(params, dilations, patience, max_steps, x, m, cap):
    """The adaptive run, untimed: ``(pred, steps, executed sample-iterations)``."""
    fn = jax.jit(lambda p, x, m, c: adaptive_dyndepth(p, dilations, patience, max_steps, x, m, c))
    pred, steps, executed = jax.block_until_ready(fn(params, x, m, cap))
    return np.asarray(pred), np.asarray(steps), int(executed)


def _timed(contenders, repeats):
    """Compile each ``(fn, args)`` of the dict ``contenders`` ahead of time, then run them in
    turn, ``repeats`` rounds: per name ``(output, fastest run seconds, compile seconds)``.
    Taking turns spreads a change in the machine's load over all contenders."""
    compiled, compile_seconds, runs, outputs = {}, {}, {}, {}
    for name, (fn, args) in contenders.items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*args).compile()
        compile_seconds[name] = time.perf_counter() - t0
    for _ in range(repeats):
        for name, (_, args) in contenders.items():
            check_interrupt("interrupted during the adaptive evaluation")
            t0 = time.perf_counter()
            outputs[name] = jax.block_until_ready(compiled[name](*args))
            runs.setdefault(name, []).append(time.perf_counter() - t0)
    return {name: (outputs[name], min(runs[name]), compile_seconds[name]) for name in contenders}


class _Strings:
    """The adaptive evaluation's test strings, as drawn (random lengths) and longest first."""

    def __init__(self, cfg, max_length, batch, key):
        x, t, m, lengths = make_mixed_batch(key, batch, cfg.adaptive_min_length, max_length)
        self.x, self.t, self.m = x, t, m
        self.lengths = np.asarray(lengths)
        self.cap = budgets(m, cfg.stop_budget)
        self.order = np.argsort(-self.lengths, kind="stable")  # longest first

    def solved(self, pred, order=None):
        """Per string (in drawn order): every bit of ``pred`` right; ``pred`` in ``order``."""
        pred = np.asarray(pred)
        if order is not None:
            pred = pred[np.argsort(order)]
        return np.all((pred == np.asarray(self.t)) | (np.asarray(self.m) == 0), axis=1)

    def sorted_args(self):
        o = self.order
        return self.x[o], self.m[o], self.cap[o]


def _fixed_count_for(params, s, cfg, goal, longest):
    """The smallest count at which the whole batch reaches ``goal`` accuracy (or its best
    within ``longest`` iterations): ``(count, accuracy curve, solved_from)``, where
    ``solved_from[b]`` is the iteration from which string ``b`` stays solved (0: never)."""
    solved = solved_matrix(
        params, s.x, s.t, s.m, cfg, max_iters=longest, stop=lambda acc: acc[-1] >= goal
    )
    curve = solved.mean(axis=1)
    count = int(np.flatnonzero(curve >= min(goal, curve.max()))[0]) + 1
    stays = np.flip(np.cumprod(np.flip(solved, 0), 0), 0).sum(0)
    return count, curve, np.where(stays > 0, len(curve) - stays + 1, 0)


def _row(contender, accuracy, iterations, executed, useful, timing):
    _, seconds, compile_seconds = timing
    return {
        "contender": contender,
        "accuracy": float(accuracy),
        "mean_iterations": float(np.mean(iterations)),
        "executed": int(executed),
        "useful": int(useful),
        "seconds": seconds,
        "compile_seconds": compile_seconds,
    }


ADAPTIVE = "adaptive, dyndepth.while_loop under vmap"


def adaptive_eval(params, cfg, *, max_length=None, batch=None, key=None, repeats=None):
    """The adaptive-vs-fixed comparison on ``batch`` strings of lengths drawn uniformly from
    ``[cfg.adaptive_min_length, max_length]``, each with a budget of ``cfg.stop_budget``
    iterations per bit. Returns a dict with per-string ``lengths``, ``steps``, ``solved`` and
    ``solved_from`` (in drawn order), the fixed count and its accuracy curve on the same
    strings, and per contender (``contenders``) its accuracy, mean iterations, executed and
    useful sample-iterations, fastest of ``repeats`` run times and compile time.

    The adaptive loop runs twice: on the strings longest first (the lengths are known, the
    stopping iterations are not; long strings start first, so the scheduler's tail stays
    short) and in the drawn order."""
    max_length = max(cfg.eval_lengths) if max_length is None else max_length
    batch = cfg.adaptive_batch if batch is None else batch
    key = jax.random.PRNGKey(777) if key is None else key
    repeats = cfg.adaptive_repeats if repeats is None else repeats
    s = _Strings(cfg, max_length, batch, key)
    dil, patience, max_steps = tuple(cfg.dilations), cfg.patience, int(s.cap.max())

    # 1. The adaptive runs, with the sample-iterations the scheduler executes (untimed).
    check_interrupt("interrupted during the adaptive evaluation")
    pred, steps, executed_drawn = _first_run(params, dil, patience, max_steps, s.x, s.m, s.cap)
    pred_sorted, steps_sorted, executed_sorted = _first_run(
        params, dil, patience, max_steps, *s.sorted_args()
    )
    solved = s.solved(pred)
    useful = int(steps.sum())

    # 2. The fixed count reaching the adaptive accuracy on the same strings.
    fixed, curve, solved_from = _fixed_count_for(
        params, s, cfg, float(solved.mean()), int(steps.max())
    )

    # 3. Wall times: compiled ahead of time, run in turn; the fastest of `repeats` rounds.
    def adaptive(p, x, m, c):
        return adaptive_dyndepth(p, dil, patience, max_steps, x, m, c)

    def lax_loop(p, x, m, c):
        return adaptive_lax(p, dil, patience, max_steps, x, m, c)

    timings = _timed(
        {
            "fixed": (lambda p, x, m: fixed_count(p, dil, fixed, x, m), (params, s.x, s.m)),
            "sorted": (adaptive, (params, *s.sorted_args())),
            "drawn": (adaptive, (params, s.x, s.m, s.cap)),
            "lax": (lax_loop, (params, s.x, s.m, s.cap)),
        },
        repeats,
    )
    t_fix, t_sorted, t_drawn, t_lax = (timings[k] for k in ("fixed", "sorted", "drawn", "lax"))
    p_sorted, s_sorted, _ = t_sorted[0]
    p_drawn, s_drawn, _ = t_drawn[0]
    p_lax, s_lax = t_lax[0]
    rows = [
        _row(
            f"fixed count ({fixed} iterations, whole batch)",
            s.solved(t_fix[0]).mean(),
            fixed,
            batch * fixed,
            batch * fixed,
            t_fix,
        ),
        _row(
            f"{ADAPTIVE}, longest first",
            s.solved(p_sorted, s.order).mean(),
            s_sorted,
            executed_sorted,
            useful,
            t_sorted,
        ),
        _row(
            f"{ADAPTIVE}, in drawn order",
            s.solved(p_drawn).mean(),
            s_drawn,
            executed_drawn,
            useful,
            t_drawn,
        ),
        _row(
            "adaptive, vmap(lax.while_loop)",
            s.solved(p_lax).mean(),
            s_lax,
            batch * int(np.max(s_lax)),
            useful,
            t_lax,
        ),
    ]
    same = [
        np.array_equal(np.asarray(s_drawn), np.asarray(s_lax)),
        np.array_equal(np.asarray(p_drawn), np.asarray(p_lax)),
        np.array_equal(np.asarray(s_sorted), np.asarray(s_lax)[s.order]),
        np.array_equal(np.asarray(p_sorted), np.asarray(p_lax)[s.order]),
    ]
    return {
        "rule": f"stop when the predicted bits are unchanged for {patience} consecutive "
        f"iterations, or after {cfg.stop_budget:g} iteration(s) per bit",
        "strings": batch,
        "min_length": cfg.adaptive_min_length,
        "max_length": max_length,
        "lengths": s.lengths.tolist(),
        "steps": steps.tolist(),
        "solved": solved.tolist(),
        "solved_from": solved_from.tolist(),
        "accuracy": float(solved.mean()),
        "fixed_iterations": fixed,
        "fixed_curve": curve.tolist(),
        "timing_repeats": repeats,
        "same_as_lax": bool(all(same)),
        "same_as_counted_run": bool(
            np.array_equal(np.asarray(s_drawn), steps)
            and np.array_equal(steps_sorted, steps[s.order])
            and np.array_equal(pred_sorted, pred[s.order])
        ),
        "contenders": rows,
    }


def _speedup(base, row):
    """How many times faster ``row`` ran than ``base``."""
    return f"{base['seconds'] / row['seconds']:.2f}x"


def adaptive_table(res):
    """The adaptive-vs-fixed comparison as a Markdown table."""
    fixed, lax_row = res["contenders"][0], res["contenders"][-1]
    lines = [
        "| evaluation | accuracy | iterations per string (mean) | executed sample-iterations | "
        "useful | executed / useful | wall time | speed-up vs fixed count | "
        "speed-up vs vmap(lax.while_loop) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["contenders"]:
        lines.append(
            f"| {r['contender']} | {100 * r['accuracy']:.1f}% | {r['mean_iterations']:.1f} | "
            f"{r['executed']} | {r['useful']} | {r['executed'] / r['useful']:.2f} | "
            f"{r['seconds']:.2f} s | {_speedup(fixed, r)} | {_speedup(lax_row, r)} |"
        )
    return "\n".join(lines)
