"""The documentation's code runs: every ```python block of README.md and docs/*.md, and every
example in the public docstrings.

The blocks of one page run in order in one namespace, as a reader runs them top to bottom; a
block whose preceding line is a marker comment runs differently:

- ``<!-- test: skip (reason) -->``: not run; the reason is required (the test fails without
  one). Kept for what the suite cannot do, e.g. several processes.
- A ```` ```text ```` block right after a code block is what that code prints: the test
  compares them, numbers to a relative 1e-3 (``outputs_match``).
- ``<!-- test: devices=8 -->``: run in a fresh Python process with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 simulated CPU devices), together
  with the page's other blocks so marked, in their order, in one namespace of their own.

Every gradient the code computes is checked (:class:`GradientGuard`): a concrete result of
``jax.grad``, ``jax.value_and_grad``, ``jax.jacrev`` or ``jax.hessian`` (and of ``jit`` or ``vmap``
of one) must be finite and not zero everywhere, so that an example cannot pass by comparing two
zero gradients, or print ``inf``.

Code runs under JAX's default (standard) dtype promotion and with the scheduler's measured time
model, as a reader's does, not the suite's strict promotion and test cost model
(tests/conftest.py). Docstring examples are the indented blocks after a line ending in
``Example::`` or ``Examples::``, and ``>>>`` doctests; they run with ``jax``, ``jnp``,
``dyndepth`` and ``key`` (``jax.random.key(0)``) defined.
"""

from __future__ import annotations

import contextlib
import doctest
import functools
import inspect
import io
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

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    code: str
    marker: str  # "", "skip (...)" or "devices=8"
    output: str | None = None  # the ```text block right after it: what the code prints

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
            k = j + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k < len(lines) and lines[k].strip() == "```text":
                end = k + 1
                while lines[end].strip() != "```":
                    end += 1
                found[-1].output = "\n".join(lines[k + 1 : end]) + "\n"
                j = end
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


class GradientGuard:
    """While installed, every concrete gradient that ``jax.grad``, ``jax.value_and_grad``,
    ``jax.jacrev`` or ``jax.hessian`` returns (directly, or through ``jax.jit`` or ``jax.vmap`` of
    such a function) is checked: every floating leaf finite, and not every entry of every leaf
    zero. Results inside a trace (tracers) are left to the outer call. ``checked`` counts the
    gradients checked."""

    def __init__(self):
        self.checked = 0
        self._saved: dict[str, object] = {}

    def check(self, grads, what: str) -> None:
        leaves = [x for x in jax.tree_util.tree_leaves(grads) if hasattr(x, "dtype")]
        leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
        if not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
            return
        bad = [x for x in leaves if not bool(jnp.all(jnp.isfinite(x)))]
        assert not bad, f"{what} returned a non-finite gradient: {bad[0]}"
        assert any(bool(jnp.any(x != 0)) for x in leaves), (
            f"{what} returned a gradient that is zero everywhere (does the function use the "
            "argument it is differentiated with respect to?)"
        )
        self.checked += 1

    def _checking(self, fn, pick, what):
        """``fn``, whose results' ``pick(out)`` is checked; attributes (``.lower``) pass through."""
        guard = self

        class Checked:
            _pick, _what = staticmethod(pick), what

            def __call__(self, *args, **kwargs):
                out = fn(*args, **kwargs)
                guard.check(pick(out), what)
                return out

            def __getattr__(self, name):
                attr = getattr(fn, name)
                if name in ("lower", "compile"):  # jit(grad(f)).lower(...).compile()(...)
                    return lambda *a, **k: guard._checking(attr(*a, **k), pick, what)
                return attr

        checked = Checked()
        functools.update_wrapper(checked, fn)  # the signature, for static_argnums and names
        return checked

    def install(self) -> None:
        def gradient_of(name):
            original = self._saved.setdefault(name, getattr(jax, name))

            def differentiate(fun, *args, **kwargs):
                aux = kwargs.get("has_aux", False)
                if name == "value_and_grad":  # ((value, aux), grad) or (value, grad)
                    pick = lambda out: out[1]
                else:  # (grad, aux) or grad
                    pick = (lambda out: out[0]) if aux else (lambda out: out)
                return self._checking(original(fun, *args, **kwargs), pick, f"jax.{name}")

            return differentiate

        def transform_of(name):
            original = self._saved.setdefault(name, getattr(jax, name))

            def transform(fun, *args, **kwargs):
                out = original(fun, *args, **kwargs)
                if hasattr(type(fun), "_what"):  # jit or vmap of a gradient: check it too
                    return self._checking(out, fun._pick, f"jax.{name} of {fun._what}")
                return out

            return transform

        for name in ("grad", "value_and_grad", "jacrev", "hessian"):
            setattr(jax, name, gradient_of(name))
        for name in ("jit", "vmap"):
            setattr(jax, name, transform_of(name))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(jax, name, original)
        self._saved.clear()


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def outputs_match(got: str, want: str, rtol: float = 1e-3) -> bool:
    """Whether printed text ``got`` is ``want``, up to whitespace at line ends and numbers
    within ``rtol`` (float32 sums may differ in the last digits between machines)."""
    got_lines = [ln.rstrip() for ln in got.strip().splitlines()]
    want_lines = [ln.rstrip() for ln in want.strip().splitlines()]
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines, strict=True):
        if _NUMBER.sub("#", g) != _NUMBER.sub("#", w):
            return False
        for a, b in zip(_NUMBER.findall(g), _NUMBER.findall(w), strict=True):
            if abs(float(a) - float(b)) > rtol * max(abs(float(b)), 1e-12):
                return False
    return True


