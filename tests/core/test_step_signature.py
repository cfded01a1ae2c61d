"""How the loops call the user's step: an error naming the loop argument that decides the call
(``key=``, ``keys=``, ``with_index=``) and the expected signature when the step's signature
takes neither form; a keyword-only ``key`` (Equinox's ``def f(x, *, key=None)``) called as a
keyword, with the same values and gradients as the positional step."""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import tree_allclose
from shared_lists import STRATEGIES

import dyndepth as dd
from dyndepth import nn

X = jnp.linspace(-1.0, 1.0, 3)
XS = jnp.stack([X, 2 * X, -X, X + 1])
DEPTHS = jnp.array([0, 1, 3, 5])
KEY = jax.random.key(0)
KEYS = jax.random.split(KEY, 4)
FIX_KEY = r"take the step's key last \(positionally, or as a keyword-only `key`"


def _no_key(c):
    return c + 1.0


def _with_key(c, k):
    return c + jax.random.normal(k, c.shape)


# name: (call, error type, pattern every message must match)
SIGNATURE_ERRORS = {
    "repeat-key-given-step-takes-carry": (
        lambda: dd.repeat(lambda c: c, X, 3, max_depth=5, key=KEY),
        rf"^`f` is called as `f\(carry, key\)` because `key=` is given, but its signature is "
        rf"`f\(c\)`: {FIX_KEY}.*or leave out `key=`",
    ),
    "repeat-no-key-step-takes-key": (
        lambda: dd.repeat(_with_key, X, 3, max_depth=5),
        r"^`f` is called as `f\(carry\)` because no `key=` is given, but its signature is "
        r"`f\(c, k\)`: give the loop `key=` if the step takes a key last",
    ),
    "repeat-with-index-step-takes-no-index": (
        lambda: dd.repeat(_with_key, X, 3, max_depth=5, key=KEY, with_index=True),
        r"^`f` is called as `f\(i, carry, key\)` because `key=` is given and "
        r"`with_index=True`.*take the step index first or drop `with_index`",
    ),
    "repeat-index-step-without-with-index": (
        lambda: dd.repeat(lambda i, c: c + i, X, 3, max_depth=5),
        r"^`f` is called as `f\(carry\)`.*`with_index=True` passes the step index first",
    ),
    "scan-step-takes-no-x": (
        lambda: dd.scan(lambda c: (c, None), X, None, depth=2, length=4),
        r"^`f` is called as `f\(carry, x\)` because no `key=` is given, but its signature is "
        r"`f\(c\)`",
    ),
    "scan-key-given-step-takes-carry-and-x": (
        lambda: dd.scan(lambda c, x: (c + x, None), X, XS, depth=2, key=KEY),
        rf"^`f` is called as `f\(carry, x, key\)` because `key=` is given.*{FIX_KEY}",
    ),
    "scan-with-index": (
        lambda: dd.scan(lambda c, x: (c + x, None), X, XS, depth=2, with_index=True),
        r"^`f` is called as `f\(i, carry, x\)` because no `key=` is given and `with_index=True`",
    ),
    "while_loop-key-given": (
        lambda: dd.while_loop(lambda c: c[0] < 3, _no_key, X, max_steps=5, key=KEY),
        rf"^`body_fun` is called as `body_fun\(carry, key\)` because `key=` is given.*{FIX_KEY}",
    ),
    "repeat_batched-keys-given": (
        lambda: dd.repeat_batched(_no_key, XS, DEPTHS, max_depth=5, keys=KEYS),
        r"^`f` is called as `f\(carry, key\)` because `keys=` is given.*or leave out `keys=`",
    ),
    "vmap-repeat-key-given": (
        lambda: jax.vmap(lambda x, d, k: dd.repeat(_no_key, x, d, max_depth=5, key=k))(
            XS, DEPTHS, KEYS
        ),
        r"^`f` is called as `f\(carry, key\)` because `key=` is given",
    ),
    "recurrent_depth-key-given": (
        lambda: nn.recurrent_depth(lambda s, x: s + x, X, X, n=1, k=1, max_n=2, max_k=2, key=KEY),
        rf"^`core` is called as `core\(state, x, key\)` because `key=` is given.*{FIX_KEY}",
    ),
    "recurrent_depth-no-x": (
        lambda: nn.recurrent_depth(lambda s: s, X, X, n=1, k=1, max_n=2, max_k=2),
        r"^`core` is called as `core\(state, x\)` because no `key=` is given",
    ),
    "halting-key-given": (
        lambda: nn.halting(lambda s: (s, 0.5, s), X, max_steps=3, key=KEY),
        rf"^`step_fn` is called as `step_fn\(state, key\)` because `key=` is given.*{FIX_KEY}",
    ),
}


