"""Per-sample against per-batch depth in a recurrent-depth Equinox transformer (#37's meter).

The model, in the style of the seed author's code: an Equinox recurrent core (the input
re-injected at every iteration, "recall"; multi-head attention and an MLP, pre-norm, dropout
with a key per iteration) on one sample's ``(L, D)`` activations; by default B=32, D=64, L=16, 4
heads (``--batch``, ``--width``, ``--length``, ``--heads``).
Training draws ``(n, k)`` with ``dyndepth.nn.sample_nk(max_iters=16)`` (Bansal et al.'s draw:
``n + k`` has mean about 12.25 and is at most 16) and runs ``dyndepth.nn.recurrent_depth``
(``n`` iterations without gradient, then ``k`` with gradient, the loss on the final state):

- **per-sample**: one ``(n, k)`` per sample, under ``jax.vmap`` (the per-sample scheduler,
  default slot counts);
- **per-batch**: one ``(n, k)`` for the whole batch at the same mean depth (the per-sample
  draws' means, rounded: lockstep, one copy of the core);
- **Equinox checkpointed** (not in ``--quick``): the per-sample draw in
  ``equinox.internal.while_loop(kind="checkpointed", max_steps=16)`` under ``jax.vmap``, the
  state after iteration ``n`` under ``stop_gradient`` (the same truncated backpropagation).

It prints value_and_grad time (best of ``--rounds`` interleaved rounds), compile time (lower +
compile, median of ``--repeats`` distinct programs: a constant of the core differs; one
discarded first), temp memory, the useful work (``sum(n + k)`` iterations of the core) and the
ratios #37's "Done when" names: per-sample / per-batch time (target <= 1.25x at equal mean
depth) and compile (target <= 3x). The "grad diff" column is the largest difference of the
gradients to the per-sample loop's relative to their largest value (the per-batch row draws
other depths: not comparable, so not given).

How to run (from the repository root; Equinox comes with the ``bench`` and ``test`` extras)::

    .venv/bin/python benchmarks/recurrent_transformer.py
    .venv/bin/python benchmarks/recurrent_transformer.py --quick   # one compile each, no Equinox
    python benchmarks/recurrent_transformer.py --batch 256 --length 64 --width 512 --heads 8

``--quick`` takes about a minute or more on the 2-core development machine: the per-sample
program alone compiles in 30-60 s there (five slot counts, each a copy of the core, forward and
backward).
"""

from __future__ import annotations

import argparse

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from measure import best_seconds, compile_times, machine_line, table, temp_mib

import dyndepth as dd
import dyndepth.nn as dnn

MAX_ITERS = 16


class Core(eqx.Module):
    """One iteration on ``(L, D)``: inject the input, attention, MLP, dropout on the MLP."""

    inject: eqx.nn.Linear
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key, width: int, heads: int):
        k = jax.random.split(key, 4)
        self.inject = eqx.nn.Linear(2 * width, width, key=k[0])
        self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k[1])
        self.up = eqx.nn.Linear(width, 4 * width, key=k[2])
        self.down = eqx.nn.Linear(4 * width, width, key=k[3])
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, s, x, key, scale=1.0):
        h = jax.vmap(self.inject)(jnp.concatenate([s, x], axis=-1))
        a = jax.vmap(self.norm1)(h)
        h = h + self.attn(a, a, a)
        m = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(h))))
        return h + scale * self.dropout(m, key=key)


def per_sample_loss(scale):
    def loss(params, static, xs, n, k, keys):
        core = eqx.combine(params, static)

        def one(x, n, k, key):
            s = dnn.recurrent_depth(lambda s, x, kk: core(s, x, kk, scale), jnp.zeros_like(x),
                                    x, n=n, k=k, max_n=MAX_ITERS - 1, max_k=MAX_ITERS,
                                    key=key)  # fmt: skip
            return jnp.mean(s**2)

        return jnp.mean(jax.vmap(one, in_axes=(0, 0, 0, 0))(xs, n, k, keys))

    return loss


def per_batch_loss(scale):
    def loss(params, static, xs, n, k, keys):
        core = eqx.combine(params, static)

        def one(x, key):
            s = dnn.recurrent_depth(lambda s, x, kk: core(s, x, kk, scale), jnp.zeros_like(x),
                                    x, n=n, k=k, max_n=MAX_ITERS - 1, max_k=MAX_ITERS,
                                    key=key)  # fmt: skip
            return jnp.mean(s**2)

        return jnp.mean(jax.vmap(one)(xs, keys))

    return loss


