"""Learned, data-dependent depth (ACT, PonderNet): ``halting`` and ``ponder_loss``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._layers import Strategy, call_step, while_loop, zeros
from . import _validate as v

__all__ = ["HaltingResult", "halting", "ponder_loss"]

HaltKind = Literal["pondernet", "act"]
HaltInput = Literal["probability", "logit"]


class HaltingResult(NamedTuple):
    """What :func:`halting` returns (for one sample; under ``vmap`` every field gains a batch
    axis).

    - ``state``: the state after ``steps`` steps.
    - ``outputs``: the per-step outputs of ``step_fn``, each leaf stacked along a leading axis
      of size ``max_steps``; rows ``>= steps`` are zeros.
    - ``p``: float32 ``(max_steps,)``, the halting distribution; rows ``>= steps`` are zeros.
    - ``steps``: int32 scalar, the number of steps taken (``1 <= steps <= max_steps``).
    """

    state: Any
    outputs: Any
    p: jax.Array
    steps: jax.Array


def halting(
    step_fn: Callable,
    state: Any,
    *,
    max_steps: int,
    threshold: float = 0.99,
    kind: HaltKind = "pondernet",
    halt: HaltInput = "probability",
    normalize: bool = True,
    key: Any = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    slots: int | Sequence[int] | Literal["work"] | None = None,
) -> HaltingResult:
    """Iterate a step until its cumulative halting probability reaches ``threshold``.

    The plain-Python meaning, for one sample (``key`` given; without it, ``step_fn`` takes the
    state alone; ``lam`` is the step's halting probability, ``sigmoid(output)`` with
    ``halt="logit"``)::

        def halting(step_fn, state, *, max_steps, threshold, kind, normalize, key):
            p, outputs, rest, t = [], [], 1.0, 0    # rest: probability of not having halted
            while t < max_steps and 1 - rest < threshold:
                state, lam, y = step_fn(state, dyndepth.step_key(key, t))
                if kind == "pondernet":             # lam is conditional on reaching step t
                    p.append(lam * rest)            # p_t = lam_t * prod_{j<t} (1 - lam_j)
                    rest = rest * (1 - lam)
                else:                               # "act": lam is the halting unit h_t
                    p.append(lam)
                    rest = rest - lam
                outputs.append(y)
                t += 1
            if normalize:
                p[-1] += rest                       # the remainder goes to the last step
            return HaltingResult(state, pad(outputs, max_steps), pad(p, max_steps), t)

    With ``normalize=True`` (default), ``p`` sums to one over the steps taken: for
    ``"pondernet"`` this is PonderNet's ``lambda_N = 1`` at the last step ``N`` (Banino et al.,
    2021), for ``"act"`` it is ACT's remainder ``R = 1 - sum_{n<N} h_n`` (Graves, 2016), whose
    ponder cost is ``steps + R``, i.e. ``steps + p[steps - 1]``. The expected output is
    ``jnp.einsum("n,n...->...", p, outputs)``; the PonderNet loss is
    :func:`ponder_loss` of the per-step task losses. Every sample takes at least one step.

    **Cost:** built on :func:`dyndepth.while_loop`, so forward and backward cost follow the steps
    taken; under ``vmap`` finished samples are masked, and with ``strategy="auto"`` the
    per-sample scheduler (``slots``) refills their slots with pending samples. The per-step
    outputs and ``p`` live in the loop's carry (fixed-size buffers of ``max_steps`` rows), so in
    reverse mode every stored carry holds them: memory about ``max_steps x (state + max_steps x
    output)`` with ``checkpoints=None``. Keep outputs small (return the per-step loss, or logits)
    or pass ``checkpoints``.

    **Arguments:**

    - ``step_fn``: ``step_fn(state) -> (state, lam, y)``, or ``step_fn(state, key)`` when ``key``
      is given; written for one sample. ``state`` keeps its structure, shapes and dtypes;
      ``lam`` is a float scalar (a probability in ``[0, 1]``, or a logit with
      ``halt="logit"``); ``y`` is any pytree of arrays. What it closes over receives gradients
      through ``lam`` and ``y`` (the stopping decision itself has no gradient).
    - ``state``: the initial state, a pytree of arrays.
    - ``max_steps``: static int ``>= 1``.
    - ``threshold``: static float in ``(0, 1]``; ``1 - epsilon`` in PonderNet and ACT. The loop
      stops after the first step at which the cumulative halting probability is ``>=
      threshold``; ``1.0`` runs ``max_steps`` steps unless a step halts with certainty.
    - ``kind``: ``"pondernet"`` (default; ``lam`` conditional) or ``"act"`` (``lam`` the
      unconditional halting unit; ``p`` is ``lam`` itself).
    - ``halt``: ``"probability"`` (default) or ``"logit"``.
    - ``normalize``: add the remaining probability to the last step taken (default ``True``).
    - ``key``: optional PRNG key; step ``t`` receives ``dyndepth.step_key(key, t)``.
    - ``strategy``, ``checkpoints``, ``slots``: passed to :func:`dyndepth.while_loop`.

    **Returns:** a :class:`HaltingResult` ``(state, outputs, p, steps)``.

    **Transformations:** jit, vmap (each sample stops on its own), grad/vjp (``"auto"``,
    ``"checkpointed"``, ``"masked"``), jvp (every strategy).

    **Raises** (at trace time): ``TypeError`` if ``step_fn`` is not callable, does not return a
    3-tuple, returns a ``lam`` that is not a float scalar, or changes the state; if ``key`` is
    not a PRNG key. ``ValueError`` for ``max_steps < 1``, ``threshold`` outside ``(0, 1]``, an
    unknown ``kind``/``halt``/``strategy``.
    """
    v.callable_arg(step_fn, "step_fn")
    max_steps = v.static_int(max_steps, "max_steps", minimum=1)
    threshold = v.static_float(threshold, "threshold")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"`threshold` must lie in (0, 1], got {threshold!r}")
    kind = v.choice_arg(kind, "kind", ("pondernet", "act"))
    halt = v.choice_arg(halt, "halt", ("probability", "logit"))
    normalize = v.bool_arg(normalize, "normalize")
    v.strategy_arg(strategy)
    state = jax.tree_util.tree_map(jnp.asarray, state)
    lam_shape, y_shape = _step_output_types(step_fn, state, key, halt)

    # typed like the step's outputs (an Explicit mesh's sharding included), so they can be
    # written into the buffers
    outputs0 = jax.tree_util.tree_map(lambda a: zeros((max_steps,), a), y_shape)
    carry0 = dict(
        state=state,
        t=jnp.zeros((), jnp.int32),
        rest=jnp.ones((), jnp.float32),
        p=zeros((max_steps,), lam_shape).astype(jnp.float32),
        outputs=outputs0,
    )

    def cond(c):
        return (1.0 - c["rest"]) < threshold

    final = while_loop(
        cond,
        _halting_step(step_fn, kind, halt),
        carry0,
        max_steps=max_steps,
        key=key,
        strategy=strategy,
        checkpoints=checkpoints,
        slots=slots,
    )
    steps = final["t"]
    p = final["p"]
    if normalize:
        last = jnp.arange(max_steps) == steps - 1
        p = p + jnp.where(last, final["rest"], 0.0)
    return HaltingResult(final["state"], final["outputs"], p, steps)


def _call(step_fn: Callable, state: Any, key: Any) -> Any:
    """``step_fn(state[, key])``, as the loops call a step (a keyword-only ``key`` too)."""
    return call_step(step_fn, "step_fn", ["state"], [state], key, index_hint=False)


def _step_output_types(step_fn: Callable, state: Any, key: Any, halt: str) -> tuple[Any, Any]:
    """The types of ``step_fn``'s halting value and output ``y``, its outputs checked."""
    if key is not None:
        v.key_arg(key)
        key = jax.random.fold_in(key, 0)
    out = jax.eval_shape(lambda s, k: _call(step_fn, s, k), state, key)
    if not isinstance(out, tuple) or len(out) != 3:
        raise TypeError(
            "`step_fn` must return a tuple (state, lam, y), got "
            f"{jax.tree_util.tree_structure(out)}"
        )
    new_state, lam_shape, y_shape = out
    v.same_structure(state, new_state, "step_fn", "state")
    if (
        not hasattr(lam_shape, "shape")
        or lam_shape.shape != ()
        or not jnp.issubdtype(lam_shape.dtype, jnp.floating)
    ):
        got = (
            f"{lam_shape.dtype}{list(lam_shape.shape)}"
            if hasattr(lam_shape, "shape")
            else repr(lam_shape)
        )
        raise TypeError(
            "`step_fn` must return a float scalar halting "
            f"{'logit' if halt == 'logit' else 'probability'} as its second output, got {got}; "
            "under vmap, write step_fn for one sample"
        )
    return lam_shape, y_shape


