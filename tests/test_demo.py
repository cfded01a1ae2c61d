"""`dyndepth demo --quick` end to end: training, evaluation, plot, JSON, checkpoint and eval."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

from dyndepth import _cli
from dyndepth import _demo as demo


def test_data_is_prefix_parity():
    x, t = demo.make_batch(jax.random.PRNGKey(0), 4, 10)
    bits = (np.asarray(x) + 0.5).astype(int)
    assert set(np.unique(bits)) <= {0, 1}
    np.testing.assert_array_equal(np.asarray(t), np.cumsum(bits, axis=1) % 2)


def test_conv_matches_lax_conv():
    x = jax.random.normal(jax.random.PRNGKey(1), (9, 3))
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 5))  # (kernel, cin, cout)
    ref = jax.lax.conv_general_dilated(
        x.T[None],
        jnp.transpose(w, (2, 1, 0)),
        (1,),
        "SAME",
        dimension_numbers=("NCH", "OIH", "NCH"),
    )[0].T
    tree_allclose(demo.conv(x, w.reshape(9, 5)), ref)


def test_think_gradient_is_truncated_to_the_last_k_iterations():
    params = demo.init_params(jax.random.PRNGKey(3), 8)
    x, t = demo.make_batch(jax.random.PRNGKey(4), 2, 6)

    def loss(p, n, k):
        logits = jax.vmap(lambda x: demo.think(p, x, n, k, 6))(x)
        return demo.cross_entropy(logits, t)

    def reference(p, n, k):
        def one(x):
            h = demo.project(p, x)
            for i in range(n + k):
                if i == n and n > 0:
                    h = jax.lax.stop_gradient(h)
                q = jax.lax.stop_gradient(p) if i < n else p
                h = demo.core(q, h, x)
            return demo.head(p, h)

        return demo.cross_entropy(jax.vmap(one)(x), t)

    for n, k in [(0, 3), (2, 2), (4, 1)]:
        tree_allclose(loss(params, n, k), reference(params, n, k))
        tree_allclose(jax.grad(loss)(params, n, k), jax.grad(reference)(params, n, k), rtol=1e-4)


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli.main(["demo", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert set(report["summary"]) == {"alpha=1", "alpha=0"}
    curves = report["curves"]["alpha=1"]
    assert set(curves) == {"8", "16"}
    assert all(len(c) == 8 * 4 for c in curves.values())
    assert all(0.0 <= a <= 1.0 for c in curves.values() for a in c)
    assert "step_seconds_per_iteration" in report["training"]["alpha=1"]
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "| alpha=1 | 16 |" in text

    # The checkpoint evaluates from the command line, at any length and iteration count.
    js = tmp_path / "eval.json"
    ckpt = out / "alpha=1.ckpt.npz"
    assert (
        _cli.main(
            [
                "eval",
                "--checkpoint",
                str(ckpt),
                "--lengths",
                "8,24",
                "--iters",
                "5",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    ev = json.loads(js.read_text())
    assert set(ev) == {"8", "24"} and all(len(v) == 5 for v in ev.values())


def test_resume_continues_the_same_run(tmp_path):
    cfg = demo.Config(width=8, train_length=6, max_iters=3, batch=8, steps=6, eval_batch=8)
    quiet = lambda *a, **k: None  # noqa: E731
    full, _ = demo.train(cfg, str(tmp_path / "a"), log=quiet)
    demo.train(cfg, str(tmp_path / "b"), stop_at=3, log=quiet)  # interrupted at step 3
    _, _, step, saved = demo.load_checkpoint(str(tmp_path / "b" / "alpha=1.ckpt.npz"))
    assert step == 3 and saved == cfg
    # Resuming continues the same run: same parameters as the uninterrupted one.
    resumed, _ = demo.train(cfg, str(tmp_path / "b"), log=quiet)
    tree_allclose(resumed, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_sample", [False, True])
def test_train_step_runs_per_batch_and_per_sample(per_sample):
    cfg = demo.Config(width=8, train_length=6, max_iters=3, batch=8, steps=2, per_sample=per_sample)
    params = demo.init_params(jax.random.PRNGKey(0), cfg.width)
    step = demo.make_train_step(cfg)
    p2, _, loss, gnorm, nk = step(
        params, demo.adamw_init(params), jax.random.PRNGKey(1), jnp.int32(0)
    )
    assert np.isfinite(float(loss)) and float(gnorm) > 0
    assert 1 <= float(nk) <= cfg.max_iters
    assert not bool(jnp.allclose(p2["recall"], params["recall"]))
