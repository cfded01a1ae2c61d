"""An unused ``max_depth``: memory and time of value_and_grad as ``max_depth`` grows, depths fixed.

``jax.value_and_grad`` of ``jax.vmap(dyndepth.repeat)`` (step ``x -> x + tanh(x @ W)``, a carry of
16 floats) with the same small depths at ``max_depth`` 100, 1,000, 10,000 and 100,000: the compiled
program's temporary memory (XLA's memory analysis), its compile time and its run time (best of
``--repeats`` rounds in which the max_depths take turns), and each run time over the one at
``max_depth`` 100 (#38's target: every row within 1.3x, temp memory within the 512 MiB stored-carry
budget). Two batches: B=4096 with depth 3 for every sample, and B=64 with depths uniform in [0, 20).
``--json PATH`` also writes the rows as JSON (to compare a run before a change with one after).

How to run (from the repository root)::

    .venv/bin/python benchmarks/max_depth.py             # the table in benchmarks/README.md
    .venv/bin/python benchmarks/max_depth.py --quick     # max_depth 100 and 10,000 only
    .venv/bin/python benchmarks/max_depth.py --json /tmp/max_depth.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from measure import best_seconds

import dyndepth as dd


def compiled_loss(batch: int, depths: jax.Array, max_depth: int) -> tuple:
    """``(compiled value_and_grad, args, compile seconds)`` of the loop at ``max_depth``."""
    W = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) * 0.1
    xs = jax.random.normal(jax.random.PRNGKey(1), (batch, 16))

    def loss(W, xs):
        one = lambda x, d: dd.repeat(lambda c: c + jnp.tanh(c @ W), x, d, max_depth=max_depth)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths) ** 2)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(W, xs).compile()
    return compiled, (W, xs), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args()
    max_depths = (100, 10_000) if a.quick else (100, 1_000, 10_000, 100_000)
    platform = jax.devices()[0].platform
    print(f"jax {jax.__version__}, {platform}, best of {a.repeats} interleaved rounds\n")
    print("| batch, depths | max_depth | temp MiB | compile s | run ms | run / max_depth 100 |")
    print("|---|---|---|---|---|---|")
    batches = {
        "B=4096, depth 3": (4096, jnp.full((4096,), 3, jnp.int32)),
        "B=64, depths in [0, 20)": (64, jax.random.randint(jax.random.PRNGKey(2), (64,), 0, 20)),
    }
    rows = []
    for name, (batch, depths) in batches.items():
        made = {md: compiled_loss(batch, depths, md) for md in max_depths}
        # (the max_depths take turns, round after round: load falls on all of them alike)
        best = best_seconds({md: (c, args) for md, (c, args, _) in made.items()}, a.repeats)
        for md, (compiled, _, compile_s) in made.items():
            r = dict(temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
                     compile_s=compile_s, run_ms=1e3 * best[md])  # fmt: skip
            relative = best[md] / best[max_depths[0]]
            rows.append(dict(batch=name, max_depth=md, **r, relative=relative))
            print(f"| {name} | {md:,} | {r['temp_mib']:.0f} | {r['compile_s']:.1f} | "
                  f"{r['run_ms']:.1f} | {relative:.2f} |", flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(jax=jax.__version__, repeats=a.repeats, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
