"""The per-sample scheduler on skewed depth distributions: work, wall time, compile time.

What it measures, for the step ``x -> x + tanh(x @ W)`` (``B`` samples of width ``D``):

1. **Work**, for each depth distribution and batch size: executed / useful sample-steps of
   ``dyndepth.repeat_batched`` (``return_stats``), forward; the backward pass is scheduled by
   the same rule on the same depths (``tests/core/test_schedule.py`` counts both with a callback).
2. **Time** (ms, best of ``--repeats`` rounds, the calls taken in turn within each round), at
   ``B, D = --batch, --width`` with depths uniform in ``[1, max_depth]``: forward and
   ``value_and_grad`` of ``jax.vmap(dyndepth.repeat)`` (``"auto"``: the scheduler) on those
   depths and on equal depths with the same sum (the same useful work, no skew), against a
   vmapped ``lax.while_loop`` (forward). And the **critical path** of the uniform batch: its
   deepest sample's steps run one after another, so any schedule takes at least ``max(depth)``
   iterations, of ``ceil(sum / max)`` rows on average; a lockstep batch of that shape (equal
   depths, nothing to schedule) is the least the uniform batch can cost on this machine.
3. **Full depth**: every sample at ``max_depth``: forward against ``lax.scan`` and
   ``value_and_grad`` against ``jax.checkpoint`` + ``lax.scan`` (nothing to save; the per-step
   overhead shows).
4. **Forward time per distribution** at the same sizes: the default slot counts, two
   (``slots=(B/2, 1)``: two compiled branches, the work bound kept) and the unscheduled
   lockstep loop (``"checkpointed"``).
5. **Compile time** (lower + compile of ``value_and_grad``, median of 3 fresh functions after a
   discarded one) of
   ``"auto"`` (one compiled branch per slot count, listed), with ``slots=(B/2, 1)`` and with
   one slot count (``slots=B/2``), against ``"checkpointed"`` (one unscheduled loop): the
   step above at B = 64 and 256, and a small transformer block (a heavier step) at B = 64.

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
from measure import SEQ, block, block_shapes

import dyndepth as dd
from dyndepth import _cost as dd_cost
from dyndepth._slots import SlotRule
from dyndepth_app.bench import time_in_rounds


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


def interleaved_ms(calls: dict, repeats: int) -> dict:
    """Best time (ms) of each ``label: (fn, args)`` over ``repeats`` rounds, the calls taken in
    turn within a round (``dyndepth bench``'s :func:`time_in_rounds`): load on a shared machine
    then falls on all of them alike, and the best of many rounds is what the code itself
    costs."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    seconds = time_in_rounds([(fn, args, repeats) for fn, args in calls.values()])
    return {label: 1e3 * t for label, t in zip(calls, seconds, strict=True)}


def layer(W):
    return lambda x: x + jnp.tanh(x @ W)


def scheduled(W, xs, ds, max_depth, strategy="auto", slots=None):
    one = lambda x, d: dd.repeat(
        layer(W), x, d, max_depth=max_depth, strategy=strategy, slots=slots
    )
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
    """The work rule (``slots="work"``) on a step of one addition: the bound it keeps."""
    print(f"\n### Work: executed / useful sample-steps, forward, slots=\"work\" "
          f"(max depth {hi})\n")  # fmt: skip
    print("| distribution | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for i, name in enumerate(DISTRIBUTIONS):
        cells = []
        for b in batches:
            ds = depths_of(name, jax.random.PRNGKey(i), b, hi)
            xs = jnp.zeros((b, 1))
            _, st = dd.repeat_batched(
                lambda x: x + 1.0, xs, ds, max_depth=hi, slots="work", return_stats=True
            )
            useful, executed = int(st["useful_sample_steps"]), int(st["executed_sample_steps"])
            ratio = "exact (0 = 0)" if useful == 0 else f"{executed / useful:.3f}"
            cells.append(f"{ratio} ({int(st['iterations'])} it.)")
        print(f"| {name} | " + " | ".join(cells) + " |")


def time_table(batch, width, hi, repeats):
    kw, kx, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(kw, (width, width)) / (2 * np.sqrt(width))
    xs = jax.random.normal(kx, (batch, width))
    uniform = jax.random.randint(kd, (batch,), 1, hi + 1)
    total, longest = int(uniform.sum()), int(uniform.max())
    equal = jnp.full((batch,), total // batch, jnp.int32).at[: total % batch].add(1)
    full = jnp.full((batch,), hi, jnp.int32)
    # The critical path: the deepest sample takes `longest` steps one after another, so any
    # schedule runs at least that many iterations, of ceil(total / longest) rows on average.
    # A lockstep batch of that shape, unscheduled, is what the uniform batch costs at best.
    rows = -(-total // longest)
    floor = (W, xs[:rows], jnp.full((rows,), longest, jnp.int32))
    fwd = lambda run: jax.jit(lambda W, xs, ds: run(W, xs, ds, hi))
    vg = lambda run: jax.jit(jax.value_and_grad(loss_of(run, hi)))
    remat_scan = lambda W, xs, ds, hi: full_scan(W, xs, ds, hi, remat=True)
    calls = {}
    for label, ds in (("uniform", uniform), ("equal, same sum", equal), ("full", full)):
        calls[label, "fwd"] = (fwd(scheduled), (W, xs, ds))
        calls[label, "while"] = (fwd(vmapped_while), (W, xs, ds))
        calls[label, "vg"] = (vg(scheduled), (W, xs, ds))
    calls["floor", "fwd"] = (fwd(scheduled), floor)
    calls["floor", "vg"] = (vg(scheduled), floor)
    calls["scan", "fwd"] = (fwd(full_scan), (W, xs, full))
    calls["scan", "vg"] = (vg(remat_scan), (W, xs, full))
    ms = interleaved_ms(calls, repeats)
    print(f"\n### Time (ms, best of {repeats} interleaved rounds): B={batch}, D={width}, "
          f"max_depth={hi}\n")  # fmt: skip
    print("| depths | forward: scheduler | vmap(lax.while_loop) | value_and_grad: scheduler |")
    print("|---|---|---|---|")
    for label in ("uniform", "equal, same sum", "full"):
        print(f"| {label} | {ms[label, 'fwd']:.1f} | {ms[label, 'while']:.1f} | "
              f"{ms[label, 'vg']:.1f} |")  # fmt: skip
    print(f"| critical path: {rows} rows x {longest} steps, lockstep | {ms['floor', 'fwd']:.1f} | "
          f"| {ms['floor', 'vg']:.1f} |")  # fmt: skip
    print(f"| full, `lax.scan` / `jax.checkpoint` + `lax.scan` | {ms['scan', 'fwd']:.1f} | | "
          f"{ms['scan', 'vg']:.1f} |")  # fmt: skip
    ratio = lambda a, b, kind: ms[a, kind] / ms[b, kind]
    eq = "equal, same sum"
    print("\nRatios:")
    print(f"- uniform / equal depths, same sum: forward {ratio('uniform', eq, 'fwd'):.2f}x, "
          f"value_and_grad {ratio('uniform', eq, 'vg'):.2f}x")  # fmt: skip
    print(f"- critical path / equal depths (the least any schedule of the uniform batch costs): "
          f"forward {ratio('floor', eq, 'fwd'):.2f}x, "
          f"value_and_grad {ratio('floor', eq, 'vg'):.2f}x")  # fmt: skip
    print(f"- uniform, forward: vmap(lax.while_loop) / scheduler = "
          f"{ms['uniform', 'while'] / ms['uniform', 'fwd']:.2f}x")  # fmt: skip
    print(f"- full depth: scheduler / lax.scan forward {ratio('full', 'scan', 'fwd'):.2f}x, "
          f"scheduler / (jax.checkpoint + lax.scan) value_and_grad "
          f"{ratio('full', 'scan', 'vg'):.2f}x")  # fmt: skip


def distribution_table(batch, width, hi, repeats):
    """Forward time on every distribution: the default slot rule (time), the work rule
    (``slots="work"``), two counts (``B/2`` and 1: fewer compiled branches), and the
    unscheduled lockstep loop (``"checkpointed"``), which runs every sample to the batch's
    deepest."""
    kw, kx = jax.random.split(jax.random.PRNGKey(1))
    W = jax.random.normal(kw, (width, width)) / (2 * np.sqrt(width))
    xs = jax.random.normal(kx, (batch, width))
    kinds = {
        "default": dict(strategy="auto"),
        'slots="work"': dict(strategy="auto", slots="work"),
        "slots=(B/2, 1)": dict(strategy="auto", slots=(batch // 2, 1)),
        "lockstep": dict(strategy="checkpointed"),
    }
    fns = {k: jax.jit(lambda W, xs, ds, kw=kw: scheduled(W, xs, ds, hi, **kw))
           for k, kw in kinds.items()}  # fmt: skip
    calls = {}
    for i, name in enumerate(DISTRIBUTIONS[:-1]):  # all-zero: nothing to time
        ds = depths_of(name, jax.random.PRNGKey(i), batch, hi)
        calls.update({(name, k): (fn, (W, xs, ds)) for k, fn in fns.items()})
    ms = interleaved_ms(calls, repeats)
    print(f"\n### Forward time per distribution (ms, best of {repeats} interleaved rounds): "
          f"B={batch}, D={width}, max_depth={hi}\n")  # fmt: skip
    print("| distribution | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name in DISTRIBUTIONS[:-1]:
        print(f"| {name} | " + " | ".join(f"{ms[name, k]:.1f}" for k in kinds) + " |")


def compile_seconds(strategy, batch, width, hi, slots=None, step="tanh"):
    if step == "tanh":
        params, xs = jnp.zeros((width, width)), jnp.zeros((batch, width))
        layer_of = layer
    else:
        params = {name: jnp.zeros(shape) for name, shape in block_shapes(width).items()}
        xs = jnp.zeros((batch, SEQ, width))
        layer_of = lambda p: lambda x: block(p, x)  # noqa: E731
    ds = jnp.ones((batch,), jnp.int32)

    def loss(p, xs, ds):
        one = lambda x, d: dd.repeat(  # noqa: E731
            layer_of(p), x, d, max_depth=hi, strategy=strategy, slots=slots
        )
        return jnp.sum(jax.vmap(one)(xs, ds) ** 2)

    times = []
    for _ in range(4):
        # A new function object each time: a fresh trace, lowering and compile.
        fn = jax.value_and_grad(lambda *args: loss(*args))
        t0 = time.perf_counter()
        jax.jit(fn).lower(params, xs, ds).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first fills JAX's caches for these shapes


def default_counts(batch, width, step):
    """The slot counts the default rule compiles for the step on this backend (its weights,
    shared by the samples, read once per iteration)."""
    if step == "tanh":
        p = jnp.zeros((width, width))
        fn, x = layer(p), jnp.zeros((width,))
    else:
        p = {n: jnp.zeros((width, m * width)) for n, m in (("q", 1), ("k", 1), ("v", 1), ("o", 1))}
        p |= dict(up=jnp.zeros((width, 4 * width)), down=jnp.zeros((4 * width, width)))
        fn, x = (lambda x: block(p, x)), jnp.zeros((SEQ, width))
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(p))
    fixed = dd_cost.backend_cost().fixed_rows(dd_cost.jaxpr_flops(jaxpr), weights)
    return SlotRule.of(None, batch, fixed, dd_cost.jaxpr_equations(jaxpr)).candidates


def compile_table(rows):
    """``rows``: ``(label, batch, width, max_depth, step)``."""
    print("\n### Compile time of value_and_grad (s, median of 3)\n")
    print("| step, B | checkpointed | auto: default slot counts | ratio | `slots=(B/2, 1)` | ratio "
          "| `slots=B/2` | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, b, width, hi, step in rows:
        shape = (b, width, hi)
        base = compile_seconds("checkpointed", *shape, step=step)
        auto = compile_seconds("auto", *shape, step=step)
        two = compile_seconds("auto", *shape, slots=(b // 2, 1), step=step)
        one = compile_seconds("auto", *shape, slots=b // 2, step=step)
        counts = ", ".join(map(str, default_counts(b, width, step)))
        print(f"| {label}, B={b} | {base:.2f} | {auto:.2f} ({counts}) | {auto / base:.2f}x | "
              f"{two:.2f} | {two / base:.2f}x | {one:.2f} | {one / base:.2f}x |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--max-depth", type=int, default=100)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    batches = (64, 256, 1024)
    if a.quick:
        a.batch, a.width, a.max_depth, a.repeats, batches = 16, 8, 10, 1, (16,)
    print(f"JAX {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")  # fmt: skip
    t0 = time.perf_counter()
    work_table(batches, a.max_depth)
    time_table(a.batch, a.width, a.max_depth, a.repeats)
    distribution_table(a.batch, a.width, a.max_depth, a.repeats)
    tanh = f"x + tanh(x W), D={a.width}, max_depth={a.max_depth}"
    rows = [(tanh, b, a.width, a.max_depth, "tanh") for b in batches[:2]]
    rows.append((f"transformer block, L={SEQ}, D=64, max_depth=32", 64, 64, 32, "block"))
    if a.quick:
        rows = [(tanh, a.batch, a.width, a.max_depth, "tanh"), ("block", 8, 8, 4, "block")]
    compile_table(rows)
    print(f"\n(whole run: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
