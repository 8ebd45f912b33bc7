"""Shell blocks of the docs marked runnable run as written: ``<!-- run -->`` (every line exits 0)
or ``<!-- run: exit N -->`` (every line exits N: an error the page shows) right above a ```bash /
```shell block. Only cheap commands may be marked (`unirl check ...`, `--help`, `--version`):
a marked `unirl train` would make CI slow, so it is refused here. The lines run in this process
through `unirl.cli.main` (the `unirl` entry point's function), not a shell."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"^[ \t]*<!-- run(?:: exit (\d+))? -->\n[ \t]*```(?:bash|shell)\n(.*?)\n[ \t]*```", re.M | re.S
)


def _runnable() -> list[tuple[str, int, str]]:
    """(where, expected exit status, command line) for each line of every marked block."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            first = text[: match.start(2)].count("\n") + 1
            for n, line in enumerate(match.group(2).splitlines()):
                command = line.split(" #", 1)[0].strip()
                if command and not command.startswith("#"):
                    where = f"{page.relative_to(ROOT)}:{first + n}"
                    found.append((where, int(match.group(1) or 0), command))
    return found


def _cheap(argv: list[str]) -> bool:
    """`unirl check ...`, `unirl --version`, `unirl [command] --help`: seconds, nothing started."""
    if argv[:1] != ["unirl"]:
        return False
    return argv[1:2] == ["check"] or "--help" in argv or "-h" in argv or argv[1:] == ["--version"]


def test_some_blocks_are_marked_and_each_is_cheap():
    commands = _runnable()
    assert len(commands) >= 5
    assert [where for where, _, line in commands if not _cheap(shlex.split(line))] == []


@pytest.mark.parametrize("where, status, line", _runnable(), ids=lambda v: str(v)[:50])
def test_the_marked_command_runs(where, status, line, capsys, monkeypatch):
    from unirl.cli import main

    monkeypatch.chdir(ROOT)  # the pages' paths (examples/...) are from the repository root
    try:
        code = main(shlex.split(line)[1:])
    except SystemExit as exit_:  # argparse's --help / --version
        code = exit_.code or 0
    out = capsys.readouterr()
    assert code == status, f"{where}: `{line}` exited {code}\n{out.out[-2000:]}\n{out.err[-2000:]}"
    if status:
        assert out.err.startswith("unirl: error: "), (where, out.err)
