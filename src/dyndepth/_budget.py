"""The stored-carry budget: how many carries a reverse-mode loop keeps for its backward pass.

With ``checkpoints=None`` the forward pass stores the carry before every step, ``max_steps``
carries per sample, as long as the whole loop's buffer (every sample of the batch, every level
of ``vmap``) fits the budget (:func:`stored_carry_budget`); above it, as many
carries per sample as the budget holds, the backward pass recomputing the others (one more
forward step per step it does not store). Unless set, the budget is a quarter of one device's
memory where the backend reports it (TPUs, GPUs: the store itself then takes at most an eighth),
512 MiB where it does not (the CPU). The batch is only known when a batched loop runs (a
batching rule added it), so the budget is applied there: :func:`fitted` gives the loop a kernel
runs, and :func:`matching` the loop whose backward pass reads a buffer the forward pass stored.

Where writing a carry to fresh memory costs more than recomputing it (the CPU, for a step of
few operations per byte of carry: memory a program touches for the first time is written at
page-fault speed there), a loop stores at most :data:`SMALL_STORE` carries per sample whatever
the budget, so that a generous ``max_steps`` costs neither memory nor time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from . import _cost, _slots
from ._leaves import nbytes
from ._step import Loop

# Bytes one loop's stored carries may take with ``checkpoints=None``, its batch included, counting
# the two copies the compiled backward pass may hold (it writes recomputed carries into its own):
# a fraction of one device's memory where the backend reports it, else DEFAULT_BUDGET. On one TPU
# v5e (15.7 GiB), benchmarks/tpu_budget.py's long tail ran value_and_grad in 121.8 ms at 512 MiB
# and 77.6 ms at 4 GiB (2.1 GiB of temporary memory, less than jax.checkpoint + lax.scan's).
DEFAULT_BUDGET = 512 * 2**20
DEVICE_FRACTION = 1 / 4
_budget: list[int | None] = [None]  # None: the default

# How fast a backend writes memory a program touches for the first time: on the project's CPU
# machine about 1.3 GB/s (benchmarks/max_depth.py: 26 MiB of stored carries fill in 20 ms);
# accelerators write their memory at its bandwidth (taken as free here).
FRESH_BYTES_PER_SECOND = {"cpu": 1.3e9}
# Carries per sample a loop stores where recomputing a step is the cheaper (see above).
SMALL_STORE = 64
# A recomputed step costs about three steps in the backward pass (it runs as a step's vjp).
RECOMPUTE_ROWS = 3


def stored_carry_budget() -> int:
    """The bytes a loop traced now may store for its backward pass (see
    :func:`set_stored_carry_budget`)."""
    return default_budget() if _budget[0] is None else _budget[0]


def default_budget() -> int:
    """The budget of a loop traced now unless one is set: :data:`DEVICE_FRACTION` of the memory
    of a device of the platform it is lowered for, where that platform is this process's
    default backend and its devices report their memory; :data:`DEFAULT_BUDGET` otherwise (a
    CPU, or a program lowered for another platform than the one it is traced on)."""
    if _family(_cost.current_platform()) != _family(jax.default_backend()):
        return DEFAULT_BUDGET
    memory = device_memory()
    return DEFAULT_BUDGET if memory is None else max(DEFAULT_BUDGET, int(memory * DEVICE_FRACTION))


def _family(platform: str) -> str:
    """``"gpu"`` for the GPU platforms' names (a lowering platform says ``"cuda"``), else the
    name."""
    return "gpu" if platform in ("cuda", "rocm") else platform


@functools.cache
def device_memory() -> int | None:
    """Bytes one device of the default backend may allocate (``memory_stats()``'s
    ``bytes_limit``: on a GPU, what JAX's allocator was given), or None where it does not say."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except (RuntimeError, NotImplementedError):  # (a backend that cannot tell)
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def set_stored_carry_budget(nbytes: int | None) -> None:
    """Set how many bytes of carries a reverse-mode loop may store for its backward pass, its
    whole batch included (two copies counted); ``None`` restores the default: a quarter of one
    device's memory on a backend that reports it (TPUs, GPUs), 512 MiB elsewhere (the CPU).

    Below ``2 x batch x max_depth x carry`` bytes, a loop with ``checkpoints=None`` stores as
    many carries per sample as the budget holds and recomputes the others in its backward pass
    (``return_info``/``return_stats`` report the count). The budget is read when a loop is
    traced: a function ``jax.jit`` has already traced keeps the budget it was traced with. For
    one loop, :func:`stored_carry_budget_scope`.

    Raises ``TypeError`` for an ``nbytes`` that is not an int (or None) and ``ValueError`` for
    one below 1."""
    if nbytes is None:
        _budget[0] = None
        return
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"`nbytes` must be an int number of bytes or None, got {nbytes!r}")
    if nbytes < 1:
        raise ValueError(f"`nbytes` must be at least 1, got {nbytes}")
    _budget[0] = int(nbytes)


