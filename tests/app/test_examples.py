"""Every script in examples/ runs (smoke tests against the installed package)."""

import runpy
from pathlib import Path

import jax.numpy as jnp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_dropout_residual_example_prints_batch_shape(capsys):
    ns = runpy.run_path(str(EXAMPLES / "dropout_residual.py"), run_name="not_main")
    out = ns["main"]()
    assert out.shape == (32, 64)
    assert "(32, 64)" in capsys.readouterr().out
    assert bool(jnp.all(jnp.isfinite(out)))
