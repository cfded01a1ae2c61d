"""The documentation site builds and its pages hold together, as a reader would find them.

The site is built once per session with ``mkdocs build --strict`` (warnings are errors: a broken
cross-reference, link or anchor fails the build) into a temporary folder. Then every page of it
is checked by parsing its HTML:

- every internal link leads to a file of the site, and its ``#fragment`` to an element of the
  target page; every image, script and stylesheet a page loads exists;
- the API reference has an entry (a heading with the object's id) for every name in
  ``dyndepth.__all__`` and ``dyndepth.nn.__all__``, and no reStructuredText left over from the
  docstrings (roles, ``::`` blocks, ``====`` tables).

When a Chromium or Chrome binary is on the PATH (Debian: ``apt-get install chromium``), the pages
are also rendered in it, served over HTTP from 127.0.0.1: a check page loads each page in turn
and reports the images that did not load and the public names missing from the rendered API
text. A machine without a browser (a fresh CI machine installs none) skips that test only; the
parsing checks above run everywhere.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import posixpath
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import dyndepth
import dyndepth.nn

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "api": [f"dyndepth.{n}" for n in dyndepth.__all__],
    "nn": [f"dyndepth.nn.{n}" for n in dyndepth.nn.__all__],
}


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


class _Page(HTMLParser):
    """The ids, links and loaded resources of one HTML page, and the text of its article."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.resources: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag in ("img", "script") and a.get("src"):
            self.resources.append(a["src"])
        if tag == "link" and a.get("rel") in ("stylesheet", "icon") and a.get("href"):
            self.resources.append(a["href"])

    def handle_data(self, data):
        self.text.append(data)


@functools.cache
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def _target(site: Path, page: Path, url: str) -> tuple[Path, str] | None:
    """The file and fragment an internal ``url`` on ``page`` points to; None if external."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc:
        return None
    path = unquote(parts.path)
    if not path:
        return page, parts.fragment
    base = page.parent.relative_to(site).as_posix()
    rel = posixpath.normpath(posixpath.join(base, path))
    target = site / rel
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, parts.fragment


def test_site_has_the_pages(site):
    names = {p.relative_to(site).as_posix() for p in _pages(site)}
    for expected in ("index.html", "api/index.html", "nn/index.html", "getting-started/index.html",
                     "examples/dropout_residual/index.html"):  # fmt: skip
        assert expected in names


def test_no_broken_links_anchors_or_images(site):
    broken = []
    for page in _pages(site):
        parsed = _parse(page)
        where = page.relative_to(site)
        for url in parsed.links:
            t = _target(site, page, url)
            if t is None:
                continue
            target, fragment = t
            if not target.exists():
                broken.append(f"{where}: link {url} -> missing {target.relative_to(site)}")
            elif fragment and target.suffix == ".html" and fragment not in _parse(target).ids:
                broken.append(f"{where}: link {url} -> no #{fragment} in that page")
        for url in parsed.resources:
            t = _target(site, page, url)
            if t is not None and not t[0].exists():
                broken.append(f"{where}: resource {url} is missing")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", sorted(PUBLIC))
def test_api_reference_lists_every_public_name(site, page):
    parsed = _parse(site / page / "index.html")
    missing = [name for name in PUBLIC[page] if name not in parsed.ids]
    assert not missing, f"{page}: no API entry for {missing}"
    text = "".join(parsed.text)
    for leftover in (":func:`", ":class:`", "::\n", "====="):
        assert leftover not in text, f"{page}: reStructuredText left in the page: {leftover!r}"


_CHECK_PAGE = """<!doctype html><meta charset="utf-8"><title>check</title>
<iframe id="f" style="width:1200px;height:900px"></iframe><pre id="result">pending</pre>
<script>
const pages = %(pages)s, names = %(names)s, out = [];
const frame = document.getElementById("f");
function next(i) {
  if (i === pages.length) {
    document.getElementById("result").textContent = JSON.stringify(out);
    return;
  }
  frame.onload = () => setTimeout(() => {
    const doc = frame.contentDocument;
    const imgs = Array.from(doc.images);
    const broken = imgs.filter(im => !im.complete || im.naturalWidth === 0).map(im => im.src);
    const text = doc.body ? doc.body.innerText : "";
    const wanted = names[pages[i]] || [];
    out.push({page: pages[i], title: doc.title, images: imgs.length, broken: broken,
              missing: wanted.filter(n => !text.includes(n)),
              height: doc.documentElement.scrollHeight});
    next(i + 1);
  }, 50);
  frame.src = pages[i];
}
next(0);
</script>
"""


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_pages_render_in_a_headless_browser(site):
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium or chrome on PATH: the HTML-parsing checks above still ran")
    pages = [p.relative_to(site).as_posix() for p in _pages(site)]
    names = {f"{k}/index.html": [n.split(".")[-1] for n in v] for k, v in PUBLIC.items()}
    (site / "__check__.html").write_text(
        _CHECK_PAGE % {"pages": json.dumps(pages), "names": json.dumps(names)}
    )

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # a closed connection is no failure
            pass

    handler = functools.partial(Handler, directory=str(site))
    with Quiet(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/__check__.html"
        proc = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--virtual-time-budget=120000", "--dump-dom", url],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        server.shutdown()
    dom = proc.stdout
    start, end = dom.find('<pre id="result">'), dom.find("</pre>")
    assert start >= 0 and end > start, f"no result from the browser:\n{proc.stderr[-2000:]}"
    raw = dom[start + len('<pre id="result">') : end]
    results = json.loads(raw.replace("&quot;", '"').replace("&amp;", "&"))
    assert [r["page"] for r in results] == pages, "the browser did not load every page"
    problems = [r for r in results if r["broken"] or r["missing"] or r["height"] < 200]
    assert not problems, json.dumps(problems, indent=1)
    assert all(r["title"] for r in results)
