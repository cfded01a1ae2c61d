"""Per-sample depth under memory pressure: the backward pass past the stored-carry budget (#38).

``jax.value_and_grad`` (in ``W``) of ``sum(out ** 2)``, ``out = jax.vmap(dyndepth.repeat)`` with
the step ``c + 0.05 * tanh(c @ W)`` (``W`` 64 x 64), a carry of 32 x 64 float32 (8 KiB) per sample,
B=64, ``max_depth`` 1024: storing every carry would take 512 MiB, and two copies of it cross the
512 MiB budget, so the loop thins its checkpoints. Three programs:

- **uniform**: depths uniform in ``[1, 512]``;
- **all 512**: every depth 512 (the work of the deepest sample, for every sample);
- **checkpoint + scan**: ``jax.checkpoint`` + masked ``lax.scan`` over 512 steps, the uniform
  depths (a select keeps finished samples).

Printed: run time (best of ``--rounds`` interleaved rounds), compile time (lower + compile,
median of ``--repeats`` distinct programs), XLA's temp memory, useful sample-steps
(``sum(depth)``), executed forward sample-steps (``return_stats`` of ``repeat_batched``, the
same loop), executed backward sample-steps and carries stored per sample (the same stats), and
#38's "Done when" ratios: uniform / all 512 (target <= 0.65x), uniform / checkpoint + scan
(target <= 0.8x), temp memory within the 512 MiB budget.

How to run (from the repository root)::

    .venv/bin/python benchmarks/memory_pressure.py            # 5 rounds, compile median of 3
    .venv/bin/python benchmarks/memory_pressure.py --quick    # 2 rounds, one compile each

``--quick`` times two calls of each (no warm-up call) and takes about a minute on the 2-core
development machine: three compiles of 5-12 s and one of the stats program, and calls of 2-4 s.
The timed loop is ``jax.vmap(dyndepth.repeat)``; the stats come from ``repeat_batched`` (the
same vmapped loop, which alone returns them), a compile of its own.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from measure import best_seconds, compile_times, machine_line, masked_scan, table, temp_mib

import dyndepth as dd

B, ROWS, WIDTH, MAX_DEPTH, DEEP = 64, 32, 64, 1024, 512
BUDGET_MIB = 512


def step(W, scale=0.05):
    return lambda c: c + scale * jnp.tanh(c @ W)


def loop_loss(scale):
    def loss(W, xs, ds):
        one = lambda x, d: dd.repeat(step(W, scale), x, d, max_depth=MAX_DEPTH)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, ds) ** 2)

    return jax.value_and_grad(loss)


def scan_loss(scale):
    def loss(W, xs, ds):
        return jnp.sum(masked_scan(step(W, scale), xs, ds, DEEP, remat=True) ** 2)

    return jax.value_and_grad(loss)


def loop_stats(W, xs, ds) -> dict:
    """``return_stats`` of the same loop (``repeat_batched`` is ``vmap(repeat)``), taken from a
    value_and_grad: the backward pass's work and the carries stored per sample are there."""

    def loss(W):
        out, stats = dd.repeat_batched(step(W), xs, ds, max_depth=MAX_DEPTH, return_stats=True)
        return jnp.sum(out**2), stats

    (_, stats), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(W)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="distinct programs per compile median")
    p.add_argument("--quick", action="store_true", help="2 rounds, one compile each, no warm-up")
    a = p.parse_args()
    rounds, repeats = (2, 1) if a.quick else (a.rounds, a.repeats)
    print(machine_line())
    kw, kx, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(kw, (WIDTH, WIDTH)) / WIDTH**0.5
    xs = jax.random.normal(kx, (B, ROWS, WIDTH))
    uniform = jax.random.randint(kd, (B,), 1, DEEP + 1, dtype=jnp.int32)
    deep = jnp.full((B,), DEEP, jnp.int32)
    programs = {
        "uniform": (loop_loss, uniform),
        f"all {DEEP}": (loop_loss, deep),
        "checkpoint + scan": (scan_loss, uniform),
    }
    print(
        f"B={B}, carry {ROWS}x{WIDTH} float32 per sample, max_depth {MAX_DEPTH}, uniform "
        f"depths in [1, {DEEP}]: sum {int(uniform.sum())} (all {DEEP}: {B * DEEP})\n"
    )
    compiled, comp = {}, {}
    for name, (loss_of, ds) in programs.items():
        make = lambda i, loss_of=loss_of: loss_of(0.05 + 1e-6 * i)  # noqa: E731
        lower_s, compile_s, compiled[name] = compile_times(make, (W, xs, ds), repeats)
        comp[name] = lower_s + compile_s
    calls = {n: (compiled[n], (W, xs, programs[n][1])) for n in programs}
    sec = best_seconds(calls, rounds, warm_up=not a.quick)
    rows, stats = [], {}
    for name, (_, ds) in programs.items():
        fwd = bwd = stored = "n/a"
        if name == "checkpoint + scan":
            fwd = bwd = B * DEEP
        elif name == "uniform" or not a.quick:  # each a compile of its own: quick skips one
            stats[name] = loop_stats(W, xs, ds)
            fwd = int(stats[name]["executed_sample_steps"])
            bwd = int(stats[name]["backward_executed_sample_steps"])
            stored = int(stats[name]["stored_carries"])
        rows.append([name, int(ds.sum()), fwd, bwd, stored,
                     f"{1e3 * sec[name]:.0f}", f"{comp[name]:.2f}",
                     f"{temp_mib(compiled[name]):.1f}"])  # fmt: skip
    print(table(["program", "useful sample-steps", "executed fwd", "executed bwd", "stored carries",
                 "value_and_grad ms", "compile s", "temp MiB"], rows))  # fmt: skip
    temp = temp_mib(compiled["uniform"])
    within = "within" if temp <= BUDGET_MIB else "over"
    warm = ", no warm-up" if a.quick else ""
    print(f"\nuniform / all {DEEP}: {sec['uniform'] / sec[f'all {DEEP}']:.2f}x (target <= 0.65; "
          f"useful work {int(uniform.sum()) / (B * DEEP):.2f}x); uniform / checkpoint + scan: "
          f"{sec['uniform'] / sec['checkpoint + scan']:.2f}x (target <= 0.8); uniform temp "
          f"memory {temp:.1f} MiB ({within} the {BUDGET_MIB} MiB budget); best of {rounds} "
          f"round(s){warm}, compile median of {repeats}")  # fmt: skip
    u = stats["uniform"]
    print(
        f"uniform: backward executed sample-steps {int(u['backward_executed_sample_steps'])} "
        f"against sum(depth) {int(uniform.sum())} (at most 2x with recompute), "
        f"{int(u['stored_carries'])} carries stored per sample"
    )


if __name__ == "__main__":
    main()
