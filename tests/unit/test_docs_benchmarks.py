"""The generated benchmark page (`docs/reference/benchmark-results.md`, written by
`docs/gen_benchmarks.py` from benchmarks/results/): it is current, a new result file committed
without regenerating fails here with the command to run, its headline figures are the file's own
numbers, and a schema the generator does not know is listed, not a crash."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_benchmarks", ROOT / "docs/gen_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_current():
    run = subprocess.run(
        [sys.executable, "docs/gen_benchmarks.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "python docs/gen_benchmarks.py" in _generator().HEADER


def _throughput(tokens_per_s: float, mfu: float, command: str) -> dict:
    """A megatron_throughput result as benchmarks/megatron_throughput.py writes one."""
    return {
        "environment": {"command": command, "gpus": ["NVIDIA H100 80GB HBM3"]},
        "model": {"name": "qwen3-4b", "num_hidden_layers": 36},
        "batch": {"tokens": 65536, "tokens_per_microbatch": 65536},
        "parallel": {"tp": 1, "pp": 1, "cp": 1, "gpus": 1},
        "results": {
            "reuse": {
                "peak_memory_gib": 70.25,
                "summary": {"train_tokens_per_s": tokens_per_s, "train_mfu": mfu},
            }
        },
    }


def _results(tmp_path: Path) -> Path:
    results = tmp_path / "benchmarks" / "results"
    (results / "megatron_throughput").mkdir(parents=True)
    (results / "brand_new").mkdir()
    old = results / "megatron_throughput" / "2026-12-01_h100_aaaaaaa.json"
    new = results / "megatron_throughput" / "2026-12-07_h100_bbbbbbb_long.json"
    old.write_text(json.dumps(_throughput(12345.0, 0.25, "python old.py")))
    new.write_text(json.dumps(_throughput(48870.88, 0.49379, "python new.py --long")))
    # a schema nobody summarises, a known benchmark's drifted schema, a file that is not JSON
    (results / "brand_new" / "2026-12-07_cpu_ccccccc.json").write_text('{"command": "python x.py"}')
    drifted = results / "megatron_throughput" / "2026-12-05_h200_ddddddd.json"
    drifted.write_text(json.dumps({"environment": {"command": "python drift.py"}, "results": 3}))
    (results / "brand_new" / "2026-12-06_cpu_eeeeeee.json").write_text("{not json")
    (results.parent / "README.md").write_text(
        "# B\n\n## Result files\n\n### brand_new\n\n| file | status | date | hardware | commit |"
        " command | what |\n|---|---|---|---|---|---|---|\n| `2026-12-06_cpu_eeeeeee.json` |"
        " current | 2026-12-06 | cpu | eeeeeee | `x.py --broken` | a broken file |\n"
    )
    return results


def test_rows_are_newest_first_with_the_files_own_figures(tmp_path):
    page = _generator().render(_results(tmp_path))
    section = page.split("\n## megatron_throughput\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| 2026-")]
    assert [row.split(" | ")[0] for row in rows] == ["| 2026-12-07", "| 2026-12-05", "| 2026-12-01"]
    # 48,870.88 tok/s -> 48.9k, MFU 0.49379 -> 49.4%, by hand
    assert "reuse: 48.9k tok/s, 49.4% MFU, 70.2 GiB" in rows[0]
    assert "1 x NVIDIA H100 80GB HBM3" in rows[0] and "`bbbbbbb`" in rows[0]
    assert rows[0].endswith("| `python new.py --long` |")
    assert "reuse: 12.3k tok/s, 25.0% MFU" in rows[2]
    # the anchors stand beside this benchmark
    assert "35.4% MFU, 28.97k tokens/s" in section.split("\n## ", 1)[0]


def test_an_unknown_or_broken_schema_is_listed_with_date_and_command(tmp_path):
    page = _generator().render(_results(tmp_path))
    drifted = next(line for line in page.splitlines() if "ddddddd.json" in line)
    assert "no headline figures" in drifted and "`python drift.py`" in drifted
    new = page.split("\n## brand_new\n", 1)[1].split("\n## ", 1)[0]
    unknown = next(line for line in new.splitlines() if "ccccccc.json" in line)
    assert unknown.startswith("| 2026-12-07 | CPU |") and unknown.endswith("| `python x.py` |")
    broken = next(line for line in new.splitlines() if "eeeeeee.json" in line)
    assert broken.endswith("| README: `x.py --broken` |")
    assert "35.4%" not in new  # no anchor beside a benchmark it does not compare with
