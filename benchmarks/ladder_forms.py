"""The slot counts' loops under one conditional (a CPU's and a GPU's form) against one chain of
loops (a TPU's), on the machine it runs on.

A batched loop with per-sample depths compiles a ladder of slot counts and runs the one its
time rule picks. A CPU or a GPU chooses among the counts' loops with one conditional; a TPU
runs them one after another, each iterating only on its turn (``dyndepth._schedule.Turn``),
which keeps a loop's state in the chip's fast memory. Each form is traced as for its platform
(``measure.trace_as``, a private hook) with this machine's time model, so that both choose the
same count. Each is timed against the forward pass's count fixed (``slots=S``, one loop),
forward and value_and_grad (whose backward pass chooses its own count, which may differ), in
interleaved rounds; ``--forward-only`` leaves the value_and_grad calls out of the rounds (on a
CPU they evict the forward calls' data from the caches between calls). A CPU's speed at about
a millisecond moves between processes more than within one, so the measurement runs in
``--processes`` fresh processes and prints each one's ratios.

How to run (from the repository root)::

    .venv/bin/python benchmarks/ladder_forms.py                   # few-deep, B=512, 3 processes
    .venv/bin/python benchmarks/ladder_forms.py --forward-only --processes 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import jax
from measure import machine_line, table, trace_as
from scheduler import DISTRIBUTIONS, depths_of, interleaved_ms, layer, loss_of, scheduled

import dyndepth as dd

FORMS = {"conditional": "cpu", "chain": "tpu"}


def chosen_count(W, xs, ds, max_depth: int) -> int:
    _, stats = dd.repeat_batched(layer(W), xs, ds, max_depth=max_depth, return_stats=True)
    return int(stats["executed_sample_steps"]) // int(stats["iterations"])


def one_process(a) -> dict:
    """``{pass: {program: ms}}`` of the programs, best of ``a.rounds`` interleaved rounds."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(k[0], (a.width, a.width)) / a.width**0.5
    xs = jax.random.normal(k[1], (a.batch, a.width))
    ds = depths_of(a.dist, k[2], a.batch, a.max_depth)
    passes = ["forward"] if a.forward_only else ["forward", "value_and_grad"]
    calls, S = {}, chosen_count(W, xs, ds, a.max_depth)
    host = jax.default_backend()
    for label, platform in [*FORMS.items(), (f"S={S} fixed", host)]:
        trace_as(platform)
        kw = {"slots": S} if label.startswith("S=") else {}
        run = lambda W, xs, ds, md, kw=kw: scheduled(W, xs, ds, md, **kw)  # noqa: E731
        fns = {
            "forward": jax.jit(lambda W, xs, ds, run=run: run(W, xs, ds, a.max_depth)),
            "value_and_grad": jax.jit(jax.value_and_grad(loss_of(run, a.max_depth))),
        }
        for p in passes:
            jax.block_until_ready(fns[p](W, xs, ds))  # (traced now, under this platform)
            calls[p, label] = (fns[p], (W, xs, ds))
    trace_as(host)
    times = interleaved_ms(calls, a.rounds)
    out = {p: {} for p in passes}
    for (p, label), ms in times.items():
        out[p][label] = ms
    return out


def one_child() -> dict:
    """:func:`one_process` in a fresh process, with this one's arguments."""
    child = subprocess.run([sys.executable, *sys.argv, "--one"], capture_output=True, text=True)
    if child.returncode:
        sys.exit(f"ladder_forms.py: a measuring process failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=128)
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="few-deep")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.processes < 1:
        p.error(f"--processes must be at least 1, got {a.processes}")
    if a.one:
        print(json.dumps(one_process(a)))
        return
    runs = [one_child() for _ in range(a.processes)]
    print(machine_line())  # (after the children: an accelerator opens in one process at a time)
    print(
        f"B={a.batch}, D={a.width}, max_depth {a.max_depth}, {a.dist} depths; best of "
        f"{a.rounds} interleaved rounds in each of {a.processes} processes"
        f"{' (forward calls only)' if a.forward_only else ''}; ms, and / the count fixed\n"
    )
    rows = []
    for pass_ in runs[0]:
        fixed = next(label for label in runs[0][pass_] if label.startswith("S="))
        for form in FORMS:
            ratios = [r[pass_][form] / r[pass_][fixed] for r in runs]
            cells = [f"{r[pass_][form]:.2f} / {r[pass_][fixed]:.2f} = {x:.2f}"
                     for r, x in zip(runs, ratios, strict=True)]  # fmt: skip
            rows.append([pass_, form, *cells, f"{statistics.median(ratios):.2f}"])
    header = ["pass", "form", *[f"process {i + 1}" for i in range(a.processes)], "median"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
