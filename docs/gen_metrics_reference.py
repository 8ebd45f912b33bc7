"""Write docs/reference/metrics.md, the metrics reference, from `unirl.core.run.metric_names`.

    python docs/gen_metrics_reference.py           # rewrite the page
    python docs/gen_metrics_reference.py --check   # exit 1 when the committed page is stale

Every metric name a run logs to ``metrics.jsonl`` (and TensorBoard / W&B), grouped by namespace,
with its one-line meaning. `tests/unit/test_docs_metrics.py` fails when the page is stale or a
short real run logs a key that has no entry.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "metrics.md"
REGENERATE = "python docs/gen_metrics_reference.py"

logger = logging.getLogger("gen_metrics_reference")

HEADER = f"""# Metrics reference

Generated from `unirl/core/run/metric_names.py` by `docs/gen_metrics_reference.py`; do not edit
by hand (a test fails when this page is stale: run `{REGENERATE}`). Every name a run writes to
`metrics.jsonl` in its run folder, one line per RL step, and to TensorBoard and W&B when they are
on. Values are means over the step's optimizer steps unless the line says otherwise; a metric
appears only when the feature that makes it is on (a reference model for `kl`, a critic for
`critic/*`, an engine's log-probs for `train_rollout_*`, ...). `{{s}}` and `{{k}}` stand for a
number (a staleness, a k of pass@k). TensorBoard and W&B show the top-level names under `train/`
(`train/loss`, `train/grad_norm`, ...), so every chart there sits in a namespace; the
"completions" table there is `completions.jsonl`'s rows.
"""


def _title(namespace: str) -> str:
    return f"`{namespace}/`" if namespace else "Top level (no namespace)"


def render() -> str:
    """The whole page."""
    sys.path.insert(0, str(ROOT))
    from unirl.core.run.metric_names import METRICS, namespace

    groups: dict[str, list[str]] = {}
    for name in METRICS:
        groups.setdefault(namespace(name), []).append(name)
    out = [HEADER]
    for group in sorted(groups):
        out += [f"\n## {_title(group)}\n", "| metric | meaning |", "| --- | --- |"]
        for name in sorted(groups[group]):
            meaning = METRICS[name].replace("|", "\\|")
            out.append(f"| `{name}` | {meaning} |")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            logger.error("%s is stale: run %s and commit the page", PAGE, REGENERATE)
            return 1
        return 0
    PAGE.write_text(text)
    logger.info("wrote %s", PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
