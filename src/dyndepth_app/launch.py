"""``dyndepth launch``: a multi-process ``dyndepth demo`` on this machine, for trying the
several-process setup without several hosts.

``dyndepth launch --processes 2 --devices-per-process 2 -- demo --quick`` picks a free loopback
port and starts two processes of ``python -m dyndepth_app demo --quick --coordinator
127.0.0.1:PORT --num-processes 2 --process-id I``, each with two simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``, ``JAX_PLATFORMS=cpu``). Process 0's
output goes to the terminal; the others' go to a log file each, whose last lines are shown if
that process fails. When one process fails, the others are stopped (they would wait for it in
their next collective) and the launcher exits with its status, after a one-line error naming
it. Ctrl-C is passed on to every process, which all stop at the same training step.

It runs no JAX computation itself: the processes are plain subprocesses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .args import RENAMED_TASKS, Interrupted, int_at_least
from .processes import FLAGS

TAIL_LINES = 20


def add_arguments(p):
    p.add_argument(
        "--processes", type=int_at_least(1), default=2, metavar="P", help="processes (default 2)"
    )
    p.add_argument(
        "--devices-per-process",
        type=int_at_least(1),
        default=1,
        metavar="D",
        help="simulated CPU devices of each process (default 1)",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="keep the output of processes 1..P-1 in DIR/process-I.log (default: a temporary "
        "folder, removed at the end)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: the demo command, e.g. -- demo --quick (the launcher adds the flags "
        "of each process)",
    )


def check_command(command) -> str | None:
    """The one-line error for a command the launcher cannot run, or None."""
    if not command:
        return "no command: give it after --, e.g. dyndepth launch --processes 2 -- demo --quick"
    if command[0] != "demo":
        return f"it runs `dyndepth demo` only, got {' '.join(command)!r} after --"
    task = _task_of(command)
    if task in ("dropout-residual", *RENAMED_TASKS):
        return f"--task {task} runs on one device; the launcher runs the prefix-sums training"
    for arg in command:
        flag = arg.split("=", 1)[0]
        if flag in FLAGS:
            return f"{flag} is set by the launcher for each process; leave it out of the command"
    return None


def _task_of(command) -> str | None:
    """The value of ``--task`` in ``command`` (``--task X`` or ``--task=X``), or None."""
    for i, arg in enumerate(command):
        if arg == "--task" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    return None


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_argv(command, port, process_id, processes):
    return [
        sys.executable,
        "-m",
        "dyndepth_app",
        *command,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(processes),
        "--process-id",
        str(process_id),
    ]


def process_env(environ, devices_per_process, port):
    """The environment of each process: ``devices_per_process`` simulated CPU devices (replacing
    a device count already in ``XLA_FLAGS``), the CPU platform, and the coordinator listening
    on the loopback address only."""
    flags = [
        f
        for f in environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    return {
        **environ,
        "XLA_FLAGS": " ".join(flags),
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
    }


def main(a) -> int:
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    error = check_command(command)
    if error:
        print(f"dyndepth launch: error: {error}", file=sys.stderr)
        return 2
    port = free_port()
    env = process_env(os.environ, a.devices_per_process, port)
    argvs = [process_argv(command, port, i, a.processes) for i in range(a.processes)]
    with _log_dir(a.log_dir) as logs:
        paths = [None] + [os.path.join(logs, f"process-{i}.log") for i in range(1, a.processes)]
        return _run(argvs, env, paths, keep_logs=a.log_dir is not None)


@contextlib.contextmanager
def _log_dir(path):
    if path is None:
        with tempfile.TemporaryDirectory(prefix="dyndepth-launch-") as tmp:
            yield tmp
    else:
        os.makedirs(path, exist_ok=True)
        yield path


def _run(argvs, env, paths, *, keep_logs):
    procs, files, interrupts = [], [], []
    try:
        for argv, path in zip(argvs, paths, strict=True):
            files.append(None if path is None else open(path, "w"))  # None: this terminal
            procs.append(_start(argv, env, files[-1]))
        with _forward_sigint(procs, interrupts):
            failed = _wait(procs, interrupts)
        stopped = _stop(procs)
    finally:
        _stop(procs)  # after an error in the launcher itself
        for f in files:
            if f is not None:
                f.close()
    if interrupts:
        raise Interrupted(
            f"Ctrl-C passed on to the {len(procs)} processes; process 0 says above what it kept"
        )
    if failed is None:
        return 0
    i, code = failed
    if paths[i] is not None:
        _show_tail(i, paths[i])
    what = f"; stopped process(es) {', '.join(map(str, stopped))}" if stopped else ""
    where = f"; its output: {paths[i]}" if keep_logs and paths[i] else ""
    print(
        f"dyndepth launch: error: process {i} of {len(procs)} exited with status {code}"
        f"{what}{where}",
        file=sys.stderr,
    )
    return code if code > 0 else 1


def _start(argv, env, log):
    """One process, writing to ``log`` (None: to this terminal). In a session of its own, so
    that the terminal's Ctrl-C reaches the launcher alone, which passes each one on once (see
    :func:`_forward_sigint`)."""
    err = None if log is None else subprocess.STDOUT
    return subprocess.Popen(argv, env=env, stdout=log, stderr=err, start_new_session=True)


@contextlib.contextmanager
def _forward_sigint(procs, interrupts):
    """While the processes run, each Ctrl-C goes to all of them (a first one stops them at the
    same step, a second one at once) and is recorded in ``interrupts``."""

    def forward(signum, frame):
        interrupts.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    try:
        previous = signal.signal(signal.SIGINT, forward)
    except ValueError:  # not the main thread: Ctrl-C stays with the caller
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait(procs, interrupts, grace=10.0):
    """Wait until all processes exit; returns ``(id, status)`` of the first process that failed
    (the lowest id among those found failed at the same time), or None. After Ctrl-C every
    process stops by itself: wait for all."""
    first, deadline = None, None
    while any(p.poll() is None for p in procs):
        if first is None and not interrupts:
            failed = [
                (i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)
            ]
            if failed:
                # A usage error stops every process at once, each saying why: give the others
                # ``grace`` seconds to exit by themselves before stopping those that wait for
                # the failed one in a collective.
                first, deadline = failed[0], time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if first is None:
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        first = failed[0] if failed else None
    return first


def _stop(procs):
    """Stop the processes still running; returns their ids."""
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in running:
        procs[i].terminate()
    for i in running:
        try:
            procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait()
    return running


def _show_tail(i, path):
    with open(path, errors="replace") as fh:
        lines = fh.read().splitlines()[-TAIL_LINES:]
    for line in lines:
        print(f"[process {i}] {line}", file=sys.stderr)
