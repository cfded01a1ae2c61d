"""The package as a user installs it: the wheel and the sdist build, pass ``twine check``, hold
what they should, and the wheel installed into a fresh virtual environment runs the README's
quickstart (printing what the README shows) and ``dyndepth --version``.

To stay fast and offline, the fresh environment does not download jax again: a ``.pth`` file
puts this environment's site-packages (for jax and numpy) after its own, and the wheel is
installed with ``--no-deps --no-index``. The editable install of the source tree is not
visible there (``.pth`` files of a directory added that way are not processed); the test checks
that ``dyndepth`` is imported from the fresh environment's copy.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from test_docs import outputs_match

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="session")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason='the packaging tools come with ".[test]"')
    pytest.importorskip("hatchling", reason='the packaging tools come with ".[test]"')
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build backend (hatchling) comes from this environment, no download
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = f"dyndepth-{VERSION}.dist-info/METADATA"
        return email.parser.Parser().parsestr(z.read(name).decode())


def test_builds_a_wheel_and_an_sdist_of_the_version(dist):
    assert _wheel(dist).name == f"dyndepth-{VERSION}-py3-none-any.whl"
    assert (dist / f"dyndepth-{VERSION}.tar.gz").exists()


def test_twine_check_passes(dist):
    pytest.importorskip("twine", reason='twine comes with ".[test]"')
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))])


def test_wheel_holds_the_library_and_its_command_only(dist):
    with zipfile.ZipFile(_wheel(dist)) as z:
        names = z.namelist()
        licence = z.read(f"dyndepth-{VERSION}.dist-info/licenses/LICENSE").decode()
    top = {n.split("/")[0] for n in names}
    assert top == {"dyndepth", "dyndepth_app", f"dyndepth-{VERSION}.dist-info"}, top
    assert "Apache License" in licence and "Version 2.0" in licence
    for forbidden in ("tests/", "benchmarks/", "examples/", "docs/", "/_ext/"):
        assert not [n for n in names if forbidden in n], forbidden
    needed = ("dyndepth/__init__.py", "dyndepth/py.typed", "dyndepth/nn/__init__.py",
              "dyndepth_app/cli.py", "dyndepth_app/__main__.py")  # fmt: skip
    for name in needed:
        assert name in names, name


def test_runtime_dependency_is_jax_alone_and_extras_are_named(dist):
    meta = _metadata(_wheel(dist))
    assert meta["Version"] == VERSION
    requires = meta.get_all("Requires-Dist") or []
    runtime = [r for r in requires if "extra ==" not in r]
    assert [re.split(r"[ <>=!~;\[]", r)[0] for r in runtime] == ["jax"], runtime
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"demo", "test", "docs"} <= extras, extras
    assert meta.get_content_type() == "text/plain"  # the body is the README
    assert meta["Description-Content-Type"] == "text/markdown"


def test_license_and_classifiers(dist):
    meta = _metadata(_wheel(dist))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier") or []
    # the license is the expression; a License :: classifier beside it is rejected by PEP 639
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert meta["Author"], "no author"


def test_console_script_points_into_the_wheel(dist):
    with zipfile.ZipFile(_wheel(dist)) as z:
        entry_points = z.read(f"dyndepth-{VERSION}.dist-info/entry_points.txt").decode()
        names = set(z.namelist())
    m = re.search(r"^dyndepth\s*=\s*([\w.]+):(\w+)", entry_points, re.M)
    assert m, entry_points
    module = m.group(1)  # dyndepth_app.cli
    path = module.replace(".", "/")
    assert f"{path}.py" in names or f"{path}/__init__.py" in names, module


def test_sdist_holds_the_sources_and_no_build_output(dist):
    with tarfile.open(dist / f"dyndepth-{VERSION}.tar.gz") as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in (
        "pyproject.toml",
        "README.md",
        "CHANGELOG.md",
        "LICENSE",
        "src/dyndepth/__init__.py",
    ):
        assert needed in names
    assert not [n for n in names if n.startswith((".venv/", "site/", "dist/", ".ci/"))]


def test_changelog_has_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## (\d+\.\d+\.\d+)", text, re.M)
    assert released and released[0] == VERSION, (released, VERSION)


def test_installed_wheel_runs_the_quickstart(dist, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    purelib = Path(site.stdout.strip())
    # jax and numpy from this environment, after the fresh environment's own packages
    (purelib / "zz_parent_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
          "--no-deps", "--no-index", str(_wheel(dist))])  # fmt: skip

    readme = (ROOT / "README.md").read_text()
    quickstart = re.search(r"## Quickstart.*?```python\n(.*?)```", readme, re.S).group(1)
    check = (
        "import dyndepth, importlib.metadata as m\n"
        f"assert dyndepth.__file__.startswith({str(purelib)!r}), dyndepth.__file__\n"
        f"assert dyndepth.__version__ == m.version('dyndepth') == {VERSION!r}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = _run([str(python), "-c", check + quickstart], cwd=tmp_path, env=env)
    shown = re.search(r"## Quickstart.*?```python\n.*?```\s*```text\n(.*?)```", readme, re.S)
    assert out.stdout.strip() and outputs_match(out.stdout, shown.group(1)), out.stdout
    cli = _run([str(venv / "bin" / "dyndepth"), "--help"], cwd=tmp_path, env=env)
    assert "demo" in cli.stdout
    version = _run([str(venv / "bin" / "dyndepth"), "--version"], cwd=tmp_path, env=env)
    assert version.stdout.startswith(f"dyndepth {VERSION} (jax "), version.stdout
