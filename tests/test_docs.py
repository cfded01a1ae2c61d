"""The documentation's code runs: every ```python block of README.md and docs/*.md, and every
example in the public docstrings.

The blocks of one page run in order in one namespace, as a reader runs them top to bottom; a
block whose preceding line is a marker comment runs differently:

- ``<!-- test: skip (reason) -->``: not run; the reason is required (the test fails without
  one). Kept for what the suite cannot do, e.g. several processes.
- ``<!-- test: devices=8 -->``: run in a fresh Python process with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 simulated CPU devices), together
  with the page's other blocks so marked, in their order, in one namespace of their own.

Code runs under JAX's default (standard) dtype promotion, as a reader's does, not the suite's
strict one. Docstring examples are the indented blocks after a line ending in ``Example::`` or
``Examples::``, and ``>>>`` doctests; they run with ``jax``, ``jnp``, ``dyndepth`` and ``key``
(``jax.random.key(0)``) defined.
"""

from __future__ import annotations

import doctest
import inspect
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import dyndepth
import dyndepth.nn

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    code: str
    marker: str  # "", "skip (...)" or "devices=8"

    def compiled(self):
        # Padded with newlines so that tracebacks give the line number in the page.
        return compile("\n" * (self.line - 1) + self.code, str(self.page), "exec")


def blocks(page: Path) -> list[Block]:
    """The ```python blocks of ``page``, with the marker on the line before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            prev = lines[i - 1] if i else ""
            m = _MARKER.match(prev.strip())
            found.append(Block(page, i + 2, "\n".join(lines[i + 1 : j]) + "\n",
                               m.group(1) if m else ""))  # fmt: skip
            i = j
        i += 1
    return found


def _check_markers(page_blocks: list[Block]) -> None:
    for b in page_blocks:
        if b.marker and b.marker != "devices=8" and not re.fullmatch(r"skip \(.+\)", b.marker):
            raise AssertionError(
                f"{b.page.name}:{b.line}: unknown marker {b.marker!r}; use "
                "'skip (the reason)' or 'devices=8'"
            )


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_code_runs(page):
    page_blocks = blocks(page)
    _check_markers(page_blocks)
    here = [b for b in page_blocks if not b.marker]
    multi = [b for b in page_blocks if b.marker == "devices=8"]
    if not here and not multi:
        pytest.skip(f"{page.name} has no python blocks to run")
    namespace = {"__name__": f"docs_{page.stem}"}
    with jax.numpy_dtype_promotion("standard"):
        for b in here:
            exec(b.compiled(), namespace)
    if multi:
        _run_on_8_devices(page, multi)


def _run_on_8_devices(page: Path, multi: list[Block]) -> None:
    script = "\n".join(
        f"exec(compile({chr(10) * (b.line - 1) + b.code!r}, {str(page)!r}, 'exec'))" for b in multi
    )
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"the devices=8 blocks of {page.name} failed:\n{proc.stdout}\n{proc.stderr}"
    )


def test_markers_are_few_and_explained():
    skipped = [b for p in PAGES for b in blocks(p) if b.marker.startswith("skip")]
    for b in skipped:
        assert re.fullmatch(r"skip \(.{10,}\)", b.marker), f"{b.page.name}:{b.line}"
    assert len(skipped) <= 3, [f"{b.page.name}:{b.line}" for b in skipped]


PUBLIC = [f"dyndepth.{n}" for n in dyndepth.__all__] + [
    f"dyndepth.nn.{n}" for n in dyndepth.nn.__all__
]


def _public_object(name: str):
    module = dyndepth.nn if name.startswith("dyndepth.nn.") else dyndepth
    return getattr(module, name.rsplit(".", 1)[1])


def _docstring_examples(doc: str) -> list[str]:
    lines = doc.splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.search(r"\bExamples?::\s*$", line):
            base = len(line) - len(line.lstrip())
            body = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= base:
                    break
                body.append(nxt)
            found.append(textwrap.dedent("\n".join(body)))
    return found


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples_run(name):
    doc = inspect.getdoc(_public_object(name)) or ""
    namespace = {"jax": jax, "jnp": jnp, "dyndepth": dyndepth, "key": jax.random.key(0)}
    with jax.numpy_dtype_promotion("standard"):
        for code in _docstring_examples(doc):
            exec(compile(code, f"<docstring of {name}>", "exec"), dict(namespace))
        parser = doctest.DocTestParser()
        test = parser.get_doctest(doc, dict(namespace), name, None, 0)
        if test.examples:
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            result = runner.run(test)
            assert result.failed == 0, f"{result.failed} doctest(s) of {name} failed"


def test_the_runner_finds_blocks():
    """The extraction itself: the README's quickstart is found, and a marker is read."""
    readme = blocks(ROOT / "README.md")
    assert any("dyndepth.repeat" in b.code for b in readme)
    assert _docstring_examples(inspect.getdoc(dyndepth.step_key))
