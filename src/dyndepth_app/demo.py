"""``dyndepth demo``: train a recurrent-depth ("Deep Thinking") network on prefix sums mod 2 that
solves strings far longer than it was trained on by thinking longer, and let every string
think exactly as long as it needs.

The run (:func:`run_demo`): train the progressive-loss net (``alpha=1``; with ``--control`` also
the ``alpha=0`` control, :mod:`~dyndepth_app.train`), evaluate the whole-string accuracy after
every iteration count for each test length until it has held ``>= 99%`` over a 4x range of
iterations, then run the adaptive evaluation on a batch of mixed lengths
(:mod:`~dyndepth_app.evaluate`). Output: a
progress bar, tables, ``accuracy.png``, ``adaptive.png``, ``results.json`` and checkpoints in
the output folder. The task and model are in :mod:`~dyndepth_app.model`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zipfile

import jax
import numpy as np

import dyndepth

from . import processes
from .args import RENAMED_TASKS, Interrupted, int_at_least, int_list, positive_float, renamed
from .config import QUICK, Config, config_to_json, replace
from .evaluate import accuracy_curve, adaptive_eval, adaptive_table, summarize, table
from .plots import MISSING, have_matplotlib, plot_accuracy, plot_adaptive
from .processes import from_primary, is_primary, run_log
from .train import (
    BadCheckpoint,
    ConfigMismatch,
    check_resumable,
    device_table,
    load_checkpoint,
    make_mesh,
    mesh_devices,
    train,
)


def evaluate_run(params, cfg, label, *, strings, log, caps=None):
    """Accuracy curves for every length of ``cfg.eval_lengths`` (each until it has held over
    ``cfg.eval_hold`` x its iterations, see :func:`~dyndepth_app.evaluate.accuracy_curve`, at
    most ``caps[length]`` iterations when given)."""
    curves = {}
    for length in cfg.eval_lengths:
        t0 = time.perf_counter()
        cap = None if caps is None else caps[int(length)]
        curves[int(length)] = accuracy_curve(
            params, cfg, length, strings, max_iters=cap, hold=cfg.eval_hold
        )
        log(
            f"[{label}] {length} bits: {len(curves[int(length)])} iterations on {strings} "
            f"strings in {time.perf_counter() - t0:.0f} s"
        )
    return curves


def _where(devices):
    """Where the training runs, for the run's first line."""
    if devices == 1:
        return f"devices: {jax.devices()}"
    where = f"data-parallel over {devices} devices"
    if jax.process_count() > 1:
        where += f" of {jax.process_count()} processes"
    return f"{where}: {mesh_devices(devices, jax.devices())}"


def _check_resumable(runs, out_dir):
    """Raise :class:`ConfigMismatch` when ``out_dir`` holds a checkpoint of another
    configuration, before any training. On several processes, process 0 alone looks (the
    others may not see the folder) and all of them stop."""
    error = None
    if is_primary():
        try:
            for label, c, _ in runs:
                ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
                if os.path.exists(ckpt):
                    check_resumable(ckpt, c)
        except ConfigMismatch as e:
            error = e
    if int(from_primary(np.int32(error is not None))):
        raise error or ConfigMismatch(
            f"--out {out_dir} on process 0 holds a checkpoint of another configuration (process "
            "0 names the settings)"
        )


