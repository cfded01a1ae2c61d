"""Side-by-side benchmarks: the seed's scan + cond method, plain JAX loops and dyndepth, one run.

    dyndepth bench [WORKLOAD ...] [--quick] [--repeats 5] [--json FILE]
    python benchmarks/bench.py ...   # the same

Each workload is a residual layer closing over a weight ``W`` (D x D), a batch of per-sample
depths, per-sample keys, ``jax.vmap`` + ``jax.jit``. For every contender: forward time and
value_and_grad time (median of repeats after a warm-up, blocking on the result), compile time
apart, XLA temp memory of the compiled gradient, executed vs useful sample-steps, and the largest
difference of outputs and gradients relative to the seed's method (which equals the plain-Python
reference: tests check that). Ratios are against the seed's method.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dyndepth

__all__ = ["WORKLOADS", "main", "run_workload", "seed_method"]


# ----------------------------------------------------------------------------- contenders


def seed_method(layer, x, depth, key, max_iters, *, remat=False):
    """The seed's program: scan over max_iters with lax.cond(step < depth, layer, identity).

    Step ``i`` gets ``fold_in(key, i)``, dyndepth's schedule, so that results compare exactly.
    With ``remat`` each scan step runs under ``jax.checkpoint`` (stores only the carry).
    """

    def scan_step(carry, i):
        current_x, step = carry
        new_x = lax.cond(
            step < depth,
            lambda: layer(current_x, jax.random.fold_in(key, i)),
            lambda: current_x,
        )
        return (new_x, step + 1), None

    step = jax.checkpoint(scan_step) if remat else scan_step
    (out, _), _ = lax.scan(step, (x, 0), jnp.arange(max_iters))
    return out


def vmapped_while(layer, x, depth, key):
    """A plain lax.while_loop (forward only: not reverse-differentiable)."""

    def body(s):
        i, c = s
        return i + 1, layer(c, jax.random.fold_in(key, i))

    return lax.while_loop(lambda s: s[0] < depth, body, (0, x))[1]


def remat_seed_method(layer, x, depth, key, max_iters):
    """The seed's method with each scan step under ``jax.checkpoint``."""
    return seed_method(layer, x, depth, key, max_iters, remat=True)


def equinox_checkpointed(layer, x, depth, key, max_iters):
    """Equinox's ``equinox.internal.while_loop(kind="checkpointed")`` with its default
    checkpoints (online treeverse), the strongest public differentiable dynamic loop."""
    import equinox.internal as eqxi

    def body(s):
        i, c = s
        return i + 1, layer(c, jax.random.fold_in(key, i))

    return eqxi.while_loop(
        lambda s: s[0] < depth, body, (jnp.int32(0), x), max_steps=max_iters, kind="checkpointed"
    )[1]


def equinox_available():
    try:
        import equinox.internal  # noqa: F401
    except ImportError:
        return False
    return True


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


@dataclass
class Contender:
    name: str
    fn: Callable  # (W, x, depth, key, max_depth, kind) -> x, one sample
    grad: bool  # reverse-differentiable?
    stats: bool = False  # reports executed sample-steps through repeat_batched
    batched: bool = False  # called on the whole batch (repeat_batched) instead of under vmap


def _dd(strategy, checkpoints=None):
    def fn(W, x, d, k, max_depth, kind):
        return dyndepth.repeat(
            make_layer(W, kind),
            x,
            d,
            max_depth=max_depth,
            key=k,
            strategy=strategy,
            checkpoints=checkpoints,
        )

    return fn


def _wrap(method):
    def fn(W, x, d, k, max_depth, kind):
        return method(make_layer(W, kind), x, d, k, max_depth)

    return fn


CONTENDERS = [
    Contender("seed scan+cond", _wrap(seed_method), True),
    Contender("jax.checkpoint scan+cond", _wrap(remat_seed_method), True),
    Contender("lax.while_loop", _wrap(lambda f, x, d, k, m: vmapped_while(f, x, d, k)), False),
    Contender("equinox checkpointed", _wrap(equinox_checkpointed), True),
    Contender("dyndepth while", _dd("while"), False),
    Contender("dyndepth checkpointed", _dd("checkpointed"), True),
    Contender("dyndepth auto", _dd("auto"), True, stats=True),
    Contender("dyndepth repeat_batched", None, True, stats=True, batched=True),
]


# ----------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    batch: int
    dim: int
    max_depth: int
    depths: str  # "uniform" | "long-tail"
    layer: str  # "tanh" | "dropout"
    about: str


