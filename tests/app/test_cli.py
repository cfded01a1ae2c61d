"""The command line: `dyndepth bench --quick` end to end, in-process; argument errors (one line,
exit status 2); resuming into a folder trained with another configuration; `dyndepth eval`'s
table; Ctrl-C during compilation and training (in a subprocess)."""

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading

import numpy as np
import pytest

from dyndepth_app import cli as _cli
from dyndepth_app import demo, train
from dyndepth_app.config import QUICK, Config, replace


def test_bench_quick_runs_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "bench.json"
    png = tmp_path / "plots" / "bench.png"  # the folder is created
    argv = ["bench", "core", "shared-depth", "--quick", "--repeats", "1"]
    assert _cli.main(argv + ["--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| dyndepth auto |" in text and "| scan+cond |" in text
    assert f"plot: {png}" in text
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")
    report = json.loads(out.read_text())
    rows = report["workloads"]["core"]
    names = [r["contender"] for r in rows]
    assert names[0] == "scan+cond" and "dyndepth auto" in names
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
    assert _cli.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--plot PNG" in text and "nothing is drawn without this option" in text
    assert "big-params" in text and "--max-temp-gib" in text


def test_bench_rejects_unknown_workload(capsys):
    assert _cli.main(["bench", "nope", "--quick"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_demo_dropout_residual_task_rejects_devices(capsys):
    assert _cli.main(["demo", "--task", "dropout-residual", "--devices", "2"]) == 2
    assert "--devices 2 applies to the prefix-sums training only" in capsys.readouterr().err


def test_renamed_task_and_workload_are_accepted_with_a_warning(capsys):
    """``--task seed`` and the ``seed`` workload, the old names, still work for one release."""
    assert _cli.main(["demo", "--task", "seed", "--devices", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        "dyndepth demo: warning: the --task 'seed' is deprecated and will be removed in the next "
        "release; use 'dropout-residual'"
    )
    assert "--task dropout-residual runs on one device" in err[1]  # read as the new name
    assert _cli.main(["bench", "seed", "nope"]) == 2  # the unknown name stops it before a run
    err = capsys.readouterr().err
    assert "warning: the workload 'seed' is deprecated" in err and "'nope'" in err


def test_import_dyndepth_does_not_import_the_app():
    """The library never imports the application (demo, bench, CLI), nor tqdm or matplotlib."""
    code = (
        "import dyndepth, dyndepth.nn, sys; "
        "bad = sorted(m for m in sys.modules if m.startswith('dyndepth_app') "
        "or m.split('.')[0] in ('tqdm', 'matplotlib')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of the --quick configuration after 2 steps, in its own --out folder."""
    out = tmp_path_factory.mktemp("tiny")
    cfg = replace(Config(), **{**QUICK, "steps": 2})
    train.train(cfg, str(out), log=lambda *a, **k: None)
    return out / "alpha=1.ckpt.npz"


def _bad_checkpoints(tmp_path, ckpt):
    corrupt = tmp_path / "corrupt.ckpt.npz"
    corrupt.write_bytes(b"not a zip file")
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.zeros(3))
    return {
        "missing": str(tmp_path / "nope.ckpt.npz"),
        "directory": str(ckpt.parent),
        "corrupt": str(corrupt),
        "foreign": str(foreign),
    }


@pytest.mark.parametrize("which", ["missing", "directory", "corrupt", "foreign"])
def test_eval_rejects_bad_checkpoints(tmp_path, tiny_checkpoint, capsys, which):
    path = _bad_checkpoints(tmp_path, tiny_checkpoint)[which]
    assert _cli.main(["eval", "--checkpoint", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dyndepth eval: error: argument --checkpoint:") and path in err
    assert "pickle" not in err, err  # numpy's advice to load a file unsafely is not for users
    if which == "directory":  # points at the checkpoint inside
        assert "alpha=1.ckpt.npz" in err
    if which == "corrupt":
        assert "is not a checkpoint (not an .npz archive)" in err, err


def test_version(capsys):
    from importlib.metadata import version

    assert _cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"dyndepth {version('dyndepth')} (jax {version('jax')})\n"


def test_every_flag_has_help():
    import argparse

    missing = []

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(_cli._parser(), "dyndepth")
    assert not missing, missing


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "--checkpoint", "X", "--iters", "-3"], "--iters"),
        (["eval", "--checkpoint", "X", "--iters", "0"], "--iters"),
        (["eval", "--checkpoint", "X", "--lengths", "16,,32"], "--lengths"),
        (["demo", "--batch", "0"], "--batch"),
        (["demo", "--width", "0"], "--width"),
        (["demo", "--max-iters", "0"], "--max-iters"),
        (["demo", "--eval-lengths", ""], "--eval-lengths"),
        (["demo", "--eval-lengths", "32,x"], "--eval-lengths"),
        (["demo", "--steps", "-5"], "--steps"),
        (["demo", "--quick", "--steps", "0"], "--steps"),
        (["demo", "--lr", "nan"], "--lr"),
        (["demo", "--lr", "-1e-3"], "--lr"),
        (["demo", "--train-length", "0"], "--train-length"),
        (["demo", "--devices", "0"], "--devices"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--max-temp-gib", "inf"], "--max-temp-gib"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_flag(tmp_path, capsys, argv, flag):
    argv = [a if a != "X" else str(tmp_path / "x.ckpt.npz") for a in argv]
    assert _cli.main(argv + ["--out", str(tmp_path)] if argv[0] == "demo" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"argument {flag}:" in err, err
    assert not (tmp_path / "alpha=1.ckpt.npz").exists()  # nothing trained


def test_quick_keeps_flags_given_explicitly():
    p = _cli._parser()
    cfg = demo.config_from_args(p.parse_args(["demo", "--quick", "--width", "12", "--steps", "7"]))
    assert (cfg.width, cfg.steps) == (12, 7)
    assert (cfg.max_iters, cfg.train_length) == (
        QUICK["max_iters"],
        QUICK["train_length"],
    )
    cfg = demo.config_from_args(p.parse_args(["demo", "--quick", "--eval-lengths", "8,40"]))
    assert cfg.eval_lengths == (8, 40) and cfg.width == QUICK["width"]


def test_resume_with_another_config_is_an_error(tiny_checkpoint, capsys):
    out = tiny_checkpoint.parent
    before = tiny_checkpoint.read_bytes()
    argv = ["demo", "--quick", "--steps", "2", "--no-control", "--out", str(out)]
    assert _cli.main(argv + ["--width", "12", "--lr", "0.01"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "width 8 (checkpoint) vs 12 (now)" in err and "lr 0.003 (checkpoint) vs 0.01" in err
    assert "--out" in err and "steps" not in err.split("configuration:")[1]
    assert tiny_checkpoint.read_bytes() == before  # nothing trained, nothing overwritten


def test_eval_table_marks_iterations_not_evaluated(tiny_checkpoint, capsys):
    M = QUICK["max_iters"]
    argv = ["eval", "--checkpoint", str(tiny_checkpoint), "--lengths", "8", "--iters", str(M - 1)]
    assert _cli.main(argv + ["--strings", "8"]) == 0
    text = capsys.readouterr().out
    header = next(ln for ln in text.splitlines() if ln.startswith("| run"))
    row = next(ln for ln in text.splitlines() if ln.startswith("| eval | 8 |"))
    cells = dict(zip(header.split("|")[1:-1], row.split("|")[1:-1], strict=True))
    cells = {k.strip(): v.strip() for k, v in cells.items()}
    assert cells[f"at M = {M}"] == "n/a"  # iteration M was not evaluated
    assert cells["at the last iteration"].endswith(f"({M - 1})")
    assert cells["strings"] == "8"
    assert "8M" not in text and "0.0% |" not in cells[f"at M = {M}"]


def _demo_process(out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "dyndepth_app", "demo", "--quick", "--no-control", "--out", str(out)]
        + list(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
    )


def _read_until(stream, pattern, proc, timeout=120):
    """Read ``stream`` (text, in a thread) until ``pattern`` matches; returns the match."""
    buf, found = [], threading.Event()

    def reader():
        while not found.is_set():
            ch = stream.read(1)
            if not ch:
                return
            buf.append(ch)
            if re.search(pattern, "".join(buf[-200:])):
                found.set()

    threading.Thread(target=reader, daemon=True).start()
    assert found.wait(timeout), (proc.poll(), "".join(buf)[-2000:])
    return re.search(pattern, "".join(buf[-200:]))


class _Terminal:
    """The reading end of a pty, unbuffered, as text; its end (EIO once the process exited)
    reads as ''."""

    def __init__(self, fd):
        self.fd = fd

    def read(self, n):
        try:
            return os.read(self.fd, n).decode(errors="replace")
        except OSError:
            return ""

    def read_all(self) -> str:
        out = []
        while chunk := self.read(4096):
            out.append(chunk)
        return "".join(out).replace("\r\n", "\n")


def test_ctrl_c_while_compiling_exits_cleanly_with_a_checkpoint(tmp_path):
    """Ctrl-C as soon as the demo has started (it is compiling): exit status 130, one line that
    says what was kept, no crash (a KeyboardInterrupt inside XLA's compiler made the interpreter
    segfault on exit in about half the trials)."""
    out = tmp_path / "run"
    proc = _demo_process(out)
    line = proc.stdout.readline()  # printed (and flushed) before the first compilation
    assert line.startswith("dyndepth demo:"), line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dyndepth demo: interrupted at step "), err[-3000:]
    assert "Fatal Python error" not in err and "Traceback" not in err
    assert "%|" not in err, err[-3000:]  # stderr is a pipe here: no progress-bar frames
    step = int(last.split("interrupted at step ")[1].split()[0])
    assert train.load_checkpoint(str(out / "alpha=1.ckpt.npz"))[2] == step


def test_ctrl_c_while_training_saves_the_steps_done(tmp_path):
    """Ctrl-C in the middle of training (the first periodic save would come at step 400): the
    checkpoint holds every step done, and the message says so. stderr is a terminal (a pty), as
    a user's is: the progress bar, which says how many steps are done, shows only there."""
    out = tmp_path / "run"
    steps = 4000
    master, terminal = pty.openpty()
    # 24 x 120 characters (a new pty has none, and tqdm would draw an empty bar)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    argv = [sys.executable, "-m", "dyndepth_app", "demo", "--quick", "--no-control", "--out",
            str(out), "--steps", str(steps)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=terminal, text=True)
    os.close(terminal)
    stream = _Terminal(master)
    try:
        _read_until(stream, rf"\b([3-9]|[1-9][0-9]+)/{steps}\b", proc)  # a few steps done
        proc.send_signal(signal.SIGINT)
        rest: list[str] = []  # read while the process writes, so that the pty never fills up
        reader = threading.Thread(target=lambda: rest.append(stream.read_all()), daemon=True)
        reader.start()
        proc.communicate(timeout=120)
        reader.join(timeout=30)
        err = "".join(rest)
    finally:
        os.close(master)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "checkpoint saved to" in last and "run the same command to resume" in last, last
    step = int(last.split("interrupted at step ")[1].split()[0])
    assert 3 <= step < steps // 10
    assert train.load_checkpoint(str(out / "alpha=1.ckpt.npz"))[2] == step


@pytest.mark.parametrize(
    "argv, module, entry",
    [
        (["demo"], "dyndepth_app.demo", "main_demo"),
        (["demo", "--task", "sudoku"], "dyndepth_app.sudoku", "main"),
        (["eval", "--checkpoint", "x.ckpt.npz"], "dyndepth_app.demo", "main_eval"),
    ],
)
def test_demos_use_jax_persistent_compilation_cache_unless_told_not(
    tmp_path, monkeypatch, argv, module, entry
):
    """On by default, in $XDG_CACHE_HOME/dyndepth/jax, set before the command compiles anything
    (the command itself is replaced by a stub that reads the setting); off with
    --no-compilation-cache; a cache folder the user gave JAX is kept."""
    import importlib

    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(
        importlib.import_module(module),
        entry,
        lambda a: seen.append(jax.config.jax_compilation_cache_dir) or 0,
    )
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert _cli.main(argv) == 0
        jax.config.update("jax_compilation_cache_dir", None)
        assert _cli.main([*argv, "--no-compilation-cache"]) == 0
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert _cli.main(argv) == 0
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert seen == [str(tmp_path / "dyndepth" / "jax"), None, str(tmp_path / "mine")]
    assert not (tmp_path / "dyndepth").exists()  # nothing compiled, nothing written
