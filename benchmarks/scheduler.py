"""The per-sample scheduler on skewed depth distributions: work, wall time, compile time.

What it measures, for the step ``x -> x + tanh(x @ W)`` (``B`` samples of width ``D``):

1. **Work**, for each depth distribution and batch size: executed / useful sample-steps of
   ``dyndepth.repeat_batched`` (``return_stats``), forward; the backward pass is scheduled by
   the same rule on the same depths (``tests/test_schedule.py`` counts both with a callback).
2. **Time** (ms, best of ``--repeats``), at ``B, D = --batch, --width`` with depths uniform in
   ``[1, max_depth]``: forward and ``value_and_grad`` of ``jax.vmap(dyndepth.repeat)``
   (``"auto"``: the scheduler) on those depths and on equal depths with the same sum (the same
   useful work, no skew), against a vmapped ``lax.while_loop`` (forward) and the seed's
   ``jax.checkpoint`` + ``lax.scan`` over ``max_depth`` with ``lax.cond``.
3. **Full depth**: every sample at ``max_depth``: ``value_and_grad`` of the scheduler against
   ``jax.checkpoint`` + ``lax.scan`` (nothing to save; the per-step overhead shows).
4. **Compile time** (lower + compile of ``value_and_grad``, median of 3 fresh functions) of
   ``"auto"`` against ``"checkpointed"`` (one unscheduled loop) at ``--compile-batch``.

How to run (from the repository root)::

    .venv/bin/python benchmarks/scheduler.py              # the table in benchmarks/README.md
    .venv/bin/python benchmarks/scheduler.py --quick      # small shapes, a smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dyndepth as dd


def depths_of(name: str, key: jax.Array, batch: int, hi: int) -> jax.Array:
    """The depth distributions of the scheduler's promise, in ``[0, hi]``."""
    k1, k2 = jax.random.split(key)
    if name == "bimodal":
        return jnp.where(jax.random.bernoulli(k1, 0.53, (batch,)), hi, 1)
    if name == "one-deep-many-shallow":
        return jnp.zeros((batch,), jnp.int32).at[0].set(hi)
    if name == "few-deep":
        shallow = jax.random.randint(k1, (batch,), 0, 3)
        return jnp.where(jnp.arange(batch) % 32 == 0, hi, shallow)
    if name == "geometric":
        return jnp.minimum(jax.random.geometric(k1, 0.05, (batch,)), hi).astype(jnp.int32)
    if name == "uniform":
        return jax.random.randint(k1, (batch,), 1, hi + 1)
    if name == "long-tail":
        tau = jnp.exp(jnp.log(hi / 8) - 0.125 + 0.5 * jax.random.normal(k1, (batch,)))
        return jnp.clip(1 + jax.random.poisson(k2, tau), 1, hi).astype(jnp.int32)
    if name == "all-equal":
        return jnp.full((batch,), hi // 2, jnp.int32)
    if name == "all-zero":
        return jnp.zeros((batch,), jnp.int32)
    raise ValueError(f"unknown distribution {name!r}")


DISTRIBUTIONS = (
    "bimodal",
    "one-deep-many-shallow",
    "few-deep",
    "geometric",
    "uniform",
    "long-tail",
    "all-equal",
    "all-zero",
)


def best_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def layer(W):
    return lambda x: x + jnp.tanh(x @ W)


def scheduled(W, xs, ds, max_depth, strategy="auto"):
    one = lambda x, d: dd.repeat(layer(W), x, d, max_depth=max_depth, strategy=strategy)
    return jax.vmap(one)(xs, ds)


def vmapped_while(W, xs, ds, max_depth):
    def one(x, d):
        body = lambda s: (s[0] + 1, layer(W)(s[1]))
        return lax.while_loop(lambda s: s[0] < d, body, (0, x))[1]

    return jax.vmap(one)(xs, ds)


def full_scan(W, xs, ds, max_depth, remat=False):
    """Every sample at ``max_depth``: a ``lax.scan`` of the step (with ``remat``, each step
    rematerialised in the backward pass, as ``jax.checkpoint`` + ``lax.scan``)."""
    body = jax.checkpoint(layer(W)) if remat else layer(W)
    one = lambda x: lax.scan(lambda c, _: (body(c), None), x, None, length=max_depth)[0]
    return jax.vmap(one)(xs)


def loss_of(run, max_depth):
    return lambda W, xs, ds: jnp.sum(run(W, xs, ds, max_depth) ** 2)


def work_table(batches, hi):
    print(f"\n### Work: executed / useful sample-steps, forward (max depth {hi})\n")
    print("| distribution | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for i, name in enumerate(DISTRIBUTIONS):
        cells = []
        for b in batches:
            ds = depths_of(name, jax.random.PRNGKey(i), b, hi)
            xs = jnp.zeros((b, 1))
            _, st = dd.repeat_batched(lambda x: x + 1.0, xs, ds, max_depth=hi, return_stats=True)
            useful, executed = int(st["useful_sample_steps"]), int(st["executed_sample_steps"])
            ratio = "exact (0 = 0)" if useful == 0 else f"{executed / useful:.3f}"
            cells.append(f"{ratio} ({int(st['iterations'])} it.)")
        print(f"| {name} | " + " | ".join(cells) + " |")


def time_table(batch, width, hi, repeats):
    kw, kx, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(kw, (width, width)) / (2 * np.sqrt(width))
    xs = jax.random.normal(kx, (batch, width))
    uniform = jax.random.randint(kd, (batch,), 1, hi + 1)
    total = int(uniform.sum())
    equal = jnp.full((batch,), total // batch, jnp.int32).at[: total % batch].add(1)
    full = jnp.full((batch,), hi, jnp.int32)
    ms = lambda fn, ds: best_ms(jax.jit(fn), W, xs, ds, repeats=repeats)
    fwd = lambda run: lambda W, xs, ds: run(W, xs, ds, hi)
    vg = lambda run: jax.value_and_grad(loss_of(run, hi))
    rows = {
        label: (ms(fwd(scheduled), ds), ms(fwd(vmapped_while), ds), ms(vg(scheduled), ds))
        for label, ds in (("uniform", uniform), ("equal, same sum", equal), ("full", full))
    }
    scan_fwd = ms(fwd(full_scan), full)
    remat_scan = lambda W, xs, ds, hi: full_scan(W, xs, ds, hi, remat=True)
    scan_vg = ms(vg(remat_scan), full)
    print(f"\n### Time (ms, best of {repeats}): B={batch}, D={width}, max_depth={hi}\n")
    print("| depths | forward: scheduler | vmap(lax.while_loop) | value_and_grad: scheduler |")
    print("|---|---|---|---|")
    for label, (f, w, g) in rows.items():
        print(f"| {label} | {f:.1f} | {w:.1f} | {g:.1f} |")
    print(
        f"| full, `lax.scan` / `jax.checkpoint` + `lax.scan` | {scan_fwd:.1f} | | {scan_vg:.1f} |"
    )
    (uf, uw, ug), (ef, _, eg), (ff, _, fg) = rows.values()
    print("\nRatios:")
    print(
        f"- uniform / equal depths, same sum: forward {uf / ef:.2f}x, value_and_grad {ug / eg:.2f}x"
    )
    print(f"- uniform, forward: vmap(lax.while_loop) / scheduler = {uw / uf:.2f}x")
    print(
        f"- full depth: scheduler / lax.scan forward {ff / scan_fwd:.2f}x, "
        f"scheduler / (jax.checkpoint + lax.scan) value_and_grad {fg / scan_vg:.2f}x"
    )


def compile_seconds(strategy, batch, width, hi):
    W = jnp.zeros((width, width))
    xs = jnp.zeros((batch, width))
    ds = jnp.ones((batch,), jnp.int32)
    times = []
    for _ in range(3):
        # A new function object each time: a fresh trace, lowering and compile.
        fn = jax.value_and_grad(lambda W, xs, ds: jnp.sum(scheduled(W, xs, ds, hi, strategy)))
        t0 = time.perf_counter()
        jax.jit(fn).lower(W, xs, ds).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_table(batches, width, hi):
    print(f"\n### Compile time of value_and_grad (s, median of 3; D={width}, max_depth={hi})\n")
    print("| B | auto (scheduler) | checkpointed | ratio |")
    print("|---|---|---|---|")
    compile_seconds("checkpointed", 4, width, hi)  # warm-up: JAX's own caches
    for b in batches:
        auto = compile_seconds("auto", b, width, hi)
        base = compile_seconds("checkpointed", b, width, hi)
        print(f"| {b} | {auto:.2f} | {base:.2f} | {auto / base:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--max-depth", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    batches = (64, 256, 1024)
    if a.quick:
        a.batch, a.width, a.max_depth, a.repeats, batches = 16, 8, 10, 1, (16,)
    print(f"JAX {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")  # fmt: skip
    t0 = time.perf_counter()
    work_table(batches, a.max_depth)
    time_table(a.batch, a.width, a.max_depth, a.repeats)
    compile_table(batches[:2] if not a.quick else batches, a.width, a.max_depth)
    print(f"\n(whole run: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
