"""The operands and outputs of the loop primitives, by name.

A primitive binds a flat list of operands; every rule that reads one names it here instead of
cutting the list by position. Each layout is a small frozen dataclass: ``split`` cuts a flat
sequence once, with the counts the primitive's parameters fix (the loop, its perturbation, its
residual plan), and ``flat`` joins it again in binding order. The same layout cuts a batching
rule's ``dims`` and a :class:`dyndepth._dispatch.Level`'s flags, so a rule reads
``flags.init[j]`` for the flag of ``init``'s leaf ``j``.

Binding order:

* ``loop_p``: :class:`LoopOperands` -> :class:`LoopOutputs` (with ``store``, the forward pass's
  :class:`Stored` part).
* ``lin_p``: :class:`LinOperands` (the loop's operands, its :class:`Residuals` when it keeps
  them, the tangents of the perturbed leaves) -> :class:`Tangents`.
* ``bwd_p``: :class:`BwdOperands` -> :class:`Cotangents`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ._derivative import Perturbed
from ._residuals import ResidualPlan
from ._step import Loop


class _Cursor:
    """Reads consecutive groups from a flat sequence; ``done`` checks nothing is left."""

    def __init__(self, flat: Sequence[Any]):
        self.flat, self.pos = list(flat), 0

    def group(self, count: int) -> list:
        part = self.flat[self.pos : self.pos + count]
        if len(part) != count:
            raise ValueError(f"operand list too short: {len(self.flat)} operands")
        self.pos += count
        return part

    def one(self) -> Any:
        return self.group(1)[0]

    def done(self) -> None:
        if self.pos != len(self.flat):
            raise ValueError(f"{len(self.flat) - self.pos} operands left over")


def _whole(flat: Sequence[Any], read: Callable[[_Cursor], Any]) -> Any:
    """``read`` over all of ``flat``: an error if it leaves operands over."""
    cut = _Cursor(flat)
    out = read(cut)
    cut.done()
    return out


def n_stored(plan: ResidualPlan | None) -> int:
    """How many stored-residual buffers a forward pass with ``plan`` keeps."""
    return 0 if plan is None else len(plan.stored)


@dataclasses.dataclass(frozen=True)
class LoopOperands:
    """``loop_p``'s operands: the step's consts, the stop predicate's consts, the carry's
    initial leaves, the ``xs`` leaves, the depth ``n`` and the key data ``kd``."""

    consts: list
    cconsts: list
    init: list
    xs: list
    n: Any
    kd: Any

    @staticmethod
    def read(cut: _Cursor, loop: Loop) -> LoopOperands:
        return LoopOperands(cut.group(loop.n_consts), cut.group(loop.n_cconsts),
                            cut.group(len(loop.carry_avals)), cut.group(len(loop.x_avals)),
                            cut.one(), cut.one())  # fmt: skip

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop) -> LoopOperands:
        return _whole(flat, lambda cut: LoopOperands.read(cut, loop))

    def flat(self) -> list:
        return [*self.consts, *self.cconsts, *self.init, *self.xs, self.n, self.kd]


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a forward pass bound with ``store`` keeps for the backward pass: the carry's
    checkpoints ``buf`` (one buffer per carry leaf), their ``stride``, per sample the slot count
    of a forward pass that wrote them in schedule order (``in_order``, 0 where they are kept per
    sample: :mod:`dyndepth._store`) and the stored-residual buffers ``ext`` of a residual
    plan."""

    buf: list
    stride: Any
    in_order: Any
    ext: list

    @staticmethod
    def read(cut: _Cursor, loop: Loop, n_ext: int) -> Stored:
        return Stored(cut.group(len(loop.carry_avals)), cut.one(), cut.one(), cut.group(n_ext))

    def flat(self) -> list:
        return [*self.buf, self.stride, self.in_order, *self.ext]