@pytest.mark.parametrize("name", list(SIGNATURE_ERRORS))
def test_step_signature_errors_name_the_deciding_argument(name):
    call, pattern = SIGNATURE_ERRORS[name]
    with pytest.raises(TypeError, match=pattern) as info:
        call()
    # the step's own signature is in the message, and Python's count of arguments is not
    assert "positional argument" not in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)  # Python's error, kept as the cause


def test_halting_step_error_does_not_offer_with_index():
    """``nn.halting`` has no ``with_index``: its message does not suggest it."""
    with pytest.raises(TypeError) as info:
        SIGNATURE_ERRORS["halting-key-given"][0]()
    assert "with_index" not in str(info.value)


def test_type_error_inside_the_step_is_not_rewritten():
    def step(c):
        return c + "text"  # a TypeError from inside the step: its arguments bound

    with pytest.raises(TypeError, match="unsupported operand") as info:
        dd.repeat(step, X, 2, max_depth=3)
    assert "is called as" not in str(info.value)


def test_step_without_a_readable_signature_raises_pythons_error():
    """``jnp.tanh`` has a signature; a callable without one gets Python's own error."""

    class NoSignature:
        __signature__ = "not a signature"  # inspect.signature raises TypeError

        def __call__(self, c):
            return c

    with pytest.raises(TypeError, match="positional argument"):
        dd.repeat(NoSignature(), X, 2, max_depth=3, key=KEY)
    with pytest.raises(TypeError, match=re.escape("`f` is called as `f(carry, key)`")):
        dd.repeat(jnp.tanh, X, 2, max_depth=3, key=KEY)


# ----------------------------------------------------------------------------- keyword-only key


def _keyword_step(c, *, key=None):  # Equinox's convention
    return c + 0.5 * jnp.tanh(c) * jax.random.normal(key, c.shape)


def _positional_step(c, key):
    return _keyword_step(c, key=key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keyword_only_key_runs_like_a_positional_key(strategy):
    def loss(step, X):
        one = lambda x, d, k: dd.repeat(step, x, d, max_depth=5, key=k, strategy=strategy)
        return jnp.sum(jax.vmap(one)(X, DEPTHS, KEYS) ** 2)

    tree_allclose(loss(_keyword_step, XS), loss(_positional_step, XS))
    if strategy != "while":  # no reverse mode
        tree_allclose(jax.grad(lambda X: loss(_keyword_step, X))(XS),
                      jax.grad(lambda X: loss(_positional_step, X))(XS))  # fmt: skip


def test_keyword_only_key_in_every_loop():
    """``scan``, ``while_loop``, ``repeat_batched`` (``keys=``), ``with_index``, and the ``nn``
    layers that take a step with a key."""

    def kw_scan(c, x, *, key):
        return _keyword_step(c + x, key=key), c

    def pos_scan(c, x, key):
        return kw_scan(c, x, key=key)

    tree_allclose(dd.scan(kw_scan, X, XS, depth=3, key=KEY),
                  dd.scan(pos_scan, X, XS, depth=3, key=KEY))  # fmt: skip
    cond = lambda c: c[0] < 2.0
    tree_allclose(dd.while_loop(cond, _keyword_step, X, max_steps=6, key=KEY),
                  dd.while_loop(cond, _positional_step, X, max_steps=6, key=KEY))  # fmt: skip
    batched = dict(max_depth=5, keys=KEYS)
    tree_allclose(dd.repeat_batched(_keyword_step, XS, DEPTHS, **batched),
                  dd.repeat_batched(_positional_step, XS, DEPTHS, **batched))  # fmt: skip

    def kw_index(i, c, *, key):
        return _keyword_step(c + i.astype(c.dtype), key=key)

    indexed = dict(max_depth=5, key=KEY, with_index=True)
    pos_index = lambda i, c, key: kw_index(i, c, key=key)
    tree_allclose(dd.repeat(kw_index, X, 3, **indexed), dd.repeat(pos_index, X, 3, **indexed))

    def core(s, x, *, key=None):
        return _keyword_step(s + 0.1 * x, key=key)

    rd = dict(n=1, k=2, max_n=2, max_k=3, key=KEY)
    pos_core = lambda s, x, key: core(s, x, key=key)
    tree_allclose(nn.recurrent_depth(core, X, X, **rd), nn.recurrent_depth(pos_core, X, X, **rd))

    def halt_step(s, *, key):
        s = _keyword_step(s, key=key)
        return s, jax.nn.sigmoid(s[0]), s

    kw = nn.halting(halt_step, X, max_steps=4, key=KEY)
    pos = nn.halting(lambda s, key: halt_step(s, key=key), X, max_steps=4, key=KEY)
    tree_allclose(tuple(kw), tuple(pos))