def run_demo(cfg, out_dir, *, control=False, devices=1, log=None):
    """The whole demo (see the module's docstring); returns the report that ``results.json``
    holds. On several processes (:mod:`~dyndepth_app.processes`) every process runs it and
    process 0 alone logs and writes ``out_dir``."""
    primary = is_primary()
    log = run_log(log)
    t_run = time.perf_counter()
    if primary:
        os.makedirs(out_dir, exist_ok=True)
    make_mesh(devices, cfg.batch)  # a clear error before any work
    log(
        f"dyndepth demo: prefix sums mod 2, width {cfg.width}, dilations {cfg.dilations}, "
        f"training strings of {cfg.min_train_length}..{cfg.train_length} bits, "
        f"M={cfg.max_iters}, batch {cfg.batch}, {cfg.steps} steps, {_where(devices)}"
    )
    if not have_matplotlib():
        log(MISSING)
    runs = [("alpha=1", cfg, cfg.eval_batch)]
    if control:
        control_cfg = replace(cfg, alpha=0.0, per_sample=False)
        runs.append(("alpha=0", control_cfg, cfg.control_eval_batch))
    _check_resumable(runs, out_dir)  # a config mismatch is an error before any training
    curves, summaries, training, seconds = {}, {}, {}, {}
    trained = {}
    for label, c, _ in runs:
        t0 = time.perf_counter()
        params, figures = train(c, out_dir, label=label, devices=devices, log=log)
        seconds[f"train {label}"] = time.perf_counter() - t0
        training[label] = figures
        trained[label] = params
    for label, c, strings in runs:
        ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
        t0 = time.perf_counter()
        # the control is evaluated over the same iterations as the alpha=1 run (at most)
        caps = None if label == "alpha=1" else {n: len(v) for n, v in curves["alpha=1"].items()}
        try:
            curves[label] = evaluate_run(
                trained[label], c, label, strings=strings, log=log, caps=caps
            )
        except Interrupted:
            raise Interrupted(
                f"interrupted while evaluating {label}; training is complete in {out_dir} "
                f"(dyndepth eval --checkpoint {ckpt} evaluates it; the same command resumes the "
                "demo)"
            ) from None
        seconds[f"evaluate {label}"] = time.perf_counter() - t0
        summaries[label] = summarize(curves[label], c, strings)
    t0 = time.perf_counter()
    try:
        adaptive = adaptive_eval(trained["alpha=1"], cfg)
    except Interrupted:
        raise Interrupted(
            f"interrupted during the adaptive evaluation; training is complete in {out_dir} "
            "(the same command resumes the demo)"
        ) from None
    seconds["adaptive evaluation"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_run
    report = {
        "config": config_to_json(cfg),
        "devices": devices,
        "processes": jax.process_count(),
        "training": training,
        "summary": summaries,
        "curves": {label: {str(k): v for k, v in cv.items()} for label, cv in curves.items()},
        "adaptive": adaptive,
        "seconds": seconds,
        "jax": jax.__version__,
        "dyndepth": dyndepth.__version__,
    }
    if not primary:
        return report
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    log("")
    log(table(summaries, cfg))
    log("")
    log(
        f"Adaptive stopping on {adaptive['strings']} strings of {adaptive['min_length']}.."
        f"{adaptive['max_length']} bits in one batch; rule: {adaptive['rule']}:"
    )
    log(adaptive_table(adaptive))
    if not adaptive["same_as_lax"]:
        log(
            "warning: dyndepth.while_loop and vmap(lax.while_loop) disagreed on the predictions "
            "or stopping iterations of some strings (see results.json)"
        )
    log("")
    for label, f in training.items():
        if "step_seconds_per_iteration" in f:
            fixed, per = f["step_seconds_fixed"], f["step_seconds_per_iteration"]
            fit = (
                f"step time = {1e3 * fixed:.1f} ms + {1e3 * per:.2f} ms x (n + k)"
                if fixed >= 0 and per >= 0
                else "step times too noisy to fit a fixed and a per-iteration cost"
            )
            log(f"[{label}] training {f['train_seconds']:.0f} s; {fit}")
    for label, f in training.items():
        if devices == 1 and not (cfg.per_sample and label == "alpha=1"):
            continue  # one device, per-batch depth: 100% by construction (still in the JSON)
        rows = f["per_device"]
        log("")
        if not rows[0]["steps"]:
            log(f"[{label}] per-device utilisation: no training step ran in this call (resumed)")
            continue
        log(
            f"[{label}] per-device utilisation over {rows[0]['steps']} steps on {devices} "
            f"device(s), {f['per_device_counts']}:"
        )
        log(device_table(rows))
    log(
        "time: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f"; results: {os.path.join(out_dir, 'results.json')}"
    )
    write_plots(curves, adaptive, out_dir, cfg, log)
    return report


def write_plots(curves, adaptive, out_dir, cfg, log):
    """``accuracy.png`` and ``adaptive.png`` in ``out_dir``; without matplotlib, says how to get
    them instead. Returns the paths written."""
    pngs = [
        plot_accuracy(curves, os.path.join(out_dir, "accuracy.png"), cfg),
        plot_adaptive(adaptive, os.path.join(out_dir, "adaptive.png")),
    ]
    if all(pngs):
        log(f"plots: {pngs[0]}, {pngs[1]}")
        return pngs
    log(MISSING)
    return []


# ----------------------------------------------------------------------------- CLI


def add_arguments(p):
    d = Config()
    p.add_argument(
        "--task",
        type=lambda v: renamed(v, RENAMED_TASKS, "dyndepth demo", "--task"),
        choices=["prefix-sums", "dropout-residual", "sudoku"],
        default="prefix-sums",
        help="prefix-sums (default): train and evaluate the recurrent-depth network; "
        "dropout-residual: the README quickstart's program (a dropout residual layer, batch "
        "32, width 64, depths in [1, 100]), timed against the scan + cond baseline; sudoku: a "
        "tiny recursive model that halts per puzzle (docs/sudoku.md)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few seconds: tiny model, few steps (flags given explicitly still apply)",
    )
    p.add_argument("--width", type=int_at_least(2), help=f"channels (default {d.width})")
    p.add_argument(
        "--train-length",
        type=int_at_least(1),
        help=f"longest training string in bits (default {d.train_length})",
    )
    p.add_argument(
        "--max-iters", type=int_at_least(1), help=f"M: n + k <= M (default {d.max_iters})"
    )
    p.add_argument(
        "--batch",
        type=int_at_least(1),
        help=f"training batch (default {d.batch}, rounded up to a multiple of --devices)",
    )
    p.add_argument("--steps", type=int_at_least(1), help=f"training steps (default {d.steps})")
    p.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {d.lr})")
    p.add_argument(
        "--alpha",
        type=float,
        choices=[0.0, 1.0],
        default=d.alpha,
        help=f"1: the progressive loss (random n iterations without gradient, then k with); "
        f"0: the control, k = M iterations with gradient at every step (default {d.alpha:g})",
    )
    p.add_argument("--per-sample", action="store_true", help="per-sample n and k (scheduler)")
    p.add_argument(
        "--control",
        action="store_true",
        help="also train and evaluate the alpha=0 control (the same recipe, but k = M "
        "iterations with gradient at every step: more than doubles the run time)",
    )
    p.add_argument("--no-control", action="store_true", help=argparse.SUPPRESS)  # the default
    p.add_argument(
        "--devices",
        type=int_at_least(1),
        default=None,
        help="data-parallel training over this many devices (default 1; with --coordinator: "
        "all devices of all processes). The batch must split evenly; on a CPU, simulate "
        "devices with XLA_FLAGS=--xla_force_host_platform_device_count=N",
    )
    processes.add_arguments(p)
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help=f"random seed of the parameters, data and depths (default {d.seed})",
    )
    p.add_argument(
        "--eval-lengths",
        type=int_list(1),
        help="test string lengths, comma-separated (default "
        + ",".join(map(str, d.eval_lengths))
        + "); the adaptive evaluation mixes lengths up to the largest",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default runs/<timestamp>/). A folder that holds checkpoints of "
        "the same configuration resumes them; one trained with another configuration is an "
        "error naming the differing settings",
    )


