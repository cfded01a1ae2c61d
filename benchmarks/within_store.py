"""Depths within a thinned store: the backward pass when every sample kept every carry.

Past the stored-carry budget a loop keeps ``K`` carries per sample (``K`` below ``max_depth``)
and a sample deeper than ``K`` keeps every other one, or fewer. A batch whose depths are all at
most ``K`` keeps every carry, and its backward pass is that of a loop storing every carry, not
the thinned one (``dyndepth._dispatch._backward_kernel``). This script times ``value_and_grad``
of ``repeat_batched`` with the defaults on the long-tail workload of ``benchmarks/tpu.py``
(B=4096, D=1024, ``max_depth`` 256; on a TPU v5e the default budget keeps 125 carries per
sample): its depths clipped to ``--clip`` (120 by default: every one within the store) and as
they are (deeper ones thin), each against ``jax.checkpoint`` + a masked ``lax.scan`` over its
deepest sample. Printed per row: the best time of ``--repeats`` interleaved rounds, the compile
time (lower + compile), the loop's stats (iterations forward and backward, carries stored per
sample).

How to run (from the repository root, dyndepth importable; run it at two commits to compare)::

    python benchmarks/within_store.py            # on a TPU (about two minutes on a v5e)
    python benchmarks/within_store.py --quick    # tiny shapes: a smoke run on a CPU
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
from measure import machine_line
from scheduler import interleaved_ms
from tpu import checkpointed_scan, compiled, scheduled, workload_args

LONG_TAIL = (4096, 1024, 256, "long-tail")
QUICK = (64, 16, 32, "long-tail")
# --quick's stored-carry budget: too small for 32 carries of 16 floats per sample (two copies
# counted), so that the tiny loop thins too (it keeps 8, the fewest for 32 steps).
QUICK_BUDGET = 2 * 64 * 16 * 4 * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--clip", type=int, default=None, help="the clipped depths' largest")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on a CPU)")
    a = ap.parse_args()
    spec, budget = (QUICK, QUICK_BUDGET) if a.quick else (LONG_TAIL, None)
    clip = a.clip if a.clip is not None else (8 if a.quick else 120)
    print(machine_line())
    p, xs, ds = workload_args(spec)
    batch, width, max_depth, _ = spec
    print(f"B={batch}, D={width}, max_depth {max_depth}, long-tail depths (max {int(ds.max())}); "
          f"value_and_grad, best of {a.repeats} interleaved rounds\n")  # fmt: skip
    calls, rows = {}, []
    for name, depths in [(f"clipped to {clip}", jnp.minimum(ds, clip)), ("as drawn", ds)]:
        args = (p, xs, depths)
        loop, seconds = compiled(scheduled(max_depth), args, budget)
        scan, _ = compiled(checkpointed_scan(int(depths.max())), args, None)
        calls[name], calls[name + " scan"] = (loop, args), (scan, args)
        (_, stats), _ = loop(*args)
        rows.append((name, int(depths.max()), seconds, stats))
    ms = interleaved_ms(calls, a.repeats)
    print("| depths | deepest | default ms | scan ms | vs scan | compile s | iterations fwd / bwd "
          "| stored / sample |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, deepest, seconds, st in rows:
        its = f"{int(st['iterations'])} / {int(st['backward_iterations'])}"
        print(f"| {name} | {deepest} | {ms[name]:.2f} | {ms[name + ' scan']:.2f} "
              f"| {ms[name] / ms[name + ' scan']:.2f}x | {seconds:.1f} | {its} "
              f"| {int(st['stored_carries'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