@dataclasses.dataclass(frozen=True)
class LoopOutputs:
    """``loop_p``'s outputs: the final carry, the stacked ys, the steps taken (per row, or one
    count), the loop statistics and, with ``store``, :class:`Stored`."""

    carry: list
    ys: list
    steps: Any
    stats: Any
    stored: Stored | None = None

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop, store: bool, n_ext: int = 0) -> LoopOutputs:
        return _whole(flat, lambda cut: LoopOutputs(
            cut.group(len(loop.carry_avals)), cut.group(len(loop.y_avals)), cut.one(), cut.one(),
            Stored.read(cut, loop, n_ext) if store else None))  # fmt: skip

    def flat(self) -> list:
        rest = [] if self.stored is None else self.stored.flat()
        return [*self.carry, *self.ys, self.steps, self.stats, *rest]


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the tangent and backward passes take from the forward pass: its steps and what it
    stored."""

    steps: Any
    stored: Stored

    @staticmethod
    def read(cut: _Cursor, loop: Loop, n_ext: int) -> Residuals:
        return Residuals(cut.one(), Stored.read(cut, loop, n_ext))

    def flat(self) -> list:
        return [self.steps, *self.stored.flat()]


@dataclasses.dataclass(frozen=True)
class LinOperands:
    """``lin_p``'s operands: the loop's, its :class:`Residuals` (``None`` unless the forward
    pass kept them), then the tangents of the perturbed consts, carry and xs leaves."""

    primal: LoopOperands
    res: Residuals | None
    t_consts: list
    t_init: list
    t_xs: list

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop, pert: Perturbed, plan: ResidualPlan | None,
              keep: bool) -> LinOperands:  # fmt: skip
        def read(cut):  # (in binding order: the loop's operands, then the residuals)
            primal = LoopOperands.read(cut, loop)
            res = Residuals.read(cut, loop, n_stored(plan)) if keep else None
            return LinOperands(primal, res, cut.group(sum(pert.consts)),
                               cut.group(sum(pert.carry)), cut.group(sum(pert.xs)))  # fmt: skip

        return _whole(flat, read)

    def flat(self) -> list:
        res = [] if self.res is None else self.res.flat()
        return [*self.primal.flat(), *res, *self.t_consts, *self.t_init, *self.t_xs]


@dataclasses.dataclass(frozen=True)
class Tangents:
    """``lin_p``'s outputs: the tangents of the perturbed carry and ys leaves."""

    carry: list
    ys: list

    @staticmethod
    def split(flat: Sequence[Any], pert: Perturbed) -> Tangents:
        return _whole(flat, lambda cut: Tangents(cut.group(sum(pert.carry)),
                                                 cut.group(sum(pert.ys))))  # fmt: skip

    def flat(self) -> list:
        return [*self.carry, *self.ys]


@dataclasses.dataclass(frozen=True)
class BwdOperands:
    """``bwd_p``'s operands: the step's consts, the xs, the key data, the forward pass's
    :class:`Residuals`, and the cotangents of the perturbed carry and ys leaves."""

    consts: list
    xs: list
    kd: Any
    res: Residuals
    ct_carry: list
    ct_ys: list

    @staticmethod
    def split(flat: Sequence[Any], loop: Loop, pert: Perturbed,
              plan: ResidualPlan | None) -> BwdOperands:  # fmt: skip
        return _whole(flat, lambda cut: BwdOperands(
            cut.group(loop.n_consts), cut.group(len(loop.x_avals)), cut.one(),
            Residuals.read(cut, loop, n_stored(plan)), cut.group(sum(pert.carry)),
            cut.group(sum(pert.ys))))  # fmt: skip

    def flat(self) -> list:
        return [*self.consts, *self.xs, self.kd, *self.res.flat(), *self.ct_carry, *self.ct_ys]


@dataclasses.dataclass(frozen=True)
class Cotangents:
    """``bwd_p``'s outputs: the cotangents of the perturbed consts, ``init`` and xs leaves."""

    consts: list
    init: list
    xs: list

    @staticmethod
    def split(flat: Sequence[Any], pert: Perturbed) -> Cotangents:
        return _whole(flat, lambda cut: Cotangents(cut.group(sum(pert.consts)),
                                                   cut.group(sum(pert.carry)),
                                                   cut.group(sum(pert.xs))))  # fmt: skip

    def flat(self) -> list:
        return [*self.consts, *self.init, *self.xs]
