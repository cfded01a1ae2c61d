"""MkDocs hooks: the repository's README, CHANGELOG, examples and benchmark notes as pages.

The Markdown files link to each other by their paths in the repository (``docs/scaling.md``
from the README, ``../examples/seed.py`` from a guide), so that the links work when the files
are read on a code host. The site has other paths: the README is its home page, every script in
``examples/`` gets a page, and ``docs/`` is the site's root. ``on_page_markdown`` rewrites each
relative link from the repository path to the site path; a link that leads to no page is left
as it is, so the strict build reports it.
"""

from __future__ import annotations

import ast
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]

# repository path -> path in the site's sources
_COPIED = {
    "README.md": "index.md",
    "CHANGELOG.md": "changelog.md",
    "CONTRIBUTING.md": "contributing.md",
    "benchmarks/README.md": "benchmarks.md",
    "benchmarks/bench.png": "bench.png",
}
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _examples() -> dict[str, str]:
    return {
        f"examples/{p.name}": f"examples/{p.stem}.md"
        for p in sorted((REPO / "examples").glob("*.py"))
    }


def _site_path(repo_path: str) -> str | None:
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return _COPIED.get(repo_path) or _examples().get(repo_path)


def _example_page(repo_path: str) -> str:
    """A page for one example script: its docstring as text, then its source."""
    source = (REPO / repo_path).read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    title, _, rest = doc.partition("\n")
    lines = [f"# {title.strip().rstrip('.') or repo_path}", "", f"`{repo_path}`", ""]
    # The docstring's indented command line becomes a shell block.
    for line in rest.strip().splitlines():
        lines.append(line)
    lines += ["", "```python", source.rstrip(), "```", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    for repo_path, site_path in {**_COPIED, **_examples()}.items():
        if not (REPO / repo_path).exists():
            continue
        if repo_path.endswith(".py"):
            content: str | bytes = _example_page(repo_path)
        elif repo_path.endswith(".md"):
            content = (REPO / repo_path).read_text()
        else:
            content = (REPO / repo_path).read_bytes()
        files.append(File.generated(config, site_path, content=content))
    return files


def _repo_path_of(page: Any) -> str:
    site_path = page.file.src_uri
    for repo_path, target in {**_COPIED, **_examples()}.items():
        if target == site_path:
            return repo_path
    return "docs/" + site_path


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = posixpath.dirname(_repo_path_of(page))
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, hash_, fragment = target.partition("#")
        site = _site_path(posixpath.normpath(posixpath.join(here, path)))
        if site is None:
            return match.group(0)
        new = posixpath.relpath(site, page_dir or ".") + hash_ + fragment
        return match.group(1) + new + match.group(3)

    out, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(rewrite, line))
    return "\n".join(out)
