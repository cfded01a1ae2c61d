"""Where an unused ``max_depth`` spends its time on an accelerator, op by op.

``benchmarks/max_depth.py``'s B=4096 program (value_and_grad of ``jax.vmap(dyndepth.repeat)``,
step ``c -> c + tanh(c @ W)`` on 16 floats, every depth 3) at ``--max-depth`` (10,000 by
default: on a TPU v5e the loop then stores 8038 carries per sample, 2.1 GB, and took 202 ms
against 1.0 ms at 100), under ``jax.profiler``: its wall time, then per call the device time of
the largest executed XLA ops (``benchmarks/tpu_profile.py``'s reading of the trace), with the
name stack they were emitted for where the compiler kept one (its own loops have none).

How to run (on the accelerator host, from the repository root, dyndepth importable)::

    python benchmarks/tpu_max_depth_profile.py
    python benchmarks/tpu_max_depth_profile.py --max-depth 100
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from op_profile import op_names
from tpu_profile import profile

import dyndepth as dd

BATCH, WIDTH, DEPTH = 4096, 16, 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-depth", type=int, default=10_000)
    p.add_argument("--calls", type=int, default=2, help="profiled calls")
    p.add_argument("--top", type=int, default=14, help="ops printed")
    a = p.parse_args()
    if a.max_depth < DEPTH or a.calls < 1 or a.top < 1:
        p.error(f"--max-depth at least {DEPTH}, --calls and --top positive")
    W = jax.random.normal(jax.random.PRNGKey(0), (WIDTH, WIDTH)) * 0.1
    xs = jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTH))
    depths = jnp.full((BATCH,), DEPTH)

    def loss(W, xs):
        step = lambda c: c + jnp.tanh(c @ W)  # noqa: E731
        one = lambda x, d: dd.repeat(step, x, d, max_depth=a.max_depth)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths) ** 2)

    fn = jax.jit(jax.value_and_grad(loss)).lower(W, xs).compile()
    names = op_names(fn)
    for _ in range(3):
        jax.block_until_ready(fn(W, xs))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(W, xs))
    wall = 1e3 * (time.perf_counter() - t0)
    ms, runs = profile(fn, (W, xs), a.calls)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B={BATCH}, {WIDTH} floats, "
          f"depth {DEPTH}, max_depth {a.max_depth}: {wall:.1f} ms a call, temp "
          f"{fn.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB\n")  # fmt: skip
    print("| op | ms | runs | emitted for |\n|---|---|---|---|")
    for n, v in sorted(ms.items(), key=lambda kv: -kv[1])[: a.top]:
        where = names.get(n, "(the compiler's own)")[-80:]
        print(f"| {n} | {v:.2f} | {runs[n]:.0f} | {where} |")


if __name__ == "__main__":
    main()
