"""Narrow carries under a large store: memory and time of value_and_grad on an accelerator.

A TPU lays a store of carries shorter than its 128 lanes (here 16 floats) out with the batch
along the lanes, or pads each carry to 128 where a loop's access wants that: a store of every
carry then takes up to 8 times its bytes, which the stored-carry budget counts on a TPU
(``dyndepth._budget.stored_bytes``). For B=4096 samples of 16 floats, step ``c + tanh(c @ W)``,
depths uniform in ``[0, max_depth]``, this script compiles and runs value_and_grad of
``repeat_batched`` (the defaults) and of ``jax.checkpoint`` + masked ``lax.scan`` (the baseline
of every meter), and prints per ``max_depth``: the compiled program's temporary memory, the
carries stored per sample (``return_stats``), and the best of ``--repeats`` calls, or the error
where a program does not fit the device (``RESOURCE_EXHAUSTED``).

How to run (on the accelerator host, from the repository root, dyndepth importable)::

    python benchmarks/narrow_carries.py
    python benchmarks/narrow_carries.py --max-depths 500 --batch 256   # a CPU, quickly
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from measure import machine_line, masked_scan

import dyndepth as dd

WIDTH = 16


def programs(max_depth: int) -> dict:
    """label -> the loss whose value_and_grad in ``W`` is timed, and whether it has stats."""

    def step_of(W):
        return lambda c: c + jnp.tanh(c @ W)

    def dyndepth_loss(W, xs, depths):
        out, stats = dd.repeat_batched(step_of(W), xs, depths, max_depth=max_depth,
                                       return_stats=True)  # fmt: skip
        return jnp.sum(out**2), stats

    def scan_loss(W, xs, depths):
        out = masked_scan(step_of(W), xs, depths, max_depth, remat=True)
        return jnp.sum(out**2), {}

    return {"`repeat_batched`, defaults": dyndepth_loss,
            "`jax.checkpoint` + masked `lax.scan`": scan_loss}  # fmt: skip


def run(loss, args, repeats: int) -> str:
    """One table row's cells after the label: temp MiB, stored carries, ms (or the error)."""
    try:
        fn = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(*args).compile()
        temp = fn.memory_analysis().temp_size_in_bytes / 2**20
        (_, stats), _ = out = fn(*args)
        jax.block_until_ready(out)
        best = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best.append(time.perf_counter() - t0)
    except Exception as e:  # (a program the device cannot hold: its message, one line)
        return f"- | - | {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    stored = int(stats["stored_carries"]) if "stored_carries" in stats else "-"
    return f"{temp:.0f} | {stored} | {1e3 * min(best):.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--max-depths", type=int, nargs="+", default=[2000, 6000])
    p.add_argument("--repeats", type=int, default=3, help="timed calls (best of)")
    a = p.parse_args()
    if a.batch < 1 or a.repeats < 1 or min(a.max_depths) < 1:
        p.error("--batch, --max-depths and --repeats must be positive")
    print(f"{machine_line()}; B={a.batch}, {WIDTH} floats, depths uniform in [0, max_depth]\n")
    print("| program | max_depth | temp MiB | stored per sample | ms |\n|---|---|---|---|---|")
    W = jax.random.normal(jax.random.PRNGKey(0), (WIDTH, WIDTH)) * 0.1
    xs = jax.random.normal(jax.random.PRNGKey(1), (a.batch, WIDTH))
    for max_depth in a.max_depths:
        depths = jax.random.randint(jax.random.PRNGKey(2), (a.batch,), 0, max_depth + 1)
        for label, loss in programs(max_depth).items():
            print(f"| {label} | {max_depth:,} | {run(loss, (W, xs, depths), a.repeats)} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
