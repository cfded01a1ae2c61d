"""Test configuration: strict dtype promotion, float32 (x64 stays off), helpers on the path."""

from __future__ import annotations

import os
import sys

import jax
import pytest

# Strict promotion at import, before any test module builds an array: Python scalars mixed with
# arrays stay fine (weak types), but float32 mixed with int32 arrays is an error, so a loop that
# silently promotes a leaf fails loudly here.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_x64", False)

# ``from helpers import ...`` works under every pytest import mode.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def _strict_float32_session():
    """Keep the whole session on strict promotion and float32, and say so if a test changes it."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_enable_x64", False)
    yield
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    assert not jax.config.jax_enable_x64
