"""One process of a multi-process ``dyndepth demo``: the flags ``--coordinator HOST:PORT
--num-processes P --process-id I``, ``jax.distributed.initialize``, and the few points where
the processes must agree.

Every process runs the whole demo, the same program on the same numbers: the training steps run
on one mesh over all processes' devices (each device computes its rows of the global batch,
drawn from the replicated step key; see :mod:`~dyndepth_app.train`), and the evaluation runs
on each process's first device. Only process 0 prints and reads or writes files; what the other
processes need from a file (a checkpoint to resume) comes from process 0 by broadcast, so the
other hosts need not see the output folder. The other processes evaluate too, although nobody
reads their figures: this keeps every process busy until the end, where
``jax.distributed.shutdown`` waits for all of them (with a time limit that a long evaluation on
process 0 alone would exceed).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from .args import check_interrupt, int_at_least, positive_float

FLAGS = ("--coordinator", "--num-processes", "--process-id")
# Seconds a process waits to join the run (JAX's own limit, after which it aborts, is 300).
DEFAULT_TIMEOUT = 300.0


def host_port(text):
    """An argparse ``type``: ``HOST:PORT`` with a port in 1..65535."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.1:1234), got {text!r}"
        )
    return text


def add_arguments(p):
    p.add_argument(
        "--coordinator",
        type=host_port,
        metavar="HOST:PORT",
        help="one process of a multi-process run: the address of process 0 (it listens on "
        "PORT), the same for every process; needs --num-processes and --process-id",
    )
    p.add_argument(
        "--num-processes", type=int_at_least(1), metavar="P", help="processes in the run"
    )
    p.add_argument(
        "--process-id",
        type=int_at_least(0),
        metavar="I",
        help="this process, 0..P-1; process 0 alone prints and writes the output folder",
    )
    p.add_argument(
        "--coordinator-timeout",
        type=positive_float,
        metavar="SECONDS",
        help=f"with --coordinator: give up joining the run after SECONDS (default "
        f"{DEFAULT_TIMEOUT:g}), with a one-line error",
    )


def given(a) -> list[str]:
    """Which of the three flags the command line gives (none: a single-process run)."""
    return [f for f in FLAGS if getattr(a, f[2:].replace("-", "_"), None) is not None]


def check_flags(a) -> str | None:
    """The one-line error for an incomplete or inconsistent set of the three flags, or None."""
    present = given(a)
    missing = [f for f in FLAGS if f not in present]
    if getattr(a, "coordinator_timeout", None) is not None and not present:
        return "--coordinator-timeout applies to a multi-process run (with --coordinator)"
    if missing and present:
        return f"{', '.join(present)} needs {' and '.join(missing)} (the three flags go together)"
    if not missing and a.process_id >= a.num_processes:
        return (
            f"argument --process-id: {a.process_id} is not below --num-processes "
            f"{a.num_processes} (ids run from 0 to {a.num_processes - 1})"
        )
    return None


class JoinFailed(Exception):
    """The process could not join the run; the message is one line naming the address."""


def initialize(a, *, progress_every: float = 10.0, first_progress: float = 2.0) -> None:
    """Join the run: ``jax.distributed.initialize``, within ``--coordinator-timeout`` seconds.
    Must come before any other use of JAX in the process: the backends read the distributed
    client when they start.

    JAX's own wait cannot be stopped: a coordinator that never answers blocks it, Ctrl-C does
    not reach Python, and at its time limit JAX aborts the process with a stack trace. So the
    call runs in a thread of its own (with a time limit past ours) while this thread waits:
    it says on stderr what it waits for (after ``first_progress`` seconds, then every
    ``progress_every``), stops at Ctrl-C (raises :class:`~dyndepth_app.args.Interrupted`),
    and after ``--coordinator-timeout`` seconds raises :class:`JoinFailed`. Either way the
    blocked thread remains: the caller must end the process with ``os._exit`` (as
    ``dyndepth demo`` does), since JAX's exit handlers would wait for it. Once joined, the CPU
    collectives connect at once, quietly (:func:`_connect_quietly`).
    """
    # Collectives between CPU devices of different processes need an implementation; gloo comes
    # with jaxlib. The setting concerns the CPU backend only, so it is harmless on accelerators.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = getattr(a, "coordinator_timeout", None) or DEFAULT_TIMEOUT
    done: list[BaseException | None] = []

    def join():
        try:
            jax.distributed.initialize(
                coordinator_address=a.coordinator,
                num_processes=a.num_processes,
                process_id=a.process_id,
                initialization_timeout=int(timeout) + 60,  # ours comes first
            )
            done.append(None)
        except BaseException as e:  # reported by the waiting thread
            done.append(e)

    who = f"process {a.process_id} of {a.num_processes}"
    thread = threading.Thread(target=join, name="dyndepth-join", daemon=True)
    start = time.monotonic()
    thread.start()
    next_note = first_progress
    while True:
        thread.join(0.1)
        if done:
            if done[0] is not None:
                raise done[0]
            _connect_quietly()
            return
        waited = time.monotonic() - start
        check_interrupt(
            f"{who}: stopped while waiting for the coordinator at {a.coordinator}; "
            "nothing was started"
        )
        if waited >= timeout:
            raise JoinFailed(
                f"{who} could not join the run at --coordinator {a.coordinator} within "
                f"{timeout:g} s (--coordinator-timeout): {_diagnosis(a)}"
            )
        if waited >= next_note:
            print(
                f"dyndepth demo: {who}: waiting for {_waiting_for(a)} at {a.coordinator} "
                f"({waited:.0f} s of {timeout:g} s; Ctrl-C to stop)",
                file=sys.stderr,
                flush=True,
            )
            next_note += progress_every


def _connect_quietly() -> None:
    """Connect the CPU collectives between the processes now, with this process's stdout (file
    descriptor 1) sent to /dev/null: gloo prints a line per connection ("[Gloo] Rank 0 is
    connected to 1 peer ranks. ...") that tells a user nothing. The training's collectives
    then reuse the connection."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        multihost_utils.sync_global_devices("dyndepth: joined")
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _waiting_for(a) -> str:
    if a.process_id == 0:
        return f"the other {a.num_processes - 1} process(es) to join"
    return "the coordinator (process 0)"


def _diagnosis(a) -> str:
    """Why the join may have failed, from what a plain TCP connection finds at the address."""
    if a.process_id == 0:
        return (
            f"not all of the other {a.num_processes - 1} process(es) joined (are they started, "
            "with the same --coordinator and --num-processes?)"
        )
    host, _, port = a.coordinator.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
            pass
    except OSError as e:
        return (
            f"nothing accepts connections there ({e.strerror or type(e).__name__}; is process 0 "
            "started, and is the address right?)"
        )
    return (
        "the address accepts connections, but no JAX coordinator answered, or not all "
        f"{a.num_processes} processes joined"
    )


def is_primary() -> bool:
    """Whether this process prints and writes (process 0; always true on one process)."""
    return jax.process_index() == 0


def run_log(log=None):
    """The log of a run: ``log`` (default: ``print``, flushed) on process 0, nothing on the
    others."""
    if not is_primary():
        return lambda *args: None
    return log or (lambda *args: print(*args, flush=True))


def from_primary(tree):
    """``tree`` (arrays or numbers, of the same shapes on every process) as process 0 has it,
    as numpy arrays; a collective that every process must call at the same point."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(np.asarray, tree)
    return multihost_utils.broadcast_one_to_all(tree)


def on_any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on some process, so that all processes take the same branch; a
    collective that every process must call at the same point."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