def _round_up(n, m):
    m = m if isinstance(m, int) and m >= 1 else 1
    return -(-n // m) * m


_FLAGS = ("width", "train_length", "max_iters", "batch", "steps", "lr", "eval_lengths")


def config_from_args(a):
    """The run's :class:`~dyndepth_app.config.Config`: each flag given explicitly, else the
    ``--quick`` value (with ``--quick``), else the default. Without ``--batch`` the batch is
    rounded up to a multiple of ``--devices``, so that it splits evenly."""
    devices = getattr(a, "devices", None) or 1
    values = config_to_json(Config())
    if a.quick:
        values.update(QUICK)
    if getattr(a, "batch", None) is None:
        values["batch"] = _round_up(values["batch"], devices)
    for name in _FLAGS:
        if getattr(a, name, None) is not None:
            values[name] = getattr(a, name)
    values["min_train_length"] = min(values["min_train_length"], values["train_length"])
    values["adaptive_min_length"] = min(values["adaptive_min_length"], max(values["eval_lengths"]))
    values.update(alpha=a.alpha, per_sample=a.per_sample, seed=a.seed)
    return Config(**values)


def main_demo(a):
    """``dyndepth demo`` after its flags are parsed (and, for one process of a multi-process
    run, after ``jax.distributed.initialize``)."""
    if getattr(a, "devices", None) is None:  # all of them, on several processes
        a.devices = jax.device_count() if jax.process_count() > 1 else 1
    cfg = config_from_args(a)
    devices = a.devices
    try:
        make_mesh(devices, cfg.batch)
    except ValueError as e:
        print(f"dyndepth demo: error: {e}", file=sys.stderr)
        return 2
    default_batch = QUICK.get("batch", Config().batch) if a.quick else Config().batch
    if a.batch is None and cfg.batch != default_batch and is_primary():
        print(
            f"batch {cfg.batch} (the default {default_batch}, rounded up to a multiple of "
            f"--devices {devices})"
        )
    if a.quick and is_primary():
        print(
            "dyndepth demo: --quick is a smoke run (tiny model, few steps) that checks the demo "
            "end to end; it "
            "trains far too little to learn the task, so accuracies near 0%, 'did not "
            "converge' and noisy timings are expected (run without --quick for the demo)"
        )
    out = a.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    try:
        run_demo(cfg, out, control=a.control, devices=devices)
    except ConfigMismatch as e:
        print(f"dyndepth demo: error: {e}", file=sys.stderr)
        return 2
    return 0


def add_eval_arguments(ev):
    ev.add_argument("--checkpoint", required=True, help="a DIR/alpha=1.ckpt.npz file")
    ev.add_argument(
        "--lengths",
        type=int_list(1),
        default=(32, 64, 128, 512),
        help="test string lengths in bits, comma-separated (default 32,64,128,512)",
    )
    ev.add_argument(
        "--iters",
        type=int_at_least(1),
        default=None,
        help="evaluate iterations 1..ITERS (default: as the demo, until the accuracy has held "
        ">= 99%% over a 4x range of iterations, at most the checkpoint's eval_max_iters)",
    )
    ev.add_argument(
        "--strings",
        type=int_at_least(1),
        default=None,
        help="test strings per length (default: the checkpoint's, 1000 for the demo)",
    )
    ev.add_argument(
        "--adaptive",
        action="store_true",
        help="also the adaptive-stopping comparison on mixed lengths up to the largest of "
        "--lengths",
    )
    ev.add_argument("--json", default=None, help="write the curves (and adaptive figures) here")


def main_eval(a):
    if os.path.isfile(a.checkpoint) and not zipfile.is_zipfile(a.checkpoint):
        print(
            f"dyndepth eval: error: argument --checkpoint: {a.checkpoint} is not a checkpoint "
            "(not an .npz archive); pass a DIR/alpha=1.ckpt.npz file that dyndepth demo wrote",
            file=sys.stderr,
        )
        return 2
    try:
        params, _, step, cfg = load_checkpoint(a.checkpoint)
    except BadCheckpoint as e:
        print(f"dyndepth eval: error: argument --checkpoint: {e}", file=sys.stderr)
        return 2
    strings = a.strings or cfg.eval_batch
    cfg = replace(cfg, eval_lengths=tuple(a.lengths))
    if a.iters is None:
        how = f"until held over {cfg.eval_hold}x, at most {cfg.eval_max_iters} iterations"
    else:
        how = f"iterations 1..{a.iters}"
    print(
        f"checkpoint {a.checkpoint} (step {step}, width {cfg.width}, M={cfg.max_iters}); "
        f"{strings} strings per length, {how}",
        flush=True,
    )
    hold = cfg.eval_hold if a.iters is None else None
    curves = {
        int(n): accuracy_curve(params, cfg, n, strings, max_iters=a.iters, hold=hold)
        for n in a.lengths
    }
    print(table({"eval": summarize(curves, cfg, strings)}, cfg))
    out = {"curves": {str(k): v for k, v in curves.items()}}
    if a.adaptive:
        res = adaptive_eval(params, cfg)
        print(
            f"\nAdaptive stopping on {res['strings']} strings of {res['min_length']}.."
            f"{res['max_length']} bits; rule: {res['rule']}:"
        )
        print(adaptive_table(res))
        out["adaptive"] = res
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh)
    return 0
