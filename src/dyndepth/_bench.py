"""The seed's workload: the seed's scan + cond method against dyndepth, side by side, one run.

    dyndepth bench [--batch 256] [--dim 64] [--max-depth 100] [--repeats 7] [--layer tanh]
    python benchmarks/bench_seed.py   # the same

Workload: a residual layer closing over ``W`` (D x D), a batch of per-sample depths uniform in
[1, max_depth], per-sample keys, ``jax.vmap`` + ``jax.jit``. Reported: forward time,
value_and_grad time (median of repeats, after a warm-up, blocking on the result), compile time
apart, and the XLA temp memory of the compiled function; correctness relative to the seed's
method. A second table runs the batch with one shared depth of 10 and of ``max_depth`` to show
that the cost follows the depth.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import dyndepth

__all__ = ["main", "run", "seed_method"]


def seed_method(layer, x, depth, key, max_iters):
    """The seed's program: scan over max_iters with lax.cond(step < depth, layer, identity).

    Step ``i`` gets ``fold_in(key, i)``, dyndepth's schedule, so that results compare exactly.
    """

    def scan_step(carry, i):
        current_x, step = carry
        new_x = lax.cond(
            step < depth,
            lambda: layer(current_x, jax.random.fold_in(key, i)),
            lambda: current_x,
        )
        return (new_x, step + 1), None

    (out, _), _ = lax.scan(scan_step, (x, 0), jnp.arange(max_iters))
    return out


def vmapped_while(layer, x, depth, key):
    """A plain lax.while_loop (forward only: not reverse-differentiable)."""

    def body(s):
        i, c = s
        return i + 1, layer(c, jax.random.fold_in(key, i))

    return lax.while_loop(lambda s: s[0] < depth, body, (0, x))[1]


LAYERS = ("tanh", "dropout")


def make_layer(W, kind):
    """``x + tanh(x @ W)``, or (``dropout``) the seed's ReLU residual with dropout 0.5 on the
    step key."""
    if kind == "dropout":

        def layer(x, key):
            h = jax.nn.relu(x @ W)
            keep = jax.random.bernoulli(key, 0.5, h.shape)
            return x + jnp.where(keep, h * 2.0, 0.0)

        return layer

    def layer(x, key):
        del key
        return x + jnp.tanh(x @ W)

    return layer


def contenders(max_depth, kind):
    """name -> (per-sample function (W, x, depth, key) -> x, reverse-differentiable?)."""

    def seed(W, x, d, k):
        return seed_method(make_layer(W, kind), x, d, k, max_depth)

    def lax_while(W, x, d, k):
        return vmapped_while(make_layer(W, kind), x, d, k)

    def dd(strategy, checkpoints=None):
        def run(W, x, d, k):
            return dyndepth.repeat(
                make_layer(W, kind),
                x,
                d,
                max_depth=max_depth,
                key=k,
                strategy=strategy,
                checkpoints=checkpoints,
            )

        return run

    return {
        "seed scan+cond": (seed, True),
        "lax.while_loop": (lax_while, False),
        "dyndepth while": (dd("while"), False),
        "dyndepth auto": (dd("auto"), True),
        "dyndepth checkpointed": (dd("checkpointed"), True),
        "dyndepth checkpointed K=10": (dd("checkpointed", 10), True),
    }


def timeit(fn, args, repeats):
    """(median seconds, compile seconds, XLA temp bytes, result) of ``jax.jit(fn)(*args)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    return statistics.median(times), compile_s, temp, compiled(*args)


def batched(fn, depth_axis=0):
    def run(W, xs, ds, ks):
        return jax.vmap(fn, in_axes=(None, 0, depth_axis, 0))(W, xs, ds, ks)

    return run


def loss_of(fn, depth_axis=0):
    def loss(W, xs, ds, ks):
        return jnp.mean(batched(fn, depth_axis)(W, xs, ds, ks) ** 2)

    return jax.value_and_grad(loss)


def rel_err(a, b):
    """max |a - b| / max |b|: the correctness column, relative to the seed's result."""
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def fmt_mb(b):
    return "n/a" if b is None else f"{b / 2**20:.2f}"


