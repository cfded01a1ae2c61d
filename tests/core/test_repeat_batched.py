"""``dyndepth.repeat_batched``'s argument errors (its scheduling: test_schedule.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import expect_errors

import dyndepth as dd


def _f(c):
    return c


def _fk(c, k):
    return c


BATCH_X = jnp.zeros((3, 2))
BATCH_D = jnp.zeros((3,), jnp.int32)

REPEAT_BATCHED_ERRORS = {
    "depths-2d": (dict(depths=jnp.zeros((3, 1), jnp.int32)), ValueError, r"`depths`.*\(3, 1\)"),
    "depths-float": (dict(depths=jnp.zeros((3,))), TypeError, r"`depths`.*integer dtype"),
    "depths-scalar-float": (dict(depths=2.0), TypeError, r"`depths` must be an integer array"),
    "depths-scalar-out-of-range": (
        dict(depths=5),
        ValueError,
        r"`depths` must lie in \[0, max_depth\] = \[0, 4\], got 5$",
    ),
    "depths-out-of-range": (
        dict(depths=jnp.array([1, 9, 0])),
        ValueError,
        r"`depths`.*\[0, 4\], got 9 at batch index 1",
    ),
    "inits-mismatched-batch": (
        dict(inits={"a": BATCH_X, "b": jnp.zeros((2, 2))}),
        ValueError,
        r"leading batch axis of size 3.*inits\['b'\] has shape \(2, 2\)",
    ),
    "keys-count": (
        dict(f=_fk, keys=jax.random.split(jax.random.key(0), 2)),
        ValueError,
        r"`keys` needs a leading batch axis of size 3",
    ),
    "keys-float": (dict(f=_fk, keys=jnp.zeros((3, 2))), TypeError, r"`keys\[0\]` must be a PRNG"),
    "f-not-callable": (dict(f=None), TypeError, r"`f` must be callable"),
    "f-changes-shape": (dict(f=lambda c: c[:1]), TypeError, r"float32\[2\].*float32\[1\]"),
    "max_depth-negative": (dict(max_depth=-2), ValueError, r"`max_depth` must be >= 0"),
    "max_depth-float": (dict(max_depth=1e9), TypeError, r"`max_depth` must be a static Python"),
    "max_depth-beyond-int32": (
        dict(max_depth=2**31),
        ValueError,
        r"`max_depth` must be <= 2\*\*31",
    ),
    "slots-zero": (dict(slots=0), ValueError, r"`slots` must be >= 1, got 0"),
    "slots-unknown-rule": (
        dict(slots="time"),
        ValueError,
        r"`slots` must be None, \"work\", a slot count or a sequence of them, got 'time'",
    ),
    "checkpoints-negative": (dict(checkpoints=-1), ValueError, r"`checkpoints` must be >= 1"),
}


def _call_repeat_batched(overrides):
    kwargs = dict(f=_f, inits=BATCH_X, depths=BATCH_D, max_depth=4)
    kwargs.update(overrides)
    f, inits, depths = kwargs.pop("f"), kwargs.pop("inits"), kwargs.pop("depths")
    dd.repeat_batched(f, inits, depths, **kwargs)


def test_repeat_batched_errors():
    expect_errors(REPEAT_BATCHED_ERRORS, list(REPEAT_BATCHED_ERRORS), _call_repeat_batched)
