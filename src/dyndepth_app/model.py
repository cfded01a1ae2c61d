"""The demo's task and model: prefix sums mod 2 and a DT-recall recurrent network (1-D).

Task: a string of fair coin flips ``b``; the input is ``b - 0.5``, the target at position ``i``
is ``sum(b[:i+1]) mod 2``; a string counts as solved only when every bit is right. Strings of
several lengths share one array by padding on the right; the mask ``m`` (1 inside the string, 0
in the padding) zeroes every conv's output in the padding, so a padded string computes exactly
what it computes alone (the convolutions' own padding is zeros too).

Model (Schwarzschild et al. 2021, Bansal et al. 2022; no biases, no normalisation; every conv
has kernel 3 and SAME zero padding)::

    h = relu(conv(x, 1 -> w))                                    # projection
    repeat:  z = conv(concat(h, x), w + 1 -> w)                  # recurrent core, with recall
             z = block(block(z)), block(u) = relu(u + conv(relu(conv(u))))
             h = z                                               # (times the mask)
    logits = conv(relu(conv(relu(conv(h, w -> w)), w -> w/2)), w/2 -> 2)   # head

``conv`` is written as one matmul over the three shifted copies of its input, which XLA:CPU
differentiates far faster than ``lax.conv`` inside a loop body; the evaluation, which never
differentiates, uses ``lax.conv_general_dilated`` (:func:`conv_eval`, the same function, faster
forward). ``dilations`` gives the dilation of each of the four convs of the two blocks (the
demo's 1, 2, 4, 8 let one iteration reach 16 positions on each side); the second conv of each
block starts at zero.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import dyndepth
from dyndepth import nn as dnn

# ----------------------------------------------------------------------------- data


def make_batch(key, batch, length):
    """(inputs (B, L) float32 in {-0.5, 0.5}, targets (B, L) int32 prefix parities)."""
    bits = jax.random.bernoulli(key, 0.5, (batch, length)).astype(jnp.int32)
    targets = jnp.cumsum(bits, axis=1) % 2
    return bits.astype(jnp.float32) - 0.5, targets


def length_mask(lengths, width):
    """(B, width) float32: 1 at positions ``< lengths[b]``, else 0."""
    return (jnp.arange(width)[None, :] < jnp.asarray(lengths)[:, None]).astype(jnp.float32)


def make_mixed_batch(key, batch, min_length, max_length):
    """Strings of lengths drawn uniformly from ``[min_length, max_length]``, padded to
    ``max_length``: ``(x, targets, mask, lengths)``; ``x`` is 0 in the padding. A string's
    bits are those of an unpadded string drawn with the same key (its prefix)."""
    kb, kl = jax.random.split(key)
    x, t = make_batch(kb, batch, max_length)
    lengths = jax.random.randint(kl, (batch,), min_length, max_length + 1, dtype=jnp.int32)
    m = length_mask(lengths, max_length)
    return x * m, t, m, lengths


# ----------------------------------------------------------------------------- model


def conv(x, w, dilation=1):
    """SAME conv1d, kernel 3, as one matmul: x (..., L, Cin), w (3 * Cin, Cout)."""
    d = dilation
    length = x.shape[-2]
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(d, d), (0, 0)])
    shifted = jnp.concatenate(
        [xp[..., :length, :], xp[..., d : d + length, :], xp[..., 2 * d : 2 * d + length, :]],
        axis=-1,
    )
    return shifted @ w


def conv_eval(x, w, dilation=1):
    """:func:`conv` with ``lax.conv_general_dilated`` (forward only: faster on XLA:CPU)."""
    lead, (length, cin) = x.shape[:-2], x.shape[-2:]
    y = lax.conv_general_dilated(
        x.reshape((-1, length, cin)),
        w.reshape(3, cin, -1),
        (1,),
        [(dilation, dilation)],
        rhs_dilation=(dilation,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    )
    return y.reshape(lead + (length, -1))


def init_params(key, width):
    def conv_w(k, cin, cout):
        bound = 1.0 / math.sqrt(3 * cin)  # PyTorch's default conv initialisation
        return jax.random.uniform(k, (3 * cin, cout), jnp.float32, -bound, bound)

    ks = jax.random.split(key, 9)
    return {
        "proj": conv_w(ks[0], 1, width),
        "recall": conv_w(ks[1], width + 1, width),
        # The second conv of each residual block starts at zero (every block starts as the
        # identity, Goyal et al. 2017 / Fixup): with dilated blocks, training leaves its
        # plateau far more reliably.
        "blocks": [
            {"a": conv_w(ks[2], width, width), "b": jnp.zeros((3 * width, width))},
            {"a": conv_w(ks[4], width, width), "b": jnp.zeros((3 * width, width))},
        ],
        "head": [
            conv_w(ks[6], width, width),
            conv_w(ks[7], width, width // 2),
            conv_w(ks[8], width // 2, 2),
        ],
    }


def _masked(h, m):
    return h if m is None else h * m[..., None]


def project(params, x, m=None, conv_fn=conv):
    """x (..., L) -> initial state (..., L, w)."""
    return _masked(jax.nn.relu(conv_fn(x[..., None], params["proj"])), m)


def core(params, h, x, dilations=(1, 1, 1, 1), m=None, conv_fn=conv):
    """One iteration of the recurrent core (recall: the raw input is concatenated each time).
    With a mask, every conv's output is zeroed in the padding, so that the next conv reads
    zeros there, as it does beyond the end of an unpadded string."""
    z = _masked(conv_fn(jnp.concatenate([h, x[..., None]], axis=-1), params["recall"]), m)
    for i, blk in enumerate(params["blocks"]):
        u = _masked(jax.nn.relu(conv_fn(z, blk["a"], dilations[2 * i])), m)
        z = jax.nn.relu(z + _masked(conv_fn(u, blk["b"], dilations[2 * i + 1]), m))
    return z


def head(params, h, m=None, conv_fn=conv):
    """Logits (..., L, 2); with a mask, the hidden layers are zeroed in the padding."""
    a, b, c = params["head"]
    u = _masked(jax.nn.relu(conv_fn(h, a)), m)
    return conv_fn(_masked(jax.nn.relu(conv_fn(u, b)), m), c)


# ----------------------------------------------------------------------------- training


def think(params, x, n, k, max_iters, dilations=(1, 1, 1, 1), m=None):
    """Logits (..., L, 2) after ``n`` iterations without gradient and ``k`` with gradient, with
    :func:`dyndepth.nn.recurrent_depth`. ``x`` (B, L) is a batch sharing one ``(n, k)`` (the
    loop carries the whole batch) or, under ``vmap``, one string with its own ``n`` and ``k``.
    The first ``n`` iterations store nothing and pass no gradient; the projection receives a
    gradient only when ``n == 0`` (Bansal et al.'s code)."""
    h0 = project(params, x, m)
    h = dnn.recurrent_depth(
        lambda h, xm: core(params, h, xm[0], dilations, xm[1]),
        h0,
        (x, m),
        n=n,
        k=k,
        max_n=max_iters,
        max_k=max_iters,
    )
    return head(params, h, m)


def think_batched(params, x, n, k, max_iters, dilations=(1, 1, 1, 1), m=None):
    """:func:`think` for a batch ``x`` (B, L) with per-sample ``n`` and ``k`` (B,), both loops
    through ``dyndepth.repeat_batched`` (the per-sample scheduler): returns the logits
    (B, L, 2) and this device's forward work as ``(executed, useful)`` int32 arrays of shape
    (1,), summed over the two loops: ``executed`` is slots x loop iterations as run by the
    scheduler (its own count), ``useful`` is ``sum(n + k)``. Inside ``shard_map`` the figures
    are the device's own.

    Not :func:`dyndepth.nn.recurrent_depth` under ``vmap`` (which also schedules per sample):
    it returns no work counts. The carry is ``(h, x, m)``: the recall input and the mask ride
    along unchanged, since ``repeat_batched`` steps one sample at a time and takes no
    per-sample ``xs``."""
    if m is None:
        m = jnp.ones_like(x)
    h0 = jax.vmap(lambda x, m: project(params, x, m))(x, m)
    frozen = jax.lax.stop_gradient(params)
    (h, _, _), st_n = dyndepth.repeat_batched(
        lambda c: (core(frozen, c[0], c[1], dilations, c[2]), c[1], c[2]),
        (jax.lax.stop_gradient(h0), x, m),
        n,
        max_depth=max_iters,
        return_stats=True,
    )
    h = jnp.where((n == 0)[:, None, None], h0, jax.lax.stop_gradient(h))
    (h, _, _), st_k = dyndepth.repeat_batched(
        lambda c: (core(params, c[0], c[1], dilations, c[2]), c[1], c[2]),
        (h, x, m),
        k,
        max_depth=max_iters,
        return_stats=True,
    )
    logits = jax.vmap(lambda h, m: head(params, h, m))(h, m)
    executed = st_n["per_device_executed_sample_steps"] + st_k["per_device_executed_sample_steps"]
    useful = st_n["per_device_useful_sample_steps"] + st_k["per_device_useful_sample_steps"]
    return logits, executed, useful


def sample_cross_entropy(logits, targets, m=None):
    """Per-sample cross-entropy, the mean over the string's positions: (B, L, 2), (B, L) ->
    (B,); with a mask, over the positions inside the string."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    ll = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if m is None:
        return -jnp.mean(ll, axis=-1)
    return -jnp.sum(ll * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def cross_entropy(logits, targets, m=None):
    return jnp.mean(sample_cross_entropy(logits, targets, m))
