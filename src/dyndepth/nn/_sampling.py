"""Depth samplers: per-sample depths, Deep Thinking ``(n, k)`` pairs, stochastic-depth schedules."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate as v

__all__ = ["sample_depth", "sample_nk", "survival_schedule"]

DepthDist = Literal["uniform", "poisson_lognormal"]
PairKind = Literal["deep_thinking", "uniform_pairs"]
ScheduleKind = Literal["linear", "uniform"]

_DISTS = ("uniform", "poisson_lognormal")
_PAIR_KINDS = ("deep_thinking", "uniform_pairs")
_SCHEDULE_KINDS = ("linear", "uniform")


def sample_depth(
    key: Any,
    shape: int | tuple[int, ...] = (),
    *,
    dist: DepthDist,
    low: int | None = None,
    high: int | None = None,
    mean: float | None = None,
    sigma: float = 0.5,
    max_depth: int | None = None,
) -> jax.Array:
    """Draw integer depths (loop counts) of the given shape.

    The plain-Python meaning, per element::

        if dist == "uniform":              # every integer of [low, high] equally likely
            depth = random.randint(low, high)
        elif dist == "poisson_lognormal":  # Huginn (Geiping et al., 2025)
            tau = exp(random.gauss(log(mean) - sigma**2 / 2, sigma))   # E[tau] = mean
            depth = 1 + poisson(tau)                                    # E[depth] = 1 + mean
        if max_depth is not None:
            depth = min(depth, max_depth)

    The exact draws: ``"uniform"`` is ``jax.random.randint(key, shape, low, high + 1)``;
    ``"poisson_lognormal"`` splits ``k1, k2 = jax.random.split(key)``, draws
    ``z = jax.random.normal(k1, shape)`` and ``1 + jax.random.poisson(k2, tau, shape)``.
    Huginn then splits a total of ``t`` iterations into ``n = max(t - k_max, 0)`` steps without
    gradient and ``k = min(t, k_max)`` with gradient; pass those to
    :func:`dyndepth.nn.recurrent_depth`.

    **Arguments:**

    - ``key``: a PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``).
    - ``shape``: static shape of the result (an int or a tuple of ints); ``()`` for one depth.
    - ``dist``: ``"uniform"`` or ``"poisson_lognormal"``.
    - ``low``, ``high``: for ``"uniform"`` (required there, ignored otherwise): static ints with
      ``0 <= low <= high``; both ends are included.
    - ``mean``, ``sigma``: for ``"poisson_lognormal"``: static floats, ``mean > 0`` the mean of
      the Poisson rate ``tau`` (``mean`` is required), ``sigma >= 0`` the log-normal spread
      (default ``0.5``, Huginn's value).
    - ``max_depth``: optional static int ``>= 0``; depths are clipped to it (use the loop's
      ``max_depth`` so that no draw is clamped silently by the loop).

    **Returns:** an int32 array of shape ``shape``.

    **Transformations:** jit, vmap (over ``key``); the result is an integer and carries no
    gradient.

    **Raises:** ``ValueError`` for an unknown ``dist``, ``low > high``, ``low < 0``,
    ``mean <= 0``, ``sigma < 0``, or a missing ``low``/``high``/``mean``; ``TypeError`` for a
    non-key ``key`` or non-static ``shape``/``low``/``high``/``max_depth``.
    """
    v.key_arg(key)
    shape = v.shape_arg(shape)
    dist = v.choice_arg(dist, "dist", _DISTS)
    if max_depth is not None:
        max_depth = v.static_int(max_depth, "max_depth")
    if dist == "uniform":
        if low is None or high is None:
            raise ValueError(
                f'dist="uniform" needs both `low` and `high`, got low={low!r}, high={high!r}'
            )
        low = v.static_int(low, "low")
        high = v.static_int(high, "high")
        if high < low:
            raise ValueError(f"`high` must be >= `low`, got low={low}, high={high}")
        depth = jax.random.randint(key, shape, low, high + 1, dtype=jnp.int32)
    else:
        if mean is None:
            raise ValueError('dist="poisson_lognormal" needs `mean` (the mean Poisson rate)')
        mean = v.static_float(mean, "mean")
        sigma = v.static_float(sigma, "sigma")
        if not mean > 0.0:
            raise ValueError(f"`mean` must be > 0, got {mean!r}")
        if not sigma >= 0.0:
            raise ValueError(f"`sigma` must be >= 0, got {sigma!r}")
        k1, k2 = jax.random.split(key)
        mu = float(np.log(mean) - sigma**2 / 2)
        tau = jnp.exp(mu + sigma * jax.random.normal(k1, shape, jnp.float32))
        depth = 1 + jax.random.poisson(k2, tau, shape, dtype=jnp.int32)
    if max_depth is not None:
        depth = jnp.minimum(depth, max_depth)
    return depth


def sample_nk(
    key: Any,
    shape: int | tuple[int, ...] = (),
    *,
    max_iters: int,
    kind: PairKind = "deep_thinking",
) -> tuple[jax.Array, jax.Array]:
    """Draw ``(n, k)`` pairs for recurrent-depth training: ``n >= 0`` steps without gradient, then
    ``k >= 1`` steps with gradient, ``n + k <= max_iters``.

    The plain-Python meaning, per element (``M = max_iters``)::

        if kind == "deep_thinking":   # Bansal et al. (2022), "End-to-end algorithm synthesis"
            n = random.randint(0, M - 1)
            k = random.randint(1, M - n)
        elif kind == "uniform_pairs": # every valid pair equally likely
            n, k = random.choice([(n, k) for n in range(M) for k in range(1, M - n + 1)])

    **The skew of ``"deep_thinking"``.** Drawing ``n`` first and then ``k`` given ``n`` gives
    pair ``(n, k)`` the probability ``1 / (M * (M - n))``: pairs with a large ``n`` (and hence a
    small ``k``) are over-represented. The marginal of ``k`` is
    ``P(k) = (H_M - H_{k-1}) / M`` (``H`` the harmonic numbers) with ``E[k] = (M + 3) / 4``;
    under ``"uniform_pairs"`` it is ``P(k) = 2 (M - k + 1) / (M (M + 1))`` with
    ``E[k] = (M + 2) / 3``. For ``M = 30``: ``P(k = 1)`` is 0.133 against 0.065, ``E[k]`` 8.25
    against 10.67. ``"deep_thinking"`` reproduces the published training runs; ``"uniform_pairs"``
    is the unskewed alternative.

    The exact draws: ``"deep_thinking"`` splits ``k1, k2 = jax.random.split(key)`` and draws
    ``n = jax.random.randint(k1, shape, 0, M)`` and
    ``k = jax.random.randint(k2, shape, 1, M - n + 1)``;
    ``"uniform_pairs"`` draws one index ``jax.random.randint(key, shape, 0, M (M + 1) / 2)`` and
    maps it to a pair, ordered by ``n + k`` then ``k``.

    **Arguments:**

    - ``key``: a PRNG key.
    - ``shape``: static shape of ``n`` and ``k``; ``()`` for one pair (Bansal et al. draw one pair
      per batch).
    - ``max_iters``: static int ``>= 1``, the largest ``n + k``.
    - ``kind``: ``"deep_thinking"`` (default) or ``"uniform_pairs"``.

    **Returns:** ``(n, k)``, two int32 arrays of shape ``shape``.

    **Transformations:** jit, vmap (over ``key``); no gradient (integers).

    **Raises:** ``ValueError`` for an unknown ``kind`` or ``max_iters < 1``; ``TypeError`` for a
    non-key ``key`` or a non-int ``max_iters``.
    """
    v.key_arg(key)
    shape = v.shape_arg(shape)
    max_iters = v.static_int(max_iters, "max_iters", minimum=1)
    kind = v.choice_arg(kind, "kind", _PAIR_KINDS)
    if kind == "deep_thinking":
        k1, k2 = jax.random.split(key)
        n = jax.random.randint(k1, shape, 0, max_iters, dtype=jnp.int32)
        k = jax.random.randint(k2, shape, 1, max_iters - n + 1, dtype=jnp.int32)
        return n, k
    total = max_iters * (max_iters + 1) // 2
    idx = jax.random.randint(key, shape, 0, total, dtype=jnp.int32)
    # tri[s] = s (s + 1) / 2 pairs have n + k <= s; pairs with n + k == s are indices
    # tri[s - 1] .. tri[s] - 1, and there k = idx - tri[s - 1] + 1.
    s_vals = np.arange(max_iters + 1)
    tri = jnp.asarray(s_vals * (s_vals + 1) // 2, jnp.int32)
    s = jnp.searchsorted(tri, idx, side="right").astype(jnp.int32)
    k = idx - tri[s - 1] + 1
    return s - k, k


def survival_schedule(
    num_layers: int, final_rate: float, *, kind: ScheduleKind = "linear"
) -> jax.Array:
    """Per-layer drop rates for stochastic depth (Huang et al., 2016).

    The plain-Python meaning (layers numbered ``l = 1 .. L`` from the input)::

        if kind == "linear":   # Huang et al.'s linear decay of the survival probability
            rates = [l / L * final_rate for l in range(1, L + 1)]
        elif kind == "uniform":
            rates = [final_rate] * L

    The result holds **drop** rates (``1 - `` the survival probability of each layer), ready for
    :func:`dyndepth.nn.layer_drop` or one entry at a time for :func:`dyndepth.nn.drop_path`.
    The last layer's rate is ``final_rate`` in both kinds.

    **Arguments:**

    - ``num_layers``: static int ``L >= 0``.
    - ``final_rate``: static float in ``[0, 1]``, the drop rate of the last layer.
    - ``kind``: ``"linear"`` (default) or ``"uniform"``.

    **Returns:** a float32 array of shape ``(L,)``.

    **Raises:** ``ValueError`` for ``final_rate`` outside ``[0, 1]``, ``num_layers < 0`` or an
    unknown ``kind``; ``TypeError`` for non-static arguments.
    """
    num_layers = v.static_int(num_layers, "num_layers")
    final_rate = v.static_float(final_rate, "final_rate")
    v.rate_arg(final_rate, "final_rate")
    kind = v.choice_arg(kind, "kind", _SCHEDULE_KINDS)
    if kind == "linear":
        rates = np.arange(1, num_layers + 1) / max(num_layers, 1) * final_rate
    else:
        rates = np.full((num_layers,), final_rate)
    return jnp.asarray(rates, jnp.float32)