@contextlib.contextmanager
def stored_carry_budget_scope(nbytes: int | None) -> Iterator[None]:
    """:func:`set_stored_carry_budget` for the loops traced inside the ``with`` block only.

    Raises as :func:`set_stored_carry_budget`."""
    before = _budget[0]
    set_stored_carry_budget(nbytes)
    try:
        yield
    finally:
        _budget[0] = before


def checkpoints_for(loop: Loop, rows: int, platform: str | None = None,
                    per_sample: bool = True) -> int | None:  # fmt: skip
    """The carries per sample ``loop`` stores over ``rows`` samples with ``checkpoints=None``:
    ``None`` (every one) while they fit the budget (and :data:`SMALL_STORE` where that bounds
    them), else as many as fit, at least :func:`fewest_held`'s. ``per_sample``: whether the
    samples may stop at different steps (see :func:`stored_bytes`)."""
    carry = nbytes(loop.carry_avals)
    length = loop.max_steps
    fits = loop.budget // max(2 * rows * stored_bytes(loop, rows, platform, per_sample), 1)
    if _recompute_is_cheaper(loop, carry, platform):
        fits = min(fits, SMALL_STORE)
    if carry == 0 or length <= fits:
        return None
    return max(fits, fewest_held(length))


def stored_bytes(loop: Loop, rows: int, platform: str | None = None,
                 per_sample: bool = True) -> int:  # fmt: skip
    """Bytes one stored carry of ``loop`` over ``rows`` rows may take on ``platform`` (by
    default the one the loop is traced on, as :func:`_recompute_is_cheaper`): on a TPU, where
    the loop may run scheduled (samples that may stop at different steps, ``per_sample``, and
    :func:`dyndepth._slots.may_run_scheduled`), each array's last
    dimension padded to the lanes (:func:`dyndepth._cost.lane_padded_bytes`), since the TPU
    compiler may lay such a loop's store out with the carry's last dimension along them
    (compiled for a TPU v5e, value_and_grad over B=4096 carries of 16 floats, 6000 stored per
    sample in wrap-around slot counts, held 15 GiB of temporary memory for a 1.5 GiB store); a
    lockstep loop keeps its rows along the lanes. Elsewhere :func:`dyndepth._leaves.nbytes`."""
    platform = platform or jax.default_backend()
    scheduled = per_sample and _slots.may_run_scheduled(loop, rows, platform)
    if platform != "tpu" or not scheduled:
        return nbytes(loop.carry_avals)
    return sum(_cost.lane_padded_bytes(a.shape, a.dtype.itemsize) for a in loop.carry_avals)


