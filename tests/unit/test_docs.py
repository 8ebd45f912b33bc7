"""The documentation is tested: the site builds with warnings as errors, every YAML block in
docs/ passes the config loading that `unirl check` and `unirl train` run, the README stays short
and keeps its two commands, and `unirl --help`'s examples run."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"

# A ```yaml block (indented inside a list item too) and the HTML comments right above it.
BLOCK = re.compile(r"((?:^[ \t]*<!--.*?-->\n)*)^([ \t]*)```yaml\n(.*?)\n[ \t]*```", re.M | re.S)


def _yaml_blocks() -> list[tuple[str, str, str]]:
    """(where, check marker or '', the block's text) for every YAML block under docs/."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            marker = re.search(r"<!-- check: (.*?) -->", match.group(1))
            line = text[: match.start(2)].count("\n") + 1
            where = f"{page.relative_to(ROOT)}:{line}"
            found.append(
                (where, marker.group(1) if marker else "", textwrap.dedent(match.group(3)))
            )
    return found


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merge(base[key], value) if both else value
    return out


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="needs mkdocs and mkdocs-material: pip install -e '.[test]'",
)
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_every_yaml_block_is_marked_for_the_check():
    """A block says how it is checked: ``<!-- check: whole -->`` (a whole config),
    ``<!-- check: serve -->`` (a `unirl serve` config) or
    ``<!-- check: --over examples/X.yaml [--set k=v ...] [--world-size N] -->`` (a fragment
    merged over that example)."""
    blocks = _yaml_blocks()
    assert len(blocks) >= 8
    assert [where for where, marker, _ in blocks if not marker] == []


@pytest.mark.parametrize("where, marker, text", _yaml_blocks(), ids=lambda v: str(v)[:60])
def test_yaml_block_passes_the_config_check(where, marker, text, tmp_path, capsys):
    from unirl.cli import main
    from unirl.core.config.run_config import load_config

    data = yaml.safe_load(text)
    config = tmp_path / "config.yaml"
    if marker == "serve":  # a `unirl serve` config: its own keys, its train section's rules
        from unirl.serve.config import serve_config_from_dict
        from unirl.serve.sessions import train_config

        cfg = serve_config_from_dict(data)
        train_config(cfg, Path("/models/x"), {"rank": 8})
        return
    if marker == "whole":
        config.write_text(text)
        # the whole `unirl check`: config rules, local paths, the rollout source's files
        assert main(["check", str(config)]) == 0, capsys.readouterr().err
        return
    args = shlex.split(marker)
    over = args[args.index("--over") + 1]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    world = int(args[args.index("--world-size") + 1]) if "--world-size" in args else None
    config.write_text(yaml.safe_dump(_merge(yaml.safe_load((ROOT / over).read_text()), data)))
    # a fragment may name folders of the reader's (/models/...): the config rules only
    load_config(config, sets, world_size=world)


def test_the_readme_is_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        assert f"{marker}\n```\npip install -e " in readme


def test_the_readmes_links_to_docs_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 8
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_version_and_help_examples(capsys):
    from unirl import __version__
    from unirl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"unirl {__version__}\n"
    assert __version__ == "0.1.0"  # pyproject.toml's version
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "\nexamples:\n  unirl train examples/tiny_grpo.yaml" in capsys.readouterr().out


def test_the_help_examples_of_unirl_check_run(capsys):
    """The epilog's `unirl check` lines, run as written (train runs are the README's command)."""
    from unirl.cli import _EXAMPLES, main

    lines = [line.split("#")[0].split() for line in _EXAMPLES.splitlines()]
    checks = [words[1:] for words in lines if words[:2] == ["unirl", "check"]]
    assert len(checks) == 2
    for argv in checks:
        assert main(argv) == 0, (argv, capsys.readouterr().err)


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (the page's shorthand)."""
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    return [
        p
        for part in match.group(1).split(",")
        for p in _expand(path[: match.start()] + part + path[match.end() :])
    ]


def test_what_is_where_names_files_that_exist():
    """Every path on the page, and every bare file name in a cell (``passes.py``, ``heads.py``)
    looked up in the folder of the path before it in that cell."""
    missing = []
    for row in (DOCS / "what-is-where.md").read_text().splitlines():
        if not row.startswith("| "):
            continue
        folder = ""
        for name in re.findall(r"`([\w./{},\-]+)`", row):
            if "/" in name and name.split("/")[0] in ("unirl", "tests", "examples", "benchmarks"):
                paths = _expand(name)
                folder = str(Path(paths[0]).parent) if "." in Path(paths[0]).name else paths[0]
            elif re.fullmatch(r"[\w{},]+\.(py|md|yaml)", name) and folder:
                paths = [f"{folder}/{p}" for p in _expand(name)]
            else:
                continue
            missing += [p for p in paths if not (ROOT / p.rstrip("/")).exists()]
    assert missing == []
