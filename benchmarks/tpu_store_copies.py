"""What the TPU compiler does with a large store that a loop barely uses (deviceless: libtpu).

``benchmarks/max_depth.py`` on a TPU v5e: value_and_grad of ``jax.vmap(dyndepth.repeat)`` over
B=4096 samples of 16 floats, every depth 3, took 1.0 ms at ``max_depth`` 100 and 202 ms at
10,000, where the loop stores 8038 carries per sample (2.1 GB: the chip's budget, with no cap
for a small step on a TPU). This script compiles that program for one device of a TPU topology,
the store's count given (``checkpoints=8038``, what a TPU host chooses; a CPU host would cap it
at 64), and lists every instruction of the optimized program that makes a store-sized array
(copies between layouts, conversions), with its layout and the compiler's estimate of its
cycles, beside the program's temporary memory.

How to run (from the repository root; the libtpu venv as in benchmarks/README.md)::

    PYTHONPATH=src /path/to/tpuvenv/bin/python benchmarks/tpu_store_copies.py 2>/dev/null
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from tpu_compile import tpu_sharding

import dyndepth as dd

BATCH, WIDTH, DEPTH = 4096, 16, 3
# one store-sized instruction of the optimized program: name, dtype, layout, opcode, cycles
_MADE = re.compile(r"^\s*%(\S+) = (\w+)\[{dims}\]\{{([^}}]*)\}} (\w[\w-]*)\(")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def compiled(max_depth: int, stored: int, topology: str):
    sharding = tpu_sharding(topology)
    spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731

    def loss(W, xs, depths):
        step = lambda c: c + jnp.tanh(c @ W)  # noqa: E731
        one = lambda x, d: dd.repeat(step, x, d, max_depth=max_depth, checkpoints=stored)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths) ** 2)

    args = spec((WIDTH, WIDTH)), spec((BATCH, WIDTH)), spec((BATCH,), jnp.int32)
    return jax.jit(jax.value_and_grad(loss)).lower(*args).compile()


def store_instructions(text: str, stored: int) -> list[tuple[str, str, str, str, int]]:
    """``(name, dtype, layout, opcode, estimated cycles)`` of the instructions that make an
    array of the store's shape, parameters and tuple elements left out."""
    made = re.compile(_MADE.pattern.format(dims=f"{stored},{BATCH},{WIDTH}"))
    out = []
    for line in text.splitlines():
        m = made.match(line)
        if m and m.group(4) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            cycles = _CYCLES.search(line)
            out.append((*m.groups(), int(cycles.group(1)) if cycles else 0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:2x2", help="TPU topology (default v5e:2x2)")
    p.add_argument("--max-depth", type=int, default=10_000)
    p.add_argument("--stored", type=int, default=8038, help="carries stored per sample")
    a = p.parse_args()
    program = compiled(a.max_depth, a.stored, a.topology)
    temp = program.memory_analysis().temp_size_in_bytes / 2**20
    store = a.stored * BATCH * WIDTH * 4 / 2**20
    print(f"jax {jax.__version__}; compiled for TPU {a.topology}, one device, deviceless")
    print(f"B={BATCH}, {WIDTH} floats, depth {DEPTH}, max_depth {a.max_depth}: a store of "
          f"{store:.0f} MiB, temp {temp:.0f} MiB\n")  # fmt: skip
    print("| instruction | dtype | layout | opcode | estimated cycles |")
    print("|---|---|---|---|---|")
    for name, dtype, layout, opcode, cycles in store_instructions(program.as_text(), a.stored):
        print(f"| {name} | {dtype} | `{{{layout}}}` | {opcode} | {cycles:,} |")


if __name__ == "__main__":
    main()
