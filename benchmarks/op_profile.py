"""Where a compiled value_and_grad spends its time on the CPU, by loop pass and by kind of op.

Runs ``benchmarks/memory_pressure.py``'s value_and_grad (B=64, a 32 x 64 carry, ``max_depth``
1024) on the depths named by ``--depths`` under ``jax.profiler``, and sums the time of every
executed XLA op over ``--calls`` calls (per call), grouped by the pass it belongs to
(``forward``/``backward``: the name stack of dyndepth's kernels) and by kind: ``step`` for the
ops of the user's step (under ``vmap``, as the kernels call it), else the kernel's own
operation (a gather, a scatter, a select), or what runs outside the loops (``(outside)``: the
store's first fill is a ``dynamic_update_slice`` fused with its zeros). An op XLA fused keeps
the name of the operation it was emitted for, so a gather fused into the step's first product
counts as ``step``.

How to run (from the repository root)::

    .venv/bin/python benchmarks/op_profile.py --depths uniform   # also: all-512, ones
    .venv/bin/python benchmarks/op_profile.py --depths all-512 --by-op --top 20
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import memory_pressure as mp
from measure import machine_line


def op_names(compiled) -> dict:
    """HLO op name -> the JAX name stack it was emitted for (its ``op_name`` metadata)."""
    out = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = .*op_name="([^"]*)"', line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def kind_of(stack: str) -> str:
    """``"<pass> <kind>"`` of an op's name stack (see the module docstring)."""
    phase = "backward" if "backward" in stack else "forward" if "forward" in stack else "other"
    if "while/body/" not in stack:
        return f"{phase} (outside) {stack.split('/')[-1]}"
    inner = stack.split("while/body/")[-1]
    return f"{phase} {'step' if 'vmap(' in inner else inner.split('/')[0]}"


def trace_events(fn, args, calls: int) -> list:
    """The events of ``jax.profiler``'s trace of ``calls`` calls of ``fn(*args)``."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        return json.load(gzip.open(path))["traceEvents"]


def profile(fn, args, calls: int, by_op: bool = False) -> collections.Counter:
    """Milliseconds per call of each kind (``by_op``: of each op, with its name stack), over
    ``calls`` profiled calls (after two warm-ups)."""
    names = op_names(fn)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    totals = collections.Counter()
    for e in trace_events(fn, args, calls):
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in names or name.startswith(("while", "cond", "call")):
            continue  # (a loop's or a branch's own event spans the ops inside it)
        key = f"{name}: {names[name][-70:]}" if by_op else kind_of(names[name])
        totals[key] += e["dur"] / 1e3 / calls
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", choices=("uniform", "all-512", "ones"), default="uniform")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--by-op", action="store_true", help="each op apart, not summed by kind")
    a = p.parse_args()
    if a.calls < 1 or a.top < 1:
        p.error("--calls and --top must be positive")
    kw, kx, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(kw, (mp.WIDTH, mp.WIDTH)) / mp.WIDTH**0.5
    xs = jax.random.normal(kx, (mp.B, mp.ROWS, mp.WIDTH))
    depths = {
        "uniform": jax.random.randint(kd, (mp.B,), 1, mp.DEEP + 1, dtype=jnp.int32),
        "all-512": jnp.full((mp.B,), mp.DEEP, jnp.int32),
        "ones": jnp.ones((mp.B,), jnp.int32),
    }[a.depths]
    fn = jax.jit(mp.loop_loss(0.05)).lower(W, xs, depths).compile()
    totals = profile(fn, (W, xs, depths), a.calls, a.by_op)
    print(machine_line())
    print(f"\nmemory_pressure's value_and_grad, depths {a.depths} (sum {int(depths.sum())}): "
          f"{sum(totals.values()):.1f} ms of ops per call, {a.calls} profiled calls\n")  # fmt: skip
    print(f"| {'op: name stack' if a.by_op else 'pass and kind'} | ms per call |\n|---|---|")
    for kind, ms in totals.most_common(a.top):
        print(f"| {kind} | {ms:.2f} |")


if __name__ == "__main__":
    main()
