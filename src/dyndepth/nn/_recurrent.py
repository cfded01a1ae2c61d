"""Recurrent depth with truncated backpropagation (Deep Thinking, Huginn): ``recurrent_depth``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._layers import KeySchedule, Strategy, call_step, repeat, scan, stopped
from . import _validate as v

__all__ = ["recurrent_depth"]


def recurrent_depth(
    core: Callable,
    state: Any,
    x: Any,
    *,
    n: Any,
    k: Any,
    max_n: int,
    max_k: int,
    key: Any = None,
    return_all: bool = False,
    readout: Callable | None = None,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
    with_index: bool = False,
    slots: int | Sequence[int] | Literal["work"] | None = None,
) -> Any:
    """Run a recurrent core ``n + k`` times, backpropagating through the last ``k`` steps only.

    The plain-Python meaning (``key`` given; without it, ``core`` takes ``(state, x)``)::

        def recurrent_depth(core, state, x, *, n, k, key, return_all, readout):
            s = state
            for j in range(n):                        # no gradient, nothing stored
                s = core(s, x, dyndepth.step_key(key, j))
            if n > 0:
                s = jax.lax.stop_gradient(s)          # truncated backprop
            ys = []
            for j in range(max_k):                    # with gradient
                if j < k:
                    s = core(s, x, dyndepth.step_key(key, n + j))
                    ys.append(readout(s) if readout else s)
                else:
                    ys.append(zeros_like(ys[0]))
            return (s, stack(ys)) if return_all else s

    The core receives the input ``x`` at every step ("recall", Bansal et al. 2022; Huginn's
    ``e``). Iteration ``j`` (0-based over all ``n + k`` iterations) gets
    ``dyndepth.step_key(key, j)``, so a run's keys do not depend on where the split between
    ``n`` and ``k`` falls.

    **Gradients:** nothing before iteration ``n`` is differentiated: the first ``n`` iterations
    run under ``stop_gradient`` (everything ``core`` closes over included) in a loop that stores
    no residuals, so memory does not grow with ``n`` or ``max_n``; the last ``k`` run in a
    reverse-differentiable :func:`dyndepth.scan` (``strategy``, ``checkpoints``), whose memory
    follows ``max_k``. Parameters that ``core`` closes over and ``x`` receive gradients from the
    last ``k`` iterations. The initial ``state`` receives a gradient only when ``n == 0``, as in
    Bansal et al.'s code (``n = 0`` skips the detached phase).

    **Arguments:**

    - ``core``: ``core(state, x) -> state``, or ``core(state, x, key)`` when ``key`` is given;
      it keeps the state's pytree structure, shapes and dtypes.
    - ``state``: the initial state, a pytree of arrays.
    - ``x``: the input given to every step, any pytree (or ``None``).
    - ``n``, ``k``: iteration counts, Python ints or integer scalar arrays; they may be traced
      and batched under ``vmap`` (one pair per sample, e.g. from
      :func:`dyndepth.nn.sample_nk`). Concrete values outside ``[0, max_n]``/``[0, max_k]``
      raise; traced ones are clamped.
    - ``max_n``, ``max_k``: static ints ``>= 0``. ``max_n`` costs nothing (no buffer depends on
      it); ``max_k`` sizes the stored carries and the ``ys`` buffer.
    - ``key``: optional PRNG key, see above.
    - ``return_all``: also return the per-iteration outputs of the last ``k`` iterations, for a
      loss at every step (progressive loss): ``ys`` stacks ``max_k`` rows along a new leading
      axis; row ``j < k`` is the output after iteration ``n + j`` (``j + 1`` differentiated
      steps) and rows ``j >= k`` are zeros. With ``n = 0``, those are all the iterations.
    - ``readout``: ``readout(state) -> y``, any pytree (e.g. the logits of an output head);
      ``None`` stores the state itself. Only used with ``return_all``.
    - ``strategy``: the strategy of the differentiated phase (see :func:`dyndepth.repeat`);
      the first ``n`` iterations run with ``"auto"`` when it is ``"auto"`` (the per-sample
      scheduler under ``vmap``) and with ``"while"`` otherwise.
    - ``checkpoints``: passed to the differentiated phase.
    - ``slots``: the per-sample scheduler's slot counts, for both phases (with
      ``strategy="auto"`` only; see :func:`dyndepth.repeat`): ``None`` chooses at run time
      among up to five counts (fewer for a large ``core``: at most 512 of its equations over
      the counts), each a compiled copy of ``core`` forward and backward; one
      count (``slots=S``) compiles one copy, a tuple those counts.
    - ``with_index``: call ``core(j, state, x)`` (``core(j, state, x, key)`` with ``key``), ``j``
      the iteration's index over all ``n + k`` iterations (an int32 scalar, each sample's own
      under ``vmap``: the number its key is folded with), as ``lax.fori_loop`` gives it.

    **Returns:** the final state, or ``(state, ys)`` with ``return_all``.

    **Transformations:** jit, vmap (per-sample ``n``, ``k``, keys, states), grad/vjp
    (``"auto"``, ``"checkpointed"``, ``"masked"``), jvp (every strategy).

    **Raises** (at trace time): ``TypeError`` if ``core``/``readout`` is not callable, if
    ``core`` changes the state's structure, shape or dtype, if ``key`` is not a PRNG key or
    ``n``/``k`` are not integers; ``ValueError`` for negative ``max_n``/``max_k``, concrete
    ``n``/``k`` out of range, non-scalar ``n``/``k`` or an unknown ``strategy``.
    """
    v.callable_arg(core, "core")
    if readout is not None:
        v.callable_arg(readout, "readout")
    return_all = v.bool_arg(return_all, "return_all")
    with_index = v.bool_arg(with_index, "with_index")
    max_n = v.static_int(max_n, "max_n")
    max_k = v.static_int(max_k, "max_k")
    n = v.count_arg(n, "n", "max_n", max_n)
    k = v.count_arg(k, "k", "max_k", max_k)
    v.strategy_arg(strategy)
    state = jax.tree_util.tree_map(jnp.asarray, state)

    def call(i, s, x, *kk):  # the user's core, given the iteration's index if it asks for it
        names, args = (["i", "state", "x"], [i, s, x]) if with_index else (["state", "x"], [s, x])
        return call_step(core, "core", names, args, kk[0] if kk else None)

    if key is not None:
        v.key_arg(key)
    s_n = _without_gradient(call, state, x, n, key, max_n, strategy, with_index, slots)
    out = readout if readout is not None else (lambda s: s)
    s_out, ys = _with_gradient(call, s_n, x, n, k, key, out if return_all else None, max_k,
                               strategy, checkpoints, slots)  # fmt: skip
    return (s_out, ys) if return_all else s_out


def _without_gradient(call: Callable, state: Any, x: Any, n: Any, key: Any, max_n: int,
                      strategy: str, with_index: bool, slots: Any) -> Any:  # fmt: skip
    """Phase 1: ``n`` iterations, nothing differentiated (the state itself if ``n == 0``)."""
    i_example = np.zeros((), np.int32)  # concrete, also under jit
    key_example = None if key is None else jax.random.fold_in(key, 0)
    kk_example = [] if key is None else [key_example]
    out_shape = jax.eval_shape(call, i_example, state, x, *kk_example)
    v.same_structure(state, out_shape, "core", "state")
    frozen = stopped(call, i_example, state, x, *kk_example)
    x_stopped = lax.stop_gradient(x)
    if with_index:

        def f1(i, s, *kk):
            return frozen(i, s, x_stopped, *kk)
    else:

        def f1(s, *kk):
            return frozen(i_example, s, x_stopped, *kk)

    s_n = repeat(
        f1,
        lax.stop_gradient(state),
        n,
        max_depth=max_n,
        key=key,
        strategy="auto" if strategy == "auto" else "while",
        with_index=with_index,
        # (another strategy's `slots` is refused by the differentiated phase, under its name)
        slots=slots if strategy == "auto" else None,
    )
    return jax.tree_util.tree_map(lambda a, b: jnp.where(n == 0, a, b), state, s_n)


def _with_gradient(call: Callable, s_n: Any, x: Any, n: Any, k: Any, key: Any,
                   readout: Callable | None, max_k: int, strategy: str,
                   checkpoints: int | None, slots: Any) -> tuple[Any, Any]:  # fmt: skip
    """Phase 2: ``k`` iterations with gradient; iteration ``n + j`` gets ``step_key(key, n +
    j)``. Returns the final state and the stacked ``readout`` of each (None without one)."""
    if key is not None:
        keys = KeySchedule.of(key)
        key_data = keys.data(key)

    def f2(carry, _):
        s, i = carry
        if key is None:
            s = call(i, s, x)
        else:
            s = call(i, s, x, keys.key_at(key_data, i))
        y = readout(s) if readout is not None else None
        return (s, i + 1), y

    (s_out, _), ys = scan(f2, (s_n, n), None, depth=k, length=max_k, strategy=strategy,
                          checkpoints=checkpoints, slots=slots)  # fmt: skip
    return s_out, ys
