"""The loops on a TPU: the time model's constants and value_and_grad against the masked scan.

Run on a TPU host (one chip is enough); it takes about three minutes on one TPU v5e.

1. ``dyndepth.measure_iteration_cost`` at widths 256 and 1024, beside the built-in constants.
2. For two workloads of ``benchmarks/gpu.py`` (step ``x -> x + 0.1 * tanh(x @ W1) @ W2``):
   long-tail (B=4096, D=1024, ``max_depth`` 256, depths 1 + Poisson(LogNormal), mean about 33)
   and uniform-100 (B=256, D=256, depths uniform in [1, 100]): ``value_and_grad`` of
   ``repeat_batched`` with the defaults, with every carry stored (a stored-carry budget of 8
   GiB), with ``checkpoints=16``, in lockstep (``slots=B``), and of ``vmap(repeat)`` with
   ``strategy="checkpointed"`` (one unscheduled loop), against ``jax.checkpoint`` + a
   ``lax.scan`` masked to each sample's depth over the batch's deepest. Per contender: the best
   time of ``--repeats`` interleaved rounds, the compile time (lower + compile), the compiled
   program's temporary memory, and the loop's stats (forward and backward iterations, backward
   executed sample-steps, carries stored per sample).

How to run (from the repository root, dyndepth importable)::

    python benchmarks/tpu.py              # on the TPU
    python benchmarks/tpu.py --quick      # tiny shapes: a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from gpu import masked_scan, step
from scheduler import depths_of, interleaved_ms

import dyndepth as dd
from dyndepth import _cost as dd_cost

WORKLOADS = {  # name: (batch, width, max_depth, distribution)
    "long-tail": (4096, 1024, 256, "long-tail"),
    "uniform-100": (256, 256, 100, "uniform"),
}
QUICK = {"long-tail": (64, 16, 32, "long-tail"), "uniform": (32, 8, 16, "uniform")}
STORE_ALL_BUDGET = 8 * 2**30
STATS = ("iterations", "backward_iterations", "backward_executed_sample_steps", "stored_carries")


def scheduled(max_depth, **kw):
    def loss(p, xs, ds):
        out, stats = dd.repeat_batched(step(p), xs, ds, max_depth=max_depth, return_stats=True,
                                       **kw)  # fmt: skip
        return jnp.sum(out**2), {k: stats[k] for k in STATS}

    return loss


def unscheduled(max_depth):
    def loss(p, xs, ds):
        one = lambda x, d: dd.repeat(step(p), x, d, max_depth=max_depth, strategy="checkpointed")  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, ds) ** 2), {}

    return loss


def checkpointed_scan(longest):
    def loss(p, xs, ds):
        return jnp.sum(masked_scan(p, xs, ds, longest, remat=True) ** 2), {}

    return loss


def contenders(batch, max_depth, longest):
    """``name: (loss, stored-carry budget or None)``."""
    return {
        "default": (scheduled(max_depth), None),
        "every carry stored": (scheduled(max_depth), STORE_ALL_BUDGET),
        "checkpoints=16": (scheduled(max_depth, checkpoints=16), None),
        f"lockstep, slots={batch}": (scheduled(max_depth, slots=batch), None),
        '"checkpointed"': (unscheduled(max_depth), None),
        "jax.checkpoint + lax.scan": (checkpointed_scan(longest), None),
    }


def compiled(loss, args, budget):
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    t0 = time.perf_counter()
    if budget is None:
        out = fn.lower(*args).compile()
    else:
        with dd.stored_carry_budget_scope(budget):
            out = fn.lower(*args).compile()
    return out, time.perf_counter() - t0


def workload_args(spec):
    """The operands ``(params, xs, depths)`` of a workload ``(batch, width, max_depth,
    distribution)``."""
    batch, width, max_depth, dist = spec
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"W1": jax.random.normal(k[0], (width, width)) / width**0.5,
         "W2": jax.random.normal(k[1], (width, width)) / width**0.5}  # fmt: skip
    xs = jax.random.normal(k[2], (batch, width))
    return p, xs, depths_of(dist, k[3], batch, max_depth)


def workload(name, spec, repeats):
    batch, width, max_depth, dist = spec
    args = workload_args(spec)
    ds = args[2]
    named = contenders(batch, max_depth, int(ds.max()))
    built = {n: compiled(loss, args, budget) for n, (loss, budget) in named.items()}
    ms = interleaved_ms({n: (c, args) for n, (c, _) in built.items()}, repeats)
    scan_ms = ms["jax.checkpoint + lax.scan"]
    print(f"\n### {name}: B={batch}, D={width}, max_depth {max_depth}, depths {dist} "
          f"(mean {float(ds.mean()):.1f}, max {int(ds.max())}), value_and_grad\n")  # fmt: skip
    print("| contender | ms | vs scan | compile s | temp MiB | iterations fwd / bwd "
          "| bwd executed | stored / sample |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n, (c, seconds) in built.items():
        (_, stats), _ = c(*args)
        temp = c.memory_analysis().temp_size_in_bytes / 2**20
        if stats:
            it, bit, bex, st = (int(stats[s]) for s in STATS)
            cells = f"{it} / {bit} | {bex} | {st}"
        else:
            cells = "- | - | -"
        print(f"| {n} | {ms[n]:.2f} | {ms[n] / scan_ms:.2f}x | {seconds:.1f} | {temp:.1f} "
              f"| {cells} |")  # fmt: skip


def print_costs(quick):
    kw = dict(batch=128, width=16, depth=2, repeats=1) if quick else {}
    print(f"built-in IterationCost for {jax.default_backend()}: {dd_cost.backend_cost()}")
    for width in (16,) if quick else (256, 1024):
        cost = dd.measure_iteration_cost(**dict(kw, width=width))
        print(f"measured at width {width}: fixed {cost.fixed_seconds * 1e6:.2f} us, "
              f"{cost.flops_per_second / 1e12:.2f} TFLOP/s, row floor "
              f"{cost.row_floor_seconds * 1e9:.1f} ns, weights read at "
              f"{cost.bytes_per_second / 1e9:.0f} GB/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on a CPU)")
    a = ap.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), best of {a.repeats} "
          f"interleaved rounds")  # fmt: skip
    t0 = time.perf_counter()
    print_costs(a.quick)
    for name, spec in (QUICK if a.quick else WORKLOADS).items():
        workload(name, spec, a.repeats)
    print(f"\nwhole run: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
