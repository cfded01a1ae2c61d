"""``dyndepth demo --task sudoku``: a tiny recursive model that thinks per puzzle and halts per
puzzle, in batches.

The run (:func:`run_sudoku`): make the puzzles (seeded, cached in ``--out``: training removal
paths, and held-out test puzzles bucketed by difficulty, :mod:`~dyndepth_app.sudoku_data`),
train the model (:mod:`~dyndepth_app.sudoku_train`, :mod:`~dyndepth_app.sudoku_model`),
then evaluate it on the test puzzles three ways:

- the fixed maximum: every puzzle runs ``max_steps`` outer steps (a batched ``lax.fori_loop``);
- per-puzzle halting in one batch: ``dyndepth.while_loop`` under ``vmap``, the library's
  continuous batching in ``eval_slots`` slots (a slot takes the next puzzle the moment its
  puzzle halts); beside it, as a control, the fixed maximum run ``eval_slots`` puzzles at a
  time (the same working set, no halting);
- ``jax.vmap(lax.while_loop)`` with the same rule (the batch runs until its slowest halts).

The halting rule (``halt_rule``): ``"valid"`` stops a puzzle once its answer obeys the rules
(every digit once per row, column and box; with the givens kept, that is the unique solution);
``"stalled"`` also stops it once its count of conflicts (repeated digits in a row, column or
box) has not reached a new low for ``stall_steps`` outer steps (a puzzle that is stuck);
``"head"`` once the learned halting head says the answer is final (``q > 0``); ``"both"`` when
both hold. Output: a progress bar, tables, ``sudoku_steps.png``, ``sudoku_accuracy.png``,
``results.json`` (and ``--json FILE``), a checkpoint and the cached puzzles in the folder.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dyndepth

from . import sudoku_data as sd
from . import sudoku_model as sm
from . import sudoku_train as st
from .args import check_interrupt, int_at_least
from .config import _eval, training_fields
from .evaluate import _timed
from .plots import MISSING, _pyplot, have_matplotlib
from .train import BadCheckpoint, ConfigMismatch

GENERATOR_VERSION = 1


@dataclass(frozen=True)
class SudokuConfig:
    # model
    width: int = 16  # channels per (cell, digit)
    hidden: int = 32
    layers: int = 2
    cycles: int = 2  # per outer step; gradient through the last one
    latent_steps: int = 1  # z updates per cycle
    max_steps: int = 16  # outer steps, in training and evaluation
    # training
    batch: int = 32
    steps: int = 1600
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    halt_weight: float = 0.5
    # a training puzzle leaves the carried batch once solved ("solved") or once the halting
    # head fires ("head", TRM's rule), or after max_steps outer steps
    train_halt: str = "solved"
    min_givens: int = 17  # training puzzles: givens drawn from [min_givens, max_givens]
    max_givens: int = 40
    train_paths: int = 500
    seed: int = 0
    # at most this many minutes of training steps per call (a later call resumes); 0: no limit
    train_minutes: float = _eval(7.0)
    # evaluation
    test_per_bucket: int = _eval(100)
    halt_rule: str = _eval("valid")
    eval_chunk: int = _eval(60)
    adaptive_repeats: int = _eval(1)
    # slots of the scheduled loop (dyndepth.while_loop's ``slots=``); 0: the library's default
    # (a quarter of the batch). Fewer slots leave a shorter tail (a slot waits for the last
    # puzzles) and keep the working set in the CPU's caches; see docs/sudoku.md
    eval_slots: int = _eval(15)
    # rule "stalled": a puzzle also stops when its conflicts have not reached a new low for
    # this many outer steps
    stall_steps: int = _eval(6)


# ``--quick``: a seconds-long smoke run. Flags given explicitly win over these values.
QUICK = dict(
    width=4,
    hidden=8,
    layers=1,
    cycles=2,
    latent_steps=1,
    max_steps=4,
    batch=8,
    steps=6,
    warmup=2,
    train_paths=8,
    test_per_bucket=4,
    eval_slots=3,
)

# ``--preset gpu``: a larger model and longer training for one accelerator.
GPU = dict(
    width=32,
    hidden=64,
    layers=2,
    latent_steps=2,
    max_steps=16,
    batch=256,
    steps=6000,
    lr=2e-3,
    warmup=200,
    train_paths=3000,
    min_givens=17,
    max_givens=40,
    train_minutes=8.0,
    test_per_bucket=500,
    eval_slots=0,
    eval_chunk=500,
)
PRESETS = {"cpu": {}, "gpu": GPU}


def config_from_json(values):
    names = {f.name for f in fields(SudokuConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"unknown fields {unknown}")
    return SudokuConfig(**values)


def replace(cfg, **changes):
    return SudokuConfig(**{**asdict(cfg), **changes})


# ----------------------------------------------------------------------------- data sets


# Test puzzles have 17 to 45 givens (whatever the training range).
TEST_GIVENS = (17, 45)


def _test_set(cfg, log):
    """One puzzle per removal path of the test stream (never the training stream's), each
    aimed at the bucket with the fewest puzzles so far, until every bucket holds
    ``cfg.test_per_bucket``: arrays ``puzzles, solutions`` (N, 81) and per puzzle ``givens``,
    ``rounds``, ``nodes``, ``bucket`` (index into :data:`~dyndepth_app.sudoku_data.BUCKETS`)."""
    rng = random.Random(f"sudoku-test-{cfg.seed}")
    need = cfg.test_per_bucket
    got = {b: [] for b in sd.BUCKETS}
    lo, hi = TEST_GIVENS
    tries = 0
    while min(len(v) for v in got.values()) < need:
        tries += 1
        if tries > 50 * need + 100:
            raise RuntimeError("the test-set generator could not fill its difficulty buckets")
        want = min(sd.BUCKETS, key=lambda b: len(got[b]))
        solution, path = sd.removal_path(rng)
        end = 81 - len(path)
        if want == "easy":
            target = rng.randint(max(36, lo), max(36, hi))
        elif want == "medium":
            target = rng.randint(max(end, lo, 26), max(end, lo, 35))
        else:
            target = max(end, lo)
        givens = min(max(target, end), 81)
        puzzle = sd.puzzle_from_path(solution, path, givens)
        rounds, nodes = sd.difficulty(puzzle)
        bucket = sd.bucket_of(rounds, nodes)
        if len(got[bucket]) < need:
            got[bucket].append((puzzle, solution, givens, rounds, nodes))
    rows = [(*r, i) for i, b in enumerate(sd.BUCKETS) for r in got[b]]
    return {
        "puzzles": np.asarray([r[0] for r in rows], np.int8),
        "solutions": np.asarray([r[1] for r in rows], np.int8),
        "givens": np.asarray([r[2] for r in rows], np.int32),
        "rounds": np.asarray([r[3] for r in rows], np.int32),
        "nodes": np.asarray([r[4] for r in rows], np.int32),
        "bucket": np.asarray([r[5] for r in rows], np.int32),
        "paths_drawn": np.asarray(tries),
    }


def _data_key(cfg):
    return json.dumps(
        {
            "version": GENERATOR_VERSION,
            "seed": cfg.seed,
            "train_paths": cfg.train_paths,
            "test_per_bucket": cfg.test_per_bucket,
            "min_givens": cfg.min_givens,
            "max_givens": cfg.max_givens,
            "test_givens": TEST_GIVENS,
        },
        sort_keys=True,
    )


def datasets(cfg, out_dir, log):
    """``(train, test, figures)``: the training removal paths and the test puzzles, read from
    ``out_dir/sudoku_data.npz`` when it holds the same settings, else generated (seeded) and
    written there. Training and test grids come from separate random streams; a test grid equal
    to a training grid would raise."""
    path = os.path.join(out_dir, "sudoku_data.npz")
    key = _data_key(cfg)
    if os.path.exists(path):
        try:
            data = np.load(path, allow_pickle=False)
            if str(data["key"]) == key:
                train = (data["train_solutions"], data["train_ranks"])
                test = {k[5:]: data[k] for k in data.files if k.startswith("test_")}
                log(f"[sudoku] puzzles read from {path}")
                return train, test, {"cached": True, "seconds": 0.0}
        except Exception:  # unreadable or stale: make them again
            pass
    t0 = time.perf_counter()
    bar = st._bar(cfg.train_paths, "puzzles")
    progress = (lambda n: bar.update(n)) if bar is not None else None
    train = sd.make_paths(f"sudoku-train-{cfg.seed}", cfg.train_paths, progress)
    if bar is not None:
        bar.close()
    t_train = time.perf_counter() - t0
    check_interrupt("interrupted while making the puzzles (nothing saved)")
    t1 = time.perf_counter()
    test = _test_set(cfg, log)
    t_test = time.perf_counter() - t1
    seen = {s.tobytes() for s in train[0]}
    if any(s.tobytes() in seen for s in test["solutions"]):
        raise RuntimeError("a test grid equals a training grid")
    os.makedirs(out_dir, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(
        tmp,
        key=np.asarray(key),
        train_solutions=train[0],
        train_ranks=train[1],
        **{f"test_{k}": v for k, v in test.items()},
    )
    os.replace(tmp, path)
    figures = {
        "cached": False,
        "seconds": time.perf_counter() - t0,
        "train_paths_per_second": cfg.train_paths / max(t_train, 1e-9),
        "test_paths_drawn": int(test["paths_drawn"]),
        "test_seconds": t_test,
    }
    log(
        f"[sudoku] made {cfg.train_paths} training paths in {t_train:.0f} s and "
        f"{len(test['bucket'])} test puzzles (from {int(test['paths_drawn'])} paths) in "
        f"{t_test:.0f} s; cached in {path}"
    )
    return train, test, figures


# ----------------------------------------------------------------------------- evaluation


def _stop(rule, q, answer):
    if rule == "head":
        return q > 0
    if rule == "valid":
        return sm.obeys_rules(answer)
    return (q > 0) & sm.obeys_rules(answer)


def stalled(conflicts, stall_steps):
    """Rule ``"stalled"`` replayed on conflicts per step ``(T, N)``: per step and puzzle, whether
    the answer obeys the rules (no conflicts) or its conflicts have not reached a new low for
    ``stall_steps`` steps (bool, (T, N))."""
    best = np.full(conflicts.shape[1], np.iinfo(np.int32).max)
    since = np.zeros(conflicts.shape[1], np.int64)
    out = np.zeros(conflicts.shape, bool)
    for t, c in enumerate(conflicts):
        since = np.where(c < best, 0, since + 1)
        best = np.minimum(best, c)
        out[t] = (c == 0) | (since >= stall_steps)
    return out


def _kw(cfg):
    return dict(cycles=cfg.cycles, latent_steps=cfg.latent_steps)


def trajectory(params, cfg, puzzles, solutions):
    """After each outer step ``1..max_steps`` of every puzzle: ``solved``, ``valid`` (the answer
    obeys the rules), ``head`` (``q > 0``), bool, and ``conflicts`` (:func:`sm.conflicts`), int,
    numpy arrays (max_steps, N); in chunks of ``cfg.eval_chunk`` puzzles, checking for Ctrl-C
    between them."""

    @jax.jit
    def run(params, puz, sol):
        def step(state, _):
            state = sm.outer_step_eval(params, state, puz, **_kw(cfg))
            _, q, ans = sm.readout(params, state, puz)
            valid = sm.obeys_rules(ans)
            return state, (jnp.all(ans == sol, -1), valid, q > 0, sm.conflicts(ans))

        return lax.scan(step, sm.init_state(params, puz), None, length=cfg.max_steps)[1]

    outs = []
    for i in range(0, len(puzzles), cfg.eval_chunk):
        check_interrupt("interrupted during the evaluation")
        sl = slice(i, i + cfg.eval_chunk)
        p, s = jnp.asarray(puzzles[sl], jnp.int32), jnp.asarray(solutions[sl], jnp.int32)
        outs.append([np.asarray(a) for a in run(params, p, s)])
    return [np.concatenate([o[j] for o in outs], axis=1) for j in range(4)]


def halting_fns(params, cfg, rule):
    """``(init, cond, body, answer)`` of one puzzle's halting loop: the carry is ``(z, y,
    puzzle, stop, best, since)`` (``best``: the fewest conflicts so far, ``since``: steps since
    that low was reached, for rule ``"stalled"``); ``body`` runs one outer step and evaluates
    the rule."""

    def init(puz):
        z, y = sm.init_state(params, puz)
        big = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
        return z, y, puz, jnp.zeros((), bool), big, jnp.zeros((), jnp.int32)

    def body(c):
        z, y, puz, _, best, since = c
        z, y = sm.outer_step_eval(params, (z, y), puz, **_kw(cfg))
        _, q, ans = sm.readout(params, (z, y), puz)
        if rule == "stalled":
            n = sm.conflicts(ans)
            since = jnp.where(n < best, 0, since + 1)
            best = jnp.minimum(best, n)
            stop = (n == 0) | (since >= cfg.stall_steps)
        else:
            stop = _stop(rule, q, ans)
        return z, y, puz, stop, best, since

    def answer(c):
        return sm.readout(params, (c[0], c[1]), c[2])[2]

    return init, (lambda c: ~c[3]), body, answer


def halting_dyndepth(params, cfg, rule, puzzles):
    """``dyndepth.while_loop`` under ``vmap``: ``(answers (N, 81), steps (N,), executed)``,
    ``executed`` the sample-steps its loop ran (``return_info``). Puzzles with more blanks
    (fewer givens: usually the hardest, the longest to think) start first, so that the long
    ones do not form the loop's tail."""
    init, cond, body, answer = halting_fns(params, cfg, rule)
    slots = cfg.eval_slots or None

    def one(puz):
        c, info = dyndepth.while_loop(
            cond, body, init(puz), max_steps=cfg.max_steps, return_info=True, slots=slots,
            priority=lambda c: jnp.sum(c[2] == 0),
        )  # fmt: skip
        return answer(c), info["steps"], info["executed_sample_steps"]

    answers, steps, executed = jax.vmap(one)(puzzles)
    return answers, steps, executed[0]  # (one loop for the batch: every puzzle has its figure)


