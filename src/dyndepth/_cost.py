"""The scheduler's time model: what one loop iteration costs on a backend.

An iteration of a scheduled loop over ``S`` slots costs ``fixed + S x row`` seconds: a fixed
part (launching the iteration's kernels, the loop's own bookkeeping, and reading the step's
shared operands, its weights, which every iteration reads once whatever its rows) and a part
per row (the step on one sample). With ``C(S)`` iterations, a schedule takes
``C(S) x (fixed + S x row)``; only the ratio matters for choosing ``S``, so the model is one
number, the fixed cost in rows: ``fixed_rows = fixed / row``. Minimizing executed
sample-steps is the same model with ``fixed_rows = 0``.

``row`` is estimated from the step's floating-point operations (``2 x m x n x k`` per matrix
product, one per element of anything else), floored by the least a row costs on the backend
(small steps are bound by memory and launches, not arithmetic). The constants below were fitted
to measurements: the GPU's on one NVIDIA H200 (``repeat_batched`` forward, steps of width 256
and 1024, the workloads of ``benchmarks/gpu.py``: ``fixed_rows`` about 2,000-3,000), the CPU's on
the project's 2-core machine (width 64, ``benchmarks/slot_sweep.py``: about 20). The rate at
which an iteration reads the shared operands: on the CPU fitted to a width-256 step's forward
iteration, about 20 us whatever its rows for 256 KiB of weights (``measure_iteration_cost``
fits it too); on the GPU the H200's memory bandwidth, rounded down from its nominal 4.8 TB/s,
not measured.

A scheduled iteration (fewer slots than rows) also moves each row's data in and out of its
slot (gathers and scatters) where a lockstep one, every row at one shared step, moves slices:
``moved_row_seconds`` per row, in rows ``moved_rows = moved / row``, so that lockstep costs
``C x (fixed_rows + B)`` and ``S`` slots ``C(S) x (fixed_rows + S x (1 + moved_rows))``. On
the CPU and the GPU it is left at 0 (not measured apart). On a TPU it is what decides: one TPU
v5e (``benchmarks/tpu_slot_costs.py``) moved a row for about 20 ns whatever its width (16 to
512 floats), beside 0.2-12 ns for the step itself in lockstep, so that 2,048 slots of a
width-16 step ran 19x slower than lockstep on uniform depths while doing the same iterations
(the GPU's constants chose them). The TPU's constants below are that chip's.

The constants are those of the platform a program is lowered for (:func:`current_platform`):
a program lowered for a TPU on a CPU host (``lowering_platforms=("tpu",)``, or a deviceless
compile for a TPU topology) gets the TPU's slot counts. The checkpoint count chosen under the
stored-carry budget is decided earlier, when the loop is traced, from the default backend's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class IterationCost:
    """A backend's costs: per loop iteration ``fixed_seconds`` plus the step's shared operands
    (its weights) read once, ``shared_bytes / bytes_per_second``; per row the larger of
    ``row_flops / flops_per_second`` and ``row_floor_seconds``, and in a scheduled iteration
    (fewer slots than rows) ``moved_row_seconds`` more: moving the row's data in and out of its
    slot (gathers and scatters), which a lockstep iteration, whose rows all take one shared
    step, does as slices. The default ``bytes_per_second`` (infinite) leaves the weights out,
    the default ``moved_row_seconds`` (0) the moves."""

    fixed_seconds: float
    flops_per_second: float
    row_floor_seconds: float
    bytes_per_second: float = math.inf
    moved_row_seconds: float = 0.0

    def fixed_rows(self, row_flops: float, shared_bytes: float = 0.0) -> float:
        """The fixed cost of an iteration in rows of a step of ``row_flops`` operations whose
        operands shared by the rows take ``shared_bytes``."""
        row = max(row_flops / self.flops_per_second, self.row_floor_seconds)
        fixed = self.fixed_seconds + shared_bytes / self.bytes_per_second
        return fixed / row if row > 0 else 0.0

    def moved_rows(self, row_flops: float) -> float:
        """What moving a row in and out of its slot costs a scheduled iteration, in rows of a
        step of ``row_flops`` operations."""
        row = max(row_flops / self.flops_per_second, self.row_floor_seconds)
        return self.moved_row_seconds / row if row > 0 else 0.0


_GPU = IterationCost(fixed_seconds=30e-6, flops_per_second=2.8e14, row_floor_seconds=10e-9,
                     bytes_per_second=4e12)  # fmt: skip
BACKEND_COSTS: dict[str, IterationCost] = {
    "cpu": IterationCost(
        fixed_seconds=2.7e-6,
        flops_per_second=5.5e10,
        row_floor_seconds=2e-9,
        bytes_per_second=1.5e10,
    ),  # fmt: skip
    "gpu": _GPU,
    "cuda": _GPU,
    "rocm": _GPU,
    # One TPU v5e (benchmarks/tpu_slot_costs.py, value_and_grad, per forward and backward
    # iteration): lockstep 2-3 us plus 0.2-12 ns a row for widths 16-512 (a forward step's
    # flops at about 3.5e13 a second); a scheduled iteration 3-4.5 us plus 20-31 ns a row,
    # about 20 ns a row more than lockstep's whatever the width; weights read at 740-790 GB/s
    # (benchmarks/tpu.py's measured constants at width 1024).
    "tpu": IterationCost(
        fixed_seconds=3e-6,
        flops_per_second=3.5e13,
        row_floor_seconds=2e-10,
        bytes_per_second=7.5e11,
        moved_row_seconds=2e-8,
    ),  # fmt: skip
}


_DEFAULTS = dict(BACKEND_COSTS)


# Set while a loop's kernel is traced for a lowering to one platform (see lowering_for).
_LOWERING_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dyndepth_lowering_platform", default=None
)


@contextlib.contextmanager
def lowering_for(platform: str | None) -> Iterator[None]:
    """While a kernel is traced for a program lowered for ``platform`` (None: unknown, or
    several): the time model is that platform's, not the host's (a program lowered for a TPU
    on a CPU host gets the TPU's slot counts)."""
    token = _LOWERING_PLATFORM.set(platform)
    try:
        yield
    finally:
        _LOWERING_PLATFORM.reset(token)


def current_platform() -> str:
    """The platform whose costs apply here: the one being lowered for, else the default
    backend's."""
    return _LOWERING_PLATFORM.get() or jax.default_backend()


def conditionals_on_device() -> bool:
    """Whether a conditional in a loop's body is cheap on the platform a kernel is traced for
    (:func:`current_platform`): not on a GPU, whose XLA runtime reads a conditional's predicate
    on the host, a wait every iteration."""
    return current_platform() not in ("gpu", "cuda", "rocm")


def keeps_loop_state_in_fast_memory() -> bool:
    """Whether the platform a kernel is traced for keeps a loop's state in fast memory where a
    conditional's output would leave it out: a TPU, whose compiler placed a weight's cotangent
    out of the chip's fast memory when a conditional chose among loops (see
    :func:`dyndepth._dispatch._chains`)."""
    return current_platform() == "tpu"


# A TPU lays an array's last dimension along its 128 lanes, padded to fill them.
TPU_LANES = 128
# Above this many bytes (a store padded to the lanes), moving a store is worth avoiding at the
# price of a kernel every iteration (see rows_on_lanes).
_MOVE_WORTH_A_KERNEL = 64 * 2**20


def lane_padded_bytes(shape: tuple, itemsize: int) -> int:
    """Bytes of an array of ``shape`` with its last dimension rounded up to a TPU's lanes (a
    scalar as it is)."""
    if not shape:
        return itemsize
    return math.prod(shape[:-1]) * (-(-shape[-1] // TPU_LANES) * TPU_LANES) * itemsize


def rows_on_lanes(shape: tuple, dtype: Any) -> bool:
    """Whether a store of ``shape`` (slot-major, ``(K, B, ...)``) is large and, on the platform
    a kernel is traced for, laid out with its rows along the lanes: on a TPU, where a last
    dimension short of the lanes makes the compiler put the rows there rather than pad it,
    while a loop that reads a slot into the step, or scatters rows into the store, wants the
    carry's last dimension there. The compiler then moves the whole store: before the loop, to
    read one slot per iteration (a copy padded to the lanes, at 16 floats 8 times the store);
    every iteration, to scatter rows (on a TPU v5e, 7 ms an iteration for a 250 MiB store).
    Only where the store padded to the lanes exceeds 64 MiB: below, moving it costs less than
    avoiding it (a kernel every iteration)."""
    if current_platform() != "tpu" or len(shape) < 3 or shape[-1] % TPU_LANES == 0:
        return False
    return lane_padded_bytes(shape, np.dtype(dtype).itemsize) > _MOVE_WORTH_A_KERNEL


def backend_cost(platform: str | None = None) -> IterationCost:
    """The costs of ``platform`` (:func:`current_platform`'s when None; an unknown one takes
    the GPU's: an accelerator pays per iteration)."""
    return BACKEND_COSTS.get(platform or current_platform(), _GPU)


def set_iteration_cost(platform: str, cost: IterationCost | None) -> None:
    """Set the time model the scheduler uses on ``platform`` (``"cpu"``, ``"gpu"``, ``"cuda"``,
    ``"rocm"``, ``"tpu"``, or the name ``jax.default_backend()`` gives the backend in use), or
    restore the measured default with ``None``.

    The model is read when a loop is traced for the default backend, so set it before the first
    call of a jitted function (one already compiled keeps its slot counts). A cost of
    ``IterationCost(fixed_seconds=0.0, flops_per_second=1.0, row_floor_seconds=1.0)`` makes the
    time rule minimize executed sample-steps; ``slots="work"`` does that with a bound.

    With several processes (``jax.distributed``), every process takes process 0's cost: the
    slot counts a loop compiles follow it, and the processes of one program must compile the
    same (a process whose own cost differs gets a ``UserWarning`` saying so). So call it on
    every process, as any multi-process JAX computation, with ``measure_iteration_cost()``'s
    result or a cost of your own.

    Raises ``TypeError`` for a ``cost`` that is not an :class:`IterationCost` (or a field that is
    not a real number), ``ValueError`` for an unknown ``platform``, a NaN, infinite or negative
    ``fixed_seconds``, ``row_floor_seconds`` or ``moved_row_seconds``, or a NaN, zero or
    negative rate (``flops_per_second``, ``bytes_per_second``; infinite is allowed: that cost
    is left out).
    """
    _check_platform(platform)
    if cost is not None:
        if not isinstance(cost, IterationCost):
            raise TypeError(f"`cost` must be a dyndepth.IterationCost or None, got {cost!r}")
        for field, rate in (("fixed_seconds", False), ("row_floor_seconds", False),
                            ("moved_row_seconds", False), ("flops_per_second", True),
                            ("bytes_per_second", True)):  # fmt: skip
            _check_field(cost, field, rate)
    cost = _process_zeros(platform, cost)
    BACKEND_COSTS[platform] = _DEFAULTS.get(platform, _GPU) if cost is None else cost


def _process_zeros(platform: str, cost: IterationCost | None) -> IterationCost | None:
    """Process 0's ``cost`` for ``platform`` (``None``: the default), on every process; the
    identity with one process."""
    if jax.process_count() == 1:
        return cost
    mine = _encode(platform, cost)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(mine))
    if np.array_equal(agreed, mine):
        return cost
    if agreed[0] != mine[0]:
        raise ValueError(
            f"set_iteration_cost: process {jax.process_index()} sets `platform`={platform!r}, "
            "process 0 another one; call it with the same platform on every process"
        )
    theirs = None if not agreed[1] else IterationCost(*agreed[2:].view(np.float64).tolist())
    described = lambda c: f"the default {_DEFAULTS.get(platform, _GPU)}" if c is None else str(c)
    warnings.warn(
        f"dyndepth.set_iteration_cost: process {jax.process_index()}'s cost for {platform!r}, "
        f"{described(cost)}, differs from process 0's, {described(theirs)}; every process "
        "uses process 0's, so that all of them compile the same slot counts",
        stacklevel=3,
    )
    return theirs


def _encode(platform: str, cost: IterationCost | None) -> np.ndarray:
    """``[crc32(platform), has cost, the cost's floats as float64 bits]`` as uint32 words
    (a broadcast of float64 values would round them to float32 without x64)."""
    fields = [f.name for f in dataclasses.fields(IterationCost)]
    values = [0.0 if cost is None else float(getattr(cost, f)) for f in fields]
    bits = np.asarray(values, np.float64).view(np.uint32)
    head = np.asarray([zlib.crc32(platform.encode()), cost is not None], np.uint32)
    return np.concatenate([head, bits])


def _check_platform(platform: Any) -> None:
    known = sorted(set(_DEFAULTS) | {jax.default_backend()})
    if not isinstance(platform, str) or platform not in known:
        raise ValueError(f"`platform` must be one of {known}, got {platform!r}")


def _check_field(cost: IterationCost, field: str, rate: bool) -> None:
    """A time (finite, >= 0) or a rate (> 0, infinite allowed): else an error naming it."""
    value = getattr(cost, field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`cost.{field}` must be a real number, got {value!r}")
    if rate and not value > 0:
        raise ValueError(f"`cost.{field}` must be > 0 (math.inf leaves it out), got {value!r}")
    if not rate and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`cost.{field}` must be finite and >= 0, got {value!r}")


# ----------------------------------------------------------------------------- step flops


def jaxpr_flops(jaxpr: Any) -> float:
    """Floating-point operations of one evaluation of ``jaxpr`` (a core ``Jaxpr``): matrix
    products count ``2 x`` their multiply-adds, any other equation one per output element; a
    nested jaxpr (a call, a branch, a loop body) counts once, its largest branch for a
    conditional."""
    total = 0.0
    for eqn in jaxpr.eqns:
        subs = _nested(eqn)
        if subs:
            counts = [jaxpr_flops(s) for s in subs]
            total += max(counts) if eqn.primitive.name == "cond" else sum(counts)
        elif eqn.primitive.name == "dot_general":
            total += _dot_flops(eqn)
        else:
            total += sum(_size(v.aval) for v in eqn.outvars)
    return total


def jaxpr_equations(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` (a core ``Jaxpr``), each nested jaxpr's counted (every branch of
    a conditional): how much there is to compile in a copy of it."""
    return sum(1 + sum(jaxpr_equations(s) for s in _nested(eqn)) for eqn in jaxpr.eqns)


def _nested(eqn: Any) -> list:
    """The core jaxprs in an equation's parameters (a call's, each branch of a conditional)."""
    subs = [_core_jaxpr(v) for v in eqn.params.values()]
    subs += [_core_jaxpr(b) for v in eqn.params.values() if isinstance(v, tuple) for b in v]
    return [s for s in subs if s is not None]


def _core_jaxpr(value: Any) -> Any:
    """The core jaxpr inside a parameter (a ``ClosedJaxpr`` or a ``Jaxpr``), else None."""
    inner = getattr(value, "jaxpr", value)
    return inner if hasattr(inner, "eqns") else None


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _dot_flops(eqn: Any) -> float:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    k = math.prod(lhs[d] for d in contract)
    return 2.0 * k * sum(_size(v.aval) for v in eqn.outvars)
