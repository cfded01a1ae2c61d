"""Second-order costs: forward over reverse (a Hessian-vector product, ``jax.jvp`` of
``jax.grad``, which ``jax.hessian`` and ``jax.jacfwd(jax.grad(f))`` are made of) and reverse
over reverse (the gradient of a gradient penalty, plain and with the inner gradient jitted),
through ``dyndepth.repeat`` at a depth far below ``max_depth``, against the ``"masked"`` loop
(``max_depth`` steps: the scan + cond baseline).

    python benchmarks/second_order.py [--depth 8] [--max-depth 64] [--width 256] [--batch 16]

Prints one line per (form, strategy, batched or not): the best of ``--repeats`` timed calls
(after a warm-up call) and the compile time. Every strategy's values are checked against the
``"masked"`` loop's before timing.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import dyndepth as dd


def forms(loss):
    def penalty(W, *a):
        return jnp.sum(jax.grad(loss)(W, *a) ** 2)

    def penalty_jit(W, *a):
        return jnp.sum(jax.jit(jax.grad(loss))(W, *a) ** 2)

    return {
        "hvp (jvp of grad)": lambda W, V, *a: jax.jvp(lambda w: jax.grad(loss)(w, *a), (W,), (V,))[
            1
        ],  # fmt: skip
        "grad(grad)": lambda W, V, *a: jax.grad(penalty)(W, *a),
        "grad(jit(grad))": lambda W, V, *a: jax.grad(penalty_jit)(W, *a),
    }


def losses(strategy, max_depth, batched):
    def one(W, x, d):
        return dd.repeat(lambda c: jnp.tanh(c @ W), x, d, max_depth=max_depth, strategy=strategy)

    if batched:
        return lambda W, xs, ds: jnp.sum(jax.vmap(one, (None, 0, 0))(W, xs, ds) ** 2)
    return lambda W, x, d: jnp.sum(one(W, x, d) ** 2)


def timed(fn, args, repeats):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return compiled(*args), best, compile_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--max-depth", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    k = jax.random.split(jax.random.key(0), 4)
    D, B = args.width, args.batch
    W = jax.random.normal(k[0], (D, D)) / jnp.sqrt(D)
    V = jax.random.normal(k[1], (D, D))
    cases = {
        False: (jax.random.normal(k[2], (D,)), jnp.int32(args.depth)),
        True: (
            jax.random.normal(k[3], (B, D)),
            jnp.arange(B, dtype=jnp.int32) % (args.depth + 1),
        ),  # fmt: skip
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, depth {args.depth}, "
          f"max_depth {args.max_depth}, width {D}, batch {B}")  # fmt: skip
    for batched, data in cases.items():
        reference = forms(losses("masked", args.max_depth, batched))
        for strategy in ["masked", "auto", "checkpointed"]:
            for name, fn in forms(losses(strategy, args.max_depth, batched)).items():
                try:
                    out, best, compile_s = timed(fn, (W, V, *data), args.repeats)
                except TypeError as e:  # (reverse over a jitted derivative before issue 40)
                    print(f"{name:18s} {strategy:12s} batched={batched!s:5s}  raises: {e!s:.60}")
                    continue
                want = jax.jit(reference[name])(W, V, *data)
                err = float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want)))
                print(f"{name:18s} {strategy:12s} batched={batched!s:5s} {best * 1e3:9.2f} ms"
                      f"  compile {compile_s:6.2f} s  rel err {err:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