def _recompute_is_cheaper(loop: Loop, carry_bytes: int, platform: str | None) -> bool:
    """Whether writing a carry to fresh memory costs more than recomputing its step, on
    ``platform``: by default the one the loop is traced on, not the one it is lowered for. The
    count decides the store's shape, which the loop's abstract evaluation (traced on the host)
    and its lowering (for the lowering platform) must agree on: a program lowered for a TPU on
    a CPU host stores as many carries as the host would."""
    platform = platform or jax.default_backend()
    cost = _cost.backend_cost(platform)
    rate = FRESH_BYTES_PER_SECOND.get(platform, math.inf)
    flops = _cost.jaxpr_flops(loop.step_jaxpr.jaxpr)
    row = max(flops / cost.flops_per_second, cost.row_floor_seconds)
    return carry_bytes / rate > RECOMPUTE_ROWS * row


def fewest_held(length: int) -> int:
    """The number of checkpoints ``K = ceil(length / S)``, ``S`` a power of two, whose carries
    with the two-level recompute buffers of :func:`recompute_slots` are fewest (the most
    checkpoints among equals): about ``3 x length ** (1/3)`` carries per sample, the least
    memory a loop can run in."""
    spacings = [2**e for e in range(max(length - 1, 1).bit_length() + 1)]
    options = [(-(-length // s), s) for s in spacings]
    held = [(k + sum(recompute_slots(s)), -k) for k, s in options]
    return -min(held)[1]


# A segment of checkpoints this long or longer is recomputed in two levels.
TWO_LEVEL_FROM = 64


def recompute_slots(segment: int) -> tuple[int, int]:
    """``(inner, sub)``: the two-level backward pass's buffers for segments of up to
    ``segment`` steps (a power of two): one of ``segment`` carries (``sub = 0``), or, from
    :data:`TWO_LEVEL_FROM` on, sub-checkpoints every ``inner`` steps (``inner`` the power of
    two nearest above ``sqrt(segment)``) and one sub-segment's carries."""
    if segment < TWO_LEVEL_FROM:
        return segment, 0
    inner = 2 ** -(-(segment.bit_length() - 1) // 2)
    return inner, segment // inner


_VARIANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _with_checkpoints(loop: Loop, checkpoints: int | None) -> Loop:
    """``loop`` storing ``checkpoints`` carries per sample; one object per count, so that
    what is traced per loop is traced once."""
    if checkpoints == loop.checkpoints:
        return loop
    variants = _VARIANTS.setdefault(loop, {})
    if checkpoints not in variants:
        variants[checkpoints] = dataclasses.replace(loop, checkpoints=checkpoints)
    return variants[checkpoints]


def every_carry(loop: Loop) -> Loop:
    """``loop`` storing every carry: the backward pass of a thinned store whose samples all
    kept every carry (stride 1: each sample's steps within the store's ``K`` slots, or the
    store written in schedule order, :mod:`dyndepth._store`) is this loop's. One object per
    loop (see :func:`_with_checkpoints`)."""
    return _with_checkpoints(loop, None)


def fitted(loop: Loop, batch: tuple, per_sample: bool = True) -> Loop:
    """The loop a kernel runs over ``batch`` (its levels, each with a ``size``): with
    ``checkpoints=None``, the checkpoints that keep every sample's stored carries within the
    budget; a count the user chose stays. A symbolic size (``jax.export``) counts as one
    sample: its rows are not known until the program runs. ``per_sample``: whether the rows
    may stop at different steps (see :func:`stored_bytes`)."""
    if loop.checkpoints is not None or loop.strategy not in ("auto", "checkpointed"):
        return loop
    rows = math.prod(level.size if isinstance(level.size, int) else 1 for level in batch)
    return _with_checkpoints(loop, checkpoints_for(loop, rows, per_sample=per_sample))


def matching(loop: Loop, buffer_leaf: Any) -> Loop:
    """The loop whose forward pass stored ``buffer_leaf`` (the stored carries of one carry
    leaf, checkpoint slots on its first axis: :mod:`dyndepth._store`)."""
    if loop.strategy not in ("auto", "checkpointed"):
        return loop
    slots = buffer_leaf.shape[0]
    if slots == loop.slots_stored:
        return loop
    return _with_checkpoints(loop, slots if slots < loop.max_steps else None)
