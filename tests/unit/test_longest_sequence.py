"""`benchmarks/longest_sequence.py`'s search, with a stand-in child (no model): lengths tried
shortest first, each with its own length flags and ``--out``; the first that runs out of memory
ends the search, and the largest that ran is reported with what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A throughput script's stand-in: it "fits" up to 200 tokens (a megatron_throughput-shaped JSON
# whose peak memory is the length / 100) and beyond that fails as an out-of-memory does.
CHILD = textwrap.dedent(
    """
    import json, sys
    args = sys.argv[1:]
    n, out = int(args[args.index("--max-len") + 1]), args[args.index("--out") + 1]
    assert args[args.index("--tokens-per-microbatch") + 1] == str(n)
    assert args[args.index("--samples") + 1] == "1" and "--steady" in args
    if n > 200:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        sys.exit(1)
    reuse = {"peak_memory_gib": n / 100, "step_s": [1.0],
             "summary": {"train_mfu": 0.4, "train_tokens_per_s": float(n)}}
    json.dump({"memory_plan": {"optimizer_offload": True}, "results": {"reuse": reuse}},
              open(out, "w"))
    """
)


def test_search_stops_at_the_first_out_of_memory(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    out = tmp_path / "longest.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/longest_sequence.py"), "--lengths",
           "300,100,200,400", "--timeout-s", "60", "--budget-s", "120", "--out", str(out),
           "--", sys.executable, str(child), "--steady"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    report = json.loads(out.read_text())
    assert [t["len"] for t in report["tries"]] == [100, 200, 300]  # shortest first, 400 not run
    assert [t["fits"] for t in report["tries"]] == [True, True, False]
    assert report["tries"][-1]["why"] == "out of memory"
    assert report["largest_fitting_len"] == 200
    largest = report["largest"]
    assert largest["peak_memory_gib"] == 2.0 and largest["train_mfu"] == 0.4
    assert largest["memory_plan"] == {"optimizer_offload": True}
