"""What one loop iteration costs beyond its step: the tiny-step meter of #37.

A step so small that an iteration's fixed cost dominates: B=64 samples of width 8, the
elementwise step ``c + 0.1 * tanh(c)``, ``max_depth`` 200, on two batches of depths: all at 200,
and uniform in ``[1, 200]``. Per loop, the time of one call (best of ``--rounds`` interleaved
rounds: the contenders take turns, each round starting at the next one, after a warm-up call
each) over its iterations:

- ``lax.scan`` forward (masked: a select keeps finished samples) and ``jax.checkpoint`` + masked
  ``lax.scan`` value_and_grad: 200 iterations whatever the depths; the same with the mask
  hoisted (``measure.masked_scan(..., hoisted=True)``: the depths broadcast to the carry's
  shape before the scan, as dyndepth's lockstep loops do for rows of at most 8 elements, which
  XLA's CPU backend then masks with vector code);
- ``repeat_batched`` in lockstep (``slots=B``, and one shared depth for the batch: all-200 only)
  and wrap-around (``slots=32``), forward and value_and_grad: iterations from ``return_stats``;
- ``vmap(lax.while_loop)`` forward (``max(depth)`` iterations) and ``vmap(dyndepth.while_loop)``
  forward (continuous refill; iterations from ``return_stats``).

value_and_grad's time is divided by its forward plus backward iterations (``return_stats`` of a
value_and_grad). The dyndepth loops store every carry (``checkpoints=max_depth``): on this CPU
the default would store 64 per sample for a step this small and recompute the rest (see
``dyndepth._budget``), and this meter times the kernels, not that choice. The ratios are those #37's
"Done when" names: lockstep and wrap-around value_and_grad against ``jax.checkpoint`` +
``lax.scan`` (targets 1.2x and 1.3x), forward against ``lax.scan`` (target 1.1x), per iteration,
in the same run. Read them on the all-200 batch: there no sample is masked. On uniform depths
XLA's CPU code for the masked scan's select skips the elementwise step on the rows it masks (the
same compiled scan takes 0.31 ms on the uniform batch, 0.57 ms at all 200 and 0.07 ms at all 0,
2026-12-05), so with this elementwise step the scan's cost per iteration falls with the share of
finished samples, and a ratio against it measures that as well as the loop's fixed cost.

How to run (from the repository root)::

    .venv/bin/python benchmarks/iteration_overhead.py            # 50 rounds
    .venv/bin/python benchmarks/iteration_overhead.py --quick    # 10 rounds, under a minute
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from measure import best_seconds, machine_line, masked_scan, table, uniform_depths

import dyndepth as dd

B, WIDTH, MAX_DEPTH, WRAP_SLOTS = 64, 8, 200, 32


def step(c):
    return c + 0.1 * jnp.tanh(c)


def loss_of(run):
    return jax.value_and_grad(lambda xs, ds: jnp.sum(run(xs, ds) ** 2))


def scan(remat=False, hoisted=False):
    """The masked scan over ``MAX_DEPTH`` steps (see :func:`measure.masked_scan`)."""
    return lambda xs, ds: masked_scan(step, xs, ds, MAX_DEPTH, remat=remat, hoisted=hoisted)


def batched(slots, shared=False, return_stats=False):
    def run(xs, ds):
        depths = jnp.max(ds) if shared else ds
        return dd.repeat_batched(step, xs, depths, max_depth=MAX_DEPTH, slots=slots,
                                 checkpoints=MAX_DEPTH, return_stats=return_stats)  # fmt: skip

    return run


def lax_while(xs, ds):
    def one(x, d):
        return lax.while_loop(lambda s: s[0] < d, lambda s: (s[0] + 1, step(s[1])), (0, x))[1]

    return jax.vmap(one)(xs, ds)


def dd_while(xs, ds, return_stats=False):
    def one(x, d):
        body = lambda s: (step(s[0]), s[1] + 1)  # noqa: E731
        return dd.while_loop(lambda s: s[1] < d, body, (x, 0), max_steps=MAX_DEPTH,
                             return_info=return_stats)  # fmt: skip

    out = jax.vmap(one)(xs, ds)
    if not return_stats:
        return out
    (carry, _), info = out  # (the batch's one loop: the same iterations in every row)
    return carry, {"iterations": info["iterations"][0], "backward_iterations": 0}


def contenders(shared_row: bool):
    """label -> (kind, run, iterations(xs, ds)): ``run`` is the forward function, iterations
    ``(forward, backward)``."""
    n_scan = lambda xs, ds: (MAX_DEPTH, MAX_DEPTH)  # noqa: E731
    n_max = lambda xs, ds: (int(jnp.max(ds)),) * 2  # noqa: E731

    def n_stats(stats_run):
        def count(xs, ds):
            def loss(xs):
                out, stats = stats_run(xs, ds)
                return jnp.sum(out**2), stats

            (_, stats), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(xs)
            return int(stats["iterations"]), int(stats["backward_iterations"])

        return count

    rows = {
        "`lax.scan` (masked)": ("fwd", scan(), n_scan),
        "`jax.checkpoint` + `lax.scan` (masked)": ("vg", scan(remat=True), n_scan),
        "`lax.scan`, mask hoisted": ("fwd", scan(hoisted=True), n_scan),
        "`jax.checkpoint` + `lax.scan`, mask hoisted": ("vg", scan(True, True), n_scan),
        "lockstep, `slots=B`": ("both", batched(B), n_stats(batched(B, return_stats=True))),
    }
    if shared_row:
        stats = batched(None, shared=True, return_stats=True)
        rows["lockstep, one depth for the batch"] = ("both", batched(None, shared=True),
                                                      n_stats(stats))  # fmt: skip
    wrap = batched(WRAP_SLOTS, return_stats=True)
    rows[f"wrap-around, `slots={WRAP_SLOTS}`"] = ("both", batched(WRAP_SLOTS), n_stats(wrap))
    rows["`vmap(lax.while_loop)`"] = ("fwd", lax_while, n_max)
    refill_stats = lambda xs, ds: dd_while(xs, ds, return_stats=True)  # noqa: E731
    rows["`vmap(dyndepth.while_loop)` (refill)"] = ("fwd", dd_while, n_stats(refill_stats))
    return rows


def measure_batch(label: str, ds: jax.Array, rounds: int) -> None:
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, WIDTH))
    rows = contenders(shared_row=bool(jnp.all(ds == ds[0])))
    calls, iters = {}, {}
    for name, (kind, run, count) in rows.items():
        iters[name] = count(xs, ds)
        if kind in ("fwd", "both"):
            calls[name, "fwd"] = (jax.jit(run), (xs, ds))
        if kind in ("vg", "both"):
            calls[name, "vg"] = (jax.jit(loss_of(run)), (xs, ds))
    sec = best_seconds(calls, rounds)
    per = {k: 1e6 * s / sum(iters[k[0]][: 1 + (k[1] == "vg")]) for k, s in sec.items()}
    scan_f, scan_vg = per["`lax.scan` (masked)", "fwd"], per[next(k for k in per if k[1] == "vg")]
    print(f"\n### {label}: sum {int(ds.sum())}, max {int(ds.max())} (best of {rounds} rounds)\n")
    out = []
    for name in rows:
        fwd_it, bwd_it = iters[name]
        cells = [name, f"{fwd_it} / {bwd_it}" if (name, "vg") in sec else fwd_it]
        for kind, base in (("fwd", scan_f), ("vg", scan_vg)):
            if (name, kind) in sec:
                cells += [f"{1e3 * sec[name, kind]:.3f}", f"{per[name, kind]:.2f}",
                          f"{per[name, kind] / base:.2f}x"]  # fmt: skip
            else:
                cells += ["", "", ""]
        out.append(cells)
    print(table(["loop", "iterations fwd / bwd", "forward ms", "µs / it.", "vs `lax.scan`",
                 "value_and_grad ms", "µs / it.", "vs checkpoint + scan"], out))  # fmt: skip
    ratio = lambda name, kind, base: per[name, kind] / base  # noqa: E731
    wrap = f"wrap-around, `slots={WRAP_SLOTS}`"
    print(f"\n#37's ratios, per iteration: lockstep value_and_grad / checkpoint + scan "
          f"{ratio('lockstep, `slots=B`', 'vg', scan_vg):.2f}x (target <= 1.2); wrap-around "
          f"{ratio(wrap, 'vg', scan_vg):.2f}x (<= 1.3); forward / `lax.scan`: lockstep "
          f"{ratio('lockstep, `slots=B`', 'fwd', scan_f):.2f}x, wrap-around "
          f"{ratio(wrap, 'fwd', scan_f):.2f}x (<= 1.1)")  # fmt: skip
    hoisted_vg = per["`jax.checkpoint` + `lax.scan`, mask hoisted", "vg"]
    hoisted_f = per["`lax.scan`, mask hoisted", "fwd"]
    print(f"Against the scans with the mask hoisted: lockstep value_and_grad "
          f"{ratio('lockstep, `slots=B`', 'vg', hoisted_vg):.2f}x, wrap-around "
          f"{ratio(wrap, 'vg', hoisted_vg):.2f}x; forward lockstep "
          f"{ratio('lockstep, `slots=B`', 'fwd', hoisted_f):.2f}x")  # fmt: skip


def main() -> None:
    global B, WIDTH  # noqa: PLW0603 (the sizes every contender reads)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="10 rounds")
    p.add_argument("--batch", type=int, default=B, help=f"samples (default {B}, at least 32)")
    p.add_argument("--width", type=int, default=WIDTH, help=f"carry width (default {WIDTH})")
    a = p.parse_args()
    B, WIDTH = a.batch, a.width
    rounds = 10 if a.quick else a.rounds
    print(machine_line())
    print(f"B={B}, width {WIDTH}, step c + 0.1 * tanh(c), max_depth {MAX_DEPTH}")
    measure_batch("all depths 200", jnp.full((B,), MAX_DEPTH, jnp.int32), rounds)
    measure_batch("uniform depths in [1, 200]", uniform_depths(0, B, MAX_DEPTH), rounds)
    print(
        "\n(On the uniform batch the masked scan skips the step's elementwise work on masked rows"
        " on this CPU: read #37's ratios on the all-200 batch; see the docstring.)"
    )


if __name__ == "__main__":
    main()
