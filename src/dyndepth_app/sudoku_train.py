"""Training the Sudoku demo's model: the training pool on the device, random symmetries, the
carried batch of deep supervision, AdamW with a cosine schedule, checkpoints.

**Data.** Training puzzles come from removal paths (:mod:`~dyndepth_app.sudoku_data`) held on
the device: each new puzzle is a random path, a number of givens drawn uniformly from
``[max(cfg.min_givens, the path's end), cfg.max_givens]``, and a random symmetry of the grid
(bands, rows, stacks, columns, transpose, digits), so that a thousand paths give far more
distinct puzzles than a run sees.

**Deep supervision** (TRM): the batch of ``cfg.batch`` puzzles is carried from one optimizer
step to the next with its latent state ``(z, y)`` detached; each step runs one outer step of
:func:`~dyndepth_app.sudoku_model.outer_step` with gradient through its last cycle and
updates the parameters. A puzzle that is solved (``cfg.train_halt="solved"``; with
``"head"``, TRM's rule: whose halting logit is positive), or that has had ``cfg.max_steps``
outer steps, is replaced by a new one at the next step: the batch's rows go to the puzzles that
still have something to learn.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import sudoku_model as sm
from .args import Interrupted, interrupt_requested
from .train import (
    BadCheckpoint,
    _bar,
    adamw_init,
    adamw_update,
    refuse_other_training,
    save_checkpoint,
)

# ----------------------------------------------------------------------------- data


def _lines(key):
    """The 9 row (or column) indices of a random order of bands (stacks) and of the rows
    (columns) within each."""
    kb, *kr = jax.random.split(key, 4)
    bands = jax.random.permutation(kb, 3)
    return jnp.concatenate([3 * bands[i] + jax.random.permutation(kr[i], 3) for i in range(3)])


def symmetry(key):
    """A random validity-preserving map ``(cells (81,), digits (10,))``, applied as
    ``new = digits[old[cells]]`` (the JAX twin of :func:`~dyndepth_app.sudoku_data.symmetry`)."""
    kr, kc, kt, kd = jax.random.split(key, 4)
    rows, cols = _lines(kr), _lines(kc)
    cells = (rows[:, None] * 9 + cols[None, :]).reshape(81)
    cells = jnp.where(jax.random.bernoulli(kt), cells.reshape(9, 9).T.reshape(81), cells)
    digits = jnp.concatenate([jnp.zeros((1,), jnp.int32), 1 + jax.random.permutation(kd, 9)])
    return cells, digits


def draw(pool, key, n, min_givens, max_givens):
    """``n`` training puzzles from ``pool = (solutions, ranks, ends)`` (see
    :func:`~dyndepth_app.sudoku_data.make_paths`; ``ends``: each path's fewest givens):
    ``(puzzles, solutions)``, (n, 81) int32 each."""
    solutions, ranks, ends = pool
    ki, kg, ka = jax.random.split(key, 3)
    idx = jax.random.randint(ki, (n,), 0, solutions.shape[0])
    lo = jnp.maximum(ends[idx], min_givens)
    givens = jax.random.randint(kg, (n,), lo, jnp.maximum(lo, max_givens) + 1)
    sol = solutions[idx].astype(jnp.int32)
    puz = jnp.where(ranks[idx].astype(jnp.int32) >= 81 - givens[:, None], sol, 0)
    cells, digits = jax.vmap(symmetry)(jax.random.split(ka, n))

    def apply(grid):
        moved = jnp.take_along_axis(grid, cells, axis=1)
        return jnp.take_along_axis(digits, moved, axis=1)

    return apply(puz), apply(sol)


def device_pool(solutions, ranks):
    ends = 81 - np.sum(ranks < 81, axis=1)
    return (
        jnp.asarray(solutions, jnp.int8),
        jnp.asarray(ranks, jnp.int8),
        jnp.asarray(ends, jnp.int32),
    )


# ----------------------------------------------------------------------------- one step


def learning_rate(step, cfg):
    """Linear warm-up over ``cfg.warmup`` steps, then a cosine from ``cfg.lr`` down to
    ``cfg.lr / 10`` at ``cfg.steps``."""
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1) / max(1, cfg.warmup))
    frac = jnp.clip((step - cfg.warmup) / max(1, cfg.steps - cfg.warmup), 0.0, 1.0)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * frac)))


def init_carry(cfg):
    """The carried batch before the first step: every row done, so that all are drawn anew."""
    b, w = cfg.batch, cfg.width
    return {
        "puzzle": jnp.zeros((b, 81), jnp.int32),
        "solution": jnp.ones((b, 81), jnp.int32),
        "z": jnp.zeros((b, 81, 9, w)),
        "y": jnp.zeros((b, 81, 9, w)),
        "steps": jnp.zeros((b,), jnp.int32),
        "done": jnp.ones((b,), bool),
    }


def make_train_step(cfg):
    """The jitted step ``(params, opt, carry, pool, key, step) -> (params, opt, carry,
    metrics)``."""
    kw = dict(cycles=cfg.cycles, latent_steps=cfg.latent_steps)

    @jax.jit
    def train_step(params, opt, carry, pool, key, step):
        new_p, new_s = draw(pool, key, cfg.batch, cfg.min_givens, cfg.max_givens)
        reset = carry["done"]
        puzzle = jnp.where(reset[:, None], new_p, carry["puzzle"])
        solution = jnp.where(reset[:, None], new_s, carry["solution"])
        z0, y0 = sm.init_state(params, puzzle)
        z = jnp.where(reset[:, None, None, None], z0, carry["z"])
        y = jnp.where(reset[:, None, None, None], y0, carry["y"])
        # At the first step every row starts; rows pretend to have run 0..max_steps - 1 steps
        # already, so that they leave at different steps from then on (a batch that starts
        # together would otherwise stay in lockstep, every row at the same outer step).
        stagger = jnp.where(step == 0, jnp.arange(cfg.batch) * cfg.max_steps // cfg.batch, 0)
        steps = jnp.where(reset, stagger.astype(jnp.int32), carry["steps"])

        def loss_fn(params):
            state = sm.outer_step(params, (z, y), puzzle, **kw)
            logits, q, answer = sm.readout(params, state, puzzle)
            ce, bce, solved = sm.losses(logits, q, answer, puzzle, solution)
            return jnp.mean(ce) + cfg.halt_weight * jnp.mean(bce), (state, q, solved, ce)

        (loss, (state, q, solved, ce)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params, opt, gnorm = adamw_update(
            params, grads, opt, learning_rate(step, cfg), weight_decay=cfg.weight_decay
        )
        steps = steps + 1
        # A row leaves once its puzzle is solved (``train_halt="solved"``) or its halting head
        # fires (``"head"``, TRM's rule), or after ``max_steps`` outer steps.
        finished = solved if cfg.train_halt == "solved" else q > 0
        done = finished | (steps >= cfg.max_steps)
        carry = {
            "puzzle": puzzle,
            "solution": solution,
            "z": jax.lax.stop_gradient(state[0]),
            "y": jax.lax.stop_gradient(state[1]),
            "steps": steps,
            "done": done,
        }
        metrics = {
            "loss": loss,
            "ce": jnp.mean(ce),
            "solved": jnp.mean(solved.astype(jnp.float32)),
            "halted": jnp.mean(done.astype(jnp.float32)),
            "gnorm": gnorm,
        }
        return params, opt, carry, metrics

    return train_step


# ----------------------------------------------------------------------------- checkpoints


def _flat(tree, prefix, data):
    leaves = []
    for kp, like in jax.tree_util.tree_leaves_with_path(tree):
        leaf = np.asarray(data[prefix + jax.tree_util.keystr(kp)])
        if leaf.shape != like.shape:
            raise ValueError(f"{prefix}{jax.tree_util.keystr(kp)} has shape {leaf.shape}")
        leaves.append(jnp.asarray(leaf, like.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)


def fresh_state(cfg):
    params = sm.init_params(jax.random.PRNGKey(cfg.seed), cfg.width, cfg.layers, cfg.hidden)
    return params, {"adam": adamw_init(params), "carry": init_carry(cfg)}


def read_checkpoint(path, config_from_json):
    """``(params, state, step, cfg)`` from a Sudoku checkpoint; raises :class:`BadCheckpoint`."""
    if os.path.isdir(path):
        raise BadCheckpoint(f"{path} is a directory; pass a checkpoint file (sudoku.ckpt.npz)")
    if not os.path.exists(path):
        raise BadCheckpoint(f"{path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
        cfg = config_from_json(json.loads(str(data["__config__"])))
        params, state = fresh_state(cfg)
        return _flat(params, "params", data), _flat(state, "opt", data), int(data["__step__"]), cfg
    except Exception as e:  # zip, npz, JSON, field or shape errors: all mean "not ours"
        raise BadCheckpoint(
            f"{path} is not a checkpoint of this version of dyndepth demo --task sudoku "
            f"({type(e).__name__}: {e})"
        ) from None


def check_resumable(saved, cfg, path, training_fields):
    """Raise :class:`ConfigMismatch` when the checkpoint at ``path`` (config ``saved``) was
    trained with another configuration than ``cfg``."""
    refuse_other_training(training_fields(saved), training_fields(cfg), path)


# ----------------------------------------------------------------------------- the loop


def train(cfg, pool, out_dir, *, config_from_json, training_fields, log, stop_at=None):
    """Train for ``cfg.steps`` steps, resuming from ``out_dir/sudoku.ckpt.npz`` when present;
    returns ``(params, figures)``. After Ctrl-C, saves a checkpoint and raises
    :class:`~dyndepth_app.args.Interrupted`. ``stop_at`` ends the call early at that step (as
    an interruption would)."""
    ckpt = os.path.join(out_dir, "sudoku.ckpt.npz")
    params, state = fresh_state(cfg)
    start = 0
    if os.path.exists(ckpt):
        params, state, start, saved = read_checkpoint(ckpt, config_from_json)
        check_resumable(saved, cfg, ckpt, training_fields)
        log(f"[sudoku] resuming from {ckpt} at step {start}")
    step_fn = make_train_step(cfg)
    key = jax.random.PRNGKey(cfg.seed + 1)

    def save(step):
        save_checkpoint(ckpt, params, state, step, cfg)

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    bar = _bar(cfg.steps, "sudoku")
    if bar is not None:
        bar.update(start)
    every = max(1, cfg.steps // 10)
    history, times = [], []
    t_start = time.perf_counter()
    step = start
    budget = 60 * cfg.train_minutes if cfg.train_minutes > 0 else float("inf")
    timed_out = False
    while step < end:
        if time.perf_counter() - t_start > budget:
            save(step)
            timed_out = True
            break
        if interrupt_requested():
            save(step)
            if bar is not None:
                bar.close()
            raise Interrupted(
                f"interrupted at step {step} of {cfg.steps}; checkpoint saved to {ckpt}; run the "
                "same command to resume"
            )
        t0 = time.perf_counter()
        params, adam, carry, m = step_fn(
            params,
            state["adam"],
            state["carry"],
            pool,
            jax.random.fold_in(key, step),
            jnp.int32(step),
        )
        state = {"adam": adam, "carry": carry}
        m = {k: float(v) for k, v in m.items()}
        dt = time.perf_counter() - t0
        if step > start + 2:
            times.append(dt)
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", solved=f"{m['solved']:.2f}")
        if step % every == 0 or step == end:
            history.append({"step": step, **m})
            if bar is None or bar.disable:  # no bar (stderr is not a terminal): a log line
                log(
                    f"[sudoku] step {step} loss {m['loss']:.4f}, solved {m['solved']:.2f} of "
                    f"the batch, {time.perf_counter() - t_start:.0f} s"
                )
            save(step)
    if bar is not None:
        bar.close()
    if timed_out:
        log(
            f"[sudoku] stopped at step {step} of {cfg.steps}: the training time limit of "
            f"{cfg.train_minutes:g} minutes is used up (the same command resumes the training; "
            "--train-minutes 0 lifts the limit)"
        )
    figures = {
        "steps_run": step - start,
        "step": step,
        "stopped_by_time_limit": timed_out,
        "train_seconds": time.perf_counter() - t_start,
        "median_step_seconds": float(np.median(times)) if times else None,
        "history": history,
        "parameters": sm.count_params(params),
    }
    return params, figures