def _halting_step(step_fn: Callable, kind: str, halt: str) -> Callable:
    """One step of :func:`halting` on its carry: the user's step, its halting probability
    ``p_t`` and output written at step ``t``, the probability left to halt updated."""

    def body(c, kk=None):
        s, lam, y = _call(step_fn, c["state"], kk)
        lam = jnp.asarray(lam).astype(jnp.float32)
        if halt == "logit":
            lam = jax.nn.sigmoid(lam)
        t, rest = c["t"], c["rest"]
        if kind == "pondernet":
            p_t, new_rest = lam * rest, rest * (1.0 - lam)
        else:
            p_t, new_rest = lam, rest - lam
        outputs = jax.tree_util.tree_map(
            lambda buf, a: lax.dynamic_update_index_in_dim(buf, jnp.asarray(a, buf.dtype), t, 0),
            c["outputs"],
            y,
        )
        return dict(
            state=s,
            t=t + 1,
            rest=new_rest,
            p=lax.dynamic_update_index_in_dim(c["p"], p_t, t, 0),
            outputs=outputs,
        )

    return body


def ponder_loss(
    task_losses: jax.Array,
    p: jax.Array,
    *,
    prior_lambda: float,
    beta: float,
) -> jax.Array:
    """PonderNet's loss: expected task loss plus a KL pull towards a geometric prior.

    The plain-Python meaning, for one sample (``N = p.shape[-1]``, steps ``n = 0 .. N-1``)::

        q = [prior_lambda * (1 - prior_lambda) ** n for n in range(N)]
        q = [q_n / sum(q) for q_n in q]                     # geometric, truncated to N steps
        reconstruction = sum(p[n] * task_losses[n] for n in range(N))
        kl = sum(p[n] * (log(p[n]) - log(q[n])) for n in range(N) if p[n] > 0)
        return reconstruction + beta * kl

    The truncated prior is renormalized, so that ``KL(p || q) >= 0`` for a ``p`` that sums to
    one (``normalize=True`` in :func:`halting`). Rows of ``task_losses`` at steps that were not
    taken are multiplied by ``p = 0`` and do not count (they may hold anything finite).

    **Arguments:**

    - ``task_losses``: float array ``(..., N)``, the loss of each step's output.
    - ``p``: float array ``(..., N)``, the halting distribution (``HaltingResult.p``).
    - ``prior_lambda``: static float in ``(0, 1]``, the prior's halting probability per step
      (the prior's mean number of steps is about ``1 / prior_lambda``).
    - ``beta``: static float ``>= 0``, the weight of the KL term.

    **Returns:** a float array of shape ``p.shape[:-1]`` (take the mean over the batch).

    **Transformations:** jit, vmap, grad, jvp (the gradient at ``p_n = 0`` is finite).

    **Raises:** ``ValueError`` if the shapes differ or are scalars, or for ``prior_lambda``
    outside ``(0, 1]`` or a negative ``beta``; ``TypeError`` for non-static floats.
    """
    prior_lambda = v.static_float(prior_lambda, "prior_lambda")
    beta = v.static_float(beta, "beta")
    if not 0.0 < prior_lambda <= 1.0:
        raise ValueError(f"`prior_lambda` must lie in (0, 1], got {prior_lambda!r}")
    if not beta >= 0.0:
        raise ValueError(f"`beta` must be >= 0, got {beta!r}")
    task_losses = jnp.asarray(task_losses)
    p = jnp.asarray(p)
    if p.ndim == 0 or task_losses.shape != p.shape:
        raise ValueError(
            "`task_losses` and `p` must have the same shape (..., N) with N the steps, got "
            f"{task_losses.shape} and {p.shape}"
        )
    N = p.shape[-1]
    steps = np.arange(N)
    if prior_lambda == 1.0:
        log_q = np.where(steps == 0, 0.0, -np.inf)
    else:
        log_q = np.log(prior_lambda) + steps * np.log1p(-prior_lambda)
        log_q = log_q - np.log(-np.expm1(N * np.log1p(-prior_lambda)))
    log_q = jnp.asarray(log_q, p.dtype)
    positive = p > 0
    safe_p = jnp.where(positive, p, jnp.ones((), p.dtype))
    safe_log_q = jnp.where(positive, log_q, jnp.zeros((), p.dtype))
    kl_terms = jnp.where(positive, p * (jnp.log(safe_p) - safe_log_q), jnp.zeros((), p.dtype))
    reconstruction = jnp.sum(p * task_losses, axis=-1)
    return reconstruction + beta * jnp.sum(kl_terms, axis=-1)
