"""The slot rule against every fixed slot count: does the default pick the fastest?

For each depth distribution, ``repeat_batched``-style loops (``jax.vmap(dyndepth.repeat)``,
step ``x -> x + tanh(x @ W)``, ``B`` samples of width ``D``) run with the default slot rule and
with each fixed count of the sweep ``B, B/2, B/4, ..., 1`` (``slots=S``), forward and
``value_and_grad``; every call of one distribution is compiled first, then timed in
interleaved rounds (best of ``--repeats``). The table gives each time in ms, the best fixed
count, and the default's time over the best one's (the issue's target: at most 1.1x). A last
table sets the compile time of value_and_grad against the worst of those ratios, for the default
and for shorter ladders of slot counts (``slots=(...)``): each count is a compiled copy of the
step, so compile time and run time trade against each other.

How to run (from the repository root)::

    .venv/bin/python benchmarks/slot_sweep.py             # B=512, D=64, max_depth 128
    .venv/bin/python benchmarks/slot_sweep.py --quick     # small shapes, a smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from scheduler import depths_of, interleaved_ms, loss_of, scheduled

import dyndepth as dd


def sweep_counts(batch: int) -> list[int]:
    counts, c = [], batch
    while c >= 1:
        counts.append(c)
        c //= 2
    return counts


def ladders(batch: int) -> dict:
    """Shorter ladders of slot counts than the default's five: each count is a compiled copy
    of the step, forward and backward, so they compile faster and choose among fewer counts."""
    return {
        "3 counts": (batch, batch // 4, batch // 16),
        "2 counts": (batch // 2, batch // 16),
        "1 count": (batch // 4,),
    }


def contenders(batch: int, max_depth: int) -> dict:
    out = {"default": lambda W, xs, ds, md: scheduled(W, xs, ds, md)}
    for s in sweep_counts(batch):
        out[f"S={s}"] = lambda W, xs, ds, md, s=s: scheduled(W, xs, ds, md, slots=s)
    for label, counts in ladders(batch).items():
        out[label] = lambda W, xs, ds, md, c=counts: scheduled(W, xs, ds, md, slots=c)
    return out


def compile_seconds(batch: int, width: int, max_depth: int, repeats: int = 3) -> dict:
    """Median wall time of compiling value_and_grad (a fresh function each time, so no cache
    hit) for the default, each shorter ladder and the unscheduled ``"checkpointed"`` loop."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (jax.random.normal(k[0], (width, width)), jax.random.normal(k[1], (batch, width)),
            depths_of("uniform", k[2], batch, max_depth))  # fmt: skip
    runs = {"checkpointed": lambda W, xs, ds, md: scheduled(W, xs, ds, md, "checkpointed")}
    runs.update((label, run) for label, run in contenders(batch, max_depth).items()
                if not label.startswith("S="))  # fmt: skip
    out = {}
    for label, run in runs.items():
        times = []
        for _ in range(repeats):
            lowered = jax.jit(jax.value_and_grad(loss_of(run, max_depth))).lower(*args)
            t0 = time.perf_counter()
            lowered.compile()
            times.append(time.perf_counter() - t0)
        out[label] = statistics.median(times)
    return out


