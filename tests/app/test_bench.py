"""`dyndepth bench` internals: the big-params and long-tail rows, the memory guard, the plot."""

import pytest

from dyndepth_app import bench as _bench


def _check_rows(rows, tol_f=1e-5, tol_g=1e-4):
    for r in rows:
        if r.get("missing"):  # Equinox is an optional extra
            assert r["contender"].startswith("equinox"), r
            continue
        assert r["fwd_rel_err"] < tol_f, r
        if "grad_rel_err" in r:
            assert r["grad_rel_err"] < tol_g, r
        assert r["executed"] >= r["useful"] > 0


@pytest.mark.slow
def test_big_params_workload_quick_rows_agree():
    w = _bench.WORKLOADS["big-params"]
    assert (w.dim, w.layer) == (1024, "tanh-dropout") and w.notes
    rows = _bench.run_workload(_bench.quick(w), 1, progress=lambda *a, **k: None)
    names = [r["contender"] for r in rows]
    assert names == [c.name for c in _bench.CONTENDERS]
    _check_rows(rows)
    # the scan + cond baseline under vmap broadcasts W to the batch: the largest temp memory
    baseline = rows[0]["grad_temp_bytes"]
    assert all(r["grad_temp_bytes"] < baseline for r in rows[1:] if "grad_temp_bytes" in r)
    # masked loops run every sample to the batch's deepest (the baseline: to max_depth)
    by = {r["contender"]: r for r in rows}
    assert by["scan+cond"]["executed"] == 8 * 12
    assert by["jax.checkpoint scan+cond"]["executed"] == 8 * 12


def test_long_tail_lists_checkpointed_rows():
    w = _bench.WORKLOADS["long-tail"]
    names = [c.name for c in _bench.contenders_for(w)]
    assert names[: len(_bench.CONTENDERS)] == [c.name for c in _bench.CONTENDERS]
    assert names[len(_bench.CONTENDERS) :] == [
        "dyndepth auto checkpoints=16",
        "dyndepth repeat_batched checkpoints=16",
    ]
    q = _bench.quick(w)
    assert q.checkpoints == 4 < q.max_depth  # the quick rows thin their checkpoints too
    extra = _bench.checkpointed_contenders(q.checkpoints)
    rows = _bench.run_workload(
        q, 1, contenders=[_bench.CONTENDERS[0], *extra], progress=lambda *a, **k: None
    )
    assert [r["contender"] for r in rows][1:] == [c.name for c in extra]
    _check_rows(rows)
    text = _bench.table(rows, w.notes)
    assert "| dyndepth repeat_batched checkpoints=4 |" in text and "masked over the batch" in text


def test_max_temp_guard_skips_with_a_note():
    q = _bench.quick(_bench.WORKLOADS["core"])
    baseline, batched = _bench.CONTENDERS[0], _bench.CONTENDERS[-1]
    rows = _bench.run_workload(
        q, 1, contenders=[baseline, batched], progress=lambda *a, **k: None, max_temp_bytes=1
    )
    r = rows[0]
    assert "grad_s" not in r and r["grad_note"].startswith("not run: XLA temp")
    assert r["grad_temp_bytes"] > 1  # the memory is still reported
    text = _bench.table(rows)
    assert "| scan+cond |" in text and "not run: XLA temp" in text


def test_table_names_a_reference_other_than_the_first_row():
    rows = [
        dict(contender="a", fwd_note="not run", fwd_compile_s=0.1, executed=4, useful=2),
        dict(
            contender="b",
            fwd_s=0.001,
            fwd_rel_err=0.0,
            fwd_ref="b",
            fwd_compile_s=0.1,
            executed=2,
            useful=2,
        ),
    ]
    text = _bench.table(rows)
    assert "| a | not run |" in text
    assert "rel. diff of outputs is against `b`: `a` was not run." in text


def _report():
    def row(name, grad_s, mem, **kw):
        return dict(contender=name, grad_s=grad_s, grad_temp_bytes=mem, **kw)

    shared = [
        dict(contender=n, depth=d, fwd_s=d * 1e-4, grad_s=d * 3e-4, batch=8, dim=8, max_depth=12)
        for n in ("scan+cond", "dyndepth auto")
        for d in (3, 12)
    ]
    core = [
        row("scan+cond", 0.4, 5e8),
        dict(contender="lax.while_loop", fwd_s=0.001),  # forward only: not in the bars
        dict(contender="equinox checkpointed", missing="not installed"),
        row("dyndepth repeat_batched", 0.01, 6e6),
    ]
    big = [
        dict(contender="scan+cond", grad_note="not run: ...", grad_temp_bytes=3e9),
        row("dyndepth repeat_batched", 0.05, 7e6),
        row("dyndepth repeat_batched checkpoints=16", 0.07, 2e6),
    ]
    return {"header": "h", "workloads": {"core": core, "big-params": big, "shared-depth": shared}}


@pytest.mark.parametrize(
    "keep", [("core", "big-params", "shared-depth"), ("shared-depth",), ("core",)]
)
def test_plot_writes_a_png(tmp_path, keep):
    report = _report()
    report["workloads"] = {k: v for k, v in report["workloads"].items() if k in keep}
    path = tmp_path / "sub" / "bench.png"
    _bench.plot(report, str(path))
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")
