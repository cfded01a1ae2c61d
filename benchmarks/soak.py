"""Soak test: many jitted calls with fresh random depths, no retrace, no memory growth.

What it measures: ``--calls`` (default 10,000) calls of each of two jitted functions,

- ``jax.value_and_grad`` of a loss over ``dyndepth.repeat_batched`` (the per-sample scheduler),
- ``jax.value_and_grad`` of a loss over ``jax.vmap(dyndepth.repeat)`` with ``strategy="auto"``,

on a small batch (``--batch`` samples of width ``--width``, step ``x + tanh(x @ W)`` with a
per-step dropout mask from the step key), with per-sample depths drawn fresh in
``[0, --max-depth]`` before every call. It asserts that each function was traced exactly once
(a Python counter incremented inside the traced function), that the two agree in value and
gradient at every sample point, and that the resident set size (``VmRSS`` from
``/proc/self/status``) does not grow by more than ``--max-growth-mib`` (default 50 MiB) between
the end of the warm-up (10% of the calls) and the end. RSS is sampled after 1%, 10%, 50% and
100% of the calls. Exits with status 1 if a check fails, after printing the summary.

How to run (from the repository root)::

    .venv/bin/python benchmarks/soak.py                 # 10,000 calls
    .venv/bin/python benchmarks/soak.py --calls 2000
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dyndepth as dd


def rss_mib() -> float:
    """Current resident set size (VmRSS), MiB; falls back to the peak from getrusage."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mib()


def peak_rss_mib() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 1024


def layer(W):
    def f(x, k):
        keep = jax.random.bernoulli(k, 0.8, x.shape)
        return x + jnp.where(keep, jnp.tanh(x @ W) / 0.8, 0.0)

    return f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000, help="calls of each function")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--max-depth", type=int, default=32)
    p.add_argument("--max-growth-mib", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.calls < 10:
        p.error("--calls must be at least 10")

    rng = np.random.default_rng(a.seed)
    X = jnp.asarray(rng.normal(size=(a.batch, a.width)) * 0.5, jnp.float32)
    W = jnp.asarray(rng.normal(size=(a.width, a.width)) / np.sqrt(a.width), jnp.float32)
    keys = jax.random.split(jax.random.key(a.seed), a.batch)
    M = a.max_depth
    traces = {"repeat_batched": 0, "vmap(repeat) auto": 0}

    def loss_batched(X, W, depths, keys):
        traces["repeat_batched"] += 1
        out = dd.repeat_batched(layer(W), X, depths, max_depth=M, keys=keys)
        return jnp.sum(out**2)

    def loss_vmap(X, W, depths, keys):
        traces["vmap(repeat) auto"] += 1
        out = jax.vmap(
            lambda x, d, k: dd.repeat(layer(W), x, d, max_depth=M, key=k, strategy="auto")
        )(X, depths, keys)
        return jnp.sum(out**2)

    fns = {
        "repeat_batched": jax.jit(jax.value_and_grad(loss_batched, argnums=(0, 1))),
        "vmap(repeat) auto": jax.jit(jax.value_and_grad(loss_vmap, argnums=(0, 1))),
    }

    dev = jax.devices()[0]
    print(
        f"device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
        f"dyndepth {dd.__version__}, python {platform.python_version()}"
    )
    print(
        f"calls: {a.calls} per function, batch {a.batch}, width {a.width}, max_depth {M}, "
        f"depths uniform in [0, {M}] drawn fresh per call"
    )

    marks = {max(1, a.calls // 100): "1%", a.calls // 10: "10%", a.calls // 2: "50%"}
    marks[a.calls] = "100%"
    samples: list[tuple[str, int, float, float]] = []
    failures: list[str] = []
    max_diff = 0.0
    rss_start = rss_mib()
    t_start = time.perf_counter()
    t_warm = None
    for call in range(1, a.calls + 1):
        depths = jnp.asarray(rng.integers(0, M + 1, size=a.batch), jnp.int32)
        outs = {name: fn(X, W, depths, keys) for name, fn in fns.items()}
        if call in marks:
            jax.block_until_ready(outs)
            (v1, g1), (v2, g2) = outs["repeat_batched"], outs["vmap(repeat) auto"]
            leaves1 = jax.tree_util.tree_leaves((v1, g1))
            for x, y in zip(leaves1, jax.tree_util.tree_leaves((v2, g2)), strict=True):
                x, y = np.asarray(x), np.asarray(y)
                scale = max(1.0, float(np.max(np.abs(y))))
                max_diff = max(max_diff, float(np.max(np.abs(x - y))) / scale)
            samples.append((marks[call], call, rss_mib(), time.perf_counter() - t_start))
            if marks[call] == "10%":
                t_warm = time.perf_counter()
    jax.block_until_ready(outs)
    t_end = time.perf_counter()

    print()
    print("| point | calls | RSS MiB | elapsed s |")
    print("|---|---|---|---|")
    print(f"| start (before compiling) | 0 | {rss_start:.1f} | 0.0 |")
    for label, call, rss, el in samples:
        print(f"| {label} | {call} | {rss:.1f} | {el:.1f} |")

    rss_at = {label: rss for label, _, rss, _ in samples}
    growth = rss_at["100%"] - rss_at["10%"]
    steady_calls = a.calls - a.calls // 10
    per_call_ms = (t_end - t_warm) / max(steady_calls, 1) * 1e3 if t_warm else float("nan")
    print()
    print(f"traces: {traces}")
    print(
        f"RSS growth after warm-up (10% -> 100%): {growth:+.1f} MiB "
        f"(limit {a.max_growth_mib:.0f} MiB); peak RSS {peak_rss_mib():.1f} MiB"
    )
    print(
        f"steady state: {per_call_ms:.3f} ms per iteration (both functions, incl. drawing depths);"
        f" total {t_end - t_start:.1f} s"
    )
    print(f"max relative difference repeat_batched vs vmap(repeat) auto: {max_diff:.2e}")

    if any(n != 1 for n in traces.values()):
        failures.append(f"retraced: {traces}")
    if growth > a.max_growth_mib:
        failures.append(f"RSS grew by {growth:.1f} MiB > {a.max_growth_mib} MiB")
    if max_diff > 1e-4:
        failures.append(f"repeat_batched and vmap(repeat) disagree: {max_diff:.2e}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("OK: one trace per function, no RSS growth beyond the limit, results agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
