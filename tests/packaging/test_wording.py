"""What a user reads says what things are, not how the project came to them: no words from the
project's history in the README, CONTRIBUTING, the docs, the benchmark notes, the examples and
the command line's help (the changelog is history by design, and is not checked)."""

import re
from pathlib import Path

import pytest

from dyndepth_app import cli as _cli

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md"]
    + list((ROOT / "docs").glob("*.md"))
    + list((ROOT / "examples").glob("*.py"))
)

# Each a phrase that only the project's history explains; a name it once gave (`seed`: the
# program of the first request) has a descriptive name now (`dropout-residual`, `scan+cond`).
FORBIDDEN = {
    "the original request": r"\boriginal (request|question|sizes)",
    "a session of work": r"\bsessions?\b",
    "an issue's number": r"\bissue\s*#?\d+",
    "an issue as the reader's context": r"\bthe (GPU |TPU )?issue('s|s)?\b",
    "a design note outside the repository": r"\bshared/|\bdesigns/",
    "`seed` as a name": r"examples/seed\b|--task[ =]seed\b|\bseed scan\+cond|\bvs seed\b"
    r"|\bthe seed'?s\b|`seed`",
}


def findings(text: str) -> list[str]:
    """``what: the line`` for every forbidden phrase in ``text``."""
    found = []
    for line in text.splitlines():
        for what, pattern in FORBIDDEN.items():
            if re.search(pattern, line, re.IGNORECASE):
                found.append(f"{what}: {line.strip()}")
    return found


def test_the_patterns_find_what_they_forbid():
    bad = [
        "the forward pass of the original request",
        "this session had no GPU",
        "Against the issue's targets (issue 28)",
        "see ../shared/designs/tpu_deviceless.md",
        "`dyndepth demo --task seed` runs it",
        "| seed scan+cond | 6.63 |",
    ]
    assert all(findings(line) for line in bad), [b for b in bad if not findings(b)]
    good = ["--seed 0 (the random seed)", "seeded generator", "a 2-core CPU, seed 2", "tissue"]
    assert not any(findings(line) for line in good)


@pytest.mark.parametrize("path", FILES, ids=[p.relative_to(ROOT).as_posix() for p in FILES])
def test_no_history_words_in_what_users_read(path):
    assert path.exists(), path
    assert not findings(path.read_text()), findings(path.read_text())


@pytest.mark.parametrize("argv", [[], ["demo"], ["eval"], ["bench"], ["launch"]])
def test_no_history_words_in_the_command_line_help(capsys, argv):
    assert _cli.main([*argv, "--help"]) == 0
    text = capsys.readouterr().out
    assert "usage: dyndepth" in text
    assert not findings(text), findings(text)
