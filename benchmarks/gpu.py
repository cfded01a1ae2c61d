"""The accelerator benchmark: does the scheduler win in wall time where iterations are dear?

Three workloads (step ``x -> x + 0.1 * tanh(x @ W1) @ W2``, per-sample depths), each timed
forward and ``value_and_grad`` (ms, best of ``--repeats`` interleaved rounds, every call
compiled and warmed up first):

- long-tail: B=4096, D=1024, max_depth 256, depths 1 + Poisson(LogNormal) (mean about 33);
- uniform-64: B=4096, D=1024, depths uniform in [1, 64];
- uniform-100: B=256, D=256, depths uniform in [1, 100].

Contenders: ``jax.vmap(dyndepth.repeat)`` with the default slot rule and with each fixed count
of a sweep (``slots=S``); full-depth ``lax.scan`` over ``max(depth)`` for every sample
(forward) and ``jax.checkpoint`` + ``lax.scan`` (value_and_grad), masked to each sample's
depth as a careful user writes it; ``jax.vmap(lax.while_loop)`` (forward). Then the compile
time (lower + compile, one fresh function) of value_and_grad for the default against
``strategy="checkpointed"`` (one unscheduled loop). The ratios printed are the issue's
targets: default / best fixed count, and default / full-depth scan. Last, the backend's
iteration cost as ``dyndepth.measure_iteration_cost`` measures it, beside the built-in one.

Made to run within about 5 minutes on one GPU. How to run (from the repository root)::

    python benchmarks/gpu.py                 # on the accelerator
    python benchmarks/gpu.py --quick         # tiny shapes: a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax
from scheduler import depths_of, interleaved_ms

import dyndepth as dd
from dyndepth import _cost as dd_cost

WORKLOADS = {  # name: (batch, width, max_depth, distribution, sweep)
    "long-tail": (4096, 1024, 256, "long-tail", (4096, 2048, 1024, 512, 256)),
    "uniform-64": (4096, 1024, 64, "uniform", (4096, 2048, 1024)),
    "uniform-100": (256, 256, 100, "uniform", (256, 128, 64)),
}
QUICK = {
    "long-tail": (64, 16, 32, "long-tail", (64, 32, 16)),
    "uniform-small": (32, 8, 16, "uniform", (32, 16)),
}


MODES = ("forward", "value_and_grad")


def step(p):
    return lambda x: x + 0.1 * jnp.tanh(x @ p["W1"]) @ p["W2"]


def scheduled(p, xs, ds, max_depth, slots=None, strategy="auto"):
    kw = dict(slots=slots) if strategy == "auto" else {}
    one = lambda x, d: dd.repeat(step(p), x, d, max_depth=max_depth, strategy=strategy, **kw)  # noqa: E731
    return jax.vmap(one)(xs, ds)


def masked_scan(p, xs, ds, length, remat=False):
    """Every sample runs ``length`` (the batch's deepest) steps, each kept only below its
    depth."""
    body = jax.checkpoint(step(p)) if remat else step(p)

    def one(x, d):
        f = lambda c, i: (jnp.where(i < d, body(c), c), None)  # noqa: E731
        return lax.scan(f, x, jnp.arange(length))[0]

    return jax.vmap(one)(xs, ds)


def vmapped_while(p, xs, ds):
    def one(x, d):
        return lax.while_loop(lambda s: s[0] < d, lambda s: (s[0] + 1, step(p)(s[1])), (0, x))[1]

    return jax.vmap(one)(xs, ds)


def workload(name, spec, repeats):
    batch, width, hi, dist, sweep = spec
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"W1": jax.random.normal(k[0], (width, width)) / width**0.5,
         "W2": jax.random.normal(k[1], (width, width)) / width**0.5}  # fmt: skip
    xs = jax.random.normal(k[2], (batch, width))
    ds = depths_of(dist, k[3], batch, hi)
    loss = lambda run: lambda p, xs, ds: jnp.sum(run(p, xs, ds) ** 2)  # noqa: E731
    fwd = {"default": lambda p, xs, ds: scheduled(p, xs, ds, hi)}
    for s in sweep:
        fwd[f"slots={s}"] = lambda p, xs, ds, s=s: scheduled(p, xs, ds, hi, slots=s)
    vag = dict(fwd)
    longest = int(ds.max())
    fwd["lax.scan, full depth"] = lambda p, xs, ds: masked_scan(p, xs, ds, longest)
    fwd["vmap(lax.while_loop)"] = vmapped_while
    vag["jax.checkpoint + lax.scan, full depth"] = lambda p, xs, ds: masked_scan(
        p, xs, ds, longest, remat=True
    )
    calls = {("forward", n): (jax.jit(f), (p, xs, ds)) for n, f in fwd.items()}
    calls |= {("value_and_grad", n): (jax.jit(jax.value_and_grad(loss(f))), (p, xs, ds))
              for n, f in vag.items()}  # fmt: skip
    ms = interleaved_ms(calls, repeats)
    print(f"\n### {name}: B={batch}, D={width}, max_depth {hi}, depths {dist} "
          f"(mean {float(ds.mean()):.1f}, max {int(ds.max())})\n")  # fmt: skip
    print("| contender | forward ms | value_and_grad ms |")
    print("|---|---|---|")
    names = list(dict.fromkeys([n for _, n in calls]))
    for n in names:
        cells = [f"{ms[mode, n]:.2f}" if (mode, n) in ms else "-" for mode in MODES]
        print(f"| {n} | {' | '.join(cells)} |")
    baselines = ("lax.scan, full depth", "jax.checkpoint + lax.scan, full depth")
    for mode, baseline in zip(MODES, baselines, strict=True):
        best = min((ms[mode, f"slots={s}"], s) for s in sweep)
        print(f"- {mode}: default / best fixed count (slots={best[1]}) "
              f"{ms[mode, 'default'] / best[0]:.2f}x; full-depth scan / default "
              f"{ms[mode, baseline] / ms[mode, 'default']:.2f}x")  # fmt: skip
    return p, xs, ds, hi


def compile_seconds(p, xs, ds, hi, strategy):
    def loss(p, xs, ds):
        return jnp.sum(scheduled(p, xs, ds, hi, strategy=strategy) ** 2)

    t0 = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(p, xs, ds).compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on a CPU)")
    a = ap.parse_args()
    specs = QUICK if a.quick else WORKLOADS
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), best of {a.repeats} "
          f"interleaved rounds")  # fmt: skip
    t0 = time.perf_counter()
    shapes = {name: workload(name, spec, a.repeats) for name, spec in specs.items()}
    print("\n### Compile time of value_and_grad (s, one fresh function each)\n")
    print("| workload | checkpointed | default | ratio |")
    print("|---|---|---|---|")
    for name, shape in shapes.items():
        base = compile_seconds(*shape, "checkpointed")
        auto = compile_seconds(*shape, "auto")
        print(f"| {name} | {base:.2f} | {auto:.2f} | {auto / base:.2f}x |")
    print_measured_cost(a.quick)
    print(f"\nwhole run: {time.perf_counter() - t0:.0f} s")


def print_measured_cost(quick: bool) -> None:
    """This backend's iteration cost as ``dyndepth.measure_iteration_cost`` measures it,
    beside the built-in constants the runs above used."""
    kw = dict(batch=128, width=16, depth=2, repeats=1) if quick else {}
    cost = dd.measure_iteration_cost(**kw)
    print(f"\nmeasured IterationCost: fixed {cost.fixed_seconds * 1e6:.1f} us, "
          f"{cost.flops_per_second / 1e12:.2f} TFLOP/s, row floor "
          f"{cost.row_floor_seconds * 1e9:.1f} ns (built-in for {jax.default_backend()}: "
          f"{dd_cost.backend_cost()})")  # fmt: skip


if __name__ == "__main__":
    main()