WORKLOADS = {
    "seed": Workload("seed", 32, 64, 100, "uniform", "dropout", "the seed's exact workload"),
    "core": Workload("core", 256, 64, 100, "uniform", "tanh", "B=256, D=64 tanh residual"),
    "per-sample": Workload(
        "per-sample", 256, 256, 100, "uniform", "tanh", "B=256, D=256 tanh residual MLP"
    ),
    "long-tail": Workload(
        "long-tail", 256, 64, 256, "long-tail", "tanh", "1 + Poisson(LogNormal), mean 32"
    ),
}


def draw_depths(key, w: Workload):
    if w.depths == "uniform":
        return jax.random.randint(key, (w.batch,), 1, w.max_depth + 1)
    k1, k2 = jax.random.split(key)
    sigma = 0.5
    tau = jnp.exp(jnp.log(32.0) - sigma**2 / 2 + sigma * jax.random.normal(k1, (w.batch,)))
    return jnp.clip(1 + jax.random.poisson(k2, tau), 1, w.max_depth).astype(jnp.int32)


# ----------------------------------------------------------------------------- measuring


def timeit(fn, args, repeats, budget_s=3.0):
    """(median seconds, compile seconds, XLA temp bytes, result) of ``jax.jit(fn)(*args)``.

    Slow functions get fewer repeats: at most ``budget_s`` seconds after the warm-up."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    warm = time.perf_counter() - t0
    n = max(1, min(repeats, int(budget_s / max(warm, 1e-9))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    return statistics.median(times), compile_s, temp, out


def rel_err(a, b):
    """max |a - b| / max |b| over all leaves: the correctness column."""
    num = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))
    den = max(float(jnp.max(jnp.abs(y))) for y in b)
    return num / max(den, 1e-30)


def run_workload(w: Workload, repeats: int, contenders=None, progress=print):
    """Measure every contender on ``w``; returns a list of row dicts."""
    k_w, k_x, k_d, k_k = jax.random.split(jax.random.PRNGKey(0), 4)
    W = jax.random.normal(k_w, (w.dim, w.dim)) / jnp.sqrt(w.dim)
    xs = jax.random.normal(k_x, (w.batch, w.dim))
    ds = draw_depths(k_d, w)
    ks = jax.random.split(k_k, w.batch)
    args = (W, xs, ds, ks)
    useful = int(ds.sum())
    rows = []
    ref_f = ref_g = None
    for c in contenders or CONTENDERS:
        if c.name.startswith("equinox") and not equinox_available():
            rows.append(dict(workload=w.name, contender=c.name, missing="not installed"))
            continue

        def fwd(W, xs, ds, ks, c=c):
            if c.batched:
                return dyndepth.repeat_batched(
                    make_layer(W, w.layer), xs, ds, max_depth=w.max_depth, keys=ks
                )
            return jax.vmap(lambda x, d, k: c.fn(W, x, d, k, w.max_depth, w.layer))(xs, ds, ks)

        def loss(W, xs, ds, ks, fwd=fwd):
            return jnp.mean(fwd(W, xs, ds, ks) ** 2)

        progress(f"  [{w.name}] {c.name}: forward", flush=True)
        f_t, f_c, _, out = timeit(fwd, args, repeats)
        row = dict(workload=w.name, contender=c.name, fwd_s=f_t, fwd_compile_s=f_c)
        ref_f = out if ref_f is None else ref_f
        row["fwd_rel_err"] = rel_err([out], [ref_f])
        if c.grad:
            progress(f"  [{w.name}] {c.name}: value_and_grad", flush=True)
            g_t, g_c, g_mem, (_, (gW, gx)) = timeit(
                jax.value_and_grad(loss, argnums=(0, 1)), args, repeats
            )
            ref_g = (gW, gx) if ref_g is None else ref_g
            row.update(
                grad_s=g_t,
                grad_compile_s=g_c,
                grad_temp_bytes=g_mem,
                grad_rel_err=rel_err([gW, gx], list(ref_g)),
            )
        if c.name.startswith("seed"):
            row["executed"] = w.batch * w.max_depth
        elif c.stats:
            _, st = dyndepth.repeat_batched(
                make_layer(W, w.layer), xs, ds, max_depth=w.max_depth, keys=ks, return_stats=True
            )
            row["executed"] = int(st["executed_sample_steps"])
        else:
            row["executed"] = w.batch * int(ds.max())
        row["useful"] = useful
        rows.append(row)
    return rows


def shared_depth_rows(repeats, quick, progress=print):
    """One depth for the whole batch, swept: the cost must follow the depth."""
    B, D, M = (8, 8, 12) if quick else (256, 64, 100)
    sweep = (3, 12) if quick else (10, 25, 50, 100)
    k_w, k_x, k_k = jax.random.split(jax.random.PRNGKey(1), 3)
    W = jax.random.normal(k_w, (D, D)) / jnp.sqrt(D)
    xs = jax.random.normal(k_x, (B, D))
    ks = jax.random.split(k_k, B)
    rows = []
    for c in [c for c in CONTENDERS if c.grad and not c.batched]:
        if c.name.startswith("equinox") and not equinox_available():
            continue
        for depth in sweep:

            def fwd(W, xs, d, ks, c=c):
                return jax.vmap(lambda x, k: c.fn(W, x, d, k, M, "tanh"))(xs, ks)

            def loss(W, xs, d, ks, fwd=fwd):
                return jnp.mean(fwd(W, xs, d, ks) ** 2)

            progress(f"  [shared-depth] {c.name} depth {depth}", flush=True)
            a = (W, xs, jnp.asarray(depth, jnp.int32), ks)
            f_t = timeit(fwd, a, repeats)[0]
            g_t = timeit(jax.value_and_grad(loss), a, repeats)[0]
            rows.append(dict(contender=c.name, depth=depth, fwd_s=f_t, grad_s=g_t, max_depth=M))
    return rows


# ----------------------------------------------------------------------------- reporting


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _x(base, v):
    return "" if (base is None or v is None) else f"{base / v:.1f}x"


def table(rows):
    base = rows[0]
    out = [
        "| contender | forward ms | vs seed | value_and_grad ms | vs seed | grad temp MiB "
        "| vs seed | executed / useful sample-steps | compile fwd / grad s "
        "| rel. diff fwd / grad |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "missing" in r:
            out.append(f"| {r['contender']} | {r['missing']} |" + " |" * 8)
            continue
        mem = r.get("grad_temp_bytes")
        bmem = base.get("grad_temp_bytes")
        cells = [
            r["contender"],
            _ms(r["fwd_s"]),
            _x(base["fwd_s"], r["fwd_s"]),
            _ms(r.get("grad_s")),
            _x(base.get("grad_s"), r.get("grad_s")),
            "n/a" if mem is None else f"{mem / 2**20:.2f}",
            "" if (mem is None or bmem is None) else f"{bmem / max(mem, 1):.0f}x",
            f"{r['executed']} / {r['useful']} ({r['executed'] / r['useful']:.2f}x)",
            f"{r['fwd_compile_s']:.2f} / "
            + ("-" if "grad_compile_s" not in r else f"{r['grad_compile_s']:.2f}"),
            f"{r['fwd_rel_err']:.1e} / "
            + ("-" if "grad_rel_err" not in r else f"{r['grad_rel_err']:.1e}"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def shared_table(rows):
    out = ["| contender | depth | forward ms | value_and_grad ms |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['contender']} | {r['depth']} | {_ms(r['fwd_s'])} | {_ms(r['grad_s'])} |")
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    out.append("")
    for name, rs in by.items():
        lo, hi = rs[0], rs[-1]
        out.append(
            f"- {name}: depth {lo['depth']} costs {lo['fwd_s'] / hi['fwd_s']:.2f}x (forward) and "
            f"{lo['grad_s'] / hi['grad_s']:.2f}x (value_and_grad) of depth {hi['depth']}"
        )
    return "\n".join(out)


def header():
    return (
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, "
        f"{jax.device_count()} device(s)), jax {jax.__version__}, dyndepth "
        f"{dyndepth.__version__}, python {platform.python_version()}, numpy {np.__version__}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(prog="dyndepth bench", description=__doc__.splitlines()[0])
    names = list(WORKLOADS) + ["shared-depth"]
    p.add_argument("workloads", nargs="*", help=f"any of {names} (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, for tests")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="also write all rows as JSON")
    a = p.parse_args(argv)
    for name in a.workloads:
        if name not in names:
            p.error(f"unknown workload {name!r}; choose from {names}")
    chosen = a.workloads or names
    print(header())
    print(f"command: dyndepth bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    report = {"header": header(), "workloads": {}}
    for name in chosen:
        if name == "shared-depth":
            rows = shared_depth_rows(a.repeats, a.quick, progress=_progress)
            print("\n### shared-depth: one depth for the whole batch\n")
            print(shared_table(rows), flush=True)
        else:
            w = WORKLOADS[name]
            if a.quick:
                w = Workload(w.name, 8, 8, 12, w.depths, w.layer, "quick")
            rows = run_workload(w, a.repeats, progress=_progress)
            print(
                f"\n### {w.name}: {w.about}; B={w.batch}, D={w.dim}, max_depth={w.max_depth}, "
                f"{w.depths} depths, {w.layer} layer\n"
            )
            print(table(rows), flush=True)
        report["workloads"][name] = rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


def _progress(msg, flush=True):
    print(msg, file=sys.stderr, flush=flush)


if __name__ == "__main__":
    main()
