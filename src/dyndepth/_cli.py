"""The ``dyndepth`` command line: ``dyndepth demo`` and ``dyndepth bench``.

The library never imports this module.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import dyndepth
    from dyndepth import _bench

    print("== the seed's program with dyndepth.repeat (B=32, D=64, depths in [1, 100]) ==")
    max_iters, batch, dim = 100, 32, 64
    key = jax.random.PRNGKey(42)
    kx, kd, kb = jax.random.split(key, 3)
    xs = jax.random.normal(kx, (batch, dim))
    ds = jax.random.randint(kd, (batch,), 1, max_iters + 1)
    ks = jax.random.split(kb, batch)

    def layer(x, k):
        h = jax.nn.relu(x @ jnp.ones((dim, dim)) / dim)
        keep = jax.random.bernoulli(k, 0.5, h.shape)
        return x + jnp.where(keep, h * 2.0, 0.0)

    out = jax.jit(
        jax.vmap(lambda x, d, k: dyndepth.repeat(layer, x, d, max_depth=max_iters, key=k))
    )(xs, ds, ks)
    print(out.shape)
    print()
    print("== side by side on the seed's workload: the seed's scan+cond vs dyndepth ==")
    _bench.run(batch=32, dim=64, max_depth=100, repeats=args.repeats, kind="dropout")
    return 0


def _bench_cmd(args: argparse.Namespace) -> int:
    from dyndepth import _bench

    argv = ["--repeats", str(args.repeats), "--layer", args.layer]
    if args.quick:
        argv += ["--batch", "8", "--dim", "8", "--max-depth", "12"]
    _bench.main(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dyndepth", description="dyndepth demo and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the seed's program and a side-by-side on its workload")
    demo.add_argument("--repeats", type=int, default=5)
    demo.set_defaults(run=_demo)
    bench = sub.add_parser("bench", help="the seed's method against dyndepth, side by side")
    bench.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    bench.add_argument("--repeats", type=int, default=7)
    bench.add_argument("--layer", choices=["tanh", "dropout"], default="tanh")
    bench.set_defaults(run=_bench_cmd)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
