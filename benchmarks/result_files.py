"""Where a benchmark writes a new result: ``benchmarks/results/<benchmark>/<date>_<hardware>_<commit>[_<variant>].<ext>``.

Results are kept as history: a new run gets a new dated file beside the older ones instead of
overwriting them, and ``benchmarks/README.md`` names every file in a table (checked by
``tests/unit/test_benchmark_results.py``, which holds the same pattern).
"""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HARDWARE = ("cpu", "h100", "h200")
# <date>_<hardware>_<commit>[_<variant>].<ext>: the variant says what was run (not when).
NAME = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})_(?P<hardware>cpu|h100|h200)_(?P<commit>[0-9a-f]{7,12})"
    r"(?:_(?P<variant>[a-z0-9][a-z0-9.-]*))?\.(?P<ext>json|jsonl|txt|png)$"
)


def head_commit() -> str:
    """The short hash of the checked-out commit: the code a new result measures."""
    out = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def new_result_path(benchmark: str, hardware: str, variant: str = "", ext: str = "json") -> Path:
    """A fresh dated file under ``results/<benchmark>/`` for today (UTC) and the current commit."""
    if hardware not in HARDWARE:
        raise ValueError(f"hardware must be one of {HARDWARE}, got {hardware!r}")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    name = f"{date}_{hardware}_{head_commit()}" + (f"_{variant}" if variant else "") + f".{ext}"
    if not NAME.match(name):
        raise ValueError(f"{name!r} does not follow the results layout")
    return RESULTS / benchmark / name
