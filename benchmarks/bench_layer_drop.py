"""LayerDrop: does the cost follow the layers kept?

``dyndepth.nn.layer_drop`` in batch mode (one decision per layer) over a stack of 24 residual
MLP layers (D=256, batch 64), rate 0.5 against rate 0 (which runs a plain ``lax.scan`` over the
stack), for the forward pass and for ``value_and_grad``. ``strategy="auto"`` runs
``dyndepth.scan`` over the kept layers only, and recomputes each kept layer once in the backward
pass; ``"masked"`` is a ``lax.scan`` over all 24 layers with a ``lax.cond`` per layer.
Each configuration is compiled once (compile time reported apart), warmed up, then timed with
``block_until_ready``: the median of ``--repeats`` runs per key (configurations take turns),
averaged over ``--keys`` keys (the number of layers kept varies with the key; its mean is
reported). Prints a Markdown table; the target is a ratio <= 0.65 at rate 0.5.

    python benchmarks/bench_layer_drop.py [--repeats 20] [--keys 8] [--dim 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import dyndepth
import dyndepth.nn as dnn

L = 24


def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def make_inputs(D, B):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w": jax.random.normal(k1, (L, D, D), jnp.float32) / np.sqrt(D),
        "b": jnp.zeros((L, D), jnp.float32),
    }
    x = jax.random.normal(k2, (B, D), jnp.float32)
    return params, x


def build(rate: float, strategy: str, traced: bool):
    def fwd(params, x, key, rate_arg):
        r = rate_arg if traced else rate  # a traced rate takes the dynamic path even at 0
        return dnn.layer_drop(layer, params, x, key, r, strategy=strategy)

    def loss(params, x, key, rate_arg):
        return jnp.mean(fwd(params, x, key, rate_arg) ** 2)

    return jax.jit(fwd), jax.jit(jax.value_and_grad(loss))


def compile_and_warm(fn, calls) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*calls[0]))
    compile_s = time.perf_counter() - t0
    for args in calls:
        jax.block_until_ready(fn(*args))  # warm-up
    return compile_s


def time_interleaved(fns, calls_of, repeats):
    """Median over ``repeats`` runs per (function, key), mean over keys, in ms. The functions
    take turns within every repeat, so that load from other processes spreads over all."""
    runs = {name: [[] for _ in calls_of[name]] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for j, args in enumerate(calls_of[name]):
                t = time.perf_counter()
                jax.block_until_ready(fn(*args))
                runs[name][j].append(time.perf_counter() - t)
    return {
        name: float(np.mean([np.median(r) for r in per_key])) * 1e3
        for name, per_key in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--keys", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256, help="layer width D (default 256)")
    parser.add_argument("--batch", type=int, default=64, help="rows of x (default 64)")
    args = parser.parse_args()
    D, B = args.dim, args.batch

    params, x = make_inputs(D, B)
    keys = jax.random.split(jax.random.PRNGKey(1), args.keys)
    kept = np.mean([int(jnp.sum(jax.random.bernoulli(k, 0.5, (L,)))) for k in keys])
    configs = [
        ("rate 0 (plain lax.scan)", 0.0, "auto", False, L),
        ('rate 0.5, strategy="auto" (default)', 0.5, "auto", False, kept),
        ('rate 0.5, strategy="masked"', 0.5, "masked", False, kept),
        ('rate 0 traced, strategy="auto" (the dyndepth loop over all 24)', 0.0, "auto", True, L),
    ]
    fns, calls_of, compile_s = {}, {}, {}
    for name, rate, strategy, traced, _ in configs:
        calls = [(params, x, k, jnp.float32(rate)) for k in keys]
        fwd, vg = build(rate, strategy, traced)
        fns[name, "fwd"], fns[name, "vg"] = fwd, vg
        calls_of[name, "fwd"] = calls_of[name, "vg"] = calls
        compile_s[name] = compile_and_warm(fwd, calls) + compile_and_warm(vg, calls)
    times = time_interleaved(fns, calls_of, args.repeats)
    results = [
        (name, n_kept, times[name, "fwd"], times[name, "vg"], compile_s[name])
        for name, _, _, _, n_kept in configs
    ]

    base_fwd, base_vg = results[0][2], results[0][3]
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, dyndepth {dyndepth.__version__}, "
        f"python {platform.python_version()}"
    )
    print(
        f"layer_drop, mode='batch', L={L}, D={D}, batch={B}; median of {args.repeats} runs "
        f"per key, mean over {args.keys} keys\n"
    )
    print("| configuration | layers kept (mean) | forward ms | ratio | value_and_grad ms | ratio "
          "| compile s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n_kept, t_fwd, t_vg, comp in results:
        print(
            f"| {name} | {n_kept:.1f} | {t_fwd:.2f} | {t_fwd / base_fwd:.2f}x | {t_vg:.2f} | "
            f"{t_vg / base_vg:.2f}x | {comp:.1f} |"
        )


if __name__ == "__main__":
    main()
