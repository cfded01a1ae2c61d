"""A griffe extension: turn the reStructuredText parts of dyndepth's docstrings into Markdown.

The docstrings are Markdown (``**Arguments:**``, bullet lists, ``double-backtick`` code spans,
which Markdown reads as code too) with three reStructuredText habits that Markdown does not know:

- roles such as ``:func:`repeat``` become cross-references to the API pages (the name is looked
  up in ``dyndepth.__all__`` and ``dyndepth.nn.__all__``; a name found in neither is left as
  code, and the page check then flags nothing for it);
- a paragraph ending in ``::`` followed by an indented block becomes that paragraph (ending in
  ``:``) and a fenced ``python`` code block;
- a simple table (rows between lines of ``====  ====``) becomes a Markdown table.

The source files are not changed: ``help()`` shows the docstrings as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

import dyndepth

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj):`~?([\w.]+)`")
_BORDER = re.compile(r"^(\s*)(=+)((?:\s+=+)+)\s*$")

# The public names and where they are documented; the docs render each under its public path.
_TOP = tuple(dyndepth.__all__)
_NN = tuple(dyndepth.nn.__all__)


def public_path(name: str) -> str | None:
    """The documented path of ``name`` (``repeat``, ``nn.halting``, ``dyndepth.nn.halting``)."""
    short = name.removeprefix("dyndepth.").removeprefix("nn.")
    if name.startswith("dyndepth.nn.") or name.startswith("nn.") or short in _NN:
        return f"dyndepth.nn.{short}" if short in _NN else None
    if short in _TOP:
        return f"dyndepth.{short}"
    if name in ("dyndepth", "dyndepth.nn"):
        return name
    return None


def _role(match: re.Match) -> str:
    name = match.group(1)
    target = public_path(name)
    shown = name.removeprefix("dyndepth.")
    return f"[`{shown}`][{target}]" if target else f"`{shown}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_blocks(lines: list[str]) -> list[str]:
    """``para::`` + blank + indented block -> ``para:`` + fenced python block."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            base = _indent(line)
            j = i + 1
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
                j -= 1
            body = [b for b in block if b.strip()]
            if body:
                cut = min(_indent(b) for b in body)
                pad = " " * base
                text = line.rstrip()[:-2].rstrip()
                out.append(text + ":" if text.strip() else "")
                out.append("")
                out.append(pad + "```python")
                out.extend(pad + b[cut:] if b.strip() else "" for b in block)
                out.append(pad + "```")
                i = j
                continue
        out.append(line)
        i += 1
    return out


def _cells(line: str, starts: list[int]) -> list[str]:
    """The cells of a table row whose columns start at ``starts``."""
    ends = starts[1:] + [None]
    return [line[a:b].strip() for a, b in zip(starts, ends, strict=True)]


def _rows(chunk: list[str], starts: list[int]) -> list[list[str]]:
    """Table rows; a line with an empty first cell continues the row above."""
    result: list[list[str]] = []
    for line in chunk:
        if not line.strip():
            continue
        parts = _cells(line, starts)
        if result and not parts[0]:
            result[-1] = [f"{a} {b}".strip() for a, b in zip(result[-1], parts, strict=True)]
        else:
            result.append(parts)
    return result


def _simple_tables(lines: list[str]) -> list[str]:
    """reST simple tables (top border, header, border, rows, bottom border) -> Markdown."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _BORDER.match(lines[i])
        ends = [j for j in range(i + 1, len(lines)) if m and lines[j].rstrip() == lines[i].rstrip()]
        if not m or len(ends) < 2:
            out.append(lines[i])
            i += 1
            continue
        starts = [s.start() for s in re.finditer(r"=+", lines[i])]
        head_end, bottom = ends[0], ends[1]
        pad = m.group(1)
        out.append("")
        for r in _rows(lines[i + 1 : head_end], starts):
            out.append(pad + "| " + " | ".join(r) + " |")
        out.append(pad + "|" + "---|" * len(starts))
        for r in _rows(lines[head_end + 1 : bottom], starts):
            out.append(pad + "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
        out.append("")
        i = bottom + 1
    return out


def _list_blocks(lines: list[str]) -> list[str]:
    """Indent what belongs to a ``- item`` by four spaces, as Python-Markdown wants it (the
    docstrings indent continuation lines by two, and tables by more). Fenced code keeps its own
    indentation relative to its fence."""
    out: list[str] = []
    item: int | None = None  # indentation of the open list item's dash
    fence: tuple[int, int] | None = None  # (original, new) indentation of an open fence
    for line in lines:
        stripped = line.lstrip()
        ind = _indent(line)
        if fence is not None:
            out.append(" " * fence[1] + line[fence[0] :] if stripped else "")
            if stripped.startswith("```"):
                fence = None
            continue
        if stripped.startswith("- "):
            if item is not None and out and out[-1].strip():
                out.append("")  # else Python-Markdown continues the paragraph above
            item = ind
        elif item is not None and stripped and ind <= item:
            item = None
        elif item is not None and stripped:
            line = " " * (item + 4) + stripped
            if stripped.startswith("```"):
                fence = (ind, item + 4)
        elif stripped.startswith("```"):
            fence = (ind, ind)
        out.append(line)
    return out


def to_markdown(text: str) -> str:
    """The docstring ``text`` with its reST parts turned into Markdown."""
    lines = _ROLE.sub(_role, text).splitlines()
    lines = _literal_blocks(lines)
    lines = _simple_tables(lines)
    lines = _list_blocks(lines)
    return "\n".join(lines)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring that griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
