"""A loop under two ``vmap`` levels against the same samples under one.

``jax.vmap(jax.vmap(repeat))`` over ``G`` groups of ``B / G`` samples computes what
``jax.vmap(repeat)`` over all ``B`` does. The slot count is chosen once for every group
(``dyndepth._slots.outer_level``); a choice per group would be batched over the outer level,
which on a TPU runs the counts' chained loops masked to the groups that chose them and on a CPU
or a GPU, whose counts sit under one conditional, turns that conditional into a select that
runs every count's loop. The TPU's and the GPU's programs are traced here on the host by
setting the platform the kernels are traced for (``measure.trace_as``, a private hook) with
the CPU's time model, so that every program chooses among the same counts; all run on this CPU.
It prints the forward time (best of ``--rounds`` interleaved rounds), the loops and the
conditionals in each optimized program (a select where a conditional was shows as fewer).

How to run (from the repository root)::

    .venv/bin/python benchmarks/nested_vmap.py                # B=512 in 4 groups, long tail
    .venv/bin/python benchmarks/nested_vmap.py --dist few-deep --groups 8
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from measure import machine_line, table, trace_as
from scheduler import DISTRIBUTIONS, depths_of, interleaved_ms, layer

import dyndepth as dd


def programs(W, xs, ds, groups: int, max_depth: int) -> dict:
    one = lambda x, d: dd.repeat(layer(W), x, d, max_depth=max_depth)  # noqa: E731
    B, D = xs.shape

    def nested(xs, ds):
        grouped = (xs.reshape(groups, B // groups, D), ds.reshape(groups, B // groups))
        return jax.vmap(jax.vmap(one))(*grouped).reshape(B, D)

    return {"one level": jax.jit(jax.vmap(one)), "two levels": jax.jit(nested)}


def shape_of(compiled_text: str) -> str:
    branches = [len(m.split(",")) for m in re.findall(r"branch_computations=\{([^}]*)\}",
                                                      compiled_text)]  # fmt: skip
    conditionals = (f"conditionals of {', '.join(map(str, branches))} branches" if branches
                    else "no conditional")  # fmt: skip
    return f"{compiled_text.count(' while(')} loops, {conditionals}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=128)
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="long-tail")
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    if a.groups < 1 or a.batch % a.groups:
        p.error(f"--groups must divide --batch ({a.batch}), got {a.groups}")
    print(machine_line())
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(k[0], (a.width, a.width)) / a.width**0.5
    xs = jax.random.normal(k[1], (a.batch, a.width))
    ds = depths_of(a.dist, k[2], a.batch, a.max_depth)
    host = jax.default_backend()
    calls, shapes, outs = {}, {}, []
    for platform in (host, "tpu", "cuda"):
        trace_as(platform)
        traced_for = {"tpu": "a TPU", "cuda": "a GPU"}.get(platform, host)
        for level, fn in programs(W, xs, ds, a.groups, a.max_depth).items():
            calls[traced_for, level] = (fn, (xs, ds))
            shapes[traced_for, level] = shape_of(fn.lower(xs, ds).compile().as_text())
            outs.append(fn(xs, ds))
    assert all(float(jnp.max(jnp.abs(o - outs[0]))) < 1e-5 for o in outs), "programs disagree"
    times = interleaved_ms(calls, a.rounds)
    print(f"B={a.batch} in {a.groups} groups, D={a.width}, max_depth {a.max_depth}, "
          f"{a.dist} depths; forward, best of {a.rounds} rounds\n")  # fmt: skip
    rows = [[f"traced for {t}, {level}", f"{ms:.2f}", f"{ms / times[t, 'one level']:.2f}x",
             shapes[t, level]] for (t, level), ms in times.items()]  # fmt: skip
    print(table(["program", "ms", "vs one level", "optimized program"], rows))


if __name__ == "__main__":
    main()