def run(batch, dim, max_depth, repeats, kind="tanh", seed=0):
    """Run both tables and print them as Markdown; returns the measured rows."""
    k_w, k_x, k_d, k_k = jax.random.split(jax.random.PRNGKey(seed), 4)
    W = jax.random.normal(k_w, (dim, dim)) / jnp.sqrt(dim)
    xs = jax.random.normal(k_x, (batch, dim))
    ds = jax.random.randint(k_d, (batch,), 1, max_depth + 1)
    ks = jax.random.split(k_k, batch)
    args = (W, xs, ds, ks)
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, dyndepth {dyndepth.__version__}, python "
        f"{platform.python_version()}"
    )
    print(
        f"workload: B={batch}, D={dim}, max_depth={max_depth}, per-sample depths uniform in "
        f"[1, {max_depth}] (mean {float(ds.mean()):.1f}, max {int(ds.max())}), "
        f"{kind} residual layer, vmap + jit, median of {repeats}",
        flush=True,
    )
    table = {}
    ref_fwd = ref_grad = None
    for name, (fn, has_grad) in contenders(max_depth, kind).items():
        fwd_t, fwd_c, fwd_mem, out = timeit(batched(fn), args, repeats)
        row = dict(fwd=fwd_t, fwd_compile=fwd_c, fwd_mem=fwd_mem)
        if ref_fwd is None:
            ref_fwd = out
        row["fwd_err"] = rel_err(out, ref_fwd)
        if has_grad:
            g_t, g_c, g_mem, (_, g) = timeit(loss_of(fn), args, repeats)
            if ref_grad is None:
                ref_grad = g
            row.update(grad=g_t, grad_compile=g_c, grad_mem=g_mem, grad_err=rel_err(g, ref_grad))
        table[name] = row
        print(f"  measured {name}", flush=True)

    base = table["seed scan+cond"]
    print()
    print(
        "| contender | forward ms | x seed | value_and_grad ms | x seed | grad temp MiB | "
        "x seed | compile fwd / grad s | rel. diff vs seed fwd / grad |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in table.items():
        g, gm = r.get("grad"), r.get("grad_mem")
        cells = [name, f"{r['fwd'] * 1e3:.2f}", f"{base['fwd'] / r['fwd']:.1f}x"]
        cells += [f"{g * 1e3:.2f}", f"{base['grad'] / g:.1f}x"] if g else ["n/a", ""]
        cells += [fmt_mb(gm), f"{base['grad_mem'] / gm:.0f}x"] if gm else ["n/a", ""]
        cells.append(f"{r['fwd_compile']:.2f} / " + (f"{r['grad_compile']:.2f}" if g else "-"))
        cells.append(f"{r['fwd_err']:.1e} / " + (f"{r['grad_err']:.1e}" if g else "-"))
        print("| " + " | ".join(cells) + " |")

    print()
    print(f"Shared depth (one depth for the whole batch, max_depth={max_depth}):")
    print("| contender | depth | forward ms | value_and_grad ms |")
    print("|---|---|---|---|")
    shared = {}
    all_fns = contenders(max_depth, kind)
    for name in ["seed scan+cond", "dyndepth auto"]:
        fn, _ = all_fns[name]
        for depth in sorted({min(10, max_depth), max_depth}):
            sargs = (W, xs, jnp.asarray(depth, jnp.int32), ks)
            f_t = timeit(batched(fn, None), sargs, repeats)[0]
            g_t = timeit(loss_of(fn, None), sargs, repeats)[0]
            shared[(name, depth)] = (f_t, g_t)
            print(f"| {name} | {depth} | {f_t * 1e3:.2f} | {g_t * 1e3:.2f} |")
    lo, hi = shared[("dyndepth auto", min(10, max_depth))], shared[("dyndepth auto", max_depth)]
    print(
        f"\ndyndepth auto, depth {min(10, max_depth)} / depth {max_depth}: "
        f"forward {lo[0] / hi[0]:.2f}x, value_and_grad {lo[1] / hi[1]:.2f}x"
    )
    return table, shared


def main(argv=None):
    p = argparse.ArgumentParser(prog="dyndepth bench", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layer", choices=LAYERS, default="tanh")
    a = p.parse_args(argv)
    run(a.batch, a.dim, a.max_depth, a.repeats, kind=a.layer)


if __name__ == "__main__":
    main()
