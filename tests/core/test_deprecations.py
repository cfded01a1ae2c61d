"""Spellings kept for one release with a ``DeprecationWarning``, and what replaces them.

- ``while_loop(return_steps=..., return_stats=...)``: ``return_info=True`` returns
  ``(carry, info)``, ``info`` a dict with ``"steps"``, ``"iterations"`` and
  ``"executed_sample_steps"``.
- ``dyndepth demo --task seed``: ``--task dropout-residual``; ``dyndepth bench seed``:
  ``dyndepth bench dropout-residual``.
"""

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import tree_allclose

import dyndepth as dd

LIMITS = jnp.array([0.0, 1.0, 2.5, 7.0])


def cond(c):
    return c[0] < c[1]


def body(c):
    return c.at[0].add(1.0)


def run(limit, **kwargs):
    return dd.while_loop(cond, body, jnp.stack([0.0, limit]), max_steps=6, **kwargs)


@pytest.mark.parametrize("strategy", ["auto", "checkpointed", "while"])
@pytest.mark.parametrize("batched", [False, True])
def test_return_info_holds_what_the_deprecated_flags_returned(strategy, batched):
    def new(limit):
        return run(limit, strategy=strategy, return_info=True)

    def old(limit):
        return run(limit, strategy=strategy, return_steps=True, return_stats=True)

    if batched:
        new, old = jax.vmap(new), jax.vmap(old)
    limits = LIMITS if batched else LIMITS[2]
    carry, info = new(limits)
    with pytest.warns(DeprecationWarning):
        carry_old, steps, stats = old(limits)
    tree_allclose(carry, carry_old)
    assert set(info) == {"steps", "iterations", "executed_sample_steps", "backward_iterations",
                         "backward_executed_sample_steps", "stored_carries"}  # fmt: skip
    tree_allclose(info["steps"], steps)
    tree_allclose({k: info[k] for k in stats}, stats)
    expected = jnp.minimum(jnp.ceil(limits), 6).astype(jnp.int32)
    tree_allclose(info["steps"], expected)


def test_return_info_of_the_masked_loop_has_steps_and_no_work_figures():
    carry, info = jax.vmap(lambda t: run(t, strategy="masked", return_info=True))(LIMITS)
    tree_allclose(info["steps"], jnp.array([0, 1, 3, 6], jnp.int32))
    assert all(info[k] is None for k in info if k != "steps")
    with pytest.raises(ValueError, match="`return_stats`=True reports the work"):
        with pytest.warns(DeprecationWarning):
            run(2.0, strategy="masked", return_stats=True)


@pytest.mark.parametrize("name", ["return_steps", "return_stats"])
def test_deprecated_flags_warn_at_the_callers_line(name):
    with pytest.warns(DeprecationWarning, match=rf"`{name}` is deprecated.*return_info=True") as w:
        out = run(2.0, **{name: True})
    assert w[0].filename == __file__  # the warning points at the user's call
    assert isinstance(out, tuple) and len(out) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(2.0, return_info=True)  # the new spelling warns nothing
        run(2.0)


@pytest.mark.parametrize("name", ["return_steps", "return_stats"])
def test_return_info_with_a_deprecated_flag_is_an_error(name):
    with pytest.raises(ValueError, match=rf"`return_info` replaces `{name}`"):
        with pytest.warns(DeprecationWarning):
            run(2.0, return_info=True, **{name: True})


def test_deprecated_flags_are_still_checked():
    with pytest.raises(TypeError, match="`return_steps` must be a static Python bool"):
        run(2.0, return_steps="yes")
    with pytest.raises(TypeError, match="`return_info` must be a static Python bool"):
        run(2.0, return_info=1)
