"""The Sudoku demo's model: a tiny recursive model (TRM-style) on row/column/box message passing.

One small network ``net`` updates two latent states of shape (81, 9, width), one vector per
cell and digit: ``z`` (the reasoning state) and ``y`` (the current answer). Each of its
``layers`` residual layers lets every (cell, digit) read the means over its row, its column and
its box (for the same digit) and over its cell's nine digits; the same weights serve every
digit, so the network treats the digits alike (relabelling them relabels its answer)::

    cycle(z, y):  z = net(z + y + x)   (latent_steps times; x: the embedded givens)
                  y = net(y + z)
    outer step:   cycles - 1 cycles without gradient, then one cycle with gradient
                  (dyndepth.nn.recurrent_depth with n = cycles - 1, k = 1)
                  answer = argmax(y @ out) on the empty cells, the givens elsewhere
                  q      = mean over cells of y, times the halting head (a logit)

Training uses deep supervision (TRM): a carried batch of puzzles, one outer step per optimizer
step, the carry ``(z, y)`` detached between steps; the loss is the cross-entropy on the empty
cells plus the binary cross-entropy of ``q`` against "the answer is fully right". A puzzle
leaves the batch (and a new one takes its row) once it is solved (or, with TRM's rule, once
``q > 0``) or after ``max_steps`` outer steps. Gradients flow through the last cycle of each
outer step only, as in TRM.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dyndepth import nn as dnn

# ----------------------------------------------------------------------------- network


def init_params(key, width, layers, hidden=None):
    """Parameters for ``width`` channels per (cell, digit) and ``hidden`` in each layer."""
    hidden = 2 * width if hidden is None else hidden
    ks = jax.random.split(key, 2 * layers + 5)

    def dense(k, cin, cout, scale=1.0):
        return scale * jax.random.normal(k, (cin, cout), jnp.float32) / math.sqrt(cin)

    return {
        "embed": jax.random.normal(ks[0], (3, width), jnp.float32),
        "z0": jax.random.normal(ks[1], (width,), jnp.float32),
        "y0": jax.random.normal(ks[2], (width,), jnp.float32),
        "layers": [
            {
                "w1": dense(ks[5 + 2 * i], 5 * width, hidden),
                "b1": jnp.zeros((hidden,), jnp.float32),
                "w2": dense(ks[6 + 2 * i], hidden, width, 0.5),
                "b2": jnp.zeros((width,), jnp.float32),
            }
            for i in range(layers)
        ],
        "out": dense(ks[3], width, 1)[:, 0],
        "halt": jnp.zeros((width,), jnp.float32),
        "halt_b": jnp.asarray(-2.0, jnp.float32),
    }


def count_params(params):
    return int(sum(a.size for a in jax.tree_util.tree_leaves(params)))


def _rms(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def units(h):
    """``h`` (..., 81, 9, C) -> (..., 81, 9, 5C): each (cell, digit)'s own vector, the means
    over its row, column and box (same digit), and the mean over its cell's nine digits."""
    lead, c = h.shape[:-3], h.shape[-1]
    g = h.reshape(lead + (3, 3, 3, 3, 9, c))  # band, row in band, stack, column in stack
    n = len(lead)
    row = jnp.mean(g, axis=(n + 2, n + 3), keepdims=True)
    col = jnp.mean(g, axis=(n + 0, n + 1), keepdims=True)
    box = jnp.mean(g, axis=(n + 1, n + 3), keepdims=True)
    cell = jnp.mean(g, axis=n + 4, keepdims=True)
    full = g.shape
    parts = [g] + [jnp.broadcast_to(a, full) for a in (row, col, box, cell)]
    return jnp.concatenate(parts, axis=-1).reshape(lead + (81, 9, 5 * c))


def net(params, h):
    for layer in params["layers"]:
        u = jax.nn.relu(units(h) @ layer["w1"] + layer["b1"])
        h = _rms(h + u @ layer["w2"] + layer["b2"])
    return h


def cycle(params, state, x, latent_steps):
    z, y = state
    for _ in range(latent_steps):
        z = net(params, z + y + x)
    return z, net(params, y + z)


def embed(params, puzzle):
    """The givens ``puzzle`` (..., 81) int (0: empty) -> (..., 81, 9, C): per (cell, digit),
    the embedding of "this digit is given here", "another digit is given here" or "empty"."""
    digits = jnp.arange(1, 10, dtype=puzzle.dtype)
    p = puzzle[..., None]
    kind = jnp.where(p == digits, 0, jnp.where(p > 0, 1, 2))
    return params["embed"][kind]


