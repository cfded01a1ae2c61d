"""Compile time and temp memory of ``value_and_grad`` against ``max_depth``.

What it measures: for a small carry (``B`` samples of width ``D``, default ``(4, 16)``) and the
step ``x -> tanh(x @ W)``, the wall time of ``jax.jit(fn).lower(...)`` and of ``.compile()`` for
``jax.value_and_grad`` of

- ``jax.vmap(dyndepth.repeat)`` with ``strategy="checkpointed"`` and per-sample depths,
- ``jax.vmap(dyndepth.repeat)`` with ``strategy="auto"`` (the per-sample scheduler),
- ``dyndepth.repeat_batched``,

each with ``checkpoints=None`` (every carry stored: memory grows with ``max_depth``) and
``checkpoints=64``, at ``max_depth`` 100 and 10,000, together with XLA's temp buffer size of the
compiled program (``compiled.memory_analysis().temp_size_in_bytes``). ``max_depth`` only sizes
buffers, so compile time should barely move with it; temp memory follows ``max_depth`` with
``checkpoints=None`` (``max_depth`` stored carries) and grows only as ``K + S`` carries with
``checkpoints=K`` (``S`` the smallest power of two with ``ceil(max_depth / S) <= K``: for K=64,
66 carries at max_depth 100 and 320 at 10,000). Every measurement traces a new
function object, so it is a fresh lowering and a fresh compile (no in-process cache hit); with
``--repeats N`` (default 3) the median of N is reported, after one discarded warm-up
compile. Nothing is executed.

How to run (from the repository root)::

    .venv/bin/python benchmarks/compile_time.py
    .venv/bin/python benchmarks/compile_time.py --repeats 5 --batch 4 --width 16
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import dyndepth as dd

CONTENDERS = ["vmap(repeat) checkpointed", "vmap(repeat) auto", "repeat_batched"]


def make_loss(contender: str, max_depth: int, checkpoints: int | None):
    def step(W):
        return lambda x: jnp.tanh(x @ W)

    def loss(X, W, depths):
        if contender == "repeat_batched":
            out = dd.repeat_batched(
                step(W), X, depths, max_depth=max_depth, checkpoints=checkpoints
            )
        else:
            strategy = contender.split()[-1]
            out = jax.vmap(
                lambda x, d: dd.repeat(
                    step(W),
                    x,
                    d,
                    max_depth=max_depth,
                    strategy=strategy,
                    checkpoints=checkpoints,
                )
            )(X, depths)
        return jnp.sum(out**2)

    return jax.value_and_grad(loss, argnums=(0, 1))


def measure(contender, max_depth, checkpoints, args_example):
    """One fresh lower + compile: ``(lower s, compile s, temp bytes)``."""
    vg = make_loss(contender, max_depth, checkpoints)
    fn = jax.jit(lambda *a: vg(*a))  # a new function object: no cache hit
    t0 = time.perf_counter()
    lowered = fn.lower(*args_example)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    return t1 - t0, t2 - t1, temp


def fmt_mib(b):
    return "n/a" if b is None else f"{b / 2**20:.3f}"


def ratio(a, b, digits=1):
    if a is None or b is None or a == 0:
        return "n/a"
    return f"{b / a:.{digits}f}x"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-depths", default="100,10000", help="two comma-separated max_depths")
    p.add_argument("--checkpoints", default="none,64", help="comma-separated: none or ints")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="fresh compiles per cell (median)")
    a = p.parse_args(argv)
    lo, hi = (int(x) for x in a.max_depths.split(","))
    cks = [None if c.strip().lower() == "none" else int(c) for c in a.checkpoints.split(",")]

    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.normal(size=(a.batch, a.width)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(a.width, a.width)) / np.sqrt(a.width), jnp.float32)

    def depths_for(m):
        return jnp.asarray(rng.integers(1, m + 1, size=a.batch), jnp.int32)

    # Warm-up: the first lowering in a process pays one-off costs (imports, caches).
    measure(CONTENDERS[0], lo, None, (X, W, depths_for(lo)))

    dev = jax.devices()[0]
    print(
        f"device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
        f"dyndepth {dd.__version__}, python {platform.python_version()}, "
        f"carry ({a.batch}, {a.width}), step tanh(x @ W), value_and_grad w.r.t. (X, W), "
        f"per-sample depths, median of {a.repeats} fresh compile(s)"
    )
    print()
    print(
        f"| contender | checkpoints | lower s @{lo} | compile s @{lo} | lower s @{hi} "
        f"| compile s @{hi} | compile ratio | temp MiB @{lo} | temp MiB @{hi} | temp ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for contender in CONTENDERS:
        for ck in cks:
            cells = {}
            for m in (lo, hi):
                runs = [measure(contender, m, ck, (X, W, depths_for(m))) for _ in range(a.repeats)]
                cells[m] = (
                    statistics.median(r[0] for r in runs),
                    statistics.median(r[1] for r in runs),
                    runs[0][2],
                )
            (l_lo, c_lo, t_lo), (l_hi, c_hi, t_hi) = cells[lo], cells[hi]
            print(
                f"| {contender} | {ck} | {l_lo:.2f} | {c_lo:.2f} | {l_hi:.2f} | {c_hi:.2f} "
                f"| {ratio(c_lo, c_hi, 2)} | {fmt_mib(t_lo)} | {fmt_mib(t_hi)} "
                f"| {ratio(t_lo, t_hi)} |",
                flush=True,
            )
    print()
    print(
        "compile ratio = compile s at max_depth "
        f"{hi} / at {lo}; temp ratio likewise for XLA's temp buffer of the compiled program."
    )


if __name__ == "__main__":
    main()
