"""One process of a multi-process ``dyndepth demo``: the flags ``--coordinator HOST:PORT
--num-processes P --process-id I``, ``jax.distributed.initialize``, and the few points where
the processes must agree.

Every process runs the whole demo, the same program on the same numbers: the training steps run
on one mesh over all processes' devices (each device computes its rows of the global batch,
drawn from the replicated step key; see :mod:`~dyndepth._app.train`), and the evaluation runs
on each process's first device. Only process 0 prints and reads or writes files; what the other
processes need from a file (a checkpoint to resume) comes from process 0 by broadcast, so the
other hosts need not see the output folder. The other processes evaluate too, although nobody
reads their figures: this keeps every process busy until the end, where
``jax.distributed.shutdown`` waits for all of them (with a time limit that a long evaluation on
process 0 alone would exceed).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from jax.experimental import multihost_utils

from .args import int_at_least

FLAGS = ("--coordinator", "--num-processes", "--process-id")


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


def given(a) -> list[str]:
    """Which of the three flags the command line gives (none: a single-process run)."""
    return [f for f in FLAGS if getattr(a, f[2:].replace("-", "_"), None) is not None]


def check_flags(a) -> str | None:
    """The one-line error for an incomplete or inconsistent set of the three flags, or None."""
    present = given(a)
    missing = [f for f in FLAGS if f not in present]
    if missing and present:
        return f"{', '.join(present)} needs {' and '.join(missing)} (the three flags go together)"
    if not missing and a.process_id >= a.num_processes:
        return (
            f"argument --process-id: {a.process_id} is not below --num-processes "
            f"{a.num_processes} (ids run from 0 to {a.num_processes - 1})"
        )
    return None


def initialize(a) -> None:
    """Join the run. Must come before any other use of JAX in the process: the backends read
    the distributed client when they start."""
    # Collectives between CPU devices of different processes need an implementation; gloo comes
    # with jaxlib. The setting concerns the CPU backend only, so it is harmless on accelerators.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=a.coordinator, num_processes=a.num_processes, process_id=a.process_id
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
