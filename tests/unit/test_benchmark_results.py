"""Every benchmark result follows the dated layout and is named by a table of benchmarks/README.md.

History used to live in file-name suffixes (``_before``, ``_0512``, ``_rerun``) and some files
were named nowhere; these checks keep a stray or unlisted file from coming back. The pattern is
written out here on purpose, not imported from ``benchmarks/result_files.py``, so that the two
are checked against each other.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from benchmarks.result_files import NAME

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
LAYOUT = re.compile(
    r"^(\d{4}-\d{2}-\d{2})_(cpu|h100|h200)_[0-9a-f]{7,12}(_[a-z0-9][a-z0-9.-]*)?\.(json|jsonl|txt|png)$"
)


def result_files() -> list[Path]:
    """Every file under benchmarks/results/, relative to it."""
    return sorted(p.relative_to(RESULTS) for p in RESULTS.rglob("*") if p.is_file())


def readme_tables() -> dict[str, set[str]]:
    """File names per benchmark, from the tables under "## Result files" in benchmarks/README.md."""
    section = README.read_text().split("\n## Result files\n", 1)[1]
    tables: dict[str, set[str]] = {}
    benchmark = None
    for line in section.splitlines():
        if line.startswith("## "):
            break
        if line.startswith("### "):
            benchmark = line[4:].strip()
            tables[benchmark] = set()
        elif line.startswith("| `") and benchmark is not None:
            tables[benchmark].add(line.split("`")[1])
    return tables


def layout_problems(files: list[Path]) -> list[str]:
    """The files that are not ``<benchmark>/<date>_<hardware>_<commit>[_<variant>].<ext>``."""
    problems = []
    for rel in files:
        match = LAYOUT.match(rel.name)
        if len(rel.parts) != 2 or match is None:
            problems.append(str(rel))
            continue
        datetime.date.fromisoformat(match.group(1))
    return problems


def unlisted(files: list[Path], tables: dict[str, set[str]]) -> list[str]:
    """The files that no table of their benchmark's README section names."""
    return [str(rel) for rel in files if rel.name not in tables.get(rel.parts[0], set())]


def test_every_result_file_follows_the_dated_layout() -> None:
    files = result_files()
    assert len(files) >= 83
    assert layout_problems(files) == []


def test_every_result_file_is_named_by_a_readme_table() -> None:
    assert unlisted(result_files(), readme_tables()) == []


def test_every_table_row_names_a_file_that_exists() -> None:
    present = {str(rel) for rel in result_files()}
    rows = {f"{bench}/{name}" for bench, names in readme_tables().items() for name in names}
    assert sorted(rows - present) == []


def test_the_checks_catch_a_stray_file() -> None:
    """A suffix-named file at the top, or a dated file missing from the tables, is reported."""
    stray = [
        Path("megatron_throughput_h200_rerun.json"),
        Path("logprobs/2026-12-06_h200_abcdef0.json"),
    ]
    assert layout_problems(stray) == ["megatron_throughput_h200_rerun.json"]
    assert unlisted(stray[1:], readme_tables()) == ["logprobs/2026-12-06_h200_abcdef0.json"]


def test_the_writer_and_the_check_agree_on_the_pattern() -> None:
    for rel in result_files():
        assert NAME.match(rel.name), rel
    assert not NAME.match("fused_head_h200_chunk_matmuls_16k_before.json")
