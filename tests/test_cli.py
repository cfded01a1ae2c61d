"""The command line: `dyndepth bench --quick` and `dyndepth demo` end to end, in-process."""

import json
import subprocess
import sys

import pytest

from dyndepth._app import cli as _cli


def test_bench_quick_runs_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "bench.json"
    png = tmp_path / "plots" / "bench.png"  # the folder is created
    argv = ["bench", "core", "shared-depth", "--quick", "--repeats", "1"]
    assert _cli.main(argv + ["--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| dyndepth auto |" in text and "| seed scan+cond |" in text
    assert f"plot: {png}" in text
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")
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


def test_bench_help_documents_plot(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--plot PNG" in text and "nothing is drawn without this option" in text
    assert "big-params" in text and "--max-temp-gib" in text


def test_bench_rejects_unknown_workload(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["bench", "nope", "--quick"])
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_demo_seed_task_rejects_devices(capsys):
    assert _cli.main(["demo", "--task", "seed", "--devices", "2"]) == 2
    assert "--devices 2 applies to the prefix-sums training only" in capsys.readouterr().err


def test_import_dyndepth_does_not_import_the_app():
    """The library never imports the application (demo, bench, CLI), nor tqdm or matplotlib."""
    code = (
        "import dyndepth, dyndepth.nn, sys; "
        "bad = sorted(m for m in sys.modules if m.startswith('dyndepth._app') "
        "or m.split('.')[0] in ('tqdm', 'matplotlib')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