def init_state(params, puzzle):
    shape = puzzle.shape + (9,) + params["z0"].shape
    return jnp.broadcast_to(params["z0"], shape), jnp.broadcast_to(params["y0"], shape)


def readout(params, state, puzzle):
    """``(logits (..., 81, 9), q (...,), answer (..., 81) int)``: the answer keeps the givens."""
    y = state[1]
    logits = y @ params["out"]
    q = jnp.mean(y, axis=(-3, -2)) @ params["halt"] + params["halt_b"]
    answer = jnp.where(puzzle > 0, puzzle, jnp.argmax(logits, axis=-1) + 1)
    return logits, q, answer.astype(puzzle.dtype)


def outer_step(params, state, puzzle, *, cycles, latent_steps, library=False):
    """One outer (supervision) step: ``cycles - 1`` cycles without gradient, then one with
    gradient. Returns the new state. ``library=True`` runs it through
    :func:`dyndepth.nn.recurrent_depth` (``n = cycles - 1``, ``k = 1``), which computes the
    same; the demo unrolls it (two fixed cycles: a loop primitive of one iteration only costs
    compile and step time here, see docs/sudoku.md)."""
    x = embed(params, puzzle)
    if library:
        return dnn.recurrent_depth(
            lambda s, x: cycle(params, s, x, latent_steps),
            state,
            x,
            n=cycles - 1,
            k=1,
            max_n=max(cycles - 1, 0),
            max_k=1,
        )
    if cycles > 1:
        frozen, xs = jax.lax.stop_gradient(params), jax.lax.stop_gradient(x)
        state = jax.lax.stop_gradient(state)
        for _ in range(cycles - 1):
            state = cycle(frozen, state, xs, latent_steps)
        state = jax.lax.stop_gradient(state)
    return cycle(params, state, x, latent_steps)


def outer_step_eval(params, state, puzzle, *, cycles, latent_steps):
    """:func:`outer_step` for evaluation (no gradient): the same cycles, plainly unrolled."""
    x = embed(params, puzzle)
    for _ in range(cycles):
        state = cycle(params, state, x, latent_steps)
    return state


def obeys_rules(answer):
    """Whether a full grid ``answer`` (..., 81) has every digit once in each row, column and
    box: for a puzzle with a unique solution that also keeps its givens, solved."""
    one = jax.nn.one_hot(answer - 1, 9, dtype=jnp.int32)  # (..., 81, 9)
    lead = answer.shape[:-1]
    g = one.reshape(lead + (3, 3, 3, 3, 9))
    n = len(lead)
    ok = [
        jnp.all(jnp.sum(g, axis=axes) == 1, axis=tuple(range(n, n + 3)))
        for axes in ((n + 2, n + 3), (n + 0, n + 1), (n + 1, n + 3))
    ]
    return ok[0] & ok[1] & ok[2]


def conflicts(answer):
    """Rule violations of a full grid ``answer`` (..., 81): over every row, column and box, the
    cells beyond the first that hold a digit the unit already has (0 exactly when
    :func:`obeys_rules`)."""
    one = jax.nn.one_hot(answer - 1, 9, dtype=jnp.int32)
    lead = answer.shape[:-1]
    g = one.reshape(lead + (3, 3, 3, 3, 9))
    n = len(lead)
    total = 0
    for axes in ((n + 2, n + 3), (n + 0, n + 1), (n + 1, n + 3)):
        extra = jnp.maximum(jnp.sum(g, axis=axes) - 1, 0)
        total = total + jnp.sum(extra, axis=tuple(range(n, n + 3)))
    return total


def losses(logits, q, answer, puzzle, solution):
    """Per puzzle: ``(cross-entropy on the empty cells, halting BCE, solved)``."""
    empty = (puzzle == 0).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ll = jnp.take_along_axis(logp, (solution - 1)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = -jnp.sum(ll * empty, axis=-1) / jnp.maximum(jnp.sum(empty, axis=-1), 1.0)
    solved = jnp.all(answer == solution, axis=-1)
    t = solved.astype(jnp.float32)
    bce = jnp.maximum(q, 0) - q * t + jnp.log1p(jnp.exp(-jnp.abs(q)))
    return ce, bce, solved