def equinox_loss(scale):
    def loss(params, static, xs, n, k, keys):
        core = eqx.combine(params, static)

        def one(x, n, k, key):
            def body(carry):
                i, s = carry
                s = core(s, x, dd.step_key(key, i), scale)
                return i + 1, jnp.where(i + 1 <= n, jax.lax.stop_gradient(s), s)

            init = (jnp.int32(0), jnp.zeros_like(x))
            _, s = eqxi.while_loop(lambda c: c[0] < n + k, body, init, max_steps=MAX_ITERS,
                                   kind="checkpointed")  # fmt: skip
            return jnp.mean(s**2)

        return jnp.mean(jax.vmap(one)(xs, n, k, keys))

    return loss


def rel_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    num = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(la, lb, strict=True))
    return num / max(max(float(jnp.max(jnp.abs(y))) for y in lb), 1e-30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="distinct programs per compile median")
    p.add_argument("--quick", action="store_true", help="one compile each, 3 rounds, no Equinox")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=16, help="tokens per sample")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--precision",
        choices=["default", "high", "highest"],
        default=None,
        help="jax.default_matmul_precision for every program (default: jax's own)",
    )
    a = p.parse_args()
    for flag in ("batch", "length", "width", "heads"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    if a.width % a.heads:
        p.error(f"--width must be a multiple of --heads ({a.heads}), got {a.width}")
    B, L, D, HEADS = a.batch, a.length, a.width, a.heads
    if a.precision:
        jax.config.update("jax_default_matmul_precision", a.precision)
    rounds, repeats = (3, 1) if a.quick else (a.rounds, a.repeats)
    print(machine_line())
    params, static = eqx.partition(Core(jax.random.key(0), D, HEADS), eqx.is_array)
    xs = jax.random.normal(jax.random.key(1), (B, L, D))
    n, k = dnn.sample_nk(jax.random.key(2), (B,), max_iters=MAX_ITERS)
    keys = jax.random.split(jax.random.key(3), B)
    n_b, k_b = jnp.round(n.mean()).astype(jnp.int32), jnp.round(k.mean()).astype(jnp.int32)
    useful = {"per-sample": int((n + k).sum()), "per-batch": B * int(n_b + k_b)}
    useful["Equinox checkpointed"] = useful["per-sample"]
    print(f"B={B}, L={L}, D={D}, {HEADS} heads, max_iters {MAX_ITERS}; per-sample n + k: mean "
          f"{float((n + k).mean()):.2f}, max {int((n + k).max())}, mean k {float(k.mean()):.2f}; "
          f"per-batch n = {int(n_b)}, k = {int(k_b)}; matmul precision "
          f"{a.precision or 'jax default'}\n")  # fmt: skip
    losses = {"per-sample": per_sample_loss, "per-batch": per_batch_loss}
    if not a.quick:
        losses["Equinox checkpointed"] = equinox_loss
    args = {name: (params, xs, n, k, keys) for name in losses}
    args["per-batch"] = (params, xs, n_b, k_b, keys)
    compiled, comp = {}, {}
    for name, loss_of in losses.items():
        make = lambda i, loss_of=loss_of: jax.value_and_grad(  # noqa: E731
            lambda p, *rest: loss_of(1.0 + 1e-6 * i)(p, static, *rest)
        )
        lower_s, compile_s, compiled[name] = compile_times(make, args[name], repeats)
        comp[name] = lower_s + compile_s
    sec = best_seconds({name: (compiled[name], args[name]) for name in losses}, rounds)
    ref = compiled["per-sample"](*args["per-sample"])[1]
    rows = []
    for name in losses:
        diff = {"per-sample": "(reference)", "per-batch": ""}.get(name)
        diff = diff if diff is not None else f"{rel_diff(compiled[name](*args[name])[1], ref):.1e}"
        rows.append([name, useful[name], f"{1e3 * sec[name]:.1f}", f"{comp[name]:.2f}",
                     f"{temp_mib(compiled[name]):.1f}", diff])  # fmt: skip
    print(table(["depth", "useful core iterations", "value_and_grad ms", "compile s",
                 "temp MiB", "grad diff"], rows))  # fmt: skip
    print(f"\nper-sample / per-batch: value_and_grad {sec['per-sample'] / sec['per-batch']:.2f}x "
          f"(target <= 1.25) for {useful['per-sample'] / useful['per-batch']:.2f}x the useful "
          f"work; compile {comp['per-sample'] / comp['per-batch']:.2f}x (target <= 3); "
          f"best of {rounds} rounds, compile median of {repeats}")  # fmt: skip


if __name__ == "__main__":
    main()
