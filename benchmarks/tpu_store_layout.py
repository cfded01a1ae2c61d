"""Temp memory of value_and_grad on the TPU compiler, by how the lockstep backward pass reads
the stored carries (deviceless: libtpu, no TPU needed).

A lockstep backward pass can end the samples' sweeps together (every row undoes one shared step
per iteration: the stored carries are read as slices) or start them together (each row at its
own step: per-row reads). Where the program also holds wrap-around slot counts (the default's
ladder at B=4096), a batch-major store, ``(B, K, ...)``, made the TPU compiler lay the store out
one way for the slices and another for the wrap-around schedule's scatters, and copy it between
them (temp memory 1,282 MiB ending together, 770 starting together, for a 256 MiB store, on
2026-12-06); the slot-major store, ``(K, B, ...)`` (:mod:`dyndepth._store`), has one layout for
both. This script compiles ``jax.value_and_grad`` of ``repeat_batched`` (step ``x -> x + 0.1 *
tanh(x @ W1) @ W2``, ``benchmarks/gpu.py``'s) for one device of a TPU topology with each
alignment forced, and prints XLA's temp memory and the size of the stored carries.

How to run (from the repository root; the libtpu venv as in benchmarks/README.md)::

    PYTHONPATH=src /path/to/tpuvenv/bin/python benchmarks/tpu_store_layout.py 2>/dev/null
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from tpu_compile import tpu_sharding

import dyndepth as dd
from dyndepth import _dispatch

SIZES = [  # (batch, width, max_depth): stores of 256 MiB (the default budget holds every carry)
    (4096, 256, 64),  # and 4 GiB (an 8 GiB budget)
    (4096, 1024, 256),
]


def loss(p, xs, ds, max_depth):
    def step(x):
        return x + 0.1 * jnp.tanh(x @ p["W1"]) @ p["W2"]

    return jnp.sum(dd.repeat_batched(step, xs, ds, max_depth=max_depth) ** 2)


def temp_mib(batch, width, max_depth, at_end, topology):
    sharding = tpu_sharding(topology)
    spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = ({"W1": spec((width, width)), "W2": spec((width, width))}, spec((batch, width)),
            spec((batch,), jnp.int32))  # fmt: skip
    forced = _dispatch._lockstep_at_end
    _dispatch._lockstep_at_end = lambda loop: at_end and not loop.thinning
    try:
        fn = jax.jit(jax.value_and_grad(lambda p, xs, ds: loss(p, xs, ds, max_depth)))
        with dd.stored_carry_budget_scope(8 * 2**30):
            compiled = fn.lower(*args).compile()
    finally:
        _dispatch._lockstep_at_end = forced
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:2x2", help="TPU topology (default v5e:2x2)")
    a = p.parse_args()
    print(f"jax {jax.__version__}; compiled for TPU {a.topology}, one device, deviceless\n")
    print(
        "| B | D | max_depth | stored carries MiB | temp MiB, sweeps end together "
        "| temp MiB, sweeps start together |"
    )
    print("|---|---|---|---|---|---|")
    for batch, width, max_depth in SIZES:
        store = batch * max_depth * width * 4 / 2**20
        end, start = (temp_mib(batch, width, max_depth, e, a.topology) for e in (True, False))
        print(f"| {batch} | {width} | {max_depth} | {store:.0f} | {end:.0f} | {start:.0f} |")


if __name__ == "__main__":
    main()
