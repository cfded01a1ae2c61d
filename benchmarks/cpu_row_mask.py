"""Why a masked backward sweep costs more on this CPU than ``jax.checkpoint`` + ``lax.scan``'s:
XLA's CPU code for a select whose per-row mask is broadcast inside a loop body.

Three plain-JAX reverse sweeps over the same stored carries (``(T, B, W)``, step ``c + 0.1 *
tanh(c)``, T=200), differing only in where the mask that freezes finished rows comes from:

- ``stored mask``: a ``(T, B, W)`` bool array read at the step, what ``jax.checkpoint`` +
  masked ``lax.scan``'s backward pass reads (its forward pass stores the broadcast mask);
- ``row mask``: ``j < lengths`` per row, broadcast to ``(B, W)`` in the loop body, what a
  dyndepth lockstep backward pass computes for rows of more than 8 elements
  (``dyndepth._leaves.rows_mask``);
- ``hoisted lengths``: the lengths broadcast to ``(B, W)`` once, before the loop, compared with
  the step in the body, what it computes for rows of 2 to 8 elements
  (``dyndepth._leaves.RowsBelow``).

On XLA's CPU backend (JAX 0.10.2) the ``row mask`` body is emitted as scalar code (no vector
instructions in its fusion: ``XLA_FLAGS=--xla_dump_to=...``), the other two are vectorized.
Prints the time of each sweep (best of ``--rounds``) and its ratio to the stored mask's.

How to run (from the repository root)::

    .venv/bin/python benchmarks/cpu_row_mask.py [--batch 512] [--width 8]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from measure import best_seconds, machine_line

STEPS = 200


def step(c):
    return c + 0.1 * jnp.tanh(c)


def sweep(kind: str):
    def run(buf, mask, lengths, ct):
        B, W = ct.shape
        hoisted = jnp.broadcast_to(lengths[:, None], (B, W))

        def body(t, ct):
            j = STEPS - 1 - t
            c = lax.dynamic_index_in_dim(buf, j, 0, keepdims=False)
            if kind == "stored mask":
                live = lax.dynamic_index_in_dim(mask, j, 0, keepdims=False)
            elif kind == "row mask":
                live = jnp.broadcast_to((j < lengths)[:, None], (B, W))
            else:
                live = j < hoisted
            new = jax.vjp(step, c)[1](jnp.where(live, ct, 0))[0]
            return jnp.where(live, new, ct)

        return lax.fori_loop(0, STEPS, body, ct)

    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.batch < 1 or args.width < 1 or args.rounds < 1:
        parser.error("--batch, --width and --rounds must be positive")
    B, W = args.batch, args.width
    buf = jax.random.normal(jax.random.key(0), (STEPS, B, W))
    lengths = jax.random.randint(jax.random.key(1), (B,), 1, STEPS + 1)
    mask = jnp.arange(STEPS)[:, None, None] < lengths[None, :, None]
    mask = jnp.broadcast_to(mask, (STEPS, B, W))
    ct = jnp.ones((B, W))
    kinds = ["stored mask", "row mask", "hoisted lengths"]
    fns = {k: sweep(k) for k in kinds}
    outs = {k: fns[k](buf, mask, lengths, ct) for k in kinds}
    for k in kinds[1:]:  # the three sweeps compute the same cotangent
        assert jnp.allclose(outs[k], outs[kinds[0]]), k
    times = best_seconds({k: (fns[k], (buf, mask, lengths, ct)) for k in kinds}, args.rounds)
    print(machine_line())
    print(f"\nB={B}, width {W}, {STEPS} steps, best of {args.rounds} rounds\n")
    print("| mask | ms | vs stored mask |\n|---|---|---|")
    for k in kinds:
        print(f"| {k} | {times[k] * 1e3:.3f} | {times[k] / times[kinds[0]]:.2f}x |")


if __name__ == "__main__":
    main()
