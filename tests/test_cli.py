"""The command line: `dyndepth bench --quick` and `dyndepth demo` end to end, in-process."""

import json

import pytest

from dyndepth import _cli


def test_bench_quick_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        _cli.main(
            ["bench", "core", "shared-depth", "--quick", "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| dyndepth auto |" in text and "| seed scan+cond |" in text
    report = json.loads(out.read_text())
    rows = report["workloads"]["core"]
    names = [r["contender"] for r in rows]
    assert names[0] == "seed scan+cond" and "dyndepth auto" in names
    for r in rows:
        if r.get("missing"):  # Equinox is an optional extra
            assert r["contender"].startswith("equinox"), r
            continue
        assert r["fwd_rel_err"] < 1e-5, r
        if "grad_rel_err" in r:
            assert r["grad_rel_err"] < 1e-4, r
        assert r["executed"] >= r["useful"] > 0
    assert {r["depth"] for r in report["workloads"]["shared-depth"]} == {3, 12}


def test_bench_rejects_unknown_workload(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["bench", "nope", "--quick"])
    assert "unknown workload 'nope'" in capsys.readouterr().err
