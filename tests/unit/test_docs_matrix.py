"""The support matrix (`docs/support-matrix.md`): every cell says measured / tested on the CPU /
not run / not built, every file it names exists, it covers each feature x backend, and the home
page links to it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "support-matrix.md"
LABELS = ("measured", "tested on the CPU", "not run", "not built")
BACKENDS = ("megatron", "deepspeed", "fsdp2")
# the features the documentation issue asks the matrix for (a prefix of the row's feature cell)
FEATURES = (
    "RL training step",
    "contract suite",
    "LoRA",
    "MoE",
    "expert parallel",
    "context parallel",
    "pipeline / virtual pipeline",
    "critic",
    "asynchronous training",
    "multi-turn",
    "vLLM sync: `file`",
    "vLLM sync: `ipc`",
    "vLLM sync: `nccl`",
    "evaluation",
    "DAPO shaping",
    "`unirl serve`",
    "agent gateway",
)


def _rows() -> list[list[str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[1] in BACKENDS:
            rows.append(cells)
    return rows


def test_every_cell_has_a_status_and_every_named_file_exists():
    rows = _rows()
    assert len(rows) >= 3 * len(FEATURES)
    bad = [(r[0], r[1], c) for r in rows for c in r[2:] if not c.startswith(LABELS)]
    assert bad == []
    named = [
        p for r in rows for c in r[2:] for p in re.findall(r"`((?:tests|benchmarks)/[^`]+)`", c)
    ]
    assert len(named) >= 40
    assert [p for p in named if not (ROOT / p).is_file()] == []
    # "measured" and "tested" name their evidence; "not run" / "not built" need none
    unnamed = [
        (r[0], r[1], c)
        for r in rows
        for c in r[2:]
        if c.startswith(("measured", "tested")) and not re.search(r"`(tests|benchmarks)/", c)
    ]
    assert unnamed == []


def test_a_measured_cell_names_a_result_of_that_hardware():
    """ "measured" on a GPU column cites an h100 / h200 result file, on the CPU column a cpu one
    (the hardware is in the file name: benchmarks/result_files.py)."""
    wrong = []
    for row in _rows():
        for column, cell in zip(("cpu", "gpu", "gpu"), row[2:]):
            if not cell.startswith("measured"):
                continue
            names = re.findall(r"`benchmarks/results/[^/`]+/\d{4}-\d{2}-\d{2}_(\w+?)_", cell)
            if not names or any((h == "cpu") != (column == "cpu") for h in names):
                wrong.append((row[0], row[1], cell))
    assert wrong == []


def test_each_feature_has_a_row_per_backend_and_the_home_page_links_it():
    rows = _rows()
    for feature in FEATURES:
        backends = sorted(r[1] for r in rows if r[0].startswith(feature))
        assert backends == sorted(BACKENDS), feature
    assert "(support-matrix.md)" in (ROOT / "docs" / "index.md").read_text()
