"""What a loop iteration pays to write or read one row per sample in a buffer, on this backend.

The loops keep per-sample buffers (stored carries, recomputed segments) and touch one position
per row at each iteration. How that is written decides what it costs on a TPU. Timed here, per
iteration of a ``lax.fori_loop`` of 200 (best of 3 runs), for buffers of ``K`` positions of
``B`` rows of width ``D`` (float32), where two rows in three are written:

- batch-major ``(B, K, D)``: a scatter ``buf.at[rows, k].set(v, mode="drop")`` (masked rows
  pointing past the end), the same with sorted/unique flags, one shared position as a masked
  dynamic update of a column, and a ``vmap`` of dynamic updates (each row's old value kept by
  a select: the form the two-level backward sweep used until 2026-12-05);
- step-major ``(K, B, D)``: one shared position as a masked dynamic update of a slice (and
  unmasked), a scatter at per-row positions;
- reads: per-row positions (gather) in either layout, one shared position (a slice).

How to run (from the repository root)::

    python benchmarks/tpu_writes.py            # about a minute on a TPU
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax

SIZES = ((4096, 16, 1024), (256, 16, 256), (64, 200, 8))  # (B, K, D)


def per_iteration_us(body, init, n=200):
    run = jax.jit(lambda s: lax.fori_loop(0, n, body, s))
    jax.block_until_ready(run(init))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(init))
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def contenders(B, K):
    rows = jnp.arange(B)
    keep = rows % 3 > 0
    own = rows % K  # each row's own position, moving with the iteration
    drop = jnp.where(keep, rows, B)
    nxt = lambda v: v * 1.0001  # noqa: E731

    def vmapped_updates(buf, k, v):
        def one(b, i, x, m):
            old = lax.dynamic_index_in_dim(b, i, 0, keepdims=False)
            return lax.dynamic_update_index_in_dim(b, jnp.where(m, x, old), i, 0)

        return jax.vmap(one)(buf, k, v, keep)

    def column(buf, k, v):
        old = lax.dynamic_index_in_dim(buf, k, 1, keepdims=False)
        return lax.dynamic_update_index_in_dim(buf, jnp.where(keep[:, None], v, old), k, 1)

    def step_slice(buf, k, v):
        return lax.dynamic_update_index_in_dim(buf, jnp.where(keep[:, None], v, buf[k]), k, 0)

    writes = {
        "batch-major: scatter, drop mode": (
            lambda b, i, v: b.at[drop, (own + i) % K].set(v, mode="drop"), False),
        "batch-major: scatter, sorted + unique": (
            lambda b, i, v: b.at[drop, (own + i) % K].set(
                v, mode="drop", indices_are_sorted=True, unique_indices=True), False),
        "batch-major: vmap of dynamic updates": (
            lambda b, i, v: vmapped_updates(b, (own + i) % K, v), False),
        "batch-major: one position, column update": (lambda b, i, v: column(b, i % K, v), False),
        "step-major: one position, slice update": (
            lambda b, i, v: step_slice(b, i % K, v), True),
        "step-major: one position, unmasked": (
            lambda b, i, v: lax.dynamic_update_index_in_dim(b, v, i % K, 0), True),
        "step-major: scatter, drop mode": (
            lambda b, i, v: b.at[jnp.where(keep, (own + i) % K, K), rows].set(v, mode="drop"),
            True),
    }  # fmt: skip
    reads = {
        "batch-major: per-row gather": (
            lambda b, i: b.at[rows, (own + i) % K].get(mode="promise_in_bounds"), False),
        "step-major: per-row gather": (
            lambda b, i: b.at[(own + i) % K, rows].get(mode="promise_in_bounds"), True),
        "step-major: one position, slice": (lambda b, i: b[i % K], True),
    }  # fmt: skip
    out = {n: (lambda i, s, w=w: (w(s[0], i, s[1]), nxt(s[1])), t) for n, (w, t) in writes.items()}
    out |= {n: (lambda i, s, r=r: (s[0], s[1] + r(s[0], i)), t) for n, (r, t) in reads.items()}
    out["nothing (the loop and one multiply)"] = (lambda i, s: (s[0], nxt(s[1])), True)
    return out


def main() -> None:
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}); us per iteration\n")
    print("| form | " + " | ".join(f"B={B}, K={K}, D={D}" for B, K, D in SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    cells: dict[str, list[str]] = {}
    for B, K, D in SIZES:
        v = jnp.ones((B, D))
        for name, (body, step_major) in contenders(B, K).items():
            buf = jnp.zeros((K, B, D) if step_major else (B, K, D))
            cells.setdefault(name, []).append(f"{per_iteration_us(body, (buf, v)):.1f}")
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