def _run_block(b: Block, namespace: dict) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(b.compiled(), namespace)
    sys.stdout.write(printed.getvalue())
    if b.output is not None:
        assert outputs_match(printed.getvalue(), b.output), (
            f"{b.page.name}:{b.line}: the code printed\n{printed.getvalue()}\nbut the page "
            f"shows\n{b.output}"
        )


@contextlib.contextmanager
def readers_time_model():
    """The scheduler's measured time model for this backend while the block runs (the suite
    prices an iteration at one row instead; see tests/conftest.py), then the suite's again."""
    platform = jax.default_backend()
    suites = dyndepth._cost.backend_cost(platform)
    dyndepth.set_iteration_cost(platform, None)
    try:
        yield
    finally:
        dyndepth.set_iteration_cost(platform, suites)


def _computes_gradients(code: str) -> bool:
    return bool(re.search(r"\bjax\.(grad|value_and_grad|jacrev|hessian)\(", code))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_code_runs(page):
    page_blocks = blocks(page)
    _check_markers(page_blocks)
    here = [b for b in page_blocks if not b.marker]
    multi = [b for b in page_blocks if b.marker == "devices=8"]
    if not here and not multi:
        pytest.skip(f"{page.name} has no python blocks to run")
    namespace = {"__name__": f"docs_{page.stem}"}
    guard = GradientGuard()
    guard.install()
    try:
        with jax.numpy_dtype_promotion("standard"), readers_time_model():
            for b in here:
                _run_block(b, namespace)
    finally:
        guard.uninstall()
    if any(_computes_gradients(b.code) for b in here):
        assert guard.checked, f"{page.name} computes gradients, but none was checked"
    if multi:
        _run_on_8_devices(page, multi)


def _run_on_8_devices(page: Path, multi: list[Block]) -> None:
    script = "\n".join(
        [
            f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})",
            "from test_docs import GradientGuard; guard = GradientGuard(); guard.install()",
            *(
                f"exec(compile({chr(10) * (b.line - 1) + b.code!r}, {str(page)!r}, 'exec'))"
                for b in multi
            ),  # fmt: skip
            f"assert guard.checked or not {any(_computes_gradients(b.code) for b in multi)}",
        ]
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
    with jax.numpy_dtype_promotion("standard"), readers_time_model():
        for code in _docstring_examples(doc):
            exec(compile(code, f"<docstring of {name}>", "exec"), dict(namespace))
        parser = doctest.DocTestParser()
        test = parser.get_doctest(doc, dict(namespace), name, None, 0)
        if test.examples:
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            result = runner.run(test)
            assert result.failed == 0, f"{result.failed} doctest(s) of {name} failed"


def test_gradient_guard_catches_zero_and_non_finite_gradients():
    """The two mistakes it exists for: a loss that ignores its argument (both gradients of a
    comparison exactly zero) and a loss that overflows."""
    W = jnp.ones((3, 3))
    guard = GradientGuard()
    guard.install()
    try:
        ignores = lambda V: jnp.sum(jnp.tanh(W @ jnp.ones(3)))  # closes over W, not V
        with pytest.raises(AssertionError, match="zero everywhere"):
            jax.jit(jax.grad(ignores))(W)
        overflows = lambda V: jnp.sum(jnp.exp(100 * V))
        with pytest.raises(AssertionError, match="non-finite"):
            jax.value_and_grad(overflows)(W)
        with pytest.raises(AssertionError, match="non-finite"):
            jax.vmap(jax.grad(lambda v: jnp.sum(jnp.exp(100 * v))))(W)
        with pytest.raises(AssertionError, match="zero everywhere"):
            jax.jit(jax.value_and_grad(ignores)).lower(W).compile()(W)  # compiled apart
        jax.grad(lambda V: jnp.sum(V**2))(W)  # a good one passes and counts
        assert guard.checked == 1
    finally:
        guard.uninstall()
    assert jax.grad(ignores)(W).sum() == 0  # uninstalled: nothing is checked


def test_printed_output_is_compared():
    assert outputs_match("loss 5.5568, norm 3.5667\n", "loss 5.557, norm 3.567")
    assert not outputs_match("loss 5.6, norm 3.5667", "loss 5.5568, norm 3.5667")
    assert not outputs_match("loss 5.5568", "loss 5.5568\n(32, 64)")
    assert not outputs_match("gain 5.5568", "loss 5.5568")


def test_the_runner_finds_blocks():
    """The extraction itself: the README's quickstart is found, and a marker is read."""
    readme = blocks(ROOT / "README.md")
    assert any("dyndepth.repeat" in b.code for b in readme)
    assert _docstring_examples(inspect.getdoc(dyndepth.step_key))