def sweep(dist: str, batch: int, width: int, max_depth: int, repeats: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    W = jax.random.normal(k[0], (width, width)) / width**0.5
    xs = jax.random.normal(k[1], (batch, width))
    ds = depths_of(dist, k[2], batch, max_depth)
    calls = {}
    for label, run in contenders(batch, max_depth).items():
        fwd = jax.jit(lambda W, xs, ds, run=run: run(W, xs, ds, max_depth))
        vag = jax.jit(jax.value_and_grad(loss_of(run, max_depth)))
        calls[("forward", label)] = (fwd, (W, xs, ds))
        calls[("value_and_grad", label)] = (vag, (W, xs, ds))
    times = interleaved_ms(calls, repeats)
    stats = dd.repeat_batched(layer_of(W), xs, ds, max_depth=max_depth, return_stats=True)[1]
    return dict(times=times, useful=int(jnp.sum(ds)), longest=int(jnp.max(ds)),
                iterations=int(stats["iterations"]),
                executed=int(stats["executed_sample_steps"]))  # fmt: skip


def layer_of(W):
    return lambda x: x + jnp.tanh(x @ W)


def ladder_ratios(batch: int, r: dict) -> dict:
    """Each ladder's time over the best fixed count's, forward and value_and_grad."""
    times, fixed = r["times"], [f"S={s}" for s in sweep_counts(batch)]
    out = {}
    for label in ["default", *ladders(batch)]:
        for mode in ("forward", "value_and_grad"):
            best = min(times[(mode, f)] for f in fixed)
            out[(label, mode)] = times[(mode, label)] / best
    return out


def ladder_table(batch: int, ratios: list[dict], compiled: dict) -> None:
    print("\n#### Fewer slot counts: compile time against the worst time over the best fixed "
          "count (all distributions above)\n")  # fmt: skip
    print("| slot counts | value_and_grad compile s | vs checkpointed | worst forward / best "
          "| worst value_and_grad / best |")  # fmt: skip
    print("|---|---|---|---|---|")
    print(f"| checkpointed (unscheduled) | {compiled['checkpointed']:.2f} | 1.00x | | |")
    for label, counts in [("default", None), *ladders(batch).items()]:
        worst = [max(r[(label, m)] for r in ratios) for m in ("forward", "value_and_grad")]
        name = f"{label} {counts}" if counts else "default (time rule, up to 5 counts)"
        ratio = compiled[label] / compiled["checkpointed"]
        print(f"| {name} | {compiled[label]:.2f} | {ratio:.2f}x | {worst[0]:.2f} | "
              f"{worst[1]:.2f} |")  # fmt: skip


def report(dist: str, batch: int, r: dict) -> list[float]:
    times = r["times"]
    ratio = r["executed"] / max(r["useful"], 1)
    print(f"\n#### {dist}: sum {r['useful']}, max {r['longest']}; the default ran "
          f"{r['iterations']} iterations, executed / useful {ratio:.3f}\n")  # fmt: skip
    labels = ["default"] + [f"S={s}" for s in sweep_counts(batch)]
    print("| pass | " + " | ".join(labels) + " | best fixed | default / best |")
    print("|---" * (len(labels) + 3) + "|")
    ratios = []
    for mode in ("forward", "value_and_grad"):
        row = [times[(mode, lab)] for lab in labels]
        best_i = min(range(1, len(labels)), key=lambda i: row[i])
        ratio = row[0] / row[best_i]
        ratios.append(ratio)
        cells = " | ".join(f"{t:.2f}" for t in row)
        print(f"| {mode} | {cells} | {labels[best_i]} | {ratio:.2f} |")
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dists", default="uniform,long-tail,few-deep,geometric,bimodal")
    p.add_argument("--quick", action="store_true", help="B=32, D=8, max_depth 16, 3 rounds")
    a = p.parse_args()
    if a.quick:
        a.batch, a.width, a.max_depth, a.repeats = 32, 8, 16, 3
    where = f"jax {jax.__version__}, {jax.devices()[0].platform} ({platform.processor() or '?'})"
    print(f"{where}, B={a.batch}, D={a.width}, max_depth {a.max_depth}, "
          f"best of {a.repeats} rounds, ms")  # fmt: skip
    worst, ratios = [], []
    for dist in a.dists.split(","):
        r = sweep(dist, a.batch, a.width, a.max_depth, a.repeats)
        worst += report(dist, a.batch, r)
        ratios.append(ladder_ratios(a.batch, r))
    print(f"\nworst default / best fixed: {max(worst):.2f}")
    ladder_table(a.batch, ratios, compile_seconds(a.batch, a.width, a.max_depth))


if __name__ == "__main__":
    main()
