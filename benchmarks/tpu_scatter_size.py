"""What a per-row write into a loop's buffer costs on an accelerator, against the buffer's size.

The wrap-around schedule's forward pass writes each slot's carry into the store with one
scatter per iteration (``dyndepth._store.put_cells``); on a TPU v5e that scatter is the long
tail's largest op (``benchmarks/tpu_profile.py``), about five times the scatter of the same rows
into the carries' own rows. This script times, in a ``lax.fori_loop`` of ``T`` iterations,
a write of ``S`` rows of ``D`` float32 (4 MiB at the defaults) per iteration:

- a scatter into a ``(K, B, D)`` buffer at a 2-D index (a slot and a row per update, the
  store's form), for ``K`` from 1 (the carries' own size, 16 MiB) up;
- at ``K = 64`` (1 GiB): the same rows at a 1-D index into the buffer flattened to
  ``(K x B, D)``, sorted, or all in one slot (one 16 MiB slab);
- a ``dynamic_update_slice`` of the ``S`` rows as one contiguous block (what a store laid out
  by schedule, one block per iteration, would write);
- at ``K = 64``, scatters of ``S / 4`` and ``4 S`` rows an iteration (is the cost per scatter or
  per row: would gathering the writes of several iterations into one scatter help?).

Each loop's time is the best of five calls, over ``T``. Every write also multiplies its rows
by the iteration (one pass over them).

How to run (on the accelerator machine, from the repository root)::

    python benchmarks/tpu_scatter_size.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

B, D, S, T = 4096, 1024, 1024, 183
DROP = dict(mode="drop", wrap_negative_indices=False)


def best_ms(fn) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def looped(shape: tuple, write, n: int | None = None) -> callable:
    """The loop writing ``n`` rows (default ``S``) an iteration into a buffer of ``shape``."""
    n = S if n is None else n
    # (distinct cells: no two writes of an iteration alike; past B rows, the next slots too)
    cells = jax.random.permutation(jax.random.PRNGKey(0), max(n, B))[:n]
    rows, slot = cells % B, cells // B
    update = jax.random.normal(jax.random.PRNGKey(1), (n, D))
    K = shape[0] if len(shape) == 3 else shape[0] // B

    def run():
        def body(t, buf):
            return write(buf, (rows + 7 * t) % B, (slot + rows + t) % K, update * t, t)

        # (a corner of the buffer, so that every write is needed)
        return lax.fori_loop(0, T, body, jnp.zeros(shape)).reshape(-1)[:4]

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.device_kind}; {T} iterations of {S} rows of {D} float32\n")
    out = []
    for K in (1, 2, 4, 8, 16, 64):
        f = looped((K, B, D), lambda buf, b, i, u, t: buf.at[i, b].set(u, **DROP))
        out.append((f"scatter, 2-D index, K={K} ({K * B * D * 4 >> 20} MiB)", best_ms(f)))
    K = 64
    flat = (K * B, D)
    forms = {
        "scatter, 1-D index, flattened": lambda buf, b, i, u, t: buf.at[i * B + b].set(u, **DROP),
        "scatter, 1-D index, sorted": lambda buf, b, i, u, t: buf.at[jnp.sort(i * B + b)].set(
            u, **DROP
        ),
        "scatter, one slot for every row": lambda buf, b, i, u, t: buf.at[i[0] * B + b].set(
            u, **DROP
        ),
        "dynamic_update_slice, one block": lambda buf, b, i, u, t: lax.dynamic_update_slice_in_dim(
            buf, u, (t % (K * B // S)) * S, 0
        ),
    }
    for name, write in forms.items():
        out.append((f"{name} ({K * B * D * 4 >> 20} MiB)", best_ms(looped(flat, write))))
    scatter = lambda buf, b, i, u, t: buf.at[i, b].set(u, **DROP)  # noqa: E731
    for n in (S // 4, 4 * S):
        ms = best_ms(looped((K, B, D), scatter, n))
        out.append((f"scatter, 2-D index, {n} rows an iteration ({K * B * D * 4 >> 20} MiB)", ms))
    print("| write per iteration | ms | µs / iteration |\n|---|---|---|")
    for name, ms in out:
        print(f"| {name} | {ms:.2f} | {1e3 * ms / T:.1f} |")


if __name__ == "__main__":
    main()
