"""Command-line plumbing shared by ``dyndepth demo``, ``eval`` and ``bench``: a parser whose
errors are one line, argument types that name the flag in their message, and Ctrl-C handling.

Ctrl-C: :class:`SigintGuard` replaces Python's ``KeyboardInterrupt`` while a command runs. The
first Ctrl-C only sets a flag; the command stops at its next safe point (between training steps,
between evaluation chunks, between benchmark rows), saves what it has (the demo writes a
checkpoint), and :func:`dyndepth_app.cli.main` prints one line and returns 130. A
``KeyboardInterrupt`` raised inside an XLA compilation and the interpreter teardown that follows
crashed the process (segmentation fault) in about half the trials; with the flag, nothing is
interrupted mid-call. A second Ctrl-C quits at once (``os._exit(130)``, no teardown), keeping the
last checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# `dyndepth demo --task` names renamed, still accepted for one release (old -> new).
RENAMED_TASKS = {"seed": "dropout-residual"}


def renamed(value, old_names, prog, what):
    """``value``, or its new name if ``old_names`` (old -> new) renamed it; an old name is still
    accepted for one release, with a warning on stderr naming the new one."""
    if value not in old_names:
        return value
    new = old_names[value]
    print(
        f"{prog}: warning: the {what} {value!r} is deprecated and will be removed in the next "
        f"release; use {new!r}",
        file=sys.stderr,
    )
    return new


def int_at_least(minimum):
    """An argparse ``type``: an integer ``>= minimum``."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(text):
    """An argparse ``type``: a finite float ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def int_list(minimum=1):
    """An argparse ``type``: a non-empty comma-separated list of integers ``>= minimum``."""

    def parse(text):
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of integers >= {minimum} (e.g. 32,64), "
                f"got {text!r}"
            )
        try:
            values = tuple(int(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of integers, got {text!r}"
            ) from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"every entry must be an integer >= {minimum}, got {text!r}"
            )
        return values

    parse.__name__ = "list of integers"
    return parse


class Interrupted(Exception):
    """Raised at a safe point after Ctrl-C; the message says what was kept."""


_current: SigintGuard | None = None


class SigintGuard:
    """Context manager: while active, Ctrl-C sets :func:`interrupt_requested` instead of raising
    ``KeyboardInterrupt``; a second Ctrl-C exits at once with status 130. Outside the main
    thread (where signal handlers cannot be installed) it does nothing."""

    def __init__(self, prog="dyndepth"):
        self.prog = prog
        self.requested = False
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame):
        if self.requested:
            sys.stdout.flush()
            sys.stderr.write(f"\n{self.prog}: second Ctrl-C: quitting now\n")
            sys.stderr.flush()
            os._exit(130)
        self.requested = True
        sys.stderr.write(
            f"\n{self.prog}: Ctrl-C: stopping at the next safe point (press again to quit now)\n"
        )
        sys.stderr.flush()

    def __enter__(self):
        global _current
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        self._outer, _current = _current, self
        return self

    def __exit__(self, *exc):
        global _current
        _current = self._outer
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
        return False


def interrupt_requested() -> bool:
    """Whether Ctrl-C was pressed under the active :class:`SigintGuard` (False without one)."""
    return _current is not None and _current.requested


def check_interrupt(what: str) -> None:
    """Raise :class:`Interrupted` (``what`` says where and what was kept) after a Ctrl-C."""
    if interrupt_requested():
        raise Interrupted(what)