def halting_lax(params, cfg, rule, puzzles):
    """``jax.vmap`` of ``lax.while_loop`` with the same rule: ``(answers, steps)``."""
    init, cond, body, answer = halting_fns(params, cfg, rule)

    def one(puz):
        c, steps = lax.while_loop(
            lambda cs: cond(cs[0]) & (cs[1] < cfg.max_steps),
            lambda cs: (body(cs[0]), cs[1] + 1),
            (init(puz), jnp.int32(0)),
        )
        return answer(c), steps

    return jax.vmap(one)(puzzles)


def fixed_steps(params, cfg, puzzles):
    """Every puzzle for ``max_steps`` outer steps (a batched ``lax.fori_loop``): answers."""
    state = lax.fori_loop(
        0,
        cfg.max_steps,
        lambda i, s: sm.outer_step_eval(params, s, puzzles, **_kw(cfg)),
        sm.init_state(params, puzzles),
    )
    return sm.readout(params, state, puzzles)[2]


def fixed_in_chunks(params, cfg, puzzles, size):
    """:func:`fixed_steps` on ``size`` puzzles at a time (a ``lax.map`` over chunks, the last
    one padded with empty grids): the fixed maximum with the working set of ``size`` slots, to
    tell what the scheduled loop gains from halting from what it gains from its smaller batch."""
    n = puzzles.shape[0]
    chunks = -(-n // size)
    padded = jnp.zeros((chunks * size, 81), puzzles.dtype).at[:n].set(puzzles)
    out = lax.map(lambda x: fixed_steps(params, cfg, x), padded.reshape(chunks, size, 81))
    return out.reshape(chunks * size, 81)[:n]


def _by_bucket(values, bucket):
    return {b: float(np.mean(values[bucket == i])) for i, b in enumerate(sd.BUCKETS)}


def rule_table(traj, bucket, stall_steps):
    """Each halting rule replayed on the fixed run's trajectory: accuracy and mean steps, by
    bucket (a puzzle's answer is the one after the step at which the rule first holds)."""
    solved, valid, head, conflicts = traj
    T = solved.shape[0]
    out = {}
    replays = (
        ("valid", valid),
        ("head", head),
        ("both", valid & head),
        ("stalled", stalled(conflicts, stall_steps)),
    )
    for rule, stop in replays:
        first = np.where(stop.any(0), stop.argmax(0), T - 1)
        ok = solved[first, np.arange(solved.shape[1])]
        steps = first + 1
        out[rule] = {
            "accuracy": float(ok.mean()),
            "mean_steps": float(steps.mean()),
            "accuracy_by_difficulty": _by_bucket(ok, bucket),
            "steps_by_difficulty": _by_bucket(steps, bucket),
        }
    return out


def evaluate(params, cfg, test, log):
    """The three-way comparison on the test puzzles (see the module's docstring)."""
    puzzles = jnp.asarray(test["puzzles"], jnp.int32)
    solutions = np.asarray(test["solutions"])
    bucket = np.asarray(test["bucket"])
    N = len(bucket)
    t0 = time.perf_counter()
    traj = trajectory(params, cfg, test["puzzles"], test["solutions"])
    t_traj = time.perf_counter() - t0
    rules = rule_table(traj, bucket, cfg.stall_steps)
    rule = cfg.halt_rule
    check_interrupt("interrupted during the evaluation")
    contenders = {
        "fixed": (lambda p, x: fixed_steps(p, cfg, x), (params, puzzles)),
        "dyndepth": (lambda p, x: halting_dyndepth(p, cfg, rule, x), (params, puzzles)),
        "lax": (lambda p, x: halting_lax(p, cfg, rule, x), (params, puzzles)),
    }
    slots = cfg.eval_slots or -(-N // 4)  # the library's default: a quarter of the batch
    if slots < N:
        contenders["fixed_chunks"] = (
            lambda p, x: fixed_in_chunks(p, cfg, x, slots),
            (params, puzzles),
        )
    timings = _timed(contenders, cfg.adaptive_repeats)
    ans_fixed = np.asarray(timings["fixed"][0])
    ans_dd, steps_dd, executed_dd = timings["dyndepth"][0]
    ans_dd, steps_dd = np.asarray(ans_dd), np.asarray(steps_dd)
    ans_lax, steps_lax = (np.asarray(a) for a in timings["lax"][0])
    if "fixed_chunks" in timings and not np.array_equal(
        np.asarray(timings["fixed_chunks"][0]), ans_fixed
    ):
        raise RuntimeError("the fixed maximum in chunks gave other answers than in one batch")
    solved_fixed = np.all(ans_fixed == solutions, axis=1)
    solved_dd = np.all(ans_dd == solutions, axis=1)
    solved_lax = np.all(ans_lax == solutions, axis=1)
    useful = int(steps_dd.sum())
    rows = {
        "fixed": dict(
            accuracy=float(solved_fixed.mean()),
            mean_steps=float(cfg.max_steps),
            executed=N * cfg.max_steps,
        ),
        "dyndepth": dict(
            accuracy=float(solved_dd.mean()),
            mean_steps=float(steps_dd.mean()),
            executed=int(executed_dd),
        ),
        "lax": dict(
            accuracy=float(solved_lax.mean()),
            mean_steps=float(steps_lax.mean()),
            executed=N * int(steps_lax.max()),
        ),
    }
    if "fixed_chunks" in timings:
        rows["fixed_chunks"] = dict(
            accuracy=rows["fixed"]["accuracy"],
            mean_steps=float(cfg.max_steps),
            executed=-(-N // slots) * slots * cfg.max_steps,
        )
    for name, r in rows.items():
        r["seconds"] = timings[name][1]
        r["compile_seconds"] = timings[name][2]
        r["executed_over_useful"] = r["executed"] / max(useful, 1)
    adaptive = {
        "rule": rule,
        "puzzles": N,
        "accuracy": rows["dyndepth"]["accuracy"],
        "fixed_accuracy": rows["fixed"]["accuracy"],
        "lax_accuracy": rows["lax"]["accuracy"],
        "mean_steps": rows["dyndepth"]["mean_steps"],
        "max_steps": cfg.max_steps,
        "executed": rows["dyndepth"]["executed"],
        "useful": useful,
        "executed_over_useful": rows["dyndepth"]["executed_over_useful"],
        "lax_executed_over_useful": rows["lax"]["executed_over_useful"],
        "seconds": rows["dyndepth"]["seconds"],
        "fixed_seconds": rows["fixed"]["seconds"],
        "lax_seconds": rows["lax"]["seconds"],
        "slots": min(slots, N),
        "fixed_chunks_seconds": rows.get("fixed_chunks", {}).get("seconds"),
        "timing_repeats": cfg.adaptive_repeats,
        "same_as_lax": bool(
            np.array_equal(steps_dd, steps_lax) and np.array_equal(ans_dd, ans_lax)
        ),
        "order": "fewest givens first",
        "contenders": rows,
    }
    fixed_by_step = {
        b: traj[0][:, bucket == i].mean(axis=1).tolist() for i, b in enumerate(sd.BUCKETS)
    }
    givens = np.asarray(test["givens"])
    by_givens = {}
    for lo, hi in ((17, 25), (26, 35), (36, 45)):
        sel = (givens >= lo) & (givens <= hi)
        if sel.any():
            by_givens[f"{lo}-{hi}"] = {
                "puzzles": int(sel.sum()),
                "accuracy": float(solved_dd[sel].mean()),
                "fixed_accuracy": float(solved_fixed[sel].mean()),
            }
    return {
        "accuracy_by_givens": by_givens,
        "accuracy_by_difficulty": _by_bucket(solved_dd, bucket),
        "steps_by_difficulty": _by_bucket(steps_dd, bucket),
        "fixed_accuracy_by_difficulty": _by_bucket(solved_fixed, bucket),
        "fixed_accuracy_by_step": fixed_by_step,
        "rules": rules,
        "adaptive": adaptive,
        "puzzles": {
            "bucket": [sd.BUCKETS[i] for i in bucket],
            "givens": np.asarray(test["givens"]).tolist(),
            "rounds": np.asarray(test["rounds"]).tolist(),
            "search_nodes": np.asarray(test["nodes"]).tolist(),
            "steps": steps_dd.tolist(),
            "solved": solved_dd.tolist(),
        },
        "trajectory_seconds": t_traj,
    }


# ----------------------------------------------------------------------------- report


def tables(res, cfg):
    """The accuracy-by-difficulty and halting tables (Markdown)."""
    counts = {b: res["puzzles"]["bucket"].count(b) for b in sd.BUCKETS}
    lines = [
        "| difficulty | puzzles | fully solved, halting | mean steps, halting | "
        f"fully solved, fixed {cfg.max_steps} steps |",
        "|---|---|---|---|---|",
    ]
    for b in sd.BUCKETS:
        lines.append(
            f"| {b} ({sd.BUCKET_RULES[b]}) | {counts[b]} | "
            f"{100 * res['accuracy_by_difficulty'][b]:.1f}% | "
            f"{res['steps_by_difficulty'][b]:.1f} | "
            f"{100 * res['fixed_accuracy_by_difficulty'][b]:.1f}% |"
        )
    a = res["adaptive"]
    lines += [
        "",
        f"Halting per puzzle, rule {a['rule']!r}, {a['puzzles']} test puzzles in one batch:",
        "",
        "| evaluation | fully solved | mean steps | executed / useful sample-steps | wall time | "
        "vs fixed |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "fixed": f"fixed maximum ({cfg.max_steps} steps, lax.fori_loop)",
        "dyndepth": "dyndepth.while_loop under vmap (scheduled)",
        "lax": "vmap(lax.while_loop)",
        "fixed_chunks": f"fixed maximum, {a['slots']} puzzles at a time (lax.map)",
    }
    fixed_s = a["contenders"]["fixed"]["seconds"]
    for k in ("fixed", "fixed_chunks", "dyndepth", "lax"):
        if k not in a["contenders"]:
            continue
        r = a["contenders"][k]
        lines.append(
            f"| {names[k]} | {100 * r['accuracy']:.1f}% | {r['mean_steps']:.1f} | "
            f"{r['executed_over_useful']:.2f} | {r['seconds']:.2f} s | "
            f"{r['seconds'] / fixed_s:.2f}x |"
        )
    lines += ["", "Halting rules replayed on the fixed run (fully solved / mean steps):", ""]
    lines += ["| rule | " + " | ".join(sd.BUCKETS) + " | all |", "|---|---|---|---|---|"]
    for rule, r in res["rules"].items():
        cells = [
            f"{100 * r['accuracy_by_difficulty'][b]:.1f}% / {r['steps_by_difficulty'][b]:.1f}"
            for b in sd.BUCKETS
        ]
        lines.append(
            f"| {rule} | " + " | ".join(cells) + f" | {100 * r['accuracy']:.1f}% / "
            f"{r['mean_steps']:.1f} |"
        )
    return "\n".join(lines)


def plot(res, cfg, out_dir):
    """``sudoku_steps.png`` (steps taken against difficulty) and ``sudoku_accuracy.png``
    (accuracy by bucket, and after each outer step); ``[]`` without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return []
    pz = res["puzzles"]
    rounds, nodes = np.asarray(pz["rounds"]), np.asarray(pz["search_nodes"])
    steps, solved = np.asarray(pz["steps"]), np.asarray(pz["solved"], bool)
    hard = nodes > 0
    top = int(rounds[~hard].max()) if (~hard).any() else 0
    x = np.where(hard, top + 3, rounds).astype(float)
    x = x + np.random.default_rng(0).uniform(-0.3, 0.3, x.shape)
    y = steps + np.random.default_rng(1).uniform(-0.2, 0.2, x.shape)
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=100)
    ax.scatter(x[solved], y[solved], s=6, label="halted, solved")
    if (~solved).any():
        ax.scatter(x[~solved], y[~solved], s=10, marker="x", color="red", label="not solved")
    for r in sorted(set(rounds[~hard].tolist())):
        sel = (~hard) & (rounds == r)
        ax.plot([r - 0.4, r + 0.4], [steps[sel].mean()] * 2, color="black", lw=1.5)
    if hard.any():
        ax.plot([top + 2.6, top + 3.4], [steps[hard].mean()] * 2, color="black", lw=1.5)
    ticks = list(range(0, top + 1, max(1, top // 8))) + [top + 3]
    ax.set_xticks(ticks, [str(t) for t in ticks[:-1]] + ["search"])
    ax.axvline(4.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("difficulty: rounds of single-candidate propagation (search: singles get stuck)")
    ax.set_ylabel("outer steps taken (black: mean)")
    ax.set_title(
        f"Per-puzzle halting ({res['adaptive']['rule']}), {len(steps)} test puzzles in one batch",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    p1 = os.path.join(out_dir, "sudoku_steps.png")
    fig.savefig(p1)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4), dpi=100)
    xs = np.arange(len(sd.BUCKETS))
    a1.bar(xs - 0.2, [100 * res["accuracy_by_difficulty"][b] for b in sd.BUCKETS], 0.4,
           label="halting per puzzle")  # fmt: skip
    a1.bar(xs + 0.2, [100 * res["fixed_accuracy_by_difficulty"][b] for b in sd.BUCKETS], 0.4,
           label=f"fixed {cfg.max_steps} steps")  # fmt: skip
    a1.set_xticks(xs, sd.BUCKETS)
    a1.set_ylabel("test puzzles fully solved (%)")
    a1.set_ylim(0, 105)
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3, axis="y")
    for b, curve in res["fixed_accuracy_by_step"].items():
        a2.plot(np.arange(1, len(curve) + 1), 100 * np.asarray(curve), label=b)
    a2.set_xlabel("outer steps (fixed count)")
    a2.set_ylabel("fully solved (%)")
    a2.set_ylim(-2, 102)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle("Sudoku: accuracy by difficulty bucket (dyndepth demo --task sudoku)", fontsize=10)
    fig.tight_layout()
    p2 = os.path.join(out_dir, "sudoku_accuracy.png")
    fig.savefig(p2)
    plt.close(fig)
    return [p1, p2]


def run_sudoku(cfg, out_dir, *, json_path=None, log=None, stop_at=None):
    """The whole Sudoku demo; returns the report that ``results.json`` holds."""
    log = log or (lambda *a: print(*a, flush=True))
    t_run = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "sudoku.ckpt.npz")
    if os.path.exists(ckpt):  # a configuration mismatch is an error before any work
        _, _, _, saved = st.read_checkpoint(ckpt, config_from_json)
        st.check_resumable(saved, cfg, ckpt, training_fields)
    if not have_matplotlib():
        log(MISSING)
    train, test, data_fig = datasets(cfg, out_dir, log)
    params0 = sm.init_params(jax.random.PRNGKey(cfg.seed), cfg.width, cfg.layers, cfg.hidden)
    log(
        f"dyndepth demo --task sudoku: width {cfg.width}, {cfg.layers} layers "
        f"({sm.count_params(params0)} parameters), {cfg.cycles} cycles of {cfg.latent_steps} "
        f"latent steps per outer step, at most {cfg.max_steps} outer steps, batch {cfg.batch}, "
        f"{cfg.steps} steps; {cfg.train_paths} training paths; devices: {jax.devices()}"
    )
    seconds = {"puzzles": data_fig["seconds"]}
    t0 = time.perf_counter()
    params, training = st.train(
        cfg,
        st.device_pool(*train),
        out_dir,
        config_from_json=config_from_json,
        training_fields=training_fields,
        log=log,
        stop_at=stop_at,
    )
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = evaluate(params, cfg, test, log)
    seconds["evaluate"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_run
    report = {
        "task": "sudoku",
        "config": asdict(cfg),
        "buckets": dict(sd.BUCKET_RULES),
        "data": data_fig,
        "training": training,
        **res,
        "seconds": seconds,
        "jax": jax.__version__,
        "dyndepth": dyndepth.__version__,
        "devices": str(jax.devices()),
    }
    for path in [os.path.join(out_dir, "results.json")] + ([json_path] if json_path else []):
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
    log("")
    log(tables(res, cfg))
    log("")
    log(
        "time: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f"; results: {os.path.join(out_dir, 'results.json')}"
        + (f" and {json_path}" if json_path else "")
    )
    pngs = plot(res, cfg, out_dir)
    log(f"plots: {', '.join(pngs)}" if pngs else MISSING)
    return report


# ----------------------------------------------------------------------------- CLI


def add_arguments(p):
    """The flags of ``dyndepth demo`` that only ``--task sudoku`` reads."""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="(--task sudoku) model and training size: cpu (default; about 10 minutes on a "
        "2-core CPU) or gpu (a larger model for one accelerator)",
    )
    p.add_argument(
        "--halt-rule",
        choices=["valid", "stalled", "head", "both"],
        default=None,
        help="(--task sudoku) when a puzzle stops: its answer obeys the rules (valid, default), "
        "that or its conflicts reach no new low for 6 steps (stalled), the halting head says it "
        "is final (head), or both",
    )
    p.add_argument(
        "--json", default=None, metavar="FILE", help="(--task sudoku) also write results here"
    )
    p.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="(--task sudoku) stop training after this many minutes (default 7; the same "
        "command resumes it; 0: no limit, train all --steps)",
    )
    p.add_argument(
        "--test-per-bucket",
        type=int_at_least(1),
        default=None,
        help="(--task sudoku) test puzzles per difficulty bucket (default 100)",
    )


# flags of the prefix-sums task, with the value they have when not given
_OTHER_TASK = {
    "train_length": None,
    "max_iters": None,
    "per_sample": False,
    "control": False,
    "eval_lengths": None,
    "devices": None,
    "coordinator": None,
    "num_processes": None,
    "process_id": None,
}
_SUDOKU_ONLY = ("preset", "halt_rule", "json", "test_per_bucket", "train_minutes")


def wrong_task_flag(a):
    """The one-line error for a flag of the other task, or ``None``."""
    if a.task == "sudoku":
        for name, default in _OTHER_TASK.items():
            if getattr(a, name, default) not in (default,):
                return f"--{name.replace('_', '-')} applies to --task prefix-sums only"
        if getattr(a, "alpha", 1.0) != 1.0:
            return "--alpha applies to --task prefix-sums only"
        return None
    for name in _SUDOKU_ONLY:
        if getattr(a, name, None) is not None:
            return f"--{name.replace('_', '-')} applies to --task sudoku only"
    return None


def config_from_args(a):
    values = asdict(SudokuConfig())
    values.update(PRESETS[a.preset or "cpu"])
    if a.quick:
        values.update(QUICK)
    for name in ("width", "batch", "steps", "lr", "test_per_bucket", "halt_rule", "train_minutes"):
        if getattr(a, name, None) is not None:
            values[name] = getattr(a, name)
    values["seed"] = a.seed
    return SudokuConfig(**values)


def main(a):
    """``dyndepth demo --task sudoku`` after its flags are parsed."""
    error = wrong_task_flag(a)
    if error:
        print(f"dyndepth demo: error: {error}", file=sys.stderr)
        return 2
    cfg = config_from_args(a)
    out = a.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    try:
        run_sudoku(cfg, out, json_path=a.json)
    except (ConfigMismatch, BadCheckpoint) as e:
        print(f"dyndepth demo: error: {e}", file=sys.stderr)
        return 2
    return 0
